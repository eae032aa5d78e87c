"""What the closed loop's environments need on this machine, checked before anything is built:
a run that would score every episode 0 for an environment reason refuses to start, naming
the cause and the fix (`ptrain.eval_failures` gives the same fixes to launch.eval).

  check(config)   raises a ValueError for the first missing package, engine, tool or image

  sandbox.backend pinned        that backend runs here (`sandbox.backends.unavailable_reason`)
  terminal, backend docker      the docker SDK, a reachable engine, and the base image of each
                                task in terminal.tasks_dir / heldout_dir (after image_map)
  terminal, backend bwrap       the bwrap binary
  terminal                      pytest on this host (lent to task images without their own):
                                a warning, since images that have it need none
"""

from __future__ import annotations

import importlib.util
import logging
import shutil

from ptrain import eval_failures

log = logging.getLogger("ptrain.preflight")
TERMINAL = "terminal"


def check(config) -> None:
    if "tasks" not in config:
        return
    domains = set(config.tasks.domains)
    if domains - {TERMINAL} and config.sandbox.backend != "auto":
        _check_sandbox(config.sandbox.backend)
    if TERMINAL in domains:
        _check_terminal(config.terminal)


def _refuse(key, cause):
    raise ValueError(f"config: {key}: {cause}; fix: {eval_failures.fix(cause)}")


def _check_sandbox(name):
    import sandbox
    from sandbox import backends
    reason = backends.unavailable_reason(sandbox.pick_backend(name))
    if reason is not None:
        raise ValueError(f"config: sandbox.backend={name!r} cannot run here: {reason}; pin "
                         "another backend or set 'auto' (the strongest that runs here)")


def _check_terminal(t):
    if importlib.util.find_spec("pytest") is None:
        log.warning("pytest is not installed on this host: terminal tasks whose image lacks "
                    "pytest will score 0; fix: %s", eval_failures.fix("No module named pytest"))
    if t.backend == "bwrap":
        if shutil.which("bwrap") is None:
            _refuse("terminal.backend='bwrap'", "No such file or directory: 'bwrap'")
        return
    if importlib.util.find_spec("docker") is None:
        _refuse("terminal.backend='docker'", "No module named 'docker'")
    from sandbox.terminal import container
    try:
        client = container.docker_client()
        client.ping()
    except Exception as e:  # noqa: BLE001 (any failure to reach the engine)
        _refuse("terminal.backend='docker'", f"Cannot connect to the Docker daemon ({e})")
    for key in ("tasks_dir", "heldout_dir"):
        if t[key]:
            _check_images(client, t[key], t.image_map, f"terminal.{key}")


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
