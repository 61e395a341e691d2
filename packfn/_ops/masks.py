"""Ops that turn a document-id mask into attention masks: dense block-causal and FlexAttention blocks.

The packing format is the one of :mod:`packfn._ops.metadata`: a token
attends exactly the earlier tokens of its row that carry the same id, padding
(id 0) attends nothing and is attended by nothing, and padding inside a
document does not split it.

Every op here never raises on its data: its last output is ``broken``, bool
``[3]``, one flag per rule of :func:`packfn._ops.metadata.mask_rules`,
computed in the same pass, or all False with ``check=False`` (the caller
has checked the mask already: NOTE [Check once]). The public functions
enforce the flags (NOTE [One way to report a broken rule] in
:mod:`packfn._ops._registry`).

Shapes: ``B`` batch, ``S`` sequence, ``Q`` / ``K`` query / key blocks.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from packfn._ops._registry import packfn_op
from packfn._ops.metadata import broken_fake, mask_flags
from packfn._utils import cdiv

__all__ = [
    "BlockCausalOutputs",
    "DocumentBlockTables",
    "block_causal_mask_op",
    "block_pairs",
    "block_summaries",
    "document_block_tables_op",
]


# ------------------------------------------------------------- block causal


def _block_causal_mask_fake(document_ids: torch.Tensor, check: bool):
    """Bool ``[batch, 1, sequence, sequence]`` and the rule flags."""
    batch, sequence = document_ids.shape
    return document_ids.new_empty(batch, 1, sequence, sequence, dtype=torch.bool), broken_fake(document_ids)


class BlockCausalOutputs(NamedTuple):
    """Outputs of ``packfn::block_causal_mask``."""

    mask: torch.Tensor  # bool [batch, 1, sequence, sequence]
    broken: torch.Tensor  # bool [3]: mask_rules


@packfn_op("block_causal_mask", fake=_block_causal_mask_fake, outputs=BlockCausalOutputs)
def block_causal_mask_op(document_ids: torch.Tensor, check: bool) -> tuple[torch.Tensor, torch.Tensor]:
    ids = document_ids.to(torch.int64)
    positions = torch.arange(ids.shape[1], device=ids.device)
    causal = positions.unsqueeze(1) >= positions.unsqueeze(0)
    # Same id and a valid query imply a valid key.
    same = (ids.unsqueeze(2) == ids.unsqueeze(1)) & (ids != 0).unsqueeze(2)
    return (same & causal).unsqueeze(1), mask_flags(ids, check)


# ------------------------------------------------------------ flex attention


def _document_block_tables_fake(
    document_ids: torch.Tensor,
    block_size: int,
    window: int | None,
    separate_full: bool,
    positions: torch.Tensor | None,
    check: bool,
):
    """int32 ``[B, 1, Q]`` counts and ``[B, 1, Q, K]`` indices: key blocks, full key blocks, query blocks, full
    query blocks (``Q == K``); the rule flags."""
    batch, sequence = document_ids.shape
    blocks = cdiv(sequence, block_size)
    new = document_ids.new_empty
    counts, indices = (batch, 1, blocks), (batch, 1, blocks, blocks)
    tables = [new(shape, dtype=torch.int32) for _ in range(4) for shape in (counts, indices)]
    return (*tables, broken_fake(document_ids))


def _ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block counts and block indices (present blocks ascending, then absent ones), as create_block_mask orders them.

    The counts sum the sorted flags, not the flags: Inductor's Triton backend
    fuses the ``[batch, 1, Q, K]`` flags' pointwise producer into a sum over
    ``K`` and, with dynamic shapes (``Q == K`` symbolic), cannot split the
    fused ranges (``CantSplit: B*Q not divisible by B*Q**2``, torch 2.11 to
    2.15 on CUDA); the sort's output is a buffer of its own.
    """
    values, indices = torch.sort(dense.to(torch.int32).contiguous(), dim=-1, descending=True, stable=True)
    return values.sum(dim=-1, dtype=torch.int32), indices.to(torch.int32)


class DocumentBlockTables(NamedTuple):
    """Outputs of ``packfn::document_block_tables``: a BlockMask's tables and the mask rule flags."""

    kv_num_blocks: torch.Tensor
    kv_indices: torch.Tensor
    full_kv_num_blocks: torch.Tensor
    full_kv_indices: torch.Tensor
    q_num_blocks: torch.Tensor
    q_indices: torch.Tensor
    full_q_num_blocks: torch.Tensor
    full_q_indices: torch.Tensor
    broken: torch.Tensor


def block_summaries(
    document_ids: torch.Tensor, block_size: int, window: int | None, positions: torch.Tensor | None
) -> torch.Tensor:
    """int64 ``[batch, 6, blocks]``: each block's first and last id, first and last valid coordinate, whether it is
    uniform (valid throughout, one id) and whether it holds a valid token; what :func:`block_pairs` reads.

    A block without a valid token gets first id -1, which no block's last id
    (0 or a positive id) equals, so it shares a document with no block. (Any
    positive sentinel is a legal id that a real block may end with.) The
    coordinates are columns, or ``positions`` where a window measures them.
    Slots past the sequence are padding, so an edge block is never uniform,
    as in ``create_block_mask``.
    """
    batch, sequence = document_ids.shape
    blocks = cdiv(sequence, block_size)
    ids = F.pad(document_ids.to(torch.int64), (0, blocks * block_size - sequence)).reshape(batch, blocks, block_size)
    valid = ids != 0
    columns = torch.arange(blocks * block_size, device=ids.device).reshape(blocks, block_size)
    past_end = blocks * block_size + 1
    last_id = ids.amax(dim=2)  # 0 for a block without a valid token
    any_valid = valid.any(dim=2)
    first_id = torch.where(valid, ids, torch.iinfo(torch.int64).max).amin(dim=2)
    first_id = torch.where(any_valid, first_id, -1)
    first_valid = torch.where(valid, columns, past_end).amin(dim=2)
    last_valid = torch.where(valid, columns, -past_end).amax(dim=2)
    if window is not None and positions is not None:
        # The same tokens, measured in positions: gathered by their index in the block.
        coordinates = F.pad(positions.to(torch.int64), (0, blocks * block_size - sequence))
        coordinates = coordinates.view(batch, blocks, block_size)
        first_valid = coordinates.gather(2, (first_valid % block_size).unsqueeze(2)).squeeze(2)
        last_valid = coordinates.gather(2, (last_valid % block_size).unsqueeze(2)).squeeze(2)
    uniform = valid.all(dim=2) & (first_id == last_id)
    return torch.stack([first_id, last_id, first_valid, last_valid, uniform.long(), any_valid.long()], dim=1)


def block_pairs(
    summaries: torch.Tensor, block_size: int, window: int | None, separate_full: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bool ``[batch, Q, K]``: query block ``i`` sees key block ``j`` in part, and in full (all False unless
    ``separate_full``, as then a partial block is any block seen).

    Ids never decrease along the valid tokens of a row, so a key block j
    strictly before query block i shares a document with it only through its
    last id, which must be the first id of block i; the nearest pair is (last
    valid key of j, first valid query of i), which decides the window, and a
    full pair (both blocks uniform, one document) stays full when its
    farthest pair is within the window. The window counts columns, or
    positions (increasing along each document's valid tokens, as restarting
    position ids). The diagonal block holds each valid query attending itself.
    """
    first_id, last_id, first_valid, last_valid, uniform, any_valid = summaries.unbind(1)
    blocks = summaries.shape[2]
    q_block = torch.arange(blocks, device=summaries.device).unsqueeze(1)
    kv_block = torch.arange(blocks, device=summaries.device).unsqueeze(0)
    shared = last_id.unsqueeze(1) == first_id.unsqueeze(2)  # [batch, q block, kv block]
    reach = (kv_block < q_block).unsqueeze(0) & shared
    diagonal = (kv_block == q_block).unsqueeze(0) & (any_valid != 0).unsqueeze(2)
    # Every key of block j precedes every query of block i (causal throughout).
    full_causal = (kv_block + 1) * block_size <= q_block * block_size + 1
    full = (uniform != 0).unsqueeze(2) & (uniform != 0).unsqueeze(1) & shared & full_causal.unsqueeze(0)
    if window is not None:
        reach = reach & (first_valid.unsqueeze(2) - last_valid.unsqueeze(1) < window)
        full = full & (last_valid.unsqueeze(2) - first_valid.unsqueeze(1) < window)
    present = reach | diagonal
    if not separate_full:
        return present, torch.zeros_like(present)
    return present & ~full, full


@packfn_op(
    "document_block_tables", fake=_document_block_tables_fake, outputs=DocumentBlockTables, gpu="block_tables_kernels"
)
def document_block_tables_op(
    document_ids: torch.Tensor,
    block_size: int,
    window: int | None,
    separate_full: bool,
    positions: torch.Tensor | None,
    check: bool,
) -> tuple[
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
]:
    summaries = block_summaries(document_ids, block_size, window, positions)
    partial, full = block_pairs(summaries, block_size, window, separate_full)
    # The query side is the key side transposed, ordered alike (as BlockMask.from_kv_blocks makes it).
    tables = [_ordered(flags.unsqueeze(1)) for flags in (partial, full, partial.mT, full.mT)]
    return (*(table for pair in tables for table in pair), mask_flags(document_ids.to(torch.int64), check))
