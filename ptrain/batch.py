"""A batch of finished episodes, and how a step's batch is collected.

  Batch        host-side numpy rows: G consecutive rows per group, each its group's prompt
               and the row's continuation, with loss mask, sampler log-probs, reward and
               group id; `from_rows` / `from_histories` pack per-row lists
  Collector    the step's batch from the producer calls the learner makes: the DAPO
               overlong penalty, dynamic sampling (groups whose rewards are all equal are
               dropped and the learner asked for more calls, up to a cap) and group filling;
               its metrics (rewards, lengths, per-domain means)

Everything here is numpy on the host; the device programs are `ptrain.step`'s.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ptrain import alerts, losses, sharding
from ptrain import config as config_lib


# ===================================================================================== Batch


@dataclasses.dataclass
class Batch:
    """A batch of finished episodes on the host (numpy): one row per sample, G rows per group

    A row is its group's prompt (left-padded to a fixed width, identical for the G rows of a
    group, which are consecutive) and the row's continuation: everything after the prompt
    (model turns and, in multi-turn episodes, tool observations), right-padded. Per-token
    arrays are aligned with `tokens_bn`: column j describes continuation token j, whose
    log-prob is that of the token given everything before it. `loss_mask_bn` is 1 only on
    tokens the model produced and is trained on (never on observations or padding).

    The learner runs each group's prompt once and continues it G times through the KV cache,
    as the sampler does, so a long prompt costs one forward and one backward per group.
    `meta` is host-only (texts, feedback, domain) and never goes to the device. A mixture-of-
    experts producer may add the sampler's routing (`Samples.experts`, `prompt_experts`, one
    prompt's per row), which the learner replays with rl.router_replay.

    `max_len_b` (host-only too) is the cap each row's episode had on its tokens after the
    prompt, set by a producer whose episodes have their own (rollout.max_len for `Tasks`,
    terminal.max_len for terminal episodes): the DAPO overlong penalty measures each row
    against its own cap, so a batch mixed from several producers keeps each one's (None, or
    0 in a row: the config's cap, `config.overlong_max_len`).
    """

    prompt_bp: np.ndarray  # int32 [b, p]: the group's prompt, left-padded
    prompt_lens_b: np.ndarray  # int32 [b]
    tokens_bn: np.ndarray  # int32 [b, n]: the continuation, right-padded
    lengths_b: np.ndarray  # int32 [b]: tokens in the continuation
    loss_mask_bn: np.ndarray  # float32 [b, n]
    rollout_logp_bn: np.ndarray  # float32 [b, n]: the sampler's, of logits / temperature
    rewards_b: np.ndarray  # float32 [b]
    group_ids_b: np.ndarray  # int32 [b]
    meta: list = dataclasses.field(default_factory=list)  # one dict per row
    experts_bnlk: np.ndarray | None = None  # int [b, n, MoE layers, k]: each token's experts
    prompt_experts_bplk: np.ndarray | None = None  # int [b, p, MoE layers, k]: the prompt's
    max_len_b: np.ndarray | None = None  # int32 [b]: the row's episode's cap (0: the config's)
    # rl.interrupt: the policy version that sampled each continuation token, int32 [b, n]
    # (ptrain.generate.interrupt.UNSAMPLED on observations and padding); host-only
    versions_bn: np.ndarray | None = None
    # A vision-language batch's prompt images, each row its group's (`ptrain.vision.prompts.
    # with_images`; `ptrain.vision.vl.learner_inputs` reads them): the patches padded to the
    # run's patch budget, their rotary rows / columns, frame and window segments, where each
    # merged feature goes in the prompt, the prompt's M-RoPE positions and the rope delta.
    vision_patches_bnf: np.ndarray | None = None
    vision_rope_hw_bn2: np.ndarray | None = None
    vision_full_seg_bn: np.ndarray | None = None
    vision_window_seg_bn: np.ndarray | None = None
    vision_dest_bm: np.ndarray | None = None
    vision_rope_b3p: np.ndarray | None = None
    vision_delta_b: np.ndarray | None = None
    # Images a row's continuation holds (tool observations of multi-turn episodes, each row
    # its own; `ptrain.rollout.images.attach`): patches padded to the run's observation patch
    # budget, their layout, where each merged feature goes in the continuation, and the
    # continuation's M-RoPE positions [b, 3, n].
    vision_obs_patches_bnf: np.ndarray | None = None
    vision_obs_rope_hw_bn2: np.ndarray | None = None
    vision_obs_full_seg_bn: np.ndarray | None = None
    vision_obs_window_seg_bn: np.ndarray | None = None
    vision_obs_dest_bm: np.ndarray | None = None
    vision_rope_b3n: np.ndarray | None = None

    @classmethod
    def from_rows(cls, prompts, continuations, loss_masks, rollout_logps, rewards, group_ids,
                  *, prompt_len, length, meta=None, pad_id=0, max_len=None) -> Batch:
        """Packs per-row lists (prompt ids; continuation ids with one 0/1 loss-mask value and
        one log-prob each) into arrays of `prompt_len` and `length` columns. `max_len`: the
        cap the episodes had (`max_len_b`; default: the config's applies)."""
        b = len(prompts)
        out = cls(prompt_bp=np.full((b, prompt_len), pad_id, np.int32),
                  prompt_lens_b=np.zeros(b, np.int32),
                  tokens_bn=np.full((b, length), pad_id, np.int32),
                  lengths_b=np.zeros(b, np.int32),
                  loss_mask_bn=np.zeros((b, length), np.float32),
                  rollout_logp_bn=np.zeros((b, length), np.float32),
                  rewards_b=np.asarray(rewards, np.float32).reshape(b),
                  group_ids_b=np.asarray(group_ids, np.int32).reshape(b),
                  meta=list(meta) if meta is not None else [{} for _ in range(b)],
                  max_len_b=None if max_len is None else np.full(b, max_len, np.int32))
        rows = zip(prompts, continuations, loss_masks, rollout_logps)
        for i, (prompt, tok, mask, logp) in enumerate(rows):
            p, n = len(prompt), len(tok)
            if not 0 < p <= prompt_len:
                raise ValueError(f"episode {i}: its prompt has {p} tokens; it needs 1 to "
                                 f"prompt_len={prompt_len}")
            if n > length:
                raise ValueError(f"episode {i} continues its prompt with {n} tokens, more than "
                                 f"the length {length}; raise the cap or cut the episode")
            if max_len is not None and n > max_len:
                raise ValueError(f"episode {i} continues its prompt with {n} tokens, more than "
                                 f"its cap max_len={max_len}")
            if len(mask) != n or len(logp) != n:
                raise ValueError(f"episode {i}: {n} tokens but {len(mask)} mask values and "
                                 f"{len(logp)} log-probs; give one per token")
            out.prompt_bp[i, prompt_len - p:], out.prompt_lens_b[i] = prompt, p
            out.tokens_bn[i, :n], out.lengths_b[i] = tok, n
            out.loss_mask_bn[i, :n], out.rollout_logp_bn[i, :n] = mask, logp
        return out

    @classmethod
    def from_histories(cls, tokens, loss_masks, rollout_logps, rewards, group_ids, *,
                       prompt_lens, prompt_len, length, meta=None, pad_id=0,
                       max_len=None) -> Batch:
        """Like `from_rows`, from whole histories (prompt included): row i's first
        prompt_lens[i] tokens are its prompt, the rest its continuation."""
        split = [(list(t[:p]), list(t[p:]), list(m[p:]), list(lp[p:]))
                 for t, m, lp, p in zip(tokens, loss_masks, rollout_logps, prompt_lens)]
        for i, (t, m, p) in enumerate(zip(tokens, loss_masks, prompt_lens)):
            if any(m[:p]):
                raise ValueError(f"episode {i}: its loss mask is 1 inside the prompt (the "
                                 f"first {p} tokens); prompt tokens are never trained on")
        prompts, continuations, masks, logps = zip(*split) if split else ((),) * 4
        return cls.from_rows(prompts, continuations, masks, logps, rewards, group_ids,
                             prompt_len=prompt_len, length=length, meta=meta, pad_id=pad_id,
                             max_len=max_len)

    def __len__(self):
        return len(self.tokens_bn)

    def columns(self) -> dict[str, Any]:
        """The fields that are set (the routing ones are None unless recorded)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) is not None}

    def arrays(self) -> dict[str, np.ndarray]:
        """What goes to the device."""
        return {k: v for k, v in self.columns().items() if k not in HOST_ONLY}

    def check_groups(self, group_size: int) -> None:
        """Groups must be G consecutive rows with one id and one prompt."""
        b = len(self)
        if b % group_size:
            raise ValueError(f"{b} episodes do not form groups of {group_size}")
        for name, what in (("group_ids_b", "group id"), ("prompt_bp", "prompt")):
            x = getattr(self, name).reshape((b // group_size, group_size, -1))
            if not (x == x[:, :1]).all():
                raise ValueError(f"episodes: the {group_size} consecutive rows of a group must "
                                 f"share their {what}; keep each prompt's samples together")


HOST_ONLY = ("meta", "max_len_b", "versions_bn")  # Batch fields that never go to the device


def gather(batch: Batch, mesh=None) -> Batch:
    """The global batch, the same on every process, from each process's own rows (the
    rows of its block, `sharding.row_block`, scored where they were generated): blocks in
    order, group ids made distinct across blocks (block k's shifted past block k-1's). With
    one process, or rows replicated over processes, the batch itself."""
    blocks = sharding.gather_blocks(batch, mesh)
    if len(blocks) == 1:
        return blocks[0]
    shift = max(int(b.group_ids_b.max(initial=-1)) for b in blocks) + 1
    columns = {}
    for k, block in enumerate(blocks):
        block = dataclasses.replace(block, group_ids_b=block.group_ids_b + k * shift)
        for name, value in block.columns().items():
            columns.setdefault(name, []).append(value)
    return Batch(**{name: sum(parts, []) if name == "meta" else
                    None if parts[0] is None else np.concatenate(parts)
                    for name, parts in columns.items()})


# =================================================================================== collect


class Collector:
    """A step's batch, collected from producer calls that the learner makes (the one place of
    DAPO dynamic sampling). The learner's loop:

        collector = Collector(config, mesh=mesh)
        while collector.wants_more():
            collector.add(producer.score(producer.generate(params, next(batches),
                                                           fold_in(key, collector.calls))))
        batch, metrics = collector.result()

    Without dynamic sampling it wants one call. With it, rows of groups whose rewards are all
    equal are dropped and it wants more calls until data.prompts_per_step informative groups
    are held, up to dapo.max_gen_batches calls; a batch still short is topped up with the last
    call's dropped groups (their advantage is 0) and the count is logged.

    Each call's Batch is checked, and with many processes gathered (`gather`): each process's
    producer returns its own rows (its block of the prompts), and everything after is on the
    global batch, the same on every process: the same groups kept, the same number of calls,
    the same metrics. The DAPO overlong penalty is added to the rewards first
    (`overlong_penalty`): each episode's tokens after its prompt (`lengths_b`: model turns and
    observations) against its cap. With dapo.filter_overlong, truncated episodes
    (`truncated`: cut at their own cap) are masked out of the loss.
    """

    def __init__(self, config, *, mesh=None):
        self.config, self.mesh = config, mesh
        self.calls = 0  # producer calls added so far (the attempt index of the next one)
        self.added = []  # each call's global Batch, every group (the adaptive draw's verdicts)
        self._acc, self._full, self._rewards, self._last = None, False, [], None

    def wants_more(self) -> bool:
        """Whether the learner should draw and add another producer call."""
        c = self.config
        if not c.dapo.dynamic_sampling:
            return self.calls == 0
        return not self._full and self.calls < c.dapo.max_gen_batches

    def add(self, episodes: Batch) -> None:
        """One producer call's Batch (this process's rows)."""
        if not self.wants_more():
            raise ValueError(f"the step's batch is collected ({self.calls} producer calls); "
                             "call result()")
        episodes = _shaped(episodes, self.calls, self.config, self.mesh)
        self.calls += 1
        self.added.append(episodes)
        self._rewards.append(episodes.rewards_b)
        self._last = episodes
        if self.config.dapo.dynamic_sampling:
            keep = informative_groups(episodes.rewards_b, episodes.group_ids_b)
            self._acc, self._full = accumulate_groups(
                self._acc, episodes.columns(), keep, num_groups=self.config.data.prompts_per_step,
                group_key="group_ids_b")

    def result(self) -> tuple[Batch, dict]:
        """The step's Batch and its metrics (rewards of every call, lengths, per-domain
        means; with dynamic sampling the calls made and the groups topped up)."""
        c = self.config
        if self._last is None:
            raise ValueError("no producer call was added; add() one first")
        if not c.dapo.dynamic_sampling:
            episodes = self._last
            return _filtered(episodes, c), {**_reward_metrics(episodes.rewards_b),
                                            **_batch_metrics(episodes, c)}
        n_groups, acc, full, last = c.data.prompts_per_step, self._acc, self._full, self._last
        filler = 0
        if not full:
            before = len(set(np.asarray(acc["group_ids_b"]).tolist()))
            keep = informative_groups(last.rewards_b, last.group_ids_b)
            acc, full = accumulate_groups(acc, last.columns(), ~keep, num_groups=n_groups,
                                          group_key="group_ids_b")
            filler = len(set(np.asarray(acc["group_ids_b"]).tolist())) - before
        if not full:
            raise ValueError("dynamic sampling could not fill the batch: a rollout returned "
                             f"fewer than data.prompts_per_step={n_groups} groups")
        episodes = Batch(**acc)
        metrics = _reward_metrics(np.concatenate(self._rewards))
        metrics.update({"dapo/gen_batches": self.calls, "dapo/uninformative_groups": filler,
                        "reward/batch_mean": np.mean(acc["rewards_b"])})
        # (Filtered first: the length metrics are of the loss mask the update sees.)
        return _filtered(episodes, c), {**metrics, **_batch_metrics(episodes, c)}


def _shaped(episodes, attempt, config, mesh=None):
    """Checks a producer's Batch (this process's rows), gathers the global one (`gather`),
    adds the DAPO overlong penalty to its rewards and makes its group ids unique across the
    calls of a step."""
    c = config
    _check_type(episodes)
    episodes = gather(episodes, mesh)
    _check(episodes, c)
    if c.dapo.overlong_buffer:  # the tokens after the prompt against the episode's cap
        episodes.rewards_b = episodes.rewards_b + overlong_penalty(episodes, c)
    _, local = np.unique(episodes.group_ids_b, return_inverse=True)
    episodes.group_ids_b = (attempt * len(episodes) + local).astype(np.int32)
    return episodes


def overlong_penalty(episodes: Batch, config) -> np.ndarray:
    """DAPO's soft overlong penalty of each row (`losses.overlong_penalty`): its tokens after
    the prompt against its own episode's cap, `max_len_b` where the producer set one, else
    the config's (`config.overlong_max_len`: rollout.max_len in the closed loop, else
    dapo.overlong_max_len or sampling.max_new_tokens)."""
    caps_b = np.full(len(episodes), config_lib.overlong_max_len(config), np.int32)
    if episodes.max_len_b is not None:
        caps_b = np.where(episodes.max_len_b > 0, episodes.max_len_b, caps_b)
    out = np.zeros(len(episodes), np.float32)
    for cap in np.unique(caps_b):
        rows = caps_b == cap
        out[rows] = losses.overlong_penalty(
            episodes.lengths_b[rows], max_len=int(cap), buffer_len=config.dapo.overlong_buffer,
            penalty_factor=config.dapo.overlong_penalty)
    return out


def _filtered(episodes, config):
    """With dapo.filter_overlong (DAPO's overlong filtering), truncated episodes keep their
    tokens but get no loss (after the metrics, which describe what was generated)."""
    if config.dapo.filter_overlong:
        truncated_b = np.array([truncated(m) for m in episodes.meta], bool)
        episodes.loss_mask_bn = np.asarray(losses.filter_overlong(episodes.loss_mask_bn,
                                                                  truncated_b))
    return episodes


def _reward_metrics(rewards):
    return {"reward/mean": rewards.mean(), "reward/std": rewards.std(),
            "reward/max": rewards.max(), "reward/min": rewards.min()}


def _batch_metrics(episodes, config):
    mask = episodes.loss_mask_bn
    metrics = {"response/length_mean": mask.sum(-1).mean(),
               "response/length_max": mask.sum(-1).max()}
    if config.dapo.filter_overlong:
        metrics["dapo/filtered_overlong"] = np.mean([truncated(m) for m in episodes.meta])
    reasons = [m.get("finish_reason") for m in episodes.meta]
    if any(r is not None for r in reasons):
        metrics["response/clip_ratio"] = np.mean([r == "length" for r in reasons])
    errors = [m["error_type"] for m in episodes.meta if "error_type" in m]
    if errors:  # verdicts whose sandbox failed (timeouts, worker errors): alerts watch it
        metrics["sandbox/error_rate"] = alerts.sandbox_error_rate(errors)
    metrics.update(domain_metrics(episodes))
    return metrics


TRUNCATED = ("truncated", "max_len")  # an episode's `finish` when a cap cut it


def truncated(meta: dict) -> bool:
    """Whether a row's episode was cut at a length cap before it ended: a single turn that
    hit sampling.max_new_tokens (`finish_reason` "length"), an episode's answer cut at it or
    an episode out of room (rollout.max_len, terminal.max_len; `finish`)."""
    return meta.get("finish_reason") == "length" or meta.get("finish") in TRUNCATED


def domain_metrics(episodes: Batch) -> dict[str, float]:
    """Per-domain means when the rows' meta name a domain: reward/<domain>/mean, the numeric
    episode fields a producer reports (pass rate, turns, tool calls and errors), and each
    rubric component of the verdicts (episode/<domain>/rubric_<name>: e.g. a CAD part's
    build, iou, chamfer)."""
    fields = ("passed", "turns", "tool_calls", "tool_errors", "attempts")
    by_domain: dict[str, list[int]] = {}
    for i, meta in enumerate(episodes.meta):
        if "domain" in meta:
            by_domain.setdefault(meta["domain"], []).append(i)
    out = {}
    for domain, rows in sorted(by_domain.items()):
        out[f"reward/{domain}/mean"] = float(np.mean(episodes.rewards_b[rows]))
        for field in fields:
            values = [episodes.meta[i][field] for i in rows if field in episodes.meta[i]]
            if values:
                out[f"episode/{domain}/{field}"] = float(np.mean(values))
        parts = [episodes.meta[i].get("components") or {} for i in rows]
        for name in sorted({name for p in parts for name in p}):
            values = [p[name] for p in parts if name in p]
            out[f"episode/{domain}/rubric_{name}"] = float(np.mean(values))
    return out


def _check_type(episodes):
    if not isinstance(episodes, Batch):
        raise TypeError(f"a producer's score (or rollout_fn) must return a ptrain.batch.Batch, "
                        f"got {type(episodes).__name__}")


def _check(episodes, config):
    rows = config.data.prompts_per_step * config.sampling.num_samples
    if len(episodes) != rows:
        raise ValueError(f"a producer returned {len(episodes)} rows; the batch shape is fixed "
                         f"at data.prompts_per_step * sampling.num_samples = {rows}")


def rollout_samples(episodes: Batch, n: int) -> list[dict]:
    """The first n rows as rollouts.jsonl samples (prompt, completion, reward, feedback...)."""
    out = []
    for i in range(min(n, len(episodes))):
        meta = episodes.meta[i] if i < len(episodes.meta) else {}
        out.append({"prompt": meta.get("prompt", ""), "completion": meta.get("completion", ""),
                    **meta, "reward": float(episodes.rewards_b[i]),
                    "group": int(episodes.group_ids_b[i])})
    return out


# ============================================================ DAPO dynamic sampling (numpy)


def informative_groups(rewards_b, group_ids_b):
    """DAPO dynamic sampling: True for samples whose group's rewards are not all equal.

    verl's DAPO trainer keeps a group when the std of its rewards is > 0 or it has one
    sample. Host-side numpy; returns a bool mask [b].
    """
    r_b, g_b = np.asarray(rewards_b, np.float64), np.asarray(group_ids_b)
    keep_b = np.zeros(len(r_b), bool)
    for g in np.unique(g_b):
        in_g = g_b == g
        keep_b[in_g] = in_g.sum() == 1 or np.std(r_b[in_g]) > 0
    return keep_b


def _take(x, idx):
    return [x[i] for i in idx] if isinstance(x, list) else np.asarray(x)[idx]


def _concat(a, b):
    return a + b if isinstance(a, list) else np.concatenate([a, b])


def accumulate_groups(acc, batch, keep_b, *, num_groups, group_key="group_id"):
    """Adds the kept rows of `batch` to `acc` until it holds `num_groups` whole groups.

    batch: dict of per-sample columns (numpy arrays or lists, leading dimension b), one of
    them `group_key`. acc: None or the previous return value. Returns (acc, full); once
    full, acc is cut to the first `num_groups` groups. Group ids must be unique across
    generation batches. The decision to sample again until full, with a cap, is
    `Collector`'s.
    """
    idx = np.flatnonzero(keep_b)
    new = {k: _take(v, idx) for k, v in batch.items()}
    if acc is not None:
        clash = set(np.asarray(acc[group_key]).tolist()) & set(np.asarray(new[group_key]).tolist())
        if clash:
            raise ValueError(f"group ids {sorted(clash)[:5]} repeat across generation batches; "
                             "give every prompt of the run a distinct group id")
        new = {k: _concat(acc[k], v) for k, v in new.items()}
    groups = list(dict.fromkeys(np.asarray(new[group_key]).tolist()))
    if len(groups) < num_groups:
        return new, False
    chosen = set(groups[:num_groups])
    rows = [i for i, g in enumerate(np.asarray(new[group_key]).tolist()) if g in chosen]
    return {k: _take(v, rows) for k, v in new.items()}, True
