"""Megatron-Bridge's packed SFT format (thdpack/offline/commands/bridge_export.py): ``--output-format megatron-bridge``
and ``thdpack export PATH --to megatron-bridge OUT``.

The output is fed to Bridge's own reader (megatron-bridge 0.6.2's ``GPTSFTPackedParquetDataset``:
``__getitem__`` + ``collate_fn``, run by tests/megatron_run.py) at cp 1 and 2, and compared with
thdpack's collator on the same packs, in Bridge's convention (each sample's last token dropped,
labels = the next token, cu_seqlens one shorter per sample, samples pre-padded to pad_seq_to_mult).
The same packs are checked against ``spec_collate``, a transcription of Bridge's documented reader,
everywhere; where Bridge's wheels cannot be downloaded the test of its own code skips (its id ends
``-missing``; the reason is in pytest's summary).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("datasets")
pq = pytest.importorskip("pyarrow.parquet")

import megatron_env  # noqa: E402  (tests/megatron_env.py)

from thdpack.cli import main as cli_main  # noqa: E402
from thdpack.demo import TOKENIZER_DIR, generate_rows, write_jsonl  # noqa: E402
from thdpack.offline import BuildConfig, build_packed, load_packed  # noqa: E402
from thdpack.offline.commands.bridge_export import METADATA, bridge_lengths, convert, export_bridge  # noqa: E402
from thdpack.offline.errors import ConfigError, InputError, OutputExistsError  # noqa: E402

EOS = 2  # the demo tokenizer's EOS id (what Bridge pads with)
PACK = 512
BRIDGE_KEYS = ["dataset_max_seqlen", "max_samples_per_bin", "packing_factor", "packing_efficiency", "pack_size",
               "min_packed_seqlen"]


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory):
    return write_jsonl(generate_rows(120, seed=5, kind="chat"), tmp_path_factory.mktemp("data") / "chat.jsonl")


def build(path, jsonl, **kw):
    cfg = BuildConfig(input=str(jsonl), tokenizer=str(TOKENIZER_DIR), pack_size=PACK, overflow="truncate", **kw)
    return build_packed(cfg, path, progress=False)


@pytest.fixture(scope="module")
def builds(tmp_path_factory, jsonl):
    root = tmp_path_factory.mktemp("bridge")
    return {cp: build(root / f"cp{cp}", jsonl, cp_size=cp, output_format="megatron-bridge") for cp in (1, 2)}


@pytest.fixture(scope="module")
def bridge(builds):
    """Bridge's collate_fn output for every pack of each build (one subprocess); for tests that
    take :func:`megatron_env.site_param`, so run only where Bridge's code is here."""
    site = megatron_env.site_or_reason()
    tasks = [{"kind": "bridge_collate", "path": str(builds[cp].path), "pad_seq_to_mult": builds[cp].metadata["align"], "eos_id": EOS,
              "max_seq_length": PACK, "batches": [[k] for k in range(builds[cp].metadata["num_packs"])]}
             for cp in (1, 2)]
    return dict(zip((1, 2), megatron_env.run(site, tasks)))


# ---------------------------------------------------------------------------- Bridge's convention


def expected_bridge(batch, multiple: int, max_seq_length: int) -> dict:
    """What Bridge's collate_fn must give for a pack, derived from thdpack's collated ``batch``
    (real ``ThdCollator`` output). Bridge's layout (packing/offline.py ``_pre_pad_data_point``):
    a sample of ``s`` tokens is stored with EOS appended up to ``r + 1`` tokens, ``r = ceil(s-1,
    multiple)``; the reader streams the first ``r`` (labels: the next stored token; loss where
    thdpack's target labels score the next real token). The stream is padded with EOS to
    ``ceil(total, 16)`` (Bridge's default pad_seq_length_to_mult)."""
    ids, tgt, pos = batch.input_ids.tolist(), batch.labels.tolist(), batch.position_ids.tolist()
    cu_p = batch.cu_seqlens_padded.tolist()
    tokens, labels, mask, positions = [], [], [], []
    cu, cu_pad, cut = [0], [0], 0
    for i, s in enumerate(batch.seq_lens.tolist()):
        a = cu_p[i]
        assert pos[a:a + s] == list(range(s))
        real_tgt = tgt[a:a + s - 1]
        assert all(t in (-100, n) for t, n in zip(real_tgt, ids[a + 1:a + s]))  # thdpack's targets: the next token
        r = int(bridge_lengths(np.array([s]), multiple)[0])
        stored = ids[a:a + s] + [EOS] * (r + 1 - s)
        tokens += stored[:r]
        labels += stored[1:r + 1]
        mask += [int(t != -100) for t in real_tgt] + [0] * (r - (s - 1))
        positions += list(range(r))
        logical = r
        if multiple > 1:  # Bridge ends the logical length at the last non-EOS token (packing/gpt_sft.py collate_fn)
            while logical and stored[logical - 1] == EOS:
                logical -= 1
        cu.append(cu[-1] + logical)
        cu_pad.append(cu_pad[-1] + r)
        cut += logical < s - 1
    return _padded_to_16(tokens, labels, mask, positions, cu, cu_pad, multiple, max_seq_length), cut


def spec_collate(row: dict, multiple: int, max_seq_length: int) -> dict:
    """Bridge's reader of one packed Parquet row, as its code documents it (megatron-bridge 0.6.2,
    ``GPTSFTPackedParquetDataset.__getitem__`` in data/packing/parquet.py and
    ``GPTSFTPackedDataset.collate_fn`` / ``_build_loss_mask`` in data/packing/gpt_sft.py, with
    ``answer_only_loss=True``): every stored sample loses its last token, labels are the next
    stored token, loss_mask is the stored mask without its last entry."""
    ids, mask = row["input_ids"], row["loss_mask"]
    bounds = row["seq_start_id"] + [len(ids)]
    tokens, labels, loss, positions, cu, cu_pad = [], [], [], [], [0], [0]
    for a, b in zip(bounds[:-1], bounds[1:]):
        seg = ids[a:b - 1]
        tokens += seg
        labels += ids[a + 1:b]
        loss += mask[a:b - 1]
        positions += list(range(b - a - 1))
        cu_pad.append(cu_pad[-1] + b - a - 1)
        logical = len(seg)
        while multiple > 1 and logical and seg[logical - 1] == EOS:
            logical -= 1
        cu.append(cu[-1] + (logical if multiple > 1 else b - a - 1))
    return _padded_to_16(tokens, labels, loss, positions, cu, cu_pad, multiple, max_seq_length)


def _padded_to_16(tokens, labels, loss_mask, positions, cu, cu_pad, multiple, max_seq_length) -> dict:
    """Bridge's collate_fn tail: the pack padded with EOS (mask 0) to a multiple of 16 (at most
    max_seq_length); the padding is one more cu_seqlens entry (padded and unpadded at cp > 1)."""
    max_len = min(max_seq_length, -(-len(tokens) // 16) * 16)
    tail = max_len - len(tokens)
    out = {"tokens": tokens + [EOS] * tail, "labels": labels + [EOS] * tail, "loss_mask": loss_mask + [0] * tail,
           "position_ids": positions + [0] * tail}
    if multiple > 1:
        if cu_pad[-1] != max_len:
            cu_pad.append(max_len)
            cu.append(cu[-1])
        out.update(cu_seqlens_q=cu, cu_seqlens_q_padded=cu_pad)
    else:
        if cu[-1] != max_len:
            cu.append(max_len)
        out["cu_seqlens_q"] = cu
    return out


def bridge_rows(path) -> list[dict]:
    files = sorted(path.glob("*.idx.parquet"))
    return [row for f in files for row in pq.read_table(f).to_pylist()]


def first_row(batch: dict) -> dict:
    """Bridge's batch of one pack, without its batch axis, in the keys :func:`expected_bridge` gives."""
    return {k: v[0] for k, v in batch.items() if k in ("tokens", "labels", "loss_mask", "position_ids", "cu_seqlens_q",
                                                       "cu_seqlens_q_padded")}


# ---------------------------------------------------------------------------- tests


def bridge_view(builds, cp: int) -> tuple[list[dict], list[dict], int]:
    """Per pack of build ``cp``: what Bridge's collate_fn must give (``expected_bridge`` of thdpack's
    collator), the stored Parquet rows, and Bridge's cut-short samples in all."""
    ds = load_packed(builds[cp].path)
    collate = ds.collator()  # the cp_size the build planned for: samples padded to 2*cp (cp > 1)
    assert ds.metadata["align"] == (2 * cp if cp > 1 else 1)
    rows = bridge_rows(builds[cp].path)
    assert len(rows) == len(ds) > 3
    wants = [expected_bridge(collate(ds[k]), ds.metadata["align"], PACK) for k in range(len(ds))]
    return [w for w, _ in wants], rows, sum(cut for _, cut in wants)


@pytest.mark.parametrize("cp", [1, 2])
def test_written_reader_matches_thdpack_collator(builds, cp):
    """``spec_collate`` (the written transcription of Bridge's reader) on the build's Parquet = thdpack's
    collator on the same packs, in Bridge's convention; the cut-short count in the metadata is right."""
    wants, rows, cut_short = bridge_view(builds, cp)
    multiple = builds[cp].metadata["align"]
    for k, want in enumerate(wants):
        assert spec_collate(rows[k], multiple, PACK) == want, f"pack {k}"
    assert builds[cp].metadata["megatron_bridge"]["samples_cut_short_by_bridge"] == cut_short
    assert (cut_short > 0) == (cp > 1)  # the demo's chat template ends turns with EOS + newline


@pytest.mark.parametrize("cp", [1, 2])
@pytest.mark.parametrize("site", [megatron_env.site_param()])
def test_bridge_reader_matches_thdpack_collator(builds, bridge, cp, site):
    """Bridge's own reader and collate_fn on the build's Parquet = thdpack's collator on the same
    packs, token for token, in Bridge's convention; cu_seqlens (and cu_seqlens_padded at cp 2) too."""
    wants, rows, _ = bridge_view(builds, cp)
    assert bridge[cp]["len"] == len(rows)  # Bridge's directory glob found exactly the .idx.parquet files
    for k, want in enumerate(wants):
        assert first_row(bridge[cp]["batches"][k]) == want, f"pack {k}: Bridge's collate_fn differs"


def test_bridge_metadata_is_bridges_list(builds):
    """``bridge_metadata.json`` is the JSON list of dicts Bridge's pack_metadata_file_path reads, in
    Bridge's units; thdpack's own metadata.json and Arrow data files stay loadable next to it."""
    for cp, result in builds.items():
        entries = json.loads((result.path / METADATA).read_text())
        assert isinstance(entries, list) and len(entries) == 1 and list(entries[0]) == BRIDGE_KEYS
        entry = entries[0]
        rows = bridge_rows(result.path)
        runtime = [len(r["input_ids"]) - len(r["seq_start_id"]) for r in rows]  # Bridge streams s-1 per sample
        lens = [b - a - 1 for r in rows for a, b in zip(r["seq_start_id"], r["seq_start_id"][1:] + [len(r["input_ids"])])]
        assert entry["pack_size"] == PACK and max(runtime) <= PACK
        assert entry["min_packed_seqlen"] == min(runtime)
        assert entry["dataset_max_seqlen"] == max(lens)
        assert entry["max_samples_per_bin"] == max(len(r["seq_start_id"]) for r in rows)
        assert entry["packing_efficiency"] == round(sum(runtime) / len(rows) / PACK * 100, 2)
        ds = load_packed(result.path)
        multiple = ds.metadata["align"]
        assert all(n % multiple == 0 for n in lens)
        assert ds.metadata["file_format"] == "arrow" and ds.metadata["megatron_bridge"]["pad_seq_to_mult"] == multiple
        assert int(ds.pack_num_tokens().sum()) == ds.metadata["counts"]["tokens"]


def test_export_equals_build(tmp_path, jsonl, builds):
    """``thdpack export`` of a plain build writes the same Bridge rows as building with
    ``--output-format megatron-bridge``; a labels build exports the same rows too."""
    plain = build(tmp_path / "plain", jsonl, cp_size=2, output_format="parquet")
    labels = build(tmp_path / "labels", jsonl, cp_size=2, targets="labels")
    assert cli_main(["export", str(plain.path), "--to", "megatron-bridge", str(tmp_path / "e1"), "-q"]) == 0
    export_bridge(labels.path, tmp_path / "e2")
    want = bridge_rows(builds[2].path)
    assert bridge_rows(tmp_path / "e1") == want
    assert bridge_rows(tmp_path / "e2") == want
    assert json.loads((tmp_path / "e1" / METADATA).read_text()) == json.loads((builds[2].path / METADATA).read_text())


def test_export_refuses_what_bridge_cannot_hold(tmp_path, builds, capsys):
    """One-line errors: a pad_seq_to_mult that pushes a pack past pack_size (names the data file and
    pack), an existing output, labels that are not the next token (names data file, pack, token)."""
    src = builds[1].path
    with pytest.raises(ConfigError, match=r"data-00000-of-00001\.arrow: pack \d+: at pad_seq_to_mult=64 .* more than "
                                          r"pack_size=512; export with a pad_seq_to_mult that divides"):
        export_bridge(src, tmp_path / "big", pad_seq_to_mult=64)
    assert not (tmp_path / "big").exists()
    export_bridge(src, tmp_path / "ok")
    with pytest.raises(OutputExistsError, match="already exists; pass --overwrite"):
        export_bridge(src, tmp_path / "ok")
    export_bridge(src, tmp_path / "ok", overwrite=True)
    assert cli_main(["export", str(src), "--to", "megatron-bridge", str(tmp_path / "big"), "--pad-seq-to-mult", "64"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("thdpack export: error: ")
    with pytest.raises(ValueError, match=r"^pad_id must be an integer in \[0, 2147483648\), got -1 \(the tokenizer's EOS id"):
        export_bridge(src, tmp_path / "neg", pad_id=-1)

    ids = np.array([5, 6, 7, 8, 9], np.int32)
    labels_table = {"off": np.array([0, 5]), "ids": ids, "labels": np.array([-100, 6, 99, 8, 9], np.int32)}
    import pyarrow as pa

    from thdpack.offline.commands.bridge_export import _batch_rows

    batch = pa.RecordBatch.from_pydict({
        "input_ids": pa.array([labels_table["ids"].tolist()], pa.list_(pa.int32())),
        "labels": pa.array([labels_table["labels"].tolist()], pa.list_(pa.int32())),
        "seq_lens": pa.array([[5]], pa.list_(pa.int32())),
    })
    with pytest.raises(InputError, match=r"data\.arrow: pack 0, token 2: label 99 differs from the token 7"):
        _batch_rows(batch, "labels", 1, EOS, lambda j: f"data.arrow: pack {j}")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(1, 40), min_size=1, max_size=6), min_size=1, max_size=5),
       st.sampled_from([1, 2, 4, 8]), st.integers(0, 3))
def test_convert_layout_and_budget(packs, align, shrink):
    """For any packs planned to pack_size at alignment ``align`` and any pad_seq_to_mult ``m``
    dividing it: every stored sample is its tokens then EOS padding, ``len - 1`` a multiple of
    ``m``; Bridge's mask is thdpack's shifted by one inside each sample; no pack exceeds pack_size."""
    m = align >> shrink if align >> shrink else 1
    pack_size = max(sum(-(-s // align) * align for s in p) for p in packs)
    lens = np.array([s for p in packs for s in p], np.int64)
    rng = np.random.default_rng(int(lens.sum()))
    ids = rng.integers(3, 100, int(lens.sum())).astype(np.int32)
    is_target = rng.random(ids.size) < 0.5
    tok_off = np.concatenate([[0], np.cumsum([sum(p) for p in packs])])
    smp_off = np.concatenate([[0], np.cumsum([len(p) for p in packs])])
    rows = convert(ids, is_target, smp_off, lens, m, EOS)
    assert (rows.pack_runtime <= pack_size).all()
    for k, p in enumerate(packs):
        row_ids = rows.input_ids[rows.tok_offsets[k]:rows.tok_offsets[k + 1]]
        row_mask = rows.loss_mask[rows.tok_offsets[k]:rows.tok_offsets[k + 1]]
        starts = rows.seq_start_id[rows.sample_offsets[k]:rows.sample_offsets[k + 1]].tolist() + [row_ids.size]
        for j, s in enumerate(p):
            a, b = starts[j], starts[j + 1]
            src = slice(int(tok_off[k]) + sum(p[:j]), int(tok_off[k]) + sum(p[:j]) + s)
            assert (b - a - 1) % m == 0 and b - a - 1 < max(s - 1, 0) + m
            assert row_ids[a:a + s].tolist() == ids[src].tolist() and (row_ids[a + s:b] == EOS).all()
            assert row_mask[a:a + s - 1].tolist() == is_target[src][1:].astype(int).tolist()
            assert not row_mask[a + s - 1:b].any()


def test_merge_of_bridge_slice_builds(tmp_path, jsonl):
    """``thdpack merge`` of slice builds made with megatron-bridge writes Bridge's files of the
    merged packs (what exporting the merged dataset gives), not the first slice's record."""
    from thdpack.offline.inputs.input_slice import InputSlice
    from thdpack.offline.commands.slice_merge import merge_slices

    cfg = BuildConfig(input=str(jsonl), tokenizer=str(TOKENIZER_DIR), pack_size=PACK, overflow="truncate", cp_size=2,
                      output_format="megatron-bridge")
    for i in range(2):
        build_packed(cfg, tmp_path / f"part-{i}", progress=False, input_slice=InputSlice(i, 2))
    merged = merge_slices([str(tmp_path / "part-0"), str(tmp_path / "part-1")], tmp_path / "merged")
    export_bridge(merged.path, tmp_path / "export")
    assert bridge_rows(merged.path) == bridge_rows(tmp_path / "export")
    assert len(bridge_rows(merged.path)) == merged.metadata["num_packs"]
    record = load_packed(merged.path).metadata["megatron_bridge"]
    assert [f["path"] for f in record["files"]] == sorted(p.name for p in merged.path.glob("*.idx.parquet"))
    assert json.loads((merged.path / METADATA).read_text()) == json.loads((tmp_path / "export" / METADATA).read_text())
