"""The judge's stdin/stdout cases, in T (see judge/harness.py): the solution runs as
`__main__` in a fresh process C per input, and T keeps what it wrote (capped) and how it
ended; the expected outputs never enter the sandbox (they are compared on the host)."""

import binascii
import os
import select
import time

rpc = _load_module("rpc")  # noqa: F821 (given by the harness's loader)
zygote = _load_module("zygote")  # noqa: F821


def run(judge, payload):
    """Each input of `payload` through a fresh solution process (within the run's deadline);
    what it wrote and how it ended, per case."""
    cases = []
    for inp, cap in zip(payload["inputs"], payload["output_caps"]):
        left = judge.deadline - time.monotonic()
        if left <= 0.05:
            cases.append({"stdout": "", "stderr": "", "exit_code": None, "signal": None,
                          "timed_out": True, "not_run": True, "duration_s": 0.0,
                          "stdout_truncated": False})
            continue
        cases.append(run_case(judge, inp, int(cap), min(float(payload["case_timeout_s"]),
                                                         left)))
    return {"cases": cases}


def run_case(judge, inp, cap, timeout):
    """Runs the solution on one input; returns what it wrote and how it ended."""
    stdin_fd = zygote.memfd(inp.encode("utf-8", "surrogateescape"))
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    start = time.monotonic()
    try:
        pid = judge.spawn([stdin_fd, out_w, err_w])
    finally:
        for fd in (stdin_fd, out_w, err_w):
            os.close(fd)
    bufs = {out_r: bytearray(), err_r: bytearray()}
    caps = {out_r: cap, err_r: 4 * rpc.MAX_TEXT}
    dropped = {out_r: 0, err_r: 0}

    def read(fd):
        chunk = os.read(fd, 65536)
        room = max(caps[fd] - len(bufs[fd]), 0)
        bufs[fd] += chunk[:room]
        dropped[fd] += max(len(chunk) - room, 0)
        return chunk

    open_fds, status, timed_out = [out_r, err_r], None, False
    deadline = start + timeout
    while status is None:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        ready, _, _ = select.select(open_fds + [judge.ctl], [], [], left)
        for fd in ready:
            if fd is not judge.ctl and not read(fd):
                open_fds.remove(fd)
        if dropped[out_r]:
            break  # over its output cap: the answer is wrong anyway, stop it now
        if judge.ctl in ready:
            status = judge.ctl_recv()
    if status is None:
        status = judge.reap(pid)
    duration = time.monotonic() - start
    for fd in open_fds:  # what is already written; grandchildren may hold the pipes open
        while select.select([fd], [], [], 0)[0] and read(fd):
            pass
    os.close(out_r)
    os.close(err_r)
    signaled = os.WIFSIGNALED(status)
    return {
        "stdout": binascii.b2a_base64(bytes(bufs[out_r]), newline=False).decode(),
        "stdout_truncated": dropped[out_r] > 0,
        "stderr": bytes(bufs[err_r]).decode("utf-8", "replace"),
        "exit_code": None if signaled else os.WEXITSTATUS(status),
        "signal": os.WTERMSIG(status) if signaled else None,
        "timed_out": timed_out,
        "not_run": False,
        "duration_s": round(duration, 6),
    }
