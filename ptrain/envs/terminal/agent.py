"""A model as a terminal agent: multi-turn tool calls in a task's persistent shell.

    policy = SamplerPolicy(sampler, params, stop_ids=..., max_new_tokens=256)
    agent = ShellAgent(policy, tokenizer, chat.QWEN, stop_ids=..., max_turns=16)
    terminal.evaluate(tasks, agent, "runs/model", harness=h)     # or agent(episode) yourself

The terminal environment's tool, `BASH`, runs a command line in the episode's shell
(`sandbox.terminal.Episode.run`: cwd, variables and background jobs persist; the per-call and
the task's time limits apply) and shows its output and how it ended (`shell_observation`).
`ShellAgent` is one episode of the RL loop's turns (`ptrain.rollout.turns`: the same
parsing, tool calls, observations and caps, one policy call per turn) against a
`sandbox.terminal.Episode`, for `sandbox.terminal.evaluate` (launch.eval --agent=model): it
returns the `rollout.Episode` (token history, loss mask, log-probs, finish) and notes every
model turn in the episode's transcript between the commands.

`load_hf(path)` makes a policy of a local Hugging Face directory.
"""

from __future__ import annotations

import threading
import types

import jax

from ptrain import chat
from ptrain.envs import base
from ptrain.rollout import episodes as episodes_lib
from ptrain.rollout import turns

SYSTEM = ("You are an agent working in a Linux shell inside a container. Call the bash tool "
          "to run a command; the shell persists between calls (working directory, variables "
          "and background processes are kept). When the task is done, reply without a tool "
          "call.")


def shell_observation(result) -> str:
    """What the model sees of a command: its output, then how it ended (the episode's
    max_tool_output_chars cut the middle of a long one)."""
    if result.timed_out:
        end = f"[timed out after {result.duration_s:.0f} s]"
    elif result.exit_code is None:
        end = "[no exit status: the shell was restarted]"
    else:
        end = f"[exit status {result.exit_code}]"
    if result.restarted and result.exit_code is not None:
        end += " [the shell was restarted: cwd and variables are reset]"
    return f"{result.output}{end}"


def _run_bash(session, args, timeout_s):
    from sandbox.terminal import TimeUp  # the harness's, not a ptrain dependency
    try:
        return shell_observation(session.run(args["command"], timeout_s or None))
    except TimeUp as e:
        return f"Error: {e}; reply without a tool call."


BASH = base.Tool(
    "bash", "Run a command line in the task's persistent bash shell. Returns its output "
    "(stdout and stderr) and the exit status.",
    {"type": "object", "properties": {
        "command": {"type": "string", "description": "The command line to run."}},
     "required": ["command"], "additionalProperties": False}, _run_bash)


def render_prompt(fmt: chat.ChatFormat, tokenizer, instruction: str,
                  system: str = SYSTEM) -> list[int]:
    """The prompt's ids: system + instruction through the chat template with the bash schema,
    or plain text for a format without a template (the instruction alone when `system` is
    "": a small model trained from scratch on short prompts)."""
    if not fmt.uses_template:
        return chat.encode(tokenizer, f"{system}\n\nTask:\n{instruction}\n" if system
                           else instruction)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"chat format {fmt.name!r} renders the prompt with the tokenizer's "
                         "chat template and this tokenizer has none; use 'plain'")
    messages = ([{"role": "system", "content": system}] if system else []) + \
        [{"role": "user", "content": instruction}]
    text = tokenizer.apply_chat_template(messages, tools=[BASH.schema()],
                                         add_generation_prompt=True, tokenize=False)
    return chat.encode(tokenizer, text)


class SamplerPolicy:
    """policy(ids) -> (new turn ids, their log-probs under logits / temperature, the policy the
    learner trains), from a `Sampler` (one row per call; calls from several episodes' threads
    take turns)."""

    def __init__(self, sampler, params, *, stop_ids, stop_strings=(), max_new_tokens: int = 256,
                 temperature: float = 1.0, greedy: bool = False, seed: int = 0):
        self.sampler, self.params = sampler, params
        self.stop_ids, self.stop_strings = tuple(stop_ids), tuple(stop_strings)
        self.max_new_tokens, self.temperature, self.greedy = max_new_tokens, temperature, greedy
        self._key, self._calls = jax.random.key(seed), 0
        self._lock = threading.Lock()

    def __call__(self, ids):
        with self._lock:
            key = jax.random.fold_in(self._key, self._calls)
            self._calls += 1
            s = self.sampler.sample(self.params, [ids], max_new_tokens=self.max_new_tokens,
                                    temperature=self.temperature, greedy=self.greedy,
                                    stop_token_ids=self.stop_ids,
                                    stop_strings=self.stop_strings, key=key)
        n = int(s.lengths[0])
        return s.tokens[0, :n].tolist(), s.logp_temp[0, :n].tolist()


_ENV = base.Environment(name="terminal", tasks=lambda ctx: base.Splits((), ()),
                        verify=lambda *a, **k: [], tools=(BASH,))


class ShellAgent:
    """agent(episode) -> the `rollout.Episode` of the model's turns and tool calls in a
    `sandbox.terminal.Episode`'s shell (see the module docstring). `policy(ids) -> (ids,
    logps)`; `stop_ids` end a turn (one that ends without one was cut at the policy's cap:
    "truncated")."""

    __name__ = "model"

    def __init__(self, policy, tokenizer, fmt: chat.ChatFormat, *, stop_ids=(),
                 max_turns: int = 16, max_len: int = 4096, max_output_chars: int = 2000,
                 call_timeout_s: float | None = None, system: str = SYSTEM):
        self.policy, self.tokenizer, self.fmt, self.system = policy, tokenizer, fmt, system
        self.stop_ids = frozenset(stop_ids)
        self.config = episodes_lib.RolloutConfig(
            num_samples=1, max_new_tokens=1, max_turns=max_turns, max_len=max_len,
            max_tool_output_chars=max_output_chars, tool_timeout_s=call_timeout_s or 0.0,
            stop_token_ids=tuple(stop_ids))

    def __call__(self, episode) -> episodes_lib.Episode:
        c = self.config
        prompt = render_prompt(self.fmt, self.tokenizer, episode.instruction, self.system)
        task = types.SimpleNamespace(id=episode.instruction, domain="terminal", tools=("bash",))
        e = episodes_lib.Episode(task=task, group_id=0, tokens=list(prompt),
                                 mask=[0] * len(prompt), logp=[0.0] * len(prompt),
                                 prompt_len=len(prompt), session=episode, env=_ENV)
        text = turns.TurnText.of(self.tokenizer, self.fmt, c)
        for _ in range(c.max_turns):
            new, logp = self.policy(e.tokens)
            room = c.max_len - (len(e.tokens) - e.prompt_len)
            episode.turns += 1
            episode.note("model", chat.turn_text(self.tokenizer, new, text.strip))
            calls = turns.take_turn(e, new[:room], logp[:room], text, cut=len(new) > room,
                                    hit_length=not (new and new[-1] in self.stop_ids))
            if not calls or not turns.observe(
                    e, [turns.call_tool(e, call, c) for call in calls], self.tokenizer,
                    self.fmt, c):
                return e
        e.finish = "max_turns"
        return e


def detect_format(tokenizer) -> chat.ChatFormat:
    """The chat format of a tokenizer's family: Qwen (<|im_end|>), Llama 3 (<|eot_id|>), or
    plain completion for a tokenizer without a chat template."""
    if not getattr(tokenizer, "chat_template", None):
        return chat.PLAIN
    for fmt in (chat.QWEN, chat.LLAMA3):
        if chat.token_id(tokenizer, fmt.end_of_turn[0]) is not None:
            return fmt
    raise ValueError("the tokenizer has a chat template of no known family; name the chat "
                     f"format ({', '.join(sorted(chat.FORMATS))})")


def load_hf(path: str, *, chat_format: str = "", mesh=None):
    """(model, tokenizer, chat format, stop ids) of a local Hugging Face model directory."""
    from ptrain import hf
    model, config = hf.load(path, mesh=mesh)
    tokenizer = hf.load_tokenizer(path)
    chat.check_vocab(tokenizer, config.vocab_size)
    fmt = chat.get(chat_format) if chat_format else detect_format(tokenizer)
    stop = chat.stop_ids(fmt, tokenizer, eos_sources=hf.eos_token_ids(path),
                         vocab_size=config.vocab_size)
    return model, tokenizer, fmt, stop
