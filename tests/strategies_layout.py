"""Hypothesis strategies for document-length tables (aligned layouts), shared by the layout tests."""

from __future__ import annotations

from typing import NamedTuple

import torch
from hypothesis import strategies as st

CORE_ABSENT = (0,)
"""How the core marks an absent document slot."""
UPSTREAM_ABSENT = (0, -1000)
"""How NeMo AutoModel marks one (its ``packed_layout`` and the drop-in take both)."""
ALIGNMENTS = st.one_of(st.sampled_from([1, 2, 4, 8, 16, 64, 128, 256]), st.integers(1, 256))


class LayoutInput(NamedTuple):
    """Keyword arguments of ``packed_layout`` (plus ``seq_lens``) as plain Python data and tensors."""

    seq_lens: torch.Tensor
    seq_lens_padded: torch.Tensor | None
    input_shape: tuple[int, int]
    alignment: int
    minimum_length: int

    def kwargs(self) -> dict:
        return layout_kwargs(self.seq_lens_padded, self.input_shape, self.alignment, self.minimum_length)


def layout_kwargs(spans, input_shape, alignment, minimum_length=0) -> dict:
    """Keyword arguments of ``packed_layout`` (packfn's and upstream's)."""
    return {
        "seq_lens_padded": spans,
        "input_shape": input_shape,
        "alignment": alignment,
        "minimum_length": minimum_length,
    }


def _row_span(lengths: list[int], spans: list[int]) -> int:
    return sum(span for length, span in zip(lengths, spans, strict=True) if length not in UPSTREAM_ABSENT)


@st.composite
def length_tables(draw, *, max_batch: int = 6, max_documents: int = 12, max_length: int = 40, absent=CORE_ABSENT):
    """``(lengths, spans, padded)``: rows of real lengths with ``absent`` markers mixed in, and physical spans.

    ``padded`` says whether the spans hold inner padding (``seq_lens_padded``
    given) or equal the lengths (``seq_lens_padded`` omitted).
    """
    batch = draw(st.integers(1, max_batch))
    documents = draw(st.integers(0, max_documents))
    padded = draw(st.booleans())
    entry = st.one_of(st.sampled_from(absent), st.integers(1, 5), st.integers(1, max_length))
    lengths = [[draw(entry) for _ in range(documents)] for _ in range(batch)]
    spans = [
        [
            draw(st.sampled_from(absent)) if length in absent else length + (draw(st.integers(0, 6)) if padded else 0)
            for length in row
        ]
        for row in lengths
    ]
    return lengths, spans, padded


def _tensor(rows: list[list[int]], dtype: torch.dtype, one_dim: bool) -> torch.Tensor:
    table = torch.tensor(rows, dtype=torch.int64).reshape(len(rows), -1).to(dtype)
    return table[0] if one_dim else table


@st.composite
def layout_inputs(draw, *, broken: bool = False, absent=CORE_ABSENT) -> LayoutInput:
    """Valid ``packed_layout`` inputs, or (``broken=True``) inputs with one or more broken data rules.

    Covers batch 1..6, 0..12 document slots, the ``absent`` markers, inner
    padding or none, ``[documents]`` tables for batch one, int32 and int64
    (independently for lengths and spans), alignment 1..256, minimum_length
    below and above the need, and input rows with slack past the last span.
    """
    lengths, spans, padded = draw(length_tables(absent=absent))
    if broken:
        cells = [(row, column) for row in range(len(lengths)) for column in range(len(lengths[row]))]
        kinds = ["past_row"] + (["negative", "short_span", "absent_with_span"] if cells else [])
        for _ in range(draw(st.integers(1, 3))):
            kind = draw(st.sampled_from(kinds))
            if kind == "past_row":
                continue  # applied through the row length below
            row, column = draw(st.sampled_from(cells))
            if kind == "negative":
                lengths[row][column] = draw(st.integers(-7, -1))
                spans[row][column] = lengths[row][column] if not padded else draw(st.integers(-7, 3))
            elif kind == "short_span":
                padded = True
                lengths[row][column] = draw(st.integers(2, 20))
                spans[row][column] = lengths[row][column] - draw(st.integers(1, 2))
            else:
                padded = True
                lengths[row][column] = draw(st.sampled_from(absent))
                spans[row][column] = draw(st.integers(1, 5))
        too_short = "past_row" in kinds and draw(st.booleans())
    else:
        too_short = False
    if not padded:
        spans = lengths
    batch = len(lengths)
    widest = max(max(0, _row_span(row, span)) for row, span in zip(lengths, spans, strict=True))
    sequence = max(0, widest - draw(st.integers(1, 5))) if too_short else widest + draw(st.integers(0, 8))
    one_dim = batch == 1 and draw(st.booleans())
    seq_lens = _tensor(lengths, draw(st.sampled_from([torch.int32, torch.int64])), one_dim)
    seq_lens_padded = _tensor(spans, draw(st.sampled_from([torch.int32, torch.int64])), one_dim) if padded else None
    alignment = draw(ALIGNMENTS)
    minimum_length = draw(st.one_of(st.integers(-5, 8), st.integers(0, 600)))
    return LayoutInput(seq_lens, seq_lens_padded, (batch, sequence), alignment, minimum_length)


def round_trip_inputs(sequence: int, trailing: tuple[int, ...], absent: int = 0):
    """Length tables ``[2, 3]`` whose first row fills ``sequence``, and values ``[2, sequence, *trailing]``."""
    lens = torch.tensor([[3, 5, sequence - 8], [1, absent, 2]])
    values = torch.randn(2, sequence, *trailing, generator=torch.Generator().manual_seed(sequence))
    return lens, values


def random_values(shape, dtype, seed=0):
    """Activations of any dtype for pack / restore / unpad / pad: random, reproducible from ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=generator) > 0.5
    if not dtype.is_floating_point:
        return torch.randint(-100, 100, shape, generator=generator, dtype=dtype)
    return torch.randn(shape, generator=generator).to(dtype)


LAYOUT_FIELDS = ("source_indices", "input_positions", "position_ids", "sequence_ids")
"""The tensor fields of a ``PackedSequenceLayout`` (packfn's and upstream's)."""


def layout_fields(layout) -> tuple[torch.Tensor, ...]:
    """A layout's :data:`LAYOUT_FIELDS`, in order."""
    return tuple(getattr(layout, name) for name in LAYOUT_FIELDS)
