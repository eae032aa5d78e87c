"""A model as a terminal agent: multi-turn tool calls in a task's persistent shell.

    policy = SamplerPolicy(sampler, params, stop_ids=..., max_new_tokens=256)
    agent = ShellAgent(policy, tokenizer, chat.QWEN, max_turns=16)
    terminal.evaluate(tasks, agent, "runs/model", harness=h)     # or agent(episode) yourself

The conversation is token in, token out, as in `ptrain.rollout`: the prompt (the task's
instruction, rendered through the tokenizer's chat template with the `bash` tool's schema, or
as plain text for the `plain` format), then each model turn exactly as sampled, then the
results of its tool calls rendered by the chat format (`chat.observation`) and encoded on their
own. Each turn's calls are parsed by the format (`chat.parse_tool_calls`: Hermes blocks for
Qwen and plain, a JSON turn for Llama 3) and each `bash` call runs in the episode's shell
(`Episode.run`: cwd, variables and background jobs persist; the per-call and the task's time
limits apply). A malformed call, another tool, or a `command` that is not a string comes back
as an error observation. A turn without a call ends the agent's turn, as do `max_turns`, the
`max_len` token budget and the task's agent time (`TimeUp`).

What the agent did stays on the episode: every model turn in its transcript (`Episode.note`)
between the commands, and the token history as `episode.tokens` (`Tokens`: ids, a loss mask
that is 1 on the model's tokens only, and their sampled log-probs) for RL.

`load_hf(path)` makes a policy of a local Hugging Face directory.
"""

from __future__ import annotations

import dataclasses
import threading

import jax

from ptrain import chat

SYSTEM = ("You are an agent working in a Linux shell inside a container. Call the bash tool "
          "to run a command; the shell persists between calls (working directory, variables "
          "and background processes are kept). When the task is done, reply without a tool "
          "call.")

BASH = {"type": "function", "function": {
    "name": "bash",
    "description": "Run a command line in the task's persistent bash shell. Returns its "
                   "output (stdout and stderr) and the exit status.",
    "parameters": {"type": "object", "properties": {
        "command": {"type": "string", "description": "The command line to run."}},
        "required": ["command"], "additionalProperties": False}}}


@dataclasses.dataclass
class Tokens:
    """An episode's token history: ids[i] is the model's iff mask[i] == 1, and then logp[i]
    is its sampled log-prob (logits / temperature)."""

    ids: list[int]
    mask: list[int]
    logp: list[float]
    prompt_len: int
    finish: str = ""  # answered | truncated (cut at max_new_tokens) | max_turns | max_len | time_up

    def add(self, ids, *, model: bool, logp=None) -> None:
        ids = list(ids)
        self.ids += ids
        self.mask += [int(model)] * len(ids)
        self.logp += list(logp) if logp is not None else [0.0] * len(ids)


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
    text = tokenizer.apply_chat_template(messages, tools=[BASH], add_generation_prompt=True,
                                         tokenize=False)
    return chat.encode(tokenizer, text)


def _clip(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n[... {len(text) - 2 * half} characters left out ...]\n{text[-half:]}"


def shell_observation(result, limit: int) -> str:
    """What the model sees of a command: its output (head and tail past `limit` characters),
    then how it ended."""
    if result.timed_out:
        end = f"[timed out after {result.duration_s:.0f} s]"
    elif result.exit_code is None:
        end = "[no exit status: the shell was restarted]"
    else:
        end = f"[exit status {result.exit_code}]"
    if result.restarted and result.exit_code is not None:
        end += " [the shell was restarted: cwd and variables are reset]"
    return f"{_clip(result.output, limit)}{end}"


class SamplerPolicy:
    """policy(ids) -> (new turn ids, their log-probs under logits / temperature, the policy the
    learner trains), from a `Sampler` (one
    row per call; calls from several episodes' threads take turns)."""

    def __init__(self, sampler, params, *, stop_ids, max_new_tokens: int = 256,
                 temperature: float = 1.0, greedy: bool = False, seed: int = 0):
        self.sampler, self.params = sampler, params
        self.stop_ids, self.max_new_tokens = tuple(stop_ids), max_new_tokens
        self.temperature, self.greedy = temperature, greedy
        self._key, self._calls = jax.random.key(seed), 0
        self._lock = threading.Lock()

    def __call__(self, ids):
        with self._lock:
            key = jax.random.fold_in(self._key, self._calls)
            self._calls += 1
            s = self.sampler.sample(self.params, [ids], max_new_tokens=self.max_new_tokens,
                                    temperature=self.temperature, greedy=self.greedy,
                                    stop_token_ids=self.stop_ids, key=key)
        n = int(s.lengths[0])
        return s.tokens[0, :n].tolist(), s.logp_temp[0, :n].tolist()


class ShellAgent:
    """agent(episode): the model's turns and tool calls in the episode's shell (see the
    module docstring). `policy(ids) -> (ids, logps)`; `stop_ids` end a turn."""

    __name__ = "model"

    def __init__(self, policy, tokenizer, fmt: chat.ChatFormat, *, stop_ids=(),
                 max_turns: int = 16, max_len: int = 4096, max_output_chars: int = 2000,
                 call_timeout_s: float | None = None, system: str = SYSTEM):
        if max_turns < 1 or max_len < 1:
            raise ValueError(f"max_turns and max_len must be >= 1, got {max_turns}, {max_len}")
        self.policy, self.tokenizer, self.fmt = policy, tokenizer, fmt
        self.stop_ids = tuple(stop_ids)
        self.max_turns, self.max_len = max_turns, max_len
        self.max_output_chars, self.call_timeout_s = max_output_chars, call_timeout_s
        self.system = system

    def __call__(self, episode) -> Tokens:
        tokens = self.start(episode)
        while not self.step(episode, tokens, *self.policy(tokens.ids)):
            pass
        return tokens

    def start(self, episode) -> Tokens:
        """The episode's prompt (kept on it as `episode.tokens`)."""
        prompt = render_prompt(self.fmt, self.tokenizer, episode.instruction, self.system)
        episode.tokens = Tokens(list(prompt), [0] * len(prompt), [0.0] * len(prompt),
                                len(prompt))
        return episode.tokens

    def step(self, episode, tokens: Tokens, new, logp) -> bool:
        """One model turn (`new` ids, their log-probs): its calls run, their results
        appended. Returns whether the agent's turn is over (`tokens.finish` says why). A
        batched producer samples the turns of many episodes at once and calls this for each."""
        from sandbox.terminal import TimeUp  # the harness's, not a ptrain dependency
        room = self.max_len - (len(tokens.ids) - tokens.prompt_len)
        tokens.add(new[:room], model=True, logp=logp[:room])
        episode.turns += 1
        text = chat.turn_text(self.tokenizer, new, self.stop_ids)
        episode.note("model", text)
        if len(new) > room:
            tokens.finish = "max_len"
            return True
        calls = chat.parse_tool_calls(self.fmt, text)
        if not calls:  # a final answer: one that ends without a stop id was cut at the cap
            tokens.finish = "answered" if new and new[-1] in self.stop_ids else "truncated"
            return True
        outputs = []
        try:
            for call in calls:
                outputs.append(self._call(episode, call))
        except TimeUp:
            tokens.finish = "time_up"
            return True
        closed = bool(new) and new[-1] in self.stop_ids
        obs = chat.encode(self.tokenizer, chat.observation(self.fmt, outputs, closed=closed))
        room = self.max_len - (len(tokens.ids) - tokens.prompt_len)
        tokens.add(obs[:room], model=False)
        if len(obs) + 1 > room:  # no room left for the model to answer
            tokens.finish = "max_len"
            return True
        if episode.turns >= self.max_turns:
            tokens.finish = "max_turns"
            return True
        return False

    def _call(self, episode, call) -> str:
        if isinstance(call, str):  # a malformed call: the parser's error message
            return call
        if call.name != "bash":
            return f"Error: tool {call.name!r} is not available here; use bash."
        command = call.arguments.get("command")
        if not isinstance(command, str) or not command.strip():
            return 'Error: bash takes {"command": "<a command line>"}.'
        return shell_observation(episode.run(command, self.call_timeout_s),
                                 self.max_output_chars)


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
