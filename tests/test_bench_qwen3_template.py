"""``benchmarks/templates/qwen3_training.jinja``: the Qwen3 training template that
``benchmarks/build.py --chat-template`` gives both thdpack and TRL.

It must render every conversation exactly as the real Qwen3 template does (multi-turn,
reasoning in ``<think>`` or ``reasoning_content``, tool calls and a ``tools`` list),
its ``{% generation %}`` spans (what TRL's ``assistant_only_loss`` trains on) must be
each assistant turn's body through ``<|im_end|>``, and a thdpack build with it must be
byte-identical to one on the real template, whose turns thdpack finds without markers.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

from real_tokenizers import real_tokenizer  # noqa: E402

from thdpack.demo import generate_rows  # noqa: E402
from thdpack.offline.commands.build_packs import build_packed  # noqa: E402
from thdpack.offline.config import BuildConfig  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = ROOT / "benchmarks" / "templates" / "qwen3_training.jinja"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
TOOL_CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
             {"role": "assistant", "content": "", "reasoning_content": "I need the tool.",
              "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
             {"role": "tool", "content": "sunny, 21C"},
             {"role": "assistant", "content": "<think>\nRead it.\n</think>\n\nSunny, 21C."},
             {"role": "user", "content": "Thanks!"},
             {"role": "assistant", "content": "", "reasoning_content": "Polite reply.",
              "tool_calls": [{"function": {"name": "get_weather", "arguments": "{\"city\": \"Lyon\"}"}}]},
             {"role": "tool", "content": "rain"}, {"role": "assistant", "content": "Lyon: rain."}]


def _bench():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import build as bench
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return bench


@pytest.fixture(scope="module")
def qwen3():
    path = real_tokenizer("qwen3")
    return path, transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)


@pytest.fixture(scope="module")
def conversations():
    """Benchmark chat rows (multi-turn, half the answers with reasoning) and a tool-call chat."""
    rows = _bench().add_reasoning(generate_rows(150, seed=5, kind="chat"), 0.5, 5)
    assert sum(any("<think>" in m["content"] for m in r["messages"]) for r in rows) > 50
    return [r["messages"] for r in rows] + [TOOL_CHAT]


def test_renders_like_the_real_qwen3_template(qwen3, conversations):
    _, tok = qwen3
    mine = TEMPLATE.read_text(encoding="utf-8")
    assert "{% generation %}" in mine.replace("{%- generation %}", "{% generation %}")
    for k, messages in enumerate(conversations):
        for tools in (None, TOOLS):
            real = tok.apply_chat_template(messages, tools=tools, tokenize=False)
            ours = tok.apply_chat_template(messages, tools=tools, tokenize=False, chat_template=mine)
            assert ours == real, f"conversation {k} (tools={tools is not None}) renders differently"


def test_generation_spans_are_turn_bodies_through_im_end(qwen3):
    """TRL's assistant masks on the template: each run is one assistant turn's rendered body
    (after ``<|im_start|>assistant\\n``) through ``<|im_end|>``; reasoning before the last user
    message is dropped, as Qwen3 renders it."""
    _, tok = qwen3
    enc = tok.apply_chat_template(TOOL_CHAT, tools=TOOLS, tokenize=True, return_dict=True,
                                  return_assistant_tokens_mask=True, chat_template=TEMPLATE.read_text())
    ids, mask = enc["input_ids"], enc["assistant_masks"]
    runs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    assert not cur
    assert runs == [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
        "Sunny, 21C.<|im_end|>",
        '<think>\nPolite reply.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}'
        "\n</tool_call><|im_end|>",
        "<think>\n\n</think>\n\nLyon: rain.<|im_end|>",
    ]


def test_thdpack_build_equals_the_real_template_build(qwen3, conversations, tmp_path):
    """The markers give thdpack the same targets as its turn spans on the real template."""
    path, _ = qwen3
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations))
    shards = []
    for name, template in (("real", None), ("marked", str(TEMPLATE))):
        cfg = BuildConfig(input=str(data), tokenizer=str(path), pack_size=8192, overflow="truncate",
                          save_tokenizer=False, chat_template=template)
        res = build_packed(cfg, tmp_path / name, progress=False)
        assert res.timings  # the build ran
        shards.append({p.name: p.read_bytes() for p in sorted((tmp_path / name).iterdir())
                       if p.name != "metadata.json"})
    assert shards[0] and shards[0] == shards[1]


def test_benchmark_help_prints():
    """``benchmarks/build.py --help`` (its help names ``{% generation %}``, which argparse
    must not read as a % format)."""
    import subprocess

    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "build.py"), "--help"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--chat-template FILE" in out.stdout and "{% generation %}" in out.stdout
