"""mini-swe-agent (PyPI `mini-swe-agent`, run from its own virtualenv) as the agent program of
an agent-driven environment: its DefaultAgent with the `mini.yaml` model and environment
settings, short templates (the tiny test model's 512-token episodes), a step limit, its
LitellmModel pointed at $PTRAIN_BASE_URL and its LocalEnvironment in the work dir. Prints
the agent's submission (the episode's answer) and its exit status on stderr."""

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # (no fetch at start-up)
answer = sys.stdout
sys.stdout = sys.stderr  # (its banner and litellm's notices: stdout is the answer alone)

import yaml  # noqa: E402
from minisweagent import config as mini_config  # noqa: E402
from minisweagent.agents.default import DefaultAgent  # noqa: E402
from minisweagent.environments.local import LocalEnvironment  # noqa: E402
from minisweagent.models.litellm_model import LitellmModel  # noqa: E402

task = json.loads(os.environ["PTRAIN_TASK"])
settings = yaml.safe_load((Path(mini_config.__file__).parent / "mini.yaml").read_text())
model = LitellmModel(model_name="openai/ptrain", cost_tracking="ignore_errors",
                     observation_template=settings["model"]["observation_template"],
                     model_kwargs={"api_base": os.environ["PTRAIN_BASE_URL"],
                                   "api_key": os.environ["PTRAIN_API_KEY"],
                                   "drop_params": True})
agent = DefaultAgent(model, LocalEnvironment(cwd=os.getcwd(), env=settings["environment"]["env"]),
                     system_template="You solve tasks with the bash tool.",
                     instance_template="{{task}}", step_limit=int(os.environ.get("STEPS", "2")),
                     cost_limit=0.0)
result = agent.run(task["prompt"] or task["messages"][-1]["content"])
print(f"mini-swe-agent exit: {result.get('exit_status')}", file=sys.stderr)
print(result.get("submission") or "", file=answer)
