"""Offline mixture builds (``input``: a list of sources; thdpack/offline/commands/mixture_build.py).

What must hold, each checked here through ``thdpack build`` / :func:`build_packed` / ``thdpack stats``:

- every packed sample is its source's row, token for token: the tokens and targets of each ``(source_index,
  sample_index)`` equal that row in a build of the source alone (its own format, loss, template);
- the blend is :func:`plan_mixture`'s over each source's kept rows (tested against Megatron's blending rule and
  ``datasets.interleave_datasets`` in tests/test_mixture.py): the packed samples per source and row are its counts;
- no row is lost silently: rows read = kept + failed + too long per source, and what the plan drops is counted;
- the same config gives the same bytes whatever ``num_proc``; one source without weights is the plain build;
- the loader returns each sample's source (``ThdBatch.source_index``), and ``thdpack stats`` shows the table;
- bad mixtures are refused in one line naming the source.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("datasets")

from thdpack.cli import main  # noqa: E402
from thdpack.demo import TOKENIZER_DIR, generate_rows, write_jsonl  # noqa: E402
from thdpack.offline import BuildConfig, build_packed, load_packed  # noqa: E402
from thdpack.offline.stage_options import MixtureOptions  # noqa: E402
from thdpack.offline.errors import ConfigError, InputError  # noqa: E402
from thdpack.planning.mixture import plan_mixture  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TOK = str(TOKENIZER_DIR)


def tree_digest(path: Path) -> dict:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    """Three JSON Lines sources: chat (a few rows too long for 2048), text, preference pairs."""
    d = tmp_path_factory.mktemp("mixture-inputs")
    out = {}
    for name, kind, n, seed in (("chat", "chat", 240, 3), ("prose", "text", 150, 4), ("pairs", "pairs", 60, 5)):
        out[name] = write_jsonl(generate_rows(n, seed=seed, kind=kind), d / f"{name}.jsonl")
    return out


def mixture_config(files: dict, **top) -> BuildConfig:
    return BuildConfig(input=[
        {"path": str(files["chat"]), "format": "chat", "loss": "last_assistant", "weight": 0.7},
        {"path": str(files["prose"]), "name": "prose", "format": "text", "weight": 0.3},
        {"path": str(files["pairs"]), "format": "preference", "epochs": 1.5},
    ], tokenizer=TOK, pack_size=2048, overflow="error", skip_bad_rows=True, seed=3, **top)


@pytest.fixture(scope="module")
def built(files, tmp_path_factory):
    out = tmp_path_factory.mktemp("mixture-out") / "mix"
    cfg = mixture_config(files, mixture=MixtureOptions(stopping="all_exhausted"))
    return cfg, build_packed(cfg, out, progress=False)


def _samples_by_source(path: Path) -> list[tuple[int, int, np.ndarray, np.ndarray]]:
    """``(source, row, ids, targets)`` of every sample of every pack (a build of one source: source 0)."""
    ds = load_packed(path)
    out = []
    for k in range(len(ds)):
        row = ds[k]
        sources = row["source_index"] if "source_index" in row else np.zeros(len(row["seq_lens"]), np.int64)
        for sample, src, idx in zip(ds.samples(k), sources, row["sample_index"]):
            out.append((int(src), int(idx), sample["input_ids"], sample["loss_mask"]))
    return out


def test_every_packed_sample_is_its_sources_row_token_for_token(files, built, tmp_path):
    cfg, result = built
    alone = {}
    for k, source in enumerate(cfg.sources()):  # each source built on its own, same options
        single = build_packed(source.config, tmp_path / f"alone-{k}", progress=False)
        alone[k] = {idx: (ids, mask) for _, idx, ids, mask in _samples_by_source(single.path)}
    samples = _samples_by_source(result.path)
    assert {s for s, *_ in samples} == {0, 1, 2}
    for src, idx, ids, mask in samples:
        ref_ids, ref_mask = alone[src][idx]
        assert np.array_equal(ids, ref_ids) and np.array_equal(mask, ref_mask), (src, idx)


def test_the_packed_samples_are_the_blend_of_the_kept_rows(built):
    cfg, result = built
    meta = result.metadata
    report = meta["mixture"]["sources"]
    kept = [r["units_kept"] for r in report]
    assert [r["unit"] for r in report] == ["row", "row", "pair"] and kept == [r["rows_kept"] for r in report]
    sources = [{"name": s.name, "num_rows": n, **s.weights} for s, n in zip(cfg.sources(), kept)]
    blend = plan_mixture(sources, stopping="all_exhausted", seed=cfg.planning.seed)
    samples = _samples_by_source(result.path)
    per_row = [1, 1, 2]  # preference rows: chosen and rejected
    for k, r in enumerate(report):
        rows = np.array([idx // per_row[k] for s, idx, *_ in samples if s == k and idx % per_row[k] == 0])
        counts = np.bincount(rows) if rows.size else np.zeros(0, np.int64)
        assert rows.size == blend.counts[k] and rows.size * per_row[k] == r["packed_samples"]
        assert counts.max() == r["max_repeats"] == blend.repeats(k).max()
        assert sorted(counts[counts > 0].tolist()) == sorted(blend.repeats(k)[blend.repeats(k) > 0].tolist())
        assert r["blend_units"] == blend.counts[k]
        assert r["requested_share"] == pytest.approx(blend.requested_share[k], abs=1e-6)
        assert r["realized_share"] == pytest.approx(blend.realized_share[k], abs=1e-6)
    assert report[2]["blend_units"] == 90  # epochs 1.5 of 60 rows
    # every row read is accounted for, per source
    for r in report:
        assert r["rows_read"] == r["rows_kept"] + r["rows_failed"] + r["rows_too_long"]
    assert report[0]["rows_too_long"] > 0  # the long chat rows, skipped and counted
    assert meta["counts"]["skipped_rows"] == sum(r["rows_too_long"] + r["rows_failed"] for r in report)
    assert sum(r["tokens"] for r in report) == meta["counts"]["tokens"]
    assert sum(r["target_tokens"] for r in report) == meta["counts"]["target_tokens"]


def test_the_online_mixture_dataset_draws_the_same_blend(built):
    """MixtureDataset (the DataLoader path) over each source's kept rows, with the build's weights and seed,
    gives the rows (and repeats) the offline build packed."""
    from collections import Counter

    from thdpack.loaders.mixture_dataset import MixtureDataset

    cfg, result = built
    per_row = [1, 1, 2]
    packed = Counter((s, idx // per_row[s]) for s, idx, *_ in _samples_by_source(result.path)
                     if idx % per_row[s] == 0)
    kept = [sorted({row for s, row in packed if s == k}) for k in range(3)]  # all_exhausted: every kept row is in
    assert [len(k) for k in kept] == [r["rows_kept"] for r in result.metadata["mixture"]["sources"]]
    online = MixtureDataset([{"name": s.name, "dataset": [{"row": r} for r in rows], **s.weights}
                             for s, rows in zip(cfg.sources(), kept)], stopping="all_exhausted", seed=cfg.planning.seed)
    drawn = Counter((int(online.plan.source[i]), kept[int(online.plan.source[i])][int(online.plan.row[i])])
                    for i in range(len(online)))
    assert drawn == packed


def test_a_pair_stays_in_one_pack_and_sample_index_is_the_row_within_its_source(built):
    _, result = built
    ds = load_packed(result.path)
    for k in range(len(ds)):
        row = ds[k]
        pairs = row["sample_index"][row["source_index"] == 2]
        for idx in pairs.tolist():
            assert idx ^ 1 in pairs.tolist(), (k, idx)


def test_the_loader_gives_each_samples_source(built):
    """ThdBatch.source_index is each sample's source; thdpack.losses splits the targets by it."""
    import torch

    from thdpack.losses import source_totals

    _, result = built
    ds = load_packed(result.path)
    picked = [k for k in range(len(ds)) if len(set(ds[k]["source_index"].tolist())) > 1][:3]  # mixed packs
    rows = [ds[k] for k in picked]
    batch = ds.collator()(rows)
    expected = np.concatenate([r["source_index"] for r in rows])
    assert batch.source_index.tolist() == expected.tolist() and len(set(expected.tolist())) > 1
    _, items = source_totals(torch.zeros(batch.input_ids.numel()), batch, num_sources=3)
    want = np.zeros(3)
    for k, r in zip(picked, rows):
        for sample, src in zip(ds.samples(k), r["source_index"]):
            want[int(src)] += int(np.asarray(sample["loss_mask"], bool)[1:].sum())
    assert items.tolist() == want.tolist()


def test_the_same_mixture_gives_the_same_bytes_whatever_num_proc(files, built, tmp_path):
    cfg, result = built
    again = build_packed(cfg.override(num_proc=2), tmp_path / "np2", progress=False)
    assert tree_digest(again.path) == tree_digest(result.path)


def test_one_source_without_weights_is_the_plain_build(files, tmp_path):
    plain = BuildConfig(input=str(files["chat"]), tokenizer=TOK, pack_size=4096, overflow="truncate")
    one = plain.override(input=[{"path": str(files["chat"])}])
    a = build_packed(plain, tmp_path / "plain", progress=False)
    b = build_packed(one, tmp_path / "one", progress=False)
    assert tree_digest(a.path) == tree_digest(b.path)


def test_stratified_packing_keeps_every_step_close_to_the_blend(files, tmp_path):
    cfg = BuildConfig(input=[{"path": str(files["chat"]), "weight": 0.5},
                             {"path": str(files["prose"]), "format": "text", "weight": 0.5}],
                      tokenizer=TOK, pack_size=2048, overflow="truncate",
                      mixture=MixtureOptions(packing="stratified", step_packs=4))
    result = build_packed(cfg.override(shuffle_packs=False), tmp_path / "strat", progress=False)
    ds = load_packed(result.path)
    src = [ds[k]["source_index"] for k in range(len(ds))]
    steps = [np.concatenate(src[a:a + 4]) for a in range(0, len(src) - 4, 4)]
    shares = np.array([np.mean(s == 0) for s in steps])
    assert result.metadata["algorithm"] == "stratified" and result.metadata["mixture"]["packing"] == "stratified"
    assert np.abs(shares - 0.5).max() < 0.2, shares
    bfd = build_packed(dataclasses.replace(cfg, mixture=MixtureOptions(packing="bfd"), shuffle_packs=False),
                       tmp_path / "bfd", progress=False)
    assert bfd.metadata["counts"]["samples"] == result.metadata["counts"]["samples"]


def test_token_weights_give_token_shares(files, tmp_path):
    cfg = BuildConfig(input=[{"path": str(files["chat"]), "weight": 3}, {"path": str(files["prose"]), "format": "text",
                                                                       "weight": 1}],
                      tokenizer=TOK, pack_size=4096, overflow="truncate", mixture=MixtureOptions(weight_by="tokens"))
    report = build_packed(cfg, tmp_path / "tok", progress=False).metadata["mixture"]["sources"]
    assert report[0]["requested_share"] == pytest.approx(0.75)
    for r in report:
        assert r["realized_share"] == pytest.approx(r["requested_share"], abs=0.02)


def test_stats_shows_the_per_source_table(built, capsys):
    _, result = built
    assert main(["stats", str(result.path)]) == 0
    out = capsys.readouterr().out
    assert "mixture          3 sources" in out
    for r in result.metadata["mixture"]["sources"]:
        line = next(x for x in out.splitlines() if x.strip().startswith(r["name"]))
        assert f"{r['rows_read']:,}" in line and f"{r['requested_share']:.4f}" in line
    assert main(["inspect", str(result.path), "--pack", "0", "--max-tokens", "4"]) == 0
    names = [r["name"] for r in result.metadata["mixture"]["sources"]]
    heads = [x for x in capsys.readouterr().out.splitlines() if x.startswith("── sample")]
    first = load_packed(result.path)[0]
    assert len(heads) == len(first["seq_lens"])
    for head, src, idx in zip(heads, first["source_index"].tolist(), first["sample_index"].tolist()):
        assert f"source {names[src]!r}, input row {idx}," in head


def test_the_bundled_mixture_example_builds(tmp_path, capsys):
    assert main(["build", "--config", str(ROOT / "configs" / "mixture.yaml"), "--output", str(tmp_path / "m"),
                 "-q"]) == 0
    meta = json.loads((tmp_path / "m" / "metadata.json").read_text())
    assert [s["name"] for s in meta["mixture"]["sources"]] == ["chat", "prose", "pairs"]
    assert [s["format"] for s in meta["mixture"]["sources"]] == ["chat", "text", "preference"]


# ---------------------------------------------------------------------------- refused, one line naming the source


@pytest.mark.parametrize("sources, message", [
    ([{"path": "a.jsonl", "wieght": 1}], "input source 'a': unknown key 'wieght' (did you mean 'weight'?)"),
    ([{"path": "a.jsonl", "weight": -1}, {"path": "b.jsonl"}], "mixture source 'a': weight must be a finite number"),
    ([{"path": "a.jsonl", "weight": float("nan")}, {"path": "b.jsonl"}], "mixture source 'a': weight must be"),
    ([{"path": "a.jsonl", "weight": 0}, {"path": "b.jsonl", "epochs": 0}], "every mixture source's weight is 0"),
    ([{"path": "a.jsonl"}, {"path": "./a.jsonl", "name": "again"}], "input sources 'a' and 'again' read the same data"),
    ([{"path": "a.jsonl"}, {"path": "b.jsonl", "name": "a"}], "input sources 0 and 1 are both named 'a'"),
    ([{"path": "a.jsonl", "format": "csv"}], "input source 'a': format must be one of"),
    ([{"path": "a.jsonl", "demo": {}}], "input source 'a': give one of path or demo"),
    ([{"path": "a.jsonl", "weight": 1, "epochs": 2}], "mixture source 'a' gives weight and epochs"),
    (["a.jsonl", {"path": "b.jsonl"}], "input source 0: a mixture's input is a list of sources"),
])
def test_a_bad_mixture_is_refused_naming_the_source(sources, message, tmp_path):
    cfg = BuildConfig(input=sources, tokenizer=TOK, base_dir=tmp_path)
    with pytest.raises(ConfigError) as caught:
        cfg.validate()
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_mixture_options_without_a_mixture_and_a_slice_are_refused(files, tmp_path):
    with pytest.raises(ConfigError, match="mixture_packing needs input as a list of sources"):
        BuildConfig(input=str(files["chat"]), tokenizer=TOK, mixture=MixtureOptions(packing="stratified")).validate()
    assert main(["build", "--config", str(ROOT / "configs" / "mixture.yaml"), "--output", str(tmp_path / "s"),
                 "--slice", "0/2", "-q"]) != 0
    assert not (tmp_path / "s").exists()


def test_a_source_left_empty_by_filtering_is_named(files, tmp_path):
    long_rows = tmp_path / "long.jsonl"
    write_jsonl([{"text": "word " * 3000}] * 3, long_rows)
    cfg = BuildConfig(input=[{"path": str(files["prose"]), "format": "text"},
                             {"path": str(long_rows), "name": "long", "format": "text"}],
                      tokenizer=TOK, pack_size=1024, skip_bad_rows=True)
    with pytest.raises(InputError) as caught:
        build_packed(cfg, tmp_path / "out", progress=False)
    assert str(caught.value).startswith("mixture source 'long': no usable rows") and "\n" not in str(caught.value)
    assert not (tmp_path / "out").exists()


def test_sample_values_follow_their_samples_across_sources(tmp_path):
    """``sample_values`` (a column every source has) are written per sample of the mixture, each its row's."""
    chat = [dict(r, score=float(i) / 4) for i, r in enumerate(generate_rows(80, seed=8, kind="chat"))]
    prose = [dict(r, score=1000 + i) for i, r in enumerate(generate_rows(50, seed=9, kind="text"))]
    write_jsonl(chat, tmp_path / "c.jsonl")
    write_jsonl(prose, tmp_path / "p.jsonl")
    cfg = BuildConfig(input=[{"path": str(tmp_path / "c.jsonl"), "format": "chat", "weight": 1},
                             {"path": str(tmp_path / "p.jsonl"), "format": "text", "epochs": 2}],
                      tokenizer=TOK, pack_size=4096, overflow="truncate", sample_values=["score"])
    ds = load_packed(build_packed(cfg, tmp_path / "out", progress=False).path)
    seen = 0
    for k in range(len(ds)):
        row = ds[k]
        for src, idx, value in zip(row["source_index"], row["sample_index"], row["sample_values.score"]):
            assert value == (chat[idx]["score"] if src == 0 else prose[idx]["score"]), (k, src, idx)
            seen += 1
    assert seen == 80 + 100


def test_stratified_packing_of_pairs_is_refused(files, tmp_path):
    cfg = mixture_config(files, mixture=MixtureOptions(packing="stratified"))
    with pytest.raises(ConfigError, match="stratified cannot keep preference pairs or group_column groups together"):
        build_packed(cfg, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_group_column_groups_are_the_units_of_the_blend(tmp_path):
    """With ``group_column`` a source's unit is its group: drawn, repeated and packed whole (every member of a
    drawn group in one pack, as often as the group was drawn); a source without the column's groups is read as
    groups of one."""
    base = generate_rows(90, seed=11, kind="chat")
    grouped = [dict(r, gid=f"g{i // 3}") for i, r in enumerate(base)]  # 30 groups of 3
    single = [dict(r, gid=f"s{i}") for i, r in enumerate(generate_rows(40, seed=12, kind="chat"))]
    write_jsonl(grouped, tmp_path / "grouped.jsonl")
    write_jsonl(single, tmp_path / "single.jsonl")
    cfg = BuildConfig(input=[{"path": str(tmp_path / "grouped.jsonl"), "epochs": 1.5},
                             {"path": str(tmp_path / "single.jsonl"), "weight": 1}],
                      tokenizer=TOK, pack_size=8192, group_column="gid", skip_bad_rows=True)
    result = build_packed(cfg, tmp_path / "out", progress=False)
    report = result.metadata["mixture"]["sources"]
    assert [r["unit"] for r in report] == ["group", "group"]
    kept_groups = report[0]["units_kept"]
    assert report[0]["blend_units"] == round(1.5 * kept_groups + 1e-9) and report[0]["max_repeats"] == 2
    ds = load_packed(result.path)
    packs = []
    for k in range(len(ds)):
        row = ds[k]
        in_pack: dict = {}
        for src, idx in zip(row["source_index"].tolist(), row["sample_index"].tolist()):
            if src == 0:
                in_pack.setdefault(idx // 3, []).append(idx)
        packs.append(in_pack)
    members = {g: set(m) for p in packs for g, m in p.items()}  # a group's kept rows, wherever they are
    drawn: dict = {}
    for k, in_pack in enumerate(packs):
        for group, rows in in_pack.items():  # every copy of a drawn group whole in this pack
            copies, left = divmod(len(rows), len(members[group]))
            assert not left and sorted(rows) == sorted(list(members[group]) * copies), (k, group, rows)
            drawn[group] = drawn.get(group, 0) + copies
    assert sum(drawn.values()) == report[0]["blend_units"] and set(drawn.values()) <= {1, 2}
    assert len(drawn) == kept_groups


def test_dpo_loss_reads_the_preference_source_of_every_pack(built):
    """Every loaded pack's preference samples are whole pairs for ``dpo_loss(source=2)`` (a pair repeated in one
    pack counted per copy), the chat and text samples left out."""
    import torch

    from thdpack.losses import dpo_loss

    _, result = built
    ds = load_packed(result.path)
    collate = ds.collator()
    pairs = 0
    for k in range(len(ds)):
        batch = collate(ds[k])
        logps = torch.linspace(-3, 0, batch.num_samples, dtype=torch.float64)
        loss = dpo_loss(logps, torch.zeros_like(logps), batch, source=2, num_items=1)
        n = int((batch.source_index == 2).sum()) // 2
        assert (n == 0) == (float(loss) == 0.0)
        pairs += n
    assert pairs == result.metadata["mixture"]["sources"][2]["blend_units"]


def test_share_prefix_in_a_mixture_shares_each_pairs_prompt(files, tmp_path):
    """``share_prefix``: a preference source's pairs share their prompt as a build of that source alone shares it
    (the same prefix_len per row), a source without groups is laid out unshared (prefix 0); the loaded packs are
    shared-prefix batches within pack_size that keep each sample's source."""
    cfg = BuildConfig(input=[{"path": str(files["chat"]), "format": "chat", "weight": 1},
                             {"path": str(files["pairs"]), "format": "preference", "epochs": 2}],
                      tokenizer=TOK, pack_size=2048, overflow="error", skip_bad_rows=True, share_prefix=True,
                      min_prefix_len=4)
    result = build_packed(cfg, tmp_path / "mix", progress=False)
    meta = result.metadata
    assert meta["share_prefix"]["tokens_saved"] > 0
    assert {"group_id", "prefix_len", "source_index"} <= set(meta["columns"])
    alone = build_packed(cfg.sources()[1].config, tmp_path / "alone", progress=False)
    ds_alone = load_packed(alone.path)
    want = {i: p for k in range(len(ds_alone))
            for i, p in zip(ds_alone[k]["sample_index"].tolist(), ds_alone[k]["prefix_len"].tolist())}
    ds = load_packed(result.path)
    collate = ds.collator()
    seen_pairs = 0
    for k in range(len(ds)):
        row = ds[k]
        for src, idx, prefix in zip(row["source_index"].tolist(), row["sample_index"].tolist(),
                                    row["prefix_len"].tolist()):
            assert prefix == (want[idx] if src == 1 else 0), (k, src, idx)
            seen_pairs += src == 1
        batch = collate(row)
        assert batch.input_ids.numel() <= meta["pack_size"]
        assert batch.source_index.tolist() == row["source_index"].tolist()
    assert seen_pairs == 2 * 2 * 60  # every pair twice, chosen + rejected
