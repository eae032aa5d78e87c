"""The closed loop: overlapped scoring (rl.staleness), on-policy exactness, the main job end to
end through `launch/train.py`, and its resume.

Everything is real: the model samples, the tools and verdicts run in the sandbox. The
producer is instrumented (it records the order of its calls and the parameters it was given)
but does all of its work.
"""

import json
import logging
import os
import subprocess
import sys
import threading

import jax
import numpy as np
import pytest

from configs import quickstart
from ptrain import closed_loop, learner, metrics, rollout, sharding

pytestmark = pytest.mark.xdist_group("closed_loop")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WAIT_S = 120.0  # generous: only a broken overlap waits this long (and then fails)


def _tiny_config(staleness, steps=4):
    """A random tiny model on two synthetic domains (code: one turn; arith: tool calls)."""
    c = quickstart.get_config("short")
    c.unlock()
    c.steps = steps
    c.model.update(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64)
    c.sft.steps = 0
    c.tasks.envs = tuple(dict(env=env, args=dict(n_train=16, n_heldout=2))
                         for env in ("ptrain.envs.code:generated", "ptrain.envs.math:arith"))
    c.eval.n = 2
    c.data.prompts_per_step = 2
    c.sampling.num_samples = 4
    c.sampling.max_new_tokens = 16
    c.rollout.max_len = 40
    c.rl.staleness = staleness
    c.dapo.overlong_buffer = 8  # measured against rollout.max_len (multi-turn episodes)
    c.optim.lr = 3e-2  # big steps: parameters one update apart give clearly different log-probs
    c.rl.entropy_coef = 0.05  # a random model never passes: this keeps every update non-zero
    c.sandbox.backend = "process"  # the overlap does not depend on the isolation
    c.checkpoint.every = 100
    c.lock()
    return c


class RoomProfile:
    """Which rooms (files of ptrain/ and sandbox/) one thread's calls enter, and which are
    re-entered: called while already on the thread's stack below another room (the old
    closed_loop -> learner -> closed_loop -> rollout -> ... pattern). A `sys.setprofile`
    hook; the stack is seeded with the frames live when it starts."""

    PACKAGES = tuple(os.path.join(ROOT, d) + os.sep for d in ("ptrain", "sandbox"))

    def __init__(self):
        self.stack, self.entered, self.reentered = [], set(), []
        frame = sys._getframe(1)
        while frame is not None:
            self.stack.insert(0, self._room(frame))
            frame = frame.f_back

    def _room(self, frame):
        path = frame.f_code.co_filename
        return os.path.relpath(path, ROOT) if path.startswith(self.PACKAGES) else None

    def __call__(self, frame, event, arg):
        if event == "call":
            room = self._room(frame)
            if room is not None:
                self.entered.add(room)
                top = next((r for r in reversed(self.stack) if r is not None), None)
                if room != top and room in self.stack:
                    self.reentered.append((room, [r for r in self.stack if r]))
            self.stack.append(room)
        elif event == "return" and self.stack:
            self.stack.pop()


class Watched(rollout.Tasks):
    """A real Tasks producer that records the order of its calls and the parameters each
    generate() got. With `hold`, score(i) waits (bounded) until generate(i+1) has started:
    only an overlapped loop lets it through. With `profile`, the learner's thread is
    profiled from generate(2) to generate(3): one whole RL step (`RoomProfile`)."""

    hold = False
    steps = 0
    profile = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.events, self.fingerprints = [], []
        self.changed = threading.Condition()
        self.generated = 0

    def _log(self, event):
        with self.changed:
            self.events.append(event)
            self.changed.notify_all()

    def generate(self, params, records, key):
        self.generated += 1
        i = self.generated
        if self.profile is not None and i in (2, 3):
            sys.setprofile(None)
            if i == 2:
                type(self).profile = RoomProfile()
                sys.setprofile(self.profile)
        leaves = jax.tree.leaves(params)
        self.fingerprints.append(float(sum(np.abs(np.asarray(x)).sum() for x in leaves)))
        self._log(("generate", i))
        episodes = super().generate(params, records, key)
        for e in episodes:
            e.batch_index = i
        return episodes

    def score(self, episodes):
        i = episodes[0].batch_index
        self._log(("score_start", i))
        if self.hold and i < self.steps:
            with self.changed:
                self.changed.wait_for(lambda: ("generate", i + 1) in self.events,
                                      timeout=WAIT_S)
        out = super().score(episodes)
        self._log(("score_end", i))
        return out


def _run(tmp_path, monkeypatch, staleness, hold, profile=False):
    config = _tiny_config(staleness)
    watched = type("W", (Watched,), {"hold": hold, "steps": config.steps,
                                     "profile": False if profile else None})
    instances = []
    monkeypatch.setattr(rollout, "Tasks",
                        lambda *a, **k: instances.append(watched(*a, **k)) or instances[-1])
    workdir = str(tmp_path / f"staleness{staleness}")
    mesh = sharding.make_mesh(data=1, fsdp=1, devices=jax.devices()[:1])
    evals = closed_loop.run(config, workdir, mesh=mesh)
    rows = metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
    return config, instances[0], rows, evals


def test_staleness_one_scores_batch_t_while_generating_batch_t_plus_1(tmp_path, monkeypatch):
    config, p, rows, evals = _run(tmp_path, monkeypatch, staleness=1, hold=True)
    ev = p.events
    assert p.generated == config.steps  # no batch generated beyond the last step
    for i in range(1, config.steps):
        # score(i) was let through only because generate(i+1) began while it was scoring.
        assert ev.index(("generate", i + 1)) < ev.index(("score_end", i)), ev
    # Staleness exactly 1: batches 1 and 2 come from the initial parameters, batch k >= 3
    # from the parameters after k - 2 updates (each one different).
    f = p.fingerprints
    assert f[0] == f[1]
    assert len(set(f[1:])) == len(f) - 1
    # The learner sees the mismatch (one update late) and corrects it with truncated IS.
    assert len(rows) == config.steps
    late = [r["rollout/logp_mismatch"] for r in rows[1:]]
    assert min(late) > 1e-3, late
    assert all(r["tis/weight_mean"] != 1.0 for r in rows[1:])
    assert {(e["stage"], e["domain"]) for e in evals} == {("rl", "code"), ("rl", "arith")}


def _untimed(rows):
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]


def test_staleness_zero_is_exactly_on_policy_and_equals_the_plain_loop(tmp_path, monkeypatch):
    config, p, rows, evals = _run(tmp_path, monkeypatch, staleness=0, hold=False,
                                  profile=True)
    # One RL step (step 2, followed call by call in the learner's thread) enters each room
    # once: no file of ptrain/ or sandbox/ is called while it is already on the stack.
    step = type(p).profile
    assert step.reentered == [], step.reentered[:3]
    # (The jitted programs of step.py run from jax's cached C++ path: no Python frame.)
    assert {"ptrain/learner.py", "ptrain/rollout/producers.py", "ptrain/rollout/episodes.py",
            "ptrain/batch.py", "ptrain/rewards.py",
            "ptrain/metrics.py", "sandbox/pool.py"} <= step.entered, sorted(step.entered)
    ev = p.events
    for i in range(1, config.steps):  # strictly serial: score(i) ends before generate(i+1)
        assert ev.index(("score_end", i)) < ev.index(("generate", i + 1)), ev
    assert len(set(p.fingerprints)) == config.steps  # every batch from the newest parameters
    # The sampler's log-probs are the learner's (same parameters, same tokens).
    assert len(rows) == config.steps
    assert max(r["rollout/logp_mismatch"] for r in rows) < 1e-4
    assert all(abs(r["tis/weight_mean"] - 1.0) < 1e-4 for r in rows)

    # The same run through the plain loop (one rollout_fn call per step, no producer
    # machinery) gives the same numbers.
    train = learner.train

    def plain(config, workdir, *, producer, **kwargs):
        return train(config, workdir, **kwargs,
                     rollout_fn=lambda p, r, k: producer.score(producer.generate(p, r, k)))

    monkeypatch.setattr(learner, "train", plain)
    _, _, plain_rows, plain_evals = _run(tmp_path / "plain", monkeypatch, staleness=0,
                                         hold=False)
    assert _untimed(plain_rows) == _untimed(rows)
    assert plain_evals == evals


# ------------------------------------------------------------------------- the main job


def _launch(workdir, *overrides):
    cmd = [sys.executable, "-m", "launch.train", "--config=configs/quickstart.py:short",
           f"--workdir={workdir}", *overrides]
    env = dict(os.environ, XLA_FLAGS=" ".join(  # one CPU device, as on a laptop, and LLVM -O1:
        [f for f in os.environ.get("XLA_FLAGS", "").split()  # its cost is running, not compiling
         if "device_count" not in f and "optimization_level" not in f
         and "expensive_passes" not in f] + ["--xla_backend_optimization_level=1"]))
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)


def test_quickstart_short_end_to_end_and_resume(tmp_path):
    """`make quickstart`'s command on the short config: SFT, held-out eval, RL on sandbox
    verdicts, eval again; every artefact it promises; held-out pass rates rise; a second
    launch resumes and repeats nothing."""
    workdir = str(tmp_path / "qs")
    config = quickstart.get_config("short")
    proc = _launch(workdir)
    assert proc.returncode == 0, proc.stderr[-4000:]

    evals = metrics.read_jsonl(os.path.join(workdir, "eval.jsonl"))
    domains = [env.name for env in closed_loop.environments(config)]
    assert [(e["stage"], e["domain"]) for e in evals] == \
        [(s, d) for s in ("sft", "rl") for d in domains]
    for e in evals:
        assert set(e) == {"stage", "step", "split", "domain", "decoding", "pass_rate", "n",
                          "pass@1", "samples", "truncated", "finish"}
        assert e["pass@1"] == e["pass_rate"] and e["samples"] == 1
        assert e["split"] == "heldout" and e["decoding"] == "greedy"
        assert e["n"] == config.eval.n and 0.0 <= e["pass_rate"] <= 1.0
        assert e["step"] == (config.sft.steps if e["stage"] == "sft" else config.steps)

    rows = metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
    assert [r["step"] for r in rows] == list(range(1, config.steps + 1))
    # No alert fires on the quickstart (ptrain/alerts.py logs a fired one as alert/<name>).
    sft_rows = metrics.read_jsonl(os.path.join(workdir, "sft", "metrics.jsonl"))
    assert len(sft_rows) == config.sft.steps
    assert [k for r in sft_rows + rows for k in r if k.startswith("alert/")] == []
    for d in domains:
        assert all(f"reward/{d}/mean" in r for r in rows), d
    # RL improves on the SFT policy where it counts: greedy, on the held-out split (the short
    # run's SFT has not converged on arith's copying yet; code and files gain most).
    rate = {(e["stage"], e["domain"]): e["pass_rate"] for e in evals}
    gains = [rate["rl", d] - rate["sft", d] for d in domains]
    assert np.mean(gains) >= 0.15, rate

    rollouts = metrics.read_jsonl(os.path.join(workdir, "rollouts.jsonl"))
    assert rollouts and {"prompt", "completion", "feedback", "reward", "domain"} <= set(
        rollouts[0])
    assert os.path.getsize(os.path.join(workdir, "reward_curve.png")) > 1000
    page = open(os.path.join(workdir, "report.html")).read()  # ptrain.report (test_report.py)
    assert all(f"<tr><td>{d}</td>" in page for d in domains) and "<svg" in page
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(
        os.path.join(workdir, "tb")))
    held = {json.loads(line)["prompt"]
            for d in domains for line in open(os.path.join(workdir, "tasks",
                                                            f"{d}.heldout.jsonl"))}
    train = {json.loads(line)["prompt"]
             for d in domains for line in open(os.path.join(workdir, "tasks",
                                                             f"{d}.train.jsonl"))}
    assert held and train and not held & train

    # A second launch finds everything done: no training step, no evaluation repeated.
    proc = _launch(workdir)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert metrics.read_jsonl(os.path.join(workdir, "eval.jsonl")) == evals
    assert metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl")) == rows


# --------------------------------------------------------------- load-time checks, evaluation


def _jsonl_config(tmp_path, train, heldout, tools=(), **changes):
    c = closed_loop.defaults()
    c.tasks.envs = (dict(env="ptrain.envs.files:records", name="code", args=dict(
        train=train, heldout=heldout, tools=tools)),)
    for key, value in changes.items():
        section, name = key.split(".")
        c[section][name] = value
    return c


def _task_file(path, prompts):
    from ptrain import tasks
    tasks.write_jsonl([tasks.Task(f"t{i}", "code", tasks.Answer("1"), prompt=p)
                       for i, p in enumerate(prompts)], str(path))
    return str(path)


def _make_tasks(config, tokenizer, tmp_path):
    return closed_loop.make_tasks(config, closed_loop.environments(config), tokenizer,
                                  str(tmp_path / "w"))


def test_task_files_are_checked_when_loaded_naming_the_key(tmp_path):
    from ptrain.envs import synthetic
    tok = synthetic.WordTokenizer.for_tasks()
    human_eval = tmp_path / "he.jsonl"
    human_eval.write_text(json.dumps({"task_id": "HumanEval/0", "prompt": "def f():\n    \"\"\"One.\"\"\"\n",
                                      "test": "def check(c): pass", "entry_point": "f"}) + "\n")
    held = _task_file(tmp_path / "held.jsonl", ["code: 1 plus 1"])
    with pytest.raises(ValueError, match=r"environment 'code' args.train: .*set the file's "
                                         r"format: .*args.train=\(.*he.jsonl', 'humaneval'\)"):
        _make_tasks(_jsonl_config(tmp_path, str(human_eval), held), tok, tmp_path)
    train, _, _ = _make_tasks(
        _jsonl_config(tmp_path, (str(human_eval), "humaneval"), held), tok, tmp_path)
    assert train["code"][0].id == "HumanEval/0" and train["code"][0].domain == "code"
    long = _task_file(tmp_path / "long.jsonl", ["code: 2 plus 2", "code: " + "1 plus " * 40])
    with pytest.raises(ValueError, match=r"1 of 2 code prompts are longer than "
                                         r"data.max_prompt_len=64 tokens \(the longest, 't1'"):
        _make_tasks(_jsonl_config(tmp_path, long, held), tok, tmp_path)


def test_derive_config_counts_added_tokens_and_stops_where_a_chat_turn_ends(hf_dir, tmp_path):
    from ptrain import hf
    base = hf_dir("qwen2.5-base")
    tok = hf.load_tokenizer(base)
    c = _jsonl_config(tmp_path, "t.jsonl", "h.jsonl", **{"rollout.chat_format": "qwen"})
    c.hf_model = base
    out = closed_loop.derive_config(c, str(tmp_path), tok)
    im_end, eos = tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id
    assert out.sampling.stop_token_ids == (im_end, eos)  # a base model's eos is not the turn's
    c.hf_model = ""
    c.model.vocab_size = 0  # the tokenizer's: len(tokenizer), added tokens included
    assert closed_loop.derive_config(c, str(tmp_path), tok).model.vocab_size == len(tok) > \
        tok.vocab_size
    c.model.vocab_size = len(tok) - 3
    with pytest.raises(ValueError, match=r"config.model.vocab_size.*at least"):
        closed_loop.derive_config(c, str(tmp_path), tok)


def test_a_chat_format_its_template_does_not_write_is_refused_when_tasks_load(hf_dir, tmp_path):
    """The format appends turns the way the tokenizer's template writes them (`chat.check`,
    with the tasks' tools): the real Qwen2.5 template passes; one that ends a turn without
    its newline is refused before anything runs, naming rollout.chat_format."""
    from ptrain import hf
    tok = hf.load_tokenizer(hf_dir("qwen2.5-base"))
    c = _jsonl_config(tmp_path, _task_file(tmp_path / "t.jsonl", ["code: 1 plus 1"]),
                      _task_file(tmp_path / "h.jsonl", ["code: 2 plus 2"]), tools=("python",),
                      **{"rollout.chat_format": "qwen", "data.max_prompt_len": 512})
    _make_tasks(c, tok, tmp_path)
    assert "'<|im_end|>' + '\\n'" in tok.chat_template
    tok.chat_template = tok.chat_template.replace("'<|im_end|>' + '\\n'", "'<|im_end|>'")
    with pytest.raises(ValueError, match=r"rollout.chat_format='qwen': .* does not match this "
                                         r"tokenizer's chat template"):
        _make_tasks(c, tok, tmp_path)


def test_eval_summary_pass_at_k_and_truncated_turns():
    from types import SimpleNamespace

    from sandbox.terminal.evaluate import pass_at_k

    def episode(passed, finish="answered"):
        return SimpleNamespace(verdicts=[SimpleNamespace(passed=passed, reward=float(passed))],
                               finish=finish)
    # two tasks, four samples each: 1 of 4 and 3 of 4 passed; one answer cut short
    episodes = [episode(p) for p in (False, True, False, False)] + \
        [episode(True), episode(True), episode(False, "truncated"), episode(True)]
    out = closed_loop.eval_summary(episodes, 4)
    for k in (1, 2, 4):
        assert out[f"pass@{k}"] == pytest.approx((pass_at_k(4, 1, k) + pass_at_k(4, 3, k)) / 2)
    assert out["pass_rate"] == out["pass@1"] == 0.5
    assert (out["n"], out["samples"], out["truncated"]) == (2, 4, 1 / 8)
    assert out["finish"] == {"answered": 7, "truncated": 1}


def test_evaluations_are_keyed_by_stage_and_step_and_resume_row_by_row(tmp_path, monkeypatch):
    """Each (domain, decoding) row is written as it is measured: an evaluation interrupted
    after its first row measures only the others when run again; TensorBoard gets them too."""
    calls, fail_after = [], [1]

    def fake_evaluate(*, stage, step, config, heldout, skip, on_line, **kwargs):
        for decoding in ("greedy", "sample"):
            for domain in heldout:
                if (domain, decoding) in skip:
                    continue
                if fail_after[0] == 0:
                    raise KeyboardInterrupt
                fail_after[0] -= 1
                calls.append((step, domain, decoding))
                on_line({"stage": stage, "step": step, "domain": domain, "decoding": decoding,
                         "pass_rate": 0.5, "pass@1": 0.5, "n": 1, "truncated": 0.0})
    monkeypatch.setattr(closed_loop, "evaluate", fake_evaluate)
    config = quickstart.get_config("short")
    config.eval.sample = True
    ev = dict(config=config, heldout={"code": [0, 1], "arith": [2]})
    path = str(tmp_path / "eval.jsonl")
    with pytest.raises(KeyboardInterrupt):  # killed after its first row
        closed_loop._evaluate_once(path, "rl", 100, **ev)
    assert [(r["domain"], r["decoding"]) for r in metrics.read_jsonl(path)] == [
        ("code", "greedy")]
    fail_after[0] = 100
    rows = closed_loop._evaluate_once(path, "rl", 100, **ev)  # resumed: the other three
    assert [(r["domain"], r["decoding"]) for r in rows] == [
        ("code", "greedy"), ("arith", "greedy"), ("code", "sample"), ("arith", "sample")]
    closed_loop._evaluate_once(path, "rl", 100, **ev)  # done: nothing new
    closed_loop._evaluate_once(path, "rl", 150, **ev)  # extended to more steps: its new step
    assert calls == [(100, "code", "greedy"), (100, "arith", "greedy"), (100, "code", "sample"),
                     (100, "arith", "sample")] + [
        (150, d, dec) for dec in ("greedy", "sample") for d in ("code", "arith")]
    assert len(metrics.read_jsonl(path)) == 8
    from test_metrics import read_events
    scalars = {}
    for file in sorted((tmp_path / "tb" / "eval").glob("events.*")):
        for e in read_events(file):
            for v in e.summary.value:
                scalars.setdefault(v.tag, []).append((e.step, v.simple_value))
    assert "eval_domain/arith/rl_sample/pass_rate" in scalars
    assert scalars["eval_domain/code/rl_greedy/pass_rate"] == [(100, 0.5), (150, 0.5)]


def test_an_evaluation_in_calls_of_a_few_tasks_shows_progress_and_equals_one_call(tmp_path,
                                                                                 caplog):
    """eval.tasks_per_call: the held-out tasks run a call at a time, the progress advancing
    after each call (not once per environment), and greedy rows equal those of one call."""
    rows, lines = {}, {}
    for per_call in (0, 1):
        c = _tiny_config(0, steps=0)
        c.unlock()
        c.tasks.envs = tuple(dict(env=env, args=dict(n_train=8, n_heldout=3))
                             for env in ("ptrain.envs.code:generated", "ptrain.envs.math:arith"))
        c.eval.update(n=3, tasks_per_call=per_call)
        c.lock()
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="ptrain.progress"):
            closed_loop.run(c, str(tmp_path / str(per_call)),
                            mesh=sharding.make_mesh(data=1, fsdp=1, devices=jax.devices()[:1]))
        lines[per_call] = [r.getMessage() for r in caplog.records
                           if r.name == "ptrain.progress" and r.getMessage().startswith("eval")]
        rows[per_call] = metrics.read_jsonl(str(tmp_path / str(per_call) / "eval.jsonl"))
    assert [(r["domain"], r["n"]) for r in rows[1]] == [("code", 3), ("arith", 3)]
    assert rows[1] == rows[0]
    # A log line at the first task judged (then at most every 30 s, and at the last): one call
    # of all tasks judges three at once, a call per task one.
    assert any(line.startswith("eval rl: 1/6 tasks") for line in lines[1]), lines[1]
    assert any(line.startswith("eval rl: 3/6 tasks") for line in lines[0]), lines[0]
    assert not any(line.startswith("eval rl: 1/6") for line in lines[0]), lines[0]
