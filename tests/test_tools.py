"""The tools wing, `ringeqx.tools`: its old top-level names still work for one release."""

import types
import warnings

import pytest

import ringeqx as rx


OLD_NAMES = sorted(
    n
    for n, v in vars(rx.tools).items()
    if not n.startswith("_") and not isinstance(v, types.ModuleType)
)


def test_every_tool_is_in_the_tools_and_not_at_the_top():
    assert "plan" in OLD_NAMES and "target_mesh" in OLD_NAMES and "HARDWARE" in OLD_NAMES
    assert len(OLD_NAMES) == 27
    assert not set(OLD_NAMES) & set(vars(rx)), "a tool is still a plain top-level name"
    assert "ring_attention" in vars(rx) and "tools" in vars(rx) and "nn" in vars(rx)


@pytest.mark.parametrize("name", OLD_NAMES)
def test_an_old_name_warns_once_and_is_the_tool(name, monkeypatch):
    monkeypatch.setattr(rx, "_warned", set())  # as if no test had asked for it yet
    with pytest.warns(DeprecationWarning, match=rf"`ringeqx\.{name}` is deprecated: use "):
        old = getattr(rx, name)
    assert old is getattr(rx.tools, name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second warning would raise here
        assert getattr(rx, name) is old
    # `from ringeqx import name` goes through the same door.
    namespace: dict = {}
    exec(f"from ringeqx import {name}", namespace)
    assert namespace[name] is old


def test_an_unknown_name_is_still_an_attribute_error():
    with pytest.raises(AttributeError, match="module 'ringeqx' has no attribute 'planner'"):
        rx.planner  # noqa: B018
