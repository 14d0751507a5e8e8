"""``to_packed_seq_params(ThdBatch)`` sets ``total_tokens`` (issue 13 §2), so that megatron-core
(>= 0.19) computes ``seq_idx`` and its Mamba mixer scans each sample on its own; and it leaves
``cu_seqlens_q/kv_padded`` None when no sample is padded, as Megatron-Bridge does (issue 20 §6:
TransformerEngine picks a slower kernel when they are set).

Checked with megatron-core 0.19.2's own ``PackedSeqParams`` (tests/megatron_env.py unpacks the
wheel; tests/megatron_run.py imports it in a subprocess; a test id ending ``-missing`` says it
was skipped for want of the wheel), and with a ``PackedSeqParams`` of 0.16.x's fields (no
``total_tokens``), the newest megatron-core for Python 3.11.
"""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest
import torch

import megatron_env  # tests/megatron_env.py

import thdpack
from thdpack import build_thd_batch
from thdpack.integrations import packed_seq_params_dict, to_packed_seq_params

SAMPLES = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18], [19]]


def layout_of(params: dict) -> list[int]:
    """The stream layout megatron-core reads: ``cu_seqlens_q_padded``, else ``cu_seqlens_q``."""
    padded = params["cu_seqlens_q_padded"]
    return (padded if padded is not None else params["cu_seqlens_q"]).tolist()


def sample_of_each_slot(cu_padded: list[int]) -> list[int]:
    """int ``[T]``: which sample each stream slot belongs to (its padding included)."""
    return [i for i in range(len(cu_padded) - 1) for _ in range(cu_padded[i + 1] - cu_padded[i])]


@pytest.mark.parametrize("cp_size", [1, 2])
def test_total_tokens_is_the_global_stream_length(cp_size):
    batch = build_thd_batch([{"input_ids": s} for s in SAMPLES], cp_size=cp_size)
    stream = int(batch.input_ids.numel())
    d = packed_seq_params_dict(batch)
    assert d["total_tokens"] == stream == int(batch.cu_seqlens_padded[-1])
    assert len(sample_of_each_slot(layout_of(d))) == d["total_tokens"]  # seq_idx, by its documented rule
    if cp_size > 1:
        for rank in range(cp_size):  # a shard keeps the global metadata
            assert packed_seq_params_dict(thdpack.shard(batch, cp_size=cp_size, cp_rank=rank))["total_tokens"] == stream


@pytest.mark.parametrize("site", [megatron_env.site_param(megatron_env.CORE_ID)])
def test_megatron_core_019_seq_idx_marks_each_sample(site):
    """megatron-core 0.19.2's PackedSeqParams, made by thdpack: seq_idx[0, t] is the sample of slot t."""
    tasks = [{"kind": "thdpack_packed_seq_params", "samples": SAMPLES, "cp_size": cp, "cp_rank": rank}
             for cp, rank in ((1, None), (2, None), (2, 1))]
    for task, got in zip(tasks, megatron_env.run(site, tasks)):
        full = build_thd_batch([{"input_ids": s} for s in SAMPLES], cp_size=task["cp_size"])
        assert got["total_tokens"] == int(full.input_ids.numel())
        # cp 1: no sample padded, so no padded fields; seq_idx is the same, from cu_seqlens_q
        want_padded = full.cu_seqlens_padded.tolist() if task["cp_size"] > 1 else None
        assert got["cu_seqlens_q_padded"] == want_padded, task
        assert got["seq_idx"] == [sample_of_each_slot(full.cu_seqlens_padded.tolist())], task


@pytest.mark.parametrize(
    "lengths,kw,layout_padded,padded",
    [
        ([5, 2, 7, 1], {}, False, False),
        ([5, 2, 7, 1], {"pad_multiple": 8}, True, True),
        ([5, 2, 7, 1], {"cp_size": 2}, True, True),
        # every length already a multiple of 2·cp: equal layouts, but CP keeps the fields (megatron-core's
        # CP partitioning reads cu_seqlens_q_padded unconditionally; Bridge sets them for pad_seq_to_mult > 1)
        ([4, 8, 12], {"cp_size": 2}, False, True),
        ([4, 8, 12], {"pad_multiple": 4}, False, True),
        ([4, 8, 12], {"cp_size": 2, "pad_to": 32}, True, True),  # only the last sample padded, to pad_to
        ([5, 2, 7, 1], {"pad_to": 16}, True, True),
    ],
)
@pytest.mark.parametrize("core", megatron_env.packed_seq_params_params())
def test_padded_fields_only_with_an_alignment_or_a_padded_sample(lengths, kw, layout_padded, padded, core,
                                                                 monkeypatch):
    megatron_env.import_packed_seq_params(monkeypatch, core)
    batch = build_thd_batch([{"input_ids": list(range(3, 3 + n))} for n in lengths], **kw)
    assert torch.equal(batch.cu_seqlens_padded, batch.cu_seqlens) != layout_padded
    views = [packed_seq_params_dict(batch)]
    if kw.get("cp_size", 1) > 1:
        views += [packed_seq_params_dict(thdpack.shard(batch, cp_size=kw["cp_size"], cp_rank=r))
                  for r in range(kw["cp_size"])]
    for d in views:
        for name in ("cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
            if padded:
                assert torch.equal(d[name], batch.cu_seqlens_padded), name
            else:
                assert d[name] is None, name
        assert layout_of(d) == batch.cu_seqlens_padded.tolist()  # what megatron-core reads: the layout
        assert torch.equal(d["cu_seqlens_q"], batch.cu_seqlens) and d["total_tokens"] == batch.input_ids.numel()
    params = to_packed_seq_params(batch)
    assert isinstance(params, dict) if core is None else isinstance(params, core.PackedSeqParams)
    assert (megatron_env.field(params, "cu_seqlens_q_padded") is not None) == padded


def test_megatron_core_016_without_total_tokens(monkeypatch):
    """An installed PackedSeqParams without ``total_tokens`` (megatron-core 0.16.x's fields) still
    gets every field it has."""
    fields_016 = ["qkv_format", "cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded",
                  "max_seqlen_q", "max_seqlen_kv", "local_cp_size", "cp_group"]
    params_016 = dataclasses.make_dataclass("PackedSeqParams", [(f, object, None) for f in fields_016])
    module = types.ModuleType("megatron.core.packed_seq_params")
    module.PackedSeqParams = params_016
    for name, mod in (("megatron", types.ModuleType("megatron")), ("megatron.core", types.ModuleType("megatron.core")),
                      ("megatron.core.packed_seq_params", module)):
        monkeypatch.setitem(sys.modules, name, mod)
    batch = build_thd_batch([{"input_ids": s} for s in SAMPLES], cp_size=2)
    params = to_packed_seq_params(batch)
    assert isinstance(params, params_016)
    assert torch.equal(params.cu_seqlens_q_padded, batch.cu_seqlens_padded) and params.qkv_format == "thd"
