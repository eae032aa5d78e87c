"""The one verdict type: how an environment's verifier judged one answer.

    Verdict(reward=1.0, passed=True, fraction_passed=1.0, feedback="Correct.")
    rubric({"builds": 1.0, "iou": 0.62}, {"builds": 0.5, "iou": 0.5}, passed=False,
           feedback="IoU 0.62 < 0.9")                 # reward = the weighted sum, 0.81

`reward` is what the learner trains on; `passed` counts for pass rates; `feedback` is the text
the model sees on a retry; `error_type` names the failure for metrics ("" when passed);
`components` and `weights` are a rubric's named parts (the weights sum to 1, and the reward
is their weighted sum); `artefacts` are for people, never for the model (files, images, a
transcript: name -> path or text). `check` refuses a verdict the learner cannot use (a reward
that is NaN, infinite or not a number), naming the environment.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping

WEIGHT_TOLERANCE = 1e-6  # how far a rubric's weights may sum from 1


@dataclasses.dataclass(frozen=True)
class Verdict:
    reward: float
    passed: bool
    fraction_passed: float  # of the checks the verifier ran (tests, cases, files)
    feedback: str
    error_type: str = ""  # "" when passed; an exception name, "timeout", "wrong_answer", ...
    components: Mapping[str, float] = dataclasses.field(default_factory=dict)
    weights: Mapping[str, float] = dataclasses.field(default_factory=dict)
    artefacts: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        for key in ("components", "weights", "artefacts"):  # kept short when unused
            if not out[key]:
                del out[key]
        return out


def check_weights(weights: Mapping[str, float], *, where: str = "rubric") -> None:
    """A rubric's weights: finite, non-negative, summing to 1."""
    bad = {k: w for k, w in weights.items() if not _number(w) or w < 0}
    if bad:
        raise ValueError(f"{where}: weights must be finite numbers >= 0, got {bad}")
    total = sum(weights.values())
    if abs(total - 1.0) > WEIGHT_TOLERANCE:
        raise ValueError(f"{where}: weights {dict(weights)} sum to {total:g}; they must sum "
                         "to 1 (the reward is the weighted sum of the components)")


def rubric(components: Mapping[str, float], weights: Mapping[str, float], *, passed: bool,
           feedback: str, error_type: str = "", artefacts: Mapping[str, str] = ()) -> Verdict:
    """A verdict whose reward is the weighted sum of named components (each in [0, 1]);
    `weights` names the same components and sums to 1."""
    if set(components) != set(weights):
        raise ValueError(f"rubric: components {sorted(components)} and weights "
                         f"{sorted(weights)} must name the same parts")
    check_weights(weights)
    reward = sum(weights[k] * float(components[k]) for k in components)
    return Verdict(reward, passed, float(passed), feedback, "" if passed else error_type,
                   dict(components), dict(weights), dict(artefacts))


def check(verdict, *, env: str) -> Verdict:
    """The verdict, if the learner can use it; else an error naming the environment."""
    if not isinstance(verdict, Verdict):
        raise TypeError(f"environment {env!r}: its verifier returned {type(verdict).__name__} "
                        f"({verdict!r:.80}); return a ptrain.envs.Verdict per answer")
    if not _number(verdict.reward):
        raise ValueError(f"environment {env!r}: its verifier returned reward "
                         f"{verdict.reward!r}; a reward must be a finite number")
    if verdict.weights:
        check_weights(verdict.weights, where=f"environment {env!r}: rubric")
        if set(verdict.weights) != set(verdict.components):
            raise ValueError(f"environment {env!r}: rubric weights {sorted(verdict.weights)} "
                             f"and components {sorted(verdict.components)} differ")
    return verdict


def _number(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)
