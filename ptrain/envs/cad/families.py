"""Parametric CAD parts with reference CadQuery code, in families, for generated tasks.

Each family turns a parameter dict into a prompt (every dimension and where the part sits: the
measurement compares in the task's frame), a reference script (which builds the part) and the
named checks an assembly must pass. `generate(n, seed, split)` draws parameters; the held-out
split takes parameter values the train split never uses (`_HELD_OUT`), so a model that
memorised the train parts has not seen a held-out one.

Pure data: no CadQuery import here (the reference code runs in the sandbox like the model's).
"""

from __future__ import annotations

import random

# Held-out parameters: every draw of the held-out split has one of these, no train draw does.
_HELD_OUT = {"holes": (5,), "odd_mm": (7, 13, 17)}


def _pick(rng, choices, split, held_out):
    pool = [c for c in choices if (c in held_out) == (split == "heldout")]
    return rng.choice(pool or list(choices))


def plate(rng, split):
    nx = _pick(rng, (2, 3, 4, 5), split, _HELD_OUT["holes"])
    w, d = rng.choice((40, 50, 60)), rng.choice((20, 30))
    t, r = rng.choice((3, 4, 5)), rng.choice((1.5, 2.0, 2.5))
    pitch = (w - 10) / (nx - 1)
    return {
        "prompt": (f"A rectangular plate {w} mm (x) by {d} mm (y) by {t} mm (z), centred at the "
                   f"origin, with a row of {nx} through holes of diameter {2 * r:g} mm along x "
                   f"at y = 0, evenly spaced {pitch:g} mm apart and centred."),
        "code": (f"import cadquery as cq\n"
                 f"result = (cq.Workplane('XY').box({w}, {d}, {t})\n"
                 f"          .faces('>Z').workplane()\n"
                 f"          .rarray({pitch:g}, 1, {nx}, 1).hole({2 * r:g}))\n"),
        "family": "plate", "checks": []}


def l_bracket(rng, split):
    leg = _pick(rng, (20, 25, 30, 13, 17), split, _HELD_OUT["odd_mm"])
    width, t = rng.choice((15, 20)), rng.choice((3, 4))
    return {
        "prompt": (f"An L-bracket of constant thickness {t} mm and width {width} mm (y, centred "
                   f"on y = 0): a horizontal leg from x = 0 to x = {leg} mm at z = 0..{t} and a "
                   f"vertical leg at x = 0..{t} from z = 0 up to z = {leg} mm."),
        "code": (f"import cadquery as cq\n"
                 f"result = (cq.Workplane('XZ')\n"
                 f"          .polyline([(0, 0), ({leg}, 0), ({leg}, {t}), ({t}, {t}), "
                 f"({t}, {leg}), (0, {leg})]).close()\n"
                 f"          .extrude({width} / 2, both=True))\n"),
        "family": "l_bracket", "checks": []}


def flange(rng, split):
    holes = _pick(rng, (3, 4, 6, 8, 5), split, _HELD_OUT["holes"])
    outer, bore = rng.choice((60, 80)), rng.choice((20, 25))
    t, bolt = rng.choice((6, 8)), rng.choice((4, 5))
    circle = (outer + bore) / 2
    return {
        "prompt": (f"A flange: a disc of diameter {outer} mm and thickness {t} mm (z = 0..{t}, "
                   f"axis on z), a central bore of diameter {bore} mm, and {holes} bolt holes "
                   f"of diameter {bolt} mm equally spaced on a {circle:g} mm bolt circle, the "
                   f"first on the +x axis."),
        "code": (f"import cadquery as cq\n"
                 f"result = (cq.Workplane('XY').circle({outer / 2:g}).circle({bore / 2:g})"
                 f".extrude({t})\n"
                 f"          .faces('>Z').workplane()\n"
                 f"          .polarArray({circle / 2:g}, 0, 360, {holes}).hole({bolt}))\n"),
        "family": "flange", "checks": []}


def stepped_shaft(rng, split):
    steps = rng.choice((2, 3))
    lengths = [_pick(rng, (10, 15, 20, 7, 13, 17), split, _HELD_OUT["odd_mm"])
               for _ in range(steps)]
    diameters = sorted(rng.sample((8, 10, 12, 16, 20), steps), reverse=True)
    parts = ", ".join(f"{d} mm diameter for {length} mm" for d, length in zip(diameters, lengths))
    code = ["import cadquery as cq", "result = cq.Workplane('XY')", "z = 0"]
    for d, length in zip(diameters, lengths):
        code.append(f"result = result.union(cq.Workplane('XY').workplane(offset=z)"
                    f".circle({d / 2:g}).extrude({length}))")
        code.append(f"z += {length}")
    return {"prompt": (f"A stepped shaft on the z axis starting at z = 0, going up: {parts}."),
            "code": "\n".join(code) + "\n", "family": "stepped_shaft", "checks": []}


def shelled_box(rng, split):
    w = _pick(rng, (30, 40, 50, 17), split, _HELD_OUT["odd_mm"])
    d, h = rng.choice((20, 30)), rng.choice((15, 20))
    wall = rng.choice((1.5, 2))
    fillet = wall + rng.choice((1, 2))  # the shell's inner fillet keeps a radius
    return {
        "prompt": (f"An open-top box: outside {w} x {d} x {h} mm (x, y, z), centred on x and y, "
                   f"bottom at z = 0, vertical outside edges filleted with radius {fillet} mm, "
                   f"hollowed with {wall} mm walls and floor, open at the top."),
        "code": (f"import cadquery as cq\n"
                 f"result = (cq.Workplane('XY').box({w}, {d}, {h}, centered=(True, True, False))\n"
                 f"          .edges('|Z').fillet({fillet})\n"
                 f"          .faces('>Z').shell(-{wall}))\n"),
        "family": "shelled_box", "checks": []}


def pin_in_hole(rng, split):
    """An assembly: a plate with a hole and a pin through it that must not collide."""
    hole = _pick(rng, (6, 8, 10, 7, 13), split, _HELD_OUT["odd_mm"])
    clearance = rng.choice((0.2, 0.3, 0.5))
    t = rng.choice((4, 5))
    pin = hole - 2 * clearance
    return {
        "prompt": (f"Two parts, as result = {{'plate': ..., 'pin': ...}}: a plate 40 x 30 x {t} mm "
                   f"centred at the origin with a through hole of diameter {hole} mm at its "
                   f"centre, and a pin of diameter {pin:g} mm and length {3 * t} mm on the z "
                   f"axis from z = -{t} to z = {2 * t}, passing through the hole without touching "
                   f"it ({clearance:g} mm radial clearance)."),
        "code": (f"import cadquery as cq\n"
                 f"plate = cq.Workplane('XY').box(40, 30, {t}).faces('>Z').workplane()"
                 f".hole({hole})\n"
                 f"pin = cq.Workplane('XY').workplane(offset=-{t}).circle({pin / 2:g})"
                 f".extrude({3 * t})\n"
                 f"result = {{'plate': plate, 'pin': pin}}\n"),
        "family": "pin_in_hole",
        "checks": [{"name": "pin clears the hole", "kind": "max_interference",
                    "parts": ["pin", "plate"], "value": 0.0},
                   {"name": "radial clearance", "kind": "min_clearance",
                    "parts": ["pin", "plate"], "value": 0.9 * clearance}]}


FAMILIES = {f.__name__: f for f in (plate, l_bracket, flange, stepped_shaft, shelled_box,
                                    pin_in_hole)}


def generate(n: int, seed: int = 0, split: str = "train", families=None) -> list[dict]:
    """`n` distinct parts (prompt, reference code, family, checks), families in turn."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    names = list(families or FAMILIES)
    unknown = sorted(set(names) - set(FAMILIES))
    if unknown:
        raise ValueError(f"unknown CAD families {unknown}; known: {sorted(FAMILIES)}")
    rng, out, seen = random.Random(f"{seed}/{split}"), [], set()
    tries = 0
    while len(out) < n:
        part = FAMILIES[names[len(out) % len(names)]](rng, split)
        tries += 1
        if part["code"] in seen:
            if tries > 100 * n:
                raise ValueError(f"the families hold fewer than {n} distinct {split} parts")
            continue
        seen.add(part["code"])
        out.append(part)
    return out
