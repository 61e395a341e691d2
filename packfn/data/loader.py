"""A data loader of packed batches over tokenized examples (plain Python and ``torch.utils.data``, no ops).

:class:`PackedDataset` is a ``torch.utils.data.IterableDataset`` whose items
are whole batches with static shapes, packed by :mod:`packfn.data.packer` (best
fit over a window of documents by default) under the static budgets, so
every batch passes ``varlen_metadata(document_ids, max_documents=...)`` and
``aligned_layout(seq_lens, seq_lens_padded, ..., budget=...)``. Wrap it in a
``DataLoader(dataset, batch_size=None, num_workers=...)`` (it batches
itself) or torchdata's ``StatefulDataLoader``.

Examples are an HF ``datasets.Dataset`` with an ``input_ids`` column (and
optionally ``labels`` and ``loss_mask``) or a ``pyarrow.Table`` of them,
read in place (a memory-mapped corpus: NOTE [Reading an Arrow corpus in
place] in :mod:`packfn.data.examples`), a list of such dicts, a list of
token lists (or 1-D integer tensors), or any re-iterable of those (an HF
``IterableDataset`` included, read whole by every process).

NOTE [How the loader shards and resumes]
One packing plan covers the epoch: the epoch's documents (the examples in
order, or a seeded permutation of them with ``shuffle=True``) packed a
window at a time (NOTE [Windows and carried rows] in
:mod:`packfn.data.packer`) into batches numbered 0, 1, ... It depends on
the documents' lengths alone and is deterministic, so every data-parallel
rank and every ``DataLoader`` worker computes the same plan, with no
collective. Batch ``g`` goes to rank ``g % world``; a rank's ``j``-th batch
to its worker ``j % num_workers``, the order in which a ``DataLoader``
takes batches from its workers. So with ``shards = world * num_workers``,
worker ``w`` of rank ``r`` takes batches ``w * world + r``, then every
``shards``-th, and reads the tokens of those batches only. Every rank gets
every ``world``-th batch, so the ranks' counts differ only in the epoch's
last round, which the remainder rule completes: with ``N`` batches in the
plan, each rank yields ``ceil(N / world)``, batches ``N, N + 1, ...`` of the
last round being batches ``0, 1, ...`` again (as ``DistributedSampler``
repeats its first samples); with ``drop_last=True`` the plan's partial last
batch is dropped and each rank yields ``floor(N' / world)`` of the ``N'``
full ones, the last ``N' % world`` left out (the ``world`` batches before
the end wait until the plan's end is known). A shard's state is small: the
position of the plan's current window among the epoch's documents, the
number of the window's first batch, how many of its batches are past, and
the rows carried into it (document, offset and length of their pieces, not
their tokens). A restored shard reads that window again, packs it the same
way, skips the batches already past and goes on, so the batches after a
restore are exactly those an uninterrupted run sends. ``state_dict()`` /
``load_state_dict()`` are the protocol torchdata's ``StatefulDataLoader``
calls in each worker; with a plain ``DataLoader``,
:meth:`PackedDataset.state_after` computes the state of every worker from
the number of batches the training loop consumed (workers take turns).
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import torch
from torch.utils.data import IterableDataset, get_worker_info

from packfn._checks import check_int, check_positive_int, check_scalar_fits
from packfn._ops import formats as _format_ops
from packfn.data.batch import token_positions
from packfn.data.examples import IGNORE_INDEX, Examples, Tokens, concatenate
from packfn.data.fit import Items, checked_budgets
from packfn.data.packer import Carry, Window, batch_and_items, pack_window
from packfn.data.stats import (
    FILL_WARNING_ROWS,
    FillWarning,
    ThrownFill,
    batch_stats,
    fill_warning,
    stats_tensors,
    thrown_fill,
)
from packfn.formats import shift_labels

__all__ = ["BATCH_KEYS", "IGNORE_INDEX", "PackedDataset"]


BATCH_KEYS = (
    "input_ids",
    "labels",
    "shift_labels",
    "position_ids",
    "document_ids",
    "seq_lens",
    "seq_lens_padded",
    "documents",
    "document_offsets",
    "packing_stats",
)
"""The keys of every batch :class:`PackedDataset` yields (see its docstring); ``packing_stats`` is left out
with ``packing_stats=False``."""

_STATE_VERSION = 2


# ------------------------------------------------------------------ the dataset


class _Shard(NamedTuple):
    """Where an iterator runs: it takes the plan's batches ``index, index + count, ...``; ``key`` names its state.

    ``index = worker * world + rank`` and ``count = world * num_workers``
    (NOTE [How the loader shards and resumes]); ``key`` is ``"worker/workers"``.
    """

    index: int
    count: int
    key: str


class _Store(NamedTuple):
    """The tokens of some documents: flat tokens and labels (None: the tokens), documents sorted, where each starts."""

    tokens: torch.Tensor
    labels: torch.Tensor | None
    document: torch.Tensor
    start: torch.Tensor


class _Step(NamedTuple):
    """One batch of the epoch's plan: its window, its rows, its place, the state after it, the tokens to build it."""

    packed: Window
    rows: torch.Tensor
    index: int  # among the window's batches
    number: int  # among the epoch's batches
    state: dict[str, Any]
    store: _Store | None  # None where the shard does not build the window's batches (or reads lengths only)


class _End(NamedTuple):
    """The end of the epoch's plan: its batches, and whether the last one has fewer than ``batch`` rows."""

    total: int
    partial: bool


def _fresh_state() -> dict[str, Any]:
    empty = Carry.empty()
    return {"position": 0, "emitted": 0, "batches": 0, "finished": False, "carry": _carry_state(empty)}


def _finished_state() -> dict[str, Any]:
    return {**_fresh_state(), "finished": True}


def _check_state(state: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` naming the first entry of a state_dict that is missing or out of range (an edited one)."""
    for key, kind, name in (
        ("settings", Mapping, "a mapping"),
        ("epoch", int, "an int"),
        ("shards", Mapping, "a mapping"),
    ):
        if not isinstance(state.get(key), kind) or isinstance(state.get(key), bool):
            raise ValueError(f"the state_dict's {key!r} is missing or not {name}")
    if state["epoch"] < 0:
        raise ValueError(f"the state_dict's 'epoch' is negative: {state['epoch']}")
    for shard, progress in state["shards"].items():
        for key in ("position", "emitted", "batches"):
            value = progress.get(key) if isinstance(progress, Mapping) else None
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"shard {shard!r} of the state_dict has no count {key!r} of at least 0: {value!r}")


def _carry_state(carry: Carry) -> dict[str, torch.Tensor]:
    return {
        "document": carry.items.document,
        "offset": carry.items.offset,
        "length": carry.items.length,
        "total": carry.items.total,
        "row": carry.row,
        "age": carry.age,
    }


def _carry_from_state(state: Mapping[str, torch.Tensor]) -> Carry:
    return Carry(Items(state["document"], state["offset"], state["length"], state["total"]), state["row"], state["age"])


def _fingerprint(lengths: torch.Tensor) -> str:
    """A short digest of a window's document lengths: a state saved over other examples does not resume."""
    return hashlib.blake2b(lengths.to(torch.int64).numpy().tobytes(), digest_size=8).hexdigest()


class PackedDataset(IterableDataset):
    """An iterable dataset of packed batches with static shapes, sharded over workers and ranks, resumable.

    Every item is a dict (:data:`BATCH_KEYS`), with ``B = batch``,
    ``S = sequence``, ``D = max_documents``:

    - ``input_ids`` int64 ``[B, S]``: the tokens, ``padding_token_id`` at padding;
    - ``labels`` int64 ``[B, S]``: the examples' labels (or ``input_ids``),
      ``-100`` where a ``loss_mask`` is 0 and at padding; unshifted, as
      :func:`packfn.integrations.hf.hf_model_inputs` and transformers take them;
    - ``shift_labels`` int64 ``[B, S]``: each token's target, the label of
      the next token of its document (piece), ``-100`` at the last token
      and at padding: the ``labels`` of :func:`packfn.shard_packed_batch`;
    - ``position_ids`` int64 ``[B, S]``: positions restarting at every
      document, as :func:`packfn.packed_position_ids` gives them;
    - ``document_ids`` int64 ``[B, S]``: the packing format (1-based slot,
      0 at padding) of :func:`packfn.varlen_metadata` and the masks;
    - ``seq_lens``, ``seq_lens_padded`` int64 ``[B, D]``: real lengths and
      physical spans per slot (0 when absent), for
      :func:`packfn.aligned_layout` and :func:`packfn.shard_packed_batch`;
    - ``documents``, ``document_offsets`` int64 ``[B, D]``: the index of
      each slot's example and the first token of it the slot holds (-1 and
      0 when absent), for logging and checks;
    - ``packing_stats`` float64 ``[len(STATS_FIELDS)]``: how well the batch
      is packed (fill, documents per row, split pieces, what closed each
      row), the fields of :class:`packfn.data.stats.PackingStats` in the
      order of :data:`~packfn.data.stats.STATS_FIELDS`;
      :func:`~packfn.data.stats.stats_dict` reads it (or a stack of them)
      back. Not there with ``packing_stats=False``.

    Args:
        examples: An HF ``datasets.Dataset`` (or a ``pyarrow.Table``) with
            an ``input_ids`` column (and optional ``labels``,
            ``loss_mask``), a sequence of such mappings or of token-id
            sequences, or a re-iterable of them (an HF ``IterableDataset``
            not split by node).
        batch: Rows per batch.
        sequence: Tokens per row.
        max_documents: Document cap per row (``D``).
        alignment, budget, pad_to_multiple_of, split, strategy, window:
            As :func:`packfn.pack_stream` (``alignment`` defaults to 1).
        shuffle: Visit the examples in a seeded random order, new every
            epoch (:meth:`set_epoch`); indexable examples only.
        seed: Seed of that order.
        rank, world: This data-parallel rank and the number of ranks.
        drop_last: Drop the epoch's last, partly filled batch, and the
            batches past the last multiple of ``world`` (instead of
            repeating the epoch's first batches to complete the last round).
        padding_token_id: ``input_ids`` at padding (an int that int64 holds).
        packing_stats: Add ``packing_stats`` to every batch (on by default:
            it costs under 2% of the loader's time, ``scripts/bench_packer.py
            --parts loader``). It changes no other key and no state: a state
            saved with it on resumes with it off.

    Every rank yields the same number of batches per epoch,
    :meth:`batches_per_rank`, whatever its number of workers: one packing
    plan covers the epoch, which every rank and worker computes from the
    documents' lengths alone (no collective); rank ``r`` takes its batches
    ``r, r + world, ...`` and reads only their tokens. With ``N`` batches in
    the plan, each rank yields ``ceil(N / world)``: the ranks that the last
    round leaves short take the plan's first batches again (at most
    ``world - 1`` batches repeated an epoch). With ``drop_last=True`` the
    plan's partial last batch is dropped, then its last ``N' % world`` full
    batches, and each rank yields ``N' // world``. See NOTE [How the loader
    shards and resumes].

    Raises:
        TypeError, ValueError: bad arguments, at construction; bad examples
            (no ``input_ids``, non-integer tokens, a null inside a column's
            list, an empty example, a document longer than a row without
            ``split=True``) when read, each naming the example (and column);
            a loaded state that does not match the examples
            (:meth:`load_state_dict`) at the first batch.

    Warns:
        FillWarning: once per dataset, when the rows the cap (or the
            budget) closed leave more than a tenth of the input columns
            empty (:func:`packfn.data.stats.fill_warning` has the
            criterion).
    """

    def __init__(
        self,
        examples: object,
        *,
        batch: int,
        sequence: int,
        max_documents: int,
        alignment: int = 1,
        budget: int | None = None,
        pad_to_multiple_of: int = 1,
        split: bool = False,
        strategy: str = "best_fit",
        window: int = 1000,
        shuffle: bool = False,
        seed: int = 0,
        rank: int = 0,
        world: int = 1,
        drop_last: bool = False,
        padding_token_id: int = 0,
        packing_stats: bool = True,
    ) -> None:
        super().__init__()
        self._budgets = checked_budgets(sequence, alignment, max_documents, budget, pad_to_multiple_of, split, strategy)
        self.batch = check_positive_int(batch, "batch")
        self.window = check_positive_int(window, "window")
        self.world = check_positive_int(world, "world")
        self.rank = check_int(rank, "rank", minimum=0)
        if self.rank >= self.world:
            raise ValueError(f"rank must be in [0, world={self.world}), got {self.rank}")
        for name, value in (("shuffle", shuffle), ("drop_last", drop_last), ("packing_stats", packing_stats)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
        self.seed = check_int(seed, "seed")
        self.padding_token_id = check_scalar_fits(
            check_int(padding_token_id, "padding_token_id"), torch.int64, "padding_token_id"
        )
        self.shuffle, self.drop_last, self.packing_stats = shuffle, drop_last, packing_stats
        self._examples = Examples(examples)
        if shuffle and self._examples.count is None:
            raise ValueError("shuffle=True needs indexable examples (a sequence or a datasets.Dataset)")
        self.epoch = 0
        self._fill_warned = False  # FillWarning is given once per dataset (per process)
        self._states: dict[str, dict[str, Any]] = {}  # by shard key: the progress of the latest iterators
        self._pending: dict[str, Any] | None = None  # a loaded state the next iterator starts from
        self._worker_iterated = False  # in a DataLoader worker's copy: an iterator was made (once, unless persistent)

    # ---------------------------------------------------------------- settings and state

    @property
    def budget(self) -> int:
        """The aligned row length every batch fits (pass it to :func:`packfn.aligned_layout`)."""
        return self._budgets.budget

    @property
    def max_documents(self) -> int:
        return self._budgets.max_documents

    @property
    def sequence(self) -> int:
        return self._budgets.sequence

    def settings(self) -> dict[str, Any]:
        """What a state depends on: a state from a dataset with other settings does not load."""
        budgets = self._budgets
        return {
            "batch": self.batch,
            "sequence": budgets.sequence,
            "alignment": budgets.alignment,
            "max_documents": budgets.max_documents,
            "budget": budgets.budget,
            "pad_to_multiple_of": budgets.multiple,
            "split": budgets.split,
            "strategy": budgets.strategy,
            "window": self.window,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "rank": self.rank,
            "world": self.world,
            "drop_last": self.drop_last,
            "examples": self._examples.count,
        }

    def set_epoch(self, epoch: int) -> None:
        """Start the next iteration at ``epoch`` (its order, with ``shuffle``), from its first document."""
        self.epoch = check_int(epoch, "epoch", minimum=0)
        self._states, self._pending = {}, None

    def state_dict(self) -> dict[str, Any]:
        """The progress of this dataset's shards: what :meth:`load_state_dict` resumes from.

        In the process that iterates (``num_workers=0``, or inside a worker,
        where torchdata's ``StatefulDataLoader`` calls it), it holds that
        process's shard after the last batch it yielded.
        """
        return {
            "version": _STATE_VERSION,
            "settings": self.settings(),
            "epoch": self.epoch,
            "shards": dict(self._states),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume the next iteration where ``state`` (from :meth:`state_dict` or :meth:`state_after`) left off.

        The state names documents by index; over other examples (of the same
        count) the iteration's first batch raises a ``ValueError`` that says
        the state does not match them when the documents it reads again
        (the window it resumes in, the pieces it carries) have other
        lengths, or a re-iterable ends before the position it resumes
        from. Examples with the same lengths are not told apart.

        Raises:
            ValueError: a state of another version, saved by a dataset
                with other settings (each differing setting is named), or
                with an entry missing or out of range (a negative count).
        """
        if not isinstance(state, Mapping) or state.get("version") != _STATE_VERSION:
            raise ValueError(f"not a PackedDataset state_dict (version {_STATE_VERSION})")
        _check_state(state)
        differences = [
            f"{name}={state['settings'].get(name)!r} there, {value!r} here"
            for name, value in self.settings().items()
            if state["settings"].get(name) != value
        ]
        if differences:
            raise ValueError(
                "the state_dict was saved by a PackedDataset with other settings: " + "; ".join(differences)
            )
        self.epoch = state["epoch"]
        self._states = dict(state["shards"])
        self._pending = {"shards": dict(state["shards"]), "rotation": state.get("rotation", 0)}

    def state_after(self, batches: int, *, num_workers: int = 0) -> dict[str, Any]:
        """The state of a plain ``DataLoader(self, batch_size=None, num_workers=...)`` after it yielded ``batches``.

        A plain ``DataLoader`` takes a batch from each worker in turn (a
        worker that runs out drops out of the turns), and its workers' state
        never reaches the main process; this replays each worker's packing
        (document lengths only, no batch is built) to find where each one
        stands. Pass the result to :meth:`load_state_dict` of a fresh
        dataset with the same settings, before wrapping it in a
        ``DataLoader`` with the same ``num_workers``.

        Raises:
            ValueError: ``batches`` is negative, or past the batches this
                rank yields in the epoch (a global step count, say): the
                resumed epoch would yield nothing.
        """
        batches = check_int(batches, "batches", minimum=0)
        num_workers = check_int(num_workers, "num_workers", minimum=0)
        workers = max(num_workers, 1)
        shards = [self._shard(worker, num_workers) for worker in range(workers)]

        def sent(shard: _Shard) -> Iterator[dict[str, Any]]:
            """The shard's state after each batch it sends."""
            return (state for step, state in self._sent(shard, None, True) if step is not None)

        totals = [sum(1 for _ in itertools.islice(sent(shard), batches)) for shard in shards]
        if batches > sum(totals):  # the epoch's batches, counted up to one past the end
            raise ValueError(
                f"batches must be at most the {sum(totals)} batches this rank's DataLoader yields in epoch "
                f"{self.epoch} (the batches the training loop consumed in the epoch), got {batches}"
            )
        taken = [0] * workers
        for _, worker in zip(range(batches), _turns(totals), strict=False):
            taken[worker] += 1
        states = {}
        for shard, count in zip(shards, taken, strict=True):
            states[shard.key] = next(itertools.islice(sent(shard), count - 1, None)) if count else _fresh_state()
        # A new DataLoader starts its turns at worker 0: rotate the shards so its worker 0 takes the one whose
        # turn is next (the turns go round the same cycle), and the batches come in the uninterrupted order.
        following = next(itertools.islice(_turns(totals), batches, None), 0) if batches else 0
        return {
            "version": _STATE_VERSION,
            "settings": self.settings(),
            "epoch": self.epoch,
            "shards": states,
            "rotation": following,
        }

    def batches_per_rank(self, epoch: int | None = None) -> int:
        """The batches every rank yields in ``epoch`` (this dataset's epoch by default), with any number of workers.

        ``ceil(N / world)`` for the ``N`` batches of the epoch's plan, or
        with ``drop_last=True`` ``N' // world`` for its ``N'`` full ones
        (NOTE [How the loader shards and resumes]). It replays the plan over
        the documents' lengths (every document's length is read once, no
        batch is built); the dataset's own state is left alone.
        """
        replay = copy.copy(self)
        replay.set_epoch(self.epoch if epoch is None else epoch)
        state = _fresh_state()
        reader = _Reader(replay, 0, state, lengths_only=True, whole=False)
        end = next(step for step in replay._plan(state, reader, lambda number: False) if isinstance(step, _End))
        return replay._per_rank(end)

    # ---------------------------------------------------------------- iteration

    def _shard(self, worker: int, num_workers: int) -> _Shard:
        workers = max(num_workers, 1)
        return _Shard(worker * self.world + self.rank, self.world * workers, f"{worker}/{workers}")

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        info = get_worker_info()
        pending, self._pending = self._pending, None
        if info is None:
            shard = self._shard(0, 0)
        else:
            if self._worker_iterated:  # raised at the first batch, which the DataLoader hands to the main process
                return _refused(
                    RuntimeError(
                        "PackedDataset iterated again in the same DataLoader worker (persistent_workers=True): "
                        "set_epoch and load_state_dict in the main process never reach a persistent worker's "
                        "copy, so this epoch would repeat the last one's batches; use persistent_workers=False"
                    )
                )
            self._worker_iterated = True
            rotation = pending.get("rotation", 0) if pending is not None else 0
            shard = self._shard((info.id + rotation) % info.num_workers, info.num_workers)
        return _PackedIterator(self, shard, pending)

    def _order(self) -> torch.Tensor | range:
        """The epoch's documents in order: a ``range`` without ``shuffle`` (nothing held per document)."""
        count = self._examples.count
        if not self.shuffle:
            return range(count)
        generator = torch.Generator().manual_seed((self.seed * 1_000_003 + self.epoch) % (2**63))
        return torch.randperm(count, generator=generator)

    def _per_rank(self, end: _End) -> int:
        """The batches each rank yields in an epoch whose plan ends at ``end`` (the remainder rule)."""
        if self.drop_last:
            return (end.total - end.partial) // self.world
        return -(-end.total // self.world)

    def _plan(
        self,
        state: Mapping[str, Any],
        reader: _Reader,
        own: Callable[[int], bool],
        on_window: Callable[[Window], None] | None = None,
    ) -> Iterator[_Step | _End]:
        """The epoch's batches from ``state`` on, every shard's, then its :class:`_End`.

        A window's lengths make its plan; the tokens of the batches ``own``
        takes (by number) are read once per window, into the steps' store.
        ``on_window`` sees each window packed.
        """
        state = dict(state)
        resumed = state.get("lengths")  # a restored shard's window, read again: its lengths must be the same
        check_carried = True
        while True:
            carry = _carry_from_state(state["carry"])
            tokens, final = reader.window(state["position"], self.window)
            lengths = _fingerprint(tokens.length)
            if resumed is not None and lengths != resumed:
                raise ValueError(
                    f"the state_dict does not match these examples: the documents of shard {reader.shard} from "
                    f"position {state['position']} on have other lengths than when the state was saved"
                )
            resumed = None
            if check_carried:  # the carried pieces of a restored shard
                reader.check_carried(carry)
                check_carried = False
            new = Items(tokens.document, torch.zeros_like(tokens.length), tokens.length, tokens.length)
            packed = pack_window(carry, new, self._budgets, self.batch, final)
            if on_window is not None:
                on_window(packed)
            first, emitted = state["batches"], state["emitted"]
            mine = [rows for index, rows in enumerate(packed.batches[emitted:], emitted) if own(first + index)]
            store = reader.store(packed, tokens, mine) if mine and not reader.lengths_only else None
            reader.keep(packed.carry)
            for index in range(emitted, len(packed.batches)):
                after = {**state, "emitted": index + 1, "lengths": lengths}
                yield _Step(packed, packed.batches[index], index, first + index, after, store)
            total = first + len(packed.batches)
            if final:
                yield _End(total, bool(packed.batches) and packed.batches[-1].shape[0] < self.batch)
                return
            state = {
                "position": state["position"] + tokens.document.shape[0],
                "emitted": 0,
                "batches": total,
                "finished": False,
                "carry": _carry_state(packed.carry),
            }

    def _sent(
        self,
        shard: _Shard,
        state: Mapping[str, Any] | None,
        lengths_only: bool,
        on_window: Callable[[Window], None] | None = None,
    ) -> Iterator[tuple[_Step | None, dict[str, Any]]]:
        """Each batch the shard sends from ``state``, with the state after it, then ``(None, the end's state)``."""
        state = dict(state or _fresh_state())
        if state["finished"]:
            return

        def own(number: int) -> bool:
            return number % shard.count == shard.index

        reader = _Reader(self, shard.index, state, lengths_only, whole=shard.count == 1)
        # With drop_last, the world batches before the plan's end wait until it is known whether they are sent.
        waiting: deque[_Step] = deque()
        for step in self._plan(state, reader, own, on_window):
            if isinstance(step, _End):
                end = step
                break
            waiting.append(step)
            while len(waiting) > (self.world if self.drop_last else 0):
                step = waiting.popleft()
                if own(step.number):
                    yield step, step.state
        sent = self._per_rank(end) * self.world  # the batches of the epoch, over all ranks
        for step in waiting:
            if step.number < sent and own(step.number):
                yield step, step.state
        for number in range(end.total, sent):  # the last round: the plan's first batches again
            if own(number):
                yield self._again(shard, number % end.total, lengths_only), _finished_state()
        yield None, _finished_state()

    def _again(self, shard: _Shard, number: int, lengths_only: bool) -> _Step:
        """Batch ``number`` of the epoch's plan, replayed from the epoch's start for ``shard``."""
        state = _fresh_state()
        reader = _Reader(self, shard.index, state, lengths_only, whole=False)
        return next(
            step
            for step in self._plan(state, reader, lambda wanted: wanted == number)
            if isinstance(step, _Step) and step.number == number
        )


def _refused(error: Exception) -> Iterator[Any]:
    """An iterator that raises ``error`` at its first ``next``."""
    raise error
    yield


def _turns(totals: list[int]) -> Iterator[int]:
    """The worker each consumed batch comes from, when workers take turns and drop out when they run out."""
    for turn in range(max(totals, default=0)):
        for worker, total in enumerate(totals):
            if turn < total:
                yield worker


def _store(*parts: Tokens) -> _Store:
    """The :class:`_Store` of the documents of ``parts`` (read with their tokens)."""
    document = torch.cat([part.document for part in parts])
    length = torch.cat([part.length for part in parts])
    tokens = torch.cat([part.tokens for part in parts])
    labels = None
    if any(part.labels is not None for part in parts):
        labels = torch.cat([part.tokens if part.labels is None else part.labels for part in parts])
    start = torch.cumsum(length, 0) - length
    document, order = torch.sort(document)
    return _Store(tokens, labels, document, start.index_select(0, order))


class _Reader:
    """Reads the epoch's documents a window at a time (their lengths), and the tokens of a shard's batches.

    Indexable examples are read by index: a window's lengths, then the
    documents of the shard's batches in it (the shard that takes every
    batch, ``whole``, reads each window's tokens with its lengths). A
    re-iterable is read in one pass; each window's examples, and those with
    pieces carried on, are held decoded until their batches are built.
    """

    def __init__(
        self, dataset: PackedDataset, shard: int, state: Mapping[str, Any], lengths_only: bool, whole: bool
    ) -> None:
        self.examples, self.shard, self.lengths_only = dataset._examples, shard, lengths_only
        self.whole = whole and not lengths_only
        self.order = dataset._order() if self.examples.count is not None else None
        self.stream: Iterator[tuple[int, object]] | None = None
        self.read = 0  # examples read from the stream (non-indexable examples)
        self.held: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}  # decoded examples of a stream
        self.wanted = set(state["carry"]["document"].tolist())  # a restored shard's carried documents

    def window(self, position: int, size: int) -> tuple[Tokens, bool]:
        """The documents of the window at ``position`` (lengths; tokens too when ``whole``), and whether it is last."""
        if self.order is not None:
            documents = self.order[position : position + size]
            documents = list(documents) if isinstance(documents, range) else documents.tolist()
            # As pack_stream: a window that reads fewer documents than its size is the last one.
            return self.examples.read(documents, lengths_only=not self.whole), len(documents) < size
        if self.stream is None:
            self.stream = self.examples.stream()
        while self.read < position:  # a restored shard: skip what was read before, keeping carried documents
            entry = next(self.stream, None)
            if entry is None:
                raise ValueError(
                    f"the state_dict does not match these examples: it resumes shard {self.shard} after "
                    f"{position} of its examples, and they hold {self.read}"
                )
            index, values = entry
            if index in self.wanted:
                self.held[index] = values
            self.read += 1
        chunk = list(itertools.islice(self.stream, size))
        self.read += len(chunk)
        if not self.lengths_only:
            self.held.update(chunk)
        return concatenate([index for index, _ in chunk], [values for _, values in chunk], True), len(chunk) < size

    def check_carried(self, carry: Carry) -> None:
        """Raise when a restored shard's carried pieces do not match these examples' documents."""
        documents = carry.items.document.tolist()
        if not documents:
            return
        unique = sorted(set(documents))
        if self.order is not None:
            held = dict(zip(unique, self.examples.read(unique, lengths_only=True).length.tolist(), strict=True))
        else:
            missing = [index for index in unique if index not in self.held]
            if missing:
                raise ValueError(
                    f"the state_dict does not match these examples: it carries a piece of example {missing[0]}, "
                    "which these examples do not reach"
                )
            held = {index: self.held[index][0].shape[0] for index in unique}
        for document, total in zip(documents, carry.items.total.tolist(), strict=True):
            if held[document] != total:
                raise ValueError(
                    f"the state_dict does not match these examples: it carries a piece of example {document} "
                    f"of {total} tokens, which has {held[document]} here"
                )

    def store(self, packed: Window, tokens: Tokens, batches: list[torch.Tensor]) -> _Store:
        """The tokens of the documents with pieces in ``batches`` (rows of the packed window)."""
        plan = packed.plan
        selected = torch.zeros(plan.rows, dtype=torch.bool).index_fill_(0, torch.cat(batches), True)
        pieces = torch.nonzero(selected.index_select(0, plan.row)).reshape(-1)
        documents = torch.unique(packed.items.document.index_select(0, plan.item.index_select(0, pieces)))
        if self.order is None:
            wanted = documents.tolist()
            return _store(concatenate(wanted, [self.held[index] for index in wanted], False))
        if tokens.tokens is None:
            return _store(self.examples.read(documents.tolist()))
        # A window read whole holds its own documents; those of pieces carried into it are read again.
        earlier = torch.nonzero(~torch.isin(documents, tokens.document)).reshape(-1)
        if not earlier.numel():
            return _store(tokens)
        return _store(tokens, self.examples.read(documents.index_select(0, earlier).tolist()))

    def keep(self, carry: Carry) -> None:
        """Forget the decoded examples of a stream but those with pieces carried into the next window."""
        if self.held:
            carried = set(carry.items.document.tolist())
            self.held = {index: values for index, values in self.held.items() if index in carried}


class _PackedIterator:
    """One shard's iterator: yields its batches; ``state_dict`` / ``load_state_dict`` as torchdata calls them."""

    def __init__(self, dataset: PackedDataset, shard: _Shard, pending: Mapping[str, Any] | None) -> None:
        self.dataset, self.shard = dataset, shard
        self.resume: dict[str, Any] | None = None
        self.batches: Iterator | None = None
        self.window_stats: tuple[Window, tuple[torch.Tensor, ...]] | None = None  # the window's packing_stats
        self.thrown = ThrownFill()  # over the windows packed, for FillWarning
        self.counted = False  # windows were counted since the last check
        if pending is not None:
            self._resume_from(pending)
        self.state = self.resume or _fresh_state()

    def _resume_from(self, state: Mapping[str, Any]) -> None:
        shards = state["shards"]
        if not shards:
            self.resume = None
            return
        if self.shard.key not in shards:
            raise ValueError(
                f"the state_dict holds the shards {sorted(shards)} (worker/workers), not {self.shard.key}: "
                "resume with the number of DataLoader workers it was saved with"
            )
        self.resume = shards[self.shard.key]

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": _STATE_VERSION,
            "settings": self.dataset.settings(),
            "epoch": self.dataset.epoch,
            "shards": {self.shard.key: self.state},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self.batches is not None:
            raise RuntimeError("load_state_dict must come before the iterator's first batch")
        self.dataset.load_state_dict(state)
        self.dataset._pending = None
        self._resume_from(state)
        self.state = self.resume or _fresh_state()

    def __iter__(self) -> _PackedIterator:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self.batches is None:
            self.batches = self.dataset._sent(self.shard, self.resume, False, self._count_fill)
        while True:
            step, state = next(self.batches)
            self.state = state
            self.dataset._states[self.shard.key] = state
            if not self.dataset._fill_warned and (
                step is None or (self.counted and self.thrown.rows >= FILL_WARNING_ROWS)
            ):
                self._check_fill()
            if step is not None:
                batch = _tensors(step, self.dataset)
                if self.dataset.packing_stats:
                    batch["packing_stats"] = self._stats(step.packed, step.index)
                return batch

    def _count_fill(self, packed: Window) -> None:
        """Count a window's rows (every shard counts the whole plan's) for :func:`~packfn.data.stats.fill_warning`."""
        if packed.batches and not self.dataset._fill_warned:
            self.thrown = self.thrown.plus(thrown_fill(packed.plan, torch.cat(packed.batches), self.dataset._budgets))
            self.counted = True

    def _check_fill(self) -> None:
        """Warn once when the cap or the budget threw fill away (:func:`~packfn.data.stats.fill_warning`)."""
        self.counted = False
        message = fill_warning(self.thrown, self.dataset._budgets)
        if message is not None:
            self.dataset._fill_warned = True
            warnings.warn(f"PackedDataset: {message}", FillWarning, stacklevel=3)

    def _stats(self, packed: Window, index: int) -> torch.Tensor:
        """``packing_stats`` of batch ``index`` of a packed window: the window's batches are counted at once."""
        if self.window_stats is None or self.window_stats[0] is not packed:
            plan, budgets = packed.plan, self.dataset._budgets
            # Without split every piece is a whole document.
            total = packed.items.total.index_select(0, plan.item) if budgets.split else None
            stats = batch_stats(
                plan.row,
                plan.length,
                total,
                plan.count,
                plan.closed,
                packed.batches,
                batch=self.dataset.batch,
                sequence=budgets.sequence,
                budget=budgets.budget,
            )
            self.window_stats = packed, stats_tensors(stats)
        return self.window_stats[1][index]


def _tensors(step: _Step, dataset: PackedDataset) -> dict[str, torch.Tensor]:
    """The batch dict of a step of the plan (see :class:`PackedDataset`)."""
    budgets, batch = dataset._budgets, dataset.batch
    sequence, cap = budgets.sequence, budgets.max_documents
    packed, store = step.packed, step.store
    result, _ = batch_and_items(packed.plan, packed.items, step.rows, batch, budgets)
    pieces = result.pieces
    # index_select / index_copy_, not advanced indexing: NOTE [No advanced indexing on the packing path] (fit.py)
    start = store.start.index_select(0, torch.searchsorted(store.document, pieces.document))
    source = token_positions(start + pieces.offset, pieces.length)
    target = token_positions(pieces.row * sequence + pieces.column, pieces.length)
    input_ids = torch.full((batch * sequence,), dataset.padding_token_id, dtype=torch.int64)
    input_ids.index_copy_(0, target, store.tokens.index_select(0, source))
    input_ids = input_ids.view(batch, sequence)
    document_ids = result.document_ids
    if store.labels is None:  # the labels are the tokens: the pieces' tokens are where the ids are not 0
        label_row = torch.where(document_ids == 0, IGNORE_INDEX, input_ids)
    else:
        label_row = torch.full((batch * sequence,), IGNORE_INDEX, dtype=torch.int64)
        label_row.index_copy_(0, target, store.labels.index_select(0, source))
        label_row = label_row.view(batch, sequence)
    # The packer's ids obey the mask rules: the op's rule flags need no check.
    positions, next_token, _ = _format_ops.document_positions_op(document_ids)
    slots = pieces.row * cap + pieces.slot
    documents = torch.full((batch, cap), -1, dtype=torch.int64)
    documents.view(-1).index_copy_(0, slots, pieces.document)
    offsets = torch.zeros(batch, cap, dtype=torch.int64)
    offsets.view(-1).index_copy_(0, slots, pieces.offset)
    return {
        "input_ids": input_ids,
        "labels": label_row,
        "shift_labels": shift_labels(label_row, next_token),
        "position_ids": positions,
        "document_ids": document_ids,
        "seq_lens": result.seq_lens,
        "seq_lens_padded": result.seq_lens_padded,
        "documents": documents,
        "document_offsets": offsets,
    }
