"""Programs that tests run both in one process x 8 devices and in N processes (multiprocess.py).

Each returns plain numpy / Python values so the two runs can be compared.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ptrain import sharding


def helpers(rows: int = 16) -> dict:
    """sharding's global-array helpers on three meshes: batch over all devices, over fsdp=2
    (tensor=4 inside a process), and replicated (tensor over all devices)."""
    out = {"process": jax.process_index(), "count": jax.process_count()}
    x_bt = np.arange(rows * 3, dtype=np.float32).reshape(rows, 3)
    lengths_b = np.arange(rows, dtype=np.int32) % 5
    for name, mesh in [("fsdp", sharding.make_mesh(fsdp=-1)),
                       ("fsdp2", sharding.make_mesh(fsdp=2, tensor=-1)),
                       ("tensor", sharding.make_mesh(fsdp=1, tensor=-1))]:
        rs = sharding.local_rows(mesh, rows)
        x, lengths = sharding.from_process_local((x_bt[rs], lengths_b[rs]), mesh,
                                                 global_rows=rows)
        y = jax.jit(lambda a, n: a * 2.0 + a.sum() + n[:, None])(x, lengths)
        host = sharding.to_memory(y, "pinned_host")  # (kl.ref_offload's round trip)
        back = sharding.to_memory(host, "device")
        out[name] = {"rows": (rs.start, rs.stop), "whole": sharding.to_host(y),
                     "local": sharding.to_host_local(y),
                     "sum": float(sharding.to_host(jnp.sum(y))),
                     "memory": (host.sharding.memory_kind, back.sharding.memory_kind,
                                back.sharding == y.sharding),
                     "back": sharding.to_host(back)}
        # Without global_rows: inferred from how many processes hold different rows.
        again = sharding.from_process_local(x_bt[rs], mesh, axes=("batch", None))
        out[name]["inferred_shape"] = tuple(again.shape)
    # Host values that differ per process, agreed before they steer control flow.
    mine = 3 + 4 * jax.process_index()
    out["max"] = sharding.agree(mine, "max")
    out["min"] = sharding.agree(mine, "min")
    out["sum"] = sharding.agree(mine, "sum")
    out["any"] = sharding.agree(jax.process_index() == 1, "any")
    out["all"] = sharding.agree(jax.process_index() == 1, "all")
    out["vec"] = sharding.agree(np.array([mine, -mine]), "max")
    out["equal"] = sharding.agree(7, "equal")
    try:
        sharding.agree(mine, "equal")
        out["equal_error"] = None
    except ValueError as e:
        out["equal_error"] = str(e)
    return out


def fails_on_one() -> None:
    """Process 1 raises; the harness must report it instead of waiting on process 0."""
    if jax.process_index() == 1:
        1 / 0
    sharding.agree(1, "max")  # process 0 waits here for process 1, which is gone


def sleeps(marker: str) -> None:
    """Writes `marker` (this worker runs), then sleeps until it is killed."""
    import os
    import time
    with open(marker + f".{jax.process_index()}.tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(marker + f".{jax.process_index()}.tmp", marker + f".{jax.process_index()}")
    while True:
        time.sleep(1)


def holds(mb: int) -> None:
    """Holds `mb` MiB of (touched) memory until it is killed."""
    import time
    held = np.ones(mb * 2**20 // 8)
    while True:
        time.sleep(1)
        held[0] += 1


SAMPLER_PROMPTS = [[1, 5, 9, 33, 2], [1, 7], [1, 40, 41, 12, 3, 3, 18, 30, 22, 9, 11], [4],
                   [1, 2, 3], [9, 9, 9, 9], [1, 30], [17, 2, 5, 6, 7, 8]]


def _decode_chars(ids):
    return "".join(chr(97 + i % 26) for i in ids)


def _sampler_model_and_prompts():
    """The samplers' model (fsdp over all devices), its state, and this process's block of
    SAMPLER_PROMPTS."""
    from flax import nnx

    from ptrain import model as M
    config = M.ModelConfig(vocab_size=48, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2,
                           d_ff=64)
    n, p = jax.process_count(), jax.process_index()
    k = len(SAMPLER_PROMPTS) // n
    model = M.init(config, seed=3, mesh=sharding.make_mesh(fsdp=-1))
    return model, nnx.state(model), SAMPLER_PROMPTS[p * k:(p + 1) * k]


def sampler_program() -> dict:
    """The sampler with each process passing its own prompts (rows over fsdp): random
    samples with an explicit key, greedy ones with stop strings (a host loop whose stops are
    agreed across processes). One prefill compilation, two decode ones."""
    from ptrain.generate import sampler as S
    model, params, prompts = _sampler_model_and_prompts()
    sampler = S.Sampler(model, decode=_decode_chars, stop_check_every=3)
    a = sampler.sample(params, prompts, max_new_tokens=8, num_samples=2, temperature=0.8,
                       key=jax.random.key(7))
    b = sampler.sample(params, prompts, max_new_tokens=8, num_samples=2, greedy=True,
                       stop_strings=("c", "f", "k", "p"))
    return {k: (s.tokens, s.logp, s.logp_t1, s.lengths, s.finish_reasons, s.prompt_index)
            for k, s in (("random", a), ("stops", b))}


def engine_program() -> dict:
    """The rollout engine behind the producers (sampling.engine) with each process passing
    its own prompts: every process decodes its own copy of the fsdp-sharded policy (gathered
    at the weight sync), sampled rows (temperature, top-p) with an explicit key, greedy ones
    with stop strings; then a second sync after the parameters change."""
    from ptrain.generate import engine_sampler
    model, params, prompts = _sampler_model_and_prompts()
    sampler = engine_sampler.EngineSampler(model, slots=4, decode=_decode_chars,
                                           stop_check_every=3)
    out = {}
    a = sampler.sample(params, prompts, max_new_tokens=8, num_samples=2, temperature=0.8,
                       top_p=0.9, key=jax.random.key(7), prompt_len=16)
    b = sampler.sample(params, prompts, max_new_tokens=8, num_samples=2, greedy=True,
                       stop_strings=("c", "f", "k", "p"), prompt_len=16)
    scaled = jax.jit(lambda s: jax.tree.map(lambda x: x * 1.5, s))(params)  # "an update"
    c = sampler.sample(scaled, prompts, max_new_tokens=8, num_samples=1, greedy=True,
                       prompt_len=16)
    for name, s in (("random", a), ("stops", b), ("updated", c)):
        out[name] = (s.tokens, s.logp, s.logp_temp, s.logp_t1, s.lengths, s.finish_reasons,
                     s.prompt_index)
    out["syncs"] = sampler.weights.syncs if sampler.weights is not None else 0
    held = {d for x in jax.tree.leaves(getattr(sampler.weights, "params", None))
            for d in x.devices()}
    out["devices"] = (sorted({d.process_index for d in held}), len(held))
    return out


def checkpoint_program(directory: str, save: bool) -> dict:
    """Save step 5 (arrays over fsdp, each process its own data state) and restore it onto
    another mesh; or only restore what another process count saved."""
    import optax

    from ptrain.checkpoint import Checkpointer
    mesh = sharding.make_mesh(fsdp=-1)
    other = sharding.make_mesh(fsdp=2, tensor=-1)
    rows = sharding.local_rows(mesh, 16)
    w = np.arange(16 * 4, dtype=np.float32).reshape(16, 4)
    params = {"w_dv": sharding.from_process_local(w[rows], mesh, axes=("batch", None),
                                                  global_rows=16),
              "b": jax.device_put(jnp.arange(4.0), jax.sharding.NamedSharding(
                  mesh, jax.sharding.PartitionSpec()))}
    opt_state = optax.adam(0.1).init(params)
    rng = jax.random.key(3)
    out = {}
    with Checkpointer(directory, max_to_keep=2) as ckpt:
        if save:
            grads = jax.tree.map(jnp.ones_like, params)
            updates, opt_state = optax.adam(0.1).update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            ckpt.save(5, params=params, opt_state=opt_state, rng=jax.random.fold_in(rng, 5),
                      data_state={"pos": 10 + jax.process_index()}, extra={"kl": 0.5})
            ckpt.wait()
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding.named(
            other, ("batch", None)[:x.ndim], x.shape)), (params, opt_state))
    with Checkpointer(directory) as ckpt:
        restored = ckpt.restore(params=target[0], opt_state=target[1], rng=rng)
    out["step"], out["extra"], out["data_state"] = restored.step, restored.extra, \
        restored.data_state
    out["specs"] = [tuple(x.sharding.spec) for x in jax.tree.leaves(restored.params)]
    out["values"] = sharding.to_host((restored.params, restored.opt_state))
    out["rng"] = np.asarray(jax.random.key_data(restored.rng))
    return out


def small_programs(saved_by_one: str, save_to: str) -> dict:
    """`helpers`, `sampler_program`, and `checkpoint_program` twice (restore what another
    process count saved in `saved_by_one`, save and restore in `save_to`), in one process
    start: what each returned."""
    return {"helpers": helpers(), "sampler": sampler_program(), "engine": engine_program(),
            "restored": checkpoint_program(saved_by_one, save=False),
            "saved": checkpoint_program(save_to, save=True)}


# ------------------------------------------------------------------------ the terminal domain

class ScriptedPolicy:
    """The real sampler (its prefill and decode programs span the processes), each row's
    text then scripted by its history, so that the episodes' turns differ by process: the
    tasks in `answers_at_once` answer "done" in their first turn, the others run their
    command (the demonstrations' mistake on odd rows) and say "done" after its output. The
    log-probs are the real sampler's (of its own tokens), so that equal layouts show equal
    sampling. `calls`: the rows of every sampler call (over all processes' histories)."""

    def __init__(self, sampler, tok, by_instruction, answers_at_once):
        self.sampler, self.mesh, self.tok = sampler, sampler.mesh, tok
        self.by_instruction, self.at_once, self.calls = by_instruction, answers_at_once, []

    def sample(self, params, prompts, *, max_new_tokens, stop_token_ids, num_samples=1,
               **kwargs):
        from ptrain import chat
        from ptrain.envs.terminal import generated as terminal_tasks
        out = self.sampler.sample(params, prompts, max_new_tokens=max_new_tokens,
                                  stop_token_ids=stop_token_ids, num_samples=num_samples,
                                  **kwargs)
        histories = [ids for ids in prompts for _ in range(num_samples)]
        self.calls.append(len(histories))
        tokens, lengths = np.zeros_like(out.tokens), np.zeros_like(out.lengths)
        for i, ids in enumerate(histories):
            text = self.tok.decode(list(ids))
            if "<tool_response>" in text or text in self.at_once:
                row = chat.encode(self.tok, "done") + [self.tok.eos_token_id]
            else:  # a call turn ends at its </tool_call>
                g = self.by_instruction[text]
                row = chat.encode(self.tok, terminal_tasks.call_text(g.good if i % 2 == 0
                                                                     else g.bad))
            assert row[-1] in stop_token_ids and len(row) <= max_new_tokens
            tokens[i, :len(row)], lengths[i] = row, len(row)
        return dataclasses.replace(out, tokens=tokens, lengths=lengths,
                                   finish_reasons=["stop"] * len(histories))


def terminal_program(root: str) -> dict:
    """The terminal domain on this process's block of the records (bwrap task boxes, the
    real sampler under `ScriptedPolicy`): one batch of episodes of two terminal environments
    (one has tasks on process 0 only), gathered; and the held-out evaluation of 3 tasks
    (uneven blocks, `closed_loop.evaluate`). Process 0's episodes end after one turn,
    process 1's go on."""
    import os
    from flax import nnx
    from ptrain import batch as batch_lib
    from ptrain import closed_loop, rollout
    from ptrain import config as config_lib
    from ptrain.envs import terminal as terminal_env
    from ptrain import model as M
    from ptrain.envs.terminal import generated as terminal_tasks
    from ptrain.generate import sampler as S
    from sandbox import terminal
    tasks = terminal_tasks.generate(os.path.join(root, f"p{jax.process_index()}"), 4, seed=0,
                                    split="train")
    tok = terminal_tasks.tokenizer()
    mesh = sharding.make_mesh(fsdp=-1)
    model = M.init(M.ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_layers=1,
                                 n_heads=4, n_kv_heads=2, d_ff=64), seed=3, mesh=mesh)
    policy = ScriptedPolicy(S.Sampler(model), tok, {g.instruction: g for g in tasks},
                            {tasks[0].instruction, tasks[1].instruction})
    records = [dataclasses.replace(g, domain=d)
               for g, d in zip(tasks, ("terminal", "other", "terminal", "terminal"))]
    block, blocks = sharding.row_block(mesh)
    mine = records[len(records) * block // blocks:len(records) * (block + 1) // blocks]
    c = config_lib.defaults(closed_loop=True)
    c.sampling.update(num_samples=2, max_new_tokens=56, stop_token_ids=(tok.eos_token_id,))
    c.rollout.update(max_turns=3, max_len=96)
    c.data.max_prompt_len = 24
    c.eval.n = 3
    params = nnx.state(model)
    with terminal.Harness(backend="bwrap", max_idle=8) as harness:
        env = dataclasses.replace(terminal_env.make(system="", threads=4), open_session=lambda
                                  t: harness.episode(terminal.load_task(t.task_dir)))
        envs = {name: dataclasses.replace(env, name=name) for name in ("terminal", "other")}
        producer = rollout.Tasks(policy, tok, c, None, envs=envs)
        batch = batch_lib.gather(producer.score(producer.generate(params, mine,
                                                                  jax.random.key(5))), mesh)
        train_calls = list(policy.calls)
        (line,) = closed_loop.evaluate(policy, params, {"terminal": tasks[:3]}, tokenizer=tok,
                                       config=c, pool=None, stage="rl", step=1,
                                       envs=[envs["terminal"]])
    rows = sorted(range(len(batch)), key=lambda i: (batch.meta[i]["prompt"], i))
    return {"calls": train_calls, "eval_calls": policy.calls[len(train_calls):],
            "eval": line, "tasks": [batch.meta[i]["prompt"] for i in rows],
            "turns": [batch.meta[i]["turns"] for i in rows],
            "tool_calls": [batch.meta[i]["tool_calls"] for i in rows],
            "rewards": batch.rewards_b[rows], "tokens": batch.tokens_bn[rows],
            "mask": batch.loss_mask_bn[rows], "logp": batch.rollout_logp_bn[rows],
            "groups": len(set(batch.group_ids_b.tolist()))}


# ---------------------------------------------------------------------- the learner's phases

def _toy_config(**changes):
    from configs import grpo_toy
    c = grpo_toy.get_config()
    c.checkpoint.async_save = False
    c.update_from_flattened_dict(changes)  # dotted keys, e.g. 'rl.staleness'
    return c


def sft_records(seed):
    """(prompt, completion) pairs of the toy vocabulary: a completion of 1-8 TARGET tokens."""
    import random
    rng = random.Random(seed)
    return [{"prompt_ids": [1] + [rng.randrange(2, 32) for _ in range(rng.randint(1, 6))],
             "completion_ids": [7] * rng.randint(1, 8)} for _ in range(64)]


def _run_metrics(workdir):
    import os

    from ptrain.metrics import read_jsonl
    path = os.path.join(workdir, "metrics.jsonl")
    if jax.process_index() or not os.path.exists(path):  # only process 0 writes logs
        return None
    # Timings, and what the engines did apart from the tokens (their number of syncs, calls
    # and queues depend on how many engines there are), are not compared.
    return [{k: v for k, v in r.items() if not k.startswith("time/") and (
        not k.startswith("engine/") or k in ("engine/tokens", "engine/prefill_tokens"))}
        for r in read_jsonl(path)]


def _copy(params):
    return jax.tree.map(jnp.copy, params)


def _on_mesh(host, mesh):
    """Whole host parameters (numpy) placed as a fresh toy model's are on `mesh`."""
    from flax import nnx

    from ptrain import learner as L
    from ptrain import model as M
    like = sharding.abstract(lambda: M.Transformer(L.model_config(_toy_config()),
                                                   rngs=nnx.Rngs(0), mesh=mesh), mesh)[1]
    return jax.tree.map(lambda h, x: jax.make_array_from_callback(
        x.shape, x.sharding, lambda index: h[index]), host, like)


# The learner's phases, in order. Each RL phase but multiturn (another vocabulary) starts
# from SFT's parameters.
PHASES = ("sft", "sft_packed", "grpo", "ppo", "multiturn", "multiturn_engine")
# Where a process may SIGKILL itself in a step (the step under way: updates finished + 1):
# entering a producer.generate call, a reward (producer.score), the update, or the
# checkpoint save (after the step's metrics are written). With rl.staleness=1 (the ppo
# phase) batch t+1 is generated and scored in threads while update t runs, so "generate"
# and "score" there are not tied to one step: only the other two points.
KILL_POINTS = ("generate", "score", "update", "save")
STALE_KILL_POINTS = ("update", "save")


def _rl_config(steps, ref_offload=False):
    """The grpo phase: GRPO with DAPO dynamic sampling and KL (the reference in host memory
    between steps with `ref_offload`), a checkpoint a step."""
    return _toy_config(**{"steps": steps, "checkpoint.every": 1, "dapo.dynamic_sampling": True,
                          "dapo.max_gen_batches": 3, "kl.coef": 0.01, "sampling.num_samples": 4,
                          "kl.ref_offload": ref_offload})


def _ppo_config(steps):
    """The ppo phase: PPO's critic (GAE) with staleness 1 (batch t+1 generated and scored in
    threads during step t) and KL, a checkpoint a step."""
    return _toy_config(**{"steps": steps, "checkpoint.every": 1, "rl.estimator": "gae",
                          "rl.staleness": 1, "critic.optim.lr": 1e-2,
                          "critic.optim.weight_decay": 0.0, "kl.coef": 0.01,
                          "sampling.num_samples": 4})


class _Killer:
    """Patches the RL loop's stages so that process `victim` SIGKILLs itself at `point` of
    step `step`, first writing `marker` (so a test knows it died there); the run resumes
    from step `start`."""

    def __init__(self, victim, step, point, marker, start):
        import os
        import signal

        from ptrain import checkpoint
        from ptrain import learner as L
        from ptrain import rollout
        self.updates = start  # finished: the step under way is updates + 1
        self.saved = (rollout.SingleTurn.generate, rollout.SingleTurn.score, L.Learner.update,
                      checkpoint.Checkpointer.save)
        generate, score, update, save = self.saved

        def die(where, at):
            if jax.process_index() == victim and where == point and at == step:
                with open(marker, "w") as f:
                    f.write(point)
                os.kill(os.getpid(), signal.SIGKILL)

        def generate_(this, *args, **kwargs):
            die("generate", self.updates + 1)
            return generate(this, *args, **kwargs)

        def score_(this, *args, **kwargs):
            die("score", self.updates + 1)
            return score(this, *args, **kwargs)

        def update_(this, *args, **kwargs):
            die("update", self.updates + 1)
            out = update(this, *args, **kwargs)
            self.updates += 1
            return out

        def save_(this, at, **kwargs):
            die("save", at)
            return save(this, at, **kwargs)

        rollout.SingleTurn.generate, rollout.SingleTurn.score = generate_, score_
        L.Learner.update, checkpoint.Checkpointer.save = update_, save_

    def close(self):
        from ptrain import checkpoint
        from ptrain import learner as L
        from ptrain import rollout
        (rollout.SingleTurn.generate, rollout.SingleTurn.score, L.Learner.update,
         checkpoint.Checkpointer.save) = self.saved


def _rl_phase(config, workdir, params, mesh, kill, start):
    """learner.train from `params` (resuming from workdir's latest checkpoint, step `start`),
    armed with `kill` ((victim, step, point, marker) or None). Returns process 0's metrics
    and the final parameters (whole)."""
    from ptrain import learner as L
    killer = _Killer(*kill, start) if kill else None
    try:
        params = L.train(config, workdir, params=params, mesh=mesh)
    finally:
        if killer:
            killer.close()
    return {"metrics": _run_metrics(workdir), "params": sharding.to_host(params)}


def learner_program(workdir: str, phases=PHASES, kills=None, split_sft=True,
                    ref_offload=False) -> dict:
    """The learner's phases on the mesh fsdp = all devices, each process its own rows:

    sft   three SFT steps (with `split_sft`: two, then a third resumed from the step-2
          checkpoint in a new `learner.sft` call);
    sft_packed  the same with sft.packing (records back to back in 8 rows of 32 tokens);
    sft_lora  the same unpacked with LoRA (rank-4 adapters attached to the base, trained
          alone; checkpoints hold the adapters);
    grpo  three GRPO steps from SFT's parameters, DAPO dynamic sampling (groups kept and
          filled globally), KL (with `ref_offload`, kl.ref_offload), a checkpoint each step;
    ppo   three PPO steps from SFT's parameters: the critic (GAE), rl.staleness=1, KL;
    multiturn  `multiturn_program`.

    The program may be killed and run again in the same `workdir` (a restart of every
    process): a phase that finished before is read back from <workdir>/<phase>.<process>.pkl
    (written as it ends), an RL phase resumes from its latest checkpoint. `kills`:
    {phase: [(victim, step, point), ...]}: that phase's run has process `victim` SIGKILL
    itself at (step, point) (KILL_POINTS), the first kill of the list that has not happened
    yet (<workdir>/killed-<phase>-<i> marks the ones that have). Returns {phase: the start
    steps of its runs, process 0's metrics and the final parameters (whole)}."""
    import os
    import pickle

    from flax import nnx

    from ptrain import checkpoint
    from ptrain import learner as L
    from ptrain import metrics
    metrics.MetricsWriter.plot = lambda self: None  # PNG curves: seconds, and not compared
    mesh = sharding.make_mesh(fsdp=-1)
    me, out = jax.process_index(), {}

    def done(phase):
        path = os.path.join(workdir, f"{phase}.{me}.pkl")
        if os.path.exists(path):
            with open(path, "rb") as f:
                out[phase] = pickle.load(f)
        return phase in out

    def finish(phase, result):
        out[phase] = result
        path = os.path.join(workdir, f"{phase}.{me}.pkl")
        with open(path + ".tmp", "wb") as f:
            pickle.dump(result, f)
        os.replace(path + ".tmp", path)

    def sft_params():
        if "sft" in out:
            return _on_mesh(out["sft"]["params"], mesh)
        return nnx.state(L.build_model(_toy_config(), mesh))

    sft_configs = {"sft": {"sft.batch_size": 16},
                   "sft_packed": {"sft.batch_size": 8, "sft.packing": True, "sft.seq_len": 32},
                   "sft_lora": {"sft.batch_size": 16, "lora.rank": 4, "lora.alpha": 16.0}}
    for phase, changes in sft_configs.items():
        if phase not in phases or done(phase):
            continue
        params = nnx.state(L.build_model(_toy_config(), mesh))
        c = _toy_config(**{"sft.records_fn": sft_records, "sft.steps": 3,
                           "checkpoint.every": 2, **changes})
        d = os.path.join(workdir, phase)
        if split_sft:
            c.sft.steps = 2
            L.sft(c, d, mesh=mesh, params=_copy(params))  # (its params are donated)
            c.sft.steps = 3
        params = L.sft(c, d, mesh=mesh, params=params)  # (split: resumed at step 2)
        finish(phase, {"metrics": _run_metrics(d), "params": sharding.to_host(params)})
    for phase, config in (("grpo", _rl_config), ("ppo", _ppo_config)):
        if phase not in phases or done(phase):
            continue
        d = os.path.join(workdir, phase)
        kill = None
        for i, (victim, step, point) in enumerate((kills or {}).get(phase, ())):
            marker = os.path.join(workdir, f"killed-{phase}-{i}")
            if not os.path.exists(marker):
                kill = (victim, step, point, marker)
                break
        os.makedirs(d, exist_ok=True)
        with checkpoint.Checkpointer(os.path.join(d, "checkpoints")) as ckpt:
            start = ckpt.latest_step() or 0
        with open(os.path.join(workdir, f"{phase}.starts.{me}"), "a") as f:
            f.write(f"{start}\n")  # before this run, which may be killed
        c = config(steps=3, **({"ref_offload": ref_offload} if phase == "grpo" else {}))
        result = _rl_phase(c, d, sft_params(), mesh, kill, start)
        with open(os.path.join(workdir, f"{phase}.starts.{me}")) as f:
            finish(phase, {**result, "starts": [int(x) for x in f.read().split()]})
    for phase in ("multiturn", "multiturn_engine"):
        if phase in phases and not done(phase):
            finish(phase, multiturn_program(os.path.join(workdir, phase), mesh,
                                            engine=phase == "multiturn_engine"))
    return out


PATTERNS = ("[a-f]", "[0-9]", "[g-p]", "[q-z]", "[A-M]", "[:=]", "[N-Z]", "[(]")
CALLS = 24  # whole python tool calls in the multi-turn vocabulary (`tool_tokenizer`)


def tool_tokenizer():
    """The task vocabulary plus CALLS pieces that are each a whole python tool call
    (print(k)): a random model writes one about every tenth token, so the episodes really
    call their tool (and sometimes a malformed one, from the vocabulary's own <tool_call>);
    and the Format verifier's feedback sentence as one piece (short retries: fewer shapes
    to compile)."""
    import re

    from ptrain import chat
    from ptrain import rewards
    from ptrain import tasks as T
    from ptrain.envs.synthetic import WordTokenizer
    calls = [chat.format_turn(chat.PLAIN, "", [chat.ToolCall("python", {"code": f"print({k})"})])
             for k in range(CALLS)]
    feedback = rewards.check_format(T.Format("^$"), "x").feedback

    class Tokenizer(WordTokenizer):
        def encode(self, text, add_special_tokens=False):
            parts = re.split(f"({re.escape(feedback)})", text)
            return [i for part in parts if part for i in (
                [self.ids[part]] if part == feedback else WordTokenizer.encode(self, part))]

    return Tokenizer(WordTokenizer.for_tasks().pieces + calls + [feedback])


def format_tasks(seed, n=16):
    """Task records judged by a Format pattern that random text often matches (so some
    episodes pass at their first attempt and others try again), with the python tool."""
    from ptrain import tasks as T
    return [T.to_record(T.Task(f"t{i}", "fmt", T.Format(PATTERNS[(i + seed) % 8]),
                               prompt=f"arith: what is {i} plus {seed}", tools=("python",)))
            for i in range(n)]


def multiturn_program(workdir: str, mesh=None, engine: bool = False) -> dict:
    """One multi-turn RL step: two model turns per attempt with the python tool (run in the
    process sandbox), and self-correction (a failed answer gets its feedback and a second
    attempt), so processes hold different numbers of live episodes each turn; through
    closed_loop's Tasks producer, then the held-out greedy evaluation. With `engine`, on the
    rollout engine (sampling.engine: each process runs its own episodes in its own slots).
    Returns process 0's metrics, the eval lines and the final parameters."""
    import os

    from ptrain import closed_loop as CL
    from ptrain import learner as L
    from ptrain import rollout
    tok = tool_tokenizer()
    c = CL.defaults()
    c.steps = 1
    c.model.update(vocab_size=tok.vocab_size, d_model=32, d_ff=64)
    c.data.update(records_fn=format_tasks, max_prompt_len=16, prompts_per_step=8)
    c.sampling.update(num_samples=2, max_new_tokens=6, stop_token_ids=(tok.eos_token_id,),
                      engine=engine, engine_slots=8)
    c.rl.update(num_minibatches=2)
    c.rollout.update(max_turns=2, max_attempts=2, attempt_reward="mean", max_len=56,
                     tool_timeout_s=120.0)  # (a timeout would differ between the runs)
    c.sandbox.backend = "process"
    c.optim.update(lr=1e-2, schedule="constant")
    c.checkpoint.async_save = False
    c.eval.n = 4  # 2 a process
    mesh = sharding.make_mesh(fsdp=-1) if mesh is None else mesh
    sampler = CL.make_sampler(c, mesh, tok)
    producer = rollout.Tasks(sampler, tok, c, pool=None)
    params = L.train(c, workdir, producer=producer, mesh=mesh, tokenizer=tok)
    heldout = {"fmt": [CL.tasks_lib.from_record(r) for r in format_tasks(5, n=4)]}
    lines = CL.evaluate(sampler, params, heldout, tokenizer=tok, config=c, pool=None,
                        stage="rl", step=1, envs=[rollout.builtin("fmt")])
    return {"metrics": _run_metrics(workdir), "eval": lines,
            "params": sharding.to_host(params)}
