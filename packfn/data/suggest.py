"""Choosing the budgets: the aligned row length and the document cap a length distribution needs."""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import torch

from packfn._checks import check_positive_int
from packfn._utils import cdiv, round_up
from packfn.data.fit import Items, Plan, checked_budgets, lengths_tensor
from packfn.data.packer import plan_rows

__all__ = ["BudgetSuggestion", "suggest_budgets"]


class BudgetSuggestion(NamedTuple):
    """Budgets proposed by :func:`suggest_budgets` for a length distribution, and what they cost.

    Attributes:
        budget: Aligned row length to pass to the packer and to
            :func:`packfn.aligned_layout`.
        max_documents: Document cap to pass to the packer and the metadata ops.
        rows: Rows the sample packs into under both.
        fill: Real tokens over the input rows, ``tokens / (rows * sequence)``.
        fill_ratio: Real tokens over the aligned rows, ``tokens / (rows * budget)``.
        unlimited_rows: Rows with no cap and no aligned budget (only the input
            row's columns: the best any budgets can do, up to the packer).
        lower_bound_rows: ``ceil(tokens / sequence)``.
        most_documents: The most documents a row holds with no cap.
    """

    budget: int
    max_documents: int
    rows: int
    fill: float
    fill_ratio: float
    unlimited_rows: int
    lower_bound_rows: int
    most_documents: int


def suggest_budgets(
    lengths: Iterable[int],
    *,
    sequence: int,
    alignment: int = 1,
    pad_to_multiple_of: int = 1,
    tolerance: float = 0.01,
) -> BudgetSuggestion:
    """Propose a ``budget`` and the smallest ``max_documents`` that costs under ``tolerance`` of the fill.

    A cap too small for the length distribution collapses fill (at
    ``max_documents=16``, rows of 8192 columns hold about 1,500 tokens of
    documents averaging 96; the loader warns of it with
    :class:`~packfn.data.FillWarning`); a budget no wider than the row loses what
    alignment rounds away. This packs a sample of lengths (best fit,
    ``split=True``) a few times over:

    1. the budget: of the multiples of ``alignment`` from
       ``round_up(sequence, alignment)`` to twice that (17 of them at most,
       evenly spaced), the one whose rows carry the most real tokens per
       aligned column, ``tokens / (rows * budget)``, with no cap (the
       narrowest on a tie): a wider budget holds more documents per row but
       makes every row, and its attention, wider;
    2. the cap: under that budget, the smallest cap (by bisection) whose rows
       are at most ``rows(no cap) / (1 - tolerance)``.

    Args:
        lengths: A sample of document lengths (a few thousand are plenty;
            each pass is a pack of the whole sample).
        sequence: Input row length.
        alignment: Alignment of document starts in the aligned rows.
        pad_to_multiple_of: Physical span multiple (as the packer's).
        tolerance: Fraction of fill the cap may cost, in ``[0, 1)``.

    Returns:
        :class:`BudgetSuggestion`. Example: for 20,000 exponential lengths of
        mean 96 at ``sequence=8192, alignment=1``, ``max_documents=87``
        (rows hold 85 documents on average; under 16 they hold 1,500 tokens).

    Raises:
        TypeError, ValueError: as :func:`pack_documents`; a ``tolerance``
            outside ``[0, 1)``; an empty sample.
    """
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0 <= tolerance < 1:
        raise ValueError(f"tolerance must be a number in [0, 1), got {tolerance!r}")
    sequence = check_positive_int(sequence, "sequence")
    alignment = check_positive_int(alignment, "alignment")
    multiple = check_positive_int(pad_to_multiple_of, "pad_to_multiple_of")
    values = lengths_tensor(lengths)
    if not values.numel():
        raise ValueError("suggest_budgets needs at least one length")
    count = values.shape[0]
    items = Items(torch.arange(count), torch.zeros(count, dtype=torch.int64), values, values)
    no_carry = torch.zeros(0, dtype=torch.int64)
    most = max(1, sequence // multiple)  # a row never holds more documents (each takes a span of at least one multiple)
    tokens = int(values.sum())

    def rows(budget: int, cap: int) -> Plan:
        return plan_rows(items, no_carry, checked_budgets(sequence, alignment, cap, budget, multiple, True))

    narrowest = cdiv(sequence, alignment)  # in blocks of alignment columns
    step = max(1, cdiv(narrowest, 16))
    candidates = range(narrowest, 2 * narrowest + 1, step)
    plans = {blocks * alignment: rows(blocks * alignment, most) for blocks in candidates}
    budget = max(plans, key=lambda width: (tokens / (plans[width].rows * width), -width))
    uncapped = plans[budget]
    widest = round_up(sequence, alignment) + most * (alignment - 1) // alignment * alignment
    unlimited = rows(widest, most).rows  # only the input columns bind
    most_documents = int(uncapped.count.max())
    low, high = 1, most_documents
    while low < high:
        middle = (low + high) // 2
        if rows(budget, middle).rows <= uncapped.rows / (1 - tolerance):
            high = middle
        else:
            low = middle + 1
    chosen = rows(budget, low).rows
    return BudgetSuggestion(
        budget=budget,
        max_documents=low,
        rows=chosen,
        fill=tokens / (chosen * sequence),
        fill_ratio=tokens / (chosen * budget),
        unlimited_rows=unlimited,
        lower_bound_rows=cdiv(tokens, sequence),
        most_documents=most_documents,
    )
