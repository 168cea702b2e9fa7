"""Saving a model whole: its arrays and its static configuration (masks, kernels, sizes),
which `eqx.tree_serialise_leaves` alone does not store."""

import io
import os
import pickle

import equinox as eqx
import jax
import numpy as np


_MAGIC = b"ringeqx-model-1\n"


def save_model(path: str | os.PathLike, model: eqx.Module) -> None:
    """Save `model` whole: its structure and static configuration (the mask, kernel,
    sizes, ...) and its arrays.

    `eqx.tree_serialise_leaves` stores the arrays only: deserialising them into a model
    built with another mask, kernel or configuration silently keeps the template's
    (static fields are not stored). [`ringeqx.nn.load_model`][] needs no template.

    The structure is stored with `pickle` (a model's classes must be importable where it
    is loaded), the arrays with `eqx.tree_serialise_leaves`. Like any pickle, load only
    files you trust.
    """
    arrays, static = eqx.partition(model, eqx.is_array)
    skeleton = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), arrays)
    leaves = io.BytesIO()
    eqx.tree_serialise_leaves(leaves, arrays)
    with open(path, "wb") as f:
        f.write(_MAGIC)
        pickle.dump((skeleton, static, leaves.getvalue()), f)


def load_model(path: str | os.PathLike) -> eqx.Module:
    """The model [`ringeqx.nn.save_model`][] saved at `path`, as it was (configuration
    and arrays)."""
    with open(path, "rb") as f:
        if f.read(len(_MAGIC)) != _MAGIC:
            raise ValueError(
                f"`path` {str(path)!r} is not a model saved by ringeqx.nn.save_model."
            )
        skeleton, static, leaves = pickle.load(f)
    like = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), skeleton)
    arrays = eqx.tree_deserialise_leaves(io.BytesIO(leaves), like)
    arrays = jax.tree.map(jax.numpy.asarray, arrays)
    return eqx.combine(arrays, static)
