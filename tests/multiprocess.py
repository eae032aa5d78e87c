"""Run a function in N JAX processes joined by a loopback coordinator (a test utility).

    results = multiprocess.run("mp_programs:helpers", n=2, devices=4, args={...})

starts N fresh Python processes, each with `devices` simulated CPU devices and gloo
collectives, calls `jax.distributed.initialize` on a free 127.0.0.1 port, imports the module
(from tests/ or the repository), calls the function with `args` and returns what each process's
call returned (pickled), in process order. A process that fails, or a run past `timeout`,
raises with every process's output; all processes are killed on the way out.

Run as a script it is the worker: `python tests/multiprocess.py SPEC ID N PORT OUT`.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# XLA:CPU compiles without LLVM's optimisations: programs of tiny models compile several times
# faster (and run a little slower); for runs compared with each other, both built so.
FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")


def env_for(devices: int, cache_dir: str | None = None, fast_compile: bool = False) -> dict:
    """The workers' environment: `devices` CPU devices; with `cache_dir`, JAX's persistent
    compilation cache there (a program compiled once is loaded by every later compile of it,
    in this run or the next one that shares the folder); `fast_compile`: FAST_COMPILE."""
    env = dict(os.environ)
    if cache_dir:
        env["JAX_COMPILATION_CACHE_DIR"] = cache_dir
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
        env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if "xla_force_host_platform_device_count" not in f]
    flags += list(FAST_COMPILE) if fast_compile else []
    env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([_ROOT, _HERE, env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep)
    return env


def start(spec: str, n: int, devices: int, args: dict, workdir: str,
          port: int | None = None, cache_dir: str | None = None,
          fast_compile: bool = False) -> list[subprocess.Popen]:
    """Start the N workers (each in its own process group); `wait` collects them."""
    port = port or free_port()
    with open(os.path.join(workdir, "args.pkl"), "wb") as f:
        pickle.dump(args, f)
    procs = []
    for i in range(n):
        log = open(os.path.join(workdir, f"log{i}.txt"), "wb")
        procs.append(subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), spec, str(i), str(n), str(port), workdir],
            env=env_for(devices, cache_dir, fast_compile), stdout=log, stderr=subprocess.STDOUT, cwd=_ROOT,
            start_new_session=True))
        log.close()
    return procs


def kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        p.wait()


def logs(workdir: str, n: int) -> str:
    out = []
    for i in range(n):
        path = os.path.join(workdir, f"log{i}.txt")
        text = open(path, errors="replace").read() if os.path.exists(path) else ""
        out.append(f"--- process {i} ---\n{text[-6000:]}")
    return "\n".join(out)


def wait(procs: list[subprocess.Popen], workdir: str, timeout: float) -> list:
    deadline = time.monotonic() + timeout
    try:
        while True:
            codes = [p.poll() for p in procs]  # every one polled (no short-circuit)
            if all(c is not None for c in codes):
                break
            if any(c not in (None, 0) for c in codes):
                break  # one failed: the others would wait on it forever
            if time.monotonic() > deadline:
                raise TimeoutError(f"processes ran past {timeout}s\n{logs(workdir, len(procs))}")
            time.sleep(0.05)
    finally:
        kill(procs)
    codes = [p.returncode for p in procs]
    if any(codes):
        raise RuntimeError(f"processes exited with {codes}\n{logs(workdir, len(procs))}")
    results = []
    for i in range(len(procs)):
        with open(os.path.join(workdir, f"out{i}.pkl"), "rb") as f:
            results.append(pickle.load(f))
    return results


def run(spec: str, n: int = 2, devices: int = 4, args: dict | None = None,
        timeout: float = 120.0, workdir: str | None = None,
        cache_dir: str | None = None, fast_compile: bool = False) -> list:
    """What `module:function(**args)` returned in each of the N processes (`cache_dir`,
    `fast_compile`: see `env_for`)."""
    with tempfile.TemporaryDirectory(prefix="mp_") as tmp:
        workdir = workdir or tmp
        return wait(start(spec, n, devices, args or {}, workdir, cache_dir=cache_dir,
                          fast_compile=fast_compile), workdir, timeout)


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
    import importlib
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


if __name__ == "__main__":
    spec_, pid_, n_, port_, dir_ = sys.argv[1:6]
    try:
        _worker(spec_, int(pid_), int(n_), int(port_), dir_)
    except BaseException:
        import traceback
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)  # not sys.exit: jax.distributed's exit handler would wait for the others
