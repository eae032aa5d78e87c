"""Progress of SFT, RL and every evaluation: done / total, rate and ETA, as a tqdm bar when
stderr is a terminal, else (a log file: nohup, a batch job) a log line at the start, then at
most every `interval_s` seconds, plus the first and the last unit done.

    bar = Progress(total=100, desc="rl", unit="step", initial=start)
    bar.advance_to(step, reward=0.5)   # or bar.update(n)
    bar.close()
"""

from __future__ import annotations

import logging
import sys
import time

import tqdm

log = logging.getLogger("ptrain.progress")
INTERVAL_S = 30.0  # the most seconds between two log lines (when stderr is not a terminal)


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    return (f"{h}h{rest // 60:02d}m" if h else f"{rest // 60}m{rest % 60:02d}s")


class Progress:
    """One task's progress (see the module docstring). bar: True / False / None (whether
    stderr is a terminal) or a file to draw the bar on."""

    def __init__(self, total, *, desc: str, unit: str = "it", initial: int = 0,
                 bar=None, interval_s: float = INTERVAL_S, clock=time.monotonic,
                 enabled: bool = True):
        self.total, self.desc, self.unit = total, desc, unit
        self.done = self._start = initial
        self.interval_s, self._clock = interval_s, clock
        self._t0 = self._last = clock()
        self._logged_once = False
        self.enabled = enabled
        show = sys.stderr.isatty() if bar is None else bool(bar)
        self._bar = None
        if enabled and show:
            self._bar = tqdm.tqdm(total=total, initial=initial, desc=desc, unit=unit,
                                  dynamic_ncols=True,
                                  file=bar if hasattr(bar, "write") else None)
        elif enabled:  # (the first unit may take long: compiling, a first evaluation)
            log.info("%s: starting at %d%s %ss", desc, initial,
                     f"/{total}" if total else "", unit)

    def line(self) -> str:
        """"desc: done/total unit (pct), rate unit/s, ETA" of now."""
        elapsed = max(self._clock() - self._t0, 1e-9)
        rate = (self.done - self._start) / elapsed
        out = f"{self.desc}: {self.done}"
        if self.total:
            out += f"/{self.total} {self.unit}s ({100 * self.done / self.total:.0f}%)"
        else:
            out += f" {self.unit}s"
        out += f", {rate:.3g} {self.unit}/s" if rate >= 1 else (
            f", {1 / rate:.3g} s/{self.unit}" if rate > 0 else "")
        if self.total and rate > 0:
            out += f", ETA {_duration((self.total - self.done) / rate)}"
        return out + f", elapsed {_duration(elapsed)}"

    def update(self, n: int = 1, **postfix) -> None:
        self.advance_to(self.done + n, **postfix)

    def advance_to(self, done: int, **postfix) -> None:
        """`done` of the total so far; postfix: values shown beside it (numbers)."""
        if not self.enabled:
            return
        step, self.done = done - self.done, done
        shown = {k: f"{v:.3g}" if isinstance(v, float) else str(v) for k, v in postfix.items()}
        if self._bar is not None:
            if shown:
                self._bar.set_postfix(shown, refresh=False)
            self._bar.update(step)
            return
        now = self._clock()
        finished = self.total is not None and done >= self.total
        if not self._logged_once or finished or now - self._last >= self.interval_s:
            self._logged_once, self._last = True, now
            extra = "".join(f", {k} {v}" for k, v in shown.items())
            log.info("%s%s", self.line(), extra)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
