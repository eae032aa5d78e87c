"""Alerts: a training run that goes wrong stops or warns, with a message that says what and why.

    monitor = alerts.Monitor(alerts.AlertConfig())        # or AlertConfig.from_config(c.alerts)
    fired = monitor.check(step, metrics)                  # after the step's metrics reach the host
    writer.write(step, {**metrics, **alerts.as_metrics(fired)})   # alert/<name> = 1 when fired
    alerts.raise_on_stop(fired)                           # before the step's checkpoint is saved

    with alerts.Watchdog(stall_minutes=30) as dog:        # a thread: no progress for N minutes
        for step in ...: ...; dog.beat(step)

Alerts, each with an action "stop" (raise `AlertStop`), "warn" (log) or "off":
- nonfinite: NaN or Inf in a loss or a gradient norm (stop: raised before the step's
  checkpoint is written, so the last checkpoint on disk is the last good one);
- reward_collapse: the mean reward of the last `reward_window` steps fell below
  `reward_collapse_ratio` x the best such mean so far (once that best was >= `reward_min_best`);
- kl_blowup: the KL to the reference (kl/k1) or the PPO KL (actor/ppo_kl) above `kl_max`;
- logp_mismatch: |sampler log-prob - learner log-prob| (rollout/logp_mismatch) above
  `logp_mismatch_max` (the sampler and the learner disagree: a bug, or bf16 drift);
- entropy_collapse: the policy's entropy below `entropy_min` while the mean reward is still
  below `entropy_reward_ceiling` (a policy that became deterministic without solving the tasks;
  one that solved them may well be deterministic);
- sandbox_errors: the share of the step's scored episodes whose sandbox failed (timeouts,
  worker or judge errors; `sandbox/error_rate`, see `sandbox_error_rate`) above
  `sandbox_error_rate_max`;
- stall (the Watchdog): no step finished for `stall_minutes`; "stop" dumps every thread's
  stack and exits the process (code 75) since a hung collective cannot be interrupted.
"""

from __future__ import annotations

import collections
import dataclasses
import faulthandler
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping

log = logging.getLogger("ptrain.alerts")

ACTIONS = ("stop", "warn", "off")
STALL_EXIT_CODE = 75  # EX_TEMPFAIL: a restart may well succeed
# Error types of an envs.Verdict that mean the sandbox failed rather than the program.
SANDBOX_ERRORS = ("timeout", "judge_error", "worker_error", "WorkerLost", "sandbox_error")
_ENTROPY_KEYS = ("actor/entropy",)  # SFT may well end near-deterministic
_KL_KEYS = ("kl/k1", "actor/ppo_kl")


class AlertStop(RuntimeError):
    """An alert with action "stop" fired; the message says which and why."""

    def __init__(self, alerts: list[Alert]):
        self.alerts = alerts
        super().__init__("training stopped by an alert:\n" + "\n".join(
            f"  {a.message}" for a in alerts))


@dataclasses.dataclass(frozen=True)
class Alert:
    name: str
    action: str  # "stop" or "warn"
    step: int
    message: str


@dataclasses.dataclass
class AlertConfig:
    """Thresholds and actions. Keys mirror the `alerts` section of a config."""
    nonfinite: str = "stop"
    reward_collapse: str = "warn"
    reward_window: int = 5
    reward_collapse_ratio: float = 0.3
    reward_min_best: float = 0.1
    kl_blowup: str = "warn"
    kl_max: float = 1.0
    logp_mismatch: str = "warn"
    logp_mismatch_max: float = 0.5
    entropy_collapse: str = "warn"
    entropy_min: float = 0.01
    entropy_reward_ceiling: float = 0.9
    sandbox_errors: str = "warn"
    sandbox_error_rate_max: float = 0.5
    stall: str = "warn"
    stall_minutes: float = 30.0

    def __post_init__(self):
        for name in ("nonfinite", "reward_collapse", "kl_blowup", "logp_mismatch",
                     "entropy_collapse", "sandbox_errors", "stall"):
            if getattr(self, name) not in ACTIONS:
                raise ValueError(f"alerts.{name}={getattr(self, name)!r}; use one of {ACTIONS}")
        if self.reward_window < 1:
            raise ValueError(f"alerts.reward_window={self.reward_window}; use >= 1")
        if self.stall_minutes <= 0:
            raise ValueError(f"alerts.stall_minutes={self.stall_minutes}; use > 0")

    @classmethod
    def from_config(cls, section: Mapping | None) -> AlertConfig:
        """From a config section (a ConfigDict or dict); an unknown key is an error."""
        if section is None:
            return cls()
        section = dict(section.to_dict() if hasattr(section, "to_dict") else section)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(section) - known)
        if unknown:
            raise ValueError(f"alerts: unknown keys {unknown}; known: {sorted(known)}")
        return cls(**section)


def defaults() -> dict:
    """The `alerts` config section with every key at its default."""
    return dataclasses.asdict(AlertConfig())


def sandbox_error_rate(error_types: Iterable[str]) -> float:
    """The share of verdicts (their `error_type`s) whose sandbox failed; 0.0 for none."""
    error_types = list(error_types)
    if not error_types:
        return 0.0
    return sum(e in SANDBOX_ERRORS for e in error_types) / len(error_types)


def _number(value) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


class Monitor:
    """Checks each step's host metrics; keeps the little history the alerts need."""

    def __init__(self, config: AlertConfig | None = None):
        self.config = config or AlertConfig()
        self._rewards: collections.deque = collections.deque(maxlen=self.config.reward_window)
        self._best_reward = -math.inf
        self.fired: list[Alert] = []  # every alert so far

    def state(self) -> dict:
        """The history the alerts read (JSON), for a checkpoint: a resumed run fires what the
        uninterrupted one would."""
        best = self._best_reward
        return {"rewards": list(self._rewards), "best_reward": None if best == -math.inf
                else best}

    def restore(self, state: dict | None) -> None:
        """Back to `state()` (None, from a checkpoint older than this: a fresh history)."""
        if state is None:
            return
        self._rewards.clear()
        self._rewards.extend(state["rewards"])
        best = state["best_reward"]
        self._best_reward = -math.inf if best is None else float(best)

    def check(self, step: int, metrics: Mapping) -> list[Alert]:
        """The alerts this step fires (each logged); `raise_on_stop` decides what stops."""
        c = self.config
        out: list[Alert] = []

        def fire(name, action, message):
            if action != "off":
                out.append(Alert(name, action, step, f"step {step}: {name}: {message}"))

        bad = sorted(k for k, v in metrics.items()
                     if ("loss" in k or "grad_norm" in k) and (x := _number(v)) is not None
                     and not math.isfinite(x))
        if bad:
            fire("nonfinite", c.nonfinite,
                 f"non-finite {', '.join(f'{k}={metrics[k]}' for k in bad)}; the update is "
                 "poisoned, so the step's checkpoint is not written (resume from the last one "
                 "with a lower learning rate, a tighter optim.grad_clip, or float32 params)")

        reward = _number(metrics.get("reward/mean"))
        if reward is not None and math.isfinite(reward):
            self._rewards.append(reward)
            if len(self._rewards) == c.reward_window:
                mean = sum(self._rewards) / len(self._rewards)
                best = self._best_reward
                if best >= c.reward_min_best and mean < c.reward_collapse_ratio * best:
                    fire("reward_collapse", c.reward_collapse,
                         f"mean reward of the last {c.reward_window} steps is {mean:.4g}, below "
                         f"{c.reward_collapse_ratio} x the best {best:.4g}; check the verifier "
                         "and the sandbox (sandbox/error_rate), or lower the learning rate")
                self._best_reward = max(best, mean)

        for key in _KL_KEYS:
            kl = _number(metrics.get(key))
            if kl is not None and kl > c.kl_max:
                fire("kl_blowup", c.kl_blowup,
                     f"{key}={kl:.4g} > alerts.kl_max={c.kl_max}; the policy runs away from "
                     "its reference: raise kl.coef, lower the learning rate or clip harder")

        mismatch = _number(metrics.get("rollout/logp_mismatch"))
        if mismatch is not None and mismatch > c.logp_mismatch_max:
            fire("logp_mismatch", c.logp_mismatch,
                 f"rollout/logp_mismatch={mismatch:.4g} > alerts.logp_mismatch_max="
                 f"{c.logp_mismatch_max}; the sampler and the learner compute different "
                 "log-probs (stale weights, a dtype or a masking difference)")

        for key in _ENTROPY_KEYS:
            entropy = _number(metrics.get(key))
            if entropy is None or entropy >= c.entropy_min:
                continue
            if key == "actor/entropy" and reward is not None and reward >= c.entropy_reward_ceiling:
                continue  # solved: a deterministic policy is fine
            fire("entropy_collapse", c.entropy_collapse,
                 f"{key}={entropy:.4g} < alerts.entropy_min={c.entropy_min}"
                 + (f" with reward/mean={reward:.4g}" if reward is not None else "")
                 + "; the policy stopped exploring: raise rl.entropy_coef or the temperature, "
                   "or clip_high (DAPO's clip-higher)")

        rate = _number(metrics.get("sandbox/error_rate"))
        if rate is not None and rate > c.sandbox_error_rate_max:
            fire("sandbox_errors", c.sandbox_errors,
                 f"sandbox/error_rate={rate:.3g} > alerts.sandbox_error_rate_max="
                 f"{c.sandbox_error_rate_max}: the sandbox times out or its workers fail, so "
                 "rewards are wrong; check the sandbox (workers, memory, reward.timeout_s)")

        for alert in out:
            (log.error if alert.action == "stop" else log.warning)("alert: %s", alert.message)
        self.fired.extend(out)
        return out


def as_metrics(fired: Iterable[Alert]) -> dict[str, float]:
    """alert/<name> = 1.0 for each fired alert (for metrics.jsonl and TensorBoard)."""
    return {f"alert/{a.name}": 1.0 for a in fired}


def raise_on_stop(fired: Iterable[Alert]) -> None:
    stops = [a for a in fired if a.action == "stop"]
    if stops:
        raise AlertStop(stops)


class Watchdog:
    """A daemon thread that fires when no `beat` came for `stall_minutes`.

    action "warn" logs (once per stall, again after the next beat); "stop" logs, dumps every
    thread's stack to stderr and exits the process with STALL_EXIT_CODE (a hung step, e.g. a
    collective waiting on a dead host, cannot be interrupted from Python). `on_stall(message)`
    replaces both (tests).
    """

    def __init__(self, stall_minutes: float = 30.0, action: str = "warn",
                 on_stall: Callable[[str], None] | None = None, poll_s: float | None = None):
        if action not in ACTIONS:
            raise ValueError(f"alerts.stall={action!r}; use one of {ACTIONS}")
        if stall_minutes <= 0:
            raise ValueError(f"alerts.stall_minutes={stall_minutes}; use > 0")
        self.stall_s = 60.0 * stall_minutes
        self.action = action
        self.on_stall = on_stall
        self.poll_s = poll_s if poll_s is not None else min(10.0, self.stall_s / 4)
        self.fired: list[str] = []
        self._last = time.monotonic()
        self._step = None
        self._armed = True
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ptrain-watchdog", daemon=True)

    def start(self) -> Watchdog:
        if self.action != "off":
            self._last = time.monotonic()
            self._thread.start()
        return self

    def beat(self, step: int | None = None) -> None:
        self._last = time.monotonic()
        self._step = step
        self._armed = True

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            idle = time.monotonic() - self._last
            if not self._armed or idle < self.stall_s:
                continue
            self._armed = False
            after = "the start" if self._step is None else f"step {self._step}"
            message = (f"stall: no step finished for {idle / 60:.1f} min (alerts.stall_minutes="
                       f"{self.stall_s / 60:g}) after {after}; a sandbox, the data, or a "
                       "collective waiting on another host is stuck")
            self.fired.append(message)
            if self.on_stall is not None:
                self.on_stall(message)
            elif self.action == "warn":
                log.warning("alert: %s", message)
            else:
                log.error("alert: %s; exiting with code %d", message, STALL_EXIT_CODE)
                print(f"alert: {message}", file=sys.stderr, flush=True)
                faulthandler.dump_traceback(all_threads=True)
                sys.stderr.flush()
                os._exit(STALL_EXIT_CODE)
