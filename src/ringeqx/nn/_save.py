"""Deprecated: saving a model whole into one pickle file (its arrays and its static
configuration). Checkpoints (`_checkpoint.py`) replace it: sharded, with the optimiser's
state, restorable onto another mesh, and no pickle."""

import hashlib
import importlib
import io
import os
import pickle
import warnings

import equinox as eqx
import jax
import numpy as np


_MAGIC = b"ringeqx-model-1\n"
# After the pickle (which `pickle.load` stops before, so files stay readable by the
# loaders that predate it): the SHA-256 of everything before, so that damage anywhere,
# the arrays' bytes included, is an error and not a model with other weights.
_DIGEST = b"sha256:"


def _deprecated(name: str) -> None:
    warnings.warn(
        f"`ringeqx.nn.{name}` is deprecated: its files are pickles, written from one host, "
        "without the optimiser's state. Use `ringeqx.nn.save_checkpoint` and "
        "`ringeqx.nn.load_checkpoint` (`pip install 'ringeqx[checkpoint]'`); to convert a "
        "file, `save_checkpoint(directory, load_model(path))`.",
        DeprecationWarning,
        stacklevel=3,
    )


def _digest(body: bytes) -> bytes:
    return _DIGEST + hashlib.sha256(body).hexdigest().encode() + b"\n"


def save_model(path: str | os.PathLike, model: eqx.Module) -> None:
    """Deprecated: use [`ringeqx.nn.save_checkpoint`][] (sharded, with the optimiser's
    state, no pickle). This still writes the old file, with a `DeprecationWarning`.

    Save `model` whole: its structure and static configuration (the mask, kernel,
    sizes, ...) and its arrays, of any dtype (bfloat16 and float16 included), exactly.

    `eqx.tree_serialise_leaves` stores the arrays only: deserialising them into a model
    built with another mask, kernel or configuration silently keeps the template's
    (static fields are not stored). [`ringeqx.nn.load_model`][] needs no template.

    The structure is stored with `pickle` (a model's classes must be importable where it
    is loaded), the arrays with `eqx.tree_serialise_leaves`, and a checksum of both
    after them. Like any pickle, load only files you trust.
    """
    _deprecated("save_model")
    arrays, static = eqx.partition(model, eqx.is_array)
    skeleton = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), arrays)
    leaves = io.BytesIO()
    eqx.tree_serialise_leaves(leaves, arrays)
    body = _MAGIC + pickle.dumps((skeleton, static, leaves.getvalue()))
    with open(path, "wb") as f:
        f.write(body)
        f.write(_digest(body))


def _leaf(f, like: np.ndarray) -> np.ndarray:
    """One array of the file, typed like `like`: `np.save` writes the dtypes that NumPy
    knows only through `ml_dtypes` (bfloat16, the float8s) as raw bytes, `|V2`."""
    out = np.load(f, allow_pickle=False)
    if out.dtype != like.dtype and out.dtype.kind == "V" and out.itemsize == like.itemsize:
        out = out.view(like.dtype)
    return out


# Modules whose classes moved (issue 44): into folders, or split in two. A file saved
# before names the old module, and its classes are now in one of these.
_MOVED = {
    "ringeqx._masks": ("_masks._base", "_masks._positional", "_masks._ids",
                       "_masks._block_sparse", "_masks._reads"),
    "ringeqx._layout": ("_layout._layout",),
    "ringeqx._tokens": ("_layout._tokens",),
    "ringeqx._comm": ("_ring._comm",),
    "ringeqx._kvcache": ("_inference._kvcache",),
    # The model's module split in two (issue 44): the block and the language model.
    "ringeqx.nn._transformer": ("nn._lm", "nn._block"),
    # The Pallas kernels' modules split by job (issue 44): the classes are in `_kernel`.
    "ringeqx._kernels._pallas_tpu": ("_kernels._mosaic._kernel",),
    "ringeqx._kernels._pallas_gpu": ("_kernels._triton._kernel",),
}  # fmt: skip


class _Unpickler(pickle.Unpickler):
    """`pickle.Unpickler` that also finds a class where it moved since the file was
    saved (`_MOVED`)."""

    def find_class(self, module: str, name: str):
        try:
            return super().find_class(module, name)
        except (ImportError, AttributeError):
            for moved in _MOVED.get(module, ()):
                found = getattr(importlib.import_module(f"ringeqx.{moved}"), name, None)
                if found is not None:
                    return found
            raise


def load_model(path: str | os.PathLike) -> eqx.Module:
    """Deprecated: use [`ringeqx.nn.load_checkpoint`][]. This still reads the files
    of [`ringeqx.nn.save_model`][], with a `DeprecationWarning`.

    The model [`ringeqx.nn.save_model`][] saved at `path`, as it was (configuration
    and arrays, in their dtypes).

    **Raises:** a `ValueError` naming `path` for a file that is not a saved model, or is
    damaged (truncated, or its bytes changed: the checksum written after the model does
    not match); an `ImportError` when a class of the model cannot be imported here.
    """
    _deprecated("load_model")
    with open(path, "rb") as f:
        data = f.read()
    where = f"`path` {str(path)!r}"
    if not data.startswith(_MAGIC):
        raise ValueError(f"{where} is not a model saved by ringeqx.nn.save_model.")

    def damaged(why: str) -> ValueError:
        return ValueError(
            f"{where} is damaged or not a ringeqx model (a file written by "
            f"ringeqx.nn.save_model): {why}."
        )

    stream = io.BytesIO(data)
    stream.seek(len(_MAGIC))
    try:
        payload = _Unpickler(stream).load()
    except (ImportError, AttributeError) as e:
        # A class the model needs is not importable here (or a damaged name).
        raise ImportError(
            f"{where}: a class of the saved model cannot be imported here ({e}). Import "
            "the module that defines it before loading (or, if it is a ringeqx class, "
            "the file is damaged)."
        ) from e
    except Exception as e:  # any other unpickling error is a damaged stream
        raise damaged(f"its model cannot be read ({type(e).__name__}: {e})") from e
    end = stream.tell()
    trailer = data[end:]
    if trailer and trailer != _digest(data[:end]):
        raise damaged("its checksum does not match its contents")
    if not (isinstance(payload, tuple) and len(payload) == 3 and isinstance(payload[2], bytes)):
        raise damaged(f"it holds a {type(payload).__name__}, not a saved model")
    skeleton, static, leaves = payload
    like = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), skeleton)
    try:
        arrays = eqx.tree_deserialise_leaves(io.BytesIO(leaves), like, filter_spec=_leaf)
    except Exception as e:  # a short or garbled array stream
        raise damaged(f"its arrays cannot be read ({type(e).__name__}: {e})") from e
    arrays = jax.tree.map(jax.numpy.asarray, arrays)
    return eqx.combine(arrays, static)
