"""Agent-driven episodes: an environment whose episode is run by an external agent program
(any harness that speaks the OpenAI API) against the policy served by `ptrain.serve`, judged
by the environment's verifier on the state the agent left, trained on the tokens the server
recorded (`serve.training_episodes`: token in, token out).

    env = Environment(name="sql", tasks=..., verify=...,
                      agent=rollout.Agent(command=("python", "my_agent.py")))
    producer = rollout.Agents(server, tokenizer, config, envs={"sql": env})
    learner.train(config, workdir, producer=producer, ...)

Each episode: the server opens an episode, the agent program runs with

  PTRAIN_BASE_URL   the episode's OpenAI base URL (http://127.0.0.1:<port>/episodes/<id>/v1)
  PTRAIN_API_KEY    the server's bearer token (also OPENAI_BASE_URL / OPENAI_API_KEY)
  PTRAIN_TASK       the task as JSON: id, prompt, messages, tools (schemas), metadata

in the episode's work dir (the task's files), inside a sandbox box (`Agent.backend`, network
kept for the loopback endpoint) when it executes model-written commands, or as a host
subprocess (`backend=None`). Its stdout (stripped) is the episode's answer; the work dir is
the `session` its verifier reads. A program that fails or times out is data: its answer is
what it printed, its verdict the verifier's, the failure logged.

The episodes are `rollout.Episode`s (one per recorded segment; `to_batch` packs them as any
other environment's), so `Agents.score` is `Tasks.score`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import os
import subprocess
import tempfile
from collections.abc import Mapping, Sequence

import sandbox

from ptrain import tasks as tasks_lib
from ptrain.rollout.episodes import Episode, verify_episodes

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Agent:
    """How an environment's episodes are run: `command` (argv) of the agent program;
    `backend`: the sandbox backend of its box ("auto", "bwrap", "docker", "process"), or None
    to run it as a host subprocess (an agent that executes nothing the model wrote);
    `env`: more environment variables; `memory_mb`: its box's memory."""

    command: tuple[str, ...]
    timeout_s: float = 600.0
    backend: object = "auto"  # a name, a spec (sandbox.Bwrap(ro_binds=...)), or None
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    memory_mb: int = 2048

    def __post_init__(self):
        if isinstance(self.command, str) or not self.command or not all(
                isinstance(a, str) and a for a in self.command):
            raise ValueError(f"Agent.command={self.command!r}: give the program's argv, a "
                             "tuple of non-empty strings, e.g. ('python', 'agent.py')")
        if not self.timeout_s > 0 or self.memory_mb < 64:
            raise ValueError("Agent: timeout_s must be > 0 and memory_mb >= 64")


def task_json(task: tasks_lib.Task, tools) -> str:
    """What the agent gets as PTRAIN_TASK (the tools' OpenAI schemas)."""
    return json.dumps({"id": task.id, "domain": task.domain, "prompt": task.prompt,
                       "messages": list(task.messages or ()),
                       "tools": [{"type": "function", "function": {
                           "name": t.name, "description": t.description,
                           "parameters": t.parameters}} for t in tools],
                       "metadata": dict(task.metadata)})


def _run(agent: Agent, env_vars: dict, session, task) -> tuple[str, str]:
    """Runs the program once; (its stdout stripped, why it failed or "")."""
    env_vars = {**env_vars, **agent.env}
    if session is not None:
        r = session.run(command=list(agent.command), env=env_vars, timeout_s=agent.timeout_s)
        out = r.stdout.decode("utf-8", "replace").strip()
        failed = "" if r.ok else (f"exit {r.exit_code}, signal {r.signal}, timed out "
                                  f"{r.timed_out}: {r.stderr[-500:].decode('utf-8', 'replace')}")
        return out, failed
    with tempfile.TemporaryDirectory(prefix="ptrain-agent-") as cwd:
        for name, content in dict(task.files or {}).items():
            path = os.path.join(cwd, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(content.encode() if isinstance(content, str) else content)
        try:
            p = subprocess.run(list(agent.command), cwd=cwd, env={**os.environ, **env_vars},
                               capture_output=True, timeout=agent.timeout_s)
        except subprocess.TimeoutExpired as e:
            return (e.stdout or b"").decode("utf-8", "replace").strip(), "timeout"
        failed = "" if p.returncode == 0 else \
            f"exit {p.returncode}: {p.stderr[-500:].decode('utf-8', 'replace')}"
        return p.stdout.decode("utf-8", "replace").strip(), failed


def run_episodes(server, tasks: Sequence[tasks_lib.Task], envs: Sequence, *,
                 num_samples: int, first_group_id: int = 0, pool=None,
                 reward_config=None, max_workers: int | None = None) -> list[Episode]:
    """`num_samples` agent runs of every task (task i's rows form group first_group_id + i),
    each judged by its environment's verifier; the recorded segments as episodes."""
    service = server.RequestHandlerClass.service  # (`serve.make_server`'s)
    url = f"http://127.0.0.1:{server.server_address[1]}"

    def one(group, task, env):
        del group  # (the rows' group: below)
        agent = env.agent
        record = service.open_episode({"metadata": {"task": task.id}})
        base = f"{url}{record['base_path']}"
        env_vars = {"PTRAIN_BASE_URL": base, "PTRAIN_API_KEY": server.token,
                    "OPENAI_BASE_URL": base, "OPENAI_API_KEY": server.token,
                    "PTRAIN_TASK": task_json(task, [env.tool(n) for n in task.tools])}
        session = None
        if agent.backend is not None:
            session = sandbox.Session(backend=agent.backend, files=dict(task.files) or None,
                                      network=True, memory_mb=agent.memory_mb)
        try:
            answer, failed = _run(agent, env_vars, session, task)
        except BaseException:
            if session is not None:
                session.close()
            raise
        finally:
            service.close_episode(record["id"])
        if failed:
            log.warning("agent of task %s (episode %s) failed: %s", task.id, record["id"],
                        failed)
        return record["id"], answer, session

    runs = [(first_group_id + i, task, env) for i, (task, env) in enumerate(zip(tasks, envs))
            for _ in range(num_samples)]
    workers = max_workers or max(1, service.engine.slots)
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as threads:
        done = list(threads.map(lambda r: one(*r), runs))
    closed = {e.id: e for e in service.take_closed({eid for eid, _, _ in done})}
    from ptrain.serve import episodes as recorded  # (serve imports rollout lazily)
    out, judged = [], []
    for (group, task, env), (eid, answer, session) in zip(runs, done):
        rows = recorded.training_episodes(closed[eid], task, group_id=group)
        for e in rows:
            e.env, e.answers = env, [answer]
        if not rows:  # dropped, or nothing sampled: no rows; its work dir goes
            if session is not None:
                session.close()
            continue
        rows[-1].session = session  # the verifier reads the state the agent left
        judged.append(rows)
        out += rows
    kwargs = {} if reward_config is None else {"config": reward_config}
    verify_episodes([rows[-1] for rows in judged], pool=pool, **kwargs)
    for rows in judged:  # a rewrite's earlier segments share the run's verdict
        for e in rows[:-1]:
            e.verdicts = list(rows[-1].verdicts)
    return out
