"""mRoPE across transformers versions (``mrope_convention``, :mod:`thdpack.vlm.convention`).

The references are the versions' own ``get_rope_index``:

- the installed transformers (5.24): its model classes' ``get_rope_index``, called directly;
- transformers 5.12.1 (the newest Megatron-Bridge 0.6.2 allows) and 4.57.6: the functions
  ``get_rope_index`` / ``get_vision_position_ids`` read from those releases' wheels
  (``pip download --no-deps``, cached under ``~/.cache/thdpack``) and run on a stub model
  (they read nothing but ``self.config``), in this process, without importing the rest of
  that transformers;
- Megatron-Bridge 0.6.2's own Qwen3-VL ``_build_llm_rope_positions``
  (``megatron/bridge/models/qwen_vl/modelling_qwen3_vl/rope.py``), read the same way from
  the wheel ``tests/megatron_env.py`` unpacks.

The written, cited transcriptions below are references of their own (ids ``transcription-*``),
checked everywhere; where a wheel is here, the transcriptions are checked against it too. Where
a wheel cannot be had (no package index) the tests of its code skip, their ids ending ``-missing``
and the reason in pytest's summary.
"""

from __future__ import annotations

import ast
import fcntl
import itertools
import os
import sys
import types
import zipfile
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from thdpack import build_thd_batch
from thdpack.vlm import get_family
from thdpack.vlm import convention as conv

transformers = pytest.importorskip("transformers")

import megatron_env  # noqa: E402  (tests/megatron_env.py)

IMG, VID, VS, VE = 90, 91, 92, 93
TEXT_HI = 80
MERGE = 2
TPS = 2  # tokens_per_second of Qwen2.5-VL's released configs
FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5")
FRAMES_ARE_ITEMS = {"qwen2_vl": False, "qwen2_5_vl": False, "qwen3_vl": True, "qwen3_5": True}
CACHE = Path(os.environ.get("THDPACK_CACHE", Path.home() / ".cache" / "thdpack")) / "transformers-wheels"
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)


def model_config(family: str) -> dict:
    return {
        "model_type": family,
        "image_token_id": IMG,
        "video_token_id": VID,
        "vision_start_token_id": VS,
        "vision_config": {"spatial_merge_size": MERGE, "tokens_per_second": TPS},
    }


def stub_config() -> types.SimpleNamespace:
    """What every version's ``get_rope_index`` reads from ``self.config``."""
    vision = types.SimpleNamespace(spatial_merge_size=MERGE, tokens_per_second=TPS)
    return types.SimpleNamespace(image_token_id=IMG, video_token_id=VID, vision_start_token_id=VS, vision_config=vision)


# --------------------------------------------------------------------------- the versions' own code


@lru_cache(maxsize=None)
def _wheel(version: str) -> Path | str:
    """transformers ``version``'s wheel (cached), or why it cannot be had."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".lock", "w") as lock:  # pytest-xdist workers: one downloads, the others wait
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = sorted(CACHE.glob(f"transformers-{version}-*.whl"))
        if found:
            return found[0]
        tmp = CACHE / f"download-{version}"
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:", "--dest", str(tmp),
               f"transformers=={version}"]
        failed = megatron_env.pip_download(CACHE, cmd, f"transformers=={version}")
        got = sorted(tmp.glob(f"transformers-{version}-*.whl"))
        if failed or not got:
            return failed or f"`pip download transformers=={version}` gave no wheel"
        os.replace(got[0], CACHE / got[0].name)  # whole wheels only in the cache
        return CACHE / got[0].name


def _functions(source: str, names: tuple[str, ...], where: str) -> dict:
    """The top-level or method functions ``names`` of ``source``, compiled without their
    decorators and annotations, in a namespace with torch and itertools."""
    tree = ast.parse(source)
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name in names and node.name not in found:
            node.decorator_list = []
            node.returns = None
            args = node.args
            for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
                if arg is not None:
                    arg.annotation = None
            found[node.name] = node
    missing = set(names) - set(found)
    assert not missing, f"{where}: no {sorted(missing)}"
    namespace = {"torch": torch, "itertools": itertools}
    exec(compile(ast.Module(body=list(found.values()), type_ignores=[]), where, "exec"), namespace)
    return {name: namespace[name] for name in names}


@lru_cache(maxsize=None)
def release_rope_index(version: str, family: str):
    """``get_rope_index`` of transformers ``version``'s ``family`` bound to a stub model, or
    why it cannot be had (a string)."""
    wheel = _wheel(version)
    if isinstance(wheel, str):
        return wheel
    path = f"transformers/models/{family}/modeling_{family}.py"
    with zipfile.ZipFile(wheel) as z:
        if path not in z.namelist():
            return f"transformers {version} has no {family}"
        source = z.read(path).decode()
    names = ("get_rope_index",) + (("get_vision_position_ids",) if "def get_vision_position_ids" in source else ())
    funcs = _functions(source, names, f"{wheel.name}:{path}")
    model = types.SimpleNamespace(config=stub_config())
    for name, fn in funcs.items():
        setattr(model, name, types.MethodType(fn, model))
    return model.get_rope_index


def installed_rope_index(family: str):
    """The installed transformers' own ``get_rope_index`` of ``family`` on a stub model."""
    classes = {"qwen2_vl": "Qwen2VLModel", "qwen2_5_vl": "Qwen2_5_VLModel", "qwen3_vl": "Qwen3VLModel",
               "qwen3_5": "Qwen3_5Model"}
    cls = getattr(transformers, classes[family])
    model = types.SimpleNamespace(config=stub_config())
    for name in ("get_rope_index", "get_vision_position_ids"):
        setattr(model, name, types.MethodType(getattr(cls, name), model))
    return model.get_rope_index


def call_rope_index(fn, family: str, ids: list[int], images, videos, spg) -> tuple[np.ndarray, int]:
    """``[3, s]`` positions and the rope delta of one sample from a ``get_rope_index`` of any
    version (4.x takes no ``mm_token_type_ids``; only Qwen2.5-VL takes ``second_per_grid_ts``)."""
    x = torch.tensor([ids])
    kw = {"image_grid_thw": torch.tensor(images) if images else None,
          "video_grid_thw": torch.tensor(videos) if videos else None}
    if family == "qwen2_5_vl":
        kw["second_per_grid_ts"] = spg
    code = getattr(fn, "__func__", fn).__code__
    if "mm_token_type_ids" in code.co_varnames[: code.co_argcount]:
        kw["mm_token_type_ids"] = ((x == IMG).int() + 2 * (x == VID).int())
    pos, delta = fn(x, **kw)
    return pos[:, 0].numpy(), int(delta.reshape(-1)[0])


# --------------------------------------------------------------------------- written references


def transcribed_rope(convention: str, family: str, ids: list[int], images, videos, spg) -> tuple[np.ndarray, int]:
    """Transcription of the rules (fallback when a wheel cannot be had).

    ``"transformers-4"``: transformers 4.57.6 ``Qwen2_5_VLModel.get_rope_index``
    (``src/transformers/models/qwen2_5_vl/modeling_qwen2_5_vl.py``): text before an item
    starts at ``st_idx = llm_pos_ids_list[-1].max() + 1``; ``second_per_grid_t`` is 0 for
    images and ``torch.as_tensor(second_per_grid_ts[i], dtype=torch.long)`` for videos; the
    temporal index is ``(arange(t) * second_per_grid_t * tokens_per_second).long()``.
    Qwen2-VL's and Qwen3-VL's (``modeling_qwen2_vl.py`` / ``modeling_qwen3_vl.py``) use
    ``arange(t)``; Qwen3-VL first splits each video into ``t`` grids of ``t = 1``.
    ``"truncate-spg"``: transformers 5.12.1 ``get_rope_index`` / ``get_vision_position_ids``
    of the same files: runs of equal ``mm_token_type_ids``; ``current_pos += max(h, w)``
    after an item; videos' ``time_interval = tokens_per_second * int(second_per_grid_ts[i])``,
    images' 1.
    """
    per_frame = FRAMES_ARE_ITEMS[family]
    images, videos = images or [], videos or []
    items = iter([(1, tuple(g)) for g in images])
    video_items = iter([(2, (1, h, w)) for t, h, w in videos for _ in range(t)] if per_frame else
                       [(2, tuple(g)) for g in videos])
    spg_iter = iter([1] * len(videos) if spg is None else [float(v) for v in spg])
    types_ = [1 if i == IMG else 2 if i == VID else 0 for i in ids]
    out, p, k = [], 0, 0
    while k < len(ids):
        if types_[k] == 0:
            out.append((p, p, p))
            p, k = p + 1, k + 1
            continue
        kind, (t, h, w) = next(items) if types_[k] == 1 else next(video_items)
        h, w = h // MERGE, w // MERGE
        if family != "qwen2_5_vl":
            step = 1
        elif kind == 1:
            step = 0 if convention == conv.TRANSFORMERS_4 else 1
        else:
            step = TPS * int(next(spg_iter))
        block = [(p + ti * step, p + hi, p + wi) for ti in range(t) for hi in range(h) for wi in range(w)]
        out += block
        k += len(block)
        p = max(max(b) for b in block) + 1 if convention == conv.TRANSFORMERS_4 else p + max(h, w)
    rows = np.array(out, dtype=np.int64).T.reshape(3, -1)
    return rows, int(rows.max()) + 1 - len(ids)


REFERENCES = {"4.57.6": conv.TRANSFORMERS_4, "5.12.1": conv.TRUNCATE_SPG}


def reference_params(versions=tuple(sorted(REFERENCES))) -> list:
    """``(version, wheel)`` parameters of the tests of an old convention: each version's written
    transcription (wheel None, id ``transcription-<version>``), and its release's own code (id
    ``transformers-<version>``; skipped, id ``transformers-<version>-missing``, where its wheel cannot
    be had)."""
    written = [pytest.param(v, None, id=f"transcription-{v}") for v in versions]
    return written + [megatron_env.peer_param(_wheel(v), f"transformers-{v}", v) for v in versions]


def old_rope(version: str, wheel, family: str, ids, images, videos, spg) -> tuple[np.ndarray, int]:
    """Positions of transformers ``version``: the transcription (``wheel`` None), else its own code
    in ``wheel``, which the transcription must equal (the transcription alone for a family the release
    does not have)."""
    written = transcribed_rope(REFERENCES[version], family, ids, images, videos, spg)
    if wheel is None:
        return written
    fn = release_rope_index(version, family)
    if isinstance(fn, str):
        assert "has no" in fn, fn
        return written
    got = call_rope_index(fn, family, ids, images, videos, spg)
    assert np.array_equal(got[0], written[0]) and got[1] == written[1], "transcription differs from the release"
    return got


# --------------------------------------------------------------------------- samples


def build_ids(family: str, layout, rng) -> list[int]:
    """``layout``: ``("text", n)`` / ``("image", grid)`` / ``("video", grid)``; every item in
    vision start / end tokens, Qwen3-style videos with a 2-token timestamp before each frame."""
    ids: list[int] = []
    for kind, value in layout:
        if kind == "text":
            ids += rng.integers(0, TEXT_HI, value).tolist()
            continue
        t, h, w = value
        if kind == "video" and FRAMES_ARE_ITEMS[family]:
            for _ in range(t):
                ids += rng.integers(0, TEXT_HI, 2).tolist() + [VS] + [VID] * (h * w // MERGE**2) + [VE]
        else:
            ids += [VS] + [IMG if kind == "image" else VID] * (t * h * w // MERGE**2) + [VE]
    return ids


def make_sample(family: str, layout, rng, spg=None) -> dict:
    ids = build_ids(family, layout, rng)
    sample = {"input_ids": ids, "labels": ids}
    for kind, prefix in (("image", "pixel_values"), ("video", "pixel_values_videos")):
        grids = [list(v) for k, v in layout if k == kind]
        if grids:
            sample[f"{kind}_grid_thw"] = grids
            sample[prefix] = np.zeros((sum(t * h * w for t, h, w in grids), 4), np.float32)
    if spg is not None and "video_grid_thw" in sample:
        sample["second_per_grid_ts"] = spg[: len(sample["video_grid_thw"])]
    return sample


def rows_of(batch, i: int) -> np.ndarray:
    a, s = int(batch.cu_seqlens_padded[i]), int(batch.seq_lens[i])
    return batch.token_extras["mrope_position_ids"][:, a : a + s].numpy()


@st.composite
def layouts(draw):
    layout = [("text", draw(st.integers(2, 3)))]
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(["image", "video"]))
        t = draw(st.sampled_from([1, 1, 2, 3, 5, 8]))
        grid = (t, MERGE * draw(st.integers(1, 3)), MERGE * draw(st.integers(1, 3)))
        layout += [(kind, grid), ("text", draw(st.integers(1, 3)))]  # a vision end token at least
    return layout


SECONDS = [0.5, 1.0, 2 / 3, 1.5, 2.0, 0.25, 7 / 3, 3.0]


# --------------------------------------------------------------------------- tests


@settings(max_examples=40, **SETTINGS)
@given(
    family=st.sampled_from(FAMILIES),
    packs=st.lists(layouts(), min_size=1, max_size=3),
    seconds=st.lists(st.sampled_from(SECONDS), min_size=3, max_size=3),
    spg_kind=st.sampled_from(["f32_tensor", "floats", "none"]),
    pad_multiple=st.sampled_from([1, 4]),
    seed=st.integers(0, 2**16),
)
@pytest.mark.parametrize("version,wheel", reference_params())
def test_old_convention_equals_old_release(version, wheel, family, packs, seconds, spg_kind, pad_multiple, seed):
    """With a release's convention, each packed sample's rows and rope delta equal that release's
    own ``get_rope_index`` on the sample alone (fractional ``second_per_grid_ts``, text after
    videos and after images with ``t > 1`` included)."""
    rng = np.random.default_rng(seed)
    spg = {"f32_tensor": torch.tensor(seconds, dtype=torch.float32), "floats": list(seconds), "none": None}[spg_kind]
    samples = [make_sample(family, layout, rng, spg) for layout in packs]
    fam = get_family(model_config(family), mrope_convention=f"transformers=={version}")
    assert fam.mrope_convention == REFERENCES[version]
    batch = build_thd_batch(samples, vlm=fam, pad_multiple=pad_multiple)
    assert batch.extras["mrope_convention"] == REFERENCES[version]
    for i, s in enumerate(samples):
        want, delta = old_rope(version, wheel, family, s["input_ids"], s.get("image_grid_thw"),
                               s.get("video_grid_thw"), s.get("second_per_grid_ts"))
        assert np.array_equal(rows_of(batch, i), want), (i, s)
        assert int(batch.extras["rope_deltas"][i]) == delta


@pytest.mark.parametrize("version,wheel", reference_params())
@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_on_a_fixed_pack(family, version, wheel):
    """The three places where the rules part, in every family: an image with ``t = 3 > max(h, w)``
    (Qwen2.5-VL 4.x: all its frames at one temporal position), a video with 0.5 s per grid and
    text after both."""
    layout = [("text", 2), ("image", (3, 2, 4)), ("text", 2), ("video", (4, 4, 4)), ("text", 2)]
    text_only = {"input_ids": [1, 2, 3], "labels": [1, 2, 3]}
    samples = [make_sample(family, layout, np.random.default_rng(5), [0.5]), text_only]
    fam = get_family(model_config(family), mrope_convention=f"transformers=={version}")
    batch = build_thd_batch(samples, vlm=fam, pad_multiple=8)
    s = samples[0]
    want, delta = old_rope(version, wheel, family, s["input_ids"], s["image_grid_thw"], s["video_grid_thw"], [0.5])
    assert np.array_equal(rows_of(batch, 0), want)
    assert int(batch.extras["rope_deltas"][0]) == delta


@settings(max_examples=25, **SETTINGS)
@given(family=st.sampled_from(FAMILIES), layout=layouts(), seconds=st.lists(st.sampled_from(SECONDS), min_size=3,
       max_size=3), seed=st.integers(0, 2**16))
def test_exact_convention_equals_installed_transformers(family, layout, seconds, seed):
    """``"exact"`` equals the installed transformers' (5.24) own ``get_rope_index``."""
    assert conv.convention_for_transformers(transformers.__version__) == conv.EXACT
    sample = make_sample(family, layout, np.random.default_rng(seed), torch.tensor(seconds, dtype=torch.float64))
    batch = build_thd_batch([sample], vlm=get_family(model_config(family), mrope_convention="exact"))
    want, delta = call_rope_index(installed_rope_index(family), family, sample["input_ids"],
                                  sample.get("image_grid_thw"), sample.get("video_grid_thw"),
                                  sample.get("second_per_grid_ts"))
    assert np.array_equal(rows_of(batch, 0), want)
    assert int(batch.extras["rope_deltas"][0]) == delta


def _video_sample(grid, spg):
    return make_sample("qwen2_5_vl", [("text", 2), ("video", grid), ("text", 2)], np.random.default_rng(0), spg)


@pytest.mark.parametrize("version,wheel", reference_params(("5.12.1",)))
def test_fractional_seconds_per_grid_issue_example(version, wheel):
    """One video, grid [4, 4, 4], tokens_per_second 2, second_per_grid_ts 0.5: the frames' temporal
    positions are [3, 4, 5, 6] in transformers >= 5.18 and [3, 3, 3, 3] up to 5.17."""
    sample = _video_sample((4, 4, 4), [0.5])
    frames = {}
    for name in (conv.EXACT, conv.TRUNCATE_SPG, conv.TRANSFORMERS_4):
        batch = build_thd_batch([sample], vlm=get_family(model_config("qwen2_5_vl"), mrope_convention=name))
        frames[name] = rows_of(batch, 0)[0, 3:19:4].tolist()  # first token of each frame (4 tokens per frame)
    assert frames == {conv.EXACT: [3, 4, 5, 6], conv.TRUNCATE_SPG: [3, 3, 3, 3], conv.TRANSFORMERS_4: [3, 3, 3, 3]}
    want, _ = old_rope(version, wheel, "qwen2_5_vl", sample["input_ids"], None, sample["video_grid_thw"], [0.5])
    assert want[0, 3:19:4].tolist() == [3, 3, 3, 3]


@pytest.mark.parametrize("version,wheel", reference_params(("4.57.6",)))
def test_text_after_video_issue_example(version, wheel):
    """t = 16, second_per_grid_ts 1.0: transformers 4.x continues after the video's last temporal
    position (3 + 15·2 = 33), 5.x after ``max(h, w)``."""
    sample = _video_sample((16, 4, 4), [1.0])
    end = len(sample["input_ids"])
    tails = {}
    for name in (conv.EXACT, conv.TRANSFORMERS_4):
        batch = build_thd_batch([sample], vlm=get_family(model_config("qwen2_5_vl"), mrope_convention=name))
        tails[name] = rows_of(batch, 0)[:, end - 3 :].tolist()  # vision end token, then 2 text tokens
    assert tails == {conv.EXACT: [[5, 6, 7]] * 3, conv.TRANSFORMERS_4: [[34, 35, 36]] * 3}
    want, _ = old_rope(version, wheel, "qwen2_5_vl", sample["input_ids"], None, sample["video_grid_thw"], [1.0])
    assert want[:, end - 3 :].tolist() == tails[conv.TRANSFORMERS_4]


@pytest.fixture
def installed(monkeypatch):
    """Set the version the package metadata reports for transformers (a function of the name)."""
    def use(version_of):
        monkeypatch.setattr(conv.metadata, "version", version_of)
        conv.installed_transformers_version.cache_clear()

    yield use
    conv.installed_transformers_version.cache_clear()


@pytest.mark.parametrize(
    ("version", "expected"),
    [("4.57.6", conv.TRANSFORMERS_4), ("5.2.0", conv.TRANSFORMERS_4), ("5.6.0", conv.TRUNCATE_SPG),
     ("5.12.1", conv.TRUNCATE_SPG), ("5.17.0", conv.TRUNCATE_SPG), ("5.18.0", conv.EXACT), ("5.24.0", conv.EXACT),
     ("6.0.0.dev0", conv.EXACT)],
)
def test_default_follows_installed_transformers(installed, version, expected):
    """Without ``mrope_convention`` the family follows the installed transformers' version
    (read from package metadata; a Megatron-Bridge environment pins <= 5.12.1)."""
    installed(lambda name: version)
    fam = get_family(model_config("qwen2_5_vl"))
    assert fam.mrope_convention == expected
    sample = _video_sample((4, 4, 4), [0.5])
    batch = build_thd_batch([sample], vlm=get_family(model_config("qwen2_5_vl")))
    assert batch.extras["mrope_convention"] == expected
    assert rows_of(batch, 0)[0, 3:19:4].tolist() == ([3, 4, 5, 6] if expected == conv.EXACT else [3, 3, 3, 3])


@pytest.mark.parametrize("version", ["5.3.0", "5.5.1"])
def test_unreproducible_releases_warn(version):
    """5.3 to 5.5 compute positions no convention gives: a warning names the version and the way out."""
    with pytest.warns(UserWarning, match=rf"transformers {version}'s .* use transformers >= 5.6"):
        assert conv.convention_for_transformers(version) == conv.TRUNCATE_SPG


def test_default_without_transformers_is_exact(installed):
    def missing(name):
        raise conv.metadata.PackageNotFoundError(name)

    installed(missing)
    assert get_family(model_config("qwen2_vl")).mrope_convention == conv.EXACT


def test_built_family_keeps_or_changes_its_convention():
    fam = get_family(model_config("qwen3_vl"), mrope_convention="truncate-spg")
    assert get_family(fam) is fam
    assert get_family(fam, mrope_convention="transformers-4").mrope_convention == conv.TRANSFORMERS_4

    class Custom:  # a family of one's own that is no dataclass
        def image_items(self): ...
        def mrope_positions(self): ...

    with pytest.raises(ValueError, match="Custom is not a dataclass; pass its transformers config"):
        get_family(Custom(), mrope_convention="exact")


@pytest.mark.parametrize("value", ["transformers-5", "EXACT", "transformers==x.y", 3])
def test_unknown_convention_is_refused(value):
    with pytest.raises(ValueError, match=r"mrope_convention.*(not known|cannot read).*"):
        get_family(model_config("qwen2_5_vl"), mrope_convention=value)


def bridge_qwen3_rope():
    """Megatron-Bridge 0.6.2's ``_build_llm_rope_positions`` (Qwen3-VL), or why it cannot be had."""
    site = megatron_env.site_or_reason()
    if isinstance(site, str):
        return site
    path = site / "megatron" / "bridge" / "models" / "qwen_vl" / "modelling_qwen3_vl" / "rope.py"
    return _functions(path.read_text(), ("_build_llm_rope_positions",), str(path))["_build_llm_rope_positions"]


@pytest.mark.parametrize("fn", [pytest.param(None, id="transcription"),
                                megatron_env.peer_param(bridge_qwen3_rope(), megatron_env.SITE_ID)])
def test_bridge_qwen3_vl_rope_is_transformers_4(fn):
    """Megatron-Bridge's THD Qwen3-VL positions (its own ``get_rope_index``, one packed sample at
    a time; ``fn`` None: the transformers-4 transcription) are the ``"transformers-4"`` rule;
    transformers 5.x differs on images with ``t > max(h, w)`` (after merge), where the text after
    them starts later in Bridge."""
    layout = [("text", 2), ("image", (5, 2, 4)), ("text", 3), ("video", (3, 4, 4)), ("text", 2), ("image", (1, 4, 2)),
              ("text", 1)]
    sample = make_sample("qwen3_vl", layout, np.random.default_rng(1))
    if fn is None:
        want = transcribed_rope(conv.TRANSFORMERS_4, "qwen3_vl", sample["input_ids"], sample["image_grid_thw"],
                                sample["video_grid_thw"], None)[0]
    else:
        videos = torch.tensor(sample["video_grid_thw"])
        videos = torch.repeat_interleave(videos, videos[:, 0], dim=0)
        videos[:, 0] = 1  # as Bridge's get_rope_index does before calling it
        want, _, _ = fn(torch.tensor(sample["input_ids"]), spatial_merge_size=MERGE, image_token_id=IMG,
                        video_token_id=VID, vision_start_token_id=VS,
                        image_grid_thw=torch.tensor(sample["image_grid_thw"]), video_grid_thw=videos,
                        image_index=0, video_index=0)
        want = want.numpy()
    got = {}
    for name in (conv.TRANSFORMERS_4, conv.EXACT):
        batch = build_thd_batch([sample], vlm=get_family(model_config("qwen3_vl"), mrope_convention=name))
        got[name] = rows_of(batch, 0)
    assert np.array_equal(got[conv.TRANSFORMERS_4], want)
    assert not np.array_equal(got[conv.EXACT], want)  # the image with t = 5 > max(1, 2)
