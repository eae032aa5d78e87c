"""ptrain/mixed_producer.py: records routed to their producers by kind, the episodes packed
into one batch with whole GRPO groups, unique group ids and each row's domain."""

import jax
import numpy as np
import pytest

from ptrain import batch as batch_lib
from ptrain import learner, mixed_producer


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
        return learner.Episodes.from_rows(
            [[1, 2 + r["i"]] for r, _ in rows],
            [[7] * (self.width - k) for _, k in rows],
            [[1] * (self.width - k) for _, k in rows],
            [[-0.5] * (self.width - k) for _, k in rows],
            [r["i"] / 10 for r, _ in rows],
            [j // self.g for j in range(n)], prompt_len=4, length=self.width,
            meta=[{"domain": self.domain, "passed": r["i"] % 2 == 0} for r, _ in rows])


def test_records_are_routed_and_episodes_packed_with_whole_groups():
    term, tasks = Fake("terminal", 6), Fake("code", 3)
    mixed = mixed_producer.MixedProducer({"terminal": term, "tasks": tasks})
    records = [{"task_dir": "/t/a", "i": 0}, {"id": "x", "i": 1}, {"task_dir": "/t/b", "i": 2},
               {"id": "y", "i": 3}, {"id": "z", "i": 4}]
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
    mixed = mixed_producer.MixedProducer({"terminal": term, "tasks": Fake("code", 4)})
    episodes = mixed.score(mixed.generate(None, [{"task_dir": "a", "i": 1}], jax.random.key(0)))
    assert len(episodes) == 2 and episodes.group_ids_b.tolist() == [0, 0]
    only = mixed_producer.MixedProducer({"tasks": Fake("code", 4)})
    with pytest.raises(ValueError, match="routed to 'terminal'"):
        only.generate(None, [{"task_dir": "a", "i": 1}], jax.random.key(0))
    wide = Fake("code", 4)
    wide.score = lambda records: learner.Episodes.from_rows(
        [[1]], [[2]], [[1]], [[0.0]], [0.0], [0], prompt_len=8, length=4)
    with pytest.raises(ValueError, match="prompt_len"):
        mixed_producer.concat([term.score([{"i": 0}]), wide.score(None)])
