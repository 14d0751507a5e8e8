"""``to_bridge_batch`` / ``BridgeCollator`` (thdpack/integrations/megatron_bridge.py): a thdpack
batch in the keys Megatron-Bridge's training steps read (issue 13 §4).

Checked against megatron-bridge 0.6.2's own code (tests/megatron_env.py, tests/megatron_run.py):
the keys ``gpt_step.get_batch`` and ``vlm_step.get_batch`` read (taken from their source), the
``PackedSeqParams`` Bridge's ``get_packed_seq_params`` makes of the packed keys, and Bridge's
``GenericVisualInputs`` for the vision inputs; where Bridge's wheel cannot be had, those tests skip
(ids ending ``-missing``) and ``test_bridge_batch_has_the_written_keys`` still checks the written lists.
"""

from __future__ import annotations

import pytest
import torch

import megatron_env  # tests/megatron_env.py

import thdpack
from thdpack import ThdCollator, build_thd_batch
from thdpack.integrations.megatron_bridge import BridgeCollator, VisualInputs, to_bridge_batch

SAMPLES = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14]]
# what the steps read, written down (megatron-bridge 0.6.2, training/gpt_step.py get_batch +
# _CURRENT_PACKED_SEQ_*_KEYS): checked against the source where its wheel is here
SPEC_GPT_READS = ["attention_mask", "labels", "loss_mask", "position_ids", "tokens"]
SPEC_PACKED = ["cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded", "max_seqlen_q",
               "max_seqlen_kv"]


@pytest.mark.parametrize("cp_size", [1, 2])
def test_bridge_batch_is_the_pack(cp_size):
    """Tokens, target labels (ignored ones 0), loss mask, positions and boundaries of the pack, [1, T]."""
    thd = build_thd_batch([{"input_ids": s} for s in SAMPLES], cp_size=cp_size)
    b = to_bridge_batch(thd)
    t = thd.input_ids.numel()
    for key in ("tokens", "labels", "loss_mask", "position_ids"):
        assert b[key].shape == (1, t), key
    assert torch.equal(b["tokens"][0], thd.input_ids) and torch.equal(b["position_ids"][0], thd.position_ids)
    assert b["loss_mask"].dtype == torch.float32 and torch.equal(b["loss_mask"][0].bool(), thd.loss_mask)
    scored = thd.loss_mask
    assert torch.equal(b["labels"][0][scored], thd.labels[scored]) and (b["labels"][0][~scored] == 0).all()
    assert torch.equal(b["cu_seqlens_q"][0], thd.cu_seqlens)
    if cp_size > 1:  # samples padded to 2·cp: the layout is given
        assert torch.equal(b["cu_seqlens_q_padded"][0], thd.cu_seqlens_padded)
        assert torch.equal(b["cu_seqlens_kv_padded"][0], thd.cu_seqlens_padded)
    else:  # no sample padded: None, as Bridge leaves them (TransformerEngine's faster kernel)
        assert torch.equal(thd.cu_seqlens_padded, thd.cu_seqlens)
        assert b["cu_seqlens_q_padded"] is None and b["cu_seqlens_kv_padded"] is None
    assert b["max_seqlen_q"].item() == thd.max_seqlen and b["attention_mask"] is None
    assert "visual_inputs" not in b
    assert BridgeCollator(ThdCollator(cp_size=cp_size))([{"input_ids": s} for s in SAMPLES]).keys() == b.keys()


def test_bridge_batch_refuses_a_cp_shard():
    thd = build_thd_batch([{"input_ids": s} for s in SAMPLES], cp_size=2)
    with pytest.raises(ValueError, match="rank 1's shard .* collate the whole pack"):
        to_bridge_batch(thdpack.shard(thd, cp_size=2, cp_rank=1))


def test_bridge_batch_has_the_written_keys():
    """Every key of the written lists (SPEC_*: Bridge's steps' reads, copied from its source and checked
    against it in test_bridge_steps_read_it), and the vision inputs as a VisualInputs."""
    thd = build_thd_batch([{"input_ids": s} for s in SAMPLES], cp_size=2)
    thd.extras["pixel_values"] = torch.ones(4, 6)
    b = to_bridge_batch(thd)
    assert set(SPEC_GPT_READS + SPEC_PACKED) <= set(b)
    assert isinstance(b["visual_inputs"], VisualInputs) and "pixel_values" in b["visual_inputs"].normalized_for_model()


@pytest.mark.parametrize("site", [megatron_env.site_param()])
def test_bridge_steps_read_it(site):
    """Bridge's gpt_step / vlm_step find every key they read; its get_packed_seq_params gives
    thdpack's boundaries; its GenericVisualInputs carries the vision inputs."""
    (r,) = megatron_env.run(site, [{"kind": "bridge_steps", "samples": SAMPLES, "cp_size": 2}])
    keys = set(r["batch_keys"])
    assert set(r["gpt"]["get_batch_reads"]) <= keys
    assert set(r["vlm"]["get_batch_reads"]) - {"input_ids"} <= keys  # vlm_step: tokens, else input_ids
    packed = r["gpt"]["tuples"]["_CURRENT_PACKED_SEQ_PARAM_KEYS"]
    assert set(r["gpt"]["get_batch_reads"]) == set(SPEC_GPT_READS)  # the written lists are the source's
    assert set(packed) - {"total_tokens"} == set(SPEC_PACKED)
    assert set(packed) - {"total_tokens"} <= keys  # total_tokens: the steps set it for hybrid models
    assert set(r["vlm"]["tuples"]["_PACKED_SEQ_PARAM_KEYS"]) - {"total_tokens"} <= keys
    p, thd = r["params"], r["thd"]
    assert p["qkv_format"] == "thd"
    assert p["cu_seqlens_q"] == p["cu_seqlens_kv"] == thd["cu_seqlens"]
    assert p["cu_seqlens_q_padded"] == p["cu_seqlens_kv_padded"] == thd["cu_seqlens_padded"]
    assert p["max_seqlen_q"] == p["max_seqlen_kv"] == thd["max_seqlen"]
    assert r["visual_type"].endswith("visual_inputs.GenericVisualInputs")
    assert r["visual_kwargs"] == ["image_grid_thw", "pixel_values"]


@pytest.mark.parametrize("site", [megatron_env.site_param()])
def test_bridge_reads_an_unpadded_batch_without_padded_fields(site):
    """Bridge's own get_packed_seq_params on a batch with no sample padded: no padded fields,
    real boundaries as cu_seqlens_q (its legacy path does the same for pad_seq_to_mult 1). The batch
    alone: test_bridge_batch_is_the_pack[1]."""
    (r,) = megatron_env.run(site, [{"kind": "bridge_steps", "samples": SAMPLES, "cp_size": 1}])
    p, thd = r["params"], r["thd"]
    assert thd["cu_seqlens_padded"] == thd["cu_seqlens"] == p["cu_seqlens_q"] == p["cu_seqlens_kv"]
    assert p["cu_seqlens_q_padded"] is None and p["cu_seqlens_kv_padded"] is None
    assert p["max_seqlen_q"] == p["max_seqlen_kv"] == thd["max_seqlen"] and p["qkv_format"] == "thd"


def test_example_runs(monkeypatch, capsys, tmp_path):
    """examples/megatron_bridge.py: the offline build with Bridge's files and the recipe lines, and
    one online batch scored the way Bridge's gpt_step scores it."""
    pytest.importorskip("datasets")
    import runpy
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "examples" / "megatron_bridge.py"
    monkeypatch.setattr("sys.argv", [str(script), "--num-samples", "80", "--pack-size", "512", "--out", str(tmp_path)])
    runpy.run_path(str(script), run_name="__main__")
    out = capsys.readouterr().out
    assert (tmp_path / "packed" / "data-00000-of-00001.idx.parquet").is_file()
    assert f"packed_metadata_path='{tmp_path / 'packed' / 'bridge_metadata.json'}'" in out
    assert "pad_seq_to_mult=4" in out
    loss = float(out.split("loss ")[1].split()[0])
    assert loss == loss and loss > 0  # finite, positive
