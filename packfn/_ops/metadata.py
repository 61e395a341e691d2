"""Ops that parse packing masks into varlen metadata (shape-static).

The packing format is defined in :mod:`packfn.metadata` (and docs/format.md).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from packfn._ops._registry import Rule, gpu_or, named_value, packfn_op
from packfn._ops.scan import running_sum

__all__ = [
    "FLATTEN_RULES",
    "BatchOutputs",
    "FlattenOutputs",
    "VarlenOutputs",
    "batch_metadata_op",
    "binary_search_slots",
    "broken_fake",
    "flat_boundaries",
    "flatten_metadata_op",
    "flatten_violations",
    "mask_flags",
    "mask_rules",
    "search_running_sums",
    "varlen_metadata_op",
]


def mask_rules(max_documents: int, name: str = "document_ids") -> tuple[Rule, ...]:
    """Data rules of a packing mask named ``name``, in the order of every mask op's ``broken`` flags.

    Upstream does not check these (its output is inconsistent there); the
    drop-ins raise the same messages as ``ValueError``. With
    ``max_documents = sequence`` the third rule never breaks.
    """
    return (
        Rule(f"{name} must not contain negative document ids"),
        Rule(
            f"{name} document ids must not decrease along a row "
            "(an id reappears after a different id, or ids are out of order)"
        ),
        Rule(f"a row of {name} holds more documents than {named_value('max_documents', max_documents)}"),
    )


def mask_flags(document_ids: torch.Tensor, check: bool) -> torch.Tensor:
    """Bool ``[3]``: the :func:`mask_rules` flags of ``[batch, sequence]`` ids (``D = sequence``), all False unchecked.

    NOTE [Check once]
    A public function that has the flags of a mask already (from the first
    op it called on it) passes ``check=False`` to the others, so no op
    parses the mask twice.
    """
    if not check:
        return document_ids.new_zeros(3, dtype=torch.bool)
    # On CUDA one pass of a Triton kernel (NOTE [Two launches on a GPU]), where the aten body parses the mask.
    return gpu_or("mask_flags_kernels", lambda ids: parse_mask(ids, ids.shape[1]).broken, document_ids)


def broken_fake(document_ids: torch.Tensor) -> torch.Tensor:
    """Bool ``[3]``: the rule flags of a mask op."""
    return document_ids.new_empty(3, dtype=torch.bool)


class ParsedMask(NamedTuple):
    """What every mask op starts from (see :func:`parse_mask`)."""

    valid: torch.Tensor  # bool [batch, sequence]
    starts: torch.Tensor  # bool [batch, sequence]: the first token of each document
    broken: torch.Tensor  # bool [3]: one flag per rule of mask_rules
    indices: torch.Tensor  # int64 [batch * sequence]: valid positions in order, then padding in order
    valid_seen: torch.Tensor  # int64 [batch * sequence]: valid tokens at or before each position


def _valid_first(valid: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``values`` (1-d) at the ``valid`` positions in order, then at the others in order; and the running valid count.

    A scatter that writes each slot once: valid position ``p`` goes to its
    rank ``valid_seen[p] - 1``, any other to ``num_tokens + (others before p)``.
    """
    valid_seen = valid.cumsum(0)
    positions = torch.arange(valid.numel(), device=valid.device)
    destination = torch.where(valid, valid_seen - 1, (positions - valid_seen).add_(valid_seen[-1]))
    return torch.empty_like(values).scatter_(0, destination, values), valid_seen


def parse_mask(document_ids: torch.Tensor, max_documents: int) -> ParsedMask:
    """Find the documents of a ``[batch, sequence]`` mask in a few fused passes.

    Valid tokens keep their order at the front of ``indices`` and padding
    follows in order: a permutation, so unpad and pad are a gather and its
    inverse. The same permutation gives each token the last valid token
    before it (the valid token ranked just below it), so a valid token starts
    a document exactly when its row holds no earlier valid token or that
    token's id differs. Padding inside a document therefore does not split
    it, and no running maximum (``cummax``, slow in aten and not lowered by
    Inductor on the CPU) is needed.
    """
    batch, sequence = document_ids.shape
    ids = document_ids.to(torch.int64).reshape(-1)
    valid = ids != 0
    indices, valid_seen = _valid_first(valid, torch.arange(ids.numel(), device=ids.device))
    earlier = valid_seen - valid.long()  # valid tokens before each position
    # The last of them (any position when there is none); index_select is
    # the fast 1-d gather in eager (advanced indexing is several times slower).
    previous = indices.index_select(0, (earlier - 1).clamp_min(0))
    row_begins = earlier.view(batch, sequence)[:, :1]  # valid tokens before each row
    in_row = (earlier.view(batch, sequence) > row_begins).reshape(-1)
    before = torch.where(in_row, ids.index_select(0, previous), 0)
    starts = valid & (ids != before)
    per_row = starts.view(batch, sequence).sum(dim=1)
    broken = torch.stack([(ids < 0).any(), (valid & (ids < before)).any(), (per_row > max_documents).any()])
    return ParsedMask(valid.view(batch, sequence), starts.view(batch, sequence), broken, indices, valid_seen)


def parse_mask_eager(document_ids: torch.Tensor, max_documents: int) -> ParsedMask:
    """:func:`parse_mask` in fewer, larger aten calls, for the eager kernels (NOTE [Eager kernels]).

    Where the mask rules hold (no negative id, ids never decrease along the
    valid tokens of a row), the running maximum of a row before a position is
    the id of the last valid token before it (0 if there is none), so one
    ``cummax`` replaces the permutation gathers; a valid id below the running
    maximum is exactly a decrease. On broken masks the flags may differ from
    :func:`parse_mask`'s past the first broken rule, which is the same.
    """
    ids = document_ids.view(torch.uint8) if document_ids.dtype == torch.bool else document_ids
    valid = ids != 0
    running = ids.cummax(1).values
    starts = valid.clone()
    starts[:, 1:] &= ids[:, 1:] != running[:, :-1]
    negative = ids.min() < 0 if ids.dtype.is_signed else valid.new_zeros(())
    decreasing = (valid & (ids != running)).any()
    broken = torch.stack([negative, decreasing, starts.sum(1).max() > max_documents])
    indices, valid_seen = _valid_first(valid.reshape(-1), torch.arange(valid.numel(), device=ids.device))
    return ParsedMask(valid, starts, broken, indices, valid_seen)


# Up to this many document slots per row, boundaries are found by binary
# search; past it (the default capacity, D = sequence) by a scatter.
_SEARCH_MAX_DOCUMENTS = 256


def binary_search_slots(max_documents: int) -> bool:
    """Whether :func:`compact` should binary-search for ``max_documents`` slots per row.

    A function of the static argument alone, never of a symbolic size: a
    branch on ``sequence`` would guard on it, so a compile with dynamic
    shapes would recompile where the choice flips and ``torch.export`` with a
    ``Dim`` on the sequence would fail. A ``max_documents`` that is itself
    symbolic (the default ``D = sequence`` under dynamic shapes) takes the
    scatter, which suits any number of slots.
    """
    return isinstance(max_documents, int) and max_documents <= _SEARCH_MAX_DOCUMENTS


# NOTE [One flat search]
# Inductor lowers torch.searchsorted to a Triton binary search, and three
# forms of a row-by-row search failed to compile on CUDA (torch 2.11, an
# H200, in compiled training steps and ops):
# - a [batch, n] sequence with queries shared by every row: in a 2-D tiled
#   kernel the queries vary along one axis and the row offset along the
#   other ("Loop-carried variable low has initial type <['1', '32'], int64>
#   but is re-assigned to <['8', '32'], int64> in loop");
# - a flat view of a computed [batch, n] tensor: the lowering reads the
#   sequence's strides, and the view has none ("NotImplementedError: View");
# - a flat sequence shifted by row * span after a row-wise cumsum: the shift
#   fuses into the scan kernel, which has no x axis to index the row by
#   ("list indices must be integers or slices, not NoneType").
# search_running_sums takes none of them: one cumsum over the flattened rows
# makes a sorted 1-D sequence in which row r's running sums are raised by
# the total of the rows before it; each query is raised the same way, and
# the scan's output is searched as it is. tests/core/test_fakes.py holds every
# searchsorted in the ops' decompositions to a 1-D sequence that is not a
# view.


def search_running_sums(increments: torch.Tensor, queries: torch.Tensor, *, right: bool = False) -> torch.Tensor:
    """Search each row's running sums for the same ``queries``, as one 1-D search (NOTE [One flat search]).

    Args:
        increments: ``[batch, n]``, never negative, ``n >= 1``, with a
            total over every row that int64 holds.
        queries: ``[m]``, every row's queries: above 0 (``right=False``),
            or not below 0 (``right=True``), so that none finds the sums
            of the rows before.
        right: as ``torch.searchsorted``'s.

    Returns:
        int64 ``[batch, m]`` positions in the flattened rows: ``r * n +
        torch.searchsorted(increments[r].cumsum(0), queries, right=right)``
        where that search gives less than ``n``; at least ``(r + 1) * n``
        for a query past row ``r``'s total.
    """
    batch, n = increments.shape
    running = increments.reshape(-1).cumsum(0)
    # Each row's running sums start from the rows before; padded then cut
    # (not [:-1]), so that no size of the batch is special (batch 0 included).
    before = F.pad(running.view(batch, n)[:, -1], (1, 0))[:batch].unsqueeze(1)
    return torch.searchsorted(running, (before + queries).flatten(), right=right).view(batch, queries.shape[0])


def compact(flags: torch.Tensor, values: torch.Tensor, slots: int, *, search: bool) -> torch.Tensor:
    """Along the last axis, move ``values`` at the flagged positions, in order, to the first ``slots`` entries.

    Entries past the number of flags hold garbage; callers mask them. With
    ``search`` (few slots, see :func:`binary_search_slots`) each slot binary-searches
    the running count of flags; otherwise the k-th flagged position goes to
    slot k and every other position to a spare slot of its own, so a scatter
    writes each slot at most once (deterministic, no atomics, O(sequence)).
    """
    length = flags.shape[-1]
    if search:
        targets = torch.arange(1, slots + 1, device=flags.device)
        found = search_running_sums(flags.reshape(-1, length), targets)
        # Flat positions: a slot past its row's count reads another row (garbage).
        return (
            values.reshape(-1).gather(0, found.flatten().clamp_max(values.numel() - 1)).view(*flags.shape[:-1], slots)
        )
    seen = running_sum(flags)
    spare = slots + torch.arange(length, device=flags.device)
    target = torch.where(flags, seen - 1, spare)
    buffer = values.new_empty((*flags.shape[:-1], slots + length))
    return buffer.scatter_(-1, target, values)[..., :slots]


def _varlen_metadata_fake(document_ids: torch.Tensor, max_documents: int):
    """``indices [B*S]``, ``cu_seqlens [B*D+1]``, ``seqlens [B*D]``, three 0-d tensors, rule flags ``[3]``."""
    batch, sequence = document_ids.shape
    capacity = batch * max_documents
    new = document_ids.new_empty
    return (
        new(batch * sequence, dtype=torch.int64),
        new(capacity + 1, dtype=torch.int32),
        new(capacity, dtype=torch.int32),
        new((), dtype=torch.int32),
        new((), dtype=torch.int64),
        new((), dtype=torch.int64),
        new(3, dtype=torch.bool),
    )


class VarlenOutputs(NamedTuple):
    """Outputs of ``packfn::varlen_metadata`` (the fields of :class:`packfn.VarlenMetadata`, then ``broken``)."""

    indices: torch.Tensor
    cu_seqlens: torch.Tensor
    seqlens: torch.Tensor
    max_seqlen: torch.Tensor
    num_tokens: torch.Tensor
    num_documents: torch.Tensor
    broken: torch.Tensor


def varlen_from(parsed: ParsedMask, batch: int, max_documents: int):
    valid, starts = parsed.valid.reshape(-1), parsed.starts.reshape(-1)
    num_tokens = parsed.valid_seen[-1]
    num_documents = starts.sum()
    slots = torch.arange(batch * max_documents + 1, device=valid.device)
    # A start is valid, so the valid tokens before it are its running count minus one.
    firsts = compact(starts, parsed.valid_seen - 1, slots.numel(), search=binary_search_slots(max_documents))
    cu_seqlens = torch.where(slots < num_documents, firsts, num_tokens).to(torch.int32)
    seqlens = cu_seqlens[1:] - cu_seqlens[:-1]
    # The count as a reduction of its own, not the scan's last entry: Inductor
    # drops a clone of that entry and would return a 0-d view that keeps the
    # whole [batch * sequence] scan alive (tests/core/test_output_storage.py).
    return parsed.indices, cu_seqlens, seqlens, seqlens.max(), valid.sum(), num_documents, parsed.broken


def _varlen_metadata_eager(
    document_ids: torch.Tensor, max_documents: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    parsed = parse_mask_eager(document_ids, max_documents)
    return varlen_from(parsed, document_ids.shape[0], max_documents)


@packfn_op(
    "varlen_metadata",
    fake=_varlen_metadata_fake,
    outputs=VarlenOutputs,
    eager=_varlen_metadata_eager,
    gpu="varlen_kernels",
)
def varlen_metadata_op(
    document_ids: torch.Tensor, max_documents: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return varlen_from(parse_mask(document_ids, max_documents), document_ids.shape[0], max_documents)


def _batch_metadata_fake(document_ids: torch.Tensor, max_documents: int):
    """``packed_token_indices [B, S]``, ``cu_seqlens [B, D+1]``, ``row_max_seqlen``, ``num_documents [B]``, flags."""
    batch, sequence = document_ids.shape
    new = document_ids.new_empty
    return (
        new(batch, sequence, dtype=torch.int64),
        new(batch, max_documents + 1, dtype=torch.int32),
        new(batch, dtype=torch.int32),
        new(batch, dtype=torch.int64),
        new(3, dtype=torch.bool),
    )


class BatchOutputs(NamedTuple):
    """Outputs of ``packfn::batch_metadata``."""

    packed_token_indices: torch.Tensor  # int64 [batch, sequence]
    cu_seqlens: torch.Tensor  # int32 [batch, D + 1]
    row_max_seqlen: torch.Tensor  # int32 [batch]: each row's longest document (0 for an empty row)
    num_documents: torch.Tensor  # int64 [batch]
    broken: torch.Tensor  # bool [3]: mask_rules


def _batch_from(parsed: ParsedMask, max_documents: int):
    valid, starts = parsed.valid, parsed.starts
    batch, sequence = valid.shape
    columns = torch.arange(sequence, device=valid.device)
    packed_token_indices = torch.where(valid, columns, -1)
    flat_seen = parsed.valid_seen.view(batch, sequence)
    # Row-local running counts: minus the valid tokens of the rows before.
    valid_seen = flat_seen - (flat_seen[:, :1] - valid[:, :1].long())
    num_documents = starts.sum(1, keepdim=True)
    slots = torch.arange(max_documents + 1, device=valid.device)
    firsts = compact(starts, valid_seen - 1, slots.numel(), search=binary_search_slots(max_documents))
    last = torch.where(slots == num_documents, valid_seen[:, -1:], -1)
    boundaries = torch.where(slots < num_documents, firsts, last)
    cu_seqlens = boundaries.to(torch.int32)
    used = boundaries[:, 1:] >= 0
    lengths = torch.where(used, boundaries[:, 1:] - boundaries[:, :-1], 0)
    row_max_seqlen = lengths.amax(1).to(torch.int32)
    return packed_token_indices, cu_seqlens, row_max_seqlen, num_documents.squeeze(1), parsed.broken


def _batch_metadata_eager(
    document_ids: torch.Tensor, max_documents: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _batch_from(parse_mask_eager(document_ids, max_documents), max_documents)


@packfn_op(
    "batch_metadata", fake=_batch_metadata_fake, outputs=BatchOutputs, eager=_batch_metadata_eager, gpu="batch_kernels"
)
def batch_metadata_op(
    document_ids: torch.Tensor, max_documents: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _batch_from(parse_mask(document_ids, max_documents), max_documents)


FLATTEN_RULES = (
    Rule("cu_seqlens rows must start at zero"),
    Rule("cu_seqlens rows must be monotonic"),
    Rule("cu_seqlens rows must not hold a boundary after a -1 entry"),
    Rule("the last boundary of each cu_seqlens row must equal its number of valid tokens"),
)
"""Data rules of batch-major metadata, in the order of the flatten op's flags."""


def flatten_violations(row_tokens: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Bool ``[len(FLATTEN_RULES)]``: broken rules of batch-major metadata (``row_tokens``: valid tokens a row)."""
    valid_bounds = cu_seqlens >= 0
    after_gap = valid_bounds & (running_sum(~valid_bounds) > 0)
    pairs = valid_bounds[:, 1:] & valid_bounds[:, :-1]
    decreasing = (cu_seqlens[:, 1:] < cu_seqlens[:, :-1]) & pairs
    count = valid_bounds.sum(dim=1)
    last = cu_seqlens.gather(1, (count - 1).clamp_min(0).unsqueeze(1)).squeeze(1)
    return torch.stack(
        [
            (cu_seqlens[:, 0] != 0).any(),  # also where a row has no valid boundary
            decreasing.any(),
            after_gap.any(),
            (last != row_tokens).any(),
        ]
    )


def flat_boundaries(cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Batch-major boundaries ``[B, D + 1]`` made flat: ``[B * D + 1]`` (then the total repeated), total, documents.

    Document k of the flat stream lives in the row whose running document
    count first exceeds k; its boundary is that row's token offset plus the
    row-local boundary.
    """
    batch, documents = cu_seqlens.shape[0], cu_seqlens.shape[1] - 1
    device = cu_seqlens.device
    row_documents = ((cu_seqlens >= 0).sum(dim=1) - 1).clamp_min(0)
    documents_through = row_documents.cumsum(0)
    row_tokens = cu_seqlens.long().gather(1, row_documents.unsqueeze(1)).squeeze(1)
    tokens_through = row_tokens.cumsum(0)
    slots = torch.arange(1, batch * documents + 1, device=device)
    rows = torch.searchsorted(documents_through, slots).clamp_max(batch - 1)
    documents_before = documents_through[rows] - row_documents[rows]
    local = (slots - documents_before).clamp(0, documents)
    inside = slots <= documents_through[-1]
    boundary = tokens_through[rows] - row_tokens[rows] + cu_seqlens.long()[rows, local]
    total = tokens_through[-1]
    flat = torch.where(inside, boundary, total)
    flat_cu_seqlens = torch.cat([flat.new_zeros(1), flat]).to(cu_seqlens.dtype)
    # Counts as reductions of their own, not views of the scans (see varlen_from).
    return flat_cu_seqlens, row_tokens.sum(), row_documents.sum()


def _flatten_metadata_fake(packed_token_indices: torch.Tensor, cu_seqlens: torch.Tensor):
    """``indices [B*S]`` int64, ``cu_seqlens [B*D+1]`` in cu_seqlens' dtype, two 0-d counts, flags ``[4]``."""
    batch, sequence = packed_token_indices.shape
    capacity = batch * (cu_seqlens.shape[1] - 1)
    return (
        packed_token_indices.new_empty(batch * sequence, dtype=torch.int64),
        cu_seqlens.new_empty(capacity + 1),
        cu_seqlens.new_empty((), dtype=torch.int64),
        cu_seqlens.new_empty((), dtype=torch.int64),
        cu_seqlens.new_empty(len(FLATTEN_RULES), dtype=torch.bool),
    )


class FlattenOutputs(NamedTuple):
    """Outputs of ``packfn::flatten_metadata``."""

    indices: torch.Tensor  # int64 [batch * sequence]
    cu_seqlens: torch.Tensor  # [batch * D + 1], dtype of the input cu_seqlens
    num_tokens: torch.Tensor  # int64 0-d
    num_documents: torch.Tensor  # int64 0-d
    broken: torch.Tensor  # bool [4]: FLATTEN_RULES


@packfn_op("flatten_metadata", fake=_flatten_metadata_fake, outputs=FlattenOutputs, gpu="flatten_kernels")
def flatten_metadata_op(
    packed_token_indices: torch.Tensor, cu_seqlens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    batch, sequence = packed_token_indices.shape
    device = packed_token_indices.device
    # Token stream: valid tokens (their index values made flat) in row-major
    # order, then the padding positions in order, as in varlen_metadata.
    valid = packed_token_indices >= 0
    positions = torch.arange(valid.numel(), device=device)
    row_offsets = torch.arange(batch, device=device).unsqueeze(1) * sequence
    values = torch.where(valid, packed_token_indices + row_offsets, positions.view(batch, sequence))
    indices, _ = _valid_first(valid.reshape(-1), values.reshape(-1))
    flat_cu_seqlens, total, num_documents = flat_boundaries(cu_seqlens)
    broken = flatten_violations(valid.sum(dim=1), cu_seqlens)
    return indices, flat_cu_seqlens, total, num_documents, broken
