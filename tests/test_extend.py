"""Runs extend and resume as users expect (ptrain.run_record, ptrain.lookahead): a finished run
given more steps goes on at every staleness, a changed setting on resume is either allowed and
logged or refused with the reason, and a refused resume leaves the work dir as it was."""

import logging
import os
import shutil

import jax
import pytest

from configs import grpo_toy
from ptrain import checkpoint, closed_loop, metrics, run_record, sharding

pytestmark = pytest.mark.xdist_group("learner")


def _config(steps, staleness, **changes):
    c = grpo_toy.get_config()
    c.update_from_flattened_dict({
        "steps": steps, "rl.staleness": staleness, "data.prompts_per_step": 2,
        "sampling.num_samples": 2, "sampling.max_new_tokens": 4, "rl.num_minibatches": 1,
        "rl.microbatch_size": 0, "model.n_layers": 1, "mesh.fsdp": 1, "checkpoint.every": 100,
        "log.rollouts_every": 100, **changes})
    return c


def _run(config, workdir):
    mesh = sharding.make_mesh(fsdp=1, devices=jax.devices()[:1])
    closed_loop.run(config, workdir, mesh=mesh)
    return [r["step"] for r in metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))]


@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_a_finished_run_extended_to_more_steps_goes_on(tmp_path, staleness, caplog):
    workdir = str(tmp_path / "run")
    assert _run(_config(2, staleness), workdir) == [1, 2]
    rollouts = metrics.read_jsonl(os.path.join(workdir, "rollouts.jsonl"))
    assert {r["step"] for r in rollouts} == {1}  # the first step's, before log.rollouts_every
    assert checkpoint.Checkpointer(os.path.join(workdir, "checkpoints")).aux_keys() == {}
    with caplog.at_level(logging.WARNING, logger="ptrain.run_record"):
        assert _run(_config(4, staleness, **{"optim.lr": 5e-3}), workdir) == [1, 2, 3, 4]
    logged = caplog.text
    assert "steps changed: 2 -> 4" in logged and "optim.lr changed: 0.01 -> 0.005" in logged
    rows = metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
    if staleness:  # the extension's batches come from the restored (step 2) parameters
        assert rows[2]["rollout/staleness"] == 0
        assert rows[3]["rollout/staleness"] == min(1, staleness)
    assert metrics.read_run_config(workdir).steps == 4


@pytest.fixture(scope="module")
def one_step_run(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("one") / "run")
    _run(_config(1, 0), workdir)
    return workdir


@pytest.mark.parametrize("key, value, reason", [
    ("sampling.num_samples", 4, "the batch's shape"),
    ("rl.estimator", "rloo", "the algorithm"),
    ("rl.staleness", 1, "pending batches"),
    ("model.d_model", 64, "parameter shapes"),
])
def test_a_refused_change_on_resume_names_it_and_changes_nothing(one_step_run, tmp_path, key,
                                                                 value, reason):
    workdir = str(tmp_path / "run")
    shutil.copytree(one_step_run, workdir)
    before = {name: open(os.path.join(workdir, name)).read()
              for name in (metrics.CONFIG_FILE, metrics.COMMAND_FILE, "metrics.jsonl")}
    with pytest.raises(ValueError) as e:
        closed_loop.run(_config(2, 0, **{key: value}), workdir)
    assert key in str(e.value) and reason in str(e.value) and "new --workdir" in str(e.value)
    assert before == {name: open(os.path.join(workdir, name)).read() for name in before}


def test_the_table_of_what_may_change():
    for key in ("optim.lr", "steps", "log.every", "checkpoint.every", "eval.n", "mesh.fsdp",
                "model.remat", "model.attention_impl", "sampling.temperature", "sft.steps"):
        assert run_record.refusal(key) is None, key
    for key in ("model.n_layers", "hf_model", "seed", "rl.loss", "data.prompts_per_step",
                "tasks.envs", "sft.batch_size"):
        assert run_record.refusal(key), key
    assert run_record.changes({"a": {"b": 1, "c": 2}}, {"a": {"b": 1, "c": 3}, "d": 0}) == [
        ("a.c", 2, 3), ("d", None, 0)]
