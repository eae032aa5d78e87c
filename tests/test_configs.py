"""Every file in configs/ builds: get_config() returns a locked ConfigDict that its consumer
accepts (`ptrain.learner.check_config` unless listed in PLAN_CONFIGS)."""

import importlib
import pathlib

import ml_collections
import pytest

from ptrain import learner
from ptrain import plan

CONFIG_DIR = pathlib.Path(__file__).resolve().parent.parent / "configs"
NAMES = sorted(p.stem for p in CONFIG_DIR.glob("*.py") if p.stem != "__init__")
PLAN_CONFIGS = {"long_context_1m"}  # read by launch/plan.py; the rest by the learner


def test_configs_are_found():
    assert {"grpo_toy", "long_context_1m"} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_config_builds(name):
    module = importlib.import_module(f"configs.{name}")
    assert all(f"{part}:" in (module.__doc__ or "") for part in ("Command", "Hardware", "Expected"))
    config = module.get_config()
    assert isinstance(config, ml_collections.ConfigDict) and config.is_locked
    check = plan.check_config if name in PLAN_CONFIGS else learner.check_config
    check(config)
