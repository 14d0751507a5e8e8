"""Hybrid layers on a rollout trie: each segment runs from its parent's final state (the state *forks*).

A trie batch (:mod:`thdpack.batching.trie`) lays every shared segment out once; a segment continues its
parent, so a linear-attention, SSM or convolution layer must start it from the state its parent ended
in, not from zero: the recurrent state (Gated DeltaNet's ``[H, K, V]`` matrix, Mamba's SSM state) and a
causal convolution's last inputs (the window it reads before the segment's first token)::

    segments      P (root) | T, parent P | A, parent T | B, parent P
    a layer runs  P from 0 | T from P's  | A from T's  | B from P's
    final state   s_P      | s_T         | s_A         | s_B

The layer's own code does the work: transformers (>= 5.25) mixers continue a sequence from a ``Cache``
holding a conv window and a recurrent state (chunked prefill), on any device, with flash-linear-attention /
mamba-ssm / causal-conv1d kernels where installed (``initial_state``). :class:`ForkCache` is such a cache
for one segment: it hands the mixer its parent's state and keeps what the segment ends in, out of place,
so the states stay in the autograd graph: a prefix's state gets the sum of its branches' gradients.

A segment's pad slots (its alignment padding, a ``pad_to`` tail) never enter a state: they run as one
sequence of their own from zero (their rows score nothing and are attended by no real token).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from thdpack.attention.tree_mask import check_tree, slot_segments


@dataclass(frozen=True)
class TrieCall:
    """The segments of a packed trie call, as :func:`thdpack.integrations.to_hf_kwargs` gives them.

    Attributes:
        offsets: ``S + 1`` padded segment offsets (``cu_seq_lens_q``).
        lens: ``S`` real tokens of each segment (``segment_lens``).
        parents: ``S`` parent of each segment, ``-1`` for a root (``segment_parents``).
        total: slots in the stream (a ``pad_to`` tail after ``offsets[-1]``).
    """

    offsets: tuple[int, ...]
    lens: tuple[int, ...]
    parents: tuple[int, ...]
    total: int

    @classmethod
    def from_kwargs(cls, cu, lens, parents, total: int) -> "TrieCall":
        """Validated (:func:`thdpack.attention.tree_mask.check_tree`: parents earlier, real lengths inside their
        spans, depth bounded); ``ValueError`` naming the bad segment."""
        cu_, lens_, par_, total = check_tree(torch.as_tensor(cu).cpu(), torch.as_tensor(lens).cpu(),
                                            torch.as_tensor(parents).cpu(), total)
        return cls(tuple(cu_.tolist()), tuple(lens_.tolist()), tuple(par_.tolist()), int(total))

    def real_positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(slots, positions)``: int64 ``[R]`` every real slot and its position along its path (a root's
        tokens count from 0, a child's from where its parent ends)."""
        pos0: list[int] = []
        slots, positions = [], []
        for s, (a, n, p) in enumerate(zip(self.offsets, self.lens, self.parents)):
            pos0.append(0 if p < 0 else pos0[p] + self.lens[p])
            slots.append(torch.arange(a, a + n))
            positions.append(torch.arange(pos0[s], pos0[s] + n))
        return torch.cat(slots), torch.cat(positions)

    def pad_slots(self) -> torch.Tensor:
        """int64 ``[P]``: the slots no segment's real tokens hold, in order."""
        cu, lens = torch.tensor(self.offsets, dtype=torch.int64), torch.tensor(self.lens, dtype=torch.int64)
        _, _, real = slot_segments(cu, lens, torch.arange(self.total), self.total)
        return torch.nonzero(~real).reshape(-1)


def check_trie_positions(row: torch.Tensor, trie: TrieCall) -> None:
    """``ValueError`` unless the text positions (int ``[T]``) of every real slot continue its parent's: the
    trie the positions describe is the one the boundaries name."""
    if row.numel() != trie.total:
        raise ValueError(f"position_ids cover {row.numel()} tokens, the trie's segments {trie.total}")
    slots, want = trie.real_positions()
    got = row.detach().to("cpu", torch.int64)[slots]
    if not torch.equal(got, want):
        bad = int(torch.nonzero(got != want)[0])
        raise ValueError(f"position_ids at slot {int(slots[bad])} are {int(got[bad])}, but its segment continues its "
                         f"parent (segment_parents) at position {int(want[bad])}: pass position_ids, cu_seq_lens_q, "
                         "segment_lens and segment_parents from one to_hf_kwargs(batch)")


class ForkCache:
    """A transformers ``Cache`` for one mixer running one segment: it reads the parent's conv window and
    recurrent state, and records the segment's, without writing in place (the autograd graph keeps both).

    Only the linear-attention part of the Cache API that transformers' mixers call is here; the states
    live in :attr:`conv` / :attr:`recurrent` (``{state_idx: tensor}``), None where the segment is a root.
    ``is_recording_past`` is True so that a one-token segment's convolution takes the out-of-place path
    (transformers' one-token update writes the window in place)."""

    def __init__(self, conv: dict | None = None, recurrent: dict | None = None):
        self.conv = dict(conv or {})
        self.recurrent = dict(recurrent or {})

    # -- read by the mixers
    def get_conv_state(self, layer_idx: int, state_idx: int = 0):
        state = self.conv.get(state_idx)
        return None if state is None else state.clone()  # siblings share the parent's; kernels may write it

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0):
        state = self.recurrent.get(state_idx)
        return None if state is None else state.clone()

    def is_recording_past(self, layer_idx: int) -> bool:
        return True

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        return 0

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        return bool(self.conv or self.recurrent)

    def increase_count(self, layer_idx: int, state_idx: int = 0) -> None:
        pass

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    # -- written by the mixers
    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                          conv_kernel_size: int | None = None, **kwargs) -> torch.Tensor:
        """``conv_states`` (``[B, C, L]``, the segment's convolution inputs) after the parent's window: what the
        convolution reads. Records the last ``conv_kernel_size`` inputs (zeros before a root's first)."""
        previous = self.conv.get(state_idx)
        full = conv_states if previous is None else torch.cat([previous.to(conv_states.dtype), conv_states], -1)
        keep = full
        if conv_kernel_size is not None:
            keep = full[..., -conv_kernel_size:]
            if keep.shape[-1] < conv_kernel_size:
                keep = torch.nn.functional.pad(keep, (conv_kernel_size - keep.shape[-1], 0))
        self.conv[state_idx] = keep
        return full

    def update_recurrent_state(self, recurrent_states, layer_idx: int, state_idx: int = 0, **kwargs):
        last = recurrent_states if isinstance(recurrent_states, torch.Tensor) else recurrent_states[-1]
        self.recurrent[state_idx] = last
        return last


def run_trie(run, hidden: torch.Tensor, trie: TrieCall, rest: dict, *, continues_state: bool = True) -> torch.Tensor:
    """A mixer's output over a trie stream: ``run(hidden_states=[1, L, D] piece, cache=ForkCache, **rest)``
    per segment from its parent's state, the pad slots as one sequence from zero; ``hidden`` ``[1, T, D]``,
    the result ``[1, T, D']`` in stream order (a mixer returning a tuple: that tuple with its first element
    so assembled).

    A one-token segment runs after its parent's tokens, from its grandparent's state: transformers' one-token
    (decode) step is not always its prefill (Zamba2 clamps the time step in one only), and a sample alone is
    a prefill. ``continues_state=False`` (a family whose own scan ignores a cache's state: Jamba's Mamba-1)
    runs every segment after its whole path, from zero: exact, at the cost of recomputing the ancestors."""
    finals: list[ForkCache] = []
    pieces, slots, raw = [], [], None
    device = hidden.device
    for s, n in enumerate(trie.lens):
        p = trie.parents[s]
        if not n:
            finals.append(finals[p] if p >= 0 else ForkCache())  # an empty segment ends in its parent's state
            continue
        first, run_slots = s, [_real_slots(trie, s)]
        while trie.parents[first] >= 0 and (not continues_state or sum(len(r) for r in run_slots) < 2):
            first = trie.parents[first]
            run_slots.insert(0, _real_slots(trie, first))
        base = finals[trie.parents[first]] if trie.parents[first] >= 0 else ForkCache()
        cache = ForkCache(base.conv, base.recurrent)
        index = torch.cat(run_slots).to(device)
        raw = run(hidden_states=hidden[:, index], cache=cache, **rest)
        pieces.append(_first(raw)[:, -n:])
        slots.append(index[-n:])
        finals.append(cache)
    pad = trie.pad_slots().to(device)
    if pad.numel():
        raw = run(hidden_states=hidden[:, pad], cache=None, **rest)
        pieces.append(_first(raw))
        slots.append(pad)
    order = torch.cat(slots)
    if order.numel() != hidden.shape[1]:  # pragma: no cover - segments and pad slots tile the stream
        raise AssertionError("trie segments do not tile the stream")
    out = torch.cat(pieces, dim=1)[:, torch.argsort(order)]
    return (out,) + tuple(raw[1:]) if isinstance(raw, tuple) else out


def _real_slots(trie: TrieCall, s: int) -> torch.Tensor:
    a = trie.offsets[s]
    return torch.arange(a, a + trie.lens[s])


def _first(output):
    return output[0] if isinstance(output, tuple) else output
