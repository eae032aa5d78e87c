"""Every file in configs/ builds: get_config() returns a locked ConfigDict that its consumer
accepts (`ptrain.plan.check_config` for PLAN_CONFIGS, `ptrain.closed_loop.check_config` for
configs with tasks, `ptrain.learner.check_config` for the rest), and a bad override fails with
a message that names it."""

import importlib
import pathlib

import ml_collections
import pytest

import subprocess
import sys

from ptrain import closed_loop
from ptrain import config as config_lib
from ptrain import learner
from ptrain import plan

CONFIG_DIR = pathlib.Path(__file__).resolve().parent.parent / "configs"
NAMES = sorted(p.stem for p in CONFIG_DIR.glob("*.py") if p.stem != "__init__")
PLAN_CONFIGS = {"long_context_1m", "moe_plan"}  # read by launch/plan.py; the rest by the learner


def test_configs_are_found():
    assert {"grpo_toy", "long_context_1m", "quickstart"} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_config_builds(name):
    module = importlib.import_module(f"configs.{name}")
    assert all(f"{part}:" in (module.__doc__ or "") for part in ("Command", "Hardware", "Expected"))
    config = module.get_config()
    assert isinstance(config, ml_collections.ConfigDict) and config.is_locked
    if name in PLAN_CONFIGS:
        plan.check_config(config)
    elif "tasks" in config:
        closed_loop.check_config(config)
    else:
        learner.check_config(config)


def test_quickstart_short_variant_builds():
    from configs import quickstart
    short = quickstart.get_config("short")
    closed_loop.check_config(short)
    assert short.steps < quickstart.get_config().steps


@pytest.mark.parametrize("name, arg", [("quickstart", "smoke"), ("terminal_toy", "smoke"),
                                       ("byo_qwen", ",smoke")])
def test_smoke_variants_build_and_keep_every_stage(name, arg):
    module = importlib.import_module(f"configs.{name}")
    full, smoke = module.get_config(arg.replace("smoke", "").rstrip(",")), module.get_config(arg)
    closed_loop.check_config(smoke)
    assert 0 < smoke.steps <= 2 and smoke.eval.n <= 4
    assert bool(smoke.sft.steps) == bool(full.sft.steps)  # SFT kept where the run has it
    assert (smoke.hf_model, [e["env"] for e in smoke.tasks.envs], smoke.rl.estimator) == (
        full.hf_model, [e["env"] for e in full.tasks.envs], full.rl.estimator)
    with pytest.raises(ValueError, match="smoke"):
        module.get_config(arg.replace("smoke", "smok"))


@pytest.mark.parametrize("override, message", [
    ("--config.stepz=3", "stepz"),
    ("--config.rl.clip_hi=0.3", "clip_hi"),
    ("--config.steps=many", "many"),
])
def test_a_bad_override_fails_clearly(tmp_path, override, message):
    run = subprocess.run(
        [sys.executable, "-m", "launch.train", "--config=configs/quickstart.py", override,
         f"--workdir={tmp_path}"], cwd=CONFIG_DIR.parent, capture_output=True, text=True,
        timeout=120)
    assert run.returncode != 0
    assert message in run.stderr
    assert not any(tmp_path.iterdir())  # nothing ran


@pytest.mark.parametrize("name", NAMES)
def test_config_sets_only_keys_that_exist(name):
    """Each config is defaults() with changes: it holds exactly the keys of its defaults
    (a plan's model section takes any ModelConfig field), and its base is locked before the
    changes, so a misspelt key fails when the file builds."""
    module = importlib.import_module(f"configs.{name}")
    config = module.get_config()
    if name in PLAN_CONFIGS:
        ref = config_lib.plan_defaults()
    else:
        ref = config_lib.defaults(closed_loop="tasks" in config)
    missing, unknown = config_lib.key_diff(ref, config)
    if name in PLAN_CONFIGS:
        missing = [k for k in missing if not k.startswith("model.")]
        unknown = [k for k in unknown if not k.startswith("model.")]
    assert (missing, unknown) == ([], [])


def test_the_config_module_is_pure_data():
    run = subprocess.run([sys.executable, "-c", "import sys; from configs import quickstart, "
                          "grpo_toy; quickstart.get_config(); grpo_toy.get_config(); "
                          "print('jax' in sys.modules)"], cwd=CONFIG_DIR.parent,
                         capture_output=True, text=True, timeout=60)
    assert run.stdout.strip() == "False", run.stderr


def test_chat_formats_match_the_rollout():
    from ptrain import chat
    assert set(config_lib.CHAT_FORMATS) == set(chat.FORMATS)


@pytest.mark.parametrize("mesh, change, message", [
    (dict(data=3, fsdp=1), {}, "microbatch of 16 rows .* data x fsdp x expert = 3"),
    (dict(data=1, fsdp=1, expert=3), {}, "microbatch of 16 rows .* data x fsdp x expert = 3"),
    (dict(data=1, fsdp=1, sequence=3), {},
     "continuation length 8 .* must divide over mesh sequence=3"),
    (dict(data=1, fsdp=1), {"sft.steps": 5, "sft.microbatch_size": 2}, None),
    (dict(data=4, fsdp=1), {"sft.steps": 5, "sft.microbatch_size": 2},
     "sft's microbatch of 2 rows"),
])
def test_batch_and_sequence_dims_must_divide_their_mesh_axes(mesh, change, message):
    from configs import grpo_toy
    config = grpo_toy.get_config()
    config.mesh.update(tensor=1, **mesh)
    for dotted, value in change.items():
        section, key = dotted.split(".")
        config[section][key] = value
    if message is None:
        learner.check_config(config)
    else:
        with pytest.raises(ValueError, match=message):
            learner.check_config(config)
