"""Dry-run memory plan: compile the training step for a simulated mesh and report memory.

  python -m launch.plan --config=configs/long_context_1m.py --out=plan.json
  python -m launch.plan --config=configs/long_context_1m.py --search --out=search.json
  python -m launch.plan --config=configs/long_context_1m.py --config.budget_gib=95 --search
  python -m launch.plan --config=configs/grpo_toy.py --config.mesh.fsdp=2   # the RL step

Without --search: the config's mesh. With it: the smallest mesh of config.search.device_counts
that fits config.budget_gib per device (`ptrain.plan.search`). A learner config (configs/
grpo_toy.py, quickstart.py, ...) compiles the learner's own RL step on its mesh, whose sizes
it must name (`ptrain.plan.compile_rl_step`).
"""

import os

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "a plan config (configs/*.py)")
_OUT = flags.DEFINE_string("out", "", "write the JSON result here")
_SEARCH = flags.DEFINE_bool("search", False, "search the mesh instead of compiling config.mesh")


def main(argv):
    del argv
    config = _CONFIG.value
    if _SEARCH.value:
        devices = max(config.search.device_counts)
    else:
        devices = 1
        for size in config.mesh.values():
            devices *= max(size, 1)  # -1 (all devices): plan.run asks for a size
    # Simulated CPU devices; this must happen before JAX is imported.
    os.environ["XLA_FLAGS"] = " ".join(
        [f for f in os.environ.get("XLA_FLAGS", "").split()
         if not f.startswith("--xla_force_host_platform_device_count")]
        + [f"--xla_force_host_platform_device_count={devices}"])
    os.environ["JAX_PLATFORMS"] = "cpu"
    from ptrain import plan  # pylint: disable=import-outside-toplevel

    result = plan.run(config, do_search=_SEARCH.value)
    print(plan.summary(result))
    if _OUT.value:
        plan.write_json(result, _OUT.value)


if __name__ == "__main__":
    flags.mark_flag_as_required("config")
    app.run(main)
