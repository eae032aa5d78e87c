"""sandbox.terminal without docker: task loading (both layouts, malformed tasks), Dockerfile
bases, verdict parsing against real pytest output, pass@k against a brute-force count."""

import itertools
import json
import os
import subprocess
import sys
import textwrap

import pytest

from sandbox import terminal
from sandbox.terminal import image, verify

TASKS_DIR = terminal.BUNDLED_TASKS

HARBOR_TOML = """\
version = "1.0"

[metadata]
category = "demo"

[verifier]
timeout_sec = 30.0

[agent]
timeout_sec = 60.0

[environment]
cpus = 1
memory_mb = 256
"""

TB1_YAML = """\
instruction: |-
  Do the thing.
difficulty: easy
parser_name: pytest
max_agent_timeout_sec: 60.0
max_test_timeout_sec: 30.0
"""


def write(root, files):
    for rel, text in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    return str(root)


def harbor_task(root, **overrides):
    files = {"instruction.md": "Do the thing.\n", "task.toml": HARBOR_TOML,
             "environment/Dockerfile": "FROM ptrain-term-base:latest\n",
             "tests/test.sh": "echo 1 > /logs/verifier/reward.txt\n",
             "solution/solve.sh": "true\n"}
    files.update(overrides)
    return write(root, {k: v for k, v in files.items() if v is not None})


def quick_task(root, agent_s=3, verifier_s=30, test_sh="echo 0 > /logs/verifier/reward.txt\n"):
    """A loaded Harbor task with short time limits (test_terminal, test_terminal_bwrap)."""
    from sandbox import terminal
    toml = (f"[verifier]\ntimeout_sec = {verifier_s}\n\n[agent]\ntimeout_sec = {agent_s}\n\n"
            "[environment]\nmemory_mb = 256\nallow_internet = false\n")
    return terminal.load_task(harbor_task(root, **{"task.toml": toml, "tests/test.sh": test_sh}))


def tb1_task(root, **overrides):
    files = {"task.yaml": TB1_YAML, "Dockerfile": "FROM ptrain-term-base:latest\n",
             "run-tests.sh": "pytest $TEST_DIR/test_outputs.py -rA\n",
             "tests/test_outputs.py": "def test_x():\n    assert True\n",
             "solution.sh": "true\n"}
    files.update(overrides)
    return write(root, {k: v for k, v in files.items() if v is not None})


# --- the bundled tasks --------------------------------------------------------------------------

def test_bundled_tasks_load_in_both_layouts_and_cover_the_required_kinds():
    loaded = terminal.load_tasks(TASKS_DIR)
    assert loaded.skipped == ()
    assert len(loaded.tasks) >= 12
    layouts = {t.layout for t in loaded.tasks}
    assert layouts == {"harbor", "tb1"}
    categories = {t.category for t in loaded.tasks}
    assert {"file-operations", "text-processing", "scripting", "debugging", "archives",
            "services"} <= categories
    for t in loaded.tasks:
        assert t.has_solution, t.name
        assert t.tests, t.name
        assert t.instruction.strip(), t.name
    # TB 1.0's build context is the task directory: its tests and solution stay out of it.
    tb1 = next(t for t in loaded.tasks if t.layout == "tb1")
    assert {"tests", "run-tests.sh", "solution.sh"} & set(tb1.context_exclude)


def test_harbor_fields_follow_harbor_names(tmp_path):
    path = harbor_task(tmp_path, **{
        "instruction.md": "<!-- canary GUID 1234 -->\n\nReally do it.\n",
        "task.toml": HARBOR_TOML.replace("memory_mb = 256", 'memory = "1G"\nstorage = "2G"')
        + '\n[environment.env]\nGREETING = "${PTRAIN_TEST_UNSET_VAR:-hi}"\n'
        + '\n[solution.env]\nMODE = "fast"\n'})
    t = terminal.load_task(path)
    assert (t.layout, t.agent_timeout_s, t.verifier_timeout_s) == ("harbor", 60.0, 30.0)
    assert (t.memory_mb, t.storage_mb, t.cpus) == (1024, 2048, 1.0)
    assert t.instruction == "Really do it.\n"  # canary lines are not for the agent
    assert dict(t.env) == {"GREETING": "hi"}
    assert dict(t.solution_env) == {"MODE": "fast"}
    assert t.allow_internet  # harbor's default; the operator still decides
    assert t.test_command == "bash /tests/test.sh"
    assert ("/tests/test.sh" in dict((dst, src) for src, dst in t.tests))


def test_harbor_prebuilt_image_needs_no_dockerfile(tmp_path):
    path = harbor_task(tmp_path, **{
        "environment/Dockerfile": None,
        "task.toml": HARBOR_TOML + 'docker_image = "ghcr.io/x/y:1"\nallow_internet = false\n'})
    t = terminal.load_task(path)
    assert t.docker_image == "ghcr.io/x/y:1" and t.dockerfile is None
    assert not t.allow_internet


@pytest.mark.parametrize("change, file, field, words", [
    ({"task.toml": "[agent\ntimeout_sec = 1"}, "task.toml", None, "not valid TOML"),
    ({"task.toml": HARBOR_TOML + "colour = 'red'\n"}, "task.toml", "[environment] colour",
     "unknown key"),
    ({"task.toml": HARBOR_TOML.replace("[agent]\ntimeout_sec = 60.0", "[agent]")},
     "task.toml", "[agent] timeout_sec", "is missing"),
    ({"task.toml": HARBOR_TOML.replace("timeout_sec = 30.0", "")}, "task.toml",
     "[verifier] timeout_sec", "is missing"),
    ({"task.toml": HARBOR_TOML.replace("timeout_sec = 30.0", 'timeout_sec = "soon"')},
     "task.toml", "[verifier] timeout_sec", "positive number"),
    ({"task.toml": HARBOR_TOML.replace("cpus = 1", "cpus = -2")}, "task.toml",
     "[environment] cpus", "positive number"),
    ({"task.toml": HARBOR_TOML + "gpus = 1\n"}, "task.toml", "[environment] gpus", "GPU"),
    ({"instruction.md": None}, "instruction.md", None, "is missing"),
    ({"tests/test.sh": None}, "tests/test.sh", None, "is missing"),
    ({"environment/Dockerfile": None}, "environment/Dockerfile", None, "docker_image"),
    ({"task.toml": HARBOR_TOML + '\n[environment.env]\nK = "${PTRAIN_TEST_UNSET_VAR}"\n'},
     "task.toml", "[environment] K", "PTRAIN_TEST_UNSET_VAR"),
])
def test_malformed_harbor_task_names_the_file_and_the_field(tmp_path, change, file, field,
                                                            words):
    path = harbor_task(tmp_path, **change)
    with pytest.raises(terminal.TaskError) as e:
        terminal.load_task(path)
    assert e.value.file == os.path.join(path, file)
    assert e.value.field == field
    assert words in str(e.value) and e.value.file in str(e.value)


@pytest.mark.parametrize("change, file, field, words", [
    ({"task.yaml": "instruction: [unclosed\n"}, "task.yaml", None, "not valid YAML"),
    ({"task.yaml": TB1_YAML + "colour: red\n"}, "task.yaml", "colour", "unknown key"),
    ({"task.yaml": TB1_YAML.replace("max_test_timeout_sec: 30.0\n", "")}, "task.yaml",
     "max_test_timeout_sec", "is missing"),
    ({"task.yaml": TB1_YAML.replace("max_agent_timeout_sec: 60.0\n", "")}, "task.yaml",
     "max_agent_timeout_sec", "is missing"),
    ({"task.yaml": TB1_YAML.replace("parser_name: pytest", "parser_name: swebench")},
     "task.yaml", "parser_name", "only 'pytest'"),
    ({"task.yaml": "- just a list\n"}, "task.yaml", None, "mapping"),
    ({"run-tests.sh": None}, "run-tests.sh", None, "is missing"),
    ({"Dockerfile": None}, "Dockerfile", None, "is missing"),
    ({"docker-compose.yaml": "services:\n  a:\n    build: .\n  b:\n    image: x\n"},
     "docker-compose.yaml", "services", "exactly one service"),
])
def test_malformed_tb1_task_names_the_file_and_the_field(tmp_path, change, file, field, words):
    path = tb1_task(tmp_path, **change)
    with pytest.raises(terminal.TaskError) as e:
        terminal.load_task(path)
    assert e.value.file == os.path.join(path, file)
    assert e.value.field == field
    assert words in str(e.value)


def test_a_directory_loads_with_what_was_skipped_and_why(tmp_path):
    harbor_task(tmp_path / "good-harbor")
    tb1_task(tmp_path / "good-tb1")
    harbor_task(tmp_path / "no-timeout", **{
        "task.toml": HARBOR_TOML.replace("[agent]\ntimeout_sec = 60.0", "")})
    write(tmp_path / "notes", {"README.md": "not a task\n"})
    both = harbor_task(tmp_path / "both")
    write(both, {"task.yaml": TB1_YAML})
    write(tmp_path / ".git", {"HEAD": "ref\n"})
    loaded = terminal.load_tasks(str(tmp_path))
    assert sorted(t.name for t in loaded.tasks) == ["good-harbor", "good-tb1"]
    reasons = {os.path.basename(p): why for p, why in loaded.skipped}
    assert set(reasons) == {"no-timeout", "notes", "both"}  # hidden dirs are not looked at
    assert "[agent] timeout_sec" in reasons["no-timeout"]
    assert "no task.toml" in reasons["notes"]
    assert "both task.toml" in reasons["both"]
    summary = loaded.summary()
    assert "2 tasks loaded, 3 skipped" in summary and "[agent] timeout_sec" in summary


def test_tb1_compose_and_solution_yaml(tmp_path):
    compose = textwrap.dedent("""\
        services:
          client:
            build:
              dockerfile: Dockerfile
            image: ${T_BENCH_TASK_DOCKER_CLIENT_IMAGE_NAME}
            ports: ["8080:80"]
            environment:
              - TEST_DIR=${T_BENCH_TEST_DIR}
              - MODE=demo
              - LOGS=${T_BENCH_CONTAINER_LOGS_PATH}
        """)
    path = tb1_task(tmp_path, **{"docker-compose.yaml": compose, "solution.sh": None,
                                 "solution.yaml": "- command: cd /srv\n- command: export A=1\n"})
    t = terminal.load_task(path)
    assert dict(t.env) == {"TEST_DIR": "/tests", "MODE": "demo"}
    assert any("services.client.ports is not used" in n for n in t.notes)
    assert any("LOGS=${T_BENCH_CONTAINER_LOGS_PATH} is not set" in n for n in t.notes)
    assert t.solution_command == "cd /srv\nexport A=1" and t.solution == ()
    assert t.parser == "pytest" and dict(t.verifier_env)["TEST_DIR"] == "/tests"


# --- Dockerfile bases -------------------------------------------------------------------------

def test_rewrite_bases_maps_external_images_only():
    text = textwrap.dedent("""\
        # syntax comment
        ARG BASE=python:3.12-slim
        FROM --platform=linux/amd64 ${BASE} AS build
        RUN echo hi \\
            && echo there
        FROM build AS test
        COPY --from=build /a /b
        COPY --from=tools:1 /bin/x /bin/x
        FROM scratch
        COPY --from=0 /a /a
        """)
    out, bases = image.rewrite_bases(text, {"python:3.12-slim": "local:py", "tools:1": "local:t"})
    assert [(name, target) for _, name, target in bases] == [
        ("python:3.12-slim", "local:py"), ("tools:1", "local:t")]
    assert "FROM --platform=linux/amd64 local:py AS build" in out
    assert "COPY --from=local:t /bin/x /bin/x" in out
    assert "FROM build AS test" in out and "COPY --from=0 /a /a" in out
    assert len(out.split("\n")) == len(text.split("\n"))  # line numbers still match


def test_image_map_from_the_command_line():
    assert image.parse_image_map(["a:1=b:2", "ubuntu=ptrain-term-base:latest"]) == {
        "a:1": "b:2", "ubuntu": "ptrain-term-base:latest"}
    with pytest.raises(ValueError, match="FROM-IMAGE=LOCAL-IMAGE"):
        image.parse_image_map(["nothing"])


# --- verdicts ---------------------------------------------------------------------------------

def real_pytest_output(tmp_path) -> str:
    """What the real pytest prints with -rA for a passing, a failing and an erroring test."""
    write(tmp_path, {"test_demo.py": textwrap.dedent("""\
        import pytest

        @pytest.fixture
        def broken():
            raise RuntimeError("fixture broke")

        def test_ok():
            assert 1 + 1 == 2

        def test_wrong():
            assert [1, 2] == [1, 3], "lists differ"

        def test_error(broken):
            pass
        """)})
    r = subprocess.run([sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider",
                        "test_demo.py"], cwd=tmp_path, capture_output=True, text=True,
                       env={**os.environ, "COLUMNS": "200", "PYTEST_ADDOPTS": ""})
    return r.stdout


def test_pytest_verdict_from_real_pytest_output(tmp_path):
    out = real_pytest_output(tmp_path)
    v = verify.pytest_result(out, tail=out[-500:])
    assert v.tests == {"test_demo.py::test_ok": "PASSED", "test_demo.py::test_wrong": "FAILED",
                       "test_demo.py::test_error": "ERROR"}
    assert v.reward == 0.0 and not v.passed
    assert any("test_wrong" in f and "lists differ" in f for f in v.failures)
    assert any("test_error" in f and "fixture broke" in f for f in v.failures)
    assert "1 of 3 tests passed" in v.feedback and "lists differ" in v.feedback
    ok = verify.pytest_result(out.replace("FAILED", "PASSED").replace("ERROR ", "PASSED "),
                               tail="")
    assert ok.reward == 1.0 and ok.passed
    none = verify.pytest_result("bash: pytest: command not found\n", tail="")
    assert none.reward == 0.0 and "no pytest results" in none.error


@pytest.mark.parametrize("files, reward, error", [
    ({"reward.txt": b"1\n"}, 1.0, None),
    ({"reward.txt": b"0.25"}, 0.25, None),
    ({"reward.json": b'{"reward": 0.5, "rows": 3}', "reward.txt": b"1"}, 0.5, None),
    ({"reward.json": b'{"accuracy": 0.75}'}, 0.75, None),
    ({"reward.json": b'{"a": 1, "b": 0}'}, 0.0, "no 'reward'"),
    ({"reward.json": b"[1]"}, 0.0, "object"),
    ({"reward.json": b"{"}, 0.0, "not JSON"),
    ({"reward.txt": b""}, 0.0, "empty"),
    ({"reward.txt": b"yes"}, 0.0, "not a number"),
    ({"reward.txt": b"nan"}, 0.0, "finite"),
    ({}, 0.0, "wrote no"),
])
def test_reward_files_read_as_harbor_reads_them(files, reward, error):
    v = verify.reward_file_result(files, "", tail="")
    assert v.reward == reward
    assert v.passed == (reward >= 1.0)
    if error is None:
        assert v.error is None
    else:
        assert error in v.error


def test_pass_at_k_equals_a_brute_force_count():
    for n in range(1, 7):
        for c in range(n + 1):
            outcomes = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(range(n), k))
                want = sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)
                assert terminal.pass_at_k(n, c, k) == pytest.approx(want)
    with pytest.raises(ValueError):
        terminal.pass_at_k(3, 4, 1)


def test_summarize_gives_pass_at_k_per_task_and_category():
    rows = [{"task": "a", "attempt": i, "reward": float(p), "passed": p, "category": "x"}
            for i, p in enumerate([True, False, False, True])]
    rows += [{"task": "b", "attempt": i, "reward": 0.0, "passed": False, "category": "y"}
             for i in range(4)]
    s = terminal.summarize(rows, 4)
    assert s["tasks"]["a"]["pass@1"] == pytest.approx(0.5)
    assert s["tasks"]["a"]["pass@2"] == pytest.approx(terminal.pass_at_k(4, 2, 2))
    assert s["pass@1"] == pytest.approx(0.25) and s["pass@4"] == pytest.approx(0.5)
    assert s["categories"] == {"x": {"tasks": 1, "pass@1": 0.5}, "y": {"tasks": 1, "pass@1": 0.0}}
    json.dumps(s)
