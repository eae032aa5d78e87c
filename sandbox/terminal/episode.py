"""Episodes: a task's environment, the agent's shell in it, then the task's own tests.

    harness = terminal.Harness(image_map={...})        # builds images, keeps warm containers
    with harness.episode(task) as ep:                  # a clean container and a fresh shell
        ep.instruction                                 # what the agent is asked to do
        r = ep.run("ls /app")                          # ShellResult: output, exit_code, ...
        result = ep.verify()                           # VerifierResult: reward, feedback
    # leaving the block kills the container, renews it and keeps it warm

The agent's clock starts when the shell is ready and stops at `verify()`; every `run` is cut
at the per-call timeout or at what is left of the task's agent timeout, whichever is first;
once the time is up, `run` raises `TimeUp` instead of running anything. `verify()` kills the
agent's box (its pid namespace), reads its final files as data (state.py) and runs the tests,
copied in only then, in a fresh box of the image with the verifier's own pytest
(host_pytest.py): nothing of the tests is in the agent's image or box, and nothing the agent
runs or plants there takes part in the verdict (docs/terminal.md, "Verification").
"""

import logging
import shlex
import threading
import time

from sandbox.terminal import bwrap, host_pytest, state as state_, verify as verifier
from sandbox.terminal.container import (Container, ContainerGone, Limits, docker_client,
                                        remove_orphans)
from sandbox.terminal.container import wait_removed as container_wait_removed
from sandbox.terminal.image import ensure_image
from sandbox.terminal.shell import Shell, ShellResult
from sandbox.terminal.task import TESTS_DIR, VERIFIER_LOGS, Task

_TAIL_CHARS = 4000
_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# The task's script ("bash /tests/test.sh"), by the image's bash found by its path (a trusted
# path of the state policy), never looked up on a PATH the agent's session may have set.
_BY_BASH = ('for b in /bin/bash /usr/bin/bash; do [ -x "$b" ] && exec "$b" "$@"; done; '
            'exec /bin/sh "$@"')
# Session variables not passed to the verifier (they would steer its shell, loader or python).
_STEERING = ("LD_", "PYTHON", "PYTEST", "BASH_FUNC_", "PTRAIN")
_STEERING_NAMES = {"BASH_ENV", "ENV", "SHELLOPTS", "BASHOPTS", "PS4", "IFS", "GLOBIGNORE",
                   "CDPATH", "HOME", "PWD", "OLDPWD", "SHLVL", "_"}
log = logging.getLogger("sandbox.terminal")


class HealthcheckFailed(RuntimeError):
    """The task's [environment.healthcheck] never passed."""


class TimeUp(Exception):
    """Raised by `Episode.run` once the agent's time is spent: an agent that never stops on
    its own is stopped here (the call that reached the limit returned normally, cut)."""


class Harness:
    """Task images and warm containers, shared by the episodes of a process (thread-safe).

    image_map: {FROM image: local image} for bases not on this machine.
    network: the operator's permission; a task gets a network only if it also asks for one.
    reset: "auto" (in place where possible, else recreate), "inplace" or "recreate".
    max_idle: warm containers kept per task image between episodes.
    call_timeout_s: a shell command's default time limit (within the agent's).
    backend: "docker", or "bwrap" for tasks whose environment is files on an unpacked base
      (`sandbox.terminal.bwrap`: no docker; a task that needs its Dockerfile's image raises
      `bwrap.NeedsImage` when its episode opens).
    """

    def __init__(self, *, image_map=None, network: bool = False, reset: str = "auto",
                 max_idle: int = 8, call_timeout_s: float = 180.0,
                 max_output_bytes: int = 32 << 10, supply_pytest: bool = True,
                 build_log=None, client=None, backend: str = "docker"):
        if backend not in ("docker", "bwrap"):
            raise ValueError(f"backend must be 'docker' or 'bwrap', got {backend!r}")
        self.image_map, self.network, self.reset_mode = dict(image_map or {}), network, reset
        self.max_idle, self.call_timeout_s = max_idle, call_timeout_s
        self.max_output_bytes, self.build_log = max_output_bytes, build_log
        self.backend = backend
        if backend == "bwrap":
            why = bwrap.unavailable()
            if why is not None:
                raise RuntimeError(f"the bwrap terminal backend cannot run here: {why}")
            self.client = None
        else:
            self.client = client or docker_client()
            removed = remove_orphans(self.client)
            if removed:
                log.info("removed %d task containers left by processes that are gone",
                         removed)
        self.pytest_dir = host_pytest.pytest_dir() if supply_pytest else None  # None: no pytest
        self._images: dict[str, str] = {}
        self._idle: dict[tuple, list[Container]] = {}
        self._lock = threading.Lock()
        self._task_locks: dict[str, threading.Lock] = {}
        self._closed = False

    # --- images and containers ----------------------------------------------------------------

    def image(self, task: Task):
        """The local image `task` runs in, built (once) if it needs building (bwrap: its
        `bwrap.Plan`, the files on an unpacked base)."""
        with self._lock:
            lock = self._task_locks.setdefault(task.path, threading.Lock())
        with lock:
            if task.path not in self._images:
                self._images[task.path] = bwrap.plan(task, image_map=self.image_map) \
                    if self.backend == "bwrap" else ensure_image(
                        task, self.client, image_map=self.image_map, network=self.network,
                        log=self.build_log)
            return self._images[task.path]

    def _new(self, task: Task, key: tuple, *, net_of=None):
        if self.backend == "bwrap":
            return bwrap.Box(key[0], key[1], env=key[2], name=task.name,
                             pytest_dir=self.pytest_dir, populate=net_of is None,
                             net_of=None if net_of is None else net_of.pid)
        return Container(key[0], key[1], env=key[2], name=task.name,
                         pytest_dir=self.pytest_dir, reset=self.reset_mode, client=self.client,
                         network_of=None if net_of is None else net_of.id)

    def verifier_box(self, task: Task, agent_box=None):
        """A fresh box for the verifier: a warm clean one of the task's image, or (a task
        whose tests use the agent's services: `agent_box`) a new one in that box's network
        namespace. It is used once: `release` kills and renews it."""
        if agent_box is None:
            return self.acquire(task)
        return self._new(task, self._key(task), net_of=agent_box)

    def limits(self, task: Task) -> Limits:
        return Limits(cpus=task.cpus, memory_mb=task.memory_mb,
                      network=self.network and task.allow_internet,
                      storage_mb=task.storage_mb)

    def _key(self, task: Task) -> tuple:
        return self.image(task), self.limits(task), task.env

    def acquire(self, task: Task) -> Container:
        """A clean container for `task`: a warm one if there is one, else a new one."""
        key = self._key(task)
        with self._lock:
            idle = self._idle.get(key)
            if idle:
                return idle.pop()
        return self._new(task, key)

    def release(self, task: Task, container: Container) -> None:
        """Reset `container` and keep it warm (or close it, past `max_idle` or if it fails).
        A box that shares another's network (a service task's verifier) is closed."""
        if container.shares_network:
            container.close()
            return
        try:
            container.kill()  # its pid namespace: nothing of the episode runs on
            container.reset()
        except Exception:  # noqa: BLE001 (a container that cannot be reset is not reused)
            container.close()
            return
        key = self._key(task)
        with self._lock:
            idle = self._idle.setdefault(key, [])
            if not self._closed and len(idle) < self.max_idle:
                idle.append(container)
                return
        container.close()

    def warm(self, task: Task, n: int) -> None:
        """Start containers for `task` now, up to `n` idle ones."""
        key = self._key(task)
        with self._lock:
            need = n - len(self._idle.get(key, []))
        made = [self._new(task, key) for _ in range(max(0, need))]
        with self._lock:
            self._idle.setdefault(key, []).extend(made)

    def episode(self, task: Task) -> "Episode":
        return Episode(self, task)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle = [c for cs in self._idle.values() for c in cs]
            self._idle.clear()
        for c in idle:
            c.close()
        container_wait_removed()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Episode:
    """One attempt at a task: a clean container, a fresh shell, the agent's clock."""

    def __init__(self, harness: Harness, task: Task):
        self.harness, self.task = harness, task
        self.instruction = task.instruction
        self.transcript: list[dict] = []
        self.turns = 0              # agents that think in turns (a model) count them here
        self.agent_timed_out = False
        self.result: verifier.VerifierResult | None = None
        self.container = harness.acquire(task)
        try:
            self._healthcheck()
            self.shell = Shell(self.container, user=task.agent_user,
                               max_output_bytes=harness.max_output_bytes)
        except BaseException:
            harness.release(task, self.container)
            raise
        self.started = time.monotonic()
        self._deadline = self.started + task.agent_timeout_s
        self._agent_done = None
        self._closed = False

    @property
    def time_left_s(self) -> float:
        return max(0.0, self._deadline - time.monotonic())

    @property
    def agent_time_s(self) -> float:
        """The agent's time so far (until `verify()` once it ran)."""
        return (self._agent_done or time.monotonic()) - self.started

    @property
    def tool_calls(self) -> int:
        """Commands run (the transcript's other entries are an agent's notes)."""
        return sum("command" in step for step in self.transcript)

    def note(self, role: str, text: str) -> None:
        """Record what is not a command in the transcript (a model's turn, in order)."""
        self.transcript.append({"role": role, "text": text})

    def _healthcheck(self) -> None:
        hc = dict(self.task.healthcheck)
        if not hc:
            return
        time.sleep(hc.get("start_period_sec", 0.0))
        retries = int(hc.get("retries", 3))
        last = None
        for attempt in range(retries + 1):
            last = self.container.exec(["sh", "-c", hc["command"]],
                                       timeout_s=hc.get("timeout_sec", 30.0))
            if last.exit_code == 0:
                return
            if attempt < retries:
                time.sleep(hc.get("interval_sec", 5.0))
        raise HealthcheckFailed(f"{self.task.name}: the healthcheck {hc['command']!r} failed "
                                f"{retries + 1} times; last output: {last.text[-500:]!r}")

    # --- the agent's side ---------------------------------------------------------------------

    def run(self, command: str, timeout_s: float | None = None) -> ShellResult:
        """Run `command` in the episode's shell."""
        if self.result is not None or self._closed:
            raise RuntimeError("the episode is over: run() comes before verify()")
        left = self.time_left_s
        if left <= 0:
            self.agent_timed_out = True
            raise TimeUp(f"the agent's time limit ({self.task.agent_timeout_s:g} s) is reached")
        limit = min(timeout_s or self.harness.call_timeout_s, left)
        try:
            result = self.shell.run(command, limit)
        except (ContainerGone, OSError, RuntimeError) as e:
            result = ShellResult(f"[the task's container is gone: {e}]", None, False,
                                 False, 0.0, restarted=True)
        if result.timed_out and self.time_left_s <= 0:
            self.agent_timed_out = True
        self.transcript.append({"command": command, "output": result.output,
                                "exit_code": result.exit_code, "timed_out": result.timed_out,
                                "duration_s": round(result.duration_s, 4),
                                "restarted": result.restarted})
        return result

    def put_files(self, files) -> None:
        """Copy [(host path or bytes, container path)] in (the oracle's solution)."""
        self.container.put_files(files)

    # --- the verifier -------------------------------------------------------------------------

    def verify(self) -> verifier.VerifierResult:
        """The agent's turn is over: its box is killed (unless the task's tests use the
        services it left running) and the task's tests judge its final files in a fresh box
        (docs/terminal.md, "Verification")."""
        if self.result is not None:
            return self.result
        task = self.task
        self._agent_done = time.monotonic()
        t0 = time.monotonic()
        box = None
        try:
            env, workdir = self._session() if task.run_tests_in_same_shell else ({}, None)
            keep = task.uses_agent_services
            limit = (task.storage_mb or task.memory_mb or 1024) << 20
            try:
                state = self.container.end_episode(kill=not keep, limit=limit)
            except state_.StateTooLarge as e:
                self.result = verifier.failed_result(str(e), duration_s=time.monotonic() - t0)
                return self.result
            box = self.harness.verifier_box(task, self.container if keep else None)
            box.lay_state(state)
            box.fresh_dirs([TESTS_DIR], 0o755)
            box.fresh_dirs([VERIFIER_LOGS, "/logs/agent", host_pytest.VERDICT_DIR], 0o777)
            box.put_files(task.tests)
            path = env.get("PATH") or box.path or _PATH
            env = {**env, **dict(task.verifier_env), "PATH": f"{host_pytest.BIN}:{path}",
                   "COLUMNS": "200", "PYTHONNOUSERSITE": "1",
                   "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
            script = shlex.split(task.test_command)[1:]  # ("bash", script)
            r = box.exec(["/bin/sh", "-c", _BY_BASH, "sh", *script],
                         timeout_s=task.verifier_timeout_s, user=task.verifier_user, env=env,
                         workdir=workdir or box.workdir, max_output_bytes=1 << 20)
            # Read only once nothing the tests started runs on.
            box.kill_processes()
            reports = box.read_files(host_pytest.VERDICT_DIR)
            files = box.read_files(VERIFIER_LOGS) if task.parser != "pytest" else {}
        except ContainerGone as e:
            self.result = verifier.failed_result(
                f"the task's container stopped during the episode ({e})",
                duration_s=time.monotonic() - t0)
            return self.result
        except (OSError, RuntimeError) as e:  # the state could not be laid in, a box not made
            self.result = verifier.failed_result(
                f"the verifier could not run: {type(e).__name__}: {e}",
                duration_s=time.monotonic() - t0)
            return self.result
        finally:
            if box is not None:
                self.harness.release(task, box)
        tail = r.text[-_TAIL_CHARS:]
        extra = {"duration_s": time.monotonic() - t0, "exit_code": r.exit_code,
                 "dropped": tuple(f"{p}: {why}" for p, why in state.dropped)}
        if r.timed_out:
            self.result = verifier.failed_result(
                f"the tests ran past their time limit ({task.verifier_timeout_s:g} s) and "
                f"were stopped", tail=tail, timed_out=True, **extra)
        elif task.parser == "pytest":
            self.result = verifier.pytest_result(reports, tail=tail, **extra)
        else:
            files = {name.split("/", 1)[1]: data for name, data in files.items()
                     if name.count("/") == 1}
            self.result = verifier.reward_file_result(files, reports, tail=tail, **extra)
        return self.result

    def _session(self) -> tuple[dict, str | None]:
        """(exported variables, cwd) of the agent's shell session, for a task whose tests
        run "in the same shell" (TB 1.0 `run_tests_in_same_shell`). The shell answers as
        data: what it says is a state the agent could have set up for real, and the tests
        run in the verifier's fresh box, never in that shell (whose functions and aliases
        the agent controls). Variables that would steer the verifier itself are left out."""
        try:
            r = self.shell.run("env -0; printf '\\0%s' \"$PWD\"", 30)
        except (ContainerGone, OSError, RuntimeError):
            return {}, None
        if r.exit_code != 0:
            return {}, None
        *pairs, cwd = r.output.split("\0")
        env = dict(p.split("=", 1) for p in pairs if "=" in p)
        env = {k: v for k, v in env.items() if k.isidentifier() and not k.startswith(
            _STEERING) and k not in _STEERING_NAMES}
        return env, cwd if cwd.startswith("/") and "\n" not in cwd else None

    def close(self) -> None:
        """The episode ends: the shell closes, the box is killed, renewed and kept warm."""
        if self._closed:
            return
        self._closed = True
        self.shell.close()
        self.harness.release(self.task, self.container)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

