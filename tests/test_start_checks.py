"""A run's start: every bad value and missing input fails in the config check, naming the key
and what to do, before any model is built and before the work dir is written (ptrain.config,
ptrain.inputs, ptrain.run_record). Each case goes through `closed_loop.run`, the entry point of
launch/train.py and of a run from Python; building a model there fails the test."""

import json
import os

import pytest

from configs import byo_qwen, grpo_toy, quickstart
from ptrain import closed_loop, learner, metrics


@pytest.fixture(autouse=True)
def no_model(monkeypatch):
    """Building a model or a sampler is an error: every check must come before."""
    def built(*args, **kwargs):
        raise AssertionError("a model was built before the bad value was found")
    monkeypatch.setattr(learner, "build_model", built)
    monkeypatch.setattr(learner, "Learner", built)
    monkeypatch.setattr(closed_loop, "make_sampler", built)
    monkeypatch.setattr(closed_loop, "make_tasks", built)


def _refused(config, workdir, *needles):
    with pytest.raises(ValueError) as e:
        closed_loop.run(config, str(workdir))
    message = str(e.value)
    for needle in needles:
        assert needle in message, message
    assert not os.path.exists(os.path.join(workdir, metrics.CONFIG_FILE))
    return message


def _changed(module, *args, **changes):
    c = module.get_config(*args)
    c.update_from_flattened_dict(changes)
    return c


@pytest.mark.parametrize("key, value, needle", [
    ("data.prompts_per_step", 0, "data.prompts_per_step=0 must be a positive int"),
    ("rl.microbatch_size", -2, "rl.microbatch_size=-2 must be an int >= 0"),
    ("eval.n", 0, "eval.n=0 must be a positive int"),
    ("eval.tasks_per_call", -4, "eval.tasks_per_call=-4 must be an int >= 0 (0: every"),
    ("rl.num_minibatches", 0, "rl.num_minibatches=0 must be a positive int"),
    ("sampling.num_samples", 0, "sampling.num_samples=0 must be a positive int"),
    ("sft.batch_size", -1, "sft.batch_size=-1 must be a positive int"),
    ("checkpoint.every", 0, "checkpoint.every=0 must be a positive int"),
    ("log.rollouts_every", -1, "log.rollouts_every=-1 must be an int >= 0"),
    ("sandbox.backend", "bwarp", "sandbox.backend='bwarp': use one of"),
])
def test_a_bad_count_fails_naming_the_key(tmp_path, key, value, needle):
    _refused(_changed(quickstart, "short", **{key: value}), tmp_path / "run", needle)


def test_the_readmes_default_data_path_missing_names_the_key(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no data/ here
    config = byo_qwen.get_config("")
    message = _refused(config, tmp_path / "run", "tasks.envs[0].args.train",
                       "'data/mbpp.jsonl'", "does not exist", "--config.tasks.envs")
    assert str(tmp_path) in message  # relative to where it was looked for


def test_an_empty_training_file_fails_naming_the_key(tmp_path):
    empty, held = tmp_path / "train.jsonl", tmp_path / "held.jsonl"
    empty.write_text("\n  \n")
    held.write_text(json.dumps({"question": "1 + 1?", "answer": "#### 2"}) + "\n")
    config = quickstart.get_config("short")
    config.update_from_flattened_dict({
        "tasks.envs": (dict(env="ptrain.envs.math:gsm8k",
                            args=dict(train=str(empty), heldout=str(held))),),
        "tokenizer": str(tmp_path), "sft.steps": 0})
    message = _refused(config, tmp_path / "run", "tasks.envs[0].args.train", "is empty")
    assert repr(str(empty)) in message  # the file, as it was given


def test_an_empty_prompt_file_of_the_learner_fails_naming_the_key(tmp_path):
    (tmp_path / "prompts.jsonl").write_text("")
    config = _changed(grpo_toy, **{"data.records_fn": None,
                                   "data.sources": (str(tmp_path / "prompts.jsonl"),)})
    message = _refused(config, tmp_path / "run", "data.sources[0]", "is empty")
    assert str(tmp_path / "prompts.jsonl") in message


def test_a_work_dir_that_is_a_file_fails_naming_the_flag(tmp_path):
    path = tmp_path / "run"
    path.write_text("not a directory")
    with pytest.raises(ValueError, match="--workdir=.* is a file"):
        closed_loop.run(quickstart.get_config("short"), str(path))
    assert path.read_text() == "not a directory"


def test_a_missing_model_directory_names_hf_model(tmp_path):
    config = _changed(byo_qwen, str(tmp_path / "nowhere"))
    message = _refused(config, tmp_path / "run", "hf_model=",
                       "is not a directory with a config.json")
    assert str(tmp_path / "nowhere") in message


def test_a_terminal_task_whose_image_is_missing_refuses_to_start(tmp_path):
    from tests.test_terminal import _REASON  # (skips without a docker engine)
    from tests.test_terminal_load import TASKS_DIR
    from configs import terminal_toy
    import shutil
    task = tmp_path / "tasks" / "hello-file"
    shutil.copytree(os.path.join(TASKS_DIR, "hello-file"), task)
    dockerfile = task / "environment" / "Dockerfile"
    dockerfile.write_text(dockerfile.read_text().replace("FROM ptrain-term-base:latest",
                                                         "FROM python:3.12-slim"))
    config = terminal_toy.get_config()
    args = dict(tasks_dir=str(tmp_path / "tasks"))
    config.tasks.envs = (dict(env="ptrain.envs.terminal:make", args=args),)
    _refused(config, tmp_path / "run", "tasks.envs[0].args.tasks_dir",
             "'python:3.12-slim' is not present", "--image_map=FROM=LOCAL")
    config.tasks.envs = (dict(env="ptrain.envs.terminal:make", args=dict(
        args, image_map=("python:3.12-slim=ptrain-term-base:latest",))),)
    from ptrain import preflight
    preflight.check(config)  # mapped to a local image: it starts


def test_a_pinned_sandbox_backend_that_cannot_run_refuses_to_start(tmp_path, monkeypatch):
    from sandbox import backends
    monkeypatch.setattr(backends, "unavailable_reason", lambda spec: "bwrap is not installed")
    config = _changed(quickstart, "short", **{"sandbox.backend": "bwrap"})
    message = _refused(config, tmp_path / "run", "sandbox.backend='bwrap' cannot run here",
                       "bwrap is not installed")
    assert "'auto'" in message  # the way out: the strongest backend that runs here


def test_sft_steps_without_sft_records_and_rl_without_prompts_fail_naming_the_keys(tmp_path):
    config = _changed(grpo_toy, **{"sft.steps": 10})
    no_sft = _refused(config, tmp_path / "a", "sft.steps=10 but no SFT records", "sft.sources")
    no_rl = _refused(_changed(grpo_toy, **{"data.records_fn": None}), tmp_path / "b",
                     "steps=30 but no prompts", "data.sources")
    assert "sft.steps=0" in no_sft and "data.records_fn" in no_rl  # each names its way out
