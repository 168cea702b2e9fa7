"""The memory model behind `ringeqx.plan`: per-device bytes of ring attention's forward and
backward and of an LM training step, from the arrays each one holds.

The model is structural: every term is the size of arrays the program really holds (the
arguments and outputs exactly; among the temporaries the residuals the custom VJP keeps,
the K/V blocks and dK/dV accumulators in flight, the tiles of scores, the per-layer
activations a remat policy keeps, the logits, the gradients), and each term's count is a
constant calibrated against XLA's `memory_analysis()` on CPU (8 fake devices, JAX 0.10.2,
`benchmarks/plan_grid.py --calibrate`). Separate constants hold where XLA's buffer
assignment differs in kind: one ring step (no buffers in flight), two (loops of one
trip, which XLA simplifies) and more; float32 and 16-bit inputs.
"""

import math

import equinox as eqx

from ._plan_constants import ATTENTION, HEADROOM, LM


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
    "const": "attention",
}
LM_TERMS = {
    "gradients": "parameters",
    "stream": "activations",
    "mlp": "activations",
    "logits": "activations",
    "attention": "attention",
    "in_flight": "communication",
    "const": "attention",
}

_MIB = 2**20


class Shapes(eqx.Module):
    """Per-device sizes of one ring attention call: `batch` examples of `capacity`
    tokens, `num_steps` ring steps, tiles `block_q x block_kv` (shrunk to the shard);
    `dense` when the mask rules nothing out (`Full`), so no step or tile is conditional."""

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
    return {
        # The custom VJP keeps q, k, v (heads-major copies), out (float32) and lse.
        "residuals": float((q + 2 * kv) * s.itemsize + 4 * (q + rows)),
        # Two K/V blocks in flight forward; backward, K/V and float32 dK/dV, two each.
        "in_flight": float(4 * kv * s.itemsize + 4 * kv * 4) if ring else 0.0,
        "tile": 4.0 * s.batch * s.heads * bq * bk,
        "q32": 4.0 * q,
        "kv32": 4.0 * kv,
        "q32_tiled": 4.0 * q * tiled,
        "kv32_tiled": 4.0 * kv * tiled,
        "const": float(_MIB),
    }


def attention_io(s: Shapes) -> int:
    """Arguments (q, k, v, d_out) and outputs (out, dq, dk, dv) of the program."""
    q, kv, _ = s.elements()
    return 2 * (2 * q + 2 * kv) * s.itemsize


def attention_regime(s: Shapes) -> str:
    """The calibration regime: ring steps (one, two, more) and input width. Two steps
    under a dense mask are a regime of their own: with no conditional step, XLA's CPU
    buffer assignment keeps up to three more q-sized float32 buffers live (measured at
    N = 32K: 364 MiB against 279 MiB for the same program under `Causal`)."""
    n = s.num_steps
    ring = "p1" if n == 1 else ("p2d" if s.dense else "p2") if n == 2 else "pn"
    return f"{ring}-{'f32' if s.itemsize >= 4 else 'f16'}"


class LMShapes(eqx.Module):
    """Per-device sizes of an LM training step."""

    attention: Shapes
    vocab_size: int = eqx.field(static=True)
    dim: int = eqx.field(static=True)
    num_layers: int = eqx.field(static=True)
    hidden: int = eqx.field(static=True)
    remat: str = eqx.field(static=True)

    def param_count(self) -> int:
        a = self.attention
        qo = 2 * self.dim * a.heads * a.head_dim
        kv = 2 * self.dim * a.kv_heads * a.head_dim
        mlp = 2 * self.dim * self.hidden + self.hidden + self.dim
        block = qo + kv + mlp + 4 * self.dim  # two RMSNorms, weight and bias each
        return 2 * self.vocab_size * self.dim + self.num_layers * block + 2 * self.dim


def _attention_temp(s: Shapes) -> tuple[float, float]:
    """`(temporaries but the buffers in flight, buffers in flight)` the attention model
    predicts for one ring attention call."""
    parts = _combine(attention_features(s), ATTENTION_TERMS, ATTENTION.get(attention_regime(s), {}))
    in_flight = parts["communication"]
    return sum(parts.values()) - in_flight, in_flight


def lm_features(s: LMShapes) -> dict[str, float]:
    """The temporaries' terms of one LM training step, in bytes (float32 activations);
    one layer's attention temporaries come from the attention model."""
    a = s.attention
    tokens = a.batch * a.capacity
    layer_attention, in_flight = _attention_temp(a)
    return {
        "gradients": 4.0 * s.param_count(),
        "stream": 4.0 * s.num_layers * tokens * s.dim,
        "mlp": 4.0 * s.num_layers * tokens * s.hidden,
        "logits": 4.0 * tokens * s.vocab_size,
        "attention": layer_attention,
        "in_flight": in_flight,
        "const": float(_MIB),
    }


def lm_io(s: LMShapes) -> tuple[int, int, int]:
    """`(parameters, optimizer_state, inputs_outputs)` bytes of the step's arguments and
    outputs: parameters in and out, Adam's moments in and out, tokens, labels, loss."""
    params = 4 * s.param_count()
    tokens = s.attention.batch * s.attention.capacity
    return 2 * params, 4 * params, 2 * 4 * tokens + 4 + 8


def lm_regime(s: LMShapes) -> str:
    """The calibration regime: one for every remat policy, since XLA's CPU compiler gives
    the three the same bytes (within 2%, see docs/memory.md); the GPU and TPU compilers
    would need one each."""
    return "lm"


def _combine(features, terms, coefficients) -> dict[str, float]:
    out = dict.fromkeys(CATEGORIES, 0.0)
    for name, value in features.items():
        out[terms[name]] += coefficients.get(name, 0.0) * value
    return out


def predict_attention(s: Shapes) -> MemoryBreakdown:
    """Predicted per-device bytes of ring attention's forward and backward."""
    parts = _combine(attention_features(s), ATTENTION_TERMS, ATTENTION.get(attention_regime(s), {}))
    parts["inputs_outputs"] += attention_io(s)
    return MemoryBreakdown(**{k: int(math.ceil(v)) for k, v in parts.items()})


def predict_lm(s: LMShapes) -> MemoryBreakdown:
    """Predicted per-device bytes of an LM training step with Adam."""
    parts = _combine(lm_features(s), LM_TERMS, LM.get(lm_regime(s), {}))
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


def headroom(kind: str) -> float:
    """How much more than predicted a program of `kind` (`"attention"` or `"lm"`) may
    compile to: the largest under-prediction seen in calibration, with 2% to spare."""
    return HEADROOM.get(kind, 0.0)


def terms(shapes: "Shapes | LMShapes") -> tuple[dict[str, float], str, int]:
    """`(features, regime, exact bytes of arguments and outputs)` of a problem: what
    `benchmarks/plan_grid.py --calibrate` fits the constants on."""
    if isinstance(shapes, LMShapes):
        return lm_features(shapes), lm_regime(shapes), sum(lm_io(shapes))
    return attention_features(shapes), attention_regime(shapes), attention_io(shapes)
