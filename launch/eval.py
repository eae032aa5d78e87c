"""Evaluate an agent on a directory of terminal tasks, or on a file of code / math tasks.

    python -m launch.eval --tasks=sandbox/terminal/tasks --agent=oracle --out=runs/oracle
    python -m launch.eval --tasks=tb2/ --agent=nop --out=runs/nop --attempts=3 \\
        --image_map=python:3.12-slim=ptrain-term-base:latest
    python -m launch.eval --tasks=HumanEval.jsonl.gz --agent=oracle --out=runs/he
    python -m launch.eval --tasks=sandbox/terminal/tasks --agent=model --model=HF_DIR --out=runs/m
    python -m launch.eval --tasks=examples/cad_tasks.jsonl --agent=oracle --out=runs/cad

--tasks: a directory of terminal tasks (Harbor or Terminal-Bench 1.0 layout, each task a
sub-directory; `sandbox.terminal`), or a JSONL task file in a format of `ptrain.tasks.FORMATS`
(--format, detected from the first record when not given), judged by `ptrain.rewards`, or a
CAD task file (`ptrain.envs.cad.task_file`: records with a "target"; --format=cad), each
answer built and measured in the CAD sandbox (renders and STEP files in OUT/artefacts/).
--agent=model: a local Hugging Face directory (--model) acting through its chat format's tool
calls in the task's persistent shell (`ptrain.envs.terminal.agent`), or answering code tasks in one
turn (`ptrain.code_eval.ModelAgent`); or a launch/train.py work dir, exported first, which on
the synthetic tasks' word tokenizer (the quickstart's, configs/terminal_toy.py's) acts with
that tokenizer, the run's chat format and its terminal system prompt.
Writes OUT/results.jsonl (one line per attempt), OUT/transcripts/, OUT/summary.json (pass@1 and
pass@k, unbiased) and OUT/report.html; progress goes to stderr (a bar on a terminal, else a
log line now and then), the summary to stdout.
Run again with the same --out, only the attempts without a line in results.jsonl run.
Attempts that failed for an environment reason (a missing package, image or host tool) are
listed on stderr with the fix, and the exit status is 2 (`ptrain.eval_failures`).
"""

import os
import subprocess
import sys
import time

from absl import app, flags

_TASKS = flags.DEFINE_string("tasks", None, "A directory of terminal tasks, or a task file.")
_FORMAT = flags.DEFINE_string("format", "", "The task file's format (ptrain.tasks.FORMATS, or "
                              "cad); '' detects it. Not used for a directory of terminal tasks.")
_AGENT = flags.DEFINE_enum("agent", None, ["oracle", "nop", "model"],
                           "oracle: the task's own solution; nop: nothing; model: --model.")
_OUT = flags.DEFINE_string("out", None, "The output directory.")
_ATTEMPTS = flags.DEFINE_integer("attempts", 1, "Attempts per task (pass@k for k <= this).")
_CONCURRENCY = flags.DEFINE_integer("concurrency", 2, "Terminal episodes run at once.")
_IMAGE_MAP = flags.DEFINE_multi_string(
    "image_map", [], "FROM=LOCAL: build a Dockerfile's FROM image from a local image instead "
    "(repeat the flag for several).")
_NETWORK = flags.DEFINE_bool("network", False, "Let tasks that ask for a network have one.")
_BACKEND = flags.DEFINE_enum("backend", "docker", ["docker", "bwrap"],
                             "Terminal tasks' environment: docker, or bwrap for tasks that need "
                             "only files (the others score 0, saying they need the docker "
                             "backend).")
_WORKERS = flags.DEFINE_integer("workers", 2, "Sandbox workers judging code tasks.")
_MODEL = flags.DEFINE_string("model", "", "--agent=model: a local Hugging Face model directory, "
                             "or the --workdir of a launch/train.py run (its latest RL "
                             "checkpoint, else SFT, exported to OUT/model first).")
_CHAT_FORMAT = flags.DEFINE_string("chat_format", "", "qwen | llama3 | plain; '' detects it "
                                   "from the tokenizer.")
_MAX_TURNS = flags.DEFINE_integer("max_turns", 16, "Model turns per terminal episode.")
_MAX_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 256, "Tokens per model turn.")
_MAX_LEN = flags.DEFINE_integer("max_len", 4096, "Tokens per episode after the prompt.")
_TEMPERATURE = flags.DEFINE_float("temperature", 1.0, "Sampling temperature.")
_GREEDY = flags.DEFINE_bool("greedy", False, "Greedy decoding (pass@k needs sampling).")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
flags.mark_flags_as_required(["tasks", "agent", "out"])


def load_model():
    """(sampler, params, tokenizer, chat format, stop ids, system prompt) of --model."""
    from ptrain.envs.terminal import agent as terminal_agent
    path, run_config = _MODEL.value, None
    if not path:
        raise app.UsageError("--agent=model needs --model=DIR (a Hugging Face model directory "
                             "or a training run's work dir)")
    run = [stage for stage, sub in (("rl", "checkpoints"), ("sft", "sft/checkpoints"))
           if os.path.isdir(os.path.join(path, sub)) and os.listdir(os.path.join(path, sub))]
    if run:  # a launch/train.py work dir: its checkpoint as a Hugging Face directory
        hf_dir = os.path.join(_OUT.value, "model")
        subprocess.run([sys.executable, "-m", "launch.export", f"--workdir={path}",
                        f"--out={hf_dir}", f"--stage={run[0]}"], check=True)
        print(f"--model={path}: its latest {run[0]} checkpoint exported to {hf_dir}",
              file=sys.stderr)
        from ptrain import metrics
        run_config = metrics.read_run_config(path)
        path = hf_dir
    elif not os.path.isfile(os.path.join(path, "config.json")):
        raise app.UsageError(f"--model={path}: neither a Hugging Face model directory "
                             "(config.json) nor a training run's work dir (checkpoints/)")
    system = terminal_agent.SYSTEM
    if any(os.path.exists(os.path.join(path, f))
           for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        model, tokenizer, fmt, stop = terminal_agent.load_hf(path,
                                                             chat_format=_CHAT_FORMAT.value)
    elif run_config is not None and "tasks" in run_config and not run_config.tokenizer:
        model, tokenizer, fmt, stop = word_tokenizer_model(path, run_config)
        system = next((e["args"]["system"] for e in run_config.tasks.envs
                       if "system" in e.get("args", {})), "")  # the run's agent prompt
    else:
        raise app.UsageError(f"--model={_MODEL.value}: no Hugging Face tokenizer, and not the "
                             "work dir of a run on the synthetic tasks' word tokenizer; the "
                             "model agent needs one of them")
    from ptrain.generate import sampler as sampler_lib
    sampler = sampler_lib.Sampler(model, seed=_SEED.value,
                                  pad_id=getattr(tokenizer, "pad_token_id", None) or 0,
                                  decode=tokenizer.decode)
    return sampler, model, tokenizer, fmt, stop, system


def word_tokenizer_model(path, run_config):
    """(model, tokenizer, chat format, stop ids) of an exported run on the word tokenizer:
    the run's own (`closed_loop.make_tokenizer`), its chat format and where its sampler
    stopped a turn."""
    from ptrain import chat, closed_loop, hf
    if _CHAT_FORMAT.value and _CHAT_FORMAT.value != run_config.rollout.chat_format:
        raise app.UsageError(f"--chat_format={_CHAT_FORMAT.value}: the run at {_MODEL.value} "
                             f"was trained in {run_config.rollout.chat_format!r}")
    model, config = hf.load(path)
    tokenizer = closed_loop.make_tokenizer(run_config, closed_loop.environments(run_config))
    chat.check_vocab(tokenizer, config.vocab_size)
    fmt = chat.get(run_config.rollout.chat_format)
    stop = chat.stop_ids(fmt, tokenizer, vocab_size=config.vocab_size)
    return model, tokenizer, fmt, tuple(dict.fromkeys(
        (*stop, *map(int, run_config.sampling.stop_token_ids))))


def terminal_model_agent():
    from ptrain.envs.terminal import agent as terminal_agent
    sampler, params, tokenizer, fmt, stop, system = load_model()
    policy = terminal_agent.SamplerPolicy(
        sampler, params, stop_ids=stop, max_new_tokens=_MAX_NEW_TOKENS.value,
        temperature=_TEMPERATURE.value, greedy=_GREEDY.value, seed=_SEED.value)
    return terminal_agent.ShellAgent(policy, tokenizer, fmt, stop_ids=stop,
                                     max_turns=_MAX_TURNS.value, max_len=_MAX_LEN.value,
                                     system=system)


def code_model_agent():
    from ptrain import code_eval
    sampler, params, tokenizer, fmt, stop, _ = load_model()
    return code_eval.ModelAgent(sampler, params, tokenizer, fmt, stop_ids=stop,
                                max_new_tokens=_MAX_NEW_TOKENS.value,
                                temperature=_TEMPERATURE.value, greedy=_GREEDY.value,
                                seed=_SEED.value)


def progress_bar():
    """progress(done, total, row) after each attempt: `ptrain.progress` (a bar on a terminal,
    else a log line now and then: done/total, rate, ETA), with the attempts passed so far."""
    from ptrain import progress as progress_lib
    state = {"bar": None, "passed": 0}

    def progress(done, total, row):
        if state["bar"] is None:  # (a resumed evaluation: its rate counts from here)
            state["bar"] = progress_lib.Progress(total, desc="eval", unit="attempt",
                                                 initial=done - 1)
        state["passed"] += bool(row.get("passed"))
        state["bar"].advance_to(done, passed=state["passed"])
        if done == total:
            state["bar"].close()
    return progress


def evaluate_terminal(path, agent_name, out, progress):
    from sandbox import terminal
    loaded = terminal.load_tasks(path)
    print(loaded.summary(), file=sys.stderr)
    if not loaded.tasks:
        raise app.UsageError(f"--tasks={path}: no task loaded")
    agent = (terminal_model_agent() if agent_name == "model" else
             {"oracle": terminal.oracle, "nop": terminal.nop}[agent_name])
    image_map = terminal.parse_image_map(_IMAGE_MAP.value)
    with terminal.Harness(image_map=image_map, network=_NETWORK.value,
                          backend=_BACKEND.value) as harness:
        return terminal.evaluate(loaded.tasks, agent, out, attempts=_ATTEMPTS.value,
                                 concurrency=_CONCURRENCY.value, harness=harness,
                                 progress=progress)


def evaluate_code(path, agent_name, out, progress):
    import sandbox
    from ptrain import code_eval
    items = code_eval.load(path, _FORMAT.value)
    agent = (code_model_agent() if agent_name == "model" else
             {"oracle": code_eval.oracle, "nop": code_eval.nop}[agent_name])
    with sandbox.Pool(_WORKERS.value) as pool:
        return code_eval.evaluate(items, agent, out, attempts=_ATTEMPTS.value, pool=pool,
                                  progress=progress)


def evaluate_cad(path, agent_name, out, progress):
    import concurrent.futures
    import dataclasses
    from ptrain import code_eval
    from ptrain.envs import cad
    items = [(dataclasses.replace(t, metadata={**t.metadata, "format": "cad"}),
              t.verifier.code or None) for t in cad.brought(path)]
    env = cad.make(artefacts_dir=os.path.join(out, "artefacts"))
    agent = (code_model_agent() if agent_name == "model" else
             {"oracle": code_eval.oracle, "nop": code_eval.nop}[agent_name])
    with concurrent.futures.ThreadPoolExecutor(_WORKERS.value) as pool:
        return code_eval.evaluate(items, agent, out, attempts=_ATTEMPTS.value, pool=pool,
                                  progress=progress, verify=env.verify)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    path, out = _TASKS.value, _OUT.value
    if not os.path.exists(path):
        raise app.UsageError(f"--tasks={path}: no such file or directory")
    if os.path.isdir(path) and _FORMAT.value:
        raise app.UsageError("--format names a task file's format; --tasks is a directory of "
                             "terminal tasks")
    os.makedirs(out, exist_ok=True)
    from ptrain.envs.cad import task_file
    run = (evaluate_terminal if os.path.isdir(path) else evaluate_cad
           if _FORMAT.value == "cad" or (not _FORMAT.value and task_file.is_cad_file(path))
           else evaluate_code)
    t0 = time.monotonic()
    from ptrain import eval_failures
    try:
        summary = run(path, _AGENT.value, out, progress_bar())
    except ModuleNotFoundError as e:  # e.g. the docker SDK: the cause and the fix, no trace
        sys.exit(f"launch.eval: {e}\n  fix: {eval_failures.fix(f'No module named {e.name!r}')}")
    from sandbox.terminal import report
    html = report.write_html(out, title=f"{_AGENT.value} on {path}")
    ks = [k for k in summary if k.startswith("pass@")]
    print(f"{summary['tasks_evaluated']} tasks x {_ATTEMPTS.value} attempts, agent "
          f"{_AGENT.value}: " + ", ".join(f"{k} {summary[k]:.3f}" for k in ks) +
          f", mean reward {summary['mean_reward']:.3f}; {time.monotonic() - t0:.1f} s")
    print(f"results: {os.path.join(out, 'results.jsonl')}\nreport: {html}")
    if run is evaluate_terminal:  # environment failures: said on the console, exit 2
        from ptrain import jsonl
        rows = jsonl.read(os.path.join(out, "results.jsonl"))
        failures = eval_failures.environment(rows)
        if failures:
            print(eval_failures.report(failures, len(rows)), file=sys.stderr)
            sys.exit(2)


if __name__ == "__main__":
    app.run(main)
