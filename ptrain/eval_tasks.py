"""Evaluate an agent on a directory of terminal tasks, or on a file of code / math / CAD /
chart tasks: what `python -m launch.eval` runs.

    status = evaluate(Options(tasks="sandbox/terminal/tasks", agent="oracle", out="runs/o"))

`tasks`: a directory of terminal tasks (Harbor or Terminal-Bench 1.0 layout, each task a
sub-directory; `sandbox.terminal`), or a JSONL task file in a format of `ptrain.tasks.FORMATS`
(`format`, detected from the first record when not given), judged by `ptrain.rewards`, or a
CAD task file (`ptrain.envs.cad.task_file`: records with a "target"; format "cad"), each
answer built and measured in the CAD sandbox (renders and STEP files in OUT/artefacts/), or a
chart task file (`ptrain.envs.charts.task_file`: records with "images" and "question"; format
"charts"), each answer judged numerically on the host; its model agent is a Qwen2.5-VL
directory answering in one turn with the images (`ptrain.envs.charts.agent`).
agent "model": a local Hugging Face directory (`model`) acting through its chat format's tool
calls in the task's persistent shell (`ptrain.envs.terminal.agent`), or answering code tasks in
one turn (`ptrain.code_eval.ModelAgent`); or a launch/train.py work dir, exported first, which
on the synthetic tasks' word tokenizer (the quickstart's, configs/terminal_toy.py's) acts with
that tokenizer, the run's chat format and its terminal system prompt.
Writes OUT/results.jsonl (one line per attempt), OUT/transcripts/, OUT/summary.json (pass@1 and
pass@k, unbiased) and OUT/report.html (`ptrain.report`); progress goes to stderr (a bar on a
terminal, else a log line now and then), the summary to stdout.
Run again with the same `out`, only the attempts without a line in results.jsonl run.
Attempts that failed for an environment reason (a missing package, image or host tool) are
listed on stderr with the fix, and the exit status is 2 (`ptrain.eval_failures`).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time


class UsageError(ValueError):
    """Bad input (a flag's value): the message names the flag and what to fix."""


@dataclasses.dataclass(frozen=True)
class Options:
    """launch/eval.py's flags (its --help says what each means)."""
    tasks: str
    agent: str  # oracle | nop | model
    out: str
    format: str = ""
    attempts: int = 1
    concurrency: int = 2
    image_map: tuple = ()
    network: bool = False
    backend: str = "docker"
    workers: int = 2
    model: str = ""
    chat_format: str = ""
    max_turns: int = 16
    max_new_tokens: int = 256
    max_len: int = 4096
    temperature: float = 1.0
    greedy: bool = False
    seed: int = 0


def load_model(o: Options):
    """(sampler, params, tokenizer, chat format, stop ids, system prompt) of --model."""
    from ptrain.envs.terminal import agent as terminal_agent
    path, run_config = o.model, None
    if not path:
        raise UsageError("--agent=model needs --model=DIR (a Hugging Face model directory "
                             "or a training run's work dir)")
    run = [stage for stage, sub in (("rl", "checkpoints"), ("sft", "sft/checkpoints"))
           if os.path.isdir(os.path.join(path, sub)) and os.listdir(os.path.join(path, sub))]
    if run:  # a launch/train.py work dir: its checkpoint as a Hugging Face directory
        hf_dir = os.path.join(o.out, "model")
        subprocess.run([sys.executable, "-m", "launch.export", f"--workdir={path}",
                        f"--out={hf_dir}", f"--stage={run[0]}"], check=True)
        print(f"--model={path}: its latest {run[0]} checkpoint exported to {hf_dir}",
              file=sys.stderr)
        from ptrain import metrics
        run_config = metrics.read_run_config(path)
        path = hf_dir
    elif not os.path.isfile(os.path.join(path, "config.json")):
        raise UsageError(f"--model={path}: neither a Hugging Face model directory "
                             "(config.json) nor a training run's work dir (checkpoints/)")
    system = terminal_agent.SYSTEM
    if any(os.path.exists(os.path.join(path, f))
           for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        model, tokenizer, fmt, stop = terminal_agent.load_hf(path, chat_format=o.chat_format)
    elif run_config is not None and "tasks" in run_config and not run_config.tokenizer:
        model, tokenizer, fmt, stop = word_tokenizer_model(o, path, run_config)
        system = next((e["args"]["system"] for e in run_config.tasks.envs
                       if "system" in e.get("args", {})), "")  # the run's agent prompt
    else:
        raise UsageError(f"--model={o.model}: no Hugging Face tokenizer, and not the "
                             "work dir of a run on the synthetic tasks' word tokenizer; the "
                             "model agent needs one of them")
    from ptrain.generate import sampler as sampler_lib
    sampler = sampler_lib.Sampler(model, seed=o.seed,
                                  pad_id=getattr(tokenizer, "pad_token_id", None) or 0,
                                  decode=tokenizer.decode)
    return sampler, model, tokenizer, fmt, stop, system


def word_tokenizer_model(o: Options, path, run_config):
    """(model, tokenizer, chat format, stop ids) of an exported run on the word tokenizer:
    the run's own (`closed_loop.make_tokenizer`), its chat format and where its sampler
    stopped a turn."""
    from ptrain import chat, closed_loop, hf
    if o.chat_format and o.chat_format != run_config.rollout.chat_format:
        raise UsageError(f"--chat_format={o.chat_format}: the run at {o.model} "
                             f"was trained in {run_config.rollout.chat_format!r}")
    model, config = hf.load(path)
    tokenizer = closed_loop.make_tokenizer(run_config, closed_loop.environments(run_config))
    chat.check_vocab(tokenizer, config.vocab_size)
    fmt = chat.get(run_config.rollout.chat_format)
    stop = chat.stop_ids(fmt, tokenizer, vocab_size=config.vocab_size)
    return model, tokenizer, fmt, tuple(dict.fromkeys(
        (*stop, *map(int, run_config.sampling.stop_token_ids))))


def terminal_model_agent(o: Options):
    from ptrain.envs.terminal import agent as terminal_agent
    from ptrain.rollout import turns
    sampler, params, tokenizer, fmt, stop, system = load_model(o)
    stop_ids, stop_strings = turns.turn_stops(fmt, tokenizer, stop, tools=True)  # as in RL
    policy = terminal_agent.SamplerPolicy(
        sampler, params, stop_ids=stop_ids, stop_strings=stop_strings,
        max_new_tokens=o.max_new_tokens, temperature=o.temperature, greedy=o.greedy,
        seed=o.seed)
    return terminal_agent.ShellAgent(policy, tokenizer, fmt, stop_ids=stop,
                                     max_turns=o.max_turns, max_len=o.max_len,
                                     system=system)


def code_model_agent(o: Options):
    from ptrain import code_eval
    sampler, params, tokenizer, fmt, stop, _ = load_model(o)
    return code_eval.ModelAgent(sampler, params, tokenizer, fmt, stop_ids=stop,
                                max_new_tokens=o.max_new_tokens,
                                temperature=o.temperature, greedy=o.greedy,
                                seed=o.seed)


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


def evaluate_terminal(o: Options, progress):
    path, agent_name, out = o.tasks, o.agent, o.out
    from sandbox import terminal
    loaded = terminal.load_tasks(path)
    print(loaded.summary(), file=sys.stderr)
    if not loaded.tasks:
        raise UsageError(f"--tasks={path}: no task loaded")
    agent = (terminal_model_agent(o) if agent_name == "model" else
             {"oracle": terminal.oracle, "nop": terminal.nop}[agent_name])
    image_map = terminal.parse_image_map(o.image_map)
    with terminal.Harness(image_map=image_map, network=o.network,
                          backend=o.backend) as harness:
        return terminal.evaluate(loaded.tasks, agent, out, attempts=o.attempts,
                                 concurrency=o.concurrency, harness=harness,
                                 progress=progress)


def evaluate_code(o: Options, progress):
    path, agent_name, out = o.tasks, o.agent, o.out
    import sandbox
    from ptrain import code_eval
    items = code_eval.load(path, o.format)
    agent = (code_model_agent(o) if agent_name == "model" else
             {"oracle": code_eval.oracle, "nop": code_eval.nop}[agent_name])
    with sandbox.Pool(o.workers) as pool:
        return code_eval.evaluate(items, agent, out, attempts=o.attempts, pool=pool,
                                  progress=progress)


def evaluate_cad(o: Options, progress):
    path, agent_name, out = o.tasks, o.agent, o.out
    import concurrent.futures
    import dataclasses
    from ptrain import code_eval
    from ptrain.envs import cad
    items = [(dataclasses.replace(t, metadata={**t.metadata, "format": "cad"}),
              t.verifier.code or None) for t in cad.brought(path)]
    env = cad.make(artefacts_dir=os.path.join(out, "artefacts"))
    agent = (code_model_agent(o) if agent_name == "model" else
             {"oracle": code_eval.oracle, "nop": code_eval.nop}[agent_name])
    with concurrent.futures.ThreadPoolExecutor(o.workers) as pool:
        return code_eval.evaluate(items, agent, out, attempts=o.attempts, pool=pool,
                                  progress=progress, verify=env.verify)


def charts_model_agent(o: Options):
    from ptrain.envs.charts import agent
    if not os.path.isfile(os.path.join(o.model, "config.json")):
        raise UsageError(f"--model={o.model}: chart tasks need a Qwen2.5-VL Hugging Face "
                         "directory (config.json)")
    try:
        return agent.model_agent(o.model, chat_format=o.chat_format, seed=o.seed,
                                 max_new_tokens=o.max_new_tokens,
                                 temperature=o.temperature, greedy=o.greedy)
    except ValueError as e:
        raise UsageError(f"--model={o.model}: {e}") from None


def evaluate_charts(o: Options, progress):
    path, agent_name, out = o.tasks, o.agent, o.out
    import dataclasses
    from ptrain import code_eval
    from ptrain.envs import charts
    items = [(dataclasses.replace(t, metadata={**t.metadata, "format": "charts"}),
              charts.answer_text(t)) for t in charts.brought(path)]
    env = charts.make(n_train=0, n_heldout=0)
    agent = (charts_model_agent(o) if agent_name == "model" else
             {"oracle": code_eval.oracle, "nop": code_eval.nop}[agent_name])
    return code_eval.evaluate(items, agent, out, attempts=o.attempts, progress=progress,
                              verify=env.verify)


def evaluate(o: Options) -> int:
    """Runs the evaluation `o` describes, writes OUT's files and the report, prints the summary;
    returns the exit status (2: attempts failed for an environment reason)."""
    path, out = o.tasks, o.out
    if not os.path.exists(path):
        raise UsageError(f"--tasks={path}: no such file or directory")
    if os.path.isdir(path) and o.format:
        raise UsageError("--format names a task file's format; --tasks is a directory of "
                         "terminal tasks")
    os.makedirs(out, exist_ok=True)
    from ptrain.envs.cad import task_file
    from ptrain.envs.charts import task_file as charts_file
    run = (evaluate_terminal if os.path.isdir(path) else evaluate_cad
           if o.format == "cad" or (not o.format and task_file.is_cad_file(path))
           else evaluate_charts
           if o.format == "charts" or (not o.format and charts_file.is_charts_file(path))
           else evaluate_code)
    t0 = time.monotonic()
    from ptrain import eval_failures
    try:
        summary = run(o, progress_bar())
    except ModuleNotFoundError as e:  # e.g. the docker SDK: the cause and the fix, no trace
        sys.exit(f"launch.eval: {e}\n  fix: {eval_failures.fix(f'No module named {e.name!r}')}")
    from ptrain import report
    html = report.write_report_quietly(out, title=f"{o.agent} on {path}")
    ks = [k for k in summary if k.startswith("pass@")]
    print(f"{summary['tasks_evaluated']} tasks x {o.attempts} attempts, agent "
          f"{o.agent}: " + ", ".join(f"{k} {summary[k]:.3f}" for k in ks) +
          f", mean reward {summary['mean_reward']:.3f}; {time.monotonic() - t0:.1f} s")
    print(f"results: {os.path.join(out, 'results.jsonl')}")
    if html:
        print(f"report: {html}")
    if run is evaluate_terminal:  # environment failures: said on the console, exit 2
        from ptrain import jsonl
        rows = jsonl.read(os.path.join(out, "results.jsonl"))
        failures = eval_failures.environment(rows)
        if failures:
            print(eval_failures.report(failures, len(rows)), file=sys.stderr)
            return 2
    return 0
