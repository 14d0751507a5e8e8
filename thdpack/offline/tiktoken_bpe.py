"""Byte-level BPE through ``tiktoken``: the ids of a Hugging Face tokenizer, several times faster.

Most LLM tokenizers (Qwen, Llama 3, GPT-2 style) are byte-level BPE: a regex splits
the text into pieces, each piece's UTF-8 bytes are merged pair by pair in the order
of the merge list. ``tiktoken`` runs the same algorithm in Rust without building an
``Encoding`` object (ids, token strings, offsets, masks) per token, which is where
``tokenizers`` spends most of its time (``benchmarks/build.py --tokenizer-backend hf``
measures a build without this module).

:meth:`TiktokenBPE.from_tokenizer` converts a ``tokenizers`` BPE model when its
algorithm is provably the one tiktoken runs, and says why not otherwise:

- the regex is the tokenizer's own (a ``Split`` regex, or ByteLevel's GPT-2 pattern);
  no normalizer but NFC (rows that are not NFC-normalized go through ``tokenizers``);
- every non-added token is one of the 256 bytes or the result of exactly one merge,
  and a token's rank is its merge's position, so "merge the adjacent pair whose
  result ranks lowest" is "apply the lowest-ranked listed merge";
- without ``ignore_merges`` every token is reachable: BPE on the token's own bytes
  gives the token (tiktoken takes a piece that is a whole token as is);
- added tokens strip nothing, match whole words anywhere, and none is a prefix of
  another (tiktoken's special-token split is leftmost-first, HF's leftmost-longest);
- what the post-processor adds around a row (BOS/EOS) is a fixed prefix and suffix.

Then the two can still differ only where a pair that is not a listed merge spells a
token (a merge list not produced by BPE training). So every encoding is also
checked: the first :data:`HEAD_ROWS` rows of a process and one row in
:data:`CHECK_EVERY` after them are encoded by ``tokenizers`` too, and any difference
raises :class:`FastTokenizerMismatch`; ``thdpack build`` then tokenizes everything
again with ``tokenizers`` (no partial result is kept).
"""

from __future__ import annotations

import itertools
import json
import unicodedata

import numpy as np

HEAD_ROWS = 64
CHECK_EVERY = 128

# GPT-2's pattern, what ByteLevel(use_regex=True) splits with
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


class FastTokenizerMismatch(RuntimeError):
    """tiktoken gave other ids than the Hugging Face tokenizer for a row."""


def byte_level_alphabet() -> list[str]:
    """The 256 characters byte-level BPE writes bytes 0..255 as (GPT-2's ``bytes_to_unicode``)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    order = sorted(range(256), key=lambda k: bs[k])
    return [chr(cs[k]) for k in order]


class TiktokenBPE:
    """A ``tokenizers`` byte-level BPE model as a tiktoken ``Encoding``.

    ``encode(texts, add_special_tokens)`` -> one int32 array of ids per text, equal to
    ``backend.encode_batch_fast(texts, add_special_tokens=...)[i].ids``.
    """

    def __init__(self, backend, pattern: str, ranks: dict, specials: dict, rank_to_id: np.ndarray,
                 prefix: list[int], suffix: list[int], nfc: bool):
        self.backend = backend  # tokenizers.Tokenizer: the reference, and rows tiktoken cannot take
        self.pattern = pattern
        self.ranks = ranks  # bytes -> rank
        self.specials = specials  # added token text -> rank
        self.rank_to_id = rank_to_id  # int32 [ranks + specials]
        self.prefix = np.asarray(prefix, dtype=np.int32)
        self.suffix = np.asarray(suffix, dtype=np.int32)
        self.nfc = nfc
        self._rows_seen = 0
        self._build()

    def _build(self) -> None:
        import tiktoken

        self._enc = tiktoken.Encoding("thdpack-bpe", pat_str=self.pattern, mergeable_ranks=self.ranks,
                                      special_tokens=self.specials)
        self._special_set = set(self.specials)
        core = getattr(self._enc, "_core_bpe", None)
        if core is not None and hasattr(core, "encode"):
            # the Rust call itself: no thread pool per batch, and a text that is not valid UTF-8 (a lone
            # surrogate) raises as it does in tokenizers instead of being replaced
            self._encode_one = core.encode
        else:
            self._encode_one = lambda text, special: self._enc.encode(text, allowed_special=special,
                                                                       disallowed_special=())

    def __getstate__(self):
        state = dict(self.__dict__)
        state.pop("_enc", None)
        state.pop("_special_set", None)
        state.pop("_encode_one", None)
        state["_rows_seen"] = 0  # a new process checks its own first rows
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._build()

    # ------------------------------------------------------------------ encoding
    def encode(self, texts: list[str], add_special_tokens: bool) -> list[np.ndarray]:
        """int32 ids of every text; checked against ``tokenizers`` on a sample (module doc)."""
        out: list = [None] * len(texts)
        slow = []
        fast_texts, fast_rows = [], []
        for i, text in enumerate(texts):
            if self.nfc and not text.isascii() and not unicodedata.is_normalized("NFC", text):
                slow.append(i)
            else:
                fast_rows.append(i)
                fast_texts.append(text)
        if fast_texts:
            encode, special = self._encode_one, self._special_set
            ranks = [encode(text, special) for text in fast_texts]
            lengths = np.fromiter(map(len, ranks), dtype=np.int64, count=len(ranks))
            flat = np.fromiter(itertools.chain.from_iterable(ranks), dtype=np.int64, count=int(lengths.sum()))
            ids = self.rank_to_id[flat]
            for i, part in zip(fast_rows, np.split(ids, np.cumsum(lengths)[:-1])):
                out[i] = self._wrap(part) if add_special_tokens else part
        if slow:
            for i, enc in zip(slow, self.backend.encode_batch_fast([texts[i] for i in slow],
                                                                   add_special_tokens=add_special_tokens)):
                out[i] = np.asarray(enc.ids, dtype=np.int32)
        self._check(texts, fast_rows, out, add_special_tokens)
        return out

    def _wrap(self, ids: np.ndarray) -> np.ndarray:
        if not self.prefix.size and not self.suffix.size:
            return ids
        return np.concatenate([self.prefix, ids, self.suffix])

    def _check(self, texts, fast_rows, out, add_special_tokens) -> None:
        start = self._rows_seen
        self._rows_seen += len(texts)
        picks = [i for i in fast_rows if start + i < HEAD_ROWS or (start + i) % CHECK_EVERY == 0]
        if not picks:
            return
        ref = self.backend.encode_batch_fast([texts[i] for i in picks], add_special_tokens=add_special_tokens)
        for i, enc in zip(picks, ref):
            if not np.array_equal(out[i], np.asarray(enc.ids, dtype=np.int32)):
                raise FastTokenizerMismatch(
                    f"tiktoken and the tokenizer disagree on {texts[i][:60]!r}...: the tokenizer's merges "
                    "are not equivalent to tiktoken's rank order"
                )

    # ------------------------------------------------------------------ conversion
    @classmethod
    def from_tokenizer(cls, tok) -> tuple[TiktokenBPE | None, str]:
        """(converted, "") or (None, why not) for a ``transformers`` fast tokenizer."""
        try:
            import tiktoken  # noqa: F401
        except ImportError:
            return None, "tiktoken is not installed (pip install tiktoken)"
        backend = getattr(tok, "backend_tokenizer", None)
        if backend is None or not getattr(tok, "is_fast", False):
            return None, "not a fast (Rust) tokenizer"
        if getattr(tok, "split_special_tokens", False):
            return None, "split_special_tokens is set"
        spec = json.loads(backend.to_str())
        why = _unsupported(spec)
        if why:
            return None, why
        model = spec["model"]
        alphabet = byte_level_alphabet()
        byte_of = {c: b for b, c in enumerate(alphabet)}
        added = {a["id"]: a for a in spec.get("added_tokens", [])}
        vocab = {t: i for t, i in model["vocab"].items() if i not in added}

        def to_bytes(token: str) -> bytes | None:
            try:
                return bytes(byte_of[c] for c in token)
            except KeyError:
                return None

        ranks: dict[bytes, int] = {}
        rank_to_id: list[int] = []
        for b, c in enumerate(alphabet):
            if c not in vocab:
                return None, f"byte {b} has no token"
            ranks[bytes([b])] = b
            rank_to_id.append(vocab[c])
        targets = []
        for merge in model["merges"]:
            a, b = merge.split(" ", 1) if isinstance(merge, str) else merge
            token = a + b
            raw = to_bytes(token)
            if raw is None or token not in vocab:
                return None, f"merge {a!r} + {b!r} gives a token outside the byte-level vocabulary"
            if raw in ranks:
                return None, f"two merges give {token!r}"
            ranks[raw] = len(rank_to_id)
            rank_to_id.append(vocab[token])
            targets.append(token)
        if len(ranks) != len(vocab):
            if model.get("ignore_merges"):
                return None, "the vocabulary has tokens no merge gives (kept whole under ignore_merges)"
            # without ignore_merges tokenizers never outputs them; tiktoken will not know them
        if not model.get("ignore_merges"):
            bpe = backend.model
            for token in targets:
                got = bpe.tokenize(token)
                if len(got) != 1:
                    return None, f"token {token!r} is not what BPE gives for its own bytes"
        specials = {}
        contents = [a["content"] for a in added.values()]
        for a in added.values():
            if a.get("lstrip") or a.get("rstrip") or a.get("single_word"):
                return None, f"added token {a['content']!r} strips spaces or matches single words"
            if any(o != a["content"] and o.startswith(a["content"]) for o in contents):
                return None, f"added token {a['content']!r} is a prefix of another"
            if spec.get("normalizer") and a.get("normalized") and not unicodedata.is_normalized("NFC", a["content"]):
                return None, f"added token {a['content']!r} changes under NFC"
            specials[a["content"]] = len(rank_to_id)
            rank_to_id.append(a["id"])
        affix = _post_processor_affix(backend)
        if affix is None:
            return None, "the post-processor adds more than a fixed prefix and suffix"
        try:
            return cls(backend, _pattern(spec), ranks, specials, np.asarray(rank_to_id, dtype=np.int32), *affix,
                       nfc=spec.get("normalizer") is not None), ""
        except Exception as exc:  # noqa: BLE001 - e.g. a split regex tiktoken's engine does not compile
            return None, f"tiktoken cannot take it ({type(exc).__name__}: {str(exc)[:200]})"


def _steps(node: dict | None, kind: str) -> list[dict]:
    if not node:
        return []
    return list(node.get(kind, [])) if node.get("type") == "Sequence" else [node]


def _unsupported(spec: dict) -> str:
    model = spec.get("model", {})
    if model.get("type") != "BPE":
        return f"model type {model.get('type')!r} is not BPE"
    for key in ("dropout", "continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(key):
            return f"BPE option {key}={model[key]!r}"
    if model.get("byte_fallback"):
        return "byte_fallback BPE (SentencePiece style) is not byte-level"
    norms = _steps(spec.get("normalizer"), "normalizers")
    if norms and [n.get("type") for n in norms] != ["NFC"]:
        return f"normalizer {[n.get('type') for n in norms]} (only NFC or none)"
    if _pattern(spec) is None:
        return "pre-tokenizer is not a regex split + byte-level (or ByteLevel's own regex)"
    return ""


def _pattern(spec: dict) -> str | None:
    """The split regex when the pre-tokenizer is ByteLevel(regex) or Split(regex, isolated) + ByteLevel."""
    steps = _steps(spec.get("pre_tokenizer"), "pretokenizers")
    if len(steps) == 1 and steps[0].get("type") == "ByteLevel":
        s = steps[0]
        return GPT2_PATTERN if s.get("use_regex", True) and not s.get("add_prefix_space") else None
    if len(steps) == 2 and [s.get("type") for s in steps] == ["Split", "ByteLevel"]:
        split, level = steps
        regex = (split.get("pattern") or {}).get("Regex")
        if regex and split.get("behavior") == "Isolated" and not split.get("invert") and level.get(
                "use_regex", True) is False and not level.get("add_prefix_space"):
            return regex
    return None


def _post_processor_affix(backend) -> tuple[list[int], list[int]] | None:
    """(prefix, suffix) ids ``add_special_tokens=True`` puts around one text, or None when that is
    not the same for every text."""
    probes = ["a", "hello world", "x y z 1"]
    affixes = set()
    for probe in probes:
        plain = backend.encode(probe, add_special_tokens=False).ids
        full = backend.encode(probe, add_special_tokens=True).ids
        n = len(plain)
        found = None
        for k in range(len(full) - n + 1):
            if full[k : k + n] == plain:
                found = (tuple(full[:k]), tuple(full[k + n :]))
                break
        if found is None:
            return None
        affixes.add(found)
    if len(affixes) != 1:
        return None
    prefix, suffix = affixes.pop()
    return list(prefix), list(suffix)
