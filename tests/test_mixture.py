"""ptrain/mixture.py: the RL step's adaptive draw over environments (host only, no JAX):
weights follow learning progress, the pass-rate band and the task filter, the draw resumes
exactly, the processes draw one global batch, and the learner's default stays the static
grain mixture (`data.prompt_batches`)."""

import json
import types

import ml_collections
import numpy as np
import pytest

from ptrain import config as config_lib
from ptrain import data as data_lib
from ptrain import mixture, prompt_streams
from ptrain.envs import adaptive as adaptive_lib


def _records(domain, n=6):
    return [{"domain": domain, "id": j, "prompt_ids": [1, 2 + j]} for j in range(n)]


def _section(**change):
    section = ml_collections.ConfigDict(adaptive_lib.section_defaults())
    section.update(change)
    return section


def _draw(section, *, lag=0, batch_size=8, index=0, count=1, names=("a", "b")):
    return mixture.AdaptiveDraw([(_records(n), 1.0) for n in names], section=section,
                                batch_size=batch_size, seed=3, lag=lag,
                                process_index=index, process_count=count)


def _episodes(records, passed):
    """A global batch of 2 samples per record, the rows' meta as the producers write it;
    `passed(record) -> (pass of sample 0, pass of sample 1)`."""
    meta, groups = [], []
    for g, r in enumerate(records):
        for p in passed(r):
            meta.append({"domain": r["domain"], "task_id": r["id"], "passed": p})
            groups.append(g)
    return types.SimpleNamespace(meta=meta, rewards_b=np.array([m["passed"] for m in meta],
                                                               float),
                                 group_ids_b=np.array(groups))


def _run(draw, steps, passed, first=1):
    drawn = []
    for step in range(first, first + steps):
        draw.at(step)
        records = next(draw)
        drawn.append([(r["domain"], r["id"]) for r in records])
        draw.observe(step, _episodes(records, lambda r, s=step: passed(r, s)))
    return drawn


def test_progress_moves_the_weights_to_the_environment_whose_pass_rate_moves():
    # "a"'s pass rate rises step by step, "b"'s stays at one half: a's fast and slow EMAs
    # separate, b's stay equal (score 0), so b keeps only its share of the floor.
    draw = _draw(_section(mode="progress", floor=0.2))
    passed = lambda r, s: ((float(s > r["id"]), float(s > r["id"] + 2)) if r["domain"] == "a"
                           else (1.0, 0.0))
    drawn = _run(draw, 8, passed)
    next(draw)  # (applies the last step's observations)
    weights = draw.metrics()
    assert weights["tasks/weight/b"] == pytest.approx(0.2 * 0.5)
    assert weights["tasks/weight/a"] == pytest.approx(0.2 * 0.5 + 0.8)
    late = [d for step in drawn[3:] for d, _ in step]
    assert late.count("a") > 2 * late.count("b")


def test_band_draws_the_environment_outside_the_band_at_the_floor_only():
    draw = _draw(_section(mode="band", band=(0.2, 0.8), floor=0.2))
    _run(draw, 3, lambda r, s: (1.0, 1.0) if r["domain"] == "a" else (1.0, 0.0))
    next(draw)  # (applies the third step's observations)
    assert draw.metrics()["tasks/weight/a"] == pytest.approx(0.2 * 0.5)
    assert draw.metrics()["tasks/weight/b"] == pytest.approx(0.2 * 0.5 + 0.8)


def test_the_filter_skips_tasks_always_solved_or_never_solved():
    draw = _draw(_section(filter_patience=1))
    # Tasks 0 and 1 of each environment: every sample passes / fails; the rest in between.
    outcome = {0: (1.0, 1.0), 1: (0.0, 0.0)}
    drawn = _run(draw, 6, lambda r, s: outcome.get(r["id"], (1.0, 0.0)))
    seen = {(d, t) for d, t in drawn[0]}
    assert {("a", 0), ("a", 1)} <= seen or {("b", 0), ("b", 1)} <= seen  # (drawn first)
    later = {t for step in drawn[2:] for _, t in step}
    assert later and not later & {0, 1} and draw.metrics()["tasks/skipped"] == 4
    assert draw.filter.skipped() == {"a/0": "solved", "a/1": "unsolved",
                                     "b/0": "solved", "b/1": "unsolved"}


def _lookahead(draw, passed, *, lag, first, last, saves):
    """The learner's schedule: at step t the batch of t + lag is drawn (a run's first step
    also draws first .. first + lag - 1), then batch t is observed; a checkpoint of t saves
    the state taken before batch t + 1 was drawn, completed (`saves`, filled)."""
    pending, trained = {}, []

    def draw_batch(s):
        draw.at(s)
        state = draw.get_state()
        pending[s] = (state, next(draw))

    for s in range(first, min(first + lag, last + 1)):
        draw_batch(s)
    for t in range(first, last + 1):
        if t + lag <= last:
            draw_batch(t + lag)
        _, records = pending.pop(t)
        trained.append([(r["domain"], r["id"]) for r in records])
        taken = pending[t + 1][0] if lag and t + 1 in pending else draw.get_state()
        draw.observe(t, _episodes(records, lambda r: passed(r, t)))
        saves[t] = json.loads(json.dumps(draw.complete(taken)))  # (as the checkpoint's JSON)
    return trained


def test_every_producer_call_of_a_step_is_observed():
    # With DAPO dynamic sampling a step makes several calls and keeps only informative
    # groups; the draw observes them all (`batch.Collector.added`), the all-pass ones too.
    draw = _draw(_section(filter_patience=1))
    solved = _episodes(_records("a", 1), lambda r: (1.0, 1.0))
    mixed = _episodes(_records("b", 1), lambda r: (1.0, 0.0))
    mixed.group_ids_b = mixed.group_ids_b + 1  # (unique across the step's calls)
    draw.observe(1, [solved, mixed])
    draw.at(2)
    next(draw)
    assert draw.filter.skipped() == {"a/0": "solved"}
    assert draw.adaptive.state()["count"] == [1, 1]


@pytest.mark.parametrize("lag", [0, 2])
def test_a_restored_draw_continues_as_the_uninterrupted_one(lag):
    passed = lambda r, s: (float((r["id"] + s) % 3 == 0), float(r["domain"] == "a" and s > 2))
    section = _section(mode="progress", filter_patience=2)
    saves = {}
    whole = _lookahead(_draw(section, lag=lag), passed, lag=lag, first=1, last=9, saves=saves)
    resumed = _draw(section, lag=lag).iterator(saves[5])
    assert _lookahead(resumed, passed, lag=lag, first=6, last=9, saves={}) == whole[5:]
    # (and the observations mattered: a draw that never observes draws otherwise)
    blind = _draw(section, lag=lag)
    assert [[(r["domain"], r["id"]) for r in next(blind)] for _ in range(9)][5:] != whole[5:]


def test_each_environment_is_read_once_per_epoch_in_a_new_order():
    draw = _draw(_section(mode="band"), batch_size=6, names=("a",))
    epochs = [[r["id"] for r in next(draw)] for _ in range(3)]
    assert all(sorted(e) == list(range(6)) for e in epochs) and len(set(map(tuple, epochs))) > 1


def test_processes_draw_one_global_batch_and_each_takes_its_block():
    section = _section(mode="progress")
    one = next(_draw(section, batch_size=8))
    blocks = [next(_draw(section, batch_size=4, index=i, count=2)) for i in range(2)]
    assert blocks[0] + blocks[1] == one


def test_disabled_is_the_static_grain_mixture(tmp_path):
    c = config_lib.defaults()
    c.data.prompts_per_step, c.seed = 4, 5
    sources = [(_records("a"), 1.0), (_records("b"), 3.0)]
    for adaptive in (None, _section()):
        prompts = prompt_streams.step_prompts(c, str(tmp_path), sources=sources, adaptive=adaptive)
        today = data_lib.prompt_batches(sources, batch_size=4, seed=5, process_index=0,
                                        process_count=1)
        ours, theirs = prompts.iterator(), today.iterator()
        assert [next(ours) for _ in range(5)] == [next(theirs) for _ in range(5)]
    assert isinstance(prompt_streams.step_prompts(c, str(tmp_path), sources=sources,
                                           adaptive=_section(mode="band")),
                      mixture.AdaptiveDraw)


def test_bad_sources_are_errors_before_the_draw():
    with pytest.raises(ValueError, match="records of one `domain`"):
        mixture.AdaptiveDraw([(_records("a") + _records("b"), 1.0)], section=_section(
            mode="band"), batch_size=2, seed=0)
    draw = _draw(_section(mode="band"))
    with pytest.raises(ValueError, match="domain 'c'"):
        draw.observe(1, _episodes(_records("c", 1), lambda r: (1.0, 1.0)))
    with pytest.raises(ValueError, match="resume with the same environments"):
        _draw(_section(mode="band"), names=("a",)).iterator(draw.get_state())
