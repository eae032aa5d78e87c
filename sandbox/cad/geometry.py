"""The measurement of built parts: run in a fresh sandbox that never ran the model's script.

It reads only meshes (STL files the build left, and the task's target meshes, laid in only
for this run), so nothing the script did can reach the numbers: a forged `build.json` or a
printed "IoU 1.0" is never read. Also importable on the host (tests, the benchmark).

    python geometry.py < spec.json    # {"parts": {name: stl}, "target": {name: stl} | null,
                                      #  "checks": [...], "render": true}
prints one JSON object (`measure`'s result) and writes render.png when asked.

Numbers, in the task's own frame (the task says where the part sits; nothing is aligned):
- per part: volume, surface area, bounding box, bodies, watertight (a closed 2-manifold:
  what manifold3d accepts as a solid; anything else is not a solid and gates the reward);
- against a target: IoU = vol(A n B) / vol(A u B) (manifold3d booleans on the unions of the
  parts), Chamfer distance (mean of both directions' nearest-point distances over 2048
  surface samples each, fixed seed) divided by the target's bounding-box diagonal, and the
  bounding-box and volume differences;
- between parts (assemblies): the interference volume of every pair and their clearance
  (manifold3d's min_gap, up to `CLEARANCE_SEARCH` of the target's diagonal).
"""

from __future__ import annotations

import io
import json
import sys

import numpy as np

SAMPLES = 2048  # surface points per mesh for the Chamfer distance
SEED = 0
CLEARANCE_SEARCH = 0.25  # min_gap's search length, as a share of the scene's diagonal
MAX_TRIANGLES = 2_000_000  # a mesh beyond this is refused, not measured


def load_mesh(data: bytes):
    """An STL (binary or ASCII) as a trimesh.Trimesh, vertices merged; ValueError if it is
    not a triangle mesh or too large."""
    import trimesh
    mesh = trimesh.load(io.BytesIO(data), file_type="stl", force="mesh", process=True)
    if not isinstance(mesh, trimesh.Trimesh) or len(mesh.faces) == 0:
        raise ValueError("the file holds no triangles")
    if len(mesh.faces) > MAX_TRIANGLES:
        raise ValueError(f"{len(mesh.faces)} triangles (at most {MAX_TRIANGLES})")
    if not np.isfinite(mesh.vertices).all():
        raise ValueError("the mesh has non-finite coordinates")
    return mesh


def solid(mesh):
    """The mesh as a manifold3d solid, or None if it is not a closed 2-manifold."""
    import manifold3d
    m = manifold3d.Manifold(manifold3d.Mesh(
        vert_properties=np.ascontiguousarray(mesh.vertices, np.float32),
        tri_verts=np.ascontiguousarray(mesh.faces, np.uint32)))
    if m.status() != manifold3d.Error.NoError or m.is_empty() or m.volume() <= 0:
        return None
    return m


def summary(mesh, m) -> dict:
    lo, hi = mesh.bounds
    # repair=False: repairing a broken mesh's pieces needs networkx, which CAD runs lack
    bodies = len(mesh.split(only_watertight=False, repair=False))
    return {"volume": float(m.volume()) if m is not None else float(abs(mesh.volume)),
            "area": float(mesh.area), "bbox_min": lo.tolist(), "bbox_max": hi.tolist(),
            "size": (hi - lo).tolist(), "bodies": int(bodies),
            "watertight": m is not None, "triangles": int(len(mesh.faces))}


def union(solids):
    import manifold3d
    return manifold3d.Manifold.batch_boolean(list(solids), manifold3d.OpType.Add)


def iou(a, b) -> float:
    """Volume IoU of two solids."""
    inter = (a ^ b).volume()
    total = a.volume() + b.volume() - inter
    return float(inter / total) if total > 0 else 0.0


def chamfer(mesh_a, mesh_b, scale: float) -> float:
    """Symmetric mean nearest-surface distance over fixed-seed samples, divided by `scale`."""
    import trimesh
    from scipy.spatial import cKDTree
    pa, _ = trimesh.sample.sample_surface(mesh_a, SAMPLES, seed=SEED)
    pb, _ = trimesh.sample.sample_surface(mesh_b, SAMPLES, seed=SEED)
    da, _ = cKDTree(pb).query(pa)
    db, _ = cKDTree(pa).query(pb)
    return float((da.mean() + db.mean()) / 2 / scale)


def contacts(solids: dict, diagonal: float) -> list[dict]:
    """Every pair of parts: interference volume (their intersection) and clearance (the
    smallest gap, 0 when they touch or overlap; None when farther than the search)."""
    names, out = sorted(solids), []
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            overlap = float((solids[a] ^ solids[b]).volume())
            search = CLEARANCE_SEARCH * diagonal
            gap = 0.0 if overlap > 0 else float(solids[a].min_gap(solids[b], search))
            out.append({"parts": [a, b], "interference": overlap,
                        "clearance": gap if gap < search else None})
    return out


def measure(parts: dict, target: dict | None = None, checks=(), render: bool = False) -> dict:
    """parts / target: name -> STL bytes. Returns {"ok", "error", "parts", "scene",
    "target", "contacts", "checks"} (and "png": bytes when render); never raises for bad
    meshes (they come back as errors)."""
    out = {"ok": False, "error": None, "parts": {}, "contacts": [], "checks": []}
    meshes, solids = {}, {}
    for name, data in sorted(parts.items()):
        try:
            meshes[name] = load_mesh(data)
        except Exception as e:  # noqa: BLE001 (any unreadable mesh is the script's error)
            out["error"] = f"part {name!r}: {e}"
            return out
        solids[name] = solid(meshes[name])
        out["parts"][name] = summary(meshes[name], solids[name])
    if not meshes:
        out["error"] = "no part was exported"
        return out
    broken = [n for n, s in solids.items() if s is None]
    if broken:
        out["error"] = (f"not a closed solid: {', '.join(broken)} (open, self-intersecting or "
                        "non-manifold surface)")
        return out
    import trimesh
    scene_mesh = trimesh.util.concatenate(list(meshes.values()))
    scene = union(solids.values())
    lo, hi = scene_mesh.bounds
    out["scene"] = {"volume": float(scene.volume()), "bbox_min": lo.tolist(),
                    "bbox_max": hi.tolist(), "size": (hi - lo).tolist()}
    diagonal = float(np.linalg.norm(hi - lo))
    if target:
        tmeshes = {n: load_mesh(d) for n, d in sorted(target.items())}
        tsolids = {n: solid(m) for n, m in tmeshes.items()}
        if any(s is None for s in tsolids.values()):
            raise ValueError("the target is not a closed solid (a brought target mesh must be "
                             "watertight)")
        tmesh = trimesh.util.concatenate(list(tmeshes.values()))
        tlo, thi = tmesh.bounds
        tdiag = float(np.linalg.norm(thi - tlo))
        tvol = float(union(tsolids.values()).volume())
        diagonal = max(diagonal, tdiag)
        out["target"] = {
            "iou": iou(scene, union(tsolids.values())),
            "chamfer": chamfer(scene_mesh, tmesh, tdiag),
            "bbox_error": float(np.abs(np.concatenate([lo - tlo, hi - thi])).max() / tdiag),
            "volume_error": float(abs(scene.volume() - tvol) / tvol)}
    if len(solids) > 1:
        out["contacts"] = contacts(solids, diagonal)
    out["checks"] = [run_check(c, out) for c in checks]
    out["ok"] = True
    if render:
        out["png"] = render_png(meshes)
    return out


def run_check(check: dict, result: dict) -> dict:
    """A named check on the numbers: {"name", "kind", ...} with kind one of
    "max_interference" (parts, value: at most this overlap volume), "min_clearance" (parts,
    value), "volume" (value, rel_tol), "size" (value: [x, y, z], abs_tol). Returns the check
    with "passed" and "by" (how far off; 0 when passed)."""
    kind, value = check["kind"], check.get("value")
    if kind in ("max_interference", "min_clearance"):
        pair = next((c for c in result["contacts"] if sorted(c["parts"]) == sorted(check["parts"])),
                    None)
        if pair is None:
            return {**check, "passed": False, "by": None, "why": "those parts were not built"}
        if kind == "max_interference":
            by = max(0.0, pair["interference"] - value)
        else:
            gap = pair["clearance"]
            by = value if gap is None else max(0.0, value - gap)
            by = 0.0 if gap is None and pair["interference"] == 0 and value == 0 else by
    elif kind == "volume":
        got = result["scene"]["volume"]
        by = max(0.0, abs(got - value) - check.get("rel_tol", 0.01) * value)
    elif kind == "size":
        got = np.array(result["scene"]["size"])
        by = float(max(0.0, (np.abs(got - np.array(value)) - check.get("abs_tol", 0.05)).max()))
    else:
        return {**check, "passed": False, "by": None, "why": f"unknown check kind {kind!r}"}
    return {**check, "passed": by == 0, "by": float(by)}


# (name, the direction the camera looks from, the screen's up): three orthographic views and
# an isometric one
VIEWS = (("front", (0, -1, 0), (0, 0, 1)), ("top", (0, 0, 1), (0, 1, 0)),
         ("right", (1, 0, 0), (0, 0, 1)), ("isometric", (1, -1, 1), (0, 0, 1)))
PALETTE = ((0.35, 0.55, 0.85), (0.9, 0.55, 0.3), (0.45, 0.75, 0.45), (0.8, 0.4, 0.6))


def render_png(meshes: dict, size_px: int = 512) -> bytes:
    """The four VIEWS of the parts (one colour each), flat-shaded, painted back to front:
    the same meshes give the same bytes (no GPU, no randomness)."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib.collections import PolyCollection
    from matplotlib.figure import Figure
    names = sorted(meshes)
    tris_f3c = np.concatenate([meshes[n].triangles for n in names])
    colour_fc = np.concatenate([np.repeat(np.array([PALETTE[i % len(PALETTE)]]),
                                          len(meshes[n].faces), 0) for i, n in enumerate(names)])
    normal_fc = np.cross(tris_f3c[:, 1] - tris_f3c[:, 0], tris_f3c[:, 2] - tris_f3c[:, 0])
    normal_fc /= np.maximum(np.linalg.norm(normal_fc, axis=1, keepdims=True), 1e-12)
    fig = Figure(figsize=(size_px / 100, size_px / 100), dpi=100)
    for k, (title, eye, up) in enumerate(VIEWS):
        eye = np.asarray(eye, float) / np.linalg.norm(eye)
        right = np.cross(up, eye)
        right /= np.linalg.norm(right)
        screen_up = np.cross(eye, right)
        xy_f3c = np.stack([tris_f3c @ right, tris_f3c @ screen_up], -1)
        order = np.argsort((tris_f3c @ eye).mean(1), kind="stable")  # farthest first
        light = eye + 0.5 * screen_up + 0.25 * right  # from over the viewer's right shoulder
        shade_f = 0.3 + 0.7 * np.abs(normal_fc @ (light / np.linalg.norm(light)))
        ax = fig.add_subplot(2, 2, k + 1)
        ax.add_collection(PolyCollection(xy_f3c[order],
                                         facecolors=colour_fc[order] * shade_f[order, None],
                                         edgecolors="none", antialiased=False))
        lo, hi = xy_f3c.reshape(-1, 2).min(0), xy_f3c.reshape(-1, 2).max(0)
        pad = 0.05 * max(float((hi - lo).max()), 1e-9)
        ax.set_xlim(lo[0] - pad, hi[0] + pad)
        ax.set_ylim(lo[1] - pad, hi[1] + pad)
        ax.set_aspect("equal")
        ax.set_title(title, fontsize=8)
        ax.set_xticks([])
        ax.set_yticks([])
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None})
    return buf.getvalue()


def main() -> None:
    spec = json.load(sys.stdin)
    read = lambda paths: {n: open(p, "rb").read() for n, p in (paths or {}).items()}  # noqa: E731
    try:
        out = measure(read(spec["parts"]), read(spec.get("target")), spec.get("checks", ()),
                      spec.get("render", False))
    except ValueError as e:  # the task's own target is bad: not the script's fault
        out = {"ok": False, "error": f"task: {e}", "task_error": True}
    png = out.pop("png", None)
    if png is not None:
        with open("render.png", "wb") as f:
            f.write(png)
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
