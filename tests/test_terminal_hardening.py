"""The terminal verifier and boxes under attack, on both backends (bwrap and docker).

Each attack is an agent that does not solve its task but tries to forge the reward; each must
score 0, and the real solution (the oracle) must still score 1 on the same warm boxes. The
host is probed before and after, read-only (sysctls, keyrings, mounts, processes of the
boxes' uids): never written. docs/terminal.md, "Threat model", names these tests."""

import os
import textwrap

import pytest

from sandbox import terminal
from sandbox.backends.bwrap import _KEYRING_SYSCALLS
from sandbox.terminal import bwrap, host_pytest, state
from tests.test_terminal_load import TASKS_DIR, TB1_YAML, harbor_task, host_processes, tb1_task

pytestmark = pytest.mark.xdist_group("terminal")

_BWRAP = bwrap.unavailable()
_KEYCTL = _KEYRING_SYSCALLS[os.uname().machine][1][2]


def _docker_reason():
    from tests.test_terminal import _REASON
    return _REASON


BACKENDS = [pytest.param("bwrap", marks=pytest.mark.skipif(_BWRAP is not None,
                                                           reason=str(_BWRAP))),
            "docker"]
HOST_SYSCTLS = ("kernel/core_pattern", "kernel/modprobe", "kernel/hostname",
                "kernel/domainname", "fs/suid_dumpable", "kernel/panic", "vm/overcommit_memory",
                "net/ipv4/ip_forward", "kernel/keys/maxkeys", "kernel/printk")


def host_state() -> dict:
    """What a box must not change on the host, read without writing anything."""
    sysctls = {}
    for name in HOST_SYSCTLS:
        try:
            with open(f"/proc/sys/{name}") as f:
                sysctls[name] = f.read()
        except OSError:
            pass
    keys = {ring: _keyring(ring) for ring in (-3, -4, -5)}  # session, user, user session
    with open("/proc/self/mountinfo") as f:  # docker's own container mounts come and go
        mounts = sorted(" ".join(line.split()[3:5]) for line in f
                        if "docker" not in line and "/run/netns" not in line
                        and " nsfs " not in line)
    return {"sysctls": sysctls, "keys": keys, "mounts": mounts}


def _keyring(ring: int) -> bytes:
    """The key ids linked in one of this process's keyrings (keyctl KEYCTL_READ)."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(4096)
    n = libc.syscall(_KEYCTL, 11, ring, buf, 4096)
    return buf.raw[:max(n, 0)]


def box_keys(uids) -> list[str]:
    """Keys owned by one of `uids` (host-wide, as root sees /proc/keys)."""
    with open("/proc/keys") as f:
        return [line for line in f if int(line.split()[5]) in uids]


def box_processes(uids) -> list[str]:
    """Host processes running as one of `uids` that are ours: below this process, or orphans
    (the uids are a pool other sandboxes on this machine take from once ours let them go)."""
    def status(pid):
        with open(f"/proc/{pid}/status") as f:
            return dict(line.split(":", 1) for line in f)

    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = status(pid)
            if int(fields["Uid"].split()[0]) not in uids:
                continue
            chain, p = [], int(fields["PPid"])
            while p > 1 and p != os.getpid():
                chain.append(p)
                p = int(status(p)["PPid"])
        except (OSError, KeyError):
            continue
        if p == os.getpid() or not chain:
            out.append(f"{pid} {fields['State'].strip()} {fields['Name'].strip()}")
    return out


@pytest.fixture(scope="module")
def host_before():
    return host_state()


@pytest.fixture(scope="module", params=BACKENDS)
def harness(request, host_before):
    if request.param == "docker" and _docker_reason() is not None:
        pytest.skip(_docker_reason())
    uids = set()
    with terminal.Harness(backend=request.param, max_idle=2) as h:
        h.box_uids = uids
        yield h
    assert host_state() == host_before
    assert box_processes(uids - {None}) == []
    assert box_keys(uids - {None}) == []


@pytest.fixture(scope="module")
def tasks():
    return {t.name: t for t in terminal.load_tasks(TASKS_DIR).tasks}


@pytest.fixture(scope="module")
def tb1_probe(tmp_path_factory):
    """A TB 1.0 task whose test runs the agent's /app/answer and wants 42."""
    root = tmp_path_factory.mktemp("tb1-probe")
    return terminal.load_task(tb1_task(root / "answer", **{
        "Dockerfile": "FROM ptrain-term-base:latest\nWORKDIR /app\n",
        "tests/test_outputs.py": textwrap.dedent("""\
            import subprocess

            def test_answer():
                out = subprocess.run(["/app/answer"], capture_output=True, text=True).stdout
                assert out.strip() == "42"
            """),
        "solution.sh": "printf '#!/bin/sh\\necho 42\\n' > /app/answer; chmod +x /app/answer\n"}))


@pytest.fixture(scope="module")
def same_shell(tmp_path_factory):
    """A TB 1.0 task whose tests run "in the agent's shell": APP_MODE exported, cwd /srv."""
    root = tmp_path_factory.mktemp("same-shell")
    return terminal.load_task(tb1_task(root / "session", **{
        "task.yaml": TB1_YAML + "run_tests_in_same_shell: true\n",
        "Dockerfile": "FROM ptrain-term-base:latest\nWORKDIR /app\n",
        "tests/test_outputs.py": textwrap.dedent("""\
            import os

            def test_session():
                assert os.environ.get("APP_MODE") == "production"
                assert os.getcwd() == "/srv"
            """),
        "solution.sh": None,
        "solution.yaml": "- command: cd /srv\n- command: export APP_MODE=production\n"}))


def attempt(harness, task, commands):
    """Run the agent's `commands` (a nop agent's attack), verify, note the box's uid."""
    with harness.episode(task) as ep:
        harness.box_uids.add(getattr(ep.container, "host_uid", None))
        for command in commands:
            ep.run(command)
        return ep.verify()


def oracle(harness, task):
    row, _ = terminal.run_attempt(harness, task, terminal.oracle, 0)
    return row


# What a planted pytest hook does: every test passes.
_PASS_ALL = ("import pytest\n@pytest.hookimpl(hookwrapper=True)\n"
             "def pytest_runtest_makereport(item, call):\n    o = yield\n"
             "    r = o.get_result(); r.outcome = 'passed'; r.longrepr = None\n")
_PASS_ALL_PTH = ("import sys; exec(\"import builtins\\n"
                 "try:\\n import _pytest.reports as R\\n"
                 " R.TestReport.failed = property(lambda s: False)\\n"
                 " R.TestReport.passed = property(lambda s: True)\\n"
                 "except Exception: pass\")\n")


def _write(path, text) -> str:
    """A shell command that writes `text` to `path` (parents made), failing quietly."""
    import shlex
    return (f"mkdir -p {shlex.quote(os.path.dirname(path))} 2>/dev/null; "
            f"printf %s {shlex.quote(text)} > {shlex.quote(path)} 2>/dev/null; true")


def test_planted_pytest_config_conftest_pth_and_sitecustomize_do_not_count(harness, tasks):
    hello = tasks["hello-file"]
    planted = [_write(p, _PASS_ALL) for p in ("/conftest.py", "/app/conftest.py",
                                              "/tests/conftest.py")]
    planted += [_write(p, "[pytest]\naddopts = -p no:python --co\n")
                for p in ("/pytest.ini", "/app/pytest.ini", "/tox.ini")]
    planted += [_write("/app/pyproject.toml", "[tool.pytest.ini_options]\naddopts = '-x --co'\n"),
                _write("/root/.local/lib/python3.11/site-packages/zz.pth", _PASS_ALL_PTH),
                _write("/usr/lib/python3/dist-packages/zz.pth", _PASS_ALL_PTH),
                _write("/usr/lib/python3.11/sitecustomize.py", _PASS_ALL_PTH),
                _write("/usr/local/lib/python3.11/dist-packages/zz.pth", _PASS_ALL_PTH),
                "echo 'export PYTHONPATH=/app PYTEST_ADDOPTS=--co' >> /root/.bashrc",
                _write("/logs/verifier/reward.txt", "1")]
    v = attempt(harness, hello, planted)
    assert v.reward == 0.0 and not v.passed, v.feedback
    assert any("hello.txt does not exist" in f for f in v.failures), v.feedback
    dropped = "\n".join(v.dropped)
    if harness.backend == "docker":  # written for real there (through the image's symlink
        assert "sitecustomize.py: a trusted path" in dropped  # to /etc): left out
    assert oracle(harness, hello)["reward"] == 1.0


def test_a_fake_pytest_first_on_path_and_fake_passed_lines_do_not_count(harness, tasks,
                                                                      tb1_probe):
    fake = "#!/bin/sh\necho 'PASSED test_outputs.py::test_answer'\necho '1 passed'\nexit 0\n"
    v = attempt(harness, tb1_probe, [
        _write("/usr/local/bin/pytest", fake), "chmod +x /usr/local/bin/pytest 2>/dev/null",
        _write("/app/bin/pytest", fake), "chmod +x /app/bin/pytest",
        _write("/root/.local/bin/pytest", fake), "chmod +x /root/.local/bin/pytest",
        _write(f"{host_pytest.VERDICT_DIR}/1.json",
               '{"tests": {"t": "PASSED"}, "failures": [], "exitstatus": 0}')])
    assert v.reward == 0.0, v.feedback
    assert v.tests == {"test_outputs.py::test_answer": "FAILED"}, v.feedback
    assert oracle(harness, tb1_probe)["reward"] == 1.0


def test_printing_passed_and_killing_pytest_scores_zero(harness, tb1_probe):
    # The program under test prints pytest's summary of a pass and kills pytest: the exit
    # status counts, and the summary is never parsed.
    liar = ("#!/bin/sh\nprintf '%s\\n' '===== short test summary info =====' "
            "'PASSED test_outputs.py::test_answer' '===== 1 passed in 0.01s ====='\n"
            "kill -9 $PPID\n")
    v = attempt(harness, tb1_probe, [_write("/app/answer", liar), "chmod +x /app/answer"])
    assert v.reward == 0.0 and v.exit_code != 0, v.feedback
    assert "did not run" in v.error or "status" in v.error, v.feedback


def test_a_bash_function_in_the_agent_s_shell_never_runs_the_verdict(harness, same_shell):
    forged = ('{"tests": {"test_outputs.py::test_session": "PASSED"}, "failures": [], '
              '"exitstatus": 0}')
    v = attempt(harness, same_shell, [
        "bash() { mkdir -p /logs/ptrain-verdict; echo '" + forged + "' > "
        "/logs/ptrain-verdict/9.json; echo PASSED; return 0; }; export -f bash",
        "pytest() { bash; }; export -f pytest; alias pytest=bash",
        "export PYTEST_ADDOPTS=--co PYTHONPATH=/app LD_PRELOAD=/app/x.so BASH_ENV=/app/env",
        # a fake bash first on the session's PATH, forging the verdict file and exiting 0
        _write("/app/evil/bash", "#!/bin/sh\nmkdir -p /logs/ptrain-verdict\necho '" + forged
               + "' > /logs/ptrain-verdict/8.json\nexit 0\n"),
        "chmod +x /app/evil/bash && export PATH=/app/evil:$PATH",
        "cd /srv"])  # the cwd is right, APP_MODE is not exported
    assert v.reward == 0.0, v.feedback
    assert any("APP_MODE" in f or "assert" in f for f in v.failures), v.feedback
    assert oracle(harness, same_shell)["reward"] == 1.0  # the session's state is carried


def test_no_process_of_the_agent_survives_into_the_verifier_or_the_next_episode(harness,
                                                                                tasks):
    # A background writer forging the reward and the tests while they run, and a ptraced
    # keep-alive that tries to outlive the box (and forge the next episode's reward).
    hello = tasks["hello-file"]
    writer = ("nohup sh -c 'while :; do mkdir -p /logs/verifier /tests; "
              "echo 1 > /logs/verifier/reward.txt; echo \"echo 1 > /logs/verifier/reward.txt\""
              " > /tests/test.sh; sleep 0.01; done' >/dev/null 2>&1 &")
    keep_alive = textwrap.dedent("""\
        python3 - <<'EOF' &
        import ctypes, os, signal, time
        libc = ctypes.CDLL(None, use_errno=True)
        child = os.fork()
        if child == 0:
            os.setsid(); os.execvp("sleep", ["sleep", "4242"])
        time.sleep(0.2)
        libc.ptrace(0x4206, child, 0, 0)  # PTRACE_SEIZE: a traced keep-alive
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        while True:
            try:
                os.makedirs("/logs/verifier", exist_ok=True)
                open("/logs/verifier/reward.txt", "w").write("1")
            except OSError:
                pass
            time.sleep(0.05)
        EOF""")
    with harness.episode(hello) as ep:
        init = _box_init(ep.container)  # the box's own pid 1 (docker: init + keep-alive sleep)
        with open(f"/proc/{init}/task/{init}/children") as f:
            keep = [int(p) for p in f.read().split()]
        for command in (writer, keep_alive, "sleep 0.5"):
            ep.run(command)
        v = ep.verify()
    assert v.reward == 0.0, v.feedback
    assert not host_processes("sleep 4242")
    for pid in (init, *keep):  # the box's own keep-alive is gone too
        assert not os.path.exists(f"/proc/{pid}") or _zombie(pid), pid
    nxt = attempt(harness, hello, ["ps -eo args; ls /logs/verifier 2>&1"])
    assert nxt.reward == 0.0, nxt.feedback
    with harness.episode(hello) as ep:
        out = ep.run("ps -eo args").output
        assert "4242" not in out and "while :" not in out, out


def _box_init(box) -> int:
    return box.pid if isinstance(box, bwrap.Box) else box.container.attrs["State"]["Pid"]


def _zombie(pid) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def test_xattrs_and_special_files_are_not_carried_or_kept(harness, tmp_path):
    # The agent stores answers in xattrs (on /etc, the work dir, /dev and files), leaves a
    # FIFO, a setuid file, a hard link and a symlink, deletes a file of the image; the
    # verifier's box shows the policy, and the next episode on the reused box sees none of it.
    probe = ("python3 - <<'EOF'\nimport os, stat\n"
             "def x(p):\n    try: return sorted(os.listxattr(p))\n    except OSError as e: "
             "return e.errno\n"
             "for p in ('/etc', '/app', '/dev', '/app/f', '/app/link'):\n"
             "    print('XATTR', p, x(p))\n"
             "print('FIFO', os.path.exists('/app/fifo'))\n"
             "print('SETUID', oct(os.stat('/app/f').st_mode & 0o6777))\n"
             "print('LINKS', os.stat('/app/f').st_nlink, os.path.exists('/app/hard'))\n"
             "print('SYMLINK', os.path.islink('/app/link') and os.readlink('/app/link'))\n"
             "print('DELETED', not os.path.exists('/app/gone.txt'))\n"
             "EOF\necho 0 > /logs/verifier/reward.txt\n")
    task = terminal.load_task(harbor_task(tmp_path / "xattrs", **{
        "environment/Dockerfile": ("FROM ptrain-term-base:latest\nWORKDIR /app\n"
                                   "COPY gone.txt /app/gone.txt\n"),
        "environment/gone.txt": "of the image\n", "tests/test.sh": probe}))
    plant = ("python3 -c \"import os\nfor p in ('/etc', '/app', '/dev', '/app/f'):\n"
             "    try: os.setxattr(p, 'user.answer', b'42')\n    except OSError: pass\"")
    v = attempt(harness, task, [
        "echo data > /app/f && chmod 4755 /app/f && ln /app/f /app/hard && "
        "ln -s /app/f /app/link && mkfifo /app/fifo && rm /app/gone.txt", plant])
    out = v.output_tail
    for p in ("/etc", "/app", "/dev", "/app/f"):
        assert f"XATTR {p} []" in out or f"XATTR {p} 61" in out, out
    assert "FIFO False" in out and "SETUID 0o755" in out, out
    assert "LINKS 1 True" in out and "SYMLINK /app/f" in out, out
    assert "DELETED True" in out, out  # a file of the image the agent deleted
    assert any("FIFO" in d for d in v.dropped), v.dropped
    with harness.episode(task) as ep:
        r = ep.run("python3 -c \"import os; print([os.listxattr(p) for p in "
                   "('/etc', '/app', '/dev')])\"; ls /app")
        assert r.output.splitlines()[0] == "[[], [], []]", r.output


def test_the_bwrap_box_has_no_host_privilege(harness, tasks):
    """Root inside, an unprivileged uid outside; /proc/sys read-only and the masked /proc
    entries empty; the code sandbox's seccomp filter (keyrings refused); a keyring of its
    own; docker's default capabilities."""
    if harness.backend != "bwrap":
        pytest.skip("the bwrap box's guarantees (docker gives its own defaults)")
    with harness.episode(tasks["hello-file"]) as ep:
        box = ep.container
        assert box.host_uid is not None and box.host_uid >= 500_000
        with open(f"/proc/{box.pid}/status") as f:
            uids = next(line for line in f if line.startswith("Uid:")).split()[1:]
        assert set(uids) == {str(box.host_uid)}
        r = ep.run("id -u; grep -E '^(Seccomp|CapBnd):' /proc/self/status; "
                   # (read-only probes: access(2) and the mount table, never a write)
                   "python3 -c 'import os; print(\"writable\", os.access("
                   "\"/proc/sys/kernel/core_pattern\", os.W_OK))'; "
                   "grep -E \" /proc/(sys|keys) \" /proc/self/mountinfo; "
                   "python3 -c 'import ctypes; l = ctypes.CDLL(None, use_errno=True); "
                   f"print(\"keyctl\", l.syscall({_KEYCTL}, 0, -3, 0), ctypes.get_errno())'")
        lines = r.output.splitlines()
        assert lines[0] == "0" and "Seccomp:\t2" in r.output, r.output
        assert "CapBnd:\t00000000000405fb" in r.output, r.output  # docker's defaults
        assert "writable False" in r.output, r.output
        mounts = [line for line in r.output.splitlines() if "/proc/sys " in line]
        assert mounts and all(" ro," in line or " ro " in line for line in mounts), r.output
        assert any(" /proc/keys " in line for line in r.output.splitlines()), r.output
        assert "keyctl -1 38" in r.output, r.output  # ENOSYS: the seccomp filter
        with open(f"/proc/{box.pid}/status") as f:  # its pid 1 too
            assert "Seccomp:\t2" in f.read()


def test_the_state_policy_keeps_the_verifier_s_own_paths():
    assert state.trusted("/usr/bin/python3.11") and state.trusted("/bin/sh")
    assert state.trusted("/usr/lib/python3.11/sitecustomize.py")
    assert state.trusted("/etc/ld.so.preload") and state.trusted("/tests/conftest.py")
    assert state.trusted("/lib/x86_64-linux-gnu/libc.so.6")
    assert not state.trusted("/usr/lib/python3/dist-packages/numpy/__init__.py")
    assert not state.trusted("/usr/local/lib/python3.11/site-packages/x.pth")
    assert not state.trusted("/app/conftest.py") and not state.trusted("/etc/passwd")

