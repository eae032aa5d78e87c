"""Hugging Face parity: tiny random checkpoints written by `transformers` itself."""

import json
import os

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch (CPU) is the reference; pip install '.[test]'")
transformers = pytest.importorskip("transformers", reason="pip install '.[test]'")

from ptrain import hf, learner, safetensors_io, sharding  # noqa: E402

VOCAB = 128
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, max_position_embeddings=1024)

FAMILIES = {
    # Llama 3.1-style RoPE scaling, GQA, untied.
    "llama3": lambda: transformers.LlamaConfig(
        **SMALL, num_key_value_heads=2, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 32}),
    # Llama 3.2-style tied embeddings, MQA, with attention biases.
    "llama_tied_mqa_bias": lambda: transformers.LlamaConfig(
        **SMALL, num_key_value_heads=1, tie_word_embeddings=True, attention_bias=True),
    # Qwen2.5: q/k/v biases, tied, GQA.
    "qwen2": lambda: transformers.Qwen2Config(
        **SMALL, num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1e6),
    # Qwen3: per-head q/k RMSNorm, head_dim != d/h, untied, YaRN scaling.
    "qwen3_yarn": lambda: transformers.Qwen3Config(
        **SMALL, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                         "original_max_position_embeddings": 64}),
    # Qwen3 tied.
    "qwen3_tied": lambda: transformers.Qwen3Config(
        **SMALL, num_key_value_heads=4, tie_word_embeddings=True),
    # Qwen3-MoE: 8 experts, top-2 renormalised; layer 1 dense (mlp_only_layers).
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **SMALL, num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1]),
}


def _write_checkpoint(config, path, seed=0):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # perturb everything, norms and biases included, so each one matters
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    return model


def _tokens(batch=2, time=80, seed=0):
    return np.random.RandomState(seed).randint(0, VOCAB, (batch, time))


def _hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.float().numpy()


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def checkpoint(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    model = _write_checkpoint(FAMILIES[request.param](), path)
    return path, model


@pytest.mark.parametrize("impl", ["blockwise", "reference"])  # the default, and dense
def test_logits_match_transformers(checkpoint, impl):
    path, ref_model = checkpoint
    tokens = _tokens()
    model, config = hf.load(path, overrides={"attention_impl": impl, "attn_block_q": 32,
                                             "attn_block_k": 16})
    assert config.attention_impl == impl
    ours = np.asarray(model(tokens))
    assert ours.dtype == np.float32
    np.testing.assert_allclose(ours, _hf_logits(ref_model, tokens), atol=2e-4, rtol=0)
    assert config.vocab_size == VOCAB


def test_overriding_a_parameter_field_is_refused(checkpoint):
    with pytest.raises(ValueError, match=r"overrides \['d_model'\].*config.json"):
        hf.load(checkpoint[0], overrides={"d_model": 64})


def test_learner_applies_runtime_model_keys_to_a_checkpoint(checkpoint):
    path, _ = checkpoint
    c = learner.defaults()
    c.hf_model = path
    c.model.attention_impl = "reference"
    c.model.remat = "full"
    c.model.d_model = 12345  # a parameter shape: the checkpoint's wins
    config = learner.model_config(c)
    assert (config.attention_impl, config.remat) == ("reference", "full")
    assert config.d_model == hf.config_from_hf(hf.read_config(path)).d_model


def test_a_model_key_that_contradicts_config_json_is_an_error(checkpoint):
    path, _ = checkpoint
    ours = hf.config_from_hf(hf.read_config(path))
    c = learner.defaults()
    c.hf_model = path
    c.model.update(attention_impl="reference", remat="full")  # run-time keys may differ
    c.model.d_model = ours.d_model  # agreeing with config.json is fine
    learner.check_config(c)
    c.model.d_model = 12345
    with pytest.raises(ValueError, match=rf"model.d_model=12345 but hf_model's config.json .*"
                                         rf"gives d_model={ours.d_model}"):
        learner.check_config(c)


def test_round_trip_identical_tensors_and_transformers_loads_it(checkpoint, tmp_path):
    path, ref_model = checkpoint
    model, config = hf.load(path)
    out = str(tmp_path / "saved")
    hf.save(model, config, out, max_shard_bytes=40_000)  # force several shards + an index
    assert os.path.exists(os.path.join(out, "model.safetensors.index.json"))

    original = safetensors_io.File(os.path.join(path, "model.safetensors"))
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    expected = set(original.keys())
    if config.tie_embeddings:
        expected.discard("lm_head.weight")
    assert set(weight_map) == expected
    for name, file in weight_map.items():
        saved = safetensors_io.File(os.path.join(out, file)).array(name)
        np.testing.assert_array_equal(saved, original.array(name), err_msg=name)

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = _tokens(seed=1)
    np.testing.assert_array_equal(_hf_logits(reloaded, tokens), _hf_logits(ref_model, tokens))


def test_sharded_load_places_tensors_on_shards(tmp_path):
    path = str(tmp_path / "llama")
    ref_model = _write_checkpoint(FAMILIES["llama3"](), path)
    mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
    model, _ = hf.load(path, mesh=mesh)
    wq = model.layers.wq[...]
    assert wq.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor", None)
    shard_shapes = {s.data.shape for s in wq.addressable_shards}
    assert shard_shapes == {(2, 32, 2, 16)}  # [l, d/fsdp, h/tensor, e]
    assert model.embed[...].sharding.spec == jax.sharding.PartitionSpec("tensor", "fsdp")
    tokens = _tokens(batch=4)
    np.testing.assert_allclose(np.asarray(model(sharding.shard_batch(tokens, mesh))),
                               _hf_logits(ref_model, tokens), atol=2e-4, rtol=0)


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_moe_block_matches_transformers(norm_topk_prob):
    """One sparse MoE block against transformers' Qwen3MoeSparseMoeBlock, all dispatches."""
    from ptrain import moe
    config = FAMILIES["qwen3_moe"]()
    config.norm_topk_prob = norm_topk_prob
    torch.manual_seed(0)
    block = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(config)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.2)
    x = np.random.RandomState(0).randn(2, 24, 64).astype(np.float32)
    with torch.no_grad():
        want = block(torch.tensor(x)).numpy()
    e = block.experts
    f = config.moe_intermediate_size
    p = {"router": block.gate.weight.detach().numpy().T,
         "w_gate": e.gate_up_proj.detach().numpy()[:, :f].transpose(0, 2, 1),
         "w_up": e.gate_up_proj.detach().numpy()[:, f:].transpose(0, 2, 1),
         "w_down": e.down_proj.detach().numpy().transpose(0, 2, 1)}
    c = hf.config_from_hf(config.to_dict())
    assert c.norm_topk_prob == norm_topk_prob
    for dispatch in ("dropless", "capacity", "dense"):
        got, _ = moe.block(p, x, np.ones((2, 24)), c.replace(moe_dispatch=dispatch,
                                                            moe_capacity_factor=8.0), None)
        np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=0, err_msg=dispatch)


def test_sharded_moe_load_matches_transformers(tmp_path):
    path = str(tmp_path / "moe")
    ref_model = _write_checkpoint(FAMILIES["qwen3_moe"](), path)
    mesh = sharding.make_mesh(expert=4, fsdp=2)
    model, config = hf.load(path, mesh=mesh)
    assert config.n_experts == 8 and config.dense_layers == (1,)
    assert model.experts.w_gate[...].sharding.spec == jax.sharding.PartitionSpec(
        None, "expert", "fsdp", None)
    assert {s.data.shape for s in model.experts.w_gate[...].addressable_shards} == {
        (1, 2, 32, 32)}  # [MoE layers, experts / 4, d / 2, f]
    tokens = _tokens(batch=8, time=16)
    np.testing.assert_allclose(np.asarray(model(sharding.shard_batch(tokens, mesh))),
                               _hf_logits(ref_model, tokens), atol=2e-4, rtol=0)


def test_bfloat16_load_and_save(tmp_path):
    path = str(tmp_path / "qwen")
    ref_model = _write_checkpoint(FAMILIES["qwen2"](), path)
    model, config = hf.load(path, dtype="bfloat16")
    assert model.embed[...].dtype == jax.numpy.bfloat16 and config.dtype == "bfloat16"
    tokens = _tokens()
    ref = _hf_logits(ref_model, tokens)
    err = np.abs(np.asarray(model(tokens)) - ref).max()
    assert err < 0.1 * np.abs(ref).max()  # bfloat16 compute: close, not exact
    out = str(tmp_path / "bf16")
    hf.save(model, config, out)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert reloaded.model.embed_tokens.weight.dtype == torch.bfloat16


# ----------------------------------------------------------------------------- bad input

def test_no_config_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        hf.load(str(tmp_path))


def test_unsupported_architecture_names_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"],
                                                      "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM.*Qwen2ForCausalLM"):
        hf.load(str(tmp_path))


def test_unsupported_feature_is_named():
    config = FAMILIES["llama3"]().to_dict()
    config["hidden_act"] = "gelu"
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        hf.config_from_hf(config)


def _rewrite(path, edit):
    file = os.path.join(path, "model.safetensors")
    original = safetensors_io.File(file)
    tensors = {name: np.array(original.array(name)) for name in original.keys()}
    edit(tensors)
    safetensors_io.write(file, tensors.items())


def test_missing_tensor_is_named(tmp_path):
    path = str(tmp_path)
    _write_checkpoint(FAMILIES["qwen2"](), path)
    _rewrite(path, lambda t: t.pop("model.layers.1.self_attn.k_proj.bias"))
    with pytest.raises(ValueError, match=r"missing 1 tensor\(s\): model.layers.1.self_attn.k_proj"):
        hf.load(path)


def test_misshaped_tensor_names_both_shapes(tmp_path):
    path = str(tmp_path)
    _write_checkpoint(FAMILIES["qwen2"](), path)

    def shrink(t):
        t["model.layers.0.mlp.up_proj.weight"] = t["model.layers.0.mlp.up_proj.weight"][:90]

    _rewrite(path, shrink)
    with pytest.raises(ValueError, match=r"up_proj.weight: expected \(96, 64\), found \(90, 64\)"):
        hf.load(path)


def test_no_safetensors(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(FAMILIES["qwen2"]().to_dict()))
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        hf.load(str(tmp_path))


# ----------------------------------------------------------------------------- tokenizer

def test_load_tokenizer_with_chat_template(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    words = ["<pad>", "<eos>", "<|im_start|>", "<|im_end|>", "user", "assistant", "hello",
             "world", "\n", "[UNK]"]
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>",
                                                pad_token="<pad>")
    fast.chat_template = ("{% for m in messages %}<|im_start|> {{ m['role'] }} "
                          "{{ m['content'] }} <|im_end|> {% endfor %}")
    fast.save_pretrained(str(tmp_path))

    loaded = hf.load_tokenizer(str(tmp_path))
    ids = loaded.apply_chat_template([{"role": "user", "content": "hello world"}],
                                     tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert [words[i] for i in ids] == ["<|im_start|>", "user", "hello", "world", "<|im_end|>"]
    assert loaded.eos_token_id == 1


def test_load_tokenizer_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer"):
        hf.load_tokenizer(str(tmp_path))


# ----------------------------------------------------------------------------- export

@pytest.mark.parametrize("name", ["qwen2.5-base", "llama3.1-instruct"])
def test_export_writes_a_directory_transformers_loads_with_our_logits(hf_dir, name, tmp_path):
    from flax import nnx

    from ptrain import chat
    source = hf_dir(name)
    model, config = hf.load(source)
    tokenizer = hf.load_tokenizer(source)
    fmt = chat.LLAMA3 if name.startswith("llama") else chat.QWEN
    stops = chat.stop_ids(fmt, tokenizer, eos_sources=hf.eos_token_ids(source))
    graphdef, params = nnx.split(model)  # what the learner holds and checkpoints
    params = jax.tree.map(lambda x: x * 1.01 + 0.001, params)  # "trained": not the source
    out = str(tmp_path / "exported")
    hf.export(params, config, out, tokenizer=tokenizer, base_dir=source, stop_ids=stops)

    tokens = np.asarray([chat.encode(tokenizer, "def add(a, b):\n    return a + b\n")] * 2)
    ours = np.asarray(nnx.merge(graphdef, params)(tokens))
    exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    np.testing.assert_allclose(_hf_logits(exported, tokens), ours, atol=2e-4, rtol=0)
    source_model = transformers.AutoModelForCausalLM.from_pretrained(source).eval()
    assert np.abs(_hf_logits(source_model, tokens) - ours).max() > 1e-2  # the new weights

    reloaded = transformers.AutoTokenizer.from_pretrained(out)
    messages = [{"role": "user", "content": "Compute 6 * 7."}]
    for tools in (None, chat.tool_schemas(["python"])):
        assert reloaded.apply_chat_template(messages, tools=tools, tokenize=False,
                                            add_generation_prompt=True) == \
            tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                          add_generation_prompt=True)
    assert len(reloaded) == len(tokenizer) and reloaded.eos_token == tokenizer.eos_token
    generation = transformers.GenerationConfig.from_pretrained(out)
    eos = generation.eos_token_id if isinstance(generation.eos_token_id, list) else [
        generation.eos_token_id]
    assert set(stops) <= set(eos)  # generate() stops where our sampler stopped
    base = hf.read_generation_config(source)
    assert {k: getattr(generation, k) for k in ("do_sample", "temperature", "top_p")} == {
        k: base.get(k, getattr(transformers.GenerationConfig(), k))
        for k in ("do_sample", "temperature", "top_p")}  # the brought sampling defaults
    if name == "qwen2.5-base":  # the chat turn's end, which no eos field of the base names
        assert tokenizer.convert_tokens_to_ids("<|im_end|>") in eos


def test_save_without_a_generation_config_writes_the_model_eos(tmp_path, checkpoint):
    path, _ = checkpoint
    model, config = hf.load(path)
    out = str(tmp_path / "plain")
    hf.save(model, config, out)
    generation = hf.read_generation_config(out)
    assert generation.get("eos_token_id") == (
        None if not config.eos_token_ids else list(config.eos_token_ids)
        if len(config.eos_token_ids) > 1 else config.eos_token_ids[0])
    transformers.GenerationConfig.from_pretrained(out)
    with pytest.raises(TypeError, match="has no save_pretrained"):
        from ptrain.envs import synthetic
        hf.save(model, config, out, tokenizer=synthetic.WordTokenizer.for_tasks())
