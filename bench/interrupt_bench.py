"""What a swap at a weight update costs (rl.interrupt, ptrain/generate/interrupt.py): one engine
generation with the swap forced after the first decode round, its held sequences' caches
recomputed under the new weights (rl.interrupt_cache="recompute") or kept
(rl.interrupt_cache="keep"), against the same generation with no swap, measured in one run.

bench/rl_bench.py's model (Qwen3-style, 1.05M parameters, float32), `--requests` prompts of
8-32 tokens x `--new-tokens` sampled tokens, `--slots` decode slots; the swap falls after
`--every` decode steps (every slot then holds a sequence mid-turn). The three modes alternate
over `--rounds`; best and median seconds per generation, and the swap's own time (timed
around `interrupt.swap`, its device work blocked on) with the tokens it prefilled.

    python bench/interrupt_bench.py [--requests 64 --new-tokens 64 --slots 32 --every 16]
"""

import argparse
import os
import sys
import time

import jax
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "bench"))

import rl_bench  # noqa: E402
from ptrain import model as model_lib  # noqa: E402
from ptrain.generate import engine as engine_lib  # noqa: E402
from ptrain.generate import interrupt  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--every", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    config = model_lib.ModelConfig(**rl_bench.MODEL, qk_norm=True, family="qwen3",
                                   bos_token_id=1, eos_token_ids=(rl_bench.EOS,))
    old, new = model_lib.init(config, seed=0), model_lib.init(config, seed=1)
    rng = np.random.RandomState(0)
    requests = [engine_lib.Request([1] + rng.randint(3, config.vocab_size,
                                                     rng.randint(8, 32)).tolist(),
                                   key=jax.random.key(i)) for i in range(args.requests)]
    engine = engine_lib.Engine(old, slots=args.slots, max_len=32 + args.new_tokens,
                               max_new_tokens=args.new_tokens)

    swap_s = []
    original_swap = interrupt.swap

    def timed_swap(run, version, params):  # the swap alone, its device work included
        jax.block_until_ready(run.e.state)
        start = time.perf_counter()
        original_swap(run, version, params)
        jax.block_until_ready(run.e.state)
        swap_s.append(time.perf_counter() - start)

    interrupt.swap = timed_swap

    def generate(mode):
        live = None
        if mode != "no swap":
            switch = interrupt.Switch(every=args.every, at_round=1,
                                      keep_cache=mode == "keep")
            switch.publish(1, new)
            live = interrupt.Live(old, 0, switch)
        elif args.every:  # the same rounds, never swapped
            live = interrupt.Live(old, 0, interrupt.Switch(every=args.every))
        before = engine.metrics().get("recompute_tokens", 0)
        start = time.perf_counter()
        trajs = engine.generate(old, requests, live=live)
        seconds = time.perf_counter() - start
        swapped = sum(len(t.versions) == 2 for t in trajs)
        return seconds, swapped, engine.metrics().get("recompute_tokens", 0) - before

    def swap_ms(mode):
        del swap_s[:]
        for _ in range(args.repeats):
            generate(mode)
        return np.min(swap_s) * 1e3, np.median(swap_s) * 1e3

    modes = ("no swap", "recompute", "keep")
    swap_times = {}
    times = {m: [] for m in modes}
    info = {}
    for m in modes:
        generate(m)  # compilation
    for r in range(args.rounds):
        for m in modes:
            for _ in range(args.repeats):
                seconds, swapped, prefilled = generate(m)
                times[m].append(seconds)
                info[m] = (swapped, prefilled)
        for m in modes[1:]:
            swap_times.setdefault(m, []).append(swap_ms(m))
        print(f"round {r}: " + ", ".join(
            f"{m} {np.median(times[m][-args.repeats:]) * 1e3:.0f} ms" for m in modes),
            flush=True)
    print(f"{args.requests} requests x {args.new_tokens} tokens, {args.slots} slots, the swap "
          f"after {args.every} decode steps; jax {jax.__version__}, {os.cpu_count()} cores")
    for m in modes:
        best, median = np.min(times[m]), np.median(times[m])
        swapped, prefilled = info[m]
        extra = "" if m == "no swap" else (
            f"; the swap itself {min(t[0] for t in swap_times[m]):.1f} ms best, "
            f"{np.median([t[1] for t in swap_times[m]]):.1f} ms median; {swapped} sequences "
            f"with two versions, {prefilled} tokens prefilled")
        print(f"  {m:10s} best {best * 1e3:6.0f} ms, median {median * 1e3:6.0f} ms{extra}")


if __name__ == "__main__":
    main()
