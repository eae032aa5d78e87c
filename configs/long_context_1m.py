"""The 1M-token plan: Llama-3.1-8B shapes trained on 1,048,576-token sequences (a dry run).

Nothing is downloaded or run: `launch.plan` builds the model abstractly, compiles the
long-context training step (`ptrain.step.packed_update`, the step packed SFT runs: ring
attention over the `sequence` axis, zigzag layout, full remat per layer, chunked log-probs
per sequence shard, AdamW with float32 parameters and moments, bfloat16 compute) for the mesh
below on simulated CPU devices, and reports per-device memory and FLOPs.

Command:  python -m launch.plan --config=configs/long_context_1m.py --out=plan_1m.json
          python -m launch.plan --config=configs/long_context_1m.py --search --out=search.json
          (--config.budget_gib=95 for TPU v5p, 140 for H200)
Hardware: any CPU (it simulates the devices); each compile takes 6-8 s on 2 cores. The plan
          is for 16 accelerators of at least 80 GB (H100 80 GB, TPU v5p, H200).
Expected: 16 devices (sequence=16): peak 72.1 GiB per device = 5.6 GiB of parameters and
          AdamW moments + 66.5 GiB of temporaries; 9.12e17 model FLOPs per step. --search
          (80, 95 or 140 GiB) answers this mesh; the best 8-device meshes need 141.2 GiB
          (sequence=8) and 218.1 GiB (sequence=4 x tensor=2); sequence=32 needs 37.2 GiB.
          (docs/benchmarks.md, "The 1M-token plan"). The attention kernels tie their mask
          inputs to q (`lax.optimization_barrier`) so that differentiating the layer scan
          does not hoist O(t^2) masks out of it (11,445 GiB per device without).
"""

from ptrain import config as config_lib


def get_config():
    """ptrain.config.plan_defaults() with what this plan changes."""
    c = config_lib.plan_defaults()
    c.lock()  # a key that plan_defaults() lacks is an error here
    # Llama-3.1-8B (meta-llama/Llama-3.1-8B config.json), RoPE rescaled for 1M positions
    # (Llama 3.1's recipe with factor 128 = 1M / 8K). model.* takes ModelConfig fields: the
    # model section is replaced whole.
    c.unlock()
    c.model = dict(vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                   d_ff=14336, rms_eps=1e-5, tie_embeddings=False, rope_theta=500000.0,
                   rope_type="llama3", rope_factor=128.0, rope_low_freq_factor=1.0,
                   rope_high_freq_factor=4.0, rope_original_max_position=8192,
                   max_position_embeddings=1048576, param_dtype="float32", dtype="bfloat16",
                   remat="full", attention_impl="ring", attn_block_q=512, attn_block_k=512)
    c.lock()
    c.seq_len = 1048576
    c.mesh.sequence = 16  # the search's answer for 80 GiB
    c.optim.update(warmup_steps=10, schedule="cosine", min_lr_ratio=0.1)
    return c
