"""The documentation site documents every public name (the same check `nox -s docs` runs)."""

import importlib.util
from pathlib import Path


_CHECK = Path(__file__).parents[1] / "docs" / "check_api.py"


def _check_api():
    spec = importlib.util.spec_from_file_location("check_api", _CHECK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_public_name_is_on_an_api_page(tmp_path):
    check = _check_api()
    public, documented = check.public_names(), check.documented_names()
    assert "ringeqx.ring_attention" in public and "ringeqx.nn.RingAttention" in public
    assert public - documented == set(), "public names missing from docs/api/"
    assert documented - public == set(), "docs/api/ names things that are not public"
    # The check sees a page that misses a name.
    (tmp_path / "one.md").write_text("# One\n\n::: ringeqx.ring_attention\n")
    assert check.documented_names(tmp_path) == {"ringeqx.ring_attention"}


def test_ring_attention_says_score_modifier_parameters_are_trainable():
    # tests/test_score_mod_grads.py shows that they get their exact gradient; the
    # docstring said they were constants (issue 45).
    import ringeqx as rx

    doc = rx.ring_attention.__doc__
    score_mod = doc[doc.index("- `score_mod`:") : doc.index("- `span_ids`:")]
    assert "trainable" in score_mod and "no gradient" not in score_mod
    assert "constants" not in score_mod
