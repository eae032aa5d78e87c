"""ptrain.sft_records / launch/sft_data.py: (prompt, completion) text pairs become SFT records
whose ids are what the brought tokenizer's own chat template writes for that conversation
(transformers' apply_chat_template is the reference), ended where a turn ends."""

import json
import subprocess
import sys

import pytest

from ptrain import hf, jsonl, sft_records

PAIRS = [("What is 2 + 2?", "4"), ("Write hello.", "print('hello')")]


@pytest.mark.parametrize("name, fmt", [("qwen2.5-instruct", "qwen"),
                                       ("llama3.1-instruct", "llama3")])
def test_records_are_the_templates_conversation(hf_dir, name, fmt):
    tokenizer = hf.load_tokenizer(hf_dir(name))
    records = sft_records.from_pairs(PAIRS, tokenizer, chat_format=fmt)
    for (prompt, completion), r in zip(PAIRS, records):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}],
            tokenize=False)
        whole = tokenizer.encode(text, add_special_tokens=False)
        ids = r["prompt_ids"] + r["completion_ids"]
        assert whole[:len(ids)] == ids  # (the template may write a newline after the turn)
        assert tokenizer.decode(r["completion_ids"][:-1]) == completion
        assert tokenizer.convert_ids_to_tokens(r["completion_ids"][-1]) in (
            "<|im_end|>", "<|eot_id|>")


def test_a_format_the_template_does_not_write_is_refused(hf_dir):
    tokenizer = hf.load_tokenizer(hf_dir("qwen2.5-instruct"))
    with pytest.raises(ValueError, match="chat_format='llama3'"):
        sft_records.from_pairs(PAIRS, tokenizer, chat_format="llama3")


def test_the_command_writes_the_records(hf_dir, tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": p, "completion": c}) + "\n" for p, c in PAIRS))
    out = tmp_path / "sft.jsonl"
    model = hf_dir("qwen2.5-instruct")
    run = subprocess.run([sys.executable, "-m", "launch.sft_data", f"--tokenizer={model}",
                          "--chat_format=qwen", f"--pairs={pairs}", f"--out={out}"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert jsonl.read(str(out)) == sft_records.from_pairs(
        PAIRS, hf.load_tokenizer(model), chat_format="qwen")
