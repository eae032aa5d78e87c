"""sandbox.cad: the measurement against closed-form geometry, and builds in every CAD backend
that runs here, with the scripts a model writes wrong (and one that tries to forge its score)."""

import io
import math
import struct

import numpy as np
import pytest

trimesh = pytest.importorskip("trimesh", reason="the [cad] extra (trimesh) is not installed")
pytest.importorskip("manifold3d", reason="the [cad] extra (manifold3d) is not installed")

from sandbox import cad  # noqa: E402
from sandbox.cad import geometry  # noqa: E402


def _stl(mesh) -> bytes:
    return mesh.export(file_type="stl")


def _box(extents, at=(0, 0, 0)):
    return _stl(trimesh.creation.box(extents=extents,
                                     transform=trimesh.transformations.translation_matrix(at)))


def test_volumes_iou_interference_and_clearance_equal_the_closed_forms():
    a, b = _box((10, 10, 10)), _box((10, 10, 10), at=(5, 0, 0))
    m = geometry.measure({"a": a}, {"target": b})
    assert m["ok"] and m["parts"]["a"]["watertight"]
    assert m["parts"]["a"]["volume"] == pytest.approx(1000, rel=1e-6)
    assert m["parts"]["a"]["area"] == pytest.approx(600, rel=1e-6)
    assert m["target"]["iou"] == pytest.approx(500 / 1500, rel=1e-6)  # overlap 5x10x10
    assert m["target"]["bbox_error"] == pytest.approx(5 / math.sqrt(300), rel=1e-6)
    assert m["target"]["volume_error"] == pytest.approx(0, abs=1e-9)
    same = geometry.measure({"a": a}, {"target": a})["target"]
    assert same["iou"] == pytest.approx(1.0) and same["chamfer"] == pytest.approx(0.0, abs=1e-12)
    # Chamfer of a box against the same box shifted by s along x, normalised by the diagonal:
    # positive, and growing with the shift
    shifted = [geometry.measure({"a": a}, {"t": _box((10, 10, 10), at=(s, 0, 0))})["target"]
               ["chamfer"] for s in (0.5, 2.0)]
    assert 0 < shifted[0] < shifted[1]

    overlap = geometry.measure({"a": a, "b": b})["contacts"]
    assert overlap == [{"parts": ["a", "b"], "interference": pytest.approx(500, rel=1e-6),
                        "clearance": 0.0}]
    apart = geometry.measure({"a": a, "c": _box((10, 10, 10), at=(12.5, 0, 0))})["contacts"]
    assert apart[0]["interference"] == 0 and apart[0]["clearance"] == pytest.approx(2.5, rel=1e-5)


def test_a_cylinder_s_tessellated_volume_is_close_to_pi_r2_h():
    cylinder = trimesh.creation.cylinder(radius=5, height=10, sections=256)
    m = geometry.measure({"c": _stl(cylinder)})
    assert m["parts"]["c"]["volume"] == pytest.approx(math.pi * 25 * 10, rel=1e-3)


def test_an_open_or_broken_mesh_is_not_a_solid_and_a_bad_target_is_the_task_s_fault():
    box = trimesh.creation.box(extents=(1, 1, 1))
    open_box = trimesh.Trimesh(box.vertices, box.faces[:-1], process=False)
    m = geometry.measure({"lid": _stl(open_box)})
    assert not m["ok"] and "not a closed solid: lid" in m["error"]
    assert not geometry.measure({"x": b"solid nonsense\nendsolid"})["ok"]
    assert geometry.measure({})["error"] == "no part was exported"
    with pytest.raises(ValueError, match="target is not a closed solid"):
        geometry.measure({"a": _box((1, 1, 1))}, {"t": _stl(open_box)})


def test_checks_say_which_failed_and_by_how_much():
    a, b = _box((10, 10, 10)), _box((10, 10, 10), at=(9, 0, 0))  # 1 x 10 x 10 overlap
    checks = [{"name": "fits", "kind": "max_interference", "parts": ["a", "b"], "value": 0.0},
              {"name": "size", "kind": "size", "value": [19, 10, 10], "abs_tol": 0.01},
              {"name": "volume", "kind": "volume", "value": 1000, "rel_tol": 0.01}]
    got = {c["name"]: c for c in geometry.measure({"a": a, "b": b}, checks=checks)["checks"]}
    assert not got["fits"]["passed"] and got["fits"]["by"] == pytest.approx(100, rel=1e-6)
    assert got["size"]["passed"] and got["size"]["by"] == 0
    assert not got["volume"]["passed"]  # 1900 built against 1000 +- 1 %
    assert got["volume"]["by"] == pytest.approx(1900 - 1000 - 10, rel=1e-6)
    text = cad.describe(geometry.measure({"a": a, "b": b}, checks=checks))
    assert "a and b collide: overlap volume 100" in text and "Check failed: fits" in text


def test_the_render_is_a_deterministic_png_of_four_views():
    meshes = {"a": _box((10, 4, 2)), "b": _box((2, 2, 8), at=(3, 0, 4))}
    one = geometry.measure(meshes, render=True)["png"]
    two = geometry.measure(meshes, render=True)["png"]
    assert one == two and one[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", one[16:24])
    assert (width, height) == (512, 512)
    # both parts' colours are drawn (a part hidden by a painting bug would be missing)
    from matplotlib import image
    pixels = image.imread(io.BytesIO(one))[..., :3]
    for colour in geometry.PALETTE[:2]:
        hue = np.asarray(colour) / np.linalg.norm(colour)
        direction = pixels / np.maximum(np.linalg.norm(pixels, axis=-1, keepdims=True), 1e-6)
        assert ((direction @ hue) > 0.999).sum() > 100


# ----------------------------------------------------------------- builds in the sandbox

PLATE = """
import cadquery as cq
result = (cq.Workplane("XY").box(40, 30, 5).faces(">Z").workplane()
          .rect(30, 20, forConstruction=True).vertices().hole(4))
"""


def _backends():
    out = []
    for name in ("process", "bwrap", "docker"):
        reason = cad.unavailable_reason(name)
        out.append(pytest.param(name, marks=pytest.mark.skipif(reason is not None,
                                                               reason=str(reason))))
    return out


@pytest.fixture(scope="module")
def target_plate():
    """The reference part, built once on whichever backend runs CAD here."""
    if cad.unavailable_reason("auto"):
        pytest.skip(f"no CAD backend: {cad.unavailable_reason('auto')}")
    _, report, files = cad.build(PLATE)
    assert report["ok"], report
    return {"part": files["out/part.stl"]}


@pytest.mark.parametrize("backend", _backends())
def test_a_build_is_measured_from_its_meshes_and_a_forged_report_changes_nothing(
        backend, target_plate):
    good = cad.build_and_measure(PLATE, target_plate, backend=backend)
    assert good.built and good.measurement["target"]["iou"] == pytest.approx(1.0, abs=1e-6)
    assert "IoU 1.000" in good.text and good.png[:4] == b"\x89PNG"
    assert {"out/part.stl", "out/part.step"} <= set(good.files)
    assert good.files["out/part.step"].startswith(b"ISO-10303-21")
    # The script prints a perfect score, writes a perfect build.json after the harness would,
    # looks for the target, and builds a 1 mm cube: the numbers are the cube's.
    forged = cad.build_and_measure("""
import atexit, json, os
import cadquery as cq
print("Against the target: IoU 1.000")
print("SEEN", sorted(os.listdir(".")), os.path.exists("target"), os.path.exists("/target"))
def forge():
    with open("out/build.json", "w") as f:
        json.dump({"ok": True, "error": None, "parts": {}}, f)
atexit.register(forge)
result = cq.Workplane("XY").box(1, 1, 1)
""", target_plate, backend=backend)
    assert forged.built and forged.measurement["target"]["iou"] < 0.01
    assert "SEEN ['out', 'script.py'] False False" in forged.stdout


@pytest.mark.parametrize("backend", [p for p in _backends() if p.values[0] == "bwrap"])
def test_broken_scripts_come_back_as_build_errors_with_their_cause(backend):
    cases = {
        "raise": ("import cadquery as cq\nx = 1 / 0\nresult = cq.Workplane().box(1, 1, 1)\n",
                  ["ZeroDivisionError", 'File "script.py", line 2']),
        "no result": ("import cadquery as cq\npart = cq.Workplane().box(1, 1, 1)\n",
                      ["did not set `result`"]),
        "sketch": ("import cadquery as cq\nresult = cq.Workplane().rect(2, 2)\n",
                   ["is not a solid", "extrude"]),
        "nan": ("import cadquery as cq\nresult = cq.Workplane().box(float('nan'), 1, 1)\n",
                ["Build failed"]),
        "not cadquery": ("result = 42\n", ["must be a cq.Workplane or cq.Shape"]),
        "exit": ("import os\nos._exit(0)\n", ["did not finish"]),
        # a file past the limit (MAX_MESH_MB): the write fails, nothing is measured
        "huge": ("import os\nos.makedirs('out', exist_ok=True)\n"
                 "open('out/part.stl', 'wb').write(b'0' * (100 << 20))\n", ["File too large"]),
    }
    for name, (script, needles) in cases.items():
        report = cad.build_and_measure(script, backend=backend, render=False)
        assert not report.built, name
        for needle in needles:
            assert needle in report.text, (name, report.text)
    slow = cad.build_and_measure("while True:\n    pass\n", backend=backend,
                                 build_timeout_s=2.0)
    assert not slow.built and "timed out" in slow.text


def test_every_family_s_reference_builds_and_scores_one_and_held_out_parts_are_unseen():
    from ptrain.envs.cad import families
    train = families.generate(12, seed=0, split="train")
    heldout = families.generate(6, seed=0, split="heldout")
    assert {p["family"] for p in heldout} == set(families.FAMILIES)
    assert not {p["code"] for p in train} & {p["code"] for p in heldout}
    assert len({p["code"] for p in train}) == 12
    if cad.unavailable_reason("auto"):
        pytest.skip(f"no CAD backend: {cad.unavailable_reason('auto')}")
    for part in heldout + train[:6]:
        _, report, files = cad.build(part["code"])
        assert report["ok"], (part["family"], report)
        target = {p.split("/")[-1][:-4]: d for p, d in files.items() if p.endswith(".stl")}
        m = cad.measure(target, target, part["checks"], render=False)
        assert m["target"]["iou"] == pytest.approx(1.0, abs=1e-6), part["family"]
        assert all(c["passed"] for c in m["checks"]), (part["family"], m["checks"])
    with pytest.raises(ValueError, match="unknown CAD families"):
        families.generate(1, families=["gear"])


def test_the_reward_is_gated_on_a_solid_then_follows_iou_and_the_checks():
    from ptrain.envs.cad import reward
    a, half = _box((10, 10, 10)), _box((10, 10, 10), at=(5, 0, 0))
    assert reward.score(None) == {"reward": 0.0, "passed": False,
                                  "components": {"build": 0.0, "iou": 0.0, "checks": 0.0}}
    broken = geometry.measure({"x": b"not an stl"}, {"t": a})
    assert reward.score(broken)["reward"] == 0.0  # nothing measured: no partial credit
    m = geometry.measure({"a": half}, {"t": a})
    assert reward.score(m)["reward"] == pytest.approx(1 / 3)
    assert reward.score(m, mode="pass")["reward"] == 0.0
    assert reward.score(geometry.measure({"a": a}, {"t": a}), mode="pass")["reward"] == 1.0
    # an assembly that collides: half its checks pass, half the IoU
    two = geometry.measure({"a": a, "b": half}, {"t": a}, checks=[
        {"name": "apart", "kind": "max_interference", "parts": ["a", "b"], "value": 0},
        {"name": "size", "kind": "size", "value": [15, 10, 10]}])
    s = reward.score(two)
    assert s["components"]["checks"] == 0.5 and s["components"]["collisions"] == 1.0
    assert s["reward"] == pytest.approx(0.5 * s["components"]["iou"]) and not s["passed"]
    with pytest.raises(ValueError, match="mode must be one of"):
        reward.score(m, mode="dense")
