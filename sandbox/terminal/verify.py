"""What a task's own tests gave (`VerifierResult`): reward, and feedback a model can learn from.

The terminal domain's form of a judge report: ptrain turns it into a `ptrain.envs.Verdict`
(`ptrain.envs.terminal.verdict`) and that into a batch row, as for the other domains.

Harbor tasks write their reward to /logs/verifier/reward.json (a table of numbers; "reward"
is the one that counts) or reward.txt (one number), as harbor reads them. TB 1.0 tasks are
judged by pytest's result: the verifier's pytest reports each test's outcome through its
plugin (trusted/ptrain_verdict.py: pytest's report objects, one JSON file per pytest
session), never from the output the tested programs share; the task passes when the test
command exited 0, at least one test passed and none failed or errored.
"""

import dataclasses
import json
import math

_FAILING = ("FAILED", "ERROR")


@dataclasses.dataclass(frozen=True)
class VerifierResult:
    reward: float
    passed: bool                      # reward >= 1 (the task is solved)
    rewards: dict                     # every number the verifier reported
    tests: dict                       # test id -> PASSED / FAILED / ERROR / ... (if pytest ran)
    failures: tuple[str, ...]         # "test id - message" of each failing test
    error: str | None                 # why the verifier gave no usable result, if it did not
    output_tail: str                  # the end of the verifier's output
    timed_out: bool = False
    duration_s: float = 0.0
    exit_code: int | None = None
    dropped: tuple[str, ...] = ()     # what of the agent's state the verifier did not take

    @property
    def feedback(self) -> str:
        """A few lines: what failed and why, then the end of the output."""
        head = f"reward {self.reward:g}"
        if self.error:
            head += f": {self.error}"
        elif self.tests:
            bad = sum(s in _FAILING for s in self.tests.values())
            head += f": {len(self.tests) - bad} of {len(self.tests)} tests passed"
        lines = [head, *self.failures]
        if self.output_tail.strip():
            lines += ["--- verifier output (end) ---", self.output_tail.rstrip()]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "failures": list(self.failures)}


Verdict = VerifierResult  # the old name (ptrain.envs.Verdict is the learner's verdict)


def parse_reports(reports: dict[str, bytes]) -> tuple[dict, tuple[str, ...], list[int]]:
    """(test id -> status, failure lines, exit statuses) of the verdict plugin's reports
    ({file name: JSON}); a report that does not parse counts as an error."""
    tests, failures, statuses = {}, [], []
    for name in sorted(reports):
        try:
            rep = json.loads(reports[name])
            tests.update({str(k): str(v) for k, v in rep["tests"].items()})
            failures += [str(f) for f in rep["failures"]]
            statuses.append(int(rep["exitstatus"]))
        except (ValueError, KeyError, TypeError, AttributeError):
            tests[f"<report {name}>"] = "ERROR"
            failures.append(f"<report {name}> - not a report of the verifier's pytest")
    return tests, tuple(failures), statuses


def pytest_result(reports: dict[str, bytes], *, tail: str, exit_code: int | None = None,
                  **extra) -> VerifierResult:
    """TB 1.0: solved iff the test command exited 0, the verifier's pytest ran, at least one
    test passed and none failed."""
    tests, failures, statuses = parse_reports(reports)
    passed_n = sum(s in ("PASSED", "XFAIL") for s in tests.values())
    error = None
    if not statuses:
        error = "the verifier's pytest did not run (no report)"
    elif failures:
        error = None
    elif not passed_n:
        error = "no test passed"
    elif exit_code != 0:
        error = f"the test command exited with status {exit_code}"
    solved = error is None and bool(tests) and not failures and passed_n > 0
    reward = 1.0 if solved else 0.0
    return VerifierResult(reward, solved, {"reward": reward}, tests, failures, error, tail,
                          exit_code=exit_code, **extra)


def reward_file_result(files: dict[str, bytes], reports: dict[str, bytes], *, tail: str,
                       exit_code: int | None = None, **extra) -> VerifierResult:
    """Harbor: reward.json (numbers; its "reward", or its only number) before reward.txt;
    a test script killed by a signal (status 128 + N) scores 0."""
    tests, failures, _ = parse_reports(reports)
    rewards, error = {}, None
    if "reward.json" in files:
        try:
            parsed = json.loads(files["reward.json"])
        except ValueError as e:
            parsed, error = None, f"reward.json is not JSON: {e}"
        if parsed is not None:
            if isinstance(parsed, dict):
                rewards = {k: float(v) for k, v in parsed.items()
                           if isinstance(v, (int, float)) and not isinstance(v, bool)}
                if "reward" not in rewards and len(rewards) != 1 and "reward.txt" in files:
                    rewards.update(_reward_txt(files["reward.txt"])[0])
                if "reward" not in rewards and len(rewards) == 1:
                    rewards["reward"] = next(iter(rewards.values()))
                if "reward" not in rewards:
                    error = f"reward.json has no 'reward' number: {sorted(parsed)}"
            elif isinstance(parsed, (int, float)) and not isinstance(parsed, bool):
                rewards = {"reward": float(parsed)}
            else:
                error = "reward.json must be an object of numbers"
    elif "reward.txt" in files:
        rewards, error = _reward_txt(files["reward.txt"])
    else:
        error = "the tests wrote no /logs/verifier/reward.txt or reward.json"
    if error is None and exit_code is not None and exit_code > 128:
        error = f"the test script was killed (status {exit_code})"
    reward = rewards.get("reward", 0.0)
    if error is None and not math.isfinite(reward):
        error, reward = f"the reward is not a finite number: {reward}", 0.0
    if error is not None:
        reward = 0.0
    return VerifierResult(reward, reward >= 1.0, rewards, tests, failures, error, tail,
                          exit_code=exit_code, **extra)


def _reward_txt(data: bytes):
    text = data.decode("utf-8", "replace").strip()
    if not text:
        return {}, "reward.txt is empty"
    try:
        return {"reward": float(text)}, None
    except ValueError:
        return {}, f"reward.txt is not a number: {text[:80]!r}"


def failed_result(error: str, *, tail: str = "", **extra) -> VerifierResult:
    """Reward 0 with the reason (the verifier hung, the container died, ...)."""
    return VerifierResult(0.0, False, {}, {}, (), error, tail, **extra)
