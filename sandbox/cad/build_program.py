"""Runs a model's CadQuery script in the sandbox and exports what it built (sent as source).

The script is `script.py` in the work dir. It leaves its part in `result`: a Workplane, a
Shape, or a dict of name -> Workplane/Shape for several parts (an assembly). This program, not
the script, then checks each part is a 3-D solid, tessellates it at a fixed tolerance
(TOLERANCE of its bounding-box diagonal, ANGULAR radians) and writes into `out/`: NAME.stl per
part and part.step (all parts), and `out/build.json` for the feedback: the build error with the
script's last frames, or per part its solids and OCC validity.

The script runs in this process, so build.json and the exported files are whatever it left:
the host reads build.json only for feedback text, and the reward comes from measuring the
STL files in a fresh sandbox (`geometry.py`).
"""

import json
import os
import sys
import traceback

TOLERANCE = 1e-3  # of the part's bounding-box diagonal: linear deflection of the tessellation
ANGULAR = 0.1  # radians
FRAMES = 4  # traceback frames of the script kept in the feedback


def _tail(exc) -> str:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == "script.py"]
    lines = traceback.format_list(frames[-FRAMES:])
    return "".join(lines) + "".join(traceback.format_exception_only(type(exc), exc))


def _shapes(cq, result) -> dict:
    if isinstance(result, dict):
        items = result.items()
    elif isinstance(result, (list, tuple)):
        items = ((f"part{i}", r) for i, r in enumerate(result))
    else:
        items = (("part", result),)
    out = {}
    for name, value in items:
        if not isinstance(name, str) or not name.isidentifier():
            raise TypeError(f"part names must be identifiers, got {name!r}")
        if isinstance(value, cq.Workplane):
            vals = [v for v in value.vals() if isinstance(v, cq.Shape)]
            if not vals:
                raise TypeError(f"{name}: the Workplane holds no shape (a sketch or points only)")
            value = vals[0] if len(vals) == 1 else cq.Compound.makeCompound(vals)
        if not isinstance(value, cq.Shape):
            raise TypeError(f"{name}: `result` must be a cq.Workplane or cq.Shape, got "
                            f"{type(value).__name__}")
        out[name] = value
    if not out:
        raise TypeError("`result` holds no part")
    return out


def main() -> None:
    os.makedirs("out", exist_ok=True)
    report = {"ok": False, "error": None, "parts": {}}
    try:
        import cadquery as cq
        namespace = {"__name__": "__main__", "cq": cq}
        with open("script.py") as f:
            source = f.read()
        try:
            exec(compile(source, "script.py", "exec"), namespace)
        except BaseException as e:  # noqa: BLE001 (SystemExit included: the build failed)
            report["error"] = "the script raised:\n" + _tail(e)
            return
        if "result" not in namespace:
            report["error"] = ("the script did not set `result` (assign the part, e.g. "
                               "result = cq.Workplane('XY').box(10, 10, 10))")
            return
        try:
            shapes = _shapes(cq, namespace["result"])
        except TypeError as e:
            report["error"] = str(e)
            return
        for name, shape in shapes.items():
            solids = shape.Solids()
            info = {"solids": len(solids), "valid": bool(shape.isValid())}
            report["parts"][name] = info
            if not solids:
                report["error"] = (f"{name} is not a solid ({shape.ShapeType()}: a 2-D sketch, "
                                   "wire or face; extrude or revolve it)")
                return
            box = shape.BoundingBox()
            if not all(abs(x) < 1e9 for x in (box.xmin, box.xmax, box.ymin, box.ymax,
                                              box.zmin, box.zmax)):
                report["error"] = f"{name} has a non-finite or huge bounding box"
                return
            tol = max(TOLERANCE * box.DiagonalLength, 1e-6)
            cq.exporters.export(shape, f"out/{name}.stl", tolerance=tol,
                                angularTolerance=ANGULAR)
        compound = cq.Compound.makeCompound(list(shapes.values()))
        cq.exporters.export(compound, "out/part.step")
        report["ok"] = True
    except BaseException as e:  # noqa: BLE001 (an export that failed: the part is bad)
        report["error"] = "exporting the part failed:\n" + "".join(
            traceback.format_exception_only(type(e), e))
    finally:
        with open("out/build.json", "w") as f:
            json.dump(report, f)
        sys.stdout.flush()


main()
