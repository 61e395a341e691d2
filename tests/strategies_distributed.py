"""Hypothesis strategies for context-parallel shards of packed batches."""

from __future__ import annotations

from typing import NamedTuple

import torch
from hypothesis import strategies as st

import packfn

from tests.strategies_layout import length_tables


class ShardCase(NamedTuple):
    """Keyword arguments of ``shard_packed_batch`` (plus the length tables), always valid."""

    seq_lens: torch.Tensor
    seq_lens_padded: torch.Tensor | None
    input_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    rank: int
    world: int
    budget: int
    alignment: int

    def kwargs(self) -> dict:
        fields = self._asdict()
        return {
            name: fields[name] for name in ("input_ids", "labels", "loss_mask", "rank", "world", "budget", "alignment")
        }


@st.composite
def shard_cases(draw, *, max_world: int = 4) -> ShardCase:
    """Valid length tables (absent slots, inner padding), 1..``max_world`` ranks and a budget every input fits.

    The budget is the worst-case aligned length rounded up to a multiple of
    ``world * alignment``, plus 0..2 more such multiples (rows with slack).
    """
    lengths, spans, padded = draw(length_tables(max_batch=3, max_documents=5, max_length=12))
    batch = len(lengths)
    widest = max(
        (
            sum(span for length, span in zip(row, row_spans, strict=True) if length > 0)
            for row, row_spans in zip(lengths, spans, strict=True)
        ),
        default=0,
    )
    sequence = max(1, widest + draw(st.integers(0, 4)))
    world = draw(st.integers(1, max_world))
    alignment = draw(st.sampled_from([1, 2, 4]))
    unit = world * alignment
    fits = packfn.safe_budget(sequence, len(lengths[0]), alignment)
    budget = (fits + unit - 1) // unit * unit + unit * draw(st.integers(0, 2))
    seed = draw(st.integers(0, 2**16))
    generator = torch.Generator().manual_seed(seed)
    return ShardCase(
        seq_lens=torch.tensor(lengths, dtype=torch.int64).reshape(batch, -1),
        seq_lens_padded=torch.tensor(spans, dtype=torch.int64).reshape(batch, -1) if padded else None,
        input_ids=torch.randint(1, 1000, (batch, sequence), generator=generator),
        labels=torch.randint(0, 1000, (batch, sequence), generator=generator),
        loss_mask=torch.rand(batch, sequence, generator=generator),
        rank=draw(st.integers(0, world - 1)),
        world=world,
        budget=budget,
        alignment=alignment,
    )
