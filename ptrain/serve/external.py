"""Rollouts from an external OpenAI-compatible engine (vLLM on GPU, vLLM / tpu-inference on
TPU, ptrain's own endpoint), behind the sampler interface every producer uses
(`sample(params, prompts, ...) -> Samples`: `rollout.SingleTurn`, `rollout.Tasks`' turn loop).

    sampler = serve.ExternalSampler(model, serve.ExternalConfig(
        base_url="http://gpu-host:8000", token="...", server="vllm", sync_dir="/shared/sync",
        reload_path="/update_weights_from_disk"), tokenizer=tokenizer)

Token in, token out: each prompt goes as token ids to `/v1/completions` (the engine never
re-renders a template), and the ids and per-token log-probs come from the response
(`choices[0].token_ids`, `logprobs.token_logprobs`), so the learner trains on exactly what the
engine sampled. The engine's log-probs are the batch's `rollout_logp_bn`; the learner
recomputes its own and the truncated importance correction (`losses.truncated_is_weights`)
takes the difference, logged as `rollout/logp_mismatch` (docs/engines.md: which servers
report log-probs after temperature, as the learner's are).

Weights: when `sample` gets parameters it has not synced, they are exported as a Hugging Face
checkpoint (`hf.save`) under `sync_dir/v<k>` and the engine is told to load it, by
`weight_sync`: "sglang" POSTs `reload_path` with {"model_path": dir} (SGLang's
`/update_weights_from_disk` shape, which ptrain's endpoint serves too); "vllm" POSTs vLLM's
`/collective_rpc` {"method": "reload_weights", "kwargs": {"weights_path": dir}} (the
workers reload in place; a server started with VLLM_SERVER_DEV_MODE=1), then
`/reset_prefix_cache` (no cached prefix of the old weights is reused). `sync_dir` must be a
directory the engine can read.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import urllib.error
import urllib.request

import jax
import numpy as np

from ptrain.generate.sampler import Samples

SERVERS = ("vllm", "ptrain")
WEIGHT_SYNCS = ("sglang", "vllm")  # how the engine is told to load an export


@dataclasses.dataclass(frozen=True)
class ExternalConfig:
    base_url: str  # the server's root (http://host:port), its routes under /v1
    token: str = ""  # the bearer token ("": $PTRAIN_ENGINE_TOKEN, or none)
    model: str = ""  # the served model's name (vLLM: --served-model-name)
    server: str = "vllm"  # SERVERS: the request's extra fields (vLLM's, or ptrain's episodes)
    timeout_s: float = 600.0
    max_concurrency: int = 64  # requests in flight
    sync_dir: str = ""  # where exported checkpoints go ("": weights are not synced)
    weight_sync: str = ""  # WEIGHT_SYNCS ("": the server's own: vllm -> "vllm", else "sglang")
    reload_path: str = "/update_weights_from_disk"  # "sglang": POSTed {"model_path": dir}

    def __post_init__(self):
        if self.server not in SERVERS:
            raise ValueError(f"ExternalConfig.server={self.server!r}: one of {SERVERS}")
        if self.weight_sync not in ("",) + WEIGHT_SYNCS:
            raise ValueError(f"ExternalConfig.weight_sync={self.weight_sync!r}: one of "
                             f"{WEIGHT_SYNCS} (or \"\": the server's own)")
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"ExternalConfig.base_url={self.base_url!r}: give http(s)://host:port")
        if self.timeout_s <= 0 or self.max_concurrency < 1:
            raise ValueError("ExternalConfig: timeout_s must be > 0 and max_concurrency >= 1")


def _weight_sync(config: ExternalConfig) -> str:
    return config.weight_sync or ("vllm" if config.server == "vllm" else "sglang")


class EngineError(RuntimeError):
    """The external engine refused a request or answered without what training needs."""


class ExternalSampler:
    """See the module docstring. `model`: the learner's (its graph and config, for exports)."""

    def __init__(self, model, config: ExternalConfig, *, tokenizer=None, pad_id: int = 0):
        if jax.process_count() > 1:
            # Each process would export (hf.save is collective, process 0 writes), tell the
            # engine to reload and send its own rows, with no agreement on when the reload
            # is done nor a gather of a shared batch's rows: not wired.
            raise ValueError(
                f"ExternalSampler runs on one process; this run has {jax.process_count()}: "
                "sample with the external engine from a one-process learner (the engine "
                "scales on its own), or use the in-process sampler on many processes")
        if config.sync_dir and _weight_sync(config) == "vllm" and model.config.tie_embeddings:
            # vLLM 0.32's in-place reload (reload_weights) loads the embedding and puts the
            # tied output head's old tensor back ("ParallelLMHead: Failed to load weights"):
            # the engine would sample with the new body and the old head.
            raise ValueError(
                "ExternalConfig.weight_sync='vllm' cannot sync a model with tied embeddings "
                "(vLLM's reload_weights keeps the old output head): sync by restarting the "
                "server on each export, or train a model with an untied head")
        self.model, self.config, self.tokenizer, self.pad_id = model, config, tokenizer, pad_id
        self.token = config.token or os.environ.get("PTRAIN_ENGINE_TOKEN", "")
        self.version, self._synced = 0, None

    # ------------------------------------------------------------------ http

    def _post(self, path: str, body: dict) -> dict:
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        request = urllib.request.Request(self.config.base_url.rstrip("/") + path,
                                         data=json.dumps(body).encode(), headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=self.config.timeout_s) as r:
                return json.loads(r.read() or b"{}")  # (vLLM's /collective_rpc: no body)
        except urllib.error.HTTPError as e:
            dev = e.code == 404 and path in ("/collective_rpc", "/reset_prefix_cache")
            hint = (" (vLLM serves /collective_rpc and /reset_prefix_cache only with "
                    "VLLM_SERVER_DEV_MODE=1)" if dev else "")
            raise EngineError(f"{path}: HTTP {e.code}: {e.read()[:500].decode('utf-8', 'replace')}"
                              + hint) from None

    # ------------------------------------------------------------------ weights

    def sync(self, params) -> str:
        """Exports `params` (`hf.save`) and has the engine load them; returns the directory."""
        from flax import nnx

        from ptrain import hf
        if not self.config.sync_dir:
            raise ValueError("ExternalConfig.sync_dir is not set: the engine cannot be given "
                             "new weights (set it to a directory the engine reads)")
        self.version += 1
        path = os.path.join(self.config.sync_dir, f"v{self.version}")
        graphdef, _ = nnx.split(self.model)
        hf.save(nnx.merge(graphdef, params), self.model.config, path, tokenizer=self.tokenizer)
        if _weight_sync(self.config) == "vllm":
            self._post("/collective_rpc", {"method": "reload_weights",
                                           "kwargs": {"weights_path": path}})
            if not self._post("/reset_prefix_cache", {}).get("success", True):
                raise EngineError("vLLM did not reset its prefix cache after the reload "
                                  "(other requests still hold its blocks)")
        else:
            self._post(self.config.reload_path, {"model_path": path})
        self._synced = params
        return path

    # ------------------------------------------------------------------ sampling

    def _request(self, prompt, max_new_tokens, c, seed, temperature, top_k, top_p,
                 stop_token_ids, stop_strings) -> tuple[list, list, str]:
        body = {"prompt": [int(t) for t in prompt], "max_tokens": int(max_new_tokens),
                "temperature": temperature, "top_p": top_p, "seed": seed}
        if c.model:
            body["model"] = c.model
        if top_k:
            body["top_k"] = top_k
        if c.server == "vllm":  # (vLLM's extra sampling fields)
            body.update(logprobs=0, return_token_ids=True, skip_special_tokens=False,
                        stop_token_ids=list(stop_token_ids), stop=list(stop_strings) or None,
                        include_stop_str_in_output=True)
            reply = self._post("/v1/completions", body)
        else:  # ptrain: an episode per request, the server's stop tokens
            if stop_strings:
                raise ValueError("ptrain's endpoint stops at its stop tokens only; stop "
                                 f"strings {stop_strings} cannot be sent")
            body["logprobs"] = True
            eid = self._post("/v1/episodes", {})["id"]
            try:
                reply = self._post(f"/episodes/{eid}/v1/completions", body)
            finally:
                self._post(f"/v1/episodes/{eid}/close", {})
        choice = reply["choices"][0]
        ids = choice.get("token_ids")
        logp = (choice.get("logprobs") or {}).get("token_logprobs")
        if ids is None or logp is None or len(ids) != len(logp):
            raise EngineError("the engine's completion has no token_ids or no per-token "
                              "log-probs (vLLM: return_token_ids and logprobs; see "
                              "docs/engines.md)")
        return [int(t) for t in ids], [float(x) for x in logp], choice.get("finish_reason")

    def sample(self, params, prompts, *, max_new_tokens: int, num_samples: int = 1,
               temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
               greedy: bool = False, stop_token_ids=(), stop_strings=(), key=None,
               prompt_len: int | None = None, batch_size: int | None = None,
               record_routing: bool | None = None, shared: bool = False) -> Samples:
        """`num_samples` completions of each prompt by the external engine (rows
        prompt-major, as `Sampler.sample`); `params` not yet synced are synced first."""
        del prompt_len, batch_size
        if record_routing or shared:
            raise ValueError("an external engine records no MoE routing and samples no "
                             "shared multi-process batch (ExternalSampler runs on one "
                             "process)")
        if params is not None and params is not self._synced and self.config.sync_dir:
            self.sync(params)
        temperature = 0.0 if greedy else float(temperature)
        base = 0 if key is None else int(jax.random.randint(key, (), 0, 2 ** 30))
        rows = [(i, prompt) for i, prompt in enumerate(prompts) for _ in range(num_samples)]
        c = self.config
        with concurrent.futures.ThreadPoolExecutor(max_workers=c.max_concurrency) as pool:
            out = list(pool.map(lambda r: self._request(
                r[1][1], max_new_tokens, c, base + r[0], temperature, top_k, top_p,
                stop_token_ids, stop_strings), enumerate(rows)))
        n = len(rows)
        tokens = np.full((n, max_new_tokens), self.pad_id, np.int32)
        logp = np.zeros((n, max_new_tokens), np.float32)
        lengths = np.zeros(n, np.int32)
        for r, (ids, lp, _) in enumerate(out):
            if len(ids) > max_new_tokens:
                raise EngineError(f"the engine returned {len(ids)} tokens for max_tokens="
                                  f"{max_new_tokens}")
            tokens[r, :len(ids)], logp[r, :len(ids)], lengths[r] = ids, lp, len(ids)
        finish = ["stop" if f == "stop" else "length" for _, _, f in out]
        # One log-prob per token, the engine's: what the learner's correction compares with.
        return Samples(tokens=tokens, logp=logp, logp_temp=logp, logp_t1=logp,
                       lengths=lengths, finish_reasons=finish,
                       prompt_index=np.asarray([i for i, _ in rows], np.int32))
