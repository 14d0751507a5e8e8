"""Mixtures under bad and edge input (issue 43): sizes, epochs and weight ratios checked against a bound before
anything is drawn; no empty blend; no numpy warnings on extreme weights; integer indices only into a
``MixtureDataset``; a source whose every sample the plan drops stops the build; ``share_prefix`` without groups
told in the build's own words; a hand-edited ``mixture`` entry of ``metadata.json`` named by file and key.

Valid inputs keep their results: the blend of weights scaled by a power of two is the same blend (the
scaling is exact), and tests/test_mixture.py / tests/test_offline_mixture.py pin the rest."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from thdpack.loaders.mixture_dataset import MixtureDataset
from thdpack.planning.mixture import MAX_BLEND_SAMPLES, check_mixture, plan_mixture

SETTINGS = settings(max_examples=40, deadline=None)
LENGTHS = np.arange(1, 11, dtype=np.int64)  # ten rows of 1..10 tokens


def _blend(weights, stopping="first_exhausted", weight_by="samples", size=None):
    sources = [{"name": f"s{i}", "num_rows": 10, "weight": w, "lengths": LENGTHS} for i, w in enumerate(weights)]
    return plan_mixture(sources, stopping=stopping, weight_by=weight_by, size=size, seed=1)


def _same(a, b) -> bool:
    return all(np.array_equal(getattr(a, k), getattr(b, k))
               for k in ("source", "row", "counts", "requested_share", "realized_share"))


# ---------------------------------------------------------------------------- sizes, epochs and weights: bounded


@SETTINGS
@given(size=st.integers(MAX_BLEND_SAMPLES, 2**63 - 1))
@example(size=10**13)
def test_a_size_past_the_bound_is_refused_saying_what_it_would_take(size):
    for api in (plan_mixture, check_mixture):
        with pytest.raises(ValueError) as caught:
            api([{"name": "chat", "num_rows": 10}, {"name": "math", "num_rows": 5}], size=size)
        message = str(caught.value)
        assert f"size {size:,}" in message and "fewer than 2**31" in message and "bytes a sample" in message
        assert "\n" not in message


@SETTINGS
@given(rows=st.integers(1, 1000), epochs=st.floats(1.0, 1e308))
@example(rows=10, epochs=1e12)
def test_epochs_are_bounded_and_anything_below_the_bound_is_drawn(rows, epochs):
    if epochs * rows + 0.5 < MAX_BLEND_SAMPLES:
        epochs = min(epochs, 1000.0)  # drawn below: keep it small
        assert plan_mixture([{"name": "a", "num_rows": rows, "epochs": epochs}]).counts[0] == math.floor(
            epochs * rows + 0.5)
        return
    with pytest.raises(ValueError, match=r"mixture source 'a' would put .* samples in the blend \(epochs .* of "
                                         r"its .* rows\); a blend holds fewer than 2\*\*31"):
        plan_mixture([{"name": "a", "num_rows": rows, "epochs": epochs}])


@SETTINGS
@given(small=st.floats(0, 1, exclude_min=True), big=st.floats(1, 1.7e308), stopping=st.sampled_from(
    ["first_exhausted", "all_exhausted"]), weight_by=st.sampled_from(["samples", "tokens"]))
@example(small=1e-300, big=1.0, stopping="all_exhausted", weight_by="samples")
@example(small=1e-300, big=1.0, stopping="all_exhausted", weight_by="tokens")
@example(small=5e-324, big=1.0, stopping="first_exhausted", weight_by="samples")
@example(small=1e-300, big=1e300, stopping="first_exhausted", weight_by="samples")
@example(small=1.0, big=1e300, stopping="all_exhausted", weight_by="samples")
def test_extreme_weight_ratios_give_a_blend_or_one_line_and_no_warning(small, big, stopping, weight_by):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a numpy RuntimeWarning fails the test
        try:
            plan = _blend([small, big], stopping, weight_by)
        except ValueError as exc:
            assert "would put" in str(exc) and "fewer than 2**31" in str(exc) and "\n" not in str(exc)
            assert stopping == "all_exhausted"  # first_exhausted draws at most the sources' rows
            return
    assert 0 < len(plan) < MAX_BLEND_SAMPLES and plan.counts.sum() == len(plan)
    assert np.isfinite(plan.requested_share).all() and np.isfinite(plan.realized_share).all()


@SETTINGS
@given(weights=st.lists(st.floats(1e-3, 1e3), min_size=1, max_size=4), scale=st.integers(900, 1013),
       stopping=st.sampled_from(["first_exhausted", "all_exhausted"]), weight_by=st.sampled_from(["samples", "tokens"]))
@example(weights=[1000.0, 1000.0, 1000.0, 3.0], scale=1013, stopping="all_exhausted", weight_by="samples")
def test_huge_weights_are_the_blend_of_the_same_weights_scaled_down(weights, scale, stopping, weight_by):
    """Weights near the float maximum (their sum overflows) blend as the same weights times 2**-scale."""
    huge = [w * 2.0**scale for w in weights]
    assert all(math.isfinite(w) for w in huge)
    assert _same(_blend(huge, stopping, weight_by), _blend(weights, stopping, weight_by))


def test_a_weight_so_large_that_it_overflows_is_not_an_overflow_error():
    assert _same(_blend([1e308, 1e308]), _blend([1, 1]))


# ---------------------------------------------------------------------------- no empty blend


@SETTINGS
@given(size=st.integers(1, 400), weights=st.lists(st.floats(0.01, 100), min_size=1, max_size=3))
@example(size=1, weights=[1.0, 1.0])
def test_token_weights_with_a_tiny_size_draw_a_sample_or_say_the_size_that_does(size, weights):
    try:
        plan = _blend(weights, weight_by="tokens", size=size)
    except ValueError as exc:
        message = str(exc)
        assert message.startswith("the blend draws no sample: size ") and "\n" not in message
        need = int(message.split("give size >= ")[1].split(" ")[0].replace(",", ""))
        assert need > size and len(_blend(weights, weight_by="tokens", size=need)) > 0
        return
    assert len(plan) > 0


def test_epochs_that_round_to_no_sample_are_refused():
    with pytest.raises(ValueError, match=r"the blend draws no sample: every source's share rounds to 0 samples "
                                         r"\(source 'a': epochs 0.1 of its 2 rows\)"):
        plan_mixture([{"name": "a", "num_rows": 2, "epochs": 0.1}])


def test_the_online_mixture_refuses_what_plan_mixture_refuses():
    rows = [{"input_ids": [1, 2]}] * 4
    with pytest.raises(ValueError, match="fewer than 2\\*\\*31"):
        MixtureDataset([{"name": "a", "dataset": rows}], size=10**13)
    with pytest.raises(ValueError, match="draws no sample"):
        MixtureDataset([{"name": "a", "dataset": rows, "epochs": 0.1}])


# ---------------------------------------------------------------------------- MixtureDataset indices


MIXTURE = MixtureDataset([{"name": "a", "dataset": [{"input_ids": [i, i]} for i in range(5)]},
                          {"name": "b", "dataset": [{"input_ids": [9, i]} for i in range(3)], "epochs": 2}], seed=0)


@SETTINGS
@given(index=st.one_of(st.floats(allow_nan=True), st.booleans(), st.text(max_size=2), st.none(),
                       st.just(np.float64(1.0)), st.just(np.bool_(True))))
@example(index=1.5)
@example(index=1.0)
def test_a_mixture_index_is_an_integer(index):
    with pytest.raises(TypeError, match="MixtureDataset index must be an integer in"):
        MIXTURE[index]
    with pytest.raises(TypeError, match="MixtureDataset index must be an integer in"):
        MIXTURE.__getitems__([0, index])


@SETTINGS
@given(index=st.integers(-2**70, 2**70))
def test_an_integer_index_is_in_range_or_an_index_error_and_negatives_count_from_the_end(index):
    n = len(MIXTURE)
    for k in (index, np.int64(max(min(index, 2**62), -2**62))):
        if -n <= k < n:
            assert MIXTURE[k] == MIXTURE[int(k) % n] and MIXTURE[k]["sample_index"] == int(k) % n
            assert MIXTURE.__getitems__([k]) == [MIXTURE[int(k) % n]]
        else:
            with pytest.raises(IndexError, match=f"out of range for {n} samples"):
                MIXTURE[k]


# ---------------------------------------------------------------------------- offline builds

pytest.importorskip("datasets")

from test_cli_robust import _error_line  # noqa: E402

from thdpack.cli import main  # noqa: E402
from thdpack.demo import TOKENIZER_DIR, generate_rows, write_jsonl  # noqa: E402
from thdpack.offline import BuildConfig, build_packed  # noqa: E402
from thdpack.offline.stage_options import MixtureOptions  # noqa: E402
from thdpack.offline.errors import ConfigError, InputError  # noqa: E402

TOK = str(TOKENIZER_DIR)


def _demo(kind: str, n: int, seed: int, **own) -> dict:
    return {"demo": {"num_samples": n, "seed": seed, "kind": kind}, "name": kind, "format": kind, **own}


def _config(sources: list, **top) -> BuildConfig:
    return BuildConfig(input=sources, tokenizer=TOK, **{"pack_size": 2048, "skip_bad_rows": True, **top})


def _refused(cfg: BuildConfig, out: Path, error=InputError) -> str:
    with pytest.raises(error) as caught:
        build_packed(cfg, out, progress=False)
    assert not out.exists()
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_a_token_size_too_small_for_a_row_stops_the_build(tmp_path, capsys):
    cfg = tmp_path / "mix.yaml"
    cfg.write_text(json.dumps({"input": [_demo("chat", 40, 0, weight=1), _demo("text", 30, 1, weight=1)],
                               "mixture": {"weight_by": "tokens", "size": 1}, "tokenizer": TOK, "pack_size": 2048,
                               "skip_bad_rows": True}))
    assert main(["build", "--config", str(cfg), "--output", str(tmp_path / "out"), "-q"]) == 2
    line = _error_line(capsys.readouterr().err, "build")
    assert "mixture: the blend draws no sample: size 1 tokens" in line and "give size >= " in line
    assert not (tmp_path / "out").exists()


def test_a_source_whose_every_row_overflow_drops_stops_the_build(tmp_path):
    long_rows = write_jsonl([{"text": "word " * 3000}] * 4, tmp_path / "long.jsonl")
    cfg = _config([_demo("text", 30, 1), {"path": str(long_rows), "name": "long", "format": "text"}],
                  pack_size=1024, overflow="drop")
    message = _refused(cfg, tmp_path / "out")
    assert message.startswith("mixture source 'long': the plan dropped every one of its samples in the blend (4 "
                              "longer than pack_size=1024 (overflow: drop))")
    assert "overflow: truncate or split" in message and "drop the source from the mixture" in message


def test_a_source_whose_every_row_has_no_target_stops_the_build(tmp_path):
    """Long prompts whose answers truncation cuts off: no target token left, dropped (without_targets: drop)."""
    rows = [{"messages": [{"role": "user", "content": "why " * 2000}, {"role": "assistant", "content": "because"}]}
            for _ in range(3)]
    cut = write_jsonl(rows, tmp_path / "cut.jsonl")
    cfg = _config([_demo("text", 30, 1), {"path": str(cut), "name": "cut", "format": "chat"}], pack_size=1024,
                  overflow="truncate")
    message = _refused(cfg, tmp_path / "out")
    assert message.startswith("mixture source 'cut': the plan dropped every one of its samples in the blend (3 with "
                              "no target token (without_targets: drop))")
    assert "without_targets: keep" in message
    kept = build_packed(cfg.override(without_targets="keep"), tmp_path / "kept", progress=False)
    assert kept.metadata["mixture"]["sources"][1]["packed_samples"] == 3  # keep: packed, as the policy says


def test_share_prefix_without_groups_says_what_the_single_source_build_says(tmp_path):
    cfg = _config([_demo("chat", 20, 0), _demo("text", 20, 1)], share_prefix=True)
    message = _refused(cfg, tmp_path / "out", ConfigError)
    assert message == ("share_prefix needs preference rows (prompt / chosen / rejected) or group_column; no mixture "
                       "source has them: 'chat' (chat rows), 'text' (text rows)")


@pytest.mark.parametrize("top, source, expected", [
    ({"mixture": MixtureOptions(size=10**13)}, {}, "size 10,000,000,000,000 at weight 1"),
    ({}, {"epochs": 1e12}, "at least 1,000,000,000,000 samples in the blend (epochs 1e+12 of each of its rows)"),
    ({"mixture": MixtureOptions(stopping="all_exhausted")}, {"weight": 1e-300}, "stopping='all_exhausted'"),
])
def test_a_config_past_the_bound_is_refused_before_reading(tmp_path, top, source, expected):
    cfg = _config([{"path": str(tmp_path / "never-read.jsonl"), **source}, {"path": str(tmp_path / "b.jsonl")}],
                  base_dir=tmp_path, **top)
    with pytest.raises(ConfigError) as caught:
        cfg.validate()
    assert expected in str(caught.value) and "fewer than 2**31" in str(caught.value)


def test_epochs_past_the_bound_on_the_kept_rows_stop_the_build(tmp_path):
    """Within the bound for one row (the config's check), past it for the source's kept rows (the blend's)."""
    cfg = _config([_demo("chat", 40, 0), _demo("text", 30, 1, epochs=1e8)])
    cfg.validate()
    message = _refused(cfg, tmp_path / "out")
    assert message.startswith("mixture: mixture source 'text' would put 3,000,000,000 samples in the blend (epochs "
                              "1e+08 of its 30 rows)") and "lower its epochs" in message


# ---------------------------------------------------------------------------- a hand-edited metadata.json


@pytest.fixture(scope="module")
def mixture_build(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("mixture-build") / "mix"
    build_packed(_config([_demo("chat", 40, 0, weight=2), _demo("text", 30, 1)]), out, progress=False)
    return out


def _edited(build: Path, tmp_path: Path, edit) -> Path:
    import shutil

    copy = tmp_path / "edited"
    shutil.copytree(build, copy)
    meta = json.loads((copy / "metadata.json").read_text())
    edit(meta["mixture"])
    (copy / "metadata.json").write_text(json.dumps(meta))
    return copy


@pytest.mark.parametrize("edit, expected", [
    (lambda m: m["sources"].pop(), "'source_index' has 1, but 'mixture.sources' in metadata.json lists 1 sources"),
    (lambda m: m.update(sources="chat"), "'mixture.sources' must be a non-empty list, got 'chat'"),
    (lambda m: m.update(sources=[]), "'mixture.sources' must be a non-empty list"),
    (lambda m: m["sources"][1].pop("name"), "'mixture.sources[1].name' is missing"),
    (lambda m: m["sources"][0].update(rows_read="40"), "'mixture.sources[0].rows_read' must be an integer >= 0"),
    (lambda m: m["sources"][0].update(requested_share=None), "'mixture.sources[0].requested_share' must be a number"),
    (lambda m: m["sources"].__setitem__(0, 5), "'mixture.sources[0]' must be an object, got 5"),
    (lambda m: m.pop("samples"), "'mixture.samples' is missing"),
])
@pytest.mark.parametrize("command", ["inspect", "stats"])
def test_a_hand_edited_mixture_entry_is_named_by_file_and_key(mixture_build, tmp_path, capsys, edit, expected,
                                                              command):
    copy = _edited(mixture_build, tmp_path, edit)
    assert main([command, str(copy)]) == 2
    line = _error_line(capsys.readouterr().err, command)
    assert expected in line and "metadata.json" in line


def test_the_unedited_build_reads(mixture_build, capsys):
    assert main(["stats", str(mixture_build)]) == 0 and main(["inspect", str(mixture_build), "--pack", "0"]) == 0
    out = capsys.readouterr().out
    assert "mixture          2 sources" in out and "source 'chat'" in out
