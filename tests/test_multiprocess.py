"""Multi-controller JAX: 2 processes x 4 CPU devices (gloo) against 1 process x 8 devices."""

import glob
import os
import random

import jax
import numpy as np
import pytest

import mp_programs
import multiprocess
from ptrain.checkpoint import Checkpointer


# The helpers, sampler and checkpoint tests' 2 x 4 side: one process start (mp_programs.
# small_programs) for all of them, on one xdist worker. 1 x 8 saves its checkpoint first (in
# this process), so that 2 x 4 can restore it in the same start.
_SMALL = pytest.mark.xdist_group("multiprocess_small")


@pytest.fixture(scope="module")
def small_dirs(tmp_path_factory):
    """(the checkpoint 1 x 8 saved, what it returned; the directory 2 x 4 saves to)."""
    one = str(tmp_path_factory.mktemp("ckpt_one"))
    return one, mp_programs.checkpoint_program(one, save=True), \
        str(tmp_path_factory.mktemp("ckpt_two"))


@pytest.fixture(scope="module")
def small_2x4(small_dirs):
    one, _, two = small_dirs
    return multiprocess.run("mp_programs:small_programs", n=2, devices=4, timeout=600,
                            args={"saved_by_one": one, "save_to": two})


@pytest.fixture(scope="module")
def helpers_2x4(small_2x4):
    return [r["helpers"] for r in small_2x4]


@_SMALL
def test_helpers_match_one_process(helpers_2x4):
    one = mp_programs.helpers()
    assert one["count"] == 1 and [r["count"] for r in helpers_2x4] == [2, 2]
    for name, held in [("fsdp", [(0, 8), (8, 16)]), ("fsdp2", [(0, 8), (8, 16)]),
                       ("tensor", [(0, 16), (0, 16)])]:
        assert one[name]["rows"] == (0, 16)
        for i, r in enumerate(helpers_2x4):
            assert r[name]["rows"] == held[i], name
            np.testing.assert_array_equal(r[name]["whole"], one[name]["whole"], err_msg=name)
            lo, hi = held[i]
            np.testing.assert_array_equal(r[name]["local"], one[name]["whole"][lo:hi])
            assert r[name]["sum"] == one[name]["sum"]
            assert r[name]["inferred_shape"] == (16, 3)
            assert r[name]["memory"] == ("pinned_host", "device", True)
            np.testing.assert_array_equal(r[name]["back"], one[name]["whole"])
        np.testing.assert_array_equal(one[name]["local"], one[name]["whole"])


@_SMALL
def test_agree(helpers_2x4):
    one = mp_programs.helpers()
    assert (one["max"], one["min"], one["sum"], one["any"], one["all"]) == (3, 3, 3, False, False)
    assert one["equal_error"] is None
    for r in helpers_2x4:
        assert (r["max"], r["min"], r["sum"], r["any"], r["all"]) == (7, 3, 10, True, False)
        np.testing.assert_array_equal(r["vec"], [7, -3])
        assert r["equal"] == 7
        assert "disagree" in r["equal_error"] and "[3, 7]" in r["equal_error"]


def test_the_terminal_domain_on_two_processes_equals_one(tmp_path):
    """Terminal episodes (bwrap task boxes, the real sampler with scripted text) on 2 x 4:
    process 0's episodes end after one turn while process 1's go on, and one of the batch's
    two terminal environments has records on process 0 only; both processes still join every
    sampler call (they would hang otherwise), and the gathered batch and the held-out evaluation (3 tasks
    over 2 processes) equal one process holding every record."""
    from sandbox.terminal import bwrap
    if bwrap.unavailable() is not None:
        pytest.skip(f"bwrap task boxes unavailable: {bwrap.unavailable()}")
    two = multiprocess.in_background(  # (while 1 x 8 runs here)
        multiprocess.run, "mp_programs:terminal_program", n=2, devices=4, timeout=600,
        args={"root": str(tmp_path / "two")})
    try:
        one = mp_programs.terminal_program(str(tmp_path / "one"))
    finally:
        two = two.result()  # (its processes end before the test does, whatever happened)
    # Turn 1: 4 tasks x 2 samples; turn 2: the 2 tasks that ran a command.
    assert one["calls"] == [8, 4] and one["eval_calls"] == [3, 1]
    assert one["groups"] == 4 and sorted(set(one["turns"])) == [1, 2]
    assert 0.0 < one["rewards"].mean() < 1.0  # the tasks' own tests, passed and failed
    assert one["eval"]["n"] == 3 and one["eval"]["pass_rate"] == pytest.approx(1 / 3)
    for r in two:
        for name in ("calls", "eval_calls", "eval", "tasks", "turns", "tool_calls", "groups"):
            assert r[name] == one[name], name
        for name in ("rewards", "tokens", "mask"):
            np.testing.assert_array_equal(r[name], one[name], err_msg=name)
        np.testing.assert_allclose(r["logp"], one["logp"], rtol=0, atol=1e-5)


# configs/terminal_toy.py:short cut to a few steps (no learning is asserted here).
_TERMINAL_RUN = ["-m", "launch.train", "--config=configs/terminal_toy.py:short",
                 "--config.tasks.envs=({'env': 'ptrain.envs.terminal:make', 'args': "
                 "{'backend': 'bwrap', 'n_train': 8, 'n_heldout': 4}},)",
                 "--config.sft.steps=6", "--config.steps=2",
                 "--config.checkpoint.every=1", "--config.eval.n=4"]


def _run_logs(workdir):
    from ptrain.metrics import read_jsonl

    def untimed(name):
        return [{k: v for k, v in r.items() if not k.startswith("time/")}
                for r in read_jsonl(os.path.join(workdir, name))]
    return {name: untimed(name) for name in ("sft/metrics.jsonl", "metrics.jsonl",
                                              "eval.jsonl", "rollouts.jsonl")}


def test_the_terminal_closed_loop_through_launch_train_on_two_processes_equals_one(tmp_path):
    """`python -m launch.train` started on 2 processes x 4 devices as launch/gpu.sh starts
    hosts (PTRAIN_COORDINATOR, a loopback coordinator; JAX's CPU collectives over gloo):
    the terminal domain's closed loop (generated tasks, SFT, held-out eval, RL in bwrap task
    boxes, eval again) writes the logs and evals of 1 process x 8 devices; a second launch
    of both resumes, finds everything done and repeats nothing."""
    from sandbox.terminal import bwrap
    if bwrap.unavailable() is not None:
        pytest.skip(f"bwrap task boxes unavailable: {bwrap.unavailable()}")

    def launch(n, devices):
        workdir, logdir = tmp_path / f"run{n}", tmp_path / f"logs{n}"
        logdir.mkdir()
        multiprocess.launch([*_TERMINAL_RUN, f"--workdir={workdir}"], n, devices, str(logdir))
        return _run_logs(str(workdir))

    one = multiprocess.in_background(launch, 1, 8)  # (while 2 x 4 runs)
    try:
        two = launch(2, 4)
    finally:
        one = one.result()
    assert [r["step"] for r in one["metrics.jsonl"]] == [1, 2]
    assert [(e["stage"], e["n"]) for e in one["eval.jsonl"]] == [("sft", 4), ("rl", 4)]
    # Episodes of one batch end at different turns (the processes' turn loops agree).
    assert any(1 < r["episode/terminal/turns"] < 2 for r in one["metrics.jsonl"])
    assert two["eval.jsonl"] == one["eval.jsonl"]
    assert two["rollouts.jsonl"] == one["rollouts.jsonl"]
    for name in ("sft/metrics.jsonl", "metrics.jsonl"):
        assert [r.keys() for r in two[name]] == [r.keys() for r in one[name]], name
        for a, b in zip(two[name], one[name]):
            for k in b:
                np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-5, err_msg=(name, k))
    multiprocess.launch([*_TERMINAL_RUN, f"--workdir={tmp_path / 'run2'}"], 2, 4,
                        str(tmp_path / "logs2"))
    assert _run_logs(str(tmp_path / "run2")) == two


def test_worker_failure_is_reported(tmp_path):
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        multiprocess.run("mp_programs:fails_on_one", n=2, devices=1, timeout=60)


def test_memory_bound_kills_the_run():
    """A worker past max_rss_mb is killed with a clear error (not the machine's OOM killer)."""
    with pytest.raises(MemoryError, match="over the 800 MiB bound"):
        multiprocess.run("mp_programs:holds", n=1, devices=1, timeout=120, max_rss_mb=800,
                         args={"mb": 1200})


_ORPHAN_PARENT = """
import sys, time
sys.path.insert(0, sys.argv[1])
import multiprocess
procs = multiprocess.start("mp_programs:sleeps", 2, 1, {"marker": sys.argv[2]}, sys.argv[3])
time.sleep(600)
"""


def test_workers_die_with_their_parent(tmp_path):
    """A parent SIGKILLed (no finally runs: the pytest worker killed, the OOM killer) takes
    its workers with it: none is left running."""
    import signal
    import subprocess
    import sys
    import time
    from fleet_util import alive
    marker, pids = str(tmp_path / "running"), []
    parent = subprocess.Popen([sys.executable, "-c", _ORPHAN_PARENT, os.path.dirname(__file__),
                               marker, str(tmp_path)], env=multiprocess.env_for(1),
                              start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not all(os.path.exists(f"{marker}.{i}") for i in range(2)):
            assert parent.poll() is None and time.monotonic() < deadline, "workers never ran"
            time.sleep(0.2)
        pids += [int(open(f"{marker}.{i}").read()) for i in range(2)]
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(30)
        deadline = time.monotonic() + 60
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(alive(p) for p in pids), pids
    finally:
        if parent.poll() is None:
            os.killpg(parent.pid, signal.SIGKILL)
            parent.wait(30)
        for pid in filter(alive, pids):  # (only if the test failed)
            os.killpg(pid, signal.SIGKILL)


@_SMALL
def test_sampler_rows_where_their_prompts_live(small_2x4):
    """Each process samples its own prompts; together they equal one process with all."""
    one = mp_programs.sampler_program()
    two = [r["sampler"] for r in small_2x4]
    assert "stop" in one["stops"][4] and "length" in one["stops"][4]
    for kind in ("random", "stops"):
        tokens, logp, logp_t1, lengths, reasons, index = one[kind]
        got = [r[kind] for r in two]
        np.testing.assert_array_equal(np.concatenate([g[0] for g in got]), tokens)
        np.testing.assert_allclose(np.concatenate([g[1] for g in got]), logp, atol=1e-5)
        np.testing.assert_allclose(np.concatenate([g[2] for g in got]), logp_t1, atol=1e-5)
        np.testing.assert_array_equal(np.concatenate([g[3] for g in got]), lengths)
        assert sum((g[4] for g in got), []) == reasons
        # prompt_index counts this process's prompts
        np.testing.assert_array_equal(np.concatenate([g[5] + 4 * i for i, g in enumerate(got)]),
                                      index)


@_SMALL
def test_the_engine_samples_each_processs_prompts_from_its_own_copy(small_2x4):
    """sampling.engine on 2 x 4: each process decodes its own prompts on its own copy of the
    policy (its own 4 devices, synced once per parameters), and together they give what one
    process with every prompt gives: the same tokens (sampled with the same per-request keys,
    greedy with stop strings, and after the parameters change), log-probs to 1e-5."""
    one = mp_programs.engine_program()
    two = [r["engine"] for r in small_2x4]
    assert "stop" in one["stops"][5] and "length" in one["stops"][5]
    for kind in ("random", "stops", "updated"):
        tokens, logp, logp_temp, logp_t1, lengths, reasons, index = one[kind]
        got = [r[kind] for r in two]
        np.testing.assert_array_equal(np.concatenate([g[0] for g in got]), tokens, err_msg=kind)
        for i, want in ((1, logp), (2, logp_temp), (3, logp_t1)):
            np.testing.assert_allclose(np.concatenate([g[i] for g in got]), want, atol=1e-5)
        np.testing.assert_array_equal(np.concatenate([g[4] for g in got]), lengths)
        assert sum((g[5] for g in got), []) == reasons
        np.testing.assert_array_equal(np.concatenate([g[6] + 4 * i for i, g in enumerate(got)]),
                                      index)
    assert len({tuple(r) for r in one["random"][0]}) > 4  # the samples differ
    assert one["syncs"] == 0  # one process decodes the learner's own arrays
    for p, r in enumerate(two):
        assert r["syncs"] == 2  # the first call after each change of parameters
        assert r["devices"] == ([p], 4)  # a copy on its own 4 devices only


@_SMALL
def test_checkpoint_across_process_counts(small_dirs, small_2x4):
    """2 x 4 saves (each process its shards and its data state) and restores onto another
    mesh; 1 x 8 restores that too, and 2 x 4 restores what 1 x 8 saved."""
    _, ref, saved_by_two = small_dirs
    two = [r["saved"] for r in small_2x4]
    one = mp_programs.checkpoint_program(saved_by_two, save=False)
    back = [r["restored"] for r in small_2x4]
    assert [r["data_state"] for r in two] == [{"pos": 10}, {"pos": 11}]
    assert ref["data_state"] == {"pos": 10}
    assert one["data_state"] is None and [r["data_state"] for r in back] == [None, None]
    for r in two + [one] + back:
        assert r["step"] == 5 and r["extra"] == {"kl": 0.5}
        assert r["specs"] == [("fsdp",), ("fsdp", None)]
        for a, b in zip(jax.tree.leaves(r["values"]), jax.tree.leaves(ref["values"])):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(r["rng"], ref["rng"])


# ------------------------------------------------- the learner: 2 x 4 equals 1 x 8, phase by phase

# The kills of the 2 x 4 run, one per RL phase, the victim drawn from a seed: GRPO's entering
# a generation in step 2 (the restart resumes from step 1's checkpoint), PPO's (staleness 1:
# the look-ahead batch in flight) entering the save of step 3, which leaves that step's
# checkpoint unwritten (the restart resumes from step 2's). Every other kill point, at
# staleness 0, 1 and 2 and at several seeds, is tests/test_resume.py's (one process): what two
# processes add is that both restart from the same checkpoint and data state, which each kill
# here shows. (Two kills a phase, every point, cost two more starts of both processes: ~50 s
# of the suite.)
_rng = random.Random(0)
KILLS = {"grpo": [(_rng.randrange(2), 2, "generate")], "ppo": [(_rng.randrange(2), 3, "save")]}
assert {p for kills in KILLS.values() for _, _, p in kills} <= set(mp_programs.KILL_POINTS)
assert all(p in mp_programs.STALE_KILL_POINTS for _, _, p in KILLS["ppo"])


def _learner(n, devices, cache, workdir, **args):
    """mp_programs.learner_program in n processes x `devices` (compiled as tests/conftest.py
    sets it, into the persistent compilation cache `cache`: a restart loads what the run
    before compiled, process 0 compiles for both)."""
    return multiprocess.run("mp_programs:learner_program", n=n, devices=devices, timeout=900,
                            cache_dir=cache, args={"workdir": workdir, **args})


@pytest.fixture(scope="module")
def learner_runs(tmp_path_factory):
    """The learner's phases (mp_programs.PHASES: SFT, packed SFT, GRPO with dynamic
    sampling, PPO with staleness 1, a multi-turn step with tools and self-correction, and
    the held-out evaluation) once uninterrupted in 1 process x 8 devices, and in 2 processes
    x 4 killed at each of KILLS and restarted (every process) until it finishes: one process
    start per layout and kill, 1 x 8 alongside 2 x 4 (`multiprocess.in_background`). Returns
    (the 2 x 4 results, the 1 x 8 result, the 2 x 4 work dir, the exit codes of each killed
    run)."""
    cache = str(tmp_path_factory.mktemp("xla_cache"))
    one = multiprocess.in_background(  # (while 2 x 4 runs)
        _learner, 1, 8, cache, str(tmp_path_factory.mktemp("learner_1x8")), split_sft=False)
    workdir = str(tmp_path_factory.mktemp("learner_2x4"))
    killed = []
    try:
        for i in range(sum(map(len, KILLS.values()))):
            try:
                _learner(2, 4, cache, workdir, kills=KILLS, ref_offload=True)
                killed.append("finished")
            except RuntimeError as e:  # "processes exited with [codes]": one killed itself
                if len(glob.glob(os.path.join(workdir, "killed-*"))) != i + 1:
                    raise  # not (only) the kill: a failure
                killed.append(str(e).splitlines()[0])
        two = _learner(2, 4, cache, workdir, kills=KILLS, ref_offload=True)
    finally:
        one = one.result()[0]
    return two, one, workdir, killed


def _same_metrics(two, one, atol=None):
    """Process 0's metrics and every process's final parameters equal one process's: bit for
    bit, or within `atol`."""
    assert two[1]["metrics"] is None  # process 1 writes no logs
    got, want = two[0]["metrics"], one["metrics"]
    assert [r["step"] for r in got] == [r["step"] for r in want] and want
    for a, b in zip(got, want):
        assert a.keys() == b.keys()
        for k in b:
            if atol is None:
                assert a[k] == b[k], (a["step"], k, a[k], b[k])
            else:
                np.testing.assert_allclose(a[k], b[k], atol=atol, rtol=1e-5, err_msg=k)
    for p in two:  # every process ends with the same (whole) parameters as one process
        for a, b in zip(jax.tree.leaves(p["params"]), jax.tree.leaves(one["params"])):
            if atol is None:
                np.testing.assert_array_equal(a, b)
            else:
                np.testing.assert_allclose(a, b, atol=atol)


def _killed_where_told(two, workdir, killed, phase):
    """Each kill of `phase` happened at its point, and every process's runs of the phase
    started from 0, then from the checkpoint each kill left: a kill in step s leaves step
    s - 1's (one at the save of step s never lists step s's)."""
    assert all(k.startswith("processes exited with") for k in killed), killed
    for i, (_, step, point) in enumerate(KILLS[phase]):
        with open(os.path.join(workdir, f"killed-{phase}-{i}")) as f:
            assert f.read() == point
    assert [r[phase]["starts"] for r in two] == [[0] + [s - 1 for _, s, _ in KILLS[phase]]] * 2
    with Checkpointer(os.path.join(workdir, phase, "checkpoints")) as ckpt:
        assert ckpt.latest_step() == 3


_LEARNER = pytest.mark.xdist_group("multiprocess_learner")  # one fixture, on one worker


@_LEARNER
@pytest.mark.timeout(2400)
def test_sft_and_its_resume_equal_one_process(learner_runs):
    """Two SFT steps, a third resumed from the step-2 checkpoint, on 2 x 4: bit for bit the
    three uninterrupted steps of 1 x 8."""
    two, one, _, _ = learner_runs
    _same_metrics([r["sft"] for r in two], one["sft"])
    assert [r["step"] for r in one["sft"]["metrics"]] == [1, 2, 3]


@_LEARNER
@pytest.mark.timeout(2400)
def test_packed_sft_and_its_resume_equal_one_process(learner_runs):
    """sft.packing on 2 x 4 (every process packs the global rows from the whole record
    stream and places its devices' rows), two steps and a third resumed: 1 x 8's three."""
    two, one, _, _ = learner_runs
    _same_metrics([r["sft_packed"] for r in two], one["sft_packed"])
    metrics = one["sft_packed"]["metrics"]
    assert [r["step"] for r in metrics] == [1, 2, 3]
    assert all(r["sft/documents"] > 8 and r["sft/fill"] > 0.5 for r in metrics)  # packed


@_LEARNER
@pytest.mark.timeout(2400)
def test_rl_with_dynamic_sampling_killed_and_restarted_equals_one_process(learner_runs):
    """GRPO with groups kept and filled over the global batch, KL (2 x 4 holds the reference
    in host memory between steps, kl.ref_offload; 1 x 8 on the devices); one process SIGKILLed
    entering a generation in step 2; a restart of both resumes from step 1's checkpoint and
    the run ends bit for bit as 1 x 8's uninterrupted one."""
    two, one, workdir, killed = learner_runs
    _killed_where_told(two, workdir, killed, "grpo")
    _same_metrics([r["grpo"] for r in two], one["grpo"])
    assert [r["step"] for r in one["grpo"]["metrics"]] == [1, 2, 3]
    assert "dapo/gen_batches" in one["grpo"]["metrics"][0]


@_LEARNER
@pytest.mark.timeout(2400)
def test_ppo_critic_with_staleness_killed_and_restarted_equals_one_process(learner_runs):
    """PPO's critic (GAE) with rl.staleness=1 (batch t+1 generated in step t from the
    parameters a checkpoint keeps, scored in a thread), KL; one process SIGKILLed entering
    the save of step 3 (its checkpoint unwritten: both resume from step 2's): bit for bit
    1 x 8's uninterrupted run."""
    two, one, workdir, killed = learner_runs
    _killed_where_told(two, workdir, killed, "ppo")
    _same_metrics([r["ppo"] for r in two], one["ppo"])
    metrics = one["ppo"]["metrics"]
    assert [r["step"] for r in metrics] == [1, 2, 3]
    assert "critic/vf_loss" in metrics[0] and metrics[2]["rollout/staleness"] > 0


@_LEARNER
@pytest.mark.timeout(2400)
def test_multiturn_rl_with_tools_and_eval_equal_one_process(learner_runs):
    """A multi-turn step (python tool calls in the process sandbox, then self-correction:
    processes hold different numbers of live episodes each turn), then the held-out
    evaluation, each process scoring its own block of the tasks: 1 x 8's to float
    tolerance (its own model: the task vocabulary)."""
    two, one, _, _ = learner_runs
    _same_metrics([r["multiturn"] for r in two], one["multiturn"], atol=1e-5)
    metrics = one["multiturn"]["metrics"]
    assert [r["step"] for r in metrics] == [1]
    assert metrics[0]["episode/fmt/tool_calls"] > 0 and metrics[0]["episode/fmt/attempts"] > 1
    for r in two:
        assert r["multiturn"]["eval"] == one["multiturn"]["eval"]
    assert one["multiturn"]["eval"][0]["n"] == 4


@_LEARNER
@pytest.mark.timeout(2400)
def test_multiturn_rl_on_the_engine_equals_one_process(learner_runs):
    """The same multi-turn step and evaluation with sampling.engine=True: on 2 x 4 each
    process runs its own episodes on its own engine and copy of the policy (gathered at the
    weight sync); 1 x 8's one engine decodes the learner's arrays. Metrics (the engines'
    decoded and prefilled tokens among them), parameters and eval lines equal to float
    tolerance."""
    two, one, _, _ = learner_runs
    _same_metrics([r["multiturn_engine"] for r in two], one["multiturn_engine"], atol=1e-5)
    metrics = one["multiturn_engine"]["metrics"]
    assert metrics[0]["engine/tokens"] > 0 and metrics[0]["engine/prefill_tokens"] > 0
    assert metrics[0]["episode/fmt/tool_calls"] > 0 and metrics[0]["episode/fmt/attempts"] > 1
    for r in two:
        assert r["multiturn_engine"]["eval"] == one["multiturn_engine"]["eval"]
