"""Benchmark: how evenly PyTorch native context parallel spreads a pack's attention work over the CP ranks,
with torch's own per-document balancer against thdpack's indices.

    python benchmarks/torch_cp_balance.py                 # 50 packs of 12 lognormal documents, cp 2 4 8
    python benchmarks/torch_cp_balance.py --packs 200 --docs 24 --cp 2 4

torch shards the rearranged buffer ``x[rearrange]`` into ``cp`` contiguous pieces (rank ``r`` gets piece
``r``). A query token at position ``t`` of its document attends to ``t + 1`` keys (document-causal), so a
rank's work is the sum of ``t + 1`` over its queries. The table gives the most loaded rank's work over the
mean, per pack (mean and worst over the packs), for the rearrange indices of torch 2.13's
``_PerDocumentHeadTailLoadBalancer._generate_indices`` and of :func:`thdpack.torch_cp_indices`. Documents
are padded to multiples of ``2·cp`` (both balancers need it). Exits 1 if thdpack's ranks are not balanced
to within 1%.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import torch

from thdpack import torch_cp_indices


def rank_work(lengths: np.ndarray, rearrange: torch.Tensor, cp: int) -> np.ndarray:
    """float64 ``[cp]``: the causal (query, key) pairs of each rank's contiguous piece of ``x[rearrange]``."""
    position = np.concatenate([np.arange(n) for n in lengths])  # each slot's position in its document
    keys = (position + 1)[rearrange.numpy()]
    return keys.reshape(cp, -1).sum(1).astype(np.float64)


def torch_rearrange(lengths, cp: int) -> torch.Tensor:
    from torch.distributed.tensor.experimental._context_parallel import _load_balancer as lb

    return lb._PerDocumentHeadTailLoadBalancer([list(map(int, lengths))], cp, "cpu")._generate_indices()[0].long()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--packs", type=int, default=50)
    ap.add_argument("--docs", type=int, default=12, help="documents per pack")
    ap.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    print(f"max / mean causal work per CP rank over {args.packs} packs of {args.docs} lognormal(6, 1) documents")
    print(f"{'cp':>3} {'torch mean':>11} {'torch worst':>12} {'thdpack mean':>13} {'thdpack worst':>14}")
    ok = True
    for cp in args.cp:
        rng = np.random.default_rng(args.seed)
        ratios = {"torch": [], "thdpack": []}
        for _ in range(args.packs):
            raw = np.clip(rng.lognormal(6.0, 1.0, args.docs), 1, 8192).astype(np.int64)
            lengths = -(-raw // (2 * cp)) * (2 * cp)
            cu = [0, *np.cumsum(lengths).tolist()]
            for name, rearrange in (("torch", torch_rearrange(lengths, cp)), ("thdpack", torch_cp_indices(cu, cp)[0])):
                work = rank_work(lengths, rearrange, cp)
                ratios[name].append(work.max() / work.mean())
        t, m = np.array(ratios["torch"]), np.array(ratios["thdpack"])
        ok &= bool(m.max() <= 1.01)
        print(f"{cp:>3} {t.mean():>11.3f} {t.max():>12.3f} {m.mean():>13.3f} {m.max():>14.3f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
