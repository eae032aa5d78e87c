"""Tools a model may call (python, bash, write_file, read_file), run inside a `Session`.

    with sandbox.Session() as session:
        tools.schemas()                        # for the chat template: [{"type": "function", ...}]
        tools.call_tool(session, "python", {"code": "print(6 * 7)"})     # "42\n"

`call_tool` never raises for a bad call: an unknown tool, arguments that are not a JSON object,
a missing or mistyped argument, a path outside the work dir all come back as an observation
starting with "Error:", which the model sees like any other.

A tool's run returns text, or a `ToolOutput`: text and images (e.g. a render), for a
vision-language policy; such a tool declares `images=True` so that a run can refuse it
before generation when its policy reads text only.
"""

import dataclasses
import json
from typing import Callable

from sandbox.request import check_path


@dataclasses.dataclass(frozen=True)
class Tool:
    """A tool: its name, what the model is told, a JSON schema of its arguments (an object of
    string/integer/boolean properties), and how it runs: run(session, args, timeout_s)."""

    name: str
    description: str
    parameters: dict
    run: Callable
    images: bool = False  # run may return a ToolOutput with images

    def schema(self) -> dict:
        """The OpenAI/Hermes function-calling form."""
        return {"type": "function", "function": {
            "name": self.name, "description": self.description, "parameters": self.parameters}}


@dataclasses.dataclass(frozen=True)
class ToolOutput:
    """What a tool returns besides plain text: its text and images, in that order in the
    observation. An image is anything `ptrain.vision.image_processing` reads: PNG/JPEG bytes,
    a file path on the host, a PIL image or a uint8 array."""

    text: str
    images: tuple = ()


def _object(properties, required):
    return {"type": "object", "properties": properties, "required": list(required),
            "additionalProperties": False}


def _run_python(session, args, timeout_s):
    return session.run(args["code"], language="python", timeout_s=timeout_s)


def _run_bash(session, args, timeout_s):
    return session.run(args["command"], language="bash", timeout_s=timeout_s)


def _write_file(session, args, timeout_s):
    path = check_path(args["path"])
    content = args["content"]
    session.write_files({path: content})
    return f"Wrote {len(content.encode('utf-8'))} bytes to {path}."


_READ = """import sys
with open({path!r}, "rb") as f:
    data = f.read({limit} + 1)
sys.stdout.buffer.write(data)
"""


def _read_file(session, args, timeout_s, limit=1 << 20):
    # Read inside the sandbox: a symlink the program left there resolves under its isolation.
    result = session.run(_READ.format(path=check_path(args["path"]), limit=limit),
                         language="python", timeout_s=timeout_s, max_output_bytes=limit + 1)
    if not result.ok:
        last = result.stderr_text.strip().splitlines()[-1:] or [result.describe()]
        return f"Error: cannot read {args['path']}: {last[0]}"
    text = result.stdout_text
    if len(result.stdout) > limit:
        text = text[:limit] + f"\n[file is longer than {limit} bytes; the rest is not shown]"
    return text


PYTHON = Tool(
    "python", "Run Python 3 code in the work dir (a fresh process each call; files persist "
    "across calls). Returns what it prints, then stderr and the exit status if not 0.",
    _object({"code": {"type": "string", "description": "Python source to run."}}, ["code"]),
    _run_python)
BASH = Tool(
    "bash", "Run a bash command line in the work dir (a fresh shell each call; files persist "
    "across calls). Returns its stdout, then stderr and the exit status if not 0.",
    _object({"command": {"type": "string", "description": "The command line."}}, ["command"]),
    _run_bash)
WRITE_FILE = Tool(
    "write_file", "Create or overwrite a text file in the work dir.",
    _object({"path": {"type": "string", "description": "Path relative to the work dir."},
             "content": {"type": "string", "description": "The whole new content."}},
            ["path", "content"]),
    _write_file)
READ_FILE = Tool(
    "read_file", "Read a text file in the work dir.",
    _object({"path": {"type": "string", "description": "Path relative to the work dir."}},
            ["path"]),
    _read_file)
TOOLS = (PYTHON, BASH, WRITE_FILE, READ_FILE)


def schemas(tools=TOOLS) -> list:
    """The tools' function-calling schemas, for a chat template's `tools=`."""
    return [t.schema() for t in tools]


def call_tool(session, name, arguments, *, tools=TOOLS, timeout_s: float = 10.0,
              max_output_chars: int = 4000):
    """Runs tool `name` with `arguments` (a dict, or its JSON text) in `session`; returns the
    observation text, at most `max_output_chars` (the middle is cut), or a `ToolOutput` (its
    text cut the same way) when the tool returned images. Never raises for a bad call or
    anything the program does: those are observations starting with "Error:"."""
    tool = next((t for t in tools if t.name == name), None)
    if tool is None:
        names = ", ".join(t.name for t in tools)
        return f"Error: unknown tool {name!r}; the tools are: {names}."
    if isinstance(arguments, (str, bytes)):
        try:
            arguments = json.loads(arguments)
        except ValueError as e:
            return f"Error: the arguments of {name} are not valid JSON ({e})."
    problem = validate(tool.parameters, arguments)
    if problem:
        return f"Error: bad arguments for {name}: {problem}."
    try:
        out = tool.run(session, arguments, timeout_s)
    except (ValueError, TypeError) as e:  # a path outside the work dir, a bad file name
        return f"Error: {e}."
    except Exception as e:  # noqa: BLE001 - the sandbox failed; the model sees it, we go on
        return f"Error: the sandbox failed to run {name} ({type(e).__name__}: {e})."
    if isinstance(out, ToolOutput):
        text = clip(out.text, max_output_chars)
        return ToolOutput(text, tuple(out.images)) if out.images else text
    text = out if isinstance(out, str) else format_result(out, timeout_s)
    return clip(text, max_output_chars)


def validate(schema: dict, args) -> str:
    """What is wrong with `args` for an object `schema` of simple properties ("" if nothing)."""
    if not isinstance(args, dict):
        return f"expected a JSON object, got {type(args).__name__}"
    props = schema.get("properties", {})
    missing = [k for k in schema.get("required", ()) if k not in args]
    if missing:
        return f"missing {', '.join(map(repr, missing))}"
    extra = [k for k in args if k not in props]
    if extra and schema.get("additionalProperties", True) is False:
        return f"unexpected {', '.join(map(repr, extra))} (allowed: {', '.join(props)})"
    kinds = {"string": str, "integer": int, "boolean": bool, "number": (int, float)}
    for key, value in args.items():
        want = props.get(key, {}).get("type")
        ok = want is None or (isinstance(value, kinds[want]) and not (
            want in ("integer", "number") and isinstance(value, bool)))
        if not ok:
            return f"{key!r} must be a {want}, got {type(value).__name__}"
    return ""


def format_result(result, timeout_s: float) -> str:
    """A run's observation: stdout, then stderr, then how it ended if not cleanly."""
    parts = [result.stdout_text] if result.stdout else []
    if result.stdout_truncated:
        parts.append("[stdout truncated]")
    if result.stderr:
        parts.append("[stderr]\n" + result.stderr_text)
    if result.timed_out:
        parts.append(f"[timed out after {timeout_s:g} s]")
    elif result.oom:
        parts.append("[killed: out of memory]")
    elif result.signal is not None:
        parts.append(f"[{result.describe()}]")
    elif result.exit_code:
        parts.append(f"[exit code {result.exit_code}]")
    return "\n".join(p.rstrip("\n") if i < len(parts) - 1 else p
                     for i, p in enumerate(parts)) or "[no output]"


def clip(text: str, max_chars: int) -> str:
    """`text` with its middle replaced by a marker if it is longer than `max_chars`."""
    if len(text) <= max_chars:
        return text
    marker = f"\n[... {len(text) - max_chars} characters omitted ...]\n"
    head = max((max_chars - len(marker)) * 2 // 3, 0)
    tail = max(max_chars - len(marker) - head, 0)
    return text[:head] + marker + (text[-tail:] if tail else "")
