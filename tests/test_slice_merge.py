"""Sliced offline builds (``thdpack build --slice i/N``) and ``thdpack merge``.

The reference for "slices + merge" is one process that reads and tokenizes the whole
input once and plans every slice's row range on its own (``reference_build`` below,
written from ``prepare``, ``plan_packs`` and ``summarize`` only: no slice or merge
code). The merged dataset must hold exactly its packs, in its order, with the same
counts and statistics; every usable input row appears exactly once.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

pytest.importorskip("datasets")
pytest.importorskip("transformers")

from thdpack.cli import main
from thdpack.demo import TOKENIZER_DIR, generate_rows, write_jsonl
from thdpack.offline import (
    BuildConfig,
    NotPackedError,
    OutputExistsError,
    build_packed,
    load_packed,
)
from thdpack.offline.commands.build_packs import prepare
from thdpack.offline.errors import ConfigError, InputError
from thdpack.offline.inputs.input_slice import InputSlice, parse_slice, slice_from_env
from thdpack.offline.commands.slice_merge import SliceMismatchError, merge_slices
from thdpack.offline.commands.pack_stats import summarize
from thdpack.planning.plan import plan_packs

IGNORE = -100


# ---------------------------------------------------------------------------- helpers


def write_rows(path: Path, rows: list) -> Path:
    """JSON Lines of ``{"input_ids": [...]}`` rows; a ``None`` row becomes a malformed line."""
    with open(path, "w") as f:
        f.writelines("{not json\n" if r is None else json.dumps({"input_ids": r}) + "\n" for r in rows)
    return path


def tree_digest(path: Path) -> dict:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def build_slices(cfg: BuildConfig, parts: Path, n: int) -> list[Path]:
    out = []
    for i in range(n):
        res = build_packed(cfg, parts / f"part-{i}", progress=False, input_slice=InputSlice(i, n))
        out.append(res.path)
    return out


def reference_build(cfg: BuildConfig, n: int) -> dict:
    """One process, whole input tokenized once, each slice's row range planned on its own."""
    with tempfile.TemporaryDirectory() as d:
        prep = prepare(cfg, Path(d), progress=False)
        table = prep.tokenized.dataset.data.table
        ids = table.column("input_ids").to_pylist()
        tgt = table.column(cfg.tokenize.targets).to_pylist()
        lengths = prep.tokenized.lengths.copy()
        usable = prep.sample_rows.copy()
        total = prep.source.num_rows
        skipped = prep.skipped_examples()
        counts = prep.counts()
        del prep
    packs, seq_lens, n_per_pack = [], [], []
    for i in range(n):
        a, b = i * total // n, (i + 1) * total // n
        rows = usable[(usable >= a) & (usable < b)]
        plan = plan_packs(lengths[rows], cfg.planning.pack_size, algorithm=cfg.planning.algorithm, align=cfg.planning.align,
                          overflow=cfg.planning.overflow, max_samples_per_pack=cfg.planning.max_samples_per_pack, seed=cfg.planning.seed)
        order = np.random.default_rng(cfg.planning.seed).permutation(len(plan)) if cfg.store.shuffle_packs else np.arange(len(plan))
        for k in order.tolist():
            pieces = range(int(plan.pack_offsets[k]), int(plan.pack_offsets[k + 1]))
            p_rows = [int(rows[plan.sample_index[j]]) for j in pieces]
            p_start = [int(plan.start[j]) for j in pieces]
            p_len = [int(plan.length[j]) for j in pieces]
            packs.append({
                "input_ids": [t for r, s, m in zip(p_rows, p_start, p_len) for t in ids[r][s : s + m]],
                cfg.tokenize.targets: [t for r, s, m in zip(p_rows, p_start, p_len) for t in tgt[r][s : s + m]],
                "seq_lens": p_len, "sample_index": p_rows, "sample_start": p_start,
            })
            seq_lens.extend(p_len)
            n_per_pack.append(len(p_len))
    offsets = np.concatenate([[0], np.cumsum(n_per_pack)]).astype(np.int64)
    target_tokens = 0
    for p in packs:
        is_t = np.asarray(p[cfg.tokenize.targets]) if cfg.tokenize.targets == "loss_mask" else np.asarray(p[cfg.tokenize.targets]) != IGNORE
        firsts = np.cumsum([0] + p["seq_lens"][:-1])
        target_tokens += int(is_t.sum()) - int(is_t[firsts].sum())
    stats = summarize(np.asarray(seq_lens), offsets, cfg.planning.pack_size, cfg.planning.align, input_lengths=lengths[usable])
    return {"packs": packs, "stats": stats, "usable": usable, "total": total, "skipped": skipped,
            "counts": counts, "target_tokens": target_tokens}


def check_equals_reference(ds, ref: dict, cfg: BuildConfig) -> None:
    meta = ds.metadata
    assert len(ds) == len(ref["packs"]) == meta["num_packs"]
    for k, want in enumerate(ref["packs"]):
        got = ds[k]
        for name in ("input_ids", cfg.tokenize.targets, "seq_lens", "sample_index", "sample_start"):
            np.testing.assert_array_equal(np.asarray(got[name]).astype(np.int64), np.asarray(want[name], dtype=np.int64),
                                          err_msg=f"pack {k} {name}")
        assert int(np.sum(want["seq_lens"])) <= cfg.planning.pack_size
    for key, value in ref["stats"].items():  # same arrays in the same order: exactly equal
        assert meta["stats"][key] == value, key
    c = meta["counts"]
    assert c["input_rows"] == ref["total"]
    assert c["samples"] == ref["usable"].size
    assert c["skipped_rows"] == ref["total"] - ref["usable"].size - c["without_targets"]["dropped_samples"]
    assert c["tokens"] == meta["stats"]["real_tokens"] == sum(len(p["input_ids"]) for p in ref["packs"])
    assert c["target_tokens"] == meta["stats"]["target_tokens"] == ref["target_tokens"]
    for key in ("truncated", "dropped", "split", "skipped_rows", "samples_without_targets"):
        assert meta["stats"][key] == c[key] == ref["counts"][key], key
    for key in ("policy", "dropped_samples", "dropped_tokens", "pieces"):  # not "packs": the plans differ
        want = ref["counts"]["without_targets"][key]
        assert meta["stats"]["without_targets"][key] == c["without_targets"][key] == want, key
    assert meta["skipped_examples"] == ref["skipped"]
    assert meta["packing_efficiency"] == round(100 * ref["stats"]["efficiency"], 2)
    assert meta["dataset_max_seqlen"] == ref["stats"]["max_seqlen"]


def check_every_row_once(ds, usable: np.ndarray, overflow: str) -> None:
    rows, starts, lens = [], [], []
    for k in range(len(ds)):
        row = ds[k]
        rows.extend(row["sample_index"].tolist())
        starts.extend(row["sample_start"].tolist())
        lens.extend(row["seq_lens"].tolist())
    if overflow == "split":  # pieces of a row tile it: unique (row, start), rows = the usable rows
        assert len(set(zip(rows, starts))) == len(rows)
        assert sorted(set(rows)) == usable.tolist()
    else:
        kept = sorted(rows)
        assert len(kept) == len(set(kept))  # no row twice
        assert set(kept) <= set(usable.tolist())
        if overflow != "drop":
            assert kept == usable.tolist()


# ---------------------------------------------------------------------------- slices + merge = the single build


@st.composite
def case(draw):
    n_rows = draw(st.integers(1, 40))
    lens = draw(st.lists(st.integers(1, 90), min_size=n_rows, max_size=n_rows))
    bad = draw(st.lists(st.booleans(), min_size=n_rows, max_size=n_rows)) if draw(st.booleans()) else [False] * n_rows
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    rows = [None if b else rng.integers(0, 500, m).tolist() for m, b in zip(lens, bad)]
    n = draw(st.integers(1, min(5, n_rows)))
    opts = dict(
        pack_size=draw(st.sampled_from([48, 64, 128])),
        algorithm=draw(st.sampled_from(["bfd", "ffd", "first_fit_shuffle", "sequential"])),
        overflow=draw(st.sampled_from(["truncate", "split", "drop", "error"])),
        seed=draw(st.integers(0, 5)),
        shuffle_packs=draw(st.booleans()),
        cp_size=draw(st.sampled_from([1, 2])),
        targets=draw(st.sampled_from(["loss_mask", "labels"])),
        output_format=draw(st.sampled_from(["arrow", "parquet"])),
        file_size_mb=draw(st.sampled_from([512, 0.0005])),  # tiny: several data files per slice
        skip_bad_rows=True,
        without_targets=draw(st.sampled_from(["drop", "keep"])),  # a 1-token row has no target token
    )
    return rows, n, opts


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case())
def test_slices_plus_merge_equal_the_single_build_with_slice_local_plans(c):
    rows, n, opts = c
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        cfg = BuildConfig(input=str(write_rows(d / "rows.jsonl", rows)), format="tokenized", **opts)
        # every slice needs a usable row (a slice of only bad rows is an error, tested below)
        for i in range(n):
            a, b = i * len(rows) // n, (i + 1) * len(rows) // n
            assume(any(r is not None and (opts["overflow"] != "error" or len(r) <= opts["pack_size"] // cfg.planning.align * cfg.planning.align)
                       and (opts["without_targets"] == "keep" or len(r) > 1) for r in rows[a:b]))
        # overflow: drop of every row of the whole input stops the build (test_offline_hardening.py,
        # test_overflow_drop_of_every_row_stops); a slice whose rows are all dropped is written empty
        assume(opts["overflow"] != "drop" or any(r is not None and len(r) <= opts["pack_size"] // cfg.planning.align * cfg.planning.align
                                                  for r in rows))
        parts = build_slices(cfg, d / "parts", n)
        merged = merge_slices(parts[::-1], d / "merged")  # any argument order
        ds = load_packed(merged.path, verify=True)
        ref = reference_build(cfg, n)
        check_equals_reference(ds, ref, cfg)
        check_every_row_once(ds, ref["usable"], opts["overflow"])
        assert ds.metadata["input_slices"]["count"] == n
        assert ds.metadata["input_slices"]["num_packs"] == [load_packed(p).metadata["num_packs"] for p in parts]
        # the data files are the slices' files, byte for byte, in slice order
        slice_files = [hashlib.sha256((p / f["path"]).read_bytes()).hexdigest()
                       for p in parts for f in load_packed(p).metadata["files"]]
        assert [f["sha256"] for f in ds.metadata["files"]] == slice_files
        # deterministic: merging again (other order, other name) gives the same bytes
        again = merge_slices(parts, d / "again")
        assert tree_digest(again.path) == tree_digest(merged.path)


def test_one_slice_merged_is_the_ordinary_build(tmp_path):
    rows = generate_rows(120, seed=5, kind="chat")
    data = write_jsonl(rows, tmp_path / "chat.jsonl")
    for shuffle in (False, True):
        cfg = BuildConfig(input=str(data), tokenizer=str(TOKENIZER_DIR), pack_size=1024, overflow="truncate",
                          shuffle_packs=shuffle)
        single = build_packed(cfg, tmp_path / f"single-{shuffle}", progress=False)
        (part,) = build_slices(cfg, tmp_path / f"parts-{shuffle}", 1)
        merged = merge_slices([part], tmp_path / f"merged-{shuffle}")
        a, b = tree_digest(single.path), tree_digest(merged.path)
        assert a.pop("metadata.json") != b.pop("metadata.json")
        assert a == b  # data files and tokenizer copy: byte-identical
        ma, mb = single.metadata, dict(merged.metadata)
        assert mb.pop("input_slices")["row_ranges"] == [[0, 120]]
        assert list(ma) == list(mb)
        assert_close(ma, mb)
        if not shuffle:  # the same pack order as the plan: the statistics are exactly equal
            assert ma == mb


def assert_close(a, b, where="metadata"):
    if isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), where
        for k in a:
            assert_close(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, float):
        assert math.isclose(a, b, rel_tol=1e-12) or (math.isnan(a) and math.isnan(b)), where
    else:
        assert a == b, where


def test_chat_slices_merge_with_tokenizer_and_global_row_locations(tmp_path):
    rows = generate_rows(90, seed=7, kind="chat")
    data = write_jsonl(rows, tmp_path / "chat.jsonl")
    lines = data.read_text().splitlines()
    for k in (3, 40, 41, 88):  # malformed lines, in several slices
        lines[k] = "{broken"
    data.write_text("\n".join(lines) + "\n")
    cfg = BuildConfig(input=str(data), tokenizer=str(TOKENIZER_DIR), pack_size=1024, overflow="split",
                      skip_bad_rows=True)
    parts = build_slices(cfg, tmp_path / "parts", 3)
    for p in parts:  # a slice is a normal packed dataset with global row indices
        info = load_packed(p).metadata["input_slice"]
        rows_seen = np.concatenate([r["sample_index"] for r in load_packed(p)])
        assert info["row_start"] <= rows_seen.min() and rows_seen.max() < info["row_stop"]
    merged = merge_slices([tmp_path / "parts"], tmp_path / "merged")  # the parent directory
    ds = load_packed(merged.path, verify=True)
    ref = reference_build(cfg, 3)
    check_equals_reference(ds, ref, cfg)
    check_every_row_once(ds, ref["usable"], "split")
    assert [e["where"] for e in ds.metadata["skipped_examples"]] == [f"{data}:{k + 1}" for k in (3, 40, 41, 88)]
    assert (merged.path / "tokenizer" / "tokenizer.json").is_file()
    assert ds.collator()(ds[0]).input_ids.numel() > 0
    # the whole input's description, as an ordinary build records it
    single = build_packed(cfg, tmp_path / "single", progress=False)
    assert ds.metadata["source"] == single.metadata["source"]
    assert ds.metadata["tokenizer"] == single.metadata["tokenizer"]
    assert ds.metadata["counts"] == single.metadata["counts"]


def test_rebuilt_slices_and_merge_are_byte_identical(tmp_path):
    rng = np.random.default_rng(0)
    data = write_rows(tmp_path / "rows.jsonl", [rng.integers(0, 100, int(m)).tolist() for m in rng.integers(1, 200, 150)])
    cfg = BuildConfig(input=str(data), format="tokenized", pack_size=256)
    digests = []
    for run in range(2):
        parts = build_slices(cfg, tmp_path / f"parts{run}", 4)
        merged = merge_slices(parts, tmp_path / f"merged{run}")
        digests.append(([tree_digest(p) for p in parts], tree_digest(merged.path)))
    assert digests[0] == digests[1]


# ---------------------------------------------------------------------------- the command line


def test_cli_slice_auto_under_torchrun_and_slurm_then_merge_and_stats(tmp_path, monkeypatch, capsys):
    rng = np.random.default_rng(1)
    data = write_rows(tmp_path / "rows.jsonl", [rng.integers(0, 100, int(m)).tolist() for m in rng.integers(1, 300, 200)])
    base = ["build", "-q", "--input", str(data), "--format", "tokenized", "--pack-size", "512"]
    for var in ("RANK", "WORLD_SIZE", "SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT", "SLURM_ARRAY_TASK_MIN",
                "SLURM_ARRAY_TASK_MAX", "SLURM_ARRAY_TASK_STEP"):
        monkeypatch.delenv(var, raising=False)
    for rank in range(3):  # torchrun --nproc-per-node 3
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "3")
        assert main(base + ["--slice", "auto", "--output", str(tmp_path / "torchrun" / "part-{slice}")]) == 0
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    for task in (1, 2, 3):  # sbatch --array=1-3
        for k, v in dict(SLURM_ARRAY_TASK_ID=task, SLURM_ARRAY_TASK_COUNT=3, SLURM_ARRAY_TASK_MIN=1,
                         SLURM_ARRAY_TASK_MAX=3).items():
            monkeypatch.setenv(k, str(v))
        assert main(base + ["--slice", "auto", "--output", str(tmp_path / "slurm" / "{index}")]) == 0
    assert sorted(p.name for p in (tmp_path / "torchrun").iterdir()) == [f"part-0000{i}-of-00003" for i in range(3)]
    assert sorted(p.name for p in (tmp_path / "slurm").iterdir()) == ["0", "1", "2"]
    assert main(["merge", "-q", str(tmp_path / "a"), str(tmp_path / "torchrun" / "part-*")]) == 0
    assert main(["merge", "-q", str(tmp_path / "b"), str(tmp_path / "slurm")]) == 0
    assert tree_digest(tmp_path / "a") == tree_digest(tmp_path / "b")
    capsys.readouterr()
    assert main(["stats", str(tmp_path / "a"), "--json", "--verify"]) == 0
    stats = json.loads(capsys.readouterr().out)
    meta = load_packed(tmp_path / "a").metadata
    for key in ("packs", "samples", "real_tokens", "efficiency", "lengths", "target_tokens"):
        assert stats[key] == meta["stats"][key], key
    assert stats["samples"] == 200
    # refuses to overwrite, then does with --overwrite; errors are one line, exit code 2
    assert main(["merge", "-q", str(tmp_path / "a"), str(tmp_path / "slurm")]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["merge", "-q", "--overwrite", str(tmp_path / "a"), str(tmp_path / "slurm")]) == 0
    assert main(["merge", "-q", str(tmp_path / "c"), str(tmp_path / "slurm" / "0")]) == 2
    assert "missing 2 of 3 slices: index 1, 2" in capsys.readouterr().err


def test_parse_slice_and_environment():
    assert parse_slice("2/5") == InputSlice(2, 5)
    assert parse_slice(" 0/1 ") == InputSlice(0, 1)
    for bad in ("x", "1/2/3", "1", "a/3"):
        with pytest.raises(ConfigError, match="--slice must be I/N"):
            parse_slice(bad)
    for bad, message in (("5/5", r"slice index must be an integer in \[0, 5\), got 5"),
                         ("-1/3", r"slice index must be an integer in \[0, 3\), got -1"),
                         ("1/0", r"slice count must be an integer >= 1, got 0")):
        with pytest.raises(ConfigError, match=rf"^--slice: {message}$"):
            parse_slice(bad)
    assert parse_slice("auto", {"RANK": "3", "WORLD_SIZE": "4"}) == InputSlice(3, 4, "torchrun RANK/WORLD_SIZE")
    s = slice_from_env({"SLURM_ARRAY_TASK_ID": "7", "SLURM_ARRAY_TASK_COUNT": "4", "SLURM_ARRAY_TASK_MIN": "5",
                        "SLURM_ARRAY_TASK_MAX": "8"})
    assert (s.index, s.count) == (2, 4)
    # torchrun with one process inside a Slurm array: the array decides
    s = slice_from_env({"RANK": "0", "WORLD_SIZE": "1", "SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_COUNT": "2"})
    assert (s.index, s.count) == (1, 2)
    with pytest.raises(ConfigError, match="ambiguous"):
        slice_from_env({"RANK": "0", "WORLD_SIZE": "2", "SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_COUNT": "2"})
    with pytest.raises(ConfigError, match="not one contiguous range"):
        slice_from_env({"SLURM_ARRAY_TASK_ID": "2", "SLURM_ARRAY_TASK_COUNT": "3", "SLURM_ARRAY_TASK_MIN": "0",
                        "SLURM_ARRAY_TASK_MAX": "4", "SLURM_ARRAY_TASK_STEP": "2"})
    with pytest.raises(ConfigError, match="found neither"):
        slice_from_env({})
    with pytest.raises(ConfigError, match=r"^--slice auto \(torchrun RANK/WORLD_SIZE\): slice index must be an integer "
                                          r"in \[0, 4\), got 4$"):
        slice_from_env({"RANK": "4", "WORLD_SIZE": "4"})
    assert InputSlice(3, 12).format_output("out/p-{slice}") == "out/p-00003-of-00012"
    assert InputSlice(3, 12).format_output("out/{index}of{count}") == "out/3of12"
    assert InputSlice(3, 12).format_output("out/plain") == "out/plain"  # explicit I/N: as given
    with pytest.raises(ConfigError, match="put \\{slice\\} in --output"):
        InputSlice(1, 2, "torchrun RANK/WORLD_SIZE").format_output("out/plain")
    with pytest.raises(ConfigError, match="only \\{slice\\}"):
        InputSlice(0, 2).format_output("out/{rank}")
    # contiguous row ranges: every row once, sizes within one
    for total in (1, 7, 100):
        for n in range(1, min(total, 9) + 1):
            ranges = [InputSlice(i, n).rows(total) for i in range(n)]
            assert ranges[0][0] == 0 and ranges[-1][1] == total
            assert all(ranges[i][1] == ranges[i + 1][0] for i in range(n - 1))
            assert max(b - a for a, b in ranges) - min(b - a for a, b in ranges) <= 1


# ---------------------------------------------------------------------------- compatibility errors


@pytest.fixture(scope="module")
def slice_set(tmp_path_factory):
    d = tmp_path_factory.mktemp("slices")
    rng = np.random.default_rng(2)
    data = write_rows(d / "rows.jsonl", [rng.integers(0, 100, int(m)).tolist() for m in rng.integers(1, 100, 60)])
    cfg = BuildConfig(input=str(data), format="tokenized", pack_size=128)
    return d, cfg, build_slices(cfg, d / "parts", 3)


def test_merge_refuses_slices_that_do_not_belong_together(tmp_path, slice_set):
    _, cfg, parts = slice_set

    def refused(paths, match):
        with pytest.raises((SliceMismatchError, NotPackedError), match=match):
            merge_slices(paths, tmp_path / "out")
        assert not (tmp_path / "out").exists()
        assert not list(tmp_path.glob(".out.tmp-*"))

    refused([parts[0], parts[2]], r"missing 1 of 3 slices: index 1 ")
    dup = tmp_path / "dup"
    shutil.copytree(parts[1], dup)
    refused(parts + [dup], r"slice index given more than once \(slice 1/3: ")
    other_n = build_packed(cfg, tmp_path / "n2", progress=False, input_slice=InputSlice(1, 2)).path
    refused([parts[0], other_n, parts[2]], r"different slice counts \(N=2: .*n2; N=3: ")
    other_opts = build_packed(cfg.override(pack_size=256), tmp_path / "opts", progress=False,
                              input_slice=InputSlice(1, 3)).path
    refused([parts[0], other_opts, parts[2]], r"slices 0 .* and 1 .* do not belong together: they were built with "
                                              r"different options \(pack_size\)")
    rows = [json.loads(x)["input_ids"] for x in Path(cfg.source.input).read_text().splitlines()]
    rows[-1] = rows[-1] + [1]
    other_input = build_packed(cfg.override(input=str(write_rows(tmp_path / "rows.jsonl", rows))), tmp_path / "inp",
                               progress=False, input_slice=InputSlice(2, 3)).path
    refused([parts[0], parts[1], other_input], r"different inputs \(source fingerprint")
    whole = build_packed(cfg, tmp_path / "whole", progress=False).path
    refused([whole], r"not a slice build \(no 'input_slice'")
    refused([tmp_path / "nothing"], r"nothing is not a directory")
    # a damaged data file (same size): its checksum fails while copying
    bad = tmp_path / "bad"
    shutil.copytree(parts[2], bad)
    f = bad / load_packed(bad).metadata["files"][0]["path"]
    raw = bytearray(f.read_bytes())
    raw[-20] ^= 0xFF
    f.write_bytes(bytes(raw))
    refused([parts[0], parts[1], bad], r"does not match its sha256")
    # the output is one of the slices / already exists
    with pytest.raises(ValueError, match="is one of the slices"):
        merge_slices(parts, parts[0], overwrite=True)
    merge_slices(parts, tmp_path / "ok")
    with pytest.raises(OutputExistsError):
        merge_slices(parts, tmp_path / "ok")
    merge_slices(parts, tmp_path / "ok", overwrite=True, link=True)
    assert len(load_packed(tmp_path / "ok", verify=True)) == sum(len(load_packed(p)) for p in parts)


def test_empty_slice_is_a_clear_error(tmp_path):
    data = write_rows(tmp_path / "rows.jsonl", [[1, 2, 3], [4, 5]])
    cfg = BuildConfig(input=str(data), format="tokenized", pack_size=16)
    with pytest.raises(InputError, match=r"slice 0/3 has no input rows: the input has 2 row\(s\), so use at most 2"):
        build_packed(cfg, tmp_path / "p", progress=False, input_slice=InputSlice(0, 3))
    assert not (tmp_path / "p").exists()


# ---------------------------------------------------------------------------- unknown names; the merge's keywords


def test_unknown_placeholder_option_and_flag_are_refused(capsys):
    """An ``--output`` placeholder other than ``{slice}``, ``{index}`` and ``{count}``, an unknown option (a YAML
    key or an ``override`` keyword) and an unknown flag are errors that name them."""
    from thdpack.cli import build_parser

    with pytest.raises(ConfigError, match=r"only \{slice\}, \{index\} and \{count\} may appear in braces"):
        InputSlice(3, 12).format_output("out/p-{shard}")
    with pytest.raises(ConfigError, match=r"unknown option 'shard_size_mb'"):
        BuildConfig.from_dict({"shard_size_mb": 7})
    with pytest.raises(SystemExit):
        build_parser().parse_args(["build", "--shard", "1/2", "--shard-size-mb", "3"])
    assert "unrecognized arguments: --shard 1/2 --shard-size-mb 3" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"unknown option\(s\) \['shard_size_mb'\]"):
        BuildConfig().override(file_size_mb=1, shard_size_mb=2)


def test_merge_takes_no_log_keyword_and_records_its_plan(tmp_path, slice_set):
    _, _, parts = slice_set
    with pytest.raises(TypeError, match="unexpected keyword argument 'log'"):
        merge_slices(parts, tmp_path / "m-log", log=print)
    plan = merge_slices(parts, tmp_path / "m-new").metadata["input_slices"]["plan"]
    assert plan == "slice-local: each input slice's rows were planned on their own; packs are in slice order"


def test_a_slice_whose_rows_are_all_dropped_is_written_empty(tmp_path):
    """overflow: drop of every row stops a whole build; an input slice whose rows are all longer than a pack
    is written with no packs (and counted), and the merge holds the other slice's packs."""
    rows = [list(range(1, 101)), list(range(1, 91))] + [list(range(1, 21)) for _ in range(6)]
    cfg = BuildConfig(input=str(write_rows(tmp_path / "rows.jsonl", rows)), format="tokenized", pack_size=48,
                      overflow="drop")
    parts = build_slices(cfg, tmp_path / "parts", 4)
    assert [load_packed(p).metadata["num_packs"] for p in parts][0] == 0
    merged = load_packed(merge_slices(parts, tmp_path / "merged").path, verify=True)
    assert merged.metadata["counts"]["dropped"]["samples"] == 2 and merged.metadata["num_packs"] > 0
    with pytest.raises(InputError, match="every row is longer than pack_size=48"):
        build_packed(BuildConfig(input=str(write_rows(tmp_path / "long.jsonl", rows[:2])), format="tokenized",
                                 pack_size=48, overflow="drop"), tmp_path / "none", progress=False)
