"""The charts environment: generated pages show the numbers their answers are computed from
(read back from matplotlib's artists, and the bars measured in the PNG's pixels), the
answers' parser and tolerance, the held-out split, brought task files and their bad input,
image modes and the pixel budget, the image prompt, and launch.eval's oracle and nop."""

import json
import os
import pathlib
import re

import numpy as np
import pytest

Image = pytest.importorskip("PIL.Image", reason="PIL reads and writes images")

from ptrain import eval_tasks  # noqa: E402
from ptrain.envs import base, charts  # noqa: E402
from ptrain.envs.charts import judge, pages, questions, task_file  # noqa: E402
from ptrain.vision import image_processing as ip  # noqa: E402

W, H = 224, 168  # small pages: cheap to draw


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    """Three questions of each template kind from both splits, their pages drawn."""
    out = tmp_path_factory.mktemp("pages")
    return {split: [t for kind in questions.TEMPLATES
                    for t in charts.generated(3, 5, split, str(out), kinds=(kind,),
                                              width_px=W, height_px=H)]
            for split in questions.SPLITS}


# ----------------------------------------------------------------------------- the pages

def _read_back(page):
    """{label: {series: value}} as the figure draws it: bar heights, line points, table cells
    (and the value written at each bar and point)."""
    fig = pages.figure(page, W, H)
    ax = fig.axes[0]
    if page["kind"] == "table":
        cells = ax.tables[0].get_celld()
        n_rows = 1 + len(page["series"])
        cols = [cells[0, c].get_text().get_text() for c in range(1, len(page["labels"]) + 1)]
        out = {}
        for r in range(1, n_rows):
            name = cells[r, 0].get_text().get_text()
            for c, col in enumerate(cols, 1):
                out.setdefault(col, {})[name] = float(
                    cells[r, c].get_text().get_text().replace(",", ""))
        return out
    ticks = [t.get_text() for t in ax.get_xticklabels()]
    written = sorted(float(t.get_text().replace(",", "")) for t in ax.texts)
    if page["kind"] == "bar":
        name = next(iter(page["series"]))
        heights = [p.get_height() for p in ax.patches]
        assert written == sorted(heights)  # each bar's value is written on the page
        return {tick: {name: h} for tick, h in zip(ticks, heights)}
    out = {}
    for line in ax.lines:
        for x, y in zip(line.get_xdata(), line.get_ydata()):
            out.setdefault(ticks[int(x)], {})[line.get_label()] = float(y)
    assert written == sorted(v for d in out.values() for v in d.values())
    return out


def _recompute(question, data):
    """The answer from the numbers read back and the question's words (an independent
    reading of the templates)."""
    def growth(a, b):
        return (b - a) / a * 100
    m = re.match(r"Which region had the largest", question)
    if m:
        return max(data, key=lambda k: next(iter(data[k].values())))
    m = re.match(r"What is the ratio of (.+)'s .+ to (.+)'s in", question)
    if m:
        return next(iter(data[m[1]].values())) / next(iter(data[m[2]].values()))
    m = re.match(r"What is the total .+ of all regions", question)
    if m:
        return sum(next(iter(d.values())) for d in data.values())
    m = re.match(r"By what percentage did .+ of (.+) change from (\d+) to (\d+)\?", question)
    if m:
        return growth(data[m[2]][m[1]], data[m[3]][m[1]])
    m = re.match(r"In which year were .+ of (.+) highest\?", question)
    if m:
        return float(max(data, key=lambda y: data[y][m[1]]))
    m = re.match(r"What is the total of all costs in (\d+)", question)
    if m:
        return sum(data[m[1]].values())
    m = re.match(r"By what percentage did (.+) change from (\d+) to (\d+)\?", question)
    if m:
        return growth(data[m[2]][m[1]], data[m[3]][m[1]])
    m = re.match(r"What is the ratio of (.+) to (.+) in (\d+)\?", question)
    if m:
        return data[m[3]][m[1]] / data[m[3]][m[2]]
    raise AssertionError(f"no template reads {question!r}")


def test_generated_answers_follow_from_what_the_page_shows(generated):
    for split, tasks in generated.items():
        assert {t.metadata["page"]["kind"] for t in tasks} == set(questions.TEMPLATES)
        for t in tasks:
            question = t.messages[0]["content"][-1]["text"].split("\n")[0]
            want = _recompute(question, _read_back(t.metadata["page"]))
            if t.verifier.kind == "label":
                assert want == t.verifier.answer
            else:
                assert abs(want - judge.parse_number(t.verifier.answer)) <= 0.05 + 1e-9
            # the oracle's answer passes, nothing and a wrong number do not
            assert judge.judge(t.verifier, charts.answer_text(t)).passed
            assert not judge.judge(t.verifier, "").passed


def test_bar_heights_in_the_png_are_proportional_to_the_values(tmp_path):
    """The rasterised page (Agg, not our code) measured: each bar's pixel height is the
    same multiple of its value."""
    values = [120, 95, 143, 60, 31]
    page = {"kind": "bar", "title": "t", "unit": "u", "labels": list("ABCDE"),
            "series": {"v": values}}
    rgb = np.asarray(Image.open(pages.render(page, str(tmp_path / "b.png"), width_px=448,
                                             height_px=336)).convert("RGB")).astype(int)
    color = np.array([int(pages.BAR_COLOR[i:i + 2], 16) for i in (1, 3, 5)])
    is_bar = np.abs(rgb - color).sum(-1) <= 6
    columns = np.flatnonzero(is_bar.any(0))
    runs = np.split(columns, np.flatnonzero(np.diff(columns) > 1) + 1)
    assert len(runs) == len(values)
    heights = np.array([is_bar[:, r[len(r) // 2]].sum() for r in runs], float)
    slope = heights @ values / (np.array(values) @ values)
    np.testing.assert_allclose(heights, slope * np.array(values), atol=1.5)


def test_pages_are_the_same_bytes_each_time(tmp_path):
    page = questions.generate(1, 0, "train", ("line",))[0]["page"]
    a = pages.render(page, str(tmp_path / "a.png"), width_px=W, height_px=H)
    b = pages.render(page, str(tmp_path / "b.png"), width_px=W, height_px=H)
    assert open(a, "rb").read() == open(b, "rb").read()
    assert Image.open(a).size == (W, H)


def test_heldout_split_by_seed_and_by_parameters(generated):
    from ptrain import closed_loop
    env = charts.make()
    closed_loop._check_splits(env, generated["train"], generated["heldout"], eval_n=1)
    with pytest.raises(ValueError, match="held-out prompt"):  # messages are compared
        closed_loop._check_splits(env, generated["train"], generated["train"][:1], eval_n=1)

    def years(page):
        return page["labels"] if page["kind"] != "bar" else [int(page["title"][-4:])]

    def names(page):  # what the page names: the labels of a bar chart, the series elsewhere
        return page["labels"] if page["kind"] == "bar" else list(page["series"])

    seen = {split: ({y for t in tasks for y in years(t.metadata["page"])},
                    {n for t in tasks for n in names(t.metadata["page"])})
            for split, tasks in generated.items()}
    assert max(seen["train"][0]) < min(seen["heldout"][0])
    assert seen["train"][1] and not seen["train"][1] & seen["heldout"][1]
    assert questions.generate(4, 1, "train") == questions.generate(4, 1, "train")
    assert questions.generate(4, 1, "train") != questions.generate(4, 2, "train")


# ----------------------------------------------------------------------------- judging

@pytest.mark.parametrize("text, answer, kind, passed", [
    ("Answer: 12.5", "12.5", "percent", True),
    ("The growth is large.\nAnswer: 12.5%", "12.5", "percent", True),
    ("Answer: 12.46 percent", "12.5", "percent", True),  # within half a unit of 0.1
    ("Answer: 12.4", "12.5", "percent", False),
    ("Answer: -3.2 %", "-3.2", "percent", True),
    ("Answer: 0.125", "12.5", "percent", False),  # a fraction is not the percentage
    ("Answer: $1,234", "1234", "number", True),
    ("Answer: USD 1,234 thousand.", "1234", "number", True),
    ("Answer: 1,235", "1234", "number", False),
    ("Answer: 1,23", "123", "number", False),
    ("Answer: 12.5.1", "12.5", "ratio", False),
    ("Answer: about 2", "2.0", "ratio", False),
    ("\\boxed{1.5}", "1.5", "ratio", True),
    ("Answer: east.", "East", "label", True),
    ("Answer: West", "East", "label", False),
    ("no number here", "7", "number", False),
])
def test_answers_are_parsed_and_judged(text, answer, kind, passed):
    v = judge.judge(judge.Expected(answer, kind), text)
    assert v.passed is passed and v.reward == float(passed)
    if not passed:
        # the value is never leaked (what the model wrote is quoted back)
        assert answer not in re.sub(r"'[^']*'", "", v.feedback)
        assert "Answer: <value>" in v.feedback and judge.FORMATS[kind] in v.feedback


def test_a_task_tolerance_overrides_the_default():
    assert judge.judge(judge.Expected("100", "number", 3.0), "Answer: 102.9").passed
    assert not judge.judge(judge.Expected("100", "number", 3.0), "Answer: 103.1").passed
    with pytest.raises(ValueError, match="not a number"):
        judge.Expected("lots", "number")


# ----------------------------------------------------------------------------- task files

def _image(path, mode="RGB", size=(60, 40)):
    rs = np.random.RandomState(0)
    img = Image.fromarray(rs.randint(0, 256, size[::-1] + (3,), dtype=np.uint8))
    img = img.convert(mode)
    img.save(path, format="JPEG" if mode == "CMYK" else "PNG")
    return path


def _write(path, rows):
    path.write_text("".join(r if isinstance(r, str) else json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture()
def brought(tmp_path):
    (tmp_path / "img").mkdir()
    for mode in ("RGB", "L", "P", "RGBA", "CMYK"):
        _image(str(tmp_path / "img" / f"{mode}.{'jpg' if mode == 'CMYK' else 'png'}"), mode)
    return tmp_path


def test_a_task_file_loads_and_launch_eval_scores_it(brought):
    rows = [{"id": "a", "images": ["img/RGB.png"], "question": "Total?", "answer": 1234},
            {"images": ["img/L.png", "img/P.png"],
             "question": "Compare <image> and <image>: growth in %?", "answer": "12.5%"},
            {"images": ["img/RGBA.png"], "question": "Largest?", "answer": "East"},
            {"images": ["img/CMYK.jpg"], "question": "Ratio?", "answer": "1.5",
             "tolerance": 0.2}]
    path = _write(brought / "tasks.jsonl", rows)
    tasks = charts.brought(path)
    assert task_file.is_charts_file(path)
    assert [t.id for t in tasks][0] == "a" and tasks[1].id.endswith("tasks.jsonl:2")
    assert [t.verifier.kind for t in tasks] == ["number", "percent", "label", "number"]
    content = tasks[1].messages[0]["content"]
    assert [c["type"] for c in content] == ["text", "image", "text", "image", "text"]
    assert content[1]["image"] == str(brought / "img" / "L.png")
    for agent, want in (("oracle", 1.0), ("nop", 0.0)):
        out = brought / agent
        assert eval_tasks.evaluate(eval_tasks.Options(tasks=path, agent=agent,
                                                      out=str(out))) == 0
        summary = json.loads((out / "summary.json").read_text())
        assert summary["tasks_evaluated"] == 4 and summary["pass@1"] == want
    text_model = brought / "text_model"  # a vision task given to a text-only model
    text_model.mkdir()
    (text_model / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"],
                                                        "model_type": "qwen2"}))
    with pytest.raises(eval_tasks.UsageError, match="text-only model: chart tasks show images"):
        eval_tasks.evaluate(eval_tasks.Options(tasks=path, agent="model", model=str(text_model),
                                               out=str(brought / "m")))


def test_the_example_task_file_loads():
    tasks = charts.brought(str(pathlib.Path(__file__).parent.parent / "examples" /
                               "charts_tasks.jsonl"))
    assert [t.verifier.kind for t in tasks] == ["number", "percent", "number", "number"]
    assert len(charts.images(tasks[3])) == 2 and tasks[3].verifier.tolerance == 0
    assert all(judge.judge(t.verifier, charts.answer_text(t)).passed for t in tasks)


@pytest.mark.parametrize("row, message", [
    ({"images": ["img/RGB.png"], "question": "q", "answer": 1, "hint": 2}, "unknown keys"),
    ({"images": [], "question": "q", "answer": 1}, "give \"images\""),
    ({"images": ["img/none.png"], "question": "q", "answer": 1}, "does not exist"),
    ({"images": ["bad/truncated.png"], "question": "q", "answer": 1}, "not a readable image"),
    ({"images": ["bad/text.png"], "question": "q", "answer": 1}, "not a readable image"),
    ({"images": ["bad/thin.png"], "question": "q", "answer": 1}, "aspect ratio"),
    ({"images": ["img/RGB.png"], "question": "<image> vs <image>?", "answer": 1},
     "2 <image> mark"),
    ({"images": ["img/RGB.png"], "question": " ", "answer": 1}, "question"),
    ({"images": ["img/RGB.png"], "question": "q", "answer": True}, "give the answer"),
    ({"images": ["img/RGB.png"], "question": "q", "answer": 1, "tolerance": -1},
     "tolerance"),
    ({"images": ["img/RGB.png"], "question": "q", "answer": "East", "tolerance": 1},
     "numeric answers"),
    ({"id": "a", "images": ["img/RGB.png"], "question": "q", "answer": 1},
     "'a' appears more than once"),
])
def test_bad_task_file_rows_name_their_line(brought, row, message):
    bad = brought / "bad"
    bad.mkdir()
    data = open(_image(str(bad / "ok.png")), "rb").read()
    (bad / "truncated.png").write_bytes(data[:len(data) // 2])
    (bad / "text.png").write_text("not an image")
    _image(str(bad / "thin.png"), size=(402, 2))
    first = {"id": "a", "images": ["img/RGB.png"], "question": "q", "answer": 1}
    path = _write(brought / "t.jsonl", [first, row])
    with pytest.raises(ValueError, match=re.escape("t.jsonl:2: ") + ".*" + re.escape(message)):
        charts.brought(path)


def test_image_modes_convert_to_rgb_and_big_images_fit_the_budget(brought):
    """Grayscale, palette, RGBA and CMYK pages become RGB as PIL converts them (RGBA over
    white, as transformers does); an image over the pixel budget is resized within it, its
    sides multiples of 28 and its aspect kept (tests/test_vision.py checks the sizes and
    pixels against transformers' processor)."""
    proc = ip.ImageProcessing(max_pixels=28 * 28 * 8)
    for mode in ("L", "P", "CMYK"):
        path = str(brought / "img" / f"{mode}.{'jpg' if mode == 'CMYK' else 'png'}")
        np.testing.assert_array_equal(ip.preprocess(path, proc)[0],
                                      ip.preprocess(Image.open(path).convert("RGB"), proc)[0])
    rgba = Image.open(brought / "img" / "RGBA.png")
    assert rgba.mode == "RGBA"
    white = Image.alpha_composite(Image.new("RGBA", rgba.size, (255,) * 4), rgba).convert("RGB")
    np.testing.assert_array_equal(ip.preprocess(rgba, proc)[0], ip.preprocess(white, proc)[0])
    big = _image(str(brought / "big.png"), size=(900, 600))
    _, grids = ip.preprocess(big, proc)
    h, w = grids[0][1] * 14, grids[0][2] * 14
    assert h * w <= proc.max_pixels and h % 28 == w % 28 == 0 and abs(w / h - 1.5) < 0.4


# ----------------------------------------------------------------------------- prompts

class _Template:
    """A chat template's essentials: each image item is one <|image_pad|> between vision
    start and end tokens (`drop` images: a template that forgets them)."""

    def __init__(self, drop=0):
        self.drop = drop

    def apply_chat_template(self, messages, tokenize, add_generation_prompt, **kw):
        items = [c for m in messages for c in m["content"]]
        n = sum(c["type"] == "image" for c in items) - self.drop
        return "u " + "s p e " * n + " ".join(c["text"] for c in items if c["type"] == "text")

    eos_token_id, pad_token_id = 7, 0

    def encode(self, text, add_special_tokens):
        return [{"s": 2, "p": 3, "e": 4}.get(w, 5) for w in text.split()]

    def decode(self, ids):
        return " ".join(map(str, ids))


def _vl_config():
    from ptrain import model
    from ptrain.vision import config, vl
    text = model.ModelConfig(vocab_size=8, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1,
                             d_ff=16, mrope_section=(1, 1, 2), attention_impl="reference")
    tower = config.VisionConfig(depth=1, d_model=16, n_heads=2, d_ff=16, out_d=16,
                                fullatt_blocks=(0,), attention_impl="reference")
    return vl.VLConfig(text, tower, image_token_id=3, video_token_id=6,
                       vision_start_token_id=2, vision_end_token_id=4)


def test_the_prompt_holds_one_placeholder_per_merged_patch_and_needs_a_vl_model(generated):
    from ptrain.rollout import images
    task = generated["train"][0]
    proc = ip.ImageProcessing(max_pixels=W * H)
    ids, (patches, grids) = charts.prompt(task, _Template(), _vl_config(), proc)
    assert tuple(grids[0]) == (1, H // 14, W // 14)
    assert ids.count(3) == H * W // (14 * 14 * 4) == len(patches) // 4
    with pytest.raises(ValueError, match="placeholder"):
        charts.prompt(task, _Template(drop=1), _vl_config(), proc)
    from ptrain import chat
    demo = charts.demonstration(task, _Template(), chat.PLAIN, _vl_config(), proc)
    assert demo["prompt_ids"] == ids and demo["images"] == charts.images(task)
    assert demo["completion_ids"] == [5, 5, 7] and demo["completion_mask"] == [1, 1, 1]
    env = base.load({"env": "ptrain.envs.charts:make", "args": {"n_train": 1}})
    with pytest.raises(ValueError, match="vision task needs a vision-language model"):
        charts.prompt(task, _Template(), None)
    with pytest.raises(ValueError, match="images in its prompt.*text-only model"):
        images.check([task], [env], None)  # what rollout.generate checks first


def _vl_directory(path):
    """A tiny random Qwen2.5-VL directory: weights saved by ptrain.vision.hf.save, the Qwen2.5
    test tokenizer with Qwen2.5-VL's chat template."""
    import hf_fixtures
    from flax import nnx
    from ptrain.vision import hf as vhf, vl
    tokenizer = hf_fixtures.save_tokenizer("qwen2.5-instruct", path)
    tokenizer.chat_template = hf_fixtures.QWEN25_VL_TEMPLATE
    tokenizer.save_pretrained(path)
    ids = tokenizer.convert_tokens_to_ids
    c = _vl_config()
    c = c.replace(text=c.text.replace(vocab_size=len(tokenizer) + 8, family="qwen2",
                                      qkv_bias=True),
                  image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
                  vision_start_token_id=ids("<|vision_start|>"),
                  vision_end_token_id=ids("<|vision_end|>"))
    vhf.save(vl.VLModel(c, rngs=nnx.Rngs(0)), c, path,
             image_processing=ip.ImageProcessing(max_pixels=W * H))
    return path


def test_launch_eval_model_agent_answers_with_the_images(brought):
    """--agent=model on a chart file: a Qwen2.5-VL directory (random, tiny) samples each
    prompt with its images through the chat template, and every answer is judged."""
    pytest.importorskip("transformers", reason="the tokenizer is a transformers one")
    model_dir = _vl_directory(str(brought / "vl"))
    rows = [{"images": ["img/RGB.png"], "question": "Total?", "answer": 1234},
            {"images": ["img/P.png", "img/CMYK.jpg"], "question": "Growth?", "answer": "5%"}]
    path = _write(brought / "tasks.jsonl", rows)
    out = brought / "model"
    assert eval_tasks.evaluate(eval_tasks.Options(
        tasks=path, agent="model", model=model_dir, out=str(out), greedy=True,
        max_new_tokens=4)) == 0
    results = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert [r["agent"] for r in results] == ["model", "model"]
    assert all(r["error"] in ("no_answer", "not_a_number", "wrong_answer", None)
               for r in results)
    # the agent's prompt has one placeholder per merged patch of each image (224x168 fits
    # the budget): 48 for the first task, two images' worth for the second
    from ptrain.envs.charts import agent as charts_agent
    model, c, tokenizer, processing, _, _ = charts_agent.load(model_dir)
    ids, (_, grids) = charts.prompt(charts.brought(path)[1], tokenizer, c, processing)
    assert ids.count(c.image_token_id) == int(np.prod(grids, -1).sum()) // 4 and len(grids) == 2


# ------------------------------------------------------------------------ the closed loop

def test_charts_toy_runs_sft_then_rl_with_the_images_and_evaluates_both(tmp_path,
                                                                        monkeypatch):
    """configs/charts_toy.py (shortened further) through `closed_loop.run` on a tiny random
    Qwen2.5-VL: the environment's demonstrations (image paths with them) train SFT, whose
    loss falls; every SFT and RL batch carries each row's page as patches (the learner's
    vision arrays); held-out rows for charts after SFT and after RL."""
    pytest.importorskip("transformers", reason="the tokenizer is a transformers one")
    import jax
    from configs import charts_toy
    from ptrain import closed_loop, learner, metrics, sharding
    model_dir = _vl_directory(str(tmp_path / "vl"))
    c = charts_toy.get_config(model_dir + ",short")
    c.unlock()
    c.steps = 2
    c.sft.update(steps=6, batch_size=4)
    c.data.prompts_per_step = 2
    c.sampling.update(num_samples=2, max_new_tokens=4)
    c.rollout.max_len = 4
    c.tasks.envs[0]["args"].update(n_train=4, n_heldout=2)
    c.eval.n = 2
    c.sandbox.backend = "process"
    c.checkpoint.update(every=100, async_save=False)
    c.lock()
    seen = {"sft": [], "rl": []}  # real patches per row of each batch the learner got
    patches = lambda b: (np.asarray(b.vision_full_seg_bn) > 0).sum(-1).tolist()  # noqa: E731
    sft_episodes = learner.sft_episodes
    monkeypatch.setattr(learner, "sft_episodes", lambda *a, **k: seen["sft"].append(
        patches(out := sft_episodes(*a, **k))) or out)
    prepare = learner.Learner.prepare
    monkeypatch.setattr(learner.Learner, "prepare", lambda self, params, episodes, *a, **k: (
        seen["rl"].append(patches(episodes)), prepare(self, params, episodes, *a, **k))[1])
    workdir = str(tmp_path / "run")
    mesh = sharding.make_mesh(data=1, fsdp=1, devices=jax.devices()[:1])
    evals = closed_loop.run(c, workdir, mesh=mesh)

    demos = [json.loads(x) for x in (tmp_path / "run/tasks/sft.jsonl").read_text().splitlines()]
    assert len(demos) == 4 and all(len(d["images"]) == 1 for d in demos)
    page = (H // 14) * (W // 14)  # one page's patches
    assert seen["sft"] == [[page] * 4] * 6
    assert seen["rl"] == [[page] * 4] * 2  # 2 prompts x 2 samples, each its group's page
    losses = [r["sft/loss"] for r in metrics.read_jsonl(os.path.join(workdir, "sft",
                                                                      "metrics.jsonl"))]
    assert len(losses) == 6 and losses[-1] < losses[0], losses
    rl_rows = metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
    assert len(rl_rows) == 2 and all(np.isfinite(r["loss/policy"]) for r in rl_rows
                                     if "loss/policy" in r)
    assert {(e["stage"], e["domain"], e["n"]) for e in evals} >= {
        ("base", "charts", 2), ("sft", "charts", 2), ("rl", "charts", 2)}


def test_vision_budgets_and_image_records_are_checked_before_work(tmp_path):
    pytest.importorskip("transformers", reason="the tokenizer is a transformers one")
    """A patch budget that is not a multiple of the merge unit is a config error; SFT
    records with images are refused for a text model and for packed SFT; LoRA and the PPO
    critic on a VL model are refused."""
    from ptrain import config as config_lib, learner
    from ptrain.vision import run as vision_run
    c = config_lib.defaults()
    c.vision.prompt_patches = 190
    with pytest.raises(ValueError, match="vision.prompt_patches=190"):
        config_lib.check(c)
    record = {"prompt_ids": [1], "completion_ids": [2], "images": ["page.png"]}
    with pytest.raises(ValueError, match="text only"):
        vision_run.sft_arrays(None, [record], None)
    with pytest.raises(ValueError, match="sft.packing"):
        learner.sft_document(None, record)
    # what the learner cannot yet do with a VL hf_model is refused before any loading
    c = config_lib.defaults()
    c.hf_model = _vl_directory(str(tmp_path / "vl"))
    assert vision_run.vl_config(c).vision.freeze  # frozen by default
    c.lora.rank = 4
    with pytest.raises(ValueError, match="lora.rank=4 with a vision-language hf_model"):
        vision_run.vl_config(c)
    c.lora.rank, c.rl.estimator = 0, "gae"
    with pytest.raises(ValueError, match="critic reads text only"):
        learner.new_model(c, None)
