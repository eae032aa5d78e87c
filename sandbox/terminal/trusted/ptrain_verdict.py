"""ptrain's verdict plugin (loaded first by run_pytest.py, before any test code): each test's
outcome as pytest's own report objects give it, written at the session's end into a file of
its own below /logs/ptrain-verdict. The process is made non-dumpable first, so the programs
the tests start (root without CAP_SYS_PTRACE) can neither ptrace it nor read its memory."""
import ctypes
import json
import os

VERDICT_DIR = os.environ.get("PTRAIN_VERDICT_DIR", "/logs/ptrain-verdict")
_tests, _failures = {}, []
ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 0


def _last_line(report) -> str:
    """The failure's message, as pytest's short summary gives it."""
    crash = getattr(getattr(report, "longrepr", None), "reprcrash", None)
    lines = (str(getattr(crash, "message", "") or "") or
             str(getattr(report, "longreprtext", "") or "")).strip().splitlines()
    return f" - {lines[0][:300] if crash else lines[-1][:300]}" if lines else ""


def pytest_runtest_logreport(report):
    if report.when != "call" and report.outcome == "passed":
        return
    if report.failed:
        status = "FAILED" if report.when == "call" else "ERROR"
    elif report.skipped and hasattr(report, "wasxfail"):
        status = "XFAIL"
    else:
        status = report.outcome.upper()
    if _tests.get(report.nodeid) in ("FAILED", "ERROR"):
        return
    _tests[report.nodeid] = status
    if report.failed:
        _failures.append(report.nodeid + _last_line(report))


def pytest_collectreport(report):
    if report.failed:
        nodeid = report.nodeid or "<collection>"
        _tests[nodeid] = "ERROR"
        _failures.append(nodeid + _last_line(report))


def pytest_sessionfinish(session, exitstatus):
    os.makedirs(VERDICT_DIR, exist_ok=True)
    fd = os.open(f"{VERDICT_DIR}/{os.getpid()}.json",
                 os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w") as f:
        json.dump({"tests": _tests, "failures": _failures, "exitstatus": int(exitstatus)}, f)
