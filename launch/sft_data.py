"""SFT records for a brought tokenizer from (prompt, completion) text pairs
(`ptrain.sft_records`): the prompt in the tokenizer's chat template, the completion ended by
the format's end of turn, as token ids for `sft.sources`.

    python -m launch.sft_data --tokenizer=/models/Qwen2.5-0.5B-Instruct --chat_format=qwen \\
        --pairs=pairs.jsonl --out=data/sft.jsonl

--pairs: JSONL, one {"prompt": ..., "completion": ...} object per line.
"""

from absl import app, flags

_TOKENIZER = flags.DEFINE_string("tokenizer", None, "A local Hugging Face tokenizer directory.")
_CHAT_FORMAT = flags.DEFINE_string("chat_format", None, "qwen | llama3 | plain "
                                   "(rollout.chat_format of the run).")
_PAIRS = flags.DEFINE_string("pairs", None, "JSONL of {\"prompt\", \"completion\"} objects.")
_OUT = flags.DEFINE_string("out", None, "The SFT records (JSONL) to write.")
_TOOLS = flags.DEFINE_list("tools", [], "Tools the prompts offer (tasks.tools), e.g. python.")
flags.mark_flags_as_required(["tokenizer", "chat_format", "pairs", "out"])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from ptrain import hf, jsonl, sft_records
    pairs = []
    for where, record in jsonl.records(_PAIRS.value):
        if not isinstance(record.get("prompt"), str) or \
                not isinstance(record.get("completion"), str):
            raise app.UsageError(f"{where}: needs \"prompt\" and \"completion\" texts")
        pairs.append((record["prompt"], record["completion"]))
    records = sft_records.from_pairs(pairs, hf.load_tokenizer(_TOKENIZER.value),
                                     chat_format=_CHAT_FORMAT.value, tools=_TOOLS.value)
    jsonl.write(records, _OUT.value)
    print(f"{len(records)} SFT records -> {_OUT.value}")


if __name__ == "__main__":
    app.run(main)
