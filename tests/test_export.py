"""launch/export.py: a run's checkpoint as a directory `transformers` loads, with ptrain's logits.

The references are transformers' own forward pass of the exported directory and its own
tokenizer / GenerationConfig loaders."""

import os
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest

torch = pytest.importorskip("torch", reason="torch (CPU) is the reference; pip install '.[test]'")
transformers = pytest.importorskip("transformers", reason="pip install '.[test]'")

from flax import nnx  # noqa: E402

from ptrain import export as export_lib  # noqa: E402
from ptrain import chat, checkpoint, closed_loop, hf, metrics  # noqa: E402
from ptrain import model as model_lib  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _hf_logits(path, tokens):
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.float().numpy()


def _ours(config, params, tokens):
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: model_lib.Transformer(config,
                                                                         rngs=nnx.Rngs(0))))
    return np.asarray(nnx.merge(graphdef, params)(np.asarray(tokens)))


def _save(directory, step, params):
    with checkpoint.Checkpointer(directory, async_save=False) as ckpt:
        ckpt.save(step, params=params, opt_state=optax.adam(1e-3).init(params),
                  rng=jax.random.key(0), extra={"kl_coef": 0.0})


def test_a_trained_run_exports_with_our_logits(tmp_path):
    """launch/train.py on a config file (which keeps its config), then the export."""
    workdir, out = str(tmp_path / "run"), str(tmp_path / "hf")
    run = lambda *args: subprocess.run([sys.executable, "-m", *args], cwd=REPO,  # noqa: E731
                                       capture_output=True, text=True, timeout=600)
    train = run("launch.train", "--config=configs/grpo_toy.py", "--config.steps=2",
                "--config.checkpoint.every=1", f"--workdir={workdir}")
    assert train.returncode == 0, train.stderr[-3000:]
    # Quiet logs with progress: no warning a user cannot act on, rl steps in the log file.
    assert "transition_steps" not in train.stderr and "Warning" not in train.stderr
    assert "rl: 2/2 steps (100%)" in train.stderr, train.stderr[-3000:]
    kept = metrics.read_run_config(workdir)
    assert kept.steps == 2 and kept.model.d_model == 32 and kept.optim.lr == 1e-2
    with open(os.path.join(workdir, "command.txt")) as f:
        assert "--config.steps=2" in f.read()
    assert "RL reward" in open(os.path.join(workdir, "report.html")).read()  # ptrain.report

    exported = run("launch.export", f"--workdir={workdir}", f"--out={out}", "--step=1")
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert "orbax" not in exported.stderr and "exported" in exported.stderr
    config = model_lib.ModelConfig(**kept.model.to_dict())
    graphdef, fresh = nnx.split(model_lib.init(config, seed=kept.seed))
    with checkpoint.Checkpointer(os.path.join(workdir, "checkpoints")) as ckpt:
        assert ckpt.all_steps() == [1, 2]
        trained = ckpt.restore_params(1, params=fresh)
    tokens = np.random.RandomState(0).randint(0, config.vocab_size, (2, 12))
    ours = _ours(config, trained, tokens)
    np.testing.assert_allclose(_hf_logits(out, tokens), ours, atol=2e-4, rtol=0)
    assert np.abs(_ours(config, fresh, tokens) - ours).max() > 1e-3  # step 1 is not the init
    assert not os.path.exists(os.path.join(out, "tokenizer.json"))  # the run had none


def test_a_brought_model_exports_with_its_tokenizer_template_and_stops(hf_dir, tmp_path):
    source = hf_dir("qwen2.5-base")
    workdir, out = str(tmp_path / "run"), str(tmp_path / "hf")
    config = closed_loop.defaults()
    config.hf_model, config.tokenizer = source, ""  # the tokenizer comes with the model
    config.rollout.chat_format = "qwen"
    metrics.write_run_record(workdir, config, ["launch/train.py", "--config=byo.py"])
    model, model_config = hf.load(source)
    _, params = nnx.split(model)
    for step, scale in ((3, 1.01), (6, 0.99)):
        _save(os.path.join(workdir, "checkpoints"),
              step, jax.tree.map(lambda x: x * scale + 0.001 * step, params))
    assert export_lib.export(workdir, out, step=3) == 3

    tokenizer = hf.load_tokenizer(source)
    tokens = [chat.encode(tokenizer, "def add(a, b):\n    return a + b\n")] * 2
    ours = _ours(model_config, jax.tree.map(lambda x: x * 1.01 + 0.003, params), tokens)
    np.testing.assert_allclose(_hf_logits(out, tokens), ours, atol=2e-4, rtol=0)
    reloaded = transformers.AutoTokenizer.from_pretrained(out)
    messages = [{"role": "user", "content": "Compute 6 * 7."}]
    assert reloaded.apply_chat_template(messages, tools=chat.tool_schemas(["python"]),
                                        tokenize=False, add_generation_prompt=True) == \
        tokenizer.apply_chat_template(messages, tools=chat.tool_schemas(["python"]),
                                      tokenize=False, add_generation_prompt=True)
    eos = transformers.GenerationConfig.from_pretrained(out).eos_token_id
    # the base model's eos, and the chat turn's end where the run's sampler stopped
    assert {tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id} <= set(eos)
    assert export_lib.export(workdir, str(tmp_path / "latest")) == 6


def test_errors_name_what_to_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="launch/train.py writes it"):
        export_lib.export(str(tmp_path), str(tmp_path / "out"))
    config = closed_loop.defaults()
    config.model.vocab_size = 0  # the tokenizer's: read from the checkpoint
    workdir = str(tmp_path / "run")
    metrics.write_run_record(workdir, config, ["launch/train.py"])
    model_config = model_lib.ModelConfig(**{**config.model.to_dict(), "vocab_size": 40})
    _, params = nnx.split(model_lib.init(model_config, seed=0))
    _save(os.path.join(workdir, "sft", "checkpoints"), 4, params)
    with pytest.raises(FileNotFoundError, match="--stage=sft exports those"):
        export_lib.export(workdir, str(tmp_path / "out"))
    with pytest.raises(ValueError, match=r"--step=5: .* holds steps \[4\]"):
        export_lib.export(workdir, str(tmp_path / "out"), step=5, stage="sft")
    assert export_lib.export(workdir, str(tmp_path / "out"), stage="sft") == 4
    assert transformers.AutoConfig.from_pretrained(str(tmp_path / "out")).vocab_size == 40

    config.model.d_model = 32  # a config.json that is not the checkpoint's model
    metrics.write_run_record(workdir, config, ["launch/train.py"])
    with pytest.raises(ValueError, match="does not hold the model"):
        export_lib.export(workdir, str(tmp_path / "out2"), stage="sft")
