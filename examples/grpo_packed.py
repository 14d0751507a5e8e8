"""One GRPO step as an RL trainer runs it: rollouts made on each rank -> ``thdpack.rebalance`` (the
ranks' rollouts dealt by cost, each group's prompt laid out once) -> ``thdpack.losses`` on the
shared-prefix packs -> ``handle.restore`` of per-rollout values to the rank and order they came from.
CPU, a tiny random Qwen3 (sdpa: the packs' tree masks).

    python examples/grpo_packed.py [--num-prompts 16] [--group-size 4] [--reduction token]
    torchrun --nproc-per-node 4 examples/grpo_packed.py    # 4 gloo ranks, each with its own rollouts

Without ``torch.distributed`` (plain ``python``) the step is world size 1: ``rebalance`` plans the
rank's rollouts into packs and sends nothing. Under ``torchrun`` each rank makes its own rollouts
(seeded by its rank) and the collectives run over ``gloo``.

Steps:

1. rollouts: ``--group-size`` completions of each of the rank's prompts (``input_ids``, ``labels``
   with the prompt -100, ``group``: the prompt, a toy ``reward``, a ``domain``); advantages
   ``thdpack.losses.group_advantages`` (``(r − mean_g) / (std_g + eps)``: a group is on one rank);
2. ``thdpack.rebalance(rollouts, pack_size, micro_batches=M, share_prefix="group", ...)``: the
   lengths and each group's prompt length all-gathered, one ``plan_balanced`` on every rank (the
   prompt counted once per group), one all-to-all of the rollouts; every rank gets ``S·M`` packs in
   which a group's prompt is laid out once, its completions after it;
3. ``policy_gradient_loss(logits, batch, batch.token_values("advantage"), reduction, num_items)``,
   ``num_items`` the step's over every rank (``all_reduce_items(count_items(batches))``); on a
   shared-prefix pack the prompt's last row scores every member's first token (docs/losses.md);
4. ``handle.restore(sequence_logps)``: one log-prob per rollout back on the rank that made it, in its
   order, checked against each rollout run alone; the loss against the same sum sample by sample.
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import torch

import thdpack
from thdpack.demo.models import tiny_qwen3
from thdpack.integrations import packed_model
from thdpack.losses import all_reduce_items, count_items, group_advantages, policy_gradient_loss, sequence_logps
from thdpack.integrations import to_hf_kwargs

DOMAINS = ("math", "code", "chat")


def rl_rows(num_prompts: int, group_size: int, vocab_size: int, seed: int = 0) -> list[dict]:
    """``group_size`` completions per prompt: ``input_ids``, ``labels`` (prompt -100), ``group``,
    ``reward`` (a toy one: the share of even tokens in the completion), ``domain``."""
    rng = np.random.default_rng(seed)
    rows = []
    for g in range(num_prompts):
        prompt = rng.integers(3, vocab_size, int(rng.integers(16, 96)))
        domain = int(rng.integers(0, len(DOMAINS)))
        for _ in range(group_size):
            completion = rng.integers(3, vocab_size, int(rng.integers(2, 48)))
            ids = np.concatenate([prompt, completion])
            labels = ids.copy()
            labels[: prompt.size] = -100
            rows.append({"input_ids": ids, "labels": labels, "group": g, "domain": domain,
                         "reward": float((completion % 2 == 0).mean())})
    return rows


def packed_step(model, batches, reduction: str, num_items: int) -> tuple[float, torch.Tensor, dict]:
    """Accumulate the rank's gradient of one step; returns its share of the loss, the per-rollout
    ``sequence_logps`` of its packs (concatenated, batch order) and per-domain (NLL sum, tokens)."""
    total, logps, nll = 0.0, [], {d: [0.0, 0] for d in range(len(DOMAINS))}
    for batch in batches:
        kw = to_hf_kwargs(batch, include_labels=False, attn_implementation=model.config._attn_implementation)
        logits = model(**kw).logits
        loss = policy_gradient_loss(logits, batch, batch.token_values("advantage"), reduction, num_items)
        loss.backward()
        total += float(loss.detach())
        with torch.no_grad():
            per_sample, per_token = sequence_logps(logits, batch)[0], thdpack.losses.token_logps(logits, batch)
            logps.append(per_sample)
            # the domain of every target: [N] table entries on a shared-prefix pack, [T] rows (masked) otherwise
            domain = batch.token_values("domain")
            mask = batch.loss_mask if batch.prefix_tree is None else torch.ones_like(domain, dtype=torch.bool)
            for d in nll:
                keep = mask & (domain == d)
                nll[d][0] -= float(per_token[keep].sum())
                nll[d][1] += int(keep.sum())
    return total, torch.cat(logps), nll


@torch.no_grad()
def alone_logps(model, rows) -> torch.Tensor:
    """Each rollout's summed target log-prob, run alone (no thdpack)."""
    out = []
    for r in rows:
        ids = torch.as_tensor(r["input_ids"])
        targets = torch.as_tensor(r["labels"])[1:]
        logits = model(input_ids=ids[None], use_cache=False).logits[0, :-1].double()
        keep = targets != -100
        out.append(torch.log_softmax(logits, -1)[keep].gather(1, targets[keep][:, None]).sum())
    return torch.stack(out)


def unpacked_loss_sum(rows, reduction: str) -> float:
    """This rank's on-policy PG loss numerator sample by sample (``−A`` per target token, or per sample
    with a target): the step's loss is its sum over ranks / ``num_items``."""
    total = 0.0
    for r in rows:
        n = int((np.asarray(r["labels"])[1:] != -100).sum())
        total += -r["advantage"] * (n if reduction == "token" else float(n > 0))
    return total


def all_reduce_sum(values: list[float]) -> list[float]:
    """``values`` summed over the ranks (themselves without torch.distributed)."""
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t)
    return t.tolist()


def init_distributed() -> None:
    """gloo over torchrun's environment (``RANK`` / ``WORLD_SIZE``); nothing under plain ``python``."""
    import torch.distributed as dist

    if "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=16, help="prompts per rank")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--pack-size", type=int, default=256)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--min-prefix-len", type=int, default=8)
    parser.add_argument("--reduction", default="token", choices=["token", "sample"])
    parser.add_argument("--vocab-size", type=int, default=512)
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(1)
    init_distributed()
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    rows = rl_rows(args.num_prompts, args.group_size, args.vocab_size, seed=rank)  # this rank's rollouts
    advantages = group_advantages([r["reward"] for r in rows], [r["group"] for r in rows])
    for r, a in zip(rows, advantages.tolist()):
        r["advantage"] = a
    model = packed_model(tiny_qwen3(args.vocab_size, seed=0).eval())  # the same weights on every rank

    batches, handle = thdpack.rebalance(
        rows, args.pack_size, micro_batches=args.micro_batches, cost=thdpack.CostModel.from_config(model.config),
        share_prefix="group", min_prefix_len=args.min_prefix_len, sample_values=["advantage", "domain"],
    )
    num_items = all_reduce_items(count_items(batches, args.reduction))  # the whole step's, known before it runs
    real = [b for b, filler in zip(batches, handle.filler) if not filler]
    tokens = sum(b.num_tokens for b in real)  # each group's prompt once; unshared: every rollout's whole length
    unshared = sum(b.num_tokens if b.prefix_tree is None else b.prefix_tree.unshared_rows.numel() for b in real)
    print(f"step 0 (rank {rank} of {handle.world_size}): {len(rows)} rollouts made here, {len(batches)} packs run "
          f"here ({int(handle.filler.sum())} fillers, {sum(b.prefix_tree is not None for b in batches)} with "
          f"shared prompts), {tokens} tokens ({unshared} unshared), straggler {handle.straggler:.3f}; "
          f"num_items {num_items} ({args.reduction})")

    packed, logps, nll = packed_step(model, batches, args.reduction, num_items)
    mine = handle.restore(logps)  # [len(rows)]: this rank's rollouts, in their order
    diff = float((mine.double() - alone_logps(model, rows)).abs().max())
    packed, alone = all_reduce_sum([packed, unpacked_loss_sum(rows, args.reduction) / num_items])
    torch.optim.SGD(model.parameters(), lr=1.0).step()  # (under DDP the gradients would be all-reduced first)
    print(f"pg loss {packed:.6f} ({args.reduction}; unpacked, sample by sample: {alone:.6f}; "
          f"|diff| {abs(packed - alone):.2e})")
    print(f"sequence logps restored to this rank's {mine.numel()} rollouts: max |diff| vs each alone {diff:.2e}")
    sums = all_reduce_sum([v for d in nll for v in nll[d]])
    per_domain = {DOMAINS[d]: sums[2 * d] / sums[2 * d + 1] for d in nll if sums[2 * d + 1]}
    print("nll by domain: " + ", ".join(f"{k} {v:.4f}" for k, v in per_domain.items()))
    if dist.is_initialized():
        dist.destroy_process_group()
    return {"loss": packed, "unpacked": alone, "per_domain": per_domain, "logp_diff": diff, "tokens": tokens,
            "unshared_tokens": unshared}


if __name__ == "__main__":
    main()
