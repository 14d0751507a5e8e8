"""Shared prefixes of Qwen-VL prompts with images: ``build_thd_batch(samples, share_prefix="group",
model_config=cfg)``.

Consumer code: the families' own ``model.model.get_rope_index`` (mRoPE of every sample alone) and tiny
random-weight transformers VLMs (``test_vlm.tiny_config``: 2 text layers, 2 ViT blocks, fp32, eval mode)
run on ``to_hf_kwargs(attn_implementation=..., include_labels=False)`` with ``use_cache=False`` (sdpa /
eager: the dense tree mask). The reference is the *unshared* packed batch of the same samples (whose
per-sample equivalence to each sample alone ``tests/test_vlm.py`` holds), on sdpa:

- mRoPE rows and token types of every member (at ``prefix_tree.unshared_rows``) are those of the sample
  alone (``get_rope_index``) and the unshared batch's rows gathered;
- the prompt's images are listed once (pixels, grids, ViT segments), a member's own images after them;
- a found prefix stops before an image that differs between members (same placeholders, other pixels);
  a declared one that splits or differs is a ``ValueError`` naming the group;
- logits, per-member ``sequence_logps``, a token-mean ``packed_loss`` and its gradients with respect to
  every parameter (ViT included: the tree runs it once on a shared image) equal the unshared batch's.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

import test_vlm as tv  # noqa: E402
from thdpack import build_thd_batch  # noqa: E402
from thdpack.losses import packed_loss, sequence_logps  # noqa: E402

REL = 1e-5
FAMILY = "qwen2_5_vl"


# --------------------------------------------------------------------------- samples


def _member(prompt: dict, suffix: list, rng, group: int, family: str) -> dict:
    """``prompt`` (a processor-style sample) followed by ``suffix`` (a ``test_vlm.build_ids`` layout, its
    images with fresh pixels); prompt tokens and placeholders carry no loss."""
    own = tv.make_sample(family, suffix, rng) if suffix else {"input_ids": [], "labels": []}
    ids = list(prompt["input_ids"]) + list(own["input_ids"])
    labels = [tv.IGNORE] * len(prompt["input_ids"]) + list(own["labels"])
    sample = {"input_ids": ids, "labels": labels, "group": group}
    for pix, grid in (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw")):
        parts = [s for s in (prompt, own) if grid in s]
        if parts:
            sample[grid] = torch.cat([s[grid] for s in parts])
            sample[pix] = torch.cat([s[pix] for s in parts])
    return sample


@functools.lru_cache(maxsize=None)
def vlm_samples(family: str = FAMILY) -> tuple:
    """Group 0: a prompt with an image, 3 members (one with its own image, one equal to the prompt);
    group 1: a prompt with two images (a video where the family has one), 2 members; group 2: members
    whose prompts differ only in an image's pixels (shared up to it); a sample alone with an image."""
    rng = np.random.default_rng(3)
    torch.manual_seed(3)
    p0 = tv.make_sample(family, [("text", 4), ("image", (1, 4, 4)), ("text", 30)], rng)
    p1 = tv.make_sample(family, [("text", 3), ("image", (1, 2, 2)), ("text", 6), ("video", (2, 2, 4)),
                                 ("text", 25)], rng)
    p2 = tv.make_sample(family, [("text", 36), ("image", (1, 2, 4)), ("text", 3)], rng)
    p2b = dict(p2, pixel_values=torch.randn_like(p2["pixel_values"]))
    samples = [
        _member(p0, [("text", 5)], rng, 0, family),
        _member(p1, [("text", 4)], rng, 1, family),
        _member(p0, [("text", 2), ("image", (1, 2, 2)), ("text", 3)], rng, 0, family),
        _member(p2, [("text", 6)], rng, 2, family),
        _member(p0, [], rng, 0, family),
        _member(p1, [("text", 7)], rng, 1, family),
        _member(p2b, [("text", 4)], rng, 2, family),
        dict(tv.make_sample(family, [("text", 3), ("image", (1, 2, 2)), ("text", 9)], rng), group=3),
    ]
    return tuple(samples)


def batches(family: str = FAMILY, **layout):
    samples = list(vlm_samples(family))
    cfg = tv.tiny_config(family)
    return samples, build_thd_batch(samples, model_config=cfg), build_thd_batch(
        samples, share_prefix="group", model_config=cfg, **layout)


def flat_rows(batch) -> torch.Tensor:
    cu, lens = batch.cu_seqlens_padded.tolist(), batch.seq_lens.tolist()
    return torch.cat([torch.arange(a, a + s) for a, s in zip(cu, lens)])


def assert_close_rel(got, want, what: str) -> None:
    err = float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))
    assert err < REL, f"{what}: relative error {err:.2e}"


# --------------------------------------------------------------------------- layout (no forward)


def common_prefix(a, b) -> int:
    a, b = np.asarray(a), np.asarray(b)
    n = min(a.size, b.size)
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


@pytest.mark.parametrize("family", tv.FAMILIES)
def test_mrope_rows_and_images_of_the_tree(family):
    samples, flat, tree = batches(family, pad_multiple=4)
    pt = tree.prefix_tree
    ids = [s["input_ids"] for s in samples]
    g0 = min(common_prefix(ids[0], ids[2]), len(ids[4]))
    g1 = common_prefix(ids[1], ids[5])
    # group 2: its text and the image's vision-start token (the image's pixels differ)
    assert pt.prefix_lens.tolist() == [g0, g1, g0, 37, g0, g1, 37, 0]
    model = tv.tiny_model(family)
    rows = torch.split(pt.unshared_rows, pt.sample_lens.tolist())
    frows = torch.split(flat_rows(flat), pt.sample_lens.tolist())
    mrope, types = tree.token_extras["mrope_position_ids"], tree.token_extras["mm_token_type_ids"]
    assert mrope.shape == (3, tree.input_ids.numel()) and types.shape == tree.input_ids.shape
    for j, (s, r, fr) in enumerate(zip(samples, rows, frows)):
        want, _ = tv.reference_rope(model, s)
        assert torch.equal(mrope[:, r], want), f"sample {j}: mRoPE rows differ from get_rope_index alone"
        assert torch.equal(mrope[:, r], flat.token_extras["mrope_position_ids"][:, fr]), f"sample {j}"
        assert torch.equal(types[r], tv.token_types(torch.as_tensor(s["input_ids"])).to(types.dtype)), f"sample {j}"
    assert_items_once(tree, samples)


def assert_items_once(tree, samples) -> None:
    """The tree's pixels are, in stream order, those of the items whose placeholders each segment holds
    (a prefix's from its first member, once), with their grids; the ViT segments cover them."""
    pt = tree.prefix_tree
    for tok, pix, grid_key in ((tv.IMG, "pixel_values", "image_grid_thw"),
                               (tv.VID, "pixel_values_videos", "video_grid_thw")):
        want_pix, want_grid = [], []
        for seg, j in enumerate(pt.segment_sample.tolist()):
            if j < 0:  # a shared prefix: its first member's items before the prefix's end
                j = int(pt.segment_sample[torch.nonzero(pt.parents == seg)[0, 0]])
                lo, hi = 0, int(pt.prefix_lens[j])
            else:
                lo, hi = int(pt.prefix_lens[j]), int(pt.sample_lens[j])
            s = samples[j]
            if grid_key not in s:
                continue
            patches = s[grid_key].prod(1)
            counts = patches // tv.MERGE**2
            starts = torch.nonzero(torch.as_tensor(s["input_ids"]) == tok)[:, 0][torch.cumsum(counts, 0) - counts]
            rows0 = torch.cumsum(patches, 0) - patches
            for k in range(len(patches)):
                if lo <= int(starts[k]) < hi:
                    want_pix.append(s[pix][int(rows0[k]): int(rows0[k] + patches[k])])
                    want_grid.append(s[grid_key][k])
        if not want_grid:
            assert tree.extras[grid_key] is None and tree.extras[pix] is None
            continue
        assert torch.equal(tree.extras[grid_key], torch.stack(want_grid)), grid_key
        assert torch.equal(tree.extras[pix], torch.cat(want_pix)), f"{pix}: not the stream's items, in order"
        assert int(tree.extras[grid_key].prod(1).sum()) // tv.MERGE**2 == int((tree.input_ids == tok).sum())
    n_rows = sum(int(tree.extras[k].shape[0]) for k in ("pixel_values", "pixel_values_videos")
                 if tree.extras.get(k) is not None)
    assert int(tree.extras["vision_cu_seqlens"][-1]) == n_rows
    assert tree.extras["num_image_segments"] == tree.extras["image_grid_thw"][:, 0].sum()
