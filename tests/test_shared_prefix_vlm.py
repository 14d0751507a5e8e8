"""Shared prefixes of Qwen-VL prompts with images: ``build_thd_batch(samples, share_prefix="group",
vlm=get_family(cfg))``.

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

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import test_vlm as tv  # noqa: E402
from thdpack import build_thd_batch  # noqa: E402
from thdpack.losses import packed_loss, sequence_logps  # noqa: E402
from thdpack.vlm import get_family  # noqa: E402
from thdpack.integrations import to_hf_kwargs  # noqa: E402

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
    return samples, build_thd_batch(samples, vlm=get_family(cfg)), build_thd_batch(
        samples, share_prefix="group", vlm=get_family(cfg), **layout)


def flat_rows(batch) -> torch.Tensor:
    cu, lens = batch.cu_seqlens_padded.tolist(), batch.seq_lens.tolist()
    return torch.cat([torch.arange(a, a + s) for a, s in zip(cu, lens)])


def assert_close_rel(got, want, what: str) -> None:
    err = float((got - want).detach().abs().max() / want.detach().abs().max().clamp_min(1e-30))
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
    grid = tree.extras["image_grid_thw"]
    assert tree.extras["num_image_segments"] == (0 if grid is None else int(grid[:, 0].sum()))


# --------------------------------------------------------------------------- the model: logits, losses, gradients


@functools.lru_cache(maxsize=None)
def vlm_model(attn: str) -> torch.nn.Module:
    """The tiny Qwen2.5-VL of ``test_vlm`` (same seed, same weights) with ``attn`` attention."""
    cfg = tv.tiny_config(FAMILY)
    cfg._attn_implementation = attn
    torch.manual_seed(1234)
    model = transformers.Qwen2_5_VLForConditionalGeneration(cfg).to(torch.float32).eval()
    assert model.config.text_config._attn_implementation == attn
    return model


def logits_of(model, batch, attn: str) -> torch.Tensor:
    kw = to_hf_kwargs(batch, attn_implementation=attn, include_labels=False)
    return model(**kw, use_cache=False).logits[0]


def weighted_logps(logits, batch):
    return (sequence_logps(logits, batch)[0] * torch.linspace(-1, 2, batch.num_samples)).sum()


LOSSES = {"sequence_logps": weighted_logps, "packed_loss": lambda logits, batch: packed_loss(logits, batch, "token")}


def _grads(loss, model) -> torch.Tensor:
    grads = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True, allow_unused=True)
    assert sum(g is None for g in grads) == 0, "every parameter, the ViT's included, has a gradient"
    return torch.cat([g.reshape(-1) for g in grads])


@functools.lru_cache(maxsize=None)
def reference() -> tuple:
    """The unshared batch on sdpa: its logits, per-sample log-probs, and each loss with its gradient."""
    _, flat, _ = batches(pad_multiple=8)
    model = vlm_model("sdpa")
    logits = logits_of(model, flat, "sdpa")
    losses = {what: loss_of(logits, flat) for what, loss_of in LOSSES.items()}
    return (logits.detach()[flat_rows(flat)], sequence_logps(logits, flat)[0].detach(),
            {what: (loss.detach(), _grads(loss, model)) for what, loss in losses.items()})


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_logps_loss_and_gradients_equal_unshared(attn):
    _, flat, tree = batches(pad_multiple=8)
    assert tree.prefix_tree.num_shared_groups == 3 and tree.num_tokens < flat.num_tokens - 100
    assert tree.extras["pixel_values"].shape[0] < flat.extras["pixel_values"].shape[0] - 2 * 16
    want_logits, want_logps, want = reference()
    model = vlm_model(attn)
    got_logits = logits_of(model, tree, attn)
    diff = (got_logits[tree.prefix_tree.unshared_rows] - want_logits).abs().max().item()
    assert diff < tv.LOGIT_ATOL, f"max |logit diff| {diff:.3g}"
    assert_close_rel(sequence_logps(got_logits, tree)[0], want_logps, "per-member sequence_logps")
    for what, loss_of in LOSSES.items():
        got_loss = loss_of(got_logits, tree)
        assert_close_rel(got_loss, want[what][0], what)
        assert_close_rel(_grads(got_loss, model), want[what][1], f"{what} gradient")


# --------------------------------------------------------------------------- declared prefixes


def test_declared_prefix_must_end_after_whole_equal_images():
    samples = [dict(s) for s in vlm_samples()]
    cfg = tv.tiny_config(FAMILY)
    p0 = len(samples[4]["input_ids"])  # group 0's prompt: text, an image (placeholders 5..8), text
    for j in (0, 2, 4):
        samples[j]["prefix_len"] = p0
    tree = build_thd_batch(samples, share_prefix="group", vlm=get_family(cfg))
    assert tree.prefix_tree.prefix_lens[[0, 2, 4]].tolist() == [p0] * 3
    for j in (0, 2, 4):
        samples[j]["prefix_len"] = 7  # inside the image's placeholders
    with pytest.raises(ValueError, match=r"^group 0 \(samples 0, 2, 4\): the declared prefix_len=7 .* ends inside "
                                         r"sample 0's image at tokens 5\.\.8") as err:
        build_thd_batch(samples, share_prefix="group", vlm=get_family(cfg), min_prefix_len=4)
    assert "\n" not in str(err.value)
    for j in (0, 2, 4):
        samples[j]["prefix_len"] = p0
    for j in (3, 6):
        samples[j]["prefix_len"] = 40  # past group 2's image, whose pixels differ
    with pytest.raises(ValueError, match=r"^group 2 \(samples 3, 6\): the declared prefix_len=40 .* sample 6's "
                                         r"image 0 differs from sample 3's"):
        build_thd_batch(samples, share_prefix="group", vlm=get_family(cfg))


# --------------------------------------------------------------------------- hypothesis: random groups


@st.composite
def vlm_groups(draw):
    """Groups of a prompt (text and 0-2 images) and 1-3 members (the first group 2-3), each continuing with text and maybe an image
    of its own, its prompt images maybe redrawn (other pixels) or resized (other placeholders)."""
    grids = st.sampled_from([(1, 2, 2), (1, 2, 4), (1, 4, 4), (2, 2, 2)])
    groups = []
    for _ in range(draw(st.integers(1, 3))):
        prompt = [("text", draw(st.integers(1, 12)))]
        for _ in range(draw(st.integers(0, 2))):
            prompt += [("image", draw(grids)), ("text", draw(st.integers(0, 6)))]
        members = []
        for _ in range(draw(st.integers(1, 3) if groups else st.integers(2, 3))):
            suffix = [("text", draw(st.integers(0, 5)))]
            if draw(st.booleans()):
                suffix += [("image", draw(grids)), ("text", draw(st.integers(0, 3)))]
            members.append((suffix, draw(st.sampled_from(["same", "pixels", "grid"]))))
        groups.append((prompt, members))
    return dict(groups=groups, seed=draw(st.integers(0, 1000)), min_prefix_len=draw(st.integers(1, 4)),
                pad_multiple=draw(st.sampled_from([1, 4])))


def random_samples(case) -> list[dict]:
    rng = np.random.default_rng(case["seed"])
    samples = []
    for g, (prompt, members) in enumerate(case["groups"]):
        base = tv.make_sample(FAMILY, prompt, rng)
        for suffix, change in members:
            mine = base
            images = [k for k, (kind, _) in enumerate(prompt) if kind == "image"]
            if change != "same" and images:
                k = images[int(rng.integers(len(images)))]
                layout = list(prompt)
                if change == "grid":
                    layout[k] = ("image", (1, 4, 2) if layout[k][1] != (1, 4, 2) else (1, 2, 2))
                mine = dict(base, **tv.make_sample(FAMILY, layout, np.random.default_rng(int(rng.integers(99)))))
                mine["input_ids"] = list(base["input_ids"]) if change == "pixels" else mine["input_ids"]
                mine["labels"] = list(base["labels"]) if change == "pixels" else mine["labels"]
            samples.append(_member(mine, suffix, rng, g, FAMILY))
    return samples


@pytest.mark.filterwarnings("ignore:thdpack. a batch of")
@settings(deadline=None, max_examples=15, derandomize=True)
@given(vlm_groups())
def test_random_vlm_groups(case):
    """Hypothesis: whatever the prompts' images and the members' changes, every member's mRoPE rows are its
    ``get_rope_index`` alone, its tokens its own, no prefix ends inside an image, each item is listed once."""
    samples = random_samples(case)
    cfg = tv.tiny_config(FAMILY)
    batch = build_thd_batch(samples, share_prefix="group", vlm=get_family(cfg), min_prefix_len=case["min_prefix_len"],
                            pad_multiple=case["pad_multiple"])
    model = tv.tiny_model(FAMILY)
    if batch.prefix_tree is None:  # nothing shared: the unshared batch
        assert torch.equal(batch.token_extras["mrope_position_ids"],
                           build_thd_batch(samples, vlm=get_family(cfg), pad_multiple=case["pad_multiple"])
                           .token_extras["mrope_position_ids"])
        return
    pt = batch.prefix_tree
    for j, (s, r) in enumerate(zip(samples, torch.split(pt.unshared_rows, pt.sample_lens.tolist()))):
        ids = torch.as_tensor(s["input_ids"])
        assert torch.equal(batch.input_ids[r], ids), f"sample {j}: tokens"
        assert torch.equal(batch.token_extras["mrope_position_ids"][:, r], tv.reference_rope(model, s)[0]), j
        p = int(pt.prefix_lens[j])
        if 0 < p < ids.numel():
            assert not (ids[p - 1] == tv.IMG and ids[p] == tv.IMG), f"sample {j}: prefix {p} splits an image"
    assert_items_once(batch, samples)


def test_prefix_stops_where_members_mrope_rows_differ():
    """Equal tokens and images but other mRoPE rows (e.g. a video's spacing given in another dtype): the
    family's limit cuts a found prefix there and refuses a declared one."""
    samples, flat, _ = batches()
    family = get_family(tv.tiny_config(FAMILY))
    p0 = len(samples[4]["input_ids"])
    members = np.array([0, 2, 4])
    limit = family.prefix_limit(flat)
    assert limit(members, p0, False, "group 0") == p0
    flat.token_extras["mrope_position_ids"][1, int(flat.cu_seqlens[2]) + 20] += 1
    limit = family.prefix_limit(flat)
    assert limit(members, p0, False, "group 0") == 20
    with pytest.raises(ValueError, match=r"^group 0: the declared prefix_len=40 .* mRoPE positions differ from token 20"):
        limit(members, p0, True, "group 0")


def assert_same_tree(got, tree, samples) -> None:
    """``got`` (a pack of ``samples``, in its own order) has ``tree``'s layout: the same prefixes, each
    sample's mRoPE rows, every image once."""
    assert torch.equal(got.prefix_tree.prefix_lens, tree.prefix_tree.prefix_lens[got.sample_index])
    rows = torch.split(got.prefix_tree.unshared_rows, got.prefix_tree.sample_lens.tolist())
    want_rows = torch.split(tree.prefix_tree.unshared_rows, tree.prefix_tree.sample_lens.tolist())
    for j, r in zip(got.sample_index.tolist(), rows):
        assert torch.equal(got.token_extras["mrope_position_ids"][:, r],
                           tree.token_extras["mrope_position_ids"][:, want_rows[j]]), f"sample {j}"
    assert_items_once(got, [samples[j] for j in got.sample_index.tolist()])


def test_collator_builds_the_same_tree():
    from thdpack import ThdCollator

    samples, _, tree = batches(pad_multiple=8)
    packs = ThdCollator(pack_size=4096, share_prefix="group", vlm=get_family(tv.tiny_config(FAMILY)), pad_multiple=8)(samples)
    assert len(packs) == 1
    got = packs[0]
    assert_same_tree(got, tree, samples)


def test_rebalance_shares_vlm_prompts_as_build_thd_batch_does():
    """thdpack.rebalance(share_prefix="group", vlm=family) plans each prompt with images once, cut where
    build_thd_batch cuts it (whole, equal images): its pack is the tree build_thd_batch lays out."""
    from thdpack import rebalance

    samples, _, tree = batches(pad_multiple=8)
    packs, handle = rebalance(samples, 4096, share_prefix="group", vlm=get_family(tv.tiny_config(FAMILY)), pad_multiple=8)
    assert len(packs) == 1
    got = packs[0]
    assert_same_tree(got, tree, samples)
    assert got.num_tokens == tree.num_tokens
    assert handle.restore(got.sample_index).tolist() == list(range(len(samples)))
