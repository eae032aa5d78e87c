"""A tiny random Qwen2.5-VL directory for configs/charts_toy.py on a CPU: the Qwen2.5 test
tokenizer (tests/hf_fixtures.py) with Qwen2.5-VL's chat template, a 2-layer decoder of width
64 and a 2-block tower of width 32, images up to 224x168 pixels (one chart page).

    PYTHONPATH=.:tests python examples/tiny_vl_model.py runs/tiny_vl
    python -m launch.train --config=configs/charts_toy.py:runs/tiny_vl --workdir=runs/charts
"""

import sys

from flax import nnx

import hf_fixtures
from ptrain import model
from ptrain.vision import config, hf as vhf, image_processing as ip, vl


def main(path: str) -> None:
    tokenizer = hf_fixtures.save_tokenizer("qwen2.5-instruct", path)
    tokenizer.chat_template = hf_fixtures.QWEN25_VL_TEMPLATE
    tokenizer.save_pretrained(path)
    ids = tokenizer.convert_tokens_to_ids
    text = model.ModelConfig(vocab_size=len(tokenizer) + 8, d_model=64, n_layers=2, n_heads=4,
                             n_kv_heads=2, d_ff=128, mrope_section=(2, 3, 3), family="qwen2",
                             qkv_bias=True)
    tower = config.VisionConfig(depth=2, d_model=32, n_heads=2, d_ff=64, out_d=64,
                                fullatt_blocks=(1,))
    c = vl.VLConfig(text, tower, image_token_id=ids("<|image_pad|>"),
                    video_token_id=ids("<|video_pad|>"),
                    vision_start_token_id=ids("<|vision_start|>"),
                    vision_end_token_id=ids("<|vision_end|>"))
    vhf.save(vl.VLModel(c, rngs=nnx.Rngs(0)), c, path,
             image_processing=ip.ImageProcessing(max_pixels=224 * 168))


if __name__ == "__main__":
    main(sys.argv[1])
