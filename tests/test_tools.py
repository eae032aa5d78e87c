"""sandbox.tools: schemas, tool calls inside a Session, bad calls as error observations."""

import json

import pytest

import sandbox
from sandbox import tools
from sandbox_svc_util import backend  # noqa: F401 - the fixture


@pytest.fixture
def session(backend):  # noqa: F811
    with sandbox.Session(backend=backend) as s:
        yield s


def test_schemas_are_function_calling_objects():
    schemas = tools.schemas()
    assert [s["function"]["name"] for s in schemas] == ["python", "bash", "write_file",
                                                        "read_file"]
    for s in schemas:
        assert s["type"] == "function" and s["function"]["description"]
        params = s["function"]["parameters"]
        assert params["type"] == "object" and params["additionalProperties"] is False
        assert set(params["required"]) <= set(params["properties"])
        assert all(p["type"] == "string" for p in params["properties"].values())
    assert json.loads(json.dumps(schemas)) == schemas


def test_tools_share_one_work_dir_across_calls(session):
    call = tools.call_tool
    assert call(session, "write_file", {"path": "d/a.txt", "content": "héllo\n"}) == (
        "Wrote 7 bytes to d/a.txt.")
    assert call(session, "read_file", {"path": "d/a.txt"}) == "héllo\n"
    assert call(session, "bash", {"command": "cat d/a.txt | tr a-z A-Z"}) == "HéLLO\n"
    assert call(session, "python", {"code": "print(open('d/a.txt').read().strip() * 2)"}) == (
        "héllohéllo\n")
    assert call(session, "python", '{"code": "print(6 * 7)"}') == "42\n"  # arguments as JSON


def test_failures_are_observations_with_the_reason(session):
    call = tools.call_tool
    out = call(session, "python", {"code": "print('before')\n1 / 0"})
    assert out.startswith("before\n[stderr]\nTraceback") and out.endswith(
        "ZeroDivisionError: division by zero\n[exit code 1]")
    assert call(session, "bash", {"command": "echo out; echo err >&2; exit 4"}) == (
        "out\n[stderr]\nerr\n[exit code 4]")
    assert call(session, "python", {"code": "while True: pass"}, timeout_s=0.5) == (
        "[timed out after 0.5 s]")
    assert call(session, "bash", {"command": "true"}) == "[no output]"
    assert call(session, "read_file", {"path": "missing.txt"}).startswith(
        "Error: cannot read missing.txt: FileNotFoundError")


@pytest.mark.parametrize("name, arguments, expected", [
    ("rm_rf", {}, "Error: unknown tool 'rm_rf'; the tools are: python, bash, write_file, "
                  "read_file."),
    ("python", "{not json", "Error: the arguments of python are not valid JSON"),
    ("python", ["print(1)"], "Error: bad arguments for python: expected a JSON object, got list."),
    ("python", {}, "Error: bad arguments for python: missing 'code'."),
    ("python", {"code": 1}, "Error: bad arguments for python: 'code' must be a string, got int."),
    ("bash", {"command": "ls", "cwd": "/"}, "Error: bad arguments for bash: unexpected 'cwd'"),
    ("write_file", {"path": "../x", "content": ""}, "Error: file path '../x' must be relative"),
    ("write_file", {"path": "/etc/passwd", "content": ""}, "Error: file path '/etc/passwd'"),
    ("read_file", {"path": "a/../../b"}, "Error: file path 'a/../../b' must be relative"),
])
def test_malformed_calls_become_error_observations(name, arguments, expected):
    with sandbox.Session(backend="process") as s:
        assert tools.call_tool(s, name, arguments).startswith(expected)


def test_long_output_is_clipped_in_the_middle(session):
    out = tools.call_tool(session, "python", {"code": "print('a' * 5000 + 'b' * 5000)"},
                          max_output_chars=300)
    assert len(out) == 300 and out.startswith("a" * 100) and out.endswith("b" * 50 + "\n")
    assert "[... 9701 characters omitted ...]" in out


def test_a_closed_session_is_an_error_observation():
    s = sandbox.Session(backend="process")
    s.close()
    assert tools.call_tool(s, "python", {"code": "print(1)"}).startswith(
        "Error: the sandbox failed to run python")
