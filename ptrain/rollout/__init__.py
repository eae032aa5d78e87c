"""Producers of a step's batch, and the episodes they run: single- and multi-turn, with tool
calls run in the sandbox, and retries.

One protocol, `Producer`: `generate(params, records, key)` is the device part (sampling,
tool calls), `score(generated) -> batch.Batch` the host part (rewards or sandbox verdicts,
packing). `learner.train` draws every batch through one; with rl.staleness=k it scores
each batch in a thread while the next ones are generated. Three producers:

  SingleTurn    G samples per prompt record, scored by `reward_fn(record, completion_ids,
                completion_text)` (the learner's default, `config.reward_fn`)
  Tasks         `ptrain.tasks.Task`s (or task records) of environments (`ptrain.envs`):
                multi-turn episodes with their tools' calls, verdicts from each task's
                environment (the sandbox pool's; the closed loop's)
  Agents        tasks of agent-driven environments: an external agent program per episode
                against the served policy (`ptrain.serve`), verdicts from its environment
  FromFunction  a `rollout_fn(params, records, key) -> Batch` (generate and score in one)

The package's rooms:

  episodes.py   the `Episode` record, the turn loop (`generate`), `verify_episodes`,
                `to_batch` (see its docstring: token in, token out, turns, self-correction)
  agents.py     agent-driven episodes (`Agent`, `run_episodes`): a subprocess or sandboxed
                program against the endpoint, the recorded segments as `Episode`s
  turns.py      a model turn and what follows it, shared by the per-turn and engine paths
  producers.py  the producers above, `make_sampler`, the config's episode settings
  mixed.py      one batch from several producers (records routed by environment)

Its public names are importable from here (`rollout.generate`, `rollout.Tasks`, ...).
"""

from ptrain.rollout.episodes import (ATTEMPT_REWARDS, FINISHES, Episode,  # noqa: F401
                                     RolloutConfig, builtin, close, generate, render_prompt,
                                     render_prompts, sample_across, to_batch, verify_episodes)
from ptrain.rollout.agents import Agent, run_episodes  # noqa: F401
from ptrain.rollout.producers import (Agents, FromFunction, Producer, SingleTurn, Tasks,  # noqa: F401
                                      decode, make_sampler, pad_id, reward_config,
                                      rollout_config)
