"""sandbox.terminal on the real docker engine: the persistent shell, clean state between
episodes on a reused container (checked against a fresh `docker run` of the same image), the
tests kept from the agent, time limits, image builds, and the attacks on the verdict."""

import hashlib
import json
import os

import pytest

from sandbox import terminal
from sandbox.terminal import container as container_mod
from tests.test_terminal_load import (TASKS_DIR, harbor_task, host_processes, quick_task,
                                      tb1_task, write)

pytestmark = pytest.mark.xdist_group("terminal")  # one warm harness, on one worker


def _docker_reason():
    try:
        client = container_mod.docker_client()
        client.ping()
    except Exception as e:  # noqa: BLE001
        return f"docker is not reachable: {e}"
    try:
        client.images.get(terminal.BASE_IMAGE)
    except Exception:  # noqa: BLE001
        return f"{terminal.BASE_IMAGE} is not built (bash sandbox/setup_host.sh)"
    return None


_REASON = _docker_reason()
if _REASON is not None:
    pytest.skip(_REASON, allow_module_level=True)


def own_containers():
    return container_mod.docker_client().containers.list(
        all=True, filters={"label": f"ptrain-term={os.getpid()}"})


@pytest.fixture(scope="module")
def harness():
    h = terminal.Harness()
    yield h
    h.close()
    assert own_containers() == [], "containers left behind"


@pytest.fixture(scope="module")
def hello():
    return terminal.load_task(os.path.join(TASKS_DIR, "hello-file"))


# --- the persistent shell -----------------------------------------------------------------------

def test_shell_keeps_cwd_variables_functions_and_background_servers(harness, hello):
    with harness.episode(hello) as ep:
        assert ep.run("pwd").output == "/app\n"  # the image's WORKDIR
        assert ep.run("cd /tmp").exit_code == 0
        assert ep.run("pwd").output == "/tmp\n"
        ep.run("export X=1; Y=2")
        assert ep.run("echo $X $Y").output == "1 2\n"
        ep.run("greet() { echo \"hi $1\"; }")
        assert ep.run("greet you").output == "hi you\n"
        r = ep.run("python3 -m http.server 8765 --bind 127.0.0.1 >/tmp/http.log 2>&1 &")
        assert r.exit_code == 0
        fetch = ("python3 -c \"import time, urllib.request\n"
                 "for _ in range(50):\n"
                 "    try:\n"
                 "        print(urllib.request.urlopen('http://127.0.0.1:8765/').status); break\n"
                 "    except OSError: time.sleep(0.1)\"")
        assert ep.run(fetch).output.strip() == "200"
        assert ep.run("false").exit_code == 1
        for d in ("/app", "/tmp"):  # what the agent writes, it can execute (no noexec mount)
            r = ep.run(f"printf '#!/bin/sh\\necho ran\\n' > {d}/x.sh && chmod +x {d}/x.sh "
                       f"&& {d}/x.sh && echo data | gzip | gunzip && tar --version | head -1")
            assert r.output.startswith("ran\ndata\ntar (GNU tar)"), r.output
        assert ep.run("cat <<'EOF'\nline one\n  line two\nEOF").output == "line one\n  line two\n"
        # stdin is /dev/null: a command that reads it ends instead of waiting forever
        assert ep.run("cat; read x; echo done").output == "done\n"
        # a control character inside a command reaches the command, it does not signal
        assert ep.run("printf 'a\x03b' | od -An -c").output.split() == ["a", "003", "b"]


def test_an_image_without_bash_gets_a_posix_sh_session(harness, tmp_path):
    task = terminal.load_task(harbor_task(tmp_path / "no-bash", **{
        "environment/Dockerfile": "FROM ptrain-term-base:latest\nRUN rm /usr/bin/bash\n"}))
    with harness.episode(task) as ep:
        assert not ep.shell.bash
        ep.run("cd /tmp; export X='a b'; f() { echo \"f:$1\"; }")
        assert ep.run('pwd; echo "$X"; f 1').output == "/tmp\na b\nf:1\n"
        tricky = "printf '%s|' \"100%\" 'it''s' \"\\\\n\" \"$((6*7))\" 'é'\n\n"
        assert ep.run(tricky).output == "100%|its|\\n|42|é|"
        assert ep.run("exit 4").exit_code is None
        r = ep.run("echo back")
        assert r.restarted and r.output.endswith("back\n")


def test_shell_cuts_a_command_at_its_timeout_and_keeps_its_state(harness, hello):
    with harness.episode(hello) as ep:
        ep.run("cd /tmp; export KEEP=yes")
        for stuck in ("sleep 100", "while :; do :; done", "trap '' INT; sleep 100"):
            r = ep.run(stuck, timeout_s=1)
            assert r.timed_out and r.exit_code is None and not r.restarted, stuck
            assert "cut at the time limit" in r.output
            after = ep.run("echo $KEEP; pwd")
            assert after.output == "yes\n/tmp\n", stuck
        assert "sleep 100" not in ep.run("ps -eo args").output


def test_shell_output_is_capped_head_and_tail(harness, hello):
    with harness.episode(hello) as ep:
        r = ep.run("head -c 300000 /dev/zero | tr '\\0' a; echo END")
        assert r.truncated and r.exit_code == 0
        assert len(r.output) < harness.max_output_bytes + 200
        assert r.output.startswith("aaaa") and r.output.endswith("aEND\n")
        assert "bytes left out" in r.output


def test_an_exited_shell_is_replaced_and_says_so(harness, hello):
    with harness.episode(hello) as ep:
        ep.run("cd /tmp")
        r = ep.run("exit 3")
        assert r.exit_code is None and "the shell exited" in r.output
        r = ep.run("pwd")
        assert r.restarted and r.output.endswith("/app\n")


# --- clean state between episodes -----------------------------------------------------------------

MANIFEST = (
    "cd / && find / -xdev \\( -path /proc -o -path /sys -o -path /dev \\) -prune -o "
    "-printf '%y %m %U %G %p -> %l\\n' | LC_ALL=C sort && "
    "find / -xdev \\( -path /proc -o -path /sys -o -path /dev \\) -prune -o -type f -print0 "
    "| LC_ALL=C sort -z | xargs -0 md5sum && "
    "find /dev -xdev -printf '%y %m %U %G %p -> %l\n' | LC_ALL=C sort && "
    "ls -A /dev/shm /dev/mqueue && stat -c '%n %f %t %T %u %g' /dev/* && "
    "cat /etc/hosts /etc/hostname /etc/resolv.conf /proc/sysvipc/shm /proc/sysvipc/msg && "
    # Every process but this shell and its children (ps, awk, sort: a child caught between
    # fork and exec would show as a second copy of this shell).
    "ps -eo pid=,ppid=,user=,args= | awk -v me=$$ '$1 != me && $2 != me {$1 = $2 = x; print}'"
    " | LC_ALL=C sort")

DIRTY = [
    "echo dirty > /tmp/dirty.txt; mkdir -p /opt/new/sub; echo y > /opt/new/sub/f",
    "echo 'export LEAK=1' >> /root/.bashrc; echo hacked >> /etc/bash.bashrc",
    "rm /usr/bin/bc; rm -rf /usr/share/misc; mv /etc/skel /etc/skel2",
    "chmod 700 /var/tmp; chown nobody /usr/local/bin; chmod 4755 /usr/bin/yes",
    "rm -rf /usr/local/share && ln -s / /usr/local/share; ln -s / /app/escape",
    "rm /etc/bash.bashrc && ln -s /etc/shadow /etc/bash.bashrc",
    "mkfifo /tmp/fifo; echo leaked > /dev/shm/leak; touch /dev/leakdev; rm /dev/full",
    "echo '10.9.9.9 evil' >> /etc/hosts",
    "export LEAK_VAR=1; sleep 1000 & nohup sleep 1001 >/dev/null 2>&1 &",
    "python3 -c 'import os, time; os.setsid(); time.sleep(1002)' &",
    "python3 -c 'import os, time; os.fork() or time.sleep(1003)' &",
    "python3 -c 'import ctypes; c = ctypes.CDLL(None); "
    "assert c.shmget(77, 4096, 0o1666) >= 0 and c.msgget(78, 0o1666) >= 0'",
]


def container_manifest(c) -> str:
    r = c.exec(["bash", "-c", MANIFEST], timeout_s=120, user="root",
               max_output_bytes=64 << 20)
    assert r.exit_code == 0, r.text[-2000:]
    return r.text


def host_digest(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@pytest.mark.parametrize("reset", ["auto", "recreate"])
def test_state_is_clean_between_episodes_on_a_reused_container(harness, hello, reset):
    h = harness if reset == "auto" else terminal.Harness(reset="recreate")
    try:
        image = h.image(hello)
        fresh = terminal.Container(image, h.limits(hello), name="fresh",
                                   pytest_dir=h.pytest_dir, reset="recreate")
        try:
            want = container_manifest(fresh)
        finally:
            fresh.close()
        shadow = host_digest("/etc/shadow") if os.path.exists("/etc/shadow") else None
        with h.episode(hello) as ep:
            first = ep.container
            for command in DIRTY:
                ep.run(command)
            assert ep.run("ls /opt/new/sub /tmp/dirty.txt").exit_code == 0
            assert "77" in ep.run("cat /proc/sysvipc/shm").output
            ep.verify()  # the tests and the logs are in the container now
        again = h.acquire(hello)
        assert again is first  # the warm one, reset: killed at the episode's end, recreated
        assert first.resets["recreate"] >= 1
        assert container_manifest(again) == want  # as a fresh `docker run` of the image
        h.release(hello, again)
        with h.episode(hello) as ep:
            assert ep.container is first
            assert ep.run("echo ${LEAK_VAR:-unset} ${LEAK:-unset}").output == "unset unset\n"
            assert ep.run("ls /tmp/dirty.txt /opt/new /tests /logs 2>&1 | wc -l").output \
                .strip() == "4"  # four "No such file" lines
            assert "sleep 100" not in ep.run("ps -eo args").output
        if shadow is not None:
            assert host_digest("/etc/shadow") == shadow  # the symlinks were never followed
    finally:
        if h is not harness:
            h.close()


def test_reset_keeps_the_mount_points_docker_made_where_the_image_has_none(harness,
                                                                            tmp_path):
    # The image has no /opt: docker makes /opt/ptrain-pytest's mount point in the writable
    # layer, and an episode that writes next to it must not make the reset remove it.
    task = terminal.load_task(harbor_task(tmp_path / "no-opt", **{
        "environment/Dockerfile": "FROM ptrain-term-base:latest\nRUN rm -rf /opt\n"}))
    c = harness.acquire(task)
    try:
        assert c.exec(["sh", "-c", "touch /opt/mine"], timeout_s=30).exit_code == 0
        assert c.reset() == ("inplace" if c.reset_mode == "inplace" else "recreate")
        r = c.exec(["sh", "-c", "ls -A /opt"], timeout_s=30)
        assert r.text.split() == ["ptrain-pytest"]
    finally:
        harness.release(task, c)


def test_containers_of_a_dead_process_are_removed(hello, tmp_path):
    import subprocess
    import sys
    with terminal.Harness(supply_pytest=False) as h:
        image = h.image(hello)
    code = (f"import sys; sys.path.insert(0, {os.getcwd()!r}); from sandbox import terminal; "
            f"c = terminal.Container({image!r}, name='orphan'); print(c.id, flush=True); "
            f"import os; os._exit(0)")  # no clean-up: the container outlives its process
    cid = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()[-1]
    client = container_mod.docker_client()
    assert client.containers.get(cid).status == "running"
    assert container_mod.remove_orphans(client) >= 1
    assert cid not in {c.id for c in client.containers.list(all=True)}


def test_warm_starts_containers_that_episodes_then_use(hello):
    with terminal.Harness() as h:
        h.warm(hello, 2)
        idle = list(h._idle[h._key(hello)])
        assert len(idle) == 2
        with h.episode(hello) as a, h.episode(hello) as b:
            assert {a.container, b.container} == set(idle)


# --- what the agent can see, and the attacks on the verdict ---------------------------------------

def test_the_agent_never_sees_the_tests_or_the_solution(harness):
    loaded = terminal.load_tasks(TASKS_DIR)
    for task in (t for t in loaded.tasks if t.name in ("hello-file", "fix-word-count")):
        with harness.episode(task) as ep:
            names = [os.path.basename(p) for _, p in task.tests + task.solution]
            find = ("find / -xdev \\( " + " -o ".join(f"-name '{n}'" for n in names)
                    + " \\) 2>/dev/null; ls -d /tests /solution 2>&1")
            r = ep.run(find)
            assert r.output.count("No such file") == 2, r.output
            assert all(n not in r.output.replace("/tests", "").replace("/solution", "")
                       for n in names), r.output
            terminal.oracle(ep)
            assert ep.verify().reward == 1.0  # and they are there when the verifier runs


def test_planted_reward_and_conftest_do_not_count(harness, hello):
    with harness.episode(hello) as ep:
        ep.run("mkdir -p /logs/verifier /tests && echo 1 > /logs/verifier/reward.txt && "
               "printf 'import pytest\\n@pytest.hookimpl(tryfirst=True)\\n"
               "def pytest_runtest_call(item):\\n    pass\\n' > /tests/conftest.py && "
               "echo '{\"reward\": 1}' > /logs/verifier/reward.json")
        v = ep.verify()
        assert v.reward == 0.0 and not v.passed
        assert any("hello.txt does not exist" in f for f in v.failures)


def test_symlinks_planted_where_the_verifier_writes_are_not_followed(harness, hello):
    with harness.episode(hello) as ep:
        ep.run("ln -s /etc /tests; mkdir -p /root/x; ln -s /root/x /logs")
        v = ep.verify()  # the tests ran (in the verifier's box: /tests and /logs its own)
        assert v.reward == 0.0 and "hello.txt does not exist" in v.feedback


def test_host_side_file_io_follows_no_symlink(harness, hello, tmp_path):
    host_dir = tmp_path / "host-side"
    host_dir.mkdir()
    c = harness.acquire(hello)
    try:
        r = c.exec(["sh", "-c", f"mkdir -p /srv/x && ln -s /etc/shadow /srv/x/reward.txt && "
                                f"echo hi > /srv/x/real.txt && ln -s {host_dir} /srv/y"],
                   timeout_s=30, user="root")
        assert r.exit_code == 0, r.text
        assert c.read_files("/srv/x") == {"x/real.txt": b"hi\n"}
        try:
            c.put_files([(b"data", "/srv/y/f")])
        except Exception:  # noqa: BLE001 (refused, or written inside the container: both fine)
            pass
        assert list(host_dir.iterdir()) == []
    finally:
        harness.release(hello, c)


def test_tb1_build_context_leaves_out_tests_and_solution(harness, tmp_path):
    path = tb1_task(tmp_path / "copy-all", **{
        "Dockerfile": "FROM ptrain-term-base:latest\nWORKDIR /app\nCOPY . /app\n",
        "data.txt": "payload\n"})
    task = terminal.load_task(path)
    with harness.episode(task) as ep:
        assert sorted(ep.run("ls -A /app").output.split()) == ["Dockerfile", "data.txt"]


def test_the_real_pytest_is_supplied_where_the_image_has_none(harness, hello):
    import pytest as host_pytest
    with harness.episode(hello) as ep:
        assert ep.run("python3 -c 'import pytest'").exit_code == 1  # not in the image
        terminal.oracle(ep)
        v = ep.verify()
    assert v.reward == 1.0
    c = container_mod  # the verifier ran the host's own distribution, mounted read-only
    assert os.path.isfile(os.path.join(harness.pytest_dir, "site", "pytest", "__init__.py"))
    assert c.PYTEST_MOUNT == "/opt/ptrain-pytest"
    with harness.episode(hello) as ep:
        r = ep.run(f"PYTHONPATH={c.PYTEST_MOUNT}/site python3 -m pytest --version 2>&1; "
                   f"touch {c.PYTEST_MOUNT}/x 2>&1")
        assert f"pytest {host_pytest.__version__}" in r.output
        assert "Read-only file system" in r.output


def test_limits_come_from_task_toml_and_the_network_is_off(harness, hello):
    tb1 = terminal.load_task(os.path.join(TASKS_DIR, "csv-column-sum"))
    assert tb1.allow_internet  # TB 1.0 tasks ask for a network; the operator did not allow it
    for task in (hello, tb1):
        with harness.episode(task) as ep:
            host = ep.container.container.attrs["HostConfig"]
            assert host["Memory"] == task.memory_mb << 20
            assert host["NanoCpus"] == int(task.cpus * 1e9)
            assert host["NetworkMode"] == "none"
            devices = [line.split(":")[0].strip() for line in
                       ep.run("tail -n +3 /proc/net/dev").output.splitlines()]
            assert devices == ["lo"]


@pytest.mark.parametrize("reset", ["auto", "recreate"])
def test_storage_mb_bounds_what_the_agent_writes(harness, tmp_path, reset):
    """task.toml's storage_mb: docker's size quota where the storage driver has one, else a
    tmpfs work dir of that size holding the image's files (put back from the host on an
    in-place reset, from inside the container otherwise); writing past it fails, and the
    next episode finds the image's files again, links and modes as they were."""
    from tests.test_terminal_load import HARBOR_TOML
    task = terminal.load_task(harbor_task(
        tmp_path / "disk", **{"task.toml": HARBOR_TOML + "storage_mb = 8\n",
                              "environment/Dockerfile": "FROM ptrain-term-base:latest\n"
                              "WORKDIR /app\nRUN mkdir d && echo kept > d/seed.txt && "
                              "ln -s d/seed.txt link && chmod 750 d\n"}))
    assert task.storage_mb == 8
    h = harness if reset == "auto" else terminal.Harness(reset="recreate")
    listing = "stat -c '%a %U' . && ls -lAR --time-style=+%s . | tail -n +2"
    try:
        with h.episode(task) as ep:
            if ep.container.storage is None:
                pytest.skip("docker's storage driver has no quota here and the image no "
                            "WORKDIR")
            image = ep.run(listing).output
            assert ep.run("cat link").output == "kept\n"
            assert ep.run("head -c 4M /dev/zero > small && echo ok").output == "ok\n"
            r = ep.run("head -c 16M /dev/zero > big")
            assert r.exit_code != 0 and "No space left on device" in r.output, r.output
            script = "printf '#!/bin/sh\\necho ran\\n' > x.sh && chmod +x x.sh && ./x.sh"
            assert ep.run(f"rm big && {script}").output == "ran\n"  # not noexec
            ep.run("rm -r d; chmod 700 .; ln -sf /etc/passwd link")
        with h.episode(task) as ep:  # the same container, reset: the image's files only
            assert ep.run(listing).output == image
            assert ep.run("cat link").output == "kept\n"
    finally:
        if h is not harness:
            h.close()


# --- time limits ---------------------------------------------------------------------------------

def test_an_agent_that_never_stops_is_cut_at_the_agent_timeout(harness, tmp_path):
    task = quick_task(tmp_path / "short", agent_s=3)

    def forever(ep):
        while True:
            ep.run("sleep 0.2")

    def one_long_command(ep):
        ep.run("sleep 1000", timeout_s=10_000)

    for agent in (forever, one_long_command):
        row, transcript = terminal.run_attempt(harness, task, agent, 0)  # it returns
        assert row["agent_timed_out"] and row["error"] is None, row
        assert row["agent_time_s"] >= 3.0
        steps = transcript["steps"]
        if agent is forever:
            assert len(steps) > 1 and not any(s["timed_out"] for s in steps[:-1])
        else:
            assert len(steps) == 1 and steps[0]["timed_out"]
        assert row["reward"] == 0.0 and row["verifier_timed_out"] is False


def test_a_hanging_verifier_is_cut_and_scores_zero_with_the_reason(harness, tmp_path):
    task = quick_task(tmp_path / "hang", verifier_s=2,
                      test_sh="echo 1 > /logs/verifier/reward.txt\nsleep 1000\n")
    with harness.episode(task) as ep:
        v = ep.verify()
        assert v.timed_out and v.reward == 0.0 and not v.passed
        assert "time limit (2 s)" in v.error and "time limit" in v.feedback
    assert not host_processes("sleep 1000")  # died with the verifier's container


# --- images --------------------------------------------------------------------------------------

def test_a_missing_base_image_is_an_error_saying_how_to_provide_it(tmp_path):
    path = harbor_task(tmp_path / "needs-base", **{
        "environment/Dockerfile": "FROM ptrain-term-missing:1\nWORKDIR /app\n",
        "solution/solve.sh": "echo ok > /app/ok\n",
        "tests/test.sh": "test -f /app/ok && echo 1 > /logs/verifier/reward.txt\n"})
    task = terminal.load_task(path)
    with terminal.Harness() as h:
        with pytest.raises(terminal.ImageError) as e:
            h.image(task)
    message = str(e.value)
    assert "ptrain-term-missing:1" in message and "Dockerfile:1" in message
    assert "docker load" in message and "docker import" in message and "image_map" in message
    with terminal.Harness(image_map={"ptrain-term-missing:1": terminal.BASE_IMAGE}) as h:
        row, _ = terminal.run_attempt(h, task, terminal.oracle, 0)
        assert row["reward"] == 1.0, row


def test_a_prebuilt_image_named_in_task_toml_is_used_or_named_when_missing(harness, tmp_path):
    toml = ("[verifier]\ntimeout_sec = 30\n\n[agent]\ntimeout_sec = 30\n\n[environment]\n"
            f"docker_image = \"{terminal.BASE_IMAGE}\"\n")
    files = {"task.toml": toml, "environment/Dockerfile": None,
             "solution/solve.sh": "echo ok > /srv/ok\n",
             "tests/test.sh": "test -f /srv/ok && echo 1 > /logs/verifier/reward.txt\n"}
    task = terminal.load_task(harbor_task(tmp_path / "prebuilt", **files))
    assert harness.image(task) == terminal.BASE_IMAGE
    assert terminal.run_attempt(harness, task, terminal.oracle, 0)[0]["reward"] == 1.0
    files["task.toml"] = toml.replace(terminal.BASE_IMAGE, "ghcr.io/nowhere/none:1")
    task = terminal.load_task(harbor_task(tmp_path / "absent", **files))
    with pytest.raises(terminal.ImageError, match="docker_image 'ghcr.io/nowhere/none:1'.*"
                                                   "docker load"):
        harness.image(task)


def test_agent_and_verifier_run_as_the_users_task_toml_names(harness, tmp_path):
    toml = ('[verifier]\ntimeout_sec = 30\nuser = "nobody"\n\n'
            '[agent]\ntimeout_sec = 30\nuser = "nobody"\n')
    test_sh = '[ "$(id -u)" = 65534 ] && echo 1 > /logs/verifier/reward.txt\n'
    task = terminal.load_task(harbor_task(tmp_path / "users", **{
        "task.toml": toml, "tests/test.sh": test_sh}))
    with harness.episode(task) as ep:
        assert ep.run("id -u").output == "65534\n"
        assert ep.verify().reward == 1.0


def test_the_healthcheck_runs_before_the_agent(harness, tmp_path):
    base = ("[verifier]\ntimeout_sec = 30\n\n[agent]\ntimeout_sec = 30\n\n"
            "[environment.healthcheck]\ninterval_sec = 0.1\nretries = 1\n")
    ok = terminal.load_task(harbor_task(tmp_path / "healthy", **{
        "task.toml": base + 'command = "test -d /tmp"\n'}))
    with harness.episode(ok) as ep:
        assert ep.run("echo up").output == "up\n"
    bad = terminal.load_task(harbor_task(tmp_path / "unhealthy", **{
        "task.toml": base + 'command = "echo not yet; false"\n'}))
    row, _ = terminal.run_attempt(harness, bad, terminal.oracle, 0)
    assert row["reward"] == 0.0
    assert "HealthcheckFailed" in row["error"] and "2 times" in row["error"]
    assert "not yet" in row["error"]


def test_images_are_cached_by_content(tmp_path):
    path = harbor_task(tmp_path / "cached", **{
        "environment/Dockerfile": "FROM ptrain-term-base:latest\nCOPY data.txt /data.txt\n",
        "environment/data.txt": f"{tmp_path}\n"})
    task = terminal.load_task(path)
    client = container_mod.docker_client()
    first = terminal.ensure_image(task, client)
    first_id = client.images.get(first).id
    assert terminal.ensure_image(task, client) == first
    assert client.images.get(first).id == first_id  # not rebuilt
    write(os.path.join(path, "environment"), {"data.txt": "changed\n"})
    second = terminal.ensure_image(task, client)
    assert second != first
    client.images.remove(second)
    client.images.remove(first)


# --- evaluation ---------------------------------------------------------------------------------

def test_evaluate_writes_results_and_resumes(harness, tmp_path):
    loaded = terminal.load_tasks(TASKS_DIR)
    tasks = [t for t in loaded.tasks if t.name in ("hello-file", "csv-column-sum")]
    out = str(tmp_path / "eval")
    seen = []
    s = terminal.evaluate(tasks, terminal.oracle, out, attempts=2, concurrency=2,
                          harness=harness, progress=lambda d, n, row: seen.append((d, n)))
    assert s["pass@1"] == 1.0 and s["pass@2"] == 1.0 and s["tasks_evaluated"] == 2
    assert sorted(seen) == [(1, 4), (2, 4), (3, 4), (4, 4)]
    with open(os.path.join(out, "results.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert sorted((r["task"], r["attempt"]) for r in rows) == [
        ("csv-column-sum", 0), ("csv-column-sum", 1), ("hello-file", 0), ("hello-file", 1)]
    for r in rows:
        assert {"task", "attempt", "reward", "time_s", "turns", "tool_calls", "feedback"} <= set(r)
        assert r["tool_calls"] == 1 and r["turns"] == 1
        assert os.path.isfile(os.path.join(out, "transcripts", r["task"], f"{r['attempt']}.json"))
    again = terminal.evaluate(tasks, terminal.oracle, out, attempts=2, harness=harness)
    assert again["pass@1"] == 1.0
    with open(os.path.join(out, "results.jsonl")) as f:
        assert len(f.readlines()) == 4  # nothing ran twice
    nop = terminal.evaluate(tasks, terminal.nop, str(tmp_path / "nop"), harness=harness)
    assert nop["pass@1"] == 0.0 and nop["mean_reward"] == 0.0

