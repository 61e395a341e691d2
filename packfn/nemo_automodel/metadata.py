"""NeMo AutoModel's metadata helpers, exactly: ``datasets.packing`` and ``models.common.packing`` 0.7.0.

The packing format is defined in :mod:`packfn.metadata`.

Each drop-in is the static op (:mod:`packfn.metadata`) followed by one trim
to the data-dependent size: a host read in eager (a sync on an
accelerator), an unbacked size under ``torch.compile`` and ``torch.export``,
never a graph break (:mod:`packfn.nemo_automodel._trim`). On CPU tensors in
eager they work at exact sizes from the start (NOTE [Exact sizes on the
CPU]).
"""

from __future__ import annotations

from typing import TypedDict

import torch

from packfn._checks import MASK_DTYPES, check_integer_tensor, check_mask
from packfn._ops import metadata as _ops
from packfn._ops._cpu import numpy, numpy_views
from packfn._ops._registry import Rule
from packfn.metadata import check_metadata_shapes
from packfn.nemo_automodel._exact import exact_on_cpu, nonzero
from packfn.nemo_automodel._trim import checked_ints, refuse_jit_trace

__all__ = [
    "PackedSequenceMetadata",
    "build_packed_sequence_metadata",
    "flatten_packed_sequence_metadata",
    "get_seqlens_in_batch",
    "get_unpad_data",
]


class PackedSequenceMetadata(TypedDict):
    """Batch-major metadata that stays valid when a batch is split into microbatches."""

    packed_token_indices: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int


def _check_dropin_mask(attention_mask: torch.Tensor) -> None:
    if attention_mask.ndim != 2:
        raise ValueError(f"attention_mask must have shape [batch, sequence], got {tuple(attention_mask.shape)}")
    if attention_mask.numel() == 0:  # upstream's message for an empty [batch, sequence] mask
        raise ValueError(_NO_TOKEN.message)
    check_mask(attention_mask, name="attention_mask")


# Rules the drop-ins add to the mask rules: upstream's "no valid token" error
# (checked before anything else, as upstream does), and NOTE [Narrow mask dtypes].
_NO_TOKEN = Rule("attention_mask must contain at least one valid token")

# NOTE [Narrow mask dtypes]
# Upstream counts document lengths in the mask's dtype: always in
# get_seqlens_in_batch, and in get_unpad_data / build_packed_sequence_metadata
# when ids exceed 1 (a mask of ids at most 1 is counted as bool, in int64).
# A uint8 / int8 / int16 count wraps past the dtype's maximum (a 256-token
# document of a uint8 mask counts 0 and vanishes), so where upstream would
# count a document that does not fit, the drop-ins raise ``ValueError``
# instead, eager and compiled alike (a sync-free assert there). A document
# of exactly the maximum (255 tokens for uint8) is fine. int32 and int64
# masks cannot overflow (their maximum exceeds any sequence length).


def _narrow_limit(dtype: torch.dtype) -> int | None:
    """The largest count a mask of ``dtype`` holds, or None where no document can exceed it."""
    if dtype in (torch.uint8, torch.int8, torch.int16):
        return int(torch.iinfo(dtype).max)
    return None


def _overflow_rule(dtype: torch.dtype, limit: int) -> Rule:
    return Rule(
        f"a document of more than {limit} tokens does not fit attention_mask's dtype {dtype}, "
        "in which its length is counted; pass an int32 or int64 mask"
    )


def _dropin_rules(
    attention_mask: torch.Tensor,
    broken: torch.Tensor,
    *,
    num_tokens: torch.Tensor | None,
    overflow: torch.Tensor | None,
) -> tuple[torch.Tensor, tuple[Rule, ...]]:
    """The drop-ins' flags and rules: no valid token (where given), the mask rules, then (narrow dtypes) overflow."""
    flags, rules = [broken], _ops.mask_rules(attention_mask.shape[1], "attention_mask")
    if num_tokens is not None:
        flags.insert(0, (num_tokens == 0).reshape(1))
        rules = (_NO_TOKEN, *rules)
    if overflow is not None:
        flags.append(overflow.reshape(1))
        rules = (*rules, _overflow_rule(attention_mask.dtype, _narrow_limit(attention_mask.dtype)))
    return torch.cat(flags), rules


# NOTE [Exact sizes on the CPU]
# The drop-ins are the static op at full capacity followed by one trim: one
# host read, which on an accelerator is the one sync they may make. A CPU
# tensor in eager has no device to synchronize with, so there
# get_unpad_data, get_seqlens_in_batch and build_packed_sequence_metadata
# work at exact sizes from the start: ``nonzero`` finds the valid tokens,
# the differences of neighbouring valid ids (each row's first valid token,
# found by a search, marked apart) find the documents and any decrease, and
# a second ``nonzero`` their starts: about half the aten calls of the
# static kernel, on outputs of the real size, which the drop-ins then trim
# as they trim the static op's (a no-op); the batch-major boundaries are
# scattered from the documents' rows. flatten_packed_sequence_metadata
# checks and flattens batch-major metadata in NumPy, where it is installed,
# on views of its inputs (its work is mostly on a few dozen boundaries,
# where a call's overhead is its cost). packed_layout reads its row length
# from the small document table first, then builds the aligned_layout
# eager kernel's tables from that document table at that length. The
# rules and messages are the same (``checked_ints``), and tests hold both
# paths equal on generated inputs, broken ones included. Under
# torch.compile, torch.export, a dispatch mode or on another device the
# static path runs.


def _exact_varlen(attention_mask: torch.Tensor) -> _ops.VarlenOutputs:
    """``packfn::varlen_metadata``'s outputs for a CPU mask, at exact sizes (NOTE [Exact sizes on the CPU]).

    ``indices`` holds the valid positions only, ``cu_seqlens`` / ``seqlens``
    the real documents only; trimming them to their counts changes nothing.
    The third rule (too many documents) never breaks: ``D = sequence``.
    """
    batch, sequence = attention_mask.shape
    flat = attention_mask.reshape(-1)
    indices = nonzero(flat != 0)
    ids = flat.index_select(0, indices)
    if ids.dtype in (torch.bool, torch.uint8):
        ids = ids.to(torch.int16)  # so that a difference of ids cannot wrap
    tokens = indices.numel()
    # step[j] for a valid token j > 0 is its id minus the previous valid
    # token's (non-negative ids cannot overflow); then each row's first
    # valid token and the end (found by a search of the row starts and the
    # mask's end) are marked 1. The documents start where step is not 0, and
    # ids decrease where it is negative.
    step = ids.new_empty(tokens + 1)
    torch.sub(ids[1:], ids[:-1], out=step[1:tokens])
    row_starts = torch.arange(0, batch * sequence + 1, sequence, device=indices.device)
    step.index_fill_(0, torch.searchsorted(indices, row_starts), 1)
    cu_seqlens = nonzero(step != 0).to(torch.int32)
    seqlens = cu_seqlens.diff()
    no = step.new_zeros((), dtype=torch.bool)
    negative = ids.min() < 0 if ids.dtype.is_signed and tokens else no
    return _ops.VarlenOutputs(
        indices=indices,
        cu_seqlens=cu_seqlens,
        seqlens=seqlens,
        max_seqlen=seqlens.max() if seqlens.numel() else seqlens.new_zeros(()),
        num_tokens=indices.new_full((), tokens),
        num_documents=indices.new_full((), seqlens.numel()),
        broken=torch.stack([negative, step.min() < 0, no]),
    )


def _exact_batch(attention_mask: torch.Tensor) -> _ops.BatchOutputs:
    """``packfn::batch_metadata``'s outputs for a CPU mask, from :func:`_exact_varlen` (NOTE [Exact sizes on the CPU]).

    ``cu_seqlens`` is ``[batch, D + 1]`` for ``D`` the most documents of a
    row, which the drop-in pads and cuts to upstream's width.
    """
    batch, sequence = attention_mask.shape
    device = attention_mask.device
    flat = _exact_varlen(attention_mask)
    documents = flat.seqlens.numel()
    starts, ends = flat.cu_seqlens[:-1].long(), flat.cu_seqlens[1:].long()
    rows = flat.indices.index_select(0, starts).div(sequence, rounding_mode="floor")
    num_documents = torch.bincount(rows, minlength=batch)
    # Each document's index in its row, and the valid tokens of the rows before it.
    first = torch.ones(documents, dtype=torch.bool, device=device)
    first[1:] = rows[1:] != rows[:-1]
    order = torch.arange(documents, device=device)
    first_of_row = torch.where(first, order, 0).cummax(0).values
    width = int(num_documents.max()) if documents else 0  # a CPU read, no device sync
    cu_seqlens = torch.full((batch, width + 1), -1, dtype=torch.int32, device=device)
    cu_seqlens[:, 0] = 0
    cu_seqlens[rows, order + 1 - first_of_row] = (ends - starts.index_select(0, first_of_row)).int()
    row_max_seqlen = torch.zeros(batch, dtype=torch.int32, device=device).scatter_reduce_(0, rows, flat.seqlens, "amax")
    columns = torch.arange(sequence, device=device).expand(batch, sequence)
    packed_token_indices = columns.masked_fill(attention_mask == 0, -1)
    return _ops.BatchOutputs(packed_token_indices, cu_seqlens, row_max_seqlen, num_documents, flat.broken)


def _varlen_for_dropin(attention_mask: torch.Tensor) -> _ops.VarlenOutputs:
    """What a drop-in trims: exact sizes on a CPU tensor in eager, else the static op (``D = sequence``)."""
    if exact_on_cpu(attention_mask):
        return _exact_varlen(attention_mask)
    return _ops.varlen_metadata_op(attention_mask, attention_mask.shape[1])


def get_seqlens_in_batch(attention_mask: torch.Tensor) -> torch.Tensor:
    """Return document lengths in batch-major, document-id order (drop-in).

    Args:
        attention_mask: ``[batch, sequence]`` integer document ids.

    Returns:
        ``[documents]`` lengths in the mask's dtype, documents of zero
        tokens (gaps in ids) left out. For the example mask: ``[2, 3, 4]``.

    Raises:
        ValueError: a bool or non-integer mask, a mask that is not a
            non-empty ``[batch, sequence]`` tensor, negative or decreasing
            ids, or a document longer than the mask's dtype can count
            (NOTE [Narrow mask dtypes]). Under ``torch.compile`` the data
            errors are sync-free asserts with the same messages.
    """
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dtype == torch.bool:
        raise ValueError("get_seqlens_in_batch needs integer document ids, got a bool mask; use get_unpad_data")
    _check_dropin_mask(attention_mask)
    batch, sequence = attention_mask.shape
    limit = _narrow_limit(attention_mask.dtype)
    parsed = _varlen_for_dropin(attention_mask)
    # An all-padding mask is no error here: upstream returns no lengths.
    overflow = None if limit is None else parsed.max_seqlen > limit
    flags, rules = _dropin_rules(attention_mask, parsed.broken, num_tokens=None, overflow=overflow)
    (documents,) = checked_ints([parsed.num_documents], [batch * sequence], flags, rules)
    return parsed.seqlens[:documents].to(attention_mask.dtype)


def get_unpad_data(attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Return ``(indices, cu_seqlens, max_seqlen)`` for varlen attention (drop-in).

    Args:
        attention_mask: ``[batch, sequence]`` integer or bool document ids.
            Every distinct id of a row is one document; a bool mask (or ids
            all 1) has one document per non-empty row.

    Returns:
        ``indices``: int64 ``[tokens]`` into the flattened
        ``[batch * sequence]`` mask; ``cu_seqlens``: int32
        ``[documents + 1]`` starting at 0; ``max_seqlen``: Python int. For
        the example mask: ``([0, 1, 2, 3, 4, 6, 7, 8, 9], [0, 2, 5, 9], 4)``.

    Raises:
        ValueError: the mask is not rank two ("shape"), has no valid token
            ("at least one valid token"), is floating, has negative or
            decreasing ids, or (ids above 1) a document longer than the
            mask's dtype can count (NOTE [Narrow mask dtypes]). Under
            ``torch.compile`` the data errors are sync-free asserts with the
            same messages.
    """
    _check_dropin_mask(attention_mask)
    batch, sequence = attention_mask.shape
    limit = _narrow_limit(attention_mask.dtype)
    parsed = _varlen_for_dropin(attention_mask)
    overflow = None
    if limit is not None:
        overflow = (parsed.max_seqlen > limit) & (attention_mask.max() > 1)
    flags, rules = _dropin_rules(attention_mask, parsed.broken, num_tokens=parsed.num_tokens, overflow=overflow)
    tokens, documents, longest = checked_ints(
        [parsed.num_tokens, parsed.num_documents, parsed.max_seqlen],
        [batch * sequence, batch * sequence, sequence],
        flags,
        rules,
    )
    return parsed.indices[:tokens], parsed.cu_seqlens[: documents + 1], longest


# Upstream sizes cu_seqlens [batch, largest id + 1]; past this no tensor can
# hold it (the compiled path's unbacked sizes stop at 2**62 too).
_ID_LIMIT = 2**62 - 1
_HUGE_ID = Rule(
    f"a document id above {_ID_LIMIT} cannot size build_packed_sequence_metadata's cu_seqlens "
    "[batch, largest id + 1]; renumber the documents of each row from 1"
)


def build_packed_sequence_metadata(attention_mask: torch.Tensor) -> PackedSequenceMetadata:
    """Return batch-major metadata that survives microbatch splits (drop-in).

    Args:
        attention_mask: ``[batch, sequence]`` integer or bool document ids.

    Returns:
        A dict with ``packed_token_indices`` int64 ``[batch, sequence]`` (the
        column, -1 at padding), ``cu_seqlens`` int32
        ``[batch, max(1, mask.max()) + 1]`` (row-local, -1 after each row's
        last boundary) and ``max_seqlen`` (Python int). For the example
        mask: ``cu_seqlens = [[0, 2, 5], [0, 4, -1]]``.

    Raises:
        ValueError: as :func:`get_unpad_data` (the dtype rule applies per
            row, as upstream counts each row apart), and an id above
            ``2**62 - 1`` (upstream would size a row past any tensor).
    """
    _check_dropin_mask(attention_mask)
    batch, sequence = attention_mask.shape
    parsed = (
        _exact_batch(attention_mask)
        if exact_on_cpu(attention_mask)
        else _ops.batch_metadata_op(attention_mask, sequence)
    )
    overflow = None
    limit = _narrow_limit(attention_mask.dtype)
    if limit is not None:
        overflow = ((parsed.row_max_seqlen > limit) & (attention_mask.amax(1) > 1)).any()
    num_tokens = (parsed.packed_token_indices >= 0).sum()
    flags, rules = _dropin_rules(attention_mask, parsed.broken, num_tokens=num_tokens, overflow=overflow)
    id_bound = 1 if attention_mask.dtype == torch.bool else min(int(torch.iinfo(attention_mask.dtype).max), _ID_LIMIT)
    largest_id = attention_mask.max().to(torch.int64).clamp_min(1)
    # An id past the limit would size a row no tensor holds: flagged, and read
    # as 1 so that the compiled path allocates nothing before its assert fires.
    too_large = largest_id > _ID_LIMIT
    flags, rules = torch.cat([flags, too_large.reshape(1)]), (*rules, _HUGE_ID)
    largest_id = torch.where(too_large, 1, largest_id)
    width, longest = checked_ints([largest_id, parsed.row_max_seqlen.max()], [id_bound, sequence], flags, rules)
    # Upstream sizes the rows by the largest id, which gaps in ids can push
    # past the static capacity: pad with -1, then cut to the upstream width.
    filler = parsed.cu_seqlens.new_full((batch, width + 1), -1)
    cu_seqlens = torch.cat([parsed.cu_seqlens, filler], dim=1)[:, : width + 1]
    if not torch.compiler.is_compiling():  # eager: a new tensor of upstream's strides (traced: unbacked width)
        cu_seqlens = cu_seqlens.clone(memory_format=torch.contiguous_format)
    return {"packed_token_indices": parsed.packed_token_indices, "cu_seqlens": cu_seqlens, "max_seqlen": longest}


_FLAT_RULES = (Rule("Flat packed sequence metadata must start at zero and cover every token index"),)
# Upstream's one message for every broken rule of batch-major metadata (the core's FLATTEN_RULES, and no document).
_BATCH_METADATA_ERROR = "Each packed sequence metadata row must start at zero, be monotonic, and cover its valid tokens"
_FLATTEN_RULES = tuple(Rule(_BATCH_METADATA_ERROR) for _ in _ops.FLATTEN_RULES)
_NO_DOCUMENT = Rule(_BATCH_METADATA_ERROR)


def flatten_packed_sequence_metadata(
    packed_token_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    batch_size: int,
    sequence_length: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalize batch-major (or already flat) metadata to one flat token stream (drop-in).

    Args:
        packed_token_indices: ``[batch, sequence]`` row-local columns with -1
            at padding, or flat ``[tokens]`` indices into ``[batch * sequence]``.
        cu_seqlens: ``[batch, max_documents + 1]`` row-local boundaries with
            -1 after each row's last, or flat ``[documents + 1]``.
        batch_size: Batch size of the padded layout.
        sequence_length: Sequence length of the padded layout.

    Returns:
        ``(indices, cu_seqlens)``: int64 ``[tokens]`` into
        ``[batch * sequence]`` and ``[documents + 1]`` boundaries in the
        dtype of ``cu_seqlens``. Flat inputs come back as they are (indices
        as int64).

    Raises:
        ValueError: inconsistent layouts or boundaries, with upstream's
            messages; a flat total of valid tokens that ``cu_seqlens``' dtype
            cannot hold (upstream wraps it). Under ``torch.compile`` the
            checks of values are sync-free asserts with the same messages.
    """
    check_integer_tensor(packed_token_indices, "packed_token_indices")
    check_integer_tensor(cu_seqlens, "cu_seqlens")
    if packed_token_indices.ndim == 1 and cu_seqlens.ndim == 1:
        if cu_seqlens.numel() < 2:
            raise ValueError(_FLAT_RULES[0].message)
        broken = (
            (cu_seqlens[0] != 0)
            | (cu_seqlens[-1] != packed_token_indices.numel())
            | (cu_seqlens[1:] < cu_seqlens[:-1]).any()
        )
        checked_ints([], [], broken.reshape(1), _FLAT_RULES)
        return packed_token_indices.to(torch.long), cu_seqlens
    check_metadata_shapes(packed_token_indices, cu_seqlens, batch_size, sequence_length)
    if packed_token_indices.numel() == 0:
        raise ValueError(_NO_DOCUMENT.message)
    rules = (*_FLATTEN_RULES, _NO_DOCUMENT)
    # Upstream writes the flat boundaries in cu_seqlens' dtype, where a narrow one wraps the running total
    # ([0, 100, -56] in int8): refused instead (the core's flatten_metadata widens to int32).
    limit = torch.iinfo(cu_seqlens.dtype).max
    past = Rule(f"the flat total of the valid tokens is past {limit}, which cu_seqlens' dtype {cu_seqlens.dtype} holds")
    if torch.compiler.is_compiling():
        # The aten body on every device, not the Triton kernels CUDA takes (NOTE [Two launches on a GPU]):
        # torch 2.11 cannot compile a slice by a size read back of a kernel-written output here with dynamic
        # shapes (PendingUnbackedSymbolNotFound; tests/core/test_triton_codegen.py runs it on 2.11).
        flat = _ops.flatten_metadata_op.math(packed_token_indices, cu_seqlens)
        flags = torch.cat([flat.broken, (flat.num_documents == 0).reshape(1), (flat.num_tokens > limit).reshape(1)])
        tokens, documents = checked_ints(
            [flat.num_tokens, flat.num_documents],
            [packed_token_indices.numel(), cu_seqlens.numel()],
            flags,
            (*rules, past),
        )
        return flat.indices[:tokens], flat.cu_seqlens[: documents + 1]
    indices, flat_cu_seqlens = _eager_flatten(packed_token_indices, cu_seqlens, rules)
    if indices.numel() > limit:
        raise ValueError(past.message)
    return indices, flat_cu_seqlens


def _eager_flatten(
    packed_token_indices: torch.Tensor, cu_seqlens: torch.Tensor, rules: tuple[Rule, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch-major case of :func:`flatten_packed_sequence_metadata` in eager: exact on the CPU, else trimmed."""
    if exact_on_cpu(packed_token_indices, cu_seqlens):
        exact = _exact_flatten(packed_token_indices, cu_seqlens, rules)
        if exact is not None:
            return exact
    # Elsewhere in eager: the static boundaries, trimmed; the rule flags and
    # the document count in one read, then the valid tokens at their exact
    # count (no permutation of the padding).
    valid = packed_token_indices >= 0
    flat_cu_seqlens, _, num_documents = _ops.flat_boundaries(cu_seqlens)
    flags = torch.cat([_ops.flatten_violations(valid.sum(dim=1), cu_seqlens), (num_documents == 0).reshape(1)])
    (documents,) = checked_ints([num_documents], [cu_seqlens.numel()], flags, rules)
    batch, sequence = packed_token_indices.shape
    row_offsets = torch.arange(0, batch * sequence, sequence, device=valid.device).unsqueeze(1)
    indices = torch.masked_select(packed_token_indices.long() + row_offsets, valid)
    return indices, flat_cu_seqlens[: documents + 1]


def _exact_flatten(
    packed_token_indices: torch.Tensor, cu_seqlens: torch.Tensor, rules: tuple[Rule, ...]
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The batch-major case of :func:`flatten_packed_sequence_metadata` for CPU tensors, by NumPy (None without it).

    NOTE [Exact sizes on the CPU]: the documents are the differences of
    neighbouring valid boundaries, and the rules are those of
    :func:`packfn._ops.metadata.flatten_violations` (then no document), each
    raising its drop-in message. Some 25 NumPy calls on views of the inputs
    replace some 60 aten calls, most of them on a few dozen boundaries,
    where a call's overhead is its cost. The views are DLPack's, so the
    inputs stay as they were and the outputs, torch tensors that NumPy
    writes into, stay resizable (as aten's). None also for dtypes the other
    paths' aten ops do not take (uint16 and wider), so that all paths agree.
    """
    # The mask dtypes (bool is refused before): those NumPy and the other paths' aten ops share.
    if not {packed_token_indices.dtype, cu_seqlens.dtype} <= MASK_DTYPES:
        return None
    views = numpy_views(packed_token_indices, cu_seqlens)
    if views is None:
        return None
    refuse_jit_trace()  # NumPy's work is invisible to a trace
    outcome = _flatten_views(*views, cu_seqlens.dtype, rules)
    # Raised here, once the views are gone: a traceback keeps its frames'
    # locals, and a view outlives a resize of the input it shows.
    if isinstance(outcome, Rule):
        raise ValueError(outcome.message)
    return outcome


def _flatten_views(columns, bounds, dtype: torch.dtype, rules: tuple[Rule, ...]):
    """:func:`_exact_flatten` on NumPy views: the outputs, or the first broken rule."""
    batch, sequence = columns.shape
    valid = columns >= 0
    row_tokens = numpy.count_nonzero(valid, axis=1)
    valid_bounds = bounds >= 0
    count = numpy.count_nonzero(valid_bounds, axis=1)
    pairs = valid_bounds[:, 1:] & valid_bounds[:, :-1]
    lengths = (bounds[:, 1:] - bounds[:, :-1])[pairs]  # wrap in narrow dtypes as aten's do; compared below
    last = bounds[numpy.arange(batch), numpy.maximum(count - 1, 0)]
    flags = (
        (bounds[:, 0] != 0).any(),  # also where a row has no valid boundary
        (bounds[:, 1:] < bounds[:, :-1])[pairs].any(),
        (valid_bounds & (numpy.cumsum(~valid_bounds, axis=1) > 0)).any(),
        (last != row_tokens).any(),
        lengths.size == 0,
    )
    for flag, rule in zip(flags, rules, strict=True):
        if flag:
            return rule
    indices = torch.empty(int(row_tokens.sum()), dtype=torch.int64, device="cpu")
    flat_cu_seqlens = torch.empty(lengths.size + 1, dtype=dtype, device="cpu")
    # Writeable as the inputs' views were (the same bridge).
    selected, boundaries = numpy_views(indices, flat_cu_seqlens)
    row_offsets = numpy.repeat(numpy.arange(0, batch * sequence, sequence, dtype=numpy.int64), row_tokens)
    numpy.add(columns[valid], row_offsets, out=selected, dtype=numpy.int64, casting="unsafe")
    boundaries[0] = 0
    numpy.cumsum(lengths, dtype=boundaries.dtype, out=boundaries[1:])
    return indices, flat_cu_seqlens
