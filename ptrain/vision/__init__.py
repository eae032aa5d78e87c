"""Vision-language models: Qwen2.5-VL's vision tower, its image processing and M-RoPE.

  config.py            VisionConfig: the tower's architecture (HF `vision_config`)
  image_processing.py  images -> flattened 14x14x2 patches and grid sizes, as the HF
                       Qwen2-VL image processor makes them
  layout.py            per-patch rotary positions and attention segments (full / windowed),
                       and the padded `Images` batch the tower runs on
  positions.py         M-RoPE positions of a token sequence with image placeholders, and the
                       rope delta decoding continues with
  tower.py             the vision transformer and the 2x2 patch merger (Flax NNX)
  vl.py                VLModel: decoder + tower; image features merged at the image tokens
  hf.py                Qwen2_5_VLForConditionalGeneration checkpoints: load, save, export
  generate.py          greedy / sampled decoding of image prompts over the KV cache
"""
