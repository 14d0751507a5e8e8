"""The GPU proof of the headline (issue 31), the checks ``benchmarks/gpu_check.py`` runs besides the kernel ones:

- ``ceiling``: a bf16 matmul (8192³ on CUDA): the practical TFLOP/s ceiling of the machine.
- ``varlen``: ``thdpack.integrations.register_varlen_attention``'s backend on a pack (align 8), as built and with
  static offsets (``max_num_seqs``, ``pad_to``), against every sample alone through SDPA.
- ``mfu``: a Qwen3-8B-shaped model (4 layers of its width, bf16, random weights), forward + backward through the
  varlen backend on packs of SFT-like lengths: TFLOP/s by ``Σ sᵢ²`` (thdpack.flops), by the pack length², by
  ``torch.utils.flop_counter.FlopCounterMode`` (a formula registered for the varlen op where torch has none; it
  counts every attention square in full, causal or not), each also as a fraction of the ceiling.
- ``paths``: the same samples packed by thdpack, packed by transformers' ``DataCollatorWithFlattening`` (the same
  backend) and padded to ``[B, S]`` through SDPA: tokens per second of a training step; and the collator's time per
  batch against the step time.

Every check runs on the CPU too (``--device cpu --quick``: tiny sizes, the backend's reference path), so CI keeps
the code alive; only a CUDA run gives figures worth printing.
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.nn.functional as F

import thdpack
from thdpack.integrations.varlen_attention import register_varlen_attention, varlen_attention_forward
from thdpack.integrations import to_hf_kwargs

QWEN3_8B = dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8,
                head_dim=128, vocab_size=151936)  # Qwen3-8B's width; 4 of its 36 layers
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            vocab_size=512)


def _sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _median_time(fn, dev, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs after one warm-up."""
    times = []
    for i in range(repeats + 1):
        _sync(dev)
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        if i:
            times.append(time.perf_counter() - t0)
    return float(np.median(times))


def check_ceiling(args, dev) -> dict:
    n = 256 if args.quick else 8192
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    a, b = (torch.randn(n, n, device=dev, dtype=dtype) for _ in range(2))
    seconds = _median_time(lambda: a @ b, dev, max(args.repeats, 3))
    return {"n": n, "dtype": str(dtype), "tflops": 2 * n ** 3 / seconds / 1e12}


def sft_lengths(total: int, seed: int) -> list[int]:
    """Lengths of SFT-like samples (lognormal around 600 tokens, at most 8k) filling about ``total`` tokens."""
    rng = np.random.default_rng(seed)
    mu = min(6.4, np.log(max(total, 64) / 8))  # small packs (--quick) still hold several samples
    out = []
    while sum(out) < total:
        out.append(int(np.clip(rng.lognormal(mu, 0.9), 4, min(8192, total))))
    while sum(out) > total:
        out.pop()
    return out or [total]


def sft_samples(total: int, vocab: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(1, vocab, (n,), generator=g)} for n in sft_lengths(total, seed)]


def check_varlen(args, dev) -> dict:
    """The backend's attention on a pack vs each sample alone (bf16 on CUDA), as built and with static offsets."""
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    total = args.tokens
    samples = sft_samples(total, 100, 3)
    out, worst = {"samples": len(samples)}, 0.0
    for name, layout in (("as_built", {"pad_multiple": 8}),
                         ("static", {"pad_multiple": 8, "max_num_seqs": len(samples) + 8, "pad_to": total + 8 * len(samples)})):
        batch = thdpack.build_thd_batch(samples, **layout).to(dev)
        kw = to_hf_kwargs(batch, attn_implementation=register_varlen_attention())
        T = batch.input_ids.numel()
        g = torch.Generator(device=dev).manual_seed(0)
        q, k, v = (torch.randn(1, h, T, 64, device=dev, dtype=dtype, generator=g) for h in (8, 4, 4))
        module = torch.nn.Module()
        module.is_causal = True
        got = varlen_attention_forward(module, q, k, v, None, cu_seq_lens_q=kw["cu_seq_lens_q"],
                                       cu_seq_lens_k=kw["cu_seq_lens_k"], max_length_q=kw["max_length_q"])[0][0]
        diff = 0.0
        for a, s in zip(batch.cu_seqlens_padded[:-1].tolist(), batch.seq_lens.tolist()):
            alone = F.scaled_dot_product_attention(q[:, :, a:a + s], k[:, :, a:a + s], v[:, :, a:a + s],
                                                   is_causal=True, enable_gqa=True)[0].transpose(0, 1)
            diff = max(diff, (got[a:a + s].float() - alone.float()).abs().max().item())
        out[name] = {"tokens": T, "offsets": int(kw["cu_seq_lens_q"].numel()), "max_abs_diff": diff}
        worst = max(worst, diff)
    out.update(max_abs_diff=worst, tolerance=2e-2 if dtype == torch.bfloat16 else 1e-5,
               path="varlen_attn kernel" if dev.type == "cuda" else "reference (per-sample SDPA)")
    return out


def register_varlen_flop_formulas() -> str:
    """FlopCounterMode formulas for torch's varlen ops (torch's own flash-attention formulas on their arguments),
    where torch has none; what was done, for the report."""
    from torch.utils import flop_counter as fc

    try:
        import torch.nn.attention.varlen  # noqa: F401 - defines the torch_attn ops
        forward, backward = torch.ops.torch_attn._varlen_attn, torch.ops.torch_attn._varlen_attn_backward
    except (ImportError, AttributeError) as exc:
        return f"no varlen op in this torch ({exc})"
    if forward in fc.flop_registry or forward.default in fc.flop_registry:
        return "torch counts the varlen op itself"

    def forward_flop(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *args, out_shape=None, **kwargs):
        return fc._flash_attention_forward_flop(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k,
                                                out_shape=out_shape)

    def backward_flop(grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q, max_k, *args, **kwargs):
        return fc._flash_attention_backward_flop(grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k,
                                                 max_q, max_k)

    fc.register_flop_formula(forward)(forward_flop)
    fc.register_flop_formula(backward)(backward_flop)
    return "registered (torch's flash-attention formulas: the full square per sample)"


def _qwen3(width: dict, layers: int, attn: str, dev, dtype):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(**width, num_hidden_layers=layers, max_position_embeddings=65536, attn_implementation=attn,
                      use_cache=False)
    torch.manual_seed(0)
    return Qwen3ForCausalLM(cfg).to(dev, dtype).train(), cfg


def _step(model, kw):
    model.zero_grad(set_to_none=True)
    model(**kw).loss.backward()


def check_mfu(args, dev) -> dict:
    from torch.utils.flop_counter import FlopCounterMode

    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    name = register_varlen_attention()
    formulas = register_varlen_flop_formulas()
    model, cfg = _qwen3(TINY if args.quick else QWEN3_8B, 4, name, dev, dtype)
    ceiling = args.ceiling_tflops
    out = {"model": f"Qwen3 width {cfg.hidden_size}, 4 layers, {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B "
                    f"parameters, {dtype}", "flop_counter_formula": formulas, "ceiling_tflops": ceiling}
    for total in args.mfu_tokens:
        batch = thdpack.build_thd_batch(sft_samples(total, cfg.vocab_size, 11)).to(dev)
        kw = to_hf_kwargs(batch, attn_implementation=name)
        seconds = _median_time(lambda: _step(model, kw), dev, args.repeats)
        with FlopCounterMode(display=False) as counter:
            _step(model, kw)
        T = int(batch.num_tokens)
        honest = float(thdpack.flops.model_flops(cfg, T, thdpack.flops.seqlen_squared_sum(batch.cu_seqlens)))
        pack_len = float(thdpack.flops.model_flops(cfg, T, T * T))
        row = {"samples": batch.num_samples, "step_s": seconds, "tflops_sum_si2": honest / seconds / 1e12,
               "tflops_pack_len2": pack_len / seconds / 1e12,
               "tflops_flop_counter": counter.get_total_flops() / seconds / 1e12,
               "overcount": pack_len / honest - 1}
        if ceiling:
            row["mfu_sum_si2"] = row["tflops_sum_si2"] / ceiling
            row["mfu_pack_len2"] = row["tflops_pack_len2"] / ceiling
        out[str(total)] = row
    return out


def check_paths(args, dev) -> dict:
    """Tokens/s of one training step on the same samples: thdpack's pack, transformers' flattening collator
    (the same varlen backend), and the padded ``[B, S]`` batch through SDPA; and the collator's share of a step."""
    from transformers import DataCollatorWithFlattening

    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    name = register_varlen_attention()
    model, cfg = _qwen3(TINY if args.quick else dict(QWEN3_8B, vocab_size=32000), 2 if args.quick else 4, name,
                        dev, dtype)
    out = {}
    for total in args.step_tokens:
        samples = sft_samples(total, cfg.vocab_size, 5)
        collator = thdpack.ThdCollator()
        collate_s = _median_time(lambda: collator(samples), torch.device("cpu"), args.repeats)
        kw = to_hf_kwargs(collator(samples).to(dev), attn_implementation=name)
        flat = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)(
            [{"input_ids": s["input_ids"].tolist()} for s in samples])
        flat = {k: (v.to(dev) if torch.is_tensor(v) else v) for k, v in flat.items()}
        S = max(len(s["input_ids"]) for s in samples)
        ids = torch.zeros(len(samples), S, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, s in enumerate(samples):
            ids[i, :len(s["input_ids"])], mask[i, :len(s["input_ids"])] = s["input_ids"], 1
        padded = {"input_ids": ids.to(dev), "attention_mask": mask.to(dev),
                  "labels": ids.masked_fill(mask == 0, -100).to(dev)}
        tokens = sum(len(s["input_ids"]) for s in samples)
        row = {"samples": len(samples), "padded_shape": [len(samples), S]}
        for label, batch_kw in (("thdpack", kw), ("flattening_collator", flat)):
            row[f"{label}_tokens_per_s"] = tokens / _median_time(lambda: _step(model, batch_kw), dev, args.repeats)
        model.set_attn_implementation("sdpa")
        step_s = _median_time(lambda: _step(model, padded), dev, args.repeats)
        model.set_attn_implementation(name)
        row["padded_sdpa_tokens_per_s"] = tokens / step_s
        row["collate_s"] = collate_s
        row["collate_share_of_step"] = collate_s / (tokens / row["thdpack_tokens_per_s"])
        out[str(total)] = row
    return out


def markdown(results: dict) -> str:
    """The MFU and paths tables of a run, as Markdown (README's GPU section)."""
    lines = [f"Device: {results.get('device')}, torch {results.get('torch')}, transformers "
             f"{results.get('transformers')}, {results.get('date')}.", ""]
    ceiling = results.get("ceiling", {})
    if "tflops" in ceiling:
        lines += [f"{ceiling['dtype'].removeprefix('torch.')} {ceiling['n']}³ matmul: **{ceiling['tflops']:.1f} "
                  "TFLOP/s**.", ""]
    mfu = results.get("mfu", {})
    rows = {k: v for k, v in mfu.items() if isinstance(v, dict)}
    if rows:
        lines += [f"{mfu.get('model')}; FlopCounterMode on the varlen op: {mfu.get('flop_counter_formula')}.", "",
                  "| pack | samples | step | TFLOP/s by Σ sᵢ² | by pack length² | FlopCounterMode | over-count |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {k} | {r['samples']} | {r['step_s'] * 1e3:.1f} ms | {r['tflops_sum_si2']:.0f} | "
                  f"{r['tflops_pack_len2']:.0f} | {r['tflops_flop_counter']:.0f} | {r['overcount'] * 100:.1f}% |"
                  for k, r in rows.items()]
        lines.append("")
    paths = {k: v for k, v in results.get("paths", {}).items() if isinstance(v, dict)}
    if paths:
        lines += ["| tokens | samples | thdpack pack | DataCollatorWithFlattening | padded (SDPA) | collate / step |",
                  "| --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {k} | {r['samples']} | {r['thdpack_tokens_per_s']:,.0f} tok/s | "
                  f"{r['flattening_collator_tokens_per_s']:,.0f} tok/s | {r['padded_sdpa_tokens_per_s']:,.0f} tok/s | "
                  f"{r['collate_share_of_step'] * 100:.2f}% |" for k, r in paths.items()]
    return "\n".join(lines) + "\n"
