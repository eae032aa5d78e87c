"""Export a run's checkpoint as a Hugging Face model directory that `transformers` loads.

    python -m launch.export --workdir=runs/quickstart --out=runs/quickstart/hf
    python -m launch.export --workdir=runs/byo --step=200 --stage=sft --out=/tmp/byo-sft
    python -m launch.export --workdir=runs/lora --out=/tmp/merged --peft_out=/tmp/adapter

What is written, and how a LoRA run's adapters are merged: `ptrain.export`.
"""

from absl import app, flags, logging

_WORKDIR = flags.DEFINE_string("workdir", None, "The --workdir of a launch/train.py run.")
_OUT = flags.DEFINE_string("out", None, "The Hugging Face directory to write.")
_STEP = flags.DEFINE_integer("step", None, "The checkpoint step (default: the latest).")
_STAGE = flags.DEFINE_enum("stage", "rl", ["rl", "sft"], "Which checkpoints: RL or SFT.")
_PEFT_OUT = flags.DEFINE_string("peft_out", None, "LoRA runs: also write the adapters as a "
                                "PEFT adapter directory here.")
flags.mark_flags_as_required(["workdir", "out"])


def main(argv):
    del argv
    from ptrain import export, quiet
    quiet.quiet_orbax()
    step = export.export(_WORKDIR.value, _OUT.value, step=_STEP.value, stage=_STAGE.value,
                         peft_out=_PEFT_OUT.value)
    logging.info("exported %s step %d to %s", export.checkpoint_dir(_WORKDIR.value, _STAGE.value),
                 step, _OUT.value)


if __name__ == "__main__":
    app.run(main)
