"""sandbox.Session on every available backend, unpinned (the work dir lives on the host between
runs; each run borrows any warm worker) and pinned (one worker for the whole session).

The reference for what persists is the file system itself: a listing the sandbox takes at the
end of one run (lstat of every entry, file digests) must be what the next run finds, and a
pinned session (whose work dir never leaves its worker) is the reference for how writes go.
"""

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap

import pytest

import sandbox
from sandbox_backends import (  # noqa: F401 - the autouse fixture
    backend_params, objects_before_the_test_frozen, open_fds, own_cgroups, own_containers,
    own_temp_dirs, processes_with, wait_until)

BACKENDS = backend_params()
MODES = [pytest.param(False, id="unpinned"), pytest.param(True, id="pinned")]


def _host_view(backend):
    return own_temp_dirs(), own_cgroups(), own_containers(), open_fds()


@pytest.mark.parametrize("pinned", MODES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_session_keeps_files_but_not_processes(backend, pinned):
    sandbox.shutdown()  # no idle workers: what the session leaves is all that changes
    before = _host_view(backend)
    marker = f"{os.getpid()}{int(pinned)}7"
    with sandbox.Session(backend=backend, files={"seed.txt": "seed"}, pinned=pinned) as s:
        assert s.backend == backend and s.pinned == pinned
        r1 = s.run("import subprocess, os, tempfile\n"
                   "open('turn1', 'w').write(open('seed.txt').read())\n"
                   "open(os.path.join(tempfile.gettempdir(), 'scratch'), 'w').write('t')\n"
                   f"subprocess.Popen(['sleep', '1000.{marker}'])")
        assert r1.ok, r1.stderr
        assert processes_with(f"1000.{marker}") == []  # the background sleep died with it
        if pinned:
            assert s.sandbox.processes() == []
        r2 = s.run(command=["bash", "-c", "cat turn1; cat \"$TMPDIR/scratch\"; ls"],
                   files={"more.txt": "m"})
        # /tmp persists only in a pinned session (docs/sandbox.md).
        assert r2.stdout == (b"seedt" if pinned else b"seed") + b"more.txt\nseed.txt\nturn1\n"
        s.write_files({"sub/x.py": "X = 1"})
        r3 = s.run("from sub.x import X\nprint(X)")
        assert r3.stdout == b"1\n"
        assert s.read_files() == {"seed.txt": b"seed", "turn1": b"seed", "more.txt": b"m",
                                  "sub/x.py": b"X = 1"}
        with pytest.raises(ValueError, match="max_bytes"):
            s.read_files(max_bytes=3)
        worker = s.sandbox
    assert s.closed
    for call in (lambda: s.run("print(1)"), lambda: s.write_files({"a": "b"}), s.read_files):
        with pytest.raises(sandbox.SandboxError, match="closed"):
            call()
    with sandbox.Session(backend=backend, pinned=pinned) as again:  # emptied for the next
        if pinned:
            assert again.sandbox is worker
        r = again.run(command=["bash", "-c", "ls -A; ls -A \"$TMPDIR\""])
        assert r.ok and r.stdout == b"", r
    sandbox.shutdown()
    assert _host_view(backend) == before


# Lists the work dir from inside the sandbox: every entry's kind, mode, mtime and content
# digest or link target (the dirs and files it may not read are opened up and closed again,
# which changes no mtime). Names are bytes: one is not UTF-8.
LISTING = textwrap.dedent(r"""
    import hashlib, json, os, stat
    def listing():
        found = {".": oct(stat.S_IMODE(os.stat(".").st_mode))}
        todo = [b"."]
        while todo:
            top = todo.pop()
            mode = stat.S_IMODE(os.lstat(top).st_mode)
            if top != b".":
                os.chmod(top, mode | 0o700)
            for name in os.listdir(top):
                path = os.path.join(top, name)
                st = os.lstat(path)
                kind, m = stat.S_IFMT(st.st_mode), oct(stat.S_IMODE(st.st_mode))
                if stat.S_ISDIR(st.st_mode):
                    todo.append(path)
                    found[repr(path)] = ["dir", m, st.st_mtime_ns]
                elif stat.S_ISREG(st.st_mode):
                    os.chmod(path, st.st_mode | 0o400)
                    with open(path, "rb") as f:
                        digest = hashlib.sha256(f.read()).hexdigest()
                    os.chmod(path, st.st_mode)
                    found[repr(path)] = ["file", m, st.st_mtime_ns, digest]
                elif stat.S_ISLNK(st.st_mode):
                    found[repr(path)] = ["link", os.readlink(path).decode(), st.st_mtime_ns]
                else:
                    found[repr(path)] = [kind, m, st.st_mtime_ns]
            if top != b".":
                os.chmod(top, mode)
        return found
""")
MAKE_A_TREE = textwrap.dedent("""
    import os, socket
    os.makedirs('a/b/empty')
    open('a/b/f.txt', 'w').write('hello')
    os.utime('a/b/f.txt', ns=(1_000_000_000, 1_500_000_000_123_456_789))
    os.link('a/b/f.txt', 'hard')
    open('run.sh', 'w').write('#!/bin/sh\\necho ran\\n')
    os.chmod('run.sh', 0o750)
    os.symlink('a/b/f.txt', 'link'); os.symlink('/etc/hostname', 'absolute')
    os.symlink('nowhere', 'dangling')
    os.mkfifo('pipe')
    open(b'name\\xff', 'wb').write(b'\\x80 not utf-8')
    os.makedirs('locked/inner'); open('locked/inner/secret', 'w').write('s')
    os.chmod('locked/inner/secret', 0); os.chmod('locked/inner', 0); os.chmod('locked', 0o500)
    os.mkdir('rodir'); open('rodir/kept', 'w').write('k'); os.chmod('rodir', 0o555)
    socket.socket(socket.AF_UNIX).bind('sock')
""")


@pytest.mark.parametrize("pinned", MODES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_next_run_finds_the_work_dir_exactly_as_the_last_run_left_it(backend, pinned):
    """Files (contents, modes, mtimes), directories (also empty, read-only or locked),
    symlinks, fifos and non-UTF-8 names. Not kept in an unpinned session: sockets (dead
    without their process) and hard links (each name becomes a file of its own)."""
    with sandbox.Session(backend=backend, pinned=pinned) as s:
        first = s.run(MAKE_A_TREE + LISTING + "print(json.dumps(listing()))")
        second = s.run(LISTING + "print(json.dumps(listing()))\nprint(open('link').read())")
        files = s.read_files()
    assert first.ok and second.ok, (first.stderr, second.stderr)
    left = json.loads(first.stdout)
    found, rest = second.stdout.decode().split("\n", 1)
    if not pinned:
        assert left.pop("b'./sock'")[0] == 0o140000  # S_IFSOCK
    assert json.loads(found) == left
    assert rest == "hello\n"
    assert files == {"a/b/f.txt": b"hello", "hard": b"hello", "run.sh": b"#!/bin/sh\necho ran\n",
                     "name\udcff": b"\x80 not utf-8", "locked/inner/secret": b"s",
                     "rodir/kept": b"k"}


WRITES = {  # what a model's write_file may try, after SET_UP
    "through a symlink out of the work dir": {"escape/tmp/planted": "x"},
    "through a symlink inside it": {"inside/new.txt": "n"},
    "over a read-only file": {"ro": "y"},
    "into a read-only dir": {"rodir/x": "y"},
    "below a file": {"file/x": "y"},
    "over a directory": {"sub": "y"},
    "new files and dirs": {"plain.txt": "p", "d/e.txt": "e"},
    "over a writable file": {"file": "g"},
}
SET_UP = ("mkdir sub rodir && ln -s / escape && ln -s sub inside && echo x > ro && "
          "chmod 444 ro && chmod 555 rodir && echo f > file")


@pytest.mark.parametrize("backend", BACKENDS)
def test_write_files_goes_as_in_a_pinned_session(backend):
    """An unpinned session adds files on the host where nothing can trip them, else lays its
    work dir into a worker to write them there; either way the outcome is what writing into
    a pinned session's own work dir gives, and a write that fails changes nothing."""
    outcomes = {}
    for pinned in (True, False):
        for case, files in WRITES.items():
            with sandbox.Session(backend=backend, pinned=pinned) as s:
                assert s.run(SET_UP, language="bash").ok
                before = s.read_files()
                try:
                    s.write_files(files)
                    outcomes[pinned, case] = s.read_files()
                except ValueError as e:
                    outcomes[pinned, case] = "error"
                    if case.endswith("out of the work dir"):
                        assert "leaves the work dir" in str(e)
                    if not pinned:
                        assert s.read_files() == before
                assert s.run(command=["true"]).ok
    for case in WRITES:
        assert outcomes[False, case] == outcomes[True, case], case
    assert outcomes[False, "through a symlink out of the work dir"] == "error"
    assert outcomes[False, "through a symlink inside it"]["sub/new.txt"] == b"n"
    assert outcomes[False, "over a writable file"]["file"] == b"g"
    assert not os.path.exists("/tmp/planted")


@pytest.mark.parametrize("backend", BACKENDS)
def test_many_concurrent_sessions_share_a_bounded_set_of_workers(backend, monkeypatch):
    """64 episodes at once, 3 turns each, their own files: each sees only its own, and no
    more than MAX_SANDBOXES_PER_KEY workers ever live."""
    sandbox.shutdown()
    before = _host_view(backend)
    monkeypatch.setattr(sandbox.warm_sandboxes, "MAX_SANDBOXES_PER_KEY", 3)
    live = []

    def episode(i):
        with sandbox.Session(backend=backend, files={"mine.txt": str(i)}) as s:
            outs = []
            for turn in range(3):
                r = s.run(f"import os\nopen('turn{turn}', 'w').write(open('mine.txt').read())"
                          "\nprint(sorted(os.listdir('.')))")
                live.append(len(sandbox.live_sandboxes()))
                outs.append(r.stdout)
            return outs, s.read_files()

    with concurrent.futures.ThreadPoolExecutor(64) as threads:
        episodes = list(threads.map(episode, range(64)))
    for i, (outs, files) in enumerate(episodes):
        assert outs == [str(["mine.txt"] + [f"turn{t}" for t in range(n + 1)]).encode() + b"\n"
                        for n in range(3)]
        assert files == {"mine.txt": str(i).encode(),
                         **{f"turn{t}": str(i).encode() for t in range(3)}}
    assert len(live) == 64 * 3 and max(live) <= 3
    sandbox.shutdown()
    assert _host_view(backend) == before


DEEP_TREE = ("import os\nfor _ in range(30):\n    os.mkdir('d' * 200)\n    os.chdir('d' * 200)\n"
             "open('f', 'w').write('deep')\n")


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_work_dir_past_its_caps_stays_in_its_worker(backend):
    """Too many bytes, too many entries, or a tree too deep to read by path: the session
    keeps the worker that holds it (pinned from then on), and nothing is lost."""
    with sandbox.Session(backend=backend, max_state_bytes=10_000, max_state_files=50) as s:
        assert s.run("open('small', 'w').write('s')").ok and not s.pinned
        r = s.run("import os, tempfile\nopen('big', 'wb').write(b'x' * 20_000)\n"
                  "open(os.path.join(tempfile.gettempdir(), 't'), 'w').write('t')")
        assert r.ok and s.pinned and s.sandbox is not None
        r = s.run("import os, tempfile\nprint(sorted(os.listdir('.')), "
                  "os.listdir(tempfile.gettempdir()))")
        assert r.stdout == b"['big', 'small'] ['t']\n"
        assert s.read_files() == {"small": b"s", "big": b"x" * 20_000}
    with sandbox.Session(backend=backend, max_state_files=50) as s:
        assert s.run("for i in range(60):\n    open(f'f{i}', 'w').close()").ok and s.pinned
        assert len(s.read_files()) == 60
    with sandbox.Session(backend=backend) as s:
        assert s.run(DEEP_TREE).ok and s.pinned
        assert s.run("import os\nprint(len(os.listdir('.')))").stdout == b"1\n"
    with pytest.raises(ValueError, match="max_state_bytes"):
        sandbox.Session(backend=backend, max_state_bytes=0)


CRASHING_CALLER = textwrap.dedent("""
    import os, sys, signal, sandbox
    s = sandbox.Session(backend=sys.argv[1], pinned=sys.argv[2] == 'pinned')
    s.run("open('f', 'w').write('x')")
    print(os.getpid(), *[w.server_pid for w in sandbox.live_sandboxes()], flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


@pytest.mark.parametrize("pinned", MODES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_session_is_removed_when_the_caller_dies(backend, pinned):
    out = subprocess.run([sys.executable, "-c", CRASHING_CALLER, backend,
                          "pinned" if pinned else "unpinned"], capture_output=True,
                         cwd=os.path.dirname(os.path.dirname(sandbox.__file__)), timeout=120)
    assert out.returncode == -signal.SIGKILL, out.stderr
    caller_pid, *server_pids = map(int, out.stdout.split())
    assert len(server_pids) == 1
    assert wait_until(lambda: not any(os.path.exists(f"/proc/{p}") for p in server_pids))
    prefix = f"ptrain-sbx-{caller_pid}-"
    assert not [n for n in os.listdir(tempfile.gettempdir()) if n.startswith(prefix)]
    if backend == "docker":
        assert wait_until(lambda: not own_containers(caller_pid), timeout_s=60)
    sandbox.Sandbox(backend).close()  # a new worker sweeps cgroups a dead caller left
    assert not own_cgroups(caller_pid)
