"""Plain-torch reference implementations that the tests compare packfn with.

Loops and per-document calls, written for clarity, not speed: each is the
specification of what a packfn function or a packed representation must
compute (packing must not change the math).
"""

from __future__ import annotations

import inspect
import itertools
import math

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

import packfn

HEADS, DIM = 2, 8
"""Attention heads and head size of the attention references' inputs."""


# ------------------------------------------------------------------ masks


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


def _dense_to_ordered(dense):
    """``kv_num_blocks`` and ``kv_indices`` (present blocks ascending, then the others) of a dense block mask."""
    dense = dense.to(torch.int32)
    return dense.sum(dim=-1, dtype=torch.int32), torch.argsort(dense, dim=-1, descending=True, stable=True).to(
        torch.int32
    )


def create_reference_block_mask(mask, block_size, window, separate_full_blocks=True, positions=None):
    """torch's ``create_block_mask`` of :func:`packfn.document_mask_mod` (the ``sequence**2`` evaluation)."""
    batch, sequence = mask.shape
    mask_mod = packfn.document_mask_mod(mask, window=window, positions=positions)
    shape = (mask_mod, batch, 1, sequence, sequence)
    if "separate_full_blocks" in inspect.signature(create_block_mask).parameters:
        return create_block_mask(*shape, device="cpu", BLOCK_SIZE=block_size, separate_full_blocks=separate_full_blocks)
    # torch 2.11's create_block_mask has no separate_full_blocks argument (it
    # always separates them): the BlockMask without full blocks is built from
    # its dense mask, in create_block_mask's index order.
    reference = create_block_mask(*shape, device="cpu", BLOCK_SIZE=block_size)
    if separate_full_blocks:
        return reference
    return BlockMask.from_kv_blocks(
        *_dense_to_ordered(reference.to_dense()),
        BLOCK_SIZE=block_size,
        mask_mod=mask_mod,
        seq_lengths=(sequence, sequence),
    )


def varlen_dense_mask(cu_seqlens_q, cu_seqlens_k, queries, keys):
    """The ``[queries, keys]`` mask a varlen kernel applies (bottom-right causal per segment)."""
    mask = torch.zeros(queries, keys, dtype=torch.bool)
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for first_q, last_q, first_k, last_k in zip(bounds_q, bounds_q[1:], bounds_k, bounds_k[1:], strict=False):
        rows, cols = last_q - first_q, last_k - first_k
        assert 0 <= rows <= cols or rows == 0
        causal = torch.arange(cols) <= torch.arange(rows)[:, None] + (cols - rows)
        mask[first_q:last_q, first_k:last_k] = causal
    return mask


# --------------------------------------------------------- formats, labels


def position_ids_reference(mask: torch.Tensor) -> torch.Tensor:
    """By loops: rank among the document's valid tokens; padding continues the last valid token's count."""
    out = []
    for row in mask.to(torch.int64).tolist():
        seen: dict[int, int] = {}
        positions, last = [], None  # last: (column, position) of the last valid token
        for column, document in enumerate(row):
            if document:
                seen[document] = seen.get(document, -1) + 1
                last = (column, seen[document])
                positions.append(seen[document])
            else:
                positions.append(column if last is None else last[1] + column - last[0])
        out.append(positions)
    return torch.tensor(out, dtype=torch.int64).view(mask.shape)


def shift_labels_reference(mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """By loops: the label of the next valid token of the same document, else -100."""
    out = torch.full_like(labels, -100)
    for row, positions in document_spans(mask):
        out[row, positions[:-1]] = labels[row, positions[1:]]
    return out


# ------------------------------------------------------------------ layouts


def brute_force_safe_budget(sequence: int, documents: int, alignment: int, minimum_budget: int) -> int:
    """The longest row length of upstream's packed_layout rule over every valid table (order is irrelevant).

    Row length: ``max(minimum_budget, 1, sum of the lengths rounded up to alignment)`` rounded up to
    ``alignment``; a valid table holds at most ``documents`` present lengths summing to at most ``sequence``.
    """

    def partitions(tokens: int, parts: int, largest: int):
        # Multisets of at most `parts` positive lengths summing to at most `tokens`.
        yield ()
        if parts == 0:
            return
        for first in range(1, min(tokens, largest) + 1):
            for rest in partitions(tokens - first, parts - 1, first):
                yield (first, *rest)

    floor = -(-max(minimum_budget, 1) // alignment) * alignment
    longest = max(
        sum(-(-n // alignment) * alignment for n in table) for table in partitions(sequence, documents, sequence)
    )
    return max(floor, longest)


# ---------------------------------------------------------------- attention


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


def masked_attention(mask):
    """Dense attention with a ``[batch, queries, keys]`` mask (every row has a key: see the callers)."""

    def attend(q, k, v):
        scores = (q @ k.transpose(1, 2) / math.sqrt(q.shape[-1])).masked_fill(~mask, float("-inf"))
        return scores.softmax(-1) @ v

    return attend


def varlen_attention(cu_seqlens_q, cu_seqlens_k):
    """Reference varlen kernel: each segment alone, causal aligned bottom-right (flash-attn >= 2.1)."""

    def attend(q, k, v):
        batch, queries = q.shape[:2]
        q, k, v = q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)
        bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        pieces = []
        for first_q, last_q, first_k, last_k in zip(bounds_q, bounds_q[1:], bounds_k, bounds_k[1:], strict=False):
            if last_q == first_q:
                continue
            rows, cols = last_q - first_q, last_k - first_k
            causal = torch.arange(cols) <= torch.arange(rows)[:, None] + (cols - rows)
            scores = q[first_q:last_q] @ k[first_k:last_k].T / math.sqrt(q.shape[-1])
            pieces.append(scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v[first_k:last_k])
        out = torch.cat(pieces)
        assert out.shape[0] == batch * queries
        return out.view(batch, queries, -1)

    return attend


def heads_first(function):
    """An attention over ``[batch, heads, sequence, dim]`` as one over ``[batch, sequence, heads, dim]``."""

    def attention(q, k, v, mask):
        return function(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask).transpose(1, 2)

    return attention


def qkv(mask, dtype=torch.float64, seed=0):
    """Random ``[batch, sequence, HEADS, DIM]`` queries, keys and values that require grad."""
    generator = torch.Generator().manual_seed(seed)
    shape = (*mask.shape, HEADS, DIM)
    return [torch.randn(shape, generator=generator, dtype=dtype).requires_grad_() for _ in range(3)]


def cotangent(mask, dtype=torch.float64):
    """A random output gradient, zero at padding (the loss ignores padding tokens)."""
    generator = torch.Generator().manual_seed(1)
    grad = torch.randn(*mask.shape, HEADS, DIM, generator=generator, dtype=dtype)
    return grad * (mask != 0).reshape(*mask.shape, 1, 1)


def forward_backward(attention, mask, dtype=torch.float64):
    """Output and q/k/v gradients of ``attention(q, k, v, mask)``, all ``[batch, sequence, heads, dim]``."""
    q, k, v = qkv(mask, dtype)
    out = attention(q, k, v, mask)
    if not out.requires_grad:  # a batch without a valid token: nothing depends on q, k, v
        return out, tuple(torch.zeros_like(t) for t in (q, k, v))
    grads = torch.autograd.grad(out, (q, k, v), cotangent(mask, dtype), allow_unused=True, materialize_grads=True)
    return out, grads


# ------------------------------------------------------------ formats


def ids_from_lengths(sequence: int, rows: list[list[int]]) -> torch.Tensor:
    """int64 ``[batch, sequence]``: each row's documents (1-based, in order) over its first columns, then 0."""
    out = []
    for lengths in rows:
        row = [k for k, n in enumerate(lengths, start=1) for _ in range(n)]
        out.append(row + [0] * (sequence - len(row)))
    return torch.tensor(out, dtype=torch.int64).view(len(rows), sequence)


def next_token_reference(mask: torch.Tensor) -> torch.Tensor:
    """By loops: the flat index of the next valid token of each valid token's document in its row, else -1."""
    batch, sequence = mask.shape
    rows = mask.to(torch.int64).tolist()
    out = []
    for r, row in enumerate(rows):
        for column, document in enumerate(row):
            following = [c for c in range(column + 1, sequence) if row[c]]
            same = document and following and row[following[0]] == document
            out.append(r * sequence + following[0] if same else -1)
    return torch.tensor(out, dtype=torch.int64).view(batch, sequence)


def canonical_ids(mask: torch.Tensor) -> torch.Tensor:
    """The documents of a mask renumbered 1, 2, ... in each row (gaps dropped), 0 at padding."""
    out = []
    for row in mask.to(torch.int64).tolist():
        rank, previous, renumbered = 0, None, []
        for document in row:
            if document and document != previous:
                rank, previous = rank + 1, document
            renumbered.append(rank if document else 0)
        out.append(renumbered)
    return torch.tensor(out, dtype=torch.int64).view(mask.shape)


def eos_stream(sequence: int, rows: list[list[int]], eos: int, pad: int, tail: list[bool]) -> torch.Tensor:
    """Token rows: each document's tokens are ``eos + 1 + its index``, its last an EOS unless ``tail[row]``
    leaves the row's last document open; ``pad`` fills the rest."""
    out = []
    for lengths, open_tail in zip(rows, tail, strict=True):
        row = []
        for k, n in enumerate(lengths):
            tokens = [eos + 2 + (k + j) % 5 for j in range(n)]
            if not (open_tail and k == len(lengths) - 1):
                tokens[-1] = eos
            row.extend(tokens)
        out.append(row + [pad] * (sequence - len(row)))
    return torch.tensor(out, dtype=torch.int64).view(len(rows), sequence)


def physical_segments(mask: torch.Tensor) -> list[int]:
    """Flat boundaries of the runs of equal ids over ``[batch * sequence]``, each row start a boundary."""
    batch, sequence = mask.shape
    rows = mask.tolist()
    bounds = []
    for r, row in enumerate(rows):
        for column, value in enumerate(row):
            if column == 0 or value != row[column - 1]:
                bounds.append(r * sequence + column)
    return [*bounds, batch * sequence]


def thd_reference(mask: torch.Tensor, max_documents: int) -> tuple[list[int], list[int]]:
    """THD ``cu_seqlens`` (valid lengths) and ``cu_seqlens_padded`` (flat starts) of contiguous documents."""
    batch, sequence = mask.shape
    starts, lengths = [], []
    for r, row in enumerate(mask.tolist()):
        for column, value in enumerate(row):
            if value and (column == 0 or row[column - 1] != value):
                starts.append(r * sequence + column)
                lengths.append(0)
            if value:
                lengths[-1] += 1
    slots = batch * max_documents
    total, running = batch * sequence, [0]
    for n in lengths:
        running.append(running[-1] + n)
    cu = running + [running[-1]] * (slots + 1 - len(running))
    padded = ([0, *starts[1:]] if starts else [0]) + [total] * (slots + 1 - max(1, len(starts)))
    return cu, padded
