"""DPO with packing: preference pairs packed several to a pack, both sequences of a pair in
the same pack, and the DPO loss equal to the unpacked per-pair computation. Runs on the CPU.

    python examples/dpo_packed.py [--num-pairs 64] [--pack-size 512] [--micro-batches 2]

Rows follow TRL's preference columns (``prompt`` / ``chosen`` / ``rejected``), here already
token ids (tokenize strings or messages with your tokenizer first). Each pair becomes two
rows, ``prompt + chosen`` at ``2k`` and ``prompt + rejected`` at ``2k+1``, with the prompt
tokens not targets. Steps:

1. plan packs that keep pairs together: ``TokenBudgetBatchSampler(groups=pair_groups(n))``;
2. the step's number of pairs, known before it runs (``sampler.step_items``);
3. per pack: policy and reference logits, ``sequence_logps``, ``dpo_loss`` normalised by the
   step's pairs; gradients accumulated over the micro-batches, one optimizer step;
4. the same loss computed pair by pair, unpacked, to show they agree.
"""

from __future__ import annotations

import argparse
import copy

import numpy as np
import torch

from thdpack import ThdCollator, TokenBudgetBatchSampler
from thdpack.demo.models import tiny_qwen3
from thdpack.integrations import packed_model
from thdpack.losses import dpo_loss, pair_groups, sequence_logps
from thdpack.integrations import to_hf_kwargs


def preference_pairs(num_pairs: int, vocab_size: int, seed: int = 0) -> list[dict]:
    """Seeded TRL-style pairs: ``prompt``, ``chosen``, ``rejected`` as int64 token arrays."""
    rng = np.random.default_rng(seed)
    ids = lambda n: rng.integers(3, vocab_size, int(n), dtype=np.int64)  # noqa: E731
    return [{"prompt": ids(rng.integers(4, 64)), "chosen": ids(rng.integers(1, 96)), "rejected": ids(rng.integers(1, 96))}
            for _ in range(num_pairs)]


def pair_rows(pairs: list[dict]) -> list[dict]:
    """Rows ``2k`` (prompt + chosen) and ``2k+1`` (prompt + rejected); prompt labels -100."""
    rows = []
    for pair in pairs:
        for answer in (pair["chosen"], pair["rejected"]):
            ids = np.concatenate([pair["prompt"], answer])
            labels = ids.copy()
            labels[: pair["prompt"].size] = -100
            rows.append({"input_ids": ids, "labels": labels})
    return rows


def packed_step(policy, reference, batches, num_pairs: int, beta: float) -> float:
    """Accumulate the gradient of one optimizer step over ``batches``; returns its DPO loss."""
    total = 0.0
    for batch in batches:
        kw = to_hf_kwargs(batch, include_labels=False, attn_implementation=policy.config._attn_implementation)
        policy_logps, _ = sequence_logps(policy(**kw).logits, batch)
        with torch.no_grad():
            reference_logps, _ = sequence_logps(reference(**kw).logits, batch)
        loss = dpo_loss(policy_logps, reference_logps, batch, beta, num_items=num_pairs)
        loss.backward()
        total += float(loss.detach())
    return total


@torch.no_grad()
def unpacked_loss(policy, reference, rows, row_ids, beta: float) -> float:
    """The step's DPO loss pair by pair, each sequence run alone (no thdpack)."""
    def logp(model, row):
        ids = torch.as_tensor(row["input_ids"])[None]
        labels = torch.as_tensor(row["labels"])[1:]
        logits = model(input_ids=ids, use_cache=False).logits[0, :-1]
        keep = labels != -100
        return torch.log_softmax(logits.double(), -1)[keep].gather(1, labels[keep][:, None]).sum()

    losses = []
    for k in sorted({i // 2 for i in row_ids}):
        c, r = rows[2 * k], rows[2 * k + 1]
        margin = (logp(policy, c) - logp(reference, c)) - (logp(policy, r) - logp(reference, r))
        losses.append(-torch.nn.functional.logsigmoid(beta * margin))
    return float(torch.stack(losses).mean())


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-pairs", type=int, default=64)
    parser.add_argument("--pack-size", type=int, default=512)
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--vocab-size", type=int, default=512)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    rows = pair_rows(preference_pairs(args.num_pairs, args.vocab_size))
    lengths = [r["input_ids"].size for r in rows]
    sampler = TokenBudgetBatchSampler(lengths, args.pack_size, groups=pair_groups(len(rows)),
                                      micro_batches=args.micro_batches, seed=0)
    items = sampler.step_items(0)  # every row has a response token, so samples = 2 · pairs
    num_pairs = items.samples // 2
    # DataLoader(rows, batch_sampler=sampler, collate_fn=ThdCollator()) yields these batches; the
    # packs are drawn here to know their dataset rows for the unpacked comparison
    packs = [pack for _, pack in zip(range(args.micro_batches), sampler)]
    collate = ThdCollator()
    batches = [collate([rows[i] for i in pack]) for pack in packs]
    row_ids = [i for pack in packs for i in pack]
    print(f"step 0: {len(batches)} packs, {len(row_ids)} sequences, {num_pairs} pairs "
          f"(most pairs in a pack: {max(b.num_samples for b in batches) // 2})")

    policy = tiny_qwen3(args.vocab_size, seed=0)
    reference = packed_model(copy.deepcopy(policy)).eval()  # copy first: packed_model wraps the instance
    policy = packed_model(policy)
    policy.train(False)  # no dropout in the tiny model; eval keeps the comparison exact
    with torch.no_grad():  # a policy that has moved away from the reference, as after some training
        for p in policy.parameters():
            p.add_(0.02 * torch.randn_like(p))
    packed = packed_step(policy, reference, batches, num_pairs, args.beta)
    alone = unpacked_loss(policy, reference, rows, row_ids, args.beta)
    torch.optim.SGD(policy.parameters(), lr=1.0).step()
    after = packed_step(policy, reference, batches, num_pairs, args.beta)
    print(f"dpo loss {packed:.6f} over {num_pairs} pairs (unpacked, pair by pair: {alone:.6f}; "
          f"|diff| {abs(packed - alone):.2e}); after one step {after:.6f}")
    return {"loss": packed, "unpacked": alone, "loss_after": after, "num_pairs": num_pairs,
            "max_per_pack": max(b.num_samples for b in batches)}


if __name__ == "__main__":
    main()
