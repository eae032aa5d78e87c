"""Brought CAD tasks: a JSONL file, one task a line.

    {"id": "bracket-1",                       # optional (default: FILE:LINE)
     "prompt": "An L-bracket ...",
     "target": {"code": "import cadquery as cq\\nresult = ...",    # reference CadQuery
                "mesh": "meshes/bracket.stl"},   # and/or an STL (or {name: STL} for an
                                                 # assembly), relative to the file
     "checks": [{"name": "fits", "kind": "max_interference", "parts": ["pin", "plate"],
                 "value": 0}],                   # optional, `sandbox.cad.geometry.run_check`
     "pass_iou": 0.95}                           # optional: the IoU a pass needs

The target is the mesh when one is given (the code is then the reference answer only), else
what the code builds. A record that is wrong fails the load with FILE:LINE and what to fix: an
unknown key, no prompt, no target, a mesh file that is missing, unreadable or not a closed
solid (watertight 2-manifold), a check of an unknown kind, pass_iou outside (0, 1].
"""

from __future__ import annotations

import os

from ptrain import jsonl
from ptrain.envs import task_files

KEYS = ("id", "prompt", "target", "checks", "pass_iou")
CHECK_KINDS = ("max_interference", "min_clearance", "volume", "size")
PASS_IOU = 0.95


def is_cad_file(path: str) -> bool:
    """Whether a JSONL file's first record is a CAD task (it has a "target")."""
    for _, record in jsonl.records(path):
        return "target" in record and "verifier" not in record
    return False


def read(path: str) -> list[dict]:
    """The file's tasks as dicts: id, prompt, code ("" if none), mesh ({name: absolute STL
    path}, {} if none), checks, pass_iou."""
    return task_files.parsed(path, parse, KEYS, "a CAD task")


def parse(record: dict, where: str, base_dir: str) -> dict:
    prompt = record.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(f"{where}: give the task's prompt (a non-empty string)")
    target = record.get("target")
    if not isinstance(target, dict) or not (set(target) <= {"code", "mesh"}) or not (
            target.get("code") or target.get("mesh")):
        raise ValueError(f"{where}: give a target: {{\"code\": CadQuery script}} and/or "
                         f"{{\"mesh\": STL path relative to the file}}, got {target!r:.120}")
    code = target.get("code") or ""
    if not isinstance(code, str):
        raise ValueError(f"{where}: target.code must be a CadQuery script (a string)")
    mesh = target.get("mesh") or {}
    mesh = {"part": mesh} if isinstance(mesh, str) else mesh
    if not isinstance(mesh, dict) or not all(
            isinstance(k, str) and k.isidentifier() and isinstance(v, str)
            for k, v in mesh.items()):
        raise ValueError(f"{where}: target.mesh must be an STL path or {{part name: STL path}}")
    mesh = {name: _checked_mesh(os.path.join(base_dir, p), where) for name, p in mesh.items()}
    checks = record.get("checks", [])
    if not isinstance(checks, list) or not all(isinstance(c, dict) for c in checks):
        raise ValueError(f"{where}: checks must be a list of objects")
    for c in checks:
        if c.get("kind") not in CHECK_KINDS or not isinstance(c.get("name"), str):
            raise ValueError(f"{where}: check {c!r:.120} needs a name and a kind in "
                             f"{list(CHECK_KINDS)}")
    pass_iou = record.get("pass_iou", PASS_IOU)
    if isinstance(pass_iou, bool) or not isinstance(pass_iou, (int, float)) or not (
            0 < pass_iou <= 1):
        raise ValueError(f"{where}: pass_iou={pass_iou!r} must be a number in (0, 1]")
    return {"id": str(record.get("id") or where), "prompt": prompt, "code": code, "mesh": mesh,
            "checks": checks, "pass_iou": float(pass_iou)}


def _checked_mesh(path: str, where: str) -> str:
    """The path of a brought target mesh that is a closed solid (checked here, on the host:
    the mesh is data, never code)."""
    from sandbox.cad import geometry
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ValueError(f"{where}: target mesh {path}: {e.strerror}") from None
    try:
        solid = geometry.solid(geometry.load_mesh(data))
    except ImportError as e:
        raise ValueError(f"{where}: reading target mesh {path} needs the [cad] extra ({e})") \
            from None
    except Exception as e:  # noqa: BLE001 (any unreadable file is the task's error)
        raise ValueError(f"{where}: target mesh {path} is not a readable STL ({e})") from None
    if solid is None:
        raise ValueError(f"{where}: target mesh {path} is not a closed solid (open, "
                         "self-intersecting or non-manifold): a target must be watertight")
    return path
