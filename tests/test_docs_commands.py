"""Every ``thdpack`` command in README.md and docs/*.md runs as written on the bundled data.

A command is a ``bash`` code block (shell syntax, loops, ``&``, ``&&`` and pipes included) or an
inline code span that calls ``thdpack <sub-command>`` with arguments (``thdpack stats PATH``, a
syntax summary with placeholders, is not run). Each document runs in a fresh working
directory laid out like the repository (``configs/``, ``scripts/``, ``examples/``, the demo
tokenizer), whose ``configs/demo.yaml`` is the bundled one with fewer conversations so that the
test stays fast: the commands, flags and paths are exactly the documented ones.

bash runs each block with ``thdpack`` and ``python`` defined as shell functions that record
their arguments after bash expanded them (variables, loops, ``&``/``wait``); the recorded
commands then run in this process, in order (``thdpack`` through :func:`thdpack.cli.main`,
``python SCRIPT`` through runpy), and each must exit 0. Nothing is skipped silently: what
cannot run here is listed below with the reason, and every entry must still match the docs.
"""

from __future__ import annotations

import re
import runpy
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("datasets")
pytest.importorskip("transformers")

from thdpack.cli import main  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SUBCOMMANDS = ("build", "stats", "inspect", "merge", "check")  # check: on configs/models/tiny-qwen3 (no weights)
DEMO_ROWS = 300  # instead of the bundled config's 4000 conversations (configs/demo.yaml)

# Blocks / spans that need what a test machine does not have; a block or span containing the key is
# not run. Every key must occur in the docs (test_external_list_is_current).
NEEDS_EXTERNAL = {
    "#SBATCH": "a Slurm batch script (sbatch on a cluster)",
    "sbatch --": "submits jobs to Slurm",
    "torchrun --": "a multi-node torchrun launch over a shared file system",
    "ray start": "starts Ray on the nodes of a cluster",
    "--ray-address auto": "joins a running Ray cluster",
}
# Inline spans that name a flag or a sub-command rather than give a command to run.
FRAGMENTS = {
    "thdpack stats --verify": "names the --verify flag of stats",
    "python -m thdpack ...": "says that python -m thdpack is the same command",
}
# Recorded commands that are not run here, with the reason (the thdpack commands around them are).
NOT_RUN = {
    "examples/train_from_packed.py": "trains a model for a few steps (15 s here); tests/test_no_targets.py runs it",
}
# Set-up steps of the README's first two commands: the test runs inside that environment already.
SETUP = re.compile(r"^\s*(python3 -m venv \S+|\. \S+/activate|pip install .*)\s*$")
# A placeholder in a syntax summary: PATH, N, OUT, SHARD..., I/N, i/N, ...
PLACEHOLDER = re.compile(r"^(?:[A-Za-z]/)?[A-Z][A-Z_]*(?:\.\.\.)?$|^\.\.\.$")
COMMAND = re.compile(r"\b(?:python -m )?thdpack (?:" + "|".join(SUBCOMMANDS) + r")(?=\s|$)")


def _is_syntax(span: str) -> bool:
    """``thdpack build`` (a name) or ``thdpack stats PATH`` (a summary with placeholders)."""
    words = shlex.split(span)
    args = words[words.index("thdpack") + 1:] if "thdpack" in words else words
    return len(args) <= 1 or any(PLACEHOLDER.match(w) for w in args[1:])


def _external(text: str) -> str | None:
    return next((why for key, why in NEEDS_EXTERNAL.items() if key in text), None)


def runnable(doc: Path) -> list[tuple[str, str]]:
    """``[(kind, text)]`` in document order: ``("block", shell text)`` or ``("span", command)``."""
    pieces = re.split(r"^```(\w*)\n(.*?)^```[ \t]*$", doc.read_text(encoding="utf-8"), flags=re.S | re.M)
    found = []
    for k in range(0, len(pieces), 3):  # prose, then a fenced block's language and body
        for span in re.findall(r"`([^`]+)`", pieces[k]):
            span = " ".join(span.split())
            if not (COMMAND.search(span) or span.startswith("python -m thdpack")):
                continue
            if span in FRAGMENTS or _external(span) or _is_syntax(span):
                continue
            found.append(("span", span))
        if k + 2 < len(pieces) and pieces[k + 1] in ("bash", "sh"):
            block = pieces[k + 2]
            if COMMAND.search(block) and not _external(block):
                found.append(("block", block))
    return found


def _shell_commands(block: str, record: Path) -> list[list[str]]:
    """The commands ``block`` runs, as bash expands them (set-up steps left out)."""
    lines = []
    for line in block.splitlines():
        parts = [p for p in line.split("&&") if not SETUP.match(p)]
        lines.append("&&".join(parts))
    script = (
        f'rec() {{ printf "%s\\0" "$@" "END" >> {shlex.quote(str(record))}; }}\n'
        "thdpack() { rec thdpack \"$@\"; }\npython() { rec python \"$@\"; }\n" + "\n".join(lines) + "\nwait\n"
    )
    record.write_bytes(b"")
    subprocess.run(["bash", "-euc", script], check=True, timeout=60)
    words = record.read_bytes().decode().split("\0")[:-1]
    out, cmd = [], []
    for w in words:
        if w == "END":
            out.append(cmd)
            cmd = []
        else:
            cmd.append(w)
    return out


def _run(argv: list[str]) -> None:
    """Run one recorded command here; it must succeed."""
    if argv[0] == "python" and argv[1:3] == ["-m", "thdpack"]:
        argv = ["thdpack", *argv[3:]]
    if argv[0] == "thdpack":
        assert main(argv[1:]) == 0, argv
        return
    assert argv[0] == "python" and argv[1].endswith(".py"), f"not a command this test knows how to run: {argv}"
    if argv[1] in NOT_RUN:
        return
    old = sys.argv
    sys.argv = argv[1:]
    try:
        runpy.run_path(argv[1], run_name="__main__")
    except SystemExit as stop:
        assert stop.code in (0, None), argv
    finally:
        sys.argv = old


def _sandbox(path: Path) -> None:
    """A working directory laid out like the repository, with a smaller demo config."""
    (path / "configs").mkdir()
    for name in ("thdpack", "scripts", "examples"):
        (path / name).symlink_to(ROOT / name)
    (path / "configs" / "models").symlink_to(ROOT / "configs" / "models")
    for other in sorted((ROOT / "configs").glob("*.yaml")):  # the other bundled configs as they are
        if other.name != "demo.yaml":
            (path / "configs" / other.name).symlink_to(other)
    demo = (ROOT / "configs" / "demo.yaml").read_text(encoding="utf-8")
    small = demo.replace("num_samples: 4000", f"num_samples: {DEMO_ROWS}")
    assert small != demo, "configs/demo.yaml no longer says num_samples: 4000; update this test"
    (path / "configs" / "demo.yaml").write_text(small, encoding="utf-8")


@pytest.mark.parametrize("doc", [d for d in DOCS if runnable(d)], ids=lambda d: d.name)
def test_documented_commands_run(doc, tmp_path, monkeypatch, capsys):
    work = tmp_path / "work"
    work.mkdir()
    _sandbox(work)
    monkeypatch.chdir(work)
    ran = []
    for _, text in runnable(doc):
        for argv in _shell_commands(text, tmp_path / "record"):
            _run(argv)
            ran.append(argv)
    capsys.readouterr()
    assert ran, f"{doc.name}: no command ran"


def test_the_readme_main_command_is_found():
    """The extraction itself: the README's main job and its sharded build are among the commands."""
    texts = [t for _, t in runnable(ROOT / "README.md")]
    assert any("thdpack build --config configs/demo.yaml --output out/demo --overwrite" in t for t in texts)
    assert any("thdpack merge" in t for t in texts)
    assert "thdpack stats out/demo" in texts


def test_external_list_is_current():
    """Every exception above still names something in the docs (no stale skips)."""
    text = "\n".join(d.read_text(encoding="utf-8") for d in DOCS)
    prose = " ".join(text.split())
    for key in [*NEEDS_EXTERNAL, *FRAGMENTS, *NOT_RUN]:
        assert key in text or key in prose, key
