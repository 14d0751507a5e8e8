"""Offline VLM builds: rows with image paths -> thdpack build -> load_packed -> collator.

Everything is local: PNG images written here with PIL, the bundled demo tokenizer with
Qwen-VL's vision tokens added, tiny random-weight Qwen2-VL / Qwen2.5-VL configs, and
the family's image processor built from keyword arguments.

The reference side does not use thdpack.offline: it opens the images, runs the image
processor, expands each ``<image>`` into ``<|vision_start|>`` + n × ``<|image_pad|>`` +
``<|vision_end|>`` (n = t·h·w / merge²) and tokenizes with transformers' chat template;
a pack read from disk must equal ``build_thd_batch`` of those samples, and a real model
must give, sample by sample, the logits it gives on each sample alone.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("datasets")
transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

from log_capture import thdpack_messages  # noqa: E402
from thdpack import build_thd_batch  # noqa: E402
from thdpack.cli import main  # noqa: E402
from thdpack.demo import TOKENIZER_DIR  # noqa: E402
from thdpack.demo.models import TINY_TEXT  # noqa: E402
from thdpack.flops import model_overcount_factor  # noqa: E402
from thdpack.offline import BuildConfig, InputError, build_packed, load_packed  # noqa: E402
from thdpack.offline.errors import ConfigError  # noqa: E402
from thdpack.vlm import get_family  # noqa: E402
from thdpack.integrations import to_hf_kwargs  # noqa: E402

IGNORE = -100
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
VS, VE, IMG, VID = 3072, 3073, 3074, 3075  # their ids after the demo tokenizer's 3072
PATCH, TPATCH, MERGE = 2, 2, 2
PROC_KW = {"min_pixels": 16, "max_pixels": 256}
SIZES = [(12, 8), (8, 8), (8, 16), (20, 12), (16, 16), (10, 6), (6, 14)]  # (h, w) of the test images
LOGIT_ATOL = 1e-4


# --------------------------------------------------------------------------- assets


def tiny_config(family: str):
    text = dict(vocab_size=3080, **TINY_TEXT, max_position_embeddings=4096, initializer_range=0.2,
                bos_token_id=None, eos_token_id=None,
                rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0})
    vision = dict(depth=2, num_heads=2, in_channels=3, patch_size=PATCH, spatial_merge_size=MERGE,
                  temporal_patch_size=TPATCH, initializer_range=0.2)
    tokens = dict(image_token_id=IMG, video_token_id=VID, vision_start_token_id=VS, vision_end_token_id=VE)
    if family == "qwen2_vl":
        vision.update(embed_dim=32, hidden_size=64, mlp_ratio=2)
        cfg = transformers.Qwen2VLConfig(text_config=text, vision_config=vision, **tokens)
    else:
        vision.update(hidden_size=32, intermediate_size=64, out_hidden_size=64, window_size=8, fullatt_block_indexes=[1])
        cfg = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **tokens)
    cfg._attn_implementation = "sdpa"
    return cfg


CHAT_ROWS = [
    {"messages": [{"role": "user", "content": "<image>Describe the picture."},
                  {"role": "assistant", "content": "A noisy square."}], "images": ["img/0.png"]},
    {"messages": [{"role": "user", "content": "Compare <image> and <image>, please."},
                  {"role": "assistant", "content": "They differ in size."}], "images": ["img/1.png", "img/2.png"]},
    {"messages": [{"role": "user", "content": "No image here."}, {"role": "assistant", "content": "Fine."}]},
    {"messages": [{"role": "user", "content": "First."}, {"role": "assistant", "content": "Ok."},
                  {"role": "user", "content": "Now this: <image>"}, {"role": "assistant", "content": "A tall one."}],
     "images": ["img/3.png"]},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "<image>"},
                  {"role": "assistant", "content": "Square."}], "images": ["img/4.png"]},
    {"messages": [{"role": "user", "content": "Three: <image><image> <image>"},
                  {"role": "assistant", "content": "Three pictures."}], "images": ["img/5.png", "img/6.png", "img/0.png"]},
    {"messages": [{"role": "user", "content": "Plain text again, a bit longer this time."},
                  {"role": "assistant", "content": "Understood, a longer answer as well."}], "images": []},
]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    d = tmp_path_factory.mktemp("vlm")
    tok = transformers.AutoTokenizer.from_pretrained(str(TOKENIZER_DIR), local_files_only=True)
    tok.add_tokens(VISION_TOKENS, special_tokens=True)
    assert tok.convert_tokens_to_ids(VISION_TOKENS) == [VS, VE, IMG, VID]
    tok.save_pretrained(str(d / "tok"))
    (d / "img").mkdir()
    rng = np.random.default_rng(0)
    for i, (h, w) in enumerate(SIZES):
        Image.fromarray((rng.random((h, w, 3)) * 255).astype(np.uint8)).save(d / "img" / f"{i}.png")
    with open(d / "data.jsonl", "w") as f:
        for r in CHAT_ROWS:
            f.write(json.dumps(r) + "\n")
    for family in ("qwen2_vl", "qwen2_5_vl"):
        (d / family).mkdir()
        (d / family / "config.json").write_text(json.dumps(tiny_config(family).to_dict()))
    return d


def cfg(assets, family="qwen2_vl", **kw) -> BuildConfig:
    base = dict(input=str(assets / "data.jsonl"), tokenizer=str(assets / "tok"), model_config=str(assets / family),
                image_processor=dict(PROC_KW), pack_size=160, vision_budget=128, overflow="error")
    base.update(kw)
    return BuildConfig(**base)


# --------------------------------------------------------------------------- reference (no thdpack.offline)


def reference_samples(assets, rows, *, text_rows=False):
    tok = transformers.AutoTokenizer.from_pretrained(str(assets / "tok"), local_files_only=True)
    proc = transformers.Qwen2VLImageProcessor(patch_size=PATCH, merge_size=MERGE, temporal_patch_size=TPATCH, **PROC_KW)
    out = []
    for row in rows:
        sample = {}
        runs = []
        if row.get("images"):
            images = [Image.open(assets / p).convert("RGB") for p in row["images"]]
            enc = proc(images=images, return_tensors="pt")
            sample["pixel_values"] = enc["pixel_values"]
            sample["image_grid_thw"] = enc["image_grid_thw"]
            runs = ["<|vision_start|>" + "<|image_pad|>" * (int(g.prod()) // MERGE**2) + "<|vision_end|>"
                    for g in enc["image_grid_thw"]]
        it = iter(runs)

        def sub(text, it=it):
            parts = text.split("<image>")
            return parts[0] + "".join(next(it) + p for p in parts[1:])

        if text_rows:
            ids = tok(sub(row["text"]))["input_ids"] + [tok.eos_token_id]
            mask = np.ones(len(ids), bool)
        else:
            msgs = [dict(m, content=sub(m["content"])) for m in row["messages"]]
            enc = tok.apply_chat_template([msgs], tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
            ids, mask = enc["input_ids"][0], np.asarray(enc["assistant_masks"][0], bool)
        ids = np.asarray(ids)
        assert int((ids == IMG).sum()) == sum(r.count("<|image_pad|>") for r in runs)
        mask &= ids != IMG
        sample["input_ids"] = torch.as_tensor(ids)
        sample["labels"] = torch.as_tensor(np.where(mask, ids, IGNORE))
        out.append(sample)
    return out


@torch.no_grad()
def assert_model_equivalent(model, batch, samples):
    """The packed batch's logits equal each sample's logits alone; the loss is the token-weighted mean."""
    out = model(**to_hf_kwargs(batch), use_cache=False)
    ce_sum, n_sum = 0.0, 0
    for i, s in enumerate(samples):
        ids = s["input_ids"].reshape(1, -1)
        labels = s["labels"].reshape(1, -1)
        kw = {k: s[k] for k in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw",
                                "second_per_grid_ts") if k in s}
        types = (ids == IMG).int() + 2 * (ids == VID).int()  # mm_token_type_ids: 1 image, 2 video
        alone = model(input_ids=ids, mm_token_type_ids=types, use_cache=False, **kw).logits[0]
        a, n = int(batch.cu_seqlens_padded[i]), int(batch.seq_lens[i])
        torch.testing.assert_close(out.logits[0, a:a + n], alone, rtol=0, atol=LOGIT_ATOL)
        ce = F.cross_entropy(alone[:-1], labels[0, 1:], ignore_index=IGNORE, reduction="sum")
        ce_sum += float(ce)
        n_sum += int((labels[0, 1:] != IGNORE).sum())
    torch.testing.assert_close(out.loss, torch.tensor(ce_sum / n_sum), rtol=0, atol=1e-5)


def assert_same_hf_kwargs(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


# --------------------------------------------------------------------------- end to end


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_packs_from_disk_equal_build_thd_batch_and_feed_the_model(tmp_path, assets, family):
    res = build_packed(cfg(assets, family), tmp_path / "out", progress=False)
    meta = res.metadata
    assert meta["format_version"] == 2 and meta["vision"]["model_type"] == family
    assert meta["vision"]["images"] == sum(len(r.get("images", [])) for r in CHAT_ROWS)
    ds = load_packed(res.path)
    refs = reference_samples(assets, CHAT_ROWS)
    model_cfg = json.loads((assets / family / "config.json").read_text())
    torch.manual_seed(0)
    model_cls = transformers.Qwen2VLForConditionalGeneration if family == "qwen2_vl" else transformers.Qwen2_5_VLForConditionalGeneration
    model = model_cls(tiny_config(family)).eval()
    collate = ds.collator()
    seen, patches_total = [], 0
    for k in range(len(ds)):
        batch = collate(ds[k])
        rows = batch.sample_index.tolist()
        seen += rows
        samples = [refs[r] for r in rows]
        want = build_thd_batch(samples, vlm=get_family(model_cfg))
        assert_same_hf_kwargs(to_hf_kwargs(batch), to_hf_kwargs(want))
        for key in ("mrope_position_ids", "mm_token_type_ids"):
            assert torch.equal(batch.token_extras[key], want.token_extras[key])
        assert torch.equal(batch.extras["vision_cu_seqlens"], want.extras["vision_cu_seqlens"])
        patches = int(batch.extras["sample_vision_patches"].sum())
        assert patches <= 128 and batch.num_tokens <= 160  # both budgets
        patches_total += patches
        assert_model_equivalent(model, batch, samples)
    assert sorted(seen) == list(range(len(CHAT_ROWS)))
    assert patches_total == meta["vision"]["vision_patches"]


def test_text_rows_cp_shards_and_processor_directory(tmp_path, assets):
    rows = [{"text": "Only words here."},  # the first row has no images field: still a VLM build
            {"text": "A caption: <image> then words.", "images": ["img/2.png"]},
            {"text": "Two <image> and <image> pictures.", "images": [str(assets / "img" / "3.png"), "img/4.png"]}]
    with open(assets / "text.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    proc = transformers.Qwen2VLImageProcessor(patch_size=PATCH, merge_size=MERGE, temporal_patch_size=TPATCH, **PROC_KW)
    proc.save_pretrained(str(tmp_path / "proc"))
    res = build_packed(cfg(assets, input=str(assets / "text.jsonl"), image_processor=str(tmp_path / "proc"), cp_size=2,
                           image_dir=str(assets)), tmp_path / "out", progress=False)
    assert res.metadata["source"]["format"] == "text" and res.metadata["align"] == 4
    assert res.metadata["vision"]["images"] == 3
    ds = load_packed(res.path)
    refs = reference_samples(assets, rows, text_rows=True)
    model_cfg = json.loads((assets / "qwen2_vl" / "config.json").read_text())
    for k in range(len(ds)):
        rows_k = ds[k]["sample_index"].tolist()
        samples = [refs[r] for r in rows_k]
        whole = ds.collator(cp_rank=None)(ds[k])
        assert_same_hf_kwargs(to_hf_kwargs(whole), to_hf_kwargs(build_thd_batch(samples, vlm=get_family(model_cfg), cp_size=2)))
        for r in range(2):  # each CP rank's shard
            got = ds.collator(cp_rank=r)(ds[k])
            want = build_thd_batch(samples, vlm=get_family(model_cfg), cp_size=2, cp_rank=r)
            assert_same_hf_kwargs(to_hf_kwargs(got), to_hf_kwargs(want))


def test_metadata_stats_and_byte_identical_rebuild(tmp_path, assets, capsys):
    a = build_packed(cfg(assets), tmp_path / "a", progress=False)
    b = build_packed(cfg(assets, num_proc=2, map_batch_size=2), tmp_path / "b", progress=False)

    def digest(p: Path):
        return {str(f.relative_to(p)): hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(p.rglob("*")) if f.is_file()}

    assert digest(a.path) == digest(b.path)
    assert (a.path / "image_processor" / "preprocessor_config.json").is_file()
    assert set(a.metadata["columns"]) >= {"pixel_values", "image_grid_thw", "image_counts"}
    # the model FLOPs figure counts the vision tower the same in both counts
    ds = load_packed(a.path)
    lens, _ = ds.all_seq_lens()
    lens = lens.astype(np.int64)
    grids = np.concatenate([ds[k]["image_grid_thw"].reshape(-1, 3) for k in range(len(ds))]).astype(np.int64)
    model_cfg = json.loads((assets / "qwen2_vl" / "config.json").read_text())
    want = model_overcount_factor(model_cfg, len(ds), 160, int(lens.sum()), int((lens * lens).sum()), vision_grid_thw=grids)
    mf = a.metadata["stats"]["model_flops"]
    assert mf["vision_included"] and mf["overcount"] == pytest.approx(want, rel=1e-12)
    assert mf["overcount"] < model_overcount_factor(model_cfg, len(ds), 160, int(lens.sum()), int((lens * lens).sum()))
    assert main(["stats", str(a.path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model_flops"]["overcount"] == pytest.approx(want, rel=1e-12)


def test_bad_rows_are_named(tmp_path, assets, capsys):
    bad = [
        CHAT_ROWS[0],
        {"messages": [{"role": "user", "content": "<image>"}, {"role": "assistant", "content": "x"}], "images": ["img/missing.png"]},
        {"messages": [{"role": "user", "content": "<image> <image>"}, {"role": "assistant", "content": "x"}], "images": ["img/0.png"]},
        {"messages": [{"role": "user", "content": "big <image>"}, {"role": "assistant", "content": "x"}], "images": ["img/4.png"]},
    ]
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in bad))
    # img/4.png (16x16 -> 64 patches) is over a vision budget of 32
    with pytest.raises(InputError) as exc:
        build_packed(cfg(assets, input=str(path), image_dir=str(assets), vision_budget=32), tmp_path / "x", progress=False)
    msg = str(exc.value)
    assert "3 bad row(s)" in msg and "bad.jsonl:2: image 'img/missing.png' not found" in msg
    assert "bad.jsonl:3: 2 '<image>' marker(s) but 1 image(s)" in msg
    assert "bad.jsonl:4: 64 vision patches, more than vision_budget=32" in msg
    assert not (tmp_path / "x").exists()
    res = build_packed(cfg(assets, input=str(path), image_dir=str(assets), vision_budget=32, skip_bad_rows=True),
                       tmp_path / "y", progress=False)
    assert res.metadata["counts"]["skipped_rows"] == 3 and res.metadata["counts"]["samples"] == 1
    # overflow: drop drops the row over the vision budget instead of failing it
    ok = tmp_path / "ok.jsonl"
    ok.write_text("".join(json.dumps(r) + "\n" for r in (bad[0], bad[3])))
    res = build_packed(cfg(assets, input=str(ok), image_dir=str(assets), vision_budget=32, overflow="drop"),
                       tmp_path / "z", progress=False)
    assert res.metadata["counts"]["dropped"]["samples"] == 1 and res.metadata["counts"]["samples"] == 2
    assert load_packed(res.path)[0]["sample_index"].tolist() == [0]


def as_parts(row: dict, *, inline: bool) -> dict:
    """``row`` with every message's content as a list of text and image parts (the
    transformers / TRL layout); with ``inline`` the image parts name their files."""
    images = iter(row.get("images", []))
    messages = []
    for m in row["messages"]:
        pieces = m["content"].split("<image>")
        parts = [{"type": "text", "text": pieces[0]}] if pieces[0] else []
        for piece in pieces[1:]:
            parts.append({"type": "image", "image": next(images)} if inline else {"type": "image"})
            if piece:
                parts.append({"type": "text", "text": piece})
        messages.append({"role": m["role"], "content": parts})
    out = {"messages": messages}
    if not inline and "images" in row:
        out["images"] = row["images"]
    return out


def _pack_columns(ds) -> list[dict]:
    return [{k: np.asarray(v) for k, v in ds[k].items()} for k in range(len(ds))]


@pytest.mark.parametrize("inline", [False, True])
def test_content_given_as_parts_packs_like_markers(tmp_path, assets, inline):
    path = assets / f"parts-{inline}.jsonl"
    path.write_text("".join(json.dumps(as_parts(r, inline=inline)) + "\n" for r in CHAT_ROWS))
    assert any(isinstance(m["content"], list) for m in json.loads(path.read_text().splitlines()[1])["messages"])
    with thdpack_messages() as logs:
        marked = load_packed(build_packed(cfg(assets), tmp_path / "markers", progress=False).path)
    assert any("through tiktoken" in line for line in logs)  # VLM rows take the tiktoken encoder too
    parts = load_packed(build_packed(cfg(assets, input=str(path)), tmp_path / "parts", progress=False).path)
    a, b = _pack_columns(marked), _pack_columns(parts)
    assert len(a) == len(b) == len(marked) and set(a[0]) == set(b[0])
    for pa_, pb in zip(a, b):
        for key in pa_:
            np.testing.assert_array_equal(pa_[key], pb[key], err_msg=key)


def test_bad_parts_are_named(tmp_path, assets):
    user = {"role": "user"}
    bad = [
        {"messages": [dict(user, content=[{"type": "image", "image": "img/0.png"}, {"type": "image"}]),
                      {"role": "assistant", "content": "x"}]},
        {"messages": [dict(user, content=[{"type": "image", "image": "img/0.png"}]),
                      {"role": "assistant", "content": "x"}], "images": ["img/1.png"]},
        {"messages": [dict(user, content=[{"type": "audio", "audio": "a.wav"}]), {"role": "assistant", "content": "x"}]},
        {"messages": [dict(user, content=[{"type": "text"}]), {"role": "assistant", "content": "x"}]},
        {"messages": [dict(user, content=[{"type": "image"}, {"type": "image"}]),
                      {"role": "assistant", "content": "x"}], "images": ["img/1.png"]},
    ]
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [as_parts(CHAT_ROWS[0], inline=True)] + bad))
    with pytest.raises(InputError) as exc:
        build_packed(cfg(assets, input=str(path), image_dir=str(assets)), tmp_path / "x", progress=False)
    msg = str(exc.value)
    assert "5 bad row(s)" in msg
    assert "bad.jsonl:2: 1 image part(s) name their image and 1 do not" in msg
    assert "bad.jsonl:3: images are named both in the image parts (1) and in 'images' (1)" in msg
    assert "bad.jsonl:4: message 0 part 0: part type 'audio' is not supported" in msg
    assert "bad.jsonl:5: message 0 part 0: a text part needs a 'text' string" in msg
    assert "bad.jsonl:6: 2 '<image>' marker(s) but 1 image(s)" in msg


def test_image_parts_alone_make_a_vlm_build(tmp_path, assets):
    path = assets / "parts-only.jsonl"
    rows = [{"messages": [{"role": "user", "content": "no image"}, {"role": "assistant", "content": "ok"}]},
            as_parts(CHAT_ROWS[0], inline=True)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # no images field, vision_budget or image_processor: only the image part says it has images
    res = build_packed(cfg(assets, input=str(path), image_processor=None, vision_budget=None, pack_size=4096),
                       tmp_path / "out", progress=False)
    assert res.metadata["format_version"] == 2 and res.metadata["vision"]["images"] == 1


def test_the_row_tokenizer_keeps_no_state_between_its_steps(tmp_path, assets, monkeypatch):
    """The VLM row tokenizer's steps (media, tokenizing, columns) hand their results on as
    values: a map batch leaves the tokenizer's attributes as it found them."""
    import thdpack.offline.vision.vlm_setup as vlm

    calls = []

    class Watched(vlm.VlmRowTokenizer):
        def __call__(self, table, indices):
            before = dict(vars(self))
            out = super().__call__(table, indices)
            calls.append(vars(self).keys() == before.keys() and all(vars(self)[k] is v for k, v in before.items()))
            return out

    monkeypatch.setattr(vlm, "VlmRowTokenizer", Watched)
    build_packed(cfg(assets, map_batch_size=3), tmp_path / "out", progress=False)
    assert len(calls) == 3 and all(calls), calls  # 7 rows in batches of 3


def _metadata_without_shards(meta: dict) -> dict:
    return {k: v for k, v in meta.items() if k not in ("input_slices", "input_slice")}


def test_vlm_shards_merge(tmp_path, assets):
    from thdpack.offline.inputs.input_slice import InputSlice
    from thdpack.offline.commands.slice_merge import merge_slices

    c = cfg(assets, family="qwen2_5_vl", shuffle_packs=False)
    single = build_packed(c, tmp_path / "single", progress=False)
    # one shard, merged: the ordinary build, statistics (vision tower FLOPs included) recomputed from the packs
    one = build_packed(c, tmp_path / "one-0", progress=False, input_slice=InputSlice(0, 1))
    merged_one = merge_slices([one.path], tmp_path / "merged-one")
    assert _metadata_without_shards(merged_one.metadata) == _metadata_without_shards(single.metadata)
    assert "vision_included" in merged_one.metadata["stats"]["model_flops"]
    assert (merged_one.path / "image_processor").is_dir()
    # three shards: every row once, vision counts summed, packs equal to build_thd_batch on the rows
    parts = [build_packed(c, tmp_path / f"part-{i}", progress=False, input_slice=InputSlice(i, 3)).path for i in range(3)]
    merged = merge_slices(parts, tmp_path / "merged")
    vision = merged.metadata["vision"]
    shard_visions = [json.loads((p / "metadata.json").read_text())["vision"] for p in parts]
    assert vision["images"] == sum(len(r.get("images", [])) for r in CHAT_ROWS) == sum(v["images"] for v in shard_visions)
    assert vision["vision_patches"] == sum(v["vision_patches"] for v in shard_visions)
    assert vision["max_pack_vision_patches"] == max(v["max_pack_vision_patches"] for v in shard_visions)
    ds = load_packed(merged.path)
    refs = reference_samples(assets, CHAT_ROWS)
    model_cfg = json.loads((assets / "qwen2_5_vl" / "config.json").read_text())
    collate = ds.collator()
    seen = []
    for k in range(len(ds)):
        batch = collate(ds[k])
        rows = batch.sample_index.tolist()
        seen += rows
        assert_same_hf_kwargs(to_hf_kwargs(batch), to_hf_kwargs(build_thd_batch([refs[r] for r in rows], vlm=get_family(model_cfg))))
    assert sorted(seen) == list(range(len(CHAT_ROWS)))
    # a shard of another VLM build does not merge
    other = build_packed(cfg(assets, family="qwen2_vl", shuffle_packs=False), tmp_path / "other", progress=False,
                         input_slice=InputSlice(1, 3))
    with pytest.raises(Exception, match="do not belong together"):
        merge_slices([parts[0], other.path, parts[2]], tmp_path / "bad")


def test_preference_rows_with_images_are_refused_by_name(tmp_path, assets):
    """A preference row gives two sequences (the media would be needed twice): a VLM build of
    preference rows is a configuration error naming the format, not a crash mid-build."""
    with pytest.raises(ConfigError, match="rows with images must be chat .* not preference"):
        build_packed(cfg(assets, format="preference"), tmp_path / "out", progress=False)


def test_thdpack_check_on_a_vlm_build(tmp_path, assets, capsys):
    """``thdpack check`` on a build of rows with images: each pack as its loader collates it (vision inputs,
    mRoPE rows), on the family's model with random weights, layer by layer against each sample alone."""
    from thdpack.cli import main

    res = build_packed(cfg(assets, "qwen2_5_vl"), tmp_path / "out", progress=False)
    code = main(["check", str(res.path), "--model", str(assets / "qwen2_5_vl"), "--packs", "2", "-q"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "Qwen2_5_VLForConditionalGeneration" in out and out.strip().splitlines()[-1] == "OK: 2 pack(s), every check holds"
