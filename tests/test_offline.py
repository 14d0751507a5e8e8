"""Offline pack building: build -> load -> collate keeps every token, in order, with its
targets; metadata matches the data; rebuilds are byte-identical; interrupted builds
leave nothing that looks complete; bad rows are named by file and line.

Everything is local and small: the bundled demo tokenizer and a few hundred
synthetic rows per build.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("datasets")
transformers = pytest.importorskip("transformers")

from thdpack.demo import TOKENIZER_DIR, generate_rows, write_jsonl  # noqa: E402
from thdpack.offline import (  # noqa: E402
    BuildConfig,
    ConfigError,
    InputError,
    NotPackedError,
    OutputExistsError,
    build_packed,
    load_packed,
    unpack_row,
)
from thdpack.flops import attention_overcount_factor, lengths_squared_sum  # noqa: E402
from thdpack.offline.commands.pack_stats import log2_histogram, summarize  # noqa: E402

IGNORE = -100


@pytest.fixture(scope="module")
def tok():
    return transformers.AutoTokenizer.from_pretrained(str(TOKENIZER_DIR), local_files_only=True)


@pytest.fixture(scope="module")
def chat_rows():
    return generate_rows(300, seed=3, kind="chat")


@pytest.fixture(scope="module")
def chat_jsonl(tmp_path_factory, chat_rows):
    return write_jsonl(chat_rows, tmp_path_factory.mktemp("data") / "chat.jsonl")


def reference_chat(tok, rows):
    """(ids, mask) of every chat row, straight from transformers (no thdpack code)."""
    enc = tok.apply_chat_template(
        [r["messages"] for r in rows], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    return [(np.asarray(i), np.asarray(m, dtype=bool)) for i, m in zip(enc["input_ids"], enc["assistant_masks"])]


def cfg(input, **kw) -> BuildConfig:
    base = dict(input=str(input), tokenizer=str(TOKENIZER_DIR), pack_size=2048, overflow="truncate")
    base.update(kw)
    return BuildConfig(**base)


def build(tmp_path, name="out", **kw):
    config = cfg(**kw)
    return build_packed(config, tmp_path / name, progress=False)


def tree_digest(path: Path) -> dict:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.rglob("*")) if p.is_file()}


def check_batch_against(batch, refs, *, starts=None):
    """Every sample of ``batch`` is its reference row's tokens (from ``start``), with targets
    exactly the next token where the reference marks a target, never across samples."""
    cu_p = batch.cu_seqlens_padded.tolist()
    for i, row in enumerate(batch.sample_index.tolist()):
        s = int(batch.seq_lens[i])
        a = 0 if starts is None else starts[i]
        ids, mask = refs[row]
        ids, mask = ids[a : a + s], mask[a : a + s]
        got = batch.input_ids[cu_p[i] : cu_p[i] + s].numpy()
        np.testing.assert_array_equal(got, ids)
        want = np.where(mask[1:], ids[1:], IGNORE)
        np.testing.assert_array_equal(batch.labels[cu_p[i] : cu_p[i] + s - 1].numpy(), want)
        assert int(batch.labels[cu_p[i] + s - 1]) == IGNORE  # a sample's last token predicts nothing
        assert (batch.labels[cu_p[i] + s : cu_p[i + 1]] == IGNORE).all()  # pad slots


# ---------------------------------------------------------------------------- end to end


def test_build_load_collate_keeps_every_token_once_in_order(tmp_path, tok, chat_rows, chat_jsonl):
    res = build(tmp_path, input=chat_jsonl, pack_size=8192)  # no truncation at this size
    ds = load_packed(res.path)
    refs = reference_chat(tok, chat_rows)
    collate = ds.collator()
    seen = []
    for k in range(len(ds)):
        batch = collate(ds[k])
        check_batch_against(batch, refs)
        assert batch.num_tokens <= ds.pack_size
        seen.extend(batch.sample_index.tolist())
    assert sorted(seen) == list(range(len(chat_rows)))  # every row exactly once
    assert sum(r[0].size for r in refs) == res.metadata["counts"]["tokens"]
    # targets: the assistant tokens (a sample's first token is never one)
    assert res.metadata["counts"]["target_tokens"] == sum(int(m[1:].sum()) for _, m in refs)


def test_split_overflow_keeps_every_token_of_long_rows(tmp_path, tok):
    rows = generate_rows(60, seed=5, kind="text")
    path = write_jsonl(rows, tmp_path / "text.jsonl")
    res = build(tmp_path, input=path, pack_size=256, overflow="split")
    ds = load_packed(res.path)
    eos = tok.eos_token_id
    refs = [np.asarray(tok(r["text"])["input_ids"] + [eos]) for r in rows]
    assert max(r.size for r in refs) > 256  # some rows really are split
    pieces = {}
    collate = ds.collator()
    for k in range(len(ds)):
        row = ds[k]
        batch = collate(row)
        check_batch_against(batch, [(r, np.ones(r.size, bool)) for r in refs], starts=row["sample_start"].tolist())
        for j, smp in enumerate(unpack_row(row)):
            pieces.setdefault(int(row["sample_index"][j]), []).append((int(row["sample_start"][j]), smp["input_ids"]))
    for i, ref in enumerate(refs):
        joined = np.concatenate([ids for _, ids in sorted(pieces[i], key=lambda p: p[0])])
        np.testing.assert_array_equal(joined, ref)
    assert res.metadata["counts"]["split"]["samples"] == sum(r.size > 256 for r in refs)


def test_metadata_matches_the_data(tmp_path, chat_jsonl):
    res = build(tmp_path, input=chat_jsonl, pack_size=1024, file_size_mb=0.2)
    meta = json.loads((res.path / "metadata.json").read_text())
    ds = load_packed(res.path, verify=True)
    assert len(meta["files"]) > 1  # small data files: several of them
    lens, offsets = ds.all_seq_lens()
    per_pack = np.add.reduceat(lens, offsets[:-1])
    assert meta["num_packs"] == len(ds) == sum(f["num_packs"] for f in meta["files"])
    assert meta["counts"]["tokens"] == int(lens.sum()) == sum(f["num_tokens"] for f in meta["files"])
    np.testing.assert_array_equal(per_pack, ds.pack_num_tokens())
    assert per_pack.max() <= meta["pack_size"]
    # NeMo-compatible fields, recomputed from the rows
    assert meta["max_samples_per_bin"] == int(np.diff(offsets).max())
    assert meta["min_packed_seqlen"] == int(per_pack.min())
    assert meta["dataset_max_seqlen"] == int(lens.max())
    assert meta["packing_factor"] == round(lens.size / len(ds), 2)
    assert meta["packing_efficiency"] == round(100 * lens.sum() / (len(ds) * 1024), 2)
    # truncation is counted exactly
    raw = np.asarray(meta["stats"]["lengths"]["histogram"])[:, 2].sum()
    assert raw == meta["counts"]["samples"] == lens.size
    assert meta["counts"]["truncated"]["tokens"] == meta["stats"]["truncated"]["tokens"]
    for f in meta["files"]:
        p = res.path / f["path"]
        assert p.stat().st_size == f["num_bytes"]
        assert hashlib.sha256(p.read_bytes()).hexdigest() == f["sha256"]
    assert meta["stats"]["attention_flops"]["overcount"] == pytest.approx(
        len(ds) * 1024**2 / float((lens.astype(np.int64) ** 2).sum())
    )


def test_truncation_counts(tmp_path, tok):
    rows = generate_rows(80, seed=9, kind="text")
    path = write_jsonl(rows, tmp_path / "t.jsonl")
    res = build(tmp_path, input=path, pack_size=300, overflow="truncate")
    lengths = np.array([len(tok(r["text"])["input_ids"]) + 1 for r in rows])
    over = lengths > 300
    assert res.metadata["counts"]["truncated"] == {"samples": int(over.sum()), "tokens": int((lengths[over] - 300).sum())}
    assert res.metadata["counts"]["tokens"] == int(np.minimum(lengths, 300).sum())


def test_rebuild_is_byte_identical_whatever_num_proc(tmp_path, chat_jsonl):
    a = build(tmp_path, "a", input=chat_jsonl, pack_size=1024, num_proc=1)
    b = build(tmp_path, "b", input=chat_jsonl, pack_size=1024, num_proc=2, map_batch_size=64)
    assert tree_digest(a.path) == tree_digest(b.path)


def test_same_packs_from_jsonl_parquet_arrow_and_save_to_disk(tmp_path, tok, chat_rows):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    refs = reference_chat(tok, chat_rows[:120])
    rows = [{"input_ids": i.tolist(), "labels": np.where(m, i, IGNORE).tolist()} for i, m in refs]
    table = pa.Table.from_pylist(rows)
    write_jsonl(rows, tmp_path / "in.jsonl")
    pq.write_table(table, tmp_path / "in.parquet")
    with pa.OSFile(str(tmp_path / "in.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    data_files = {}
    for name in ("in.jsonl", "in.parquet", "in.arrow", "saved"):
        res = build(tmp_path, f"out-{name}", input=tmp_path / name, pack_size=1024, tokenizer=None)
        assert res.metadata["source"]["format"] == "tokenized"
        data_files[name] = (res.path / res.metadata["files"][0]["path"]).read_bytes()
        ds = load_packed(res.path)
        for k in range(len(ds)):
            check_batch_against(ds.collator()(ds[k]), refs)
    assert len(set(data_files.values())) == 1  # the same packs, byte for byte


def test_labels_target_keeps_labels_that_are_not_the_ids(tmp_path):
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(40):
        n = int(rng.integers(5, 60))
        ids = rng.integers(3, 3000, n)
        labels = np.where(rng.random(n) < 0.5, rng.integers(3, 3000, n), IGNORE)  # distillation-style targets
        rows.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    path = write_jsonl(rows, tmp_path / "tok.jsonl")
    with pytest.raises(InputError, match="targets: labels"):
        build(tmp_path, "x", input=path, tokenizer=None, pack_size=256)
    res = build(tmp_path, "y", input=path, tokenizer=None, pack_size=256, targets="labels")
    ds = load_packed(res.path)
    assert "labels" in ds[0] and "loss_mask" not in ds[0]
    for k in range(len(ds)):
        batch = ds.collator()(ds[k])
        cu = batch.cu_seqlens_padded.tolist()
        for i, r in enumerate(batch.sample_index.tolist()):
            lab = np.asarray(rows[r]["labels"])
            np.testing.assert_array_equal(batch.labels[cu[i] : cu[i] + lab.size - 1].numpy(), lab[1:])


def test_cp_alignment_is_planned_and_collated(tmp_path, tok, chat_rows, chat_jsonl):
    res = build(tmp_path, input=chat_jsonl, pack_size=4096, cp_size=2, overflow="truncate")
    assert res.metadata["align"] == 4
    ds = load_packed(res.path)
    refs = reference_chat(tok, chat_rows)
    whole, shard = ds.collator(), ds.collator(cp_rank=1)  # cp_size=2 from the metadata
    for k in range(len(ds)):
        batch = whole(ds[k])
        assert (batch.seq_lens_padded % 4 == 0).all()
        assert batch.num_padded_tokens <= 4096  # the plan reserved room for the padding
        check_batch_against(batch, refs)
        local = shard(ds[k])
        assert local.num_padded_tokens * 2 == batch.num_padded_tokens
    with pytest.warns(UserWarning, match="planned for multiple 4"):
        ds.collator(cp_size=4)


def test_parquet_output_equals_arrow_output(tmp_path, chat_jsonl):
    a = load_packed(build(tmp_path, "a", input=chat_jsonl, pack_size=1024).path)
    p = load_packed(build(tmp_path, "p", input=chat_jsonl, pack_size=1024, output_format="parquet").path)
    assert p.metadata["files"][0]["path"].endswith(".parquet")
    assert len(a) == len(p)
    for k in range(len(a)):
        ra, rp = a[k], p[k]
        assert ra.keys() == rp.keys()
        for key in ra:
            np.testing.assert_array_equal(ra[key], rp[key])
    assert a.to_hf().num_rows == p.to_hf().num_rows == len(a)


def test_dataset_pickles_and_batches_several_rows(tmp_path, chat_jsonl):
    ds = load_packed(build(tmp_path, input=chat_jsonl, pack_size=1024).path)
    again = pickle.loads(pickle.dumps(ds))  # what DataLoader workers receive
    for key, value in ds[3].items():
        np.testing.assert_array_equal(value, again[3][key])
    both = ds.collator()([ds[0], ds[1]])  # a list of rows: one stream holding both packs
    assert both.num_samples == ds[0]["seq_lens"].size + ds[1]["seq_lens"].size
    assert both.num_tokens == ds[0]["input_ids"].size + ds[1]["input_ids"].size
    loader = torch.utils.data.DataLoader(ds, batch_size=None, collate_fn=ds.collator())
    assert sum(b.num_tokens for b in loader) == ds.metadata["counts"]["tokens"]


# ---------------------------------------------------------------------------- safety


def test_refuses_to_overwrite_without_flag(tmp_path, chat_jsonl):
    first = build(tmp_path, input=chat_jsonl, pack_size=1024)
    before = tree_digest(first.path)
    with pytest.raises(OutputExistsError, match="--overwrite"):
        build(tmp_path, input=chat_jsonl, pack_size=1024)
    assert tree_digest(first.path) == before
    second = build_packed(cfg(chat_jsonl, pack_size=2048), first.path, overwrite=True, progress=False)
    assert second.metadata["pack_size"] == 2048 and load_packed(second.path).pack_size == 2048
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    with pytest.raises(OutputExistsError, match="not a thdpack"):
        build_packed(cfg(chat_jsonl), other, overwrite=True, progress=False)
    assert (other / "notes.txt").read_text() == "keep me"


def test_interrupted_build_leaves_nothing(tmp_path, chat_jsonl, monkeypatch):
    import thdpack.offline.store.writer as writer

    calls = []
    real = writer._chunk

    def interrupt_after_first(*a, **k):
        if calls:
            raise KeyboardInterrupt
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(writer, "_chunk", interrupt_after_first)
    monkeypatch.setattr(writer, "CHUNK_TOKENS", 4096)  # several chunks
    with pytest.raises(KeyboardInterrupt):
        build(tmp_path, input=chat_jsonl, pack_size=1024)
    assert calls  # it was interrupted while writing
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no output, no temporary directory


def test_incomplete_or_damaged_outputs_are_detected(tmp_path, chat_jsonl):
    res = build(tmp_path, input=chat_jsonl, pack_size=1024)
    data_file = res.path / res.metadata["files"][0]["path"]
    # a build killed before its last step: data files but no metadata.json
    killed = tmp_path / "killed"
    killed.mkdir()
    shutil.copy(data_file, killed / data_file.name)
    with pytest.raises(NotPackedError, match="did not complete"):
        load_packed(killed)
    # a truncated data file
    cut = tmp_path / "cut"
    shutil.copytree(res.path, cut)
    data = (cut / data_file.name).read_bytes()
    (cut / data_file.name).write_bytes(data[: len(data) // 2])
    with pytest.raises(NotPackedError, match="truncated"):
        load_packed(cut)
    # same size, different bytes: caught by verify=True
    flipped = tmp_path / "flipped"
    shutil.copytree(res.path, flipped)
    data = bytearray((flipped / data_file.name).read_bytes())
    data[-100] ^= 0xFF
    (flipped / data_file.name).write_bytes(bytes(data))
    load_packed(flipped)  # sizes match
    with pytest.raises(NotPackedError, match="sha256"):
        load_packed(flipped, verify=True)


def test_bad_rows_name_file_and_line_and_can_be_skipped(tmp_path, chat_rows):
    path = tmp_path / "bad.jsonl"
    good = [json.dumps(r) for r in chat_rows[:6]]
    lines = [
        good[0],
        good[1],
        "{this is not json",  # line 3
        good[2],
        "",  # blank lines are not rows
        json.dumps({"text": "no messages"}),  # line 6
        good[3],
        json.dumps({"messages": "not a list"}),  # line 8
        good[4],
        good[5],
    ]
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(InputError) as err:
        build(tmp_path, input=path)
    msg = str(err.value)
    assert "3 bad row(s)" in msg
    assert f"{path}:3: invalid JSON" in msg
    assert f"{path}:6: no 'messages' field" in msg
    assert f"{path}:8: 'messages' must be a non-empty list" in msg
    assert "--skip-bad-rows" in msg
    assert not (tmp_path / "out").exists()

    res = build(tmp_path, input=path, skip_bad_rows=True)
    counts = res.metadata["counts"]
    assert counts["input_rows"] == 9 and counts["skipped_rows"] == 3 and counts["samples"] == 6
    assert [e["where"] for e in res.metadata["skipped_examples"]] == [f"{path}:{n}" for n in (3, 6, 8)]
    ds = load_packed(res.path)
    rows = sorted(int(i) for k in range(len(ds)) for i in ds[k]["sample_index"])
    assert rows == [0, 1, 3, 5, 7, 8]  # input rows (non-blank lines) that were good


def test_too_long_under_overflow_error_names_the_row(tmp_path):
    rows = [{"input_ids": list(range(3, 3 + n))} for n in (10, 20, 300, 30)]
    path = write_jsonl(rows, tmp_path / "long.jsonl")
    with pytest.raises(InputError, match=rf"1 row\(s\) have more tokens than pack_size=128: {path}:3 \(300 tokens\)"):
        build(tmp_path, input=path, tokenizer=None, pack_size=128, overflow="error")
    res = build(tmp_path, input=path, tokenizer=None, pack_size=128, overflow="error", skip_bad_rows=True)
    assert res.metadata["counts"]["skipped_rows"] == 1 and res.metadata["counts"]["samples"] == 3


def test_missing_tokenizer_is_a_clear_offline_error(tmp_path, chat_jsonl):
    with pytest.raises(InputError, match="not found offline.*never downloads"):
        build(tmp_path, input=chat_jsonl, tokenizer="nobody/no-such-model-xyz")
    with pytest.raises(InputError, match="no such directory"):
        build(tmp_path, input=chat_jsonl, tokenizer="./missing-dir")


# ---------------------------------------------------------------------------- chat templates


@pytest.mark.parametrize("loss", ["assistant", "last_assistant"])
def test_prefix_fallback_matches_generation_markers(tmp_path, tok, chat_rows, loss):
    """A template without {% generation %} finds the same assistant tokens by prefix rendering."""
    plain = tmp_path / "plain-tok"
    shutil.copytree(TOKENIZER_DIR, plain)
    conf = json.loads((plain / "tokenizer_config.json").read_text())
    conf["chat_template"] = conf["chat_template"].replace("{% generation %}", "").replace("{% endgeneration %}", "")
    (plain / "tokenizer_config.json").write_text(json.dumps(conf))
    path = write_jsonl(chat_rows[:80], tmp_path / "c.jsonl")
    a = load_packed(build(tmp_path, "gen", input=path, loss=loss).path)
    b = load_packed(build(tmp_path, "prefix", input=path, tokenizer=str(plain), loss=loss).path)
    assert b.metadata["tokenizer"]["chat_template_has_generation_markers"] is False
    for k in range(len(a)):
        for key in ("input_ids", "loss_mask", "sample_index"):
            np.testing.assert_array_equal(a[k][key], b[k][key])


def test_loss_modes(tmp_path, tok, chat_rows):
    rows = [r for r in chat_rows if sum(m["role"] == "assistant" for m in r["messages"]) >= 2][:20]
    path = write_jsonl(rows, tmp_path / "multi.jsonl")
    refs = reference_chat(tok, rows)
    targets = {}
    for loss in ("assistant", "last_assistant", "all"):
        res = build(tmp_path, loss, input=path, loss=loss, pack_size=8192)
        targets[loss] = res.metadata["counts"]["target_tokens"]
        ds = load_packed(res.path)
        for k in range(len(ds)):  # every mode keeps apply_chat_template's ids
            row = ds[k]
            for r, sample in zip(row["sample_index"].tolist(), unpack_row(row)):
                np.testing.assert_array_equal(sample["input_ids"], refs[r][0])
                if loss == "all":
                    assert sample["loss_mask"].all()
    total = sum(i.size - 1 for i, _ in refs)
    assert targets["all"] == total
    assert targets["last_assistant"] < targets["assistant"] == sum(int(m[1:].sum()) for _, m in refs)


def test_demo_tokenizer_is_qwen_style(tok):
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert len(tok) == 3072
    msgs = [{"role": "user", "content": "Ka vios?"}, {"role": "assistant", "content": "Zo ke."}]
    text = tok.apply_chat_template(msgs, tokenize=False)
    assert text == "<|im_start|>user\nKa vios?<|im_end|>\n<|im_start|>assistant\nZo ke.<|im_end|>\n"
    enc = tok.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids = np.asarray(enc["input_ids"])
    trained = ids[np.asarray(enc["assistant_masks"], bool)]
    assert tok.decode(trained.tolist()) == "Zo ke.<|im_end|>"


# ---------------------------------------------------------------------------- stats and imports


def test_stats_formulas():
    # two packs of 8: [3, 5] and [8]
    s = summarize(np.array([3, 5, 8]), np.array([0, 2, 3]), 8, 1, eval_multiple=4)
    assert s["attention_flops"]["overcount"] == pytest.approx(2 * 64 / (9 + 25 + 64))
    assert attention_overcount_factor(2, 8, lengths_squared_sum(np.array([3, 5, 8]))) == pytest.approx(128 / 98)
    assert s["padding"]["pad_tokens"] == (4 - 3) + (8 - 5) + 0
    assert s["padding"]["stream_tokens"] == 4 + 8 + 8
    assert s["padding"]["packs_over_pack_size"] == 1  # [4, 8] > 8
    assert s["efficiency"] == 1.0 and s["lower_bound"] == 2 and s["max_samples_per_pack"] == 2
    assert log2_histogram(np.array([1, 3, 4, 7, 8, 100])) == [
        [1, 1, 1], [2, 3, 1], [4, 7, 2], [8, 15, 1], [16, 31, 0], [32, 63, 0], [64, 127, 1]
    ]


def test_import_thdpack_stays_light():
    code = (
        "import sys, thdpack, thdpack.offline\n"
        "heavy = [m for m in ('datasets', 'transformers', 'pyarrow') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "assert thdpack.load_packed is thdpack.offline.load_packed  # lazy attribute\n"
        "assert not [m for m in ('datasets', 'transformers', 'pyarrow') if m in sys.modules]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_empty_or_blank_jsonl_is_a_clear_error(tmp_path, content):
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    with pytest.raises(InputError, match=r"empty\.jsonl: no rows"):
        build_packed(BuildConfig(input=str(path), tokenizer=str(TOKENIZER_DIR)), tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_build_logs_through_logging_and_has_no_log_callback(tmp_path, chat_jsonl, caplog, capsys):
    """Stage lines go to logging.getLogger("thdpack..."): nothing on stderr unless logging is configured;
    thdpack 0.1.0's ``log=`` callback is gone (an unexpected keyword)."""
    import logging

    with caplog.at_level(logging.INFO, logger="thdpack"):
        build_packed(cfg(chat_jsonl), tmp_path / "a", progress=False)
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("thdpack.")]
    assert lines[0].startswith("read ") and lines[-1].startswith("wrote ")
    assert {r.name for r in caplog.records} >= {"thdpack.offline.commands.build_packs", "thdpack.offline.tokenizing.tokenize_step"}
    caplog.clear()
    build_packed(cfg(chat_jsonl), tmp_path / "b", progress=False)
    assert capsys.readouterr().err == ""  # a library prints nothing by itself
    logs: list[str] = []
    with pytest.raises(TypeError, match="unexpected keyword argument 'log'"):
        build_packed(cfg(chat_jsonl), tmp_path / "c", progress=False, log=logs.append)
    assert logs == [] and not (tmp_path / "c").exists()
    assert logging.getLogger("thdpack").handlers == []  # nothing attached to the logger


def test_chat_template_option_replaces_the_tokenizers(tmp_path, chat_rows):
    """A tokenizer without generation markers + a template file with them == the marked tokenizer."""
    plain = tmp_path / "plain-tok"
    shutil.copytree(TOKENIZER_DIR, plain)
    conf = json.loads((plain / "tokenizer_config.json").read_text())
    marked_template = conf["chat_template"]
    conf["chat_template"] = marked_template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    (plain / "tokenizer_config.json").write_text(json.dumps(conf))
    (tmp_path / "train.jinja").write_text(marked_template)
    path = write_jsonl(chat_rows[:40], tmp_path / "c.jsonl")
    a = build(tmp_path, "marked", input=path)
    b = build(tmp_path, "override", input=path, tokenizer=str(plain), chat_template=str(tmp_path / "train.jinja"))
    assert b.metadata["tokenizer"]["chat_template_has_generation_markers"] is True
    assert b.metadata["tokenizer"]["fingerprint"] == a.metadata["tokenizer"]["fingerprint"]
    assert (b.path / "tokenizer" / "chat_template.jinja").read_text() == marked_template  # the saved copy has it
    da, db = load_packed(a.path), load_packed(b.path)
    for k in range(len(da)):
        for key in ("input_ids", "loss_mask", "sample_index"):
            np.testing.assert_array_equal(da[k][key], db[k][key])
    with pytest.raises(ConfigError, match="no such file"):
        build(tmp_path, "missing", input=path, chat_template=str(tmp_path / "nope.jinja"))
    (tmp_path / "bad.jinja").write_text("{% for m in messages %}{{ m['content'] }")
    with pytest.raises(ConfigError, match="not a valid Jinja template"):
        build(tmp_path, "bad", input=path, chat_template=str(tmp_path / "bad.jinja"))
