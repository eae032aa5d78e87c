"""sandbox/terminal/bwrap.py: terminal tasks that need only files, in bubblewrap (no docker).

The bundled tasks whose Dockerfile only copies files onto the base pass their oracle and fail
nop; every other one is refused with the Dockerfile line that needs the image. What the
sandbox sees of the network (its own loopback only: the host's listener is unreachable),
a clean state each episode on a reused warm box, the tests hidden until verify, the read-only
base, the storage bound, the agent's capabilities and its cgroup limits."""

import concurrent.futures
import os
import shutil
import socket
import threading
import time

import pytest

from sandbox import terminal
from sandbox.terminal import bwrap

_REASON = bwrap.unavailable()
pytestmark = [pytest.mark.skipif(_REASON is not None, reason=str(_REASON)),
              pytest.mark.xdist_group("terminal")]
TASKS = terminal.BUNDLED_TASKS
FILES_ONLY = {"csv-column-sum", "csv-to-json", "fix-stats-bug", "hello-file",
              "tcp-upper-service"}


@pytest.fixture(scope="module")
def loaded():
    return terminal.load_tasks(TASKS)


@pytest.fixture(scope="module")
def harness():
    with terminal.Harness(backend="bwrap", max_idle=2) as h:
        yield h


def _task(loaded, name):
    return next(t for t in loaded.tasks if t.name == name)


def test_files_only_tasks_pass_their_oracle_and_fail_nop(loaded, harness):
    runnable = []
    for task in loaded.tasks:
        try:
            harness.image(task)
            runnable.append(task.name)
        except bwrap.NeedsImage as e:
            assert task.name not in FILES_ONLY
            assert "line" in str(e) and "RUN" in str(e) and "docker backend" in str(e)
            # Never a silently different environment: an episode of it does not open.
            with pytest.raises(bwrap.NeedsImage):
                harness.episode(task)
    assert set(runnable) == FILES_ONLY
    for name in sorted(FILES_ONLY):
        task = _task(loaded, name)
        assert terminal.run_attempt(harness, task, terminal.oracle, 0)[0]["reward"] == 1.0, name
        assert terminal.run_attempt(harness, task, terminal.nop, 0)[0]["reward"] == 0.0, name


def test_the_network_is_the_sandboxs_own_loopback(loaded, harness):
    host = socket.socket()
    host.bind(("127.0.0.1", 0))
    host.listen(4)
    port = host.getsockname()[1]
    accepted = []
    threading.Thread(target=lambda: accepted.append(host.accept()), daemon=True).start()
    try:
        with harness.episode(_task(loaded, "hello-file")) as ep:
            devices = ep.run("tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '").output
            assert devices.split() == ["lo"]
            routes = ep.run("tail -n +2 /proc/net/route; tail -n +1 /proc/net/ipv6_route "
                            "2>/dev/null | grep -v ' lo$'").output
            assert routes.strip() == ""
            probe = ("python3 -c \"import socket; s = socket.socket(); s.settimeout(3)\n"
                     f"try: s.connect(('127.0.0.1', {port})); print('reached')\n"
                     "except OSError as e: print(type(e).__name__)\"")
            assert ep.run(probe).output.strip() == "ConnectionRefusedError"
            # Its own loopback works (a server started in one call answers in the next).
            ep.run("nohup python3 -m http.server 8123 --bind 127.0.0.1 >/dev/null 2>&1 & "
                   "sleep 0.5")
            got = ep.run("python3 -c \"import urllib.request as u; "
                         "print(u.urlopen('http://127.0.0.1:8123/').status)\"").output
            assert got.strip() == "200"
        with pytest.raises(OSError):  # and the host does not reach the sandbox's
            socket.create_connection(("127.0.0.1", 8123), timeout=2).close()
        assert not accepted
        c = socket.create_connection(("127.0.0.1", port), timeout=5)  # the listener works
        c.close()
    finally:
        host.close()


def test_clean_state_each_episode_and_the_tests_hidden_until_verify(loaded, harness):
    task = _task(loaded, "hello-file")
    with harness.episode(task) as ep:
        box = ep.container
        assert ep.run("cd /tmp && pwd").output.strip() == "/tmp"
        assert ep.run("export X=1; echo $X; pwd").output.split() == ["1", "/tmp"]
        assert ep.run("echo $X").output.strip() == "1"
        cut = ep.run("sleep 30", timeout_s=1)  # Ctrl-C on the sandbox's terminal
        assert cut.timed_out and not cut.restarted and "cut at the time limit" in cut.output
        assert ep.run("echo $X").output.strip() == "1"  # the same shell, its state kept
        assert ep.run("ls -A /tests /solution 2>&1; cat /tests/test.sh 2>&1").exit_code != 0
        ep.run("echo left > /app/left; echo left > /tmp/left; mkdir -p /opt/x; "
               "echo 'export LEFT=1' >> /root/.bashrc; setsid sleep 1000 & "
               "mkdir -p /logs/verifier; echo 1 > /logs/verifier/reward.txt; "
               "rm -rf /tests; ln -s /usr /tests")
        assert "Read-only file system" in ep.run("echo x > /usr/bin/new; echo x >> "
                                                 "/etc/passwd").output
        result = ep.verify()  # the planted reward and the /tests symlink are replaced
        assert result.reward == 0.0 and not os.path.exists("/usr/test.sh")
    with harness.episode(task) as ep:
        assert ep.container is box and box.resets["restart"] >= 1  # the warm box, reset
        out = ep.run("ls -A /app /tmp /opt /logs /tests; echo LEFT=$LEFT X=$X; "
                     "ps -eo comm= | sort | tr '\\n' ' '").output
        assert "left" not in out and "x" not in out.split() and "LEFT= X=" in out
        assert "sleep" in out and out.count("sleep") == 1  # the sandbox's own, nothing else
        assert sorted(out.split("LEFT= X=")[0].split()) == [  # the supplied pytest's mount
            "/app:", "/logs:", "/opt:", "/tests:", "/tmp:", "ptrain-pytest"], out


def test_limits_capabilities_and_storage(loaded, tmp_path):
    src = os.path.join(TASKS, "hello-file")
    shutil.copytree(src, tmp_path / "small")
    toml = (tmp_path / "small" / "task.toml").read_text().replace("storage_mb = 1024",
                                                                  "storage_mb = 8")
    (tmp_path / "small" / "task.toml").write_text(toml)
    task = terminal.load_task(str(tmp_path / "small"))
    with terminal.Harness(backend="bwrap") as h, h.episode(task) as ep:
        r = ep.run("head -c 16000000 /dev/zero > /app/big; echo $?")
        assert "No space left on device" in r.output
        # The agent's root has docker's default capabilities, and nothing more.
        bounding = int(ep.run("grep CapBnd /proc/self/status | cut -f2").output, 16)
        assert bounding == sum(1 << c for c in (0, 1, 3, 4, 5, 6, 7, 8, 10, 18))
        nested = ep.run("python3 -c \"import ctypes; libc = ctypes.CDLL(None, use_errno=True); "
                        "print(libc.unshare(0x10000000), ctypes.get_errno())\"").output.split()
        assert nested[0] == "-1"  # no user namespace inside (bwrap --disable-userns)
        box = ep.container
        if box._cgroup is not None:  # memory and pids limits hold for the agent's processes
            ns = os.readlink(f"/proc/{box.pid}/ns/pid")
            inside = [p for p in box._cgroup.pids()
                      if os.readlink(f"/proc/{p}/ns/pid") == ns]
            assert len(inside) >= 3  # the sandbox's pid 1, its sleep, the agent's shell
            name = "memory.limit_in_bytes" if box._cgroup.version == "v1" else "memory.max"
            with open(box._cgroup._file("memory", "run", name)) as f:
                assert int(f.read()) == task.memory_mb << 20


def test_time_limits_cut_the_agent_and_a_hanging_verifier(harness, tmp_path):
    from tests.test_terminal_load import quick_task
    short = quick_task(tmp_path / "short", agent_s=2)

    def forever(ep):
        while True:
            ep.run("sleep 0.2")

    row, _ = terminal.run_attempt(harness, short, forever, 0)  # it returns
    assert row["agent_timed_out"] and row["error"] is None and row["agent_time_s"] >= 2.0
    hang = quick_task(tmp_path / "hang", verifier_s=2, test_sh="echo 1 > /logs/verifier/"
                      "reward.txt\nsetsid sleep 1000 & sleep 1000\n")
    with harness.episode(hang) as ep:
        v = ep.verify()
        assert v.timed_out and v.reward == 0.0 and "time limit (2 s)" in v.error
        ps = ep.container.exec(["ps", "-eo", "args"], timeout_s=10).text
        assert "sleep 1000" not in ps  # the verifier's processes, even a setsid one


def test_a_warm_box_outlives_the_thread_that_started_it(loaded, harness):
    """bwrap's --die-with-parent fires when the thread that started bwrap ends, not the
    process: boxes started and reset by a pool's threads (the terminal producer's, an
    evaluation's) still run after that pool has shut down, and the next episode uses one."""
    task = _task(loaded, "hello-file")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        boxes = list(pool.map(lambda _: harness.acquire(task), range(2)))
        list(pool.map(lambda box: harness.release(task, box), boxes))  # reset: a new bwrap
    deadline = time.monotonic() + 1.0  # (the kernel's SIGKILL came at once when it came)
    while time.monotonic() < deadline:
        assert [box.proc.poll() for box in boxes] == [None, None]
        time.sleep(0.05)
    with harness.episode(task) as ep:
        assert ep.container in boxes
        assert ep.run("echo alive").output.strip() == "alive"


def test_commands_run_with_descriptors_past_select_s_limit(loaded, harness):
    """A long-lived process (a test worker, a long run) holds many files: the shell's
    terminal and a command's output pipe get descriptors >= 1024, which select() refuses;
    the box waits on them with poll."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < 1200")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held = []
    try:
        while not held or held[-1] < 1030:
            held.append(os.open(os.devnull, os.O_RDONLY))
        with harness.episode(_task(loaded, "hello-file")) as ep:
            assert ep.shell._sock.fd >= 1024
            assert ep.run("echo far").output.strip() == "far"
            r = ep.container.exec(["sh", "-c", "echo out"], timeout_s=30)
            assert (r.text.strip(), r.exit_code) == ("out", 0)
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_sandbox_sees_none_of_the_host_s_environment(loaded, harness, monkeypatch):
    """Its processes (their /proc/N/environ readable by the agent) and the agent's commands
    get the task's environment, not the variables of the process that started the sandbox."""
    monkeypatch.setenv("PTRAIN_HOST_SECRET", "host-only-value")
    task = _task(loaded, "hello-file")
    box = bwrap.Box(harness.image(task), name="env-test")  # started after the setenv
    try:
        every = box.exec(["sh", "-c", "cat /proc/[0-9]*/environ | tr '\\0' '\\n'"],
                         timeout_s=10).text.split("\n")
        shell = box.exec(["env"], timeout_s=10).text.split("\n")
        assert "HOME=/root" in every and "HOME=/root" in shell
        for seen in (every, shell):
            assert not [v for v in seen if "PTRAIN_HOST_SECRET" in v or "LD_PRELOAD" in v]
    finally:
        box.close()
