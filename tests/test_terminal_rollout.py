"""ptrain/terminal_rollout.py and ptrain/terminal_tasks.py on docker: generated Harbor tasks
pass their oracle and fail nop; the producer's episodes (turns batched through a sampler,
tool calls in each task's shell) are rewarded by the tasks' own tests and packed for the
learner with the loss mask on the model's tokens only."""

import random
import re

import numpy as np
import pytest

from ptrain import chat, learner, sampler as sampler_lib, terminal_rollout, terminal_tasks

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
    demonstrations' mistake for odd ones (first turn), then "done" (later turns)."""

    def __init__(self, tok, by_instruction):
        self.tok, self.by_instruction, self.calls = tok, by_instruction, []

    def sample(self, params, prompts, *, max_new_tokens, stop_token_ids, key, **kw):
        self.calls.append(len(prompts))
        rows = []
        for i, ids in enumerate(prompts):
            text = self.tok.decode(ids)
            if "<tool_response>" in text:
                rows.append(chat.encode(self.tok, "done"))
            else:
                g = self.by_instruction[text]
                command = g.good if i % 2 == 0 else g.bad
                rows.append(chat.encode(self.tok, terminal_tasks.call_text(command)))
            rows[-1] = rows[-1][:max_new_tokens - 1] + [stop_token_ids[0]]
        n = len(rows)
        tokens = np.zeros((n, max_new_tokens), np.int32)
        logp = np.zeros((n, max_new_tokens), np.float32)
        for i, r in enumerate(rows):
            tokens[i, :len(r)], logp[i, :len(r)] = r, -0.5
        return sampler_lib.Samples(tokens=tokens, logp=logp, logp_temp=logp, logp_t1=logp,
                                   lengths=np.array([len(r) for r in rows]),
                                   finish_reasons=["stop"] * n, prompt_index=np.arange(n))


def test_producer_rewards_episodes_by_the_tasks_tests(terminal, generated):
    train, _ = generated
    folders = [g for g in train if g.triggered][:2]
    plain = [g for g in train if not g.triggered][:1]
    picked = folders + plain
    tok = terminal_tasks.tokenizer()
    sampler = ScriptedSampler(tok, {g.instruction: g for g in picked})
    config = terminal_rollout.TerminalRolloutConfig(num_samples=4, max_new_tokens=56,
                                                    max_turns=2, max_len=96, threads=4,
                                                    system="")
    with terminal.Harness() as h:
        producer = terminal_rollout.TerminalProducer(
            sampler, tok, harness=h, fmt=chat.PLAIN, stop_ids=(tok.eos_token_id,),
            config=config, prompt_len=24)
        try:
            records = [{"task_dir": g.task_dir, "domain": "terminal"} for g in picked]
            import jax
            episodes = producer.score(producer.generate(None, records, jax.random.key(0)))
        finally:
            producer.close()
    assert isinstance(episodes, learner.Episodes) and len(episodes) == 12
    episodes.check_groups(4)
    assert episodes.group_ids_b.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    assert episodes.max_len_b.tolist() == [96] * 12  # terminal.max_len: the overlong cap
    # Even rows ran the right command; odd rows forgot the folder, which fails only there.
    want = [1.0, 0.0, 1.0, 0.0] * 2 + [1.0] * 4
    assert episodes.rewards_b.tolist() == want
    assert [m["passed"] for m in episodes.meta] == [w == 1.0 for w in want]
    assert sampler.calls == [12, 12]  # every episode's turn in one batch, two turns
    for i, m in enumerate(episodes.meta):
        assert m["domain"] == "terminal" and m["turns"] == 2 and m["tool_calls"] == 1
        assert m["finish"] == "answered"
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
    assert tok.decode(record["prompt_ids"]) == g.instruction


def test_terminal_loop_config_tasks_and_demonstrations(tmp_path):
    from configs import terminal_toy
    from ptrain import metrics, terminal_loop
    config = terminal_toy.get_config("short")
    terminal_loop.check_config(config)
    bad = terminal_toy.get_config("short").unlock()
    bad.rl.staleness = 1
    with pytest.raises(ValueError, match="staleness"):
        terminal_loop.check_config(bad)
    bad = terminal_toy.get_config("short").unlock()
    bad.terminal.n_tasks = 3
    with pytest.raises(ValueError, match="unknown keys \\['n_tasks'\\]"):
        terminal_loop.check_config(bad)
    tok = terminal_tasks.tokenizer()
    resolved = terminal_loop.resolve(config, str(tmp_path), tok)
    assert resolved.model.vocab_size == tok.vocab_size
    assert resolved.sampling.stop_token_ids == (tok.eos_token_id,)
    train, held = terminal_loop.make_tasks(resolved, tok, str(tmp_path))
    assert len(train) == config.terminal.n_train and len(held) == config.terminal.n_heldout
    records = metrics.read_jsonl(resolved.data.sources[0][0])
    assert [r["task_dir"] for r in records] == [g.task_dir for g in train]
    demos = metrics.read_jsonl(resolved.sft.sources[0])
    assert len(demos) == len(train)
    longest = max(len(d["completion_ids"]) for d in demos)
    assert longest <= config.sft.max_completion_len and longest <= config.terminal.max_len
    assert max(len(d["prompt_ids"]) for d in demos) <= config.data.max_prompt_len
    rc = terminal_loop.rollout_config(resolved)
    assert rc.system == "" and rc.num_samples == config.sampling.num_samples
