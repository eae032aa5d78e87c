"""sandbox.server on a loopback port: the same results as local calls, clear 4xx errors."""

import json
import os
import secrets
import socket
import threading
import urllib.request

import pytest

import sandbox
from sandbox import judge, server


@pytest.fixture(scope="module", autouse=True)
def token():
    """The servers here and their clients share a token through the environment."""
    old = os.environ.get(server.TOKEN_ENV)
    os.environ[server.TOKEN_ENV] = value = secrets.token_urlsafe(24)
    yield value
    if old is None:
        del os.environ[server.TOKEN_ENV]
    else:
        os.environ[server.TOKEN_ENV] = old


@pytest.fixture(scope="module")
def service():
    with sandbox.Pool(2, backend="process", queue_size=4) as pool:
        srv = server.make_server(pool, "127.0.0.1", 0, max_request_bytes=1 << 16,
                                 max_timeout_s=30)
        thread = threading.Thread(target=srv.serve_forever, daemon=True)
        thread.start()
        yield f"http://127.0.0.1:{srv.server_address[1]}", srv.server_address[1]
        srv.shutdown()
        srv.server_close()
        thread.join()


def post(url, path, body: bytes, headers=None):
    headers = {"Authorization": f"Bearer {os.environ[server.TOKEN_ENV]}", **(headers or {})}
    req = urllib.request.Request(url + path, data=body, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_run_matches_the_local_result_schema(service):
    url, _ = service
    client = server.Client(url)
    remote = client.run("import sys\nsys.stdout.buffer.write(sys.stdin.buffer.read()[::-1])\n"
                        "sys.exit(3)", stdin=b"\xff\x00ab", timeout_s=5,
                        files={"a.txt": "hi", "b.bin": b"\x80"}, return_files=True)
    local = sandbox.run("import sys\nsys.stdout.buffer.write(sys.stdin.buffer.read()[::-1])\n"
                        "sys.exit(3)", stdin=b"\xff\x00ab", timeout_s=5, backend="process",
                        files={"a.txt": "hi", "b.bin": b"\x80"}, return_files=True)
    assert remote.stdout == local.stdout == b"ba\x00\xff"
    assert remote.exit_code == local.exit_code == 3
    assert remote.files == local.files == {"a.txt": b"hi", "b.bin": b"\x80"}
    assert remote.backend == "process"
    status, body = post(url, "/run", json.dumps({"code": "print(1)"}).encode())
    want = sandbox.run("print(1)", backend="process").to_dict()
    assert status == 200 and sorted(body) == sorted(want) and body["stdout"] == "1\n"


def test_judges_match_the_local_reports(service):
    url, _ = service
    client = server.Client(url)
    code, tests = "def f(x):\n    return x + 1\n", "assert f(1) == 2\nassert f(2) == 4\n"
    remote = client.unit_tests(code, tests, test_timeout_s=2)
    local = judge.unit_tests(code, tests, test_timeout_s=2, backend="process")
    assert [(t.name, t.status, t.message) for t in remote.tests] == [
        (t.name, t.status, t.message) for t in local.tests]
    assert (remote.passed, remote.total, remote.feedback) == (1, 2, local.feedback)
    report = client.stdio("print(int(input()) * 2)", [("2", "4"), {"input": "3", "output": "7"}])
    assert [t.status for t in report.tests] == ["passed", "failed"]


def test_health(service):
    url, _ = service
    health = server.Client(url).health()
    assert health["ok"] is True and health["workers"] == 2 and health["backend"] == "process"


@pytest.mark.parametrize("path, body, status, message", [
    ("/run", b"{not json", 400, "not valid JSON"),
    ("/run", b"[1, 2]", 400, "must be a JSON object"),
    ("/run", b'{"code": 1}', 400, "field 'code' must be str"),
    ("/run", b'{"code": "x", "timeout": 1}', 400, "unknown field 'timeout'"),
    ("/run", b'{"code": "x", "timeout_s": -1}', 400, "positive number"),
    ("/run", b'{"code": "x", "timeout_s": 1000}', 400, "over this server's limit"),
    ("/run", b'{"code": "x", "network": true}', 400, "network"),
    ("/run", b'{"code": "x", "command": ["ls"]}', 400, "exactly one of"),
    ("/run", b'{"stdin_b64": "***", "code": "x"}', 400, "not base64"),
    ("/judge/unit_tests", b'{"code": "x"}', 400, "missing field(s) tests"),
    ("/judge/unit_tests", b'{"code": "x", "tests": "assert ("}', 400, "do not parse"),
    ("/judge/stdio", b'{"code": "x", "cases": [["1"]]}', 400, "(input, output) pair"),
    ("/nope", b"{}", 404, "no POST /nope"),
    ("/health", b"{}", 405, "no POST /health"),
])
def test_bad_requests_get_a_clear_4xx(service, path, body, status, message):
    url, _ = service
    got_status, got = post(url, path, body)
    assert got_status == status and message in got["error"], got


def test_get_on_a_post_endpoint_is_405(service):
    url, _ = service
    with pytest.raises(server.ServerError, match="405"):
        server.Client(url)._request(urllib.request.Request(url + "/run"))


def test_oversized_and_unsized_bodies_are_refused_before_reading(service):
    _, port = service

    def raw(request: bytes) -> bytes:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            s.sendall(request)
            s.shutdown(socket.SHUT_WR)
            return b"".join(iter(lambda: s.recv(65536), b""))

    big = raw(b"POST /run HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999\r\n\r\n{")
    assert big.startswith(b"HTTP/1.1 413") and b"the limit is 65536" in big
    unsized = raw(b"POST /run HTTP/1.1\r\nHost: x\r\n\r\n")
    assert unsized.startswith(b"HTTP/1.1 411")


def test_a_full_queue_answers_503(tmp_path):
    import sandbox_svc_util as util
    started, release = util.fifos(tmp_path, "started", "release")
    with sandbox.Pool(1, backend="process", queue_size=1) as pool:
        srv = server.make_server(pool)
        thread = threading.Thread(target=srv.serve_forever, daemon=True)
        thread.start()
        try:
            busy = pool.submit(util.hold, started, release)
            let_go = util.read_then_write(started, release, "done")
            queued = pool.submit(util.square, 3)  # the queue (size 1) is now full
            status, body = post(f"http://127.0.0.1:{srv.server_address[1]}", "/run",
                                b'{"code": "print(1)"}')
            assert status == 503 and "retry later" in body["error"]
            let_go()
            assert (busy.result(), queued.result()) == ("done", 9)
        finally:
            srv.shutdown()
            srv.server_close()
