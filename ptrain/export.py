"""A run's checkpoint as a Hugging Face model directory that `transformers` loads.

    step = export(workdir, out, step=None, stage="rl", peft_out=None)

The model is rebuilt from the config the run kept (`<workdir>/config.json`, written by
launch/train.py), its parameters read from `<workdir>/checkpoints` (RL; stage="sft":
`<workdir>/sft/checkpoints`) onto the host's CPU, and written with `ptrain.hf.export`:
config.json, safetensors, the tokenizer with its chat template (the run's `tokenizer`, else
the brought model's) and a generation_config.json that keeps the brought model's sampling
defaults and stops where the run's sampler stopped. A run on the quickstart's word tokenizer
has no Hugging Face tokenizer to write: the directory then holds the model only.

A LoRA run (config.lora.rank > 0) checkpoints its adapters only: the base is rebuilt as the
run built it (hf_model, or the seed), the adapters merged into it (`lora.merged`) for `out`,
and with `peft_out` also written as a PEFT adapter directory (`lora.save_peft`).
The command line is launch/export.py.
"""

from __future__ import annotations

import os

from absl import logging

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def checkpoint_dir(workdir: str, stage: str) -> str:
    return os.path.join(workdir, *(("sft",) if stage == "sft" else ()), "checkpoints")


def model_config(config, saved_shapes):
    """The run's architecture: the brought model's config.json, or config.model (vocab_size 0,
    the tokenizer's, is read from the saved embedding)."""
    from ptrain import hf
    from ptrain import model as model_lib
    if config.hf_model:
        return hf.config_from_hf(hf.read_config(config.hf_model))
    fields = config.model.to_dict()
    if not fields.get("vocab_size"):
        fields["vocab_size"] = saved_shapes[("embed",)][0]
    return model_lib.ModelConfig(**fields)


def tokenizer_dir(config) -> str | None:
    """The run's Hugging Face tokenizer: config.tokenizer, else the brought model's own."""
    if config.tokenizer:
        return config.tokenizer
    if config.hf_model and any(os.path.exists(os.path.join(config.hf_model, f))
                               for f in TOKENIZER_FILES):
        return config.hf_model
    return None


def stop_ids(config, tokenizer) -> tuple[int, ...]:
    """Where the run's sampler ended a turn: the chat format's end of turn and the eos ids
    (`chat.stop_ids`), and sampling.stop_token_ids."""
    from ptrain import chat, hf
    from ptrain.envs import synthetic
    extra = tuple(config.sampling.stop_token_ids)
    if tokenizer is None:
        if "tasks" in config and not config.tokenizer:  # the environments' word tokenizer's eos
            extra += (synthetic.EOS,)
        return tuple(dict.fromkeys(int(i) for i in extra))
    fmt = chat.get(config.rollout.chat_format) if "rollout" in config else chat.PLAIN
    eos = hf.eos_token_ids(config.hf_model) if config.hf_model else {}
    return tuple(dict.fromkeys((*chat.stop_ids(fmt, tokenizer, eos_sources=eos), *extra)))


def export(workdir: str, out: str, *, step: int | None = None, stage: str = "rl",
           peft_out: str | None = None) -> int:
    """Writes `out` from the run in `workdir`; returns the step exported."""
    import jax
    from flax import nnx

    from ptrain import checkpoint as checkpoint_lib
    from ptrain import hf, lora, metrics, sharding
    from ptrain import model as model_lib

    config = metrics.read_run_config(workdir)
    directory = checkpoint_dir(workdir, stage)
    with checkpoint_lib.Checkpointer(directory) as ckpt:
        steps = ckpt.all_steps()
        if not steps:
            other = "sft" if stage == "rl" else "rl"
            hint = (f"; --stage={other} exports those in {checkpoint_dir(workdir, other)}"
                    if os.path.isdir(checkpoint_dir(workdir, other)) else "")
            raise FileNotFoundError(f"no complete checkpoint in {directory}{hint}")
        step = steps[-1] if step is None else step
        if step not in steps:
            raise ValueError(f"--step={step}: {directory} holds steps {steps}")
        saved = ckpt.param_shapes(step)
        config_m = model_config(config, saved)
        if config.lora.rank:  # the checkpoint holds the adapters (`_lora_base` the rest)
            config_m = lora.configure(config_m, config.lora)
        _, abstract = sharding.abstract(
            lambda: model_lib.Transformer(config_m, rngs=nnx.Rngs(0)))
        cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
        target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=cpu),
                              abstract)
        if config.lora.rank:
            target = lora.split(target)[0]
        wanted = dict(_param_paths(target))
        if wanted != saved:
            diff = sorted(set(wanted.items()) ^ set(saved.items()))[:4]
            raise ValueError(f"the checkpoint in {directory} does not hold the model that "
                             f"{workdir}/config.json describes (path, shape) differences: {diff}")
        params = ckpt.restore_params(step, params=target)
    if config.lora.rank:
        params = lora.join(params, _lora_base(config, config_m))
        if peft_out:
            lora.save_peft(params, config_m, peft_out, base_model=config.hf_model)
        params, config_m = lora.merged(params, config_m)
    elif peft_out:
        raise ValueError("--peft_out: the run has no adapters (config.lora.rank is 0)")
    path = tokenizer_dir(config)
    tokenizer = hf.load_tokenizer(path) if path else None
    if tokenizer is None:
        logging.warning("the run has no Hugging Face tokenizer (config.tokenizer and hf_model "
                        "are empty): %s holds the model without one", out)
    hf.export(params, config_m, out, tokenizer=tokenizer, base_dir=config.hf_model or None,
              stop_ids=stop_ids(config, tokenizer))
    return step


def _lora_base(config, config_m):
    """A LoRA run's frozen base, as the learner built it (`learner.build_model`), on the CPU."""
    import jax
    from flax import nnx

    from ptrain import hf, lora, quant
    from ptrain import model as model_lib
    with jax.default_device(jax.devices("cpu")[0]):
        if config.hf_model:
            base = hf.load(config.hf_model, param_dtype=lora.float_dtype(config.lora))[0]
        else:
            base = model_lib.init(lora.base_config(config_m), seed=config.seed)
    base = lora.split(nnx.state(base))[1]
    return quant.quantize_state(base) if config_m.int8_base else base


def _param_paths(state):
    """(path, shape) of each parameter of an nnx state, paths as `param_shapes` spells them."""
    import jax
    from flax import nnx
    for key_path, leaf in jax.tree_util.tree_leaves_with_path(
            state, is_leaf=lambda x: isinstance(x, nnx.Variable)):
        names = tuple(str(getattr(k, "key", k)) for k in key_path)
        yield (names[:-1] if names and names[-1] == "value" else names), tuple(
            leaf.get_value().shape if isinstance(leaf, nnx.Variable) else leaf.shape)
