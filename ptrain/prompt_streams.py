"""The RL step's and SFT's record streams: the static mixture of the config's sources (or
records in memory, or records_fn's written next to the run's logs), or the adaptive draw per
environment (`ptrain.mixture`); with many processes each reads its block of the global batch."""

import os

from ptrain import data as data_lib
from ptrain import jsonl
from ptrain import mixture
from ptrain import sharding


def step_prompts(c, workdir, *, sources=None, adaptive=None, mesh=None):
    """The RL step's prompt stream (`.iterator(state)`): the static mixture of `sources` or
    the config's (`prompt_stream`), or with `adaptive` enabled the adaptive draw
    (`mixture.AdaptiveDraw`) over them, one per environment; either way each process reads
    its block of the global batch (`sharding.row_block`)."""
    if not mixture.enabled(adaptive):
        return prompt_stream(c.data, c.data.prompts_per_step, c.seed, workdir, "prompts",
                              on_error=c.data.on_error, mesh=mesh, sources=sources)
    sources = list(c.data.sources) if sources is None else list(sources)
    if not sources or c.data.records_fn is not None:
        raise ValueError("tasks.adaptive draws per environment: give one prompt source per "
                         "environment (the closed loop's tasks.envs, or data.sources), not "
                         "data.records_fn")
    index, count = sharding.row_block(mesh)
    if c.data.prompts_per_step % count:
        raise ValueError(f"data.prompts_per_step={c.data.prompts_per_step} does not divide "
                         f"over the {count} processes that hold different rows; make it a "
                         "multiple of that")
    return mixture.AdaptiveDraw(sources, section=adaptive,
                                batch_size=c.data.prompts_per_step // count, seed=c.seed,
                                lag=c.rl.staleness, on_error=c.data.on_error,
                                process_index=index, process_count=count)


def prompt_stream(data, batch_size, seed, workdir, name, *, on_error, mesh=None, sources=None):
    """A `ptrain.data` stream over the config's sources, or over records_fn(seed) written to
    <workdir>/<name>.jsonl (so that the run's data is on disk next to its logs), or over
    `sources` given (records in memory, `data.prompt_batches`).

    `batch_size` is the global batch; with many processes each reads its own block of it
    (`sharding.row_block`), so that together they read what one process would."""
    if sources is not None and (data.sources or data.records_fn is not None):
        section = "sft" if name == "sft" else "data"
        raise ValueError(f"{name} are given in memory: leave {section}.sources and "
                         f"{section}.records_fn unset")
    sources = list(data.sources) if sources is None else list(sources)
    index, count = sharding.row_block(mesh)
    if batch_size % count:
        section = "sft.batch_size" if name == "sft" else "data.prompts_per_step"
        raise ValueError(f"{section}={batch_size} does not divide over the {count} processes "
                         "that hold different rows; make it a multiple of that")
    if data.records_fn is not None:
        path = os.path.join(workdir, f"{name}.jsonl")
        jsonl.write(data.records_fn(seed), path)  # each process (atomically)
        sources = [path]
    if not sources:
        section = "sft" if name == "sft" else "data"
        raise ValueError(f"no {name}: set {section}.sources (JSONL / ArrayRecord files) or "
                         f"{section}.records_fn")
    return data_lib.prompt_batches(sources, batch_size=batch_size // count, seed=seed,
                                   on_error=on_error, process_index=index,
                                   process_count=count)
