"""What a Pallas kernel refuses, and says so when traced or lowered: the platform, the
inputs' dtypes and head dims, and masks or modifiers its compiler cannot lower."""

import functools
from collections.abc import Callable

import equinox as eqx
import jax
import jax.extend.core
import jax.numpy as jnp
from jax.interpreters import ad, batching, mlir
from jaxtyping import Array

from ..._layout._tokens import BlockSummary
from ..._masks._base import AbstractMask
from ..._score_mods import AbstractScoreMod
from ._tiles import allowed, logits, token_info


# An identity on one kernel input whose *lowering* checks the platform. Which platform a
# program is for is only known when it is lowered (`jax.export` lowers for "cuda" or "tpu"
# on a CPU-only machine; `jit` lowers for the default backend), so a check at trace time
# (`jax.default_backend()`) would refuse programs that are never meant to run here.
_platform_check_p = jax.extend.core.Primitive("ringeqx_platform_check")


@functools.cache
def _platform_check_jit(**params):
    return jax.jit(functools.partial(_platform_check_p.bind, **params))


# Applied eagerly, it still lowers (for the default backend), so the check runs there too.
_platform_check_p.def_impl(lambda x, **params: _platform_check_jit(**params)(x))
_platform_check_p.def_abstract_eval(lambda x, **_: x)
ad.deflinear2(_platform_check_p, lambda ct, x, **_: [ct])
batching.defvectorized(_platform_check_p)


def _platform_check_lowering(ctx, x, *, kernel_name, platforms, device, compiler):
    lowering = tuple(ctx.module_context.platforms)
    wrong = [p for p in lowering if p not in platforms]
    if wrong:
        raise ValueError(
            f"{kernel_name}(interpret=False) compiles with {compiler} and needs a "
            f"{device}; this program is being lowered for platform {wrong[0]!r}. Pass "
            "interpret=True to run it in the Pallas interpreter, or use XlaKernel."
        )
    return [x]


mlir.register_lowering(_platform_check_p, _platform_check_lowering)


def platform_check(
    x: Array, kernel_name: str, platforms: tuple[str, ...], device: str, compiler: str
) -> Array:
    """`x`, unchanged; lowering it for a platform outside `platforms` (the JAX platform
    names the kernel compiles for) is a clear error naming the kernel and `device`."""
    return _platform_check_p.bind(
        x,
        kernel_name=kernel_name,
        platforms=platforms,
        device=device,
        compiler=compiler,
    )


def check_inputs(
    kernel_name: str,
    q: Array,
    k: Array,
    v: Array,
    dtypes: tuple[str, ...],
    head_dim_ok: Callable[[int], bool],
    head_dim_rule: str,
) -> None:
    """Trace-time checks of what a Pallas kernel can run on its device."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if jnp.dtype(x.dtype).name not in dtypes:
            raise TypeError(
                f"{kernel_name} does not support dtype {jnp.dtype(x.dtype).name} for "
                f"`{name}`; supported dtypes: {', '.join(dtypes)}."
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"{kernel_name} needs q, k and v of one dtype; got {q.dtype}, {k.dtype} "
            f"and {v.dtype}."
        )
    head_dim = q.shape[-1]
    if not head_dim_ok(head_dim):
        raise ValueError(
            f"head_dim={head_dim} is not supported by {kernel_name}, which needs "
            f"{head_dim_rule}."
        )



# Primitives that neither Triton's nor Mosaic's lowering has for tile values.
_UNLOWERABLE = ("gather", "cumsum", "cummax", "cumprod", "cumlogsumexp", "sort")


def _primitives(jaxpr) -> set[str]:
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            names |= _primitives(sub)
    return names


def check_lowerable(
    mask: AbstractMask,
    score_mod: AbstractScoreMod | None,
    kernel_name: str,
    device: str,
    compiler: str,
) -> None:
    """Trace-time check that the mask's elementwise rule and the modifier, as a kernel
    evaluates them on a tile, use no primitive that `compiler` cannot lower.

    The rule traced is the mask's tile-local form (`AbstractMask.tile_local`), as a
    kernel gets it: a mask that looks a table up per token pair (a `gather`) lowers
    only if its `tile_local` hands the kernel per-tile entries instead, as
    `BlockSparse` does. Tracing the rule once on a small tile finds that here, with a
    message that names the feature, instead of deep inside the lowering.
    """
    qi = token_info([jnp.zeros((8, 1), jnp.int32)] * 4)
    ki = token_info([jnp.zeros((1, 128), jnp.int32)] * 4)
    one_tile = BlockSummary(*[jnp.zeros((), jnp.int32)] * 6, jnp.ones((), bool))
    # Abstract leaves: the tile-local form's own table lookups run outside kernels.
    local = eqx.filter_eval_shape(lambda m: m.tile_local(one_tile, one_tile, 8, 128).mask, mask)
    abstract = lambda x: isinstance(x, jax.ShapeDtypeStruct)  # noqa: E731
    leaves, rest = eqx.partition(local, abstract)

    def mask_rule(leaves):
        return allowed(eqx.combine(leaves, rest), qi, ki)

    parts = [("mask", type(mask).__name__, lambda: jax.make_jaxpr(mask_rule)(leaves))]
    if score_mod is not None:
        one = jax.vmap(score_mod.for_head)(jnp.arange(1, dtype=jnp.int32))
        one = jax.tree.map(lambda x: x[0] if eqx.is_array(x) else x, one)
        q, k = jnp.zeros((8, 64), jnp.float32), jnp.zeros((128, 64), jnp.float32)
        parts.append(
            (
                "score_mod",
                type(score_mod).__name__,
                lambda: jax.make_jaxpr(lambda: logits(q, k, qi, ki, one, 1.0)[0])(),
            )
        )
    for what, name, fn in parts:
        used = _primitives(fn().jaxpr)
        bad = sorted(used.intersection(_UNLOWERABLE))
        if bad:
            raise ValueError(
                f"{kernel_name}(interpret=False) cannot run {what} {name} on a "
                f"{device}: evaluated on a tile it uses {', '.join(bad)}, which "
                f"{compiler} cannot lower (a table looked up per token pair is a "
                "gather: give the mask a `tile_local` that hands the kernel the "
                "entries each tile needs, as BlockSparse does). Use XlaKernel "
                f"(kernel='xla'), which runs {name} on every device, or interpret=True."
            )

