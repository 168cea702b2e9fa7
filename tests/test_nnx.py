"""Flax NNX: the layer of docs/flax_nnx.md, run as the page runs it and checked against
dense attention.

The page's code blocks are executed here, so the page cannot drift from what is tested.
Flax is in the `test` extra: these tests always run in CI.
"""

import ast
import re
import tomllib
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx
from helpers import assert_close, mesh

import ringeqx as rx


ROOT = Path(__file__).parents[1]
PAGE = ROOT / "docs" / "flax_nnx.md"


def _page_blocks() -> list[str]:
    """The page's Python blocks: the layer, then the training step."""
    blocks = re.findall(r"^```python\n(.*?)^```$", PAGE.read_text(), re.S | re.M)
    assert len(blocks) == 2, f"expected the layer and the training step; got {len(blocks)}"
    return blocks


def _run_page(*blocks: str) -> dict:
    namespace = {}
    exec(compile("\n".join(blocks), str(PAGE), "exec"), namespace)
    return namespace


def _dense(model, x, attention):
    """The page's layer written again without the ring: `attention(q, k, v)` is dense."""
    batch, seq, _ = x.shape
    heads, kv_heads, head_dim = model.num_heads, model.num_kv_heads, model.head_dim
    q = (x @ model.q_proj.kernel[...]).reshape(batch, seq, heads, head_dim)
    k = (x @ model.k_proj.kernel[...]).reshape(batch, seq, kv_heads, head_dim)
    v = (x @ model.v_proj.kernel[...]).reshape(batch, seq, kv_heads, head_dim)
    out = attention(q, k, v)
    return out.reshape(batch, seq, heads * head_dim) @ model.out_proj.kernel[...]


def test_layer_matches_dense_values_and_gradients():
    layer = _run_page(_page_blocks()[0])["RingSelfAttention"]
    # Every axis a different size, GQA (4 query heads on 2 K/V heads), 7 tokens per device.
    model = layer(dim=10, num_heads=4, num_kv_heads=2, head_dim=6, rngs=nnx.Rngs(3))
    m = mesh(8)
    kx, kc = jax.random.split(jax.random.key(4))
    x = jax.random.normal(kx, (3, 56, 10))
    cotangent = jax.random.normal(kc, (3, 56, 10))
    forwards = [
        lambda model, x: model(x),
        lambda model, x: _dense(
            model, x, lambda q, k, v: rx.reference_attention(q, k, v, mask=rx.Causal())
        ),
        lambda model, x: _dense(
            model, x, lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)
        ),
    ]

    # One program for the ring and both dense references, each output and its gradient
    # w.r.t. the layer's nnx.Params (compiling is most of the suite's time).
    @nnx.jit
    def outputs_and_grads(model, x):
        results = []
        for forward in forwards:

            def loss(model):
                out = forward(model, x)
                return jnp.sum(out * cotangent), out

            (_, out), grads = nnx.value_and_grad(loss, has_aux=True)(model)
            results.append((out, grads))
        return results

    with jax.set_mesh(m):
        x = jax.device_put(x, jax.P(None, "sequence"))
        (out, grads), *dense = outputs_and_grads(model, x)

    params = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert len(jax.tree.leaves(grads)) == len(params) == 4
    for ref_out, ref_grads in dense:
        assert jax.tree.structure(grads) == jax.tree.structure(ref_grads)
        assert_close(out, ref_out, 1e-5, 1e-5)
        for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
            assert_close(g, r, 1e-4, 1e-4)


def test_page_training_step_lowers_the_loss():
    # The page is user code, run with JAX's default dtype promotion: optax mixes Python
    # floats with int32 step counts, which the suite's strict promotion refuses.
    with jax.numpy_dtype_promotion("standard"):
        page = _run_page(*_page_blocks())
    assert page["mesh"].shape["sequence"] == 8
    losses = [float(loss) for loss in page["losses"]]
    assert len(losses) == 3
    # Each step's loss is taken before its update: the first update lowered the next.
    assert losses[1] < losses[0] and losses[2] < losses[1], losses


def test_core_never_imports_flax():
    """Flax is an extra (`ringeqx[nnx]`, and `ringeqx[test]`), never a dependency."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not any(d.startswith("flax") for d in project["dependencies"])
    extras = project["optional-dependencies"]
    assert any(d.startswith("flax") for d in extras["nnx"])
    assert any(d.startswith("flax") for d in extras["test"])
    imported = set()
    for path in (ROOT / "src" / "ringeqx").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                imported.add(node.module.split(".")[0])
    assert "jax" in imported and "flax" not in imported
