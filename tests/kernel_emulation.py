"""The CUDA kernels transformers runs for Gated DeltaNet layers, emulated on the CPU for a test.

On CUDA, with flash-linear-attention and causal-conv1d installed, transformers hands a packed call's
boundaries to two kernels, and thdpack's ``packed_model`` leaves the layers to them (``_native``):

- causal-conv1d's ``causal_conv1d_fn(x, weight, bias, seq_idx=..., activation=...)``: ``x`` ``[B, C, T]``;
  output position ``t`` sums ``weight[:, k] * x[:, t - (W-1) + k]`` over the taps whose ``seq_idx`` equals
  ``t``'s (a sample starts from zeros); without ``seq_idx`` one sequence per row;
- fla's ``chunk_gated_delta_rule(q, k, v, g, beta, ..., cu_seqlens=...)``: each ``[cu[i], cu[i+1])`` of the
  one-row stream scanned alone from its own initial state (``[N, H, K, V]``); without ``cu_seqlens`` each row
  is one sequence.

On the CPU transformers' reference functions refuse those boundaries (they cannot honour them).
:func:`emulate_gdn_kernels` puts, for one test, CPU functions with exactly those semantics where the CUDA
dispatch would be (the modeling module's ``causal_conv1d_fn`` and ``torch_chunk_gated_delta_rule``) and makes
``packed_model`` treat the layers as native, so a check sees what a CUDA run would: a call that drops
``cu_seq_lens_q`` scans the whole stream as one sequence.
"""

from __future__ import annotations

import importlib
import inspect

import torch
import torch.nn.functional as F


def emulated_causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                              final_states_out=None, activation=None, **ignored):
    """causal-conv1d's ``causal_conv1d_fn`` semantics: ``x`` ``[B, C, T]``, ``weight`` ``[C, W]``, ``seq_idx``
    int ``[B, T]`` or None; ``[B, C, T]`` out."""
    if initial_states is not None or return_final_states:
        raise NotImplementedError("the emulation covers a packed training forward (no conv states)")
    width, length = weight.shape[-1], x.shape[-1]
    out = torch.zeros_like(x, dtype=weight.dtype)
    for k in range(width):
        shift = width - 1 - k  # tap k reads the token `shift` steps back
        if shift >= length:
            continue
        src = F.pad(x[..., : length - shift], (shift, 0)).to(weight.dtype)
        if seq_idx is not None and shift:
            ids = seq_idx.to(torch.long)
            same = F.pad(ids[..., : length - shift], (shift, 0), value=-1) == ids
            src = src * same[:, None, :]
        out = out + weight[:, k, None] * src
    if bias is not None:
        out = out + bias[:, None]
    if activation in ("silu", "swish"):
        out = F.silu(out)
    return out.to(x.dtype)


def emulated_chunk_gated_delta_rule(reference):
    """fla's ``chunk_gated_delta_rule`` semantics on top of transformers' torch ``reference`` scan (which scans
    each row of its inputs as one sequence)."""

    def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, cu_seqlens=None, **ignored):
        options = dict(output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        if scale is not None and scale != q.shape[-1] ** -0.5:
            raise NotImplementedError("the torch reference scales by head_dim ** -0.5 only")
        if cu_seqlens is None:
            return reference(q, k, v, g=g, beta=beta, initial_state=initial_state, **options)
        offsets = [int(x) for x in cu_seqlens.tolist()]
        outs, states = [], []
        for i, (a, b) in enumerate(zip(offsets[:-1], offsets[1:])):
            state = None if initial_state is None else initial_state[i : i + 1]
            o, s = reference(q[:, a:b], k[:, a:b], v[:, a:b], g=g[:, a:b], beta=beta[:, a:b],
                             initial_state=state, **options)
            outs.append(o)
            states.append(s)
        final = torch.cat(states) if output_final_state else None
        return torch.cat(outs, dim=1), final

    return chunk_gated_delta_rule


def emulate_gdn_kernels(monkeypatch, model_type: str) -> None:
    """For the current test: transformers' ``models.<model_type>`` Gated DeltaNet layers dispatch to the
    emulated kernels, and ``packed_model`` leaves them to those kernels (as on CUDA with the packages)."""
    modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    reference = inspect.unwrap(modeling.torch_chunk_gated_delta_rule)
    monkeypatch.setattr(modeling, "causal_conv1d_fn", emulated_causal_conv1d_fn)
    monkeypatch.setattr(modeling, "torch_chunk_gated_delta_rule", emulated_chunk_gated_delta_rule(reference))
    hybrid = importlib.import_module("thdpack.integrations.hybrid.packed_model")
    monkeypatch.setattr(hybrid, "_native", lambda family, device: family.kind == "gdn")
