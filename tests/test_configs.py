"""Every file in configs/ builds: get_config() returns a locked ConfigDict that its consumer
accepts (`ptrain.plan.check_config` for PLAN_CONFIGS, `ptrain.closed_loop.check_config` for
configs with tasks, `ptrain.terminal_loop.check_config` for those with a terminal section,
`ptrain.learner.check_config` for the rest), and a bad override fails with a message that
names it."""

import importlib
import pathlib

import ml_collections
import pytest

import subprocess
import sys

from ptrain import closed_loop
from ptrain import learner
from ptrain import plan
from ptrain import terminal_loop

CONFIG_DIR = pathlib.Path(__file__).resolve().parent.parent / "configs"
NAMES = sorted(p.stem for p in CONFIG_DIR.glob("*.py") if p.stem != "__init__")
PLAN_CONFIGS = {"long_context_1m"}  # read by launch/plan.py; the rest by the learner


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
    elif "terminal" in config:
        terminal_loop.check_config(config)
    else:
        learner.check_config(config)


def test_quickstart_short_variant_builds():
    from configs import quickstart
    short = quickstart.get_config("short")
    closed_loop.check_config(short)
    assert short.steps < quickstart.get_config().steps


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
