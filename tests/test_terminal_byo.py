"""A brought Hugging Face model trains on a directory of your own terminal tasks: its tokenizer
and chat format (not the generated tasks' word tokenizer), the directory's seeded split, on
bwrap and on docker with the environment's image_map honoured in training as launch.eval honours
it (the tasks' FROM image exists only through the map). tests/hf_fixtures.py's tiny
Qwen2.5-style model."""

import os
import shutil

import jax
import pytest

from ptrain import closed_loop, config as config_lib, hf, metrics, sharding
from sandbox.terminal import bwrap
from tests.test_terminal_load import TASKS_DIR  # the bundled tasks

pytestmark = pytest.mark.xdist_group("closed_loop")


def _unavailable(backend):
    if backend == "bwrap":
        return bwrap.unavailable()
    from tests.test_terminal import _docker_reason
    return _docker_reason()


@pytest.mark.parametrize("backend", ["bwrap", "docker"])
def test_a_brought_model_trains_on_a_task_directory_with_an_image_map(hf_dir, tmp_path, backend):
    if (reason := _unavailable(backend)) is not None:
        pytest.skip(str(reason))
    model_dir = hf_dir("qwen2.5-instruct")
    tasks = tmp_path / "tasks"
    for name in ("hello-file", "csv-to-json"):
        shutil.copytree(os.path.join(TASKS_DIR, name), tasks / name)
        dockerfile = tasks / name / "environment" / "Dockerfile"
        text = dockerfile.read_text()
        assert "FROM ptrain-term-base:latest" in text
        dockerfile.write_text(text.replace("FROM ptrain-term-base:latest",
                                           "FROM python:3.12-slim"))  # only via image_map
    c = config_lib.defaults(closed_loop=True)
    c.hf_model = c.tokenizer = model_dir
    c.steps = 1
    c.mesh.fsdp = 1
    c.data.update(prompts_per_step=1, max_prompt_len=1024)
    c.sampling.update(num_samples=2, max_new_tokens=8)
    c.rl.num_minibatches = 1
    c.tasks.envs = (dict(env="ptrain.envs.terminal:make", args=dict(
        tasks_dir=str(tasks), n_heldout=1, backend=backend, threads=2,
        image_map=("python:3.12-slim=ptrain-term-base:latest",))),)
    c.rollout.update(max_turns=1, max_len=16, chat_format="qwen")
    c.eval.n = 1
    c.log.rollouts_every = 1
    workdir = str(tmp_path / "run")
    mesh = sharding.make_mesh(fsdp=1, devices=jax.devices()[:1])
    lines = closed_loop.run(c, workdir, mesh=mesh)

    assert [(r["stage"], r["step"]) for r in lines] == [("base", 0), ("rl", 1)]
    assert all(r["n"] == 1 and r.get("errors", 0) == 0 for r in lines)  # episodes ran
    rows = metrics.read_jsonl(os.path.join(workdir, "rollouts.jsonl"))
    tokenizer = hf.load_tokenizer(model_dir)
    assert rows and all(r["prompt"].startswith("<|im_start|>system") for r in rows)  # its template
    assert "<|im_start|>" in tokenizer.get_vocab()
    step = metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))[0]
    assert step["step"] == 1 and "reward/terminal/mean" in step
