"""Attempts that failed for an environment reason (a missing package, image or host tool), not
the agent's: found in evaluation rows, each cause with its fix, so that `launch.eval` says so
on the console and exits non-zero instead of scoring 0, and the closed loop refuses to start
(`ptrain.preflight`).

  environment(rows)   [{"cause", "fix", "attempts", "example"}] of the environment failures
                      of terminal evaluation rows (`sandbox.terminal.evaluate`; none: [])
  report(failures, n) the console text
  fix(error)          the fix KNOWN gives for an error's text
"""

from __future__ import annotations

import re

# (what the error says, the fix); the first that matches names the fix.
KNOWN = (
    (r"No module named '?docker'?",
     "the docker backend needs the docker SDK, part of ptrain's install: pip install -e . "
     "(or run tasks that need only files with --backend=bwrap / the terminal environment's "
     "arg backend='bwrap')"),
    (r"is not present locally|ImageError|ImageNotFound",
     "the task's image is not on this machine: map it to a local one with "
     "--image_map=FROM=LOCAL (the terminal environment's arg image_map in a config), or "
     "load it (docker load)"),
    (r"No module named '?pytest'?|pytest: (command )?not found",
     "the task's tests run pytest, which neither its image nor the verifier has: reinstall "
     "ptrain (pip install -e .: pytest is part of its install; the verifier lends a read-only "
     "copy of it to images without one)"),
    (r"Cannot connect to the Docker daemon|Error while fetching server API version|"
     r"docker\.errors\.DockerException",
     "the Docker engine is not running or not reachable: start it (sandbox/setup_host.sh "
     "installs it), or use --backend=bwrap for tasks that need only files"),
    (r"bwrap: |bubblewrap|No such file or directory: 'bwrap'",
     "bubblewrap cannot run here: install it (sandbox/setup_host.sh) or use the docker "
     "backend"),
)


def _cause(row) -> str | None:
    """The row's environment error, or None: an error the episode raised before it could be
    verified (no verifier time: no environment), or one of KNOWN's in the error or the
    verifier's feedback."""
    error = row.get("error") or ""
    if not error:
        return None
    text = error + "\n" + (row.get("feedback") or "")
    if "verify_time_s" not in row or any(re.search(p, text) for p, _ in KNOWN):
        return error
    return None


def fix(text: str) -> str:
    for pattern, fix in KNOWN:
        if re.search(pattern, text):
            return fix
    return "see the attempt's transcript (OUT/transcripts/) for the whole error"


def environment(rows) -> list[dict]:
    """Grouped by cause (its first line, without the task's own paths)."""
    groups: dict[str, dict] = {}
    for row in rows:
        error = _cause(row)
        if error is None:
            continue
        text = error + "\n" + (row.get("feedback") or "")
        key = fix(text) + "|" + re.sub(r"\S*/\S*", "PATH", error.splitlines()[0])[:200]
        group = groups.setdefault(key, {"cause": error.splitlines()[0], "fix": fix(text),
                                        "attempts": 0, "example": row.get("task")})
        group["attempts"] += 1
    return list(groups.values())


def report(failures, total: int) -> str:
    n = sum(f["attempts"] for f in failures)
    lines = [f"{n} of {total} attempts failed for an environment reason, not the agent's "
             "(they score 0 in results.jsonl: after the fix, evaluate again into a new --out):"]
    for f in failures:
        lines += [f"  {f['attempts']} x (e.g. {f['example']}): {f['cause']}",
                  f"    fix: {f['fix']}"]
    return "\n".join(lines)
