"""Serve a model as an OpenAI-compatible endpoint that records every episode token for token.

    python -m launch.serve --model=/path/to/hf_dir --chat_format=qwen --port=8000
    # prints PTRAIN_SERVE_TOKEN=...; an agent then uses
    #   base_url=http://127.0.0.1:8000/episodes/<id>/v1 (POST /v1/episodes opens <id>)

See ptrain/serve/ (docs/agents.md): the routes, the recording, the flags' meaning.
"""

from __future__ import annotations

from absl import app, flags

_MODEL = flags.DEFINE_string("model", None, "A Hugging Face model directory (with tokenizer).")
_HOST = flags.DEFINE_string("host", "127.0.0.1", "The address to bind (loopback by default).")
_PORT = flags.DEFINE_integer("port", 8000, "The port (0: a free one).")
_TOKEN = flags.DEFINE_string("token", None, "The bearer token (default $PTRAIN_SERVE_TOKEN, "
                                            "else a new one, printed).")
_FORMAT = flags.DEFINE_string("chat_format", "qwen", "The model family's chat format.")
_SLOTS = flags.DEFINE_integer("slots", 16, "Decode slots: sequences held at once.")
_MAX_LEN = flags.DEFINE_integer("max_len", 4096, "Tokens per sequence (prompt included).")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 1024, "Tokens per model turn.")
_TEMPERATURE = flags.DEFINE_float("temperature", 1.0, "The policy's sampling temperature.")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Top-p.")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Top-k (0: off).")
_ON_REWRITE = flags.DEFINE_enum("on_rewrite", "reprefill", ["reprefill", "drop"],
                                "A request that rewrites its episode's history.")
_SAMPLING = flags.DEFINE_enum("sampling_params", "error", ["error", "ignore"],
                              "A request asking for other sampling than the server's.")
_AUTO = flags.DEFINE_bool("auto_episodes", False, "Unknown episode ids open episodes.")
_LOAD = flags.DEFINE_bool("load_weights", False, "Serve POST /update_weights_from_disk "
                          "(a learner's exported checkpoints: serve.ExternalSampler).")
flags.mark_flags_as_required(["model"])


def main(argv):
    del argv
    from ptrain import serve
    config = serve.ServeConfig(host=_HOST.value, port=_PORT.value, token=_TOKEN.value,
                               chat_format=_FORMAT.value, on_rewrite=_ON_REWRITE.value,
                               sampling_params=_SAMPLING.value, auto_episodes=_AUTO.value,
                               load_weights=_LOAD.value)
    service = serve.from_model_dir(_MODEL.value, config, slots=_SLOTS.value,
                                   max_len=_MAX_LEN.value, max_new_tokens=_MAX_NEW.value,
                                   temperature=_TEMPERATURE.value, top_k=_TOP_K.value,
                                   top_p=_TOP_P.value)
    serve.serve(service, config)


if __name__ == "__main__":
    app.run(main)
