"""Ring attention over thdpack's own CP shards, end to end, on gloo processes: the metadata a rank
gets from ``thdpack.shard(batch, cp_size=, cp_rank=)`` (its tokens, position ids and target labels, the global
``cu_seqlens`` / ``cu_seqlens_padded``, the local layout) is enough to compute the unsharded
attention and loss, not only index-equal to TransformerEngine.

ring-flash-attn (0.1.8: ``zigzag_ring_flash_attn_varlen_forward``) and yunchang call flash-attn's
CUDA varlen kernels; they do not run on CPU. The ring here is a plain reference of the algorithm
TransformerEngine's ``AttnFuncWithCPAndKVP2P`` runs for ``qkv_format="thd"`` and causal masks (the
same rules as ring-flash-attn's zigzag varlen): K/V blocks travel around the ring by p2p
``isend``/``irecv``; at step ``i`` rank ``r`` holds rank ``(r − i) mod cp``'s K/V and computes

- step 0 (its own K/V): causal attention within each document of the local layout;
- ``i <= r`` (K/V of an earlier rank): every query against the *first* half of each document's
  K/V (chunk ``r − i`` precedes both of this rank's chunks; its second chunk follows them), no mask;
- ``i > r`` (K/V of a later rank): the *second* half of each document's queries (chunk
  ``2·cp − 1 − r``) against all of that rank's K/V, no mask;

with the real tokens of each half from ``cu_seqlens`` (TE's ``get_cu_seqlens_on_cp_rank``: pad slots
are neither queries nor keys), merged with an online softmax over log-sum-exps. A tiny random model
(embedding, RoPE on the shard's ``position_ids``, one attention layer, an output head) turns the
outputs into logits and a cross-entropy loss on the shard's target labels, all-reduced over the ring;
both equal each sample run alone through torch's ``scaled_dot_product_attention`` (float64).

The cp=4 packs run on the 4 processes; the cp=2 packs on two 2-process subgroups of the same
processes (as CP groups are, inside data parallelism), so one spawn covers both ring sizes.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import thdpack
from thdpack import build_thd_batch

HEADS, DIM, VOCAB = 2, 8, 64
WORLD = 4


# --------------------------------------------------------------------------- a tiny model


def weights() -> dict:
    """The model's float64 weights, the same in every process."""
    g = torch.Generator().manual_seed(11)
    width = HEADS * DIM
    shapes = {"embed": (VOCAB, width), "wq": (width, width), "wk": (width, width), "wv": (width, width),
              "head": (width, VOCAB)}
    return {k: torch.randn(*s, generator=g, dtype=torch.float64) / math.sqrt(s[0] if k != "embed" else 1)
            for k, s in shapes.items()}


def rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x [t, H, D]`` at ``positions [t]`` (rotate-half convention)."""
    freq = 1.0 / (100.0 ** (torch.arange(0, DIM, 2, dtype=torch.float64) / DIM))
    angle = positions.to(torch.float64)[:, None] * freq[None, :]
    cos, sin = torch.cat([angle.cos()] * 2, -1)[:, None], torch.cat([angle.sin()] * 2, -1)[:, None]
    x1, x2 = x[..., : DIM // 2], x[..., DIM // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def qkv(w: dict, input_ids: torch.Tensor, positions: torch.Tensor):
    """``q, k, v [t, H, D]`` of tokens ``input_ids [t]`` at ``positions [t]``."""
    x = w["embed"][input_ids]
    q, k, v = ((x @ w[n]).view(-1, HEADS, DIM) for n in ("wq", "wk", "wv"))
    return rope(q, positions), rope(k, positions), v


# --------------------------------------------------------------------------- the ring (one rank)


def local_halves(local_cu: torch.Tensor):
    """``(document, offset, half)`` of every local slot, int64 ``[t]``: its sample, its offset in
    the sample's local span (chunk r, then chunk 2·cp − 1 − r) and that span's half length."""
    lengths = local_cu[1:] - local_cu[:-1]
    doc = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    offset = torch.arange(int(local_cu[-1])) - local_cu[:-1][doc]
    return doc, offset, (lengths // 2)[doc]


def real_slots(cu_seqlens, local_cu, cp: int, rank: int) -> torch.Tensor:
    """bool ``[t]``: the slots of rank ``rank``'s layout holding real tokens. Real tokens sit at the
    start of every padded span, so chunk c of a sample of s tokens holds ``clamp(s − c·h, 0, h)``."""
    doc, offset, h = local_halves(local_cu)
    s = (cu_seqlens[1:] - cu_seqlens[:-1]).long()[doc]
    first, second = (s - rank * h).clamp(min=0), (s - (2 * cp - 1 - rank) * h).clamp(min=0)
    return torch.where(offset < h, offset < first, offset - h < second)


def block_attention(q, k, v, allowed):
    """Softmax attention of ``q [tq, H, D]`` over ``k, v [tk, H, D]`` where ``allowed [tq, tk]``;
    ``(out [tq, H, D], lse [tq, H])``, a row with no key gives 0 and lse −inf."""
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(DIM)
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    lse = torch.logsumexp(scores, -1)
    p = torch.where(allowed[None], torch.exp(scores - lse.nan_to_num(neginf=0.0)[..., None]), 0.0)
    return torch.einsum("hqk,khd->qhd", p, v), lse.transpose(0, 1)


def merge(out, lse, rows, block_out, block_lse) -> None:
    """Online softmax: fold a block's ``(out, lse)`` into rows ``rows`` of the running ones."""
    old_out, old_lse = out[rows], lse[rows]
    top = torch.maximum(old_lse, block_lse).nan_to_num(neginf=0.0)
    a, b = torch.exp(old_lse - top), torch.exp(block_lse - top)
    total = a + b
    out[rows] = (old_out * a[..., None] + block_out * b[..., None]) / total.clamp(min=1e-300)[..., None]
    lse[rows] = top + torch.log(total)


def exchange(buffer: torch.Tensor, rank: int, cp: int, group):
    """Send ``buffer`` to the next rank of the ring, receive the previous rank's (TE's order: even
    ranks send first). Returns the receive buffer and the requests."""
    import torch.distributed as dist

    recv = torch.empty_like(buffer)
    nxt, prev = (dist.get_global_rank(group, (rank + d) % cp) for d in (1, -1))
    if rank % 2 == 0:
        requests = [dist.isend(buffer, nxt, group=group), dist.irecv(recv, prev, group=group)]
    else:
        requests = [dist.irecv(recv, prev, group=group), dist.isend(buffer, nxt, group=group)]
    return recv, requests


def ring_attention(q, k, v, shard, group) -> torch.Tensor:
    """The unsharded causal attention output at this rank's tokens (``[t, H, D]``, pad slots 0),
    from the rank's own ``q, k, v`` and the metadata of its shard only."""
    cp, rank = shard.shard.cp_size, shard.shard.cp_rank
    local_cu = shard.shard.local_cu_seqlens_padded.long()
    doc, offset, h = local_halves(local_cu)
    front, back = offset < h, offset >= h
    q_real = real_slots(shard.cu_seqlens, local_cu, cp, rank)
    assert torch.equal(torch.zeros_like(shard.shard.local_seq_lens).index_add_(0, doc, q_real.int()), shard.shard.local_seq_lens)
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=q.dtype)
    kv = torch.cat([k, v], -1)
    for step in range(cp):
        recv, requests = exchange(kv, rank, cp, group) if step + 1 < cp else (None, [])
        kv_real = real_slots(shard.cu_seqlens, local_cu, cp, (rank - step) % cp)
        same_doc = (doc[:, None] == doc[None, :]) & q_real[:, None] & kv_real[None, :]
        if step == 0:  # own K/V: causal within each document
            rows, cols, allowed = slice(None), slice(None), same_doc & (offset[None, :] <= offset[:, None])
        elif step <= rank:  # an earlier rank's K/V: its first chunks only
            rows, cols, allowed = slice(None), front, same_doc[:, front]
        else:  # a later rank's K/V: only this rank's second chunks see it
            rows, cols, allowed = back, slice(None), same_doc[back]
        block_out, block_lse = block_attention(q[rows], kv[cols, :, :DIM], kv[cols, :, DIM:], allowed)
        merge(out, lse, rows, block_out, block_lse)
        for request in requests:
            request.wait()
        kv = recv if recv is not None else kv
    return out


# --------------------------------------------------------------------------- processes


def packs() -> dict:
    """``{name: (cp, ranks of its ring, batch)}``: several documents, alignment padding, 1-token
    documents, a ``pad_to`` tail, lengths already multiples of 2·cp."""
    def samples(lengths, seed):
        g = torch.Generator().manual_seed(seed)
        return [{"input_ids": torch.randint(1, VOCAB, (s,), generator=g)} for s in lengths]

    return {
        "cp4_padded": (4, (0, 1, 2, 3), build_thd_batch(samples([5, 1, 17, 9, 2], 0), cp_size=4, pad_to=80)),
        "cp4_exact": (4, (0, 1, 2, 3), build_thd_batch(samples([16, 8, 1], 1), cp_size=4)),
        "cp2_ranks01": (2, (0, 1), build_thd_batch(samples([7, 1, 12, 3], 2), cp_size=2)),
        "cp2_ranks23": (2, (2, 3), build_thd_batch(samples([30, 1, 2], 3), cp_size=2, pad_to=40)),
    }


def _ring_worker(rank: int, init_file: str, batches: dict, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        groups = {ranks: dist.new_group(list(ranks)) for ranks in ((0, 1, 2, 3), (0, 1), (2, 3))}
        w = weights()
        result = {}
        for name, (cp, ranks, batch) in batches.items():
            if rank not in ranks:
                continue
            group = groups[ranks]
            # every rank of the ring gets the whole batch
            shard = thdpack.shard(batch, cp_size=cp, cp_rank=dist.get_rank(group))
            q, k, v = qkv(w, shard.input_ids, shard.position_ids)
            logits = ring_attention(q, k, v, shard, group).reshape(-1, HEADS * DIM) @ w["head"]
            loss = F.cross_entropy(logits, shard.labels, ignore_index=shard.ignore_index, reduction="sum")
            totals = torch.stack([loss, torch.tensor(float(shard.num_targets), dtype=torch.float64)])
            dist.all_reduce(totals, group=group)
            result[name] = {"logits": logits, "index": shard.shard.partition_indices, "loss": totals[0] / totals[1]}
        torch.save(result, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@torch.no_grad()
def alone(w: dict, ids: torch.Tensor):
    """Logits ``[s, V]`` and summed next-token loss of one sample alone (torch's SDPA, causal)."""
    q, k, v = qkv(w, ids, torch.arange(ids.numel()))
    o = F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (q, k, v)), is_causal=True)
    logits = o[0].transpose(0, 1).reshape(-1, HEADS * DIM) @ w["head"]
    return logits, F.cross_entropy(logits[:-1], ids[1:], reduction="sum")


@pytest.fixture(scope="module")
def ring_results(tmp_path_factory):
    """The ring's per-rank outputs of every pack, one spawn of 4 gloo processes."""
    import torch.multiprocessing as mp

    tmp = tmp_path_factory.mktemp("ring")
    batches = packs()
    mp.spawn(_ring_worker, args=(str(tmp / "init"), batches, str(tmp / "rank")), nprocs=WORLD, join=True)
    per_rank = [torch.load(tmp / f"rank.{r}") for r in range(WORLD)]
    return batches, {name: [per_rank[r][name] for r in ranks] for name, (_, ranks, _) in batches.items()}


@pytest.mark.parametrize("name", ["cp4_padded", "cp4_exact", "cp2_ranks01", "cp2_ranks23"])
def test_ring_attention_on_shards_equals_each_sample_alone(ring_results, name):
    batches, results = ring_results
    cp, _, batch = batches[name]
    assert len(results[name]) == cp
    w = weights()
    got = torch.full((batch.num_padded_tokens, VOCAB), float("nan"), dtype=torch.float64)
    for res in results[name]:
        got[res["index"]] = res["logits"]
    total, count = 0.0, 0
    for start, s in zip(batch.cu_seqlens_padded.tolist(), batch.seq_lens.tolist()):
        ids = batch.input_ids[start:start + s]
        logits, loss = alone(w, ids)
        torch.testing.assert_close(got[start:start + s], logits, rtol=1e-10, atol=1e-10)
        total, count = total + float(loss), count + s - 1
    assert count == batch.num_targets
    for res in results[name]:  # the all-reduced loss, the same on every rank of the ring
        torch.testing.assert_close(res["loss"], torch.tensor(total / count, dtype=torch.float64), rtol=1e-12, atol=0)
    # a wrong assembly is caught: rank r's outputs placed at the next rank's positions
    wrong = got.clone()
    for res, other in zip(results[name], results[name][1:] + results[name][:1]):
        wrong[other["index"]] = res["logits"]
    real = torch.cat([torch.arange(a, a + s) for a, s in zip(batch.cu_seqlens_padded.tolist(), batch.seq_lens.tolist())])
    assert not torch.allclose(wrong[real], got[real])
