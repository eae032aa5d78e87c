"""What the closed loop's environments need on this machine, checked before anything is built:
a run that would score every episode 0 for an environment reason refuses to start, naming
the cause and the fix (`ptrain.eval_failures` gives the same fixes to launch.eval).

  check(config)   raises a ValueError for the first missing package, engine, tool or image

  sandbox.backend pinned        that backend runs here (`sandbox.backends.unavailable_reason`)
  terminal, backend docker      the docker SDK, a reachable engine, and the base image of each
                                task in its tasks_dir / heldout_dir args (after image_map)
  terminal, backend bwrap       the bwrap binary
  terminal                      pytest on this host (lent to task images without their own):
                                a warning, since images that have it need none
(terminal: an entry of tasks.envs naming `TERMINAL_ENV`, its args as the environment reads them)
"""

from __future__ import annotations

import importlib.util
import logging
import shutil

from ptrain import eval_failures

log = logging.getLogger("ptrain.preflight")
TERMINAL_ENV = "ptrain.envs.terminal:make"


def check(config) -> None:
    if "tasks" not in config:
        return
    entries = [dict(e) for e in config.tasks.envs]
    terminal = [(i, e) for i, e in enumerate(entries) if e.get("env") == TERMINAL_ENV]
    if len(terminal) < len(entries) and config.sandbox.backend != "auto":
        _check_sandbox(config.sandbox.backend)
    for i, entry in terminal:
        from ptrain.envs import terminal as terminal_env
        args = dict(entry.get("args") or {})
        settings = terminal_env.Settings(**{**args, "image_map": tuple(args.get("image_map", ()))})
        _check_terminal(settings, f"tasks.envs[{i}].args")


def _refuse(key, cause):
    raise ValueError(f"config: {key}: {cause}; fix: {eval_failures.fix(cause)}")


def _check_sandbox(name):
    import sandbox
    from sandbox import backends
    reason = backends.unavailable_reason(sandbox.pick_backend(name))
    if reason is not None:
        raise ValueError(f"config: sandbox.backend={name!r} cannot run here: {reason}; pin "
                         "another backend or set 'auto' (the strongest that runs here)")


def _check_terminal(t, at):
    if importlib.util.find_spec("pytest") is None:
        log.warning("pytest is not installed on this host: terminal tasks whose image lacks "
                    "pytest will score 0; fix: %s", eval_failures.fix("No module named pytest"))
    if t.backend == "bwrap":
        if shutil.which("bwrap") is None:
            _refuse(f"{at}.backend='bwrap'", "No such file or directory: 'bwrap'")
        return
    if importlib.util.find_spec("docker") is None:
        _refuse(f"{at}.backend='docker'", "No module named 'docker'")
    from sandbox.terminal import container
    try:
        client = container.docker_client()
        client.ping()
    except Exception as e:  # noqa: BLE001 (any failure to reach the engine)
        _refuse(f"{at}.backend='docker'", f"Cannot connect to the Docker daemon ({e})")
    for key in ("tasks_dir", "heldout_dir"):
        if getattr(t, key):
            _check_images(client, getattr(t, key), t.image_map, f"{at}.{key}")


def _check_images(client, root, image_map, key):
    """Each task's prebuilt image, or each FROM image of its Dockerfile, is on this machine."""
    import docker
    from sandbox import terminal
    from sandbox.terminal import image as image_lib
    mapping = terminal.parse_image_map(image_map)
    for task in terminal.load_tasks(root).tasks:
        if task.docker_image:
            wanted = [(task.path, task.docker_image, mapping.get(task.docker_image,
                                                                 task.docker_image))]
        else:
            with open(task.dockerfile, encoding="utf-8") as f:
                _, bases = image_lib.rewrite_bases(f.read(), mapping)
            wanted = [(f"{task.dockerfile}:{line}", original, name)
                      for line, original, name in bases]
        for where, original, name in wanted:
            try:
                client.images.get(name)
            except docker.errors.ImageNotFound:
                mapped = f" (mapped to {name!r})" if name != original else ""
                _refuse(f"{key} ({where})", f"image {original!r}{mapped} is not present "
                        "locally")
