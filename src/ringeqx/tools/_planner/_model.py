"""The memory model behind `ringeqx.tools.plan`: per-device bytes of ring attention's forward and
backward and of an LM training step, from the arrays each one holds.

The model is structural: every term is the size of arrays the program really holds (the
arguments and outputs exactly; among the temporaries the residuals the custom VJP keeps,
the K/V blocks and dK/dV accumulators in flight, the tiles of scores, the per-layer
activations a remat policy keeps, the logits, the gradients), and each term's count is a
constant calibrated against the compiler's `memory_analysis()`, per family of compiler:

- `"cpu"`: XLA:CPU on 8 fake devices (`benchmarks/calibration/plan_grid.py --calibrate`),
  the program `measure_memory` compiles without a target: `XlaKernel`, parameters
  replicated.
  Separate constants hold where XLA's buffer assignment differs in kind: one ring step (no
  buffers in flight), two (loops of one trip, which XLA simplifies) and more; float32 and
  16-bit inputs.
- `"tpu"` (libtpu, v5p slices) and `"gpu"` (the CUDA plugin, H100s): the program
  `plan(..., target=...)` compiles, the platform's Pallas kernel (its tiles live on chip)
  and an LM's parameters and Adam state fully sharded over every chip and donated
  (`benchmarks/calibration/plan_target_grid.py`). Attention has one regime per ring size
  (two steps, more) and input width; an LM one per remat policy, unrolled or scanned, whose
  layers these compilers schedule differently.
"""

import math
from typing import Literal

import equinox as eqx

from .._hardware import HARDWARE
from ._constants import ATTENTION, HEADROOM, LM, WIDTHS


class MemoryBreakdown(eqx.Module):
    """Predicted bytes per device, by what holds them.

    **Fields:**

    - `parameters`: parameters in and updated out, and their gradients (0 for attention
        alone).
    - `optimizer_state`: Adam's two moments, in and out (0 for attention alone).
    - `activations`: what is kept for the backward: the layers' saved activations (by the
        remat policy), the logits, the ring's residuals (q, k, v, out, lse).
    - `attention`: attention temporaries: tiles of scores, float32 accumulators, the
        kernel's tiled copies, and the rest of XLA's scratch.
    - `communication`: the K/V blocks and the dK/dV accumulators in flight round the ring.
    - `inputs_outputs`: the program's other arguments and outputs (q, k, v, d_out, out,
        dq, dk, dv; tokens, labels, loss).
    """

    parameters: int = eqx.field(static=True)
    optimizer_state: int = eqx.field(static=True)
    activations: int = eqx.field(static=True)
    attention: int = eqx.field(static=True)
    communication: int = eqx.field(static=True)
    inputs_outputs: int = eqx.field(static=True)

    @property
    def total(self) -> int:
        """Bytes per device in all."""
        return (
            self.parameters
            + self.optimizer_state
            + self.activations
            + self.attention
            + self.communication
            + self.inputs_outputs
        )


CATEGORIES = (
    "parameters",
    "optimizer_state",
    "activations",
    "attention",
    "communication",
    "inputs_outputs",
)

# Which category each fitted term of the temporaries belongs to.
ATTENTION_TERMS = {
    "residuals": "activations",
    "in_flight": "communication",
    "tile": "attention",
    "q32": "attention",
    "kv32": "attention",
    "q32_tiled": "attention",
    "kv32_tiled": "attention",
    "q32_zigzag": "attention",
    "rows_lanes": "attention",
    "kv_rows_lanes": "attention",
    "q32_long": "attention",
    "const": "attention",
}
LM_TERMS = {
    "gradients": "parameters",
    "embedding": "parameters",
    "head_weight": "parameters",
    "weights": "parameters",
    "layer_weights": "parameters",
    "stacked": "parameters",
    "layer": "activations",
    "sequence": "activations",
    "stream": "activations",
    "mlp": "activations",
    "logits": "activations",
    "attention": "attention",
    "in_flight": "communication",
    "const": "attention",
}

_MIB = 2**20
# Rows of a shard (batch x tokens) past which libtpu's attention holds more buffers.
_LONG_ROWS = 23040


class Shapes(eqx.Module):
    """Per-device sizes of one ring attention call: `batch` examples of `capacity`
    tokens, `num_steps` ring steps, tiles `block_q x block_kv` (shrunk to the shard);
    `dense` when the mask rules nothing out (`Full`), so no step or tile is conditional;
    `zigzag` when the layout is `Zigzag`'s (two chunks a shard); `family` the compiler's."""

    batch: int = eqx.field(static=True)
    capacity: int = eqx.field(static=True)
    num_steps: int = eqx.field(static=True)
    heads: int = eqx.field(static=True)
    kv_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    itemsize: int = eqx.field(static=True)
    block_q: int = eqx.field(static=True)
    block_kv: int = eqx.field(static=True)
    dense: bool = eqx.field(static=True, default=False)
    family: str = eqx.field(static=True, default="cpu")
    zigzag: bool = eqx.field(static=True, default=False)

    def elements(self) -> tuple[int, int, int]:
        """Elements of one q-shaped, one k-shaped and one row-shaped (lse) array."""
        tokens = self.batch * self.capacity
        return (
            tokens * self.heads * self.head_dim,
            tokens * self.kv_heads * self.head_dim,
            tokens * self.heads,
        )


def attention_features(s: Shapes) -> dict[str, float]:
    """The temporaries' terms of one ring attention forward + backward, in bytes."""
    q, kv, rows = s.elements()
    bq, bk = min(s.block_q, s.capacity), min(s.block_kv, s.capacity)
    ring = s.num_steps > 1
    # Shards of more than one tile loop over tiles: tiled copies of q, dq and k/v.
    tiled = float(s.capacity > min(s.block_q, s.block_kv))
    out = {
        # The custom VJP keeps q, k, v (heads-major copies), out (float32) and lse.
        "residuals": float((q + 2 * kv) * s.itemsize + 4 * (q + rows)),
        # Two K/V blocks in flight forward; backward, K/V and float32 dK/dV, two each.
        "in_flight": float(4 * kv * s.itemsize + 4 * kv * 4) if ring else 0.0,
        "tile": 4.0 * s.batch * s.heads * bq * bk,
        "q32": 4.0 * q,
        "kv32": 4.0 * kv,
        "q32_tiled": 4.0 * q * tiled,
        "kv32_tiled": 4.0 * kv * tiled,
        # Zigzag's two chunks a shard, a term of its own: the TPU fit gives it 1.7
        # float32 q-sized buffers more than other layouts (GPU: 0.03).
        "q32_zigzag": 4.0 * q * s.zigzag,
        "const": float(_MIB),
    }
    if s.family == "tpu":
        # Mosaic's kernel takes the float32 rows (lse, and delta backward) broadcast
        # across a vreg's 128 lanes: as many bytes as q at a head_dim of 128, twice as
        # many at 64 (without it, the fit under-predicts 64-wide heads by up to 45%).
        out["rows_lanes"] = 4.0 * rows * 128
        # And the tokens' positions as int32 per kv head across 128 lanes (libtpu's
        # buffer assignment: s32[b, kv_heads, n, 128]); without it a 1-chip ring's
        # kv-heavy heads (8/8 x 64) were under-predicted by up to 29%.
        out["kv_rows_lanes"] = 4.0 * s.batch * s.capacity * s.kv_heads * 128
        # libtpu holds about 3 more float32 q-sized buffers once a shard's rows (batch x
        # tokens) pass about 23K at heads of 128 or wider (a sweep of 4-128 heads of 128
        # and 256: between 22,528 and 23,552 rows for every grouping, while the level on
        # either side depends on the grouping; 64-wide heads switch elsewhere, both ways).
        # Fitted on 37 groupings x lengths of multi-step rings, it takes that regime's
        # spread from -20% .. +24% to -8% .. +13%.
        long = s.batch * s.capacity >= _LONG_ROWS and s.head_dim >= 128
        out["q32_long"] = 4.0 * q * long
    return out


def attention_io(s: Shapes) -> int:
    """Arguments (q, k, v, d_out) and outputs (out, dq, dk, dv) of the program."""
    q, kv, _ = s.elements()
    return 2 * (2 * q + 2 * kv) * s.itemsize


def family(device: str) -> Literal["cpu", "gpu", "tpu"]:
    """The family of compiler a device profile's programs are calibrated against:
    `"cpu"`, or the kind (`"tpu"`, `"gpu"`) its row of the hardware table gives."""
    if device == "cpu":
        return "cpu"
    kind = HARDWARE[device].kind
    assert kind is not None, f"the hardware table's {device!r} has no kind"
    return kind


def attention_regime(s: Shapes) -> str:
    """The calibration regime: ring steps (one, two, more) and input width. On the CPU,
    two steps under a dense mask are a regime of their own: with no conditional
    step, XLA's CPU buffer assignment keeps up to three more q-sized float32 buffers live
    (measured at N = 32K: 364 MiB against 279 MiB for the same program under `Causal`).
    On accelerators dense and masked two-step rings share a regime (fitted on both)."""
    width = "f32" if s.itemsize >= 4 else "f16"
    n = s.num_steps
    dense = s.dense and s.family == "cpu"
    ring = "p1" if n == 1 else ("p2d" if dense else "p2") if n == 2 else "pn"
    return f"{ring}-{width}"


class LMShapes(eqx.Module):
    """Per-device sizes of an LM training step; `mlp` and `norm_bias` are the blocks'
    (`ringeqx.nn.RingTransformerLM`'s arguments: a SwiGLU MLP has three bias-free
    matrices, a GELU MLP two with biases); `param_bytes`, `compute_bytes`,
    `output_bytes` the item sizes of its `ringeqx.nn.Precision`'s three dtypes (4, 4, 4:
    float32; the recipe `Precision.mixed()` is 4, 2, 4)."""

    attention: Shapes
    vocab_size: int = eqx.field(static=True)
    dim: int = eqx.field(static=True)
    num_layers: int = eqx.field(static=True)
    hidden: int = eqx.field(static=True)
    remat: str = eqx.field(static=True)
    chips: int = eqx.field(static=True, default=1)
    scan: bool = eqx.field(static=True, default=False)
    mlp: str = eqx.field(static=True, default="gelu")
    norm_bias: bool = eqx.field(static=True, default=True)
    param_bytes: int = eqx.field(static=True, default=4)
    compute_bytes: int = eqx.field(static=True, default=4)
    output_bytes: int = eqx.field(static=True, default=4)

    def mlp_width(self) -> int:
        """Activations of one token's MLP a layer keeps, in units of `hidden`: GELU's
        hidden layer (1), SwiGLU's gate and up projections (2)."""
        return 2 if self.mlp == "swiglu" else 1

    def _norm_params(self) -> int:
        """Parameters of one RMSNorm: a weight, and a bias unless `norm_bias` is off."""
        return 2 * self.dim if self.norm_bias else self.dim

    def block_params(self) -> int:
        """Parameters of one transformer block."""
        a = self.attention
        qo = 2 * self.dim * a.heads * a.head_dim
        kv = 2 * self.dim * a.kv_heads * a.head_dim
        match self.mlp:
            case "gelu":
                mlp = 2 * self.dim * self.hidden + self.hidden + self.dim
            case "swiglu":
                mlp = 3 * self.dim * self.hidden
            case _:
                raise ValueError(f"`mlp` must be 'gelu' or 'swiglu'; got {self.mlp!r}.")
        return qo + kv + mlp + 2 * self._norm_params()

    def param_count(self) -> int:
        blocks = self.num_layers * self.block_params()
        return 2 * self.vocab_size * self.dim + blocks + self._norm_params()


def _attention_temp(s: Shapes) -> tuple[float, float]:
    """`(temporaries but the buffers in flight, buffers in flight)` the attention model
    predicts for one ring attention call."""
    parts = _combine(
        attention_features(s), ATTENTION_TERMS, _counts(ATTENTION, s.family, attention_regime(s))
    )
    in_flight = parts["communication"]
    return sum(parts.values()) - in_flight, in_flight


def lm_features(s: LMShapes) -> dict[str, float]:
    """The temporaries' terms of one LM training step, in bytes; one layer's attention
    temporaries come from the attention model (at the compute dtype: `s.attention`'s
    item size).

    Every term is bytes at the dtype the program holds it in: the weights, their
    gradients and gathered copies at `param_bytes`; the residual stream between blocks
    (`stream`, `sequence`) at `output_bytes`; the activations inside a block (`mlp`, a
    layer's) at `compute_bytes`; the logits in float32 whatever the policy. The counts
    were fitted on float32 GELU steps (every size 4, one hidden activation a token):
    under mixed precision or SwiGLU the estimate scales each term by its dtype's bytes
    and the MLP's width, with the same counts (not refitted), so it is an estimate to
    order candidates; `plan(..., target=...)` compiles the real program. On accelerators the
    parameters are sharded over `chips`: the gradients are shards, and the step gathers
    the embedding and head (`embedding`) and each layer's weights (`layer_weights`), and
    may keep every layer's for the backward (`weights`), or (on TPUs) carry every
    layer's shards (`stacked`); `layer` is one layer's activations, what a
    rematerialised layer recomputes at a time; `sequence` the hidden states of every
    chip's tokens."""
    a = s.attention
    tokens = a.batch * a.capacity
    layer_attention, in_flight = _attention_temp(a)
    w, c, o = float(s.param_bytes), float(s.compute_bytes), float(s.output_bytes)
    hidden = s.mlp_width() * s.hidden
    out = {
        "gradients": w * s.param_count() / s.chips,
        "stream": o * s.num_layers * tokens * s.dim,
        "mlp": c * s.num_layers * tokens * hidden,
        "logits": 4.0 * tokens * s.vocab_size,
        "attention": layer_attention,
        "in_flight": in_flight,
        "const": float(_MIB),
    }
    if a.family != "cpu":
        layer = s.block_params()
        out["embedding"] = w * 2 * s.vocab_size * s.dim
        out["weights"] = w * s.num_layers * layer
        out["layer_weights"] = w * layer
        out["layer"] = tokens * (o * s.dim + c * hidden)
        # For the vocabulary-sharded head the compilers gather whichever is smaller:
        # every chip's hidden states (`sequence`) or, once the sequence holds as many
        # tokens as the vocabulary, the head's whole weight (`head_weight`). Their
        # memory-usage reports: for Llama-3-8B's widths at 8K tokens a chip, on 8 v5p
        # chips `f32[65536,4096]` and the logits as `f32[16032,65536]`; on 16 and 64
        # chips no sequence-sized buffer, the logits as `f32[128256,8192]` and copies of
        # `f32[128256,4096]` (XLA:GPU's for 2 layers at 4K on 8 H100s: `f32[32768,4096]`
        # more than once). A sequence term for every length put the longest contexts on
        # 64 and 256 v5p chips at 1.7-6.2 times their compiled bytes.
        seq = tokens * s.chips
        out["sequence"] = o * seq * s.dim * (seq < s.vocab_size)
        out["head_weight"] = w * s.vocab_size * s.dim * (s.vocab_size <= seq)
    if a.family == "tpu":
        # Every layer's weights as the chip's shard of them: what scanned layers carry
        # through the loops (libtpu's live ranges of 8 scanned layers of a 7168-wide
        # model on 4 chips hold the stacked gradient being accumulated, f32[8,7168,17920]
        # / 4 chips, the stacked weights and their bf16 casts). Without it the scanned
        # rematerialised steps are under-predicted on 4 chips (-22%) and over on 8
        # (+20%), since `weights`, the gathered copies, does not shrink with the chips.
        # XLA:GPU's were not examined; fitted there too, it took the 70B grid's scanned
        # remat-"block" step from -13.3% to -15.2%, so the GPU's model does without it.
        out["stacked"] = w * s.num_layers * s.block_params() / s.chips
    return out


def lm_io(s: LMShapes) -> tuple[int, int, int]:
    """`(parameters, optimizer_state, inputs_outputs)` bytes of the step's arguments and
    outputs: parameters in and out, Adam's moments in and out, tokens, labels, loss. On
    accelerators the parameters and moments are shards of `chips`, and the updated ones
    are donated (their outputs reuse the arguments' buffers)."""
    tokens = s.attention.batch * s.attention.capacity
    if s.attention.family != "cpu":
        params = s.param_bytes * -(-s.param_count() // s.chips)
        return params, 2 * params, 2 * 4 * tokens + 4 + 4
    params = s.param_bytes * s.param_count()
    return 2 * params, 4 * params, 2 * 4 * tokens + 4 + 8


def lm_regime(s: LMShapes) -> str:
    """The calibration regime: on the CPU one for every remat policy, since XLA's CPU
    compiler gives the three the same bytes (within 2%, see docs/memory.md), calibrated
    on unrolled layers; on accelerators one for each policy, unrolled or scanned, and on
    a single chip each of those again (`-p1`): with no ring the compilers keep other
    buffers (a v5e's step under remat "attention" at 36K tokens compiled to more than
    1.28x what counts fitted on rings of 4 and 8 chips said)."""
    if s.attention.family == "cpu":
        return "lm"
    return f"lm-{'scan-' if s.scan else ''}{s.remat}{'-p1' if s.chips == 1 else ''}"


def _counts(table: dict, family_name: str, regime: str) -> dict[str, float]:
    """The calibrated counts of a regime (none where it was not calibrated: see
    `uncalibrated`, which the analytic planner checks first)."""
    return table.get(family_name, {}).get(regime, {})


def uncalibrated(shapes: "Shapes | LMShapes") -> str | None:
    """Why the model cannot predict `shapes`: its regime (or its attention's) was never
    calibrated for its family, so no counts would predict the arguments and outputs
    alone (a 1-chip ring on a TPU predicted so was 2.7x under its compiled bytes); or,
    on accelerators, the LM is wider (model or MLP) than any the family's fit held;
    None where it can."""
    attention = shapes.attention if isinstance(shapes, LMShapes) else shapes
    if isinstance(shapes, LMShapes):
        widest = WIDTHS.get(attention.family, {})
        for name in ("dim", "hidden"):
            value = getattr(shapes, name)
            if value > widest.get(name, value):
                return (
                    f"`{name}`={value} is wider than any LM the memory model was calibrated "
                    f"on for {attention.family!r} devices (at most {widest[name]}), and "
                    "its terms do not extrapolate (12288-wide steps compiled to up to 30% "
                    "more than they predict)"
                )
    checks = [(ATTENTION, attention.family, attention_regime(attention))]
    if isinstance(shapes, LMShapes):
        checks.append((LM, attention.family, lm_regime(shapes)))
    for table, family_name, regime in checks:
        known = table.get(family_name, {})
        if regime not in known:
            return (
                f"the memory model has no calibration for {regime!r} programs on "
                f"{family_name!r} devices (calibrated: {sorted(known)})"
            )
    return None


def _combine(features, terms, coefficients) -> dict[str, float]:
    out = dict.fromkeys(CATEGORIES, 0.0)
    for name, value in features.items():
        out[terms[name]] += coefficients.get(name, 0.0) * value
    return out


def predict_attention(s: Shapes) -> MemoryBreakdown:
    """Predicted per-device bytes of ring attention's forward and backward."""
    parts = _combine(
        attention_features(s), ATTENTION_TERMS, _counts(ATTENTION, s.family, attention_regime(s))
    )
    parts["inputs_outputs"] += attention_io(s)
    return MemoryBreakdown(**{k: int(math.ceil(v)) for k, v in parts.items()})


def predict_lm(s: LMShapes) -> MemoryBreakdown:
    """Predicted per-device bytes of an LM training step with Adam."""
    parts = _combine(lm_features(s), LM_TERMS, _counts(LM, s.attention.family, lm_regime(s)))
    # The LM's counts are signed: XLA reuses parameter-sized buffers (gradients, Adam's
    # temporaries) for activations once these are large. What is reused is taken off the
    # activations, so that no category is negative.
    reused = -sum(min(v, 0.0) for v in parts.values())
    parts = {k: max(v, 0.0) for k, v in parts.items()}
    parts["activations"] = max(parts["activations"] - reused, 0.0)
    params, opt, io = lm_io(s)
    parts["parameters"] += params
    parts["optimizer_state"] += opt
    parts["inputs_outputs"] += io
    return MemoryBreakdown(**{k: int(math.ceil(v)) for k, v in parts.items()})


def headroom(kind: str, device: str = "cpu", one_chip: bool = False) -> float:
    """How much more than predicted a program of `kind` (`"attention"` or `"lm"`) may
    compile to on `device`'s compiler: the largest under-prediction seen in calibrating
    its family, with 2% to spare. On accelerators an LM step on one chip (`one_chip`)
    has its own, since its counts (`lm-...-p1`) are fitted on their own: within 18% on
    one chip, to -32% on rings of 4-64 v5p chips. (Attention keeps one for both: a
    ring's own would have left a held-out program past it; so would one per regime.)"""
    table = HEADROOM.get(family(device), {})
    key = f"{kind}-p1" if one_chip and kind == "lm" else kind
    return table.get(key, table.get(kind, 0.0))


def terms(shapes: "Shapes | LMShapes") -> tuple[dict[str, float], str, int]:
    """`(features, regime, exact bytes of arguments and outputs)` of a problem: what
    `benchmarks/calibration/plan_grid.py --calibrate` fits the constants on."""
    if isinstance(shapes, LMShapes):
        return lm_features(shapes), lm_regime(shapes), sum(lm_io(shapes))
    return attention_features(shapes), attention_regime(shapes), attention_io(shapes)
