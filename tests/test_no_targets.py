"""Samples with no target tokens (issue 11, section 4).

- Offline builds count "no targets" *after* truncation and, by default, drop such
  samples before planning (``without_targets: drop``), so no pack trains on nothing;
  ``without_targets: keep`` keeps and counts them.
- Every numeric figure of ``metadata.json`` is recounted from the written packs (and,
  for figures about the input, from an independent reference: a ``split`` build that
  keeps every input token) and compared.
- In memory: ``ThdBatch.num_targets``; a batch without targets warns once; the
  training example never reports a NaN loss.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("datasets")
pytest.importorskip("transformers")

import thdpack  # noqa: E402
from thdpack.demo import TOKENIZER_DIR  # noqa: E402
from thdpack.offline import BuildConfig, build_packed, load_packed  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs" / "demo.yaml"
DEMO_ROWS = 1000  # enough for ~10 conversations whose answers lie past a 4096-token pack
IGNORE = -100

# numeric metadata figures that echo the configuration or the tokenizer (not counts)
ECHOES = ("format_version", "pack_size", "align", "cp_size", "tp_size", "seed", "pad_multiple",
          "max_samples_per_pack", "config.", "tokenizer.", "model.")


# ---------------------------------------------------------------------------- helpers


def demo_build(tmp_path: Path, name: str, **options):
    cfg = BuildConfig.from_yaml(DEMO).override(max_rows=DEMO_ROWS, **options)
    res = build_packed(cfg, tmp_path / name, progress=False)
    return cfg, load_packed(res.path)


def pack_targets(row: dict, targets: str) -> np.ndarray:
    """int64 ``[n]`` target tokens of each sample of a packed row (a sample's first token never is one)."""
    t = np.asarray(row[targets])
    is_t = t.astype(bool) if targets == "loss_mask" else t != IGNORE
    lens = np.asarray(row["seq_lens"], np.int64)
    first = np.cumsum(lens) - lens
    c = np.concatenate([[0], np.cumsum(is_t)])
    return c[first + lens] - c[first + 1]


def input_rows(ds) -> dict[int, np.ndarray]:
    """Every input row's whole target flags (bool ``[L]``), from a build that keeps every token
    (``overflow: split``, ``without_targets: keep``)."""
    pieces: dict[int, list] = {}
    for k in range(len(ds)):
        row = ds[k]
        lens = np.asarray(row["seq_lens"], np.int64)
        cut = np.cumsum(lens)[:-1]
        for r, a, m in zip(row["sample_index"].tolist(), row["sample_start"].tolist(), np.split(row["loss_mask"], cut)):
            pieces.setdefault(r, []).append((a, np.asarray(m, bool)))
    out = {}
    for r, ps in pieces.items():
        ps.sort(key=lambda p: p[0])
        assert [a for a, _ in ps] == list(np.cumsum([0] + [m.size for _, m in ps[:-1]])), f"row {r}: a gap"
        out[r] = np.concatenate([m for _, m in ps])
    return out


def numeric_leaves(x, path: str = "") -> dict:
    """``{"a.b[0].c": number}`` for every int / float leaf of a JSON value (not booleans)."""
    if isinstance(x, dict):
        return {k: v for key, val in x.items() for k, v in numeric_leaves(val, f"{path}.{key}" if path else key).items()}
    if isinstance(x, list):
        return {k: v for i, val in enumerate(x) for k, v in numeric_leaves(val, f"{path}[{i}]").items()}
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return {path: x}
    return {}


def flatten(d: dict, prefix: str) -> dict:
    return {f"{prefix}.{k}": v for k, v in numeric_leaves(d).items()}


def lower_percentile(sorted_x: np.ndarray, q: int) -> int:
    return int(sorted_x[(sorted_x.size - 1) * q // 100])


def log2_buckets(x: np.ndarray) -> list:
    k = np.array([int(v).bit_length() - 1 for v in x])
    return [[1 << b, (1 << (b + 1)) - 1, int((k == b).sum())] for b in range(k.min(), k.max() + 1)]


def recount(ds, rows: dict[int, np.ndarray], cfg: BuildConfig) -> dict:
    """Every numeric figure of ``ds.metadata`` recounted: pack figures from the packs of ``ds``,
    input figures from ``rows`` (each input row's whole target flags) and ``cfg``'s rules."""
    assert cfg.planning.overflow == "truncate" and cfg.planning.align == 1 or cfg.planning.pack_size % cfg.planning.align == 0
    P, A = cfg.planning.pack_size, cfg.planning.align
    limit = P // A * A
    seq, per_pack, n_per_pack, pack_tgt, piece_tgt, placed, files = [], [], [], [], [], set(), []
    for k in range(len(ds)):
        row = ds[k]
        lens = np.asarray(row["seq_lens"], np.int64)
        seq.append(lens)
        per_pack.append(int(lens.sum()))
        n_per_pack.append(lens.size)
        t = pack_targets(row, ds.metadata["targets"])
        piece_tgt.append(t)
        pack_tgt.append(int(t.sum()))
        placed.update(row["sample_index"].tolist())
    s = np.concatenate(seq)
    piece_tgt = np.concatenate(piece_tgt)
    per_pack, n_per_pack = np.array(per_pack), np.array(n_per_pack)
    n = len(ds)

    # the input side: what truncation keeps of each row, and which rows it leaves without targets
    length = {r: m.size for r, m in rows.items()}
    kept_targets = {r: int(m[1:min(m.size, limit)].sum()) for r, m in rows.items()}
    no_targets = sorted(r for r, t in kept_targets.items() if t == 0)
    drop = cfg.planning.without_targets == "drop"
    planned = sorted(r for r in rows if not (drop and kept_targets[r] == 0))
    assert sorted(placed) == planned  # the packs hold exactly the planned rows
    L = np.array([length[r] for r in planned])
    over = L > limit
    real = int(s.sum())
    sum_sq = int((s * s).sum())
    fill = per_pack / P
    padded = -(-s // A) * A
    counts = {
        "input_rows": len(rows),
        "skipped_rows": 0,
        "samples": len(planned),
        "pieces": int(s.size),
        "samples_without_targets": len(no_targets),
        "truncated": {"samples": int(over.sum()), "tokens": int((L[over] - limit).sum())},
        "dropped": {"samples": 0, "tokens": 0},
        "split": {"samples": 0},
        "tokens": real,
        "target_tokens": int(piece_tgt.sum()),
        "without_targets": {
            "policy": cfg.planning.without_targets,
            "dropped_samples": len(no_targets) if drop else 0,
            "dropped_tokens": sum(min(length[r], limit) for r in no_targets) if drop else 0,
            "pieces": int((piece_tgt == 0).sum()),
            "packs": int((np.array(pack_tgt) == 0).sum()),
        },
    }
    assert counts["target_tokens"] == sum(kept_targets[r] for r in planned)
    Ls = np.sort(L)
    stats = {
        "samples": int(s.size), "packs": n, "pack_size": P, "align": A,
        "lower_bound": -(-int(padded.sum()) // P), "real_tokens": real, "max_seqlen": int(s.max()),
        "min_pack_tokens": int(per_pack.min()), "efficiency": real / (n * P), "packing_factor": s.size / n,
        "max_samples_per_pack": int(n_per_pack.max()),
        "pack_fill": {"min": fill.min(), "mean": fill.mean(), "max": fill.max(),
                      "histogram": np.histogram(fill, bins=10, range=(0.0, 1.0))[0].tolist()},
        "lengths": {"count": int(L.size), "min": int(Ls[0]), "p50": lower_percentile(Ls, 50),
                    "p90": lower_percentile(Ls, 90), "p99": lower_percentile(Ls, 99), "max": int(Ls[-1]),
                    "mean": float(L.mean()), "histogram": log2_buckets(L)},
        "padding": {"multiple": A, "pad_tokens": int(padded.sum()) - real, "stream_tokens": int(padded.sum()),
                    "fraction": (int(padded.sum()) - real) / int(padded.sum()),
                    "packs_over_pack_size": 0, "static_fraction": 1 - real / (n * P)},
        "attention_flops": {"sum_seqlen_squared": sum_sq, "pack_len_count": n * P * P, "overcount": n * P * P / sum_sq,
                            "overcount_at_fill": float((per_pack.astype(float) ** 2).sum() / sum_sq)},
        **{k: counts[k] for k in ("truncated", "dropped", "split", "samples_without_targets", "skipped_rows",
                                  "target_tokens", "without_targets")},
    }
    for f in ds.metadata["files"]:
        files.append({"num_packs": len(ds), "num_tokens": real, "num_bytes": (ds.path / f["path"]).stat().st_size})
    want = {
        "num_packs": n,
        "dataset_max_seqlen": int(s.max()),
        "max_samples_per_bin": int(n_per_pack.max()),
        "packing_factor": round(s.size / n, 2),
        "packing_efficiency": round(100 * real / (n * P), 2),
        "min_packed_seqlen": int(per_pack.min()),
        "source.files[0].rows": len(rows),
        **flatten(counts, "counts"),
        **flatten(stats, "stats"),
    }
    assert len(files) == 1  # the demo fits one shard: its figures are the whole dataset's
    want.update(flatten(files[0], "files[0]"))
    return want


def check_metadata_recounted(ds, rows, cfg) -> None:
    meta = numeric_leaves(ds.metadata)
    want = recount(ds, rows, cfg)
    missing = sorted(set(want) - set(meta))
    assert not missing, f"figures missing from metadata.json: {missing}"
    unchecked = sorted(p for p in meta if p not in want and not p.startswith(ECHOES))
    assert not unchecked, f"figures of metadata.json that nothing recounts: {unchecked}"
    for path, value in want.items():
        assert meta[path] == pytest.approx(value, rel=1e-12, abs=1e-12), path


# ---------------------------------------------------------------------------- the demo


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The README's demo build (default policy), the same with ``keep``, and every input row."""
    d = tmp_path_factory.mktemp("no_targets")
    _, whole = demo_build(d, "whole", overflow="split", without_targets="keep")
    rows = input_rows(whole)
    assert len(rows) == DEMO_ROWS
    return {"rows": rows, "drop": demo_build(d, "drop"), "keep": demo_build(d, "keep", without_targets="keep")}


def test_demo_metadata_figures_are_recounted_from_the_packs(demo):
    for policy in ("drop", "keep"):
        cfg, ds = demo[policy]
        check_metadata_recounted(ds, demo["rows"], cfg)


def test_demo_build_has_no_pack_without_targets_by_default(demo):
    cfg, ds = demo["drop"]
    assert cfg.planning.without_targets == "drop" and ds.metadata["without_targets"] == "drop"
    assert all(pack_targets(ds[k], "loss_mask").sum() > 0 for k in range(len(ds)))
    c = ds.metadata["counts"]
    assert c["samples_without_targets"] > 0  # the demo has conversations whose answers truncation cuts off
    assert c["without_targets"]["dropped_samples"] == c["samples_without_targets"]
    assert c["without_targets"]["packs"] == c["without_targets"]["pieces"] == 0
    assert c["samples"] + c["without_targets"]["dropped_samples"] == c["input_rows"]


def test_keep_option_keeps_and_counts_samples_without_targets(demo):
    _, drop = demo["drop"]
    _, keep = demo["keep"]
    ck, cd = keep.metadata["counts"], drop.metadata["counts"]
    assert keep.metadata["without_targets"] == "keep"
    empty = [k for k in range(len(keep)) if pack_targets(keep[k], "loss_mask").sum() == 0]
    assert len(empty) == ck["without_targets"]["packs"] > 0
    assert ck["samples_without_targets"] == cd["samples_without_targets"] == ck["without_targets"]["pieces"]
    assert ck["samples"] == cd["samples"] + cd["without_targets"]["dropped_samples"] == ck["input_rows"]
    assert ck["target_tokens"] == cd["target_tokens"]  # the dropped samples held no targets


def test_stats_command_shows_the_policy(demo, capsys):
    from thdpack.cli import main

    _, ds = demo["drop"]
    assert main(["stats", str(ds.path)]) == 0
    out = capsys.readouterr().out
    n = ds.metadata["counts"]["samples_without_targets"]
    assert f"without targets  {n} samples (no target token left after truncation): dropped" in out, out


# ---------------------------------------------------------------------------- rules, on exact rows


def tokenized_rows(prompts, answers, seed=0) -> list[dict]:
    """Rows of ``prompt`` untrained tokens, then ``answer`` trained ones."""
    rng = np.random.default_rng(seed)
    out = []
    for p, a in zip(prompts, answers):
        ids = rng.integers(3, 3000, p + a).tolist()
        out.append({"input_ids": ids, "labels": [IGNORE] * p + ids[p:]})
    return out


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def tokenized_build(tmp_path, rows, name, **options):
    base = dict(input=str(write_rows(tmp_path / f"{name}.jsonl", rows)), format="tokenized",
                tokenizer=str(TOKENIZER_DIR), pack_size=64, overflow="truncate", shuffle_packs=False)
    base.update(options)
    res = build_packed(BuildConfig(**base), tmp_path / name, progress=False)
    return load_packed(res.path)


def test_targets_are_counted_in_what_truncation_keeps_at_the_alignment(tmp_path):
    # cp_size=3 -> align 6: a 64-token pack keeps the first 60 tokens of a row
    prompts = [59, 60, 58, 10, 70, 5]
    answers = [10, 10, 1, 10, 3, 200]
    ds = tokenized_build(tmp_path, tokenized_rows(prompts, answers), "aligned", cp_size=3)
    # row 0: targets from token 59 -> token 59 is kept (< 60): has one target; row 1, 4: none kept
    # row 2: its one target is token 58: kept
    c = ds.metadata["counts"]
    assert c["samples_without_targets"] == 2
    assert sorted(np.concatenate([ds[k]["sample_index"] for k in range(len(ds))]).tolist()) == [0, 2, 3, 5]
    assert c["without_targets"] == {"policy": "drop", "dropped_samples": 2, "dropped_tokens": 120, "pieces": 0, "packs": 0}
    assert c["truncated"] == {"samples": 2, "tokens": (69 - 60) + (205 - 60)}  # rows 0 and 5 (the dropped not counted)


def test_split_pieces_without_targets_are_kept_and_counted(tmp_path):
    # split keeps every token: a piece without targets stays (its sample has targets elsewhere)
    rows = tokenized_rows([150, 10, 100], [20, 5, 0])  # row 2 has no targets at all: dropped
    ds = tokenized_build(tmp_path, rows, "split", overflow="split")
    c = ds.metadata["counts"]
    assert c["samples_without_targets"] == 1 and c["without_targets"]["dropped_samples"] == 1
    # row 0 (170 tokens) -> pieces 0..63, 64..127 without targets, 128..169 with targets
    assert c["without_targets"]["pieces"] == 2 and c["without_targets"]["packs"] == 2
    assert c["split"] == {"samples": 1}
    empty = [k for k in range(len(ds)) if pack_targets(ds[k], "loss_mask").sum() == 0]
    assert len(empty) == 2


def test_all_rows_without_targets_is_a_clear_error(tmp_path):
    from thdpack.offline import InputError

    with pytest.raises(InputError, match=r"no row has a target token.*without_targets: keep"):
        tokenized_build(tmp_path, tokenized_rows([100, 80], [5, 5]), "none")


def test_without_targets_option_is_validated():
    from thdpack.offline import ConfigError

    with pytest.raises(ConfigError, match="without_targets must be one of drop, keep"):
        BuildConfig(input="x", without_targets="skip").validate()


# ---------------------------------------------------------------------------- in memory


def no_target_sample(n=8):
    ids = torch.arange(3, 3 + n)
    return {"input_ids": ids, "labels": torch.full((n,), IGNORE)}


def test_batch_reports_its_targets():
    batch = thdpack.build_thd_batch([{"input_ids": [5, 6, 7], "labels": [IGNORE, 6, 7]}, no_target_sample()])
    assert batch.num_targets == 2 == int((batch.labels != IGNORE).sum())


@pytest.fixture
def fresh_warning(monkeypatch):
    import thdpack.batching.batch

    monkeypatch.setattr(thdpack.batching.batch, "_warned_no_targets", False)


def test_batch_without_targets_warns_once(fresh_warning):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        thdpack.build_thd_batch([{"input_ids": [5, 6, 7]}])  # has targets: no warning
        b = thdpack.build_thd_batch([no_target_sample(), no_target_sample(5)])
        thdpack.build_thd_batch([no_target_sample()])
    msgs = [str(w.message) for w in caught if "no target" in str(w.message)]
    assert b.num_targets == 0
    assert len(msgs) == 1, msgs
    assert "sample_index [0, 1]" in msgs[0] and "num_targets" in msgs[0]


def test_collator_packs_without_targets_warn(fresh_warning):
    collate = thdpack.ThdCollator(pack_size=16, max_length=16)
    with pytest.warns(UserWarning, match=r"batch of 1 sample\(s\) \(sample_index \[1\]\) has no target"):
        batches = collate([{"input_ids": list(range(3, 19))}, no_target_sample(16)])
    assert sorted(b.num_targets for b in batches) == [0, 15]


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(name.removesuffix(".py"), ROOT / "examples" / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_training_example_never_reports_nan_on_packs_without_targets(tmp_path, capsys, fresh_warning):
    # most packs hold only a prompt cut off by truncation (kept on purpose)
    rows = tokenized_rows([100, 90, 80, 70, 5, 5], [10, 10, 10, 10, 20, 20])
    ds = tokenized_build(tmp_path, rows, "keep", without_targets="keep")
    assert ds.metadata["counts"]["without_targets"]["packs"] == 4
    threads = torch.get_num_threads()
    try:
        with pytest.warns(UserWarning, match="has no target token"):  # the collator flags the packs
            result = load_example("train_from_packed.py").main([str(ds.path), "--steps", str(len(ds)), "--workers", "0"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    printed = [float(x) for x in re.findall(r"^step +\d+ +loss (\S+)", out, re.MULTILINE)]
    assert printed and all(math.isfinite(x) for x in printed), out
    assert result["skipped"] == 4 and len(result["losses"]) == len(ds) - 4
    assert all(math.isfinite(x) for x in result["losses"])


@pytest.mark.parametrize("targets", ["loss_mask", "labels"])
def test_whole_row_target_counts_equal_the_targets_read_back(targets, tmp_path):
    """The planner counts a whole row's targets from the count tokenizing wrote (``__tail_targets__``), a cut
    piece's from the targets themselves: both equal a count of the targets read back, also for rows whose
    only target is their first token (never a target in a pack) and rows without any."""
    from thdpack.offline.commands import build_packs as pipeline
    from thdpack.offline.store.gather import count_targets

    rng = np.random.default_rng(3)
    rows = []
    for i in range(300):
        n = int(rng.integers(1, 40))
        mask = (rng.random(n) < [0.0, 0.3, 0.9][i % 3]).astype(int).tolist()
        if i % 7 == 0:
            mask = [1] + [0] * (n - 1)  # the first token alone
        rows.append({"input_ids": rng.integers(5, 400, n).tolist(), "loss_mask": mask})
    data = tmp_path / "rows.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    cfg = BuildConfig.from_dict({"input": str(data), "format": "tokenized", "pack_size": 24, "overflow": "split",
                                 "targets": targets, "without_targets": "keep"}, base_dir=tmp_path)
    prep = pipeline.prepare(cfg, tmp_path)
    plan, sample_rows = prep.plan, prep.sample_rows
    table = prep.tokenized.dataset.data.table
    want = count_targets(table, targets, sample_rows[plan.sample_index], plan.start + 1, plan.length - 1)
    whole = (plan.start == 0) & (plan.length == prep.tokenized.lengths[sample_rows[plan.sample_index]])
    assert whole.sum() > 100 and (~whole).sum() > 10  # both paths taken
    np.testing.assert_array_equal(prep.piece_targets, want)
    expected = [sum(r["loss_mask"][1:]) for r in rows]
    np.testing.assert_array_equal(table.column("__tail_targets__").to_numpy(), expected)
