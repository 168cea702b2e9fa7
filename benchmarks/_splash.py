"""JAX's splash attention at the configurations issue 43's sweep on a v5e found best, for
the benchmarks that compare with it (`tpu_vs_splash.py`, `gpu_check.py`)."""


def splash_kernel(causal: bool, length: int, heads: int, tiles: int, fused: bool):
    """A splash kernel object (heads-major, one call per example under `jax.vmap`): every
    tile `tiles` (at most `length`), with the fused backward (`fused`: best where its
    float32 dQ partials fit in HBM, with 1024 tiles) or the separate dQ kernel (512).
    Its mask tables are host NumPy, O(length^2) for a causal mask (about 11 s at 32K):
    build it once per shape, outside any timed region. It does not scale the logits:
    callers pre-scale q."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as splash,
        splash_attention_mask as splash_mask,
    )

    shape = (length, length)
    base = splash_mask.CausalMask(shape) if causal else splash_mask.FullMask(shape)
    b = min(tiles, length)
    # The fused backward computes dQ in the dK/dV kernel and takes no dQ tiles.
    dq = {} if fused else dict(block_q_dq=b, block_kv_dq=b)
    sizes = splash.BlockSizes(
        block_q=b, block_kv=b, block_kv_compute=b,
        block_q_dkv=b, block_kv_dkv=b, block_kv_dkv_compute=b,
        use_fused_bwd_kernel=fused, **dq,
    )  # fmt: skip
    return splash.make_splash_mha(
        splash_mask.MultiHeadMask([base] * heads), head_shards=1, q_seq_shards=1,
        block_sizes=sizes,
    )  # fmt: skip
