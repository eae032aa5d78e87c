"""The main job: a policy that writes code and calls tools, rewarded by really running them.

`run(config, workdir)` reads top to bottom:

  tasks     per environment (`ptrain.envs`, named by import path in tasks.envs), a
            training split and a held-out split (instances never trained on): generated
            (the quickstart's default, `ptrain.envs.synthetic`) or read from task files in
            their formats; mixed by the environments' weights; prompt lengths and the
            vocabulary checked before anything runs
  eval      a brought model (hf_model) first: its baseline at step 0
  SFT       a warm start on demonstrations, loss on the model's own turns only
  eval      greedy pass@1 on the held-out split, per environment (and sampled pass@1 / pass@k
            with eval.sample) -> <workdir>/eval.jsonl, rows keyed by (stage, step)
  RL        `learner.train` with the `rollout.Tasks` producer: multi-turn episodes whose tool
            calls run in the sandbox, verdicts from each task's environment (run in the
            sandbox pool), scoring of batch t overlapped with generating batch t+1 when
            rl.staleness=1; every environment's episodes in the one turn loop and batch
            (the terminal tasks' in docker containers its `sessions` give for the run)
  eval      again, after RL; a reward-curve PNG and the run report (report.html,
            `ptrain.report`: held-out results, curves, a sample of episodes)

Everything lands in the work dir and the job resumes where it stopped: SFT and RL from their
checkpoints, evaluations that are already in eval.jsonl are not repeated.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
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
from ptrain import envs as envs_lib
from ptrain import jsonl
from ptrain import learner as learner_lib
from ptrain import metrics as metrics_lib
from ptrain import report
from ptrain import rollout as rollout_lib
from ptrain import run_record
from ptrain import sharding
from ptrain import tasks as tasks_lib
from ptrain.envs import synthetic
from ptrain.vision import run as vision_run


# ==================================================================================== config


def defaults() -> ml_collections.ConfigDict:
    """The learner's keys plus the closed loop's sections (`ptrain.config.defaults`)."""
    return config_lib.defaults(closed_loop=True)


def check_config(config) -> None:
    """The learner's checks, then the closed loop's sections (`ptrain.config.check`)."""
    config_lib.check(config, closed_loop=True)


# ===================================================================================== tasks


def environments(config) -> list:
    """The config's environments (`envs.load_all`: each entry's import path, args, name)."""
    return envs_lib.load_all(config.tasks.envs, key="tasks.envs")


def make_tasks(config, envs, tokenizer, workdir, vision=None):
    """(train, heldout): {env name: [task]} each, written under <workdir>/tasks/, and whether
    any environment gave SFT demonstrations (<workdir>/tasks/sft.jsonl: token ids with their
    loss masks). Checked before anything runs: no held-out prompt among the training ones, a
    held-out split for each environment when evaluation is on (eval.n > 0), the chat format
    against the tokenizer with the tasks' tools, every prompt's and demonstration's length.
    `vision`: a vision-language policy's `rollout.images.Vision` (environments get it in
    their Context for demonstrations with images; prompts with images are rendered with it,
    their images checked against its patch budget, and refused for a text model)."""
    os.makedirs(os.path.join(workdir, "tasks"), exist_ok=True)
    fmt = chat.FORMATS[config.rollout.chat_format]
    train, heldout, rows, tools = {}, {}, [], {}
    for env in envs:
        splits = env.tasks(envs_lib.Context(name=env.name, seed=config.seed, workdir=workdir,
                                            tokenizer=tokenizer, fmt=fmt, vision=vision))
        train[env.name], heldout[env.name] = list(splits.train), list(splits.heldout)
        _check_splits(env, train[env.name], heldout[env.name], config.eval.n)
        for split, found in (("train", train[env.name]), ("heldout", heldout[env.name])):
            jsonl.write([x.to_record() if hasattr(x, "to_record") else tasks_lib.to_record(x)
                         for x in found], _task_file(workdir, env.name, split))
        rows += list(splits.demonstrations)
        tools.update({t.name: t for x in train[env.name] for t in env.tools
                      if t.name in getattr(x, "tools", ())})
    check_format(fmt, tokenizer, [tools[name] for name in sorted(tools)])
    for env in envs:  # before anything is generated
        ids, _ = rollout_lib.render_prompts(train[env.name], [env] * len(train[env.name]),
                                            tokenizer, fmt, vision)
        tasks_lib.check_lengths(
            {x.id: len(p) for x, p in zip(train[env.name], ids)},
            config.data.max_prompt_len, key="data.max_prompt_len", what=f"{env.name} prompt")
    if rows:
        for part, key in (("prompt", "max_prompt_len"), ("completion", "max_completion_len")):
            tasks_lib.check_lengths({f"demonstration {i} ({r['domain']})": len(r[f"{part}_ids"])
                                     for i, r in enumerate(rows)}, config.sft[key],
                                    key=f"sft.{key}", what=f"SFT {part}")
        random.Random(config.seed).shuffle(rows)
        jsonl.write(rows, os.path.join(workdir, "tasks", "sft.jsonl"))
    return train, heldout, bool(rows)


def _check_splits(env, train, heldout, eval_n) -> None:
    where = f"environment {env.name!r}"
    if not train:
        raise ValueError(f"{where}: its training split is empty; give it tasks")
    if eval_n > 0 and not heldout:
        raise ValueError(f"{where}: its held-out split is empty and evaluation is on "
                         f"(eval.n={eval_n}): give it held-out tasks (its args), or set "
                         "eval.n=0")
    wrong = {getattr(x, "domain", None) for x in (*train, *heldout)} - {env.name}
    if wrong:
        raise ValueError(f"{where}: its tasks have domain(s) {sorted(map(str, wrong))}; a "
                         "task's domain is its environment's name (Context.name)")
    overlap = {_prompt_key(x) for x in train if hasattr(x, "prompt")} & {
        _prompt_key(x) for x in heldout if hasattr(x, "prompt")}
    if overlap:
        raise ValueError(f"{len(overlap)} {env.name} held-out prompt(s) also appear in its "
                         f"training split, e.g. {sorted(overlap)[0]!r}")


def _prompt_key(task) -> str:
    """A task's prompt, or its chat messages as JSON (tasks that have only messages, e.g.
    images and a question)."""
    return task.prompt or json.dumps(list(getattr(task, "messages", ())), sort_keys=True,
                                     default=str)


def prompt_sources(config, train) -> list:
    """The RL prompt stream's sources: each environment's training tasks, served as they are
    (tasks/<name>.train.jsonl holds their records), with its weight."""
    return [(train[env_name], float(entry.get("weight", 1.0)))
            for env_name, entry in zip(train, config.tasks.envs)]


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


# ================================================================================ evaluation


def evaluate(sampler, params, heldout, *, tokenizer, config, pool, stage, step, envs,
             skip=(), on_line=None, on_progress=None, vision=None):
    """Pass rates on the held-out split, per environment: greedy pass@1, and with eval.sample
    pass@1 and pass@k at the sampling temperature from sampling.num_samples samples per task
    (the unbiased estimator of Chen et al. 2021, `sandbox.terminal.evaluate.pass_at_k`), and
    the environment's own `eval_fields`. Returns eval.jsonl lines. With many processes each
    runs and scores its block of the tasks (one sampler call over all of them per turn) and
    the summary is of all episodes. (environment, decoding) pairs in `skip` are not run;
    `on_line(line)` follows each that is; `on_progress(env_name, n_tasks)` each call of
    `eval.tasks_per_call` held-out tasks (all of them when 0), whose episodes run at once: the
    first call samples with the seed's key, the one starting at task i with it folded with i.
    `vision`: a vision-language policy's image settings (`rollout.images.Vision`)."""
    lines = []
    decodings = [("greedy", dict(greedy=True, num_samples=1))]
    if config.eval.sample:
        decodings.append(("sample", dict(num_samples=config.sampling.num_samples)))
    for decoding, change in decodings:
        rc = rollout_lib.rollout_config(config, **change)
        for env in envs:
            if (env.name, decoding) in skip:
                continue
            tasks = heldout[env.name][:config.eval.n]
            if not tasks:
                continue
            line = {"stage": stage, "step": step, "split": "heldout", "domain": env.name,
                    "decoding": decoding}
            episodes = []
            per_call = config.eval.tasks_per_call or len(tasks)
            for start in range(0, len(tasks), per_call):  # bounded memory, progress per call
                episodes += _evaluate_tasks(
                    sampler, params, tasks[start:start + per_call], env, rc, config,
                    tokenizer=tokenizer, pool=pool, vision=vision,
                    key=jax.random.fold_in(jax.random.key(config.seed), start)
                    if start else jax.random.key(config.seed))
                if on_progress:
                    on_progress(env.name, min(start + per_call, len(tasks)) - start)
            lines.append({**line, **eval_summary(episodes, rc.num_samples),
                          **(env.eval_fields(tasks, episodes) if env.eval_fields else {})})
            if on_line:
                on_line(lines[-1])
    return lines


def _evaluate_tasks(sampler, params, tasks, env, rc, config, *, tokenizer, pool, key,
                    vision=None):
    """The judged episodes of held-out `tasks` (task-major): with many processes each runs
    its block, and the verdicts and finishes of every process's come back."""
    mesh = getattr(sampler, "mesh", None)
    block, blocks = sharding.row_block(mesh)
    mine = tasks[len(tasks) * block // blocks:len(tasks) * (block + 1) // blocks]
    episodes = rollout_lib.generate(
        sampler, params, mine, tokenizer=tokenizer, key=key, config=rc,
        fmt=chat.FORMATS[config.rollout.chat_format], pool=pool,
        reward_config=rollout_lib.reward_config(config), verify_now=rc.max_attempts > 1,
        envs={env.name: env}, vision=vision)
    rollout_lib.verify_episodes(episodes, pool=pool, config=rollout_lib.reward_config(config))
    if blocks == 1:
        return episodes
    return [types.SimpleNamespace(verdicts=v, finish=f)  # what eval_summary reads
            for part in sharding.gather_blocks([(e.verdicts[-1:], e.finish) for e in episodes],
                                               mesh)
            for v, f in part]


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
        if jax.process_index() == 0:
            report.write_report_quietly(workdir)
        return []

    # ------------------------------------------------------------ set-up (checked above)
    envs = environments(config)
    tokenizer = make_tokenizer(config, envs)
    vision = make_vision(config)
    train, heldout, demonstrations = make_tasks(config, envs, tokenizer, workdir, vision)
    if config.sft.steps and not (demonstrations or config.sft.sources or config.sft.records_fn):
        raise ValueError(f"config: sft.steps={config.sft.steps} but no SFT records: environments "
                         f"{[env.name for env in envs]} bring no demonstrations; set sft.sources "
                         "(JSONL of prompt/completion, e.g. from launch/sft_data.py) or "
                         "sft.steps=0")
    config = derive_config(config, workdir, tokenizer, demonstrations=demonstrations)
    mesh = sharding.mesh_from_config(config.mesh) if mesh is None else mesh
    sampler = make_sampler(config, mesh, tokenizer)
    eval_path = os.path.join(workdir, "eval.jsonl")

    box = config.sandbox
    with contextlib.ExitStack() as stack:
        # One producer for every environment's episodes (their verdicts in the sandbox pool,
        # opened where an environment without sessions of its own needs one); records of all
        # mix in one batch by their weights.
        pool = None
        if any(env.sessions is None for env in envs):
            pool = stack.enter_context(fleet.open_pool(
                box.cluster, workers=box.workers, backend=box.backend, address=box.address))
        envs = [dataclasses.replace(env, open_session=stack.enter_context(
            env.sessions(config, heldout[env.name]))) if env.sessions else env for env in envs]
        producer = rollout_lib.Tasks(sampler, tokenizer, config, pool,
                                     envs={env.name: env for env in envs}, vision=vision)
        ev = dict(sampler=sampler, heldout=heldout, tokenizer=tokenizer, config=config,
                  pool=pool, envs=envs, vision=vision)
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
                                   prompt_sources=prompt_sources(config, train),
                                   adaptive=config.tasks.adaptive)
        _evaluate_once(eval_path, "rl", params=params, step=config.steps, **ev)
    metrics_lib.plot_rewards(workdir, [env.name for env in envs])
    if jax.process_index() == 0:  # report.html: logged, never raised, if it cannot be written
        report.write_report_quietly(workdir)
    return jsonl.read(eval_path)


def derive_config(config, workdir, tokenizer, *,
                  demonstrations: bool = False) -> ml_collections.ConfigDict:
    """A copy with what the run derives filled in: the vocabulary (model.vocab_size 0 means
    the tokenizer's, len(tokenizer) with its added tokens), checked against the tokenizer;
    the environments' SFT demonstrations as its SFT data (`demonstrations`: make_tasks
    wrote them), and the stop ids of a turn (`chat.stop_ids`: the chat format's end of
    turn, the eos ids of hf_model's config.json / generation_config.json, the tokenizer's
    eos), each checked to exist in the vocabulary."""
    out = ml_collections.ConfigDict(config.to_dict())
    if out.model.vocab_size == 0:
        out.model.vocab_size = chat.vocab_len(tokenizer)
    vocab = learner_lib.model_config(out).vocab_size
    chat.check_vocab(tokenizer, vocab, what=f"{out.hf_model}/config.json" if out.hf_model
                     else "config.model.vocab_size")
    if demonstrations:
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
    """A sampler for the config's model (a VLModel for a vision-language hf_model), built
    abstractly (parameters come with each call)."""
    abstract_model = nnx.eval_shape(lambda: learner_lib.new_model(config, mesh))
    return rollout_lib.make_sampler(abstract_model, config, tokenizer)


def make_vision(config):
    """A vision-language hf_model's image settings for the rollouts (`rollout.images.Vision`:
    its image processing, the vision section's patch budgets); None for a text model."""
    return vision_run.vision(config, vision_run.vl_config(config, learner_lib.model_config(config)))


def make_tokenizer(config, envs):
    """config.tokenizer (a local HF directory), else the environments' own: their generated
    tasks' word tokenizers (one, or the union of their pieces)."""
    if config.tokenizer:
        from ptrain import hf
        return hf.load_tokenizer(config.tokenizer)
    parts = {}
    for env in envs:
        if env.tokenizer is not None:
            tok = env.tokenizer()
            parts.setdefault(tuple(tok.pieces), tok)
    if not parts:
        raise ValueError(f"environments {[env.name for env in envs]} bring no tokenizer: set "
                         "config.tokenizer (a local HF directory)")
    found = list(parts.values())
    return found[0] if len(found) == 1 else synthetic.WordTokenizer(
        [p for tok in found for p in tok.pieces])
