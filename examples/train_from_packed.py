"""Train a tiny random-weight Qwen3 for a few steps from a packed dataset.

    thdpack build --config configs/demo.yaml --output out/demo
    python examples/train_from_packed.py out/demo [--steps 5] [--workers 1]

(If the packed dataset does not exist, the demo config builds it first.)

The DataLoader reads one pack per step with ``load_packed`` (memory-mapped Arrow),
and the dataset's collator turns it into a :class:`thdpack.ThdBatch` with the pad
token and the CP/TP alignment recorded at build time. With context parallelism,
pass ``collate_fn=ds.collator(cp_rank=rank)`` on each rank to get its shard.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from thdpack.demo.models import tiny_qwen3
from thdpack.flops import attention_overcount_factor, seqlen_squared_sum
from thdpack.integrations import packed_model
from thdpack.offline import load_packed
from thdpack.integrations import to_hf_kwargs

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", nargs="?", default="out/demo", help="packed dataset (thdpack build output)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--workers", type=int, default=1, help="DataLoader worker processes")
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args(argv)

    path = Path(args.path)
    if not path.exists():
        from thdpack.offline import BuildConfig, build_packed

        print(f"{path} does not exist: building it from configs/demo.yaml")
        build_packed(BuildConfig.from_yaml(ROOT / "configs" / "demo.yaml"), path, progress=False)

    ds = load_packed(path)
    print(ds)
    loader = DataLoader(
        ds,
        batch_size=None,  # every row is already a pack: one ThdBatch per step
        shuffle=True,
        num_workers=args.workers,
        collate_fn=ds.collator(),
        pin_memory=torch.cuda.is_available(),
        generator=torch.Generator().manual_seed(0),
    )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = packed_model(tiny_qwen3(ds.metadata["tokenizer"]["vocab_size"]).to(device))
    model.train()
    attn = model.config._attn_implementation  # the batch carries this backend's mask (sdpa: a 4D one)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)

    t0 = time.perf_counter()
    tokens, losses, skipped = 0, [], 0
    for batch in loader:
        if len(losses) == args.steps:
            break
        if batch.num_targets == 0:
            # a pack with no target token trains nothing, and its mean loss is 0/0 = NaN. Builds drop
            # such samples by default (without_targets: drop); one built with keep can still hold them.
            skipped += 1
            print(f"skip      pack of samples {batch.sample_index.tolist()[:4]}: no target token")
            continue
        batch = batch.to(device)
        out = model(**to_hf_kwargs(batch, attn_implementation=attn))
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        tokens += batch.num_tokens
        losses.append(out.loss.item())
        # attention work is Σ sᵢ² over the real samples, not pack_len²
        overcount = attention_overcount_factor(1, ds.pack_size, seqlen_squared_sum(batch))
        print(
            f"step {len(losses) - 1:3d}  loss {losses[-1]:.4f}  {batch.num_samples:2d} samples  "
            f"{batch.num_tokens} tokens  {batch.num_targets} targets  "
            f"(pack_len² would over-count attention {overcount:.1f}x)"
        )
    dt = time.perf_counter() - t0
    print(f"{len(losses)} steps, {tokens} tokens in {dt:.1f}s ({tokens / dt:,.0f} tokens/s on {device})"
          + (f"; skipped {skipped} packs without targets" if skipped else ""))
    return {"losses": losses, "skipped": skipped}


if __name__ == "__main__":
    main()
