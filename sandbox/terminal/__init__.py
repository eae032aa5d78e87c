"""sandbox.terminal: Harbor / Terminal-Bench tasks in docker, for RL and evaluation.

Plain host Python (docker SDK, PyYAML for TB 1.0); nothing from ptrain, no JAX.

    from sandbox import terminal
    loaded = terminal.load_tasks(terminal.BUNDLED_TASKS)  # both layouts; .skipped says why
    print(loaded.summary())
    with terminal.Harness(image_map={"python:3.12-slim": "ptrain-term-base:latest"}) as h:
        with h.episode(loaded.tasks[0]) as ep:         # clean warm container + fresh shell
            ep.run("cd /app && ls").output             # persistent: cwd, env, jobs survive
            v = ep.verify()                            # the task's own tests, copied in now
            v.reward, v.passed, v.feedback
        terminal.evaluate(loaded.tasks, terminal.oracle, "runs/oracle", attempts=2, harness=h)

Files: task.py (layouts, validation), image.py (build from the Dockerfile, cached by content
hash, never pulled), container.py (a task container: limits, exec, files), reset.py (its
in-place reset), hostfs.py (host-side file access that follows no symlink), shell.py (the
persistent shell), verify.py (reward and feedback), host_pytest.py (the real pytest for
images without it), episode.py (Harness, Episode), agents.py (oracle, nop), evaluate.py
(results.jsonl, pass@k), report.py (the HTML report), bwrap.py and bwrap_plan.py (the
bubblewrap backend, `Harness(backend="bwrap")`: tasks that need only files, no docker).
tasks/: the bundled tasks (`BUNDLED_TASKS`, shipped in the package), both layouts.
What each guarantees: docs/terminal.md.
"""

import os

from sandbox.terminal import bwrap
from sandbox.terminal.agents import nop, oracle
from sandbox.terminal.container import Container, ContainerGone, Limits, remove_orphans
from sandbox.terminal.episode import Episode, Harness, HealthcheckFailed, TimeUp
from sandbox.terminal.evaluate import evaluate, pass_at_k, run_attempt, summarize
from sandbox.terminal.exec_output import ExecResult
from sandbox.terminal.image import BASE_IMAGE, ImageError, ensure_image, parse_image_map
from sandbox.terminal.shell import Shell, ShellResult
from sandbox.terminal.task import Loaded, Task, TaskError, load_task, load_tasks
from sandbox.terminal.verify import Verdict, VerifierResult

# The bundled tasks (package data): a directory for `load_tasks`, launch.eval --tasks, or
# the closed loop's terminal.tasks_dir.
BUNDLED_TASKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tasks")

__all__ = [
    "BASE_IMAGE", "BUNDLED_TASKS", "Container", "ContainerGone", "Episode", "ExecResult",
    "Harness", "HealthcheckFailed", "ImageError", "Limits", "Loaded", "Shell", "ShellResult",
    "Task",
    "TaskError", "TimeUp", "Verdict", "VerifierResult", "ensure_image", "evaluate", "load_task", "load_tasks", "nop",
    "oracle", "parse_image_map", "pass_at_k", "remove_orphans", "run_attempt", "summarize",
]
