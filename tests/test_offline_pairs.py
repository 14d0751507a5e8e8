"""Offline builds of preference pairs and per-sample values (issue 15).

- ``thdpack build`` of TRL-style DPO rows (``prompt`` / ``chosen`` / ``rejected``, strings or
  messages): each row becomes two consecutive samples, chosen then rejected, in one pack;
  their ids and targets equal those of the two prompt/completion rows (prompt, chosen) and
  (prompt, rejected) built on their own; ``dpo_loss`` on the loaded packs equals the unpacked
  pair-by-pair DPO loss and gradient on a tiny random Qwen3 (CP 2 shards included);
- pairs that do not fit a pack are named by file:line; options that would part a pair are refused;
- ``sample_values: [reward, domain]`` carries each row's numbers into the packs and back as
  ``batch.sample_values[name]``, through truncation and split (each piece keeps its row's value)
  and CP shards.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("datasets")
transformers = pytest.importorskip("transformers")

from thdpack.demo import TOKENIZER_DIR  # noqa: E402
from thdpack.demo.models import TINY_TEXT  # noqa: E402
from thdpack.offline import BuildConfig, ConfigError, InputError, build_packed, load_packed, unpack_row  # noqa: E402
from thdpack.offline.tokenizing.row_formats import detect_format  # noqa: E402
from test_losses import packed_dpo_step  # noqa: E402

IGNORE = -100


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def build(tmp_path: Path, rows: list[dict], name: str, **kw):
    cfg = dict(input=str(write_jsonl(tmp_path / f"{name}.jsonl", rows)), tokenizer=str(TOKENIZER_DIR),
               pack_size=256, save_tokenizer=False)
    cfg.update(kw)
    build_packed(BuildConfig(**cfg), tmp_path / name, progress=False)
    return tmp_path / name


def string_rows(n: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    words = ["sun", "rain", "cat", "dog", "tree", "blue", " red", "x", "42", "é"]

    def text(k):
        return " ".join(rng.choice(words, k))

    # some prompts end in a space: a token may merge across the prompt / response boundary (TRL masks as many)
    return [{"prompt": text(rng.integers(1, 8)) + (" " if i % 3 == 0 else ""),
             "chosen": text(rng.integers(1, 10)), "rejected": text(rng.integers(1, 10))} for i in range(n)]


def chat_rows(n: int, seed: int) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": r["prompt"]}],
             "chosen": [{"role": "assistant", "content": r["chosen"]}],
             "rejected": [{"role": "assistant", "content": r["rejected"]}]} for r in string_rows(n, seed)]


def pack_size(make_rows) -> int:
    """A pack that holds several pairs of ``make_rows`` (the chat template adds its role headers)."""
    return 160 if make_rows is chat_rows else 96


def as_prompt_completion(rows: list[dict]) -> list[dict]:
    """Row 2k: (prompt, chosen), row 2k+1: (prompt, rejected) of pair k."""
    return [{"prompt": r["prompt"], "completion": r[side]} for r in rows for side in ("chosen", "rejected")]


def packed_samples(out: Path) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """sample_index -> (ids, loss mask) of every sample of the packs."""
    ds = load_packed(out)
    got = {}
    for k in range(len(ds)):
        row = ds[k]
        for r, s in zip(row["sample_index"].tolist(), unpack_row(row)):
            got[r] = (np.asarray(s["input_ids"]), np.asarray(s["loss_mask"], bool))
    return got


@pytest.mark.parametrize("make_rows", [string_rows, chat_rows], ids=["strings", "messages"])
def test_pairs_share_a_pack_and_equal_their_prompt_completion_rows(tmp_path, make_rows):
    rows = make_rows(12, seed=1)
    assert detect_format(rows[0].keys(), BuildConfig().tokenize) == "preference"
    out = build(tmp_path, rows, "pairs", pack_size=pack_size(make_rows))
    ds = load_packed(out)
    assert ds.metadata["source"]["format"] == "preference"
    collate = ds.collator()
    seen = []
    for k in range(len(ds)):
        index = ds[k]["sample_index"].tolist()
        assert [i // 2 for i in index[0::2]] == [i // 2 for i in index[1::2]], "each pair in one pack"
        assert index[0::2] == [i for i in index if i % 2 == 0], "chosen then rejected, consecutive"
        batch = collate(ds[k])
        assert batch.sample_index.tolist() == index
        seen += index
    assert sorted(seen) == list(range(2 * len(rows)))
    assert max(len(ds[k]["seq_lens"]) for k in range(len(ds))) >= 4, "several pairs share a pack"

    alone = packed_samples(build(tmp_path, as_prompt_completion(rows), "alone", format="prompt_completion"))
    got = packed_samples(out)
    assert got.keys() == alone.keys()
    for i in got:
        np.testing.assert_array_equal(got[i][0], alone[i][0])
        np.testing.assert_array_equal(got[i][1], alone[i][1])
        assert got[i][1].any() and not got[i][1].all(), "the response is trained, the prompt is not"


@functools.lru_cache(maxsize=None)
def tiny_model(vocab: int, seed: int) -> torch.nn.Module:
    config = transformers.Qwen3Config(vocab_size=vocab, **TINY_TEXT, max_position_embeddings=512,
                                      initializer_range=0.2, attn_implementation="sdpa")
    torch.manual_seed(seed)
    return transformers.Qwen3ForCausalLM(config).to(torch.float64).eval()


def alone_logp(model, ids: np.ndarray, mask: np.ndarray) -> torch.Tensor:
    """Sum of the log-probs of a sequence's targets, run alone (HF shift: position t scores token t+1)."""
    ids = torch.from_numpy(ids.astype(np.int64))
    logits = model(input_ids=ids[None], use_cache=False).logits[0, :-1]
    keep = torch.from_numpy(mask[1:])
    return torch.log_softmax(logits, -1)[keep].gather(1, ids[1:][keep][:, None]).sum()


def reference_dpo(policy, ref, samples: dict, beta: float) -> torch.Tensor:
    losses = []
    for k in range(len(samples) // 2):
        c, r = samples[2 * k], samples[2 * k + 1]
        with torch.no_grad():
            ref_margin = alone_logp(ref, *c) - alone_logp(ref, *r)
        margin = alone_logp(policy, *c) - alone_logp(policy, *r) - ref_margin
        losses.append(-torch.nn.functional.logsigmoid(beta * margin))
    return torch.stack(losses).mean()


def grads(model) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize("cp_size", [1, 2])
def test_dpo_loss_on_loaded_packs_equals_unpacked_pairs(tmp_path, cp_size):
    make_rows = chat_rows if cp_size == 1 else string_rows
    rows = make_rows(5, seed=3)
    out = build(tmp_path, rows, "pairs", pack_size=pack_size(make_rows), cp_size=cp_size)
    ds = load_packed(out)
    vocab = ds.metadata["tokenizer"]["vocab_size"]
    policy, ref = tiny_model(vocab, 7), tiny_model(vocab, 8)
    beta, num_pairs = 0.5, len(rows)
    policy.zero_grad()
    total = 0.0
    for k in range(len(ds)):
        total = total + packed_dpo_step(policy, ref, ds.collator()(ds[k]), cp_size, beta, num_pairs)
    got = grads(policy).clone()
    policy.zero_grad()
    want = reference_dpo(policy, ref, packed_samples(out), beta)
    want.backward()
    torch.testing.assert_close(total, want.detach(), rtol=1e-12, atol=0)
    assert float((got - grads(policy)).norm() / grads(policy).norm()) < 1e-10


def test_a_pair_over_the_pack_is_named_and_can_be_skipped(tmp_path):
    rows = string_rows(4, seed=5)
    rows[2] = {"prompt": "cat " * 30, "chosen": "dog " * 20, "rejected": "tree " * 20}
    with pytest.raises(InputError, match=r"pairs\.jsonl:3 \(\d+ tokens for chosen \+ rejected\).*larger pack_size"):
        build(tmp_path, rows, "pairs", pack_size=96)
    out = build(tmp_path, rows, "skipped", pack_size=96, skip_bad_rows=True)
    meta = load_packed(out).metadata
    assert meta["counts"]["skipped_rows"] == 1 and meta["counts"]["samples"] == 6
    assert sorted(packed_samples(out)) == [0, 1, 2, 3, 6, 7]


def test_a_bad_response_names_the_field_and_skips_the_pair(tmp_path):
    rows = string_rows(3, seed=6)
    rows[1]["rejected"] = [{"role": "assistant", "content": "no"}]
    with pytest.raises(InputError, match=r"pairs\.jsonl:2: 'prompt' and 'rejected' must both be strings"):
        build(tmp_path, rows, "pairs")
    out = build(tmp_path, rows, "skipped", skip_bad_rows=True)
    assert sorted(packed_samples(out)) == [0, 1, 4, 5]


@pytest.mark.parametrize("option", [{"overflow": "truncate"}, {"overflow": "split"}, {"overflow": "drop"},
                                    {"max_samples_per_pack": 4}])
def test_options_that_would_part_a_pair_are_refused(tmp_path, option):
    with pytest.raises(ConfigError, match=f"{next(iter(option))}.*preference rows"):
        build(tmp_path, string_rows(2, seed=7), "pairs", **option)


# --------------------------------------------------------------------------- per-sample values


def valued_rows(n: int, seed: int) -> list[dict]:
    """Text rows of varied lengths, each with its own reward (a float) and domain (an integer)."""
    rng = np.random.default_rng(seed)
    return [{"text": "sun rain " * int(rng.integers(1, 40)), "reward": float(rng.normal()) + i / 8,
             "domain": int(rng.integers(0, 4))} for i in range(n)]


def check_values(out: Path, rows: list[dict], cp_size: int = 1) -> int:
    """Every collated sample (piece) and every CP shard carries its input row's reward and domain; returns
    the number of pieces seen."""
    ds = load_packed(out)
    assert ds.metadata["sample_values"] == {"reward": "float64", "domain": "int64"}
    pieces = 0
    for k in range(len(ds)):
        for rank in range(cp_size):
            batch = ds.collator(cp_rank=rank if cp_size > 1 else None)(ds[k])
            index = batch.sample_index.tolist()
            want_reward = torch.tensor([rows[i]["reward"] for i in index], dtype=torch.float64)
            want_domain = torch.tensor([rows[i]["domain"] for i in index], dtype=torch.int64)
            torch.testing.assert_close(batch.sample_values["reward"], want_reward, rtol=0, atol=0)
            torch.testing.assert_close(batch.sample_values["domain"], want_domain, rtol=0, atol=0)
            per_token = batch.token_values("domain")
            assert per_token.numel() == batch.input_ids.numel()
            cu = batch.shard.local_cu_seqlens_padded if batch.is_shard else batch.cu_seqlens_padded
            for j in range(len(index)):
                assert (per_token[int(cu[j]) : int(cu[j + 1])] == want_domain[j]).all()
        pieces += len(index)
    return pieces


@pytest.mark.parametrize("overflow", ["error", "truncate", "split"])
def test_sample_values_follow_their_samples(tmp_path, overflow):
    rows = valued_rows(24, seed=11)
    out = build(tmp_path, rows, "values", pack_size=48, overflow=overflow, sample_values=["reward", "domain"],
                skip_bad_rows=overflow == "error")
    pieces = check_values(out, rows)
    if overflow == "split":
        assert pieces > len(rows), "some rows were split into pieces"


def test_sample_values_on_cp_shards_and_columnar_input(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = valued_rows(16, seed=12)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rows.parquet")
    cfg = BuildConfig(input=str(tmp_path / "rows.parquet"), tokenizer=str(TOKENIZER_DIR), pack_size=96, cp_size=2,
                      overflow="split", sample_values="reward,domain", save_tokenizer=False)
    build_packed(cfg, tmp_path / "out", progress=False)
    check_values(tmp_path / "out", rows, cp_size=2)


def test_sample_values_travel_with_preference_pairs(tmp_path):
    rows = [dict(r, reward=float(i) / 4, domain=i % 3) for i, r in enumerate(string_rows(6, seed=13))]
    out = build(tmp_path, rows, "pairs", pack_size=96, sample_values=["reward", "domain"])
    ds = load_packed(out)
    for k in range(len(ds)):
        batch = ds.collator()(ds[k])
        rows_of = [i // 2 for i in batch.sample_index.tolist()]
        assert batch.sample_values["reward"].tolist() == [rows[r]["reward"] for r in rows_of]
        assert batch.sample_values["domain"].tolist() == [rows[r]["domain"] for r in rows_of]


def test_builds_without_sample_values_record_nothing_new(tmp_path):
    rows = valued_rows(6, seed=14)
    meta = load_packed(build(tmp_path, rows, "plain", pack_size=512)).metadata
    assert "sample_values" not in meta and "sample_values" not in meta["config"]
    assert meta["columns"] == ["input_ids", "loss_mask", "seq_lens", "sample_index", "sample_start"]
    with pytest.raises(KeyError, match=r"no 'sample_values.reward' column.*built without sample_values"):
        load_packed(tmp_path / "plain").collator(sample_values=["reward"])(load_packed(tmp_path / "plain")[0])


def test_bad_sample_values_are_named(tmp_path):
    rows = valued_rows(4, seed=15)
    del rows[1]["reward"]
    rows[2]["domain"] = "web"
    with pytest.raises(InputError, match=r"values\.jsonl:2: no 'reward' value.*values\.jsonl:3: 'domain' is 'web'"):
        build(tmp_path, rows, "values", pack_size=512, sample_values=["reward", "domain"])
    with pytest.raises(ConfigError, match=r"sample_values must be a list of column names"):
        build(tmp_path, rows, "cfg", sample_values=[1])


def test_metadata_schema_checks_sample_values(tmp_path):
    from thdpack.offline import NotPackedError

    out = build(tmp_path, valued_rows(6, seed=16), "values", pack_size=512, sample_values=["reward", "domain"])
    meta_path = out / "metadata.json"
    meta = json.loads(meta_path.read_text())
    bad = dict(meta, sample_values={"reward": "float32", "domain": "int64"})
    meta_path.write_text(json.dumps(bad))
    with pytest.raises(NotPackedError, match=r"'sample_values' must be an object"):
        load_packed(out)
    bad = dict(meta, columns=[c for c in meta["columns"] if c != "sample_values.domain"])
    meta_path.write_text(json.dumps(bad))
    with pytest.raises(NotPackedError, match=r"'columns' lacks 'sample_values.domain' of 'sample_values'"):
        load_packed(out)


def test_sharded_preference_builds_are_refused(tmp_path):
    from thdpack.offline.inputs.input_slice import InputSlice

    cfg = BuildConfig(input=str(write_jsonl(tmp_path / "p.jsonl", string_rows(4, seed=8))),
                      tokenizer=str(TOKENIZER_DIR), pack_size=96)
    with pytest.raises(ConfigError, match=r"--slice is not available with preference rows"):
        build_packed(cfg, tmp_path / "out", progress=False, input_slice=InputSlice(0, 2))


# --------------------------------------------------------------------------- GRPO groups (group_column)


def grouped_rows(n: int, seed: int) -> list[dict]:
    """Completions of prompts in groups of 4 (string ids for some groups, integers for others), of varied lengths."""
    rng = np.random.default_rng(seed)
    return [{"text": "sun rain " * int(rng.integers(1, 12)), "prompt_id": f"q{i // 4}" if (i // 4) % 2 else i // 4,
             "reward": float(rng.normal())} for i in range(n)]


def test_group_column_keeps_each_group_in_one_pack(tmp_path):
    rows = grouped_rows(32, seed=21)
    out = build(tmp_path, rows, "groups", pack_size=256, group_column="prompt_id", sample_values=["reward"])
    ds = load_packed(out)
    assert ds.metadata["config"]["group_column"] == "prompt_id"
    pack_of = {}
    for k in range(len(ds)):
        batch = ds.collator()(ds[k])
        for i in batch.sample_index.tolist():
            pack_of[i] = k
        assert batch.sample_values["reward"].tolist() == [rows[i]["reward"] for i in batch.sample_index.tolist()]
    assert sorted(pack_of) == list(range(len(rows)))
    for g in range(len(rows) // 4):
        assert len({pack_of[i] for i in range(4 * g, 4 * g + 4)}) == 1, f"group {g} in one pack"
    assert len(ds) > 1 and max(len(ds[k]["seq_lens"]) for k in range(len(ds))) >= 8, "several groups share a pack"


def test_group_column_errors_name_the_row(tmp_path):
    rows = grouped_rows(8, seed=22)
    rows[5]["text"] = "sun rain " * 60  # its group no longer fits a pack
    with pytest.raises(InputError, match=r"groups\.jsonl:5 \(\d+ tokens in its group \(group_column: prompt_id\)\)"):
        build(tmp_path, rows, "groups", pack_size=120, group_column="prompt_id")
    out = build(tmp_path, rows, "skipped", pack_size=120, group_column="prompt_id", skip_bad_rows=True)
    assert sorted(packed_samples(out)) == [0, 1, 2, 3]
    rows = grouped_rows(8, seed=23)
    rows[2]["prompt_id"] = None
    with pytest.raises(InputError, match=r"groups\.jsonl:3: 'prompt_id' is None; a group id is a string or an integer"):
        build(tmp_path, rows, "groups", group_column="prompt_id")
    with pytest.raises(ConfigError, match=r"overflow: split cannot be used with group_column"):
        build(tmp_path, rows, "groups", group_column="prompt_id", overflow="split")


def test_pairs_values_and_groups_build_the_same_bytes_in_processes(tmp_path):
    """Two output rows per input row (pairs), value and group columns: num_proc: 2 over small batches
    writes the same shards as one process."""
    rows = [dict(r, reward=i / 2, g=i // 3) for i, r in enumerate(string_rows(30, seed=24))]
    kw = dict(pack_size=256, sample_values=["reward"], group_column="g")
    one = build(tmp_path, rows, "one", **kw)
    two = build(tmp_path, rows, "two", num_proc=2, map_batch_size=7, **kw)
    shards = sorted(p.name for p in one.glob("data-*"))
    assert shards and all((one / s).read_bytes() == (two / s).read_bytes() for s in shards)
