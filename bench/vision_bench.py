"""Vision-language sampling and the learner's step on image prompts, against transformers.

One tiny random Qwen2.5-VL checkpoint, built here (no download), loaded by both:
  decode     `--prompts` image prompts (one `--image` px image and a few words each) x
             `--samples` completions of `--new` tokens at temperature 1 (no stop token, so
             every row decodes all of them): ptrain's `Sampler` (one compiled prefill +
             decode) against transformers' `generate` (do_sample, num_return_sequences, the
             same batch); tokens/s of each and the ratio (target >= 2x).
  per group  the same sampling with each image encoded once per prompt (G samples share
             the prefill) against once per sample (every prompt repeated G times, one
             sample each): seconds and the ratio.
  learner    one jitted value-and-grad of the learner's token log-probs over the sampled
             rows with their images (the RL step's forward and backward; the optimizer's
             update is the same as text's): seconds.
Each timed call runs after a warm-up call with the same shapes (compiles are not timed);
`--rounds` repeats alternate and the median is reported.

    python bench/vision_bench.py [--prompts 4 --samples 4 --new 32 --image 112 --rounds 3]
"""

import argparse
import os
import sys
import tempfile
import time

import jax
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from flax import nnx  # noqa: E402

from ptrain import step  # noqa: E402
from ptrain.batch import Batch  # noqa: E402
from ptrain.generate.sampler import Sampler  # noqa: E402
from ptrain.vision import hf as vhf  # noqa: E402
from ptrain.vision import image_processing as ip  # noqa: E402
from ptrain.vision import layout, prompts, vl  # noqa: E402

IMG, VIDEO, VS, VE, EOS = 250, 251, 252, 253, 1


def checkpoint(path, width):
    import torch
    import transformers
    config = transformers.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=256, hidden_size=width, intermediate_size=2 * width,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=2048, bos_token_id=0, eos_token_id=EOS,
                         rope_parameters={"rope_type": "default",
                                          "mrope_section": [width // 32, width // 64 * 3,
                                                            width // 64 * 3],
                                          "rope_theta": 1e4}),
        vision_config=dict(depth=4, hidden_size=64, intermediate_size=128, num_heads=2,
                           out_hidden_size=width, fullatt_block_indexes=[3], window_size=56),
        image_token_id=IMG, video_token_id=VIDEO, vision_start_token_id=VS,
        vision_end_token_id=VE)
    torch.manual_seed(0)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config).eval()
    model.save_pretrained(path)
    return model


def image_prompts(n, px, c, processing):
    rs = np.random.RandomState(0)
    from PIL import Image
    out = []
    for i in range(n):
        image = Image.fromarray(rs.randint(0, 256, (px, px, 3), dtype=np.uint8))
        patches, grids = ip.preprocess([image], processing)
        tokens = [5 + i, 6, VS] + [IMG] * int(layout.n_merged(grids, c.vision)[0]) + [VE, 7, 8]
        out.append((tokens, (patches, grids)))
    return out


def timed(fn, rounds):
    fn()  # compiles / warms up
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--image", type=int, default=112, help="image side in pixels")
    ap.add_argument("--width", type=int, default=128, help="the decoder's hidden size")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--torch-threads", type=int, default=os.cpu_count())
    a = ap.parse_args()
    import torch
    torch.set_num_threads(a.torch_threads)
    path = tempfile.mkdtemp(prefix="vision_bench_")
    ref = checkpoint(path, a.width)
    model, c = vhf.load(path)
    processing = ip.ImageProcessing(max_pixels=a.image * a.image)
    batch = image_prompts(a.prompts, a.image, c, processing)
    params, g, n = nnx.state(model), a.samples, a.new
    sampler = Sampler(model, seed=0)
    toks = [t for t, _ in batch]
    items = [i for _, i in batch]
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}, {os.cpu_count()} cores; "
          f"{a.prompts} prompts x {g} samples x {n} new tokens, {a.image} px images "
          f"({len(toks[0])} prompt tokens each), decoder width {a.width}")

    # ------------------------------------------------------------------ decode
    def ours():
        return sampler.sample(params, toks, images=items, num_samples=g, max_new_tokens=n,
                              key=jax.random.key(1))

    def theirs():
        with torch.no_grad():
            ids = torch.tensor(toks)  # (the prompts have one length: no padding)
            pv = torch.tensor(np.concatenate([i[0] for i in items]))
            grid = torch.tensor(np.concatenate([i[1] for i in items]))
            out = ref.generate(input_ids=ids, mm_token_type_ids=(ids == IMG).long(),
                               pixel_values=pv, image_grid_thw=grid, do_sample=True,
                               num_return_sequences=g, max_new_tokens=n, min_new_tokens=n,
                               pad_token_id=0)
        assert out.shape == (a.prompts * g, len(toks[0]) + n)

    rows = a.prompts * g * n
    t_ours = timed(ours, a.rounds)
    t_hf = timed(theirs, a.rounds)
    print(f"decode: ptrain {rows / t_ours:.0f} tok/s ({t_ours:.3f} s), transformers "
          f"{rows / t_hf:.0f} tok/s ({t_hf:.3f} s): ratio {t_hf / t_ours:.2f}x (target >= 2x)")

    # ------------------------------------------------------------------ once per group
    def per_sample():
        return sampler.sample(params, [t for t in toks for _ in range(g)],
                              images=[i for i in items for _ in range(g)], num_samples=1,
                              max_new_tokens=n, key=jax.random.key(1))

    t_each = timed(per_sample, a.rounds)
    print(f"images encoded once per group {t_ours:.3f} s, once per sample {t_each:.3f} s: "
          f"ratio {t_each / t_ours:.2f}x")

    # ------------------------------------------------------------------ the learner
    out = ours()
    completions = out.completions()
    index = [r // g for r in range(a.prompts * g)]
    episodes = Batch.from_rows(
        [toks[i] for i in index], completions, [[1] * len(x) for x in completions],
        [out.logp_t1[r, :len(x)] for r, x in enumerate(completions)], np.zeros(len(index)),
        index, prompt_len=len(toks[0]), length=n)
    episodes = prompts.with_images(episodes, [items[i] for i in index], c,
                                   n_patches=prompts.patch_bucket(len(items[0][0]),
                                                                  c.vision.merge_unit))
    arrays = {k: v for k, v in episodes.arrays().items()
              if k in ("prompt_bp", "prompt_lens_b", "tokens_bn", "lengths_b") + vl.LEARNER_KEYS}
    graphdef, state = nnx.split(model)
    grad = jax.jit(jax.value_and_grad(
        lambda p, b: -step.token_logprobs(graphdef, p, b, group_size=g)[0].sum()))
    t_step = timed(lambda: jax.block_until_ready(grad(state, arrays)), a.rounds)
    print(f"learner: log-probs forward + backward over {a.prompts * g} rows with images "
          f"{t_step:.3f} s")


if __name__ == "__main__":
    main()
