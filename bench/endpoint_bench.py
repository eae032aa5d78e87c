"""Multi-turn episodes through the OpenAI-compatible endpoint (ptrain/serve/) against the same
engine in process, on one model, measured in one run.

`--episodes` episodes of `--turns` model turns of `--turn-tokens` tokens each (no stop
token: every turn runs its length), each but the last followed by `--obs-tokens` tokens of
observation. In process: one `Engine.generate` with an `on_turn` per episode. Through the
endpoint: one client thread per episode sends `/v1/completions` with the growing token ids
(a continuation: only the observation is prefilled), over HTTP on loopback. The model is
tests/hf_fixtures.py's tiny Qwen2.5 (built here), or `--model`. `--rounds` alternates the
two (a shared machine's load drifts); the median of each is reported, and their ratio.

    python bench/endpoint_bench.py [--episodes 8 --turns 3 --turn-tokens 32 --slots 8]
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None, help="a Hugging Face model directory")
    p.add_argument("--episodes", type=int, default=8)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--turn-tokens", type=int, default=32)
    p.add_argument("--obs-tokens", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=24)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()

    from flax import nnx
    from ptrain import hf, serve
    from ptrain.generate.engine import Engine, Request
    path = args.model
    if path is None:
        import hf_fixtures
        path = hf_fixtures.build("qwen2.5-instruct", tempfile.mkdtemp())
    model, _ = hf.load(path)
    params = nnx.state(model)
    tokenizer = hf.load_tokenizer(path)
    max_len = args.prompt_tokens + args.turns * (args.turn_tokens + args.obs_tokens) + 8
    engine = Engine(model, slots=args.slots, max_len=max_len,
                    max_new_tokens=args.turn_tokens, token_buckets=(16, 64, max_len))
    engine.warm_up(params)
    prompts = [[(7 * e + i) % 500 + 20 for i in range(args.prompt_tokens)]
               for e in range(args.episodes)]
    obs = [(11 * i) % 500 + 20 for i in range(args.obs_tokens)]
    tokens = args.episodes * args.turns * args.turn_tokens

    def in_process():
        def on_turn(traj):
            return obs if len(traj.turns) < args.turns else None
        start = time.perf_counter()
        engine.generate(params, [Request(prompt, key=e, on_turn=on_turn)
                                 for e, prompt in enumerate(prompts)])
        return time.perf_counter() - start

    def post(server, path_, body):
        url = f"http://127.0.0.1:{server.server_address[1]}{path_}"
        req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={
            "Authorization": f"Bearer {server.token}", "Content-Type": "application/json"})
        with urllib.request.urlopen(req) as r:
            return json.loads(r.read())

    def episode(server, e):
        eid = post(server, "/v1/episodes", {})["id"]
        ids = list(prompts[e])
        for turn in range(args.turns):
            reply = post(server, f"/episodes/{eid}/v1/completions",
                         {"prompt": ids, "max_tokens": args.turn_tokens, "seed": e})
            ids += reply["choices"][0]["token_ids"] + (obs if turn < args.turns - 1 else [])
        post(server, f"/v1/episodes/{eid}/close", {})

    def endpoint():
        """A server over the engine (its generation holds the engine until it closes); the
        time of the episodes, from the first request to the last answer."""
        service = serve.Service(engine, params, tokenizer,
                                serve.ServeConfig(chat_format="plain"))
        server = serve.make_server(service)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        threads = [threading.Thread(target=episode, args=(server, e))
                   for e in range(args.episodes)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seconds = time.perf_counter() - start
        assert len(service.take_closed()) == args.episodes
        server.shutdown()
        server.server_close()
        service.close()
        return seconds

    times = {"in_process": [], "endpoint": []}
    endpoint()  # (the first HTTP round trips, outside the timing)
    for _ in range(args.rounds):
        for name, run in (("in_process", in_process), ("endpoint", endpoint)):
            times[name].append(run())
    med = {k: statistics.median(v) for k, v in times.items()}
    for name, t in med.items():
        print(f"{name:10s} {tokens / t:8.1f} tokens/s  {args.episodes / t:6.2f} episodes/s  "
              f"(median of {args.rounds}: {t:.2f} s; all {[round(x, 2) for x in times[name]]})")
    print(f"endpoint / in process: {med['in_process'] / med['endpoint']:.2f}x "
          f"({args.episodes} episodes x {args.turns} turns x {args.turn_tokens} tokens, "
          f"{args.slots} slots)")


if __name__ == "__main__":
    main()
