"""Megatron-Bridge reading thdpack's output: offline packs and online batches.

    python examples/megatron_bridge.py [--num-samples 400] [--pack-size 1024] [--cp-size 2] [--out DIR]

1. Offline: ``thdpack build --output-format megatron-bridge`` (here through ``build_packed`` on the
   bundled demo rows) writes Bridge's packed Parquet next to thdpack's data files; the script prints
   the ``PackedSequenceSpecs`` a Bridge recipe points at it with.
2. Online: ``BridgeCollator(ThdCollator(...))`` is a ``collate_fn`` whose batches carry the keys
   Bridge's ``gpt_step`` / ``vlm_step`` read (``tokens``, ``labels``, ``loss_mask``,
   ``position_ids``, ``cu_seqlens_q(_padded)``, ``max_seqlen_q``, ...). A recipe passes such a
   DataLoader to Bridge's training loop with micro batch size 1 (one pack per micro batch); with
   context parallelism the step shards each pack itself. The script checks one batch the way
   Bridge's step uses it: the loss Bridge computes (``masked_next_token_loss``: a mean over
   ``loss_mask``, no shift) on a tiny model, and, where megatron-bridge is installed, its own
   ``get_packed_seq_params``.

See docs/megatron.md.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader

import thdpack
from thdpack.integrations.megatron_bridge import BridgeCollator


def offline(out: Path, num_samples: int, pack_size: int, cp_size: int) -> None:
    from thdpack.demo import TOKENIZER_DIR, generate_rows, write_jsonl
    from thdpack.offline import BuildConfig, build_packed

    rows = write_jsonl(generate_rows(num_samples, seed=0, kind="chat"), out / "rows.jsonl")
    cfg = BuildConfig(input=str(rows), tokenizer=str(TOKENIZER_DIR), pack_size=pack_size, overflow="truncate",
                      cp_size=cp_size, output_format="megatron-bridge")
    result = build_packed(cfg, out / "packed", progress=False, overwrite=True)
    record = result.metadata["megatron_bridge"]
    entry = json.loads((result.path / record["metadata"]).read_text())[0]
    print(f"offline: {result.metadata['num_packs']} packs; Bridge files "
          f"{', '.join(f['path'] for f in record['files'])}; Bridge's metadata {entry}")
    print("Bridge recipe:\n"
          "    cfg.dataset.enable_offline_packing = True\n"
          "    cfg.dataset.offline_packing_specs = PackedSequenceSpecs(\n"
          f"        packed_sequence_size={pack_size},\n"
          f"        packed_train_data_path={str(result.path)!r},\n"
          f"        packed_metadata_path={str(result.path / record['metadata'])!r},\n"
          f"        pad_seq_to_mult={record['pad_seq_to_mult']},\n"
          "    )\n"
          f"    cfg.dataset.seq_length = {pack_size}   # and the model's context_parallel_size = {cp_size}")


def demo_samples(num_samples: int, vocab_size: int) -> list[dict]:
    """Seeded samples: a prompt (labels -100) then an answer that is trained on."""
    rng = np.random.default_rng(0)
    samples = []
    for p, a in zip(rng.integers(4, 60, num_samples), rng.integers(4, 200, num_samples)):
        ids = rng.integers(3, vocab_size, p + a)
        labels = ids.copy()
        labels[:p] = -100
        samples.append({"input_ids": ids, "labels": labels})
    return samples


def online(num_samples: int, pack_size: int, cp_size: int, vocab_size: int = 512) -> None:
    samples = demo_samples(num_samples, vocab_size)
    lengths = np.array([s["input_ids"].size for s in samples])
    align = thdpack.cp_pad_multiple(cp_size)
    sampler = thdpack.TokenBudgetBatchSampler(lengths, pack_size, align=align, seed=0)
    collate = BridgeCollator(thdpack.ThdCollator(cp_size=cp_size))  # the whole pack: Bridge shards it itself
    batch = next(iter(DataLoader(samples, batch_sampler=sampler, collate_fn=collate)))
    print("online: " + ", ".join(f"{k} {list(v.shape)}" for k, v in batch.items() if isinstance(v, torch.Tensor)))

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(vocab_size, 32), torch.nn.Linear(32, vocab_size))
    logits = model(batch["tokens"])  # [1, T, V]
    per_token = torch.nn.functional.cross_entropy(logits.view(-1, vocab_size), batch["labels"].view(-1),
                                                  reduction="none")
    mask = batch["loss_mask"].view(-1)
    loss = (per_token * mask).sum() / mask.sum()  # Bridge's masked_next_token_loss: labels are already shifted
    loss.backward()
    print(f"one step as Bridge's gpt_step scores it: loss {loss.item():.4f} over {int(mask.sum())} target tokens")
    try:
        from megatron.bridge.training.utils.packed_seq_utils import get_packed_seq_params
    except ImportError:
        print("megatron-bridge is not installed here: its step would call get_packed_seq_params on the cu_seqlens_* "
              "and max_seqlen_* keys (tests/test_megatron_bridge_steps.py runs it)")
        return
    keys = ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded", "max_seqlen_q",
            "max_seqlen_kv")
    print(f"Bridge's get_packed_seq_params: {get_packed_seq_params({k: batch[k] for k in keys})}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-samples", type=int, default=400)
    parser.add_argument("--pack-size", type=int, default=1024)
    parser.add_argument("--cp-size", type=int, default=2)
    parser.add_argument("--out", help="directory for the offline build (default: a temporary one)")
    args = parser.parse_args()
    if args.out:
        offline(Path(args.out), args.num_samples, args.pack_size, args.cp_size)
    else:
        with tempfile.TemporaryDirectory() as d:
            offline(Path(d), args.num_samples, args.pack_size, args.cp_size)
    online(args.num_samples, args.pack_size, args.cp_size)


if __name__ == "__main__":
    main()
