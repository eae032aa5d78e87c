"""The rollout engine served as an OpenAI-compatible endpoint, every request recorded token for
token in its episode (ptrain/serve/service.py, http.py), and the recorded episodes as
training rows (episodes.py); an external OpenAI-compatible engine behind the sampler
interface, weights synced by exported checkpoint (external.py).

    service = serve.Service(engine, params, tokenizer, serve.ServeConfig(chat_format="qwen"))
    server = serve.make_server(service)       # loopback, a bearer token: server.token
"""

from ptrain.serve.episodes import Episode, Segment, training_episodes, training_segments
from ptrain.serve.external import EngineError, ExternalConfig, ExternalSampler
from ptrain.serve.http import make_server, serve
from ptrain.serve.service import ApiError, ServeConfig, Service, from_model_dir

__all__ = ["ApiError", "EngineError", "Episode", "ExternalConfig", "ExternalSampler", "Segment", "ServeConfig", "Service", "from_model_dir",
           "make_server", "serve", "training_episodes", "training_segments"]
