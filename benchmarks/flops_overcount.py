"""How much a pack-length FLOPs count over-reports for windowed models at 32k packs (docs/flops.md).

    thdpack build --config configs/demo.yaml --output out/demo32k --pack-size 32768
    python benchmarks/flops_overcount.py out/demo32k

Without a dataset it plans seeded long-tailed lengths (lognormal, 16 to 32768 tokens) itself. For each
model: the attention over-count of ``Σ sᵢ²`` (``n_packs·pack_len²/Σ sᵢ²``), that of each sliding window
(``n_packs·G_w(pack_len)/Σ G_w(sᵢ)``, :func:`thdpack.flops.length_count`) and the whole-model factor of
:func:`thdpack.flops.overcount_report`. The configs are the published sizes of each model.
"""

from __future__ import annotations

import argparse

import numpy as np

import thdpack
from thdpack.flops import overcount_report

MODELS = {
    "Mistral-7B-v0.1 (window 4096, every layer)": {
        "model_type": "mistral", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 14336, "vocab_size": 32000,
        "sliding_window": 4096},
    "Gemma-3-12B (window 1024, 5 local : 1 global)": {
        "model_type": "gemma3_text", "hidden_size": 3840, "num_hidden_layers": 48, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 256, "intermediate_size": 15360, "vocab_size": 262208,
        "sliding_window": 1024, "sliding_window_pattern": 6},
    "gpt-oss-20b (window 128, alternating)": {
        "model_type": "gpt_oss", "hidden_size": 2880, "num_hidden_layers": 24, "num_attention_heads": 64,
        "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 2880, "num_local_experts": 32,
        "num_experts_per_tok": 4, "vocab_size": 201088, "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 12},
    "Qwen3-8B (full attention, for comparison)": {
        "model_type": "qwen3", "hidden_size": 4096, "num_hidden_layers": 36, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 12288, "vocab_size": 151936},
}


def pack_lengths(dataset: str | None, pack_size: int) -> tuple[list[np.ndarray], str]:
    """Each pack's real lengths: of a built packed dataset, or of a seeded long-tailed plan."""
    if dataset:
        from thdpack.offline.store.dataset import load_packed

        lens, offsets = load_packed(dataset).all_seq_lens()
        return [lens[a:b] for a, b in zip(offsets[:-1], offsets[1:])], dataset
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(7.0, 1.1, 20000), 16, pack_size).astype(np.int64)
    plan = thdpack.plan_packs(lengths, pack_size)
    return [plan.length[plan.pack_offsets[k]:plan.pack_offsets[k + 1]] for k in range(len(plan))], "lognormal(7, 1.1)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dataset", nargs="?", help="a packed dataset built by thdpack build (default: seeded lengths)")
    ap.add_argument("--pack-size", type=int, default=32768)
    args = ap.parse_args()
    packs, source = pack_lengths(args.dataset, args.pack_size)
    first = overcount_report(pack_lengths=packs, pack_len=args.pack_size)
    print(f"{source}: {first['n_packs']} packs of {args.pack_size}, {first['n_samples']} samples, "
          f"{first['real_tokens']:,} real tokens, Σ sᵢ² = {first['seqlen_squared_sum']:,}")
    print(f"| model | Σ sᵢ² | window layers | whole model |\n| --- | --- | --- | --- |")
    for name, config in MODELS.items():
        r = overcount_report(pack_lengths=packs, pack_len=args.pack_size, config=config)
        windows = ", ".join(f"{k.split('[')[1][:-1]}: {v['overcount']:.2f}x" for k, v in r.get("length_counts", {}).items())
        print(f"| {name} | {r['attention']:.2f}x | {windows or '-'} | {r['model']:.3f}x |")


if __name__ == "__main__":
    main()
