"""PyTorch native context parallel: thdpack's rearrange / restore indices for a pack
(:mod:`thdpack.parallel.torch_cp`), checked against torch's own load balancers, their docstrings
and torch's CP sharding run on two gloo processes.

What torch 2.13 does (``torch.distributed.tensor.experimental._context_parallel``):

- ``_PerDocumentHeadTailLoadBalancer._generate_indices`` emits, per document, each rank's head
  and tail chunk, document after document (document-major). Its docstring draws the rank-major
  layout (rank 0's chunks of every document, then rank 1's). torch shards the rearranged buffer
  in contiguous pieces, so with its own indices rank 0 gets the first documents whole
  (:func:`test_torch_per_document_balancer_is_document_major`).
- ``context_parallel`` (the SDPA path) shards its buffers with the whole-sequence
  ``_HeadTailLoadBalancer`` (one document: thdpack's indices of ``[0, T]``), and its SDPA
  dispatch cannot run on CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` has no
  DTensor sharding strategy (NotImplementedError); only flash / efficient / cuDNN SDPA have ring
  handlers. It has no document mask either (SDPA CP takes no ``attn_mask``): packs need the
  FlexAttention path, which runs on CPU: ``_context_parallel_shard`` of the buffers and the
  ``BlockMask`` with a load balancer, K/V gathered with ``flex_cp_allgather``, and
  ``context_parallel_unshard`` (:func:`test_torch_context_parallel_on_two_gloo_processes`).
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import thdpack
from thdpack import TorchCPLoadBalancer, build_thd_batch, thd_partition_indices, torch_cp_indices

lb = pytest.importorskip("torch.distributed.tensor.experimental._context_parallel._load_balancer")


def torch_per_document(lengths, cp) -> torch.Tensor:
    """torch's ``_PerDocumentHeadTailLoadBalancer`` rearrange indices of one pack, int64 ``[T]``."""
    return lb._PerDocumentHeadTailLoadBalancer([list(lengths)], cp, "cpu")._generate_indices()[0].long()


def cumulative(lengths) -> list[int]:
    return [0, *np.cumsum(lengths, dtype=np.int64).tolist()]


def causal_cost(index: torch.Tensor, cu) -> int:
    """(query, key) pairs of the document-causal mask for the queries ``index``: a query at
    offset o of its document sees o + 1 keys."""
    cu = torch.as_tensor(cu, dtype=torch.int64)
    doc = torch.searchsorted(cu, index, right=True) - 1
    return int((index - cu[doc] + 1).sum())


# --------------------------------------------------------------------------- torch's docstrings


def _docstring_matrices(doc: str) -> list[torch.Tensor]:
    """The 0/1 matrices drawn in a docstring, as bool tensors, in order of appearance."""
    rows = [[int(x) for x in r.split(",")] for r in re.findall(r"\[((?:\s*[01],)+\s*[01])\]", doc)]
    size = len(rows[0])
    return [torch.tensor(rows[i:i + size], dtype=torch.bool) for i in range(0, len(rows), size)]


def document_causal_mask(cu) -> torch.Tensor:
    T = cu[-1]
    doc = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.tensor(np.diff(cu)))
    pos = torch.arange(T)
    return (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])


def test_docstring_example_of_the_per_document_balancer_exactly():
    """torch's docstring: documents of 4, 8, 4 tokens, 2 ranks; its second drawing is the mask with
    the queries rearranged, rank 0's 8 rows above rank 1's. ``mask[rearrange]`` reproduces it."""
    before, after = _docstring_matrices(lb._PerDocumentHeadTailLoadBalancer._generate_indices.__doc__)
    starts = before.int().argmax(1)  # each row's first key: its document's start
    cu = [*torch.unique(starts).tolist(), before.shape[0]]
    assert cu == [0, 4, 12, 16]
    assert torch.equal(before, document_causal_mask(cu))
    rearrange, restore = torch_cp_indices(cu, 2)
    assert torch.equal(document_causal_mask(cu)[rearrange], after)
    assert rearrange.tolist() == [0, 3, 4, 5, 10, 11, 12, 15, 1, 2, 6, 7, 8, 9, 13, 14]
    assert torch.equal(rearrange[restore], torch.arange(16))
    # torch's own indices draw another matrix (and it is not the balance the docstring shows)
    assert not torch.equal(document_causal_mask(cu)[torch_per_document(np.diff(cu), 2)], after)


def test_torch_per_document_balancer_is_document_major():
    """The claim checked on torch's code: its rank-0 piece of a [4, 12] pack is document 0 whole and
    4 tokens of document 1, and costs 26 causal pairs against rank 1's 62; thdpack's pieces cost 44
    each, and hold 2 + 6 tokens of the documents on every rank."""
    lengths, cp = [4, 12], 2
    cu = cumulative(lengths)
    theirs = torch_per_document(lengths, cp).view(cp, -1)
    ours = torch_cp_indices(cu, cp)[0].view(cp, -1)
    assert theirs[0].tolist() == [0, 3, 1, 2, 4, 5, 6, 13]
    assert [causal_cost(p, cu) for p in theirs] == [26, 62]
    assert [causal_cost(p, cu) for p in ours] == [44, 44]
    assert [int((p < 4).sum()) for p in ours] == [2, 2]


def test_one_document_equals_the_head_tail_balancer_of_context_parallel():
    """One document: the whole-sequence ``_HeadTailLoadBalancer`` (what ``context_parallel`` and
    torchtitan's ``headtail`` use) gives the same indices."""
    for T, cp in ((8, 2), (24, 3), (64, 4), (16, 1)):
        want = lb._HeadTailLoadBalancer(T, cp, "cpu")._generate_indices()[0].long()
        rearrange, restore = torch_cp_indices([0, T], cp)
        assert torch.equal(rearrange, want)
        assert torch.equal(restore, lb._HeadTailLoadBalancer(T, cp, "cpu")._generate_indices(restore=True)[0].long())


# --------------------------------------------------------------------------- against torch's chunks


@settings(deadline=None, max_examples=60)
@given(cp=st.integers(1, 4), chunks=st.lists(st.integers(0, 6), min_size=1, max_size=6))
def test_rank_pieces_are_torchs_per_document_chunks(cp, chunks):
    """Rank r's piece of ``x[rearrange]`` is torch's per-document head and tail chunks of rank r,
    document after document, and equals thdpack's dual-chunk partition of that rank; every rank
    does the same causal work; restore undoes rearrange."""
    lengths = [2 * cp * h for h in chunks]
    cu = cumulative(lengths)
    T = cu[-1]
    rearrange, restore = torch_cp_indices(cu, cp)
    assert rearrange.dtype == restore.dtype == torch.int64 and rearrange.shape == restore.shape == (T,)
    assert torch.equal(torch.sort(rearrange).values, torch.arange(T))
    assert torch.equal(rearrange[restore], torch.arange(T)) and torch.equal(restore[rearrange], torch.arange(T))
    theirs = torch_per_document(lengths, cp)  # document-major: [doc d: rank 0 head, tail, rank 1 head, tail, ...]
    for r, piece in enumerate(rearrange.view(cp, -1) if T else [rearrange] * cp):
        torch_chunks = [theirs[a + r * p // cp:a + (r + 1) * p // cp] for a, p in zip(cu, lengths)]
        assert torch.equal(piece, torch.cat(torch_chunks))
        assert torch.equal(piece, thd_partition_indices(cu, cp, r))
    costs = {causal_cost(p, cu) for p in rearrange.view(cp, -1)} if T else {0}
    assert len(costs) == 1


def test_batch_and_torch_device_inputs():
    """A ThdBatch (pad_to tail, a 1-token sample) and its offsets as list / numpy / int32 tensor give
    the same indices; ``x[rearrange]`` in cp pieces is every rank's ``thdpack.shard``; the load
    balancer hands torch ``[1, T]`` rows."""
    samples = [{"input_ids": list(range(1, s + 1))} for s in (5, 1, 9, 3)]
    batch = build_thd_batch(samples, cp_size=2, pad_to=32)
    rearrange, restore = torch_cp_indices(batch, 2)
    for cu in (batch.cu_seqlens_padded, batch.cu_seqlens_padded.tolist(), batch.cu_seqlens_padded.numpy()):
        got = torch_cp_indices(cu, 2)
        assert torch.equal(got[0], rearrange) and torch.equal(got[1], restore)
    for r in range(2):
        shard = thdpack.shard(batch, cp_size=2, cp_rank=r)
        for name in ("input_ids", "labels", "position_ids"):
            assert torch.equal(getattr(batch, name)[rearrange].view(2, -1)[r], getattr(shard, name)), name
    balancer = TorchCPLoadBalancer(batch, 2, device="cpu")
    assert torch.equal(balancer._generate_indices(), rearrange[None])
    assert torch.equal(balancer._generate_indices(restore=True), restore[None])
    assert "cp_size=2" in repr(balancer)


def test_errors_name_the_bad_value():
    samples = [{"input_ids": [1, 2, 3, 4]}, {"input_ids": [5]}]
    with pytest.raises(ValueError, match=r"cp_size must be an integer >= 1, got 0"):
        torch_cp_indices([0, 4], 0)
    with pytest.raises(ValueError, match=r"cp_size must be an integer >= 1, got True"):
        torch_cp_indices([0, 4], True)
    with pytest.raises(ValueError, match=r"cp_size must be an integer >= 1, got '2'"):
        TorchCPLoadBalancer([0, 4], "2")
    with pytest.raises(ValueError, match=r"sample 1 has padded length 2, not a multiple of 2·cp = 4"):
        torch_cp_indices([0, 4, 6], 2)
    with pytest.raises(ValueError, match=r"sample 1 has padded length 1, not a multiple of 2·cp = 4; build the batch"):
        torch_cp_indices(build_thd_batch(samples), 2)
    with pytest.raises(ValueError, match=r"start at 0 and be non-decreasing"):
        torch_cp_indices([0, 8, 4], 2)
    with pytest.raises(ValueError, match=r"cu_seqlens_padded must hold integers"):
        torch_cp_indices([0.0, 4.0], 2)
    with pytest.raises(ValueError, match=r"batch is a CP shard \(cp_size=2, rank 1\)"):
        torch_cp_indices(thdpack.shard(build_thd_batch(samples, cp_size=2), cp_size=2, cp_rank=1), 2)


# --------------------------------------------------------------------------- torch's CP on gloo


def masked_attention(q, k, v, block_mask) -> torch.Tensor:
    """Softmax attention of ``q [1, H, Tq, D]`` over ``k, v [1, H, Tk, D]`` where ``block_mask``'s
    own ``mask_mod`` allows it (evaluated token by token: for a CP shard, the ``mask_mod`` torch
    rewrote to map local query and rearranged key indices to the global ones). flex_attention
    itself is left out: on CPU even its eager path traces with dynamo (~10 s per process)."""
    q_idx = torch.arange(q.shape[2])[:, None]
    kv_idx = torch.arange(k.shape[2])[None, :]
    allowed = block_mask.mask_mod(torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64), q_idx, kv_idx)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    return scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v

CP_T, CP_HEADS, CP_DIM = 256, 2, 8  # the FlexAttention CP mask needs T % (cp · 128) == 0


def _torch_cp_worker(rank: int, init_file: str, batch, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental import _attention as cp_api
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp_impl
    from torch.nn.attention.flex_attention import create_block_mask

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        result = {}
        # 1. context_parallel (SDPA): its buffers sharded by the whole-sequence head-tail rule;
        #    its SDPA dispatch on CPU raises.
        x = torch.arange(CP_T)[None, None, :, None].expand(1, 1, CP_T, 4).double().contiguous()
        with context_parallel(mesh, buffers=[x], buffer_seq_dims=[2]):
            result["context_parallel_shard"] = x[0, 0, :, 0].long().clone()
            try:
                F.scaled_dot_product_attention(x, x, x, is_causal=True)
            except NotImplementedError as e:
                result["sdpa_error"] = str(e)
        # 2. the FlexAttention path with thdpack's balancer: shard, attend, unshard.
        # create_block_mask uncompiled: torch.compile of it costs ~10 s per process on CPU, same result
        cp_impl._compiled_create_block_mask = create_block_mask
        balancer = TorchCPLoadBalancer(batch, 2)
        doc = torch.repeat_interleave(torch.arange(batch.num_samples), batch.seq_lens_padded.long())

        def document_causal(b, h, q, kv):
            return (doc[q] == doc[kv]) & (q >= kv)

        mask = create_block_mask(document_causal, 1, 1, CP_T, CP_T, device="cpu")
        gen = torch.Generator().manual_seed(7)
        q, k, v = (torch.randn(1, CP_HEADS, CP_T, CP_DIM, generator=gen, dtype=torch.float64) for _ in range(3))
        ids, labels, pos = (t[None] for t in (batch.input_ids, batch.labels, batch.position_ids))
        ids, labels, pos, q, k, v, mask = cp_api._context_parallel_shard(
            mesh, [ids, labels, pos, q, k, v, mask], [1, 1, 1, 2, 2, 2, 2], load_balancer=balancer)
        result.update(input_ids=ids[0], labels=labels[0], position_ids=pos[0])
        group = dist.distributed_c10d._get_process_group_name(mesh.get_group())
        k_all, v_all = cp_impl.flex_cp_allgather(k, v, 2, group)
        local = masked_attention(q, k_all, v_all, mask)
        result["local_out"] = local
        (result["out"],) = cp_api.context_parallel_unshard(mesh, [local], [2], load_balancer=balancer)
        torch.save(result, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_torch_context_parallel_on_two_gloo_processes(tmp_path):
    """torch's own CP code on 2 gloo processes: ``_context_parallel_shard`` with
    :class:`TorchCPLoadBalancer` gives every rank its ``thdpack.shard`` tokens, FlexAttention on the
    shards (document-causal ``BlockMask`` sharded by torch, K/V by ``flex_cp_allgather``) unsharded
    by ``context_parallel_unshard`` equals each document's causal SDPA alone. ``context_parallel``
    itself shards by the one-document indices, and its SDPA raises on CPU."""
    import torch.multiprocessing as mp

    samples = [{"input_ids": list(range(1, s + 1))} for s in (37, 1, 90, 60)]
    batch = build_thd_batch(samples, cp_size=2, pad_to=CP_T)
    out = str(tmp_path / "rank")
    mp.spawn(_torch_cp_worker, args=(str(tmp_path / "init"), batch, out), nprocs=2, join=True)
    results = [torch.load(f"{out}.{r}") for r in range(2)]

    whole = torch_cp_indices([0, CP_T], 2)[0].view(2, -1)
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, CP_HEADS, CP_T, CP_DIM, generator=gen, dtype=torch.float64) for _ in range(3))
    for r, res in enumerate(results):
        assert torch.equal(res["context_parallel_shard"], whole[r])
        assert "sdpa_error" in res, "torch's CP SDPA ran on CPU: test its output and update the docs"
        assert "_scaled_dot_product_flash_attention_for_cpu" in res["sdpa_error"]
        shard = thdpack.shard(batch, cp_size=2, cp_rank=r)
        for name in ("input_ids", "labels", "position_ids"):
            assert torch.equal(res[name], getattr(shard, name)), (r, name)
        # rank r's attention output is the global output at its partition indices
        torch.testing.assert_close(res["local_out"], results[0]["out"][:, :, shard.shard.partition_indices])
    for start, s in zip(batch.cu_seqlens_padded.tolist(), batch.seq_lens.tolist()):
        span = slice(start, start + s)
        alone = F.scaled_dot_product_attention(q[:, :, span], k[:, :, span], v[:, :, span], is_causal=True)
        for res in results:
            torch.testing.assert_close(res["out"][:, :, span], alone, rtol=1e-10, atol=1e-10)
    assert math.isfinite(float(results[1]["out"].sum()))
