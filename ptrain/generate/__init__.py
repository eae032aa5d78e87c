"""Generation: turning a policy's parameters into sampled tokens and their log-probs.

- `sampler`: one batch of prompts, G samples each, decoded together (static shapes).
- `engine`: the rollout engine (continuous batching over decode slots, multi-turn requests);
  `kv_slots` its device programs, `buckets` the padded sizes they compile for.
- `engine_sampler`: the engine behind the producers' sampler interface.
- `interrupt`: switching a generation in flight to newer weights (rl.interrupt).
- `decode_weights`: the engine's inference copy of the parameters, refreshed at each sync.
- `prefill`: a group's prompt run once, shared by the sampler and the learner.
"""
