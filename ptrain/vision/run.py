"""A run's vision-language policy from its config: `hf_model` a Qwen2.5-VL directory
(`ptrain.vision.hf`), the `vision` section's patch budgets and tower freeze.

The learner and the closed loop ask here what they would ask `ptrain.hf` of a text model:
the decoder's ModelConfig (`text_config`), the model (`build`, `new`), and the rollouts'
image settings (`vision`); SFT records that name images get their rows' vision arrays
(`sft_arrays`). A text-only hf_model (or none) answers None / the text path everywhere.
"""

from __future__ import annotations

import os

from flax import nnx


def is_vl_dir(path: str) -> bool:
    """Whether a model directory's config.json is a Qwen2.5-VL one."""
    from ptrain import hf
    from ptrain.vision import hf as vhf
    return bool(path) and os.path.isfile(os.path.join(path, "config.json")) and \
        vhf.is_vl(hf.read_config(path))


def text_config(path: str):
    """The decoder's ModelConfig of a model directory (a VL one's text model)."""
    from ptrain import hf
    from ptrain.vision import hf as vhf
    d = hf.read_config(path)
    return vhf.config_from_hf(d).text if vhf.is_vl(d) else hf.config_from_hf(d)


def vl_config(config, text=None):
    """The run's VLConfig (None for a text model): hf_model's, its decoder replaced by `text`
    (the run's ModelConfig, with its run-time fields), the tower frozen as vision.freeze."""
    if not is_vl_dir(config.hf_model):
        return None
    check(config)
    from ptrain import hf
    from ptrain.vision import hf as vhf
    c = vhf.config_from_hf(hf.read_config(config.hf_model))
    return c.replace(text=text or c.text, vision=c.vision.replace(freeze=config.vision.freeze))


def check(config) -> None:
    """A VL hf_model with what the learner cannot yet do with it: a clear error first."""
    if config.lora.rank:
        raise ValueError(f"lora.rank={config.lora.rank} with a vision-language hf_model "
                         f"({config.hf_model}): LoRA is not wired for VL models yet; set "
                         "lora.rank=0")
    if config.rl.estimator == "gae":
        raise ValueError("rl.estimator='gae' with a vision-language hf_model: the critic "
                         "reads text only; use 'grpo' (or another critic-free estimator)")


def build(config, mesh, overrides: dict, param_dtype=None):
    """The VLModel of hf_model, born sharded, the decoder's run-time fields `overrides`."""
    from ptrain.vision import hf as vhf
    return vhf.load(config.hf_model, mesh=mesh, overrides=overrides, param_dtype=param_dtype,
                    vision_overrides={"freeze": config.vision.freeze})[0]


def new(vl, mesh):
    """An (uninitialised-shape) VLModel of VLConfig `vl`, for nnx.eval_shape / abstract."""
    from ptrain.vision import vl as vl_lib
    return vl_lib.VLModel(vl, rngs=nnx.Rngs(0), mesh=mesh)


def vision(config, vl, processing=None):
    """The rollouts' `rollout.images.Vision` (None for a text model): hf_model's image
    processing, the vision section's budgets."""
    if vl is None:
        return None
    from ptrain.rollout import images
    from ptrain.vision import hf as vhf
    return images.Vision(vl, processing or vhf.load_image_processing(config.hf_model),
                         prompt_patches=config.vision.prompt_patches,
                         observation_patches=config.vision.observation_patches)


def sft_arrays(batch, records, vis):
    """An SFT `Batch` with its rows' prompt images (records' "images": paths, as
    `ptrain.envs.charts.demonstration` writes them) as vision_* arrays padded to
    vis.prompt_patches; the batch unchanged when no record names images. A record with
    images and a text model is an error."""
    if not any(r.get("images") for r in records):
        return batch if vis is None else _with(batch, [None] * len(records), vis)
    if vis is None:
        raise ValueError("SFT records name images but the model reads text only: give a "
                         "vision-language hf_model (a Qwen2.5-VL directory)")
    from ptrain.vision import image_processing
    rows = []
    for i, r in enumerate(records):
        if not r.get("images"):
            rows.append(None)
            continue
        patches, grids = image_processing.preprocess(list(r["images"]), vis.processing)
        if len(patches) > vis.prompt_patches:
            raise ValueError(f"SFT record {i}: its images have {len(patches)} patches, over "
                             f"vision.prompt_patches={vis.prompt_patches}; raise it or lower "
                             "the image processing's max_pixels")
        rows.append((patches, grids))
    return _with(batch, rows, vis)


def _with(batch, rows, vis):
    from ptrain.vision import prompts
    return prompts.with_images(batch, rows, vis.config, n_patches=vis.prompt_patches)
