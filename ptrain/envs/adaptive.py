"""An optional adaptive sampler over a mixture's environments, and a filter of tasks that
teach nothing; both keyed by name (a string) and resumable exactly (`state` / `load`).

    mix = Adaptive(("code", "math", "sql"), (1.0, 1.0, 2.0), mode="progress", seed=0)
    names = mix.draw(64)                      # environment of each group this step
    mix.observe("code", [0.25, 1.0, 0.5])     # per-task mean pass rates of its groups
    mix.probabilities()                       # over the names, in order
    saved = json.dumps(mix.state()); mix.load(json.loads(saved))   # exact resume

    skip = TaskFilter(patience=2)
    skip.observe("code/17", 1.0); skip.keep("code/17")

Adaptive's modes (each environment's pass rate is followed by a fast and a slow exponential
moving average, `ema += rate * (x - ema)` per observed step):
  "off"       the configured weights.
  "progress"  absolute learning progress, |fast EMA - slow EMA| of the pass rate: the
              environments whose pass rate moves (up, or down: forgetting) are drawn more
              (Kanitscheider et al. 2021, "Multi-task curriculum learning in a complex, visual,
              hard-exploration domain: Minecraft", arXiv:2106.14876: their
              bidirectional learning progress from a fast and a slow EMA of success; after
              Portelas et al. 2020's absolute learning progress, arXiv:1910.07224).
  "band"      environments whose fast-EMA pass rate lies inside [band_low, band_high] are
              drawn (Bae et al. 2025, "Online Difficulty Filtering for Reasoning Oriented
              Reinforcement Learning", arXiv:2504.03380: keep prompts of intermediate pass
              rate).
The probability of environment i is
    floor * w_i / sum(w) + (1 - floor) * w_i s_i / sum(w s)
with w the configured weights and s the mode's score: `floor` of the draw always follows the
weights, so no environment's probability reaches zero. An environment with fewer than two
observations (progress: its EMAs have not separated yet) or none (band) scores the largest
score of the others (it is explored); when every score is 0 the draw is the weights.

TaskFilter skips a task once `patience` of its groups in a row had every sample pass or every
sample fail: the group's advantages are all zero and it trains nothing (DAPO's dynamic
sampling, Yu et al. 2025, arXiv:2503.14476, drops such groups within a step; AReaL-boba drops
the prompts a model always solves from the data set). A group in between resets the count.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

MODES = ("off", "progress", "band")


def _check(ok, message):
    if not ok:
        raise ValueError(message)


class Adaptive:
    """Sampling probabilities over `names` (see the module docstring)."""

    def __init__(self, names: Sequence[str], weights: Sequence[float], *, mode: str = "off",
                 fast: float = 0.3, slow: float = 0.05, band: Sequence[float] = (0.2, 0.8),
                 floor: float = 0.2, seed: int = 0):
        names, weights = tuple(names), tuple(float(w) for w in weights)
        _check(names and all(isinstance(n, str) and n for n in names),
               f"adaptive: names must be non-empty strings; got {names!r}")
        _check(len(set(names)) == len(names),
               f"adaptive: names repeat: {sorted({n for n in names if names.count(n) > 1})}")
        _check(len(weights) == len(names),
               f"adaptive: {len(weights)} weights for {len(names)} environments; give one each")
        _check(all(np.isfinite(w) and w > 0 for w in weights),
               f"adaptive: weights must be finite and > 0; got {weights}")
        _check(mode in MODES, f"adaptive: mode={mode!r}; use one of {MODES}")
        _check(0 < slow < fast <= 1,
               f"adaptive: need 0 < slow < fast <= 1 (EMA rates); got fast={fast}, slow={slow}")
        band = tuple(float(b) for b in band)
        _check(len(band) == 2 and 0 <= band[0] <= band[1] <= 1,
               f"adaptive: band must be (low, high) with 0 <= low <= high <= 1; got {band}")
        _check(0 < floor <= 1, f"adaptive: floor must be in (0, 1] (the share of the draw "
                               f"that follows the weights); got {floor}")
        self.names, self.mode, self.fast, self.slow = names, mode, float(fast), float(slow)
        self.band, self.floor = band, float(floor)
        self._index = {n: i for i, n in enumerate(names)}
        self._weights = np.asarray(weights) / sum(weights)
        self._ema = np.zeros((2, len(names)))  # fast, slow
        self._count = np.zeros(len(names), dtype=np.int64)
        self._rng = np.random.Generator(np.random.PCG64(seed))

    def observe(self, name: str, pass_rates: Sequence[float]) -> None:
        """One step's groups of environment `name`: each task's mean pass rate."""
        _check(name in self._index, f"adaptive: unknown environment {name!r}")
        rates = np.asarray(pass_rates, dtype=np.float64)
        _check(rates.ndim == 1 and rates.size > 0 and np.all((rates >= 0) & (rates <= 1)),
               f"adaptive: pass rates of {name!r} must be a non-empty list of numbers in "
               f"[0, 1]; got {pass_rates!r}")
        i, x = self._index[name], float(rates.mean())
        if self._count[i] == 0:
            self._ema[:, i] = x
        else:
            self._ema[:, i] += np.array([self.fast, self.slow]) * (x - self._ema[:, i])
        self._count[i] += 1

    def scores(self) -> np.ndarray:
        """The mode's score of each environment (before weights and floor)."""
        if self.mode == "off":
            return np.ones(len(self.names))
        if self.mode == "progress":
            score, known = np.abs(self._ema[0] - self._ema[1]), self._count >= 2
        else:
            low, high = self.band
            score = ((self._ema[0] >= low) & (self._ema[0] <= high)).astype(np.float64)
            known = self._count >= 1
        return np.where(known, score, score[known].max() if known.any() else 1.0)

    def probabilities(self) -> np.ndarray:
        """The draw's probability of each environment, in the order of `names`."""
        w, ws = self._weights, self._weights * self.scores()
        if ws.sum() <= 0:
            return w.copy()
        return self.floor * w + (1 - self.floor) * ws / ws.sum()

    def draw(self, n: int) -> list[str]:
        """n environment names drawn independently by `probabilities()`."""
        return [self.names[i] for i in self._rng.choice(len(self.names), size=n,
                                                          p=self.probabilities())]

    def state(self) -> dict:
        """Everything a resumed run needs for the same draws (JSON-able)."""
        return {"names": list(self.names), "mode": self.mode, "count": self._count.tolist(),
                "ema": self._ema.tolist(), "rng": self._rng.bit_generator.state}

    def load(self, state: dict) -> None:
        """Continues from `state()`; the names and mode must be this sampler's."""
        _check(list(state["names"]) == list(self.names) and state["mode"] == self.mode,
               f"adaptive: the saved state is of mode {state['mode']!r} over "
               f"{len(state['names'])} environments {state['names'][:5]}...; this sampler is "
               f"{self.mode!r} over {list(self.names[:5])}...: resume with the same mixture")
        self._count = np.asarray(state["count"], dtype=np.int64)
        self._ema = np.asarray(state["ema"], dtype=np.float64)
        self._rng.bit_generator.state = state["rng"]


class TaskFilter:
    """Skips tasks whose last `patience` groups were all-pass or all-fail (module docstring).
    Keys are strings the caller chooses (e.g. "<environment>/<task id>")."""

    def __init__(self, patience: int = 1):
        _check(isinstance(patience, (int, np.integer)) and patience >= 1,
               f"task filter: patience must be an integer >= 1; got {patience!r}")
        self.patience = int(patience)
        self._streak: dict[str, int] = {}  # + all passed, - all failed, in a row

    def observe(self, key: str, pass_rate: float) -> None:
        """One group of task `key`: the share of its samples that passed."""
        _check(0 <= pass_rate <= 1, f"task filter: pass rate of {key!r} must be in [0, 1]; "
                                    f"got {pass_rate!r}")
        last = self._streak.get(key, 0)
        if pass_rate == 1:
            self._streak[key] = max(last, 0) + 1
        elif pass_rate == 0:
            self._streak[key] = min(last, 0) - 1
        else:
            self._streak.pop(key, None)

    def keep(self, key: str) -> bool:
        return abs(self._streak.get(key, 0)) < self.patience

    def skipped(self) -> dict[str, str]:
        """{key: "solved" | "unsolved"} of the tasks skipped now."""
        return {k: "solved" if s > 0 else "unsolved"
                for k, s in sorted(self._streak.items()) if abs(s) >= self.patience}

    def state(self) -> dict:
        return {"patience": self.patience, "streak": dict(self._streak)}

    def load(self, state: dict) -> None:
        _check(state["patience"] == self.patience,
               f"task filter: the saved state has patience {state['patience']}, this filter "
               f"{self.patience}: resume with the same setting")
        self._streak = {str(k): int(v) for k, v in state["streak"].items()}


def from_config(names: Sequence[str], weights: Sequence[float], section,
                seed: int) -> tuple[Adaptive, TaskFilter | None]:
    """The sampler and filter (None: filter_patience 0) of a config's adaptive section
    (`section_defaults`)."""
    adaptive = Adaptive(names, weights, mode=section.mode, fast=section.fast,
                        slow=section.slow, band=section.band, floor=section.floor, seed=seed)
    return adaptive, TaskFilter(section.filter_patience) if section.filter_patience else None


# ------------------------------------------------------------------ the config's section

def section_defaults() -> dict:
    """The config's tasks.adaptive section (`ptrain.config.defaults(closed_loop=True)`)."""
    return dict(mode="off",  # MODES: "off", "progress" or "band"
                fast=0.3, slow=0.05,  # EMA rates of each environment's pass rate
                band=(0.2, 0.8),  # mode "band": the pass rates drawn more
                floor=0.2,  # the share of the draw that always follows the weights (> 0)
                # > 0: skip a task after this many all-pass or all-fail groups in a row
                filter_patience=0)


def check_section(section, where: str) -> None:
    """A clear error for a bad option of an adaptive section (`section_defaults`)."""
    if section.filter_patience < 0:
        raise ValueError(f"config: {where}.filter_patience={section.filter_patience} must be "
                         ">= 0 (0: no task filter)")
    try:
        from_config(("check",), (1.0,), section, seed=0)
    except ValueError as e:
        raise ValueError(f"config: {where}: {e}") from None
