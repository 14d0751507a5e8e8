"""Hybrid models on packs (issue 29): every transformers family with linear-attention (Gated DeltaNet),
SSM (Mamba-2, Mamba-1) or short-convolution layers gives, through ``packed_model`` and the call a user makes
(``model(**to_hf_kwargs(batch, attn_implementation=...))``, the config's own ``use_cache`` default), the
logits, token-mean loss and every parameter's gradient of each sample run alone; the same call without
``packed_model`` either is exact or raises.

The reference never uses thdpack: each sample alone through the model (batch axis 1, no position ids), its
HF labels derived here. Tiny random float32 models (tests/hybrid_models.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from hybrid_models import VOCAB, available_families, tiny_hybrid  # noqa: E402
import thdpack  # noqa: E402
from thdpack import build_thd_batch  # noqa: E402
from thdpack.integrations import packed_model  # noqa: E402
from thdpack.integrations.hybrid.mixers import MIXER_FAMILIES  # noqa: E402
from thdpack.integrations import to_hf_kwargs  # noqa: E402
from thdpack.batching import attention_mask_4d

IGNORE = -100
REL = 1e-5  # max |packed - alone| / max |alone|, float32
# hypothesis searches for the worst case: float32 rounding alone (other matmul row blockings in a pack of
# 1-token samples) reaches 2e-5 there; a leak across a boundary is 1e-2 and more (test_the_boundaries_matter)
REL_SEARCHED = 1e-4
FAMILIES = available_families()
LAYOUTS = {"plain": {}, "pad4": {"pad_multiple": 4}, "static": {"pad_multiple": 4, "pad_to": 64, "max_num_seqs": 9}}
LENGTHS = [7, 1, 2, 12, 5, 9]  # 1- and 2-token samples: shorter than the convolutions (kernel 3-4)


def supports_flex(family: str) -> bool:
    return bool(getattr(type(tiny_hybrid(family)), "_supports_flex_attn", False))


CASES = [pytest.param(f, a, id=f"{f}-{a}") for f in FAMILIES for a in ("eager", "sdpa")]
CASES += [pytest.param(f, "flex_attention", id=f"{f}-flex_attention") for f in FAMILIES if supports_flex(f)]


def samples_of(lengths, seed: int = 0) -> list[dict]:
    """Samples with a prompt (no loss on its first tokens) and a completion."""
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        ids = rng.integers(1, VOCAB, n).tolist()
        labels = list(ids)
        labels[: n // 3] = [IGNORE] * (n // 3)
        out.append({"input_ids": ids, "labels": labels})
    return out


def fresh_model(family: str, attn: str) -> torch.nn.Module:
    """A new instance (not cached): ``packed_model`` changes the instance it is given."""
    return tiny_hybrid.__wrapped__(family, attn)


def alone(model, samples, grads: bool = True):
    """Per sample logits ``[s, V]``, and the token-mean loss over all samples' targets with its gradients
    (None without ``grads``)."""
    logits, ce_sum, count = [], 0.0, 0
    for sample in samples:
        ids = torch.tensor([sample["input_ids"]])
        with torch.set_grad_enabled(grads):
            out = model(input_ids=ids)
        logits.append(out.logits[0].detach())
        targets = torch.tensor(sample["labels"][1:], dtype=torch.long)
        ce_sum = ce_sum + F.cross_entropy(out.logits[0, :-1], targets, ignore_index=IGNORE, reduction="sum")
        count += int((targets != IGNORE).sum())
    loss = ce_sum / count
    grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True) if grads else None
    return logits, loss.detach(), grads


def packed(model, batch, attn, grads: bool = True):
    with torch.set_grad_enabled(grads):
        out = model(**to_hf_kwargs(batch, attn_implementation=attn))
    grads = torch.autograd.grad(out.loss, list(model.parameters()), allow_unused=True) if grads else None
    return out.logits[0].detach(), out.loss.detach(), grads


def rel(got, want) -> float:
    got, want = got.detach(), want.detach()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def assert_same(batch, got, want, what: str) -> None:
    logits, loss, grads = got
    want_logits, want_loss, want_grads = want
    for i, ref in enumerate(want_logits):
        a, s = int(batch.cu_seqlens_padded[i]), int(batch.seq_lens[i])
        assert rel(logits[a : a + s], ref) < REL, f"{what}: sample {i} (len {s}) logits differ"
    assert rel(loss, want_loss) < REL, f"{what}: loss {float(loss)} vs {float(want_loss)}"
    if grads is None:
        return
    flat = [(g, w) for g, w in zip(grads, want_grads) if w is not None]
    assert flat and all(g is not None for g, _ in flat), f"{what}: a parameter has no gradient in the pack"
    got_all = torch.cat([g.reshape(-1) for g, _ in flat])
    want_all = torch.cat([w.reshape(-1) for _, w in flat])
    assert rel(got_all, want_all) < REL, f"{what}: gradients differ (rel {rel(got_all, want_all):.2e})"


@pytest.mark.parametrize("family,attn", CASES)
def test_packed_equals_alone(family, attn, static_flex_compiles):
    """Logits, loss and every gradient, for plain, aligned and static-shape packs, through the default call
    (the config's use_cache=True). flex_attention: the static pack (one compile), and no gradients (torch's
    FlexAttention has no backward on the CPU; the GPU script runs it)."""
    model = packed_model(fresh_model(family, attn))
    assert packed_model(model) is model  # idempotent
    samples = samples_of(LENGTHS)
    want = alone(model, samples, grads=attn != "flex_attention")
    layouts = {"static": LAYOUTS["static"]} if attn == "flex_attention" else LAYOUTS
    for name, layout in layouts.items():
        batch = build_thd_batch(samples, **layout)
        got = packed(model, batch, attn, grads=attn != "flex_attention")
        assert_same(batch, got, want, f"{family}/{attn}/{name}")


@pytest.mark.parametrize("family", FAMILIES)
def test_raw_call_is_exact_or_refused(family):
    """Without packed_model, the user's call on a CPU either raises a clear ValueError (transformers >= 5.25
    refuses seq_idx / cu_seqlens without the kernels) or is exact; never silently wrong. Jamba's decoder
    layer hands its Mamba mixer no keyword at all, so no batch can reach it: packed_model is required
    (docs/hybrid.md), and this marks the known gap."""
    model = fresh_model(family, "sdpa")
    samples = samples_of(LENGTHS)
    want = [model(input_ids=torch.tensor([s["input_ids"]])).logits[0] for s in samples]
    batch = build_thd_batch(samples, pad_multiple=4)
    try:
        with torch.no_grad():
            logits = model(**to_hf_kwargs(batch, attn_implementation="sdpa")).logits[0]
    except ValueError as err:
        assert "can't keep packed sequences apart" in str(err) and "\n" not in str(err)
        return
    worst = max(rel(logits[a : a + s], w) for a, s, w in
                zip(batch.cu_seqlens_padded.tolist(), batch.seq_lens.tolist(), want))
    if family == "jamba":
        assert worst > 1e-2  # the known gap: transformers' JambaMambaDecoderLayer drops every keyword
        pytest.xfail("jamba: transformers passes its Mamba mixer no boundary; use packed_model")
    assert worst < REL, f"{family}: the raw call is silently wrong (rel {worst:.2e})"


@pytest.mark.parametrize("family", ["qwen3_5_text", "bamba", "lfm2", "jamba"])
def test_the_boundaries_matter(family):
    """The equivalence rests on the boundaries: the same wrapped model handed a one-sample seq_idx /
    cu_seq_lens_q (the pack as one sequence) moves later samples' logits."""
    model = packed_model(fresh_model(family, "sdpa"))
    samples = samples_of(LENGTHS)
    batch = build_thd_batch(samples)
    kw = to_hf_kwargs(batch, attn_implementation="sdpa", include_labels=False)
    total = batch.num_padded_tokens
    one = dict(kw, seq_idx=torch.zeros_like(kw["seq_idx"]),
               cu_seq_lens_q=torch.tensor([0, total], dtype=torch.int32),
               cu_seq_lens_k=torch.tensor([0, total], dtype=torch.int32), max_length_q=total, max_length_k=total)
    with torch.no_grad(), pytest.raises(ValueError, match="do not restart at 0 at every sample boundary"):
        model(**one)  # the positions still restart: refused, not scanned as one sequence
    one["position_ids"] = torch.arange(total).unsqueeze(0)
    with torch.no_grad():
        good, leaky = model(**kw).logits[0], model(**one).logits[0]
    a, s = int(batch.cu_seqlens_padded[-2]), int(batch.seq_lens[-1])
    ref = model(input_ids=torch.tensor([samples[-1]["input_ids"]])).logits[0].detach()
    assert rel(good[a : a + s], ref) < REL
    assert rel(leaky[a : a + s], ref) > 1e-2


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=st.lists(st.integers(1, 11), min_size=1, max_size=7), align=st.sampled_from([1, 2, 8]),
       family=st.sampled_from([f for f in ("qwen3_5_text", "bamba", "lfm2", "jamba") if f in FAMILIES]))
def test_any_lengths(lengths, align, family):
    """Any lengths, 1- and 2-token samples (shorter than the convolution) included: every sample's logits."""
    model = tiny_hybrid(family, "sdpa")
    if not getattr(model, "_thdpack_packed_model", False):
        packed_model(model)
    samples = samples_of(lengths, seed=len(lengths))
    batch = build_thd_batch(samples, pad_multiple=align)
    with torch.no_grad():
        logits = model(**to_hf_kwargs(batch, attn_implementation="sdpa")).logits[0]
        for i, sample in enumerate(samples):
            ref = model(input_ids=torch.tensor([sample["input_ids"]])).logits[0]
            a, s = int(batch.cu_seqlens_padded[i]), int(batch.seq_lens[i])
            assert rel(logits[a : a + s], ref) < REL_SEARCHED, f"sample {i} of lengths {lengths}, align {align}"


def test_boundaries_equal_data_collator_with_flattening():
    """seq_idx, cu_seq_lens_q/k, max_length_q/k and position_ids are transformers' own collator's."""
    samples = samples_of([5, 1, 9, 3])
    collator = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True,
                                                       return_position_ids=True)
    theirs = collator([{"input_ids": s["input_ids"]} for s in samples])
    ours = to_hf_kwargs(build_thd_batch(samples), attn_implementation="sdpa")
    for key in ("seq_idx", "cu_seq_lens_q", "cu_seq_lens_k", "position_ids", "input_ids"):
        assert ours[key].dtype == theirs[key].dtype, key
        assert torch.equal(ours[key], theirs[key]), key
    assert (ours["max_length_q"], ours["max_length_k"]) == (theirs["max_length_q"], theirs["max_length_k"])


def test_static_tail_is_the_last_samples():
    """Static shapes: zero-length sequences at the end of cu_seq_lens_q hold no slot; the pad_to tail's
    seq_idx is the last sample's (after all of its real tokens, so no real token sees it)."""
    batch = build_thd_batch(samples_of([3, 4]), pad_to=16, max_num_seqs=5)
    kw = to_hf_kwargs(batch, attn_implementation="sdpa")
    assert kw["cu_seq_lens_q"].tolist() == [0, 3, 16, 16, 16, 16]
    assert kw["seq_idx"].tolist() == [[0] * 3 + [1] * 13]
    assert kw["max_length_q"] == 16


# --------------------------------------------------------------------------- refusals


def test_packed_model_refuses_what_it_cannot_scan():
    model = packed_model(fresh_model("qwen3_5_text", "sdpa"))
    batch = build_thd_batch(samples_of([6, 4, 10]), cp_size=2)
    with torch.no_grad(), pytest.raises(ValueError, match="CP / Ulysses shard's chunks or a shared-prefix tree"):
        model(**to_hf_kwargs(thdpack.shard(batch, cp_size=2, cp_rank=0), attn_implementation="flash_attention_2",
                             include_labels=False))
    prompt = [1 + i % 50 for i in range(40)]
    group = [{"input_ids": prompt + [60 + i] * (3 + i), "labels": [IGNORE] * 40 + [60 + i] * (3 + i), "group": 0}
             for i in range(3)]
    tree = build_thd_batch(group, share_prefix="group")
    assert tree.prefix_tree is not None and tree.num_tokens < 3 * 40
    tree_kw = to_hf_kwargs(tree, attn_implementation="sdpa", include_labels=False)
    without_segments = {k: v for k, v in tree_kw.items() if k not in ("segment_lens", "segment_parents")}
    with torch.no_grad(), pytest.raises(ValueError, match="shared-prefix tree cannot be scanned"):
        model(**without_segments)  # with them, the mixers fork their states (tests/test_rollout_tries_hybrid.py)
    kw = to_hf_kwargs(batch, attn_implementation="sdpa", include_labels=False)
    bare = {k: kw[k] for k in ("input_ids", "position_ids")}
    with torch.no_grad(), pytest.raises(ValueError, match="position_ids restart inside the row .* carries no seq_idx"):
        model(**bare)
    bad = dict(kw, seq_idx=kw["seq_idx"].flip(-1))
    with torch.no_grad(), pytest.raises(ValueError, match="does not give the samples of cu_seq_lens_q"):
        model(**bad)


def test_packed_model_needs_nothing_on_plain_models_and_refuses_unknown_layers():
    config = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).eval()
    samples = samples_of(LENGTHS)
    batch = build_thd_batch(samples, pad_multiple=4)
    want = [model(input_ids=torch.tensor([s["input_ids"]])).logits[0].detach() for s in samples]

    def worst(kw) -> float:
        with torch.no_grad():
            logits = model(**kw).logits[0]
        return max(rel(logits[a : a + s], w) for a, s, w in
                   zip(batch.cu_seqlens_padded.tolist(), batch.seq_lens.tolist(), want))

    assert worst(to_hf_kwargs(batch)) > 1e-2  # the flash kwargs on an sdpa model, under use_cache=True
    assert packed_model(model) is model
    assert not any(hasattr(m, "_thdpack_state") for m in model.model.modules())  # no layer is wrapped
    assert worst(to_hf_kwargs(batch)) < REL  # the hook gives the call the sdpa mask its backend reads
    assert worst(to_hf_kwargs(batch, attn_implementation="sdpa")) < REL
    unknown = transformers.Qwen3ForCausalLM(config)
    unknown.config.layer_types = ["retention"]
    with pytest.raises(ValueError, match=r"layer types \['retention'\], which are not attention"):
        packed_model(unknown)

    class StrangeMixer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1d = torch.nn.Conv1d(8, 8, 4, groups=8, padding=3)

    odd = transformers.Qwen3ForCausalLM(config)
    odd.model.layers[0].strange = StrangeMixer()
    with pytest.raises(ValueError, match=r"model.layers.0.strange \(StrangeMixer\) runs a depthwise convolution"):
        packed_model(odd)


def test_every_registered_mixer_exists_in_transformers():
    """The registry names classes the installed transformers has (a rename would skip a layer silently)."""
    import importlib

    for family in FAMILIES:
        model = tiny_hybrid(family)
        found = {type(m).__name__ for m in model.modules()} & set(MIXER_FAMILIES)
        assert found, f"{family}: no registered mixer class among its modules"
    for name, family in MIXER_FAMILIES.items():
        module = importlib.import_module(f"transformers.models.{family.model_types[0]}.modeling_{family.model_types[0]}")
        assert hasattr(module, name), name


def test_custom_attention_names():
    """A name registered in transformers' AttentionInterface is accepted, handled by what it reads: with
    sdpa's mask function, the dense mask; without a mask function, the varlen kwargs alone."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    batch = build_thd_batch(samples_of([3, 4]))
    with pytest.raises(ValueError, match="or a name registered in transformers' AttentionInterface, got 'thd_x'"):
        to_hf_kwargs(batch, attn_implementation="thd_x")
    AttentionInterface.register("thd_masked", sdpa_attention_forward)
    AttentionMaskInterface.register("thd_masked", ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    AttentionInterface.register("thd_varlen", sdpa_attention_forward)
    kw = to_hf_kwargs(batch, attn_implementation="thd_masked")
    assert torch.equal(kw["attention_mask"], attention_mask_4d(batch))
    kw = to_hf_kwargs(batch, attn_implementation="thd_varlen")
    assert "attention_mask" not in kw and torch.equal(kw["cu_seq_lens_q"], batch.cu_seqlens_padded)
    model = packed_model(fresh_model("qwen3_5_text", "sdpa"))
    model.set_attn_implementation("thd_masked")
    samples = samples_of(LENGTHS)
    want = alone(model, samples)
    batch = build_thd_batch(samples, pad_multiple=4)
    assert_same(batch, packed(model, batch, "thd_masked"), want, "thd_masked")


def test_trainer_trains_a_hybrid_on_packs(tmp_path):
    """transformers' Trainer with ``hf_collator(ThdCollator(), model=model)``: the collator prepares the model
    (packed_model) and the batches (its backend's mask); the first step's loss is the token-mean loss of the
    samples alone, and training runs."""
    from thdpack import ThdCollator
    from thdpack.integrations.hf_trainer import hf_collator

    model = fresh_model("qwen3_5_text", "sdpa").train()
    samples = samples_of(LENGTHS, seed=3)
    _, want_loss, _ = alone(model, samples, grads=False)
    collate = hf_collator(ThdCollator(), model=model)
    assert model._thdpack_packed_model
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=len(samples), max_steps=2, logging_steps=1,
        learning_rate=1e-3, report_to="none", save_strategy="no", use_cpu=True, dataloader_num_workers=0, seed=0,
        disable_tqdm=True, remove_unused_columns=False,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=samples, data_collator=collate)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 2 and losses[0] == pytest.approx(float(want_loss), rel=1e-4)


@pytest.mark.parametrize("family", ["qwen3_5_text", "jamba"])
def test_gradient_checkpointing(family):
    """With gradient checkpointing the layers are re-run in the backward pass; they find the same boundaries
    (from their keywords, or for Jamba's keyword-less mixer from the model's last packed call)."""
    model = packed_model(fresh_model(family, "sdpa")).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    samples = samples_of(LENGTHS, seed=5)
    want = alone(model, samples)
    batch = build_thd_batch(samples, pad_multiple=4)
    assert_same(batch, packed(model, batch, "sdpa"), want, f"{family}/checkpointed")


def test_a_copy_of_a_prepared_model_runs_its_own_weights():
    """``copy.deepcopy`` (a DPO reference model) after packed_model: the copy's layers run the copy's weights
    and keep their own state; both stay exact."""
    import copy

    model = packed_model(fresh_model("qwen3_5_text", "sdpa"))
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.5)
    samples = samples_of(LENGTHS)
    batch = build_thd_batch(samples)
    kw = to_hf_kwargs(batch, attn_implementation="sdpa", include_labels=False)
    for m in (model, twin):
        want = [m(input_ids=torch.tensor([s["input_ids"]])).logits[0].detach() for s in samples]
        with torch.no_grad():
            logits = m(**kw).logits[0]
        for (a, s), w in zip(zip(batch.cu_seqlens_padded.tolist(), batch.seq_lens.tolist()), want):
            assert rel(logits[a : a + s], w) < REL
    with torch.no_grad():
        assert rel(twin(**kw).logits, model(**kw).logits) > 1e-2


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", ["qwen3_sliding_layers", "mistral_window"])
def test_sliding_window_layers_keep_their_window(family, attn):
    """A whole-stream document mask has no window: on a model with sliding-window layers (samples longer
    than the window) the raw call is wrong, and packed_model hands transformers the restarting positions
    (use_cache=False, no 4D mask), which derives every layer type's mask, windows included."""
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, initializer_range=0.2, max_position_embeddings=512)
    if family == "qwen3_sliding_layers":
        config = transformers.Qwen3Config(**common, use_sliding_window=True, sliding_window=4,
                                          layer_types=["sliding_attention", "full_attention"])
        cls = transformers.Qwen3ForCausalLM
    else:
        config, cls = transformers.MistralConfig(**common, sliding_window=4), transformers.MistralForCausalLM
    config._attn_implementation = attn
    torch.manual_seed(0)
    model = cls(config).eval()
    samples = samples_of([9, 3, 12])
    batch = build_thd_batch(samples, pad_multiple=4)
    want = [model(input_ids=torch.tensor([s["input_ids"]])).logits[0].detach() for s in samples]

    def worst() -> float:
        with torch.no_grad():
            logits = model(**to_hf_kwargs(batch, attn_implementation=attn)).logits[0]
        return max(rel(logits[a : a + s], w) for a, s, w in
                   zip(batch.cu_seqlens_padded.tolist(), batch.seq_lens.tolist(), want))

    assert worst() > 1e-2  # the document mask attends beyond the window
    packed_model(model)
    assert worst() < REL


@pytest.mark.parametrize("given", ["cu_seq_lens_q", "seq_idx"])
@pytest.mark.parametrize("family", [f for f in ("bamba", "qwen3_5_text") if f in FAMILIES])
def test_a_mixer_gets_both_boundaries_when_the_call_gives_one(family, given, monkeypatch):
    """Where the kernels run natively (CUDA, packages present) packed_model leaves the mixer to them, and each
    kernel reads its own boundary (Mamba-2 and the convolutions seq_idx, the Gated DeltaNet scan cu_seq_lens_q):
    a call carrying one gets the other too, as to_hf_kwargs gives it, so no kernel scans across the samples."""
    import importlib

    pm = importlib.import_module("thdpack.integrations.hybrid.packed_model")  # the module, not the function
    monkeypatch.setattr(pm, "_native", lambda family, device: True)  # the kernels' path, as on CUDA
    model = packed_model(fresh_model(family, "sdpa"))
    seen = []
    mixer = next(m for m in model.modules() if type(m).__name__ in MIXER_FAMILIES)
    mixer.register_forward_pre_hook(lambda mod, args, kwargs: seen.append(dict(kwargs)), with_kwargs=True)
    full = to_hf_kwargs(build_thd_batch(samples_of([5, 9, 3])), include_labels=False)
    keep = {"input_ids", "position_ids", given} | ({"cu_seq_lens_k", "max_length_q", "max_length_k"}
                                                   if given == "cu_seq_lens_q" else set())
    with torch.no_grad():
        try:
            model(**{k: v for k, v in full.items() if k in keep})
        except ValueError:  # the CPU has no kernel: transformers refuses after the mixer was entered
            pass
    assert seen, "the mixer was not called"
    assert torch.equal(seen[0]["seq_idx"].reshape(-1).long(), full["seq_idx"].reshape(-1).long())
    assert torch.equal(seen[0]["cu_seq_lens_q"].long(), full["cu_seq_lens_q"].long())
