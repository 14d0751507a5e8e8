"""``check_packing(model, samples, batch=...)`` on other collators' batches (issue 45 point 2).

The installed collators, not copies: transformers' ``DataCollatorWithFlattening`` (defaults and its options)
and TRL's padding-free ``DataCollatorForLanguageModeling``, on the same 3 samples, judged on tiny random
models (Qwen3 on eager / sdpa / flex / thdpack_varlen, the hybrids Bamba and Qwen3.5) as given or prepared
by ``packed_model``. Each case asserts what the installed libraries do: exact (and nothing flagged), or the
first module that differs (or the model's refusal) and, in order, what the call lacks. docs/check.md,
"Other collators' batches", shows three of these reports.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
sft = pytest.importorskip("trl.trainer.sft_trainer")

import thdpack  # noqa: E402
from hybrid_models import tiny_hybrid  # noqa: E402  (tests/hybrid_models.py)
from thdpack.integrations import packed_model, register_varlen_attention  # noqa: E402

VARLEN = register_varlen_attention()
VOCAB = 96
LENGTHS = [5, 9, 3]
Flattening = transformers.DataCollatorWithFlattening


def samples() -> list[dict]:
    rng = np.random.default_rng(0)
    out = []
    for n in LENGTHS:
        ids = rng.integers(1, VOCAB, n).tolist()
        out.append({"input_ids": ids, "labels": [-100] * (n // 3) + ids[n // 3:]})
    return out


def trl(batch_samples, **options):
    return sft.DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True, **options)(batch_samples)


def trl_bfd(batch_samples):
    """TRL's collator on one row packed by its BFD strategy (SFTTrainer(packing=True)): ``seq_lengths``."""
    row = {k: sum((s[k] for s in batch_samples), []) for k in ("input_ids", "labels")}
    return trl([dict(row, seq_lengths=LENGTHS)])


def trl_ones_mask(batch_samples):
    """A user's own: TRL's padding-free batch with an all-ones ``attention_mask`` added."""
    batch = trl(batch_samples)
    return dict(batch, attention_mask=torch.ones_like(batch["input_ids"]))


COLLATORS = {
    "flattening": lambda s: Flattening()(s),
    "flattening_no_positions": lambda s: Flattening(return_position_ids=False)(s),
    "flattening_flash": lambda s: Flattening(return_flash_attn_kwargs=True)(s),
    "flattening_flash_seq_idx": lambda s: Flattening(return_flash_attn_kwargs=True, return_seq_idx=True)(s),
    "flattening_separator_0": lambda s: Flattening(separator_id=0)(s),
    "trl_padding_free": trl,
    "trl_pad_to_8": lambda s: trl(s, pad_to_multiple_of=8),
    "trl_bfd_packed": trl_bfd,
    "trl_ones_mask": trl_ones_mask,
}


def tiny_qwen3(attn: str) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, initializer_range=0.2,
                                   attn_implementation=attn)
    return transformers.Qwen3ForCausalLM(cfg).eval()


MODELS = {"qwen3_eager": lambda: tiny_qwen3("eager"), "qwen3_sdpa": lambda: tiny_qwen3("sdpa"),
          "qwen3_flex": lambda: tiny_qwen3("flex_attention"), "qwen3_varlen": lambda: tiny_qwen3(VARLEN),
          "bamba_sdpa": lambda: tiny_hybrid.__wrapped__("bamba", "sdpa"),
          "qwen3_5_sdpa": lambda: tiny_hybrid.__wrapped__("qwen3_5_text", "sdpa")}

# what the call lacks (the start of each line boundary_problems gives)
MASK = "has no attention mask and use_cache is on (the config's default): transformers then gives {} one causal mask " \
       "over the whole row (it finds the samples from position_ids only without a cache){}: pass use_cache=False, " \
       "or prepare the model with thdpack.integrations.packed_model(model)"
UNREAD = "; {} never reads cu_seq_lens_q"
NO_POSITIONS = "has no position_ids: RoPE positions run on across the samples"
LABELS = "scores labels across a boundary: the label at the first token of sample(s) [1, 2] is [0], not -100"
PADDING_MASK = "has a [batch, tokens] attention_mask (a padding mask), with which transformers gives sdpa one causal"
NO_CU_VARLEN = "has no cu_seq_lens_q: thdpack_varlen reads the samples from cu_seq_lens_q only (not from position_ids)"
NO_SEQ_IDX = "has no seq_idx: the short convolution"
NO_CU_GDN = "has no cu_seq_lens_q: its Gated DeltaNet scans run over the whole row"
KERNELS = "carries hybrid boundaries, which transformers keeps apart only in CUDA kernels ({})"
CONV_REFUSED = "ValueError: `causal_conv1d_fn` can't keep packed sequences apart without `causal_conv1d`"
GDN_REFUSED = "ValueError: `chunk_gated_delta_rule` can't keep packed sequences apart without `flash-linear-attention`"
RESTARTS_REFUSED = "ValueError: {}: position_ids restart inside the row (a packed batch) but the call carries no"
NO_CACHE = {"use_cache": False}  # as TRL's SFTTrainer.compute_loss and transformers' Trainer run the model
OK = None


def mask(attn: str, unread: bool = False) -> str:
    return MASK.format(attn, UNREAD.format(attn) if unread else "")


# (model, collator, keywords added to the batch, packed_model first, expected): OK, or (where it first
# shows: a module, "loss (token mean)" or "refused: <the model's error>", the call's problems in order)
CASES = [
    # full attention, the model as given: the config's default use_cache=True loses the mask on sdpa / eager / flex
    ("qwen3_sdpa", "flattening", {}, False, ("model.layers.0.self_attn", [mask("sdpa")])),
    ("qwen3_sdpa", "flattening", NO_CACHE, False, OK),
    ("qwen3_sdpa", "flattening_flash", {}, False, ("model.layers.0.self_attn", [mask("sdpa", True)])),
    ("qwen3_sdpa", "flattening_flash_seq_idx", NO_CACHE, False, OK),
    ("qwen3_sdpa", "flattening_no_positions", NO_CACHE, False, ("model.layers.0.self_attn", [NO_POSITIONS])),
    ("qwen3_sdpa", "flattening_separator_0", NO_CACHE, False, ("loss (token mean)", [LABELS])),
    ("qwen3_sdpa", "trl_padding_free", {}, False, ("model.layers.0.self_attn", [mask("sdpa", True)])),
    ("qwen3_sdpa", "trl_padding_free", NO_CACHE, False, OK),
    ("qwen3_sdpa", "trl_pad_to_8", NO_CACHE, False, OK),
    ("qwen3_sdpa", "trl_bfd_packed", NO_CACHE, False, OK),
    ("qwen3_sdpa", "trl_ones_mask", NO_CACHE, False, ("model.layers.0.self_attn", [PADDING_MASK])),
    ("qwen3_sdpa", "flattening", {}, True, OK),
    ("qwen3_sdpa", "trl_padding_free", {}, True, OK),
    ("qwen3_eager", "flattening", {}, False, ("model.layers.0.self_attn", [mask("eager")])),
    ("qwen3_eager", "flattening", NO_CACHE, False, OK),
    ("qwen3_eager", "trl_padding_free", NO_CACHE, False, OK),
    ("qwen3_flex", "flattening", {}, False, ("model.layers.0.self_attn", [mask("flex_attention")])),
    ("qwen3_flex", "trl_padding_free", NO_CACHE, False, OK),
    # thdpack's varlen backend reads cu_seq_lens_q only: the flattening defaults attend across, cache or not
    ("qwen3_varlen", "flattening", {}, False, ("model.layers.0.self_attn", [NO_CU_VARLEN])),
    ("qwen3_varlen", "flattening", NO_CACHE, False, ("model.layers.0.self_attn", [NO_CU_VARLEN])),
    ("qwen3_varlen", "flattening_flash", {}, False, OK),
    ("qwen3_varlen", "trl_padding_free", {}, False, OK),
    ("qwen3_varlen", "flattening", {}, True, OK),
    # hybrids: without seq_idx the first convolution mixes the samples; with it, transformers refuses them on
    # the CPU (its kernels are CUDA-only); packed_model runs each hybrid layer per sample
    ("bamba_sdpa", "flattening", {}, False, ("model.layers.0.mamba.conv", [NO_SEQ_IDX, mask("sdpa")])),
    ("bamba_sdpa", "flattening", NO_CACHE, False, ("model.layers.0.mamba.conv", [NO_SEQ_IDX])),
    ("bamba_sdpa", "flattening_flash", NO_CACHE, False, ("model.layers.0.mamba.conv", [NO_SEQ_IDX])),
    ("bamba_sdpa", "flattening_flash_seq_idx", NO_CACHE, False,
     (f"refused: {CONV_REFUSED}", [KERNELS.format("causal_conv1d, mamba_ssm")])),
    ("bamba_sdpa", "trl_padding_free", {}, False,
     (f"refused: {CONV_REFUSED}", [KERNELS.format("causal_conv1d, mamba_ssm"), mask("sdpa", True)])),
    ("bamba_sdpa", "trl_padding_free", {}, True, OK),
    ("bamba_sdpa", "flattening_flash", NO_CACHE, True, OK),
    ("bamba_sdpa", "flattening", NO_CACHE, True, (f"refused: {RESTARTS_REFUSED.format('BambaForCausalLM')}",
                                                 [NO_SEQ_IDX])),
    ("qwen3_5_sdpa", "flattening", {}, False,
     ("model.layers.0.linear_attn.conv", [NO_SEQ_IDX, NO_CU_GDN, mask("sdpa")])),
    ("qwen3_5_sdpa", "flattening", NO_CACHE, False, ("model.layers.0.linear_attn.conv", [NO_SEQ_IDX, NO_CU_GDN])),
    ("qwen3_5_sdpa", "flattening_flash", NO_CACHE, False,
     (f"refused: {GDN_REFUSED}", [NO_SEQ_IDX, KERNELS.format("causal_conv1d, fla")])),
    ("qwen3_5_sdpa", "flattening_flash_seq_idx", NO_CACHE, False,
     (f"refused: {CONV_REFUSED}", [KERNELS.format("causal_conv1d, fla")])),
    ("qwen3_5_sdpa", "trl_padding_free", NO_CACHE, False,
     (f"refused: {CONV_REFUSED}", [KERNELS.format("causal_conv1d, fla")])),
    ("qwen3_5_sdpa", "trl_padding_free", {}, True, OK),
    ("qwen3_5_sdpa", "flattening_flash_seq_idx", NO_CACHE, True, OK),
]


def case_id(case) -> str:
    model, collator, extra, prepared, _ = case
    return f"{model}-{collator}{'-no_cache' if extra else ''}{'-packed_model' if prepared else ''}"


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_a_foreign_batch_is_judged_exact_or_named_where_it_breaks(case, request):
    model_name, collator, extra, prepared, expected = case
    if model_name == "qwen3_flex":
        request.getfixturevalue("static_flex_compiles")  # tests/conftest.py
    model = MODELS[model_name]()
    if prepared:
        packed_model(model)
    data = samples()
    batch = dict(COLLATORS[collator](data), **extra)
    report = thdpack.check_packing(model, data, batch=batch, flops=False)
    pack = report.packs[0]
    if expected is OK:
        assert report.ok, report.table()
        assert pack.problems == [], pack.problems  # nothing flagged on an exact batch
        return
    where, problems = expected
    assert not report.ok
    assert len(pack.problems) == len(problems), pack.problems
    for line, start in zip(pack.problems, problems):
        assert line.startswith(start), (line, start)
    found = _where(pack)
    assert found == where or (where.startswith("refused: ") and found.startswith(where)), found
    last = report.table().splitlines()[-1]
    assert last.startswith("FAIL: pack 0") and last.endswith("; the call " + "; ".join(pack.problems)), last


def _where(pack) -> str:
    """Where a failing pack first shows: the model's refusal, the first module, or the first value."""
    if pack.error is not None:
        return "refused: " + pack.error
    firsts = [s.first_failure for s in pack.samples if s.first_failure is not None]
    if firsts:
        return min(firsts, key=lambda d: d.order).name
    return next(v.name for v in pack.values if not v.ok)
