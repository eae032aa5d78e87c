"""Forward throughput of ptrain's decoder against Hugging Face transformers (torch, CPU).

Both run the same ~20M-parameter Llama-style checkpoint (written by transformers, loaded by
ptrain.hf) on the same token batch, in float32, in one process; the ratio is what counts.

    python bench/model_bench.py [--batch 4 --seq 512 --repeats 5]
"""

import argparse
import os
import tempfile
import time

import jax
import numpy as np
import torch
import transformers
from flax import nnx

from ptrain import hf


def _interleaved(fns, repeats):
    """Median seconds of each function, repetitions interleaved so that load on a shared
    machine hits both sides alike."""
    for fn in fns:
        fn()  # warm-up (and compilation)
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, ts in zip(fns, times):
            start = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - start)
    return [float(np.median(ts)) for ts in times]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    config = transformers.LlamaConfig(
        vocab_size=16384, hidden_size=256, intermediate_size=1024, num_hidden_layers=12,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096,
        tie_word_embeddings=False)
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(config).eval()
    n_params = sum(p.numel() for p in ref.parameters())
    tokens = np.random.RandomState(0).randint(0, config.vocab_size, (args.batch, args.seq))

    with tempfile.TemporaryDirectory() as path:
        ref.save_pretrained(path)
        model, _ = hf.load(path)
    forward = nnx.jit(lambda m, x: m(x))
    tokens_jax = jax.numpy.asarray(tokens)
    tokens_torch = torch.tensor(tokens)
    with torch.inference_mode():
        ours, theirs = _interleaved(
            [lambda: forward(model, tokens_jax).block_until_ready(),
             lambda: ref(tokens_torch).logits], args.repeats)

    n = args.batch * args.seq
    print(f"model: Llama-style, {n_params / 1e6:.1f}M params; batch {args.batch} x {args.seq} "
          f"tokens, float32; jax {jax.__version__} on {jax.devices()[0].platform}, "
          f"torch {torch.__version__} ({torch.get_num_threads()} threads), "
          f"{os.cpu_count()} cores")
    print(f"ptrain        {n / ours:10.0f} tokens/s  ({ours * 1e3:.1f} ms)")
    print(f"transformers  {n / theirs:10.0f} tokens/s  ({theirs * 1e3:.1f} ms)")
    print(f"ratio ptrain / transformers: {theirs / ours:.2f}x")


if __name__ == "__main__":
    main()
