"""Shared-prefix packing: the samples of a group that begin with the same tokens (a DPO pair's prompt, a
GRPO group's prompt, branches of one conversation) laid out once as ``[prefix][member 1][member 2]...``.

``build_thd_batch(samples, share_prefix="group")`` shares within the groups of the sample field
``"group"`` (an integer id). Each group's prefix is declared (every member's :data:`PREFIX_FIELD`,
checked) or found (the longest common prefix whose rows' targets agree); a group shares when it has two
or more members, a prefix of at least ``min_prefix_len`` tokens (:data:`DEFAULT_MIN_PREFIX_LEN`) and a
tree shorter than the group unshared once padded. The prefix's last row predicts each member's first
token: those targets live in :class:`thdpack.batching.prefix_tree.PrefixTree`'s target table. The
batch is gathered from the unshared one (the same target rule, checks and errors). The rules in full:
docs/rl.md, "Reference details", "Shared-prefix packing: the rules".
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import numpy as np
import torch

from thdpack.batching.batch import ThdBatch
from thdpack.batching.layout import BatchLayout, padded_lengths
from thdpack.batching.prefix_tree import PrefixTree
from thdpack.batching.trie import member_layout, trie_prefix_tree, trie_segments
from thdpack.planning.prefix_budget import SharedLayout
from thdpack.common.align import check_int, round_up
from thdpack.common.samples import SampleError, get_field
from thdpack.planning.plan import number_groups

PREFIX_FIELD = "prefix_len"
"""The sample field that declares how many of a sample's first tokens its group shares (its prompt)."""

DEFAULT_MIN_PREFIX_LEN = 32
"""Shortest prefix worth sharing (tokens); shorter ones leave their group unshared."""


def check_share_args(share_prefix, min_prefix_len, layout: BatchLayout) -> None:
    """``ValueError`` / ``TypeError`` naming the argument unless ``share_prefix`` is None or a field name,
    ``min_prefix_len`` an integer >= 1, and the layout one a tree can take (no CP)."""
    if share_prefix is None:
        return
    if not isinstance(share_prefix, str) or not share_prefix:
        raise TypeError(f"share_prefix must be None or the name of a sample field holding a group id (e.g. "
                        f"'group'), got {share_prefix!r}")
    check_int(min_prefix_len, "min_prefix_len", 1, hint=" (the shortest prefix worth sharing, in tokens)")
    if layout.cp_size > 1:
        raise ValueError(f"share_prefix={share_prefix!r} with cp_size={layout.cp_size}: context-parallel attention "
                         "(ring / TE THD) cannot express a shared-prefix tree; use share_prefix=None with CP")


def flat_layout(layout: BatchLayout) -> BatchLayout:
    """The layout of the unshared stream a tree is gathered from: no padding, the same cut."""
    return BatchLayout(pad_token_id=layout.pad_token_id, ignore_index=layout.ignore_index, max_length=layout.cut_length)


def build_shared_batch(flat: ThdBatch, samples: Sequence, layout: BatchLayout, share_prefix: str,
                       min_prefix_len: int = DEFAULT_MIN_PREFIX_LEN, limit=None) -> ThdBatch | None:
    """The shared-prefix batch of ``samples``, gathered from ``flat``, their unshared batch built with
    :func:`flat_layout`; None when no group shares a prefix (then build the unshared batch). ``limit``:
    as in :func:`group_prefixes`."""
    prefix = group_prefixes(flat, samples, share_prefix, min_prefix_len, layout.multiple, limit)
    group_of = number_groups(read_groups(samples, share_prefix))
    cu = flat.cu_seqlens.numpy().astype(np.int64)
    if limit is None:  # text: a group's trie where it lays out fewer slots (VLM groups keep one level)
        declared = _declared(samples)
        segs = trie_segments(flat.input_ids.numpy(), flat.labels.numpy(), cu, group_of, prefix, declared,
                             min_prefix_len, layout.multiple)
        if segs is not None:
            return _gather_tree(flat, layout, prefix, segs, trie_prefix_tree)
    if not prefix.any():
        return None
    return _gather_tree(flat, layout, prefix, _segments(prefix, group_of, cu))


def group_shares(flat: ThdBatch, samples: Sequence, share_prefix: str, min_prefix_len: int,
                 multiple: int = 1) -> SharedLayout:
    """The planner's budget for text samples laid out as :func:`build_shared_batch` lays their groups out (a
    trie where it lays out fewer slots than one level): each sample's tokens laid out by earlier members of its
    group and the padded slots it adds (:func:`thdpack.batching.trie.member_layout`), and its group's one-level
    prefix (:func:`group_prefixes`, for a group a planner spreads over several packs)."""
    prefix = group_prefixes(flat, samples, share_prefix, min_prefix_len, multiple)
    group_of = number_groups(read_groups(samples, share_prefix))
    shared, slots = member_layout(flat.input_ids.numpy(), flat.labels.numpy(), flat.cu_seqlens.numpy().astype(np.int64),
                                  group_of, prefix, _declared(samples), min_prefix_len, multiple)
    return SharedLayout(shared, slots, prefix)


def _declared(samples: Sequence) -> np.ndarray:
    """bool ``[n]``: the samples that declare their prefix (:data:`PREFIX_FIELD`): their group keeps one level."""
    return np.asarray([_sample_int(s, PREFIX_FIELD, i, required=False) is not None for i, s in enumerate(samples)],
                      bool)


def read_groups(samples: Sequence, field: str) -> np.ndarray:
    """int64 ``[n]`` every sample's group id (``SampleError`` naming a sample without one, or a non-integer)."""
    out = np.empty(len(samples), np.int64)
    for i, sample in enumerate(samples):
        out[i] = _sample_int(sample, field, i, required=True)
    return out


def _sample_int(sample, field: str, i: int, *, required: bool) -> int | None:
    value = get_field(sample, field, i, required=required)
    if value is None:
        return None
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    try:
        number = None if isinstance(value, (bool, np.bool_)) else operator.index(value)
    except TypeError:
        number = None
    if number is None:
        raise SampleError.at(i, f": '{field}' must be an integer, got {value!r}", field=field)
    return number


def group_prefixes(flat: ThdBatch, samples: Sequence, share_prefix: str, min_prefix_len: int,
                   multiple: int = 1, limit=None) -> np.ndarray:
    """int64 ``[n]`` the prefix every sample shares with its group (0: laid out alone), from its unshared
    batch ``flat`` (no padding) and the samples' group ids and declared :data:`PREFIX_FIELD`, for segments
    padded to ``multiple`` (the rules: the module docstring). ``ValueError`` naming the group for a
    declared prefix that is not the members' common one. ``limit``: None, or ``limit(members, p, declared,
    name) -> int`` shortening a group's prefix (VLM: to whole, equal images; the family's
    ``prefix_limit``), before the minimum and padding rules."""
    groups = read_groups(samples, share_prefix)
    declared = [_sample_int(s, PREFIX_FIELD, i, required=False) for i, s in enumerate(samples)]
    ids, labels = flat.input_ids.numpy(), flat.labels.numpy()
    cu = flat.cu_seqlens.numpy().astype(np.int64)
    group_of = number_groups(groups)
    order = np.argsort(group_of, kind="stable")
    bounds = np.flatnonzero(np.diff(group_of[order])) + 1
    prefix = np.zeros(len(samples), np.int64)
    for members in np.split(order, bounds):
        if members.size < 2:
            continue
        p = _group_prefix(ids, labels, cu, members, [declared[j] for j in members], int(groups[members[0]]))
        if limit is not None and p > 0:
            p = limit(members, p, declared[members[0]] is not None, _group_name(members, int(groups[members[0]])))
        lens = cu[members + 1] - cu[members]
        shorter = round_up(np.int64(p), multiple) + round_up(lens - p, multiple).sum() < round_up(lens, multiple).sum()
        prefix[members] = p if p >= min_prefix_len and shorter else 0
    return prefix


def _group_prefix(ids, labels, cu, members: np.ndarray, declared: list, group: int) -> int:
    """The prefix of one group's ``members`` (positions in the batch, ascending): the declared one, checked,
    or the longest on which their tokens agree and their targets of rows ``0 .. p-2`` agree."""
    lens = cu[members + 1] - cu[members]
    given = {d for d in declared if d is not None}
    name = _group_name(members, group)
    if given and (len(given) > 1 or None in declared):
        raise ValueError(f"{name} declares {PREFIX_FIELD} {sorted(given)} and "
                         f"{'none on some members' if None in declared else 'differing values'}; give every member "
                         f"of a group the same {PREFIX_FIELD} (its shared prompt) or none (the common prefix is found)")
    m = given.pop() if given else int(lens.min())
    if not 0 <= m <= int(lens.min()):
        short = int(members[np.argmin(lens)])
        raise ValueError(f"{name} declares {PREFIX_FIELD}={m}, but sample {short} has {int(lens.min())} tokens; "
                         f"{PREFIX_FIELD} is the length of the prompt every member begins with (0 <= it <= each length)")
    rows = cu[members][:, None] + np.arange(m)[None, :]
    tok_ok = (ids[rows] == ids[rows[:1]]).all(0)
    lab_ok = (labels[rows[:, : max(m - 1, 0)]] == labels[rows[:1, : max(m - 1, 0)]]).all(0)
    tok_end = int(np.argmin(tok_ok)) if not tok_ok.all() else m
    lab_end = int(np.argmin(lab_ok)) + 1 if not lab_ok.all() else m
    if declared[0] is not None and min(tok_end, lab_end) < m:  # a declared prefix is checked, not shortened
        bad = tok_end < m
        t = tok_end if bad else lab_end
        j = int(members[np.argmin((ids[rows[:, t]] == ids[rows[0, t]]) if bad else
                                  (labels[rows[:, t - 1]] == labels[rows[0, t - 1]]))])
        what = f"token {t}" if bad else f"the target of token {t}"
        raise ValueError(f"{name}: sample {j}'s {what} differs from sample {int(members[0])}'s within the declared "
                         f"{PREFIX_FIELD}={m}; the declared prefix must be the members' common prefix (tokens and "
                         "targets), or leave it out to find it")
    return min(tok_end, lab_end)


def _group_name(members: np.ndarray, group: int) -> str:
    shown = ", ".join(map(str, members[:8].tolist())) + (", ..." if members.size > 8 else "")
    return f"group {group} (samples {shown})"


def _segments(prefix: np.ndarray, group_of: np.ndarray, cu: np.ndarray) -> dict:
    """The stream's segments in order, int64 ``[S]`` each: ``src`` (the unshared row of their first token),
    ``length``, ``parent``, ``sample`` (-1: a prefix), ``pos0`` (their first position id); and int64 ``[n]``
    ``own`` / ``pref`` (each sample's segment, its prefix's or -1). A group comes where its first member
    was given, its members after its prefix in the order given."""
    n = prefix.size
    members_of = {}
    for j in range(n):
        members_of.setdefault(int(group_of[j]), []).append(j)
    src, length, parent, sample, pos0 = [], [], [], [], []
    own, pref = np.full(n, -1, np.int64), np.full(n, -1, np.int64)
    placed = set()
    for j in range(n):  # one entry per sample or group: the stream's structure, not its tokens
        if prefix[j] == 0:
            own[j] = len(src)
            src.append(cu[j]), length.append(cu[j + 1] - cu[j]), parent.append(-1), sample.append(j), pos0.append(0)
            continue
        g = int(group_of[j])
        if g in placed:
            continue
        placed.add(g)
        root, p = len(src), int(prefix[j])
        src.append(cu[j]), length.append(p), parent.append(-1), sample.append(-1), pos0.append(0)
        for k in members_of[g]:
            own[k], pref[k] = len(src), root
            src.append(cu[k] + p), length.append(cu[k + 1] - cu[k] - p), parent.append(root), sample.append(k)
            pos0.append(p)
    arrays = dict(src=src, length=length, parent=parent, sample=sample, pos0=pos0)
    return {**{k: np.asarray(v, np.int64) for k, v in arrays.items()}, "own": own, "pref": pref}


def _gather_tree(flat: ThdBatch, layout: BatchLayout, prefix: np.ndarray, segs: dict, tree_of=None) -> ThdBatch:
    """The tree's stream gathered from the unshared ``flat`` by the segments ``segs`` (:func:`_segments`, or a
    trie's: :func:`thdpack.batching.trie.trie_segments` with ``tree_of=trie_prefix_tree``)."""
    length = segs["length"]
    padded = padded_lengths(length, layout)
    cu_padded = np.zeros(length.size + 1, np.int64)
    np.cumsum(padded, out=cu_padded[1:])
    total = int(cu_padded[-1])
    seg = np.repeat(np.arange(length.size), padded)
    offset = np.arange(total) - cu_padded[seg]
    real = offset < length[seg]
    src = np.where(real, segs["src"][seg] + offset, 0)
    ignore = layout.ignore_index
    input_ids = np.where(real, flat.input_ids.numpy()[src], layout.pad_token_id)
    labels = np.where(real, flat.labels.numpy()[src], ignore)
    roots = np.flatnonzero(segs["sample"] < 0)
    labels[cu_padded[roots] + length[roots] - 1] = ignore  # a prefix's last row: one target per member (the table)
    cu = np.zeros(length.size + 1, np.int64)
    np.cumsum(length, out=cu[1:])
    tree = (tree_of or _prefix_tree)(flat, prefix, segs, cu_padded, ignore)
    return ThdBatch(
        input_ids=torch.from_numpy(input_ids), labels=torch.from_numpy(labels),
        loss_mask=torch.from_numpy(labels != ignore), position_ids=torch.from_numpy(segs["pos0"][seg] + offset),
        cu_seqlens=torch.from_numpy(cu.astype(np.int32)), cu_seqlens_padded=torch.from_numpy(cu_padded.astype(np.int32)),
        max_seqlen=int(padded.max()), seq_lens=torch.from_numpy(length.astype(np.int32)),
        sample_index=flat.sample_index, source_index=flat.source_index, pad_multiple=layout.multiple,
        ignore_index=ignore,
        tokens_truncated=flat.tokens_truncated, extras=dict(flat.extras), max_num_seqs=layout.max_num_seqs,
        prefix_tree=tree,
    )


def _prefix_tree(flat: ThdBatch, prefix: np.ndarray, segs: dict, cu_padded: np.ndarray, ignore: int) -> PrefixTree:
    """The :class:`PrefixTree` of the gathered stream: rows of every unshared token, the target table."""
    cu = flat.cu_seqlens.numpy().astype(np.int64)
    lens = cu[1:] - cu[:-1]
    sample_of = np.repeat(np.arange(lens.size), lens)
    t = np.arange(int(cu[-1])) - cu[sample_of]
    p = prefix[sample_of]
    own, pref = segs["own"], segs["pref"]
    in_prefix = t < p
    rows = np.where(in_prefix, cu_padded[np.maximum(pref, 0)][sample_of] + t, cu_padded[own][sample_of] + t - p)
    flat_labels = flat.labels.numpy()
    targets = np.flatnonzero(flat.loss_mask.numpy())
    has_first = (prefix > 0) & (lens > prefix)
    first_rows = np.where(has_first, cu_padded[np.maximum(pref, 0)] + prefix - 1, -1)
    first_labels = np.where(has_first, flat_labels[np.where(has_first, cu[:-1] + prefix - 1, 0)], ignore)
    as_t = torch.from_numpy
    return PrefixTree(
        parents=as_t(segs["parent"]), segment_sample=as_t(segs["sample"]), sample_segment=as_t(own),
        prefix_lens=as_t(prefix.astype(np.int64)), sample_lens=as_t(lens), first_rows=as_t(first_rows.astype(np.int64)),
        first_labels=as_t(first_labels.astype(np.int64)), unshared_rows=as_t(rows.astype(np.int64)),
        target_rows=as_t(rows[targets].astype(np.int64)), target_labels=as_t(flat_labels[targets].astype(np.int64)),
        target_samples=as_t(sample_of[targets].astype(np.int64)),
    )
