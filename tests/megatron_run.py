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
        thdpack's ``to_packed_seq_params(ThdBatch)`` with megatron-core importable; returns
        ``total_tokens``, ``seq_idx`` and ``cu_seqlens_q_padded`` of the ``PackedSeqParams`` it made
        (None where a field is None: the padded fields of a batch without padding).
    {"kind": "bridge_steps", "samples", "cp_size"}
        the keys Bridge's gpt_step / vlm_step read (from their source), and thdpack's
        ``to_bridge_batch`` of the samples' batch read through Bridge's ``get_packed_seq_params``.

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

    import thdpack
    from thdpack import build_thd_batch
    from thdpack.integrations import to_packed_seq_params

    batch = build_thd_batch([{"input_ids": ids} for ids in task["samples"]], cp_size=task["cp_size"])
    if task.get("cp_rank") is not None:
        batch = thdpack.shard(batch, cp_size=task["cp_size"], cp_rank=task["cp_rank"])
    params = to_packed_seq_params(batch)
    assert isinstance(params, PackedSeqParams), type(params)
    return {"total_tokens": params.total_tokens, "seq_idx": _list_or_none(params.seq_idx),
            "cu_seqlens_q_padded": _list_or_none(params.cu_seqlens_q_padded)}


def _list_or_none(tensor):
    return None if tensor is None else tensor.tolist()


def _step_keys(path: Path) -> dict:
    """What a Bridge training-step module reads of a batch, from its source: the module's
    ``*_KEYS`` tuples and the string keys ``get_batch`` takes with ``batch[...]`` / ``batch.get(...)``."""
    import ast

    tree = ast.parse(path.read_text())
    names: dict = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) and t.id.endswith("_KEYS") for t in node.targets):
            exec(compile(ast.Module([node], []), str(path), "exec"), {}, names)  # tuples of strings and other *_KEYS
    get_batch = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "get_batch")
    read = set()
    for node in ast.walk(get_batch):
        if isinstance(node, ast.Subscript) and getattr(node.value, "id", None) == "batch":
            if isinstance(node.slice, ast.Constant):
                read.add(node.slice.value)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                and getattr(node.func.value, "id", None) == "batch" and node.args and isinstance(node.args[0], ast.Constant)):
            read.add(node.args[0].value)
    return {"tuples": {k: list(v) for k, v in names.items()}, "get_batch_reads": sorted(read)}


def bridge_steps(task: dict) -> dict:
    """thdpack's ``to_bridge_batch`` read the way Bridge's gpt_step / vlm_step read a packed batch:
    the keys their source reads, ``get_packed_seq_params`` on the packed keys, ``visual_inputs``."""
    import torch
    from megatron.bridge.training.utils.packed_seq_utils import get_packed_seq_params

    import megatron.bridge.training as training
    from thdpack import build_thd_batch
    from thdpack.integrations.megatron_bridge import to_bridge_batch

    steps = Path(list(training.__path__)[0])
    gpt, vlm = _step_keys(steps / "gpt_step.py"), _step_keys(steps / "vlm_step.py")
    thd = build_thd_batch([{"input_ids": ids} for ids in task["samples"]], cp_size=task["cp_size"])
    thd.extras["pixel_values"] = torch.ones(4, 6)
    thd.extras["image_grid_thw"] = torch.tensor([[1, 2, 2]])
    batch = to_bridge_batch(thd)
    keys = gpt["tuples"]["_CURRENT_PACKED_SEQ_PARAM_KEYS"]
    params = get_packed_seq_params({k: batch[k] for k in keys if batch.get(k) is not None})
    visual = batch["visual_inputs"]
    return {
        "gpt": gpt, "vlm": vlm, "batch_keys": sorted(batch),
        "shapes": {k: list(v.shape) for k, v in batch.items() if isinstance(v, torch.Tensor)},
        "params": {"cu_seqlens_q": params.cu_seqlens_q.tolist(), "cu_seqlens_kv": params.cu_seqlens_kv.tolist(),
                   "cu_seqlens_q_padded": _list_or_none(params.cu_seqlens_q_padded),
                   "cu_seqlens_kv_padded": _list_or_none(params.cu_seqlens_kv_padded),
                   "max_seqlen_q": params.max_seqlen_q, "max_seqlen_kv": params.max_seqlen_kv,
                   "qkv_format": params.qkv_format},
        "visual_type": type(visual).__module__ + "." + type(visual).__name__,
        "visual_kwargs": sorted(visual.normalized_for_model()),
        "thd": {"cu_seqlens": thd.cu_seqlens.tolist(), "cu_seqlens_padded": thd.cu_seqlens_padded.tolist(),
                "max_seqlen": thd.max_seqlen},
    }


if __name__ == "__main__":
    _stub_packages()
    tasks = json.loads(sys.stdin.read())  # a list of tasks: one interpreter start for all of them
    kinds = {"bridge_collate": bridge_collate, "packed_seq_params": packed_seq_params,
             "thdpack_packed_seq_params": thdpack_packed_seq_params, "bridge_steps": bridge_steps}
    print(json.dumps([kinds[task["kind"]](task) for task in tasks]))
