"""What a mask reads (`AbstractMask.reads`), read off its own rules: the records its
traced `allows` and `may_attend` depend on. And `check_ids`, the one check that uses it."""

import functools

import equinox as eqx
import jax
import jax.extend.core as jex
import jax.numpy as jnp

from .._layout._tokens import BlockSummary, TokenInfo


_SUMMARY_READS = {
    "pos_min": "positions",
    "pos_max": "positions",
    "seg_min": "segments",
    "seg_max": "segments",
    "span_min": "spans",
    "span_max": "spans",
    "any_valid": "valid",
}


def _used_inputs(jaxpr: jex.Jaxpr, used_outputs: list[bool]) -> list[bool]:
    """Which inputs of `jaxpr` the used outputs depend on: a backward liveness pass over
    its equations (public `jax.extend.core` API). A call of another jaxpr with the same
    arity (`jit`, `closed_call`) is followed inside; any other equation with a used
    output, or with effects, uses all its inputs (conservative: a record may be
    reported read that is not, never the other way round)."""
    live = {v for v, u in zip(jaxpr.outvars, used_outputs) if u and not isinstance(v, jex.Literal)}
    for eqn in reversed(jaxpr.eqns):
        outs = [v in live for v in eqn.outvars]
        if not (any(outs) or eqn.effects):
            continue
        inner = eqn.params.get("jaxpr")
        inner = getattr(inner, "jaxpr", inner)
        if (
            isinstance(inner, jex.Jaxpr)
            and not inner.constvars
            and len(inner.invars) == len(eqn.invars)
            and len(inner.outvars) == len(eqn.outvars)
            and not eqn.effects
        ):
            ins = _used_inputs(inner, outs)
        else:
            ins = [True] * len(eqn.invars)
        live |= {v for v, u in zip(eqn.invars, ins) if u and not isinstance(v, jex.Literal)}
    return [v in live for v in jaxpr.invars]


def _dependence(fn, treedef, leaves: tuple, records: list) -> list[bool]:
    """Whether the output of `fn(mask, *records)` depends on each record array, for the
    mask of structure `treedef` whose array leaves are given as `ShapeDtypeStruct`s."""
    is_abstract = [isinstance(x, jax.ShapeDtypeStruct) for x in leaves]

    def traced(arrays, *record_arrays):
        it = iter(arrays)
        mask = [next(it) if a else x for x, a in zip(leaves, is_abstract)]
        return fn(jax.tree.unflatten(treedef, mask), *record_arrays)

    abstract = [x for x, a in zip(leaves, is_abstract) if a]
    jaxpr = jax.make_jaxpr(traced)(abstract, *records).jaxpr
    used = _used_inputs(jaxpr, [True] * len(jaxpr.outvars))
    return used[len(used) - len(records) :]


@functools.lru_cache(maxsize=256)
def _reads_of(treedef, leaves: tuple) -> frozenset[str]:
    i32 = jnp.int32
    # Token records shaped like the kernels' `[batch, q, 1]` against `[batch, 1, k]`.
    tokens = [jax.ShapeDtypeStruct((1, 2, 1), i32)] * 3 + [
        jax.ShapeDtypeStruct((1, 2, 1), jnp.bool_)
    ]
    tokens += [jax.ShapeDtypeStruct((1, 1, 3), x.dtype) for x in tokens]

    def allows(mask, *arrays):
        return mask.allows(TokenInfo(*arrays[:4]), TokenInfo(*arrays[4:]))

    names = ("positions", "segments", "spans", "valid") * 2
    used = _dependence(allows, treedef, leaves, tokens)
    reads = {name for name, u in zip(names, used) if u}

    summary = [jax.ShapeDtypeStruct((), i32)] * 6 + [jax.ShapeDtypeStruct((), jnp.bool_)]

    def may_attend(mask, *arrays):
        return mask.may_attend(BlockSummary(*arrays[:7]), BlockSummary(*arrays[7:]))

    names = tuple(_SUMMARY_READS.values()) * 2
    used = _dependence(may_attend, treedef, leaves, summary * 2)
    reads |= {name for name, u in zip(names, used) if u}
    return frozenset(reads)


def reads(mask: eqx.Module) -> frozenset[str]:
    """`AbstractMask.reads`: the records `mask`'s rules depend on. (The mask is typed
    `eqx.Module`: the contract in `_base` imports this module, not the other way round.)"""
    # The answer depends on the mask's structure and the shapes of its arrays, not on
    # their values: cached on those, so ring calls pay the tracing once per kind of mask.
    leaves, treedef = jax.tree.flatten(mask)
    leaves = tuple(
        jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) if eqx.is_array(x) else x
        for x in leaves
    )
    try:
        hash((treedef, leaves))
    except TypeError:  # an unhashable static field or leaf: trace it, uncached
        return _reads_of.__wrapped__(treedef, leaves)
    return _reads_of(treedef, leaves)


def check_ids(mask: eqx.Module, segment_ids, span_ids, layout) -> None:
    """Raise when the mask reads segment or span ids that neither the ids nor a layout
    give (the records would then hold -1 everywhere and the answer be silently wrong)."""
    if layout is not None:
        return
    reads = mask.reads()
    name = type(mask).__name__
    if segment_ids is None and "segments" in reads:
        raise ValueError(
            "This mask reads segment ids: pass `segment_ids=` or a `layout=` (the rule "
            f"of {name} reads `segments`; got neither)."
        )
    if span_ids is None and "spans" in reads:
        raise ValueError(
            "This mask reads span ids: pass `span_ids=` or a `layout=` (the rule of "
            f"{name} reads `spans`; got neither)."
        )
