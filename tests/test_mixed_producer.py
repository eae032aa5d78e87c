"""ptrain/rollout/mixed.py: records routed to their producers by environment, the episodes packed
into one batch with whole GRPO groups, unique group ids and each row's domain."""

import jax
import numpy as np
import pytest

from ptrain import batch as batch_lib
from ptrain import learner
from ptrain.rollout import mixed as mixed_producer


class Fake:
    """A producer whose rows continue each record's prompt with `width` tokens (G rows per
    record, reward = the record's index / 10), numbering its groups from 0."""

    def __init__(self, domain, width, group_size=2):
        self.domain, self.width, self.g, self.seen = domain, width, group_size, []

    def generate(self, params, records, key):
        self.seen.append([r["i"] for r in records])
        return records

    def score(self, records):
        rows = [(r, k) for r in records for k in range(self.g)]
        n = len(rows)
        return learner.Batch.from_rows(
            [[1, 2 + r["i"]] for r, _ in rows],
            [[7] * (self.width - k) for _, k in rows],
            [[1] * (self.width - k) for _, k in rows],
            [[-0.5] * (self.width - k) for _, k in rows],
            [r["i"] / 10 for r, _ in rows],
            [j // self.g for j in range(n)], prompt_len=4, length=self.width,
            meta=[{"domain": self.domain, "passed": r["i"] % 2 == 0} for r, _ in rows])


ROUTE = mixed_producer.by_domain({"terminal": "terminal", "code": "tasks", "arith": "tasks"})


def test_records_are_routed_and_episodes_packed_with_whole_groups():
    term, tasks = Fake("terminal", 6), Fake("code", 3)
    mixed = mixed_producer.MixedProducer({"terminal": term, "tasks": tasks}, route=ROUTE)
    records = [{"task_dir": "/t/a", "domain": "terminal", "i": 0},
               {"id": "x", "domain": "code", "i": 1},
               {"task_dir": "/t/b", "domain": "terminal", "i": 2},
               {"id": "y", "domain": "arith", "i": 3}, {"id": "z", "domain": "code", "i": 4}]
    episodes = mixed.score(mixed.generate(None, records, jax.random.key(0)))
    assert term.seen == [[0, 2]] and tasks.seen == [[1, 3, 4]]
    assert len(episodes) == 10 and episodes.tokens_bn.shape == (10, 6)
    episodes.check_groups(2)
    assert episodes.group_ids_b.tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert episodes.rewards_b.tolist() == pytest.approx([0, 0, .2, .2, .1, .1, .3, .3, .4, .4])
    # a narrower producer's rows are padded with pad tokens and a zero loss mask
    assert episodes.lengths_b.tolist() == [6, 5, 6, 5, 3, 2, 3, 2, 3, 2]
    assert np.all(episodes.loss_mask_bn[4:, 3:] == 0) and np.all(episodes.tokens_bn[4:, 3:] == 0)
    assert episodes.loss_mask_bn.sum() == episodes.lengths_b.sum()
    metrics = batch_lib.domain_metrics(episodes)
    assert metrics["reward/terminal/mean"] == pytest.approx(0.1)
    assert metrics["reward/code/mean"] == pytest.approx((0.1 + 0.3 + 0.4) / 3)
    assert metrics["episode/code/passed"] == pytest.approx(1 / 3)


def test_a_batch_of_one_kind_and_an_unknown_route():
    term = Fake("terminal", 4)
    mixed = mixed_producer.MixedProducer({"terminal": term, "tasks": Fake("code", 4)},
                                         route=ROUTE)
    record = {"task_dir": "a", "domain": "terminal", "i": 1}
    episodes = mixed.score(mixed.generate(None, [record], jax.random.key(0)))
    assert len(episodes) == 2 and episodes.group_ids_b.tolist() == [0, 0]
    only = mixed_producer.MixedProducer({"tasks": Fake("code", 4)}, route=ROUTE)
    with pytest.raises(ValueError, match="routed to 'terminal'"):
        only.generate(None, [record], jax.random.key(0))
    wide = Fake("code", 4)
    wide.score = lambda records: learner.Batch.from_rows(
        [[1]], [[2]], [[1]], [[0.0]], [0.0], [0], prompt_len=8, length=4)
    with pytest.raises(ValueError, match="prompt_len"):
        mixed_producer.concat([term.score([{"i": 0}]), wide.score(None)])


def _dapo_overlong(length, *, max_len, buffer, factor=1.0):
    """R_length of the DAPO paper (arXiv 2503.14476, eq. 13), times the penalty factor."""
    if length <= max_len - buffer:
        return 0.0
    return factor * ((max_len - buffer) - length) / buffer if length <= max_len else -factor


def test_each_producers_cap_counts_for_its_own_episodes():
    """A batch mixed from `rollout.Tasks` (episodes capped at rollout.max_len = 72) and a
    terminal-style producer (terminal.max_len = 96): the DAPO overlong penalty measures each
    row against its own producer's cap (one cap for all would punish the 64-token task
    episode against 96 not at all, and refuse the 88-token terminal one against 72), and
    dapo.filter_overlong masks the rows cut at their own cap."""
    from ptrain import closed_loop, rewards, rollout, tasks
    from ptrain.envs.synthetic import WordTokenizer
    config = closed_loop.defaults()
    config.update_from_flattened_dict({
        "data.prompts_per_step": 2, "sampling.num_samples": 2, "sampling.max_new_tokens": 16,
        "rollout.max_len": 72, "dapo.overlong_buffer": 16, "dapo.filter_overlong": True,
        "data.max_prompt_len": 4})
    closed_loop.check_config(config)
    task = tasks.Task("t", "arith", tasks.Answer("42", numeric=True), prompt="arith: 6 * 7")
    episodes = []
    for n, finish in ((72, "max_len"), (64, "answered")):
        e = rollout.Episode(task=task, group_id=0, tokens=[1, 2, 3] + [5] * n,
                            mask=[0] * 3 + [1] * n, logp=[0.0] * (3 + n), prompt_len=3,
                            answers=["answer: 42"], finish=finish)
        e.verdicts.append(rewards.verify(task, e.answers[0]))
        episodes.append(e)
    producer = rollout.Tasks(None, WordTokenizer.for_tasks(), config, None)
    task_rows = producer.score(episodes)
    with pytest.raises(TypeError, match="takes ptrain.tasks.Task objects.* got str"):
        producer.generate(None, ["arith: 6 * 7"], jax.random.key(0))  # neither Task nor record
    assert task_rows.max_len_b.tolist() == [72, 72]
    terminal_rows = learner.Batch.from_rows(
        [[1, 2]] * 2, [[7] * 96, [7] * 88], [[1] * 96, [1] * 88], [[0.0] * 96, [0.0] * 88],
        [0.0, 0.0], [0, 0], prompt_len=4, length=96, max_len=96,
        meta=[{"domain": "terminal", "finish": "max_len"}, {"domain": "terminal",
                                                             "finish": "answered"}])
    mixed = mixed_producer.concat([terminal_rows, task_rows])
    assert mixed.max_len_b.tolist() == [96, 96, 72, 72] and mixed.tokens_bn.shape == (4, 96)
    before = mixed.loss_mask_bn.copy()
    collector = batch_lib.Collector(config)  # the learner's collection of one producer call
    collector.add(mixed)
    out, metrics = collector.result()
    expected = [r + _dapo_overlong(n, max_len=cap, buffer=16) for r, n, cap in
                zip([0.0, 0.0, 1.0, 1.0], [96, 88, 72, 64], [96, 96, 72, 72])]
    assert expected == [-1.0, -0.5, 0.0, 0.5]
    np.testing.assert_allclose(out.rewards_b, expected, rtol=1e-6)
    np.testing.assert_array_equal(out.loss_mask_bn, before * np.array([[0], [1], [0], [1]]))
    assert metrics["dapo/filtered_overlong"] == 0.5
    assert "max_len_b" not in out.arrays()  # host-only, as meta

    # A producer that sets no cap: its rows are measured against the config's (72).
    plain = learner.Batch.from_rows([[1, 2]] * 2, [[7] * 64] * 2, [[1] * 64] * 2,
                                       [[0.0] * 64] * 2, [0.0, 0.0], [0, 0], prompt_len=4,
                                       length=64)
    mixed = mixed_producer.concat([plain, terminal_rows])
    assert mixed.max_len_b.tolist() == [0, 0, 96, 96]
    np.testing.assert_allclose(batch_lib.overlong_penalty(mixed, config), [-0.5, -0.5, -1, -0.5])
    with pytest.raises(ValueError, match="more than its cap max_len=8"):
        learner.Batch.from_rows([[1]], [[2] * 9], [[1] * 9], [[0.0] * 9], [0.0], [0],
                                   prompt_len=4, length=16, max_len=8)


def test_each_parts_token_versions_are_kept_and_widened():
    """rl.interrupt: the per-token versions of each part, padded as UNSAMPLED where a
    narrower part's rows are widened; a part without versions among parts with them is an
    error (its tokens' versions are unknown), none at all is no versions."""
    from ptrain.generate import interrupt
    u = interrupt.UNSAMPLED
    wide, narrow = Fake("terminal", 4).score([{"i": 0}]), Fake("code", 2).score([{"i": 1}])
    wide.versions_bn = np.array([[3, 3, 4, 4], [3, 4, 4, u]], np.int32)
    narrow.versions_bn = np.array([[4, 4], [4, u]], np.int32)
    mixed = mixed_producer.concat([wide, narrow])
    np.testing.assert_array_equal(mixed.versions_bn, [[3, 3, 4, 4], [3, 4, 4, u],
                                                      [4, 4, u, u], [4, u, u, u]])
    np.testing.assert_array_equal(mixed.versions_bn != u, mixed.loss_mask_bn > 0)
    assert "versions_bn" not in mixed.arrays()  # host-only
    plain = Fake("code", 2).score([{"i": 2}])
    with pytest.raises(ValueError, match=r"parts \[1\] .* no per-token policy versions"):
        mixed_producer.concat([wide, plain])
    assert mixed_producer.concat([plain, Fake("code", 3).score([{"i": 3}])]).versions_bn is None
