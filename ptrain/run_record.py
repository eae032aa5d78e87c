"""A run's start in its work dir: the config, inputs and environments checked, a resume's changed settings
allowed (and logged) or refused (with the reason), then the run record written
(`metrics.write_run_record`: config.json and command.txt, which launch/export.py reads).

  start(config, workdir, argv)  everything above, in that order: a refused start writes
                                nothing, so config.json stays the config of the checkpoints
  changes(old, new)             (key, old, new) of each setting that differs
  refusal(key)                  why `key` may not change on resume, or None (it may)
  ensure(config, workdir)       the record alone, where none is (learner.train from Python)

What may change on resume is written down in REFUSED (and in docs/closed_loop.md's table): the
shapes and meaning of what the checkpoints hold, the data stream they resume, the algorithm. Every
other setting may change (learning rates, steps, logging, checkpointing, evaluation, the
mesh, lengths), and each change is logged when the run starts.
"""

from __future__ import annotations

import json
import logging
import os
import sys

log = logging.getLogger("ptrain.run_record")

_SHAPES = "the checkpoints' parameter shapes (start a new workdir for another model)"
_DATA = "the data stream the checkpoint resumes is of these prompts and batch size"
_ALGO = "the algorithm: the checkpoint's state (critic, pending batches) is of the old one"
# A key (or a section, "name.") -> why it may not change when a run resumes.
REFUSED = {
    "model.": _SHAPES, "hf_model": _SHAPES, "tokenizer": _SHAPES + " and the vocabulary",
    "seed": "the data order and the sampling keys of the steps already trained",
    "data.sources": _DATA, "data.records_fn": _DATA, "data.prompts_per_step": _DATA,
    # the environments, their args (tasks, held-out splits) and weights
    "tasks.envs": _DATA + " and the held-out splits of the evaluations so far",
    "sampling.num_samples": "the batch's shape (groups of sampling.num_samples rows)",
    "rl.estimator": _ALGO, "rl.loss": _ALGO, "critic.init": _ALGO,
    "rl.staleness": _ALGO + " (the parameters of its pending batches)",
    "rl.interrupt": _ALGO + " (its pending batches)",
    "sft.sources": _DATA, "sft.records_fn": _DATA, "sft.batch_size": _DATA,
    "sft.packing": _DATA, "sft.seq_len": _DATA,
}


def refusal(key: str) -> str | None:
    """Why `key` (dotted) may not change on resume; None where it may (model.* run-time
    fields, such as remat and the attention kernel, may)."""
    from ptrain import model as model_lib
    if key.startswith("model.") and key.split(".", 1)[1] in model_lib.RUNTIME_FIELDS:
        return None
    for name, reason in REFUSED.items():
        if key == name or (name.endswith(".") and key.startswith(name)):
            return reason
    return None


def _flat(tree, prefix=""):
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def _as_json(config) -> dict:
    """A config as its record holds it (values JSON cannot hold as their repr)."""
    return json.loads(config.to_json_best_effort())


def changes(old: dict, new: dict) -> list[tuple[str, object, object]]:
    """(key, old value, new value) of each dotted key whose value differs (JSON values)."""
    a, b = _flat(old), _flat(new)
    return [(k, a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def _has_checkpoint(workdir) -> bool:
    for sub in (("checkpoints",), ("sft", "checkpoints")):
        path = os.path.join(workdir, *sub)
        if os.path.isdir(path) and any(n.isdigit() for n in os.listdir(path)):
            return True
    return False


def start(config, workdir, argv=None) -> None:
    """Checks the config (`ptrain.config.check`), its inputs (`ptrain.inputs`) and what its
    environments need here (`ptrain.preflight`); on a work
    dir with checkpoints, compares the config with the recorded one: a refused change raises
    (nothing written), an allowed one is logged; then (process 0) writes the run record."""
    from ptrain import config as config_lib
    from ptrain import inputs
    from ptrain import metrics
    from ptrain import preflight
    config_lib.check(config)
    inputs.check(config, workdir)
    preflight.check(config)
    file = os.path.join(workdir, metrics.CONFIG_FILE)
    if os.path.exists(file):
        with open(file) as f:
            old = json.load(f)
        diff = changes(old, _as_json(config))
        if _has_checkpoint(workdir):
            refused = [(k, a, b, refusal(k)) for k, a, b in diff if refusal(k)]
            if refused:
                raise ValueError(
                    f"config: cannot resume {workdir!r} with "
                    + "; ".join(f"{k} changed from {a!r} to {b!r} ({why})"
                                for k, a, b, why in refused)
                    + f". Set them back (as in {file}) or give a new --workdir.")
            what = "resuming"
        else:
            what = "restarting (no checkpoint yet)"
        for k, a, b in diff:
            log.warning("%s %s with %s changed: %r -> %r", what, workdir, k, a, b)
    import jax  # (which process writes)
    if jax.process_index() == 0:
        metrics.write_run_record(workdir, config, sys.argv if argv is None else argv)


def ensure(config, workdir) -> None:
    """The run record of a run started without `start` (learner.train or learner.sft called
    from Python), so that launch/export.py can read it: written when the work dir has none."""
    from ptrain import metrics
    import jax
    if jax.process_index() == 0 and not os.path.exists(
            os.path.join(workdir, metrics.CONFIG_FILE)):
        metrics.write_run_record(workdir, config, sys.argv)
