"""The whole-model FLOPs over-count in ``thdpack build`` / ``thdpack stats`` (``model_config``).

The expected factors are computed here by hand from the packs' lengths with the dense
formula of Megatron-LM (per token ``6·h·(3·ffn + d_q + 2·d_kv + d_q)·L + 6·h·V``, per unit of
``Σ sᵢ²`` ``6·d_q·L``), not through thdpack's summaries.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("datasets")
pytest.importorskip("transformers")

from thdpack.cli import main  # noqa: E402
from thdpack.demo import TOKENIZER_DIR, generate_rows, write_jsonl  # noqa: E402
from thdpack.offline import BuildConfig, build_packed, load_packed  # noqa: E402

# Qwen3-8B's published shape
QWEN3_8B = {
    "model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
}
SMALL = dict(QWEN3_8B, hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2, head_dim=64)
PACK = 2048


def dense_factor(c: dict, n_packs: int, pack_len: int, lens: np.ndarray) -> float:
    h, L, V = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    dq = c["num_attention_heads"] * c["head_dim"]
    dkv = c["num_key_value_heads"] * c["head_dim"]
    per_token = 6 * h * 3 * c["intermediate_size"] * L + 6 * (h * (dq + 2 * dkv) + dq * h) * L + 6 * h * V
    per_sq = 6 * dq * L
    lens = lens.astype(np.int64)
    claimed = per_token * n_packs * pack_len + per_sq * n_packs * pack_len**2
    real = per_token * int(lens.sum()) + per_sq * int((lens * lens).sum())
    return claimed / real


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("flops")
    jsonl = write_jsonl(generate_rows(200, seed=7, kind="chat"), d / "chat.jsonl")
    (d / "qwen3_8b.json").write_text(json.dumps(QWEN3_8B))
    (d / "small").mkdir()
    (d / "small" / "config.json").write_text(json.dumps(SMALL))
    return d, jsonl


def test_build_records_model_and_attention_overcount(tmp_path, data):
    d, jsonl = data
    cfg = BuildConfig(input=str(jsonl), tokenizer=str(TOKENIZER_DIR), pack_size=PACK, overflow="truncate",
                      model_config=str(d / "qwen3_8b.json"))
    res = build_packed(cfg, tmp_path / "out", progress=False)
    ds = load_packed(res.path)
    lens, _ = ds.all_seq_lens()
    n = len(ds)
    stats = res.metadata["stats"]
    assert stats["attention_flops"]["overcount"] == pytest.approx(n * PACK**2 / float((lens.astype(np.int64) ** 2).sum()))
    mf = stats["model_flops"]
    assert mf["model_type"] == "qwen3" and not mf["vision_included"]
    assert mf["overcount"] == pytest.approx(dense_factor(QWEN3_8B, n, PACK, lens), rel=1e-12)
    assert mf["overcount_samples_at_pack_len"] == pytest.approx(dense_factor(QWEN3_8B, lens.size, PACK, lens), rel=1e-12)
    assert 1 < mf["overcount"] < stats["attention_flops"]["overcount"]  # attention is only part of the model
    # the config travels with the dataset, fingerprinted
    assert json.loads((res.path / "model_config.json").read_text()) == QWEN3_8B
    assert res.metadata["model"]["model_type"] == "qwen3" and len(res.metadata["model"]["fingerprint"]) == 64


def test_stats_cli_packed_and_raw(tmp_path, data, capsys):
    d, jsonl = data
    out = tmp_path / "out"
    assert main(["build", "--input", str(jsonl), "--tokenizer", str(TOKENIZER_DIR), "--pack-size", str(PACK),
                 "--overflow", "truncate", "--model-config", str(d / "small"), "--output", str(out)]) == 0
    printed = capsys.readouterr().out  # build prints one line; the statistics block is stats' (issue 11)
    assert printed.count("\n") == 1 and f"thdpack stats {out}" in printed, printed
    ds = load_packed(out)
    lens, _ = ds.all_seq_lens()
    small = dense_factor(SMALL, len(ds), PACK, lens)

    # a packed dataset uses its saved copy of the config ...
    assert main(["stats", str(out), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["model_flops"]["overcount"] == pytest.approx(small, rel=1e-12)
    # ... or the one given
    assert main(["stats", str(out), "--json", "--model-config", str(d / "qwen3_8b.json")]) == 0
    s8 = json.loads(capsys.readouterr().out)
    assert s8["model_flops"]["overcount"] == pytest.approx(dense_factor(QWEN3_8B, len(ds), PACK, lens), rel=1e-12)
    assert s8["model_flops"]["overcount"] != pytest.approx(small)
    assert main(["stats", str(out)]) == 0
    assert f"over-counts whole-model training FLOPs by {small:.2f}x" in capsys.readouterr().out

    # raw input: planned, not written, same figure
    assert main(["stats", str(jsonl), "--json", "-q", "--tokenizer", str(TOKENIZER_DIR), "--pack-size", str(PACK),
                 "--overflow", "truncate", "--model-config", str(d / "small" / "config.json")]) == 0
    raw = json.loads(capsys.readouterr().out)
    assert raw["model_flops"]["overcount"] == pytest.approx(small, rel=1e-12)
    # without a model config there is no model figure
    assert main(["stats", str(jsonl), "--json", "-q", "--tokenizer", str(TOKENIZER_DIR), "--pack-size", str(PACK),
                 "--overflow", "truncate"]) == 0
    assert "model_flops" not in json.loads(capsys.readouterr().out)


def test_yaml_mapping_and_relative_path(tmp_path, data):
    _, jsonl = data
    yaml = pytest.importorskip("yaml")
    (tmp_path / "cfgs").mkdir()
    (tmp_path / "cfgs" / "m.json").write_text(json.dumps(SMALL))
    base = dict(input=str(jsonl), tokenizer=str(TOKENIZER_DIR), pack_size=PACK, overflow="truncate", max_rows=50)
    (tmp_path / "cfgs" / "a.yaml").write_text(yaml.safe_dump(dict(base, model_config="m.json")))
    (tmp_path / "cfgs" / "b.yaml").write_text(yaml.safe_dump(dict(base, model_config=SMALL)))
    a = build_packed(BuildConfig.from_yaml(tmp_path / "cfgs" / "a.yaml"), tmp_path / "a", progress=False)
    b = build_packed(BuildConfig.from_yaml(tmp_path / "cfgs" / "b.yaml"), tmp_path / "b", progress=False)
    assert a.metadata["stats"]["model_flops"] == b.metadata["stats"]["model_flops"]
    assert a.metadata["model"]["fingerprint"] == b.metadata["model"]["fingerprint"]
    assert b.metadata["model"]["given"] == "inline mapping"


def test_bad_and_uncovered_model_configs(tmp_path, data, capsys):
    _, jsonl = data
    args = ["build", "--input", str(jsonl), "--tokenizer", str(TOKENIZER_DIR), "--pack-size", str(PACK),
            "--overflow", "truncate", "--max-rows", "30", "-q"]
    assert main(args + ["--model-config", str(tmp_path / "missing.json"), "--output", str(tmp_path / "x")]) == 2
    assert "missing.json: no such file" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    # sliding-window layers are not Σ sᵢ²: the build succeeds and says why there is no model figure
    swa = dict(SMALL, layer_types=["sliding_attention", "full_attention"] * 2)
    (tmp_path / "swa.json").write_text(json.dumps(swa))
    assert main(args + ["--model-config", str(tmp_path / "swa.json"), "--output", str(tmp_path / "y")]) == 0
    mf = json.loads((tmp_path / "y" / "metadata.json").read_text())["stats"]["model_flops"]
    assert "overcount" not in mf and "sliding" in mf["error"]


def test_a_windowed_model_config_gets_its_window_counts_from_the_packed_lengths():
    """``thdpack stats`` / the build's summary of a sliding-window model: the window counts come from the samples'
    lengths (issue 36), so the report has factors, not an error; a dense model's figures are unchanged by it."""
    import numpy as np

    from thdpack.flops import model_flops
    from thdpack.offline.commands.model_record import model_flops_summary
    from thdpack.offline.commands.pack_stats import summarize

    windowed = dict(model_type="mistral", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=100, intermediate_size=128, sliding_window=16)
    s, off = np.array([10, 40, 30, 5]), np.array([0, 2, 4])
    got = summarize(s, off, 64, 1, model_config=windowed)["model_flops"]
    assert "error" not in got and got["vision_included"] is False
    assert got["real_flops"] == int(model_flops(windowed, int(s.sum()), int((s ** 2).sum()), seq_lens=s))
    assert "error" in model_flops_summary(windowed, 2, 64, int(s.sum()), int((s ** 2).sum()), 4)  # without lengths
    dense = {k: v for k, v in windowed.items() if k != "sliding_window"}
    assert summarize(s, off, 64, 1, model_config=dense)["model_flops"] == model_flops_summary(
        dense, 2, 64, int(s.sum()), int((s ** 2).sum()), 4)
