"""Offline builds with ``share_prefix: true`` (issue 24 point 1): each DPO pair's / ``group_column`` group's
common token prefix is counted once against ``pack_size`` and the loaded packs are shared-prefix batches.

- a DPO build (string rows with the demo tokenizer, some prompts ending in a space: a token may merge across
  the prompt / answer boundary) and a GRPO-like ``group_column`` build: every sample once, each group in
  one pack, every loaded batch within ``pack_size`` though the stored samples of some packs exceed it, the
  stored prefixes equal what ``thdpack.batching.shared_prefix.group_prefixes`` (the online path) finds on the
  same samples, and the counts in ``metadata.json`` add up;
- per-member ``sequence_logps`` of a tiny random Qwen3 (sdpa, the tree's dense mask) on the loaded shared
  batches equal those of the unshared build of the same rows, sample by sample (float64);
- the config refuses ``share_prefix`` where no group exists, with CP, Megatron-Bridge output, and
  ``min_prefix_len`` without it; ``--share-prefix`` is a flag.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("datasets")
transformers = pytest.importorskip("transformers")

from test_offline_pairs import build, string_rows, tiny_model  # noqa: E402
from thdpack import build_thd_batch  # noqa: E402
from thdpack.batching.shared_prefix import group_prefixes  # noqa: E402
from thdpack.losses import sequence_logps  # noqa: E402
from thdpack.offline import BuildConfig, ConfigError, load_packed, unpack_row  # noqa: E402
from thdpack.offline.stages import BuildStages  # noqa: E402
from thdpack.integrations import to_hf_kwargs  # noqa: E402

MIN_PREFIX = 4
PACK = 160
ALIGN = 8  # of the group_column builds: padding each segment can make a tree longer than its group unshared


def dpo_rows() -> list[dict]:
    """Preference rows whose prompts (5-12 words) are longer than MIN_PREFIX tokens, answers shorter."""
    rows = string_rows(14, seed=11)
    rng = np.random.default_rng(2)
    words = ["sun", "rain", "cat", "dog", "tree", "blue"]
    for i, r in enumerate(rows):
        r["prompt"] = " ".join(rng.choice(words, rng.integers(5, 13))) + r["prompt"]
        if i == 3:
            r["rejected"] = r["chosen"] + " x"  # the answers begin alike: the common prefix runs past the prompt
    return rows


def group_rows() -> list[dict]:
    """GRPO-like prompt/completion rows, 2-4 completions per prompt id; one prompt too short to share."""
    rng = np.random.default_rng(4)
    words = ["sun", "rain", "cat", "dog", "tree", "blue", "42"]
    rows = []
    for g in range(7):
        prompt = " ".join(rng.choice(words, 2 if g == 5 else rng.integers(8, 16)))
        for _ in range(rng.integers(2, 5)):
            rows.append({"prompt": prompt, "completion": " ".join(rng.choice(words, rng.integers(1, 6))),
                         "prompt_id": f"p{g}"})
    # the same tokens, but "dog tree" is a target in one member only: the prefix ends before it
    rows += [{"prompt": "sun rain cat blue sun rain", "completion": " dog tree", "prompt_id": "targets"},
             {"prompt": "sun rain cat blue sun rain dog tree", "completion": " cat", "prompt_id": "targets"}]
    # a short prompt and answers: padded to ALIGN each, the tree would be longer than the group unshared
    rows += [{"prompt": "sun dog", "completion": c, "prompt_id": "padding"} for c in ("x", "42")]
    return rows


def built(tmp: Path, kind: str, share: bool) -> Path:
    rows = dpo_rows() if kind == "dpo" else group_rows()
    kw = dict(pack_size=PACK) if kind == "dpo" else dict(pack_size=PACK, group_column="prompt_id", pad_multiple=ALIGN)
    if share:
        kw.update(share_prefix=True, min_prefix_len=MIN_PREFIX)
    return build(tmp, rows, f"{kind}-{'shared' if share else 'unshared'}", **kw)


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("shared")
    return {(kind, share): built(tmp, kind, share) for kind in ("dpo", "groups") for share in (False, True)}


def stored(out: Path) -> dict:
    """sample_index -> (ids, loss mask, group id, prefix_len, pack) of every stored sample."""
    ds = load_packed(out)
    got = {}
    for k in range(len(ds)):
        row = ds[k]
        group = row.get("group_id", np.full(len(row["seq_lens"]), -1))
        prefix = row.get("prefix_len", np.zeros(len(row["seq_lens"]), np.int64))
        for r, s, g, p in zip(row["sample_index"].tolist(), unpack_row(row), group.tolist(), prefix.tolist()):
            got[r] = (np.asarray(s["input_ids"]), np.asarray(s["loss_mask"], bool), g, p, k)
    return got


@pytest.mark.parametrize("kind", ["dpo", "groups"])
def test_packs_fit_every_member_once_and_prefixes_are_the_groups(outputs, kind):
    shared, unshared = outputs[kind, True], outputs[kind, False]
    ds = load_packed(shared)
    samples, alone = stored(shared), stored(unshared)
    assert samples.keys() == alone.keys()
    for i in samples:  # the samples are stored whole, as the unshared build stores them
        np.testing.assert_array_equal(samples[i][0], alone[i][0])
        np.testing.assert_array_equal(samples[i][1], alone[i][1])
    groups: dict[int, list[int]] = {}
    for i, (_, _, g, _, k) in samples.items():
        groups.setdefault(g, []).append(i)
    for g, members in groups.items():
        assert len({samples[i][4] for i in members}) == 1, f"group {g} in one pack"
        assert len({samples[i][3] for i in members}) == 1, f"group {g}: one prefix"
        # the online path: the common prefix build_thd_batch would find and share, with the same rule
        group_samples = [{"input_ids": samples[i][0], "loss_mask": samples[i][1], "group": g} for i in members]
        align = ds.metadata["align"]
        want = group_prefixes(build_thd_batch(group_samples), group_samples, "group", MIN_PREFIX, align)
        assert samples[members[0]][3] == int(want[0]), f"group {g}"
    if kind == "dpo":
        assert all(sorted(m) == [m[0], m[0] + 1] and m[0] % 2 == 0 for m in groups.values()), "pairs are groups"
    seen, over = [], 0
    collate = ds.collator()
    for k in range(len(ds)):
        batch = collate(ds[k])
        assert batch.num_tokens <= ds.pack_size, f"pack {k}: {batch.num_tokens} tokens"
        over += int(len(ds[k]["input_ids"]) > ds.pack_size)
        seen += batch.sample_index.tolist()
    assert sorted(seen) == sorted(samples), "every member once"
    assert over >= 1, "some packs hold more stored tokens than a pack: only sharing makes them fit"
    assert len(ds) < len(load_packed(unshared)), "fewer packs than unshared"

    meta, counts = ds.metadata, ds.metadata["share_prefix"]
    prefixes = {g: samples[m[0]][3] for g, m in groups.items()}
    assert counts == {"min_prefix_len": MIN_PREFIX, "groups": sum(p > 0 for p in prefixes.values()),
                      "samples": sum(len(groups[g]) for g, p in prefixes.items() if p > 0),
                      "prefix_tokens": sum(prefixes.values()),
                      "tokens_saved": sum((len(groups[g]) - 1) * p for g, p in prefixes.items())}
    assert 0 < counts["groups"] < len(groups) or kind == "dpo"
    assert meta["config"]["share_prefix"] is True and meta["config"]["min_prefix_len"] == MIN_PREFIX
    assert meta["counts"]["tokens"] == sum(len(s[0]) for s in samples.values())
    assert meta["stats"]["real_tokens"] == meta["counts"]["tokens"] - counts["tokens_saved"]
    text = (unshared / "metadata.json").read_text()
    assert "share_prefix" not in text and "prefix_len" not in text and "min_prefix_len" not in text


def test_sequence_logps_of_shared_packs_equal_the_unshared_build(outputs):
    shared, unshared = (load_packed(outputs["dpo", s]) for s in (True, False))
    model = tiny_model(shared.metadata["tokenizer"]["vocab_size"], 7)

    def logps(batches) -> dict[int, float]:
        out = {}
        for batch in batches:
            kw = to_hf_kwargs(batch, attn_implementation="sdpa", include_labels=False)
            with torch.no_grad():
                values = sequence_logps(model(**kw, use_cache=False).logits[0], batch)[0]
            out.update(zip(batch.sample_index.tolist(), values.tolist()))
        return out

    trees = [shared.collator()(shared[k]) for k in range(len(shared))]  # one pack a batch, as trained
    assert all(b.prefix_tree is not None for b in trees), "the loaded batches share prefixes"
    got = logps(trees)
    want = logps([unshared.collator()(list(unshared))])  # every unshared pack in one stream: one forward
    assert got.keys() == want.keys()
    for i in want:
        assert got[i] == pytest.approx(want[i], rel=1e-10, abs=1e-10), f"sample {i}"


@pytest.mark.parametrize("options, message", [
    (dict(format="text"), "share_prefix needs groups to share within.*format 'text'"),
    (dict(cp_size=2), "share_prefix cannot be used with cp_size 2"),
    (dict(output_format="megatron-bridge"), "share_prefix cannot be used with output_format 'megatron-bridge'"),
    (dict(share_prefix=False, min_prefix_len=8), r"min_prefix_len \(8\) needs share_prefix: true"),
])
def test_config_errors(options, message):
    cfg = BuildConfig(input="x.jsonl", tokenizer="t", **{"share_prefix": True, **options})
    with pytest.raises(ConfigError, match=message):
        BuildStages.from_config(cfg)  # what a build resolves first


def test_rows_without_groups_are_refused(tmp_path):
    rows = [{"prompt": "sun rain cat", "completion": "dog"}] * 3
    with pytest.raises(ConfigError, match="share_prefix needs preference rows .* or group_column; the rows are "
                                          "prompt_completion rows"):
        build(tmp_path, rows, "plain", share_prefix=True)


def test_share_prefix_flag():
    from thdpack.cli.config_flags import ThdpackParser, add_config_flags, build_config

    parser = ThdpackParser()
    parser.add_argument("--config")
    add_config_flags(parser)
    cfg = build_config(parser.parse_args(["--share-prefix", "--min-prefix-len", "16"]))
    assert cfg.planning.share_prefix is True and cfg.planning.min_prefix_len == 16
    assert build_config(parser.parse_args([])).as_dict(recorded=True).keys().isdisjoint(
        {"share_prefix", "min_prefix_len"})
    assert json.dumps(BuildConfig().as_dict(recorded=True), default=str).count("prefix") == 0


@pytest.mark.parametrize("kind", ["dpo", "groups"])
def test_stats_of_a_shared_build_count_each_prefix_once(outputs, kind, capsys):
    """``thdpack stats PATH`` reads the packs' streams as the build counted them (a group's prefix once):
    its real tokens and fill equal metadata.json's statistics, none above the pack."""
    from thdpack.cli import main

    out = outputs[kind, True]
    assert main(["stats", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    meta = load_packed(out).metadata["stats"]
    assert summary["real_tokens"] == meta["real_tokens"]
    assert summary["efficiency"] == pytest.approx(meta["efficiency"])
    assert summary["efficiency"] <= 1.0


def trie_group_rows() -> list[dict]:
    """Multi-turn-like groups of 4 completions of one prompt whose answers share their first words at two levels
    (three begin alike, two of them further): the loader lays each group out as a trie."""
    rng = np.random.default_rng(9)
    words = ["sun", "rain", "cat", "dog", "tree", "blue", "42"]
    rows = []
    for g in range(5):
        prompt = " ".join(rng.choice(words, 10))
        turn, deeper = " ".join(rng.choice(words, 6)), " ".join(rng.choice(words, 5))
        for completion in (f"{turn} {deeper} sun", f"{turn} {deeper} rain rain", f"{turn} cat blue", "dog"):
            rows.append({"prompt": prompt, "completion": " " + completion, "prompt_id": f"t{g}"})
    return rows


def test_groups_the_loader_lays_out_as_tries(tmp_path):
    """Issue 46: a ``group_column`` build plans each group as its loader's build lays it out, a trie's segments
    once (``prefix_len``: what earlier members lay out; nothing declared, the build finds the trie), so every
    loaded pack is the trie ``build_thd_batch`` makes of its samples, within ``pack_size``, and the plan's tokens
    are the loaded streams'."""
    from test_rollout_tries import trie_depth

    rows = trie_group_rows()
    out = build(tmp_path, rows, "tries", pack_size=PACK, group_column="prompt_id", share_prefix=True,
                min_prefix_len=MIN_PREFIX)
    ds = load_packed(out)
    collate, tokens, depths = ds.collator(), 0, []
    for k in range(len(ds)):
        row = ds[k]
        batch = collate(row)
        samples = [{**s, "group": int(g)} for s, g in zip(unpack_row(row), row["group_id"].tolist())]
        want = build_thd_batch(samples, share_prefix="group", min_prefix_len=MIN_PREFIX)
        assert torch.equal(batch.input_ids, want.input_ids), f"pack {k}"
        assert torch.equal(batch.prefix_tree.parents, want.prefix_tree.parents), f"pack {k}"
        assert batch.num_padded_tokens <= ds.pack_size, f"pack {k}"
        tokens += batch.num_tokens
        depths.append(trie_depth(batch))
        for g in set(row["group_id"].tolist()):
            stored = [p for p, h in zip(row["prefix_len"].tolist(), row["group_id"].tolist()) if h == g]
            assert stored[0] == 0 and len(set(stored)) > 1, f"pack {k}, group {g}: a trie's stored shares"
    assert max(depths) >= 3 and sorted(s for k in range(len(ds)) for s in ds[k]["sample_index"].tolist()) == \
        list(range(len(rows)))
    assert ds.metadata["stats"]["real_tokens"] == tokens  # the plan counted each trie as loaded
    assert ds.metadata["stats"]["real_tokens"] == ds.metadata["counts"]["tokens"] - \
        ds.metadata["share_prefix"]["tokens_saved"]
    lens, _ = ds.all_seq_lens(stream=True)
    assert int(lens.sum()) == tokens  # the read-back rule counts the trie too


def test_a_mixture_lays_its_groups_out_as_tries(tmp_path):
    """A mixture of a ``group_column`` source whose groups are tries and a preference source (one level, its
    shares joined to the tries'): every loaded pack is the batch ``build_thd_batch`` makes of its samples, within
    ``pack_size``, and the plan's tokens are the loaded streams'. (A unit a mixture takes twice keeps one group id,
    so two copies in one pack share more than planned, with one level as with tries: fewer tokens, never more.)"""
    from thdpack.demo import TOKENIZER_DIR, write_jsonl
    from thdpack.offline import build_packed

    tries = write_jsonl(trie_group_rows(), tmp_path / "tries.jsonl")
    pairs = write_jsonl([dict(r, prompt_id=f"pair{i}") for i, r in enumerate(dpo_rows())], tmp_path / "pairs.jsonl")
    cfg = BuildConfig(input=[{"path": str(tries)}, {"path": str(pairs), "format": "preference"}],
                      tokenizer=str(TOKENIZER_DIR), pack_size=PACK, group_column="prompt_id", share_prefix=True,
                      min_prefix_len=MIN_PREFIX, save_tokenizer=False)
    ds = load_packed(build_packed(cfg, tmp_path / "mix", progress=False).path)
    collate, tokens, deep = ds.collator(), 0, 0
    for k in range(len(ds)):
        row = ds[k]
        batch = collate(row)
        samples = [{**s, "group": int(g)} for s, g in zip(unpack_row(row), row["group_id"].tolist())]
        want = build_thd_batch(samples, share_prefix="group", min_prefix_len=MIN_PREFIX)
        assert torch.equal(batch.input_ids, want.input_ids) and batch.num_padded_tokens <= ds.pack_size, f"pack {k}"
        tokens += batch.num_tokens
        deep += batch.prefix_tree is not None and int(batch.prefix_tree.parents.max()) > 0
    assert deep and ds.metadata["stats"]["real_tokens"] == tokens
