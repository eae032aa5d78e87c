"""The terminal environment (ptrain/envs/terminal/) on docker: generated Harbor tasks pass
their oracle and fail nop; its episodes in the one turn loop (`rollout.Tasks`: turns batched
through a sampler, tool calls in each task's shell) are rewarded by the tasks' own tests and
packed for the learner with the loss mask on the model's tokens only; the closed loop's
terminal environment from config, alone and mixed with another environment."""

import random
import re

import numpy as np
import pytest

from ptrain import chat, learner
from ptrain.envs.terminal import generated as terminal_tasks
from ptrain.generate import sampler as sampler_lib

pytestmark = pytest.mark.xdist_group("terminal")


@pytest.fixture(scope="module")
def terminal():
    from tests.test_terminal import _REASON
    if _REASON is not None:
        pytest.skip(_REASON)
    from sandbox import terminal
    return terminal


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("toy"))
    held = terminal_tasks.generate(root, 4, seed=0, split="heldout")
    train = terminal_tasks.generate(root, 6, seed=0, split="train",
                                    exclude={g.instruction for g in held})
    return train, held


def test_generated_splits_are_disjoint_harbor_tasks(terminal, generated):
    train, held = generated
    assert not {g.instruction for g in train} & {g.instruction for g in held}
    tasks = [terminal.load_task(g.task_dir) for g in train + held]
    assert all(t.layout == "harbor" and t.instruction.startswith("terminal: write")
               for t in tasks)
    folders = [g for g in train + held if g.triggered]
    assert folders and all("mkdir -p" in g.good and "mkdir" not in g.bad for g in folders)


def test_generated_tasks_pass_their_oracle_and_fail_nop(terminal, generated):
    train, _ = generated
    with terminal.Harness() as h:
        for g in train[:3]:
            task = terminal.load_task(g.task_dir)
            assert terminal.run_attempt(h, task, terminal.oracle, 0)[0]["reward"] == 1.0
            assert terminal.run_attempt(h, task, terminal.nop, 0)[0]["reward"] == 0.0


class ScriptedSampler:
    """Sampler-shaped: each row's turn is the right command for even rows and the
    demonstrations' mistake for odd ones (first turn; a call turn ends at its </tool_call>),
    then "done" + EOS (later turns)."""

    def __init__(self, tok, by_instruction):
        self.tok, self.by_instruction, self.calls = tok, by_instruction, []

    def sample(self, params, prompts, *, max_new_tokens, stop_token_ids, key, num_samples=1,
               **kw):
        histories = [ids for ids in prompts for _ in range(num_samples)]
        self.calls.append(len(histories))
        rows = []
        for i, ids in enumerate(histories):
            text = self.tok.decode(ids)
            if "<tool_response>" in text:
                rows.append(chat.encode(self.tok, "done") + [self.tok.eos_token_id])
            else:
                g = self.by_instruction[text]
                command = g.good if i % 2 == 0 else g.bad
                rows.append(chat.encode(self.tok, terminal_tasks.call_text(command)))
            assert rows[-1][-1] in stop_token_ids and len(rows[-1]) <= max_new_tokens
        n = len(rows)
        tokens = np.zeros((n, max_new_tokens), np.int32)
        logp = np.zeros((n, max_new_tokens), np.float32)
        for i, r in enumerate(rows):
            tokens[i, :len(r)], logp[i, :len(r)] = r, -0.5
        return sampler_lib.Samples(tokens=tokens, logp=logp, logp_temp=logp, logp_t1=logp,
                                   lengths=np.array([len(r) for r in rows]),
                                   finish_reasons=["stop"] * n,
                                   prompt_index=np.arange(n) // num_samples)


def terminal_producer(sampler, tok, harness, num_samples):
    """`rollout.Tasks` on the terminal environment, its sessions from `harness`."""
    import dataclasses
    from ptrain import config as config_lib
    from ptrain import rollout
    from ptrain.envs import terminal as terminal_env
    from sandbox import terminal
    c = config_lib.defaults(closed_loop=True)
    c.sampling.update(num_samples=num_samples, max_new_tokens=56,
                      stop_token_ids=(tok.eos_token_id,))
    c.rollout.update(max_turns=2, max_len=96)
    c.data.max_prompt_len = 24
    env = dataclasses.replace(terminal_env.make(system="", threads=4), open_session=lambda t:
                              harness.episode(terminal.load_task(t.task_dir)))
    return rollout.Tasks(sampler, tok, c, None, envs={"terminal": env})


def test_producer_rewards_episodes_by_the_tasks_tests(terminal, generated):
    train, _ = generated
    folders = [g for g in train if g.triggered][:2]
    plain = [g for g in train if not g.triggered][:1]
    picked = folders + plain
    tok = terminal_tasks.tokenizer()
    sampler = ScriptedSampler(tok, {g.instruction: g for g in picked})
    with terminal.Harness() as h:
        producer = terminal_producer(sampler, tok, h, num_samples=4)
        import jax
        episodes = producer.score(producer.generate(None, picked, jax.random.key(0)))
    assert isinstance(episodes, learner.Batch) and len(episodes) == 12
    episodes.check_groups(4)
    assert episodes.group_ids_b.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    assert episodes.max_len_b.tolist() == [96] * 12  # rollout.max_len: the overlong cap
    # Even rows ran the right command; odd rows forgot the folder, which fails only there.
    want = [1.0, 0.0, 1.0, 0.0] * 2 + [1.0] * 4
    assert episodes.rewards_b.tolist() == want
    assert [m["passed"] for m in episodes.meta] == [w == 1.0 for w in want]
    assert sampler.calls == [12, 12]  # every episode's turn in one batch, two turns
    for i, m in enumerate(episodes.meta):
        assert m["domain"] == "terminal" and m["turns"] == 2 and m["tool_calls"] == 1
        assert m["finish"] == "answered" and m["tool_errors"] == 0
        n = episodes.lengths_b[i]
        mask, toks = episodes.loss_mask_bn[i, :n], episodes.tokens_bn[i, :n]
        text = tok.decode(toks[mask == 0].tolist())
        assert re.fullmatch(r"\n<tool_response>\n.*\[exit status \d\]\n</tool_response>\n",
                            text, re.DOTALL), text  # the observation is not trained on
        assert tok.decode(toks[mask == 1].tolist()).endswith("}}</tool_call>done")
        assert np.all(episodes.rollout_logp_bn[i, :n][mask == 1] == -0.5)
    assert "No such file or directory" in tok.decode(
        episodes.tokens_bn[1, :episodes.lengths_b[1]].tolist())
    from ptrain import batch as batch_lib
    metrics = batch_lib.domain_metrics(episodes)
    assert metrics["reward/terminal/mean"] == pytest.approx(np.mean(want))
    assert metrics["episode/terminal/tool_calls"] == 1.0


def test_the_producer_at_staleness_1_on_bwrap(generated):
    """The terminal episodes under the learner's look-ahead (rl.staleness=1): batch t+1 is
    generated (episodes opened and stepped) in its thread while batch t is scored in
    another; each batch is rewarded by its tasks' tests as at staleness 0, rows carry the
    version that generated them, and at most two batches of sandboxes exist at once."""
    import jax
    import jax.numpy as jnp
    from ptrain import lookahead
    from sandbox import terminal
    from sandbox.terminal import bwrap
    if bwrap.unavailable() is not None:
        pytest.skip(bwrap.unavailable())
    train, _ = generated
    picked = [g for g in train if g.triggered][:1] + [g for g in train if not g.triggered][:1]
    tok = terminal_tasks.tokenizer()
    sampler = ScriptedSampler(tok, {g.instruction: g for g in picked})
    records = picked

    class Stream:
        n = 0

        def get_state(self):
            return self.n

        def __next__(self):
            self.n += 1
            return records

    steps, made = 4, []
    with terminal.Harness(backend="bwrap", max_idle=8) as h:
        new = h._new
        h._new = lambda task, key: made.append(1) or new(task, key)
        producer = terminal_producer(sampler, tok, h, num_samples=2)
        ahead = lookahead.LookAhead(1, producer, Stream(), jax.random.key(0), steps=steps,
                                    save_every=100)
        params, batches = {"w": jnp.zeros(())}, []
        try:
            ahead.start(1, [params])
            for step in range(1, steps + 1):
                batches.append(ahead.next(step, params))
                params = {"w": params["w"] + 1}  # the update
        finally:
            ahead.close()
    want = [1.0, 0.0, 1.0, 1.0]  # the folder task: the odd row forgets mkdir -p
    for step, b in enumerate(batches, 1):
        assert b.rewards_b.tolist() == want, (step, b.meta)
        assert {m["policy_version"] for m in b.meta} == {lookahead.version(step, 1)}
        assert lookahead.metrics(b, step, 1)["rollout/staleness"] == min(step - 1, 1)
    # warm boxes reused: two batches' worth at most, an agent box and a fresh verifier box per
    # episode (without reuse: steps * rows * 2)
    assert len(made) <= 2 * 2 * len(want) < steps * len(want) * 2


def test_demonstrations_carry_the_mistake_at_the_bug_rate(generated):
    train, _ = generated
    tok = terminal_tasks.tokenizer()
    g = next(g for g in train if g.triggered)
    rng = random.Random(0)
    demos = [terminal_tasks.demonstration(g, rng, 0.7)[0] for _ in range(200)]
    assert 0.55 < demos.count(g.bad) / 200 < 0.85
    record = terminal_tasks.demo_record(g, tok, g.good, "[exit status 0]")
    ids, mask = record["completion_ids"], record["completion_mask"]
    assert tok.decode(ids) == (terminal_tasks.call_text(g.good) + "\n<tool_response>\n"
                               "[exit status 0]\n</tool_response>\ndone")
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == \
        terminal_tasks.call_text(g.good) + "done"
    assert ids[-1] == tok.eos_token_id and tok.eos_token_id not in ids[:-1]  # a call turn
    # ends at its </tool_call> (the turn loop's stop in the plain format), an answer at EOS
    assert tok.decode(record["prompt_ids"]) == g.instruction


TERMINAL = "ptrain.envs.terminal:make"
FILES = "ptrain.envs.files:generated"


def _with_envs(config, *entries):
    config.tasks.envs = tuple(entries)
    return config


def test_terminal_environment_config_tasks_and_demonstrations(tmp_path):
    """configs/terminal_toy.py is a closed-loop config whose one environment is the terminal
    one: its args are checked, and the tasks, RL records and demonstrations are made."""
    from configs import terminal_toy
    from ptrain import closed_loop, jsonl
    config = terminal_toy.get_config("short")
    closed_loop.check_config(config)
    ahead = terminal_toy.get_config("short").unlock()
    ahead.rl.staleness = 1  # its episodes under the look-ahead: test_..._at_staleness_1
    closed_loop.check_config(ahead)
    retries = terminal_toy.get_config("short").unlock()
    retries.rollout.max_attempts = 2
    with pytest.raises(ValueError, match=r"environments \['terminal'\] have no retries"):
        closed_loop.check_config(retries)
    for args, message in [(dict(n_tasks=3), r"unknown args \['n_tasks'\]"),
                          (dict(backend="podman"), "backend='podman' must be one of"),
                          (dict(heldout_dir="x"), "heldout_dir needs tasks_dir")]:
        bad = _with_envs(terminal_toy.get_config("short").unlock(),
                         dict(env=TERMINAL, args=args))
        with pytest.raises(ValueError, match=message):
            closed_loop.check_config(bad)
    envs = closed_loop.environments(config)
    tok = closed_loop.make_tokenizer(config, envs)
    assert tok.pieces == terminal_tasks.tokenizer().pieces
    train, held, demos = closed_loop.make_tasks(config, envs, tok, str(tmp_path))
    resolved = closed_loop.derive_config(config, str(tmp_path), tok, demonstrations=demos)
    assert resolved.model.vocab_size == tok.vocab_size
    assert resolved.sampling.stop_token_ids == (tok.eos_token_id,)
    assert closed_loop.prompt_sources(resolved, train) == [(train["terminal"], 1.0)]
    train, held = train["terminal"], held["terminal"]
    assert len(train) == 40 and len(held) == 8  # the short config's args
    records = jsonl.read(str(tmp_path / "tasks" / "terminal.train.jsonl"))
    assert records == [{"task_dir": g.task_dir, "domain": "terminal"} for g in train]
    demos = jsonl.read(resolved.sft.sources[0])
    assert len(demos) == len(train) and {d["domain"] for d in demos} == {"terminal"}
    longest = max(len(d["completion_ids"]) for d in demos)
    assert longest <= config.sft.max_completion_len and longest <= config.rollout.max_len
    assert max(len(d["prompt_ids"]) for d in demos) <= config.data.max_prompt_len
    mixed = _with_envs(terminal_toy.get_config("short").unlock(), dict(env=FILES),
                       dict(env=TERMINAL))
    closed_loop.check_config(mixed)
    pieces = set(closed_loop.make_tokenizer(mixed, closed_loop.environments(mixed)).pieces)
    assert pieces == set(terminal_tasks.tokenizer().pieces) | set(
        closed_loop.synthetic.WordTokenizer.for_tasks().pieces)


def test_a_directory_of_tasks_is_the_terminal_environments_prompt_source(tmp_path):
    """tasks_dir: the bundled Harbor / TB 1.0 tasks as the environment's training and
    held-out tasks (a seeded split, or heldout_dir's), mixed with another environment by
    weight; on bwrap a task that needs its image is an error before anything runs."""
    import os
    import shutil
    from configs import terminal_toy
    from ptrain import closed_loop, jsonl
    from ptrain.envs import terminal as terminal_env
    from sandbox import terminal
    bundled = terminal.BUNDLED_TASKS
    config = _with_envs(terminal_toy.get_config("short").unlock(),
                        dict(env=FILES, args=dict(n_train=40, n_heldout=8), weight=1.0),
                        dict(env=TERMINAL, args=dict(tasks_dir=bundled, n_heldout=4),
                             weight=3.0))
    config.data.max_prompt_len = 4096  # the bundled instructions, partly spelled out
    closed_loop.check_config(config)
    envs = closed_loop.environments(config)
    tok = closed_loop.make_tokenizer(config, envs)
    train, held, _ = closed_loop.make_tasks(config, envs, tok, str(tmp_path))
    names = lambda found: sorted(os.path.basename(x.task_dir) for x in found)  # noqa: E731
    assert len(held["terminal"]) == 4 and len(train["terminal"]) == 11
    assert sorted(names(train["terminal"]) + names(held["terminal"])) == sorted(
        os.listdir(bundled))
    again = closed_loop.make_tasks(config, envs, tok, str(tmp_path / "again"))
    assert names(again[1]["terminal"]) == names(held["terminal"])  # the split is seeded
    sources = closed_loop.prompt_sources(config, train)
    assert sources[0][0] is train["files"] and [w for _, w in sources] == [1.0, 3.0]
    assert sources[1][0] is train["terminal"]
    assert jsonl.read(str(tmp_path / "tasks" / "terminal.train.jsonl")) == [
        {"task_dir": x.task_dir, "domain": "terminal"} for x in train["terminal"]]
    demos = jsonl.read(str(tmp_path / "tasks" / "sft.jsonl"))
    assert {d["domain"] for d in demos} == {"files"}  # no demonstrations for listed tasks
    # A held-out directory of its own; on bwrap, the five tasks that need only files.
    files_only = tmp_path / "files_only"
    for name in ("csv-column-sum", "csv-to-json", "fix-stats-bug", "hello-file",
                 "tcp-upper-service"):
        shutil.copytree(os.path.join(bundled, name), files_only / name)
    own = terminal_env.Settings(tasks_dir=str(files_only),
                                heldout_dir=str(files_only / "hello-file"), n_heldout=4)
    with pytest.raises(ValueError, match="also training tasks'"):
        terminal_env.from_directory(own, 0)
    from sandbox.terminal import bwrap
    if bwrap.unavailable() is None:
        own = terminal_env.Settings(tasks_dir=str(files_only), backend="bwrap", n_heldout=4)
        tr, he = terminal_env.from_directory(own, 0)
        assert len(tr) + len(he) == 5 and len(he) == 2
        with pytest.raises(ValueError, match="cannot run 10 task.*RUN"):
            terminal_env.from_directory(terminal_env.Settings(tasks_dir=bundled,
                                                              backend="bwrap"), 0)


def test_the_closed_loop_mixes_terminal_tasks_with_another_domain(terminal, tmp_path):
    """One closed-loop run with the files environment and the terminal one by weight: SFT on
    both environments' demonstrations, RL batches holding episodes of both (sandbox verdicts and
    the terminal tasks' own tests in docker), per-domain metrics and held-out evals."""
    from configs import terminal_toy
    from ptrain import closed_loop, jsonl
    c = _with_envs(terminal_toy.get_config("short").unlock(),
                   dict(env=FILES, args=dict(n_train=8, n_heldout=2)),
                   dict(env=TERMINAL, args=dict(n_train=8, n_heldout=2, threads=4,
                                                max_idle=8)))
    c.update_from_flattened_dict({"steps": 2, "sft.steps": 2, "sampling.num_samples": 4,
                                  "sampling.max_new_tokens": 24, "eval.n": 2,
                                  "checkpoint.async_save": False})
    c.lock()
    lines = closed_loop.run(c, str(tmp_path))
    assert {(x["stage"], x["domain"]) for x in lines} == {
        (s, d) for s in ("sft", "rl") for d in ("files", "terminal")}
    for x in lines:
        assert x["n"] == 2 and 0.0 <= x["pass_rate"] <= 1.0
    steps = [m for m in jsonl.read(str(tmp_path / "metrics.jsonl")) if "reward/mean" in m]
    assert len(steps) == 2
    assert any("reward/terminal/mean" in m and "reward/files/mean" in m for m in steps)
    demos = jsonl.read(str(tmp_path / "tasks" / "sft.jsonl"))
    assert {d["domain"] for d in demos} == {"files", "terminal"}
