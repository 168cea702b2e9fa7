"""Loaded by mkdocstrings before it imports ringeqx (`extensions:` in mkdocs.yml).

jaxtyping names an annotation after the array type's `__name__`, which for `jax.Array` is
`jaxlib._jax.Array`; the API pages show what the source says, `Float[Array, "..."]`. Only
the docs build runs this (Equinox's docs rename JAX types for the same reason).
"""

import griffe
import jax


jax.Array.__name__ = "Array"


class JaxtypingNames(griffe.Extension):
    """Nothing to do per object: importing this module renamed the type."""
