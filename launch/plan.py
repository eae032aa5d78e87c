"""Dry-run memory plan: compile the training step for a simulated mesh and report memory.

  python -m launch.plan --config=configs/long_context_1m.py --out=plan.json
  python -m launch.plan --config=configs/long_context_1m.py --search --out=search.json
  python -m launch.plan --config=configs/long_context_1m.py --config.budget_gib=95 --search
  python -m launch.plan --config=configs/grpo_toy.py --config.mesh.fsdp=2   # the RL step
  python -m launch.plan --config=configs/grpo_toy.py --search --budget_gib=0.003 \
      --device_counts=1,2,4,8                                                 # its mesh search

Without --search: the config's mesh. With it: the smallest mesh of config.search.device_counts
that fits config.budget_gib per device (`ptrain.plan.search`). A learner config (configs/
grpo_toy.py, quickstart.py, ...) compiles the learner's own RL step on its mesh, whose sizes
it must name (`ptrain.plan.compile_rl_step`: the sampler's prefill and decode, step.prepare
and step.update, as `learner.train` runs them), or with --search the smallest mesh of
--device_counts whose RL step fits --budget_gib (`ptrain.plan.search_rl_step`). For a plan
config the two flags, when given, replace config.budget_gib and config.search.device_counts.
"""

import os

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "a plan config (configs/*.py)")
_OUT = flags.DEFINE_string("out", "", "write the JSON result here")
_SEARCH = flags.DEFINE_bool("search", False, "search the mesh instead of compiling config.mesh")
_BUDGET = flags.DEFINE_float("budget_gib", None, "memory per device for --search (GiB)")
_COUNTS = flags.DEFINE_list("device_counts", [], "device counts --search tries, ascending")


def main(argv):
    del argv
    config = _CONFIG.value
    counts = [int(n) for n in _COUNTS.value]
    if _SEARCH.value:
        devices = max(counts or ([] if "rl" in config else config.search.device_counts) or [1])
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

    result = plan.run(config, do_search=_SEARCH.value, budget_gib=_BUDGET.value,
                      device_counts=counts or None)
    print(plan.summary(result))
    if _OUT.value:
        plan.write_json(result, _OUT.value)


if __name__ == "__main__":
    flags.mark_flag_as_required("config")
    app.run(main)
