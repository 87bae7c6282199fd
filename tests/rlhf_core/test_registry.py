"""The one table every family of interchangeable pieces uses (algorithms, rewards, dataset adapters)."""

from __future__ import annotations

import sys

import pytest

from rlhf_core.registry import Registry


def test_a_name_registered_twice_to_different_objects_is_refused_and_a_miss_names_the_valid_ones():
    table: Registry = Registry("thing")
    first = table.register("a")(len)
    assert table.register("a")(len) is first  # the same object again: import twice, same table
    assert table.register("b")(len) is len  # one object under two names
    with pytest.raises(ValueError, match="thing 'a' is already registered"):
        table.register("a")(abs)
    with pytest.raises(ValueError, match=r"unknown thing 'c'; valid: \['a', 'b'\]"):
        table.get("c")
    assert table.entries() == {"a": len, "b": len} and table.names() == ["a", "b"]
    assert ["a"] not in table  # an unhashable name (a mis-parsed config) is simply absent


def test_providers_are_imported_at_the_first_lookup_not_before(tmp_path, monkeypatch):
    """How the algorithm tables stay torch-free until asked: the module that registers the built-in
    entries is imported by the first lookup, after a plug-in registered its own."""
    (tmp_path / "registry_test_table.py").write_text(
        "from rlhf_core.registry import Registry\nTABLE = Registry('thing', ('registry_test_provider',))\n")
    (tmp_path / "registry_test_provider.py").write_text(
        "from registry_test_table import TABLE\nTABLE.register('built_in')(len)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from registry_test_table import TABLE  # noqa: PLC0415  (written above)

    TABLE.register("plugin")(abs)
    assert "registry_test_provider" not in sys.modules
    assert TABLE.names() == ["built_in", "plugin"] and "registry_test_provider" in sys.modules
