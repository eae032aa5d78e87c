"""RL on terminal tasks, top to bottom: generated Harbor tasks -> SFT warm start -> held-out
eval -> RL with the shell agent in docker, rewarded by each task's tests -> held-out eval.

    python -m launch.train --config=configs/terminal_toy.py --workdir=runs/terminal_toy

  tasks   `ptrain.terminal_tasks`: a training and a held-out split of Harbor task
          directories under <workdir>/tasks/ (instructions never shared), the RL records
          ({"task_dir": ...}) and the partly wrong SFT demonstrations
  SFT     `learner.sft` on the demonstrations (loss on the model's turns only)
  eval    greedy held-out pass rate: one episode per task, the task's own tests
          -> <workdir>/eval.jsonl
  RL      `learner.train` with `terminal_rollout.TerminalProducer`: G episodes per task in
          warm task containers, turns batched on the device, tool calls in each task's
          persistent shell, reward from its verifier; per-domain metrics (reward/terminal/mean,
          episode/terminal/passed, turns, tool_calls) in metrics.jsonl
  eval    again, after RL

Everything lands in the work dir; SFT and RL resume from their checkpoints and evaluations
already in eval.jsonl are not repeated. The config is the learner's keys plus a `terminal`
section (`defaults()`).
"""

from __future__ import annotations

import logging
import os
import random

import jax
import ml_collections
import numpy as np

from ptrain import chat
from ptrain import learner as learner_lib
from ptrain import jsonl
from ptrain import sharding
from ptrain import terminal_rollout
from ptrain import terminal_tasks

SECTION = "terminal"


def defaults() -> ml_collections.ConfigDict:
    c = learner_lib.defaults()
    c.terminal = dict(
        n_train=400, n_heldout=32,  # generated tasks per split
        bug_rate=0.7,  # how often a triggered demonstration carries its mistake
        max_turns=2, max_len=96,  # model turns per episode; tokens after the prompt
        max_output_chars=200, call_timeout_s=10.0,  # per command
        threads=16,  # episodes opened, stepped and verified at once
        max_idle=64,  # warm containers kept (the toy tasks share one image)
        image_map=(),  # ("FROM=LOCAL", ...) for task images not on this machine
    )
    return c


def check_config(config) -> None:
    learner_lib.check_config(learner_part(config))
    if SECTION not in config:
        raise ValueError(f"config: missing section {SECTION!r} (see terminal_loop.defaults())")
    ref = defaults()[SECTION]
    unknown = sorted(set(config[SECTION].keys()) - set(ref.keys()))
    missing = sorted(set(ref.keys()) - set(config[SECTION].keys()))
    if unknown or missing:
        raise ValueError(f"config.{SECTION}: unknown keys {unknown}, missing keys {missing}")
    t = config[SECTION]
    checks = [
        (config.rl.staleness == 0, "rl.staleness must be 0: two batches of open task "
                                   "containers at once would double the containers"),
        (config.tokenizer == "" and config.hf_model == "",
         "the toy trains its own word-level model: tokenizer and hf_model must be ''"),
        (t.max_len >= config.sampling.max_new_tokens,
         "terminal.max_len must be >= sampling.max_new_tokens"),
        (min(t.n_train, t.n_heldout, t.max_turns, t.threads) >= 1,
         "terminal.n_train, n_heldout, max_turns and threads must be >= 1"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(f"config: {message}")


def learner_part(config) -> ml_collections.ConfigDict:
    """The learner's sections; the DAPO overlong penalty's cap is an episode's
    (terminal.max_len: turns and shell outputs)."""
    out = ml_collections.ConfigDict({k: v for k, v in config.items() if k != SECTION})
    out.dapo = {**out.dapo.to_dict(), "overlong_max_len": config[SECTION].max_len}
    out.lock()
    return out


def make_tasks(config, tokenizer, workdir):
    """(train, heldout) generated tasks; the RL records and SFT demonstrations on disk."""
    t, root = config[SECTION], os.path.join(workdir, "tasks")
    heldout = terminal_tasks.generate(root, t.n_heldout, seed=config.seed, split="heldout")
    train = terminal_tasks.generate(root, t.n_train, seed=config.seed, split="train",
                                    exclude={g.instruction for g in heldout})
    jsonl.write([{"task_dir": g.task_dir, "domain": "terminal"} for g in train],
                os.path.join(root, "terminal.train.jsonl"))
    rng = random.Random(f"{config.seed}/terminal/demos")
    rows = [terminal_tasks.demo_record(g, tokenizer, *terminal_tasks.demonstration(
        g, rng, t.bug_rate)) for g in train]
    random.Random(config.seed).shuffle(rows)
    jsonl.write(rows, os.path.join(root, "sft.jsonl"))
    return train, heldout


def resolve(config, workdir, tokenizer) -> ml_collections.ConfigDict:
    """The vocabulary, the RL records, the SFT demonstrations and EOS as the stop token."""
    out = ml_collections.ConfigDict(config.to_dict())
    if out.model.vocab_size == 0:
        out.model.vocab_size = tokenizer.vocab_size
    root = os.path.join(workdir, "tasks")
    out.data.sources = ((os.path.join(root, "terminal.train.jsonl"), 1.0),)
    out.data.records_fn = None
    out.sft.sources = (os.path.join(root, "sft.jsonl"),)
    out.sft.records_fn = None
    out.sampling.stop_token_ids = (tokenizer.eos_token_id,)
    out.lock()
    return out


def rollout_config(config) -> terminal_rollout.TerminalRolloutConfig:
    t, s = config[SECTION], config.sampling
    return terminal_rollout.TerminalRolloutConfig(
        num_samples=s.num_samples, max_new_tokens=s.max_new_tokens, max_turns=t.max_turns,
        max_len=t.max_len, max_output_chars=t.max_output_chars,
        call_timeout_s=t.call_timeout_s, temperature=s.temperature, threads=t.threads,
        system="")


def evaluate(producer, params, heldout, *, stage, step, seed):
    rollouts = producer.evaluate(params, [g.task_dir for g in heldout], jax.random.key(seed))
    passed = [terminal_rollout.passed(r) for r in rollouts]
    triggered = [p for p, g in zip(passed, heldout) if g.triggered]
    return [{"stage": stage, "step": step, "split": "heldout", "domain": "terminal",
             "decoding": "greedy", "pass_rate": float(np.mean(passed)), "n": len(passed),
             "pass_rate_with_folder": float(np.mean(triggered)) if triggered else None,
             "errors": sum(bool(r.error) for r in rollouts)}]


def _evaluate_once(path, stage, **kwargs):
    """Evaluates unless eval.jsonl has this stage at this step (a resumed run; a run resumed
    with more steps evaluates its new last step)."""
    done = [r for r in jsonl.read(path)
            if r.get("stage") == stage and r.get("step") == kwargs["step"]]
    if done:
        return done
    lines = evaluate(stage=stage, **kwargs)
    jsonl.append(lines, path)
    for line in lines:
        logging.info("eval %(stage)s %(domain)s %(decoding)s: %(pass_rate).3f (n=%(n)d)", line)
    return lines


def run(config, workdir, *, mesh=None):
    """The job (see the module docstring); returns the eval lines."""
    from sandbox import terminal
    from ptrain import closed_loop  # make_sampler
    os.makedirs(workdir, exist_ok=True)
    check_config(config)
    tokenizer = terminal_tasks.tokenizer()
    config = resolve(config, workdir, tokenizer)
    _, heldout = make_tasks(config, tokenizer, workdir)
    lcfg = learner_part(config)
    mesh = sharding.mesh_from_config(lcfg.mesh) if mesh is None else mesh
    sampler = closed_loop.make_sampler(lcfg, mesh, tokenizer)
    eval_path = os.path.join(workdir, "eval.jsonl")
    t = config[SECTION]
    with terminal.Harness(image_map=terminal.parse_image_map(list(t.image_map)),
                          max_idle=t.max_idle, call_timeout_s=t.call_timeout_s) as harness:
        producer = terminal_rollout.TerminalProducer(
            sampler, tokenizer, harness=harness, fmt=chat.PLAIN,
            stop_ids=(tokenizer.eos_token_id,), config=rollout_config(config),
            prompt_len=config.data.max_prompt_len, pad_id=tokenizer.pad_token_id)
        try:
            if config.terminal.threads > 1:
                harness.warm(terminal.load_task(heldout[0].task_dir),
                             min(t.max_idle, config.data.prompts_per_step
                                 * config.sampling.num_samples))
            ev = dict(producer=producer, heldout=heldout, seed=config.seed)
            params = None
            if config.sft.steps:
                params = learner_lib.sft(lcfg, os.path.join(workdir, "sft"), mesh=mesh,
                                         tokenizer=tokenizer)
                _evaluate_once(eval_path, "sft", params=params, step=config.sft.steps, **ev)
            params = learner_lib.train(lcfg, workdir, params=params, producer=producer,
                                       mesh=mesh, tokenizer=tokenizer)
            _evaluate_once(eval_path, "rl", params=params, step=config.steps, **ev)
        finally:
            producer.close()
    return jsonl.read(eval_path)
