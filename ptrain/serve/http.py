"""The OpenAI-compatible HTTP endpoint over a `Service` (ptrain/serve/service.py).

    POST /v1/episodes                    {"id"?, "max_len"?, "metadata"?} -> {"id", "base_path"}
    GET  /v1/episodes/<id>               the episode's record (ptrain/serve/episodes.py)
    POST /v1/episodes/<id>/close         ends it (frees its slot) -> its record
    POST /v1/chat/completions            OpenAI chat (tools, logprobs, stream)
    POST /v1/completions                 OpenAI text completion (prompt text or token ids)
    GET  /v1/models, GET /health

A completion names its episode by the `X-Episode-Id` header, an `episode_id` body field, or
its path: `/episodes/<id>/v1/chat/completions`, so an agent that only takes a base URL is
given `http://host:port/episodes/<id>/v1`. Responses are OpenAI's, plus `token_ids` in each
choice, `prompt_token_ids` (the ids the request appended before the model's turn),
`episode_id`, `segment` and `policy_version`. `stream: true` answers in server-sent events
(OpenAI's chunks; the engine hands over a turn when it ends, so the chunks come then).

Admission is the sandbox server's (sandbox/server.py): a bearer token (`Authorization:
Bearer ...`, the server's `token`, printed at start by launch/serve.py, or
$PTRAIN_SERVE_TOKEN), the Host header must name this server, browser requests (Origin,
Sec-Fetch-*) are refused, and bodies are JSON objects of at most `max_request_bytes` with a
Content-Length. It binds loopback unless told otherwise. Errors come in OpenAI's shape,
{"error": {"message", "type", "code"}}.
"""

from __future__ import annotations

import http.server
import json
import logging
import os
import re
import secrets
import time

from sandbox import server as sandbox_server
from ptrain.serve.service import ApiError, ServeConfig, Service

log = logging.getLogger("ptrain.serve")

TOKEN_ENV = "PTRAIN_SERVE_TOKEN"
_SCOPED = re.compile(r"/episodes/([^/]+)(/v1/.*)")
_EPISODE = re.compile(r"/v1/episodes/([^/]+)(/close)?")


def make_server(service: Service, config: ServeConfig | None = None):
    """A ThreadingHTTPServer serving `service` (call `serve_forever`, e.g. in a thread);
    `server.token` is its bearer token, `server.server_address[1]` its port."""
    config = config or service.config
    token = config.token or os.environ.get(TOKEN_ENV) or secrets.token_urlsafe(32)
    if not isinstance(token, str) or len(token) < 16:
        raise ValueError("the server's token must be a str of at least 16 characters")

    class Handler(_Handler):
        pass

    Handler.service, Handler.token, Handler.token_env = service, token, TOKEN_ENV
    Handler.limits = {"max_request_bytes": config.max_request_bytes}
    server = http.server.ThreadingHTTPServer((config.host, config.port), Handler)
    server.daemon_threads = True
    server.token = token
    bound = server.server_address[1]
    host = config.host
    names = {"127.0.0.1", "localhost", "[::1]", host if ":" not in host else f"[{host}]"}
    Handler.hosts = {f"{n}:{bound}" for n in names} | set(config.allowed_hosts)
    return server


class _Handler(sandbox_server._Handler):
    """The sandbox server's admission (token, Host, browser headers, Content-Length, JSON
    bodies), with OpenAI's routes and error shape."""

    service: Service
    token_env: str
    timeout = 600  # seconds a client may take to send its request
    # Headers and body go out in separate writes: without this each answer waits out the
    # client's delayed ACK (tens of ms a turn on loopback).
    disable_nagle_algorithm = True

    def log_message(self, fmt, *args):
        log.debug("serve: " + fmt, *args)

    def do_GET(self):
        self._route("GET")

    def do_POST(self):
        self._route("POST")

    def _route(self, method):
        try:
            length = self._content_length() if method == "POST" else 0
            self._admit()
            path, eid = self.path.split("?")[0], self.headers.get("X-Episode-Id")
            scoped = _SCOPED.fullmatch(path)
            if scoped:
                eid, path = scoped.group(1), scoped.group(2)
            body = self._read_json(length) if method == "POST" else {}
            self.close_connection = False
            if "episode_id" in body:
                if not isinstance(body["episode_id"], str):
                    raise ApiError(400, "episode_id must be a string")
                if eid is not None and body["episode_id"] != eid:
                    raise ApiError(400, f"episode_id {body['episode_id']!r} contradicts the "
                                        f"request's episode {eid!r} (header or path)")
                eid = body["episode_id"]
            self._dispatch(method, path, eid, body)
        except sandbox_server.BadRequest as e:
            self._fail(e.status, str(e), "invalid_request_error")
        except ApiError as e:
            self._fail(e.status, str(e), e.kind)
        except Exception as e:  # noqa: BLE001 - a server error, said as one
            log.exception("serve: %s failed", self.path)
            self._fail(500, f"{type(e).__name__}: {e}", "server_error")

    def _admit(self):
        try:
            super()._admit()
        except sandbox_server.BadRequest as e:
            if e.status == 401:
                raise ApiError(401, "send `Authorization: Bearer <token>` with the server's "
                                    f"token (printed at its start, or ${self.token_env})",
                               "authentication_error") from None
            raise

    def _dispatch(self, method, path, eid, body):
        s = self.service
        if (method, path) == ("GET", "/health"):
            return self._send(200, {"ok": True, "policy_version": s.runner.version,
                                    "episodes": len(s.episodes), "engine": s.engine.metrics()})
        if (method, path) == ("GET", "/v1/models"):
            return self._send(200, {"object": "list", "data": [
                {"id": s.config.model_name, "object": "model", "created": 0,
                 "owned_by": "ptrain"}]})
        if (method, path) == ("POST", "/update_weights_from_disk"):
            return self._send(200, s.load_weights(body))
        if (method, path) == ("POST", "/v1/episodes"):
            return self._send(200, s.open_episode(body))
        episode = _EPISODE.fullmatch(path)
        if episode and method == ("POST" if episode.group(2) else "GET"):
            if episode.group(2):
                return self._send(200, s.close_episode(episode.group(1)))
            return self._send(200, s.episode(episode.group(1)).to_dict())
        if method == "POST" and path in ("/v1/chat/completions", "/v1/completions"):
            if not eid:
                raise ApiError(400, "every request belongs to an episode: send its id "
                                    "(X-Episode-Id header, episode_id field, or the base URL "
                                    "/episodes/<id>/v1); open one with POST /v1/episodes")
            chat = path == "/v1/chat/completions"
            reply = (s.chat if chat else s.completion)(eid, body)
            if body.get("stream"):
                return self._stream(chunks(reply, chat, usage=bool(
                    (body.get("stream_options") or {}).get("include_usage"))))
            return self._send(200, reply)
        raise ApiError(404, f"no {method} {path}; the routes: GET /health, GET /v1/models, "
                            "POST /v1/episodes, GET /v1/episodes/<id>, POST "
                            "/v1/episodes/<id>/close, POST /v1/chat/completions, POST "
                            "/v1/completions", "not_found_error")

    def _stream(self, events):
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for event in events:
            data = f"data: {event if isinstance(event, str) else json.dumps(event)}\n\n".encode()
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.write(b"0\r\n\r\n")

    def _fail(self, status, message, kind="invalid_request_error", headers=None):
        self._send(status, {"error": {"message": message, "type": kind, "code": status}},
                   headers)


def chunks(reply: dict, chat: bool, *, usage: bool = False):
    """A reply as OpenAI's stream chunks, then "[DONE]"."""
    base = {"id": reply["id"], "created": reply["created"], "model": reply["model"],
            "object": "chat.completion.chunk" if chat else "text_completion",
            "episode_id": reply["episode_id"], "policy_version": reply["policy_version"]}
    choice = reply["choices"][0]
    if chat:
        message = choice["message"]
        yield {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                    "finish_reason": None}]}
        if message["content"]:
            yield {**base, "choices": [{"index": 0, "delta": {"content": message["content"]},
                                        "logprobs": choice["logprobs"],
                                        "finish_reason": None}]}
        for i, call in enumerate(message.get("tool_calls", [])):
            yield {**base, "choices": [{"index": 0, "delta": {"tool_calls": [
                {"index": i, **call}]}, "finish_reason": None}]}
        yield {**base, "choices": [{"index": 0, "delta": {}, "token_ids": choice["token_ids"],
                                    "finish_reason": choice["finish_reason"]}]}
    else:
        yield {**base, "choices": [{"index": 0, "text": choice["text"],
                                    "logprobs": choice["logprobs"], "finish_reason": None}]}
        yield {**base, "choices": [{"index": 0, "text": "", "token_ids": choice["token_ids"],
                                    "finish_reason": choice["finish_reason"]}]}
    if usage:
        yield {**base, "choices": [], "usage": reply["usage"]}
    yield "[DONE]"


def serve(service: Service, config: ServeConfig | None = None, *, announce=print) -> None:
    """Serves until interrupted (launch/serve.py)."""
    server = make_server(service, config)
    config = config or service.config
    if not (config.token or os.environ.get(TOKEN_ENV)):
        announce(f"{TOKEN_ENV}={server.token}")
    host, port = server.server_address[:2]
    announce(f"serving {config.model_name} on http://{host}:{port}/v1 "
             f"(chat format {config.chat_format}, started {time.strftime('%H:%M:%S')})")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        service.close()
