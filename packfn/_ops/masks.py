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

__all__ = ["BlockCausalOutputs", "DocumentKvBlocks", "block_causal_mask_op", "document_kv_blocks_op"]


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


def _document_kv_blocks_fake(
    document_ids: torch.Tensor,
    block_size: int,
    window: int | None,
    separate_full: bool,
    positions: torch.Tensor | None,
    check: bool,
):
    """int32 ``kv_num_blocks [B, 1, Q]``, ``kv_indices [B, 1, Q, K]``, the same two for full blocks, rule flags."""
    batch, sequence = document_ids.shape
    blocks = cdiv(sequence, block_size)
    new = document_ids.new_empty
    counts, indices = (batch, 1, blocks), (batch, 1, blocks, blocks)
    return (
        new(counts, dtype=torch.int32),
        new(indices, dtype=torch.int32),
        new(counts, dtype=torch.int32),
        new(indices, dtype=torch.int32),
        broken_fake(document_ids),
    )


def _ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block counts and block indices (present blocks ascending, then absent ones), as create_block_mask orders them.

    The counts sum the sorted flags, not the flags: Inductor's Triton backend
    fuses the ``[batch, 1, Q, K]`` flags' pointwise producer into a sum over
    ``K`` and, with dynamic shapes (``Q == K`` symbolic), cannot split the
    fused ranges (``CantSplit: B*Q not divisible by B*Q**2``, torch 2.11 to
    2.15 on CUDA); the sort's output is a buffer of its own.
    """
    values, indices = torch.sort(dense.to(torch.int32), dim=-1, descending=True, stable=True)
    return values.sum(dim=-1, dtype=torch.int32), indices.to(torch.int32)


class DocumentKvBlocks(NamedTuple):
    """Outputs of ``packfn::document_kv_blocks``: a BlockMask's tensors and the mask rule flags."""

    kv_num_blocks: torch.Tensor
    kv_indices: torch.Tensor
    full_kv_num_blocks: torch.Tensor
    full_kv_indices: torch.Tensor
    broken: torch.Tensor


@packfn_op("document_kv_blocks", fake=_document_kv_blocks_fake, outputs=DocumentKvBlocks)
def document_kv_blocks_op(
    document_ids: torch.Tensor,
    block_size: int,
    window: int | None,
    separate_full: bool,
    positions: torch.Tensor | None,
    check: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # Ids never decrease along the valid tokens of a row, so a key block j
    # strictly before query block i shares a document with it only through
    # its last id, which must be the first id of block i; the nearest pair is
    # (last valid key of j, first valid query of i), which decides the window.
    # The window counts columns, or ``positions`` [batch, sequence] where
    # given (increasing along each document's valid tokens, as restarting
    # position ids).
    # The diagonal block holds each valid query attending itself.
    batch, sequence = document_ids.shape
    blocks = cdiv(sequence, block_size)
    unpadded = document_ids.to(torch.int64)
    ids = F.pad(unpadded, (0, blocks * block_size - sequence)).reshape(batch, blocks, block_size)
    valid = ids != 0
    columns = torch.arange(blocks * block_size, device=ids.device).reshape(blocks, block_size)
    past_end = blocks * block_size + 1
    last_id = ids.amax(dim=2)  # 0 for a block without a valid token
    # A block without a valid token gets first id -1, which no block's last
    # id (0 or a positive id) equals, so it shares a document with no block.
    # (Any positive sentinel is a legal id that a real block may end with.)
    first_id = torch.where(valid, ids, torch.iinfo(torch.int64).max).amin(dim=2)
    first_id = torch.where(valid.any(dim=2), first_id, -1)
    last_valid = torch.where(valid, columns, -past_end).amax(dim=2)
    first_valid = torch.where(valid, columns, past_end).amin(dim=2)
    # A full block: every slot valid and one id throughout (slots past the
    # sequence are padding, so an edge block is never full, as in create_block_mask).
    uniform = valid.all(dim=2) & (first_id == last_id)

    q_block = torch.arange(blocks, device=ids.device).unsqueeze(1)
    kv_block = torch.arange(blocks, device=ids.device).unsqueeze(0)
    shared = last_id.unsqueeze(1) == first_id.unsqueeze(2)  # [batch, q block, kv block]
    before = (kv_block < q_block).unsqueeze(0)
    diagonal = (kv_block == q_block).unsqueeze(0) & valid.any(dim=2).unsqueeze(2)
    # Every key of block j precedes every query of block i (causal throughout).
    full_causal = (kv_block + 1) * block_size <= q_block * block_size + 1
    full = uniform.unsqueeze(2) & uniform.unsqueeze(1) & shared & full_causal.unsqueeze(0)
    reach = before & shared
    if window is not None:
        if positions is not None:
            # The same tokens, measured in positions: gather them by index in the block.
            coordinates = F.pad(positions.to(torch.int64), (0, blocks * block_size - sequence))
            coordinates = coordinates.view(batch, blocks, block_size)
            first_valid = coordinates.gather(2, (first_valid % block_size).unsqueeze(2)).squeeze(2)
            last_valid = coordinates.gather(2, (last_valid % block_size).unsqueeze(2)).squeeze(2)
        nearest = first_valid.unsqueeze(2) - last_valid.unsqueeze(1)
        reach = reach & (nearest < window)
        # A full pair (both blocks valid throughout, one document) stays full
        # when its farthest pair is within the window.
        farthest = last_valid.unsqueeze(2) - first_valid.unsqueeze(1)
        full = full & (farthest < window)
    present = reach | diagonal
    if separate_full:
        partial = present & ~full
    else:
        partial, full = present, torch.zeros_like(present)
    kv_num_blocks, kv_indices = _ordered(partial.unsqueeze(1))
    full_kv_num_blocks, full_kv_indices = _ordered(full.unsqueeze(1))
    return kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, mask_flags(unpadded, check)
