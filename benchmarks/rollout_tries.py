"""Benchmark: multi-turn rollouts packed as tries vs one shared prompt vs unshared (issue 46).

    python benchmarks/rollout_tries.py            # 8 groups of 8 rollouts, lengths / 4, CPU step timing
    python benchmarks/rollout_tries.py --scale 1  # the lengths below (a step of minutes on a CPU)
    python benchmarks/rollout_tries.py --quick    # 4 groups, lengths / 8, one repeat (CI)
    python benchmarks/rollout_tries.py --models qwen3_5 --timer cpu   # one model, CPU time (a loaded machine)

Synthetic agent rollouts, seeded: a group of ``--rollouts`` (8) shares a task prompt (lognormal, mean 400
tokens), then runs 2-6 turns (agent turn + tool answer, lognormal, mean 120 tokens, σ 0.9: long-tailed);
after each turn the group's live branches split in two with probability ``--branch`` (0.5), and rollouts on
one branch share the turn's tokens. Every rollout trains on its turns (not on the prompt).

Layouts of the same samples, one pack per group: ``unshared`` (every rollout whole), ``one level`` (the task
prompt once: ``share_prefix`` with the declared ``prefix_len``), ``trie`` (every shared turn once:
``share_prefix`` without it). Columns: real stream tokens (what the MLP and projections see), the ratio to
unshared, and the ceiling (each group's distinct tokens / all its tokens, what a perfect trie lays out).
Step time, per model of ``--models`` (default both): forward + backward of the token-mean ``packed_loss`` over
every group's pack, best of ``--repeats``, one thread (wall clock, or with ``--timer cpu`` the process's CPU
time: steadier on a shared machine); the three losses must agree (exit 1 otherwise):

- ``qwen3``: a small Qwen3 (4 layers, hidden 256, sdpa);
- ``qwen3_5``: a small Qwen3.5 of the same size (three Gated DeltaNet layers, one attention layer, sdpa) through
  ``thdpack.integrations.packed_model``: on a trie each Gated DeltaNet layer runs every segment from its parent's
  final state (issue 46 point 3); on a CPU transformers' torch scan (flash-linear-attention's kernels on a GPU).

``--quick`` makes the Qwen3.5 smaller (2 layers, hidden 128) so the smoke test stays fast.

Then the FLOPs the unshared count over-states (``thdpack.flops.overcount.trie_overcount``, summed over the groups):
tokens laid out, the tree's attention ``Σ`` (every segment against its ancestors) and each model's FLOPs, each
layout against the samples counted unshared.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch

from thdpack import build_thd_batch
from thdpack.flops import lengths_squared_sum, model_flops
from thdpack.flops.overcount import trie_overcount
from thdpack.integrations import packed_model, to_hf_kwargs
from thdpack.losses import packed_loss

VOCAB = 4096


def _length(rng, mean: float, sigma: float, low: int, high: int) -> int:
    return int(np.clip(rng.lognormal(np.log(mean) - sigma ** 2 / 2, sigma), low, high))


def rollout_group(rng, group: int, rollouts: int, branch: float, scale: float) -> tuple[list[dict], int]:
    """One group's rollouts (samples with ``group`` / ``prefix_len`` fields) and its distinct token count."""
    prompt = rng.integers(1, VOCAB, _length(rng, 400 / scale, 0.5, 8, 4096)).tolist()
    paths = [[list(range(rollouts)), list(prompt), [-100] * len(prompt)]]  # [members, ids, labels]
    distinct = len(prompt)
    for _ in range(int(rng.integers(2, 7))):
        grown = []
        for members, ids, labels in paths:
            split = len(members) > 1 and rng.random() < branch
            parts = np.array_split(rng.permutation(members), 2) if split else [np.array(members)]
            for part in parts:
                turn = rng.integers(1, VOCAB, _length(rng, 120 / scale, 0.9, 1, 2048)).tolist()
                distinct += len(turn)
                grown.append([part.tolist(), ids + turn, labels + turn])
        paths = grown
    samples = [None] * rollouts
    for members, ids, labels in paths:
        for m in members:
            samples[m] = {"input_ids": ids, "labels": labels, "group": group, "prefix_len": len(prompt)}
    return samples, distinct


def layouts(samples: list[dict]) -> dict:
    """The three batches of one group's samples."""
    plain = [{k: s[k] for k in ("input_ids", "labels")} for s in samples]
    return {"unshared": build_thd_batch(plain),
            "one level": build_thd_batch(samples, share_prefix="group", min_prefix_len=1),
            "trie": build_thd_batch([{k: v for k, v in s.items() if k != "prefix_len"} for s in samples],
                                    share_prefix="group", min_prefix_len=1)}


def small_qwen3(quick: bool = False):
    import transformers

    cfg = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                   max_position_embeddings=32768, attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.Qwen3ForCausalLM(cfg)


def small_qwen3_5(quick: bool = False):
    """A small Qwen3.5 (Gated DeltaNet + attention) through ``packed_model``: 4 layers of hidden 256 (one of
    them attention), as the Qwen3; with ``quick`` 2 layers of hidden 128."""
    import transformers

    h, d, layers = (128, 32, ["linear_attention", "full_attention"]) if quick else (
        256, 64, ["linear_attention"] * 3 + ["full_attention"])
    cfg = transformers.Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=h, intermediate_size=3 * h, num_hidden_layers=len(layers), layer_types=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=d, linear_conv_kernel_dim=4, linear_key_head_dim=d,
        linear_value_head_dim=d, linear_num_key_heads=2, linear_num_value_heads=4, max_position_embeddings=32768,
        tie_word_embeddings=False, pad_token_id=0, bos_token_id=None, eos_token_id=None)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return packed_model(transformers.Qwen3_5ForCausalLM(cfg))


MODELS = {"qwen3": small_qwen3, "qwen3_5": small_qwen3_5}


def flops_over(batches, config) -> dict:
    """``trie_overcount`` of every group's batch summed (the unshared layout: its own counts, nothing over):
    ``{"tokens", "unshared_tokens", "attention", "unshared_attention", "model", "unshared_model"}``."""
    out = dict.fromkeys(("tokens", "unshared_tokens", "attention", "unshared_attention", "model", "unshared_model"), 0)
    for batch in batches:
        if batch.prefix_tree is None:
            tokens, sq = batch.num_tokens, lengths_squared_sum(batch.seq_lens)
            counts = dict(tokens=tokens, unshared_tokens=tokens, attention=sq, unshared_attention=sq,
                          model=model_flops(config, tokens, sq), unshared_model=model_flops(config, tokens, sq))
        else:
            r = trie_overcount(batch, config)
            counts = dict(tokens=r.tokens, unshared_tokens=r.unshared_tokens, attention=r.attention,
                          unshared_attention=r.unshared_attention, model=r.model_flops,
                          unshared_model=r.unshared_model_flops)
        for key, value in counts.items():
            out[key] += value
    return out


def step(model, batches, timer=time.perf_counter) -> tuple[float, float]:
    """Forward + backward of the token-mean loss over ``batches``: (seconds of ``timer``, summed loss)."""
    start, total = timer(), 0.0
    items = sum(b.num_targets for b in batches)
    for batch in batches:
        logits = model(**to_hf_kwargs(batch, attn_implementation="sdpa", include_labels=False), use_cache=False).logits[0]
        loss = packed_loss(logits, batch, "token", num_items=items)
        loss.backward()
        total += float(loss.detach())
    return timer() - start, total


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--scale", type=float, default=4.0, help="divide every length by this (a CPU step)")
    ap.add_argument("--rollouts", type=int, default=8)
    ap.add_argument("--branch", type=float, default=0.5)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--models", default="qwen3,qwen3_5", help="comma-separated: " + ", ".join(MODELS))
    ap.add_argument("--quick", action="store_true", help="4 groups, lengths / 8, one repeat, a smaller Qwen3.5 (CI)")
    ap.add_argument("--timer", choices=("wall", "cpu"), default="wall",
                    help="wall clock (default) or the process's CPU time (a shared, loaded machine)")
    args = ap.parse_args(argv)
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = sorted(set(names) - set(MODELS))
    if unknown or not names:
        ap.error(f"--models: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(MODELS)}")
    scale = 8.0 if args.quick else args.scale
    groups = 4 if args.quick else args.groups
    torch.set_num_threads(1)
    rng = np.random.default_rng(args.seed)
    made = [rollout_group(rng, g, args.rollouts, args.branch, scale) for g in range(groups)]
    per_layout = {name: [] for name in ("unshared", "one level", "trie")}
    for samples, _ in made:
        for name, batch in layouts(samples).items():
            per_layout[name].append(batch)
    tokens = {name: sum(b.num_tokens for b in bs) for name, bs in per_layout.items()}
    ceiling = sum(d for _, d in made) / tokens["unshared"]
    models = {name: MODELS[name](args.quick) for name in names}
    timer = time.process_time if args.timer == "cpu" else time.perf_counter
    times = {m: {} for m in names}
    worst = {}
    for m, model in models.items():
        losses = {}
        for name, batches in per_layout.items():
            runs = [step(model, batches, timer) for _ in range(1 if args.quick else args.repeats)]
            times[m][name], losses[name] = min(t for t, _ in runs), runs[0][1]
        worst[m] = max(abs(losses[n] - losses["unshared"]) / abs(losses["unshared"]) for n in losses)

    print(f"{groups} groups of {args.rollouts} rollouts; ceiling (distinct / all tokens) {ceiling:.3f}; "
          f"step seconds: {'CPU time' if args.timer == 'cpu' else 'wall clock'}, one thread")
    print(f"{'layout':<10} {'tokens':>9} {'/unshared':>9}" + "".join(f" {m + ' s':>10} {'speed-up':>8}" for m in names))
    for name in per_layout:
        print(f"{name:<10} {tokens[name]:>9,} {tokens[name] / tokens['unshared']:>9.3f}"
              + "".join(f" {times[m][name]:>10.2f} {times[m]['unshared'] / times[m][name]:>8.2f}" for m in names))
    for m in names:
        print(f"{m}: losses agree to {worst[m]:.1e} (relative)")

    print("\nWhat counting the samples unshared over-states (trie_overcount, summed over the groups):")
    print(f"{'layout':<10} {'tokens':>9} {'Σ attention':>12} {'tokens x':>9} {'attention x':>11}"
          + "".join(f" {m + ' FLOPs x':>14}" for m in names))
    for name, batches in per_layout.items():
        over = {m: flops_over(batches, model.config) for m, model in models.items()}
        f = next(iter(over.values()))
        print(f"{name:<10} {f['tokens']:>9,} {f['attention']:>12,} {f['unshared_tokens'] / f['tokens']:>9.3f} "
              f"{f['unshared_attention'] / f['attention']:>11.3f}"
              + "".join(f" {over[m]['unshared_model'] / over[m]['model']:>14.3f}" for m in names))
    print("group 0's trie, trie_overcount(batch, config) with the first model's config:")
    for line in trie_overcount(per_layout["trie"][0], next(iter(models.values())).config).lines():
        print("  " + line)
    return 0 if max(worst.values()) < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
