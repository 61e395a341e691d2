"""How well a batch is packed: fill, documents per row, split pieces and what closed each row.

:func:`packing_stats` reads a :class:`~packfn.data.PackedBatch`;
:class:`~packfn.data.PackedDataset` puts the same numbers in every batch it
yields, as the float64 tensor ``batch["packing_stats"]`` (one entry per name
of :data:`STATS_FIELDS`, in that order), so they travel through
``DataLoader`` workers with the batch. :func:`stats_dict` reads one such
tensor, or a stack of them, back::

    stats = stats_dict(batch["packing_stats"])
    stats["fill"], stats["documents_mean"], stats["closed_documents"]
    stats_dict(torch.stack(logged))     # many batches: counts summed, fills over the summed columns

Every field but the ratios is a count that adds up over batches (or, for
``documents_max``, a maximum), so a stack combines exactly; the ratios are
recomputed from the sums.
"""

from __future__ import annotations

import array
import itertools
from collections import Counter
from collections.abc import Sequence
from typing import NamedTuple

import torch

from packfn._checks import check_tensor
from packfn.data.batch import CLOSED_BY, PackedBatch

__all__ = ["STATS_FIELDS", "PackingStats", "batch_stats", "packing_stats", "stats_dict", "stats_tensors"]

_RATIOS = ("fill", "aligned_fill", "documents_mean")
_CLOSED_FIELDS = tuple(f"closed_{reason}" for reason in CLOSED_BY)
_CODES = {reason: code for code, reason in enumerate(CLOSED_BY)}


class PackingStats(NamedTuple):
    """The packing of one batch (or of several, combined by :meth:`from_tensor`).

    Attributes:
        fill: Real tokens over the input columns, ``real_tokens / columns``.
        aligned_fill: Real tokens over the aligned columns,
            ``real_tokens / aligned_columns`` (:attr:`PackedBatch.fill_ratio`).
        documents_mean: Documents per row, over the rows that hold any
            (0.0 when none does).
        documents_max: The most documents a row holds.
        split_pieces: Pieces that are not a whole document (``split=True``
            cut their document).
        closed_tokens, closed_budget, closed_documents, closed_end: Rows
            that each reason of :data:`~packfn.data.CLOSED_BY` closed
            (all-padding rows left out, as :meth:`PackedBatch.limits`).
        real_tokens: Real (non-padding) tokens.
        documents: Documents in the rows, each piece of a split document
            counted as one (it is one for attention).
        rows: Rows, all-padding rows included.
        columns: ``rows * sequence``.
        aligned_columns: ``rows * budget``.
    """

    fill: float
    aligned_fill: float
    documents_mean: float
    documents_max: int
    split_pieces: int
    closed_tokens: int
    closed_budget: int
    closed_documents: int
    closed_end: int
    real_tokens: int
    documents: int
    rows: int
    columns: int
    aligned_columns: int

    def tensor(self) -> torch.Tensor:
        """float64 ``[len(STATS_FIELDS)]``: the fields in order (exact: every count is below ``2**53``)."""
        return torch.tensor(self, dtype=torch.float64)

    def limits(self) -> Counter[str]:
        """How many rows each reason closed, as :meth:`PackedBatch.limits` counts them (zero counts left out)."""
        counts = zip(CLOSED_BY, (getattr(self, name) for name in _CLOSED_FIELDS), strict=True)
        return Counter({reason: count for reason, count in counts if count})

    @classmethod
    def from_tensor(cls, values: torch.Tensor) -> PackingStats:
        """Read :meth:`tensor`'s form back: float ``[len(STATS_FIELDS)]``, or ``[..., len(STATS_FIELDS)]`` combined.

        Args:
            values: One batch's ``packing_stats``, or a stack of them (any
                leading shape, for example ``[batches, F]`` from
                ``torch.stack``).

        Returns:
            The stats of all of them together: counts summed,
            ``documents_max`` the largest, and the ratios recomputed from
            the sums (a fill over all their columns, not a mean of fills).

        Raises:
            TypeError: ``values`` is not a floating tensor.
            ValueError: its last axis is not ``len(STATS_FIELDS)`` long, or
                it holds no batch.
        """
        check_tensor(values, "values")
        if not values.is_floating_point():
            raise TypeError(f"values must be a floating tensor (packing_stats is float64), got {values.dtype}")
        if values.ndim == 0 or values.shape[-1] != len(STATS_FIELDS):
            raise ValueError(
                f"values must have shape [..., {len(STATS_FIELDS)}] (one entry per STATS_FIELDS name), "
                f"got {tuple(values.shape)}"
            )
        flat = values.detach().to("cpu", torch.float64).reshape(-1, len(STATS_FIELDS))
        if flat.shape[0] == 0:
            raise ValueError("values holds no batch's stats")
        totals = dict(zip(STATS_FIELDS, flat.sum(0).tolist(), strict=True))
        counts = {name: round(value) for name, value in totals.items() if name not in _RATIOS}
        counts["documents_max"] = round(flat[:, STATS_FIELDS.index("documents_max")].max().item())
        filled = sum(counts[name] for name in _CLOSED_FIELDS)
        return cls(
            fill=_ratio(counts["real_tokens"], counts["columns"]),
            aligned_fill=_ratio(counts["real_tokens"], counts["aligned_columns"]),
            documents_mean=_ratio(counts["documents"], filled),
            **counts,
        )


STATS_FIELDS: tuple[str, ...] = PackingStats._fields
"""The names of the entries of ``batch["packing_stats"]`` (:meth:`PackingStats.tensor`), in order."""


def _ratio(numerator: int, denominator: int) -> float:
    return numerator / denominator if denominator else 0.0


def batch_stats(
    row: torch.Tensor,
    length: torch.Tensor,
    total: torch.Tensor | None,
    documents: torch.Tensor,
    closed: torch.Tensor,
    batches: Sequence[torch.Tensor],
    *,
    batch: int,
    sequence: int,
    budget: int,
) -> list[PackingStats]:
    """The stats of the batches cut from one packing (what the loader and :func:`packing_stats` share).

    NOTE [Packing stats: one host read a window]
    A loader's window packs the rows of several batches. Their stats take
    a few ops over the window's pieces (per row: real tokens, split pieces)
    and a host read of the per-row columns; each batch then adds up the
    entries of its rows, a handful of Python ints. Reducing per batch with
    tensor ops instead (index_add, bincount, scatter_reduce over the
    batches) takes some 25 small ops a window, each costing more than the
    sums it replaces: for short documents (a few batches a window) that is
    2% of the loader's time (docs/benchmarks.md has the figures).

    Args:
        row: int64 ``[pieces]``: each piece's row, in ``[0, rows)``.
        length: int64 ``[pieces]``: each piece's real tokens.
        total: int64 ``[pieces]``: the full length of each piece's
            document; None when every piece is a whole document.
        documents: int64 ``[rows]``: the pieces in each row.
        closed: int64 ``[rows]``: what closed each row, an index into
            :data:`~packfn.data.CLOSED_BY`.
        batches: int64 ``[n]`` each: the rows of each batch that hold a
            piece, ``n <= batch`` (the batch's other rows are all padding).
        batch: Rows per batch.
        sequence: Input row length.
        budget: Aligned row length.

    Returns:
        One :class:`PackingStats` per entry of ``batches``.
    """
    rows = closed.shape[0]
    per_row = [documents, torch.zeros(rows, dtype=torch.int64).index_add_(0, row, length)]
    if total is not None:
        per_row.append(torch.zeros(rows, dtype=torch.int64).index_add_(0, row, (length < total).long()))
    columns = [values.tolist() for values in (*per_row, closed)]
    return [_batch(columns, selected.tolist(), batch, sequence, budget) for selected in batches]


def stats_tensors(stats: Sequence[PackingStats]) -> tuple[torch.Tensor, ...]:
    """:meth:`PackingStats.tensor` of each, from one buffer: float64 ``[len(STATS_FIELDS)]`` each, none overlapping."""
    flat = torch.frombuffer(array.array("d", itertools.chain.from_iterable(stats)), dtype=torch.float64)
    return flat.view(len(stats), len(STATS_FIELDS)).unbind(0)


def _batch(columns: list[list[int]], selected: list[int], batch: int, sequence: int, budget: int) -> PackingStats:
    """The stats of the ``selected`` rows: ``columns`` hold per row its documents, real tokens, [split pieces,] code."""
    documents, real_tokens, *rest = ([column[index] for index in selected] for column in columns)
    codes = rest[-1]
    real, count = sum(real_tokens), sum(documents)
    return PackingStats(
        _ratio(real, batch * sequence),
        _ratio(real, batch * budget),
        _ratio(count, len(selected)),
        max(documents, default=0),
        sum(rest[0]) if len(rest) == 2 else 0,
        *(codes.count(code) for code in range(len(CLOSED_BY))),
        real,
        count,
        batch,
        batch * sequence,
        batch * budget,
    )


def packing_stats(packed: PackedBatch) -> PackingStats:
    """Fill, documents per row, split pieces and what closed each row, of a packed batch.

    Args:
        packed: A :class:`~packfn.data.PackedBatch` (from
            :func:`~packfn.pack_documents` or :func:`~packfn.pack_stream`).

    Returns:
        :class:`PackingStats`. For the example of
        :func:`~packfn.pack_documents` (lengths ``[4, 3, 12, 2, 7]`` in rows of
        16, alignment 4, cap 3): two rows, ``real_tokens=28``,
        ``fill=0.875``, ``documents_mean=2.5``, ``documents_max=3``,
        ``closed_tokens=1``, ``closed_documents=1``.

    Raises:
        TypeError: ``packed`` is not a ``PackedBatch``.
    """
    if not isinstance(packed, PackedBatch):
        raise TypeError(f"packed must be a PackedBatch, got {type(packed).__name__}")
    closed = torch.tensor([_CODES[reason] for reason in packed.closed_by], dtype=torch.int64)
    pieces = packed.pieces
    (stats,) = batch_stats(
        pieces.row,
        pieces.length,
        pieces.total,
        torch.bincount(pieces.row, minlength=packed.batch),
        closed,
        [torch.unique(pieces.row)],  # the rows that hold a piece
        batch=packed.batch,
        sequence=packed.sequence,
        budget=packed.budget,
    )
    return stats


def stats_dict(values: torch.Tensor | PackingStats) -> dict[str, int | float]:
    """``{name: value}`` of one batch's ``packing_stats`` tensor, or of a stack of them combined.

    Args:
        values: float ``[len(STATS_FIELDS)]`` (``batch["packing_stats"]``),
            ``[..., len(STATS_FIELDS)]`` (many batches, combined as
            :meth:`PackingStats.from_tensor` does), or a :class:`PackingStats`.

    Returns:
        The fields of :data:`STATS_FIELDS` in order: counts as ints, ratios as floats.

    Raises:
        TypeError, ValueError: as :meth:`PackingStats.from_tensor`.
    """
    stats = values if isinstance(values, PackingStats) else PackingStats.from_tensor(values)
    return stats._asdict()
