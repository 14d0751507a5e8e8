"""Equivalence: a real ``transformers`` model run on a packed :class:`ThdBatch` gives,
token by token, the logits and the loss it gives on each sample run alone.

This is the test that matters (see DESIGN.md, "The contract of a built batch").
Tiny random-weight Qwen3 / Llama models, built from configs (nothing downloaded,
nothing read from disk), fp32, eval mode, sdpa and eager attention.

The reference side never uses thdpack: each sample's HF-style labels are derived
here from its own fields, and its logits / per-token losses come from running the
model on that sample alone (batch axis 1, no position ids, no packing).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from thdpack import ThdBatch, ThdCollator, build_thd_batch, plan_packs  # noqa: E402
from thdpack.loaders import PackedBatches  # noqa: E402
from thdpack.demo.models import TINY_TEXT  # noqa: E402
from thdpack.integrations import to_hf_kwargs  # noqa: E402

IGNORE = -100
VOCAB = 128
LOGIT_ATOL = 1e-4  # max abs logit difference allowed (fp32)
LOSS_ATOL = 1e-5

FAMILIES = ("qwen3", "llama")
ATTN = ("sdpa", "eager")
MODEL_PARAMS = [pytest.param(f, a, id=f"{f}-{a}") for f in FAMILIES for a in ATTN]


# --------------------------------------------------------------------------- models


@functools.lru_cache(maxsize=None)
def tiny_model(family: str, attn: str) -> torch.nn.Module:
    """A 2-layer random-weight causal LM, fp32, eval mode.

    ``initializer_range`` is raised from HF's 0.02 so that logits are O(1) and
    attention is far from uniform: a leak across sample boundaries or a wrong
    position then moves logits by much more than ``LOGIT_ATOL``
    (``test_packing_mistakes_are_detected`` checks that).
    """
    common = dict(
        vocab_size=VOCAB,
        **TINY_TEXT,
        max_position_embeddings=512,
        initializer_range=0.2,
        attn_implementation=attn,
    )
    torch.manual_seed(1234)
    if family == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common))
    elif family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    else:  # pragma: no cover
        raise ValueError(family)
    model = model.to(torch.float32).eval()
    assert model.config._attn_implementation == attn
    return model


# --------------------------------------------------------------------------- reference (no thdpack)


def _as_long(value) -> torch.Tensor:
    """A field (list / numpy / torch, possibly ``[1, s]``) as a 1-D int64 tensor."""
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu()
    else:
        t = torch.as_tensor(np.asarray(value))
    return t.reshape(-1).to(torch.int64)


def reference_hf_labels(sample) -> torch.Tensor:
    """The sample's own HF labels (unshifted, -100 = no loss), as a user would write
    them to train on it alone: ``labels`` if given else the input ids, with tokens
    whose ``loss_mask`` is 0 set to -100."""
    ids = _as_long(sample["input_ids"])
    labels = _as_long(sample["labels"]) if sample.get("labels") is not None else ids.clone()
    if sample.get("loss_mask") is not None:
        labels = torch.where(_as_long(sample["loss_mask"]).bool(), labels, torch.full_like(labels, IGNORE))
    return labels


@torch.no_grad()
def run_alone(model, sample):
    """Logits ``[s, V]``, per-token CE ``[s-1]`` and score mask ``[s-1]`` (HF shift:
    position t is scored against label t+1) of ``sample`` run alone."""
    ids = _as_long(sample["input_ids"])
    labels = reference_hf_labels(sample)
    out = model(input_ids=ids[None], labels=labels[None], use_cache=False)
    logits = out.logits[0]
    targets = labels[1:]
    ce = F.cross_entropy(logits[:-1], targets, ignore_index=IGNORE, reduction="none")
    scored = targets != IGNORE
    n = int(scored.sum())
    if n:  # HF's own loss on the sample alone agrees with the per-token CE used as reference
        torch.testing.assert_close(out.loss, ce[scored].mean(), rtol=0, atol=LOSS_ATOL)
    return logits, ce, scored


# --------------------------------------------------------------------------- the check


@torch.no_grad()
def assert_equivalent(model, batch: ThdBatch, samples) -> dict:
    """Run ``batch`` packed and every sample alone; assert logits and losses agree.

    ``samples[i]`` is what sample i of the pack should be (after truncation / splitting).
    Returns a few numbers for extra assertions by the caller.
    """
    assert isinstance(batch, ThdBatch)
    n = batch.num_samples
    assert n == len(samples)
    T = batch.num_padded_tokens
    cu_pad = batch.cu_seqlens_padded.tolist()
    seq_lens = batch.seq_lens.tolist()
    assert cu_pad[0] == 0 and cu_pad[-1] == T

    out = model(**to_hf_kwargs(batch), use_cache=False)
    logits = out.logits
    assert logits.shape == (1, T, VOCAB)
    logits = logits[0]

    packed_ce = F.cross_entropy(logits, batch.labels, ignore_index=batch.ignore_index, reduction="none")
    real = torch.zeros(T, dtype=torch.bool)  # stream slots holding a real token
    total_ce = torch.zeros((), dtype=torch.float64)
    total_scored = 0
    max_diff = 0.0

    for i, sample in enumerate(samples):
        ids = _as_long(sample["input_ids"])
        s = ids.numel()
        assert seq_lens[i] == s, f"sample {i}: seq_len {seq_lens[i]} != {s}"
        a = cu_pad[i]
        assert cu_pad[i + 1] - a >= s
        real[a : a + s] = True
        assert torch.equal(batch.input_ids[a : a + s], ids), f"sample {i}: tokens differ in the stream"

        alone_logits, alone_ce, alone_scored = run_alone(model, sample)

        diff = (logits[a : a + s] - alone_logits).abs().max().item()
        max_diff = max(max_diff, diff)
        assert diff < LOGIT_ATOL, f"sample {i} (len {s}): max |logit diff| {diff:.3g}"

        # the same tokens are scored, against the same targets, with the same loss
        seg_mask = batch.loss_mask[a : a + s]
        assert torch.equal(seg_mask[: s - 1], alone_scored), f"sample {i}: scored positions differ"
        assert not bool(seg_mask[s - 1]), f"sample {i}: its last token is scored"
        labels_alone = reference_hf_labels(sample)
        expect_targets = torch.cat([labels_alone[1:], torch.tensor([IGNORE])])
        expect_targets[expect_targets == IGNORE] = batch.ignore_index
        assert torch.equal(batch.labels[a : a + s], expect_targets), f"sample {i}: target labels differ"
        if alone_scored.any():
            torch.testing.assert_close(
                packed_ce[a : a + s - 1][alone_scored], alone_ce[alone_scored], rtol=0, atol=LOSS_ATOL
            )
        total_ce += alone_ce[alone_scored].double().sum()
        total_scored += int(alone_scored.sum())

    # pad slots: pad token, never scored; real slots are exactly the samples' tokens
    assert int(real.sum()) == batch.num_tokens == sum(seq_lens)
    assert not bool(batch.loss_mask[~real].any()), "a pad slot is scored"
    assert bool((batch.labels[~real] == batch.ignore_index).all())
    assert torch.equal(batch.loss_mask, batch.labels != batch.ignore_index)
    assert int(batch.loss_mask.sum()) == total_scored, "nothing lost, nothing added"

    if total_scored:
        ref = (total_ce / total_scored).to(torch.float32)
        # 1. HF's own loss on the packed labels of to_hf_kwargs()
        torch.testing.assert_close(out.loss, ref, rtol=0, atol=LOSS_ATOL)
        # 2. CE of packed logits against batch.labels (target labels, no shift)
        direct = F.cross_entropy(logits, batch.labels, ignore_index=batch.ignore_index)
        torch.testing.assert_close(direct, ref, rtol=0, atol=LOSS_ATOL)
        # 3. loss_mask-weighted mean of per-token CE
        lm = batch.loss_mask.to(logits.dtype)
        masked = (packed_ce * lm).sum() / lm.sum()
        torch.testing.assert_close(masked, ref, rtol=0, atol=LOSS_ATOL)
    else:
        assert torch.isnan(out.loss) or out.loss == 0
    return {"max_diff": max_diff, "scored": total_scored}


# --------------------------------------------------------------------------- sample factories


def _rand_ids(g: torch.Generator, n: int) -> torch.Tensor:
    return torch.randint(1, VOCAB, (n,), generator=g)  # 0 is the pad token


def plain_samples(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": _rand_ids(g, n).tolist()} for n in lengths]


def prompt_masked_samples(lengths, prompt_lens, seed=0):
    """HF labels with -100 on a prompt prefix."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n, p in zip(lengths, prompt_lens):
        ids = _rand_ids(g, n)
        labels = ids.clone()
        labels[:p] = IGNORE
        out.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    return out


def loss_mask_samples(lengths, prompt_lens, seed=0):
    """The ``loss_mask`` variant: 0 on a prompt prefix, 1 on the response."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n, p in zip(lengths, prompt_lens):
        ids = _rand_ids(g, n)
        mask = [0] * p + [1] * (n - p)
        out.append({"input_ids": ids.tolist(), "loss_mask": mask})
    return out


def convert(samples, kind: str):
    """The same samples with their fields as lists / numpy arrays / torch tensors."""
    out = []
    for k, s in enumerate(samples):
        d = {}
        for key, v in s.items():
            arr = np.asarray(v)
            if kind == "list":
                d[key] = arr.tolist()
            elif kind == "numpy":
                # alternate int64 / int32 (and bool masks) as datasets and tokenizers give them
                if key == "loss_mask":
                    d[key] = arr.astype(bool)
                else:
                    d[key] = arr.astype(np.int32 if k % 2 else np.int64)
            elif kind == "torch":
                t = torch.as_tensor(arr)
                if key == "loss_mask":
                    t = t.bool()
                d[key] = t
            elif kind == "torch2d":  # tokenizer(..., return_tensors="pt") gives [1, s]
                d[key] = torch.as_tensor(arr)[None]
            else:  # pragma: no cover
                raise ValueError(kind)
        out.append(d)
    return out


# lengths 1 and 2 mixed with longer ones, a length-1 sample first and last
MIXED_LENGTHS = [1, 7, 2, 13, 1, 5, 2, 20, 3]
MIXED_PROMPTS = [0, 3, 1, 6, 1, 2, 0, 9, 2]


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("family,attn", MODEL_PARAMS)
def test_plain_pack_with_short_samples(family, attn):
    model = tiny_model(family, attn)
    samples = plain_samples(MIXED_LENGTHS, seed=1)
    batch = build_thd_batch(samples)
    assert batch.pad_multiple == 1 and batch.num_padded_tokens == sum(MIXED_LENGTHS)
    info = assert_equivalent(model, batch, samples)
    assert info["scored"] == sum(n - 1 for n in MIXED_LENGTHS)


@pytest.mark.parametrize("family,attn", MODEL_PARAMS)
@pytest.mark.parametrize("variant", ["labels", "loss_mask"])
def test_prompt_masking(family, attn, variant):
    model = tiny_model(family, attn)
    factory = prompt_masked_samples if variant == "labels" else loss_mask_samples
    samples = factory(MIXED_LENGTHS, MIXED_PROMPTS, seed=2)
    batch = build_thd_batch(samples)
    info = assert_equivalent(model, batch, samples)
    # a target at t+1 is scored iff it is past the prompt (position 0 never is)
    assert info["scored"] == sum(n - max(p, 1) for n, p in zip(MIXED_LENGTHS, MIXED_PROMPTS))


@pytest.mark.parametrize("family,attn", MODEL_PARAMS)
@pytest.mark.parametrize(
    "align_kwargs,multiple",
    [
        pytest.param({"cp_size": 2}, 4, id="cp2"),
        pytest.param({"pad_multiple": 8}, 8, id="pad8"),
        pytest.param({"cp_size": 2, "pad_multiple": 8}, 8, id="cp2-pad8"),
    ],
)
def test_aligned_pack_has_pad_slots_inside_the_stream(family, attn, align_kwargs, multiple):
    model = tiny_model(family, attn)
    samples = prompt_masked_samples(MIXED_LENGTHS, MIXED_PROMPTS, seed=3)
    batch = build_thd_batch(samples, **align_kwargs)
    assert batch.pad_multiple == multiple
    padded = batch.seq_lens_padded
    assert bool((padded % multiple == 0).all())
    assert bool((padded > batch.seq_lens).any()), "the test needs pad slots between samples"
    # a pad slot sits between two samples, not only at the end of the stream
    first_gap = int(batch.cu_seqlens_padded[0]) + int(batch.seq_lens[0])
    assert first_gap < int(batch.cu_seqlens_padded[1])
    assert batch.num_padded_tokens > batch.num_tokens
    assert_equivalent(model, batch, samples)


@pytest.mark.parametrize("family,attn", MODEL_PARAMS)
def test_nonzero_pad_token_in_pad_slots(family, attn):
    """Pad slots holding a real vocabulary id must not leak into real tokens."""
    model = tiny_model(family, attn)
    samples = loss_mask_samples(MIXED_LENGTHS, MIXED_PROMPTS, seed=4)
    batch = build_thd_batch(samples, pad_multiple=8, pad_token_id=VOCAB - 1)
    real = torch.zeros(batch.num_padded_tokens, dtype=torch.bool)
    for a, s in zip(batch.cu_seqlens_padded[:-1].tolist(), batch.seq_lens.tolist()):
        real[a : a + s] = True
    assert bool((batch.input_ids[~real] == VOCAB - 1).all())
    assert_equivalent(model, batch, samples)


@pytest.mark.parametrize("family,attn", MODEL_PARAMS)
@pytest.mark.parametrize("kind", ["list", "numpy", "torch", "torch2d"])
def test_input_containers(family, attn, kind):
    model = tiny_model(family, attn)
    base = (
        prompt_masked_samples(MIXED_LENGTHS[:5], MIXED_PROMPTS[:5], seed=5)
        + loss_mask_samples(MIXED_LENGTHS[5:], MIXED_PROMPTS[5:], seed=6)
    )
    samples = convert(base, kind)
    batch = build_thd_batch(samples, cp_size=2)
    assert_equivalent(model, batch, base)
    # the container does not change the batch
    ref = build_thd_batch(convert(base, "list"), cp_size=2)
    for name in ("input_ids", "labels", "loss_mask", "position_ids", "cu_seqlens", "cu_seqlens_padded"):
        assert torch.equal(getattr(batch, name), getattr(ref, name)), name


@pytest.mark.parametrize("family,attn", MODEL_PARAMS)
def test_mixed_fields_in_one_pack(family, attn):
    """Samples with labels, with a loss_mask, with both, and with neither, in one pack."""
    model = tiny_model(family, attn)
    g = torch.Generator().manual_seed(7)
    samples = []
    for k, (n, p) in enumerate(zip(MIXED_LENGTHS, MIXED_PROMPTS)):
        ids = _rand_ids(g, n)
        s = {"input_ids": ids}
        if k % 4 in (1, 3):
            labels = ids.clone()
            labels[:p] = IGNORE
            s["labels"] = labels
        if k % 4 in (2, 3):
            mask = torch.ones(n, dtype=torch.int64)
            mask[n // 2 :] = 0 if k % 4 == 3 else 1
            mask[: p // 2] = 0
            s["loss_mask"] = mask
        samples.append(s)
    batch = build_thd_batch(samples, pad_multiple=8)
    assert_equivalent(model, batch, samples)


@pytest.mark.parametrize("family,attn", MODEL_PARAMS)
def test_single_sample_pack(family, attn):
    model = tiny_model(family, attn)
    for lengths, kw in [([1], {}), ([2], {}), ([11], {}), ([11], {"pad_multiple": 8}), ([1], {"cp_size": 2})]:
        samples = plain_samples(lengths, seed=8)
        assert_equivalent(model, build_thd_batch(samples, **kw), samples)


@pytest.mark.parametrize("family,attn", MODEL_PARAMS)
def test_collator_single_batch(family, attn):
    model = tiny_model(family, attn)
    samples = convert(prompt_masked_samples(MIXED_LENGTHS, MIXED_PROMPTS, seed=9), "torch")
    for collator in (ThdCollator(), ThdCollator(cp_size=2), ThdCollator(pad_multiple=8)):
        batch = collator(samples)
        assert isinstance(batch, ThdBatch)
        assert batch.sample_index.tolist() == list(range(len(samples)))
        assert_equivalent(model, batch, samples)


@pytest.mark.parametrize("family,attn", MODEL_PARAMS)
@pytest.mark.parametrize(
    "collator_kwargs",
    [
        pytest.param({"pack_size": 24}, id="pack24"),
        pytest.param({"pack_size": 32, "pad_multiple": 8}, id="pack32-pad8"),
        pytest.param({"pack_size": 24, "cp_size": 2, "algorithm": "sequential"}, id="pack24-cp2-seq"),
    ],
)
def test_collator_pack_size(family, attn, collator_kwargs):
    model = tiny_model(family, attn)
    base = loss_mask_samples(MIXED_LENGTHS, MIXED_PROMPTS, seed=10)
    samples = convert(base, "numpy")
    batches = ThdCollator(**collator_kwargs)(samples)
    assert isinstance(batches, PackedBatches)
    assert len(batches) > 1, "the test needs several packs"
    seen = []
    total_scored = 0
    for batch in batches:
        assert isinstance(batch, ThdBatch)
        assert batch.num_padded_tokens <= collator_kwargs["pack_size"]
        rows = batch.sample_index.tolist()
        seen += rows
        total_scored += assert_equivalent(model, batch, [base[r] for r in rows])["scored"]
    assert sorted(seen) == list(range(len(samples))), "every sample in exactly one pack"
    assert total_scored == sum(n - max(p, 1) for n, p in zip(MIXED_LENGTHS, MIXED_PROMPTS))


def _piece(sample, start, stop):
    return {k: _as_long(v)[start:stop] for k, v in sample.items()}


@pytest.mark.parametrize("family,attn", [MODEL_PARAMS[0], MODEL_PARAMS[3]])
def test_truncated_and_split_samples(family, attn):
    """A truncated or split sample behaves like its kept piece run alone."""
    model = tiny_model(family, attn)
    base = prompt_masked_samples(MIXED_LENGTHS, MIXED_PROMPTS, seed=11)

    # max_length bounds the padded length: with cp_size=2 (multiple 4), max_length=6 keeps 4 tokens
    batch = build_thd_batch(base, max_length=6, cp_size=2)
    assert batch.tokens_truncated == sum(max(n - 4, 0) for n in MIXED_LENGTHS)
    assert batch.max_seqlen <= 6
    assert_equivalent(model, batch, [_piece(s, 0, 4) for s in base])

    pack_size = 12
    batches = ThdCollator(pack_size=pack_size, overflow="split")(base)
    plan = plan_packs([len(s["input_ids"]) for s in base], pack_size, overflow="split")
    assert len(batches) == len(plan)
    assert batches.stats.samples_split > 0
    for k, batch in enumerate(batches):
        idx, start, length = plan.pieces(k)
        pieces = [_piece(base[i], a, a + n) for i, a, n in zip(idx.tolist(), start.tolist(), length.tolist())]
        assert batch.sample_index.tolist() == idx.tolist()
        assert_equivalent(model, batch, pieces)


@given(
    data=st.lists(
        st.tuples(st.integers(1, 12), st.integers(0, 12), st.sampled_from(["plain", "labels", "loss_mask"])),
        min_size=1,
        max_size=6,
    ),
    align=st.sampled_from([{}, {"cp_size": 2}, {"pad_multiple": 8}, {"cp_size": 4}]),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_equivalence_property(data, align, seed):
    model = tiny_model("qwen3", "sdpa")
    g = torch.Generator().manual_seed(seed)
    samples = []
    for n, p, kind in data:
        p = min(p, n)
        ids = _rand_ids(g, n)
        if kind == "plain":
            samples.append({"input_ids": ids})
        elif kind == "labels":
            labels = ids.clone()
            labels[:p] = IGNORE
            samples.append({"input_ids": ids, "labels": labels})
        else:
            mask = torch.ones(n, dtype=torch.int64)
            mask[:p] = 0
            samples.append({"input_ids": ids, "loss_mask": mask})
    assert_equivalent(model, build_thd_batch(samples, **align), samples)


# --------------------------------------------------------------------------- negative control


@pytest.mark.parametrize("family,attn", MODEL_PARAMS)
@torch.no_grad()
def test_packing_mistakes_are_detected(family, attn):
    """The tolerance is meaningful: running the same stream without sample
    boundaries (positions 0..T-1, attention across samples) moves the logits of
    later samples far beyond ``LOGIT_ATOL``. Guards against a model/config so
    degenerate that the equivalence checks above could not fail."""
    model = tiny_model(family, attn)
    samples = plain_samples([9, 12], seed=12)
    batch = build_thd_batch(samples)
    kw = to_hf_kwargs(batch, include_labels=False)
    good = model(**kw, use_cache=False).logits[0]
    kw["position_ids"] = torch.arange(batch.num_padded_tokens)[None]
    leaky = model(**kw, use_cache=False).logits[0]
    second = slice(9, 21)
    alone = model(input_ids=_as_long(samples[1]["input_ids"])[None], use_cache=False).logits[0]
    assert (good[second] - alone).abs().max().item() < LOGIT_ATOL
    assert (leaky[second] - alone).abs().max().item() > 100 * LOGIT_ATOL
