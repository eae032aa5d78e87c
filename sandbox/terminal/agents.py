"""Agents that need no model: `oracle` runs the task's own solution, `nop` does nothing.

An agent is a function of an `Episode`: it acts through `episode.run(command)` until it is
done or `episode.time_left_s` runs out; the harness verifies afterwards. Together the two give
every task's sanity check: the oracle must score 1 and nop 0 (a task nop solves tests nothing).
"""

import shlex

from sandbox.terminal.episode import Episode


def oracle(episode: Episode) -> None:
    """Copy the solution in (only now: the agent never sees it otherwise) and run it in the
    episode's shell, within the agent's time."""
    task = episode.task
    if not task.has_solution:
        raise ValueError(f"{task.name}: the task has no solution (solution/solve.sh or "
                         f"solution.sh) for the oracle to run")
    if task.solution:
        episode.put_files(task.solution)
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in task.solution_env)
    episode.turns += 1
    episode.run(f"{env} {task.solution_command}" if env else task.solution_command,
                timeout_s=episode.time_left_s)


def nop(episode: Episode) -> None:
    """Nothing: the environment as the task starts it must fail the tests."""

