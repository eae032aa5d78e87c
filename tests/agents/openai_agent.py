"""An agent program for agent-driven environments (ptrain.rollout.agents), written as a user
would: the `openai` client against $PTRAIN_BASE_URL, the task from $PTRAIN_TASK, the task's
`add` tool run here, several turns until the model answers without a call. It keeps each
tool result in ./result.txt (the state its environment's verifier reads) and prints the
model's last message (the episode's answer)."""

import json
import os

import openai

task = json.loads(os.environ["PTRAIN_TASK"])
client = openai.OpenAI(base_url=os.environ["PTRAIN_BASE_URL"],
                       api_key=os.environ["PTRAIN_API_KEY"], max_retries=0)
messages, seed = list(task["messages"]), int(os.environ.get("AGENT_SEED", "0"))
answer = ""
for turn in range(int(os.environ.get("AGENT_MAX_TURNS", "3"))):
    m = client.chat.completions.create(model="ptrain", messages=messages, tools=task["tools"],
                                       seed=seed).choices[0].message
    messages.append(m.model_dump(exclude_none=True))
    answer = m.content or ""
    if not m.tool_calls:
        break
    for call in m.tool_calls:
        try:
            args = json.loads(call.function.arguments)
            result = str(int(args["a"]) + int(args["b"]))
        except (ValueError, KeyError, TypeError) as e:
            result = f"error: {e}"
        with open("result.txt", "w") as f:
            f.write(result)
        messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
print(answer)
