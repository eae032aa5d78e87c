"""The config checks that need the mesh's sizes: the batch and sequence dimensions must
divide their mesh axes (`ptrain.config.check_mesh`, and `check` when the config's mesh is
fixed)."""


def problems(config, sizes: dict) -> list[str]:
    """What does not divide over the mesh `sizes` (axis -> size): each a message naming the
    keys to change."""
    rows_axes = sizes.get("data", 1) * sizes.get("fsdp", 1) * sizes.get("expert", 1)
    seq = sizes.get("sequence", 1)
    rl, s, d = config.rl, config.sampling, config.data
    rows = d.prompts_per_step * s.num_samples
    micro = rl.microbatch_size or rows // max(rl.num_minibatches, 1)
    checks = [
        (micro % rows_axes == 0,
         f"the learner's microbatch of {micro} rows (rl.microbatch_size, or the minibatch of "
         f"data.prompts_per_step * sampling.num_samples / rl.num_minibatches) does not "
         f"divide over mesh data x fsdp x expert = {rows_axes}; change the batch or the mesh"),
        (rl.logprob_microbatch_size % rows_axes == 0,
         f"rl.logprob_microbatch_size={rl.logprob_microbatch_size} does not divide over mesh "
         f"data x fsdp x expert = {rows_axes}; change it or the mesh"),
    ]
    if config.sft.steps:
        sft_micro = config.sft.microbatch_size or config.sft.batch_size
        checks.append((sft_micro % rows_axes == 0,
                       f"sft's microbatch of {sft_micro} rows (sft.microbatch_size or "
                       f"sft.batch_size) does not divide over mesh data x fsdp x expert "
                       f"= {rows_axes}"))
    sc = config.sft
    if sc.steps and sc.packing and seq > 1:
        chunks = seq * (2 if sc.layout == "zigzag" else 1)
        checks.append((sc.seq_len % chunks == 0 and config.model.attention_impl == "ring",
                       f"packed SFT over mesh sequence={seq}: sft.seq_len={sc.seq_len} must "
                       f"divide into {chunks} chunks ({sc.layout}) and model.attention_impl "
                       "must be 'ring' (ring attention over the sequence axis)"))
    if seq > 1:
        length = config.rollout.max_len if "rollout" in config else s.max_new_tokens
        prompt = config.data.max_prompt_len
        checks.append((length % seq == 0 and prompt % seq == 0,
                       f"the continuation length {length} (sampling.max_new_tokens, or "
                       f"rollout.max_len in the closed loop) and data.max_prompt_len={prompt} "
                       f"must divide over mesh sequence={seq}"))
    return [message for ok, message in checks if not ok]
