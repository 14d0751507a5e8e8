"""The FLOPs of a checked step counted three ways: thdpack's count from the real sample lengths, torch's
``FlopCounterMode`` on the same packed forward, and a count of the pack as one sequence of its length."""

from __future__ import annotations

import numpy as np
import torch

from thdpack.check.report import FlopsCheck

GEMM_OPS = ("mm", "addmm", "bmm", "baddbmm")
NOT_GEMM_TERMS = ("core_attention", "mamba_scan")  # thdpack's terms that are no matrix multiply of weights


def step_flops(model, kwargs, spans, tokens: int) -> FlopsCheck:
    """Forward FLOPs of ``model(**kwargs)`` (the packed call; its samples at ``spans`` of a ``tokens``-long
    stream): thdpack's (:func:`thdpack.flops.model_flops_breakdown` / 3, forward of forward + backward), torch's
    ``FlopCounterMode`` (its GEMM ops and the rest), and thdpack's count of one ``tokens``-long sequence."""
    from torch.utils.flop_counter import FlopCounterMode

    from thdpack.flops import model_flops_breakdown

    with FlopCounterMode(display=False) as counter:  # autograd on: its module tracker hooks gradients
        model(**{k: v for k, v in kwargs.items() if k != "labels"})
    counts = counter.get_flop_counts().get("Global", {})
    gemm = sum(int(v) for op, v in counts.items() if str(op).split(".")[1] in GEMM_OPS)
    total = sum(int(v) for v in counts.values())
    lengths = [b - a for a, b in spans]
    try:
        terms = model_flops_breakdown(model.config, sum(lengths), sum(n * n for n in lengths),
                                      seq_lens=np.array(lengths, dtype=np.int64))
        whole = model_flops_breakdown(model.config, tokens, tokens * tokens, seq_lens=np.array([tokens]))
    except (ValueError, TypeError, NotImplementedError):  # a config thdpack cannot count: torch's numbers alone
        return FlopsCheck(0, 0, gemm, total - gemm, 0)
    mine = sum(terms.values()) // 3
    mine_gemm = sum(v for k, v in terms.items() if k not in NOT_GEMM_TERMS) // 3
    return FlopsCheck(int(mine), int(mine_gemm), gemm, total - gemm, int(sum(whole.values()) // 3))
