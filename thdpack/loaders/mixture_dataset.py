"""A dataset mixture for the online path: several map-style datasets blended by weight, as one map-style
dataset a ``DataLoader`` draws from (behind a :class:`thdpack.TokenBudgetBatchSampler`, or in order through a
:class:`thdpack.StreamingPacker`), its samples tagged with their source for :class:`thdpack.ThdCollator`."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

import numpy as np
from torch.utils.data import Dataset

from thdpack.batching.builder import SOURCE_INDEX_FIELD
from thdpack.common.align import check_int
from thdpack.loaders.collate import SAMPLE_INDEX_FIELD
from thdpack.loaders.sampler import check_state_dict
from thdpack.planning.mixture import MixturePlan, mixture_sources, plan_mixture


class MixtureDataset(Dataset):
    """The blend of :func:`thdpack.planning.mixture.plan_mixture` over map-style datasets.

    ``MixtureDataset(sources)[k]`` is sample ``k`` of the blend: row ``plan.row[k]`` of source
    ``plan.source[k]``, as a dict with ``"sample_index": k`` (its place in the blend) and
    ``"source_index"`` (its source's position in ``sources``), which :class:`thdpack.ThdCollator` puts in
    ``batch.sample_index`` and ``batch.source_index`` (an example: docs/mixtures.md, "In a DataLoader").

    One blend for every worker, rank, restart and offline build, drawn once; resumed by the sampler or packer
    in front: docs/mixtures.md, "MixtureDataset: one blend everywhere, drawn once".

    Args:
        sources: a list of mappings, one per source: ``dataset`` (anything with ``__len__`` and
            ``__getitem__`` returning mappings: a ``datasets.Dataset``, a list of dicts) and the keys of
            :class:`thdpack.planning.mixture.MixtureSource` but ``num_rows`` (the dataset's length):
            ``name`` (default ``source{i}``), one of ``weight`` / ``epochs`` / ``max_samples``, ``lengths``
            (every row's tokens: for ``weight_by="tokens"`` and for :attr:`lengths`).
        weight_by, size, stopping, seed: as in :func:`thdpack.planning.mixture.plan_mixture`.

    Raises ``ValueError`` naming the source for what :func:`plan_mixture` refuses, an empty dataset, and a
    dataset given twice (the same object, or a ``datasets.Dataset`` of the same fingerprint).

    Attributes:
        plan: the :class:`thdpack.planning.mixture.MixturePlan` (``print(mixture.plan)``: requested and
            realized share per source).
        datasets: the sources' datasets, in order.
    """

    def __init__(self, sources: Sequence, *, weight_by: str = "samples", size: int | None = None,
                 stopping: str = "first_exhausted", seed: int = 0):
        if isinstance(sources, (Mapping, str, bytes)) or not hasattr(sources, "__iter__"):
            raise TypeError(f"MixtureDataset takes a list of sources (mappings with 'dataset'), got "
                            f"{type(sources).__name__}")
        entries, datasets = [], []
        for i, entry in enumerate(sources):
            if not isinstance(entry, Mapping):
                raise TypeError(f"MixtureDataset source {i} must be a mapping with 'dataset' and its weight, got "
                                f"{type(entry).__name__}")
            name = entry.get("name", f"source{i}")
            dataset = _checked_dataset(entry, name)
            datasets.append(dataset)
            entries.append({**{k: v for k, v in entry.items() if k != "dataset"}, "name": name,
                            "num_rows": len(dataset)})
        mixture_sources(entries)  # unknown keys and duplicate names first, named by source
        _refuse_same_dataset(datasets, [e["name"] for e in entries])
        self.datasets = datasets
        self.plan: MixturePlan = plan_mixture(entries, weight_by=weight_by, size=size, stopping=stopping, seed=seed)
        self._fingerprint: str | None = None
        self._without_lengths = [e["name"] for e in entries if e.get("lengths") is None]

    def __len__(self) -> int:
        return len(self.plan)

    @property
    def lengths(self) -> np.ndarray:
        """int64 ``[len(self)]`` every sample's tokens, for :class:`thdpack.TokenBudgetBatchSampler`; needs every
        source's ``lengths``."""
        if self.plan.lengths is None:
            raise ValueError(f"MixtureDataset.lengths needs every source's lengths (rows' token counts); give "
                             f"'lengths' to {', '.join(map(repr, self._without_lengths))}")
        return self.plan.lengths

    @property
    def source_index(self) -> np.ndarray:
        """int64 ``[len(self)]`` every sample's source (``plan.source``)."""
        return self.plan.source

    def __getitem__(self, index: int) -> dict:
        """Sample ``index`` of the blend: an integer (Python or numpy, not a bool: ``TypeError``) in
        ``[-len(self), len(self))`` (``IndexError``); a negative one counts from the end, as for a list."""
        index = self._position(index)
        source, row = int(self.plan.source[index]), int(self.plan.row[index])
        return self._tagged(self.datasets[source][row], index, source, row)

    def __getitems__(self, indices: list) -> list:
        """The samples of ``indices`` (what a DataLoader fetches for one batch; each as :meth:`__getitem__`
        takes it), each source's rows read in one call where its dataset can (``__getitems__``)."""
        indices = [self._position(k) for k in indices]
        where = np.asarray(indices, np.int64)
        source, row = self.plan.source[where], self.plan.row[where]
        out: list = [None] * len(indices)
        for s in np.unique(source).tolist():
            at = np.flatnonzero(source == s)
            rows = row[at].tolist()
            dataset = self.datasets[s]
            getitems = getattr(dataset, "__getitems__", None)
            fetched = getitems(rows) if getitems else [dataset[r] for r in rows]
            for j, r, sample in zip(at.tolist(), rows, fetched):
                out[j] = self._tagged(sample, indices[j], s, r)
        return out

    def __iter__(self):
        """The blend in order (what a :class:`thdpack.StreamingPacker` packs)."""
        for k in range(len(self)):
            yield self[k]

    def _position(self, index) -> int:
        """``index`` as a position in ``[0, len(self))``; ``TypeError`` / ``IndexError`` as :meth:`__getitem__`."""
        integer = isinstance(index, (int, np.integer)) and not isinstance(index, bool)  # else the wrong type
        check_int(index, "MixtureDataset index", -len(self), below=len(self), error=IndexError if integer else TypeError,
                  hint=f" (out of range for {len(self)} samples)" if integer else f" ({type(index).__name__})")
        return int(index) % len(self)

    def _tagged(self, sample, index: int, source: int, row: int) -> dict:
        if not isinstance(sample, Mapping):
            raise TypeError(f"row {row} of mixture source {self.plan.names[source]!r} is a {type(sample).__name__}, "
                            "not a mapping (a sample with 'input_ids')")
        return {**sample, SAMPLE_INDEX_FIELD: index, SOURCE_INDEX_FIELD: source}

    # ---- resume: the blend's fingerprint -----------------------------------------------------------
    def fingerprint(self) -> str:
        """sha1 of the blend (names, sources and rows): equal for equal blends."""
        if self._fingerprint is None:
            h = hashlib.sha1(repr(self.plan.names).encode())
            h.update(self.plan.source.tobytes())
            h.update(self.plan.row.tobytes())
            self._fingerprint = h.hexdigest()
        return self._fingerprint

    def state_dict(self) -> dict:
        """``{"fingerprint"}``: the blend is a function of the sources, weights and seed; nothing else moves."""
        return {"fingerprint": self.fingerprint()}

    def load_state_dict(self, state: dict) -> None:
        """Check that ``state`` was saved over the same blend; ``ValueError`` otherwise."""
        check_state_dict(state, ("fingerprint",), "MixtureDataset", lambda s: None)
        if state["fingerprint"] != self.fingerprint():
            raise ValueError("state_dict was saved by a MixtureDataset with another blend; resume with the same "
                             "sources (and their lengths), weights, weight_by, size, stopping and seed")


def _checked_dataset(entry: Mapping, name: str):
    if "dataset" not in entry:
        raise ValueError(f"mixture source {name!r} has no 'dataset' (a map-style dataset: a datasets.Dataset, a "
                         "list of dicts)")
    dataset = entry["dataset"]
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")) or isinstance(dataset, (str, bytes)):
        raise TypeError(f"mixture source {name!r}: dataset must be map-style (with __len__ and __getitem__: a "
                        f"datasets.Dataset, a list of dicts), got {type(dataset).__name__}")
    if len(dataset) == 0:
        raise ValueError(f"mixture source {name!r} is empty (0 rows, after filtering): drop it from the mixture or "
                         "fix its rows")
    return dataset


def _refuse_same_dataset(datasets: list, names: list[str]) -> None:
    """``ValueError`` naming both sources when two are the same dataset (one object, or one fingerprint)."""
    seen: dict = {}
    for i, dataset in enumerate(datasets):
        keys = [("id", id(dataset))]
        fingerprint = getattr(dataset, "_fingerprint", None)
        if isinstance(fingerprint, str):
            keys.append(("fingerprint", fingerprint))
        for key in keys:
            if key in seen:
                raise ValueError(f"mixture sources {names[seen[key]]!r} and {names[i]!r} are the same dataset; give "
                                 "it once (epochs: 2 repeats it)")
            seen[key] = i
