"""Ulysses sequence parallelism: ``thdpack.shard(batch, sp_size=, sp_rank=)`` checked against DeepSpeed's own code.

* DeepSpeed's ``UlyssesSPDataLoaderAdapter`` (as TRL / ALST wrap a DataLoader) shards, on every rank
  of a real ``gloo`` group, the same packs exactly as thdpack does: ``input_ids``, ``position_ids``
  and its pre-shifted ``shift_labels`` (our target labels). It refuses a stream ``sp`` does not
  divide, so it is fed the pack built with ``pad_to`` (the builder's own stream padding).
* DeepSpeed's ``UlyssesSPAttentionHF``, registered into a real tiny transformers Qwen3 by its
  ``register_with_transformers`` (kv heads replicated at sp=4), runs over the shards with a
  per-document causal attention that reads only the global ``cu_seq_lens_q`` thdpack hands the
  rank; the gathered attention output and logits equal the unsharded run, each sample's logits equal
  the sample alone (sdpa), and the all-reduced loss equals the per-sample reference. At sp=4 also
  Ulysses × ring: SP groups of 2 inside CP groups of 2, the CP step a plain all-gather attention
  written here with the dual-chunk rule.
* Its constructor's head-count rule equals ``check_head_counts``.
* Hypothesis: the slices concatenated are the padded stream (every token once, in order), and
  with CP each CP rank's slices are its CP shard (``cp_size=``, ``cp_rank=``) of the padded stream.

Workers are forked (``start_method="fork"``, as tests/test_flops.py does): they inherit the imported
torch / transformers / DeepSpeed and the models, which a fresh interpreter per rank would import again.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
ulysses_sp = pytest.importorskip("deepspeed.runtime.sequence_parallel.ulysses_sp")

from hypothesis import example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import thdpack  # noqa: E402
from thdpack import ThdCollator, build_thd_batch  # noqa: E402
from thdpack.demo.models import TINY_TEXT  # noqa: E402
from thdpack.vlm import get_family  # noqa: E402
from thdpack.parallel.ulysses import (  # noqa: E402
    check_head_counts, pad_for_ulysses, ulysses_pad_multiple, ulysses_positions)
from thdpack.integrations import hf_kwargs, to_hf_kwargs

IGNORE = -100
VOCAB = 128
ATTN = "thd_document_causal"  # the core attention after Ulysses' all-to-all (registered below)
LOGIT_ATOL = 1e-4
MODEL_LENGTHS = (23, 9, 31, 14)  # 77 tokens: sp=2 and sp=4 pad the stream


# --------------------------------------------------------------------------- the core attention


def document_causal_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Causal attention inside each document of ``cu_seq_lens_q`` (int32 ``[n+1]`` offsets over the
    whole sequence the call sees; one document without it). ``query`` ``[1, h, S, d]``, ``key`` /
    ``value`` ``[1, h_kv, S, d]`` → ``([1, S, h, d], None)``, transformers' attention interface."""
    length = query.shape[2]
    cu = kwargs.get("cu_seq_lens_q")
    cu = [0, length] if cu is None else cu.tolist()
    assert cu[0] == 0 and cu[-1] == length, (cu, length)  # the offsets cover exactly what the rank holds
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    out = torch.empty_like(query)
    for a, b in zip(cu[:-1], cu[1:]):
        out[:, :, a:b] = F.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b],
                                                        is_causal=True, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


transformers.AttentionInterface.register(ATTN, document_causal_attention)


# --------------------------------------------------------------------------- samples and models


def make_samples(lengths, seed: int) -> list[dict]:
    """Samples of ``lengths`` with a prompt (label -100) and a loss mask on some."""
    rng = np.random.default_rng(seed)
    out = []
    for i, n in enumerate(lengths):
        ids = rng.integers(1, VOCAB, size=int(n))
        labels = ids.copy()
        labels[: int(n) // 3] = IGNORE
        sample = {"input_ids": ids, "labels": labels}
        if i % 3 == 2:
            sample["loss_mask"] = rng.integers(0, 2, size=int(n))
        out.append(sample)
    return out


@functools.lru_cache(maxsize=None)
def tiny_qwen3(attn: str) -> torch.nn.Module:
    """The 2-layer random Qwen3 of tests/test_equivalence.py (GQA 4/2 heads), fp32, eval mode."""
    config = transformers.Qwen3Config(vocab_size=VOCAB, **TINY_TEXT, max_position_embeddings=512,
                                      initializer_range=0.2, attn_implementation=attn)
    torch.manual_seed(1234)
    model = transformers.Qwen3ForCausalLM(config).to(torch.float32).eval()
    assert model.config._attn_implementation == attn
    return model


def hf_labels(sample) -> torch.Tensor:
    """The sample's own HF labels (unshifted), as one trains on it alone; no thdpack."""
    labels = torch.as_tensor(sample["labels"]).clone()
    if "loss_mask" in sample:
        labels[torch.as_tensor(sample["loss_mask"]) == 0] = IGNORE
    return labels


@torch.no_grad()
def run_model(model, **kwargs):
    """``(output, logits [S, V], layer-0 attention output [S, hidden])`` of one forward."""
    seen = {}

    def keep(module, args, out):  # returns None: the output is left as it is
        seen.setdefault("a", out[0])

    hook = model.model.layers[0].self_attn.register_forward_hook(keep)
    try:
        out = model(**kwargs, use_cache=False)
    finally:
        hook.remove()
    return out, out.logits[0], seen["a"][0]


def real_tokens(x: torch.Tensor, cu_seqlens_padded, lengths=MODEL_LENGTHS) -> torch.Tensor:
    """The rows of stream ``x`` ``[S, ...]`` holding real tokens, sample after sample."""
    return torch.cat([x[a:a + n] for a, n in zip(cu_seqlens_padded[:-1].tolist(), lengths)])




@pytest.fixture(scope="module")
def references():
    """The pack of :data:`MODEL_LENGTHS` run whole (padded to a multiple of 4) and every sample alone."""
    samples = make_samples(MODEL_LENGTHS, seed=7)
    model, sdpa = tiny_qwen3(ATTN), tiny_qwen3("sdpa")
    whole = build_thd_batch(samples, pad_to=80)
    _, logits, attn = run_model(model, **to_hf_kwargs(whole, include_labels=False))
    alone, ce = [], []
    for s in samples:
        _, out, _ = run_model(sdpa, input_ids=torch.as_tensor(s["input_ids"])[None])
        alone.append(out)
        ce.append(F.cross_entropy(out[:-1], hf_labels(s)[1:], ignore_index=IGNORE, reduction="none"))
    alone = torch.cat(alone)
    loss = torch.cat(ce).sum() / sum(int((hf_labels(s)[1:] != IGNORE).sum()) for s in samples)
    # the reference attention is per sample: the whole pack run with it gives each sample alone (sdpa)
    torch.testing.assert_close(real_tokens(logits, whole.cu_seqlens_padded), alone, rtol=0, atol=LOGIT_ATOL)
    return dict(samples=samples, alone=alone, loss=loss, logits=real_tokens(logits, whole.cu_seqlens_padded),
                attn=real_tokens(attn, whole.cu_seqlens_padded))


# --------------------------------------------------------------------------- gloo workers (forked)


def _init_gloo(rank: int, world: int, init_file: str) -> None:
    """torch.distributed (gloo) and deepspeed.comm over it, one thread per rank."""
    import sys

    import deepspeed.comm as ds_comm
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    # DeepSpeed compiles its CPU shared-memory all-reduce op on first use (minutes, a C++ build); without
    # it deepspeed.comm runs every collective through torch.distributed, which is what these tests use
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    ds_comm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)


# rank j's pack: T = 24, 23, 22, 21, each padded to 24: the adapter all-gathers every rank's batch, and
# gloo's all_gather takes equal sizes only
ADAPTER_LENGTHS = [(11, 5, 8), (7, 3, 13), (16, 6), (1, 2, 3, 4, 5, 6)]


def _check_adapter(rank: int, world: int, group) -> None:
    """DeepSpeed's adapter over every rank's pack (one per rank, as a DataLoader gives them) hands this
    rank, pack after pack, the slices thdpack.shard gives it."""
    packs = [make_samples(lengths, seed=100 + j) for j, lengths in enumerate(ADAPTER_LENGTHS[:world])]
    mine = build_thd_batch(packs[rank])
    padded = -(-mine.num_padded_tokens // world) * world
    fed = build_thd_batch(packs[rank], pad_to=padded)  # the builder's own tail padding (the adapter does none)
    item = {"input_ids": fed.input_ids[None], "position_ids": fed.position_ids[None], "labels": hf_kwargs.hf_labels(fed)[None]}
    adapter = ulysses_sp.UlyssesSPDataLoaderAdapter([item], sp_rank=rank, sp_group=group, sp_world_size=world,
                                                    device="cpu")
    for j, samples in enumerate(packs):
        got = next(adapter)
        ours = thdpack.shard(build_thd_batch(samples), sp_size=world, sp_rank=rank)
        assert sorted(got) == ["input_ids", "position_ids", "shift_labels"], sorted(got)
        assert torch.equal(got["input_ids"][0], ours.input_ids), (j, got["input_ids"], ours.input_ids)
        assert torch.equal(got["position_ids"][0], ours.position_ids), (j, got["position_ids"], ours.position_ids)
        assert torch.equal(got["shift_labels"][0], ours.labels), (j, got["shift_labels"], ours.labels)
        assert torch.equal(to_hf_kwargs(ours)["shift_labels"][0], ours.labels)


def _check_head_rule(world: int, group) -> None:
    """check_head_counts accepts exactly the head counts DeepSpeed's UlyssesSPAttentionHF accepts."""
    for heads in range(1, 17):
        for kv in (k for k in range(1, heads + 1) if heads % k == 0):
            try:
                ulysses_sp.UlyssesSPAttentionHF(None, 1, heads, 4, kv, 1, group, seq_length_is_variable=True)
                theirs = True
            except ValueError:
                theirs = False
            try:
                check_head_counts(world, heads, kv)
                ours = True
            except ValueError:
                ours = False
            assert ours == theirs, (world, heads, kv, ours, theirs)


def _all_gather(x: torch.Tensor, group) -> list[torch.Tensor]:
    import torch.distributed as dist

    out = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, x.contiguous(), group=group)
    return out


def _global_loss(shard, logits: torch.Tensor, group=None) -> torch.Tensor:
    """The mean CE over every rank's targets: each rank's sum and count, all-reduced."""
    import torch.distributed as dist

    totals = torch.stack([F.cross_entropy(logits, shard.labels, ignore_index=IGNORE, reduction="sum"),
                          torch.tensor(float(shard.num_targets))])
    dist.all_reduce(totals, group=group)
    return totals[0] / totals[1]


def _check_model(rank: int, world: int, refs: dict) -> None:
    """A tiny Qwen3 with DeepSpeed's Ulysses attention (register_with_transformers, as ALST does) over
    this rank's ThdCollator shard (rank from the SP group) equals the unsharded run and each sample alone."""
    model = tiny_qwen3(ATTN)
    mpu = ulysses_sp.UlyssesSPAttentionHF.register_with_transformers(
        model, ATTN, sequence_parallel_size=world, micro_batch_size=1, seq_length_is_variable=True)
    group = mpu.get_sequence_parallel_group()
    shard = ThdCollator(ulysses_sp_size=world, sp_group=group)(refs["samples"])
    assert (shard.shard.sp_size, shard.shard.sp_rank) == (world, rank)
    out, logits, attn = run_model(model, **to_hf_kwargs(shard))  # labels + shift_labels: HF's loss on them
    if shard.num_targets:  # HF's loss of the rank (a mean over its targets) is the CE of our targets
        local = F.cross_entropy(logits, shard.labels, ignore_index=IGNORE)
        torch.testing.assert_close(out.loss, local, rtol=1e-6, atol=1e-6)
    cu = shard.cu_seqlens_padded
    full_logits, full_attn = torch.cat(_all_gather(logits, group)), torch.cat(_all_gather(attn, group))
    torch.testing.assert_close(real_tokens(full_attn, cu), refs["attn"], rtol=0, atol=1e-5)
    torch.testing.assert_close(real_tokens(full_logits, cu), refs["logits"], rtol=0, atol=LOGIT_ATOL)
    torch.testing.assert_close(real_tokens(full_logits, cu), refs["alone"], rtol=0, atol=LOGIT_ATOL)
    torch.testing.assert_close(_global_loss(shard, logits, group), refs["loss"], rtol=1e-5, atol=1e-6)


def _dual_chunk_positions(cu: list[int], cp: int, cp_rank: int) -> torch.Tensor:
    """Stream positions of CP rank ``cp_rank``: per sample chunk r, then chunk 2·cp−1−r (TE's rule, written here)."""
    out = []
    for a, b in zip(cu[:-1], cu[1:]):
        h = (b - a) // (2 * cp)
        for c in (cp_rank, 2 * cp - 1 - cp_rank):
            out += range(a + c * h, a + (c + 1) * h)
    return torch.tensor(out, dtype=torch.int64)


def _all_gather_cp_attention(shard, cp_group):
    """The CP step under Ulysses: the rank's queries (its CP shard, after the SP all-to-all) attend to
    the whole stream's keys, all-gathered over the CP group and put back by the dual-chunk rule,
    causally inside each document of the global ``cu_seqlens_padded`` (what ring attention computes)."""
    cu = shard.cu_seqlens_padded.tolist()
    cp, total = shard.shard.cp_size, cu[-1]
    pos = torch.cat([_dual_chunk_positions(cu, cp, c) for c in range(cp)])
    doc = torch.searchsorted(shard.cu_seqlens_padded, torch.arange(total), right=True) - 1

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        length = query.shape[2]
        cu_local = kwargs["cu_seq_lens_q"]  # what to_hf_kwargs handed the model: the CP rank's layout
        assert torch.equal(cu_local * cp, shard.cu_seqlens_padded) and int(cu_local[-1]) == length == total // cp
        q_pos = _dual_chunk_positions(cu, cp, shard.shard.cp_rank)
        k_all, v_all = (torch.empty(*x.shape[:2], total, x.shape[3]) for x in (key, value))
        k_all[:, :, pos], v_all[:, :, pos] = torch.cat(_all_gather(key, cp_group), 2), torch.cat(_all_gather(value, cp_group), 2)
        groups = query.shape[1] // key.shape[1]
        allowed = (doc[q_pos][:, None] == doc[None, :]) & (torch.arange(total)[None, :] <= q_pos[:, None])
        out = F.scaled_dot_product_attention(query, k_all.repeat_interleave(groups, 1),
                                             v_all.repeat_interleave(groups, 1), attn_mask=allowed, scale=scaling)
        return out.transpose(1, 2).contiguous(), None

    return attention


def _check_ulysses_ring(rank: int, refs: dict) -> None:
    """Ulysses x ring on 4 ranks (CP outer, SP inner: SP groups {0,1}, {2,3}): DeepSpeed's
    UlyssesSPAttentionHF over each SP group, the CP attention above across CP groups {0,2}, {1,3}."""
    import torch.distributed as dist
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    cp = sp = 2
    cp_rank, sp_rank = divmod(rank, sp)
    sp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    cp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    collate = ThdCollator(cp_size=cp, cp_group=cp_groups[sp_rank], ulysses_sp_size=sp, sp_group=sp_groups[cp_rank])
    shard = collate(refs["samples"])
    assert (shard.shard.cp_rank, shard.shard.sp_rank) == (cp_rank, sp_rank)
    length = shard.num_padded_tokens
    cp_positions = _dual_chunk_positions(shard.cu_seqlens_padded.tolist(), cp, cp_rank)
    assert torch.equal(shard.shard.partition_indices, cp_positions[sp_rank * length:(sp_rank + 1) * length])
    uattn = ulysses_sp.UlyssesSPAttentionHF(_all_gather_cp_attention(shard, cp_groups[sp_rank]), 1, 4, 16, 2, 2,
                                            sp_groups[cp_rank], seq_length_is_variable=True)
    ALL_ATTENTION_FUNCTIONS[ATTN] = lambda module, q, k, v, mask, *a, **kw: uattn(module, q, k, v, None, *a, **kw)
    _, logits, attn = run_model(tiny_qwen3(ATTN), **to_hf_kwargs(shard, include_labels=False))
    where = torch.cat(_all_gather(shard.shard.partition_indices, None))
    full_logits = torch.empty(int(shard.cu_seqlens_padded[-1]), VOCAB)
    full_attn = torch.empty(int(shard.cu_seqlens_padded[-1]), attn.shape[-1])
    full_logits[where], full_attn[where] = torch.cat(_all_gather(logits, None)), torch.cat(_all_gather(attn, None))
    cu = shard.cu_seqlens_padded
    torch.testing.assert_close(real_tokens(full_attn, cu), refs["attn"], rtol=0, atol=1e-5)
    torch.testing.assert_close(real_tokens(full_logits, cu), refs["alone"], rtol=0, atol=LOGIT_ATOL)
    torch.testing.assert_close(_global_loss(shard, logits), refs["loss"], rtol=1e-5, atol=1e-6)


def _worker(rank: int, world: int, init_file: str, refs: dict) -> None:
    import torch.distributed as dist

    _init_gloo(rank, world, init_file)
    try:
        _check_adapter(rank, world, dist.group.WORLD)
        _check_head_rule(world, dist.group.WORLD)
        _check_model(rank, world, refs)
        if world == 4:
            _check_ulysses_ring(rank, refs)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_ulysses_over_gloo_equals_deepspeed(world, tmp_path, references):
    import torch.multiprocessing as mp

    mp.start_processes(_worker, args=(world, str(tmp_path / "init"), references), nprocs=world, join=True,
                       start_method="fork")


# --------------------------------------------------------------------------- the slices (one process)

FIELDS = ("input_ids", "labels", "loss_mask", "position_ids")


def with_extras(batch, seed: int):
    """``batch`` with two token extras: 3 mRoPE-like rows and a float ``[2, T]`` one."""
    g = torch.Generator().manual_seed(seed)
    t = batch.num_padded_tokens
    batch.token_extras = {"mrope_position_ids": batch.position_ids[None] + torch.tensor([[0], [3], [5]]),
                          "weights": torch.rand(2, t, generator=g).to(torch.bfloat16)}  # numpy has no bfloat16
    return batch


def padded_extras(batch, total: int) -> dict:
    """The token extras of ``batch`` with the tail rule written out: mRoPE rows count on from the last
    slot, other extras get 0."""
    k = total - batch.num_padded_tokens
    mrope, weights = batch.token_extras["mrope_position_ids"], batch.token_extras["weights"]
    return {"mrope_position_ids": torch.cat([mrope, mrope[:, -1:] + torch.arange(1, k + 1)], 1),
            "weights": torch.cat([weights, torch.zeros(2, k, dtype=weights.dtype)], 1)}


@pytest.mark.parametrize("fill", [None, 7])
def test_tail_without_numpy_is_the_same(fill):
    """The tail of a tensor numpy cannot view (bfloat16 here; a device tensor likewise) is the numpy one."""
    from thdpack.parallel.ulysses import _with_tail

    values = torch.arange(30, dtype=torch.int64).reshape(3, 10)
    for first, skip, slots in [(4, 0, 3), (10, 2, 2), (0, 0, 1)]:
        want = _with_tail(values, first, skip, slots, fill)
        got = _with_tail(values.to(torch.bfloat16), first, skip, slots, fill)
        assert got.dtype == torch.bfloat16 and torch.equal(got.to(torch.int64), want), (first, skip, slots)
    assert _with_tail(values, 4, 1, 2, None)[:, -2:].tolist() == [[11, 12], [21, 22], [31, 32]]


@pytest.mark.filterwarnings("ignore:thdpack. a batch of")  # one-token samples have no target
@settings(deadline=None, max_examples=40)
@example(lengths=[1], sp=4, cp=1, pad_multiple=None, extras=True)  # ranks 1..3 all tail: a tail slot skipped
@example(lengths=[3, 1], sp=5, cp=2, pad_multiple=None, extras=True)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=6), sp=st.integers(1, 5),
       cp=st.sampled_from([1, 1, 2, 3]), pad_multiple=st.sampled_from([None, 4]), extras=st.booleans())
def test_slices_are_the_padded_stream(lengths, sp, cp, pad_multiple, extras):
    """Every rank's slice, concatenated in rank order, is the stream padded as the builder pads to
    ``pad_to`` (every token once, in order); with CP, the CP rank's CP shard of it."""
    samples = make_samples(lengths, seed=sum(lengths))
    layout = dict(cp_size=cp, pad_multiple=pad_multiple, pad_token_id=3)
    batch = build_thd_batch(samples, **layout)
    if extras:
        batch = with_extras(batch, len(lengths))
    total = -(-batch.num_padded_tokens // ulysses_pad_multiple(sp, cp, batch.pad_multiple)) * ulysses_pad_multiple(
        sp, cp, batch.pad_multiple)
    assert total % (sp * cp) == 0 and total - batch.num_padded_tokens < sp * cp * batch.pad_multiple
    ref = build_thd_batch(samples, **layout, pad_to=total)  # the builder's own stream padding
    padded = pad_for_ulysses(batch, sp, cp_size=cp, pad_token_id=3)
    for name in FIELDS + ("cu_seqlens", "cu_seqlens_padded", "seq_lens"):
        assert torch.equal(getattr(padded, name), getattr(ref, name)), name
    assert padded.max_seqlen == ref.max_seqlen and padded.cu_seqlens_padded.dtype == torch.int32
    seen = []
    for c in range(cp):
        cp_shard = thdpack.shard(ref, cp_size=cp, cp_rank=c)
        shards = [thdpack.shard(batch, sp_size=sp, sp_rank=r, cp_size=cp, cp_rank=c, pad_token_id=3) for r in range(sp)]
        for name in FIELDS:
            assert torch.equal(torch.cat([getattr(s, name) for s in shards]), getattr(cp_shard, name)), name
        assert torch.equal(torch.cat([s.shard.partition_indices for s in shards]), cp_shard.shard.partition_indices)
        if extras:
            for key, value in padded_extras(batch, total).items():
                assert torch.equal(torch.cat([s.token_extras[key] for s in shards], -1), value[..., cp_shard.shard.partition_indices])
        for r, s in enumerate(shards):
            assert (s.shard.sp_size, s.shard.sp_rank, s.shard.cp_size, s.shard.cp_rank, s.num_padded_tokens) == (sp, r, cp, c, total // (sp * cp))
            assert torch.equal(s.cu_seqlens_padded, ref.cu_seqlens_padded) and torch.equal(s.cu_seqlens, ref.cu_seqlens)
            assert torch.equal(s.shard.local_cu_seqlens_padded, cp_shard.shard.local_cu_seqlens_padded)
            assert torch.equal(s.shard.local_seq_lens, cp_shard.shard.local_seq_lens) and s.max_seqlen == ref.max_seqlen
        seen += [s.shard.partition_indices for s in shards]
    order = torch.cat(seen)
    assert torch.equal(order.sort().values, torch.arange(total))
    if cp == 1:
        assert torch.equal(order, torch.arange(total))


def test_to_hf_kwargs_of_a_shard():
    """What a rank hands its model: its tokens and global positions, the global padded offsets (the
    whole stream attention sees after the all-to-all) and its targets as ``shift_labels``."""
    batch = build_thd_batch([{"input_ids": [1, 2, 3, 4, 5]}, {"input_ids": [6] * 4},
                             {"input_ids": [10, 11, 12, 13, 14]}])  # 14 tokens: sp=4 pads 2
    kw = to_hf_kwargs(thdpack.shard(batch, sp_size=4, sp_rank=3))
    assert kw["input_ids"].tolist() == [[13, 14, 0, 0]]
    assert kw["position_ids"].tolist() == [[3, 4, 5, 6]]  # sample 2's last two tokens, then the tail counting on
    assert kw["cu_seq_lens_q"].tolist() == kw["cu_seq_lens_k"].tolist() == [0, 5, 9, 16]
    assert kw["max_length_q"] == kw["max_length_k"] == 7  # sample 2's span with the tail
    assert kw["shift_labels"].tolist() == kw["labels"].tolist() == [[14, IGNORE, IGNORE, IGNORE]]


def tiny_qwen2_vl_config():
    """A small Qwen2-VL config (image token 120, vision start / end 118 / 119, merge 2)."""
    text = dict(vocab_size=VOCAB, **TINY_TEXT, bos_token_id=None, eos_token_id=None,
                rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0})
    vision = dict(depth=1, embed_dim=32, hidden_size=64, mlp_ratio=2, num_heads=2, in_channels=3, patch_size=2,
                  spatial_merge_size=2, temporal_patch_size=2)
    return transformers.Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=120, video_token_id=121,
                                      vision_start_token_id=118, vision_end_token_id=119)


def test_vlm_shards():
    """A Qwen2-VL pack: mRoPE rows and token types slice like input_ids (the tail as the builder's
    ``pad_to`` pads: text positions counting on), and each rank's vision positions and embedding
    rows pick its tokens out of the whole stream."""
    config = tiny_qwen2_vl_config()
    image = lambda n: [1, 118] + [120] * 4 + [119] + [2] * n  # noqa: E731  a 4x4 patch image (4 tokens)
    samples = [{"input_ids": image(n), "image_grid_thw": [[1, 4, 4]], "pixel_values": torch.zeros(16, 24)}
               for n in (3, 1)] + [{"input_ids": [5, 6, 7]}]
    batch = build_thd_batch(samples, vlm=get_family(config))
    sp = 4  # 21 tokens: a tail of 3
    ref = build_thd_batch(samples, vlm=get_family(config), pad_to=24)
    types = ref.token_extras["mm_token_type_ids"]
    image_row = torch.cumsum((types == 1).long(), 0) - 1
    shards = [thdpack.shard(batch, sp_size=sp, sp_rank=r) for r in range(sp)]
    for key, value in ref.token_extras.items():
        assert torch.equal(torch.cat([s.token_extras[key] for s in shards], -1), value), key
    for s in shards:
        local = s.token_extras["mm_token_type_ids"]
        assert torch.equal(s.extras["vision_token_positions"], s.shard.partition_indices[local != 0])
        assert torch.equal(s.extras["image_embed_index"], image_row[s.shard.partition_indices][local == 1])
        kw = to_hf_kwargs(s)
        assert kw["position_ids"].shape == (4, 1, 6) and torch.equal(kw["pixel_values"], ref.extras["pixel_values"])
    assert torch.equal(torch.cat([s.extras["image_embed_index"] for s in shards]), torch.arange(8))


def _same(got, want) -> None:
    for name in FIELDS + ("cu_seqlens", "cu_seqlens_padded"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    for name in ("partition_indices", "local_cu_seqlens_padded"):
        assert torch.equal(getattr(got.shard, name), getattr(want.shard, name)), name
    assert (got.max_seqlen, got.shard.sp_size, got.shard.sp_rank, got.shard.cp_size, got.shard.cp_rank) == (
        want.max_seqlen, want.shard.sp_size, want.shard.sp_rank, want.shard.cp_size, want.shard.cp_rank)


@pytest.mark.parametrize("layout", [dict(pad_token_id=5), dict(pad_token_id=5, max_length=10),
                                    dict(pad_token_id=5, pad_multiple=4)], ids=["plain", "max_length", "pad_multiple"])
def test_collator_option(layout):
    """ThdCollator(ulysses_sp_size=..., ulysses_rank=...) gives thdpack.shard(sp_size=, sp_rank=) of the batch it would
    build without Ulysses (planned packs too, the tail with its pad_token_id, a max_length cut and a pad
    multiple kept); without a rank the padded whole batch; with CP the CP rank's."""
    samples = make_samples((13, 7, 22, 5, 9), seed=4)
    for plan in ({}, dict(pack_size=32)):
        whole = ThdCollator(**layout, **plan)(samples)
        whole = whole if plan else [whole]
        for r in range(3):
            got = ThdCollator(**layout, **plan, ulysses_sp_size=3, ulysses_rank=r)(samples)
            got = got if plan else [got]
            assert len(got) == len(whole)
            for g, batch in zip(got, whole):
                _same(g, thdpack.shard(batch, sp_size=3, sp_rank=r, pad_token_id=5))
    padded = ThdCollator(**layout, ulysses_sp_size=5)(samples)
    want = pad_for_ulysses(ThdCollator(**layout)(samples), 5, pad_token_id=5)
    assert all(torch.equal(getattr(padded, f), getattr(want, f)) for f in FIELDS + ("cu_seqlens_padded",))
    assert padded.num_padded_tokens % 5 == 0 and padded.input_ids[-1] == 5 and not padded.is_shard
    got = ThdCollator(**layout, cp_size=2, cp_rank=1, ulysses_sp_size=2, ulysses_rank=1)(samples)
    _same(got, thdpack.shard(ThdCollator(**layout, cp_size=2)(samples), sp_size=2, sp_rank=1, cp_size=2, cp_rank=1,
                             pad_token_id=5))


def test_collator_pad_to():
    """A layout pad_to the Ulysses ranks split is kept (static shapes); one they cannot is refused."""
    samples = make_samples((13, 7), seed=5)
    got = ThdCollator(pad_to=24, ulysses_sp_size=4, ulysses_rank=3)(samples)
    assert got.cu_seqlens_padded[-1] == 24 and got.num_padded_tokens == 6
    with pytest.raises(ValueError, match=r"pad_to=30 is not a multiple of 4, which ulysses_sp_size=4 needs"):
        ThdCollator(pad_to=30, ulysses_sp_size=4)


# --------------------------------------------------------------------------- argument errors

_B = build_thd_batch(make_samples((5, 3), seed=0))


_TREE = build_thd_batch([{"input_ids": [5, 6, 7, 8, i], "group": 0} for i in (1, 2, 3)], share_prefix="group",
                        min_prefix_len=2)  # one prefix [5, 6, 7, 8] laid out once, three members after it


@pytest.mark.parametrize("call, error, match", [
    (lambda: thdpack.shard(_B, sp_size=0, sp_rank=0), ValueError, r"sp_size must be an integer >= 1, got 0"),
    (lambda: thdpack.shard(_B, sp_size=2.0, sp_rank=0), ValueError, r"sp_size must be an integer >= 1, got 2.0"),
    (lambda: thdpack.shard(_B, sp_size=True, sp_rank=0), ValueError, r"sp_size must be an integer >= 1, got True"),
    (lambda: thdpack.shard(_B, sp_size=4, sp_rank=4), ValueError,
     r"^sp_rank must be an integer in \[0, 4\), got 4 \(the SP rank\)$"),
    (lambda: thdpack.shard(_B, sp_size=4, sp_rank=-1), ValueError, r"sp_rank must be an integer in \[0, 4\)"),
    (lambda: thdpack.shard(_B, sp_size=2, sp_rank=0, cp_size=0), ValueError, r"cp_size must be an integer >= 1, got 0"),
    (lambda: thdpack.shard(_B, sp_size=2, sp_rank=0, cp_size=2, cp_rank=2), ValueError,
     r"cp_rank must be an integer in \[0, 2\)"),
    (lambda: thdpack.shard(_B, sp_size=2, sp_rank=0, cp_size=2), ValueError,
     r"sample 0 has padded length 5, not a multiple of 2·cp = 4; build the batch with cp_size=2"),
    (lambda: thdpack.shard(_B, sp_size=2, sp_rank=0, pad_token_id=-1), ValueError,
     r"pad_token_id must be an integer >= 0, got -1"),
    (lambda: thdpack.shard(_B, sp_size=4, sp_rank=0, num_heads=6), ValueError,
     r"num_heads=6 is not a multiple of sp_size=4"),
    (lambda: thdpack.shard(_B, sp_size=4, sp_rank=0, num_heads=0), ValueError,
     r"num_heads must be an integer >= 1, got 0"),
    (lambda: thdpack.shard(_B, sp_size=4, sp_rank=0, num_heads=12, num_kv_heads=6), ValueError,
     r"num_kv_heads=6 and sp_size=4: one must divide the other"),
    (lambda: thdpack.shard(_B, sp_size=2, sp_rank=0, num_heads=6, num_kv_heads=4), ValueError,
     r"num_heads=6 is not a multiple of num_kv_heads=4"),
    (lambda: thdpack.shard(to_hf_kwargs(_B), sp_size=2, sp_rank=0), TypeError,
     r"takes a thdpack.ThdBatch .*, got dict"),
    (lambda: thdpack.shard(thdpack.shard(_B, sp_size=2, sp_rank=0), sp_size=2, sp_rank=0), ValueError,
     r"takes a whole batch, got a shard \(cp_size=1, sp_size=2\)"),
    (lambda: thdpack.shard(thdpack.shard(build_thd_batch([{"input_ids": [1] * 4}], cp_size=2), cp_size=2, cp_rank=0),
                           sp_size=2, sp_rank=0),
     ValueError, r"takes a whole batch, got a shard \(cp_size=2, sp_size=1\)"),
    (lambda: thdpack.shard(thdpack.shard(_B, sp_size=2, sp_rank=1), cp_size=2, cp_rank=0), ValueError,
     r"batch is a Ulysses shard \(sp_size=2, rank 1\)"),
    (lambda: pad_for_ulysses(_B, 0), ValueError, r"sp_size must be an integer >= 1, got 0"),
    (lambda: thdpack.shard(_TREE, sp_size=2, sp_rank=0), ValueError,
     r"shard\(batch, sp_size=, sp_rank=\) cannot shard a shared-prefix batch .*build it with share_prefix=None under Ulysses"),
    (lambda: pad_for_ulysses(_TREE, 2), ValueError, r"pad_for_ulysses cannot shard a shared-prefix batch"),
    (lambda: pad_for_ulysses(_B, 2, cp_size=2), ValueError, r"sample 0 has padded length 5, not a multiple of 2·cp = 4"),
    (lambda: ulysses_positions([0, 5, 7], 4, 0), ValueError,
     r"cu_seqlens_padded ends at 7, not a multiple of cp·sp = 4; pad the stream first"),
    (lambda: ulysses_positions([1, 5], 2, 0), ValueError, r"cu_seqlens_padded must be 1-D .* starting at 1"),
    (lambda: ulysses_positions([0, 6, 8], 2, 0, cp_size=2), ValueError, r"sample 0 has padded length 6, not a multiple"),
    (lambda: ulysses_positions([0.0, 4.0], 2, 0), ValueError, r"cu_seqlens_padded must hold integers"),
    (lambda: ThdCollator(ulysses_sp_size=0), ValueError, r"ulysses_sp_size must be an integer >= 1, got 0"),
    (lambda: ThdCollator(ulysses_sp_size=2, ulysses_rank=2), ValueError, r"ulysses_rank must be an integer in \[0, 2\)"),
    (lambda: ThdCollator(ulysses_sp_size=2, ulysses_rank=0, cp_size=2), ValueError,
     r"got a ulysses_rank but no cp_rank= or cp_group="),
    (lambda: ThdCollator(ulysses_sp_size=2, cp_size=2, cp_rank=0), ValueError,
     r"got a cp_rank but no ulysses_rank= or sp_group="),
])
def test_argument_errors(call, error, match):
    with pytest.raises(error, match=match) as info:
        call()
    assert "\n" not in str(info.value)


def test_head_counts_accepted():
    for sp, heads, kv in [(4, 8, 8), (4, 8, 4), (4, 8, 2), (4, 8, 1), (8, 8, 2), (2, 4, None), (3, None, 6)]:
        check_head_counts(sp, heads, kv)
        thdpack.shard(_B, sp_size=sp, sp_rank=0, num_heads=heads, num_kv_heads=kv)


NUMBER_ARGS = {  # argument -> a call taking the value there
    "sp_size": lambda v: thdpack.shard(_B, sp_size=v, sp_rank=0),
    "sp_rank": lambda v: thdpack.shard(_B, sp_size=2, sp_rank=v),
    "cp_size": lambda v: thdpack.shard(_B, sp_size=2, sp_rank=0, cp_size=v),
    "cp_rank": lambda v: thdpack.shard(_B, sp_size=2, sp_rank=0, cp_size=2, cp_rank=v),
    "pad_token_id": lambda v: thdpack.shard(_B, sp_size=2, sp_rank=0, pad_token_id=v),
    "num_heads": lambda v: thdpack.shard(_B, sp_size=2, sp_rank=0, num_heads=v),
    "num_kv_heads": lambda v: thdpack.shard(_B, sp_size=2, sp_rank=0, num_kv_heads=v),
    "ulysses_sp_size": lambda v: ThdCollator(ulysses_sp_size=v),
    "ulysses_rank": lambda v: ThdCollator(ulysses_sp_size=2, ulysses_rank=v),
}


@pytest.mark.parametrize("name", sorted(NUMBER_ARGS))
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1, 2.5, True, 2**63, "2"], ids=repr)
def test_number_rule(name, value):
    """Every size, rank and count: NaN, inf, negatives, fractions, bools, past int64 and strings are one
    ValueError naming the argument."""
    with pytest.raises(ValueError, match=rf"^{name} must be an integer") as info:
        NUMBER_ARGS[name](value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("cp", [1, 2])
@pytest.mark.parametrize("sp", [2, 3, 4])
def test_flops_of_the_ulysses_ranks_add_up_to_the_pack(cp, sp):
    """FlopsAccumulator on each SP (x CP) rank's shard: real tokens of its slice, 1/sp of the attention work of
    its CP rank's shard, the samples once; summed over the ranks, the whole pack's counts (not sp times them)."""
    from thdpack.flops import FlopsAccumulator

    samples = [{"input_ids": list(range(3, 3 + n))} for n in (5, 1, 17, 9, 2, 30)]
    batch = build_thd_batch(samples, cp_size=cp)
    whole = FlopsAccumulator().add(batch)
    ranks = [FlopsAccumulator().add(thdpack.shard(batch, sp_size=sp, sp_rank=r, cp_size=cp, cp_rank=c))
             for c in range(cp) for r in range(sp)]
    for name in ("samples", "tokens", "seqlen_squared_sum"):
        assert sum(getattr(a, name) for a in ranks) == getattr(whole, name), name
    shares = [a.seqlen_squared_sum for a in ranks]
    assert max(shares) - min(shares) <= max(1, whole.seqlen_squared_sum // (cp * sp))  # heads split evenly
