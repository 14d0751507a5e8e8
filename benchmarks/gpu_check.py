"""GPU checks of thdpack's layouts against the kernels that read them (issue 23 point 8). Run only where
CUDA exists (never in CI); each check that needs a package the machine lacks says so and is skipped.

Checks, each on packs of random lengths with alignment padding, against every sample run alone:

- ``flash_varlen``: flash-attn's ``flash_attn_varlen_func`` on ``cu_seqlens_padded`` / ``max_seqlen``, and on
  the static offsets of ``max_num_seqs`` (zero-length sequences at the end, ``max_seqlen`` = the stream).
- ``te_thd``: TransformerEngine's ``DotProductAttention`` with ``qkv_format="thd"`` (``padding_causal``,
  ``cu_seqlens_q/kv`` and their padded forms); CP with ``cp_comm_type="p2p"`` needs 2+ GPUs (skipped on one).
- ``flex``: FlexAttention on CUDA with ``thdpack.batching.block_mask(batch)`` (compiled).
- ``gdn``: a Gated DeltaNet layer (``flash-linear-attention``'s ``chunk_gated_delta_rule``) with
  ``cu_seqlens``: the recurrent state restarts at each sample.
- ``step``: forward + backward time of a small random Qwen3 (transformers) on one pack vs the same
  samples padded to ``[B, S]``, at pack lengths 4k and 16k (packed through flash-attn if installed,
  else FlexAttention's BlockMask, sdpa on CPU; padded through SDPA).
- ``hybrid``: hybrid models on a pack (issue 29): the logits of small random Qwen3.5 (Gated DeltaNet +
  attention) and Bamba (Mamba-2 + attention) models through ``thdpack.integrations.packed_model`` vs each
  sample alone, naming the path each mixer took (``native``: transformers' kernels, where CUDA and every
  kernel package is present; else ``reference``: per sample) and which of fla / causal_conv1d / mamba_ssm
  import; with the native path, the reference path too. Then each kernel alone, where importable:
  fla's ``chunk_gated_delta_rule`` with ``cu_seqlens`` (the ``gdn`` check's result, run once),
  causal-conv1d's ``causal_conv1d_fn`` with ``seq_idx``, fla's ``causal_conv1d`` with ``cu_seqlens``,
  each vs per sample, and ``megatron_gdn_check()`` of ``benchmarks/gpu_megatron_gdn.py`` if that file
  exists. Every sub-result names the layer that would leak across samples if it were off.

- ``check``: ``thdpack.check_packing`` (issue 45) on the device: the small Qwen3.5 and Bamba hybrids (the
  native kernel path where every package imports) and Qwen3 (sdpa), float32 and bfloat16, with gradients:
  each layer, mixer and mixer step of every sample, the losses and gradients vs each sample alone; the
  first failing module, if any, is the check's error.

- ``trie``: a rollout trie (issue 46: prefixes shared at four levels, a one-token leaf) through a small float32
  Qwen3.5 wrapped in ``thdpack.integrations.packed_model`` (each Gated DeltaNet layer runs a segment from its
  parent's final state): every sample's logits at its rows vs the sample alone, relative error < 1e-5. Twice
  where flash-linear-attention (``fla``) imports on CUDA: transformers' torch scan and convolution forced, then
  fla's kernels (what transformers picks when fla is installed), with fla alone vs torch alone for scale; each
  result names the implementation every function ran. On a CPU (``--device cpu``) only the torch path runs
  (a dry run of the same code) and the fla path says it was skipped for want of CUDA.

- ``ceiling``, ``varlen``, ``mfu``, ``paths``: the headline's proof (issue 31; ``benchmarks/gpu_proof.py``): the
  matmul ceiling, PyTorch's varlen kernel as an attention backend vs each sample alone, the MFU table (TFLOP/s by
  ``Σ sᵢ²``, by pack length², by FlopCounterMode), and packed vs flattening-collator vs padded tokens/s with the
  collator's share of a step. ``--markdown`` writes their tables.

Usage::

    python benchmarks/gpu_check.py --out $OUT/gpu_check.json --markdown $OUT/gpu_check.md   # on a GPU machine
    python benchmarks/gpu_check.py --device cpu --quick                 # the same code paths, tiny, on CPU

Exits non-zero when a check that ran found a difference above its tolerance.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.util
import inspect
import json
import sys
import time
from pathlib import Path
from unittest import mock

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import thdpack  # noqa: E402
from thdpack.integrations import packed_seq_params_dict, to_hf_kwargs  # noqa: E402
from thdpack.batching import block_mask, seq_idx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_proof  # noqa: E402  (the headline's checks: ceiling, varlen, mfu, paths)

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
        kw = to_hf_kwargs(batch)
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
    p = packed_seq_params_dict(batch)
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
    mask = block_mask(batch)
    flex = torch.compile(flex_attention, dynamic=False)
    heads_first = lambda t: t.transpose(0, 1).unsqueeze(0)  # noqa: E731
    out = flex(heads_first(q), heads_first(k), heads_first(v), block_mask=mask, enable_gqa=True)[0].transpose(0, 1)
    ref = per_sample(sdpa_alone, batch, q, k, v)
    return {"max_abs_diff": max_diff(out, ref, _real(batch)), "tolerance": 2e-2 if dtype == torch.bfloat16 else 1e-4}


def check_gdn(args, dev) -> dict:
    return dict(_gdn_scan(args.tokens, dev))


@functools.lru_cache(maxsize=None)
def _gdn_scan(tokens: int, dev) -> dict:
    """The ``gdn`` check's result, computed once (the ``hybrid`` check reports it too)."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError as exc:
        return {"skipped": f"flash-linear-attention (fla) not importable ({exc})"}
    batch = random_pack(tokens, 4, dev=dev)
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
        t_packed = _time_step(packed, to_hf_kwargs(batch, attn_implementation=packed_attn), args.repeats)
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
            loss_diff = abs(float(packed(**to_hf_kwargs(batch, attn_implementation=packed_attn)).loss)
                            - float(padded(**padded_kw).loss))
        out[f"{total}"] = {"samples": len(lens), "padded_shape": [len(lens), S], "packed_s": t_packed,
                           "padded_s": t_padded, "speedup": t_padded / t_packed, "loss_abs_diff": loss_diff}
        if not loss_diff <= (5e-2 if dtype == torch.bfloat16 else 1e-4):
            out["error"] = f"packed and padded losses differ by {loss_diff:.3g} at {total} tokens"
        del packed, padded
    return out


# ---- hybrid models (issue 29): packed_model's paths, and each boundary-reading kernel alone ----------------

HYBRID_KERNELS = ("fla", "causal_conv1d", "mamba_ssm")
HYBRID_VOCAB = 1024
BOUNDARY_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")
QWEN3_5_LAYERS = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]


def _kernel_packages() -> dict:
    """``{package: True, or why it does not import}`` for the hybrid layers' kernel packages."""
    out = {}
    for name in HYBRID_KERNELS:
        try:
            importlib.import_module(name)
            out[name] = True
        except Exception as exc:  # not installed, or a CUDA build that does not load
            out[name] = f"{type(exc).__name__}: {exc}"[:200]
    return out


def _hybrid_config(family: str, quick: bool) -> tuple[str, str, dict]:
    """``(config class, model class, kwargs)`` of a small hybrid causal LM: 4 layers, hidden 256 (64 with
    ``--quick``), one of them attention; transformers' default initialization (0.02)."""
    h, d = (64, 16) if quick else (256, 64)
    common = dict(vocab_size=HYBRID_VOCAB, hidden_size=h, intermediate_size=3 * h, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32768, use_cache=False,
                  tie_word_embeddings=False, pad_token_id=0, bos_token_id=None, eos_token_id=None)
    if family == "qwen3_5":
        return "Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(
            common, head_dim=d, layer_types=QWEN3_5_LAYERS, linear_conv_kernel_dim=4, linear_key_head_dim=d,
            linear_value_head_dim=d, linear_num_key_heads=2, linear_num_value_heads=4)
    heads = 4 if quick else 8  # Mamba-2 heads of 2h / heads channels
    return "BambaConfig", "BambaForCausalLM", dict(
        common, attn_layer_indices=[2], mamba_n_heads=heads, mamba_d_head=2 * h // heads, mamba_n_groups=1,
        mamba_d_state=d, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=d)


def _hybrid_model(family: str, dev, dtype, quick: bool):
    """A random-weight model in train mode (the kernels a training step runs; no dropout in these configs)."""
    import transformers

    cfg_name, model_name, kwargs = _hybrid_config(family, quick)
    config = getattr(transformers, cfg_name)(**kwargs)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return getattr(transformers, model_name)(config).to(dev, dtype).train()


def _logits_alone(model, batch) -> torch.Tensor:
    """float32 ``[T, V]``: every sample's logits run alone (batch axis 1, no position ids), at its place in the
    stream (pad slots 0)."""
    out = torch.zeros(batch.input_ids.numel(), model.config.vocab_size, device=batch.input_ids.device)
    for a, s in zip(batch.cu_seqlens_padded[:-1].tolist(), batch.seq_lens.tolist()):
        out[a:a + s] = model(input_ids=batch.input_ids[None, a:a + s]).logits[0].float()
    return out


def _mixer_layers(model) -> dict:
    """``{mixer class: what it reads}`` and the decoder layers holding each, for the report."""
    from thdpack.integrations.hybrid.mixers import MIXER_FAMILIES

    found: dict = {}
    for name, module in model.named_modules():
        cls = type(module).__name__
        if cls in MIXER_FAMILIES:
            found.setdefault(cls, []).append(int(name.split("layers.")[1].split(".")[0]))
    return {cls: f"layers {layers}: {MIXER_FAMILIES[cls].reads}" for cls, layers in found.items()}


def _unwrapped_calls(model, kw, diff, tol) -> dict:
    """Before ``packed_model``: the call without the boundary keys (the mixers scan the pack as one sequence:
    the leak this check would see), and the same call as the user makes it (exact, or a refusal)."""
    out = {"leak_without_boundaries": diff(model(**{k: v for k, v in kw.items() if k not in BOUNDARY_KEYS}))}
    try:
        raw = diff(model(**kw))
        out["without_packed_model"] = raw
        if not raw <= tol:
            out["error"] = f"without packed_model the call neither refuses nor matches (max abs diff {raw:.3g})"
    except ValueError as exc:
        out["without_packed_model"] = f"refused: {str(exc)[:160]}"
    except Exception as exc:  # a kernel that fails: packed_model's native path would meet it too
        out["error"] = f"without packed_model: {type(exc).__name__}: {exc}"[:600]
    return out


def _model_case(family: str, args, dev) -> dict:
    """The logits of ``packed_model(model)`` on a pack (align 8, sdpa's 4D mask) vs each sample alone, with the
    path its mixers took; where that is the native one, the reference path as well."""
    pm = importlib.import_module("thdpack.integrations.hybrid.packed_model")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    tol = 5e-2 if dtype == torch.bfloat16 else 1e-4  # logits of max ~2 (bf16: as the step check's loss)
    model = _hybrid_model(family, dev, dtype, args.quick)
    batch = random_pack(args.tokens, 6, align=8, dev=dev)
    real = _real(batch)
    kw = to_hf_kwargs(batch, attn_implementation="sdpa", include_labels=False)
    out = {"layer": _mixer_layers(model), "samples": int(batch.seq_lens.numel()), "tokens": int(real.sum())}
    with torch.no_grad():
        ref = _logits_alone(model, batch)
        diff = lambda o: max_diff(o.logits[0], ref, real)  # noqa: E731
        out["max_abs_logit"] = float(ref[real].abs().max())
        out.update(_unwrapped_calls(model, kw, diff, tol))
        pm.packed_model(model)
        families = {type(m).__name__: pm.MIXER_FAMILIES[type(m).__name__] for m in model.modules()
                    if type(m).__name__ in pm.MIXER_FAMILIES}
        out["path"] = {cls: "native" if pm._native(f, dev) else "reference" for cls, f in families.items()}
        try:
            out["max_abs_diff"] = diff(model(**kw))
        except Exception as exc:  # reported; the reference path below is still measured
            paths = "/".join(sorted(set(out["path"].values())))
            out["error"] = f"packed_model's {paths} path: {type(exc).__name__}: {exc}"[:600]
        if "native" in out["path"].values():  # the per-sample path too, on the same machine
            with mock.patch.object(pm, "_native", lambda family, device: False):
                out["reference_path_max_abs_diff"] = diff(model(**kw))
    out["tolerance"] = tol
    return out


def _conv_case(args, dev, seed: int = 7):
    """A pack (align 8) and bf16 ``x [1, T, 256]``, ``weight [256, 4]``, ``bias [256]`` of a short convolution."""
    batch = random_pack(args.tokens, seed, align=8, dev=dev)
    g = torch.Generator(device="cpu").manual_seed(seed)
    T, D, W = batch.input_ids.numel(), 256, 4
    x = torch.randn(1, T, D, generator=g).to(dev, torch.bfloat16)
    weight = (torch.randn(D, W, generator=g) / 2).to(dev, torch.bfloat16)
    return batch, x, weight, torch.randn(D, generator=g).to(dev, torch.bfloat16)


def _conv_seq_idx(args, dev) -> dict:
    """causal-conv1d's ``causal_conv1d_fn`` with ``seq_idx`` (channel-last input, as transformers and
    megatron-core call it) vs per sample."""
    try:
        from causal_conv1d import causal_conv1d_fn
    except Exception as exc:
        return {"skipped": f"causal_conv1d not importable ({type(exc).__name__}: {exc})"[:200]}
    if dev.type != "cuda":
        return {"skipped": "causal_conv1d runs on CUDA only"}
    batch, x, weight, bias = _conv_case(args, dev)

    def conv(t, **kw):  # t [1, s, D] contiguous: transposed, it is the channel-last layout seq_idx needs
        return causal_conv1d_fn(t.transpose(1, 2), weight, bias, activation="silu", **kw).transpose(1, 2)

    out = conv(x, seq_idx=seq_idx(batch))
    ref = per_sample(lambda t: conv(t[None])[0], batch, x[0])
    return {"max_abs_diff": max_diff(out[0], ref, _real(batch)), "tolerance": 2e-2}


def _fla_conv_fn():
    """fla's varlen ``causal_conv1d`` (``fla.modules.convolution``; ``fla.modules.conv`` in newer fla)."""
    why = None
    for module in ("fla.modules.convolution", "fla.modules.conv"):
        try:
            return importlib.import_module(module).causal_conv1d, None
        except Exception as exc:
            why = why or f"{module}: {type(exc).__name__}: {exc}"[:200]
    return None, why


def _fla_conv(args, dev) -> dict:
    """flash-linear-attention's ``causal_conv1d`` with ``cu_seqlens`` vs per sample."""
    conv_fn, why = _fla_conv_fn()
    if conv_fn is None:
        return {"skipped": f"fla's causal_conv1d not importable ({why})"}
    if dev.type != "cuda":
        return {"skipped": "fla's causal_conv1d (Triton) runs on CUDA only"}
    batch, x, weight, bias = _conv_case(args, dev)

    def conv(t, **kw):
        y = conv_fn(x=t, weight=weight, bias=bias, activation="silu", **kw)
        return y[0] if isinstance(y, tuple) else y  # (output, final state)

    out = conv(x, cu_seqlens=batch.cu_seqlens_padded.long())
    ref = per_sample(lambda t: conv(t[None])[0], batch, x[0])
    return {"max_abs_diff": max_diff(out[0], ref, _real(batch)), "tolerance": 2e-2}


def _megatron_gdn(args, dev) -> dict:
    """``megatron_gdn_check()`` of benchmarks/gpu_megatron_gdn.py (another script), where that file exists."""
    path = Path(__file__).resolve().parent / "gpu_megatron_gdn.py"
    if not path.exists():
        return {"skipped": "benchmarks/gpu_megatron_gdn.py is not there"}
    try:
        spec = importlib.util.spec_from_file_location("_thdpack_gpu_megatron_gdn", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        check = module.megatron_gdn_check
    except (ImportError, AttributeError) as exc:
        return {"skipped": f"benchmarks/gpu_megatron_gdn.py: no megatron_gdn_check ({type(exc).__name__}: {exc})"}
    # a pack of at most 2048 tokens and 3 minutes, so the whole script stays within 5 on one GPU
    options = {"tokens": min(args.tokens, 2048), "timeout": 180, "quick": args.quick, "device": dev}
    params = inspect.signature(check).parameters
    return dict(check(**{k: v for k, v in options.items() if k in params}))


HYBRID_PARTS = {  # sub-result: (function, the layer that would leak across samples if it were wrong)
    "model_qwen3_5": (functools.partial(_model_case, "qwen3_5"), None),  # the model case names its layers
    "model_bamba": (functools.partial(_model_case, "bamba"), None),
    "fla_gdn_scan": (lambda args, dev: dict(_gdn_scan(args.tokens, dev), run_by="gdn check (once)"),
                     "Gated DeltaNet scan (Qwen3.5 / Qwen3-Next / OlmoHybrid): fla chunk_gated_delta_rule, "
                     "cu_seqlens"),
    "causal_conv1d_seq_idx": (_conv_seq_idx, "short convolution of Gated DeltaNet / Mamba-2 / LFM2 layers: "
                              "causal_conv1d_fn, seq_idx"),
    "fla_causal_conv1d": (_fla_conv, "short convolution of fla's Gated DeltaNet (megatron-core, fla models): "
                          "fla causal_conv1d, cu_seqlens"),
    "megatron_gdn": (_megatron_gdn, "megatron-core GatedDeltaNet layer (thd, PackedSeqParams)"),
}


def _part_failed(r: dict) -> bool:
    over = any(k.endswith("max_abs_diff") and not r[k] <= r.get("tolerance", 0) for k in r)
    return over or "error" in r


def check_hybrid(args, dev) -> dict:
    kernels = _kernel_packages()
    out = {"kernels": {k: v is True for k, v in kernels.items()}}
    out["not_importable"] = {k: v for k, v in kernels.items() if v is not True}
    failed = []
    for name, (part, layer) in HYBRID_PARTS.items():
        try:
            r = part(args, dev)
        except Exception as exc:  # one part's failure must not hide the others' results
            r = {"error": f"{type(exc).__name__}: {exc}"[:1000]}
        out[name] = {"layer": layer, **r} if layer else r
        if _part_failed(r):
            failed.append(name)
    if failed:
        out["error"] = f"above tolerance or failed: {', '.join(failed)}"
    return out


def check_packing_on_device(args, dev) -> dict:
    """``thdpack.check_packing`` of small models on ``dev`` (see the module docstring): ``{case: verdict}``."""
    out, failed = {}, []
    for family in ("qwen3_5", "bamba"):
        for dtype in (torch.float32, torch.bfloat16):
            model = _hybrid_model(family, dev, dtype, args.quick).eval()
            samples = [{"input_ids": torch.randint(1, HYBRID_VOCAB, (n,)).tolist()} for n in (300, 77, 1, 512)]
            report = thdpack.check_packing(model, samples, grad=True, flops=False)
            case = f"{family}-{str(dtype)[6:]}"
            worst = max((s.worst.rel for s in report.packs[0].samples if s.worst), default=0.0)
            out[case] = {"ok": report.ok, "worst_rel": worst, "failure": report.first_failure()}
            if not report.ok:
                failed.append(case)
    if failed:
        out["error"] = f"not exact: {', '.join(failed)}"
    return out


# ---- rollout tries (issue 46) on a hybrid model: state forks through packed_model --------------------------

TRIE_SHAPE = [(24, [(16, [(12, [(8, [(1, []), (6, [])]), (10, [])]), (14, [])]), (20, [(0, []), (9, [])])]),
              (10, [(7, []), (5, [])])]  # group 0: four shared levels, a one-token leaf, a leaf equal to its prefix
GDN_FUNCTIONS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                 "causal_conv1d_update")


def _trie_samples(scale: int, seed: int = 11) -> list[dict]:
    """One sample per leaf of :data:`TRIE_SHAPE` (node lengths times ``scale``; a group per root), every
    token a target."""
    rng = np.random.default_rng(seed)
    samples = []

    def walk(node, tokens, group):
        length, children = node
        tokens = tokens + rng.integers(3, HYBRID_VOCAB, length * scale).tolist()
        if not children:
            samples.append({"input_ids": tokens, "labels": tokens, "group": group})
        for child in children:
            walk(child, tokens, group)

    for g, root in enumerate(TRIE_SHAPE):
        walk(root, [], g)
    return samples


def _shared_depth(batch) -> int:
    """Shared levels on the trie's longest path."""
    tree = batch.prefix_tree
    depth = []
    for d, p in enumerate(tree.parents.tolist()):
        depth.append((0 if p < 0 else depth[p]) + int(tree.segment_sample[d] < 0))
    return max(depth, default=0)


def _closure_of(fn, name: str):
    """The variable ``name`` of the closure inside a transformers kernel-or-fallback function: through the
    ``kernels`` package's function module (``Func``, whose ``forward`` closes over ``func``) and
    ``functools.wraps`` layers; None where there is none."""
    f, seen = fn, 0
    while f is not None and seen < 8:
        seen += 1
        target = type(f).forward if isinstance(f, torch.nn.Module) else f
        try:
            found = inspect.getclosurevars(target).nonlocals
        except (TypeError, ValueError):
            found = {}
        if name in found:
            return found[name]
        f = found.get("func", getattr(f, "__wrapped__", None))
    return None


def _implementation(fn) -> str:
    """What a transformers kernel-or-fallback function runs on CUDA inputs: ``torch`` (its reference code) or the
    package function it found (``fla.ops...``); ``unknown`` where that cannot be read."""
    impl, ref = _closure_of(fn, "implementation"), _closure_of(fn, "torch_function")
    if impl is None:
        return "unknown"
    return "torch" if impl is ref else f"{getattr(impl, '__module__', '?')}.{getattr(impl, '__name__', impl)}"


def _torch_function(fn):
    """The reference torch code under a kernel-or-fallback function (``fn`` itself where none is found)."""
    return _closure_of(fn, "torch_function") or fn


def _trie_run(model, batch, samples, gdn, force_torch: bool) -> tuple[dict, list]:
    """``(result, logits alone)``: the trie call's worst relative error over the samples vs each alone, with
    the implementation each Gated DeltaNet function ran (transformers' torch code when ``force_torch``)."""
    functions = {n: getattr(gdn, n) for n in GDN_FUNCTIONS if hasattr(gdn, n)}
    patches = [mock.patch.object(gdn, n, _torch_function(f)) for n, f in functions.items()] if force_torch else []
    for p in patches:
        p.start()
    try:
        dev = batch.input_ids.device
        path = {n: "torch" if force_torch else _implementation(f) for n, f in functions.items()}
        if dev.type != "cuda":  # transformers runs the torch code for inputs on a device the package lacks
            path = {n: "torch (inputs on the CPU)" for n in functions}
        with torch.no_grad():
            logits = model(**to_hf_kwargs(batch, attn_implementation="sdpa", include_labels=False),
                           use_cache=False).logits[0].float()
            rows = torch.split(batch.prefix_tree.unshared_rows.to(dev), batch.prefix_tree.sample_lens.tolist())
            alone, errs = [], []
            for s, r in zip(samples, rows):
                want = model(input_ids=torch.tensor(s["input_ids"], device=dev)[None], use_cache=False).logits[0].float()
                alone.append(want)
                errs.append(float((logits[r] - want).abs().max() / want.abs().max().clamp_min(1e-30)))
    finally:
        for p in patches:
            p.stop()
    worst = int(np.argmax(errs))
    return {"path": path, "max_rel_err": errs[worst], "worst_sample": worst, "tolerance": 1e-5}, alone


def check_trie(args, dev) -> dict:
    """A depth-4 trie through ``packed_model`` on a small float32 Qwen3.5 vs each sample alone (the module
    docstring)."""
    from thdpack.integrations import packed_model

    try:
        import transformers.models.qwen3_5.modeling_qwen3_5 as gdn
    except ImportError as exc:
        return {"skipped": f"transformers has no Qwen3.5 ({exc})"}
    samples = _trie_samples(1 if args.quick else 8)
    batch = thdpack.build_thd_batch(samples, share_prefix="group", min_prefix_len=1, pad_multiple=8).to(dev)
    if batch.prefix_tree is None or _shared_depth(batch) < 3:
        return {"error": "the samples did not build a trie of depth 3 or more"}
    model = packed_model(_hybrid_model("qwen3_5", dev, torch.float32, args.quick).eval())
    fla = _kernel_packages()["fla"]
    out = {"dtype": "float32", "samples": len(samples), "segments": int(batch.seq_lens.numel()),
           "shared_depth": _shared_depth(batch), "tokens": int(batch.seq_lens.sum()),
           "unshared_tokens": int(batch.prefix_tree.sample_lens.sum()), "fla_importable": fla is True,
           "cuda": "present" if dev.type == "cuda" else
           "absent: a CPU dry run of the torch path; the fla path needs CUDA and is skipped"}
    out["torch_path"], torch_alone = _trie_run(model, batch, samples, gdn, force_torch=True)
    if dev.type != "cuda":
        out["fla_path"] = {"skipped": "no CUDA device: fla's Triton kernels run on CUDA only"}
    elif fla is not True:
        out["fla_path"] = {"skipped": f"flash-linear-attention (fla) not importable ({fla})"}
    else:
        out["fla_path"], fla_alone = _trie_run(model, batch, samples, gdn, force_torch=False)
        out["fla_path"]["fla_alone_vs_torch_alone_rel"] = max(
            float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) for a, b in zip(fla_alone, torch_alone))
        if all(v == "torch" for v in out["fla_path"]["path"].values()):
            out["fla_path"]["note"] = "fla imports but transformers did not pick it: the torch code ran twice"
    ran = [name for name in ("torch_path", "fla_path") if "max_rel_err" in out[name]]
    out["paths_run"] = ran
    failed = [name for name in ran if not out[name]["max_rel_err"] < out[name]["tolerance"]]
    if failed:
        out["error"] = f"a sample's logits on the trie differ from the sample alone: {', '.join(failed)}"
    return out


CHECKS = {"ceiling": gpu_proof.check_ceiling, "varlen": gpu_proof.check_varlen, "mfu": gpu_proof.check_mfu,
          "paths": gpu_proof.check_paths, "flash_varlen": check_flash_varlen, "te_thd": check_te_thd,
          "flex": check_flex, "gdn": check_gdn, "step": check_step, "hybrid": check_hybrid,
          "check": check_packing_on_device, "trie": check_trie}


def _version(package: str) -> str | None:
    try:
        return importlib.import_module(package).__version__
    except ImportError:
        return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (a smoke run of the same code)")
    ap.add_argument("--checks", nargs="+", choices=sorted(CHECKS), default=list(CHECKS))
    ap.add_argument("--tokens", type=int, default=8192, help="tokens of the pack the kernel checks use")
    ap.add_argument("--step-tokens", type=int, nargs="+", default=[4096, 16384], help="pack lengths of the step timing")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--mfu-tokens", type=int, nargs="+", default=[2048, 4096, 16384, 32768],
                    help="pack lengths of the MFU table")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--markdown", help="write the MFU and paths tables as Markdown here")
    args = ap.parse_args(argv)
    args.ceiling_tflops = None  # set by the ceiling check, read by the MFU one
    if args.quick:
        args.tokens, args.step_tokens, args.mfu_tokens, args.repeats = 512, [256], [256], 1
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA device: run with --device cpu for a smoke run (the GPU checks need a GPU)")
    dev = torch.device(args.device)
    results, bad = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
                    "torch": torch.__version__, "transformers": _version("transformers"),
                    "date": time.strftime("%Y-%m-%d")}, []
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
        if name == "ceiling" and "tflops" in r:
            args.ceiling_tflops = r["tflops"]
        print(f"{name:>13}: {json.dumps({k: v for k, v in r.items() if not isinstance(v, dict)})}")
        for key, value in r.items():  # sub-results (the step check's sizes, the hybrid check's parts): a line each
            if isinstance(value, dict):
                print(f"{'':>15}{key}: {json.dumps(value)}")
        sys.stdout.flush()
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    if args.markdown:
        Path(args.markdown).write_text(gpu_proof.markdown(results))
    if bad:
        print(f"FAILED: {', '.join(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
