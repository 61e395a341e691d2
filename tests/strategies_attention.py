"""Hypothesis strategies and plain-torch references for the attention tests."""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from hypothesis import strategies as st

PACKED_DTYPES = (torch.int64, torch.int32, torch.uint8, torch.bool)


@st.composite
def packed_batches(draw, *, max_batch: int = 3, max_sequence: int = 24, dtypes=PACKED_DTYPES) -> torch.Tensor:
    """A ``[batch, sequence]`` mask as a packer writes it: whole documents, padding only between and after them.

    (No padding inside a document, so every representation, physical varlen
    included, sees the same documents.) Rows may be all padding.
    """
    dtype = draw(st.sampled_from(dtypes))
    batch = draw(st.integers(1, max_batch))
    sequence = draw(st.integers(1, max_sequence))
    rows = []
    for _ in range(batch):
        row: list[int] = []
        document = 0
        while len(row) < sequence:
            if draw(st.integers(0, 3)) == 0:
                row.extend([0] * draw(st.integers(1, 4)))
            elif dtype != torch.bool or document == 0:
                document += 1
                row.extend([document] * draw(st.integers(1, 9)))
            else:
                row.extend([0] * (sequence - len(row)))
        rows.append(row[:sequence])
    mask = torch.tensor(rows, dtype=torch.int64)
    return mask > 0 if dtype == torch.bool else mask.to(dtype)


def block_causal_reference(document_ids: torch.Tensor) -> torch.Tensor:
    """Bool ``[batch, 1, sequence, sequence]`` by loops: same id, key not after query, both valid."""
    batch, sequence = document_ids.shape
    ids = document_ids.to(torch.int64).tolist()
    mask = torch.zeros(batch, 1, sequence, sequence, dtype=torch.bool)
    for b in range(batch):
        for q in range(sequence):
            for k in range(q + 1):
                mask[b, 0, q, k] = ids[b][q] != 0 and ids[b][q] == ids[b][k]
    return mask


def document_spans(document_ids: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """``(row, positions)`` of every document, in row-major, id order."""
    spans = []
    for row, ids in enumerate(document_ids.to(torch.int64)):
        for document in ids.unique().tolist():
            if document:
                spans.append((row, (ids == document).nonzero().flatten()))
    return spans


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal SDPA of one sequence laid out ``[tokens, heads, dim]``."""
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
    return out.transpose(0, 1)


def per_document_attention(q, k, v, document_ids: torch.Tensor) -> torch.Tensor:
    """The ground truth: each document attended alone. ``[batch, sequence, heads, dim]``, zeros at padding."""
    out = torch.zeros_like(q)
    for row, positions in document_spans(document_ids):
        attended = causal_attention(q[row, positions], k[row, positions], v[row, positions])
        out = out.index_put((torch.tensor(row), positions), attended)
    return out


def segments_attention(q, k, v, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """A varlen reference: causal attention on each ``[cu_seqlens[i], cu_seqlens[i+1])`` of ``[tokens, ...]`` alone."""
    bounds = cu_seqlens.tolist()
    pieces = [causal_attention(q[a:b], k[a:b], v[a:b]) for a, b in itertools.pairwise(bounds) if b > a]
    tail = q.new_full((q.shape[0] - bounds[-1], *q.shape[1:]), float("nan"))  # what a varlen kernel leaves
    return torch.cat([*pieces, tail])
