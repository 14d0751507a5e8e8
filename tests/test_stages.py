"""The build configuration is resolved once into per-stage options (thdpack/offline/stages.py).

- a whole build asks each question of the config once: the chat template is read once, and the config is
  validated once (``BuildConfig.validate``, by :meth:`BuildStages.from_config`);
- every stage's options object (and the whole :class:`BuildStages`) pickles and unpickles equal;
- no module under thdpack/offline but config.py, stages.py (and the package's ``__init__``, which re-exports
  it) names ``BuildConfig`` or takes / reads a ``cfg``; in commands/build_packs.py only the entry points that
  take a config and resolve it (:data:`ENTRY_POINTS`) do, so the metadata too is written from the stages.
"""

from __future__ import annotations

import ast
import dataclasses
import pickle
from pathlib import Path

import pytest

pytest.importorskip("datasets")
pytest.importorskip("transformers")

from thdpack.demo import TOKENIZER_DIR, generate_rows, write_jsonl  # noqa: E402
from thdpack.offline import BuildConfig, build_packed  # noqa: E402
from thdpack.offline import stages as stages_module  # noqa: E402
from thdpack.offline.stages import BuildStages  # noqa: E402

OFFLINE = Path(stages_module.__file__).parent
TEMPLATE = Path(__file__).parent / "data" / "qwen2_5_chat_template.jinja"
ALLOWED = {"config.py", "stages.py", "__init__.py"}  # __init__.py: the public re-export
BUILD = OFFLINE / "commands" / "build_packs.py"
ENTRY_POINTS = {"prepare", "build_packed", "_build", "analyze"}  # of BUILD: they take a BuildConfig


def _config(tmp_path: Path) -> BuildConfig:
    rows = [dict(r, reward=float(i)) for i, r in enumerate(generate_rows(40, seed=2, kind="chat"))]
    return BuildConfig(input=str(write_jsonl(rows, tmp_path / "chat.jsonl")), tokenizer=str(TOKENIZER_DIR),
                       chat_template=str(TEMPLATE), sample_values=["reward"], pack_size=2048,
                       overflow="truncate", save_tokenizer=False)


def _counting(monkeypatch, owner, name: str) -> list:
    """Replace ``owner.name`` by a wrapper that records each call; the list of calls."""
    calls = []
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        calls.append(args)
        return inner(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapper)
    return calls


def test_a_build_resolves_each_option_once(tmp_path, monkeypatch):
    cfg = _config(tmp_path)
    templates = _counting(monkeypatch, stages_module, "read_chat_template")
    checks = _counting(monkeypatch, BuildConfig, "validate")
    stages = BuildStages.from_config(cfg)
    assert len(checks) == 1
    assert len(templates) == 1 and stages.tokenize.chat_template_text == TEMPLATE.read_text(encoding="utf-8")
    assert stages.tokenize.value_columns == ("reward",)
    templates.clear()
    checks.clear()
    res = build_packed(cfg, tmp_path / "out", progress=False)
    assert res.metadata["sample_values"] == {"reward": "float64"}
    assert len(templates) == 1, "the chat template is read once per build"
    assert len(checks) == 1, "the config is validated once per build, by BuildStages.from_config"


def test_stage_options_pickle_and_unpickle_equal(tmp_path):
    model = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 128}
    stages = BuildStages.from_config(_config(tmp_path).override(model_config=model))
    for f in dataclasses.fields(stages):
        opts = getattr(stages, f.name)
        assert not isinstance(opts, BuildConfig)
        assert pickle.loads(pickle.dumps(opts)) == opts, f.name
    assert pickle.loads(pickle.dumps(stages)) == stages


def _config_uses(path: Path, skip: set[str] = frozenset()) -> list[str]:
    """``file:line what`` of each use of the build config in ``path`` outside the module-level functions named
    in ``skip`` (and the imports they need): the name ``BuildConfig`` (a name, an attribute, an import) or a
    ``cfg`` parameter or variable."""
    out = []
    tree = ast.parse(path.read_text(encoding="utf-8"))
    tree.body = [n for n in tree.body if not (isinstance(n, ast.FunctionDef) and n.name in skip
                                                or skip and isinstance(n, ast.ImportFrom))]
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in ("BuildConfig", "cfg"):
            out.append((node.lineno, node.id))
        elif isinstance(node, ast.Attribute) and node.attr == "BuildConfig":
            out.append((node.lineno, "BuildConfig"))
        elif isinstance(node, ast.alias) and node.name.split(".")[-1] == "BuildConfig":
            out.append((node.lineno, "import BuildConfig"))
        elif isinstance(node, ast.arg) and node.arg == "cfg":
            out.append((node.lineno, "cfg parameter"))
    return [f"{path.relative_to(OFFLINE.parent.parent)}:{line} {what}" for line, what in sorted(out)]


def test_no_stage_reads_the_build_config():
    uses = [u for p in sorted(OFFLINE.rglob("*.py")) if not (p.parent == OFFLINE and p.name in ALLOWED)
            for u in _config_uses(p, ENTRY_POINTS if p == BUILD else set())]
    assert not uses, "these read the whole BuildConfig; hand them their stage's options instead:\n" + "\n".join(uses)
