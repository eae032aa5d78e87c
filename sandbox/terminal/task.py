"""Terminal tasks, read as they are in their two layouts.

Harbor / Terminal-Bench 2.0 (`task.toml`, field names as in harbor's `TaskConfig`):

    instruction.md  task.toml  environment/Dockerfile  tests/test.sh  solution/solve.sh

TB 1.0 (`task.yaml`, field names as in terminal-bench's `Task`):

    task.yaml  Dockerfile [docker-compose.yaml]  run-tests.sh  tests/test_outputs.py  solution.sh

`load_task(dir)` returns a frozen `Task` or raises `TaskError` naming the file and the field;
`load_tasks(dir)` loads every task below a directory and says what it skipped and why.
Fields a task may set that this harness does not use are kept in `Task.notes`, never dropped
in silence.
"""

import dataclasses
import math
import os
import re

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

# Where the harness puts things inside the task's container (Harbor's and TB's paths).
TESTS_DIR = "/tests"
SOLUTION_DIR = "/solution"
VERIFIER_LOGS = "/logs/verifier"

_CANARY = re.compile(r"^(<!--.*canary.*-->|#.*canary.*)$", re.IGNORECASE)


class TaskError(ValueError):
    """A malformed task: `file` is the file at fault, `field` the field (or None)."""

    def __init__(self, file: str, field: str | None, problem: str):
        self.file, self.field, self.problem = file, field, problem
        where = f"{file}: {field}" if field else file
        super().__init__(f"{where}: {problem}")


@dataclasses.dataclass(frozen=True)
class Task:
    """One terminal task. Paths are absolute host paths; `env_*` run inside the container."""
    name: str
    path: str
    layout: str                          # "harbor" or "tb1"
    instruction: str
    agent_timeout_s: float
    verifier_timeout_s: float
    build_timeout_s: float = 600.0
    dockerfile: str | None = None        # the Dockerfile to build, or None with docker_image
    context_dir: str | None = None       # its build context
    context_exclude: tuple[str, ...] = ()  # context paths the image must not get (tests...)
    docker_image: str | None = None      # a prebuilt image named by the task
    cpus: float = 1.0
    memory_mb: int = 2048
    storage_mb: int | None = None
    allow_internet: bool = False
    env: tuple[tuple[str, str], ...] = ()           # container environment (templates resolved)
    tests: tuple[tuple[str, str], ...] = ()         # (host path, path under /tests)
    test_command: str = ""                          # how the verifier runs, in the container
    parser: str = "reward_file"                     # "reward_file" (Harbor) or "pytest" (TB1)
    verifier_env: tuple[tuple[str, str], ...] = ()
    run_tests_in_same_shell: bool = False
    uses_agent_services: bool = False               # the tests talk to what the agent runs
    solution: tuple[tuple[str, str], ...] = ()      # (host path, path under /solution)
    solution_command: str | None = None             # None: the task has no solution
    solution_env: tuple[tuple[str, str], ...] = ()
    agent_user: str | None = None
    verifier_user: str | None = None
    healthcheck: tuple[tuple[str, object], ...] = ()
    category: str = ""
    difficulty: str = ""
    tags: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()                     # fields read but not used by this harness

    @property
    def has_solution(self) -> bool:
        return self.solution_command is not None


@dataclasses.dataclass(frozen=True)
class Loaded:
    """What `load_tasks` found: the tasks, and (directory, reason) for each one skipped."""
    tasks: tuple[Task, ...]
    skipped: tuple[tuple[str, str], ...]

    def summary(self) -> str:
        lines = [f"{len(self.tasks)} tasks loaded, {len(self.skipped)} skipped"]
        lines += [f"  skipped {path}: {why}" for path, why in self.skipped]
        noted = [t for t in self.tasks if t.notes]
        lines += [f"  note {t.name}: {n}" for t in noted for n in t.notes]
        return "\n".join(lines)


def load_tasks(root: str) -> Loaded:
    """Every task in `root` (itself a task, or a directory of task directories, one level
    down). Sub-directories that are not tasks, or whose task is malformed, are skipped with
    the reason; hidden ones (.git) are not looked at. Names must be unique."""
    root = os.path.abspath(root)
    if not os.path.isdir(root):
        raise FileNotFoundError(f"no task directory at {root}")
    if _layout(root) is not None:
        return Loaded((load_task(root),), ())
    tasks, skipped, names = [], [], {}
    for entry in sorted(os.listdir(root)):
        path = os.path.join(root, entry)
        if entry.startswith(".") or not os.path.isdir(path):
            continue
        if _layout(path) is None:
            skipped.append((path, "no task.toml (Harbor) or task.yaml (Terminal-Bench 1.0)"))
            continue
        try:
            task = load_task(path)
        except TaskError as e:
            skipped.append((path, str(e)))
            continue
        if task.name in names:
            skipped.append((path, f"task name {task.name!r} is also the name of "
                                  f"{names[task.name]}"))
            continue
        names[task.name] = path
        tasks.append(task)
    return Loaded(tuple(tasks), tuple(skipped))


def load_task(path: str) -> Task:
    """The task in directory `path`, in whichever layout it has."""
    path = os.path.abspath(path)
    layout = _layout(path)
    if layout == "both":
        raise TaskError(path, None, "has both task.toml (Harbor) and task.yaml (TB 1.0); "
                                    "keep the one that describes it")
    if layout == "harbor":
        return _load_harbor(path)
    if layout == "tb1":
        return _load_tb1(path)
    raise TaskError(path, None, "not a task: no task.toml (Harbor) or task.yaml (TB 1.0)")


def _layout(path: str) -> str | None:
    toml = os.path.isfile(os.path.join(path, "task.toml"))
    yaml_ = os.path.isfile(os.path.join(path, "task.yaml"))
    return "both" if toml and yaml_ else "harbor" if toml else "tb1" if yaml_ else None


# ---------------------------------------------------------------------------------------------
# Field checking: a spec maps each known key to a type check, or to a nested spec (a table).
# ---------------------------------------------------------------------------------------------

def _num(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _pos(v):
    return _num(v) and v > 0


def _str_map(v):
    return isinstance(v, dict) and all(isinstance(k, str) and isinstance(x, str)
                                       for k, x in v.items())


def _str_list(v):
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


_ANY = (lambda v: True, "anything")
_STR = (lambda v: isinstance(v, str), "a string")
_BOOL = (lambda v: isinstance(v, bool), "true or false")
_POS = (_pos, "a positive number")
_INT = (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
        "a non-negative integer")
_STRMAP = (_str_map, "a table of strings")
_STRLIST = (_str_list, "a list of strings")
_USER = (lambda v: isinstance(v, (str, int)) and not isinstance(v, bool), "a user name or uid")
_LIST = (lambda v: isinstance(v, list), "a list")
_TABLE = (lambda v: isinstance(v, dict), "a table")

_NETWORK = {"network_mode": _STR, "allowed_hosts": _STRLIST}
_HARBOR = {
    "version": _STR, "schema_version": _STR, "source": _STR,
    "task": {"name": _STR, "description": _STR, "authors": _LIST, "keywords": _STRLIST},
    "metadata": _TABLE,
    "verifier": {"timeout_sec": _POS, "env": _STRMAP, "user": _USER,
                 "uses_agent_services": _BOOL, **_NETWORK},
    "agent": {"timeout_sec": _POS, "user": _USER, **_NETWORK},
    "environment": {
        "build_timeout_sec": _POS, "docker_image": _STR, "cpus": _POS, "memory_mb": _INT,
        "storage_mb": _INT, "gpus": _INT, "gpu_types": _ANY, "allow_internet": _BOOL,
        "mcp_servers": _LIST, "env": _STRMAP, "skills_dir": _STR,
        "healthcheck": {"command": _STR, "interval_sec": _POS, "timeout_sec": _POS,
                        "start_period_sec": (_num, "a number"),
                        "start_interval_sec": _POS, "retries": _INT},
        "memory": _STR, "storage": _STR, **_NETWORK},
    "solution": {"env": _STRMAP},
}
_TB1 = {
    "instruction": _STR, "author_name": _STR, "author_email": _STR, "difficulty": _STR,
    "category": _STR, "tags": _STRLIST, "parser_name": _STR, "max_agent_timeout_sec": _POS,
    "max_test_timeout_sec": _POS, "run_tests_in_same_shell": _BOOL, "disable_asciinema": _BOOL,
    "uses_agent_services": _BOOL,
    "estimated_duration_sec": _POS, "expert_time_estimate_min": _INT,
    "junior_time_estimate_min": _INT,
}


def _check(data: dict, spec: dict, file: str, table: str = "") -> None:
    for key, value in data.items():
        field = f"[{table}] {key}" if table else key
        if key not in spec:
            known = ", ".join(sorted(spec))
            raise TaskError(file, field, f"unknown key (known here: {known})")
        rule = spec[key]
        if isinstance(rule, dict):
            if not isinstance(value, dict):
                raise TaskError(file, field, "must be a table")
            _check(value, rule, file, f"{table}.{key}" if table else key)
        elif not rule[0](value):
            raise TaskError(file, field, f"must be {rule[1]}, got {value!r}")


def _require(data: dict, key: str, file: str, table: str, what: str):
    if key not in data:
        raise TaskError(file, f"[{table}] {key}" if table else key, f"is missing ({what})")
    return data[key]


def _files_under(root: str, prefix: str) -> tuple[tuple[str, str], ...]:
    """(host path, prefix/relative path) of every file and symlink below `root`."""
    out = []
    for top, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(files):
            host = os.path.join(top, name)
            out.append((host, prefix + "/" + os.path.relpath(host, root)))
    return tuple(out)


def _size_mb(text: str, file: str, field: str) -> int:
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMG])B?\s*", text.upper())
    if not m:
        raise TaskError(file, field, f"must be a size like '512M' or '2G', got {text!r}")
    return int(float(m.group(1)) * {"K": 1 / 1024, "M": 1, "G": 1024}[m.group(2)])


def _resolve_env(env: dict, file: str, table: str) -> tuple[tuple[str, str], ...]:
    """Harbor's ${VAR} and ${VAR:-default} templates, resolved from this host's environment."""
    out = []
    for key, value in env.items():
        def sub(m):
            name, default = m.group(1), m.group(3)
            if name in os.environ:
                return os.environ[name]
            if default is None:
                raise TaskError(file, f"[{table}] {key}",
                                f"needs ${{{name}}}, which is not set on this host")
            return default
        out.append((key, re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(:-([^}]*))?\}", sub, value)))
    return tuple(out)


def _read_text(path: str, what: str) -> str:
    if not os.path.isfile(path):
        raise TaskError(path, None, f"is missing ({what})")
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise TaskError(path, None, f"is not UTF-8 text ({e})") from None


# ---------------------------------------------------------------------------------------------
# Harbor / Terminal-Bench 2.0
# ---------------------------------------------------------------------------------------------

def _load_harbor(path: str) -> Task:
    file = os.path.join(path, "task.toml")
    try:
        with open(file, "rb") as f:
            cfg = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise TaskError(file, None, f"is not valid TOML: {e}") from None
    _check(cfg, _HARBOR, file)
    agent, verifier = cfg.get("agent", {}), cfg.get("verifier", {})
    env, meta = cfg.get("environment", {}), cfg.get("metadata", {})
    agent_timeout = _require(agent, "timeout_sec", file, "agent",
                             "the agent's time limit in seconds")
    verifier_timeout = _require(verifier, "timeout_sec", file, "verifier",
                                "the tests' time limit in seconds")
    notes = []
    if env.get("gpus", 0):
        raise TaskError(file, "[environment] gpus", "GPU tasks are not supported here")
    if env.get("mcp_servers"):
        raise TaskError(file, "[environment] mcp_servers", "MCP servers are not supported")
    for key in ("skills_dir", "gpu_types"):
        if key in env:
            notes.append(f"[environment] {key} is not used by this harness")
    memory_mb = env.get("memory_mb", 2048)
    if "memory" in env:
        memory_mb = _size_mb(env["memory"], file, "[environment] memory")
    storage_mb = env.get("storage_mb")
    if "storage" in env:
        storage_mb = _size_mb(env["storage"], file, "[environment] storage")
    modes = {t: cfg.get(t, {}).get("network_mode") for t in ("environment", "agent", "verifier")}
    for table, mode in modes.items():
        if mode not in (None, "public", "no-network", "allowlist"):
            raise TaskError(file, f"[{table}] network_mode",
                            f"must be 'public', 'no-network' or 'allowlist', got {mode!r}")
        if mode == "allowlist":
            notes.append(f"[{table}] network_mode 'allowlist' is treated as 'public' "
                         "(the operator's network switch still decides)")
    if any(t != "environment" and m for t, m in modes.items()):
        notes.append("per-phase network_mode is not used: one network setting per episode")
    base_mode = modes["environment"]
    allow_internet = (base_mode in ("public", "allowlist") if base_mode
                      else env.get("allow_internet", True))

    dockerfile = os.path.join(path, "environment", "Dockerfile")
    image = env.get("docker_image")
    if os.path.isfile(os.path.join(path, "environment", "docker-compose.yaml")):
        raise TaskError(os.path.join(path, "environment", "docker-compose.yaml"), None,
                        "multi-container (docker compose) environments are not supported")
    if image is None and not os.path.isfile(dockerfile):
        raise TaskError(dockerfile, None, "is missing, and task.toml names no "
                                          "[environment] docker_image to use instead")
    tests_dir = os.path.join(path, "tests")
    if not os.path.isfile(os.path.join(tests_dir, "test.sh")):
        raise TaskError(os.path.join(tests_dir, "test.sh"), None,
                        "is missing (the verifier: it writes /logs/verifier/reward.txt)")
    solution_dir = os.path.join(path, "solution")
    has_solution = os.path.isfile(os.path.join(solution_dir, "solve.sh"))
    hc = env.get("healthcheck")
    if hc is not None and "command" not in hc:
        raise TaskError(file, "[environment.healthcheck] command", "is missing")
    package = cfg.get("task", {})
    return Task(
        name=package.get("name", os.path.basename(path)), path=path, layout="harbor",
        instruction=_strip_canary(_read_text(os.path.join(path, "instruction.md"),
                                             "the instruction the agent gets")),
        agent_timeout_s=float(agent_timeout), verifier_timeout_s=float(verifier_timeout),
        build_timeout_s=float(env.get("build_timeout_sec", 600.0)),
        dockerfile=None if image else dockerfile,
        context_dir=None if image else os.path.dirname(dockerfile),
        docker_image=image, cpus=float(env.get("cpus", 1)), memory_mb=int(memory_mb),
        storage_mb=storage_mb, allow_internet=bool(allow_internet),
        env=_resolve_env(env.get("env", {}), file, "environment"),
        tests=_files_under(tests_dir, TESTS_DIR), test_command=f"bash {TESTS_DIR}/test.sh",
        parser="reward_file",
        verifier_env=_resolve_env(verifier.get("env", {}), file, "verifier"),
        uses_agent_services=bool(verifier.get("uses_agent_services", False)),
        solution=_files_under(solution_dir, SOLUTION_DIR) if has_solution else (),
        solution_command=f"bash {SOLUTION_DIR}/solve.sh" if has_solution else None,
        solution_env=_resolve_env(cfg.get("solution", {}).get("env", {}), file, "solution"),
        agent_user=None if agent.get("user") is None else str(agent["user"]),
        verifier_user=None if verifier.get("user") is None else str(verifier["user"]),
        healthcheck=tuple(sorted(hc.items())) if hc else (),
        category=str(meta.get("category", "")), difficulty=str(meta.get("difficulty", "")),
        tags=_tags(meta.get("tags")), notes=tuple(notes))


def _tags(value) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(str(t) for t in value)


def _strip_canary(text: str) -> str:
    """Leading canary lines (data-provenance markers) are not for the agent (as in harbor)."""
    lines, i = text.split("\n"), 0
    while i < len(lines) and _CANARY.match(lines[i].strip()):
        i += 1
    while i < len(lines) and not lines[i].strip():
        i += 1
    return "\n".join(lines[i:])


# ---------------------------------------------------------------------------------------------
# Terminal-Bench 1.0
# ---------------------------------------------------------------------------------------------

def _load_tb1(path: str) -> Task:
    import yaml
    file = os.path.join(path, "task.yaml")
    try:
        with open(file, encoding="utf-8") as f:
            cfg = yaml.safe_load(f)
    except yaml.YAMLError as e:
        raise TaskError(file, None, f"is not valid YAML: {e}") from None
    if not isinstance(cfg, dict):
        raise TaskError(file, None, "must be a YAML mapping of fields")
    _check(cfg, _TB1, file)
    instruction = _require(cfg, "instruction", file, "", "what the agent is asked to do")
    agent_timeout = _require(cfg, "max_agent_timeout_sec", file, "",
                             "the agent's time limit in seconds")
    test_timeout = _require(cfg, "max_test_timeout_sec", file, "",
                            "the tests' time limit in seconds")
    parser = cfg.get("parser_name", "pytest")
    if parser != "pytest":
        raise TaskError(file, "parser_name", f"only 'pytest' is supported, got {parser!r}")
    notes = ["disable_asciinema is not used by this harness"] if "disable_asciinema" in cfg else []
    dockerfile, context, env = os.path.join(path, "Dockerfile"), path, ()
    compose = os.path.join(path, "docker-compose.yaml")
    if os.path.isfile(compose):
        dockerfile, context, env, compose_notes = _tb1_compose(compose, path)
        notes += compose_notes
    if not os.path.isfile(dockerfile):
        raise TaskError(dockerfile, None, "is missing (the task's environment)")
    run_tests = os.path.join(path, "run-tests.sh")
    if not os.path.isfile(run_tests):
        raise TaskError(run_tests, None, "is missing (the verifier: it runs the tests)")
    tests_dir = os.path.join(path, "tests")
    tests = ((run_tests, f"{TESTS_DIR}/run-tests.sh"),)
    if os.path.isdir(tests_dir):
        tests += _files_under(tests_dir, TESTS_DIR)
    solution, command = (), None
    if os.path.isfile(os.path.join(path, "solution.sh")):
        solution = ((os.path.join(path, "solution.sh"), f"{SOLUTION_DIR}/solution.sh"),)
        command = f"bash {SOLUTION_DIR}/solution.sh"
    elif os.path.isfile(os.path.join(path, "solution.yaml")):
        command = _tb1_solution_yaml(os.path.join(path, "solution.yaml"))
    # What the agent must not see is kept out of the image too (TB 1.0's build context is
    # the task directory itself).
    exclude = tuple(p for p in ("tests", "run-tests.sh", "solution.sh", "solution.yaml",
                                "task.yaml") if os.path.exists(os.path.join(path, p)))
    exclude = tuple(os.path.relpath(os.path.join(path, p), context) for p in exclude)
    return Task(
        name=os.path.basename(path), path=path, layout="tb1",
        instruction=_strip_canary(instruction.strip()),
        agent_timeout_s=float(agent_timeout), verifier_timeout_s=float(test_timeout),
        dockerfile=dockerfile, context_dir=context, context_exclude=exclude,
        allow_internet=True, env=env, tests=tests,
        test_command=f"bash {TESTS_DIR}/run-tests.sh", parser="pytest",
        verifier_env=(("TEST_DIR", TESTS_DIR),),
        run_tests_in_same_shell=bool(cfg.get("run_tests_in_same_shell", False)),
        uses_agent_services=bool(cfg.get("uses_agent_services", False)),
        solution=solution, solution_command=command,
        category=str(cfg.get("category", "")), difficulty=str(cfg.get("difficulty", "")),
        tags=_tags(cfg.get("tags")), notes=tuple(notes))


def _tb1_compose(file: str, path: str):
    """TB 1.0's one-service docker-compose.yaml: its build (context, Dockerfile), the
    environment entries that are not the harness's own T_BENCH_* templates, and notes on
    what is not used (the image, container name, command and volumes are the harness's)."""
    import yaml
    try:
        with open(file, encoding="utf-8") as f:
            compose = yaml.safe_load(f)
    except yaml.YAMLError as e:
        raise TaskError(file, None, f"is not valid YAML: {e}") from None
    services = compose.get("services") if isinstance(compose, dict) else None
    if not isinstance(services, dict) or len(services) != 1:
        raise TaskError(file, "services", "must hold exactly one service (multi-container "
                                          "tasks are not supported)")
    (name, service), = services.items()
    build = service.get("build") if isinstance(service, dict) else None
    if isinstance(build, str):
        build = {"context": build}
    if not isinstance(build, dict):
        raise TaskError(file, f"services.{name}.build", "is missing: the image must be built "
                                                          "from the task's Dockerfile")
    context = os.path.normpath(os.path.join(path, build.get("context", ".")))
    dockerfile = os.path.join(context, build.get("dockerfile", "Dockerfile"))
    raw = service.get("environment") or []
    items = list(raw.items()) if isinstance(raw, dict) else [
        tuple(e.split("=", 1)) if "=" in e else (e, "") for e in raw]
    env, notes = [], []
    for key, value in items:
        value = str(value).replace("${T_BENCH_TEST_DIR}", TESTS_DIR)
        if "${" in value:
            notes.append(f"docker-compose.yaml: environment {key}={value} is not set (a "
                         f"template of terminal-bench's harness)")
        else:
            env.append((key, value))
    own = {"build", "image", "container_name", "command", "environment", "volumes"}
    notes += [f"docker-compose.yaml: services.{name}.{key} is not used by this harness"
              for key in sorted(set(service) - own)]
    return dockerfile, context, tuple(env), notes


def _tb1_solution_yaml(file: str) -> str:
    """TB 1.0's solution.yaml (a list of {command: ...}) as one shell script."""
    import yaml
    with open(file, encoding="utf-8") as f:
        steps = yaml.safe_load(f)
    if not isinstance(steps, list) or not all(isinstance(s, dict) and isinstance(
            s.get("command"), str) for s in steps):
        raise TaskError(file, "command", "must be a list of {command: <shell text>}")
    return "\n".join(s["command"] for s in steps)
