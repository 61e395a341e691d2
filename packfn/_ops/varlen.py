"""Ops over the flattened ``[batch * sequence]`` stream: physical varlen boundaries, unpad and pad.

Physical varlen boundaries cut at every row start and id change, padding
runs included, and accept any integer ids (as upstream's); ``pad`` flags a
malformed permutation with :data:`PAD_RULES` (NOTE [One way to report a
broken rule] in :mod:`packfn._ops._registry`).

Shapes: ``B`` batch, ``S`` sequence, ``N = B * S`` flattened positions.

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
would silently move activations): ``num_tokens`` within ``[0, N]``, every
entry within ``[0, N)``, both parts ascending (so the search is a search)
and ``indices`` gathered by the inverse giving back every position, else
``pad`` flags :data:`PAD_RULES`. On CUDA one Triton kernel does the search,
the check and the gather (``pad_kernels`` in :mod:`packfn._ops.triton_rows`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from packfn._ops._cpu import cpu_nonzero
from packfn._ops._registry import Rule, packfn_op

__all__ = [
    "PAD_RULES",
    "PhysicalVarlenOutputs",
    "pad_op",
    "physical_varlen_metadata_op",
    "segment_starts",
    "unpad_op",
]


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

    Each id is compared with its left neighbour shifted into place, padded
    then sliced to full width (NOTE [Shifts of full width] in
    :mod:`packfn._ops.formats`): no intermediate of width ``sequence - 1``,
    whose contiguity check guards ``sequence - 1 != 1`` in AOTAutograd and
    so recompiles a dynamic compile at two columns.
    """
    previous = F.pad(document_ids, (1, 0))[:, :-1]
    first = torch.arange(document_ids.shape[1], device=document_ids.device) == 0
    return (document_ids != previous) | first


class PhysicalVarlenOutputs(NamedTuple):
    """Outputs of ``packfn::physical_varlen_metadata`` (no rule flags: any integer ids are valid)."""

    cu_seqlens: torch.Tensor  # int32 [batch * sequence + 1]
    max_seqlen: torch.Tensor  # int32 0-d
    num_segments: torch.Tensor  # int64 0-d


def _physical_varlen_metadata_eager(document_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """On the CPU, the starts' positions by one ``nonzero`` written over the total (NOTE [Eager kernels]).

    Nothing to synchronize with there, and some six aten calls instead of
    the decomposition's dozen passes over ``batch * sequence``. Elsewhere
    (``nonzero`` would sync with the device), and without NumPy, the
    decomposition.
    """
    starts = cpu_nonzero(segment_starts(document_ids).reshape(-1)) if document_ids.device.type == "cpu" else None
    if starts is None:
        return tuple(physical_varlen_metadata_op.math(document_ids))
    total = document_ids.numel()
    cu_seqlens = torch.full((total + 1,), total, dtype=torch.int32, device=document_ids.device)
    cu_seqlens[: starts.numel()] = starts
    return cu_seqlens, cu_seqlens.diff().max(), cu_seqlens.new_full((), starts.numel(), dtype=torch.int64)


@packfn_op(
    "physical_varlen_metadata",
    fake=_physical_varlen_metadata_fake,
    outputs=PhysicalVarlenOutputs,
    eager=_physical_varlen_metadata_eager,
    gpu="physical_varlen_kernels",
)
def physical_varlen_metadata_op(
    document_ids: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    starts = segment_starts(document_ids).reshape(-1)
    total = starts.numel()
    positions = torch.arange(total, device=starts.device)
    # Boundary k is the position of the (k+1)-th start, the total once k
    # passes the last segment (empty trailing segments): the k-th start is
    # scattered to slot k of a buffer filled with the total, in the output's
    # dtype, so no pass fills the tail. Every other position writes the total
    # into the last slot, which holds the total anyway: duplicate indices of
    # one value, so the result does not depend on their order, and the buffer
    # is exactly the output (no spare slots for it to keep alive). (Spare
    # slots chosen by a floor division of the position made Inductor's code
    # skip the scatter's last partial block for rows of one token under
    # dynamic shapes; tests/core/test_varlen.py holds that case.)
    target = torch.where(starts, starts.cumsum(0) - 1, total)
    values = torch.where(starts, positions, total).to(torch.int32)
    buffer = torch.full((total + 1,), total, dtype=torch.int32, device=starts.device)
    cu_seqlens = buffer.scatter_(0, target, values)
    max_seqlen = (cu_seqlens[1:] - cu_seqlens[:-1]).max()
    return cu_seqlens, max_seqlen, starts.sum()


# --------------------------------------------------------------- unpad / pad


def _row_mask(keep: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return keep.reshape(keep.shape[0], *([1] * (like.ndim - 1)))


PAD_RULES = (
    Rule(
        "indices must be the varlen permutation of varlen_metadata, num_tokens its count of valid tokens: "
        "the first num_tokens entries the valid positions ascending, then the padding positions ascending"
    ),
)
"""The data rule of ``pad``'s inputs, flagged by its second output."""


def _inverse_permutation(indices: torch.Tensor, num_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``inverse [batch*sequence]`` of the varlen permutation and its :data:`PAD_RULES` flags.

    See NOTE [Unpad and pad are each other's backward].
    """
    total = indices.numel()
    positions = torch.arange(total, device=indices.device)
    # The valid positions, ascending, then a value past every position: sorted wherever the rule holds.
    valid_positions = torch.where(positions < num_tokens, indices, total)
    valid_before = torch.searchsorted(valid_positions, positions)
    is_valid = valid_positions.gather(0, valid_before.clamp_max(total - 1)) == positions
    inverse = torch.where(is_valid, valid_before, num_tokens + positions - valid_before)
    unordered = (indices[1:] <= indices[:-1]) & (positions[1:] != num_tokens)  # within the valid or padding part
    broken = (
        (indices.gather(0, inverse.clamp(0, total - 1)) != positions).any()
        | ((indices < 0) | (indices >= total)).any()
        | unordered.any()
        | (num_tokens < 0)
        | (num_tokens > total)
    )
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
    return pad_op(grad, indices, num_tokens, ctx.sequence)[0], None, None


def _pad_setup(ctx, inputs, output) -> None:
    _, indices, num_tokens, _ = inputs
    ctx.save_for_backward(indices, num_tokens)


def _pad_backward(ctx, grad, _grad_broken):
    indices, num_tokens = ctx.saved_tensors
    return unpad_op(grad, indices, num_tokens), None, None, None


@packfn_op("unpad", fake=_unpad_fake, backward=_unpad_backward, setup_context=_unpad_setup)
def unpad_op(values: torch.Tensor, indices: torch.Tensor, num_tokens: torch.Tensor) -> torch.Tensor:
    flat = values.flatten(0, 1)
    keep = torch.arange(indices.numel(), device=indices.device) < num_tokens
    return torch.where(_row_mask(keep, flat), flat.index_select(0, indices), flat.new_zeros(()))


@packfn_op("pad", fake=_pad_fake, backward=_pad_backward, setup_context=_pad_setup, gpu="pad_kernels")
def pad_op(
    values: torch.Tensor, indices: torch.Tensor, num_tokens: torch.Tensor, sequence: int
) -> tuple[torch.Tensor, torch.Tensor]:
    inverse, broken = _inverse_permutation(indices, num_tokens)
    keep = inverse < num_tokens.clamp_max(indices.numel())  # a num_tokens past the rows is flagged, never read
    # Padding rows read row 0 and are then zeroed: whatever the unpadded tail
    # holds (uninitialized rows of a varlen kernel, NaN) never reaches them.
    source = torch.where(keep, inverse, 0)
    padded = torch.where(_row_mask(keep, values), values.index_select(0, source), values.new_zeros(()))
    # The batch spelled out (not -1): values with a 0-sized trailing axis have no elements to infer it from.
    return padded.reshape(values.shape[0] // sequence, sequence, *values.shape[1:]), broken
