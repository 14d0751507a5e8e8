"""thdpack's public surface: ``__all__`` is the groups its docstring documents, in that order, every name
resolves (the offline ones on first use), and docs/architecture.md's "Public names" table is every package's
``__all__``, so the surface changes on purpose (issue 44 point 6)."""

import importlib
import pkgutil
import re
from pathlib import Path

import thdpack

_GROUP = re.compile(r"^- (\w+): (.*) -- ", re.M)
PAGE = (Path(__file__).resolve().parent.parent / "docs" / "architecture.md").read_text()


def documented_groups() -> dict[str, list[str]]:
    """``{group: [names]}`` from the docstring's one-line groups ``- group: ``name``, ... -- what``."""
    return {group: re.findall(r"``(\w+)``", names) for group, names in _GROUP.findall(thdpack.__doc__)}


def packages() -> list[str]:
    """``thdpack`` and every package under it (not the modules)."""
    return ["thdpack"] + sorted(m.name for m in pkgutil.walk_packages(thdpack.__path__, "thdpack.") if m.ispkg)


def page_rows() -> dict[str, list[str]]:
    """``{package: [names]}`` from the page's "Public names" table."""
    section = PAGE.split("## Public names", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(thdpack[\w.]*)` \| (.*) \|$", section, flags=re.M)
    return {package: re.findall(r"`(\w+)`", names) for package, names in rows}


def test_docstring_documents_the_groups_in_order():
    groups = documented_groups()
    assert list(groups) == ["check", "plan", "build", "collate", "rebalance", "shard", "offline"]
    assert all(groups.values())


def test_all_follows_the_documented_groups():
    documented = [name for names in documented_groups().values() for name in names]
    assert thdpack.__all__ == documented
    assert len(set(documented)) == len(documented)


def test_every_public_name_resolves():
    for package in packages():
        module = importlib.import_module(package)
        for name in getattr(module, "__all__", ()):
            assert getattr(module, name) is not None, f"{package}.{name}"


def test_the_top_level_names_are_the_readmes():
    groups = documented_groups()
    assert groups["check"] == ["check_packing"] and groups["plan"][0] == "plan_packs"
    assert groups["collate"][-1] == "IndexedDataset"
    assert thdpack.IndexedDataset.__module__ == "thdpack.loaders.collate"
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    unused = [name for name in thdpack.__all__ if not re.search(rf"\b{name}\b", readme)]
    assert set(unused) <= {"plan_hybrid_cp", "local_seq_lens"}, unused  # hybrid CP: docs/megatron.md


def test_a_subpackage_does_not_export_the_top_levels_names_again():
    top = set(thdpack.__all__)
    for package in ("thdpack.planning", "thdpack.batching", "thdpack.loaders", "thdpack.flops", "thdpack.losses",
                    "thdpack.vlm"):
        assert not top & set(importlib.import_module(package).__all__), package


def test_the_architecture_page_lists_every_packages_public_names():
    rows = page_rows()
    exported = {p: list(importlib.import_module(p).__all__) for p in packages()
                if hasattr(importlib.import_module(p), "__all__")}
    assert rows == exported  # a name added or removed: update docs/architecture.md's "Public names" with it
    section = PAGE.split("## Public names", 1)[1].split("\n## ", 1)[0]
    for package in sorted(set(packages()) - set(exported)):  # the packages without a row are named as such
        assert f"`{package}`" in section, package


def test_the_plan_types_and_collators_each_say_their_job():
    section = PAGE.split("## Public names", 1)[1].split("\n## ", 1)[0]
    for name in ("PackPlan", "BalancedPlan", "HybridCPPlan", "MixturePlan", "ThdCollator", "PackedRowCollator",
                 "hf_collator", "BridgeCollator"):
        assert re.search(rf"^- `[\w.]*{name}`: ", section, flags=re.M), name
