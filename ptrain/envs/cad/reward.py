"""The CAD reward: gated on a valid solid, then the geometry's agreement with the target.

A dense geometric reward without a build gate gets hacked (reward rising while no script
builds), so the reward is 0 unless the script built closed solids that the measurement
accepted. Then, with `mode="iou"`, the reward is the volume IoU with the target times the
share of named checks passed (an assembly that collides is not half right); with
`mode="pass"`, 1 when IoU >= `pass_iou` and every check passed, else 0. The components (build,
iou, chamfer, bbox, checks) are returned for the metrics either way.
"""

from __future__ import annotations

import math

MODES = ("iou", "pass")


def score(measurement: dict | None, *, mode: str = "iou", pass_iou: float = 0.95) -> dict:
    """{"reward", "passed", "components": {name: value}} of one build's measurement (None
    or not ok: the build failed)."""
    if mode not in MODES:
        raise ValueError(f"CAD reward mode must be one of {MODES}, got {mode!r}")
    if not 0 < pass_iou <= 1:
        raise ValueError(f"pass_iou must be in (0, 1], got {pass_iou!r}")
    if not measurement or not measurement.get("ok"):
        return {"reward": 0.0, "passed": False,
                "components": {"build": 0.0, "iou": 0.0, "checks": 0.0}}
    target = measurement.get("target") or {}
    checks = measurement.get("checks") or []
    share = sum(c["passed"] for c in checks) / len(checks) if checks else 1.0
    iou = float(target.get("iou", 0.0))
    passed = iou >= pass_iou and share == 1.0
    reward = iou * share if mode == "iou" else float(passed)
    if not math.isfinite(reward):
        raise ValueError(f"the CAD reward is not finite: {measurement!r}")
    components = {"build": 1.0, "iou": iou, "checks": share}
    if target:
        components.update(chamfer=float(target["chamfer"]), bbox=float(target["bbox_error"]))
    collisions = [c for c in measurement.get("contacts", ()) if c["interference"] > 0]
    components["collisions"] = float(len(collisions))
    return {"reward": float(reward), "passed": bool(passed), "components": components}
