"""An environment: everything a domain is, in one value a module returns.

    def make(n_train=500, n_heldout=50) -> Environment:      # my_pkg/sql_env.py
        return Environment(name="sql", tasks=..., verify=..., tools=(SQL,))

    config.tasks.envs = (dict(env="my_pkg.sql_env:make", args=dict(n_heldout=50),
                              weight=1.0),)

An environment has:
  name      the domain its tasks count for (metrics, eval lines, task files); unique in a run
  tasks     tasks(ctx) -> Splits: a training and a held-out split (generated from ctx.seed,
            or read from files), and SFT demonstrations if it has any. Each task is a
            `ptrain.tasks.Task` whose `domain` is the environment's name, or a value of the
            environment's own with `id`, `domain` and `tools` (the terminal tasks)
  verify    verify(tasks, answers, *, sessions, pool, config) -> one `Verdict` per answer:
            anything of the model's output it executes runs in the sandbox (`pool` judges
            concurrently, `sessions` are the episodes' work dirs, `config` the
            `rewards.RewardConfig`)
  tools     what the model may call: `Tool`s (name, description, a JSON-schema object of the
            arguments, run(session, arguments, timeout_s) in the episode's sandbox session);
            a task offers the ones it names in `Task.tools`
  turns     its turn policy (`TurnPolicy`): whether retries with feedback are allowed
  opens_session  whether a task's episode needs a sandbox session (tools, or a verifier
            that reads the work dir its tool calls left)
  tokenizer the built-in tokenizer of its generated tasks, for runs that name none
  prompt_ids  prompt_ids(task, tokenizer, fmt) -> the prompt's token ids (default: the task's
            prompt or messages with its tools' schemas, `ptrain.chat.render_prompt`)
  open_session  open_session(task) -> the episode's session, where its tools run and its
            verifier looks (closed by `.close()` after the verdict); None: a `sandbox.Session`
            (a work dir) for the tasks `opens_session` names
  sessions  sessions(config, heldout): a context manager around a run that gives its
            `open_session` (resources the episodes share: the terminal tasks' harness of
            warm containers)
  eval_fields  eval_fields(tasks, episodes) -> more fields of its held-out eval line
            (episodes task-major over `tasks`, each with its verdicts and finish)
  agent     an environment whose episodes an external agent program runs against the served
            policy (`ptrain.rollout.Agent`: its command, sandbox backend, timeout; the
            `rollout.Agents` producer): judged by `verify` on the state the agent left

`load(entry)` builds one from a config entry and checks it: the import path, the protocol,
the tools' schemas; every error names what to fix. The episodes check each verdict
(`rollout.episodes.judge`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sandbox.tools import Tool  # noqa: F401 (the tool type environments declare)
from sandbox import tools as sandbox_tools

ENTRY_KEYS = ("env", "args", "weight", "name", "agent")


@dataclasses.dataclass(frozen=True)
class TurnPolicy:
    """How an environment's episodes may go: `retries` False refuses rollout.max_attempts > 1
    (no feedback to retry on); `max_turns` caps model turns (0: rollout.max_turns)."""

    retries: bool = True
    max_turns: int = 0


@dataclasses.dataclass(frozen=True)
class Context:
    """What an environment's `tasks` gets: the run's seed, a directory of its own under the
    work dir, the tokenizer and chat format (for demonstrations), a vision-language
    policy's image settings, and its name."""

    name: str
    seed: int
    workdir: str
    tokenizer: Any = None
    fmt: Any = None
    vision: Any = None  # a vision-language policy's `rollout.images.Vision` (None: text)


@dataclasses.dataclass(frozen=True)
class Splits:
    train: Sequence
    heldout: Sequence
    demonstrations: Sequence[dict] = ()  # SFT records: prompt_ids, completion_ids, ..._mask


def _uses_tools(task) -> bool:
    return bool(getattr(task, "tools", ()))


@dataclasses.dataclass(frozen=True)
class Environment:
    name: str
    tasks: Callable[[Context], Splits]
    verify: Callable | None = None
    tools: tuple = ()
    turns: TurnPolicy = TurnPolicy()
    opens_session: Callable[[Any], bool] = _uses_tools
    tokenizer: Callable | None = None
    prompt_ids: Callable | None = None
    open_session: Callable | None = None
    sessions: Callable | None = None
    eval_fields: Callable | None = None
    agent: Any = None  # a `ptrain.rollout.Agent`

    def tool(self, name: str):
        """The tool named `name` (a task names the ones it offers in `Task.tools`)."""
        found = [t for t in self.tools if t.name == name]
        if not found:
            raise ValueError(f"environment {self.name!r} has no tool {name!r}; its tools: "
                             f"{', '.join(t.name for t in self.tools) or 'none'}")
        return found[0]


def sandbox_tools_named(*names: str) -> tuple:
    """The sandbox's own tools (python, bash, write_file, read_file) by name."""
    by_name = {t.name: t for t in sandbox_tools.TOOLS}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise ValueError(f"unknown sandbox tools {unknown}; known: {sorted(by_name)}")
    return tuple(by_name[n] for n in names)


def submit(pool, fn, *args, **kwargs) -> concurrent.futures.Future:
    """fn(*args, **kwargs) on `pool` (a verifier's sandbox pool: run its sandbox calls there,
    e.g. `sandbox.run`), or here and now without one; a Future either way."""
    if pool is None:
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_result(fn(*args, **kwargs))
        return future
    return pool.submit(fn, *args, **kwargs)


def distinct(draw: Callable[[int], Any], n: int, *, key: Callable, exclude=(),
             what: str = "tasks") -> list:
    """n values of draw(index) whose key differs from each other's and from `exclude` (another
    split's keys): a generated environment's split, drawn at most 100 * n times."""
    out, seen = [], set(exclude)
    for _ in range(100 * n):
        if len(out) == n:
            break
        x = draw(len(out))
        if key(x) not in seen:
            seen.add(key(x))
            out.append(x)
    if len(out) < n:
        raise ValueError(f"cannot draw {n} distinct {what}; lower n")
    return out


# ----------------------------------------------------------------------------- loading

def resolve(path: str, *, key: str):
    """The object an import path "module:attribute" names."""
    module_name, sep, attr = str(path).partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{key}={path!r}: name an environment as 'module:function', e.g. "
                         "'ptrain.envs.code:humaneval' or 'my_pkg.sql_env:make'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{key}={path!r}: module {module_name!r} does not import ({e}); "
                         "install it or put it on PYTHONPATH") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"{key}={path!r}: module {module_name!r} has no {attr!r}") from None


def load(entry: Mapping, *, key: str = "tasks.envs[0]") -> Environment:
    """The environment a config entry names: {"env": "module:function", "args": {...},
    "weight": w, "name": optional new name, "agent": optional agent program}. The function
    is called with the args (an Environment itself is taken as it is, without args).
    "agent": the fields of a `rollout.Agent` ({"command": argv, "backend": ..., "timeout_s":
    ..., "env": {...}, "memory_mb": ...}): the environment's episodes are run by that
    program (`rollout.Agents`)."""
    unknown = set(entry) - set(ENTRY_KEYS)
    if unknown or "env" not in entry:
        raise ValueError(f"{key}: an environment entry has keys {ENTRY_KEYS} ('env' "
                         f"required); got {sorted(entry)}")
    made = resolve(entry["env"], key=f"{key}.env")
    args = dict(entry.get("args") or {})
    if callable(made) and not isinstance(made, Environment):
        try:
            made = made(**args)
        except TypeError as e:
            raise ValueError(f"{key}: {entry['env']}(**{args}) failed: {e}") from None
    elif args:
        raise ValueError(f"{key}: {entry['env']} is an Environment, not a function: it "
                         f"takes no args (got {sorted(args)})")
    if not isinstance(made, Environment):
        raise ValueError(f"{key}: {entry['env']} gave {type(made).__name__}, not a "
                         "ptrain.envs.Environment: return Environment(name=..., tasks=..., "
                         "verify=...) (docs/environments.md)")
    if entry.get("name"):
        made = dataclasses.replace(made, name=str(entry["name"]))
    if entry.get("agent") is not None:
        made = dataclasses.replace(made, agent=agent_of(entry["agent"], key=f"{key}.agent"))
    check(made, key=key)
    return made


def agent_of(spec: Mapping, *, key: str):
    """The `rollout.Agent` a config entry's "agent" gives (lists become the tuples it takes)."""
    from ptrain.rollout.agents import Agent
    fields = [f.name for f in dataclasses.fields(Agent)]
    if not isinstance(spec, Mapping) or "command" not in spec or set(spec) - set(fields):
        raise ValueError(f"{key}: an agent is a dict with keys {fields} ('command' required: "
                         f"the program's argv); got {spec!r}")
    spec = dict(spec)
    if isinstance(spec["command"], (list, tuple)):
        spec["command"] = tuple(spec["command"])
    if "env" in spec:
        spec["env"] = dict(spec["env"])
    try:
        return Agent(**spec)
    except ValueError as e:
        raise ValueError(f"{key}: {e}") from None


def check(env: Environment, *, key: str) -> None:
    """The parts of an environment that can be checked before anything runs."""
    at = f"{key} (environment {env.name!r})"
    if not env.name or not isinstance(env.name, str) or "/" in env.name:
        raise ValueError(f"{key}: an environment needs a name without '/', got {env.name!r}")
    if not callable(env.tasks):
        raise ValueError(f"{at}: tasks must be a function tasks(ctx) -> Splits")
    if not callable(env.verify):
        raise ValueError(f"{at}: verify must be a function verify(tasks, answers, *, "
                         "sessions, pool, config) -> [Verdict]")
    names = [t.name for t in env.tools]
    if len(set(names)) != len(names):
        raise ValueError(f"{at}: tool names repeat: {names}")
    for tool in env.tools:
        check_tool(tool, where=at)


def check_tool(tool, *, where: str) -> None:
    """A tool's name, run function and argument schema (a JSON-schema object whose
    properties are schemas)."""
    if not isinstance(tool, Tool):
        raise ValueError(f"{where}: tools must be ptrain.envs.Tool values, got "
                         f"{type(tool).__name__}")
    if not tool.name.isidentifier():
        raise ValueError(f"{where}: tool name {tool.name!r} must be an identifier")
    if not callable(tool.run):
        raise ValueError(f"{where}: tool {tool.name!r} needs run(session, arguments, "
                         "timeout_s)")
    schema = tool.parameters
    problem = ("is not a dict" if not isinstance(schema, Mapping) else
               "has no \"type\": \"object\"" if schema.get("type") != "object" else
               "has \"properties\" that is not a dict of schemas"
               if not isinstance(schema.get("properties", {}), Mapping) or not all(
                   isinstance(v, Mapping) for v in schema.get("properties", {}).values()) else
               "has \"required\" names that are not properties"
               if not set(schema.get("required", ())) <= set(schema.get("properties", {}))
               else "")
    if problem:
        raise ValueError(f"{where}: tool {tool.name!r}: its parameters {schema!r:.120} "
                         f"{problem}; give a JSON-schema object, e.g. {{\"type\": \"object\", "
                         "\"properties\": {\"query\": {\"type\": \"string\"}}, \"required\": "
                         "[\"query\"]}")


def load_all(entries: Sequence[Mapping], *, key: str = "tasks.envs") -> list[Environment]:
    """Every entry's environment; names must differ."""
    if not entries:
        raise ValueError(f"{key} is empty: name at least one environment")
    envs, seen = [], {}
    for i, entry in enumerate(entries):
        if not isinstance(entry, Mapping):
            raise ValueError(f"{key}[{i}]={entry!r}: give a dict with keys {ENTRY_KEYS}")
        env = load(entry, key=f"{key}[{i}]")
        if env.name in seen:
            raise ValueError(f"{key}[{seen[env.name]}] and {key}[{i}] are both named "
                             f"{env.name!r}: give one of them another name (its entry's "
                             "'name')")
        seen[env.name] = i
        weight = entry.get("weight", 1.0)
        if not isinstance(weight, (int, float)) or not weight > 0:
            raise ValueError(f"{key}[{i}].weight={weight!r} must be a number > 0")
        envs.append(env)
    return envs
