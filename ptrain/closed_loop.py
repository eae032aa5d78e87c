"""The main job: a policy that writes code and calls tools, rewarded by really running them.

`run(config, workdir)` reads top to bottom:

  tasks     per domain, a training split and a held-out split (instances never trained on):
            generated (`ptrain.synthetic_tasks`, the quickstart's default) or read from
            task files in their formats (`ptrain.tasks`); mixed by the config's domain
            weights; prompt lengths and the vocabulary checked before anything runs
  eval      a brought model (hf_model) first: its baseline at step 0
  SFT       a warm start on demonstrations, loss on the model's own turns only
  eval      greedy pass@1 on the held-out split, per domain (and sampled pass@1 / pass@k
            with eval.sample) -> <workdir>/eval.jsonl, rows keyed by (stage, step)
  RL        `learner.train` with the `rollout.Tasks` producer: multi-turn episodes whose tool
            calls run in the sandbox, verdicts from the sandbox pool (`ptrain.rewards`),
            scoring of batch t overlapped with generating batch t+1 when rl.staleness=1;
            the terminal domain's episodes in docker task containers, rewarded by each
            task's own tests (`ptrain.terminal_domain`), packed into the same batch
  eval      again, after RL; a reward-curve PNG

Everything lands in the work dir and the job resumes where it stopped: SFT and RL from their
checkpoints, evaluations that are already in eval.jsonl are not repeated.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import random
import types

import jax
import ml_collections
from flax import nnx

from sandbox import fleet
from ptrain import chat
from ptrain import config as config_lib
from ptrain import eval_rows
from ptrain import jsonl
from ptrain import learner as learner_lib
from ptrain import metrics as metrics_lib
from ptrain import mixed_producer
from ptrain import model as model_lib
from ptrain import rollout as rollout_lib
from ptrain import run_record
from ptrain import sharding
from ptrain import synthetic_tasks
from ptrain import tasks as tasks_lib
from ptrain import terminal_domain
from ptrain import terminal_tasks

TERMINAL = terminal_domain.DOMAIN  # generated terminal tasks in docker (tasks.domains)


# ==================================================================================== config


def defaults() -> ml_collections.ConfigDict:
    """The learner's keys plus the closed loop's sections (`ptrain.config.defaults`)."""
    return config_lib.defaults(closed_loop=True)


def check_config(config) -> None:
    """The learner's checks, then the closed loop's sections (`ptrain.config.check`)."""
    config_lib.check(config, closed_loop=True)


# ===================================================================================== tasks


def make_tasks(config, tokenizer, workdir):
    """(train, heldout): {domain: [Task]} each (the terminal domain's: [terminal_tasks.
    Generated]); written under <workdir>/tasks/, plus the SFT demonstrations of the synthetic
    source (token ids with their loss masks)."""
    t = config.tasks
    os.makedirs(os.path.join(workdir, "tasks"), exist_ok=True)
    train, heldout, demos, terminal_rows = {}, {}, [], []
    for i, domain in enumerate(t.domains):
        if domain == TERMINAL:
            train[domain], heldout[domain], terminal_rows = terminal_domain.make_tasks(
                config, tokenizer, workdir, train_file=_task_file(workdir, domain, "train"),
                heldout_file=_task_file(workdir, domain, "heldout"))
            continue
        if t.source == "synthetic":
            held = synthetic_tasks.generate(domain, t.n_heldout, seed=config.seed,
                                            split="heldout")
            gen = synthetic_tasks.generate(domain, t.n_train, seed=config.seed, split="train",
                                           exclude={g.task.prompt for g in held})
            train[domain], heldout[domain] = [g.task for g in gen], [g.task for g in held]
            rng = random.Random(f"{config.seed}/demos/{domain}")
            demos += [(g.task, synthetic_tasks.demonstration(g, rng, t.bug_rate)) for g in gen]
        else:
            train[domain] = tasks_lib.load_entry(t.train[i], key=f"tasks.train[{i}]",
                                                 domain=domain)
            heldout[domain] = tasks_lib.load_entry(t.heldout[i], key=f"tasks.heldout[{i}]",
                                                   domain=domain)
            if t.tools:
                train[domain], heldout[domain] = (
                    [dataclasses.replace(x, tools=tuple(t.tools)) for x in found]
                    for found in (train[domain], heldout[domain]))
        overlap = {x.prompt for x in train[domain]} & {x.prompt for x in heldout[domain]}
        if overlap:
            raise ValueError(f"{len(overlap)} {domain} held-out prompt(s) also appear in its "
                             f"training split, e.g. {sorted(overlap)[0]!r}")
        tasks_lib.write_jsonl(train[domain], _task_file(workdir, domain, "train"))
        tasks_lib.write_jsonl(heldout[domain], _task_file(workdir, domain, "heldout"))
    fmt = chat.FORMATS[config.rollout.chat_format]
    check_format(fmt, tokenizer, {name for domain, found in train.items() if domain != TERMINAL
                                  for x in found for name in x.tools})
    for domain, found in train.items():  # before anything is generated
        tasks_lib.check_lengths(
            terminal_domain.prompt_lengths(config, tokenizer, found) if domain == TERMINAL
            else {x.id: len(rollout_lib.render_prompt(x, tokenizer, fmt)) for x in found},
            config.data.max_prompt_len, key="data.max_prompt_len", what=f"{domain} prompt")
    rows = [demo_record(task, demo, tokenizer, fmt) for task, demo in demos] + terminal_rows
    if rows:
        for part, key in (("prompt", "max_prompt_len"), ("completion", "max_completion_len")):
            tasks_lib.check_lengths({f"demonstration {i} ({r['domain']})": len(r[f"{part}_ids"])
                                     for i, r in enumerate(rows)}, config.sft[key],
                                    key=f"sft.{key}", what=f"SFT {part}")
        random.Random(config.seed).shuffle(rows)
        jsonl.write(rows, os.path.join(workdir, "tasks", "sft.jsonl"))
    return train, heldout


def prompt_sources(config, train, workdir) -> list:
    """The RL prompt stream's sources, each domain with its weight: the training Tasks
    themselves, served as they are (tasks/<domain>.train.jsonl holds the same); the terminal
    domain's records ({"task_dir": ...}) from its task file."""
    return [(_task_file(workdir, d, "train") if d == TERMINAL else train[d], float(w))
            for d, w in zip(config.tasks.domains, config.tasks.weights)]


def check_format(fmt, tokenizer, tools) -> None:
    """Episodes are appended to, never re-rendered: the chat format must write, token for
    token, what the tokenizer's own template writes for the same conversation with these
    tools (`chat.check`), or the model is trained on conversations it never sees."""
    try:
        chat.check(fmt, tokenizer, tools=tuple(sorted(tools)))
    except ValueError as e:
        raise ValueError(f"rollout.chat_format={fmt.name!r}: {e}") from None


def _task_file(workdir, domain, split):
    return os.path.join(workdir, "tasks", f"{domain}.{split}.jsonl")


def demo_record(task, demo, tokenizer, fmt) -> dict:
    """A demonstration as an SFT record: the prompt's ids, then the model's turns (trained
    on, each ending with the format's end-of-turn token; in the plain format only the last,
    with EOS, as a call turn ends at its closing tag) and the tool outputs rendered as
    observations (not trained on), exactly as a rollout appends them."""
    ids, mask = [], []
    end = list(chat.end_of_turn_ids(fmt, tokenizer)[:1])
    for i, text in enumerate(demo):
        if i % 2:  # a tool's output
            part = chat.encode(tokenizer, chat.observation(fmt, [text], closed=True))
        else:
            part = chat.encode(tokenizer, text)
            if fmt.end_of_turn or i == len(demo) - 1:
                part += end
        ids += part
        mask += [1 - i % 2] * len(part)
    return {"prompt_ids": rollout_lib.render_prompt(task, tokenizer, fmt),
            "completion_ids": ids, "completion_mask": mask, "domain": task.domain}


# ================================================================================ evaluation


def evaluate(sampler, params, heldout, *, tokenizer, config, pool, stage, step,
             terminal=None, skip=(), on_line=None):
    """Pass rates on the held-out split, per domain: greedy pass@1, and with eval.sample
    pass@1 and pass@k at the sampling temperature from sampling.num_samples samples per task
    (the unbiased estimator of Chen et al. 2021, `sandbox.terminal.evaluate.pass_at_k`).
    Returns eval.jsonl lines. With many processes each runs and scores its block of the
    tasks (one sampler call over all of them per turn) and the summary is of all episodes.
    The terminal domain's episodes run in `terminal` (its producer, `terminal_domain`).
    (domain, decoding) pairs in `skip` are not run; `on_line(line)` follows each that is."""
    lines, mesh = [], getattr(sampler, "mesh", None)
    decodings = [("greedy", dict(greedy=True, num_samples=1))]
    if config.eval.sample:
        decodings.append(("sample", dict(num_samples=config.sampling.num_samples)))
    for decoding, change in decodings:
        rc = rollout_lib.rollout_config(config, **change)
        for domain, tasks in heldout.items():
            if (domain, decoding) in skip:
                continue
            tasks = tasks[:config.eval.n]
            line = {"stage": stage, "step": step, "split": "heldout", "domain": domain,
                    "decoding": decoding}
            if domain == TERMINAL:
                lines.append({**line, **terminal_domain.evaluate(
                    terminal, params, tasks, seed=config.seed, num_samples=rc.num_samples,
                    greedy=rc.greedy, summarize=eval_summary)})
                if on_line:
                    on_line(lines[-1])
                continue
            block, blocks = sharding.row_block(mesh)
            mine = tasks[len(tasks) * block // blocks:len(tasks) * (block + 1) // blocks]
            episodes = rollout_lib.generate(
                sampler, params, mine, tokenizer=tokenizer, key=jax.random.key(config.seed),
                config=rc, fmt=chat.FORMATS[config.rollout.chat_format], pool=pool,
                reward_config=rollout_lib.reward_config(config), verify_now=rc.max_attempts > 1)
            rollout_lib.verify_episodes(episodes, pool=pool,
                                        config=rollout_lib.reward_config(config))
            if blocks > 1:  # what eval_summary reads, of every process's episodes
                episodes = [types.SimpleNamespace(verdicts=v, finish=f)
                            for part in sharding.gather_blocks(
                                [(e.verdicts[-1:], e.finish) for e in episodes], mesh)
                            for v, f in part]
            lines.append({**line, **eval_summary(episodes, rc.num_samples)})
            if on_line:
                on_line(lines[-1])
    return lines


def eval_summary(episodes, samples: int) -> dict:
    """pass@1 (also `pass_rate`) and pass@k for k = 2, 4, ... up to `samples`, over episodes
    that are task-major (`samples` consecutive episodes per task); how the episodes finished,
    a turn cut at max_new_tokens counted as truncated (rollout.FINISHES first, then any other
    way an episode ended, e.g. a terminal episode's time_up)."""
    from sandbox.terminal.evaluate import summarize
    rows = [{"task": f"{i // samples}", "attempt": i % samples, "reward": e.verdicts[-1].reward if e.verdicts else 0.0,
             "passed": bool(e.verdicts and e.verdicts[-1].passed)}
            for i, e in enumerate(episodes)]
    summary = summarize(rows, samples)
    ks = {k: summary[k] for k in summary if k.startswith("pass@")}
    finishes = [e.finish for e in episodes]
    return {"pass_rate": ks["pass@1"], **ks, "n": len(episodes) // samples, "samples": samples,
            "truncated": finishes.count("truncated") / len(finishes),
            "finish": {f: finishes.count(f) for f in dict.fromkeys(
                (*rollout_lib.FINISHES, *sorted(set(finishes)))) if f in finishes}}


def _evaluate_once(path, stage, step, **kwargs):
    """Evaluates what eval.jsonl lacks of this (stage, step), row by row (`ptrain.eval_rows`)."""
    return eval_rows.evaluate_once(evaluate, path, stage, step, **kwargs)


# ======================================================================================= run


def run(config, workdir, *, mesh=None):
    """The main job (see the module docstring). Configs without a `tasks` section run the
    learner alone (SFT if sft.steps, then RL with its own rollout). Returns the eval lines."""
    run_record.start(config, workdir)  # config, inputs, a resume's changes; config.json
    os.makedirs(workdir, exist_ok=True)
    if "tasks" not in config:
        params = learner_lib.sft(config, os.path.join(workdir, "sft"), mesh=mesh) \
            if config.sft.steps else None
        learner_lib.train(config, workdir, params=params, mesh=mesh)
        return []

    # ------------------------------------------------------------ set-up
    tokenizer = make_tokenizer(config)
    config = derive_config(config, workdir, tokenizer)
    train, heldout = make_tasks(config, tokenizer, workdir)
    mesh = sharding.mesh_from_config(config.mesh) if mesh is None else mesh
    sampler = make_sampler(config, mesh, tokenizer)
    eval_path = os.path.join(workdir, "eval.jsonl")

    box, domains = config.sandbox, config.tasks.domains
    with contextlib.ExitStack() as stack:
        # The producers of the domains: ptrain tasks (the sandbox pool's verdicts) and
        # terminal tasks (docker); records of both mix in one batch by their weights.
        producers, pool, terminal = {}, None, None
        if set(domains) - {TERMINAL}:
            pool = stack.enter_context(fleet.open_pool(
                box.cluster, workers=box.workers, backend=box.backend, address=box.address))
            producers["tasks"] = rollout_lib.Tasks(sampler, tokenizer, config, pool)
        if TERMINAL in domains:
            terminal = producers[TERMINAL] = stack.enter_context(
                terminal_domain.producer(config, sampler, tokenizer, heldout[TERMINAL]))
        producer = (next(iter(producers.values())) if len(producers) == 1 else
                    mixed_producer.MixedProducer(producers, pad_id=rollout_lib.pad_id(tokenizer)))
        ev = dict(sampler=sampler, heldout=heldout, tokenizer=tokenizer, config=config,
                  pool=pool, terminal=terminal)
        # -------------------------------------------------------- a brought model's baseline
        if config.hf_model:
            _evaluate_once(eval_path, "base", params=learner_lib.build_model(config, mesh), step=0,
                           **ev)
        # -------------------------------------------------------- SFT, then its evaluation
        params = None
        if config.sft.steps:
            params = learner_lib.sft(config, os.path.join(workdir, "sft"), mesh=mesh,
                                     tokenizer=tokenizer)
            _evaluate_once(eval_path, "sft", params=params, step=config.sft.steps, **ev)
        # -------------------------------------------------------- RL, then its evaluation
        params = learner_lib.train(config, workdir, params=params, producer=producer,
                                   mesh=mesh, tokenizer=tokenizer,
                                   prompt_sources=prompt_sources(config, train, workdir))
        _evaluate_once(eval_path, "rl", params=params, step=config.steps, **ev)
    metrics_lib.plot_rewards(workdir, config.tasks.domains)
    return jsonl.read(eval_path)


def derive_config(config, workdir, tokenizer) -> ml_collections.ConfigDict:
    """A copy with what the run derives filled in: the vocabulary (model.vocab_size 0 means
    the tokenizer's, len(tokenizer) with its added tokens), checked against the tokenizer;
    the synthetic SFT demonstrations' file, and the stop ids of a turn (`chat.stop_ids`: the chat format's end of
    turn, the eos ids of hf_model's config.json / generation_config.json, the tokenizer's
    eos), each checked to exist in the vocabulary."""
    out = ml_collections.ConfigDict(config.to_dict())
    if out.model.vocab_size == 0:
        out.model.vocab_size = chat.vocab_len(tokenizer)
    vocab = learner_lib.model_config(out).vocab_size
    chat.check_vocab(tokenizer, vocab, what=f"{out.hf_model}/config.json" if out.hf_model
                     else "config.model.vocab_size")
    if out.tasks.source == "synthetic":
        out.sft.sources = (os.path.join(workdir, "tasks", "sft.jsonl"),)
        out.sft.records_fn = None
    from ptrain import hf
    eos = hf.eos_token_ids(out.hf_model) if out.hf_model else {}
    chat.check_ids(out.sampling.stop_token_ids, vocab, where="sampling.stop_token_ids")
    out.sampling.stop_token_ids = tuple(dict.fromkeys((*out.sampling.stop_token_ids, *chat.stop_ids(
        chat.FORMATS[out.rollout.chat_format], tokenizer, eos_sources=eos, vocab_size=vocab))))
    out.lock()
    return out


def make_sampler(config, mesh, tokenizer):
    """A sampler for the config's model, built abstractly (parameters come with each call)."""
    abstract_model = nnx.eval_shape(lambda: model_lib.Transformer(
        learner_lib.model_config(config), rngs=nnx.Rngs(0), mesh=mesh))
    return rollout_lib.make_sampler(abstract_model, config, tokenizer)


def make_tokenizer(config):
    """config.tokenizer (a brought model's, whatever the task source), else the synthetic
    source's word tokenizer (the quickstart's; the terminal tasks' for the terminal domain
    alone; the union of their pieces for both)."""
    if config.tasks.source == "synthetic" and not config.tokenizer:
        domains = config.tasks.domains
        parts = ([synthetic_tasks.WordTokenizer.for_tasks()] if set(domains) - {TERMINAL}
                 else []) + ([terminal_tasks.tokenizer()] if TERMINAL in domains else [])
        return parts[0] if len(parts) == 1 else synthetic_tasks.WordTokenizer(
            [p for tok in parts for p in tok.pieces])
    if not config.tokenizer:
        raise ValueError("tasks.source='jsonl' needs config.tokenizer (a local HF directory)")
    from ptrain import hf
    return hf.load_tokenizer(config.tokenizer)
