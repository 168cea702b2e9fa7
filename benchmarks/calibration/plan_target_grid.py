"""The memory model calibrated per target family against the real TPU and GPU compilers.

The analytic planner (`ringeqx.tools.plan` without `target=`) answers instantly from a model of
the arrays a program holds, each term's count fitted per family of compiler: XLA:CPU
(`benchmarks/calibration/plan_grid.py`), XLA:TPU (libtpu, TPU v5p slices) and XLA:GPU (the CUDA
plugin, H100s). This script measures the programs `ringeqx.tools.plan(..., target=...)` compiles
(the platform's Pallas kernel; an LM's parameters and Adam state fully sharded and
donated) on compile-only chips, fits the family's counts, and checks them on a grid they
were not fitted on.

    # in the TPU venv (jax[tpu]); then the same with --family gpu in the GPU venv
    python benchmarks/calibration/plan_target_grid.py --family tpu --measure fit --points 80
    python benchmarks/calibration/plan_target_grid.py --family tpu --measure fit-scan --points 30
    python benchmarks/calibration/plan_target_grid.py --family tpu --measure fit-ring --points 40
    python benchmarks/calibration/plan_target_grid.py --family tpu --measure fit-deep --points 30
    python benchmarks/calibration/plan_target_grid.py --family tpu --measure fit-long --points 20
    python benchmarks/calibration/plan_target_grid.py --family tpu --measure fit-heads --points 48
    python benchmarks/calibration/plan_target_grid.py --family tpu --measure fit-width --points 24
    python benchmarks/calibration/plan_target_grid.py --family tpu --measure fit-width --points 20 \
        --seed 2 --targets v5p:2x2x2 --tokens 4096 8192 16384  # (wide steps, 8 chips, long shards)
    python benchmarks/calibration/plan_target_grid.py --family tpu --measure fit-wide --points 24 \
        --seed 2 --targets v5p:2x2x2 --tokens 4096 8192
    python benchmarks/calibration/plan_target_grid.py --family tpu --measure fit-vocab --points 12 \
        --targets v5p:2x2x2 --tokens 4096 8192
    python benchmarks/calibration/plan_target_grid.py --family tpu --measure fit-many --points 18
    python benchmarks/calibration/plan_target_grid.py --family tpu --measure check
    python benchmarks/calibration/plan_target_grid.py --family tpu --fit  # writes the constants
    python benchmarks/calibration/plan_target_grid.py --family tpu --measure holdout
    python benchmarks/calibration/plan_target_grid.py --family tpu --measure blind
    python benchmarks/calibration/plan_target_grid.py --family tpu --measure fourth
    python benchmarks/calibration/plan_target_grid.py --family tpu --measure sixth
    python benchmarks/calibration/plan_target_grid.py --family tpu --measure seventh
    python benchmarks/calibration/plan_target_grid.py --family tpu --table      # the error tables

(`benchmarks/RESULTS.md` lists the runs behind the committed constants.)

`fit` points are a seeded random sample of small problems (attention of 2K-64K tokens a
chip; LMs of 1-3 layers, widths 256-2048; `fit-scan` the same LMs with scanned layers);
`check` points are a fixed grid of the shapes users plan for (Llama-3-8B's heads at long
shards; 2 layers of its widths and vocabulary, unrolled, and 4 and 8 scanned, under
each remat policy), none of which the sample holds; `holdout` points a second such grid
of Llama-3-70B's shapes, measured only once the model's terms were settled; `blind`
points a third (Qwen2-72B's widths, and Llama-3-70B's on 4 chips), measured once the
terms chosen with the second grid in view were settled; `fourth` points a fourth,
defined before it was compiled (see `fourth_grid`); `chip` a fifth, of single chips;
`sixth` a sixth, defined before `fit-heads` (attention of more head groupings) was
compiled and the model refitted on it (see `sixth_grid`); `seventh` a seventh, of many
chips and sequences longer than the vocabulary (see `seventh_grid`). Measurements
accumulate in `benchmarks/calibration/plan_calibration_{family}.json` (a point already
measured is not compiled again), so runs can be interrupted and resumed.
"""

import argparse
import json
import os
import random
import re
import sys
import time
from pathlib import Path


os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import numpy as np  # noqa: E402
from _constants import CONSTANTS, write_constants  # noqa: E402

import ringeqx as rx  # noqa: E402
from ringeqx.tools._planner import _analytic, _model as _plan_model, _plan, _problem  # noqa: E402


ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "longest_context.md"
MASKS = {
    "causal": rx.Causal(),
    "full": rx.Full(),
    "window": rx.SlidingWindow(4096),
    "documents": rx.Causal() & rx.Document(),
}
# Per family: the targets (chips) the sample draws from.
TARGETS = {"tpu": ("v5p:2x2x1", "v5p:2x2x2"), "gpu": ("h100:2", "h100:4", "h100:8")}
ATTENTION_HEADS = [(8, 2, 128), (16, 4, 128), (8, 8, 64), (4, 1, 128), (16, 2, 64)]
# (vocab, dim, heads, kv_heads): small LMs for the fit.
MODELS = [(4096, 256, 4, 2), (32000, 512, 8, 2), (8192, 1024, 8, 8), (50304, 2048, 16, 4)]
# (vocab, dim, heads, kv_heads): wide LMs of 2-8 layers for the fit, some with the large
# vocabularies of recent models (none is the check grid's Llama-3-8B width).
DEEP_MODELS = [
    (32000, 3072, 24, 8),
    (65536, 5120, 40, 8),
    (50304, 2048, 16, 4),
    (152064, 3584, 28, 4),
    (128256, 2048, 16, 8),
]
# (vocab, dim, heads, kv_heads): the widest LMs for the fit (`fit-wide`), as wide as
# Llama-3-70B but none of its shapes (its vocabulary, heads and MLP width together).
WIDE_MODELS = [(65536, 8192, 64, 8), (100352, 6144, 48, 8), (32000, 7168, 56, 8)]
# (vocab, dim, heads, kv_heads): wide LMs whose vocabulary outnumbers the sequence's tokens
# at 4K-8K tokens a chip on 8 chips (`fit-vocab`), where libtpu gathers the sequence for
# the head rather than its weight; `WIDE_MODELS` at width 8192 have fewer words than that.
VOCAB_MODELS = [(152064, 8192, 64, 8), (256000, 6144, 48, 8)]
# Tokens a chip of the wide LMs (`--tokens` draws from others).
DEEP_TOKENS = [2048, 4096, 8192]
# Llama-3's shapes; `hidden` is 1.5x the gated MLP's, so that the plain MLP's two matrices
# hold as many parameters as its three.
LLAMA_8B = dict(heads=32, kv_heads=8, dim=4096, vocab_size=128256, hidden=21504)
LLAMA_70B = dict(heads=64, kv_heads=8, dim=8192, vocab_size=128256, hidden=43008)
QWEN2_72B = dict(heads=64, kv_heads=8, dim=8192, vocab_size=152064, hidden=44352)
MISTRAL_LARGE_2 = dict(heads=96, kv_heads=8, dim=12288, vocab_size=32768, hidden=43008)
WIDE_HEADS = dict(heads=16, kv_heads=8, dim=4096, vocab_size=256000, hidden=21504)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _chips(target: str) -> int:
    return _problem.target_chips(target)


def _split(rng: random.Random, target: str) -> tuple[int, int]:
    """`(batch_devices, num_devices)` of `target`'s chips: the ring gets at least 2."""
    chips = _chips(target)
    bd = rng.choice([1, 2]) if chips >= 4 else 1
    return bd, chips // bd


def attention_sample(rng: random.Random, family: str) -> dict:
    target = rng.choice(TARGETS[family])
    bd, p = _split(rng, target)
    h, kh, d = rng.choice(ATTENTION_HEADS)
    per_chip = rng.choice([2048, 4096, 8192, 16384, 32768, 65536])
    return dict(
        kind="attention",
        target=target,
        seq_len=per_chip * p,
        num_devices=p,
        batch_devices=bd,
        batch=bd * rng.choice([1, 2]),
        heads=h,
        kv_heads=kh,
        head_dim=d,
        dtype=rng.choice(["bfloat16", "bfloat16", "float32"]),
        mask=rng.choice(list(MASKS)),
        remat="none",
    )


def long_sample(rng: random.Random, family: str) -> dict:
    """Attention on a shard of 8K-64K tokens a chip."""
    cfg = attention_sample(rng, family)
    per_chip = rng.choice([8192, 16384, 32768, 65536])
    return dict(cfg, seq_len=per_chip * cfg["num_devices"])


# Head groupings for `fit-heads`: 4-96 heads of 64-256, 1-12 query heads a K/V head (the
# other samples hold 4-16 heads and no 256-wide ones; none is a held-out grid's).
WIDE_ATTENTION_HEADS = [
    (48, 8, 128), (96, 8, 128), (28, 4, 128), (32, 32, 128),
    (8, 4, 256), (32, 8, 256), (48, 8, 64), (16, 16, 64),
]  # fmt: skip


def heads_sample(rng: random.Random, family: str) -> dict:
    """Attention of `WIDE_ATTENTION_HEADS` on shards of 8K-48K tokens a chip, both sides
    of libtpu's switch near 23K (where its buffers per q-sized array step up by a level
    that depends on the head grouping)."""
    cfg = long_sample(rng, family)
    h, kh, d = rng.choice(WIDE_ATTENTION_HEADS)
    per_chip = rng.choice([8192, 12288, 16384, 20480, 24576, 32768, 49152])
    return dict(cfg, heads=h, kv_heads=kh, head_dim=d, seq_len=per_chip * cfg["num_devices"])


def lm_sample(rng: random.Random, family: str, scan: bool = False, ring: bool = False) -> dict:
    """A small LM step on one of `family`'s targets (`ring`: on a ring of every chip)."""
    target = rng.choice(TARGETS[family])
    bd, p = (1, _chips(target)) if ring else _split(rng, target)
    vocab, dim, h, kh = rng.choice(MODELS)
    per_chip = rng.choice([1024, 2048, 4096, 8192, 16384])
    return dict(
        kind="lm",
        target=target,
        seq_len=per_chip * p,
        num_devices=p,
        batch_devices=bd,
        batch=bd,
        heads=h,
        kv_heads=kh,
        dim=dim,
        num_layers=rng.choice([1, 2, 3]),
        vocab_size=vocab,
        hidden=rng.choice([3, 4]) * dim,
        mask=rng.choice(["causal", "causal", "documents", "window"]),
        remat=rng.choice(["none", "attention", "block"]),
        **({"scan_layers": True} if scan else {}),
    )


def deep_sample(rng: random.Random, family: str, scan: bool) -> dict:
    """A wide LM step of 2-8 layers on a ring of all of one of `family`'s targets."""
    target = rng.choice(TARGETS[family])
    vocab, dim, h, kh = rng.choice(DEEP_MODELS)
    per_chip = rng.choice(DEEP_TOKENS)
    return dict(
        kind="lm", target=target, seq_len=per_chip * _chips(target), num_devices=_chips(target),
        batch_devices=1, batch=1, heads=h, kv_heads=kh, dim=dim,
        num_layers=rng.choice([2, 4, 8] if scan else [2, 3]), vocab_size=vocab,
        hidden=rng.choice([3, 4]) * dim, mask="causal",
        remat=rng.choice(["none", "attention", "block"]), scan_layers=scan,
    )  # fmt: skip


def width_sample(rng: random.Random, family: str, scan: bool) -> dict:
    """A deep sample whose MLP is 2-6 times as wide as the model (`deep_sample`'s are 3 or
    4 times): without it the activations of width `dim` and of width `hidden` are nearly
    proportional in the sample, and their counts cannot be told apart."""
    cfg = deep_sample(rng, family, scan)
    hidden = int(rng.choice([2.0, 2.5, 5.0, 5.5, 6.0]) * cfg["dim"]) // 256 * 256
    return dict(cfg, hidden=hidden)


def wide_sample(rng: random.Random, family: str, scan: bool) -> dict:
    """A `width_sample` of 6144-8192 wide models (the others stop at 5120)."""
    cfg = width_sample(rng, family, scan)
    vocab, dim, h, kh = rng.choice(WIDE_MODELS)
    hidden = int(rng.choice([2.5, 3.5, 4.5, 5.5]) * dim) // 256 * 256
    return dict(cfg, vocab_size=vocab, dim=dim, heads=h, kv_heads=kh, hidden=hidden)


def vocab_sample(rng: random.Random, family: str, scan: bool) -> dict:
    """A `wide_sample` of `VOCAB_MODELS`."""
    cfg = wide_sample(rng, family, scan)
    vocab, dim, h, kh = rng.choice(VOCAB_MODELS)
    hidden = int(rng.choice([2.5, 3.5, 4.5, 5.5]) * dim) // 256 * 256
    return dict(cfg, vocab_size=vocab, dim=dim, heads=h, kv_heads=kh, hidden=hidden)


# Rings longer than `TARGETS`' (`fit-many`).
MANY_CHIPS = {
    "tpu": ("v5p:2x2x4", "v5p:2x4x4", "v5p:4x4x4"),
    "gpu": ("h100:16", "h100:32", "h100:64"),
}


def many_sample(rng: random.Random, family: str, i: int) -> dict:
    """A wide LM step on a ring of 16-64 chips (`fit-many`): every remat policy in turn,
    unrolled and scanned in turn. On long rings the sequence outnumbers the vocabulary
    many times over (64 chips of 8K tokens: 4 times Llama-3's 128256 words), and the
    compilers gather the head's weight, not every chip's activations."""
    scan = (i // 3) % 2 == 1
    target = rng.choice(MANY_CHIPS[family])
    vocab, dim, h, kh = rng.choice(DEEP_MODELS)
    per_chip = rng.choice([2048, 4096, 8192])
    return dict(
        kind="lm", target=target, seq_len=per_chip * _chips(target),
        num_devices=_chips(target), batch_devices=1, batch=1, heads=h, kv_heads=kh,
        dim=dim, num_layers=rng.choice([2, 4] if scan else [2, 3]), vocab_size=vocab,
        hidden=rng.choice([3, 4]) * dim, mask="causal",
        remat=("none", "attention", "block")[i % 3], scan_layers=scan,
    )  # fmt: skip


ONE_CHIP = {"tpu": ("v5e:1x1", "v5p:1x1x1"), "gpu": ("h100:1",)}


def chip_sample(rng: random.Random, family: str, i: int) -> dict:
    """An LM step on a single chip (`fit-chip`): every remat policy in turn, unrolled and
    scanned in turn, widths up to 5120. With no ring the compilers hold what a ring of
    chips would not (a v5e's LM step under remat "attention" at 36K tokens compiled to
    more than 1.28x what the ring-fitted counts said), so one chip is a regime of its
    own."""
    scan = (i // 3) % 2 == 1
    vocab, dim, h, kh = rng.choice(MODELS + DEEP_MODELS)
    per_chip = rng.choice([4096, 8192, 16384, 32768])
    return dict(
        kind="lm", target=rng.choice(ONE_CHIP[family]), seq_len=per_chip, num_devices=1,
        batch_devices=1, batch=1, heads=h, kv_heads=kh, dim=dim,
        num_layers=rng.choice([2, 4, 8] if scan else [1, 2, 3]), vocab_size=vocab,
        hidden=rng.choice([3, 4]) * dim, mask=rng.choice(["causal", "documents", "window"]),
        remat=("none", "attention", "block")[i % 3], scan_layers=scan,
    )  # fmt: skip


def _eight_and_four(family: str) -> tuple[str, str]:
    """The family's 8-chip and 4-chip targets."""
    return (TARGETS[family][-1], TARGETS[family][0]) if family == "tpu" else (
        "h100:8", "h100:4")  # fmt: skip


def _lm_steps(rows) -> list[dict]:
    """Causal LM steps on a ring of every chip, one per `(target, chips, model, layers,
    tokens a chip, scanned)` row and remat policy."""
    out = []
    for target, chips, model, layers, per_chip, scan in rows:
        for remat in ("none", "attention", "block"):
            out.append(dict(
                kind="lm", target=target, num_devices=chips, batch_devices=1, batch=1,
                seq_len=per_chip * chips, num_layers=layers, mask="causal", remat=remat,
                **({"scan_layers": True} if scan else {}), **model,
            ))  # fmt: skip
    return out


def _attention_programs(rows) -> list[dict]:
    """Causal bfloat16 attention on a ring of every chip, one per `(target, chips, (heads,
    kv_heads, head_dim), tokens a chip)` row."""
    return [
        dict(kind="attention", target=target, num_devices=chips, batch_devices=1, batch=1,
             seq_len=per_chip * chips, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
             dtype="bfloat16", mask="causal", remat="none")
        for target, chips, (heads, kv_heads, head_dim), per_chip in rows
    ]  # fmt: skip


def check_grid(family: str) -> list[dict]:
    """The held-out grid: Llama-3-8B's attention at long shards, and 2 layers of its LM
    under each remat policy, on the family's 8-chip target."""
    target = _eight_and_four(family)[0]
    out = []
    for per_chip in (49152, 98304, 196608):
        for mask in ("causal", "documents"):
            out.append(dict(
                kind="attention", target=target, seq_len=per_chip * 8, num_devices=8,
                batch_devices=1, batch=1, heads=32, kv_heads=8, head_dim=128,
                dtype="bfloat16", mask=mask, remat="none",
            ))  # fmt: skip
    return out + _lm_steps([
        (target, 8, LLAMA_8B, 2, 4096, False),
        (target, 8, LLAMA_8B, 2, 12288, False),
        (target, 8, LLAMA_8B, 8, 8192, True),
        (target, 8, LLAMA_8B, 4, 16384, True),
    ])  # fmt: skip


def holdout_grid(family: str) -> list[dict]:
    """A second held-out grid, measured after the model's terms were settled on the
    first: Llama-3-70B's attention, 2 unrolled layers of its LM and 4 scanned, under each
    remat policy, on the family's 8-chip target."""
    target = _eight_and_four(family)[0]
    out = _attention_programs([(target, 8, (64, 8, 128), n) for n in (32768, 65536)])
    return out + _lm_steps([
        (target, 8, LLAMA_70B, 2, 4096, False), (target, 8, LLAMA_70B, 4, 8192, True),
    ])  # fmt: skip


def blind_grid(family: str) -> list[dict]:
    """A third held-out grid, measured once the `stacked` term (fitted after the second
    grid had been seen) was settled: Qwen2-72B's widths (vocabulary 152064, its gated
    MLP's 29568 as 44352 ungated) on 8 chips, 2 unrolled and 8 scanned layers, and
    Llama-3-70B's on 4 chips, 4 scanned layers, under each remat policy; and Qwen2-72B's
    attention on 8 chips."""
    eight, four = _eight_and_four(family)
    out = _attention_programs([(eight, 8, (64, 8, 128), n) for n in (16384, 131072)])
    return out + _lm_steps([
        (eight, 8, QWEN2_72B, 2, 8192, False),
        (eight, 8, QWEN2_72B, 8, 4096, True),
        (four, 4, LLAMA_70B, 4, 4096, True),
    ])  # fmt: skip


def fourth_grid(family: str) -> list[dict]:
    """A fourth held-out grid, defined and measured once the TPU's `q32_long` term (chosen
    after the third grid had been seen; taken out again on this grid's answer) was
    settled: attention of Llama-3-405B's heads (128/8 of 128) on 8 chips, of 256-wide
    heads (16/8) and of 64-wide ones (24/4) on 4, each side of libtpu's shard-length
    switch; Mistral-Large-2's LM widths (12288, vocabulary 32768, its gated 28672 as 43008
    ungated, 96/8 heads) on 8 chips, 2 unrolled and 4 scanned layers; and a 256-wide-head
    LM with a 256000-word vocabulary (width 4096, 16/8 heads), 8 scanned layers on 4
    chips; every LM under each remat policy."""
    eight, four = _eight_and_four(family)
    out = _attention_programs([
        (eight, 8, (128, 8, 128), 12288), (eight, 8, (128, 8, 128), 40960),
        (four, 4, (16, 8, 256), 20480), (four, 4, (16, 8, 256), 28672),
        (four, 4, (24, 4, 64), 10240), (four, 4, (24, 4, 64), 20480),
    ])  # fmt: skip
    return out + _lm_steps([
        (eight, 8, MISTRAL_LARGE_2, 2, 4096, False),
        (eight, 8, MISTRAL_LARGE_2, 4, 4096, True),
        (four, 4, WIDE_HEADS, 8, 8192, True),
    ])  # fmt: skip


# Qwen2.5-32B's LM widths (its gated MLP's 27648 as 41472 ungated).
QWEN25_32B = dict(heads=40, kv_heads=8, dim=5120, vocab_size=152064, hidden=41472)


def sixth_grid(family: str) -> list[dict]:
    """A sixth held-out grid, defined and committed before the `fit-heads` sample was
    compiled or the model refitted on it: attention of head groupings no fit or grid held
    (56/8 of 128 on 8 chips, 12/2 of 256 and 40/8 of 64 on 4), each side of libtpu's
    shard-length switch; and Qwen2.5-32B's LM widths, 2 unrolled layers at 8K tokens a
    chip on 8 chips and 4 scanned at 8K on 4, under each remat policy."""
    eight, four = _eight_and_four(family)
    out = _attention_programs([
        (eight, 8, (56, 8, 128), 14336), (eight, 8, (56, 8, 128), 36864),
        (four, 4, (12, 2, 256), 16384), (four, 4, (12, 2, 256), 32768),
        (four, 4, (40, 8, 64), 9216), (four, 4, (40, 8, 64), 24576),
    ])  # fmt: skip
    return out + _lm_steps([
        (eight, 8, QWEN25_32B, 2, 8192, False),
        (four, 4, QWEN25_32B, 4, 8192, True),
    ])  # fmt: skip


def seventh_grid(family: str) -> list[dict]:
    """A seventh held-out grid, defined and committed before the model was changed for
    sequences longer than the vocabulary (the longest-context table's rows on 64 and
    256 v5p chips were predicted at 1.7-6.2 times their compiled bytes): on TPUs, rings
    of 16, 32 and 64 chips, which no fit holds: Llama-3-8B's attention at 32K tokens a
    chip on 16 and at 64K on 64; 8 scanned layers of its LM at 16K on 16 chips, 2
    unrolled at 4K on 32, and 4 scanned layers of Llama-3-70B's at 8K on 64. On 8 H100s,
    sequences longer than the vocabulary: 8 scanned layers of 8B's LM at 24K tokens a
    chip and 2 unrolled of 70B's at 24K. Every LM under each remat policy."""
    if family == "tpu":
        out = _attention_programs([
            ("v5p:2x2x4", 16, (32, 8, 128), 32768), ("v5p:4x4x4", 64, (32, 8, 128), 65536),
        ])  # fmt: skip
        return out + _lm_steps([
            ("v5p:2x2x4", 16, LLAMA_8B, 8, 16384, True),
            ("v5p:2x4x4", 32, LLAMA_8B, 2, 4096, False),
            ("v5p:4x4x4", 64, LLAMA_70B, 4, 8192, True),
        ])  # fmt: skip
    return _lm_steps([
        ("h100:8", 8, LLAMA_8B, 8, 24576, True),
        ("h100:8", 8, LLAMA_70B, 2, 24576, False),
    ])  # fmt: skip


# The 0.3B-parameter LM `benchmarks/calibration/plan_on_chip.py` runs on a real v5e chip.
CHIP_LM = dict(heads=16, kv_heads=8, dim=2048, vocab_size=32000, hidden=5632)


def chip_grid(family: str) -> list[dict]:
    """A held-out grid of single-chip LM steps, defined before it was compiled (once the
    `-p1` regimes were fitted): `plan_on_chip.py`'s 0.3B LM, 4 unrolled layers at 8K and
    24K tokens, on a v5e (an H100 for the GPU), and 2 unrolled layers of Llama-3-8B's
    widths at 8K on a v5p chip (an H100), under each remat policy."""
    small, large = ("v5e:1x1", "v5p:1x1x1") if family == "tpu" else ("h100:1", "h100:1")
    return _lm_steps([
        (small, 1, CHIP_LM, 4, 8192, False),
        (small, 1, CHIP_LM, 4, 24576, False),
        (large, 1, LLAMA_8B, 2, 8192, False),
    ])  # fmt: skip


def make_plan(cfg: dict) -> rx.tools.Plan:
    """The plan of `cfg` from the model alone (its knobs fixed; no compile)."""
    kw = {k: v for k, v in cfg.items() if k not in ("kind", "target")}
    kw["mask"] = MASKS[cfg["mask"]]
    kw["device"] = _problem.target_profile(cfg["target"], "cpu", _chips(cfg["target"]))
    # The analytic planner's first candidate, built directly: `rx.tools.plan` refuses a regime
    # the model was never calibrated for, which is what a fit calibrates.
    problem, (remat,) = _problem.problem(max_memory_usage=2**50, **kw)
    tiles = _analytic.kernel_tiles(problem)
    memory = _analytic.predict(problem, tiles[0], remat, problem.num_devices)
    return _plan.make_plan(problem, tiles[0], remat, memory, tiles=tiles)


def measure(cfg: dict) -> dict:
    """What the target's compiler allocates for `cfg`'s program, per chip."""
    kw = {k: v for k, v in cfg.items() if k != "kind"}
    kw["mask"] = MASKS[cfg["mask"]]
    try:
        p = rx.tools.plan(max_memory_usage=2**50, **kw)
    except rx.tools.NoFit as e:  # refused by the compiler as larger than a chip
        return {"refused": str(e)[:300], "seconds": e.seconds}
    c = p.compiled
    return {
        "arguments": c.arguments,
        "outputs": c.outputs,
        "temp": c.temp,
        "total": c.total,
        "seconds": round(c.seconds, 1),
    }


def _data(family: str) -> Path:
    return Path(__file__).with_name(f"plan_calibration_{family}.json")


def _load(family: str) -> list[dict]:
    path = _data(family)
    return json.loads(path.read_text()) if path.exists() else []


def run_measure(args) -> None:
    if args.targets:  # a sample on these targets only
        TARGETS[args.family] = tuple(args.targets)
    if args.tokens:  # wide LMs of these tokens a chip
        DEEP_TOKENS[:] = args.tokens
    rows = _load(args.family)
    done = {json.dumps(r["cfg"], sort_keys=True) for r in rows}
    if args.measure == "fit":
        rng = random.Random(args.seed)
        sample = [
            (attention_sample if i % 2 == 0 else lm_sample)(rng, args.family)
            for i in range(args.points)
        ]
    elif args.measure == "fit-scan":  # LMs with scanned layers
        rng = random.Random(args.seed + 1)
        sample = [lm_sample(rng, args.family, scan=True) for _ in range(args.points)]
    elif args.measure == "fit-long":  # attention on long shards
        rng = random.Random(args.seed + 4)
        sample = [long_sample(rng, args.family) for _ in range(args.points)]
    elif args.measure == "fit-heads":  # attention of more head groupings
        rng = random.Random(args.seed + 9)
        sample = [heads_sample(rng, args.family) for _ in range(args.points)]
    elif args.measure == "fit-deep":  # wide LMs, scanned and unrolled
        rng = random.Random(args.seed + 3)
        sample = [deep_sample(rng, args.family, i % 3 != 2) for i in range(args.points)]
    elif args.measure == "fit-width":  # wide LMs whose MLP width varies more
        rng = random.Random(args.seed + 5)
        sample = [width_sample(rng, args.family, i % 2 == 0) for i in range(args.points)]
    elif args.measure == "fit-wide":  # the widest LMs
        rng = random.Random(args.seed + 6)
        sample = [wide_sample(rng, args.family, i % 2 == 0) for i in range(args.points)]
    elif args.measure == "fit-vocab":  # wide LMs of large vocabularies
        rng = random.Random(args.seed + 7)
        sample = [vocab_sample(rng, args.family, i % 2 == 0) for i in range(args.points)]
    elif args.measure == "fit-ring":  # LMs on a ring of every chip, unrolled and scanned
        rng = random.Random(args.seed + 2)
        sample = [
            lm_sample(rng, args.family, scan=i % 2 == 1, ring=True) for i in range(args.points)
        ]
    elif args.measure == "fit-many":  # LMs on rings of 16-64 chips
        rng = random.Random(args.seed + 10)
        sample = [many_sample(rng, args.family, i) for i in range(args.points)]
    elif args.measure == "fit-chip":  # LMs on one chip
        rng = random.Random(args.seed + 8)
        sample = [chip_sample(rng, args.family, i) for i in range(args.points)]
    elif args.measure == "chip":
        sample = chip_grid(args.family)
    elif args.measure == "holdout":
        sample = holdout_grid(args.family)
    elif args.measure == "blind":
        sample = blind_grid(args.family)
    elif args.measure == "fourth":
        sample = fourth_grid(args.family)
    elif args.measure == "sixth":
        sample = sixth_grid(args.family)
    elif args.measure == "seventh":
        sample = seventh_grid(args.family)
    else:
        sample = check_grid(args.family)
    for i, cfg in enumerate(sample):
        key = json.dumps(cfg, sort_keys=True)
        if key in done:
            continue
        start = time.perf_counter()
        measured = measure(cfg)
        log(f"[{args.measure} {i + 1}/{len(sample)}] {time.perf_counter() - start:5.1f} s "
            f"{cfg} -> {measured.get('total', measured.get('refused'))}")  # fmt: skip
        # Read again before writing: another run may be measuring into the same file.
        rows = _load(args.family) + [{"split": args.measure, "cfg": cfg, "measured": measured}]
        done.add(key)
        _data(args.family).write_text(json.dumps(rows, indent=1) + "\n")


def _rows(family: str, split: str) -> list[dict]:
    """Measured rows of `split` with their features, regime and exact bytes of
    arguments and outputs under the present model."""
    out = []
    for r in _load(family):
        if r["split"].partition("-")[0] != split or "total" not in r["measured"]:
            continue
        problem = _analytic.plan_problem(make_plan(r["cfg"]))
        features, regime, io = _plan_model.terms(problem)
        out.append(dict(r, features=features, regime=regime, io=io))
    return out


def _calibrated(row: dict) -> bool:
    """Whether the model is fitted on a measured row: attention on shards of 8K tokens a
    chip or more; LM steps of 1 GiB a chip or more whose ring is every chip.

    Smaller programs are left out because they fit any accelerator and their bytes are
    dominated by what the compilers allocate in other ways: below 8K tokens a chip,
    libtpu keeps fewer q-sized buffers of attention live (the counts that fit longer
    shards within 3% are 20-30% off there); small LMs' bytes are the compilers' fixed
    scratch more than their arrays. With a "batch" axis too, the fully sharded
    parameters and the activations are sharded over different axes, and the compilers
    reshard between them in ways the model's terms do not follow (XLA:GPU warns of
    "involuntary full rematerialization"; up to 2.5x the temp of the same step with
    batch_devices=1): there, ask the compiler (`target=`)."""
    cfg = row["cfg"]
    if cfg["kind"] == "attention":
        return cfg["seq_len"] // cfg["num_devices"] >= 8192
    return cfg["batch_devices"] == 1 and row["measured"]["total"] >= 2**30


# The LM's terms whose count is one for every regime of a family (the parameters' shards,
# one layer's attention, the ring's buffers in flight): the rest (the activations each
# remat policy keeps, the logits, the gathered embedding and layers, whose lifetimes the
# policy changes) are fitted per regime, in the same least squares.
SHARED = ("gradients", "attention", "in_flight", "const")


def fit_family(
    rows: list[dict], kind: str, shared: tuple[str, ...] = ()
) -> dict[str, dict[str, float]]:
    """Per regime of `kind`, the counts that minimise the relative error of the total
    (non-negative least squares); the `shared` terms' counts are common to every
    regime, fitted on all of them at once."""
    from scipy.optimize import nnls

    group = [r for r in rows if r["cfg"]["kind"] == kind and _calibrated(r)]
    regimes = sorted({r["regime"] for r in group})
    names = sorted(group[0]["features"])
    columns = [(n, None) for n in names if n in shared]
    columns += [(n, g) for g in regimes for n in names if n not in shared]
    def row(r: dict) -> list[float]:
        return [r["features"][n] if g in (None, r["regime"]) else 0.0 for n, g in columns]

    a = np.array([row(r) for r in group], dtype=np.float64)
    total = np.array([r["measured"]["total"] for r in group], dtype=np.float64)
    b = total - np.array([r["io"] for r in group])
    coef, _ = nnls(a / total[:, None], b / total)
    err = (a @ coef + total - b) / total - 1
    out = {}
    for regime in regimes:
        out[regime] = {
            n: round(float(c), 4) for (n, g), c in zip(columns, coef) if c and g in (None, regime)
        }
        e = err[[r["regime"] == regime for r in group]]
        log(f"  {kind} {regime}: {len(e)} points, error {e.min():+.3f} .. {e.max():+.3f}")
    return out


def errors(rows: list[dict]) -> list[tuple[dict, int, int, float]]:
    """`(row, predicted, compiled, relative error)` of each row under the present model."""
    out = []
    for r in rows:
        predicted = make_plan(r["cfg"]).memory.total
        compiled = r["measured"]["total"]
        out.append((r, predicted, compiled, predicted / compiled - 1))
    return out


def run_fit(args) -> None:
    rows = _rows(args.family, "fit")
    attention = fit_family(rows, "attention")
    _plan_model.ATTENTION[args.family] = attention
    rows = _rows(args.family, "fit")  # the LM's features hold the attention model's
    _plan_model.LM[args.family] = fit_family(rows, "lm", SHARED)
    rows = _rows(args.family, "fit")
    # The largest under-prediction of each kind; an LM step on one chip's of its own.
    under: dict[str, float] = {}
    for r, _, _, e in errors(rows):
        if _calibrated(r):
            key = r["cfg"]["kind"] + ("-p1" if r["regime"].startswith("lm-") and
                                      r["regime"].endswith("-p1") else "")  # fmt: skip
            under[key] = max(under.get(key, 0.0), 1 / (1 + e) - 1)
    headroom = {k: round(float(np.ceil(v * 100) / 100 + 0.02), 2) for k, v in under.items()}
    _plan_model.HEADROOM[args.family] = headroom
    lms = [r["cfg"] for r in rows if r["cfg"]["kind"] == "lm" and _calibrated(r)]
    _plan_model.WIDTHS[args.family] = {k: max(c[k] for c in lms) for k in ("dim", "hidden")}
    write_constants(args.family)
    log(f"wrote {CONSTANTS.relative_to(ROOT)} ({args.family}: headroom {headroom})")


def _describe(cfg: dict) -> str:
    per_chip = cfg["seq_len"] // cfg["num_devices"]
    if cfg["kind"] == "attention":
        what = f"attention {cfg['heads']}/{cfg['kv_heads']}x{cfg['head_dim']} {cfg['dtype']}"
    else:
        what = (f"LM {cfg['num_layers']}x{cfg['dim']} (vocab {cfg['vocab_size']}), "
                f"remat {cfg['remat']}")  # fmt: skip
    return f"{cfg['target']} | {what} | {cfg['mask']} | {per_chip // 1024}K"


def _table(family: str, split: str) -> str:
    """The error table (Markdown) of a held-out grid, with its worst error and the fit's."""
    lines = [
        "| target | program | mask | tokens a chip | predicted GiB | compiled GiB | error |",
        "|---|---|---|---|---|---|---|",
    ]
    worst, refused = 0.0, 0.0
    for r, pred, comp, err in errors(_rows(family, split)):
        # What the analytic planner refuses (an LM wider than the fit's) is shown with
        # the model's number, marked, and kept out of the worst error it answers with.
        wide = _plan_model.uncalibrated(_analytic.plan_problem(make_plan(r["cfg"])))
        if wide:
            refused = max(refused, abs(err))
        else:
            worst = max(worst, abs(err))
        mark = " (refused: wider than the fit)" if wide else ""
        lines.append(
            f"| {_describe(r['cfg'])} | {pred / 2**30:.2f}{mark} | {comp / 2**30:.2f} | "
            f"{err:+.1%} |"
        )
    fit = [e for r, *_, e in errors(_rows(family, "fit")) if _calibrated(r)]
    lines.append("")
    lines.append(
        f"Held out: worst |error| {worst:.1%}"
        + (f" ({refused:.1%} where the planner refuses)" if refused else "")
        + f". The fit's own {len(fit)} points: {min(fit):+.1%} .. {max(fit):+.1%}."
    )
    return "\n".join(lines)


def run_table(args) -> None:
    """The error tables of the held-out grids (Markdown), printed and written into
    docs/longest_context.md between the family's markers."""
    grids = (
        ("check", args.family), ("holdout", f"{args.family}, 70B"),
        ("blind", f"{args.family}, third grid"), ("fourth", f"{args.family}, fourth grid"),
        ("chip", f"{args.family}, one chip"), ("sixth", f"{args.family}, sixth grid"),
        ("seventh", f"{args.family}, seventh grid"),
    )  # fmt: skip
    for split, name in grids:
        if not _rows(args.family, split):
            continue
        table = _table(args.family, split)
        print(table)
        start, end = (f"<!-- model error table ({name}): {w} -->" for w in ("start", "end"))
        text = DOC.read_text()
        if start in text:
            pattern = re.escape(start) + ".*?" + re.escape(end)
            text = re.sub(pattern, lambda _: f"{start}\n{table}\n{end}", text, flags=re.S)
            DOC.write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=("tpu", "gpu"), required=True)
    samples = (
        "fit", "fit-scan", "fit-ring", "fit-deep", "fit-width", "fit-wide", "fit-vocab",
        "fit-long", "fit-heads", "fit-many", "fit-chip", "check", "holdout", "blind",
        "fourth", "chip", "sixth", "seventh",
    )  # fmt: skip
    parser.add_argument("--measure", choices=samples)
    parser.add_argument("--points", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--targets", nargs="+", default=None,
        help="with --measure: draw the sample's targets from these (default: the family's)",
    )  # fmt: skip
    parser.add_argument(
        "--tokens", type=int, nargs="+", default=None,
        help="with --measure fit-deep, fit-width, fit-wide or fit-vocab: tokens a chip "
        "(default 2K-8K)",
    )  # fmt: skip
    parser.add_argument("--fit", action="store_true")
    parser.add_argument("--table", action="store_true")
    args = parser.parse_args()
    if args.measure:
        run_measure(args)
    if args.fit:
        run_fit(args)
    if args.table:
        run_table(args)


if __name__ == "__main__":
    main()
