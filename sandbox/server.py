"""An HTTP service over a `Pool`: runs and judges for trainers on other machines.

    python -m sandbox.server --port 8000 --workers 8 --backend bwrap   # prints its token

    POST /run               fields of sandbox.run        -> Result.to_dict()
    POST /judge/unit_tests  fields of judge.unit_tests   -> Report.to_dict()
    POST /judge/stdio       fields of judge.stdio        -> Report.to_dict()
    GET  /health            {"ok", "workers", "backend", "stats"}

It admits only its clients. Every request carries `Authorization: Bearer <token>` (the
token is generated at start and printed, or given: `--token`, `make_server(token=...)` or
$PTRAIN_SANDBOX_TOKEN); the Host header must name this server (loopback names and the bound
address, plus `allowed_hosts`), and a request with an Origin or Sec-Fetch-* header (one a
browser makes) is refused, so neither a web page nor a DNS-rebinding page can drive it.

Bodies are JSON objects of at most `max_request_bytes` (Content-Length required; chunked,
missing or malformed lengths are refused before anything is read). The run fields are the
options of `sandbox.Request` and `sandbox.Limits` (declared there once); every number must be
finite and within the server's maxima (`CAPS`, each settable in `make_server`). A bad request
gets a 4xx with {"error": what to fix}: 400 bad JSON (of any shape) / unknown field / wrong
type / bad value, 401 no or wrong token, 403 bad Host or a browser's request, 404 unknown
path, 405 wrong method, 411 no Content-Length, 413 too large; 503 when the queue is full
(retry later) or the sandbox failed. `Client` is the matching caller. Plain HTTP: put it on a
private network or behind TLS termination.
"""

import argparse
import base64
import dataclasses
import hmac
import http.server
import json
import logging
import math
import os
import secrets
import urllib.error
import urllib.request

from sandbox import judge
from sandbox.backends import Limits
from sandbox.pool import Pool, PoolFull, WorkerLost
from sandbox.request import Request
from sandbox.result import Result
from sandbox.session import run

log = logging.getLogger("sandbox")

TOKEN_ENV = "PTRAIN_SANDBOX_TOKEN"
# The server's maxima for the options that name them (`cap` in sandbox.request.option).
CAPS = {"max_timeout_s": 300.0, "max_memory_mb": 8192, "max_processes": 1024,
        "max_output_bytes": 16 << 20, "max_file_mb": 1024, "max_open_files": 4096,
        "max_files_bytes": 64 << 20, "allow_network": False}
_OPTIONS = dataclasses.fields(Request) + dataclasses.fields(Limits)
_NUM = (int, float)
# Per endpoint: field -> accepted JSON types (the run's from the dataclasses). Else a 400.
_RUN_FIELDS = {**{f.name: f.metadata["json"] for f in _OPTIONS},
               "files_b64": (dict,), "stdin_b64": (str,)}
_UNIT_FIELDS = {
    "code": (str,), "tests": (str,), "entry_point": (str,), "style": (str,),
    "test_timeout_s": _NUM, "timeout_s": _NUM, "memory_mb": (int,),
}
_STDIO_FIELDS = {
    "code": (str,), "cases": (list,), "float_tol": _NUM, "case_timeout_s": _NUM,
    "timeout_s": _NUM, "memory_mb": (int,),
}
_FIELD_CAPS = {**{f.name: f.metadata["cap"] for f in _OPTIONS if f.metadata["cap"]},
               "test_timeout_s": "max_timeout_s", "case_timeout_s": "max_timeout_s"}
_REQUIRED = {"/run": (), "/judge/unit_tests": ("code", "tests"), "/judge/stdio": ("code", "cases")}
_BROWSER_HEADERS = ("Origin", "Sec-Fetch-Site", "Sec-Fetch-Mode", "Sec-Fetch-Dest")


class BadRequest(Exception):
    def __init__(self, status, message):
        super().__init__(message)
        self.status = status


def make_server(pool: Pool, host: str = "127.0.0.1", port: int = 0, *,
                token: str | None = None, allowed_hosts=(), max_request_bytes: int = 8 << 20,
                **caps):
    """A ThreadingHTTPServer serving `pool` (not yet started: call `serve_forever`, e.g. in a
    thread). port=0 picks a free one: `server.server_address[1]`. `token`: the bearer token
    clients must send (default $PTRAIN_SANDBOX_TOKEN, else a new random one): `server.token`.
    `allowed_hosts`: more Host header values to accept ("name:port"; "*" accepts any).
    `caps`: maxima from `CAPS` to change, e.g. max_timeout_s=30, allow_network=True."""
    unknown = set(caps) - set(CAPS)
    if unknown:
        raise TypeError(f"unknown server maxima {sorted(unknown)}; the maxima are {sorted(CAPS)}")
    token = token or os.environ.get(TOKEN_ENV) or secrets.token_urlsafe(32)
    if not isinstance(token, str) or len(token) < 16:
        raise ValueError("the server's token must be a str of at least 16 characters")

    class Handler(_Handler):
        pass

    Handler.pool, Handler.token = pool, token
    Handler.limits = {**CAPS, **caps, "max_request_bytes": max_request_bytes}
    server = http.server.ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    server.token = token
    bound = server.server_address[1]
    names = {"127.0.0.1", "localhost", "[::1]", host if ":" not in host else f"[{host}]"}
    Handler.hosts = {f"{n}:{bound}" for n in names} | set(allowed_hosts)
    return server


class _Handler(http.server.BaseHTTPRequestHandler):
    pool: Pool
    limits: dict
    token: str
    hosts: set
    timeout = 60  # seconds a client may take to send its request
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):
        log.debug("sandbox server: " + fmt, *args)

    def do_GET(self):
        try:
            self._admit()
            self.close_connection = False
            if self.path != "/health":
                raise BadRequest(404 if self.path not in _REQUIRED else 405,
                                 f"no GET {self.path}; GET /health, or POST to "
                                 f"{', '.join(_REQUIRED)}")
        except BadRequest as e:
            return self._fail(e.status, str(e))
        self._send(200, {"ok": True, "workers": self.pool.workers,
                         "backend": str(self.pool.backend), "stats": self.pool.stats()})

    def do_POST(self):
        try:
            length = self._content_length()
            self._admit()
            if self.path not in _REQUIRED:
                raise BadRequest(404 if self.path != "/health" else 405,
                                 f"no POST {self.path}; use one of {', '.join(_REQUIRED)}")
            body = self._read_json(length)
            future = self._submit(self.path, body)
            value = future.result()
        except BadRequest as e:
            return self._fail(e.status, str(e))
        except PoolFull as e:
            return self._fail(503, f"busy, retry later: {e}", {"Retry-After": "1"})
        except (ValueError, TypeError) as e:  # the sandbox's own argument checks
            return self._fail(400, str(e))
        except RecursionError:
            return self._fail(400, "a field is nested too deeply")
        except WorkerLost as e:
            return self._fail(503, f"the sandbox failed: {e}")
        except Exception as e:  # noqa: BLE001 - a server error, said as one
            log.exception("sandbox server: %s failed", self.path)
            return self._fail(500, f"{type(e).__name__}: {e}")
        self._send(200, value.to_dict())

    def _admit(self):
        """Only this server's clients: no browser's request, the right Host, the token."""
        self.close_connection = True  # until the body is read: an early answer ends it
        for name in _BROWSER_HEADERS:
            if self.headers.get(name) is not None:
                raise BadRequest(403, f"requests from a browser ({name} header) are refused")
        host = self.headers.get("Host", "")
        if "*" not in self.hosts and host not in self.hosts:
            raise BadRequest(403, f"Host {host[:100]!r} is not this server's; allowed: "
                                  f"{', '.join(sorted(self.hosts))} (make_server allowed_hosts)")
        auth = self.headers.get("Authorization", "")
        given = auth[7:] if auth[:7].lower() == "bearer " else ""
        if not hmac.compare_digest(given.encode(), self.token.encode()):
            raise BadRequest(401, "send `Authorization: Bearer <token>` with the server's "
                                  "token (printed at its start, or $" + TOKEN_ENV + ")")

    def _content_length(self) -> int:
        if self.headers.get("Transfer-Encoding") is not None:
            self.close_connection = True
            raise BadRequest(411, "send a Content-Length, not a chunked body")
        lengths = self.headers.get_all("Content-Length") or []
        if not lengths:
            self.close_connection = True
            raise BadRequest(411, "a Content-Length header is required")
        if len(lengths) > 1 or not lengths[0].strip().isdigit() or not lengths[0].isascii():
            self.close_connection = True
            raise BadRequest(400, f"bad Content-Length {', '.join(lengths)[:100]!r}: one "
                                  "non-negative integer")
        length, limit = int(lengths[0]), self.limits["max_request_bytes"]
        if length > limit:
            self.close_connection = True  # the body is not read
            raise BadRequest(413, f"the body is {length} bytes; the limit is {limit}")
        return length

    def _read_json(self, length):
        data = self.rfile.read(length)
        if len(data) != length:
            raise BadRequest(400, f"the body ended after {len(data)} of {length} bytes")
        self.close_connection = False
        try:
            body = json.loads(data, parse_constant=_no_constant)
        except RecursionError:
            raise BadRequest(400, "the body is not valid JSON: nested too deeply") from None
        except (ValueError, UnicodeDecodeError) as e:
            raise BadRequest(400, f"the body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise BadRequest(400, f"the body must be a JSON object, got {type(body).__name__}")
        return body

    def _submit(self, path, body):
        fields = {"/run": _RUN_FIELDS, "/judge/unit_tests": _UNIT_FIELDS,
                  "/judge/stdio": _STDIO_FIELDS}[path]
        for key, value in body.items():
            if key not in fields:
                raise BadRequest(400, f"unknown field {key!r} for {path}; allowed: "
                                      f"{', '.join(sorted(fields))}")
            if value is None and key in ("entry_point", "float_tol", "language", "code",
                                         "command", "stdin"):
                continue
            if not isinstance(value, fields[key]) or (
                    isinstance(value, bool) and bool not in fields[key]):
                names = "/".join(t.__name__ for t in fields[key])
                raise BadRequest(400, f"field {key!r} must be {names}, got "
                                      f"{type(value).__name__}")
        missing = [k for k in _REQUIRED[path] if k not in body]
        if missing:
            raise BadRequest(400, f"missing field(s) {', '.join(missing)} for {path}")
        self._check_limits(body)
        kwargs = dict(body, backend=self.pool.backend)
        if path == "/run":
            kwargs = _decode_run(kwargs)
            _validate_run(kwargs)  # here, before any worker sees it
            return self.pool.submit_nowait(run, **kwargs)
        fn = judge.unit_tests if path == "/judge/unit_tests" else judge.stdio
        return self.pool.submit_nowait(fn, **kwargs)

    def _check_limits(self, body):
        """Every number finite and within this server's maxima."""
        for key, value in body.items():
            if isinstance(value, bool) or not isinstance(value, _NUM):
                continue
            if not math.isfinite(value):
                raise BadRequest(400, f"{key}={value} is not a finite number")
            cap = _FIELD_CAPS.get(key)
            if cap is not None and value > self.limits[cap]:
                raise BadRequest(400, f"{key}={value} is over this server's limit of "
                                      f"{self.limits[cap]} ({cap})")
        if body.get("network") and not self.limits["allow_network"]:
            raise BadRequest(400, "network=true is not allowed on this server")

    def _send(self, status, obj, headers=None):
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if self.close_connection:
            self.send_header("Connection", "close")
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(data)

    def _fail(self, status, message, headers=None):
        self._send(status, {"error": message}, headers)


def _no_constant(name):
    raise ValueError(f"{name} is not a number JSON allows")


def _validate_run(kwargs):
    """Build the run's Request and Limits (what `sandbox.run` builds again in the worker):
    a bad value is a 400 from here, before the pool sees it."""
    names = {f.name for f in dataclasses.fields(Limits)}
    Limits(**{k: v for k, v in kwargs.items() if k in names})
    Request(**{k: v for k, v in kwargs.items() if k not in names and k != "backend"})


def _decode_run(kwargs):
    """JSON fields -> sandbox.run arguments (bytes come as text, or base64 in *_b64)."""
    files = {p: t for p, t in (kwargs.pop("files", None) or {}).items()}
    for path, b64 in kwargs.pop("files_b64", {}).items():
        try:
            files[path] = base64.b64decode(b64, validate=True)
        except (ValueError, TypeError):
            raise BadRequest(400, f"files_b64[{path!r}] is not base64") from None
    if files:
        kwargs["files"] = files
    if "stdin_b64" in kwargs:
        if kwargs.get("stdin") is not None:
            raise BadRequest(400, "give stdin or stdin_b64, not both")
        try:
            kwargs["stdin"] = base64.b64decode(kwargs.pop("stdin_b64"), validate=True)
        except (ValueError, TypeError):
            raise BadRequest(400, "stdin_b64 is not base64") from None
    return kwargs


class ServerError(RuntimeError):
    """The server answered with an error status; `status` and the server's message."""

    def __init__(self, status, message):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class Client:
    """Calls a sandbox server: the same arguments and results as the local functions.
    `token`: the server's (default $PTRAIN_SANDBOX_TOKEN)."""

    def __init__(self, url: str, timeout_s: float = 600.0, token: str | None = None):
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.token = token or os.environ.get(TOKEN_ENV)

    def run(self, code=None, **kwargs) -> Result:
        body = {"code": code, **kwargs} if code is not None else dict(kwargs)
        if isinstance(body.get("stdin"), bytes):
            body["stdin_b64"] = base64.b64encode(body.pop("stdin")).decode()
        if "files" in body:
            files = body.pop("files")
            body["files"] = {p: c for p, c in files.items() if isinstance(c, str)}
            body["files_b64"] = {p: base64.b64encode(c).decode() for p, c in files.items()
                                 if isinstance(c, bytes)}
        return Result.from_dict(self._post("/run", body))

    def unit_tests(self, code, tests, **kwargs) -> judge.Report:
        return judge.Report.from_dict(self._post("/judge/unit_tests",
                                                 {"code": code, "tests": tests, **kwargs}))

    def stdio(self, code, cases, **kwargs) -> judge.Report:
        cases = [list(c) if isinstance(c, tuple) else c for c in cases]
        return judge.Report.from_dict(self._post("/judge/stdio",
                                                 {"code": code, "cases": cases, **kwargs}))

    def health(self) -> dict:
        return self._request(urllib.request.Request(self.url + "/health"))

    def _post(self, path, body):
        data = json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method="POST",
                                     headers={"Content-Type": "application/json"})
        return self._request(req)

    def _request(self, req):
        if self.token and not req.has_header("Authorization"):
            req.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as e:
            try:
                message = json.loads(e.read()).get("error", "")
            except ValueError:
                message = e.reason
            raise ServerError(e.code, message) from None


def main(argv=None):
    parser = argparse.ArgumentParser(description="Serve sandbox runs and judges over HTTP.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--queue-size", type=int, default=None)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--max-request-mb", type=int, default=8)
    parser.add_argument("--token", default=None,
                        help=f"the bearer token clients send (default ${TOKEN_ENV}, else a "
                             "new one, printed)")
    parser.add_argument("--allowed-host", action="append", default=[],
                        help="another Host header value to accept (name:port)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    with Pool(args.workers, backend=args.backend, queue_size=args.queue_size) as pool:
        server = make_server(pool, args.host, args.port, token=args.token,
                             allowed_hosts=args.allowed_host,
                             max_request_bytes=args.max_request_mb << 20)
        if not (args.token or os.environ.get(TOKEN_ENV)):
            print(f"{TOKEN_ENV}={server.token}", flush=True)
        log.info("sandbox server on http://%s:%d (%d workers, backend %s)",
                 *server.server_address[:2], args.workers, args.backend)
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            server.server_close()


if __name__ == "__main__":
    main()

