"""Ops that convert between the packing formats users have and packfn's document ids.

The packing format is the one of :mod:`packfn._ops.metadata`. Every op here
never raises on its data: its last output is ``broken``, one bool flag per
rule of its family's table (NOTE [One way to report a broken rule] in
:mod:`packfn._ops._registry`).

- document ids to position ids (``position_ids``, ``document_positions``);
- position ids, EOS / BOS token streams, cumulative lengths, per-document
  lengths and 0-based sequence indices to document ids
  (``document_ids_from_*``);
- document ids to 0-based sequence indices and to THD boundaries
  (``seq_idx_from_document_ids``, ``thd_metadata``).

Every output id mask is int64 ``[batch, sequence]``, 0 at padding.

Shapes: ``B`` batch, ``S`` sequence, ``D`` documents (slots) per row,
``N`` entries of a ``cu_seqlens`` table.

NOTE [Position ids by two running maxima]
A valid token's position is its rank among the valid tokens of its document;
a padding token continues the count of the last valid token before it in its
row (its position plus the distance) and counts from the row start when
there is none. With ``n`` the running count of valid tokens in the row, ``R``
and ``c`` the running maximum of the ids and the column where it was last
reached (``cummax``: ties go to the later index, in aten and in Inductor's
scan), and ``n_s`` the count at the first token of the current document
(a running maximum of ``n`` over the document starts, where the id exceeds
the running maximum before it):

    position = n - n_s + column - c     (c := 0 before the row's first valid token)

For a valid token ``c`` is its own column, so it is its rank ``n - n_s``; a
padding token adds its distance to the last valid one. Two scans and a
cumsum, no gather and no scatter: the decomposition. On the CPU the eager
kernel walks the runs of equal ids instead (NOTE [Eager kernels]): a few
passes over the mask and arithmetic over the runs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from packfn._ops._cpu import numpy, numpy_view
from packfn._ops._registry import Rule, named_value, packfn_op
from packfn._ops.metadata import (
    binary_search_slots,
    broken_fake,
    compact,
    parse_mask,
    parse_mask_eager,
    varlen_from,
)
from packfn._ops.scan import running_sum

__all__ = [
    "CU_SEQLENS_RULES",
    "SEQ_IDX_RANGE_RULE",
    "SEQ_IDX_RULES",
    "SEQ_LENS_RULES",
    "THD_RULES",
    "DocumentPositions",
    "EosDocumentsOutputs",
    "IdsOutputs",
    "PositionOutputs",
    "SeqIdxOutputs",
    "ThdOutputs",
    "document_ids_from_cu_seqlens_op",
    "document_ids_from_eos_op",
    "document_ids_from_position_ids_op",
    "document_ids_from_seq_idx_op",
    "document_ids_from_seq_lens_op",
    "document_positions_op",
    "eos_rules",
    "held",
    "holds",
    "position_id_rules",
    "position_ids_op",
    "seq_idx_from_document_ids_op",
    "thd_metadata_op",
]


def _ids_fake(tensor: torch.Tensor, rules: int):
    """int64 ``[batch, sequence]`` and ``rules`` flags, from a ``[batch, sequence]`` input."""
    return tensor.new_empty(tensor.shape, dtype=torch.int64), tensor.new_empty(rules, dtype=torch.bool)


def _false(like: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), dtype=torch.bool, device=like.device)


# NOTE [Shifts of full width]
# "The value before each one along a row" is written F.pad(x, (1, 0))[..., :-1]
# (and the one after, F.pad(x, (0, 1))[..., 1:]), never as x[..., 1:] op
# x[..., :-1]: an elementwise op between two slices of width S - 1 makes the
# tracer guard on S - 1 != 1 (broadcasting a width of 1 differs), so a dynamic
# compile recompiles at two columns and torch.export with a Dim on the sequence
# fails its default range, which includes 2.


def _before(x: torch.Tensor, fill) -> torch.Tensor:
    """The entry before each one along the last axis, ``fill`` first (NOTE [Shifts of full width])."""
    return F.pad(x, (1, 0), value=fill)[..., :-1]


def _after(x: torch.Tensor, fill) -> torch.Tensor:
    """The entry after each one along the last axis, ``fill`` last (NOTE [Shifts of full width])."""
    return F.pad(x, (0, 1), value=fill)[..., 1:]


# ------------------------------------------------------------ position ids


# "No column": above any column, so that a running minimum passes it over.
_NONE = 2**62


def _mask_ints(document_ids: torch.Tensor) -> torch.Tensor:
    """The ids in a dtype ``cummax`` and comparisons take (bool as uint8)."""
    return document_ids.to(torch.uint8) if document_ids.dtype == torch.bool else document_ids


def _positions_math(document_ids: torch.Tensor, padding: bool = True):
    """Position ids ``[B, S]``, validity ``[B, S]``, the mask-rule flags (NOTE [Position ids by two running maxima]).

    ``padding=False`` is the static promise that no id is 0 and every run of
    equal ids is a document (an EOS stream without padding): each position is
    then its column minus its run's first, by one running maximum, and the
    validity and the flags are None.
    """
    ids = _mask_ints(document_ids)
    sequence = ids.shape[1]
    columns = torch.arange(sequence, device=ids.device)
    if not padding:
        starts = ids != _before(ids, -1)
        return columns - torch.where(starts, columns, 0).cummax(1).values, None, None
    running, last = ids.cummax(1)
    valid = ids != 0
    seen = running_sum(valid)
    # A start: the id exceeds the running maximum before it (padding never does).
    starts = ids > _before(running, 0)
    first_seen = torch.where(starts, seen, 0).cummax(1).values
    last = torch.where(seen > 0, last, 0)
    positions = seen - first_seen + columns - last
    negative = (ids < 0).any() if ids.dtype.is_signed else _false(ids)
    broken = torch.stack([negative, (valid & (ids < running)).any(), _false(ids)])
    return positions, valid, broken


def _runs_cpu(document_ids: torch.Tensor):
    """The runs of equal ids of a CPU mask in NumPy, or None (no NumPy, no bridge, an empty mask)."""
    array = numpy_view(document_ids) if document_ids.device.type == "cpu" and document_ids.numel() else None
    if array is None:
        return None
    batch, sequence = array.shape
    if array.dtype == numpy.bool_:
        array = array.view(numpy.uint8)
    change = numpy.empty((batch, sequence), dtype=numpy.bool_)
    change[:, 0] = True
    numpy.not_equal(array[:, 1:], array[:, :-1], out=change[:, 1:])
    start = numpy.flatnonzero(change)  # flat position of each run's first token
    length = numpy.empty_like(start)
    numpy.subtract(start[1:], start[:-1], out=length[:-1])
    length[-1] = batch * sequence - start[-1]
    run_id = array.reshape(-1)[start].astype(numpy.int64)
    return array, start, length, run_id


def _document_runs(starts) -> tuple:
    """NumPy: the documents of contiguous rows from their first tokens (bool ``[B, S]``, column 0 always set).

    Returns each document's flat first position, its length and its 1-based
    index in its row.
    """
    batch, sequence = starts.shape
    first = numpy.flatnonzero(starts)
    length = numpy.empty_like(first)
    numpy.subtract(first[1:], first[:-1], out=length[:-1])
    length[-1] = batch * sequence - first[-1]
    index = numpy.arange(first.size)
    row_first = numpy.maximum.accumulate(numpy.where(first % sequence == 0, index, 0))
    return first, length, index - row_first + 1


def _expand(values, length, shape):
    """NumPy: each run's value over its run, as ``shape``."""
    return numpy.repeat(values, length).reshape(shape)


def _run_positions(offset, length, shape):
    """NumPy: position ids of runs: each token's column plus its run's ``offset`` (``-column`` at a document start)."""
    positions = _expand(offset, length, shape)
    numpy.add(positions, numpy.arange(shape[1]), out=positions)
    return positions


def _positions_cpu(document_ids: torch.Tensor):
    """:func:`_positions_math` on a CPU mask, run by run (NOTE [Eager kernels]); None where NumPy is not to be had.

    Positions inside a run of equal ids are ``column + offset`` with one
    offset per run: a valid run's offset makes its first token continue the
    valid tokens of its document in earlier runs (padding inside a document
    does not count), and a padding run inherits the offset of the run before
    it in its row (so it continues that run's count), or 0 at a row start.
    """
    runs = _runs_cpu(document_ids)
    if runs is None:
        return None
    array, start, length, run_id = runs
    sequence = array.shape[1]
    column = start % sequence
    valid = numpy.flatnonzero(run_id)
    row = start[valid] // sequence
    valid_id = run_id[valid]
    same_row = row[1:] == row[:-1]
    new_document = numpy.ones(valid.size, dtype=numpy.bool_)
    numpy.logical_or(~same_row, valid_id[1:] != valid_id[:-1], out=new_document[1:])
    offset = -column  # a valid run that begins its document: its first token is position 0
    if not new_document.all():  # documents with padding inside them: count their valid tokens in earlier runs
        earlier = numpy.cumsum(length[valid]) - length[valid]
        offset[valid] += earlier - numpy.maximum.accumulate(numpy.where(new_document, earlier, 0))
    padding = numpy.flatnonzero(run_id == 0)
    offset[padding] = numpy.where(column[padding] != 0, offset[numpy.maximum(padding - 1, 0)], 0)
    positions = _run_positions(offset, length, array.shape)
    broken = numpy.array([(run_id < 0).any(), (same_row & (valid_id[1:] < valid_id[:-1])).any(), False])
    return positions, broken, (array, start, length, run_id, valid, new_document)


def _position_ids_fake(document_ids: torch.Tensor):
    """int64 ``[batch, sequence]`` and the rule flags."""
    return document_ids.new_empty(document_ids.shape, dtype=torch.int64), broken_fake(document_ids)


class PositionOutputs(NamedTuple):
    """Outputs of ``packfn::position_ids``."""

    position_ids: torch.Tensor  # int64 [batch, sequence]
    broken: torch.Tensor  # bool [3]: mask_rules


def _position_ids_eager(document_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cpu = _positions_cpu(document_ids)
    if cpu is None:
        return tuple(position_ids_op.math(document_ids))
    positions, broken, _ = cpu
    return torch.from_numpy(positions), torch.from_numpy(broken)


@packfn_op(
    "position_ids", fake=_position_ids_fake, outputs=PositionOutputs, eager=_position_ids_eager, gpu="position_kernels"
)
def position_ids_op(document_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    positions, _, broken = _positions_math(document_ids)
    return positions, broken


def _document_positions_fake(document_ids: torch.Tensor):
    """int64 ``[batch, sequence]`` twice and the rule flags."""
    shape = document_ids.shape
    new = document_ids.new_empty
    return new(shape, dtype=torch.int64), new(shape, dtype=torch.int64), broken_fake(document_ids)


class DocumentPositions(NamedTuple):
    """Outputs of ``packfn::document_positions``: what a causal LM needs of a mask besides its attention mask."""

    position_ids: torch.Tensor  # int64 [batch, sequence]
    next_token: torch.Tensor  # int64 [batch, sequence]: flat index of the next valid token of the document, or -1
    broken: torch.Tensor  # bool [3]: mask_rules


def _document_positions_eager(document_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    cpu = _positions_cpu(document_ids)
    if cpu is None:
        return tuple(document_positions_op.math(document_ids))
    positions, broken, (array, start, length, run_id, valid, new_document) = cpu
    # A valid run whose document goes on after padding: its last token's next token is the next run's first.
    next_run = numpy.full(start.size, -1, dtype=numpy.int64)
    continued = ~new_document[1:]
    next_run[valid[:-1][continued]] = start[valid[1:][continued]]
    # Inside a valid run the next token is the next column; at its last token, the next run of the document.
    flat = numpy.arange(1, array.size + 1, dtype=numpy.int64)
    numpy.putmask(flat, numpy.repeat(run_id == 0, length), -1)
    flat[start + length - 1] = next_run
    return torch.from_numpy(positions), torch.from_numpy(flat.reshape(array.shape)), torch.from_numpy(broken)


@packfn_op(
    "document_positions", fake=_document_positions_fake, outputs=DocumentPositions, eager=_document_positions_eager
)
def document_positions_op(document_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    positions, valid, broken = _positions_math(document_ids)
    ids = _mask_ints(document_ids)
    batch, sequence = ids.shape
    columns = torch.arange(sequence, device=ids.device)
    # The first valid column after each token in its row (_NONE if none): a running minimum from the right.
    ahead = torch.where(valid, columns, _NONE).flip(1).cummin(1).values.flip(1)
    after = _after(ahead, _NONE)
    found = after != _NONE
    same = ids.gather(1, torch.where(found, after, 0)) == ids
    rows = torch.arange(batch, device=ids.device).unsqueeze(1) * sequence
    next_token = torch.where(valid & found & same, rows + after, -1)
    return positions, next_token, broken


# ---------------------------------------------------- from position ids


def position_id_rules(start: int | None) -> tuple[Rule, ...]:
    """Data rules of ``position_ids`` for documents that begin at ``start`` (None: anywhere)."""
    return (
        Rule("position_ids must not be negative"),
        Rule(
            f"every document of position_ids must begin at {named_value('start', start)} (positions that never "
            "restart, or a row that begins inside a document); pass start=None to accept any first position"
        ),
    )


class IdsOutputs(NamedTuple):
    """Outputs of the ``packfn::document_ids_from_*`` ops but EOS: the mask and the rule flags."""

    document_ids: torch.Tensor  # int64 [batch, sequence]: 1-based ids local to each row, 0 at padding
    broken: torch.Tensor  # bool [len(rules)]


def holds(dtype: torch.dtype, value: int) -> bool:
    """Whether ``dtype`` holds ``value`` (a tensor compared with an int it cannot hold wraps it: uint8 256 == 0)."""
    if dtype == torch.bool:
        return value in (0, 1)
    return torch.iinfo(dtype).min <= value <= torch.iinfo(dtype).max


def _valid_tokens(
    values: torch.Tensor, attention_mask: torch.Tensor | None, pad_value: int | None
) -> torch.Tensor | None:
    """Bool ``[B, S]``: not padding (a nonzero mask entry, a value other than ``pad_value``); None without padding."""
    valid = None if attention_mask is None else attention_mask != 0
    if pad_value is not None and holds(values.dtype, pad_value):  # a value the dtype cannot hold marks nothing
        real = values != pad_value
        valid = real if valid is None else valid & real
    return valid


def _previous_valid(valid: torch.Tensor) -> torch.Tensor:
    """int64 ``[B, S]``: the column of the last valid token before each one in its row, -1 where there is none."""
    columns = torch.arange(valid.shape[1], device=valid.device)
    return _before(torch.where(valid, columns, -1).cummax(1).values, -1)


def _from_position_ids_fake(
    position_ids: torch.Tensor, attention_mask: torch.Tensor | None, pad_position: int | None, start: int | None
):
    """int64 ``[batch, sequence]`` and 2 rule flags."""
    return _ids_fake(position_ids, 2)


def _from_position_ids_eager(
    position_ids: torch.Tensor, attention_mask: torch.Tensor | None, pad_position: int | None, start: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Without padding, on the CPU: the documents by NumPy, as runs (NOTE [Eager kernels]); else the decomposition."""
    array = None
    if attention_mask is None and pad_position is None and position_ids.device.type == "cpu" and position_ids.numel():
        array = numpy_view(position_ids)
    if array is None:
        return tuple(document_ids_from_position_ids_op.math(position_ids, attention_mask, pad_position, start))
    starts = numpy.empty(array.shape, dtype=numpy.bool_)
    starts[:, 0] = True
    array = array.astype(numpy.int64, copy=False)  # a difference in a narrow dtype wraps (255 -> 0 in uint8)
    numpy.not_equal(array[:, 1:] - array[:, :-1], 1, out=starts[:, 1:])
    first, length, index = _document_runs(starts)
    opening = array.reshape(-1)[first]
    restart = start is not None and bool((opening != start).any())
    # Every position, not only each document's first: 2**63 - 1 then -2**63 differ by 1 in int64 (a wrap).
    broken = numpy.array([array.min() < 0, restart])
    return torch.from_numpy(_expand(index, length, array.shape)), torch.from_numpy(broken)


@packfn_op(
    "document_ids_from_position_ids",
    fake=_from_position_ids_fake,
    outputs=IdsOutputs,
    eager=_from_position_ids_eager,
    gpu="position_id_kernels",
)
def document_ids_from_position_ids_op(
    position_ids: torch.Tensor, attention_mask: torch.Tensor | None, pad_position: int | None, start: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    positions = position_ids.to(torch.int64)
    valid = _valid_tokens(positions, attention_mask, pad_position)
    if valid is None:
        # No padding: the previous token is the one before, and the row start begins a document.
        starts = positions != _before(positions, -2) + 1
        ids = running_sum(starts)
        negative = (positions < 0).any()
    else:
        previous = _previous_valid(valid)
        before = positions.gather(1, previous.clamp_min(0))
        starts = valid & ((previous < 0) | (positions != before + 1))
        ids = torch.where(valid, running_sum(starts), 0)
        negative = (valid & (positions < 0)).any()
    restart = (starts & (positions != start)).any() if start is not None else _false(positions)
    return ids, torch.stack([negative, restart])


# --------------------------------------------------------------- from EOS


def eos_rules(vocab_size: int | None) -> tuple[Rule, ...]:
    """Data rules of an EOS- or BOS-delimited token stream (none without a vocabulary)."""
    return (Rule(f"input_ids must lie in [0, {named_value('vocab_size', vocab_size)})"),)


class EosDocumentsOutputs(NamedTuple):
    """Outputs of ``packfn::document_ids_from_eos``."""

    document_ids: torch.Tensor  # int64 [batch, sequence]
    position_ids: torch.Tensor  # int64 [batch, sequence]
    loss_mask: torch.Tensor  # bool [batch, sequence]
    broken: torch.Tensor  # bool [1]: eos_rules


def _from_eos_fake(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    eos_token_ids: list[int],
    bos: bool,
    pad_token_id: int | None,
    vocab_size: int | None,
    reset_position_ids: bool,
    reset_attention_mask: bool,
    eod_mask_loss: bool,
):
    """int64 ids and positions ``[batch, sequence]``, a bool loss mask, 1 rule flag."""
    new = input_ids.new_empty
    shape = input_ids.shape
    return (
        new(shape, dtype=torch.int64),
        new(shape, dtype=torch.int64),
        new(shape, dtype=torch.bool),
        new(1, dtype=torch.bool),
    )


def held(dtype: torch.dtype, token_ids: list[int]) -> list[int]:
    """The ids a token of ``dtype`` can equal (NOTE in :func:`holds`)."""
    return [token for token in token_ids if holds(dtype, token)]


def _eos_documents(input_ids, attention_mask, eos_token_ids, bos, pad_token_id):
    """Document ids ``[B, S]`` (0 at padding), the marker tokens and the valid tokens (None without padding)."""
    markers = torch.zeros(input_ids.shape, dtype=torch.bool, device=input_ids.device)
    for token in held(input_ids.dtype, eos_token_ids):
        markers = markers | (input_ids == token)
    valid = _valid_tokens(input_ids, attention_mask, pad_token_id)
    if bos:
        # A marker begins its document; the row start begins one too.
        documents = running_sum(markers | (torch.arange(input_ids.shape[1], device=input_ids.device) == 0))
    else:
        # A marker ends its document: the next token begins the next one.
        documents = running_sum(markers) - markers.long() + 1
    if valid is not None:
        documents = torch.where(valid, documents, 0)
    return documents, markers, valid


def _eos_outputs(input_ids, documents, markers, valid, positions, vocab_size, reset_attention_mask, eod_mask_loss):
    if positions is None:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand(input_ids.shape).contiguous()
    if not reset_attention_mask:  # one document per row (Megatron's plain causal mask)
        documents = torch.ones_like(documents) if valid is None else valid.long()
    loss_mask = torch.ones(input_ids.shape, dtype=torch.bool, device=input_ids.device) if valid is None else valid
    if eod_mask_loss:
        loss_mask = loss_mask & ~markers
    # Compared in int64 where aten has no CPU comparison of the dtype (uint16, uint32, uint64): exact but for
    # uint64 tokens from 2**63, which turn negative there and count as outside any vocabulary below 2**63.
    wide = input_ids.dtype in (torch.uint16, torch.uint32, torch.uint64)
    tokens = input_ids.to(torch.int64) if wide else input_ids
    if vocab_size is None:
        outside = _false(input_ids)
    elif holds(tokens.dtype, vocab_size):
        outside = ((tokens < 0) | (tokens >= vocab_size)).any()
    else:  # every token the dtype holds is below vocab_size
        outside = (tokens < 0).any()
    return documents, positions, loss_mask, outside.unsqueeze(0)


def _from_eos_eager(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    eos_token_ids: list[int],
    bos: bool,
    pad_token_id: int | None,
    vocab_size: int | None,
    reset_position_ids: bool,
    reset_attention_mask: bool,
    eod_mask_loss: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """On the CPU: without padding the documents are runs (NumPy), else the CPU position ids (NOTE [Eager kernels])."""
    plain = attention_mask is None and pad_token_id is None and input_ids.device.type == "cpu" and input_ids.numel()
    array = numpy_view(input_ids) if plain else None
    if array is not None:
        return _eos_runs_cpu(
            array,
            held(input_ids.dtype, eos_token_ids),
            bos,
            vocab_size,
            reset_position_ids,
            reset_attention_mask,
            eod_mask_loss,
        )
    documents, markers, valid = _eos_documents(input_ids, attention_mask, eos_token_ids, bos, pad_token_id)
    positions = None
    if reset_position_ids:
        cpu = _positions_cpu(documents)
        positions = torch.from_numpy(cpu[0]) if cpu is not None else _eos_positions(documents, valid)
    return _eos_outputs(
        input_ids, documents, markers, valid, positions, vocab_size, reset_attention_mask, eod_mask_loss
    )


def _eos_runs_cpu(array, eos_token_ids, bos, vocab_size, reset_position_ids, reset_attention_mask, eod_mask_loss):
    """:func:`_from_eos_eager` of a padding-free CPU stream: documents are the runs between markers."""
    shape = array.shape
    markers = numpy.zeros(shape, dtype=numpy.bool_)
    for token in eos_token_ids:
        markers |= array == token
    starts = numpy.empty(shape, dtype=numpy.bool_)
    starts[:, 0] = True
    starts[:, 1:] = markers[:, 1:] if bos else markers[:, :-1]
    first, length, index = _document_runs(starts)
    documents = _expand(index, length, shape) if reset_attention_mask else numpy.ones(shape, dtype=numpy.int64)
    if reset_position_ids:
        positions = _run_positions(-(first % shape[1]), length, shape)
    else:
        positions = numpy.broadcast_to(numpy.arange(shape[1]), shape).copy()
    loss_mask = ~markers if eod_mask_loss else numpy.ones(shape, dtype=numpy.bool_)
    outside = vocab_size is not None and bool(array.min() < 0 or array.max() >= vocab_size)
    tensors = (documents, positions, loss_mask, numpy.array([outside]))
    return tuple(torch.from_numpy(numpy.ascontiguousarray(tensor)) for tensor in tensors)


def _eos_positions(documents: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    return _positions_math(documents, padding=valid is not None)[0]


@packfn_op(
    "document_ids_from_eos",
    fake=_from_eos_fake,
    outputs=EosDocumentsOutputs,
    eager=_from_eos_eager,
    gpu="eos_kernels",
)
def document_ids_from_eos_op(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    eos_token_ids: list[int],
    bos: bool,
    pad_token_id: int | None,
    vocab_size: int | None,
    reset_position_ids: bool,
    reset_attention_mask: bool,
    eod_mask_loss: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    documents, markers, valid = _eos_documents(input_ids, attention_mask, eos_token_ids, bos, pad_token_id)
    positions = _eos_positions(documents, valid) if reset_position_ids else None
    return _eos_outputs(
        input_ids, documents, markers, valid, positions, vocab_size, reset_attention_mask, eod_mask_loss
    )


# ------------------------------------------------------- from lengths

SEQ_LENS_RULES = (
    Rule("seq_lens must not be negative"),
    Rule("the seq_lens of a row must not add up to more than sequence (the documents overrun the row)"),
)
"""Data rules of a ``seq_lens`` table, in the order of its op's flags."""


def _ends_at_or_before(ends: torch.Tensor, length: int) -> torch.Tensor:
    """int64 ``[R, length]``: how many entries of each sorted row of ``ends`` (``[R, D]``) lie at or before a column.

    NOTE [Counting boundaries without a search]
    Each group of equal ends writes its size once, at its column (by a scatter whose targets are
    distinct: the other ends go to spare slots of their own, so there are no
    atomics and no ordering to depend on), and a running sum over the columns
    counts them. Linear in ``length``, where a search would be
    ``length * log(D)`` (and aten's CPU ``searchsorted`` is slow).
    """
    rows, slots = ends.shape
    index = torch.arange(slots, device=ends.device)
    last = ends < _after(ends, 2**62)  # the last end of its group of equal ones
    first = torch.where(ends != _before(ends, -1), index, 0).cummax(-1).values
    target = torch.where(last & (ends < length), ends, length + index)
    marks = torch.zeros(rows, length + slots, dtype=torch.int64, device=ends.device)
    marks = marks.scatter(1, target, index - first + 1)
    return running_sum(marks[:, :length])


def _ids_from_lengths(lengths: torch.Tensor, sequence: int) -> torch.Tensor:
    """int64 ``[B, S]``: the 1-based slot of the document each column falls in, 0 past the row's total.

    ``lengths`` is ``[B, D]``, never negative: column ``j`` lies in slot
    ``1 + (documents ending at or before j)``.
    """
    batch, slots = lengths.shape
    if slots == 0:
        return lengths.new_zeros(batch, sequence, dtype=torch.int64)
    ends = running_sum(lengths.to(torch.int64))
    columns = torch.arange(sequence, device=lengths.device)
    return torch.where(columns < ends[:, -1:], _ends_at_or_before(ends, sequence) + 1, 0)


def _ids_from_lengths_cpu(table, sequence: int) -> torch.Tensor:
    """:func:`_ids_from_lengths` of a NumPy int64 table (never negative), by one ``repeat`` (NOTE [Eager kernels])."""
    batch, slots = table.shape
    ends = numpy.minimum(numpy.cumsum(table, axis=1), sequence)
    counts = numpy.diff(ends, axis=1, prepend=0, append=sequence)  # the lengths cut at the row end, then padding
    slot_ids = numpy.arange(1, slots + 2)
    slot_ids[-1] = 0
    ids = numpy.repeat(numpy.tile(slot_ids, batch), counts.reshape(-1))
    return torch.from_numpy(ids.reshape(batch, sequence))


def _from_seq_lens_fake(seq_lens: torch.Tensor, sequence: int):
    """int64 ``[batch, sequence]`` and 2 rule flags."""
    return seq_lens.new_empty(seq_lens.shape[0], sequence, dtype=torch.int64), seq_lens.new_empty(2, dtype=torch.bool)


def _seq_lens_flags(lengths: torch.Tensor, sequence: int) -> torch.Tensor:
    # Clamped to the row first, so that no sum of huge lengths wraps below it.
    overrun = (lengths.clamp(0, sequence + 1).sum(1) > sequence).any()
    return torch.stack([(lengths < 0).any(), overrun])


def _from_seq_lens_eager(seq_lens: torch.Tensor, sequence: int) -> tuple[torch.Tensor, torch.Tensor]:
    table = numpy_view(seq_lens) if seq_lens.device.type == "cpu" and seq_lens.numel() else None
    if table is None:
        return tuple(document_ids_from_seq_lens_op.math(seq_lens, sequence))
    table = table.astype(numpy.int64)
    negative = (table < 0).any()
    table = numpy.clip(table, 0, sequence + 1)  # as _seq_lens_flags: no sum wraps
    broken = numpy.array([negative, (table.sum(1) > sequence).any()])
    return _ids_from_lengths_cpu(table, sequence), torch.from_numpy(broken)


@packfn_op(
    "document_ids_from_seq_lens",
    fake=_from_seq_lens_fake,
    outputs=IdsOutputs,
    eager=_from_seq_lens_eager,
    gpu="seq_lens_kernels",
)
def document_ids_from_seq_lens_op(seq_lens: torch.Tensor, sequence: int) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = seq_lens.to(torch.int64)
    return _ids_from_lengths(lengths.clamp(0, sequence + 1), sequence), _seq_lens_flags(lengths, sequence)


CU_SEQLENS_RULES = (
    Rule("cu_seqlens must start at 0"),
    Rule("cu_seqlens must not decrease"),
    Rule("cu_seqlens must hold no negative entry but trailing -1 padding (a boundary after a -1)"),
    Rule(
        "cu_seqlens must not run past the tokens it describes (a boundary beyond the row; for a flat table, beyond "
        "batch * sequence: pass batch= when it covers several rows)"
    ),
    Rule("a segment of flat cu_seqlens must not cross a row boundary (document ids are local to a row)"),
)
"""Data rules of a ``cu_seqlens`` table, in the order of its op's flags."""


def _cu_seqlens_flags(cu_seqlens: torch.Tensor, limit) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The boundaries (trailing -1 entries replaced by the last present one, clamped to ``[0, limit]``), 4 flags.

    ``cu_seqlens`` is int64 ``[N]`` or ``[B, N]``: one table per row.
    """
    present = cu_seqlens >= 0
    absent_before = running_sum(~present) > 0
    count = present.sum(-1, keepdim=True)
    last = cu_seqlens.gather(-1, (count - 1).clamp_min(0))
    bounds = torch.where(present & ~absent_before, cu_seqlens, last)
    pairs = present & _before(present, False)
    flags = [
        (cu_seqlens[..., 0] != 0).any(),
        ((cu_seqlens < _before(cu_seqlens, 0)) & pairs).any(),
        ((cu_seqlens < -1) | (present & absent_before)).any(),
        (cu_seqlens > limit).any(),
    ]
    return bounds.clamp(0, limit), flags


def _from_cu_seqlens_fake(cu_seqlens: torch.Tensor, batch: int, sequence: int, attention_mask: torch.Tensor | None):
    """int64 ``[batch, sequence]`` and 5 rule flags."""
    ids = cu_seqlens.new_empty(batch, sequence, dtype=torch.int64)
    return ids, cu_seqlens.new_empty(len(CU_SEQLENS_RULES), dtype=torch.bool)


@packfn_op("document_ids_from_cu_seqlens", fake=_from_cu_seqlens_fake, outputs=IdsOutputs, gpu="cu_seqlens_kernels")
def document_ids_from_cu_seqlens_op(
    cu_seqlens: torch.Tensor, batch: int, sequence: int, attention_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    if cu_seqlens.ndim == 2:
        # One table per row, over its columns: the lengths are the differences.
        # Column j lies in slot k = #(boundaries at or before j): bounds[0] = 0 counts the first.
        bounds, flags = _cu_seqlens_flags(cu_seqlens.to(torch.int64), sequence)
        columns = torch.arange(sequence, device=cu_seqlens.device)
        ids = torch.where(columns < bounds[:, -1:], _ends_at_or_before(bounds, sequence), 0)
        flags.append(_false(cu_seqlens))
    else:
        # One table over the flattened [B * S] stream: segment k holds the
        # tokens from bounds[k] on; ids count the segments from the row's first.
        bounds, flags = _cu_seqlens_flags(cu_seqlens.to(torch.int64), batch * sequence)
        tokens = torch.arange(batch * sequence, device=cu_seqlens.device)
        segment = _ends_at_or_before(bounds.unsqueeze(0), batch * sequence).view(batch, sequence)
        inside = tokens.view(batch, sequence) < bounds[-1]
        ids = torch.where(inside, segment - segment[:, :1] + 1, 0)
        # A row that begins inside the segment its previous row ends in cuts a document in two.
        crossing = inside[:, 0] & (segment[:, 0] == F.pad(segment[:, -1], (1, 0), value=-1)[:-1])
        flags.append(crossing.any())
    if attention_mask is not None:
        ids = torch.where(attention_mask != 0, ids, 0)
    return ids, torch.stack(flags)


# -------------------------------------------------------------- seq_idx

SEQ_IDX_RULES = (
    Rule("seq_idx must not be negative"),
    Rule("seq_idx must not decrease along a row"),
    Rule("seq_idx must be below 2**63 - 1 (the document id, seq_idx + 1, must fit in int64)"),
)
"""Data rules of a 0-based ``seq_idx``, in the order of its op's flags."""

_INT64_MAX = 2**63 - 1


def _from_seq_idx_fake(seq_idx: torch.Tensor, attention_mask: torch.Tensor | None, pad_index: int | None):
    """int64 ``[batch, sequence]`` and 3 rule flags."""
    return _ids_fake(seq_idx, len(SEQ_IDX_RULES))


@packfn_op("document_ids_from_seq_idx", fake=_from_seq_idx_fake, outputs=IdsOutputs)
def document_ids_from_seq_idx_op(
    seq_idx: torch.Tensor, attention_mask: torch.Tensor | None, pad_index: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    index = seq_idx.to(torch.int64)
    valid = _valid_tokens(index, attention_mask, pad_index)
    if valid is None:
        ids = index + 1
        negative = (index < 0).any()
        decreasing = (index < _before(index, -(2**62))).any()
        overflow = (index == _INT64_MAX).any()
    else:
        ids = torch.where(valid, index + 1, 0)
        negative = (valid & (index < 0)).any()
        # The wrapped id of 2**63 - 1 (-2**63) must not hide a decrease: compare the indices.
        decreasing = (valid & (index < torch.where(valid, index, -1).cummax(1).values)).any()
        overflow = (valid & (index == _INT64_MAX)).any()
    return ids, torch.stack([negative, decreasing, overflow])


SEQ_IDX_RANGE_RULE = Rule("document ids must be at most 2**31 (seq_idx is int32: the id minus 1)")
"""The rule ``packfn::seq_idx_from_document_ids`` flags after the mask rules."""


class SeqIdxOutputs(NamedTuple):
    """Outputs of ``packfn::seq_idx_from_document_ids``."""

    seq_idx: torch.Tensor  # int32 [batch, sequence]: the document id minus 1, pad_index at padding
    broken: torch.Tensor  # bool [4]: mask_rules, then SEQ_IDX_RANGE_RULE


def _to_seq_idx_fake(document_ids: torch.Tensor, pad_index: int):
    """int32 ``[batch, sequence]`` and 4 rule flags."""
    return document_ids.new_empty(document_ids.shape, dtype=torch.int32), document_ids.new_empty(4, dtype=torch.bool)


def _mask_rule_flags(document_ids: torch.Tensor) -> torch.Tensor:
    """Bool ``[3]``: the :func:`~packfn._ops.metadata.mask_rules` flags (``D = sequence``) by one running maximum."""
    ids = _mask_ints(document_ids)
    negative = (ids < 0).any() if ids.dtype.is_signed else _false(ids)
    decreasing = ((ids != 0) & (ids < ids.cummax(1).values)).any()
    return torch.stack([negative, decreasing, _false(ids)])


@packfn_op("seq_idx_from_document_ids", fake=_to_seq_idx_fake, outputs=SeqIdxOutputs)
def seq_idx_from_document_ids_op(document_ids: torch.Tensor, pad_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = document_ids.to(torch.int64)
    seq_idx = torch.where(ids != 0, ids - 1, pad_index).to(torch.int32)
    return seq_idx, torch.cat([_mask_rule_flags(document_ids), (ids > 2**31).any().unsqueeze(0)])


# ------------------------------------------------------------------ THD

THD_RULES = (
    Rule("a document of document_ids has padding inside it (THD needs each document's tokens contiguous)"),
    Rule("the first row of document_ids begins with padding (THD's first span starts at token 0)"),
)
"""Data rules of THD boundaries, after the mask rules, in the order of ``packfn::thd_metadata``'s flags."""


class ThdOutputs(NamedTuple):
    """Outputs of ``packfn::thd_metadata``."""

    cu_seqlens: torch.Tensor  # int32 [batch * D + 1]: document lengths' running sums, then the total repeated
    cu_seqlens_padded: torch.Tensor  # int32 [batch * D + 1]: document starts in the [B * S] stream, then B * S
    broken: torch.Tensor  # bool [5]: mask_rules(D), then THD_RULES


def _thd_fake(document_ids: torch.Tensor, max_documents: int):
    """int32 ``[batch * D + 1]`` twice and 5 rule flags."""
    capacity = document_ids.shape[0] * max_documents + 1
    new = document_ids.new_empty
    return new(capacity, dtype=torch.int32), new(capacity, dtype=torch.int32), new(5, dtype=torch.bool)


def _thd_from(parsed, document_ids: torch.Tensor, max_documents: int):
    batch, sequence = document_ids.shape
    total = batch * sequence
    cu_seqlens = varlen_from(parsed, batch, max_documents)[1]
    starts = parsed.starts.reshape(-1)
    slots = torch.arange(batch * max_documents + 1, device=starts.device)
    positions = torch.arange(total, device=starts.device)
    firsts = compact(starts, positions, slots.numel(), search=binary_search_slots(max_documents))
    padded = torch.where(slots < starts.sum(), firsts, total)
    padded = torch.where(slots == 0, 0, padded).to(torch.int32)
    valid = parsed.valid
    inside = (valid & ~parsed.starts & ~_before(valid, False)).any()
    leading = ~valid[0, 0] & valid.any()
    return cu_seqlens, padded, torch.cat([parsed.broken, torch.stack([inside, leading])])


def _thd_eager(document_ids: torch.Tensor, max_documents: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _thd_from(parse_mask_eager(document_ids, max_documents), document_ids, max_documents)


@packfn_op("thd_metadata", fake=_thd_fake, outputs=ThdOutputs, eager=_thd_eager, gpu="thd_kernels")
def thd_metadata_op(document_ids: torch.Tensor, max_documents: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _thd_from(parse_mask(document_ids, max_documents), document_ids, max_documents)
