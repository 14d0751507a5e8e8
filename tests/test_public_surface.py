"""thdpack's public surface: ``__all__`` is the groups its docstring documents, in that order,
and every name resolves (the offline ones on first use)."""

import re

import thdpack

_GROUP = re.compile(r"^- (\w+): (.*) -- ", re.M)


def documented_groups() -> dict[str, list[str]]:
    """``{group: [names]}`` from the docstring's one-line groups ``- group: ``name``, ... -- what``."""
    return {group: re.findall(r"``(\w+)``", names) for group, names in _GROUP.findall(thdpack.__doc__)}


def test_docstring_documents_the_groups_in_order():
    groups = documented_groups()
    assert list(groups) == ["plan", "build", "collate", "balance", "rebalance", "shard", "flops", "offline", "losses"]
    assert all(groups.values())


def test_all_follows_the_documented_groups():
    documented = [name for names in documented_groups().values() for name in names]
    assert thdpack.__all__ == documented
    assert len(set(documented)) == len(documented)


def test_every_public_name_resolves():
    for name in thdpack.__all__:
        assert getattr(thdpack, name) is not None, name


def test_plan_options_beside_plan_packs_and_indexed_dataset_with_the_loaders():
    groups = documented_groups()
    assert groups["plan"] == ["plan_packs", "PlanOptions", "PackPlan", "PackStats"]
    assert groups["collate"][-1] == "IndexedDataset"
    assert thdpack.PlanOptions.__module__ == "thdpack.planning.options"
    assert thdpack.IndexedDataset.__module__ == "thdpack.loaders.collate"
