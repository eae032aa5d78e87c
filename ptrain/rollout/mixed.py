"""One RL batch from several producers: records routed by kind, episodes packed together.

    producer = MixedProducer({"prompts": single_turn, "tasks": task_producer},
                             route=lambda r: "tasks" if isinstance(r, Task) else "prompts")
    learner.train(config, workdir, producer=producer, ...)

The learner draws one batch of records from its weighted mixture of sources (each
environment's tasks with its weight); `route(record)` names the producer of each (e.g.
single-turn prompt records to `rollout.SingleTurn`, tasks to `rollout.Tasks`, which runs
every environment's episodes itself); `generate` hands each producer its records (in the
order given) and `score` packs what they return into one `batch.Batch`: rows padded to the
widest continuation, group ids made unique (each producer numbers its groups from 0), the
meta (with each row's domain, for the per-domain metrics), the recorded MoE routing
(`routing.concat`) and each row's cap (`Batch.max_len_b`: the DAPO overlong penalty measures
each row against its own producer's cap) kept, and with rl.interrupt each token's policy
version (`Batch.versions_bn`, UNSAMPLED on the padding). GRPO groups stay whole: a producer
returns its records' groups as consecutive rows. With many processes a producer runs on
every process when any process has records for it (its episodes' sampler calls span the
processes), so the parts, and the batch's width, are the same everywhere.

With rl.interrupt `generate` hands every producer the same `interrupt.Live`: the parts are
generated one after the other, and a part starts from the newest version the ones before it
switched to (a swap advances the Live), so the batch's versions never go back.
"""

from __future__ import annotations

import jax
import numpy as np

from ptrain import batch as batch_lib
from ptrain import routing
from ptrain import sharding
from ptrain.generate import interrupt


def domain(record) -> str:
    """The environment a record is of: its `domain` (a `ptrain.tasks.Task`'s, an environment's
    own task's, or a record dict's)."""
    return record["domain"] if isinstance(record, dict) else record.domain


def by_domain(producer_of: dict):
    """A route: each record to the producer that runs its environment (`producer_of`: env
    name -> producer name)."""
    return lambda record: producer_of[domain(record)]


class MixedProducer:
    def __init__(self, producers: dict, route, pad_id: int = 0):
        self.producers, self.route, self.pad_id = dict(producers), route, pad_id

    def generate(self, params, records, key):
        routed = {name: [] for name in self.producers}
        for r in records:
            name = self.route(r)
            if name not in routed:
                raise ValueError(f"record routed to {name!r}, which is not one of the "
                                 f"producers {sorted(self.producers)}: {sorted(r)[:6]}")
            routed[name].append(r)
        # Each producer that has records on any process runs on every process (maybe with
        # none of this one's): its sampler calls span the processes.
        run = sharding.agree(np.array([bool(rs) for rs in routed.values()]), "any")
        return [(name, self.producers[name].generate(params, rs, jax.random.fold_in(key, i)))
                for i, ((name, rs), go) in enumerate(zip(routed.items(), run)) if go]

    def score(self, generated) -> batch_lib.Batch:
        return concat([self.producers[name].score(g) for name, g in generated],
                      pad_id=self.pad_id)


def concat(parts, *, pad_id: int = 0) -> batch_lib.Batch:
    """The rows of several batches in one (see the module docstring)."""
    if not parts:
        raise ValueError("no episodes to concatenate")
    p = {e.prompt_bp.shape[1] for e in parts}
    if len(p) > 1:
        raise ValueError(f"the producers pad prompts to different widths {sorted(p)}; give "
                         "them the same prompt_len (data.max_prompt_len)")
    n = max(e.tokens_bn.shape[1] for e in parts)

    def widen(x, fill):
        return np.pad(x, ((0, 0), (0, n - x.shape[1])), constant_values=fill)
    offset, group_ids = 0, []
    for e in parts:
        ids = np.asarray(e.group_ids_b)
        _, dense = np.unique(ids, return_inverse=True)  # 0..k-1 in order of id
        group_ids.append(dense + offset)
        offset += int(dense.max()) + 1 if len(dense) else 0
    capped = any(e.max_len_b is not None for e in parts)  # 0 in a row: the config's cap
    return batch_lib.Batch(
        prompt_bp=np.concatenate([e.prompt_bp for e in parts]),
        prompt_lens_b=np.concatenate([e.prompt_lens_b for e in parts]),
        tokens_bn=np.concatenate([widen(e.tokens_bn, pad_id) for e in parts]),
        lengths_b=np.concatenate([e.lengths_b for e in parts]),
        loss_mask_bn=np.concatenate([widen(e.loss_mask_bn, 0.0) for e in parts]),
        rollout_logp_bn=np.concatenate([widen(e.rollout_logp_bn, 0.0) for e in parts]),
        rewards_b=np.concatenate([e.rewards_b for e in parts]),
        group_ids_b=np.concatenate(group_ids).astype(np.int32),
        meta=[m for e in parts for m in (e.meta or [{} for _ in range(len(e))])],
        max_len_b=np.concatenate([np.zeros(len(e), np.int32) if e.max_len_b is None
                                  else e.max_len_b for e in parts]) if capped else None,
        versions_bn=_versions(parts, widen), **routing.concat(parts, n))


def _versions(parts, widen):
    """rl.interrupt: the parts' per-token versions in one array (None when no part has
    them; a part without them among parts with them is an error: its tokens' versions are
    unknown, and the look-ahead would train them as if they were of the batch's start)."""
    have = [e.versions_bn is not None for e in parts]
    if not any(have):
        return None
    if not all(have):
        raise ValueError(f"rl.interrupt: parts {[i for i, h in enumerate(have) if not h]} of "
                         "the mixed batch carry no per-token policy versions "
                         "(Batch.versions_bn); their producers must record them")
    return np.concatenate([widen(np.asarray(e.versions_bn, np.int32), interrupt.UNSAMPLED)
                           for e in parts])
