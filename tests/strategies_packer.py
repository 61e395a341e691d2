"""Hypothesis strategies for the packer and the loader: static budgets, document lengths, tokenized documents.

Each strategy draws only inputs the tests' assertions handle: without
``split`` every document fits an empty row (so packing never raises), and
token ids are positive (so a 0 in ``input_ids`` is padding).
"""

from __future__ import annotations

from typing import NamedTuple

from hypothesis import strategies as st

ALIGNMENTS = (1, 2, 3, 4, 8, 16, 128)


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class Budgets(NamedTuple):
    """The packer's static budgets, as keyword arguments of ``pack_documents`` / ``PackedDataset``."""

    sequence: int
    alignment: int
    max_documents: int
    budget: int | None
    pad_to_multiple_of: int

    def kwargs(self) -> dict:
        return dict(self._asdict())

    @property
    def resolved_budget(self) -> int:
        return round_up(self.sequence, self.alignment) if self.budget is None else self.budget

    @property
    def longest_unsplit(self) -> int:
        """The longest document an empty row holds (its span and its aligned size both fit)."""
        multiple = self.pad_to_multiple_of
        return min(self.sequence // multiple * multiple, self.resolved_budget)

    @property
    def one_budget(self) -> bool:
        """Whether the aligned budget implies the input one (best fit then keys rows by aligned room alone)."""
        multiple = self.pad_to_multiple_of
        return self.alignment % multiple == 0 and self.resolved_budget <= self.sequence


@st.composite
def budgets(draw, *, max_sequence: int = 96) -> Budgets:
    sequence = draw(st.integers(1, max_sequence))
    alignment = draw(st.sampled_from(ALIGNMENTS))
    max_documents = draw(st.integers(1, 8))
    budget = draw(st.one_of(st.none(), st.integers(1, 8).map(lambda blocks: blocks * alignment)))
    multiple = draw(st.sampled_from([1, 1, 2, 3, 4, 8]).filter(lambda m: m <= sequence))
    return Budgets(sequence, alignment, max_documents, budget, multiple)


@st.composite
def packing_inputs(draw, *, split: bool, max_documents: int = 24, max_sequence: int = 96) -> tuple[Budgets, list[int]]:
    """Budgets and lengths; without ``split`` every length fits an empty row."""
    limits = draw(budgets(max_sequence=max_sequence))
    longest = 3 * max(limits.sequence, limits.resolved_budget) if split else limits.longest_unsplit
    lengths = draw(st.lists(st.integers(1, longest), min_size=1, max_size=max_documents))
    return limits, lengths


@st.composite
def token_documents(draw, *, longest: int, max_documents: int = 30) -> list[list[int]]:
    """Documents of positive token ids, each tagged by its index (``1000 * (index + 1) + position``)."""
    lengths = draw(st.lists(st.integers(1, longest), min_size=1, max_size=max_documents))
    return [[1000 * (index + 1) + position for position in range(length)] for index, length in enumerate(lengths)]
