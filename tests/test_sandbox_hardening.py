"""Classes of attack on the sandbox, each with a test of its own, on every isolating backend where
the class concerns the sandbox (the `backend` fixture skips what cannot run here).

Reward hacking: a value crosses from the solution to the judge only as plain data; the
tests' globals survive a restart; integers compare as integers; a truncated file listing
fails a Files verdict.
"""

import concurrent.futures
import json
import os
import socket
import threading
import time

import hypothesis
import hypothesis.strategies as st
import pytest

import sandbox
import sandbox_svc_util as util
from ptrain import rewards, tasks
from sandbox import judge, server, tools
from sandbox_backends import backend_params, own_temp_dirs
from sandbox_svc_util import backend  # noqa: F401 - the fixture

P = {"backend": "process"}


def statuses(report):
    return [t.status for t in report.tests]


# -- the judge compares plain data in the trusted harness ---------------------------------------

# HumanEval/4 as written: abs(candidate(x) - expected) < 1e-6.
HE4_TESTS = ("def check(candidate):\n"
             "    assert abs(candidate([1.0, 2.0, 3.0]) - 2.0/3.0) < 1e-6\n"
             "    assert abs(candidate([1.0, 2.0, 3.0, 4.0]) - 1.0) < 1e-6\n")
OPERATOR_ATTACKS = {
    "__sub__ returns 0.0": ("class Z:\n    def __sub__(self, o): return 0.0\n"
                            "    def __rsub__(self, o): return 0.0\n"
                            "def mad(xs):\n    return Z()\n"),
    "__abs__ and __lt__ lie": ("class Z:\n    def __sub__(self, o): return self\n"
                               "    def __abs__(self): return self\n"
                               "    def __lt__(self, o): return True\n"
                               "def mad(xs):\n    return Z()\n"),
    "float subclass": ("class F(float):\n    def __sub__(self, o): return 0.0\n"
                       "def mad(xs):\n    return F(7)\n"),
    "inside a list": ("class Z:\n    def __sub__(self, o): return 0.0\n"
                      "def mad(xs):\n    return [Z()][0]\n"),
}


@pytest.mark.parametrize("attack", sorted(OPERATOR_ATTACKS))
def test_arithmetic_on_a_returned_object_is_unjudgeable(attack, backend):  # noqa: F811
    r = judge.unit_tests(OPERATOR_ATTACKS[attack], HE4_TESTS, entry_point="mad",
                         backend=backend)
    assert r.passed == 0 and r.total == 2, r.feedback
    assert statuses(r) == ["unjudgeable", "unjudgeable"], r.feedback
    assert "cannot be judged" in r.tests[0].message and "of type" in r.tests[0].message


def test_in_hash_bool_str_and_indexing_never_run_the_solutions_code():
    code = ("class Yes:\n    def __contains__(self, x): return True\n"
            "    def __bool__(self): return True\n    def __str__(self): return '4'\n"
            "    def __hash__(self): return hash(4)\n    def __eq__(self, o): return True\n"
            "    def __getitem__(self, i): return 4\n    def __iter__(self): return iter([4])\n"
            "def f():\n    return Yes()\n")
    tests = ("assert 3 in f()\nassert f()\nassert str(f()) == '4'\nassert f() in {4}\n"
             "assert f()[0] == 4\nassert list(f()) == [4]\n"
             "try:\n    assert f() == 4\nexcept Exception:\n    pass\n")
    r = judge.unit_tests(code, tests, **P)
    assert statuses(r) == ["unjudgeable"] * 7, r.feedback
    assert "'Yes'" in r.tests[0].message


def test_objects_of_the_solution_still_work_as_objects():
    code = ("class Stack:\n    def __init__(self):\n        self.items = []\n"
            "    def push(self, x):\n        self.items.append(x)\n        return self\n"
            "    def __len__(self):\n        return len(self.items)\n"
            "def gen(n):\n    yield from range(n)\n")
    tests = ("s = Stack().push(1).push(2)\nassert len(s) == 2 and s.items == [1, 2]\n"
             "assert isinstance(s, Stack) and not isinstance(3, Stack)\n"
             "assert sum(gen(10)) == 45 and list(gen(3)) == [0, 1, 2]\n")
    r = judge.unit_tests(code, tests, **P)
    assert r.all_passed, r.feedback


def test_deep_data_crosses_as_data_and_a_cycle_is_unjudgeable():
    code = ("import sys\nsys.setrecursionlimit(100000)\n"
            "def deep(n):\n    x = 'leaf'\n    for _ in range(n):\n        x = [x]\n    return x\n"
            "def cycle():\n    a = []\n    a.append(a)\n    return a\n")
    tests = ("d = deep(20000)\nn = 0\nwhile type(d) is list:\n    d = d[0]\n    n += 1\n"
             "assert (n, d) == (20000, 'leaf')\nassert cycle() == []\n")
    r = judge.unit_tests(code, tests, test_timeout_s=10, timeout_s=30, **P)
    assert statuses(r) == ["passed", "unjudgeable"], r.feedback
    assert "cycle" in r.tests[1].message


# -- each test starts from the same state ------------------------------------------------------

CRASH_ONCE = ("import os\nEXPECTED = {2: 0, 3: 0, 4: 0}\ndef square(x):\n    return 0\n"
              "def f(x):\n    if not os.path.exists('crashed'):\n"
              "        open('crashed', 'w').close()\n        os._exit(1)\n    return 0\n")
GLOBALS_TESTS = ("EXPECTED = {2: 4, 3: 9, 4: 16}\ndef square(x):\n    return x * x\n"
                 "assert f(1) == 1\nassert f(2) == EXPECTED[2]\nassert f(3) == square(3)\n"
                 "assert f(4) == EXPECTED[4]\n")


def test_a_restart_never_rebinds_the_tests_globals(backend):  # noqa: F811
    r = judge.unit_tests(CRASH_ONCE, GLOBALS_TESTS, backend=backend)
    assert statuses(r) == ["crashed", "failed", "failed", "failed"], r.feedback
    assert r.passed == 0 and r.restarts == 1
    assert r.to_dict()["restarts"] == 1 and judge.Report.from_dict(r.to_dict()) == r


def test_after_a_restart_the_tests_see_the_new_solution():
    code = ("import os\ndef f(x):\n    if x == 0:\n        os._exit(1)\n    return x + 1\n")
    tests = ("from solution import f as g\nimport solution\nassert f(0) == 1\n"
             "assert f(1) == 2\nassert g(2) == 3\nassert solution.f(3) == 4\n")
    r = judge.unit_tests(code, tests, **P)
    assert statuses(r) == ["crashed", "passed", "passed", "passed"], r.feedback
    assert r.restarts == 1


# -- verifiers say what they did not see -------------------------------------------------------

def test_an_integer_answer_compares_as_an_integer():
    r = judge.stdio("print(12345679.0)", [("", "12345678")], **P)
    assert statuses(r) == ["failed"], r.feedback
    assert statuses(judge.stdio("print(12345678.0)", [("", "12345678")], **P)) == ["passed"]
    assert statuses(judge.stdio("print(1.0000004e7)", [("", "1e7")], **P)) == ["passed"]


SECRET_TASK = tasks.Task("s", "fs", tasks.Files({"out.txt": "done\n", "secret.txt": None},
                                                run="bash"), prompt="?")


def test_a_truncated_file_listing_fails_the_files_verdict():
    config = rewards.RewardConfig(backend="process", memory_mb=256)
    padded = "```bash\necho done > out.txt\nhead -c 17000000 /dev/zero > secret.txt\n```"
    honest = "```bash\necho done > out.txt\n```"
    bad, good = rewards.verify_all([SECRET_TASK] * 2, [padded, honest], config=config)
    assert not bad.passed and bad.reward == 0.0 and bad.error_type == "files_truncated"
    assert "cannot be verified" in bad.feedback
    assert good.passed
    truncated = sandbox.Result(exit_code=0, files={"out.txt": b"done\n"}, files_truncated=True)
    assert not rewards.check_files(SECRET_TASK.verifier, truncated.files, truncated).passed


def test_a_session_too_large_to_read_fails_the_files_verdict():
    task = tasks.Task("g", "fs", tasks.Files({"secret.txt": None}), prompt="?")
    with sandbox.Session(backend="process", pinned=True) as s:
        s.run(command=["bash", "-c", "head -c 17000000 /dev/zero > secret.txt"])
        verdict = rewards.verify(task, "", session=s)
    assert not verdict.passed and verdict.error_type == "files_truncated", verdict


# -- no channel between runs; the fork server cannot be reached from a run -----------------------

ISOLATING = ("bwrap", "docker")


@pytest.fixture(scope="module", params=backend_params(ISOLATING))
def iso_worker(request):
    with sandbox.Sandbox(request.param, sandbox.Limits(memory_mb=128)) as w:
        yield w


def run_py(worker, code, **kwargs):
    return worker.run(sandbox.Request(code=code, timeout_s=10, **kwargs))


MQ_SEND = ("import ctypes, ctypes.util, os\n"
           "rt = ctypes.CDLL(ctypes.util.find_library('rt') or None, use_errno=True)\n"
           "q = rt.mq_open(b'/ptrain-leak', os.O_CREAT | os.O_RDWR, 0o600, None)\n"
           "print('sent', q >= 0 and rt.mq_send(q, b'secret', 6, 0) == 0)\n")
MQ_READ = ("import ctypes, ctypes.util, os\n"
           "rt = ctypes.CDLL(ctypes.util.find_library('rt') or None, use_errno=True)\n"
           "q = rt.mq_open(b'/ptrain-leak', os.O_RDONLY | os.O_NONBLOCK, 0, None)\n"
           "buf = ctypes.create_string_buffer(8192)\n"
           "print('got', q >= 0 and rt.mq_receive(q, buf, 8192, None) > 0)\n"
           "print(sorted(os.listdir('/dev/mqueue')))\n")


def test_a_posix_message_queue_does_not_outlive_its_run(iso_worker):
    assert run_py(iso_worker, MQ_SEND).stdout == b"sent True\n"
    assert run_py(iso_worker, MQ_READ).stdout == b"got False\n[]\n"


KEY_ADD = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
           "for ring in (-4, -5, -3):  # @u, @us, @s\n"
           "    libc.syscall(%d, b'user', b'ptrain-leak', b'secret', 6, ring)\n")
KEY_FIND = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "found = [libc.syscall(%d, b'user', b'ptrain-leak', None, 0) for _ in range(1)]\n"
            "print('found' if found[0] >= 0 else 'none', ctypes.get_errno())\n")
_NR = {"x86_64": (248, 249), "aarch64": (217, 218)}


def test_a_key_does_not_reach_the_next_run(iso_worker):
    add_key, request_key = _NR[os.uname().machine]
    run_py(iso_worker, KEY_ADD % add_key)
    r = run_py(iso_worker, KEY_FIND % request_key)
    assert r.stdout.startswith(b"none"), r


CGROUP_MOVE = ("import glob, os\nhits = []\n"
               "for p in glob.glob('/.cgroup/*') + glob.glob('/sys/fs/cgroup/**/cgroup.procs',"
               " recursive=True):\n"
               "    try:\n        with open(p, 'w') as f:\n            f.write('1')\n"
               "        hits.append(p)\n    except OSError:\n        pass\n"
               "print('moved', hits)\n")


def test_a_run_cannot_move_the_fork_server_into_another_cgroup(iso_worker):
    server = iso_worker.server_pid

    def cgroups_of(pid):
        with open(f"/proc/{pid}/cgroup") as f:
            return f.read()
    before = cgroups_of(server) if server else None
    assert run_py(iso_worker, CGROUP_MOVE).stdout == b"moved []\n"
    if server:
        assert cgroups_of(server) == before
    assert run_py(iso_worker, "print(1)").stdout == b"1\n"


@pytest.mark.parametrize("name", ["process", "bwrap", "docker"])
def test_a_run_has_oom_score_adj_1000_and_the_server_less(name):
    if sandbox.unavailable_reason(sandbox.pick_backend(name)):
        pytest.skip(f"{name} unavailable")
    with sandbox.Sandbox(name, sandbox.Limits(memory_mb=128)) as w:
        r = run_py(w, "print(open('/proc/self/oom_score_adj').read())")
        assert r.stdout.split() == [b"1000"], r
        if w.server_pid:
            with open(f"/proc/{w.server_pid}/oom_score_adj") as f:
                assert int(f.read()) <= 0


MEMFDS = ("import os\nfds = []\nfor i in range(3):\n    fd = os.memfd_create('x')\n"
          "    os.write(fd, b'x' * (60 << 20))\n    fds.append(fd)\nprint('held')\n")


def test_memory_in_memfds_is_an_oom_verdict_not_a_lost_worker(iso_worker):
    r = run_py(iso_worker, MEMFDS)
    assert r.oom and r.status == "oom", r
    assert run_py(iso_worker, "print(2)").stdout == b"2\n"


def test_a_runs_work_dir_is_executable(iso_worker):
    r = iso_worker.run(sandbox.Request(command=["bash", "-c", "cp /bin/true t && ./t && echo ok"]))
    assert r.stdout == b"ok\n", r


# -- work dirs are untrusted input for the host ---------------------------------------------------

SPECIAL = ("import os, socket\nos.mkfifo('fifo')\n"
           "s = socket.socket(socket.AF_UNIX)\ns.bind('sock')\n")


@pytest.mark.parametrize("pinned", [False, True], ids=["unpinned", "pinned"])
def test_special_files_in_a_work_dir_are_refused_not_opened(backend, pinned):  # noqa: F811
    """A FIFO is refused; a socket too where the work dir stays in one worker (pinned), or
    it is left out, with a warning, where the work dir goes back to the host between runs."""
    with sandbox.Session(backend=backend, pinned=pinned, memory_mb=128) as s:
        assert s.run(SPECIAL).ok
        start = time.monotonic()
        for path in ("fifo", "sock") if pinned else ("fifo",):
            with pytest.raises(ValueError, match="not a regular file"):
                s.write_files({path: "x"})
            with pytest.raises(ValueError, match="not a regular file"):
                s.run("print(1)", files={path: "x"})
        assert time.monotonic() - start < 8  # refused at once: nothing waited on a reader
        left = s.run("import os; print(sorted(os.listdir('.')))").stdout
        assert left == (b"['fifo', 'sock']\n" if pinned else b"['fifo']\n")
        tool = tools.call_tool(s, "write_file", {"path": "fifo", "content": "x"})
        assert "not a regular file" in tool


DEEP = ("import os\nos.makedirs('top', exist_ok=True)\nos.chdir('top')\n"
        "for _ in range(1500):\n    os.mkdir('d')\n    os.chdir('d')\n"
        "open('leaf', 'w').write('x')\nprint('deep')\n")


def test_a_tree_deeper_than_the_recursion_limit_is_removed(backend):  # noqa: F811
    before = own_temp_dirs()
    assert sandbox.run(DEEP, backend=backend, fork_server=False).stdout == b"deep\n"
    with sandbox.Session(backend=backend) as s:
        assert s.run(DEEP).stdout == b"deep\n"
        assert s.run("import os; print(os.listdir('.'))").stdout == b"['top']\n"
    assert sandbox.run(DEEP, backend=backend).stdout == b"deep\n"
    assert sandbox.run("import os; print(os.listdir('.'))", backend=backend).stdout == b"[]\n"
    assert own_temp_dirs() <= before


# -- the server admits only its clients ------------------------------------------------------------

class StubPool:
    """A pool that answers at once: the server's parsing and checks, without sandboxes."""
    workers, backend = 1, "process"

    def stats(self):
        return {}

    def submit_nowait(self, fn, **kwargs):
        future = concurrent.futures.Future()
        if fn is server.run:
            future.set_result(sandbox.Result(stdout=b"stub", backend="process"))
        else:
            future.set_result(judge.Report(passed=0, total=0, tests=(), feedback="stub"))
        return future


TOKEN = "t" * 32


@pytest.fixture(scope="module")
def stub_server():
    srv = server.make_server(StubPool(), "127.0.0.1", 0, token=TOKEN, max_request_bytes=1 << 16,
                             max_timeout_s=30)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv.server_address[1]
    srv.shutdown()
    srv.server_close()
    thread.join()


def raw(port, head: str, body: bytes = b"", *, token=TOKEN, host=None, length=None) -> int:
    """The status of one request sent as bytes (the body's Content-Length unless given)."""
    lines = [head, f"Host: {host or f'127.0.0.1:{port}'}"]
    if token is not None:
        lines.append(f"Authorization: Bearer {token}")
    if length != "none":
        lines.append(f"Content-Length: {len(body) if length is None else length}")
    data = ("\r\n".join(lines) + "\r\n\r\n").encode() + body
    reply = b""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        try:  # the server may answer (and close) before it has all of a body it refuses
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        try:
            reply = b"".join(iter(lambda: s.recv(65536), b""))
        except ConnectionResetError:
            pass
    return int(reply.split(b" ", 2)[1])


def test_every_request_needs_the_token(stub_server):
    ok = json.dumps({"code": "print(1)"}).encode()
    assert raw(stub_server, "POST /run HTTP/1.1", ok) == 200
    assert raw(stub_server, "POST /run HTTP/1.1", ok, token=None) == 401
    assert raw(stub_server, "POST /run HTTP/1.1", ok, token="x" * 32) == 401
    assert raw(stub_server, "GET /health HTTP/1.1", token=None, length="none") == 401
    assert raw(stub_server, "GET /health HTTP/1.1", length="none") == 200
    generated = server.make_server(StubPool(), "127.0.0.1", 0)
    assert len(generated.token) >= 32 and generated.token != TOKEN
    generated.server_close()


@pytest.mark.parametrize("header", ["Origin: http://evil.example", "Sec-Fetch-Site: cross-site",
                                    "Sec-Fetch-Mode: no-cors"])
def test_a_browsers_request_is_refused(stub_server, header):
    body = json.dumps({"code": "print(1)"}).encode()
    assert raw(stub_server, f"POST /run HTTP/1.1\r\n{header}", body) == 403


def test_a_foreign_host_header_is_refused(stub_server):
    body = json.dumps({"code": "print(1)"}).encode()
    assert raw(stub_server, "POST /run HTTP/1.1", body, host="evil.example") == 403
    assert raw(stub_server, "POST /run HTTP/1.1", body, host=f"localhost:{stub_server}") == 200


@pytest.mark.parametrize("field, value", [
    ("timeout_s", "NaN"), ("timeout_s", "Infinity"), ("timeout_s", "1e999"),
    ("max_processes", "50000"), ("max_file_mb", "1048576"), ("max_output_bytes", "1e12"),
    ("max_open_files", "100000"), ("max_files_bytes", str(1 << 40)), ("memory_mb", "99999"),
    ("max_processes", "1" + "0" * 5000),
])
def test_every_number_is_finite_and_within_the_servers_maxima(stub_server, field, value):
    body = ('{"code": "print(1)", "%s": %s}' % (field, value)).encode()
    assert raw(stub_server, "POST /run HTTP/1.1", body) == 400


@pytest.mark.parametrize("length, want", [("-1", 400), ("+5", 400), ("0x10", 400), ("", 400),
                                          ("99999999", 413), ("none", 411)])
def test_the_body_cap_holds_for_any_content_length(stub_server, length, want):
    assert raw(stub_server, "POST /run HTTP/1.1", b'{"code": "print(1)"}', length=length) == want
    chunked = raw(stub_server, "POST /run HTTP/1.1\r\nTransfer-Encoding: chunked",
                  b"5\r\n{}{}{\r\n0\r\n\r\n", length="none")
    assert chunked == 411


def test_json_of_any_shape_is_a_4xx(stub_server):
    for body in (b"[" * 100_000, b'{"code": ' + b"[" * 100_000, b'{"env": {"a": {"b": 1}}}',
                 b'{"files": {"a": 1}}', b'{"command": [[]]}', b"\xff\xfe", b"1e999",
                 b'{"cases": [[1, 2]]}'):
        assert 400 <= raw(stub_server, "POST /run HTTP/1.1", body) < 500, body[:40]


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=20)
FIELDS = sorted(set(server._RUN_FIELDS) | set(server._UNIT_FIELDS) | set(server._STDIO_FIELDS))


@hypothesis.settings(max_examples=150, deadline=None,
                     suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture])
@hypothesis.given(path=st.sampled_from(["/run", "/judge/unit_tests", "/judge/stdio", "/x"]),
                  body=st.dictionaries(st.sampled_from(FIELDS + ["junk"]), JSON_VALUES,
                                       max_size=6) | JSON_VALUES)
def test_fuzzed_requests_never_get_a_5xx(stub_server, path, body):
    data = json.dumps(body, allow_nan=True).encode()
    status = raw(stub_server, f"POST {path} HTTP/1.1", data)
    assert status == 200 or 400 <= status < 500, (status, data[:200])


@hypothesis.settings(max_examples=60, deadline=None,
                     suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture])
@hypothesis.given(length=st.one_of(st.integers(-(1 << 40), 1 << 40).map(str),
                                   st.text(st.characters(min_codepoint=33, max_codepoint=126),
                                           max_size=12)),
                  body=st.binary(max_size=64))
def test_fuzzed_content_lengths_are_answered_at_once(stub_server, length, body):
    status = raw(stub_server, "POST /run HTTP/1.1", body, length=length)
    assert 200 <= status < 500, (length, body)


def test_the_pools_replies_cannot_desynchronise():
    with sandbox.Pool(1, backend="process", max_retries=1, warm=False) as pool:
        with pytest.raises(ValueError, match="finite positive"):
            pool.submit(util.square, 3, timeout_s=float("nan"))
        assert pool.submit(util.square, 4).result() == 16
        forged = pool.submit(util.forge_a_reply, "real")
        with pytest.raises(sandbox.WorkerLost, match="answered request 999"):
            forged.result()
        assert pool.submit(util.square, 5).result() == 25


def test_the_docs_options_table_is_generated_from_the_dataclasses():
    from sandbox import request
    docs = os.path.join(os.path.dirname(__file__), "..", "docs", "sandbox.md")
    with open(docs) as f:
        assert request.options_table() in f.read()
    assert set(server._RUN_FIELDS) == {f.name for f in request.OPTIONS} | {"files_b64",
                                                                          "stdin_b64"}
