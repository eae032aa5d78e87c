"""Evaluate an agent on a directory of terminal tasks, or on a file of code / math / CAD / chart
tasks.

    python -m launch.eval --tasks=sandbox/terminal/tasks --agent=oracle --out=runs/oracle
    python -m launch.eval --tasks=tb2/ --agent=nop --out=runs/nop --attempts=3 \\
        --image_map=python:3.12-slim=ptrain-term-base:latest
    python -m launch.eval --tasks=HumanEval.jsonl.gz --agent=oracle --out=runs/he
    python -m launch.eval --tasks=sandbox/terminal/tasks --agent=model --model=HF_DIR --out=runs/m
    python -m launch.eval --tasks=examples/cad_tasks.jsonl --agent=oracle --out=runs/cad
    python -m launch.eval --tasks=examples/charts_tasks.jsonl --agent=oracle --out=runs/charts

Writes OUT/results.jsonl, OUT/transcripts/, OUT/summary.json and OUT/report.html; a rerun with
the same --out runs only the missing attempts; exit status 2 when attempts failed for an
environment reason. What each kind of task runs in, and the model agent: `ptrain.eval_tasks`.
"""

import sys

from absl import app, flags

flags.DEFINE_string("tasks", None, "A directory of terminal tasks, or a task file.")
flags.DEFINE_string("format", "", "The task file's format (ptrain.tasks.FORMATS, or "
                    "cad, charts); '' detects it. Not used for a directory of terminal tasks.")
flags.DEFINE_enum("agent", None, ["oracle", "nop", "model"],
                  "oracle: the task's own solution; nop: nothing; model: --model.")
flags.DEFINE_string("out", None, "The output directory.")
flags.DEFINE_integer("attempts", 1, "Attempts per task (pass@k for k <= this).")
flags.DEFINE_integer("concurrency", 2, "Terminal episodes run at once.")
flags.DEFINE_multi_string(
    "image_map", [], "FROM=LOCAL: build a Dockerfile's FROM image from a local image instead "
    "(repeat the flag for several).")
flags.DEFINE_bool("network", False, "Let tasks that ask for a network have one.")
flags.DEFINE_enum("backend", "docker", ["docker", "bwrap"],
                  "Terminal tasks' environment: docker, or bwrap for tasks that need "
                  "only files (the others score 0, saying they need the docker "
                  "backend).")
flags.DEFINE_integer("workers", 2, "Sandbox workers judging code tasks.")
flags.DEFINE_string("model", "", "--agent=model: a local Hugging Face model directory, "
                    "or the --workdir of a launch/train.py run (its latest RL "
                    "checkpoint, else SFT, exported to OUT/model first).")
flags.DEFINE_string("chat_format", "", "qwen | llama3 | plain; '' detects it "
                    "from the tokenizer.")
flags.DEFINE_integer("max_turns", 16, "Model turns per terminal episode.")
flags.DEFINE_integer("max_new_tokens", 256, "Tokens per model turn.")
flags.DEFINE_integer("max_len", 4096, "Tokens per episode after the prompt.")
flags.DEFINE_float("temperature", 1.0, "Sampling temperature.")
flags.DEFINE_bool("greedy", False, "Greedy decoding (pass@k needs sampling).")
flags.DEFINE_integer("seed", 0, "Sampling seed.")
flags.mark_flags_as_required(["tasks", "agent", "out"])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from ptrain import eval_tasks
    values = {name: flags.FLAGS[name].value for name in (
        "tasks", "agent", "out", "format", "attempts", "concurrency", "network", "backend",
        "workers", "model", "chat_format", "max_turns", "max_new_tokens", "max_len",
        "temperature", "greedy", "seed")}
    try:
        sys.exit(eval_tasks.evaluate(eval_tasks.Options(
            image_map=tuple(flags.FLAGS.image_map), **values)))
    except eval_tasks.UsageError as e:
        raise app.UsageError(str(e)) from None


if __name__ == "__main__":
    app.run(main)
