"""A tiny GRPO run SIGKILLed at points drawn from a seed and restarted, for test_resume.

`python tests/resume_program.py ROOT STALENESS STEPS SEED KILLS [INTERRUPT [LORA [ADAPTIVE]]]`
imports everything
once, then
forks one child per run (the parent never starts JAX, so forking is safe): the uninterrupted
run in ROOT/reference, then one child per kill point in ROOT/killed, each resuming from what
the one before left and SIGKILLing itself at its point, and a last child that finishes the
run. It prints the kill points and how each child ended as JSON.

A kill point is (step, phase); the phases, in the order a step reaches them:

  generate  a producer.generate call begins (with staleness k: batch STEP + k, in the
            generation thread while update STEP runs; at a run's first step also batches
            STEP .. STEP + k - 1)
  score     a producer.score call begins (with staleness k in the scoring thread)

With staleness k the threads' calls are told apart by their order, not by the step the
learner is in when they begin: a run started at step s generates and scores batch s + n
at its n-th call, scheduled at step max(s, s + n - k).
  update    the PPO update of STEP begins
  write     the metrics of STEP have been written
  save      the checkpoint of STEP has been started (async: its arrays are being written)

The producer is the learner's default, `rollout.SingleTurn` (sample on the device, grpo_toy's
reward on the host), which rl.staleness=k overlaps as the closed loop does.

INTERRUPT=1: rl.interrupt on the engine (sampling.engine=True), the swap forced after the
first decode round of 4 tokens (`interrupt.Switch.at_round`, so that it does not depend on
the threads' timing); a resumed run trains on the finished batches its checkpoint saved,
so its n-th generate (and score) call is batch s + k + n's, at step s + n.
LORA=1: the policy trains rank-4 adapters on a frozen base (`ptrain.lora`); checkpoints hold
the adapters (and their optimizer state) only; lora.dropout=0.1, its masks drawn from the step.
ADAPTIVE=1: the prompts are two environments' (grpo_toy's prompts, halved, as domains "a" and
"b") drawn by the adaptive sampler (tasks.adaptive mode "progress" with a task filter,
`ptrain.mixture`): its state (weights' EMAs, RNG, positions, pending observations) is in the
checkpoint.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import traceback

sys.modules.setdefault("torch", None)  # tensorboardX imports torch if it can: 5 s per start
import jax  # noqa: E402
import ml_collections  # noqa: E402
from flax import nnx  # noqa: E402

from configs import grpo_toy  # noqa: E402
from ptrain import checkpoint as checkpoint_lib
from ptrain import learner
from ptrain import metrics
from ptrain import model as model_lib
from ptrain import rollout
from ptrain import sharding
from ptrain.envs import adaptive
from ptrain.generate import interrupt

PHASES = ("generate", "score", "update", "write", "save")
EVERY = 2  # checkpoint every 2 steps, keep 1: a kill during a save must not lose the last one


INTERRUPT = False  # set by main (every child inherits it)
LORA = False
ADAPTIVE = False


def config(staleness: int, steps: int):
    c = grpo_toy.get_config()
    if INTERRUPT:
        c.sampling.update(engine=True, engine_slots=8)
        c.rl.interrupt = True
    if LORA:
        c.lora.update(rank=4, alpha=16.0, dropout=0.1)  # (masks drawn from the step)
    c.steps = steps
    c.rl.staleness = staleness
    if staleness > 1:
        c.rl.tis_cap = 2.0  # the importance correction staleness k > 1 needs
    c.checkpoint.update(every=EVERY, keep=1)
    c.log.rollouts_every = 3
    c.data.prompts_per_step = 4
    c.sampling.num_samples = 4
    c.rl.num_minibatches = 1
    c.rl.microbatch_size = 0
    return c


def one_device():
    return sharding.make_mesh(fsdp=1, devices=jax.devices()[:1])


def run(workdir, staleness, steps, producer_cls=rollout.SingleTurn):
    """The run, with grpo_toy's reward through the default producer (`rollout.SingleTurn`:
    generate samples on the device, score computes the rewards on the host)."""
    c = config(staleness, steps)
    mesh = one_device()
    model = nnx.eval_shape(lambda: model_lib.Transformer(learner.model_config(c),
                                                         rngs=nnx.Rngs(0), mesh=mesh))
    producer = producer_cls(c, rollout.make_sampler(model, c))
    if not ADAPTIVE:
        return learner.train(c, workdir, producer=producer, mesh=mesh)
    records = grpo_toy.prompt_records(c.seed)
    sources = [([{**r, "domain": name, "id": j} for j, r in enumerate(records[i::2])], 1.0)
               for i, name in enumerate("ab")]
    section = ml_collections.ConfigDict(adaptive.section_defaults())
    section.update(mode="progress", filter_patience=1)
    c.data.records_fn = None
    return learner.train(c, workdir, producer=producer, mesh=mesh, prompt_sources=sources,
                         adaptive=section)


def _killing(workdir, phase, kill_step, staleness):
    """Patches the run's stages so that the process SIGKILLs itself at (phase, kill_step)."""
    latest = checkpoint_lib.Checkpointer(os.path.join(workdir, "checkpoints")).latest_step()
    now = {"step": (latest or 0) + 1}  # the step in progress
    first, calls = now["step"], {"generate": 0, "score": 0}
    loaded = INTERRUPT and latest is not None  # its pending batches come finished

    def point(name, step=None):
        if name == phase and (now["step"] if step is None else step) == kill_step:
            os.kill(os.getpid(), signal.SIGKILL)

    def scheduled(name):
        """The step that scheduled this generate or score call (see the module docstring)."""
        n, calls[name] = calls[name], calls[name] + 1
        if loaded:
            return first + n
        return max(first, first + n - staleness) if staleness else None

    class Killing(rollout.SingleTurn):
        def generate(self, *args):
            point("generate", scheduled("generate"))
            return super().generate(*args)

        def score(self, *args):
            point("score", scheduled("score"))
            return super().score(*args)

    update, write, save = (learner.Learner.update, metrics.MetricsWriter.write,
                           checkpoint_lib.Checkpointer.save)

    def update_(self, *args, **kwargs):
        point("update")
        return update(self, *args, **kwargs)

    def write_(self, step, values):
        write(self, step, values)
        point("write", step)
        now["step"] = step + 1

    def save_(self, step, **kwargs):
        save(self, step, **kwargs)
        point("save", step)

    learner.Learner.update = update_
    metrics.MetricsWriter.write = write_
    checkpoint_lib.Checkpointer.save = save_
    return Killing


def kill_points(seed, steps, kills, staleness):
    """`kills` (step, phase) points at distinct, increasing steps below the last (a step's
    generate runs ahead); "save" only at checkpoint steps, "generate" and "score" only where
    a step generates and scores (batch step + staleness within the run). Each restart resumes
    from a checkpoint at or before the step it died in, so the next point is still ahead."""
    rng = random.Random(seed)
    points = []
    for step in sorted(rng.sample(range(1, steps), kills)):
        phases = [p for p in PHASES if (p != "save" or step % EVERY == 0)
                  and (p not in ("generate", "score") or step + staleness <= steps)]
        points.append((step, rng.choice(phases)))
    return points


def _in_child(fn):
    """fn() in a forked child; returns its exit status (negative: killed by that signal)."""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            fn()
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def main(root, staleness, steps, seed, kills, interrupted=0, lora=0, adaptive_draw=0):
    global INTERRUPT, LORA, ADAPTIVE
    LORA, ADAPTIVE = bool(lora), bool(adaptive_draw)
    if interrupted:
        INTERRUPT = True
        interrupt.Switch.at_round, interrupt.Switch.every = 1, 4
    metrics.MetricsWriter.plot = lambda self: None  # PNG curves: seconds, and not compared
    points = kill_points(seed, steps, kills, staleness)
    report = {"points": points, "reference": _in_child(
        lambda: run(os.path.join(root, "reference"), staleness, steps))}
    workdir = os.path.join(root, "killed")
    report["killed"] = [_in_child(lambda: run(workdir, staleness, steps,
                                              _killing(workdir, phase, step, staleness)))
                        for step, phase in points]
    report["finished"] = _in_child(lambda: run(workdir, staleness, steps))
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:9]))
