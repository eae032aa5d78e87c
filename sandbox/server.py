"""An HTTP service over a `Pool`: runs and judges for trainers on other machines.

    python -m sandbox.server --port 8000 --workers 8 --backend bwrap

    POST /run               fields of sandbox.run        -> Result.to_dict()
    POST /judge/unit_tests  fields of judge.unit_tests   -> Report.to_dict()
    POST /judge/stdio       fields of judge.stdio        -> Report.to_dict()
    GET  /health            {"ok", "workers", "backend", "stats"}

Bodies are JSON objects, at most `max_request_bytes`. A malformed request gets a 4xx with
{"error": what to fix}: 400 bad JSON / unknown field / wrong type / bad value, 404 unknown
path, 405 wrong method, 411 no Content-Length, 413 too large; 503 when the queue is full
(retry later) or the sandbox failed. `Client` is the matching caller. Plain HTTP: put it on a
private network or behind TLS termination; it has no authentication of its own.
"""

import argparse
import base64
import http.server
import json
import logging
import urllib.error
import urllib.request

from sandbox import judge
from sandbox.pool import Pool, PoolFull, WorkerLost
from sandbox.result import Result
from sandbox.session import run

log = logging.getLogger("sandbox")

_NUM = (int, float)
# Per endpoint: field -> accepted JSON types. Everything else is a 400.
_RUN_FIELDS = {
    "code": (str,), "language": (str,), "command": (list,), "files": (dict,),
    "files_b64": (dict,), "stdin": (str,), "stdin_b64": (str,), "timeout_s": _NUM,
    "memory_mb": (int,), "return_files": (bool,), "env": (dict,), "max_processes": (int,),
    "max_output_bytes": (int,), "max_file_mb": (int,), "max_open_files": (int,),
    "max_files_bytes": (int,), "network": (bool,),
}
_UNIT_FIELDS = {
    "code": (str,), "tests": (str,), "entry_point": (str,), "style": (str,),
    "test_timeout_s": _NUM, "timeout_s": _NUM, "memory_mb": (int,),
}
_STDIO_FIELDS = {
    "code": (str,), "cases": (list,), "float_tol": _NUM, "case_timeout_s": _NUM,
    "timeout_s": _NUM, "memory_mb": (int,),
}
_REQUIRED = {"/run": (), "/judge/unit_tests": ("code", "tests"), "/judge/stdio": ("code", "cases")}


class BadRequest(Exception):
    def __init__(self, status, message):
        super().__init__(message)
        self.status = status


def make_server(pool: Pool, host: str = "127.0.0.1", port: int = 0, *,
                max_request_bytes: int = 8 << 20, max_timeout_s: float = 300.0,
                max_memory_mb: int = 8192, allow_network: bool = False):
    """A ThreadingHTTPServer serving `pool` (not yet started: call `serve_forever`, e.g. in a
    thread). port=0 picks a free one: `server.server_address[1]`."""
    limits = {"max_request_bytes": max_request_bytes, "max_timeout_s": max_timeout_s,
              "max_memory_mb": max_memory_mb, "allow_network": allow_network}

    class Handler(_Handler):
        pass

    Handler.pool, Handler.limits = pool, limits
    server = http.server.ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server


class _Handler(http.server.BaseHTTPRequestHandler):
    pool: Pool
    limits: dict
    timeout = 60  # seconds a client may take to send its request
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):
        log.debug("sandbox server: " + fmt, *args)

    def do_GET(self):
        if self.path != "/health":
            return self._fail(404 if self.path not in _REQUIRED else 405,
                              f"no GET {self.path}; GET /health, or POST to "
                              f"{', '.join(_REQUIRED)}")
        self._send(200, {"ok": True, "workers": self.pool.workers,
                         "backend": str(self.pool.backend), "stats": self.pool.stats()})

    def do_POST(self):
        try:
            if self.path not in _REQUIRED:
                raise BadRequest(404 if self.path != "/health" else 405,
                                 f"no POST {self.path}; use one of {', '.join(_REQUIRED)}")
            body = self._read_json()
            future = self._submit(self.path, body)
            value = future.result()
        except BadRequest as e:
            return self._fail(e.status, str(e))
        except PoolFull as e:
            return self._fail(503, f"busy, retry later: {e}", {"Retry-After": "1"})
        except (ValueError, TypeError) as e:  # the sandbox's own argument checks
            return self._fail(400, str(e))
        except WorkerLost as e:
            return self._fail(503, f"the sandbox failed: {e}")
        except Exception as e:  # noqa: BLE001 - a server error, said as one
            log.exception("sandbox server: %s failed", self.path)
            return self._fail(500, f"{type(e).__name__}: {e}")
        self._send(200, value.to_dict())

    def _read_json(self):
        if self.headers.get("Transfer-Encoding"):
            raise BadRequest(411, "send a Content-Length, not a chunked body")
        length = self.headers.get("Content-Length")
        if length is None:
            raise BadRequest(411, "a Content-Length header is required")
        try:
            length = int(length)
        except ValueError:
            raise BadRequest(400, f"bad Content-Length {length!r}") from None
        limit = self.limits["max_request_bytes"]
        if length > limit:
            self.close_connection = True  # the body is not read
            raise BadRequest(413, f"the body is {length} bytes; the limit is {limit}")
        data = self.rfile.read(length)
        try:
            body = json.loads(data)
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
            if value is None and key in ("entry_point", "float_tol", "language"):
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
            return self.pool.submit_nowait(run, **_decode_run(kwargs))
        fn = judge.unit_tests if path == "/judge/unit_tests" else judge.stdio
        return self.pool.submit_nowait(fn, **kwargs)

    def _check_limits(self, body):
        for key in ("timeout_s", "test_timeout_s", "case_timeout_s"):
            if key in body and body[key] > self.limits["max_timeout_s"]:
                raise BadRequest(400, f"{key}={body[key]} is over this server's limit of "
                                      f"{self.limits['max_timeout_s']}")
        if body.get("memory_mb", 0) > self.limits["max_memory_mb"]:
            raise BadRequest(400, f"memory_mb={body['memory_mb']} is over this server's limit "
                                  f"of {self.limits['max_memory_mb']}")
        if body.get("network") and not self.limits["allow_network"]:
            raise BadRequest(400, "network=true is not allowed on this server")

    def _send(self, status, obj, headers=None):
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(data)

    def _fail(self, status, message, headers=None):
        self._send(status, {"error": message}, headers)


def _decode_run(kwargs):
    """JSON fields -> sandbox.run arguments (bytes come as text, or base64 in *_b64)."""
    files = {p: t for p, t in kwargs.pop("files", {}).items()}
    for path, b64 in kwargs.pop("files_b64", {}).items():
        try:
            files[path] = base64.b64decode(b64, validate=True)
        except (ValueError, TypeError):
            raise BadRequest(400, f"files_b64[{path!r}] is not base64") from None
    if files:
        kwargs["files"] = files
    if "stdin_b64" in kwargs:
        if "stdin" in kwargs:
            raise BadRequest(400, "give stdin or stdin_b64, not both")
        try:
            kwargs["stdin"] = base64.b64decode(kwargs.pop("stdin_b64"), validate=True)
        except ValueError:
            raise BadRequest(400, "stdin_b64 is not base64") from None
    return kwargs


class ServerError(RuntimeError):
    """The server answered with an error status; `status` and the server's message."""

    def __init__(self, status, message):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class Client:
    """Calls a sandbox server: the same arguments and results as the local functions."""

    def __init__(self, url: str, timeout_s: float = 600.0):
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

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
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    with Pool(args.workers, backend=args.backend, queue_size=args.queue_size) as pool:
        server = make_server(pool, args.host, args.port,
                             max_request_bytes=args.max_request_mb << 20)
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

