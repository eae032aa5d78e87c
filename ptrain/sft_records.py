"""SFT records from (prompt, completion) text pairs, rendered as the rollouts are: the prompt
through the brought tokenizer's chat template (with the generation prompt and the tools'
schemas), the completion as the model's turn ended by the format's end-of-turn token (plain
completion: the tokenizer's eos). Token ids, so that `learner.sft` trains on exactly what
the model sees and writes in RL.

    records = sft_records.from_pairs([("2 + 2?", "4")], tokenizer, chat_format="qwen")
    python -m launch.sft_data --tokenizer=DIR --chat_format=qwen --pairs=p.jsonl --out=sft.jsonl
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ptrain import chat


def from_pairs(pairs: Iterable[tuple[str, str]], tokenizer, *, chat_format: str,
               tools: Sequence[str] = ()) -> list[dict]:
    """[{"prompt_ids", "completion_ids"}] per pair. The chat format is first checked against
    the tokenizer's own template (`chat.check`: a mismatch is an error naming the format)."""
    fmt = chat.get(chat_format)
    if fmt.uses_template:
        try:
            chat.check(fmt, tokenizer, tools=tuple(tools) or ("python",))
        except ValueError as e:
            raise ValueError(f"chat_format={chat_format!r}: {e}") from None
    end = list(chat.end_of_turn_ids(fmt, tokenizer)[:1])
    out = []
    for i, pair in enumerate(pairs):
        if len(pair) != 2 or not all(isinstance(x, str) for x in pair):
            raise ValueError(f"pair {i}: give (prompt, completion) texts, not {pair!r}")
        prompt, completion = pair
        out.append({"prompt_ids": chat.render_prompt(fmt, tokenizer, prompt=prompt,
                                                     tools=tuple(tools)),
                    "completion_ids": chat.encode(tokenizer, completion) + end})
    return out
