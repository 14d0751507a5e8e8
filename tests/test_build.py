"""Property tests for ``build_thd_batch``, ``ThdBatch`` conversions and ``ThdCollator``."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pytest
import torch

import megatron_env  # tests/megatron_env.py
from thdpack.common.align import resolve_pad_multiple
from hypothesis import given, settings
from hypothesis import strategies as st

from thdpack import ThdBatch, ThdCollator, build_thd_batch, cp_pad_multiple, plan_packs
from thdpack.loaders import PackedBatches
from thdpack.integrations import packed_seq_params_dict, to_hf_kwargs, to_packed_seq_params
from thdpack.integrations.hf_kwargs import hf_labels
from thdpack.batching import seq_idx
from thdpack.flops import seqlen_squared_sum

SETTINGS = settings(max_examples=60, deadline=None)
IGNORE = -100


# --------------------------------------------------------------------------
# strategies
# --------------------------------------------------------------------------
@st.composite
def sample_st(draw, ignore_index=IGNORE, max_len=50):
    n = draw(st.integers(1, max_len))
    ids = draw(st.lists(st.integers(0, 1000), min_size=n, max_size=n))
    sample = {"input_ids": ids}
    kind = draw(st.sampled_from(["plain", "labels", "mask", "both"]))
    if kind in ("labels", "both"):
        keep = draw(st.lists(st.booleans(), min_size=n, max_size=n))
        sample["labels"] = [t if k else ignore_index for t, k in zip(ids, keep)]
    if kind in ("mask", "both"):
        sample["loss_mask"] = draw(st.lists(st.integers(0, 1), min_size=n, max_size=n))
    return sample


@st.composite
def build_case(draw):
    ignore_index = draw(st.sampled_from([IGNORE, -1]))
    samples = draw(st.lists(sample_st(ignore_index=ignore_index), min_size=1, max_size=8))
    kw = dict(
        pad_token_id=draw(st.integers(0, 7)),
        ignore_index=ignore_index,
        cp_size=draw(st.sampled_from([1, 2, 4])),
        tp_size=draw(st.sampled_from([1, 2, 3])),
        sequence_parallel=draw(st.booleans()),
        pad_multiple=draw(st.sampled_from([None, 1, 3, 8, 16])),
    )
    return samples, kw


def expected_multiple(cp_size=1, tp_size=1, sequence_parallel=False, pad_multiple=None, **_):
    m = 2 * cp_size if cp_size > 1 else 1
    if sequence_parallel and tp_size > 1:
        m = math.lcm(m, tp_size * cp_size)
    if pad_multiple is not None:
        m = math.lcm(m, pad_multiple)
    return m


def expected_targets(sample, ignore_index):
    """Target labels of one sample alone: token t is scored against token t+1's label."""
    ids = np.asarray(sample["input_ids"], dtype=np.int64)
    src = np.asarray(sample["labels"], dtype=np.int64) if sample.get("labels") is not None else ids.copy()
    if sample.get("loss_mask") is not None:
        src = np.where(np.asarray(sample["loss_mask"]).astype(bool), src, ignore_index)
    out = np.full(ids.size, ignore_index, dtype=np.int64)
    out[:-1] = src[1:]
    return out


def check_batch(batch: ThdBatch, samples, kw, sample_index=None):
    ignore = kw.get("ignore_index", IGNORE)
    pad = kw.get("pad_token_id", 0)
    m = expected_multiple(**kw)
    n = len(samples)
    lens = np.array([len(s["input_ids"]) for s in samples], dtype=np.int64)
    padded = -(-lens // m) * m
    T = int(padded.sum())

    assert isinstance(batch, ThdBatch)
    assert batch.pad_multiple == m
    assert batch.ignore_index == ignore
    # dtypes and shapes
    for name in ("input_ids", "labels", "position_ids", "sample_index"):
        assert getattr(batch, name).dtype == torch.int64, name
    for name in ("cu_seqlens", "cu_seqlens_padded", "seq_lens"):
        assert getattr(batch, name).dtype == torch.int32, name
    assert batch.loss_mask.dtype == torch.bool
    for name in ("input_ids", "labels", "loss_mask", "position_ids"):
        assert getattr(batch, name).shape == (T,), name
    assert batch.cu_seqlens.shape == (n + 1,) and batch.cu_seqlens_padded.shape == (n + 1,)

    cu = batch.cu_seqlens.numpy().astype(np.int64)
    cup = batch.cu_seqlens_padded.numpy().astype(np.int64)
    assert cu[0] == 0 and cup[0] == 0
    assert (np.diff(cu) >= 0).all() and (np.diff(cup) >= 0).all()
    assert cu[-1] == lens.sum()
    assert cup[-1] == T == batch.input_ids.numel()
    assert np.diff(cu).tolist() == lens.tolist()
    assert batch.seq_lens.tolist() == lens.tolist()
    p = np.diff(cup)
    assert (p % m == 0).all() and (p >= lens).all() and (p - lens < m).all(), "not the least multiple"
    assert batch.seq_lens_padded.tolist() == p.tolist()
    assert isinstance(batch.max_seqlen, int) and batch.max_seqlen == int(p.max())
    assert batch.num_samples == n and batch.num_tokens == int(lens.sum()) and batch.num_padded_tokens == T
    assert len(batch) == T
    assert isinstance(seqlen_squared_sum(batch), int) and seqlen_squared_sum(batch) == int((lens * lens).sum())
    assert batch.sample_index.tolist() == (list(range(n)) if sample_index is None else list(sample_index))
    assert batch.tokens_truncated == 0

    ids = batch.input_ids.numpy()
    labels = batch.labels.numpy()
    pos = batch.position_ids.numpy()
    owner = np.full(T, -1)  # sample of each real token
    for i, s in enumerate(samples):
        a, L, b = int(cup[i]), int(lens[i]), int(cup[i + 1])
        assert ids[a : a + L].tolist() == list(np.asarray(s["input_ids"]).tolist()), f"sample {i} tokens"
        assert (ids[a + L : b] == pad).all(), f"sample {i} pad ids"
        assert (labels[a + L : b] == ignore).all(), f"sample {i} pad labels"
        assert pos[a : a + L].tolist() == list(range(L)), f"sample {i} positions"
        assert pos[a:b].tolist() == list(range(b - a)), "pad positions continue the sample's count"
        assert labels[a : a + L].tolist() == expected_targets(s, ignore).tolist(), f"sample {i} targets"
        owner[a : a + L] = i
    # loss mask, boundaries
    assert (batch.loss_mask.numpy() == (labels != ignore)).all()
    scored = np.flatnonzero(labels != ignore)
    assert (owner[scored] >= 0).all(), "pad slot scored"
    assert (scored + 1 < T).all() and (owner[scored + 1] == owner[scored]).all(), "target crosses a boundary"
    # the target of position t is the (label of the) token at t+1 of the same sample when no labels/mask
    for i, s in enumerate(samples):
        if s.get("labels") is None and s.get("loss_mask") is None:
            a, L = int(cup[i]), int(lens[i])
            assert labels[a : a + L - 1].tolist() == ids[a + 1 : a + L].tolist()


# --------------------------------------------------------------------------
# build_thd_batch properties
# --------------------------------------------------------------------------
@SETTINGS
@given(build_case())
def test_build_contract(case):
    samples, kw = case
    batch = build_thd_batch(samples, **kw)
    check_batch(batch, samples, kw)


@SETTINGS
@given(build_case())
def test_pack_scores_exactly_what_each_sample_scores_alone(case):
    samples, kw = case
    ignore = kw["ignore_index"]
    batch = build_thd_batch(samples, **kw)
    cup = batch.cu_seqlens_padded.tolist()
    total = 0
    for i, s in enumerate(samples):
        alone = build_thd_batch([s], **kw)
        L = len(s["input_ids"])
        seg = batch.labels[cup[i] : cup[i + 1]]
        assert seg.tolist() == alone.labels.tolist(), f"sample {i} scored differently in the pack"
        assert batch.input_ids[cup[i] : cup[i + 1]].tolist() == alone.input_ids.tolist()
        assert batch.position_ids[cup[i] : cup[i + 1]].tolist() == alone.position_ids.tolist()
        total += int((alone.labels != ignore).sum())
        assert int((seg[:L] != ignore).sum()) == int((alone.labels != ignore).sum())
    assert int(batch.loss_mask.sum()) == total, "pack scores targets no sample scores alone"


@SETTINGS
@given(st.integers(1, 4), st.integers(1, 4), st.booleans(), st.sampled_from([None, 1, 2, 16, 32]))
def test_pad_multiple_is_least_common_multiple(cp, tp, sp, extra):
    m = expected_multiple(cp_size=cp, tp_size=tp, sequence_parallel=sp, pad_multiple=extra)
    batch = build_thd_batch([{"input_ids": [1] * 7}], cp_size=cp, tp_size=tp, sequence_parallel=sp, pad_multiple=extra)
    assert batch.pad_multiple == m
    assert batch.num_padded_tokens == -(-7 // m) * m
    if extra is None:
        assert cp_pad_multiple(cp, tp, sp) == m


def test_cp_pad_multiple_examples():
    assert cp_pad_multiple() == 1
    assert cp_pad_multiple(2) == 4
    assert cp_pad_multiple(4) == 8
    assert cp_pad_multiple(1, 4, True) == 4
    assert cp_pad_multiple(1, 4, False) == 1
    assert cp_pad_multiple(2, 4, True) == 8
    assert cp_pad_multiple(2, 3, True) == 12
    assert cp_pad_multiple(fp8=True) == 16
    assert cp_pad_multiple(fp8="mxfp8") == 32
    assert cp_pad_multiple(4, fp8="fp8") == 16


def test_small_example():
    batch = build_thd_batch(
        [{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9], "labels": [IGNORE, 9]}], cp_size=2, pad_token_id=1
    )
    assert batch.input_ids.tolist() == [5, 6, 7, 1, 8, 9, 1, 1]
    assert batch.labels.tolist() == [6, 7, IGNORE, IGNORE, 9, IGNORE, IGNORE, IGNORE]
    assert batch.position_ids.tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    assert batch.cu_seqlens.tolist() == [0, 3, 5]
    assert batch.cu_seqlens_padded.tolist() == [0, 4, 8]
    assert batch.max_seqlen == 4


def test_loss_mask_example():
    batch = build_thd_batch([{"input_ids": [5, 6, 7, 8], "loss_mask": [1, 0, 1, 1]}])
    # token 6 is not a target, tokens 7 and 8 are; token 5 (the first) never is
    assert batch.labels.tolist() == [IGNORE, 7, 8, IGNORE]


# --------------------------------------------------------------------------
# input formats
# --------------------------------------------------------------------------
def _convert(values, fmt, mask=False):
    """``values`` in format ``fmt``; ``mask=True`` makes a boolean array where the format has one."""
    if mask:
        values = [bool(v) for v in values]
    if fmt == "list":
        return list(values)
    if fmt == "tuple":
        return tuple(values)
    if fmt == "np32":
        return np.asarray(values, dtype=np.bool_ if mask else np.int32)
    if fmt == "np64":
        return np.asarray(values, dtype=np.int64)
    if fmt == "torch":
        return torch.tensor(values, dtype=torch.bool if mask else torch.int64)
    if fmt == "torch2d":
        return torch.tensor([list(values)], dtype=torch.int64)
    if fmt == "np2d":
        return np.asarray([list(values)], dtype=np.int64)
    if fmt == "pa_array":
        return pa.array(list(values), type=pa.bool_() if mask else pa.int64())
    if fmt == "pa_scalar":
        before, after = ([True, False], [True]) if mask else ([0, 1], [2])
        col = pa.array([before, list(values), after], type=pa.list_(pa.bool_() if mask else pa.int32()))
        return col[1]  # a ListScalar whose child array is a slice
    raise AssertionError(fmt)


FORMATS = ["list", "tuple", "np32", "np64", "torch", "torch2d", "np2d", "pa_array", "pa_scalar"]


def _same_batch(a: ThdBatch, b: ThdBatch):
    for name in ("input_ids", "labels", "loss_mask", "position_ids", "cu_seqlens", "cu_seqlens_padded", "seq_lens", "sample_index"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype, name
        assert torch.equal(x, y), name
    assert a.max_seqlen == b.max_seqlen and a.pad_multiple == b.pad_multiple
    assert a.tokens_truncated == b.tokens_truncated


@settings(max_examples=40, deadline=None)
@given(build_case(), st.lists(st.sampled_from(FORMATS), min_size=8, max_size=8))
def test_input_formats_give_identical_batches(case, fmts):
    samples, kw = case
    reference = build_thd_batch(samples, **kw)
    converted = []
    for i, s in enumerate(samples):
        fmt = fmts[i]
        c = {"input_ids": _convert(s["input_ids"], fmt)}
        if "labels" in s:
            c["labels"] = _convert(s["labels"], fmt if fmt != "np32" else "np64")
        if "loss_mask" in s:
            c["loss_mask"] = _convert(s["loss_mask"], fmt, mask=fmt not in ("list", "tuple", "np64", "np2d", "torch2d"))
        converted.append(c)
    _same_batch(build_thd_batch(converted, **kw), reference)
    # every format for every sample at once, too
    for fmt in FORMATS:
        conv = [
            {k: _convert(v, fmt, mask=(k == "loss_mask" and fmt in ("torch", "pa_array", "pa_scalar"))) for k, v in s.items()}
            for s in samples
        ]
        _same_batch(build_thd_batch(conv, **kw), reference)


def test_int32_labels_with_ignore_index():
    a = build_thd_batch([{"input_ids": np.array([3, 4, 5], np.int32), "labels": np.array([-100, 4, 5], np.int32)}])
    b = build_thd_batch([{"input_ids": [3, 4, 5], "labels": [-100, 4, 5]}])
    _same_batch(a, b)


def test_tokenizer_style_2d_tensor():
    ids = torch.tensor([[11, 12, 13, 14]])
    batch = build_thd_batch([{"input_ids": ids, "labels": ids.clone()}, {"input_ids": torch.tensor([[1, 2]])}])
    assert batch.input_ids.tolist() == [11, 12, 13, 14, 1, 2]
    assert batch.seq_lens.tolist() == [4, 2]


def test_datasets_style_rows():
    table = pa.table({"input_ids": [[1, 2, 3], [4, 5]], "labels": [[-100, 2, 3], [4, 5]]})
    rows = [{name: table.column(name)[i] for name in table.column_names} for i in range(table.num_rows)]
    _same_batch(build_thd_batch(rows), build_thd_batch(table.to_pylist()))


def test_inputs_not_modified():
    ids = np.array([1, 2, 3], dtype=np.int64)
    labels = np.array([-100, 2, 3], dtype=np.int64)
    t = torch.tensor([4, 5, 6])
    batch = build_thd_batch([{"input_ids": ids, "labels": labels}, {"input_ids": t}], cp_size=2)
    batch.input_ids[:] = 99
    batch.labels[:] = 99
    assert ids.tolist() == [1, 2, 3] and labels.tolist() == [-100, 2, 3] and t.tolist() == [4, 5, 6]
    single = build_thd_batch([{"input_ids": ids}])
    single.input_ids[:] = 7
    assert ids.tolist() == [1, 2, 3]


def test_sample_index_recorded():
    batch = build_thd_batch([{"input_ids": [1]}, {"input_ids": [2, 3]}], sample_index=[7, 3])
    assert batch.sample_index.dtype == torch.int64 and batch.sample_index.tolist() == [7, 3]


# --------------------------------------------------------------------------
# truncation
# --------------------------------------------------------------------------
@SETTINGS
@given(build_case(), st.integers(1, 60))
def test_max_length_truncation(case, max_length):
    # max_length bounds each sample's padded length: it keeps max_length // m * m tokens (m = pad multiple)
    samples, kw = case
    m = resolve_pad_multiple(kw.get("cp_size", 1), kw.get("tp_size", 1), kw.get("sequence_parallel", False), kw.get("pad_multiple"))
    if max_length < m:
        with pytest.raises(ValueError, match="max_length"):
            build_thd_batch(samples, max_length=max_length, **kw)
        return
    keep = max_length // m * m
    batch = build_thd_batch(samples, max_length=max_length, **kw)
    cut = [{k: v[:keep] for k, v in s.items()} for s in samples]
    expected = build_thd_batch(cut, **kw)
    for name in ("input_ids", "labels", "loss_mask", "position_ids", "cu_seqlens", "cu_seqlens_padded", "seq_lens"):
        assert torch.equal(getattr(batch, name), getattr(expected, name)), name
    assert batch.tokens_truncated == sum(max(0, len(s["input_ids"]) - keep) for s in samples)
    assert int(batch.seq_lens.max()) <= keep
    assert batch.max_seqlen <= max_length
    check_batch(expected, cut, kw)


# --------------------------------------------------------------------------
# conversions
# --------------------------------------------------------------------------
@SETTINGS
@given(build_case())
def test_hf_kwargs(case):
    samples, kw = case
    ignore = kw["ignore_index"]
    batch = build_thd_batch(samples, **kw)
    T = batch.num_padded_tokens
    hf = to_hf_kwargs(batch)
    assert set(hf) == {"input_ids", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k",
                       "seq_idx", "labels"}
    assert torch.equal(hf["seq_idx"], seq_idx(batch)) and hf["seq_idx"].shape == (1, T)
    assert hf["input_ids"].shape == (1, T) and hf["position_ids"].shape == (1, T) and hf["labels"].shape == (1, T)
    assert torch.equal(hf["input_ids"][0], batch.input_ids)
    assert torch.equal(hf["position_ids"][0], batch.position_ids)
    assert torch.equal(hf["cu_seq_lens_q"], batch.cu_seqlens_padded) and hf["cu_seq_lens_q"].dtype == torch.int32
    assert torch.equal(hf["cu_seq_lens_k"], batch.cu_seqlens_padded)
    assert hf["max_length_q"] == hf["max_length_k"] == batch.max_seqlen
    hl = hf["labels"][0]
    assert hl.dtype == torch.int64
    assert hl[0].item() == ignore
    assert torch.equal(hl[1:], batch.labels[:-1])
    assert torch.equal(hf_labels(batch), hl)
    # HF's causal-LM loss scores logits[t] against labels[t + 1]: simulate it
    shift = hl[1:]
    scored = torch.nonzero(shift != ignore).flatten()
    cup = batch.cu_seqlens_padded.tolist()
    lens = batch.seq_lens.tolist()
    seg = np.searchsorted(np.asarray(cup), scored.numpy(), side="right") - 1
    for t, i in zip(scored.tolist(), seg.tolist()):
        assert cup[i] <= t and t + 1 < cup[i] + lens[i], "HF shift scores across a boundary or a pad"
        assert shift[t] == batch.labels[t]
    assert int((shift != ignore).sum()) == int(batch.loss_mask.sum())
    no_labels = to_hf_kwargs(batch, include_labels=False)
    assert "labels" not in no_labels and set(no_labels) == set(hf) - {"labels"}


@pytest.mark.parametrize("core", megatron_env.packed_seq_params_params())
def test_packed_seq_params(core, monkeypatch):
    megatron_env.import_packed_seq_params(monkeypatch, core)
    batch = build_thd_batch([{"input_ids": [1, 2, 3]}, {"input_ids": [4]}], cp_size=2)
    d = packed_seq_params_dict(batch)
    assert set(d) == {
        "qkv_format",
        "cu_seqlens_q",
        "cu_seqlens_kv",
        "cu_seqlens_q_padded",
        "cu_seqlens_kv_padded",
        "max_seqlen_q",
        "max_seqlen_kv",
        "total_tokens",
    }
    assert d["total_tokens"] == batch.input_ids.numel()  # the stream length: megatron-core's seq_idx
    assert d["qkv_format"] == "thd"
    assert torch.equal(d["cu_seqlens_q"], batch.cu_seqlens) and torch.equal(d["cu_seqlens_kv"], batch.cu_seqlens)
    assert torch.equal(d["cu_seqlens_q_padded"], batch.cu_seqlens_padded)
    assert torch.equal(d["cu_seqlens_kv_padded"], batch.cu_seqlens_padded)
    assert d["max_seqlen_q"] == d["max_seqlen_kv"] == batch.max_seqlen == 4
    params = to_packed_seq_params(batch)
    if core is None:
        assert isinstance(params, dict) and params.keys() == d.keys()
    else:  # megatron-core 0.19.2's has every field, and computes seq_idx from total_tokens
        assert isinstance(params, core.PackedSeqParams) and params.qkv_format == "thd"
        for name, value in d.items():
            assert megatron_env.field(params, name) is value, name
        assert params.seq_idx.tolist() == [[0, 0, 0, 0, 1, 1, 1, 1]]


def test_to_and_pin_memory():
    batch = build_thd_batch([{"input_ids": [1, 2, 3], "labels": [1, IGNORE, 3]}, {"input_ids": [4]}], cp_size=2)
    batch.extras["pixel_values"] = torch.ones(2, 3)
    batch.extras["note"] = "x"
    moved = batch.to("cpu")
    assert isinstance(moved, ThdBatch)
    _same_batch(moved, batch)
    assert torch.equal(moved.extras["pixel_values"], batch.extras["pixel_values"]) and moved.extras["note"] == "x"
    assert moved.max_seqlen == batch.max_seqlen and moved.pad_multiple == batch.pad_multiple
    try:
        pinned = batch.pin_memory()
    except RuntimeError as exc:
        if torch.cuda.is_available():
            raise
        pytest.skip(f"pin_memory unsupported without an accelerator: {exc}")
    _same_batch(pinned, batch)
    assert pinned.input_ids.is_pinned() and pinned.extras["pixel_values"].is_pinned()


# --------------------------------------------------------------------------
# ThdCollator
# --------------------------------------------------------------------------
@SETTINGS
@given(build_case())
def test_collator_without_pack_size(case):
    samples, kw = case
    collate = ThdCollator(**kw)
    out = collate(samples)
    assert isinstance(out, ThdBatch)
    _same_batch(out, build_thd_batch(samples, **kw))


@st.composite
def collate_case(draw):
    samples, kw = draw(build_case())
    m = expected_multiple(**kw)
    pack_size = draw(st.integers(m, 120))
    overflow = draw(st.sampled_from(["error", "truncate", "split", "drop"]))
    limit = pack_size // m * m
    if overflow == "error":
        samples = [{k: v[:limit] for k, v in s.items()} for s in samples]
    algorithm = draw(st.sampled_from(["bfd", "ffd", "first_fit_shuffle", "sequential"]))
    max_spp = draw(st.one_of(st.none(), st.integers(1, 4)))
    return samples, kw, dict(pack_size=pack_size, overflow=overflow, algorithm=algorithm, max_samples_per_pack=max_spp)


@SETTINGS
@given(collate_case())
def test_collator_with_pack_size(case):
    samples, kw, pkw = case
    out = ThdCollator(**kw, **pkw)(samples)
    assert isinstance(out, PackedBatches) and isinstance(out, list)
    m = expected_multiple(**kw)
    lengths = [len(s["input_ids"]) for s in samples]
    plan = plan_packs(
        lengths, pkw["pack_size"], align=m, overflow=pkw["overflow"], algorithm=pkw["algorithm"],
        max_samples_per_pack=pkw["max_samples_per_pack"],
    )
    assert out.stats == plan.stats
    assert len(out) == len(plan)
    seen: dict[int, list[tuple[int, list[int], list[int]]]] = {}
    for k, batch in enumerate(out):
        assert isinstance(batch, ThdBatch)
        assert batch.num_padded_tokens <= pkw["pack_size"], "collated pack over pack_size"
        assert batch.pad_multiple == m
        if pkw["max_samples_per_pack"]:
            assert batch.num_samples <= pkw["max_samples_per_pack"]
        idx, start, length = plan.pieces(k)
        assert batch.sample_index.tolist() == idx.tolist()
        assert batch.seq_lens.tolist() == length.tolist()
        pieces = [
            {key: v[a : a + n] for key, v in samples[i].items()} for i, a, n in zip(idx.tolist(), start.tolist(), length.tolist())
        ]
        check_batch(batch, pieces, kw, sample_index=idx.tolist())
        cup = batch.cu_seqlens_padded.tolist()
        for j, (i, a, n) in enumerate(zip(idx.tolist(), start.tolist(), length.tolist())):
            seen.setdefault(i, []).append((a, batch.input_ids[cup[j] : cup[j] + n].tolist()))
    # every sample's tokens are in the packs exactly once (split: pieces in order; truncate: a prefix)
    for i, s in enumerate(samples):
        ids = list(s["input_ids"])
        if i in set(plan.dropped.tolist()):
            assert i not in seen
            continue
        got = [t for _, toks in sorted(seen[i]) for t in toks]
        if pkw["overflow"] == "truncate":
            assert got == ids[: len(got)] and len(got) == min(len(ids), pkw["pack_size"] // m * m)
        else:
            assert got == ids
    # nothing scored that a sample alone does not score
    if pkw["overflow"] in ("error", "drop"):
        alone = sum(int(build_thd_batch([s], **kw).loss_mask.sum()) for i, s in enumerate(samples) if i in seen)
        assert sum(int(b.loss_mask.sum()) for b in out) == alone


def test_collator_max_length_and_pack_size():
    samples = [{"input_ids": list(range(1, 21))}, {"input_ids": [1, 2, 3]}]
    out = ThdCollator(pack_size=16, max_length=10)(samples)
    assert out.stats.tokens_truncated == 0  # the collator truncated before planning
    assert sum(b.tokens_truncated for b in out) == 10
    assert sorted(i for b in out for i in b.sample_index.tolist()) == [0, 1]
    assert all(b.num_padded_tokens <= 16 for b in out)


def test_collator_split_example():
    samples = [{"input_ids": list(range(1, 11)), "labels": list(range(1, 11))}]
    out = ThdCollator(pack_size=4, overflow="split", algorithm="sequential")(samples)
    assert [b.input_ids.tolist() for b in out] == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10]]
    assert out.stats.samples_split == 1 and out.stats.num_pieces == 3
    assert [b.sample_index.tolist() for b in out] == [[0], [0], [0]]
