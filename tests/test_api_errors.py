"""Python API messages (issue 11, section 7): bad ids, fields, arguments, lengths and
pixel rows are ``ValueError``s naming the sample and field (or argument); and the
rule for samples that give both ``labels`` and ``loss_mask``."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import thdpack
from thdpack import SampleError, ThdCollator, build_thd_batch, plan_hybrid_cp, plan_packs, rebalance
from thdpack.batching import BatchLayout
from thdpack.offline import PackedRowCollator
from thdpack.vlm import get_family

OK = {"input_ids": [1, 2, 3]}
IGNORE = -100
FAST = settings(max_examples=60, deadline=None, derandomize=True)


def build(bad, **kw):
    """Build a pack whose sample 1 is ``bad`` (samples 0 and 2 are fine)."""
    return build_thd_batch([OK, bad, OK], **kw)


# --------------------------------------------------------------------------
# ids as tensors the numpy bridge cannot read
# --------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("field", ["input_ids", "labels", "loss_mask"])
def test_floating_point_tensor_field(dtype, field):
    value = torch.tensor([1, 2, 3], dtype=dtype)
    bad = {"input_ids": [4, 5, 6], field: value}
    with pytest.raises(ValueError, match=rf"^sample 1: field '{field}' must hold integers, got {dtype}"):
        build(bad)


def test_meta_tensor_ids():
    bad = {"input_ids": torch.empty(3, dtype=torch.long, device="meta")}
    with pytest.raises(ValueError, match=r"^sample 1: field 'input_ids' is a meta tensor \(no data\)"):
        build(bad)


def test_collator_names_tensor_errors_by_place_in_call():
    bad = {"input_ids": torch.tensor([1, 2], dtype=torch.bfloat16)}
    with pytest.raises(ValueError, match=r"^sample 1: field 'input_ids' must hold integers, got torch.bfloat16"):
        ThdCollator()([OK, bad])
    with pytest.raises(ValueError, match=r"^sample 2: field 'input_ids' must hold integers, got torch.bfloat16") as err:
        ThdCollator(pack_size=16)([OK, OK, bad])
    assert isinstance(err.value, SampleError) and (err.value.sample, err.value.field) == (2, "input_ids")


def test_collator_renames_a_pack_error_keeping_its_field():
    """An error found while building a pack names the sample by its place in the call
    (SampleError.renamed), and keeps the field at fault."""
    bad = {"input_ids": [1, 2, 3], "labels": [1, -5, 2]}
    with pytest.raises(SampleError, match=r"^sample 2: 'labels' has -5 at token 1.*\(position 2 of pack 0\)") as err:
        ThdCollator(pack_size=16)([OK, OK, bad])
    assert (err.value.sample, err.value.field) == (2, "labels")


# --------------------------------------------------------------------------
# None, None elements, values beyond int64
# --------------------------------------------------------------------------
def test_input_ids_none():
    with pytest.raises(ValueError, match=r"^sample 1: field 'input_ids' is None; give the sample's token ids"):
        build({"input_ids": None})
    with pytest.raises(ValueError, match=r"^sample 1: field 'input_ids' is None"):
        ThdCollator(pack_size=16)([OK, {"input_ids": None}])


def test_missing_input_ids_still_lists_the_fields():
    with pytest.raises(ValueError, match=r"^sample 1 has no 'input_ids' field \(fields: \['ids'\]\)"):
        build({"ids": [1, 2]})


@pytest.mark.parametrize(
    "values, shown, token",
    [
        ([1, None, 3], "None", 1),
        ([1, 2, "3"], "'3'", 2),
        ([1, 2**64, 3], str(2**64), 1),
        ([2**63, 1], str(2**63), 0),
        ([1, -(2**63) - 1], str(-(2**63) - 1), 1),
        ((1, 2.5), "2.5", 1),
    ],
    ids=["none", "str", "2**64", "2**63", "below-int64", "tuple-float"],
)
@pytest.mark.parametrize("field", ["input_ids", "labels"])
def test_bad_list_element_named_with_its_token(values, shown, token, field):
    bad = {"input_ids": [4] * len(values), field: values}
    with pytest.raises(ValueError, match=rf"^sample 1: field '{field}' must hold integers in int64 range, got {shown} at token {token}$"):
        build(bad)


def test_uint64_ids_beyond_int64():
    ids = np.array([1, 2**63 + 5, 3], dtype=np.uint64)
    with pytest.raises(ValueError, match=rf"^sample 1: field 'input_ids' must hold integers in int64 range, got {2**63 + 5} at token 1$"):
        build({"input_ids": ids})


def test_uint64_ids_within_int64_are_fine():
    batch = build({"input_ids": np.array([7, 8], dtype=np.uint64)})
    assert batch.input_ids.tolist() == [1, 2, 3, 7, 8, 1, 2, 3]


_BAD_ELEMENTS = st.one_of(
    st.none(),
    st.text(max_size=3),
    st.floats(allow_nan=True).filter(lambda x: not float(x).is_integer()),
    st.integers(min_value=2**63, max_value=2**80),
    st.integers(max_value=-(2**63) - 1, min_value=-(2**80)),
    st.lists(st.integers(0, 9), max_size=2),
)


@FAST
@given(
    good=st.lists(st.integers(0, 1000), min_size=1, max_size=8),
    bad=_BAD_ELEMENTS,
    at=st.integers(0, 8),
    which=st.integers(0, 3),
    field=st.sampled_from(["input_ids", "labels"]),
)
def test_any_invalid_element_names_its_sample(good, bad, at, which, field):
    """Whatever invalid value sits anywhere in a list, the error is a ValueError
    that names the sample and the field."""
    values = list(good)
    values.insert(min(at, len(values)), bad)
    sample = {"input_ids": [5] * len(values), field: values}
    samples = [dict(OK) for _ in range(4)]
    samples[which] = sample
    with pytest.raises(ValueError, match=rf"^sample {which}(:| has).*'{field}'") as err:
        build_thd_batch(samples)
    assert isinstance(err.value, SampleError) and (err.value.sample, err.value.field) == (which, field)


def _tensor(dtype):
    return st.lists(st.integers(0, 9), min_size=1, max_size=5).map(lambda v: torch.tensor(v).to(dtype))


_BAD_FIELDS = st.one_of(
    st.text(max_size=4),
    st.integers(0, 9),
    st.floats(),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
    st.lists(st.lists(st.integers(0, 9), min_size=1, max_size=3), min_size=2, max_size=3),  # nested
    st.sampled_from([torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.bool]).flatmap(_tensor),
    st.lists(st.floats(allow_nan=False).filter(lambda x: not x.is_integer()), min_size=1, max_size=4).map(np.array),
    st.integers(2**63, 2**64 - 1).map(lambda v: np.array([1, v], dtype=np.uint64)),
    st.just(torch.empty(2, dtype=torch.long, device="meta")),
)


@FAST
@given(bad=_BAD_FIELDS, which=st.integers(0, 3), field=st.sampled_from(["input_ids", "labels"]))
def test_any_invalid_field_value_names_its_sample(bad, which, field):
    """Whatever invalid value a whole field holds, the error is a ValueError naming
    the sample and the field (never a TypeError or a torch error)."""
    samples = [dict(OK) for _ in range(4)]
    samples[which] = {"input_ids": [5, 6], field: bad}
    with pytest.raises(ValueError, match=rf"^sample {which}: field '{field}'") as err:
        build_thd_batch(samples)
    assert isinstance(err.value, SampleError) and (err.value.sample, err.value.field) == (which, field)


# --------------------------------------------------------------------------
# builder arguments
# --------------------------------------------------------------------------
@pytest.mark.parametrize("value", [None, "0", 1.0, -1, True, 2**63])
def test_bad_pad_token_id(value):
    with pytest.raises(ValueError, match=rf"^pad_token_id must be an integer >= 0.*got {value!r}"):
        build_thd_batch([OK], pad_token_id=value)
    with pytest.raises(ValueError, match=r"^pad_token_id must be an integer >= 0"):
        ThdCollator(pad_token_id=value)


def test_pad_token_id_none_hint():
    with pytest.raises(ValueError, match=r"eos_token_id"):
        build_thd_batch([OK], pad_token_id=None)


@pytest.mark.parametrize("value", [None, "x", -1.5, False])
def test_bad_ignore_index(value):
    with pytest.raises(ValueError, match=rf"^ignore_index must be an integer.*got {value!r}"):
        build_thd_batch([OK], ignore_index=value)
    with pytest.raises(ValueError, match=r"^ignore_index must be an integer"):
        ThdCollator(ignore_index=value)


def test_numpy_integer_arguments_accepted():
    batch = build_thd_batch([OK], pad_token_id=np.int64(9), ignore_index=np.int32(-1), pad_multiple=4)
    assert batch.input_ids.tolist() == [1, 2, 3, 9]
    assert batch.labels.tolist() == [2, 3, -1, -1]


# --------------------------------------------------------------------------
# planning lengths
# --------------------------------------------------------------------------
def test_uint64_length_beyond_int64():
    with pytest.raises(ValueError, match=rf"^sample 1 has length {2**63}; lengths must be integers in int64 range$"):
        plan_packs(np.array([3, 2**63], dtype=np.uint64), 10)


@pytest.mark.parametrize("lengths, i, shown", [([3, 2**64], 1, str(2**64)), ([None, 3], 0, "None")])
def test_python_length_not_an_int64(lengths, i, shown):
    with pytest.raises(ValueError, match=rf"^sample {i} has length {shown}; lengths must be integers in int64 range$"):
        plan_packs(lengths, 10)


# --------------------------------------------------------------------------
# VLM: pixel rows of the wrong width
# --------------------------------------------------------------------------
IMG, VID, VS, VE = 120, 121, 118, 119


def _vlm_config(model_type="qwen2_vl", **vision):
    vision = {"patch_size": 2, "temporal_patch_size": 2, "in_channels": 3, "spatial_merge_size": 2, **vision}
    return {"model_type": model_type, "image_token_id": IMG, "video_token_id": VID,
            "vision_start_token_id": VS, "vision_config": vision}


def _image_sample(width):
    return {"input_ids": [1, VS] + [IMG] * 4 + [VE, 2], "image_grid_thw": [[1, 4, 4]],
            "pixel_values": torch.zeros(16, width)}


@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5"])
def test_pixel_rows_of_wrong_width(model_type):
    cfg = _vlm_config(model_type)
    build_thd_batch([_image_sample(24)], vlm=get_family(cfg))  # 3 · 2 · 2² = 24
    with pytest.raises(
        ValueError,
        match=r"^sample 1: 'pixel_values' rows have 25 values but the model config expects 24 "
        r"\(in_channels 3 · temporal_patch_size 2 · patch_size 2²\)",
    ) as err:
        build_thd_batch([_image_sample(24), _image_sample(25)], vlm=get_family(cfg))
    assert (err.value.sample, err.value.field) == (1, "pixel_values")


def test_pixel_width_from_legacy_in_chans_and_video_rows():
    cfg = _vlm_config(in_chans=1, in_channels=None)
    video = {"input_ids": [1, VS] + [VID] * 8 + [VE], "video_grid_thw": [[2, 4, 4]],
             "pixel_values_videos": torch.zeros(32, 9)}
    with pytest.raises(ValueError, match=r"^sample 0: 'pixel_values_videos' rows have 9 values but the model config expects 8"):
        build_thd_batch([video], vlm=get_family(cfg))


def test_pixel_width_unchecked_without_patch_size():
    cfg = _vlm_config()
    del cfg["vision_config"]
    batch = build_thd_batch([_image_sample(7)], vlm=get_family(cfg))
    assert batch.extras["pixel_values"].shape == (16, 7)


# --------------------------------------------------------------------------
# labels and loss_mask together: a token is a target only where both say so
# --------------------------------------------------------------------------
def test_labels_and_loss_mask_both_given_is_their_and():
    sample = {"input_ids": [1, 2, 3, 4, 5], "labels": [IGNORE, 2, 3, IGNORE, 5], "loss_mask": [1, 1, 0, 1, 1]}
    batch = build_thd_batch([sample])
    # targets (unshifted): labels say tokens 1, 2, 4; the mask says 0, 1, 3, 4: both say 1 and 4
    assert batch.labels.tolist() == [2, IGNORE, IGNORE, 5, IGNORE]
    assert batch.loss_mask.tolist() == [True, False, False, True, False]


@st.composite
def _targeted_samples(draw):
    n = draw(st.integers(1, 4))
    out = []
    for _ in range(n):
        s = draw(st.integers(1, 9))
        ids = draw(st.lists(st.integers(0, 50), min_size=s, max_size=s))
        labels = [draw(st.sampled_from([IGNORE, t])) for t in ids]
        mask = draw(st.lists(st.booleans(), min_size=s, max_size=s))
        out.append({"input_ids": ids, "labels": labels, "loss_mask": mask})
    return out


@pytest.mark.filterwarnings("ignore:thdpack.*no target")  # random packs may have no target: expected here
@FAST
@given(samples=_targeted_samples(), cp=st.sampled_from([1, 2]))
def test_both_given_equals_labels_masked_by_loss_mask(samples, cp):
    """Both given == labels alone, with the masked-out tokens set to ignore_index."""
    anded = [
        {"input_ids": s["input_ids"], "labels": [lab if m else IGNORE for lab, m in zip(s["labels"], s["loss_mask"])]}
        for s in samples
    ]
    for rank in ([None] if cp == 1 else range(cp)):
        kw = dict(cp_size=cp, cp_rank=rank)
        both, ref = build_thd_batch(samples, **kw), build_thd_batch(anded, **kw)
        assert torch.equal(both.labels, ref.labels)
        assert torch.equal(both.loss_mask, ref.loss_mask)
    # and symmetrically: the mask alone, with the labels' ignored tokens masked out
    masked = [
        {"input_ids": s["input_ids"], "loss_mask": [m and lab != IGNORE for lab, m in zip(s["labels"], s["loss_mask"])]}
        for s in samples
    ]
    assert torch.equal(build_thd_batch(samples).labels, build_thd_batch(masked).labels)


# --------------------------------------------------------------------------
# the collator names samples by their place in its call, without parsing messages
# --------------------------------------------------------------------------
@pytest.mark.parametrize("overflow", ["truncate", "split"])
def test_cut_sample_with_bad_labels_is_named(overflow):
    """Samples cut by the plan were read with no index ('sample -1')."""
    long_bad = {"input_ids": [1, 2, 3, 4, 5, 6], "labels": [1.0] * 6}
    first = {"input_ids": [1, 2, 3, 4]}
    with pytest.raises(ValueError, match=r"^sample 1: field 'labels' must hold integers in int64 range, got 1.0 at token 0$"):
        ThdCollator(pack_size=4, overflow=overflow)([first, long_bad])


def test_split_sample_with_short_mask_names_its_whole_length():
    """A piece of a split sample compared its mask slice with the piece, not the sample."""
    bad = {"input_ids": [1, 2, 3, 4, 5, 6], "loss_mask": [1, 1, 1]}
    # the error is raised while the pack is gathered: it names the input row, and is not
    # renamed again as if it named a position in the pack
    with pytest.raises(ValueError, match=r"^sample 0: 'loss_mask' has 3 values but 'input_ids' has 6$"):
        ThdCollator(pack_size=4, overflow="split")([bad, {"input_ids": [1, 2]}])


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"input_ids": [1, -2]}, r"'input_ids' has negative id -2 at token 1"),
        ({"input_ids": [1, 2], "labels": [1, None]}, r"field 'labels' must hold integers in int64 range"),
        ({"input_ids": [1, 2], "loss_mask": [1, 2]}, r"'loss_mask' has 2 at token 1"),
        (_image_sample(25), r"'pixel_values' rows have 25 values"),
        ({**_image_sample(24), "image_grid_thw": [[1, 2, 4]]}, r"'pixel_values' has 16 rows but 'image_grid_thw' gives 8"),
        ({**_image_sample(24), "input_ids": [1, 2]}, r"its input_ids have 0 run\(s\) of image placeholder"),
    ],
    ids=["negative-id", "none-label", "mask-2", "pixel-width", "grid-rows", "placeholders"],
)
def test_collator_renames_every_sample_error(bad, message):
    """The bad sample is 3rd in the call but 2nd of the second pack (pack_size 12, next fit: 12 | 2 + 8)."""
    samples = [{"input_ids": list(range(1, 13))}, {"input_ids": [1, 2]}, bad]
    with pytest.raises(ValueError, match=rf"^sample 2: {message}.*\(position 1 of pack 1\)$"):
        ThdCollator(pack_size=12, algorithm="sequential", vlm=get_family(_vlm_config()))(samples)


def test_sample_error_is_a_value_error_rebuilt_from_its_message():
    """DataLoader workers re-raise ``type(exc)(message)``: that must stay a ValueError."""
    with pytest.raises(ValueError) as info:
        build({"input_ids": [1, None]})
    err = info.value
    assert (err.sample, err.detail) == (1, ": field 'input_ids' must hold integers in int64 range, got None at token 1")
    again = type(err)(str(err))
    assert isinstance(again, ValueError) and str(again) == str(err) and again.sample is None


# -------------------------------------------------------------------------- the batch layout


def test_layout_keywords_and_a_held_layouts_keywords_build_the_same_batch():
    samples = [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5, 6, 7, 8]}]
    keywords = dict(pad_token_id=9, cp_size=2, tp_size=2, sequence_parallel=True, pad_multiple=8, pad_to=32, cp_rank=1)
    layout = BatchLayout(**keywords)
    assert BatchLayout(**layout.keywords()) == layout and set(layout.keywords()) >= set(keywords)
    by_keywords = build_thd_batch(samples, **keywords)
    by_layout = build_thd_batch(samples, **layout.keywords())
    assert torch.equal(by_keywords.input_ids, by_layout.input_ids)
    assert torch.equal(by_keywords.shard.partition_indices, by_layout.shard.partition_indices)
    assert ThdCollator(**keywords).layout == layout == ThdCollator(**layout.keywords()).layout
    assert ThdCollator(cp_size=1, cp_rank=0).layout.cp_rank is None  # one CP rank: the whole batch


@pytest.mark.parametrize("owner", [build_thd_batch, ThdCollator, PackedRowCollator])
def test_unknown_layout_keyword_names_the_callee(owner):
    call = (lambda **kw: owner([{"input_ids": [1]}], **kw)) if owner is build_thd_batch else owner
    with pytest.raises(TypeError, match=rf"^{owner.__name__}\(\) got unexpected keyword argument\(s\) 'pad_id'"):
        call(pad_id=0)


@pytest.mark.parametrize("owner, call", [
    ("build_thd_batch", lambda **kw: build_thd_batch([{"input_ids": [1, 2]}], **kw)),
    ("ThdCollator", ThdCollator),
    ("rebalance", lambda **kw: rebalance([{"input_ids": [1, 2]}], 8, **kw)),
    ("rebalance", lambda **kw: rebalance([{"input_ids": [1, 2]}], 8, hybrid_cp=True, **kw)),
    ("PackedRowCollator", PackedRowCollator),
    ("shard", lambda **kw: thdpack.shard([{"input_ids": [1, 2]}], plan=plan_hybrid_cp([2], 1, 8), rank=0, **kw)),
])
def test_a_layout_object_is_not_a_second_way_in(owner, call):
    call(pad_token_id=3)  # the keywords
    for given in (dict(layout=BatchLayout()), dict(layout=BatchLayout(), cp_size=1), dict(layout=None)):
        with pytest.raises(TypeError, match=rf"^{owner}\(\) takes the BatchLayout fields as keywords "
                                            r"\(pad_token_id=, cp_size=, \.\.\.\), not layout=; hand a held "
                                            r"layout on as \*\*layout\.keywords\(\)$"):
            call(**given)
    for entry in (build_thd_batch, ThdCollator, rebalance, PackedRowCollator, thdpack.shard):
        named = [p.name for p in inspect.signature(entry).parameters.values() if p.kind != p.VAR_KEYWORD]
        assert "layout" not in named, entry


@pytest.mark.parametrize(
    "keywords, message",
    [
        (dict(max_length=3, cp_size=2), r"^max_length=3 is smaller than the pad multiple 4; nothing fits"),
        (dict(pad_to=6, cp_size=2), r"^pad_to must be an integer multiple of the pad multiple 4, got 6"),
        (dict(cp_size=2, cp_rank=2), r"^cp_rank must be an integer in \[0, 2\), got 2"),
    ],
)
def test_layout_validated_when_made(keywords, message):
    for make in (BatchLayout, ThdCollator, PackedRowCollator):
        with pytest.raises(ValueError, match=message):
            make(**keywords)


@pytest.mark.parametrize("make", [lambda cfg: build_thd_batch([_image_sample(24)], vlm=cfg),
                                  lambda cfg: ThdCollator(vlm=cfg),
                                  lambda cfg: rebalance([_image_sample(24)], 64, vlm=cfg, share_prefix="group"),
                                  lambda cfg: thdpack.shard([_image_sample(24)], plan=plan_hybrid_cp([8], 1, 8), rank=0,
                                                            vlm=cfg)])
def test_a_model_config_is_not_a_family(make):
    """The builder takes the family, not the config it is resolved from: a config is a TypeError saying how."""
    with pytest.raises(TypeError, match=r"vlm must be a VLM family, thdpack\.vlm\.get_family\(model_config\), or "
                       r"None; got dict$"):
        make(_vlm_config())


def test_a_family_handed_in_builds_what_it_resolves_to():
    """The family object is all the builder needs: handed in explicitly, a VLM batch is built (no registration)."""
    family = get_family(_vlm_config())
    batch = build_thd_batch([_image_sample(24)], vlm=family)
    assert batch.extras["vlm_model_type"] == family.model_type
    assert batch.token_extras["mrope_position_ids"].shape == (3, 8)
    (shard,) = thdpack.shard([_image_sample(24)], plan=plan_hybrid_cp([8], 1, 8), rank=0, vlm=family)
    assert torch.equal(shard.token_extras["mrope_position_ids"], batch.token_extras["mrope_position_ids"])
