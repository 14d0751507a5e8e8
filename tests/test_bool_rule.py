"""The one boolean rule (``thdpack.common.align.check_bool``) at every public boolean argument, integer ids and
ignore labels, and the bool check of lists of ids (issue 43)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from thdpack import ThdCollator, TokenBudgetBatchSampler, build_thd_batch, cp_pad_multiple, plan_balanced
from thdpack.batching import BatchLayout
from thdpack.common.samples import SampleError
from thdpack.integrations import to_hf_kwargs

HOLDS_BOOLS = r"^sample {}: field '{}' holds bools; token ids and labels are integers"


# --- a bool among the ids of a list, a tuple or an object array ------------------------------------------------

@pytest.mark.parametrize("container", [tuple, lambda v: np.array(v, dtype=object), list])
@pytest.mark.parametrize("flag", [True, False, np.True_, np.False_])
@pytest.mark.parametrize("field", ["input_ids", "labels"])
def test_a_bool_in_any_sequence_of_ids_is_refused(container, flag, field):
    """numpy reads a bool among Python ints as 0 or 1 (a tuple, an object array, a numpy bool in a list)."""
    values = [4, flag, 6]
    sample = {"input_ids": [4, 5, 6], field: container(values)}
    with pytest.raises(SampleError, match=HOLDS_BOOLS.format(0, field)):
        build_thd_batch([sample])


def test_ids_0_and_1_in_a_tuple_still_read():
    assert build_thd_batch([{"input_ids": (0, 1, 2), "labels": (-100, 1, 0)}]).input_ids.tolist() == [0, 1, 2]


# --- the bool check of a batch's lists runs once per batch: the same errors as a check per list -----------------

@pytest.mark.filterwarnings("ignore:thdpack. a batch of")  # one-token samples have no target
@pytest.mark.parametrize("layout", [{}, {"cp_size": 2, "cp_rank": 1}, {"pad_multiple": 8}, {"max_length": 3}])
@given(n=st.integers(1, 5), data=st.data())
@settings(max_examples=30, deadline=None)
def test_a_bool_in_any_sample_of_a_batch_is_named(layout, n, data):
    """Sample ``k``'s field holds a bool (in a slot past ``max_length`` too): that sample and field are named,
    by the builder and by the collator; without the bool the batch builds."""
    rows = [data.draw(st.lists(st.sampled_from([0, 1, 2, 7, 128_000]), min_size=1, max_size=12)) for _ in range(n)]
    samples = [{"input_ids": r, "labels": [-100] + r[1:]} for r in rows]
    build_thd_batch(samples, **layout)
    k = data.draw(st.integers(0, n - 1))
    field = data.draw(st.sampled_from(["input_ids", "labels"]))
    slot = data.draw(st.integers(0, len(rows[k]) - 1))
    samples[k] = {**samples[k], field: list(samples[k][field])}
    samples[k][field][slot] = data.draw(st.booleans())
    with pytest.raises(SampleError, match=HOLDS_BOOLS.format(k, field)):
        build_thd_batch(samples, **layout)
    with pytest.raises(SampleError, match=HOLDS_BOOLS.format(k, field)):
        ThdCollator(**layout)(samples)


@pytest.mark.parametrize("later", [{"input_ids": [3, 1.5]}, {"input_ids": [3, -4]}, {"input_ids": [3, 4], "labels": [3]},
                                   {"input_ids": [3, 4], "labels": [-7, 1]}, {"input_ids": []}, {"labels": [1]}])
def test_a_bool_is_named_before_a_fault_of_a_later_sample(later):
    """As when each list was checked as it was read: the first sample's bool is the error."""
    with pytest.raises(SampleError, match=HOLDS_BOOLS.format(0, "input_ids")):
        build_thd_batch([{"input_ids": [5, True, 6]}, later])


# --- the boolean rule at every public boolean argument ------------------------------------------------------------

SAMPLES = [{"input_ids": [3, 4, 5, 6, 7], "labels": [-100, 4, 5, 6, 7]}, {"input_ids": [6, 7, 8]}]
LENGTHS = [5, 9, 3, 14, 7, 2, 11, 6]


def _batch():
    return build_thd_batch(SAMPLES)


def _ids(batch) -> list:
    return batch.input_ids.tolist()


def _outcome(call):
    """What ``call()`` gives, or its error (type and message): the same for True and np.True_ either way."""
    try:
        return call()
    except Exception as exc:  # noqa: BLE001 - an entry whose valid call stops on a later, unrelated error
        return type(exc).__name__, str(exc)


def _offline():
    pytest.importorskip("datasets")
    from thdpack.offline import BuildConfig, build_packed, load_packed
    from thdpack.offline.commands.bridge_export import export_bridge
    from thdpack.offline.commands.build_packs import analyze
    from thdpack.offline.commands.slice_merge import merge_slices
    return BuildConfig, build_packed, load_packed, export_bridge, analyze, merge_slices


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """A packed dataset of tokenized rows (no tokenizer), and a directory for outputs."""
    BuildConfig, build_packed, *_ = _offline()
    from thdpack.demo import write_jsonl

    d = tmp_path_factory.mktemp("bools")
    rows = [{"input_ids": list(range(3, 3 + n))} for n in (10, 20, 30, 40)]
    src = write_jsonl(rows, d / "rows.jsonl")
    cfg = BuildConfig(input=str(src), tokenizer=None, pack_size=64)
    return build_packed(cfg, d / "packed", progress=False).path, d


def _sampler(**kw):
    return [list(b) for b in TokenBudgetBatchSampler(LENGTHS, 16, num_replicas=3, rank=0, **kw)]


def _stream(v):
    from thdpack.loaders.stream import StreamingPacker
    packer = StreamingPacker([{"input_ids": list(range(1, n + 1))} for n in LENGTHS], 16, skip_consumed=v)
    return [[len(s["input_ids"]) for s in pack] for pack in packer]


def _online_table():
    from thdpack.common.align import resolve_pad_multiple
    from thdpack.losses import group_advantages
    from thdpack.offline.store.dataset import PackedRowCollator

    sp = dict(cp_size=2, tp_size=3)
    return {
        "cp_pad_multiple(sequence_parallel)": ("sequence_parallel", lambda v: cp_pad_multiple(2, 3, sequence_parallel=v)),
        "resolve_pad_multiple(sequence_parallel)": ("sequence_parallel",
                                                    lambda v: resolve_pad_multiple(sequence_parallel=v)),
        "BatchLayout(sequence_parallel)": ("sequence_parallel", lambda v: BatchLayout(sequence_parallel=v, **sp).multiple),
        "build_thd_batch(sequence_parallel)": ("sequence_parallel",
                                               lambda v: _ids(build_thd_batch(SAMPLES, sequence_parallel=v, **sp))),
        "ThdCollator(sequence_parallel)": ("sequence_parallel",
                                           lambda v: _ids(ThdCollator(sequence_parallel=v, **sp)(SAMPLES))),
        "TokenBudgetBatchSampler(shuffle)": ("shuffle", lambda v: _sampler(shuffle=v)),
        "TokenBudgetBatchSampler(drop_last)": ("drop_last", lambda v: _sampler(drop_last=v)),
        "StreamingPacker(skip_consumed)": ("skip_consumed", _stream),
        "plan_balanced(fillers)": ("fillers", lambda v: plan_balanced(LENGTHS, 16, num_replicas=3, fillers=v).steps.tolist()),
        "plan_balanced(shuffle_steps)": ("shuffle_steps",
                                         lambda v: plan_balanced(LENGTHS, 16, num_replicas=3, shuffle_steps=v).steps.tolist()),
        "group_advantages(scale)": ("scale", lambda v: group_advantages([1.0, 3.0, 2.0], [0, 0, 1], scale=v).tolist()),
        "ThdBatch.to(non_blocking)": ("non_blocking", lambda v: _ids(_batch().to("cpu", non_blocking=v))),
        "to_hf_kwargs(ThdBatch, include_labels)": ("include_labels", lambda v: sorted(to_hf_kwargs(_batch(), include_labels=v))),
        "PackedRowCollator(share_prefix)": ("share_prefix", lambda v: PackedRowCollator(share_prefix=v).share_prefix),
    }


FLAGS = ("append_eos", "share_prefix", "shuffle_packs", "sequence_parallel", "skip_bad_rows", "save_tokenizer")


def _offline_table(packed):
    BuildConfig, build_packed, load_packed, export_bridge, analyze, merge_slices = _offline()
    path, d = packed
    missing = BuildConfig(input=str(d / "missing.jsonl"), tokenizer=None, pack_size=64)
    table = {
        "load_packed(verify)": ("verify", lambda v: len(load_packed(path, verify=v))),
        "PackedDataset.all_seq_lens(stream)": ("stream", lambda v: load_packed(path).all_seq_lens(stream=v)[0].tolist()),
        "build_packed(overwrite)": ("overwrite", lambda v: build_packed(missing, d / "o", overwrite=v)),
        "build_packed(progress)": ("progress", lambda v: build_packed(missing, d / "o", progress=v)),
        "analyze(progress)": ("progress", lambda v: analyze(missing, progress=v)),
        "merge_slices(overwrite)": ("overwrite", lambda v: merge_slices([str(path)], d / "m", overwrite=v)),
        "merge_slices(link)": ("link", lambda v: merge_slices([str(path)], d / "m", link=v)),
        "export_bridge(overwrite)": ("overwrite", lambda v: export_bridge(d / "none", d / "b", overwrite=v)),
    }
    for flag in FLAGS:  # the build config, as YAML or Python gives it: ValueError (ConfigError), one line
        table[f"BuildConfig.{flag}"] = (flag, lambda v, flag=flag: BuildConfig(
            input=str(path), tokenizer=None, pack_size=64, format="tokenized", **{flag: v}).validate().as_dict()[flag])
    return table


NOT_BOOLS = st.one_of(st.sampled_from(["no", "false", "False", "", "yes", 0, 1, None, 1.0, 0.0, np.int64(1), [True]]),
                      st.integers(), st.floats(), st.text(max_size=4))


def _refused(name: str, call, value) -> None:
    with pytest.raises((TypeError, ValueError), match=rf"\b{name} must be True or False, got "):
        call(value)


@given(value=NOT_BOOLS, entry=st.sampled_from(sorted(_online_table())))
@settings(max_examples=150, deadline=None)
def test_a_boolean_argument_takes_a_bool_only(value, entry):
    """A string (``"no"`` is truthy), a number or None is refused, naming the argument."""
    name, call = _online_table()[entry]
    _refused(name, call, value)


@pytest.mark.parametrize("entry", sorted(_online_table()))
@pytest.mark.filterwarnings("ignore:thdpack. a batch of")
def test_bools_and_numpy_bools_give_the_same_results(entry):
    _, call = _online_table()[entry]
    for flag in (False, True):
        assert call(np.bool_(flag)) == call(flag)


@given(value=NOT_BOOLS, data=st.data())
@settings(max_examples=60, deadline=None)
def test_an_offline_boolean_takes_a_bool_only(packed, value, data):
    table = _offline_table(packed)
    name, call = table[data.draw(st.sampled_from(sorted(table)))]
    _refused(name, call, value)


def test_offline_bools_and_numpy_bools_give_the_same_results(packed):
    for entry, (_, call) in _offline_table(packed).items():
        for flag in (False, True):
            assert _outcome(lambda: call(np.bool_(flag))) == _outcome(lambda: call(flag)), entry


@pytest.mark.parametrize("flag", FLAGS)
def test_a_config_flag_is_one_line_of_the_build(packed, flag, capsys):
    """``thdpack build`` with ``FLAG: "no"`` in its YAML (a quoted string) prints one line naming the option."""
    pytest.importorskip("yaml")
    from thdpack.cli import main

    path, d = packed
    config = d / f"{flag}.yaml"
    config.write_text(f"input: {d / 'rows.jsonl'}\npack_size: 64\n{flag}: 'no'\n")
    assert main(["build", "--config", str(config), "--output", str(d / f"out_{flag}")]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{flag} must be True or False, got 'no' (str)" in err[0], err


@pytest.mark.parametrize("fp8", [0, 1, 1.0, "", "no", "false", "fp16", np.int64(1)])
def test_fp8_takes_a_bool_none_or_its_names(fp8):
    with pytest.raises((TypeError, ValueError), match=r"^fp8 must be True, False, None, 'fp8' or 'mxfp8', got "):
        cp_pad_multiple(2, fp8=fp8)


@pytest.mark.parametrize("fp8,multiple", [(None, 4), (False, 4), (np.False_, 4), (True, 16), (np.True_, 16),
                                          ("fp8", 16), ("FP8", 16), ("mxfp8", 32)])
def test_fp8_values(fp8, multiple):
    assert cp_pad_multiple(2, fp8=fp8) == multiple


# --- token ids and ignore labels are integers ---------------------------------------------------------------------

NOT_INTS = st.one_of(st.sampled_from([1.5, 2.0, "151655", "7", True, np.float64(3.0)]),
                     st.floats(allow_nan=True), st.text(max_size=3))
VL = {"model_type": "qwen2_vl", "image_token_id": 90, "video_token_id": 91, "vision_start_token_id": 92,
      "vision_config": {"spatial_merge_size": 2, "patch_size": 2, "in_channels": 3, "temporal_patch_size": 2}}
VL_KEYS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_config.spatial_merge_size",
           "vision_config.patch_size", "vision_config.in_channels", "vision_config.temporal_patch_size")


@given(value=NOT_INTS, key=st.sampled_from(VL_KEYS))
@settings(max_examples=60, deadline=None)
def test_a_vlm_configs_token_ids_and_sizes_are_integers(value, key):
    """An image token id of 1.5 (or the string "151655") is not read as token 1 (or 151655)."""
    from thdpack.vlm import get_family

    config = {**VL, "vision_config": dict(VL["vision_config"])}
    if key.startswith("vision_config."):
        config["vision_config"][key.split(".")[1]] = value
    else:
        config[key] = value
    with pytest.raises(ValueError, match=rf"^the model config's {key} must be an integer >= [01], got "):
        get_family(config)


def test_a_vlm_configs_integers_still_read():
    from thdpack.vlm import get_family

    family = get_family({**VL, "image_token_id": np.int64(90)})
    assert (family.image_token_id, family.video_token_id, family.spatial_merge_size, family.patch_shape) == (
        90, 91, 2, (3, 2, 2))


@given(value=NOT_INTS)
@settings(max_examples=30, deadline=None)
def test_a_batchs_ignore_index_is_an_integer(value):
    """``hf_labels`` fills with ``ignore_index``: 1.5 would be the token id 1 there."""
    import dataclasses

    with pytest.raises(ValueError, match=r"^ignore_index must be an integer in int64 range, got "):
        dataclasses.replace(_batch(), ignore_index=value)
    for keyword in ("ignore_index", "pad_token_id"):  # as every builder takes them (BatchLayout)
        with pytest.raises(ValueError, match=rf"^{keyword} must be an integer"):
            build_thd_batch(SAMPLES, **{keyword: value})
