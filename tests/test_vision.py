"""Qwen2.5-VL: image processing, logits, generation and learner log-probs against
transformers on a tiny random checkpoint built here (no download)."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch", reason="torch (CPU) is the reference; pip install '.[test]'")
transformers = pytest.importorskip("transformers", reason="pip install '.[test]'")
Image = pytest.importorskip("PIL.Image", reason="PIL reads and resizes images")

from ptrain import step  # noqa: E402
from ptrain.batch import Batch  # noqa: E402
from ptrain.generate.sampler import Sampler  # noqa: E402
from ptrain.vision import hf as vhf  # noqa: E402
from ptrain.vision import image_processing as ip  # noqa: E402
from ptrain.vision import layout, positions, prompts, vl  # noqa: E402

IMG, VIDEO, VS, VE, EOS = 150, 151, 152, 153, 1
PROC = ip.ImageProcessing(max_pixels=28 * 28 * 40)  # small images: few patches
# The learner's log-probs (groups of 2), one compiled program shared by the tests below
# (batches of 4 rows, prompts of 64, continuations of 4, 128 patches per row).
LOGPROBS = jax.jit(lambda graphdef, p, b: step.token_logprobs(graphdef, p, b, group_size=2)[0],
                   static_argnums=0)


def _hf_config():
    return transformers.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=160, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, bos_token_id=0, eos_token_id=EOS,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                                          "rope_theta": 1e4}),
        # windows of 2x2 merged tokens, block 1 full attention
        vision_config=dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2,
                           out_hidden_size=64, fullatt_block_indexes=[1], window_size=56),
        image_token_id=IMG, video_token_id=VIDEO, vision_start_token_id=VS,
        vision_end_token_id=VE)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen25vl"))
    torch.manual_seed(0)
    model = transformers.Qwen2_5_VLForConditionalGeneration(_hf_config()).eval()
    with torch.no_grad():  # perturb everything, norms and biases included
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    return path, model


@pytest.fixture(scope="module")
def ours(checkpoint):
    return vhf.load(checkpoint[0], overrides={"attention_impl": "reference"},
                    vision_overrides={"attention_impl": "reference"})


def _images(seed=0, sizes=((60, 90), (150, 120), (28, 56))):
    rs = np.random.RandomState(seed)
    return [Image.fromarray(rs.randint(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


def _prompt(parts, images, c):
    """Tokens with <vision_start> <image_pad> x n <vision_end> for each "I" in parts, and
    the images' (patches, grids) (None without images)."""
    if not images:
        return [t for p in parts for t in p], None
    pv, grids = ip.preprocess(images, PROC)
    n = layout.n_merged(grids, c.vision)
    out, k = [], 0
    for p in parts:
        if p == "I":
            out += [VS] + [IMG] * n[k] + [VE]
            k += 1
        else:
            out += list(p)
    return out, (pv, grids)


def _hf_logits(model, tokens, item):
    ids = torch.tensor([tokens])
    kw = {} if item is None else dict(pixel_values=torch.tensor(item[0]),
                                      image_grid_thw=torch.tensor(item[1]))
    with torch.no_grad():
        return model(input_ids=ids, mm_token_type_ids=(ids == IMG).long(), **kw
                     ).logits[0].float().numpy()


# ----------------------------------------------------------------------------- processing

def test_pixel_values_match_transformers(tmp_path):
    rs = np.random.RandomState(1)
    rgba = Image.fromarray(rs.randint(0, 256, (60, 90, 4), dtype=np.uint8), "RGBA")
    gray = Image.fromarray(rs.randint(0, 256, (45, 70), dtype=np.uint8), "L")
    images = _images(1, ((50, 70), (100, 30), (300, 400), (29, 29), (1000, 28))) + [
        rgba, gray, gray.convert("P"), rgba.convert("CMYK"), gray.convert("LA")]
    reference = transformers.models.qwen2_vl.image_processing_pil_qwen2_vl.\
        Qwen2VLImageProcessorPil(min_pixels=PROC.min_pixels, max_pixels=PROC.max_pixels)
    want = reference(images=images, return_tensors="np")
    pv, grids = ip.preprocess(images, PROC)
    np.testing.assert_array_equal(grids, want["image_grid_thw"])
    np.testing.assert_allclose(pv, want["pixel_values"], rtol=0, atol=1e-6)
    # (300, 400) is over the pixel budget: resized within it
    assert np.prod(grids[2]) * 14 * 14 <= PROC.max_pixels
    # a file on disk, and a truncated one
    file = str(tmp_path / "a.png")
    images[0].save(file)
    np.testing.assert_array_equal(ip.preprocess(file, PROC)[0], ip.preprocess(images[0], PROC)[0])
    with open(file, "rb") as f:
        data = f.read()
    with open(file, "wb") as f:
        f.write(data[:len(data) // 2])
    with pytest.raises(ValueError, match="not a readable image"):
        ip.preprocess(file, PROC)


# ----------------------------------------------------------------------------- the model

def test_logits_match_transformers(checkpoint, ours):
    """Several images per prompt, of several sizes, in a right-padded batch of two rows."""
    _, ref = checkpoint
    model, c = ours
    imgs = _images()
    rows = [_prompt([[5, 6, 7], "I", [8, 9], "I", [10, 11, 12]], imgs[:2], c),
            _prompt([[20, 21], "I", [22, 23, 24, 25]], imgs[2:], c)]
    t = max(len(r) for r, _ in rows)
    tokens = np.zeros((2, t), np.int32)
    for i, (r, _) in enumerate(rows):
        tokens[i, :len(r)] = r
    v = prompts.prepare(tokens, [len(r) for r, _ in rows], [i for _, i in rows], c,
                        left_pad=False)
    assert v["delta_b"].tolist()[0] < 0  # images take fewer positions than tokens
    segments = (np.arange(t)[None] < np.array([[len(r)] for r, _ in rows])).astype(np.int32)
    logits = np.asarray(model(tokens, v["positions_bt"], segments,
                              rope_positions_3bt=v["rope_3bt"], images=v["images"],
                              image_dest_bm=v["dest_bm"]))
    for i, (r, item) in enumerate(rows):
        np.testing.assert_allclose(logits[i, :len(r)], _hf_logits(ref, r, item), atol=2e-4,
                                   rtol=0)


def test_save_export_and_old_names_load_in_transformers(checkpoint, ours, tmp_path):
    _, ref = checkpoint
    model, c = ours
    out = str(tmp_path / "export")
    vhf.export(nnx.state(model), c, out, base_dir=checkpoint[0])
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["architectures"] == [vhf.ARCHITECTURE]
    back = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(out).eval()
    tokens, item = _prompt([[3, 4], "I", [5]], _images()[:1], c)
    np.testing.assert_allclose(_hf_logits(back, tokens, item), _hf_logits(ref, tokens, item),
                               atol=1e-5, rtol=0)
    processor = transformers.AutoImageProcessor.from_pretrained(out)
    np.testing.assert_allclose(processor(images=_images()[:1], return_tensors="np")[
        "pixel_values"], ip.preprocess(_images()[:1], vhf.load_image_processing(out))[0],
        atol=1e-6, rtol=0)
    # the released checkpoints' names (model.layers.*, visual.*) load too
    from ptrain import safetensors_io
    old = str(tmp_path / "old")
    os.makedirs(old)
    f = safetensors_io.File(os.path.join(out, "model.safetensors"))
    safetensors_io.write(os.path.join(old, "model.safetensors"), [
        (k.replace("model.language_model.", "model.").replace("model.visual.", "visual."),
         np.asarray(f.array(k))) for k in f.keys()])
    with open(os.path.join(out, "config.json")) as src:
        config = json.load(src)
    with open(os.path.join(old, "config.json"), "w") as dst:
        json.dump(config, dst)
    again, _ = vhf.load(old)
    for a, b in zip(jax.tree.leaves(nnx.state(again)), jax.tree.leaves(nnx.state(model))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_placeholders_must_match_images(ours):
    _, c = ours
    tokens, item = _prompt([[3], "I", [4]], _images()[:1], c)
    with pytest.raises(ValueError, match="image placeholder tokens"):
        positions.mrope_positions(tokens[:-3] + [4], IMG, item[1], c.vision)
    with pytest.raises(ValueError, match="image placeholder tokens"):
        positions.mrope_positions([3, 4], IMG, item[1], c.vision)


# ----------------------------------------------------------------------------- generation

def test_greedy_generation_matches_transformers(checkpoint, ours):
    """Two prompts with images and one without, left-padded in one batch; each row decodes
    with its own rope delta."""
    _, ref = checkpoint
    model, c = ours
    imgs = _images()
    batch = [_prompt([[5, 6, 7], "I", [8, 9], "I", [10, 11, 12]], imgs[:2], c),
             _prompt([[20, 21], "I", [22, 23, 24, 25, 26, 27]], imgs[2:], c),
             _prompt([[30, 31, 32, 33]], [], c)]
    out = Sampler(model).sample(nnx.state(model), [p for p, _ in batch],
                                images=[i for _, i in batch], max_new_tokens=10, greedy=True,
                                stop_token_ids=(EOS,))
    for (p, item), mine in zip(batch, out.completions()):
        ids = torch.tensor([p])
        kw = {} if item is None else dict(pixel_values=torch.tensor(item[0]),
                                          image_grid_thw=torch.tensor(item[1]))
        want = ref.generate(input_ids=ids, mm_token_type_ids=(ids == IMG).long(), do_sample=False,
                            max_new_tokens=10, eos_token_id=EOS, pad_token_id=0, **kw)
        assert mine == want[0, len(p):].tolist()
    with pytest.raises(ValueError, match="image placeholder tokens"):
        Sampler(model).sample(nnx.state(model), [batch[0][0]], max_new_tokens=2, greedy=True)


# ----------------------------------------------------------------------------- the learner

def _learner_batch(c, with_images=True, n_patches=128):
    """Two groups of G = 2: group 0's prompt has two images (or none), group 1's none."""
    imgs = _images()
    if with_images:
        p0, i0 = _prompt([[5, 6], "I", [7], "I", [8]], imgs[:2], c)
    else:
        p0, i0 = [5, 6, 7, 8], None
    p1, i1 = [9, 10, 11], None
    prompt_rows = [p0, p0, p1, p1]
    p = 64
    prompt_bp = np.zeros((4, p), np.int32)
    for r, row in enumerate(prompt_rows):
        prompt_bp[r, p - len(row):] = row
    lens = np.array([len(r) for r in prompt_rows], np.int32)
    tokens_bn = np.array([[40, 41, 42, 0], [43, 44, 0, 0], [45, 46, 47, 48], [49, 0, 0, 0]],
                         np.int32)
    batch = dict(prompt_bp=prompt_bp, prompt_lens_b=lens, tokens_bn=tokens_bn,
                 lengths_b=np.array([3, 2, 4, 1], np.int32))
    batch.update(prompts.learner_arrays(prompt_bp, lens, [i0, i0, i1, i1], c,
                                        n_patches=n_patches))
    return batch, prompt_rows, [i0, i0, i1, i1]


def test_learner_logprobs_match_transformers_and_compile_once(checkpoint, ours):
    """Log-probs of continuations after image prompts (each group's prompt encoded once):
    equal transformers' teacher-forced log-probs; a batch without images has the same shapes
    and runs the same compiled program."""
    _, ref = checkpoint
    model, c = ours
    graphdef, params = nnx.split(model)
    batch, rows, items = _learner_batch(c)
    logp = np.asarray(LOGPROBS(graphdef, params, batch))
    compiled = LOGPROBS._cache_size()
    for r in range(4):
        n = int(batch["lengths_b"][r])
        cont = batch["tokens_bn"][r, :n].tolist()
        full = rows[r] + cont
        want = torch.log_softmax(torch.tensor(_hf_logits(ref, full, items[r])), -1).numpy()
        idx = np.arange(len(rows[r]) - 1, len(full) - 1)
        np.testing.assert_allclose(logp[r, :n], want[idx, cont], atol=2e-4, rtol=0)
    text_batch, rows, items = _learner_batch(c, with_images=False)
    assert jax.tree.map(np.shape, text_batch) == jax.tree.map(np.shape, batch)
    logp = np.asarray(LOGPROBS(graphdef, params, text_batch))
    assert LOGPROBS._cache_size() == compiled
    want = torch.log_softmax(torch.tensor(_hf_logits(ref, rows[0] + [40, 41, 42], None)), -1)
    np.testing.assert_allclose(logp[0, :3], want.numpy()[[3, 4, 5], [40, 41, 42]], atol=2e-4,
                               rtol=0)


def test_tower_gradients_flow_unless_frozen(ours):
    """The learner's loss reaches the tower's parameters through the merged features; a
    frozen tower (vision.freeze) gets none."""
    model, c = ours
    batch, _, _ = _learner_batch(c)
    graphdef, params = nnx.split(model)

    def loss(p):
        return -step.token_logprobs(graphdef, p, batch, group_size=2)[0].sum()

    grads = jax.jit(jax.grad(loss))(params)
    for part in ("vision", "text"):
        assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(grads[part])), part

    frozen = vl.VLModel(c.replace(vision=c.vision.replace(freeze=True)), rngs=nnx.Rngs(0))
    frozen_graphdef = nnx.graphdef(frozen)
    images = layout.Images(*(jnp.asarray(batch[k][:1]) for k in vl.LEARNER_KEYS[:4]))

    def features(p):
        return nnx.merge(frozen_graphdef, p).image_features(images).sum()

    frozen_grads = jax.jit(jax.grad(features))(params)
    assert all(float(jnp.abs(g).max()) == 0 for g in jax.tree.leaves(frozen_grads))


# ----------------------------------------------------------------------------- chat

def test_chat_prompt_matches_the_processor(ours, tmp_path):
    """Images in chat messages: the template's placeholders expanded per image, token for
    token as Qwen2_5_VLProcessor.apply_chat_template, with the same pixel values."""
    import hf_fixtures
    from ptrain.vision import chat
    tokenizer = hf_fixtures.save_tokenizer("qwen2.5-instruct", str(tmp_path))
    tokenizer.chat_template = hf_fixtures.QWEN25_VL_TEMPLATE
    ids = tokenizer.convert_tokens_to_ids
    _, c = ours
    c = c.replace(image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
                  vision_start_token_id=ids("<|vision_start|>"),
                  vision_end_token_id=ids("<|vision_end|>"))
    imgs = _images()
    messages = [
        {"role": "user", "content": [{"type": "image", "image": imgs[0]},
                                     {"type": "text", "text": "What is 3 + 4? Compare"},
                                     {"type": "image", "image": imgs[1]}]},
        {"role": "assistant", "content": "The answer is 7."},
        {"role": "user", "content": [{"type": "text", "text": "And now?"},
                                     {"type": "image", "image": imgs[2]}]}]
    mine, (pixels, grids) = chat.render_prompt(tokenizer, messages, c, PROC)
    processor = hf_fixtures.qwen25_vl_processor(tokenizer, min_pixels=PROC.min_pixels,
                                                max_pixels=PROC.max_pixels,
                                                chat_template=hf_fixtures.QWEN25_VL_TEMPLATE)
    want = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                         return_dict=True, return_tensors="np")
    assert mine == want["input_ids"][0].tolist()
    np.testing.assert_allclose(pixels, want["pixel_values"], atol=1e-6, rtol=0)
    np.testing.assert_array_equal(grids, want["image_grid_thw"])
    with pytest.raises(ValueError, match="placeholder"):
        chat.expand_placeholders(mine, grids, c)  # already expanded: too many placeholders


def test_sampled_logprobs_equal_the_learners(ours):
    """The sampler and the learner agree on image prompts: each sampled token's log-prob
    (temperature 1) equals the learner's teacher-forced one, G samples per prompt."""
    model, c = ours
    imgs = _images()
    batch = [_prompt([[5, 6], "I", [7], "I", [8]], imgs[:2], c), _prompt([[9, 10, 11]], [], c)]
    g, n = 2, 4
    out = Sampler(model, seed=3).sample(nnx.state(model), [p for p, _ in batch],
                                        images=[i for _, i in batch], max_new_tokens=n,
                                        num_samples=g)
    rows = [batch[i // g] for i in range(len(batch) * g)]
    completions = out.completions()
    episodes = Batch.from_rows(
        [row for row, _ in rows], completions, [[1] * len(x) for x in completions],
        [out.logp_t1[r, :len(x)] for r, x in enumerate(completions)], np.zeros(len(rows)),
        [r // g for r in range(len(rows))], prompt_len=64, length=n)
    episodes = prompts.with_images(episodes, [i for _, i in rows], c, n_patches=128)
    episodes.check_groups(g)
    graphdef, params = nnx.split(model)
    logp = np.asarray(LOGPROBS(graphdef, params, {
        k: v for k, v in episodes.arrays().items()
        if k in ("prompt_bp", "prompt_lens_b", "tokens_bn", "lengths_b") + vl.LEARNER_KEYS}))
    mask = np.arange(n)[None] < out.lengths[:, None]
    np.testing.assert_allclose(np.where(mask, logp, 0), np.where(mask, out.logp_t1, 0),
                               atol=1e-5, rtol=0)
