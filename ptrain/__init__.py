"""ptrain: JAX-native LLM post-training with RL on executable feedback.

    import ptrain
    config = ptrain.defaults(closed_loop=True)      # every key, with its default
    ptrain.run(config, "runs/qs")                   # the main job (ptrain.closed_loop)

The names below are imported on first use (importing ptrain itself loads nothing heavy);
every module is also reachable as an attribute (`ptrain.learner`, `ptrain.envs`, ...).
"""

import importlib

_PUBLIC = {
    "defaults": ("ptrain.config", "defaults"),  # the config's keys and defaults
    "check_config": ("ptrain.config", "check"),
    "run": ("ptrain.closed_loop", "run"),  # the main job: tasks, SFT, eval, RL, eval
    "train": ("ptrain.learner", "train"),  # RL from a config (any producer)
    "sft": ("ptrain.learner", "sft"),  # supervised fine-tuning from a config
    "Environment": ("ptrain.envs.base", "Environment"),  # a domain (docs/environments.md)
    "Tool": ("ptrain.envs.base", "Tool"),
    "TurnPolicy": ("ptrain.envs.base", "TurnPolicy"),
    "Splits": ("ptrain.envs.base", "Splits"),
    "Context": ("ptrain.envs.base", "Context"),
    "Verdict": ("ptrain.envs.verdict", "Verdict"),
    "rubric": ("ptrain.envs.verdict", "rubric"),
    "Task": ("ptrain.tasks", "Task"),
}
__all__ = sorted(_PUBLIC)


def __getattr__(name):
    if name in _PUBLIC:
        module, attr = _PUBLIC[name]
        value = getattr(importlib.import_module(module), attr)
    else:
        try:
            value = importlib.import_module(f"ptrain.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"ptrain.{name}":
                raise
            raise AttributeError(f"module 'ptrain' has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC))
