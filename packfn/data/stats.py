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
from packfn._utils import round_up
from packfn.data.batch import CLOSED_BUDGET, CLOSED_BY, CLOSED_DOCUMENTS, PackedBatch
from packfn.data.fit import Budgets, Plan

__all__ = [
    "FILL_WARNING_ROWS",
    "FILL_WARNING_SHARE",
    "STATS_FIELDS",
    "FillWarning",
    "PackingStats",
    "ThrownFill",
    "batch_stats",
    "fill_warning",
    "packing_stats",
    "stats_dict",
    "stats_tensors",
    "thrown_fill",
]

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


FILL_WARNING_SHARE = 0.1
"""The share of the input columns that the rows closed by the cap (or by the budget) may leave empty before
:class:`~packfn.data.PackedDataset` warns (see :func:`fill_warning`)."""

FILL_WARNING_ROWS = 64
"""The rows the loader sends before it judges :data:`FILL_WARNING_SHARE` (it also judges at the end of an
iteration)."""


class FillWarning(UserWarning):
    """``max_documents`` or ``budget`` left much of the packed rows empty (the loader warns once per dataset)."""


class ThrownFill(NamedTuple):
    """Input columns the rows closed by the cap and by the budget left empty, among rows sent (counts add up).

    Attributes:
        rows: Rows sent.
        real_tokens: Their real tokens.
        cap_rows, cap_columns: The rows the cap closed, and the input
            columns they leave empty beyond their documents' spans and
            aligned widths.
        budget_rows, budget_columns: The same for the budget.
    """

    rows: int = 0
    real_tokens: int = 0
    cap_rows: int = 0
    cap_columns: int = 0
    budget_rows: int = 0
    budget_columns: int = 0

    def plus(self, other: ThrownFill) -> ThrownFill:
        return ThrownFill(*(mine + theirs for mine, theirs in zip(self, other, strict=True)))


def thrown_fill(plan: Plan, rows: torch.Tensor, budgets: Budgets) -> ThrownFill:
    """:class:`ThrownFill` of ``rows`` (int64 ``[n]``, the rows a window sends) of a window's packing."""

    def per_row(values: torch.Tensor) -> torch.Tensor:
        return torch.zeros(plan.rows, dtype=torch.int64).index_add_(0, plan.row, values).index_select(0, rows)

    aligned = per_row(round_up(plan.length, budgets.alignment))
    left = torch.clamp(budgets.sequence - torch.maximum(per_row(plan.span), aligned), min=0)
    closed = plan.closed.index_select(0, rows)
    by_cap, by_budget = closed == CLOSED_DOCUMENTS, closed == CLOSED_BUDGET
    return ThrownFill(
        rows=rows.shape[0],
        real_tokens=int(per_row(plan.length).sum()),
        cap_rows=int(by_cap.sum()),
        cap_columns=int(torch.where(by_cap, left, 0).sum()),
        budget_rows=int(by_budget.sum()),
        budget_columns=int(torch.where(by_budget, left, 0).sum()),
    )


def fill_warning(thrown: ThrownFill, budgets: Budgets) -> str | None:
    """The warning when the rows one limit closed leave more than :data:`FILL_WARNING_SHARE` of the columns empty.

    The criterion (docs/packer.md, "When the cap or the budget throws fill
    away"): a row closed by the cap (``closed_by`` ``"documents"``) or by
    the budget (``"budget"``) still had input columns for another document
    of its window. What a looser limit could have filled there is the row's
    input columns beyond its documents' spans and aligned widths,
    ``sequence - max(spans, aligned sizes)`` (:func:`thrown_fill`). Under a
    budget of at least the row length (the default) a row the budget closed
    has less than one aligned document there, the slack of any full row,
    and under a cap that suits the lengths few rows close at the cap; a cap
    too small for the lengths, or a budget narrower than the row, leaves
    most of each row there. The loader adds these columns up over the rows
    its windows send (a small window's few rows say little alone) and asks
    once it has sent :data:`FILL_WARNING_ROWS` rows, and at the end of an
    iteration; it warns once per dataset.

    Args:
        thrown: The columns, added up over the rows sent.
        budgets: The packing's budgets.

    Returns:
        A message naming each limit whose rows leave more than
        :data:`FILL_WARNING_SHARE` of the input columns empty, how many rows
        it closed, that share and the rows' fill; None when neither does,
        or no row was sent.
    """
    columns = thrown.rows * budgets.sequence
    named = [
        (f"{limit} closed {rows} of them, leaving {empty / columns:.1%}", advice)
        for limit, rows, empty, advice in (
            (f"max_documents={budgets.max_documents}", thrown.cap_rows, thrown.cap_columns, "a larger max_documents"),
            (f"budget={budgets.budget}", thrown.budget_rows, thrown.budget_columns, "a wider budget"),
        )
        if columns and empty > FILL_WARNING_SHARE * columns
    ]
    if not named:
        return None
    return (
        f"of the {thrown.rows} rows packed (fill {thrown.real_tokens / columns:.3f} of rows x "
        f"sequence={budgets.sequence}), {' and '.join(closed for closed, _ in named)} of their input columns empty "
        f"while they had room for another document. {' or '.join(advice for _, advice in named).capitalize()} "
        "fills them: packfn.suggest_budgets proposes a cap and a budget from a sample of the document lengths "
        "(docs/packer.md, 'When the cap or the budget throws fill away')"
    )
