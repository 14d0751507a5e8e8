"""Seeded synthetic chat and text rows with a long-tailed length distribution.

The vocabulary is invented: words are random syllable strings drawn with Zipf
frequencies, so the text looks like prose to a tokenizer (frequent short words,
rare long ones, punctuation, numbers, paragraphs and lists) without being any
real language or copied from anywhere.

Lengths follow what SFT mixes look like: most conversations are a few hundred
tokens, a minority carry a long document or a long answer, and a few run past a
4k-token pack (so truncation/splitting shows up in the stats).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import numpy as np

from thdpack.common.align import check_int

_ONSETS = ["", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z",
           "br", "cl", "dr", "st", "tr", "sh", "ch", "th", "pl", "gr", "qu", "sk"]
_NUCLEI = ["a", "e", "i", "o", "u", "ai", "ea", "ou", "io", "y"]
_CODAS = ["", "", "", "n", "r", "s", "l", "m", "t", "nd", "st", "ck", "x"]

LEXICON_SIZE = 6000


class _Writer:
    """Draws words, sentences and paragraphs from one seeded generator."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.words = self._lexicon()
        weights = 1.0 / (np.arange(1, len(self.words) + 1) + 2.7) ** 1.07  # Zipf-Mandelbrot
        self.cdf = np.cumsum(weights / weights.sum())

    def _lexicon(self) -> list[str]:
        rng = np.random.default_rng(12345)  # the vocabulary is fixed, whatever the row seed
        words, seen = [], set()
        while len(words) < LEXICON_SIZE:
            n_syl = int(rng.choice([1, 2, 3, 4], p=[0.35, 0.4, 0.19, 0.06]))
            word = "".join(
                _ONSETS[rng.integers(len(_ONSETS))] + _NUCLEI[rng.integers(len(_NUCLEI))] + _CODAS[rng.integers(len(_CODAS))]
                for _ in range(n_syl)
            )
            if len(word) >= 2 and word not in seen:
                seen.add(word)
                words.append(word)
        # frequent words tend to be short, as in real languages (noisy, not strict)
        keys = np.array([len(w) for w in words]) + rng.normal(0, 1.5, len(words))
        return [words[i] for i in np.argsort(keys, kind="stable")]

    def prose(self, n_words: int, *, lists: bool = False) -> str:
        """About ``n_words`` words in sentences and paragraphs (optionally numbered lists)."""
        rng = self.rng
        n = max(3, int(n_words))
        idx = np.minimum(np.searchsorted(self.cdf, rng.random(n)), len(self.words) - 1)
        words = [self.words[i] for i in idx]
        for j in np.flatnonzero(rng.random(n) < 0.02):
            words[j] = str(int(rng.integers(0, 10_000)))
        for j in np.flatnonzero(rng.random(n) < 0.06):
            words[j] += ","
        cuts = np.cumsum(rng.integers(4, 22, size=n // 4 + 1))
        cuts = cuts[cuts < n].tolist() + [n]
        ends = rng.choice([".", "?", "!", ":"], p=[0.82, 0.1, 0.05, 0.03], size=len(cuts)).tolist()
        per_par = rng.integers(1, 6, size=len(cuts)).tolist()
        as_list = (rng.random(len(cuts)) < (0.3 if lists else 0.0)).tolist()
        sentences, a = [], 0
        for b, end in zip(cuts, ends):
            sw = words[a:b]
            sentences.append(sw[0].rstrip(",").capitalize() + (" " + " ".join(sw[1:]) if len(sw) > 1 else "").rstrip(",") + end)
            a = b
        paragraphs, k, p = [], 0, 0
        while k < len(sentences):
            group = sentences[k : k + per_par[p]]
            if as_list[p]:
                paragraphs.append("\n".join(f"{i + 1}. {s}" for i, s in enumerate(group)))
            else:
                paragraphs.append(" ".join(group))
            k += per_par[p]
            p += 1
        return "\n\n".join(paragraphs)

    def lognormal_words(self, median: float, sigma: float, cap: int) -> int:
        return int(min(cap, max(3, self.rng.lognormal(np.log(median), sigma))))


def generate_rows(num_samples: int = 4000, seed: int = 0, kind: str = "chat") -> list[dict]:
    """``num_samples`` seeded rows.

    Args:
        kind: ``"chat"`` gives ``{"messages": [{"role", "content"}, ...]}`` rows
            (optional system turn, 1-6 user/assistant exchanges, ~12% with a long
            document in the first user turn); ``"text"`` gives ``{"text": str}``
            rows (lognormal lengths, median ~250 words); ``"pairs"`` gives preference rows
            ``{"prompt": [user turn], "chosen": [assistant turn], "rejected": [assistant turn]}``
            (TRL's conversational DPO rows; the rejected answer shorter on average).

    The same ``(num_samples, seed, kind)`` always gives the same rows.
    """
    if kind not in ("chat", "text", "pairs"):
        raise ValueError(f"kind must be 'chat', 'text' or 'pairs', got {kind!r}")
    check_int(num_samples, "num_samples", 1)
    w = _Writer(seed)
    rows = []
    for _ in range(num_samples):
        if kind == "text":
            rows.append({"text": w.prose(w.lognormal_words(250, 1.0, 12_000), lists=True)})
            continue
        if kind == "pairs":
            rows.append({"prompt": [{"role": "user", "content": w.prose(w.lognormal_words(25, 0.9, 400))}],
                         "chosen": [{"role": "assistant", "content": w.prose(w.lognormal_words(90, 0.8, 1500))}],
                         "rejected": [{"role": "assistant", "content": w.prose(w.lognormal_words(60, 0.8, 1500))}]})
            continue
        messages = []
        if w.rng.random() < 0.4:
            messages.append({"role": "system", "content": w.prose(w.lognormal_words(18, 0.5, 80))})
        turns = min(6, 1 + int(w.rng.geometric(0.55)) - 1)
        for t in range(turns):
            question = w.prose(w.lognormal_words(25, 0.9, 400))
            if t == 0 and w.rng.random() < 0.12:  # a document to work on: the long tail
                question = w.prose(w.lognormal_words(700, 0.8, 6000)) + "\n\n" + question
            messages.append({"role": "user", "content": question})
            answer = w.prose(w.lognormal_words(110 if turns == 1 else 70, 0.9, 3000), lists=True)
            messages.append({"role": "assistant", "content": answer})
        rows.append({"messages": messages})
    return rows


def iter_texts(rows: list[dict]) -> Iterator[str]:
    """Every string in ``rows`` (tokenizer training input)."""
    for row in rows:
        if "text" in row:
            yield row["text"]
        for m in row.get("messages", ()):
            yield m["content"]


def write_jsonl(rows: list[dict], path: str | Path) -> Path:
    """Write ``rows`` as JSON Lines (UTF-8, one row per line)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path
