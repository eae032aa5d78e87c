"""Every bundled terminal task (sandbox/terminal/tasks/) on docker: the oracle (the task's own
solution) scores 1 and nop (doing nothing) scores 0. A task nop solves tests nothing; a task
its oracle fails is broken."""

import os

import pytest

from sandbox import terminal
from tests.test_terminal_load import TASKS_DIR

pytestmark = pytest.mark.xdist_group("terminal_tasks")  # one warm harness, on one worker

from tests.test_terminal import _REASON  # noqa: E402 (the same docker checks)

if _REASON is not None:
    pytest.skip(_REASON, allow_module_level=True)

TASKS = terminal.load_tasks(TASKS_DIR).tasks


@pytest.fixture(scope="module")
def harness():
    with terminal.Harness() as h:
        yield h


@pytest.mark.parametrize("task", TASKS, ids=[t.name for t in TASKS])
def test_oracle_scores_one_and_nop_scores_zero(harness, task):
    oracle, _ = terminal.run_attempt(harness, task, terminal.oracle, 0)
    assert oracle["reward"] == 1.0 and oracle["error"] is None, oracle["feedback"]
    nop, _ = terminal.run_attempt(harness, task, terminal.nop, 0)
    assert nop["reward"] == 0.0 and not nop["passed"], nop["feedback"]
    if task.parser == "pytest" or nop["failures"]:
        assert nop["failures"], nop["feedback"]  # the feedback names what failed


def test_bundled_tasks_are_found():
    assert len(TASKS) >= 12 and os.path.isdir(TASKS_DIR)
