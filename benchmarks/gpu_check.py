"""GPU checks of thdpack's layouts against the kernels that read them (issue 23 point 8). Run only where
CUDA exists (never in CI); each check that needs a package the machine lacks says so and is skipped.

Checks, each on packs of random lengths with alignment padding, against every sample run alone:

- ``flash_varlen``: flash-attn's ``flash_attn_varlen_func`` on ``cu_seqlens_padded`` / ``max_seqlen``, and on
  the static offsets of ``max_num_seqs`` (zero-length sequences at the end, ``max_seqlen`` = the stream).
- ``te_thd``: TransformerEngine's ``DotProductAttention`` with ``qkv_format="thd"`` (``padding_causal``,
  ``cu_seqlens_q/kv`` and their padded forms); CP with ``cp_comm_type="p2p"`` needs 2+ GPUs (skipped on one).
- ``flex``: FlexAttention on CUDA with ``ThdBatch.block_mask()`` (compiled).
- ``gdn``: a Gated DeltaNet layer (``flash-linear-attention``'s ``chunk_gated_delta_rule``) with
  ``cu_seqlens``: the recurrent state restarts at each sample.
- ``step``: forward + backward time of a small random Qwen3 (transformers) on one pack vs the same
  samples padded to ``[B, S]``, at pack lengths 4k and 16k (packed through flash-attn if installed,
  else FlexAttention's BlockMask, sdpa on CPU; padded through SDPA).

Usage::

    python benchmarks/gpu_check.py --out $OUT/gpu_check.json          # on a GPU machine
    python benchmarks/gpu_check.py --device cpu --quick                 # the same code paths, tiny, on CPU

Exits non-zero when a check that ran found a difference above its tolerance.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import thdpack  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 8, 4, 64


def random_pack(total: int, seed: int, *, align: int = 1, dev="cpu", **layout) -> thdpack.ThdBatch:
    """One pack of about ``total`` tokens of random lengths (a few long, many short, one of 1 token)."""
    rng = np.random.default_rng(seed)
    lengths = []
    while sum(lengths) < total * 0.9:
        lengths.append(int(min(total // 3, max(2, rng.lognormal(np.log(total / 12), 0.9)))))
    lengths.append(1)
    samples = [{"input_ids": rng.integers(3, 1000, n).tolist()} for n in lengths]
    if layout.get("max_num_seqs") == "spare":  # static shapes: room for 3 more sequences, the stream to 1024s
        layout.update(max_num_seqs=len(lengths) + 3, pad_to=-(-sum(-(-n // align) * align for n in lengths) // 1024) * 1024)
    return thdpack.build_thd_batch(samples, pad_multiple=align, **layout).to(dev)


def per_sample(fn, batch, *tensors):
    """``fn(*[t[a:a+s] for t in tensors])`` for every sample, written back at its place in the stream."""
    cu, lens = batch.cu_seqlens_padded.tolist(), batch.seq_lens.tolist()
    out = torch.zeros_like(tensors[0])
    for a, s in zip(cu[:-1], lens):
        out[a:a + s] = fn(*[t[a:a + s] for t in tensors])
    return out


def sdpa_alone(q, k, v):
    """Causal attention of one sample, ``[s, H, D]`` each (GQA by repeating kv heads)."""
    rep = q.shape[1] // k.shape[1]
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)))
    return F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)[0].transpose(0, 1)


def qkv(batch, dtype, dev, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    T = batch.input_ids.numel()
    make = lambda h: torch.randn(T, h, HEAD_DIM, generator=g).to(dev, dtype)  # noqa: E731
    return make(HEADS), make(KV_HEADS), make(KV_HEADS)


def max_diff(a, b, mask) -> float:
    return float((a.float() - b.float())[mask].abs().max())


def attention_case(args, seed: int, dev, **layout):
    """``(batch, q, k, v, reference)``: a bf16 pack of ``args.tokens`` tokens (align 8) and every sample's
    causal attention alone, written at its place in the stream."""
    batch = random_pack(args.tokens, seed, align=8, dev=dev, **layout)
    q, k, v = qkv(batch, torch.bfloat16, dev)
    return batch, q, k, v, per_sample(sdpa_alone, batch, q, k, v)


def check_flash_varlen(args, dev) -> dict:
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError as exc:
        return {"skipped": f"flash_attn not importable ({exc})"}
    diffs = []
    # as built, then static shapes (max_num_seqs): offsets padded with zero-length sequences, max_seqlen the stream
    for layout in ({}, {"max_num_seqs": "spare"}):
        batch, q, k, v, ref = attention_case(args, 1, dev, **layout)
        kw = batch.to_hf_kwargs()
        out = flash_attn_varlen_func(q, k, v, kw["cu_seq_lens_q"], kw["cu_seq_lens_k"], kw["max_length_q"],
                                     kw["max_length_k"], causal=True)
        diffs.append(max_diff(out, ref, _real(batch)))
    return {"max_abs_diff": max(diffs), "static_offsets": int(kw["cu_seq_lens_q"].numel()), "tolerance": 2e-2}


def check_te_thd(args, dev) -> dict:
    try:
        from transformer_engine.pytorch import DotProductAttention
    except ImportError as exc:
        return {"skipped": f"transformer_engine not importable ({exc})"}
    batch, q, k, v, ref = attention_case(args, 2, dev)
    attn = DotProductAttention(HEADS, HEAD_DIM, num_gqa_groups=KV_HEADS, qkv_format="thd",
                               attn_mask_type="padding_causal").to(dev)
    p = batch.packed_seq_params_dict()
    out = attn(q, k, v, cu_seqlens_q=p["cu_seqlens_q"], cu_seqlens_kv=p["cu_seqlens_kv"],
               cu_seqlens_q_padded=p["cu_seqlens_q_padded"], cu_seqlens_kv_padded=p["cu_seqlens_kv_padded"],
               max_seqlen_q=p["max_seqlen_q"], max_seqlen_kv=p["max_seqlen_kv"]).view_as(q)
    result = {"max_abs_diff": max_diff(out, ref, _real(batch)), "tolerance": 2e-2}
    if torch.cuda.device_count() < 2:
        result["cp_p2p"] = "skipped: TE's CP (cp_comm_type p2p) needs 2+ GPUs; tests/test_cp.py checks the shards"
    return result


def check_flex(args, dev) -> dict:
    from torch.nn.attention.flex_attention import flex_attention

    batch = random_pack(args.tokens, 3, align=8, dev=dev)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    q, k, v = qkv(batch, dtype, dev)
    mask = batch.block_mask()
    flex = torch.compile(flex_attention, dynamic=False)
    heads_first = lambda t: t.transpose(0, 1).unsqueeze(0)  # noqa: E731
    out = flex(heads_first(q), heads_first(k), heads_first(v), block_mask=mask, enable_gqa=True)[0].transpose(0, 1)
    ref = per_sample(sdpa_alone, batch, q, k, v)
    return {"max_abs_diff": max_diff(out, ref, _real(batch)), "tolerance": 2e-2 if dtype == torch.bfloat16 else 1e-4}


def check_gdn(args, dev) -> dict:
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError as exc:
        return {"skipped": f"flash-linear-attention (fla) not importable ({exc})"}
    batch = random_pack(args.tokens, 4, dev=dev)
    g = torch.Generator(device="cpu").manual_seed(4)
    T, H, D = batch.input_ids.numel(), 4, 64
    q, k, v = (torch.randn(1, T, H, D, generator=g).to(dev, torch.bfloat16) for _ in range(3))
    k = F.normalize(k.float(), dim=-1).to(torch.bfloat16)
    gate = F.logsigmoid(torch.randn(1, T, H, generator=g)).to(dev, torch.float32)
    beta = torch.rand(1, T, H, generator=g).sigmoid().to(dev, torch.bfloat16)
    out, _ = chunk_gated_delta_rule(q, k, v, gate, beta, cu_seqlens=batch.cu_seqlens.long())
    ref = torch.zeros_like(out)
    for a, b in zip(batch.cu_seqlens[:-1].tolist(), batch.cu_seqlens[1:].tolist()):
        ref[:, a:b], _ = chunk_gated_delta_rule(q[:, a:b], k[:, a:b], v[:, a:b], gate[:, a:b], beta[:, a:b])
    return {"max_abs_diff": float((out.float() - ref.float()).abs().max()), "tolerance": 2e-2}


def _real(batch) -> torch.Tensor:
    """bool ``[T]``: slots of real tokens (alignment pad slots excluded)."""
    cu, lens = batch.cu_seqlens_padded.tolist(), batch.seq_lens.tolist()
    keep = torch.zeros(batch.input_ids.numel(), dtype=torch.bool)
    for a, s in zip(cu[:-1], lens):
        keep[a:a + s] = True
    return keep.to(batch.input_ids.device)


def _small_qwen3(attn: str, dev, dtype):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=32000, hidden_size=1024, intermediate_size=3072, num_hidden_layers=8,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=64, max_position_embeddings=32768,
                      attn_implementation=attn, use_cache=False)
    return Qwen3ForCausalLM(cfg).to(dev, dtype)


def _time_step(model, kwargs, repeats: int) -> float:
    times = []
    for i in range(repeats + 1):
        model.zero_grad(set_to_none=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        model(**kwargs).loss.backward()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if i:  # the first is warm-up (compiles, autotunes)
            times.append(time.perf_counter() - t0)
    return float(np.median(times))


def check_step(args, dev) -> dict:
    try:
        import flash_attn  # noqa: F401
        packed_attn = "flash_attention_2"
    except ImportError:  # FlexAttention has no backward on CPU: there sdpa (per-sample masks from position_ids)
        packed_attn = "flex_attention" if dev.type == "cuda" else "sdpa"
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    out = {"packed_attention": packed_attn, "padded_attention": "sdpa"}
    for total in args.step_tokens:
        batch = random_pack(total, 5, dev=dev)
        packed = _small_qwen3(packed_attn, dev, dtype)
        t_packed = _time_step(packed, batch.to_hf_kwargs(attn_implementation=packed_attn), args.repeats)
        padded = _small_qwen3("sdpa", dev, dtype)
        padded.load_state_dict(packed.state_dict())
        S, lens = int(batch.seq_lens.max()), batch.seq_lens.tolist()
        ids = torch.zeros(len(lens), S, dtype=torch.long, device=dev)
        mask = torch.zeros_like(ids)
        for i, (a, s) in enumerate(zip(batch.cu_seqlens_padded[:-1].tolist(), lens)):
            ids[i, :s], mask[i, :s] = batch.input_ids[a:a + s], 1
        labels = ids.masked_fill(mask == 0, -100)
        padded_kw = {"input_ids": ids, "attention_mask": mask, "labels": labels}
        t_padded = _time_step(padded, padded_kw, args.repeats)
        with torch.no_grad():  # the same weights and targets: the same token-mean loss
            loss_diff = abs(float(packed(**batch.to_hf_kwargs(attn_implementation=packed_attn)).loss)
                            - float(padded(**padded_kw).loss))
        out[f"{total}"] = {"samples": len(lens), "padded_shape": [len(lens), S], "packed_s": t_packed,
                           "padded_s": t_padded, "speedup": t_padded / t_packed, "loss_abs_diff": loss_diff}
        if not loss_diff <= (5e-2 if dtype == torch.bfloat16 else 1e-4):
            out["error"] = f"packed and padded losses differ by {loss_diff:.3g} at {total} tokens"
        del packed, padded
    return out


CHECKS = {"flash_varlen": check_flash_varlen, "te_thd": check_te_thd, "flex": check_flex, "gdn": check_gdn,
          "step": check_step}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (a smoke run of the same code)")
    ap.add_argument("--checks", nargs="+", choices=sorted(CHECKS), default=list(CHECKS))
    ap.add_argument("--tokens", type=int, default=8192, help="tokens of the pack the kernel checks use")
    ap.add_argument("--step-tokens", type=int, nargs="+", default=[4096, 16384], help="pack lengths of the step timing")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args(argv)
    if args.quick:
        args.tokens, args.step_tokens, args.repeats = 512, [256], 1
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA device: run with --device cpu for a smoke run (the GPU checks need a GPU)")
    dev = torch.device(args.device)
    results, bad = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
                    "torch": torch.__version__}, []
    for name in args.checks:
        t0 = time.perf_counter()
        try:
            r = CHECKS[name](args, dev)
        except Exception as exc:  # one check's failure must not hide the others' results
            r = {"error": f"{type(exc).__name__}: {exc}"}
            bad.append(name)
        r["seconds"] = round(time.perf_counter() - t0, 2)
        if ("max_abs_diff" in r and not r["max_abs_diff"] <= r["tolerance"]) or ("error" in r and name not in bad):
            bad.append(name)
        results[name] = r
        print(f"{name:>13}: {json.dumps(r)}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    if bad:
        print(f"FAILED: {', '.join(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
