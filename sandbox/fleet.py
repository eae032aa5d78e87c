"""A sandbox fleet on Ray: the pool's workers and the tool sessions of multi-turn episodes,
spread over the nodes of a Ray cluster.

    from sandbox import fleet
    started = fleet.connect("local")        # or "auto", "HOST:6379", "ray://HOST:10001"
    with fleet.pool(8, backend="bwrap") as pool:            # a sandbox.Pool of Ray actors
        pool.run("print(1)"); pool.unit_tests(code, tests)  # every Pool method, backpressure
        with fleet.Session(pool, files={"a.txt": "x"}) as s:   # like sandbox.Session
            s.run(command=["cat", "a.txt"]); s.write_files(...); s.read_files()
    fleet.disconnect(started)

A training loop picks either by one config value: `with fleet.open_pool(cluster, workers=...,
backend=..., address=...) as pool` (cluster "local" or "ray") and `fleet.session_factory(pool)`
for its episodes' tool sessions.

Requests: `pool` is a `sandbox.Pool(cluster="ray")` whose actors Ray spreads over the nodes.
A request whose actor dies (its node killed, its process gone, no answer by its deadline) is
retried on a fresh actor, so every request gets exactly one outcome (its result, or
`WorkerLost` after `max_retries` failed attempts); `submit` blocks while `queue_size`
requests wait, so a saturated fleet slows its caller instead of failing it.

Sessions: a fleet `Session` keeps its work dir with the caller (as an unpinned
`sandbox.Session` keeps it on the host), and each operation is one pool request that lays
the work dir into a warm sandbox on whichever node is free, runs, and brings it back. A turn
whose node dies is therefore replayed from the work dir as it was before the turn, on another
node: no turn is lost, none is applied twice. /tmp and the like do not persist across turns,
and a work dir past `max_state_bytes` / `max_state_files` is an error (it cannot travel).
"""

from __future__ import annotations

import contextlib
import functools
import threading

from sandbox import backends
from sandbox.pool import Pool
from sandbox.request import Request, from_options
from sandbox.result import Result
from sandbox.workdir import WorkDir


def connect(address: str = "local", *, num_cpus: int | None = None) -> bool:
    """Connect this process to Ray: "local" starts a one-node cluster here (`num_cpus`),
    anything else is an address for `ray.init` ("auto", "HOST:PORT", "ray://HOST:PORT").
    Already connected: nothing happens. Returns whether it started or joined one now (pass
    that to `disconnect`)."""
    try:
        import ray
    except ImportError:
        raise ImportError("sandbox.cluster='ray' needs ray: pip install 'ptrain[ray]'") from None
    if not isinstance(address, str) or not address:
        raise ValueError(f"address must be 'local' or a Ray address, got {address!r}")
    if address != "local" and num_cpus is not None:
        raise ValueError("num_cpus is for address='local'; an existing cluster has its own")
    if ray.is_initialized():
        return False
    kwargs = dict(log_to_driver=False, configure_logging=False)
    if address == "local":
        ray.init(num_cpus=num_cpus, include_dashboard=False, **kwargs)
    else:
        ray.init(address=address, **kwargs)
    return True


def disconnect(started: bool) -> None:
    """Undo `connect` if it connected (a local cluster it started stops with it)."""
    if started:
        import ray
        ray.shutdown()


def pool(workers: int, *, backend="auto", queue_size: int | None = None, max_retries: int = 4,
         grace_s: float = 30.0, default_timeout_s: float = 300.0,
         ray_options: dict | None = None, warm: bool = True) -> Pool:
    """A `sandbox.Pool` of `workers` Ray actors (one CPU each), spread over the cluster's
    nodes. `connect` first. More retries than a local pool by default: a node that dies takes
    every request in flight on it, and the first replacement may be placed there before Ray
    has noticed; workers beyond what the surviving nodes hold wait for room."""
    options = {"scheduling_strategy": "SPREAD", **(ray_options or {})}
    return Pool(workers, backend=backend, queue_size=queue_size, max_retries=max_retries,
                grace_s=grace_s, default_timeout_s=default_timeout_s, cluster="ray",
                ray_options=options, warm=warm)


@contextlib.contextmanager
def open_pool(cluster: str = "local", *, workers: int, backend="auto", address: str = "local"):
    """The pool a training loop scores and runs tools on, by config: `cluster="local"`, a
    `sandbox.Pool` of worker processes here; `"ray"`, a fleet pool on the Ray cluster at
    `address` ("local" starts one here, stopped on the way out; a connected one is kept)."""
    if cluster == "local":
        with Pool(workers, backend=backend) as local:
            yield local
        return
    if cluster != "ray":
        raise ValueError(f"sandbox.cluster must be 'local' or 'ray', got {cluster!r}")
    started = connect(address)
    try:
        with pool(workers, backend=backend) as fleet_pool:
            yield fleet_pool
    finally:
        disconnect(started)


def session_factory(of_pool: Pool):
    """What makes an episode's tool session for `of_pool`: `sandbox.Session` (this machine)
    for a local pool, a fleet `Session` on that pool for a Ray one; same keyword arguments."""
    if getattr(of_pool, "cluster", "local") == "ray":
        return functools.partial(Session, of_pool)
    from sandbox.session import Session as LocalSession
    return LocalSession


class Session:
    """A multi-turn episode's sandbox on a fleet: the interface of `sandbox.Session`
    (run, write_files, read_files, close, backend; never pinned), its work dir kept here and
    carried to a free pool worker for each operation. Thread-safe; one operation at a time."""

    pinned = False
    sandbox = None
    worker = None  # deprecated alias of `sandbox` (Session.worker)

    def __init__(self, fleet_pool: Pool, *, backend="auto", memory_mb: int = 512,
                 max_processes: int = 64, network: bool = False, files: dict | None = None,
                 max_state_bytes: int = 16 << 20, max_state_files: int = 10_000):
        if not isinstance(fleet_pool, Pool):
            raise TypeError(f"fleet_pool must be a sandbox.Pool, got {type(fleet_pool).__name__}")
        for name, value in (("max_state_bytes", max_state_bytes),
                            ("max_state_files", max_state_files)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive int, got {value!r}")
        self._pool = fleet_pool
        self._spec = backends.pick_backend(backend) if backend != "auto" else "auto"
        self._limits = backends.Limits(memory_mb=memory_mb, max_processes=max_processes,
                                       network=network)
        self._caps = {"max_bytes": max_state_bytes, "max_files": max_state_files}
        self._lock = threading.Lock()
        self._workdir: WorkDir | None = WorkDir()
        if files:
            self.write_files(files)

    @property
    def backend(self) -> str:
        return self._spec if isinstance(self._spec, str) else self._spec.name

    @property
    def closed(self) -> bool:
        return self._workdir is None

    def run(self, code: str | None = None, **options) -> Result:
        """Like `sandbox.Session.run` (options: the fields of `Request`), on a worker of the
        fleet. Raises `WorkerLost` if every attempt's worker died."""
        request, _ = from_options({"code": code, **options}, with_limits=False)
        timeout_s = request.timeout_s
        with self._lock:
            self._check_open()
            result, self._workdir = self._remote("run", request, timeout_s)
        return result

    def write_files(self, files: dict) -> None:
        """Add or overwrite files in the work dir (no round trip when nothing in the way)."""
        files = dict(Request(code="", files=files).files)
        with self._lock:
            self._check_open()
            added = self._workdir.with_files(files)
            if added is not None:
                self._workdir = added
                return
            _, self._workdir = self._remote("put", files, 30.0)

    def read_files(self, max_bytes: int = 16 << 20) -> dict[str, bytes]:
        """The regular files now in the work dir (read here: no round trip)."""
        return self.listing(max_bytes)[0]

    def listing(self, max_bytes: int = 16 << 20) -> tuple[dict[str, bytes], dict[str, str]]:
        """As `sandbox.Session.listing` (read here: no round trip)."""
        with self._lock:
            self._check_open()
            files, others = self._workdir.files(), self._workdir.others()
        if sum(map(len, files.values())) > max_bytes:
            raise ValueError(f"the work dir holds more than max_bytes={max_bytes}; "
                             "raise it to read everything")
        return files, others

    def close(self) -> None:
        with self._lock:
            self._workdir = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _check_open(self) -> None:
        if self._workdir is None:
            from sandbox.sandbox import SandboxError
            raise SandboxError("the session is closed")

    def _remote(self, op, payload, timeout_s):
        future = self._pool.submit(_turn, op, self._workdir, payload, self._spec, self._limits,
                                   self._caps, timeout_s=timeout_s)
        return future.result()


# -- what runs in a fleet actor ---------------------------------------------------------------

_sandboxes: dict = {}  # (spec, limits) -> the actor's Sandbox for session turns
_sandboxes_lock = threading.Lock()


def _turn(op, workdir: WorkDir, payload, spec, limits, caps, *, timeout_s):
    """One session operation in this actor: lay `workdir` into a warm sandbox, run (or write
    files), collect it back. Returns (result, new work dir)."""
    del timeout_s  # the pool's deadline; the request carries its own
    from sandbox.sandbox import Sandbox
    key = (backends.pick_backend(spec), limits)
    with _sandboxes_lock:
        box = _sandboxes.get(key)
        if box is None or not box.alive:
            box = _sandboxes[key] = Sandbox(key[0], limits)
        if op == "run":
            result, new = box.run_in(workdir, payload, **caps)
        else:
            result, new = None, box.put_in(workdir, payload, **caps)
        if new is None:  # it stayed in the sandbox: empty it for the next session
            box.reset()
            raise ValueError(
                f"a fleet session's work dir outgrew max_state_bytes={caps['max_bytes']} or "
                f"max_state_files={caps['max_files']}; it travels between nodes each turn, "
                "so raise the caps or keep less in it")
    return result, new
