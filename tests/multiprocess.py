"""Run a function in N JAX processes joined by a loopback coordinator (a test utility).

    results = multiprocess.run("mp_programs:helpers", n=2, devices=4, args={...})

starts N fresh Python processes, each with `devices` simulated CPU devices and gloo
collectives, calls `jax.distributed.initialize` on a free 127.0.0.1 port, imports the module
(from tests/ or the repository), calls the function with `args` and returns what each process's
call returned (pickled), in process order. A process that fails, or a run past `timeout`,
raises with every process's output; all processes are killed on the way out.

No worker outlives the test that started it: each is killed (its whole process group) when
`wait` returns or raises (a failure, `timeout`, pytest-timeout's signal), and a worker whose
parent dies without that (the pytest worker SIGKILLed, the OOM killer) dies with it: it asks
the kernel for SIGKILL when its parent goes (PR_SET_PDEATHSIG) and watches its parent's pid.
A worker's resident memory is bounded (`MAX_RSS_MB`): past it the run is killed with a clear
error, and under memory pressure the kernel's OOM killer picks a worker before the pytest
process that started it (oom_score_adj), so the harness reports it instead of a crashed
pytest (xdist's "node down").

Run as a script it is the worker: `python tests/multiprocess.py SPEC ID N PORT OUT PARENT`,
or `launch`'s: `python tests/multiprocess.py --exec PARENT -m MODULE ARGS...` (runs the
module as `python -m` does).
"""

from __future__ import annotations

import concurrent.futures
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The most resident memory (MiB) one worker may hold; `wait` kills the run past it. Two workers
# x 4 devices, or one x 8, of the tests' toy programs peak well below it (measured: 1.1-1.4
# GiB a worker); the bound keeps a run that goes wrong from taking the (shared) machine.
MAX_RSS_MB = int(os.environ.get("PTRAIN_MP_MAX_RSS_MB", "3072"))


def env_for(devices: int, cache_dir: str | None = None) -> dict:
    """The workers' environment: `devices` CPU devices (the other XLA flags inherited: under
    pytest, tests/conftest.py's fast-compiling ones); with `cache_dir`, JAX's persistent
    compilation cache there (a program compiled once is loaded by every later compile of it,
    in this run or the next one that shares the folder)."""
    env = dict(os.environ)
    if cache_dir:
        env["JAX_COMPILATION_CACHE_DIR"] = cache_dir
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
        env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if "xla_force_host_platform_device_count" not in f]
    env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([_ROOT, _HERE, env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep)
    return env


def start(spec: str, n: int, devices: int, args: dict, workdir: str,
          port: int | None = None, cache_dir: str | None = None) -> list[subprocess.Popen]:
    """Start the N workers (each in its own process group); `wait` collects them."""
    port = port or free_port()
    with open(os.path.join(workdir, "args.pkl"), "wb") as f:
        pickle.dump(args, f)
    return _spawn([[os.path.abspath(__file__), spec, str(i), str(n), str(port), workdir,
                    str(os.getpid())] for i in range(n)],
                  [env_for(devices, cache_dir)] * n, workdir)


def _spawn(argvs: list[list[str]], envs: list[dict], logdir: str) -> list[subprocess.Popen]:
    """`python ARGV` for each argv, with its env, in its own process group, output to
    <logdir>/log<i>.txt; if one fails to start, the ones before it are killed."""
    procs = []
    try:
        for i, (argv, env) in enumerate(zip(argvs, envs)):
            with open(os.path.join(logdir, f"log{i}.txt"), "wb") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, *argv], env=env, stdout=log, stderr=subprocess.STDOUT,
                    cwd=_ROOT, start_new_session=True))  # (no preexec_fn: a fork of JAX)
    except BaseException:
        kill(procs)  # the ones started before the failure
        raise
    return procs


def _signal_live(procs: list[subprocess.Popen], send) -> None:
    """send(pid) for each worker still running (one that exits meanwhile is skipped)."""
    for p in procs:
        if p.poll() is None:
            try:
                send(p.pid)
            except ProcessLookupError:
                pass


def kill(procs: list[subprocess.Popen], timeout: float = 30.0) -> None:
    """SIGKILL each worker's process group (a worker is its group's leader), and reap them:
    a bounded wait (a process stuck in the kernel is left to init, not waited on forever)."""
    _signal_live(procs, lambda pid: os.killpg(pid, signal.SIGKILL))
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            pass


def _rss_mb(pid: int) -> int:
    """`pid`'s resident memory in MiB (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 2**20
    except (OSError, ValueError, IndexError):
        return 0


def logs(workdir: str, n: int) -> str:
    out = []
    for i in range(n):
        path = os.path.join(workdir, f"log{i}.txt")
        text = open(path, errors="replace").read() if os.path.exists(path) else ""
        out.append(f"--- process {i} ---\n{text[-6000:]}")
    return "\n".join(out)


def _dump_stacks(procs: list[subprocess.Popen]) -> None:
    """Every live worker writes every thread's Python stack to its log (faulthandler on
    SIGUSR1, registered by `_worker`): a run past its time says where each process waits."""
    _signal_live(procs, lambda pid: os.kill(pid, signal.SIGUSR1))
    time.sleep(2.0)  # (the dump is written by the worker's signal handler, asynchronously)


def _supervise(procs: list[subprocess.Popen], workdir: str, timeout: float,
               max_rss_mb: int | None = None) -> list[int]:
    """Waits for every worker and returns their exit codes; every worker is killed on the way
    out. A worker that fails ends the wait (the others would wait on it forever); a run past
    `timeout` seconds or a worker holding more than `max_rss_mb` (default MAX_RSS_MB) raises,
    with every process's output."""
    limit = MAX_RSS_MB if max_rss_mb is None else max_rss_mb
    deadline = time.monotonic() + timeout
    next_sample = 0.0
    try:
        while True:
            codes = [p.poll() for p in procs]  # every one polled (no short-circuit)
            if all(c is not None for c in codes):
                break
            if any(c not in (None, 0) for c in codes):
                break
            now = time.monotonic()
            if now > deadline:
                _dump_stacks(procs)
                raise TimeoutError(f"processes ran past {timeout}s\n{logs(workdir, len(procs))}")
            if now >= next_sample:
                next_sample = now + 0.5
                for i, p in enumerate(procs):
                    if (rss := _rss_mb(p.pid)) > limit:
                        raise MemoryError(f"process {i} holds {rss} MiB, over the {limit} MiB "
                                          f"bound (MAX_RSS_MB)\n{logs(workdir, len(procs))}")
            time.sleep(0.05)
    finally:
        kill(procs)
    return [p.returncode for p in procs]


def wait(procs: list[subprocess.Popen], workdir: str, timeout: float,
         max_rss_mb: int | None = None) -> list:
    """What each worker returned, in process order (`_supervise`); a worker that failed
    raises, with every process's output."""
    codes = _supervise(procs, workdir, timeout, max_rss_mb)
    if any(codes):
        raise RuntimeError(f"processes exited with {codes}\n{logs(workdir, len(procs))}")
    results = []
    for i in range(len(procs)):
        with open(os.path.join(workdir, f"out{i}.pkl"), "rb") as f:
            results.append(pickle.load(f))
    return results


def in_background(fn, *args, **kwargs) -> concurrent.futures.Future:
    """fn(*args, **kwargs) (a `run` or `launch`: one process layout's side of a test) in a
    thread of its own, which waits for the processes it starts; `.result()` returns what it
    returned or raises what it raised. A test runs its 1 x 8 side so while its 2 x 4 side
    runs: the two are independent, and each leaves cores idle much of its time (waiting on
    its compiles, its other process, its task boxes), so the test takes about the longer of
    the two instead of their sum, for the same CPU."""
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mp-background")
    try:
        return pool.submit(fn, *args, **kwargs)
    finally:
        pool.shutdown(wait=False)


def run(spec: str, n: int = 2, devices: int = 4, args: dict | None = None,
        timeout: float = 120.0, workdir: str | None = None,
        cache_dir: str | None = None, max_rss_mb: int | None = None) -> list:
    """What `module:function(**args)` returned in each of the N processes (`cache_dir`: see
    `env_for`; `timeout`, `max_rss_mb`: see `wait`). Call it from the
    thread that waits for it (the workers die when the thread that started them ends)."""
    with tempfile.TemporaryDirectory(prefix="mp_") as tmp:
        workdir = workdir or tmp
        return wait(start(spec, n, devices, args or {}, workdir, cache_dir=cache_dir),
                    workdir, timeout, max_rss_mb)


def launch(argv: list[str], n: int, devices: int, logdir: str, timeout: float = 900.0,
           cache_dir: str | None = None) -> None:
    """`python -m MODULE ...` (argv ["-m", "launch.train", ...]) started N times as a user
    starts a multi-host run (launch/gpu.sh): the PTRAIN_COORDINATOR / PTRAIN_NUM_PROCESSES /
    PTRAIN_PROCESS_ID variables (a loopback coordinator) when n > 1, nothing when n == 1;
    `devices` CPU devices each. The processes die with this one, share their compiles
    (process 0 compiles) and are supervised as `run`'s workers are; their output goes to
    <logdir>/log<i>.txt. Raises if any process fails."""
    port, envs = free_port(), []
    for i in range(n):
        envs.append(env_for(devices, cache_dir))
        if n > 1:
            envs[-1].update(PTRAIN_COORDINATOR=f"127.0.0.1:{port}",
                            PTRAIN_NUM_PROCESSES=str(n), PTRAIN_PROCESS_ID=str(i))
    procs = _spawn([[os.path.abspath(__file__), "--exec", str(os.getpid()), *argv]] * n,
                   envs, logdir)
    codes = _supervise(procs, logdir, timeout)
    if any(codes):
        raise RuntimeError(f"processes exited with {codes}\n{logs(logdir, n)}")


def _die_with_parent(parent: int) -> None:
    """This worker dies when `parent` (the process that started it) does, even if that one
    is SIGKILLed and runs no clean-up: the kernel's PR_SET_PDEATHSIG (it fires when the
    parent's starting thread ends), and, where that is missing, a thread that checks the
    parent's pid every second and kills this process group. A parent already gone before
    this ran: exit now. Also offers this process to the OOM killer first."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - the watchdog below still stops it
        pass
    if os.getppid() != parent:
        os._exit(1)

    def watchdog():
        while os.getppid() == parent:
            time.sleep(1.0)
        os.killpg(os.getpgrp(), signal.SIGKILL)

    threading.Thread(target=watchdog, name="die-with-parent", daemon=True).start()
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("800")  # raising it needs no privilege
    except OSError:
        pass


def _same_cache_key_on_every_process() -> bool:
    """JAX's persistent-cache key of a CPU program hashes the topology fingerprint of the
    process's own devices, so the same program over all processes' devices gets a different
    key in each process: process 1 never reads what process 0 wrote (only process 0 writes),
    it compiles every program again at every start, and compiles shared between processes
    (jax_share_binary_between_hosts) wait on a key that is never sent. Here the devices are
    hashed by kind and global id instead, the same on every process (GPU strips its device
    assignment for the same reason). Returns whether it could (JAX's internals may differ)."""
    from jax._src import cache_key
    if not (hasattr(cache_key, "_hash_accelerator_config") and hasattr(cache_key, "_hash_string")):
        return False

    def by_global_id(hash_obj, devices):
        for device in devices.flat:
            cache_key._hash_string(hash_obj, f"{device.device_kind}:{device.id}")

    cache_key._hash_accelerator_config = by_global_id
    return True


def _worker(spec: str, process_id: int, n: int, port: int, workdir: str) -> None:
    import faulthandler
    import importlib
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `_dump_stacks`
    sys.modules.setdefault("torch", None)  # tensorboardX imports torch if it can: 2 s a start

    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # A program over every process's devices is compiled by process 0 alone and sent to the
    # others through the coordinator (with the persistent cache on: `cache_dir`), instead of
    # compiled again by each process.
    if _same_cache_key_on_every_process():
        jax.config.update("jax_share_binary_between_hosts", True)
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=n,
                               process_id=process_id, initialization_timeout=60)
    with open(os.path.join(workdir, "args.pkl"), "rb") as f:
        args = pickle.load(f)
    module, name = spec.split(":")
    result = getattr(importlib.import_module(module), name)(**args)
    with open(os.path.join(workdir, f"out{process_id}.pkl.tmp"), "wb") as f:
        pickle.dump(result, f)
    os.replace(os.path.join(workdir, f"out{process_id}.pkl.tmp"),
               os.path.join(workdir, f"out{process_id}.pkl"))
    jax.distributed.shutdown()


if __name__ == "__main__" and sys.argv[1] == "--exec":  # `launch`: python -m MODULE ARGS
    _die_with_parent(int(sys.argv[2]))
    if sys.argv[3] != "-m":
        raise SystemExit(f"launch runs `python -m MODULE ...`, not {sys.argv[3:]}")
    if int(os.environ.get("PTRAIN_NUM_PROCESSES", "1")) > 1 and \
            _same_cache_key_on_every_process():  # process 0 compiles, as `run`'s workers do
        import jax
        jax.config.update("jax_share_binary_between_hosts", True)
    import runpy
    sys.argv = sys.argv[4:]
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
elif __name__ == "__main__":
    spec_, pid_, n_, port_, dir_, parent_ = sys.argv[1:7]
    _die_with_parent(int(parent_))
    try:
        _worker(spec_, int(pid_), int(n_), int(port_), dir_)
    except BaseException:
        import traceback
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)  # not sys.exit: jax.distributed's exit handler would wait for the others
