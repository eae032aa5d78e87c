"""Train from a config file: the closed loop (SFT, RL on sandbox verdicts and terminal tasks in
docker, held-out evals; ptrain/closed_loop.py), or the learner alone for a config without tasks.

    python -m launch.train --config=configs/quickstart.py --workdir=runs/quickstart
    python -m launch.train --config=configs/quickstart.py:short --config.steps=50 ...

Every host of a multi-host run starts this same command (launch/tpu_pod.sh, launch/gpu.sh);
JAX's distributed runtime is initialised first when more than one process takes part. The work
dir keeps the config (`config.json`, overrides applied) and each command line that started the
run (`command.txt`); `launch/export.py` reads them to write a Hugging Face directory.
"""

import os

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "A configs/*.py file[:arg].",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Where checkpoints, logs and evals go.")
flags.mark_flags_as_required(["config", "workdir"])


def _initialize_distributed():
    """Multi-host: explicit coordinates (launch/gpu.sh ssh mode), or what JAX detects itself
    (TPU pod slices, SLURM). A single host needs nothing."""
    import jax
    if "PTRAIN_COORDINATOR" in os.environ:
        jax.distributed.initialize(os.environ["PTRAIN_COORDINATOR"],
                                   int(os.environ["PTRAIN_NUM_PROCESSES"]),
                                   int(os.environ["PTRAIN_PROCESS_ID"]))
    elif int(os.environ.get("SLURM_NTASKS", "1")) > 1 or \
            "," in os.environ.get("TPU_WORKER_HOSTNAMES", ""):
        jax.distributed.initialize()


def main(argv):
    del argv
    from ptrain import quiet
    quiet.quiet_orbax()
    _initialize_distributed()
    from ptrain import closed_loop  # (it writes the run record, for launch/export.py)
    lines = closed_loop.run(_CONFIG.value, _WORKDIR.value)
    for line in lines:
        logging.info("eval %s", line)


if __name__ == "__main__":
    app.run(main)
