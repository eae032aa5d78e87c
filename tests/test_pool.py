"""sandbox.Pool: futures and asyncio, backpressure, retries only when a worker dies, deadlines,
clean shutdown, 500 requests under random worker kills, hostile programs, and Ray."""

import asyncio
import concurrent.futures
import os

import pytest

import sandbox
import sandbox_svc_util as util
from sandbox_svc_util import backend  # noqa: F401 - the fixture


@pytest.fixture(scope="module")
def pool():
    with sandbox.Pool(2, backend="process", max_retries=2, queue_size=4) as p:
        yield p


def test_futures_map_and_results_in_order(pool):
    futures = [pool.run(f"print({i} + {i})", timeout_s=5) for i in range(6)]
    assert [f.result().stdout for f in futures] == [f"{2 * i}\n".encode() for i in range(6)]
    assert list(pool.map(util.square, range(7))) == [i * i for i in range(7)]
    report = pool.unit_tests("def f(x):\n    return x + 1\n", "assert f(1) == 2\n").result()
    assert (report.passed, report.total) == (1, 1)


def test_asyncio_api(pool):
    async def main():
        return await asyncio.gather(*(pool.acall(util.square, i) for i in range(10)))
    assert asyncio.run(main()) == [i * i for i in range(10)]


def test_requests_run_concurrently_on_distinct_workers(pool, tmp_path):
    s1, r1, s2, r2 = util.fifos(tmp_path, "s1", "r1", "s2", "r2")
    first, second = pool.submit(util.hold, s1, r1), pool.submit(util.hold, s2, r2)
    let_go = [util.read_then_write(s1, r1, "one"), util.read_then_write(s2, r2, "two")]
    for release in let_go:  # both started before either was released: they run at once
        release()
    assert (first.result(), second.result()) == ("one", "two")
    assert len(set(pool.worker_pids())) == 2


def test_a_failing_program_or_function_is_a_result_and_never_retried(pool, tmp_path):
    log = tmp_path / "attempts"
    with pytest.raises(ValueError, match="bad input"):
        pool.submit(util.raise_value_error, str(log)).result()
    assert log.read_text().count("attempt") == 1
    before = pool.stats()["retried"]
    results = [pool.run(code, timeout_s=0.5).result() for code in (
        "import sys; sys.exit(3)", "while True: pass", "import os, signal\n"
        "os.kill(os.getpid(), signal.SIGSEGV)", "raise MemoryError")]
    assert [r.status for r in results] == ["error", "timeout", "signal", "oom"]
    assert results[0].exit_code == 3 and results[2].signal == 11
    assert pool.stats()["retried"] == before


def test_a_request_whose_worker_dies_is_retried_on_a_fresh_worker(pool, tmp_path):
    before = pool.stats()
    assert pool.submit(util.die_once, str(tmp_path / "marker")).result() == "second attempt"
    after = pool.stats()
    assert after["retried"] == before["retried"] + 1
    assert after["worker_deaths"] == before["worker_deaths"] + 1
    assert pool.run("print('ok')", timeout_s=5).result().stdout == b"ok\n"


def test_a_request_that_always_kills_its_worker_gives_up_after_max_retries(pool, tmp_path):
    log = tmp_path / "attempts"
    with pytest.raises(sandbox.WorkerLost, match="3 attempts"):
        pool.submit(util.always_die, str(log)).result()
    assert log.read_text().count("attempt") == pool.max_retries + 1
    assert pool.submit(util.square, 9).result() == 81


def test_a_request_past_its_deadline_kills_the_worker(tmp_path):
    (never_written,) = util.fifos(tmp_path, "fifo")
    with sandbox.Pool(1, backend="process", max_retries=0, grace_s=0.2) as pool:
        with pytest.raises(sandbox.WorkerLost, match="deadline"):
            pool.submit(util.read_fifo, never_written, timeout_s=0.2).result()
        assert pool.stats()["worker_deaths"] == 1
        assert pool.submit(util.square, 3).result() == 9


def test_backpressure_submit_nowait_raises_when_the_queue_is_full(tmp_path):
    started, release = util.fifos(tmp_path, "started", "release")
    with sandbox.Pool(1, backend="process", queue_size=2) as pool:
        running = pool.submit(util.hold, started, release)
        let_go = util.read_then_write(started, release, "done")  # the worker is busy now
        queued = [pool.submit(util.square, i) for i in (2, 3)]
        assert pool.stats()["queued"] == 2
        with pytest.raises(sandbox.PoolFull, match="queue_size=2"):
            pool.submit_nowait(util.square, 4)
        let_go()
        assert running.result() == "done"
        assert [q.result() for q in queued] == [4, 9]


def test_shutdown_cancels_queued_requests_and_refuses_new_ones(tmp_path):
    started, release = util.fifos(tmp_path, "started", "release")
    pool = sandbox.Pool(1, backend="process", queue_size=8)
    running = pool.submit(util.hold, started, release)
    let_go = util.read_then_write(started, release, "done")
    queued = [pool.submit(util.square, i) for i in range(3)]
    pool.shutdown(wait=False, cancel_futures=True)
    assert all(q.cancelled() for q in queued)
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit(util.square, 1)
    let_go()
    pool.shutdown(wait=True)
    assert running.result() == "done"
    assert pool.worker_pids() == []


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="workers"):
        sandbox.Pool(0)
    with pytest.raises(ValueError, match="cluster"):
        sandbox.Pool(1, cluster="k8s")


def test_500_mixed_requests_with_workers_killed_at_random_each_get_exactly_one_result():
    backend = "bwrap" if util.backend_problem("bwrap") is None else "process"
    out = util.run_driver("chaos", 540, backend=backend, n=500, workers=3, kills=12, seed=0)
    assert out["n_wrong"] == 0, out["wrong"]
    assert out["callbacks"] == [1]  # every future completed exactly once
    assert out["kills"] == 12 and out["stats"]["worker_deaths"] == 12
    assert out["stats"]["retried"] >= 1  # kills hit requests in flight, which were retried
    assert out["stats"]["completed"] == out["stats"]["submitted"] == 501
    assert out["after"] == "still serving\n"
    assert out["leftovers"] == {}


def test_hostile_programs_leave_the_pool_serving_and_no_process_behind(backend):  # noqa: F811
    out = util.run_driver("hostile", 300, backend=backend)
    assert out.pop("leftovers") == {}
    assert out.pop("judge after all") == "1/1"
    assert not [k for k, v in out.items() if "then print" in v], out
    for name in ("infinite loop", "sleep forever", "ignore signals", "stdout flood"):
        assert out[name] == "timeout", (name, out[name])
    assert out["memory bomb"] == "oom"


# -- Ray ----------------------------------------------------------------------------------------

def test_ray_pool_needs_ray_initialised():
    ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'ptrain[ray]')")
    if ray.is_initialized():
        pytest.skip("a Ray cluster is connected in this process")
    with pytest.raises(RuntimeError, match="ray.init"):
        sandbox.Pool(1, cluster="ray")


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'ptrain[ray]')")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    yield ray
    ray.shutdown()


def test_ray_pool_same_interface_and_retries_dead_actors(ray_cluster, tmp_path):
    with sandbox.Pool(2, backend="process", cluster="ray", max_retries=2) as pool:
        futures = [pool.run(f"print({i} * 3)", timeout_s=5) for i in range(6)]
        assert [f.result().stdout for f in futures] == [f"{3 * i}\n".encode() for i in range(6)]
        s1, r1, s2, r2 = util.fifos(tmp_path, "s1", "r1", "s2", "r2")
        both = [pool.submit(util.hold, s1, r1), pool.submit(util.hold, s2, r2)]
        for release in [util.read_then_write(s1, r1, "a"), util.read_then_write(s2, r2, "b")]:
            release()  # both started before either was released: two actors at once
        assert [f.result() for f in both] == ["a", "b"]
        assert os.getpid() not in pool.worker_pids()
        report = pool.unit_tests("def f(x):\n    return -x\n",
                                 "assert f(1) == -1\nassert f(2) == 2\n").result()
        assert (report.passed, report.total) == (1, 2)
        assert pool.submit(util.die_once, str(tmp_path / "marker")).result() == "second attempt"
        assert pool.stats()["retried"] == 1
        with pytest.raises(ValueError, match="bad input"):
            pool.submit(util.raise_value_error, str(tmp_path / "log")).result()
        assert (tmp_path / "log").read_text().count("attempt") == 1

        async def main():
            return await pool.acall(util.square, 12)
        assert asyncio.run(main()) == 144


def test_pool_is_an_executor():
    assert issubclass(sandbox.Pool, concurrent.futures.Executor)
