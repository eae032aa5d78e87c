"""ptrain.envs.cad: the CAD environment on the protocol (tasks, demonstrations, verdicts, the
`cad` tool, brought task files, launch.eval's oracle and nop), with bad input (each error naming what to fix).
The sandbox's own cases (forged reports, every backend) are in tests/test_cad.py."""

import base64
import hashlib
import io
import json
import os
import re
import subprocess
import sys

import pytest

trimesh = pytest.importorskip("trimesh", reason="the [cad] extra (trimesh) is not installed")
pytest.importorskip("manifold3d", reason="the [cad] extra (manifold3d) is not installed")

from ptrain import chat  # noqa: E402
from ptrain.envs import base  # noqa: E402
from ptrain.envs import cad as cad_env  # noqa: E402
from ptrain.envs.cad import task_file  # noqa: E402
from sandbox import cad  # noqa: E402

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "cad_tasks.jsonl")


def _needs_cad():
    reason = cad.unavailable_reason("auto")
    if reason:
        pytest.skip(f"no CAD backend: {reason}")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cad_targets"))


def _write(tmp_path, records, name="tasks.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _stl(mesh) -> bytes:
    return mesh.export(file_type="stl")


def test_a_bad_task_file_fails_at_load_naming_file_line_and_what_to_fix(tmp_path):
    box = trimesh.creation.box(extents=(1, 1, 1))
    (tmp_path / "open.stl").write_bytes(_stl(trimesh.Trimesh(box.vertices, box.faces[:-1],
                                                             process=False)))
    (tmp_path / "box.stl").write_bytes(_stl(box))
    good = {"prompt": "a cube", "target": {"mesh": "box.stl"}}
    cases = [
        ({"prompt": "a cube", "target": {"mesh": "open.stl"}}, "open.stl is not a closed solid"),
        ({"prompt": "a cube", "target": {"mesh": "gone.stl"}}, "gone.stl: No such file"),
        ({"prompt": "a cube", "target": {}}, "give a target"),
        ({"target": {"mesh": "box.stl"}}, "give the task's prompt"),
        ({**good, "tolerance": 1}, "unknown keys ['tolerance']"),
        ({**good, "checks": [{"name": "x", "kind": "weight"}]}, "a kind in"),
        ({**good, "pass_iou": 1.5}, "pass_iou=1.5 must be a number in (0, 1]"),
    ]
    for record, needle in cases:
        path = _write(tmp_path, [good, record])
        with pytest.raises(ValueError) as e:
            task_file.read(path)
        assert f"{path}:2: " in str(e.value) and needle in str(e.value), (needle, e.value)
    with pytest.raises(ValueError, match="appears more than once"):
        task_file.read(_write(tmp_path, [{**good, "id": "a"}, {**good, "id": "a"}]))
    tasks = task_file.read(_write(tmp_path, [good]))
    assert tasks[0]["mesh"] == {"part": str(tmp_path / "box.stl")}
    assert task_file.is_cad_file(EXAMPLE)


def test_generated_splits_are_seeded_and_disjoint_and_demonstrations_are_the_references(
        tmp_path, cache):
    env = cad_env.make(n_train=8, n_heldout=4, tools=True, cache_dir=cache)
    base.check(env, key="tasks.envs[0]")
    tok, fmt = env.tokenizer(), chat.get("plain")
    ctx = base.Context(name="cad", seed=3, workdir=str(tmp_path), tokenizer=tok, fmt=fmt)
    s, again = env.tasks(ctx), env.tasks(ctx)
    assert [t.prompt for t in s.train] == [t.prompt for t in again.train]
    assert not {t.verifier.code for t in s.train} & {t.verifier.code for t in s.heldout}
    assert len(s.demonstrations) == 8
    for task, demo in zip(s.train, s.demonstrations):
        assert task.tools == ("cad",) and dict(task.files) == {cad_env.TASK_FILE: task.id}
        assert tok.decode(demo["prompt_ids"]) == task.prompt
        text = tok.decode(demo["completion_ids"])
        assert cad_env.rewards.extract_code(text) == task.verifier.code.rstrip() + "\n"
        assert demo["domain"] == "cad" and set(demo["completion_mask"]) == {1}


@pytest.fixture(scope="module")
def env(cache, tmp_path_factory):
    _needs_cad()
    return cad_env.make(n_train=2, n_heldout=2, tools=True, cache_dir=cache,
                        build_timeout_s=8.0,
                        artefacts_dir=str(tmp_path_factory.mktemp("artefacts")))


def test_bad_scripts_get_verdicts_with_their_cause_and_a_wrong_part_its_iou(env):
    block = cad_env.brought(EXAMPLE)[0]  # its target: a brought mesh
    bad = {
        "no result": ("import cadquery as cq\npart = cq.Workplane().box(1, 1, 1)\n",
                      "did not set `result`"),
        "2-D sketch": ("import cadquery as cq\nresult = cq.Workplane().rect(30, 20)\n",
                       "is not a solid"),
        "self-intersecting": ("import cadquery as cq\nresult = cq.Workplane('XY').polyline("
                              "[(0, 0), (2, 2), (2, 0), (0, 2)]).close().extrude(1)\n",
                              "not a closed solid"),
        "NaN": ("import cadquery as cq\nresult = cq.Workplane().box(float('nan'), 1, 1)\n",
                "Build failed"),
        "infinite loop": ("while True:\n    pass\n", "timed out after 8 s"),
        "10^6 features": ("import cadquery as cq\nr = cq.Workplane()\nfor i in range(10**6):\n"
                          "    r = r.union(cq.Workplane().box(1, 1, 1).translate((2 * i, 0, 0)))"
                          "\nresult = r\n", "timed out after 8 s"),
        "huge mesh": ("import os\nos.makedirs('out', exist_ok=True)\n"
                      "open('out/part.stl', 'wb').write(b'0' * (100 << 20))\n",
                      "File too large"),
        "nothing": ("", "No script"),
    }
    verdicts = env.verify([block] * len(bad), [s for s, _ in bad.values()])
    for (name, (_, needle)), v in zip(bad.items(), verdicts):
        assert v.reward == 0.0 and not v.passed and v.error_type, name
        assert needle in v.feedback, (name, v.feedback)
        assert v.components["build"] == 0.0 and not v.artefacts, name
    # a part that builds but is wrong: partial reward (IoU), the gap said
    half = env.verify([block], [cad_env.answer(block.verifier.code.replace("30, 20", "15, 20"))])
    assert half[0].reward == pytest.approx(0.5, abs=0.01) and half[0].error_type == "below_iou"
    assert "is below the 0.95 a pass needs" in half[0].feedback


def test_the_cad_tool_measures_against_the_task_s_target_which_the_script_never_sees(env, cache):
    import sandbox
    from sandbox import tools as sandbox_tools
    ctx = base.Context(name="cad", seed=0, workdir="/unused")
    task = env.tasks(ctx).heldout[0]
    session = sandbox.Session(files=task.files)  # as a rollout opens the episode's
    seen = "import os\nprint('SEEN', sorted(os.listdir('.')))\n"
    out = sandbox_tools.call_tool(session, "cad", {"script": seen + task.verifier.code},
                                  tools=env.tools, timeout_s=20.0)
    assert "IoU 1.000" in out and "SEEN ['out', 'script.py']" in out
    wrong = sandbox_tools.call_tool(session, "cad", {"script": "result = 1"}, tools=env.tools,
                                    timeout_s=20.0)
    assert wrong.startswith("Build failed") and "cq.Workplane or cq.Shape" in wrong
    assert sandbox_tools.call_tool(session, "cad", {"code": "x"}, tools=env.tools).startswith(
        "Error: bad arguments for cad")
    assert session.read_files() == {cad_env.TASK_FILE: task.id.encode()}  # no target there
    # for a vision-language policy: the same text and the part's render as an image
    seeing = cad_env.make(n_train=2, n_heldout=2, tools=True, cache_dir=cache,
                          build_timeout_s=8.0, artefacts=False, image_observations=True)
    seeing.tasks(ctx)
    assert seeing.tool("cad").images and not env.tool("cad").images
    shown = sandbox_tools.call_tool(session, "cad", {"script": seen + task.verifier.code},
                                    tools=seeing.tools, timeout_s=20.0)
    assert isinstance(shown, sandbox_tools.ToolOutput) and shown.text == out
    from PIL import Image
    (png,) = shown.images
    assert Image.open(io.BytesIO(png)).format == "PNG"
    assert isinstance(sandbox_tools.call_tool(session, "cad", {"script": "result = 1"},
                                              tools=seeing.tools, timeout_s=20.0), str)
    session.close()


def test_launch_eval_oracle_scores_one_and_nop_zero_on_a_brought_file(tmp_path, cache, env):
    for agent, want in (("oracle", 1.0), ("nop", 0.0)):
        out = tmp_path / agent
        subprocess.run([sys.executable, "-m", "launch.eval", f"--tasks={EXAMPLE}",
                        f"--agent={agent}", f"--out={out}"], check=True,
                       capture_output=True, env={**os.environ, "PTRAIN_CAD_CACHE": cache})
        rows = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
        assert [r["task"] for r in rows] == ["block", "plate", "pin-in-hole"]
        assert all(r["reward"] == want and r["layout"] == "cad" and r["category"] == "cad"
                   for r in rows), rows
    with open(tmp_path / "oracle" / "transcripts" / "pin-in-hole" / "0.json") as f:
        pin = json.load(f)["verdict"]
    assert pin["components"]["checks"] == 1.0 and pin["components"]["collisions"] == 0
    assert "IoU 1.000" in pin["feedback"] and "pin and plate: clearance" in pin["feedback"]
    png, step = pin["artefacts"]["render"], pin["artefacts"]["step"]
    assert open(png, "rb").read(4) == b"\x89PNG" and open(step, "rb").read(12) == b"ISO-10303-21"
    data = base64.b64encode(open(png, "rb").read()).decode()  # the render inline in the report
    assert f"data:image/png;base64,{data}" in (tmp_path / "oracle" / "report.html").read_text()
    assert len(os.listdir(tmp_path / "oracle" / "artefacts")) == 3
    # the plate's and the assembly's references were built once, cached by their code's hash
    assert {hashlib.sha256(t.verifier.code.encode()).hexdigest()
            for t in cad_env.brought(EXAMPLE)[1:]} <= set(os.listdir(cache))


def test_fix_demonstrations_call_the_tool_with_a_wrong_part_read_its_real_output_then_answer(
        tmp_path, cache):
    """fix_demos: the demonstration's call builds a script with one dimension wrong, its
    observation is what the `cad` tool itself returns for that script in an episode, and the
    answer is the reference script; only the model's turns are trained on."""
    import sandbox
    from sandbox import tools as sandbox_tools
    _needs_cad()
    env = cad_env.make(n_train=1, n_heldout=1, tools=True, cache_dir=cache, fix_demos=1.0,
                       build_timeout_s=20.0, artefacts=False)
    tok, fmt = env.tokenizer(), chat.get("plain")
    ctx = base.Context(name="cad", seed=1, workdir=str(tmp_path), tokenizer=tok, fmt=fmt)
    splits = env.tasks(ctx)
    assert len(splits.demonstrations) == 1
    for task, demo in zip(splits.train, splits.demonstrations):
        ids, mask = demo["completion_ids"], demo["completion_mask"]
        turns = [tok.decode([t for t, m in zip(ids, mask) if m == keep]) for keep in (1, 0)]
        calls = chat.parse_tool_calls(fmt, turns[0])
        assert len(calls) == 1 and calls[0].name == "cad", turns[0]
        wrong = calls[0].arguments["script"]
        assert wrong != task.verifier.code
        assert cad_env.rewards.extract_code(turns[0]) == task.verifier.code.rstrip() + "\n"
        session = sandbox.Session(files=task.files)  # the episode's, as a rollout opens it
        try:
            out = sandbox_tools.call_tool(session, "cad", {"script": wrong}, tools=env.tools,
                                          timeout_s=20.0)
        finally:
            session.close()
        assert out in turns[1], (out, turns[1])
        iou = re.search(r"IoU ([\d.]+)", out)  # the wrong part is measured, and fails
        assert iou and float(iou.group(1)) < task.verifier.pass_iou, out
    with pytest.raises(ValueError, match="fix_demos=2"):
        cad_env.make(fix_demos=2)
