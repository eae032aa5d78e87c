"""The sandbox fleet on a local Ray cluster of three nodes (ray.cluster_utils.Cluster): mixed
requests and concurrent multi-turn sessions while a node is killed, backpressure, clean-up."""

import concurrent.futures
import threading
import time

import pytest

ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'ptrain[ray]')")
from ray.cluster_utils import Cluster  # noqa: E402

import fleet_util  # noqa: E402
import sandbox  # noqa: E402
from sandbox import fleet  # noqa: E402

pytestmark = pytest.mark.xdist_group("sandbox")

ADD = "def add(a, b):\n    return a + b\n"
ADD_TESTS = "assert add(1, 2) == 3\nassert add(2, 2) == 4\n"
SQUARE = "n = int(input())\nprint(n * n)\n"


@pytest.fixture(scope="module")
def cluster():
    node_args = dict(num_cpus=2, object_store_memory=80 << 20)
    c = Cluster(initialize_head=True, head_node_args=dict(
        **node_args, include_dashboard=False,
        # find a dead node within ~1.5 s, not the default ~30 s
        _system_config={"health_check_initial_delay_ms": 0, "health_check_period_ms": 500,
                        "health_check_failure_threshold": 3}))
    nodes = [c.add_node(**node_args) for _ in range(2)]
    started = fleet.connect(c.address)
    assert started
    c.wait_for_nodes()
    yield c, nodes
    fleet.disconnect(started)
    c.shutdown()


def mixed_request(pool, i, notes):
    """(future, check) for request i: five kinds, each with a known answer."""
    kind = i % 5
    if kind == 0:
        return pool.run(f"print({i} * 3)", timeout_s=10), \
            lambda r: r.stdout == f"{3 * i}\n".encode()
    if kind == 1:
        return pool.run(f"import sys; sys.exit({i % 7})", timeout_s=10), \
            lambda r: r.exit_code == i % 7
    if kind == 2:
        tests = ADD_TESTS + ("assert add(0, 0) == 1\n" if i % 2 else "")
        return pool.unit_tests(ADD, tests, timeout_s=10), \
            lambda r: (r.passed, r.total) == ((2, 3) if i % 2 else (2, 2))
    if kind == 3:
        return pool.submit(fleet_util.square_and_note, i, notes), lambda r: r == i * i
    return pool.stdio(SQUARE, [(f"{i}\n", f"{i * i}\n")], timeout_s=10), \
        lambda r: r.all_passed


def session_episode(pool, k):
    """Three turns that each append to a file: the file says whether a turn was lost or
    applied twice."""
    with fleet.Session(pool, backend="process", files={"log.txt": f"episode {k}\n"}) as s:
        for turn in range(3):
            r = s.run(f"open('log.txt', 'a').write('turn {turn}\\n')", timeout_s=10)
            assert r.ok, r.stderr
        s.write_files({"notes/end.txt": "done"})
        r = s.run(command=["cat", "log.txt", "notes/end.txt"], timeout_s=10)
        return r.stdout.decode(), s.read_files()


def test_requests_and_sessions_survive_a_node_kill(cluster, tmp_path):
    c, nodes = cluster
    notes = str(tmp_path / "pids.txt")
    n_requests, n_sessions = 500, 40
    with fleet.pool(4, backend="process", queue_size=16) as pool:
        results, errors = {}, {}
        done_count = [0]
        lock = threading.Lock()

        def submit_all():
            futures = []
            for i in range(n_requests):
                future, check = mixed_request(pool, i, notes)  # blocks while the queue is full
                futures.append((i, future, check))
                future.add_done_callback(lambda _: _count(lock, done_count))
            return futures

        with concurrent.futures.ThreadPoolExecutor(n_sessions + 1) as threads:
            submitted = threads.submit(submit_all)
            episodes = [threads.submit(session_episode, pool, k) for k in range(n_sessions)]
            while done_count[0] < 100:  # kill a node mid-run
                time.sleep(0.05)
            c.remove_node(nodes[0])
            futures = submitted.result(timeout=600)
            for i, future, check in futures:
                try:
                    value = future.result(timeout=600)
                except sandbox.WorkerLost as e:
                    errors[i] = str(e)
                    continue
                assert check(value), (i, value)
                results[i] = value
            outcomes = []
            for k, episode in enumerate(episodes):
                try:
                    outcomes.append(episode.result(timeout=600))
                except sandbox.WorkerLost as e:
                    outcomes.append(e)
        stats = pool.stats()
        pids = set(pool.worker_pids())
    # Every request exactly one outcome: a result (retried where its node died) or a clear error.
    assert len(results) + len(errors) == n_requests
    assert all("gave up after" in e for e in errors.values())
    assert len(results) >= n_requests - 5, errors
    # 4 requests per session: three turns and the cat (the files are written with no round trip)
    assert stats["submitted"] == stats["completed"] == n_requests + 4 * n_sessions
    assert stats["retried"] >= 1 and stats["worker_deaths"] >= 1  # the node's actors died
    print("fleet stats:", stats, "errors:", len(errors))
    for k, outcome in enumerate(outcomes):
        if isinstance(outcome, Exception):
            assert "gave up after" in str(outcome)
            continue
        text, files = outcome
        assert text == f"episode {k}\nturn 0\nturn 1\nturn 2\ndone", (k, text)
        assert files == {"log.txt": f"episode {k}\nturn 0\nturn 1\nturn 2\n".encode(),
                         "notes/end.txt": b"done"}
    assert sum(not isinstance(o, Exception) for o in outcomes) >= n_sessions - 2
    # Nothing left behind: every actor and every sandbox process under one is gone.
    with open(notes) as f:
        for line in f:
            pids.update(map(int, line.split()))
    assert len(pids) > 4
    deadline = time.monotonic() + 30
    while any(fleet_util.alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [p for p in pids if fleet_util.alive(p)] == []


def test_backpressure_slows_instead_of_failing(cluster):
    with fleet.pool(2, backend="process", queue_size=2, warm=False) as pool:
        held = [pool.submit(fleet_util.nap, 1.0) for _ in range(2)]
        queued = []
        with pytest.raises(sandbox.PoolFull):
            for _ in range(10):
                queued.append(pool.submit_nowait(fleet_util.nap, 0.0))
        assert len(queued) <= 2 + 2  # two running (maybe not yet taken), two waiting
        late = pool.submit(fleet_util.nap, 0.0)  # blocks for room, then runs
        assert late.result(timeout=120) == 0.0
        assert [f.result(timeout=120) for f in held] == [1.0, 1.0]


def test_session_errors_are_clear(cluster):
    with fleet.pool(1, backend="process", warm=False) as pool:
        s = fleet.Session(pool, backend="process", max_state_bytes=100)
        with pytest.raises(ValueError, match="outgrew max_state_bytes=100"):
            s.run("open('big', 'w').write('x' * 1000)", timeout_s=10)
        s.close()
        with pytest.raises(sandbox.SandboxError, match="closed"):
            s.run("print(1)")
    with pytest.raises(TypeError, match="sandbox.Pool"):
        fleet.Session(object())
    with pytest.raises(ValueError, match="num_cpus is for address='local'"):
        fleet.connect("auto", num_cpus=2)
    assert fleet.connect("local") is False  # already connected: nothing happens


def _count(lock, counter):
    with lock:
        counter[0] += 1


def test_open_pool_by_config(cluster):
    c, _ = cluster
    with fleet.open_pool("ray", workers=1, backend="process", address=c.address) as pool:
        assert pool.cluster == "ray"
        make = fleet.session_factory(pool)
        with make(backend="process", files={"a.txt": "x"}) as s:
            assert isinstance(s, fleet.Session)
            assert s.run(command=["cat", "a.txt"], timeout_s=10).stdout == b"x"
    assert ray.is_initialized()  # connected before: left connected
    with fleet.open_pool("local", workers=1, backend="process") as pool:
        assert pool.cluster == "local" and fleet.session_factory(pool) is sandbox.Session
    with pytest.raises(ValueError, match="sandbox.cluster must be 'local' or 'ray'"):
        with fleet.open_pool("k8s", workers=1):
            pass
