"""The FLOPs of a checked step counted three ways: thdpack's count from the real sample lengths, torch's
``FlopCounterMode`` on the same packed forward, and a count of the pack as one sequence of its length."""

from __future__ import annotations

import numpy as np
import torch

from thdpack.check.report import FlopsCheck

GEMM_OPS = ("mm", "addmm", "bmm", "baddbmm")
# thdpack's terms that are no matrix multiply of weights (torch counts a ViT's patch embedding as a convolution)
NOT_GEMM_TERMS = ("core_attention", "mamba_scan", "vision_attention", "vision_window_attention", "vision_patch_embed")


def step_flops(model, kwargs, spans, tokens: int) -> FlopsCheck:
    """Forward FLOPs of ``model(**kwargs)`` (the packed call; its samples at ``spans`` of a ``tokens``-long
    stream): thdpack's (:func:`thdpack.flops.model_flops_breakdown` / 3, forward of forward + backward), torch's
    ``FlopCounterMode`` (its GEMM ops and the rest), and thdpack's count of one ``tokens``-long sequence; a
    VLM's vision tower counted from the call's ``image_grid_thw`` / ``video_grid_thw``."""
    from torch.utils.flop_counter import FlopCounterMode

    from thdpack.flops import model_flops_breakdown

    # autograd on (its module tracker hooks gradients; under no_grad it fails on hybrid layers), but nothing
    # kept for a backward that never runs: a 0.5B model's 2048-token step peaked at 9.7 GiB, now 4.3
    with _nothing_saved(), FlopCounterMode(display=False) as counter:
        model(**{k: v for k, v in kwargs.items() if k != "labels"})
    counts = counter.get_flop_counts().get("Global", {})
    gemm = sum(int(v) for op, v in counts.items() if str(op).split(".")[1] in GEMM_OPS)
    total = sum(int(v) for v in counts.values())
    lengths = [b - a for a, b in spans]
    grids = [torch.as_tensor(kwargs[k]).reshape(-1, 3).cpu() for k in ("image_grid_thw", "video_grid_thw")
             if kwargs.get(k) is not None]
    vision = {"vision_grid_thw": torch.cat(grids).numpy()} if grids else {}
    try:
        terms = model_flops_breakdown(model.config, sum(lengths), sum(n * n for n in lengths),
                                      seq_lens=np.array(lengths, dtype=np.int64), **vision)
        whole = model_flops_breakdown(model.config, tokens, tokens * tokens, seq_lens=np.array([tokens]), **vision)
    except (ValueError, TypeError, NotImplementedError) as exc:  # a config thdpack cannot count: torch's alone
        return FlopsCheck(0, 0, gemm, total - gemm, 0, note=f"thdpack cannot count it: {exc}")
    mine = sum(terms.values()) // 3
    mine_gemm = sum(v for k, v in terms.items() if k not in NOT_GEMM_TERMS) // 3
    return FlopsCheck(int(mine), int(mine_gemm), gemm, total - gemm, int(sum(whole.values()) // 3))


def _nothing_saved():
    """Autograd records the graph but keeps none of the tensors a backward would read."""
    return torch.autograd.graph.saved_tensors_hooks(lambda tensor: None, lambda saved: saved)
