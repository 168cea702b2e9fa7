"""Checkpoints: a model's arrays and an optimiser's state saved sharded with Orbax (each
host writes its own shards), the model's configuration as JSON, restorable onto another
mesh or ring size. No pickle: a checkpoint is data, safe to load from anywhere."""

import dataclasses
import json
import os
import shutil
from typing import Any

import equinox as eqx
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .._kernels._mosaic._kernel import PallasTpuKernel
from .._kernels._triton._kernel import PallasGpuKernel
from .._kernels._xla import XlaKernel
from .._masks._base import And, Or
from .._masks._block_sparse import BlockSparse
from .._masks._ids import BidirectionalSpans, Document
from .._masks._positional import Causal, Full, PrefixLM, SlidingWindow
from .._ring._comm import AllGather, RingConfig
from .._score_mods import ALiBi, Chain, Softcap
from ._lm import RingTransformerLM
from ._mlp import GeluMLP, SwiGLUMLP
from ._options import AttentionOptions
from ._precision import Precision


_FORMAT = "ringeqx-checkpoint"
_VERSION = 1
_META = "ringeqx.json"  # written last: a checkpoint without it is incomplete
_ARRAYS = "arrays"

# The classes a stored configuration may name, by their public names (which survive the
# package's files moving): the options of a model's attention. Anything else (a user's
# own mask, say) is not stored as data; such a model is restored with `like=`.
_KNOWN = {
    cls.__name__: cls
    for cls in (
        Full,
        Causal,
        Document,
        SlidingWindow,
        PrefixLM,
        BidirectionalSpans,
        BlockSparse,
        And,
        Or,
        Softcap,
        ALiBi,
        Chain,
        RingConfig,
        AllGather,
        XlaKernel,
        PallasTpuKernel,
        PallasGpuKernel,
        Precision,
    )
}


class Checkpoint(eqx.Module):
    """What [`ringeqx.nn.load_checkpoint`][] restores.

    - `model`: the model, its arrays on the mesh asked for.
    - `opt_state`: the optimiser state (None when none was saved).
    - `step`: the step saved with it (None when none was).
    """

    model: Any
    opt_state: Any
    step: int | None


def _orbax():
    try:
        import orbax.checkpoint as ocp
    except ImportError as e:
        raise ImportError(
            "Checkpoints need Orbax: `pip install 'ringeqx[checkpoint]'` (or "
            "`pip install orbax-checkpoint`)."
        ) from e
    return ocp


def _checkpointer(ocp):
    """A synchronous Orbax checkpointer: a save has finished, on every host, when it
    returns (no thread left writing when the metadata says the checkpoint is whole)."""
    return ocp.Checkpointer(ocp.StandardCheckpointHandler())


class _NotData(Exception):
    """A value a configuration cannot hold as JSON."""


def _encode(x) -> Any:
    """`x` as JSON data: scalars as they are; tuples, dtypes, arrays (their bytes, exactly)
    and the known modules tagged."""
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, tuple) and not hasattr(x, "_fields"):
        return {"tuple": [_encode(y) for y in x]}
    if isinstance(x, np.dtype):
        return {"dtype": x.name}
    if isinstance(x, (jax.Array, np.ndarray)):
        a = np.asarray(x)
        return {"array": a.tobytes().hex(), "dtype": a.dtype.name, "shape": list(a.shape)}
    cls = type(x)
    if isinstance(x, eqx.Module) and _KNOWN.get(cls.__name__) is cls:
        fields = {f.name: _encode(getattr(x, f.name)) for f in dataclasses.fields(x)}
        return {"module": cls.__name__, "fields": fields}
    raise _NotData(f"a {cls.__name__}")


def _decode(x) -> Any:
    """The inverse of `_encode`."""
    if not isinstance(x, dict):
        return x
    if "tuple" in x:
        return tuple(_decode(y) for y in x["tuple"])
    if "array" in x:
        dtype = jax.numpy.dtype(x["dtype"])
        data = np.frombuffer(bytes.fromhex(x["array"]), dtype).reshape(x["shape"])
        return jax.numpy.asarray(data)
    if "dtype" in x:
        return jax.numpy.dtype(x["dtype"])
    cls = _KNOWN[x["module"]]
    names = {f.name for f in dataclasses.fields(cls)}
    if set(x["fields"]) != names:
        raise ValueError(f"a {cls.__name__} has the fields {sorted(names)}; got {x['fields']}")
    # As Equinox rebuilds a module from its fields (a pytree's unflatten): the values
    # passed their checks when the saved model was built.
    module = object.__new__(cls)
    for name, value in x["fields"].items():
        object.__setattr__(module, name, _decode(value))
    return module


def _lm_arguments(model: RingTransformerLM) -> dict:
    """The arguments of `RingTransformerLM(...)` that build a model like `model`."""
    block = model.blocks[0] if isinstance(model.blocks, tuple) else model.blocks
    a = block.attention
    match block.mlp:
        case GeluMLP():
            mlp, hidden = "gelu", block.mlp.mlp_in.out_features
        case SwiGLUMLP():
            mlp, hidden = "swiglu", block.mlp.gate.out_features
        case _:
            raise _NotData(f"an MLP {type(block.mlp).__name__}")
    if model.scan_layers:
        num_layers = jax.tree.leaves(eqx.filter(model.blocks, eqx.is_array))[0].shape[0]
    else:
        num_layers = len(model.blocks)
    layer = _first_layer if model.scan_layers else (lambda x: x)
    options = dict(
        head_dim=a.head_dim,
        mask=layer(a.mask),
        score_mod=layer(a.score_mod),
        sinks=a.sinks is not None,
        rope_theta=a.rope_theta,
        kernel=a.kernel,
        config=layer(a.config),
        axis_name=a.axis_name,
        use_bias=a.query_proj.use_bias,
        precision=a.precision,
    )
    return dict(
        vocab_size=model.embedding.num_embeddings,
        dim=model.embedding.embedding_size,
        num_heads=a.num_heads,
        num_layers=num_layers,
        num_kv_heads=a.num_kv_heads,
        hidden=hidden,
        checkpoint=model.checkpoint,
        scan_layers=model.scan_layers,
        mlp=mlp,
        norm_bias=model.final_norm.use_bias,
        attention={k: _encode(v) for k, v in options.items()},
    )


def _first_layer(tree):
    """The first layer's slice of a scanned model's option: the arrays of a mask (a
    block-sparse pattern) are stacked like the weights, one per layer."""
    arrays, static = eqx.partition(tree, eqx.is_array)
    return eqx.combine(jax.tree.map(lambda x: x[0], arrays), static)


def _abstract_lm(arguments: dict) -> RingTransformerLM:
    """The model the stored `arguments` build, its arrays as `jax.ShapeDtypeStruct`s."""
    kwargs = dict(arguments)
    options = {k: _decode(v) for k, v in kwargs.pop("attention").items()}
    attention = AttentionOptions(**options)
    return eqx.filter_eval_shape(
        lambda: RingTransformerLM(**kwargs, attention=attention, key=jax.random.key(0))
    )


def _is_leaf_array(x) -> bool:
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def _name(path) -> str:
    parts = []
    for entry in path:
        for attribute in ("name", "key", "idx"):
            if hasattr(entry, attribute):
                parts.append(str(getattr(entry, attribute)))
                break
        else:
            parts.append(str(entry))
    return ".".join(parts)


def _arrays(tree) -> list[tuple[str, Any]]:
    """The array leaves of `tree` (arrays or their shapes), each with its path's name."""
    arrays = eqx.filter(tree, _is_leaf_array)
    return [(_name(p), x) for p, x in jax.tree_util.tree_flatten_with_path(arrays)[0]]


def _nested(named: list[tuple[str, Any]]) -> dict:
    """`{name: leaf}` as nested dicts, one level per part of the name (for Orbax)."""
    out: dict = {}
    for name, leaf in named:
        node = out
        *parents, last = name.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = leaf
    return out


def _flat(nested: dict, names: list[str]) -> list:
    out = []
    for name in names:
        node = nested
        for p in name.split("."):
            node = node[p]
        out.append(node)
    return out


def _manifest(named: list[tuple[str, Any]]) -> list:
    return [[n, list(x.shape), jax.numpy.dtype(x.dtype).name] for n, x in named]


def _sync(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def save_checkpoint(
    directory: str | os.PathLike,
    model: eqx.Module,
    opt_state: Any = None,
    *,
    step: int | None = None,
    overwrite: bool = False,
) -> None:
    """Save `model` and, optionally, an optimiser's state, as one checkpoint directory.

    Every array is saved sharded, by [Orbax](https://orbax.readthedocs.io): each host
    writes the shards it holds (call this on every process of a multi-host program).
    A [`ringeqx.nn.RingTransformerLM`][]'s configuration (sizes, masks, kernels, ring
    configuration, precision) is stored as JSON beside the arrays, so that
    [`ringeqx.nn.load_checkpoint`][] rebuilds it without a template; other models (or a
    model whose layers differ from what its constructor builds) are stored without one
    and restored with `like=`. No pickle is written.

    Needs `orbax-checkpoint`: `pip install 'ringeqx[checkpoint]'`.

    **Arguments:**

    - `directory`: the checkpoint's directory; it must not exist unless `overwrite`.
    - `model`: the model (any Equinox module; its arrays may be sharded).
    - `opt_state`: an optimiser state, such as `optax`'s (a pytree of arrays).
    - `step`: the training step, returned by `load_checkpoint`.
    - `overwrite`: replace an existing directory.

    **Raises:** a `FileExistsError` naming `directory` when it exists and not
    `overwrite`; a `ValueError` for a `step` that is not an int.
    """
    ocp = _orbax()
    path = os.path.abspath(os.fspath(directory))
    if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
        raise ValueError(f"`step` must be an int or None; got {step!r}.")
    if os.path.exists(path):
        if not overwrite:
            raise FileExistsError(
                f"`directory` {path!r} exists: pass overwrite=True to replace it, or "
                "save each checkpoint to a directory of its own."
            )
        _sync("ringeqx_checkpoint_exists")  # every process has seen it before it goes
        if jax.process_index() == 0:
            shutil.rmtree(path)
        _sync("ringeqx_checkpoint_removed")
    config = None
    if isinstance(model, RingTransformerLM):
        try:
            arguments = _lm_arguments(model)
        except _NotData:
            arguments = None
        # Stored only if it rebuilds this very model: the same structure, static fields
        # (masks, kernels, ...) included, and the same shapes and dtypes.
        if arguments is not None and _same(_abstract_lm(arguments), model):
            config = {"class": "RingTransformerLM", "arguments": arguments}
    model_arrays = _arrays(model)
    state_arrays = [] if opt_state is None else _arrays(opt_state)
    items = {"model": _nested(model_arrays)}
    if state_arrays:
        items["opt_state"] = _nested(state_arrays)
    with _checkpointer(ocp) as checkpointer:
        checkpointer.save(os.path.join(path, _ARRAYS), args=ocp.args.StandardSave(items))
    meta = {
        "format": _FORMAT,
        "version": _VERSION,
        "step": step,
        "model": config,
        "arrays": {"model": _manifest(model_arrays), "opt_state": _manifest(state_arrays)},
        "has_opt_state": opt_state is not None,
    }
    if jax.process_index() == 0:
        with open(os.path.join(path, _META), "w") as f:
            json.dump(meta, f, indent=1)
    _sync("ringeqx_checkpoint_saved")


def _same(a, b) -> bool:
    """Whether two models have one structure (static fields included) and the same
    shapes and dtypes."""
    la, ta = jax.tree.flatten(eqx.filter(a, _is_leaf_array))
    lb, tb = jax.tree.flatten(eqx.filter(b, _is_leaf_array))
    if ta != tb or eqx.partition(a, _is_leaf_array)[1] != eqx.partition(b, _is_leaf_array)[1]:
        return False
    return all(x.shape == y.shape and x.dtype == y.dtype for x, y in zip(la, lb))


def _read_meta(path: str) -> dict:
    if not os.path.isdir(path):
        raise FileNotFoundError(f"`directory` {path!r} does not exist (no checkpoint there).")
    where = os.path.join(path, _META)
    if not os.path.isfile(where):
        raise ValueError(
            f"`directory` {path!r} is not a complete ringeqx checkpoint: it has no {_META} "
            "(written last by ringeqx.nn.save_checkpoint: the save did not finish, or this "
            "is another kind of directory)."
        )
    try:
        with open(where) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"`directory` {path!r} is damaged: {where} cannot be read ({e}).") from e
    if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
        raise ValueError(f"`directory` {path!r} is damaged: {where} is not a ringeqx checkpoint's.")
    if meta.get("version") != _VERSION:
        raise ValueError(
            f"`directory` {path!r} holds a checkpoint of format version "
            f"{meta.get('version')!r}; this ringeqx reads version {_VERSION}."
        )
    return meta


def _target(named, stored: list, what: str, path: str, sharding_of) -> dict:
    """The abstract arrays to restore `what` into, checked against the stored manifest."""
    have = _manifest(named)
    if have != stored:
        extra = [h for h in have if h not in stored][:3]
        missing = [s for s in stored if s not in have][:3]
        raise ValueError(
            f"The {what} template does not match the checkpoint in {path!r}: the checkpoint "
            f"has {missing} (name, shape, dtype; first three) where the template has "
            f"{extra}."
        )
    return _nested(
        [(n, jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding_of(x))) for n, x in named]
    )


def load_checkpoint(
    directory: str | os.PathLike,
    *,
    like: eqx.Module | None = None,
    optimizer: Any = None,
    mesh: Mesh | None = None,
) -> Checkpoint:
    """Restore what [`ringeqx.nn.save_checkpoint`][] saved in `directory`, onto `mesh`:
    any mesh, of any ring size, on any number of hosts (each reads the shards it needs).

    Needs `orbax-checkpoint`: `pip install 'ringeqx[checkpoint]'`.

    **Arguments:**

    - `directory`: the checkpoint's directory.
    - `like`: a template of the model (concrete, or abstract from
        `eqx.filter_eval_shape`), needed only when the checkpoint stores no
        configuration (a model other than a `RingTransformerLM`); its static fields are
        the restored model's. Its arrays' shardings are kept when `mesh` is None.
    - `optimizer`: the optimiser whose state was saved (anything with `init(params)`,
        such as an `optax.GradientTransformation`): its state's structure is
        `optimizer.init(eqx.filter(model, eqx.is_array))`'s. Without it the state is
        not restored (`opt_state` is None).
    - `mesh`: the mesh whose devices every array is placed on, replicated. Default: the
        template's shardings where `like`'s arrays have them, else every device.

    **Returns:** a [`ringeqx.nn.Checkpoint`][] `(model, opt_state, step)`.

    **Raises:** a `FileNotFoundError` or `ValueError` naming `directory` when it is
    missing, incomplete or damaged, or does not match the templates; a `ValueError` when
    it stores no configuration and no `like` is given.
    """
    ocp = _orbax()
    path = os.path.abspath(os.fspath(directory))
    meta = _read_meta(path)
    if like is None:
        config = meta.get("model")
        if config is None:
            raise ValueError(
                f"The checkpoint in {path!r} stores no model configuration (its model was "
                "not a RingTransformerLM that its constructor rebuilds): pass `like=`, a "
                "model of the same structure (e.g. from `eqx.filter_eval_shape`)."
            )
        try:
            like = _abstract_lm(config["arguments"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(
                f"`directory` {path!r} is damaged: its model configuration cannot be "
                f"rebuilt ({type(e).__name__}: {e})."
            ) from e
    if mesh is not None:
        replicated = NamedSharding(mesh, PartitionSpec())
    else:
        replicated = NamedSharding(Mesh(np.array(jax.devices()), ("devices",)), PartitionSpec())

    def sharding_of(x):
        if mesh is None and getattr(x, "sharding", None) is not None:
            return x.sharding
        return replicated

    stored = meta["arrays"]
    model_named = _arrays(like)
    targets = {"model": _target(model_named, stored["model"], "model", path, sharding_of)}
    state_like = None
    if optimizer is not None:
        if not meta.get("has_opt_state"):
            raise ValueError(
                f"The checkpoint in {path!r} holds no optimiser state; load it without "
                "`optimizer=`."
            )
        params = eqx.filter(like, _is_leaf_array)
        state_like = eqx.filter_eval_shape(optimizer.init, params)
        state_named = _arrays(state_like)
        if state_named:
            targets["opt_state"] = _target(
                state_named, stored["opt_state"], "optimizer state", path, sharding_of
            )
    with _checkpointer(ocp) as checkpointer:
        try:
            restored = checkpointer.restore(
                os.path.join(path, _ARRAYS), args=ocp.args.StandardRestore(targets)
            )
        except Exception as e:  # Orbax's errors for missing or garbled files vary
            raise ValueError(
                f"`directory` {path!r} is damaged: its arrays cannot be read "
                f"({type(e).__name__}: {e})."
            ) from e
    model = _fill(like, model_named, restored["model"])
    opt_state = None
    if state_like is not None:
        opt_state = _fill(state_like, state_named, restored.get("opt_state", {}))
    return Checkpoint(model, opt_state, meta.get("step"))


def _fill(like, named, nested: dict):
    """`like` with its arrays replaced by the restored ones."""
    arrays, static = eqx.partition(like, _is_leaf_array)
    leaves = _flat(nested, [n for n, _ in named])
    return eqx.combine(jax.tree.unflatten(jax.tree.structure(arrays), leaves), static)
