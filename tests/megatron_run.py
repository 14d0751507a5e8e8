"""Run Megatron-Bridge's / Megatron-core's own code on tasks read from stdin (a JSON list); print
a JSON list of answers. Started by ``tests/megatron_env.py:run`` with ``PYTHONPATH`` = the unpacked wheels.

Tasks:
    {"kind": "bridge_collate", "path", "pad_seq_to_mult", "eos_id", "max_seq_length", "batches": [[i, ...], ...]}
        builds ``GPTSFTPackedParquetDataset`` (megatron/bridge/data/packing/parquet.py) as Bridge's
        ``build_gpt_sft_split`` does (megatron/bridge/data/builders/gpt_sft.py) and returns its
        ``collate_fn([ds[i] for i in batch])`` for every batch, tensors as lists.
    {"kind": "packed_seq_params", "fields": {...}}
        ``megatron.core.packed_seq_params.PackedSeqParams(**fields)``; returns its ``seq_idx``.
    {"kind": "thdpack_packed_seq_params", "samples": [[ids], ...], "cp_size", "cp_rank"}
        thdpack's ``ThdBatch.to_packed_seq_params()`` with megatron-core importable; returns
        ``total_tokens``, ``seq_idx`` and ``cu_seqlens_q_padded`` of the ``PackedSeqParams`` it made.

What is stubbed, and why it is irrelevant to these tasks: the package ``__init__`` files of
``megatron.core``, ``megatron.bridge``, ``megatron.bridge.data``, ``megatron.bridge.training``
and ``megatron.training`` (they import the model zoo, the optimizer and triton kernels; the
modules below them load unchanged); ``megatron.bridge.utils.common_utils`` (distributed and
model-wrapping helpers; the dataset calls only ``get_local_rank_preinit``, used for JSONL
index building, never for Parquet); and ``MegatronTokenizer`` of
``megatron.bridge.training.tokenizers.tokenizer`` (a type annotation only; the dataset reads
``eos_id`` / ``eod`` of the tokenizer object, given here).
"""

import json
import sys
import types
from pathlib import Path


def _stub_packages() -> None:
    import megatron  # a namespace package: its directory on PYTHONPATH

    root = Path(list(megatron.__path__)[0]).parent
    for name in ("megatron.core", "megatron.bridge", "megatron.training", "megatron.bridge.data",
                 "megatron.bridge.training"):
        module = types.ModuleType(name)
        module.__path__ = [str(root / name.replace(".", "/"))]
        sys.modules[name] = module
    common = types.ModuleType("megatron.bridge.utils.common_utils")
    common.get_local_rank_preinit = lambda: 0
    sys.modules[common.__name__] = common
    tokenizer = types.ModuleType("megatron.bridge.training.tokenizers.tokenizer")
    tokenizer.MegatronTokenizer = type("MegatronTokenizer", (), {})
    sys.modules[tokenizer.__name__] = tokenizer


class _Tokenizer:
    """What the packed dataset reads of a tokenizer: its EOS id (``eos_id``, ``eod``)."""

    def __init__(self, eos_id: int):
        self.eos_id = self.eod = eos_id


def _lists(batch: dict) -> dict:
    out = {}
    for key, value in batch.items():
        out[key] = value.tolist() if hasattr(value, "tolist") else value
    return out


def bridge_collate(task: dict) -> dict:
    from megatron.bridge.data.packing.parquet import GPTSFTPackedParquetDataset

    ds = GPTSFTPackedParquetDataset(
        file_path=task["path"], tokenizer=_Tokenizer(task["eos_id"]), max_seq_length=task["max_seq_length"],
        pad_seq_to_mult=task["pad_seq_to_mult"], pad_cu_seqlens=False, pack_metadata_file_path=None,
        memmap_workers=1, hf_dataset=False, global_sample_mapping=False, add_bos=False, add_eos=True, add_sep=False,
        seed=1234, label_key="output", answer_only_loss=True, truncation_field="input", pad_to_max_length=False,
        index_mapping_dir=None, prompt_template="{input} {output}", truncation_method="right",
        get_attention_mask_from_fusion=True, prompt_completion_config=None, is_test=False,
    )
    return {"len": len(ds), "batches": [_lists(ds.collate_fn([ds[i] for i in b])) for b in task["batches"]]}


def packed_seq_params(task: dict) -> dict:
    import torch
    from megatron.core.packed_seq_params import PackedSeqParams

    fields = dict(task["fields"])
    for key in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        if fields.get(key) is not None:
            fields[key] = torch.tensor(fields[key], dtype=torch.int32)
    params = PackedSeqParams(**fields)
    seq_idx = params.seq_idx
    return {"seq_idx": None if seq_idx is None else seq_idx.tolist()}


def thdpack_packed_seq_params(task: dict) -> dict:
    """thdpack's ``to_packed_seq_params()`` with megatron-core's own ``PackedSeqParams`` importable:
    the batch of ``samples`` (token lists) at ``cp_size``, or rank ``cp_rank``'s shard of it."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from thdpack import build_thd_batch

    batch = build_thd_batch([{"input_ids": ids} for ids in task["samples"]], cp_size=task["cp_size"])
    if task.get("cp_rank") is not None:
        batch = batch.shard(task["cp_size"], task["cp_rank"])
    params = batch.to_packed_seq_params()
    assert isinstance(params, PackedSeqParams), type(params)
    return {"total_tokens": params.total_tokens, "seq_idx": None if params.seq_idx is None else params.seq_idx.tolist(),
            "cu_seqlens_q_padded": params.cu_seqlens_q_padded.tolist()}


if __name__ == "__main__":
    _stub_packages()
    tasks = json.loads(sys.stdin.read())  # a list of tasks: one interpreter start for all of them
    kinds = {"bridge_collate": bridge_collate, "packed_seq_params": packed_seq_params,
             "thdpack_packed_seq_params": thdpack_packed_seq_params}
    print(json.dumps([kinds[task["kind"]](task) for task in tasks]))
