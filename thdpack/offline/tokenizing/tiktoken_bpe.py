r"""Byte-level BPE through ``tiktoken``: the ids of a Hugging Face tokenizer, several times faster.

Most LLM tokenizers (Qwen, Llama 3, GPT-2 style) are byte-level BPE: a regex splits
the text into pieces, each piece's UTF-8 bytes are merged pair by pair in the order
of the merge list. ``tiktoken`` runs the same algorithm in Rust without building an
``Encoding`` object (ids, token strings, offsets, masks) per token, which is where
``tokenizers`` spends most of its time (``benchmarks/build.py --tokenizer-backend hf``
measures a build without this module).

:meth:`TiktokenBPE.from_tokenizer` converts a ``tokenizers`` BPE model when its
algorithm is provably the one tiktoken runs, and says why not otherwise:

- the regex is the tokenizer's own (``Split`` regexes, or ByteLevel's GPT-2 pattern;
  see "Several splits"), and text no match covers is kept as a piece, as ``Split``
  keeps it (tiktoken alone drops it); no normalizer but NFC (rows that are not
  NFC-normalized go through ``tokenizers``);
- every non-added token is one of the 256 bytes or a merge's result, and a token's
  rank is the position of its merges in the list: one merge per token, or several in
  one run of the list with every split listed ("Several merges");
- without ``ignore_merges`` tiktoken knows only the tokens BPE gives for their own
  bytes ("Unreachable tokens"); with it, every token is a merge's result;
- added tokens strip nothing, match whole words anywhere, and none is a prefix of
  another (tiktoken's special-token split is leftmost-first, HF's leftmost-longest);
- what the post-processor adds around a row (BOS/EOS) is a fixed prefix and suffix.

Details: docs/build.md, "Fast tokenizer (tiktoken): why its ids are the tokenizer's".
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
                 prefix: list[int], suffix: list[int], nfc: bool, pre_splits: tuple[str, ...] = ()):
        self.backend = backend  # tokenizers.Tokenizer: the reference, and rows tiktoken cannot take
        self.pattern = pattern
        self.pre_splits = pre_splits  # Split regexes run in Python before ``pattern`` (module doc, "Several splits")
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
        if self.pre_splits:
            self._encode_one = _SplitEncoder(self.pre_splits, self.specials, self._enc)
        elif core is not None and hasattr(core, "encode"):
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
        merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
        targets = _merge_targets(merges, vocab, set(alphabet))
        if isinstance(targets, str):
            return None, targets
        if model.get("ignore_merges") and len(targets) + len(alphabet) != len(vocab):
            return None, "the vocabulary has tokens no merge gives (kept whole under ignore_merges)"
        if not model.get("ignore_merges"):
            # tokenizers never outputs these, and tiktoken must not take a piece that spells one whole
            targets = _reachable(backend.model, targets)
        for token in targets:
            ranks[to_bytes(token)] = len(rank_to_id)
            rank_to_id.append(vocab[token])
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
            pre_splits, pattern = _pre_tokenizer(spec)
            return cls(backend, pattern, ranks, specials, np.asarray(rank_to_id, dtype=np.int32), *affix,
                       nfc=bool(_steps(spec.get("normalizer"), "normalizers")), pre_splits=pre_splits), ""
        except Exception as exc:  # noqa: BLE001 - e.g. a split regex tiktoken's engine does not compile
            return None, f"tiktoken cannot take it ({type(exc).__name__}: {str(exc)[:200]})"


def _merge_targets(merges: list[tuple[str, str]], vocab: dict, alphabet: set) -> list[str] | str:
    """The tokens ``merges`` give, in the order tiktoken ranks them (a token's rank is its first
    merge's group), or why tiktoken cannot run these merges exactly: one merge per token, or
    several in one run of the list with every split listed (module doc, "Several merges")."""
    targets: list[str] = []
    seen: set[str] = set()
    pairs: set[tuple[str, str]] = set()
    several = False
    for a, b in merges:
        token = a + b
        pairs.add((a, b))  # (tokenizers keeps one of a pair listed twice: the list read here has it once)
        if targets and targets[-1] == token:
            several = True
            continue
        if token not in vocab or not set(token) <= alphabet:
            return f"merge {a!r} + {b!r} gives a token outside the byte-level vocabulary"
        if token in seen:
            return f"the merges that give {token!r} are not next to each other in the merge list"
        seen.add(token)
        targets.append(token)
    if several:
        why = _missing_split(targets, pairs, seen | alphabet)
        if why:
            return why
    return targets


def _reachable(model, targets: list[str]) -> list[str]:
    """The merged tokens that BPE (``tokenizers.models.BPE`` ``model``) gives for their own bytes,
    in order; the others it never outputs, in any text (module doc, "Unreachable tokens")."""
    return [token for token in targets if len(model.tokenize(token)) == 1]


def _missing_split(targets: list[str], pairs: set, parts: set) -> str:
    """'' when every split of every merged token into two parts BPE can form (bytes, merged
    tokens) is a listed merge; else a sentence naming the first missing one."""
    for token in targets:
        for k in range(1, len(token)):
            a, b = token[:k], token[k:]
            if a in parts and b in parts and (a, b) not in pairs:
                return (f"tokens have several merges, but {a!r} + {b!r} (giving {token!r}) is not one: "
                        "tiktoken would merge that pair, tokenizers not")
    return ""


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
    if _pre_tokenizer(spec) is None:
        return "pre-tokenizer is not regex splits (isolated) + byte-level (or ByteLevel's own regex)"
    return ""


def _pre_tokenizer(spec: dict) -> tuple[tuple[str, ...], str] | None:
    """``(pre_splits, pattern)`` when the pre-tokenizer is ByteLevel(regex), or Split(regex, isolated)
    steps + ByteLevel: the last split's regex for tiktoken (with :func:`_with_gaps`), the ones before
    it for :class:`_SplitEncoder`; None for any other pre-tokenizer."""
    steps = _steps(spec.get("pre_tokenizer"), "pretokenizers")
    if len(steps) == 1 and steps[0].get("type") == "ByteLevel":
        s = steps[0]
        return ((), GPT2_PATTERN) if s.get("use_regex", True) and not s.get("add_prefix_space") else None
    if len(steps) < 2 or steps[-1].get("type") != "ByteLevel":
        return None
    level = steps[-1]
    if level.get("use_regex", True) is not False or level.get("add_prefix_space"):
        return None
    regexes = [_isolated_regex(step) for step in steps[:-1]]
    if None in regexes:
        return None
    return tuple(regexes[:-1]), _with_gaps(regexes[-1])


def _isolated_regex(step: dict) -> str | None:
    """The regex of a ``Split`` step that keeps matches and the text between them as pieces."""
    regex = (step.get("pattern") or {}).get("Regex")
    if step.get("type") != "Split" or not regex or step.get("behavior") != "Isolated" or step.get("invert"):
        return None
    return regex


def _with_gaps(regex: str) -> str:
    """``regex`` whose matches tiktoken takes as pieces, plus each run of text it does not match
    (``Split`` keeps such a run as a piece; tiktoken alone would drop it)."""
    return f"(?:{regex})|(?:(?!(?:{regex}))[\\s\\S])+"


class _SplitEncoder:
    """``CoreBPE.encode(text, allowed_special)`` for a pre-tokenizer of several ``Split`` steps:
    added tokens are cut out first (as ``tokenizers`` does), every ``pre_splits`` regex then splits
    each piece of the one before (matches and the text between them), and tiktoken encodes each
    final piece with the last split's regex (``Encoding`` ``enc``). Returns a list of ranks."""

    def __init__(self, pre_splits: tuple[str, ...], specials: dict, enc):
        import regex

        self.splits = [regex.compile(r) for r in pre_splits]
        self.specials = specials
        self.special_re = regex.compile("|".join(regex.escape(t) for t in specials)) if specials else None
        self.encode_piece = enc._core_bpe.encode_ordinary

    def __call__(self, text: str, allowed_special) -> list[int]:
        out: list[int] = []
        for segment, special in self._segments(text, allowed_special):
            if special:
                out.append(self.specials[segment])
                continue
            for piece in self._pieces(segment):
                out.extend(self.encode_piece(piece))
        return out

    def _segments(self, text: str, allowed_special):
        at = 0
        if self.special_re is not None and allowed_special:
            for m in self.special_re.finditer(text):
                if m.group() in allowed_special:
                    if m.start() > at:
                        yield text[at:m.start()], False
                    yield m.group(), True
                    at = m.end()
        if at < len(text):
            yield text[at:], False

    def _pieces(self, text: str) -> list[str]:
        pieces = [text]
        for split in self.splits:
            pieces = [part for piece in pieces for part in _isolated(split, piece)]
        return pieces


def _isolated(split, text: str) -> list[str]:
    """``Split(behavior="Isolated")``: the matches of compiled regex ``split`` in ``text`` and the
    non-empty runs between them, in order."""
    out, at = [], 0
    for m in split.finditer(text):
        a, b = m.span()
        if a > at:
            out.append(text[at:a])
        if b > a:
            out.append(text[a:b])
        at = b
    if at < len(text):
        out.append(text[at:])
    return out


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
