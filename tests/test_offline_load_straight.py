"""Stored packs load straight (issue 44): ``PackedRowCollator`` builds the batch from the stored
row's streams (thdpack/offline/store/row_batch.py), never splitting it into samples; a VLM pack's vision
fields come from views of the row. Over every row of real builds (the demo with a loss mask; CP 2 with
labels; a two-source mixture with per-sample values; Qwen2-VL and Qwen2.5-VL builds with images, CP 1 and 2;
DPO and GRPO-like ``share_prefix`` builds, whose batches are shared-prefix trees),
alone and several at once, with layout overrides (CP ranks, a pad multiple, a ``max_length`` that cuts),
its batch equals, field by field and dtype by dtype, the route it replaced: the row's samples
(``unpack_row``) through a ``ThdCollator`` (with the VLM family), then the stored ``sample_index`` /
``source_index`` patched in.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from thdpack import ThdCollator
from thdpack.cli import main as cli_main
from thdpack.common.values import PREFIX
from thdpack.offline import load_packed, unpack_row
from thdpack.offline.store.schema import SOURCE_COLUMN

ROOT = Path(__file__).resolve().parents[1]
DEMO = ["--config", str(ROOT / "configs" / "demo.yaml"), "--max-rows", "300", "--pack-size", "2048"]


def rejoined(collator, rows: list[dict]):
    """The batch of ``rows`` by the route before issue 44: their samples through a ``ThdCollator``."""
    samples = []
    for row in rows:
        samples += unpack_row(row)
        if collator.share_prefix:  # each sample's group and declared prefix, as the build stored them
            samples[-len(row["seq_lens"]):] = [dict(s, group=int(g), prefix_len=int(p)) for s, g, p in zip(
                samples[-len(row["seq_lens"]):], row["group_id"], row["prefix_len"])]
    batch = ThdCollator(**collator.collator.layout.keywords(), vlm=collator._vlm, **collator._share)(samples)
    index = np.concatenate([np.asarray(row["sample_index"], np.int64) for row in rows])
    batch = dataclasses.replace(batch, sample_index=torch.from_numpy(index))
    if all(SOURCE_COLUMN in row for row in rows):
        sources = np.concatenate([np.asarray(row[SOURCE_COLUMN], np.int64) for row in rows])
        batch = dataclasses.replace(batch, source_index=torch.from_numpy(sources))
    for name in collator.sample_values:
        batch.extras[PREFIX + name] = torch.from_numpy(np.concatenate([row["sample_values." + name] for row in rows]))
    return batch


def differences(got, want, name: str = "batch") -> list[str]:
    """Where ``got`` and ``want`` differ: tensors by value and dtype, dicts and dataclasses (the batch, its
    prefix tree) field by field, anything else by type and ``==``."""
    if isinstance(want, torch.Tensor):
        ok = isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want)
        return [] if ok else [name]
    if isinstance(want, dict):
        if not isinstance(got, dict) or got.keys() != want.keys():
            return [name]
        return [d for k in want for d in differences(got[k], want[k], f"{name}[{k}]")]
    if dataclasses.is_dataclass(want):
        if type(got) is not type(want):
            return [name]
        return [d for f in dataclasses.fields(want)
                for d in differences(getattr(got, f.name), getattr(want, f.name), f"{name}.{f.name}")]
    return [] if type(got) is type(want) and got == want else [name]


def assert_same(got, want, where: str) -> None:
    assert not differences(got, want), (where, differences(got, want))


def build(tmp_path_factory, name: str, *args: str):
    out = tmp_path_factory.mktemp(name) / "packs"
    assert cli_main(["build", *args, "--output", str(out), "-q"]) == 0
    return load_packed(out)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return build(tmp_path_factory, "demo", *DEMO)


@pytest.fixture(scope="module")
def demo_cp2(tmp_path_factory):
    return build(tmp_path_factory, "cp2", *DEMO, "--cp-size", "2", "--targets", "labels")


@pytest.fixture(scope="module")
def mixture(tmp_path_factory):
    """Two pre-tokenized sources with a float and an int value per row."""
    d = tmp_path_factory.mktemp("mix-in")
    rng = np.random.default_rng(0)
    inputs = []
    for k in range(2):
        rows = []
        for i in range(120):
            n = int(rng.integers(2, 300))
            rows.append({"input_ids": rng.integers(0, 3000, n).tolist(), "loss_mask": (rng.random(n) < 0.6).tolist(),
                         "reward": float(rng.normal()), "domain": int(rng.integers(0, 5))})
        path = d / f"source{k}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        inputs.append({"path": str(path), "format": "tokenized", "weight": 0.5})
    config = d / "mix.yaml"
    config.write_text(json.dumps({"input": inputs, "tokenizer": str(ROOT / "thdpack" / "demo" / "tokenizer"),
                                  "pack_size": 1024, "overflow": "truncate", "sample_values": ["reward", "domain"]}))
    return build(tmp_path_factory, "mix", "--config", str(config))


def check_rows(ds, **overrides) -> None:
    collator = ds.collator(**overrides)
    collator._rejoined = None  # text packs never take the samples' route
    rows = [ds[k] for k in range(len(ds))]
    for k, row in enumerate(rows):
        assert_same(collator(row), rejoined(collator, [row]), f"pack {k} {overrides}")
    for k in range(0, len(rows) - 2, max(1, len(rows) // 4)):  # a few calls of three rows
        assert_same(collator(rows[k:k + 3]), rejoined(collator, rows[k:k + 3]), f"packs {k}..{k + 2} {overrides}")


@pytest.mark.parametrize("overrides", [{}, {"pad_multiple": 16}, {"max_length": 256}], ids=str)
def test_demo_packs_load_as_their_samples_collated(demo, overrides):
    assert demo.metadata["targets"] == "loss_mask" and len(demo) > 5
    check_rows(demo, **overrides)


@pytest.mark.parametrize("overrides", [{}, {"cp_rank": 0}, {"cp_rank": 1}, {"cp_rank": 1, "max_length": 300}],
                         ids=str)
def test_cp2_label_packs_load_as_their_samples_collated(demo_cp2, overrides):
    assert demo_cp2.metadata["targets"] == "labels" and demo_cp2.metadata["cp_size"] == 2
    check_rows(demo_cp2, **overrides)


def test_a_mixtures_packs_load_with_their_sources_and_values(mixture):
    assert SOURCE_COLUMN in mixture[0] and set(mixture.metadata["sample_values"]) == {"reward", "domain"}
    check_rows(mixture)
    batch = mixture.collator()([mixture[k] for k in range(len(mixture))])
    assert set(batch.source_index.tolist()) == {0, 1}


def test_bad_rows_are_refused_as_before(demo):
    """A row whose tokens or targets are not integers fails as its samples did: naming the same sample."""
    collator = demo.collator()
    collator._rejoined = None
    rows = [demo[0], dict(demo[1], input_ids=np.asarray(demo[1]["input_ids"], bool))]
    first = len(rows[0]["seq_lens"])
    with pytest.raises(ValueError, match=f"sample {first}\\b.*input_ids"):
        collator(rows)
    with pytest.raises(ValueError, match=f"sample {first}\\b.*input_ids"):
        rejoined(collator, rows)
    short = dict(demo[0], loss_mask=demo[0]["loss_mask"][:-1])
    with pytest.raises(ValueError, match="'loss_mask' has"):
        collator(short)


# --------------------------------------------------------------------------- VLM packs


@pytest.fixture(scope="module")
def vlm_builds(tmp_path_factory):
    """Small VLM builds of tests/test_offline_vlm.py's chat rows with generated images: Qwen2-VL and
    Qwen2.5-VL, and Qwen2-VL planned for CP 2."""
    pytest.importorskip("datasets")
    pytest.importorskip("PIL.Image")
    from test_offline_vlm import assets as assets_fixture, cfg
    from thdpack.offline import build_packed

    assets = assets_fixture.__wrapped__(tmp_path_factory)
    out = tmp_path_factory.mktemp("vlm-builds")
    return {name: load_packed(build_packed(cfg(assets, family, **kw), out / name, progress=False).path)
            for name, family, kw in [("qwen2_vl", "qwen2_vl", {}), ("qwen2_5_vl", "qwen2_5_vl", {}),
                                     ("cp2", "qwen2_vl", {"cp_size": 2})]}


@pytest.mark.parametrize(("build_name", "overrides"), [
    ("qwen2_vl", {}), ("qwen2_vl", {"pad_multiple": 16}), ("qwen2_5_vl", {}), ("cp2", {}), ("cp2", {"cp_rank": 0}),
    ("cp2", {"cp_rank": 1}), ("qwen2_vl", {"model_config": None})], ids=str)
def test_vlm_packs_load_as_their_samples_collated(vlm_builds, build_name, overrides):
    ds = vlm_builds[build_name]
    assert "image_counts" in ds.columns and any(ds[k]["image_counts"].any() for k in range(len(ds)))
    check_rows(ds, **overrides)


def test_vlm_batches_own_their_pixels(vlm_builds):
    """The row's pixels are read-only views of the memory-mapped file; a batch's are its own copy, also
    where one sample holds all of them."""
    ds = vlm_builds["qwen2_vl"]
    collator = ds.collator()
    for k in range(len(ds)):
        row = ds[k]
        pixels = collator(row).extras["pixel_values"]
        if pixels is not None:
            assert not np.shares_memory(pixels.numpy(), row["pixel_values"]), k
            pixels.add_(0)  # writable


def test_vlm_rows_are_refused_as_before(vlm_builds):
    """A cut through an image and a damaged vision column fail as the samples' route does."""
    ds = vlm_builds["qwen2_vl"]
    collator = ds.collator(max_length=8)
    k = next(k for k in range(len(ds)) if ds[k]["image_counts"].any())
    with pytest.raises(ValueError) as got:
        collator(ds[k])
    with pytest.raises(ValueError) as want:
        rejoined(collator, [ds[k]])
    assert str(got.value) == str(want.value)
    bad = dict(ds[k], image_counts=ds[k]["image_counts"][:-1])
    with pytest.raises(ValueError, match="image_counts has"):
        ds.collator()(bad)


# --------------------------------------------------------------------------- shared-prefix packs


@pytest.fixture(scope="module")
def shared_builds(tmp_path_factory):
    """tests/test_offline_shared_prefix.py's DPO and GRPO-like (``group_column``, pad multiple 8) builds
    with ``share_prefix: true``."""
    pytest.importorskip("datasets")
    from test_offline_shared_prefix import built

    tmp = tmp_path_factory.mktemp("shared-builds")
    return {kind: load_packed(built(tmp, kind, True)) for kind in ("dpo", "groups")}


@pytest.mark.parametrize(("kind", "overrides"), [
    ("dpo", {}), ("dpo", {"share_prefix": False}), ("dpo", {"pad_multiple": 16}), ("groups", {}),
    ("groups", {"share_prefix": False})], ids=str)
def test_shared_prefix_packs_load_as_their_samples_collated(shared_builds, kind, overrides):
    ds = shared_builds[kind]
    collator = ds.collator(**overrides)
    trees = sum(collator(ds[k]).prefix_tree is not None for k in range(len(ds)))
    assert trees > 0 if collator.share_prefix else trees == 0
    check_rows(ds, **overrides)


@pytest.mark.parametrize("kind", ["dpo", "groups"])
def test_shared_prefix_packs_cut_by_max_length(shared_builds, kind):
    """A ``max_length`` that keeps every declared prefix whole and cuts some members' answers."""
    ds = shared_builds[kind]
    align = ds.metadata["align"]  # a max_length is cut down to the pad multiple
    cut = -(-max(int(ds[k]["prefix_len"].max()) for k in range(len(ds))) // align) * align
    assert any(int(ds[k]["seq_lens"].max()) > cut for k in range(len(ds)))
    check_rows(ds, max_length=cut)


def test_vlm_packs_with_group_columns_load_as_their_samples_collated(vlm_builds):
    """A VLM build cannot share prefixes (its config refuses), but a collator asked to reads the rows' groups:
    VLM pack rows given group columns (each sample its own group) load as their samples do."""
    ds = vlm_builds["qwen2_vl"]
    collator = ds.collator(share_prefix=True, min_prefix_len=4)
    rows = [dict(ds[k], group_id=np.arange(len(ds[k]["seq_lens"])), prefix_len=np.zeros(len(ds[k]["seq_lens"]), int))
            for k in range(len(ds))]
    for k, row in enumerate(rows):
        assert_same(collator(row), rejoined(collator, [row]), f"pack {k}")
    assert_same(collator(rows), rejoined(collator, rows), "all packs")


def test_shared_prefix_rows_are_refused_as_before(shared_builds):
    """A ``max_length`` that cuts a declared prefix fails as the samples' route does."""
    collator = shared_builds["dpo"].collator(max_length=6)
    with pytest.raises(ValueError, match="declares prefix_len=") as got:
        collator(shared_builds["dpo"][0])
    with pytest.raises(ValueError) as want:
        rejoined(collator, [shared_builds["dpo"][0]])
    assert str(got.value) == str(want.value)


def test_shared_prefix_rows_without_groups_are_refused(demo):
    with pytest.raises(KeyError, match="packed row 0 has no 'group_id' column"):
        demo.collator(share_prefix=True)(demo[0])
