"""launch/train.py with a scripted policy in place of the model's sampling, for test_real_path.

    python tests/scripted_train.py SCRIPT.json --config=... --workdir=... [--config.x=...]

Runs launch/train.py's `main` as its command line would, with one change: the sampler that
`rollout.make_sampler` builds (for RL and for evaluation) is wrapped in `Scripted`, which
writes each row's next turn from SCRIPT.json instead of drawing it:

  {"header": the text that opens a model turn (Llama 3: <|start_header_id|>assistant...),
   "turns": [[snippet, [turn 0, turn 1, ...]], ...]}

The first entry whose snippet is in the row's history (decoded with its special tokens) gives
the turns; the history's count of `header`, less one, says which turn. A turn is text with its
special tokens written out (`tokenizer.encode` reads them as single ids) and is cut as a
sampler cuts what it draws: after the first of the call's stop ids, else at max_new_tokens.
So a turn that goes on after a stop token ("... <|end_of_text|> wrong") tells whether that
stop id was honoured. The log-probs are the model's own (a teacher-forced forward of the
call's parameters, logits / temperature), so the learner trains on these rollouts as on
sampled ones. Every call is appended to <workdir>/scripted_calls.jsonl (stop ids, rows).
"""

from __future__ import annotations

import json
import os
import sys

sys.modules.setdefault("torch", None)  # tensorboardX imports torch if it can: 5 s per start
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from ptrain import chat, rollout  # noqa: E402
from ptrain import model as model_lib  # noqa: E402
from ptrain.generate.sampler import Samples  # noqa: E402


class Scripted:
    """The `sample` interface of `inner` (a ptrain Sampler: its graphdef and mesh), with
    scripted turns and the model's log-probs of them (see the module docstring)."""

    def __init__(self, inner, tokenizer, script: dict, log_path: str):
        self.inner, self.tok, self.mesh = inner, tokenizer, inner.mesh
        self.header, self.turns, self.log_path = script["header"], script["turns"], log_path
        graphdef = inner.graphdef

        @jax.jit
        def logp(params, tokens_1t, temperature):
            logits_1tv = nnx.merge(graphdef, params)(tokens_1t)
            return jax.nn.log_softmax(logits_1tv / temperature, axis=-1)[0]
        self._logp = logp

    def _turn(self, history: list[int]) -> list[int]:
        text = self.tok.decode(history, skip_special_tokens=False)
        turns = next((t for snippet, t in self.turns if snippet in text), None)
        if turns is None:
            raise ValueError(f"no scripted entry for the history ...{text[-300:]!r}")
        k = text.count(self.header) - 1
        if not 0 <= k < len(turns):
            raise ValueError(f"turn {k} of a history with {len(turns)} scripted turns")
        return chat.encode(self.tok, turns[k])

    def _logps(self, params, history, new, temperature):
        tokens = history + new
        width = 1 << (len(tokens) - 1).bit_length()  # few shapes, few compilations
        padded = np.zeros((1, width), np.int32)
        padded[0, :len(tokens)] = tokens
        logp_tv = np.asarray(self._logp(params, jnp.asarray(padded), jnp.float32(temperature)))
        at = np.arange(len(history) - 1, len(tokens) - 1)
        return logp_tv[at, np.asarray(new, np.int64)]

    def sample(self, params, prompts, *, max_new_tokens, num_samples=1, temperature=1.0,
               greedy=False, stop_token_ids=(), **kwargs):
        del kwargs  # top-k / top-p, stop strings, keys and padding: nothing is drawn
        if isinstance(params, model_lib.Transformer):
            params = nnx.state(params)
        rows = [list(p) for p in prompts for _ in range(num_samples)]
        stops = {int(i) for i in stop_token_ids}
        tokens = np.zeros((len(rows), max_new_tokens), np.int32)
        logp = np.zeros((len(rows), max_new_tokens), np.float32)
        lengths, reasons = np.zeros(len(rows), np.int32), []
        for r, history in enumerate(rows):
            turn = self._turn(history)
            end = next((i + 1 for i, t in enumerate(turn) if t in stops), None)
            reasons.append("stop" if end is not None and end <= max_new_tokens else "length")
            new = turn[:min(end or len(turn), max_new_tokens)]
            tokens[r, :len(new)], lengths[r] = new, len(new)
            logp[r, :len(new)] = self._logps(params, history, new,
                                             1.0 if greedy else temperature)
        with open(self.log_path, "a") as f:
            f.write(json.dumps({"stop_token_ids": sorted(stops), "rows": len(rows),
                                "max_new_tokens": max_new_tokens}) + "\n")
        return Samples(tokens=tokens, logp=logp, logp_temp=logp, logp_t1=logp, lengths=lengths,
                       finish_reasons=reasons,
                       prompt_index=np.repeat(np.arange(len(prompts)), num_samples))


def main():
    script_path, argv = sys.argv[1], [sys.argv[0]] + sys.argv[2:]
    with open(script_path) as f:
        script = json.load(f)
    workdir = next(a.split("=", 1)[1] for a in argv if a.startswith("--workdir="))
    build = rollout.make_sampler

    def make_sampler(model, config, tokenizer=None):
        return Scripted(build(model, config, tokenizer), tokenizer, script,
                        os.path.join(workdir, "scripted_calls.jsonl"))
    rollout.make_sampler = make_sampler
    from absl import app

    from launch import train
    sys.argv = argv
    app.run(train.main)


if __name__ == "__main__":
    main()
