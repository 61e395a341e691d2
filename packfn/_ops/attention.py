"""Ops that turn a document-id mask into attention inputs, and move activations in and out of varlen order.

The packing format is the one of :mod:`packfn._ops.metadata`: a token
attends exactly the earlier tokens of its row that carry the same id, padding
(id 0) attends nothing and is attended by nothing, and padding inside a
document does not split it (except in the physical varlen boundaries, which
follow upstream and cut at every id change).

Every op that reads a mask never raises on its data: its last output is
``broken``, bool ``[3]``, one flag per rule of :func:`packfn._ops.metadata.mask_rules`
(the table of the mask family), computed in the same pass; ``pad`` flags a
malformed permutation the same way. The public functions enforce the flags
(NOTE [One way to report a broken rule]).

NOTE [Unpad and pad are each other's backward]
``unpad`` and ``pad`` are both gathers driven by the varlen permutation
``indices`` (valid positions ascending, then padding positions ascending;
see :class:`packfn.VarlenMetadata`) and the count ``num_tokens`` of valid
tokens:

    unpad(x)[i] = x.flatten(0, 1)[indices[i]]   if i < num_tokens else 0
    pad(y)[j]   = y[inverse[j]]                 if inverse[j] < num_tokens else 0

As linear maps they are transposes of each other, so the backward of one is
the other applied to the gradient, and both directions are deterministic
gathers with no scatter and no atomic add. The zeros matter: varlen kernels
leave rows past the last boundary uninitialized, so ``pad`` must write exact
zeros at padding positions whatever those rows hold (a NaN there must not
leak), and the gradient of a padding token through ``unpad`` is zero.

``pad`` needs the inverse permutation. Scattering ``arange`` through
``indices`` would be an indirect store; instead the inverse is read off the
structure of ``indices`` with a binary search (a valid position ``j`` is the
``k``-th valid token where ``k`` counts the valid positions before it, a
padding position is ``num_tokens + j - k``), and checked (a wrong permutation
would silently move activations): ``indices`` gathered by the inverse must
give back every position, else ``pad`` flags :data:`PAD_RULES`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from packfn._checks import cpu_nonzero
from packfn._ops._registry import Rule, packfn_op
from packfn._ops.metadata import _compact, _parse_mask, mask_rules

__all__ = [
    "PAD_RULES",
    "BlockCausalOutputs",
    "DocumentKvBlocks",
    "PhysicalVarlenOutputs",
    "PositionOutputs",
    "block_causal_mask",
    "document_kv_blocks",
    "document_rules",
    "pad",
    "physical_varlen_metadata",
    "position_ids",
    "segment_starts",
    "unpad",
]


def document_rules(document_ids: torch.Tensor) -> tuple[Rule, ...]:
    """The mask rules (:func:`packfn._ops.metadata.mask_rules`) for a mask named ``document_ids``.

    With ``D = sequence`` the third rule (too many documents) never breaks.
    """
    return mask_rules(document_ids.shape[1], "document_ids")


def _broken(ids: torch.Tensor) -> torch.Tensor:
    """Bool ``[3]``: the mask rules of ``[batch, sequence]`` ids, by the shared mask parser."""
    return _parse_mask(ids, ids.shape[1]).broken


def _broken_fake(document_ids: torch.Tensor) -> torch.Tensor:
    return document_ids.new_empty(3, dtype=torch.bool)


# ------------------------------------------------------------- block causal


def _block_causal_mask_fake(document_ids: torch.Tensor):
    """Bool ``[batch, 1, sequence, sequence]`` and the rule flags."""
    batch, sequence = document_ids.shape
    return document_ids.new_empty(batch, 1, sequence, sequence, dtype=torch.bool), _broken_fake(document_ids)


class BlockCausalOutputs(NamedTuple):
    """Outputs of ``packfn::block_causal_mask``."""

    mask: torch.Tensor  # bool [batch, 1, sequence, sequence]
    broken: torch.Tensor  # bool [3]: document_rules


@packfn_op("block_causal_mask", fake=_block_causal_mask_fake, outputs=BlockCausalOutputs)
def block_causal_mask(document_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ids = document_ids.to(torch.int64)
    positions = torch.arange(ids.shape[1], device=ids.device)
    causal = positions.unsqueeze(1) >= positions.unsqueeze(0)
    # Same id and a valid query imply a valid key.
    same = (ids.unsqueeze(2) == ids.unsqueeze(1)) & (ids != 0).unsqueeze(2)
    return (same & causal).unsqueeze(1), _broken(ids)


# ------------------------------------------------------------ position ids


def _position_ids_fake(document_ids: torch.Tensor):
    """int64 ``[batch, sequence]`` and the rule flags."""
    return document_ids.new_empty(document_ids.shape, dtype=torch.int64), _broken_fake(document_ids)


class PositionOutputs(NamedTuple):
    """Outputs of ``packfn::position_ids``."""

    position_ids: torch.Tensor  # int64 [batch, sequence]
    broken: torch.Tensor  # bool [3]: document_rules


@packfn_op("position_ids", fake=_position_ids_fake, outputs=PositionOutputs)
def position_ids(document_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # A valid token's position is its rank among its document's valid tokens.
    # A padding token continues the count of the last valid token before it
    # in its row (its position plus the distance), and one with no valid
    # token before it in its row counts from the row start.
    batch, sequence = document_ids.shape
    parsed = _parse_mask(document_ids, sequence)
    starts, seen = parsed.starts.reshape(-1), parsed.valid_seen
    flat = torch.arange(starts.numel(), device=starts.device)
    documents = starts.cumsum(0)  # documents begun at or before each position
    # The valid rank (in the flat stream) of each document's first token.
    first = _compact(starts, seen - 1, starts.numel(), search=False)
    last_valid = parsed.indices.index_select(0, (seen - 1).clamp_min(0))
    rank = seen - 1 - first.index_select(0, (documents - 1).clamp_min(0))
    in_row = (seen > 0) & (torch.div(last_valid, sequence, rounding_mode="floor") == flat // sequence)
    positions = torch.where(in_row, rank + flat - last_valid, flat % sequence)
    return positions.view(batch, sequence), parsed.broken


# ------------------------------------------------------------ physical varlen


def _physical_varlen_metadata_fake(document_ids: torch.Tensor):
    """``cu_seqlens [batch*sequence + 1]`` int32, ``max_seqlen`` int32 0-d, ``num_segments`` int64 0-d."""
    batch, sequence = document_ids.shape
    new = document_ids.new_empty
    return (
        new(batch * sequence + 1, dtype=torch.int32),
        new((), dtype=torch.int32),
        new((), dtype=torch.int64),
    )


def segment_starts(document_ids: torch.Tensor) -> torch.Tensor:
    """Bool ``[batch, sequence]``: where a physical varlen segment starts.

    Segments are runs of equal ids, whatever the ids are: unlike the
    document view, nothing here relies on ids increasing, so there are no
    rule flags (upstream accepts any integer ids too). A segment starts at
    every row start (a document that fills its row must not merge with the
    next row's first one once flattened) and wherever the id changes, so
    padding runs are segments of their own.
    """
    return F.pad(document_ids[:, 1:] != document_ids[:, :-1], (1, 0), value=True)


class PhysicalVarlenOutputs(NamedTuple):
    """Outputs of ``packfn::physical_varlen_metadata`` (no rule flags: any integer ids are valid)."""

    cu_seqlens: torch.Tensor  # int32 [batch * sequence + 1]
    max_seqlen: torch.Tensor  # int32 0-d
    num_segments: torch.Tensor  # int64 0-d


def _physical_varlen_metadata_eager(document_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """On the CPU, the starts' positions by one ``nonzero`` written over the total (NOTE [Eager kernels]).

    Nothing to synchronize with there, and some six aten calls instead of
    the decomposition's dozen passes over ``batch * sequence``. Elsewhere
    (``nonzero`` would sync with the device) the decomposition.
    """
    if document_ids.device.type != "cpu":
        return tuple(physical_varlen_metadata.math(document_ids))
    starts = cpu_nonzero(segment_starts(document_ids).reshape(-1))
    total = document_ids.numel()
    cu_seqlens = torch.full((total + 1,), total, dtype=torch.int32, device=document_ids.device)
    cu_seqlens[: starts.numel()] = starts
    return cu_seqlens, cu_seqlens.diff().max(), cu_seqlens.new_full((), starts.numel(), dtype=torch.int64)


@packfn_op(
    "physical_varlen_metadata",
    fake=_physical_varlen_metadata_fake,
    outputs=PhysicalVarlenOutputs,
    eager=_physical_varlen_metadata_eager,
)
def physical_varlen_metadata(
    document_ids: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    starts = segment_starts(document_ids).reshape(-1)
    total = starts.numel()
    positions = torch.arange(total, device=starts.device)
    # Boundary k is the position of the (k+1)-th start, the total once k
    # passes the last segment (empty trailing segments): the k-th start is
    # scattered to slot k of a buffer filled with the total, in the output's
    # dtype, so no pass fills the tail; every other position goes to a spare
    # slot of its own past the cut, as in _compact. (Spare slots shared by
    # blocks of positions, a floor division in the index, made Inductor's
    # code skip the scatter's last partial block for rows of one token under
    # dynamic shapes; tests/test_regressions.py holds that case.)
    slots = total + 1
    target = torch.where(starts, starts.cumsum(0) - 1, slots + positions)
    buffer = torch.full((slots + total,), total, dtype=torch.int32, device=starts.device)
    cu_seqlens = buffer.scatter_(0, target, positions.to(torch.int32))[:slots]
    max_seqlen = (cu_seqlens[1:] - cu_seqlens[:-1]).max()
    return cu_seqlens, max_seqlen, starts.sum()


# ------------------------------------------------------------ flex attention


def _document_kv_blocks_fake(
    document_ids: torch.Tensor,
    block_size: int,
    window: int | None,
    separate_full: bool,
    positions: torch.Tensor | None = None,
):
    """int32 ``kv_num_blocks [B, 1, Q]``, ``kv_indices [B, 1, Q, K]``, the same two for full blocks, rule flags."""
    batch, sequence = document_ids.shape
    blocks = -(-sequence // block_size)
    new = document_ids.new_empty
    counts, indices = (batch, 1, blocks), (batch, 1, blocks, blocks)
    return (
        new(counts, dtype=torch.int32),
        new(indices, dtype=torch.int32),
        new(counts, dtype=torch.int32),
        new(indices, dtype=torch.int32),
        _broken_fake(document_ids),
    )


def _ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block counts and block indices (present blocks ascending, then absent ones), as create_block_mask orders them."""
    dense = dense.to(torch.int32)
    indices = torch.argsort(dense, dim=-1, descending=True, stable=True)
    return dense.sum(dim=-1, dtype=torch.int32), indices.to(torch.int32)


class DocumentKvBlocks(NamedTuple):
    """Outputs of ``packfn::document_kv_blocks``: a BlockMask's tensors and the mask rule flags."""

    kv_num_blocks: torch.Tensor
    kv_indices: torch.Tensor
    full_kv_num_blocks: torch.Tensor
    full_kv_indices: torch.Tensor
    broken: torch.Tensor


@packfn_op("document_kv_blocks", fake=_document_kv_blocks_fake, outputs=DocumentKvBlocks)
def document_kv_blocks(
    document_ids: torch.Tensor,
    block_size: int,
    window: int | None,
    separate_full: bool,
    positions: torch.Tensor | None = None,
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
    blocks = -(-sequence // block_size)
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
    return kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, _broken(unpadded)


# --------------------------------------------------------------- unpad / pad


def _row_mask(keep: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return keep.reshape(keep.shape[0], *([1] * (like.ndim - 1)))


PAD_RULES = (
    Rule(
        "indices must be the varlen permutation of varlen_metadata: "
        "the first num_tokens entries the valid positions ascending, then the padding positions ascending"
    ),
)
"""The data rule of ``pad``'s inputs, flagged by its second output."""


def _inverse_permutation(indices: torch.Tensor, num_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``inverse [batch*sequence]`` of the varlen permutation and its :data:`PAD_RULES` flags.

    See NOTE [Unpad and pad are each other's backward].
    """
    positions = torch.arange(indices.numel(), device=indices.device)
    # The valid positions, ascending, then a value past every position.
    valid_positions = torch.where(positions < num_tokens, indices, indices.numel())
    valid_before = torch.searchsorted(valid_positions, positions)
    is_valid = valid_positions.gather(0, valid_before.clamp_max(indices.numel() - 1)) == positions
    inverse = torch.where(is_valid, valid_before, num_tokens + positions - valid_before)
    broken = (indices.gather(0, inverse.clamp(0, indices.numel() - 1)) != positions).any()
    return inverse, broken.reshape(1)


def _unpad_fake(values: torch.Tensor, indices: torch.Tensor, num_tokens: torch.Tensor) -> torch.Tensor:
    """``[batch*sequence, ...]`` in the dtype of ``values``."""
    return values.new_empty(values.shape[0] * values.shape[1], *values.shape[2:])


def _pad_fake(values: torch.Tensor, indices: torch.Tensor, num_tokens: torch.Tensor, sequence: int):
    """``[batch, sequence, ...]`` in the dtype of ``values``, and the :data:`PAD_RULES` flags."""
    padded = values.new_empty(values.shape[0] // sequence, sequence, *values.shape[1:])
    return padded, indices.new_empty(len(PAD_RULES), dtype=torch.bool)


def _unpad_setup(ctx, inputs, output) -> None:
    _, indices, num_tokens = inputs
    ctx.save_for_backward(indices, num_tokens)
    ctx.sequence = inputs[0].shape[1]


def _unpad_backward(ctx, grad):
    indices, num_tokens = ctx.saved_tensors
    # The forward used these indices on its own: their flags were enforced there.
    return pad(grad, indices, num_tokens, ctx.sequence)[0], None, None


def _pad_setup(ctx, inputs, output) -> None:
    _, indices, num_tokens, _ = inputs
    ctx.save_for_backward(indices, num_tokens)


def _pad_backward(ctx, grad, _grad_broken):
    indices, num_tokens = ctx.saved_tensors
    return unpad(grad, indices, num_tokens), None, None, None


@packfn_op("unpad", fake=_unpad_fake, backward=_unpad_backward, setup_context=_unpad_setup)
def unpad(values: torch.Tensor, indices: torch.Tensor, num_tokens: torch.Tensor) -> torch.Tensor:
    flat = values.flatten(0, 1)
    keep = torch.arange(indices.numel(), device=indices.device) < num_tokens
    return torch.where(_row_mask(keep, flat), flat.index_select(0, indices), flat.new_zeros(()))


@packfn_op("pad", fake=_pad_fake, backward=_pad_backward, setup_context=_pad_setup)
def pad(
    values: torch.Tensor, indices: torch.Tensor, num_tokens: torch.Tensor, sequence: int
) -> tuple[torch.Tensor, torch.Tensor]:
    inverse, broken = _inverse_permutation(indices, num_tokens)
    keep = inverse < num_tokens
    # Padding rows read row 0 and are then zeroed: whatever the unpadded tail
    # holds (uninitialized rows of a varlen kernel, NaN) never reaches them.
    source = torch.where(keep, inverse, 0)
    padded = torch.where(_row_mask(keep, values), values.index_select(0, source), values.new_zeros(()))
    return padded.reshape(-1, sequence, *values.shape[1:]), broken
