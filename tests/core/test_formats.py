"""Format conversions: round trips on generated packed batches, bad input, eager kernels, compile, export, opcheck."""

from __future__ import annotations

import functools
from unittest import mock

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

import packfn
from packfn._ops import formats as ops

from tests.assertions import assert_same, assert_same_outputs
from tests.references import (
    eos_stream,
    next_token_reference,
    physical_segments,
    position_ids_reference,
    thd_reference,
)
from tests.strategies import packing_masks
from tests.strategies_formats import PackedRows, batch_in_every_format, op_samples, packed_rows

EXAMPLE = torch.tensor([[1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 0, 0]])
SETTINGS = settings(max_examples=60)

# ------------------------------------------------------------------ round trips


@SETTINGS
@given(rows=packed_rows())
def test_position_ids_round_trip(rows: PackedRows):
    positions = position_ids_reference(rows.document_ids)
    valid = rows.document_ids > 0
    assert_same(packfn.packed_position_ids(rows.document_ids), positions)
    assert_same(packfn.document_ids_from_position_ids(positions, attention_mask=valid), rows.document_ids)
    marked = positions.masked_fill(~valid, -1)
    assert_same(packfn.document_ids_from_position_ids(marked, pad_position=-1), rows.document_ids)


@SETTINGS
@given(rows=packed_rows(max_batch=3, padding=False), start=st.sampled_from([0, 2]))
def test_flattened_position_ids_round_trip(rows: PackedRows, start: int):
    """transformers' DataCollatorWithFlattening: one row of every document, positions from ``start``."""
    lengths = [n for row in rows.lengths for n in row]
    flat = torch.tensor([[start + p for n in lengths for p in range(n)]])
    ids = packfn.document_ids_from_position_ids(flat, start=start)
    assert_same(ids, torch.tensor([[k for k, n in enumerate(lengths, start=1) for _ in range(n)]]))
    assert_same(packfn.packed_position_ids(ids) + start, flat)


@SETTINGS
@given(rows=packed_rows(), data=st.data())
def test_eos_round_trip(rows: PackedRows, data):
    tail = [data.draw(st.booleans()) for _ in rows.lengths]
    tokens = eos_stream(rows.sequence, [list(row) for row in rows.lengths], eos=3, pad=0, tail=tail)
    out = packfn.document_ids_from_eos(tokens, 3, pad_token_id=0, vocab_size=16, eod_mask_loss=True)
    assert_same(out.document_ids, rows.document_ids)
    assert_same(out.position_ids, position_ids_reference(rows.document_ids))
    assert_same(out.loss_mask, (tokens != 0) & (tokens != 3))
    # Back: each document but an open tail ends with the marker.
    ends = (rows.document_ids > 0) & (rows.document_ids != torch.nn.functional.pad(rows.document_ids[:, 1:], (0, 1)))
    open_tail = torch.tensor(tail).unsqueeze(1) & (rows.document_ids == rows.document_ids.amax(1, keepdim=True))
    assert_same(tokens == 3, ends & ~open_tail)


@SETTINGS
@given(rows=packed_rows(padding=False))
def test_bos_documents_begin_at_their_marker(rows: PackedRows):
    tokens = eos_stream(rows.sequence, [list(row) for row in rows.lengths], eos=3, pad=0, tail=[True] * rows.batch)
    tokens = torch.roll(tokens, 1, dims=1)  # each document's last token (the marker) moves to its first column
    assert_same(packfn.document_ids_from_eos(tokens, [3, 15], bos=True).document_ids, rows.document_ids)


@SETTINGS
@given(rows=packed_rows())
def test_seq_lens_round_trip(rows: PackedRows):
    ids = packfn.document_ids_from_seq_lens(rows.seq_lens, rows.sequence)
    assert_same(ids, rows.document_ids)
    assert_same(packfn.seq_lens_from_document_ids(ids, max_documents=rows.max_documents), rows.seq_lens)


def test_seq_lens_absent_documents_keep_their_slot():
    ids = packfn.document_ids_from_seq_lens(torch.tensor([[2, 0, 1], [0, 0, 3]]), 5)
    assert_same(ids, torch.tensor([[1, 1, 3, 0, 0], [3, 3, 3, 0, 0]]))


@SETTINGS
@given(rows=packed_rows())
def test_cu_seqlens_per_row_round_trip(rows: PackedRows):
    cu = rows.cu_seqlens
    assert_same(packfn.document_ids_from_cu_seqlens(cu, rows.sequence), rows.document_ids)
    repeated = torch.where(cu >= 0, cu, cu.amax(1, keepdim=True))  # the total repeated instead of -1
    assert_same(packfn.document_ids_from_cu_seqlens(repeated.int(), rows.sequence), rows.document_ids)
    back = packfn.batch_metadata(rows.document_ids, max_documents=rows.max_documents).cu_seqlens
    assert_same(back.long(), cu)


@SETTINGS
@given(rows=packed_rows())
def test_flat_cu_seqlens_round_trip(rows: PackedRows):
    """The ``flash_varlen`` boundaries over ``[batch * sequence]``: padding runs are segments, the mask drops them."""
    ids, valid = rows.document_ids, rows.document_ids > 0
    physical = packfn.physical_varlen_metadata(ids).cu_seqlens
    assert physical[: len(physical_segments(ids))].tolist() == physical_segments(ids)
    got = packfn.document_ids_from_cu_seqlens(physical, rows.sequence, batch=rows.batch, attention_mask=valid)
    assert_same(got, ids)
    assert_same(packfn.physical_varlen_metadata(got).cu_seqlens, physical)


@SETTINGS
@given(rows=packed_rows(max_batch=1, padding=False))
def test_flat_cu_seqlens_of_one_row_without_padding(rows: PackedRows):
    """TRL's / transformers' ``cu_seq_lens_q`` of a flattened ``[1, T]`` batch."""
    cu = torch.tensor([0, *torch.tensor(rows.lengths[0]).cumsum(0).tolist()], dtype=torch.int32)
    assert_same(packfn.document_ids_from_cu_seqlens(cu, rows.sequence), rows.document_ids)


@SETTINGS
@given(mask=packing_masks(max_batch=4, max_sequence=40, dtypes=(torch.int64, torch.int32, torch.bool)))
def test_seq_idx_round_trip(mask):
    seq_idx = packfn.seq_idx_from_document_ids(mask)
    ids = mask.to(torch.int64)
    assert seq_idx.dtype == torch.int32
    assert_same(seq_idx, torch.where(ids > 0, ids - 1, -1).int())
    assert_same(packfn.document_ids_from_seq_idx(seq_idx, pad_index=-1), ids)
    assert_same(packfn.document_ids_from_seq_idx(seq_idx, attention_mask=mask), ids)


@SETTINGS
@given(rows=packed_rows())
def test_thd_boundaries(rows: PackedRows):
    thd = packfn.thd_metadata(rows.document_ids, max_documents=rows.max_documents)
    cu, padded = thd_reference(rows.document_ids, rows.max_documents)
    assert thd.cu_seqlens.dtype == thd.cu_seqlens_padded.dtype == torch.int32
    assert thd.cu_seqlens.tolist() == cu and thd.cu_seqlens_padded.tolist() == padded
    assert thd.max_seqlen_bound == rows.sequence
    varlen = packfn.varlen_metadata(rows.document_ids, max_documents=rows.max_documents)
    assert_same(thd.cu_seqlens, varlen.cu_seqlens)


# ------------------------------------------------------------ the eager kernels


BROKEN_MASKS = [[[2, 1, 0]], [[-1, 0, 2]], [[1, 0, -3, -3]], [[1, 2, 0, 1]], [[3, 0, 3, 2]]]


@settings(max_examples=150)
@given(mask=packing_masks(max_sequence=64))
@example(mask=torch.tensor([[0, 3, 3, 0, 3, 7, 7, 9, 9, 0, 0]]))
@example(mask=torch.zeros(2, 3, dtype=torch.int64))
def test_position_kernels_match_decomposition_and_reference(mask):
    for op in (ops.position_ids_op, ops.document_positions_op):
        assert_same_outputs(op, mask)
    positions, next_token, broken = ops.document_positions_op.eager(mask)
    assert not broken.any()
    assert_same(positions, position_ids_reference(mask))
    assert_same(next_token, next_token_reference(mask))


@pytest.mark.parametrize("mask", BROKEN_MASKS, ids=str)
def test_position_kernels_report_the_same_first_broken_rule(mask):
    for op in (ops.position_ids_op, ops.document_positions_op):
        assert_same_outputs(op, torch.tensor(mask))
        assert op.eager(torch.tensor(mask)).broken.any()


def test_position_kernel_without_numpy_runs_the_decomposition():
    with mock.patch.object(ops, "numpy_view", return_value=None):
        assert_same(ops.position_ids_op.eager(EXAMPLE), ops.position_ids_op.math(EXAMPLE))
        assert_same(ops.document_positions_op.eager(EXAMPLE), ops.document_positions_op.math(EXAMPLE))


@settings(max_examples=40)
@given(rows=packed_rows(), data=st.data())
def test_eos_and_thd_kernels_match_decomposition(rows: PackedRows, data):
    tokens = eos_stream(rows.sequence, [list(row) for row in rows.lengths], eos=3, pad=0, tail=[False] * rows.batch)
    flags = [data.draw(st.booleans()) for _ in range(4)]
    mask = data.draw(st.sampled_from([None, tokens != 0]))
    pad = None if mask is not None else data.draw(st.sampled_from([None, 0]))
    args = (tokens, mask, [3], flags[0], pad, 16, flags[1], flags[2], flags[3])
    assert_same_outputs(ops.document_ids_from_eos_op, *args)
    assert_same_outputs(ops.thd_metadata_op, rows.document_ids, rows.max_documents)


@settings(max_examples=80)
@given(
    positions=st.lists(st.lists(st.integers(-2, 6), min_size=1, max_size=12), min_size=1, max_size=3).filter(
        lambda rows: len({len(row) for row in rows}) == 1
    ),
    start=st.sampled_from([0, 1, None]),
)
def test_position_ids_to_document_ids_kernel_matches_decomposition(positions, start):
    assert_same_outputs(ops.document_ids_from_position_ids_op, torch.tensor(positions), None, None, start)


@settings(max_examples=80)
@given(
    table=st.lists(st.lists(st.integers(-1, 7), min_size=1, max_size=5), min_size=1, max_size=3).filter(
        lambda rows: len({len(row) for row in rows}) == 1
    ),
    sequence=st.integers(1, 16),
)
def test_seq_lens_kernel_matches_decomposition(table, sequence):
    assert_same_outputs(ops.document_ids_from_seq_lens_op, torch.tensor(table), sequence)


# ------------------------------------------------------------------- bad input


BAD_INPUT = [
    ("positions that never restart", lambda: packfn.document_ids_from_position_ids(torch.tensor([[3, 4, 5, 6]])),
     "must begin at start=0"),
    ("a row that begins inside a document", lambda: packfn.document_ids_from_position_ids(torch.tensor([[0, 1, 7, 8]])),
     "must begin at start=0"),
    ("negative positions", lambda: packfn.document_ids_from_position_ids(torch.tensor([[0, 1, -1, 0]]), start=None),
     "position_ids must not be negative"),
    ("a token outside the vocabulary", lambda: packfn.document_ids_from_eos(torch.tensor([[1, 9, 2]]), 1, vocab_size=8),
     r"input_ids must lie in \[0, vocab_size=8\)"),
    ("cu_seqlens that decrease", lambda: packfn.document_ids_from_cu_seqlens(torch.tensor([0, 4, 2, 6]), 6),
     "cu_seqlens must not decrease"),
    ("cu_seqlens that overrun the row", lambda: packfn.document_ids_from_cu_seqlens(torch.tensor([[0, 3, 7]]), 6),
     "must not run past"),
    ("cu_seqlens that overrun the stream",
     lambda: packfn.document_ids_from_cu_seqlens(torch.tensor([0, 13]), 6, batch=2), "must not run past"),
    ("a flat table over several rows without batch=",
     lambda: packfn.document_ids_from_cu_seqlens(torch.tensor([0, 2, 5]), 4), "pass batch= when it covers"),
    ("cu_seqlens that do not start at 0", lambda: packfn.document_ids_from_cu_seqlens(torch.tensor([[1, 3]]), 6),
     "must start at 0"),
    ("a boundary after -1", lambda: packfn.document_ids_from_cu_seqlens(torch.tensor([[0, 2, -1, 5]]), 6),
     "trailing -1"),
    ("a segment across rows", lambda: packfn.document_ids_from_cu_seqlens(torch.tensor([0, 4, 8]), 6, batch=2),
     "must not cross a row boundary"),
    ("seq_lens that exceed the row", lambda: packfn.document_ids_from_seq_lens(torch.tensor([[3, 4], [1, 1]]), 6),
     "must not add up to more than sequence"),
    ("negative seq_lens", lambda: packfn.document_ids_from_seq_lens(torch.tensor([[3, -1]]), 6),
     "seq_lens must not be negative"),
    ("decreasing seq_idx", lambda: packfn.document_ids_from_seq_idx(torch.tensor([[0, 1, 0]])),
     "seq_idx must not decrease"),
    ("decreasing seq_idx across padding",
     lambda: packfn.document_ids_from_seq_idx(torch.tensor([[1, -1, 0]]), pad_index=-1), "seq_idx must not decrease"),
    ("negative seq_idx", lambda: packfn.document_ids_from_seq_idx(torch.tensor([[-2, 0]])),
     "seq_idx must not be negative"),
    ("padding inside a THD document", lambda: packfn.thd_metadata(torch.tensor([[1, 0, 1]])), "padding inside it"),
    ("THD that begins with padding", lambda: packfn.thd_metadata(torch.tensor([[0, 1, 1]])), "begins with padding"),
    ("too many THD documents", lambda: packfn.thd_metadata(torch.tensor([[1, 2, 3]]), max_documents=2),
     "more documents than max_documents=2"),
    ("decreasing ids to seq_idx", lambda: packfn.seq_idx_from_document_ids(torch.tensor([[2, 1]])),
     "must not decrease"),
    ("ids beyond int32 to seq_idx",
     lambda: packfn.seq_idx_from_document_ids(torch.tensor([[2**32, 2**32, 2**32 + 5, 0]])), r"at most 2\*\*31"),
    ("seq_lens whose sum wraps int64",
     lambda: packfn.document_ids_from_seq_lens(torch.tensor([[2**62] * 4 + [2]]), 4), "must not add up to more"),
    ("seq_lens of the largest int64",
     lambda: packfn.document_ids_from_seq_lens(torch.tensor([[2**63 - 1, 2**63 - 1, 3]]), 4), "must not add up"),
    ("int8 positions that wrap",
     lambda: packfn.document_ids_from_position_ids(torch.tensor([[0, 1, 2, 127, -128]], dtype=torch.int8), start=None),
     "position_ids must not be negative"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "call", "message"), BAD_INPUT, ids=[case for case, _, _ in BAD_INPUT])
def test_bad_data_fails_a_sync_free_assert_that_names_the_rule(case, call, message):
    with pytest.raises(RuntimeError, match=message):
        call()


# Issue 26: an index of 2**63 - 1 is valid by the documented rules, and its id does not fit in int64.


@pytest.mark.parametrize("padding", [{}, {"pad_index": -1}, {"attention_mask": torch.ones(1, 2, dtype=torch.int64)}])
def test_document_ids_from_seq_idx_refuses_the_index_whose_id_overflows_int64(padding):
    with pytest.raises(RuntimeError, match=r"seq_idx must be below 2\*\*63 - 1 \(the document id, seq_idx \+ 1"):
        packfn.document_ids_from_seq_idx(torch.tensor([[0, 2**63 - 1]]), **padding)
    assert packfn.document_ids_from_seq_idx(torch.tensor([[0, 2**63 - 2]]), **padding).tolist() == [[1, 2**63 - 1]]


def test_document_ids_from_seq_idx_ignores_the_largest_index_at_padding():
    ids = packfn.document_ids_from_seq_idx(torch.tensor([[0, 2**63 - 1]]), pad_index=2**63 - 1)
    assert ids.tolist() == [[1, 0]]


BAD_ARGUMENTS = [
    (lambda: packfn.document_ids_from_cu_seqlens(torch.tensor([0, 3, 2**64 - 1], dtype=torch.uint64), 6), ValueError,
     "cu_seqlens must not be uint64"),  # 2**64 - 1 would read as the trailing -1
    (lambda: packfn.document_ids_from_seq_idx(torch.tensor([[0, 2**64 - 1]], dtype=torch.uint64)), ValueError,
     "seq_idx must not be uint64"),
    (lambda: packfn.document_ids_from_eos(torch.tensor([[1, 2]]), 8, vocab_size=8), ValueError,
     r"eos_token_id 8 is outside the vocabulary \[0, 8\)"),
    (lambda: packfn.document_ids_from_eos(torch.tensor([[1, 2]]), -1), ValueError, "must not be negative"),
    (lambda: packfn.document_ids_from_eos(torch.tensor([[1, 2]]), [2, 0], pad_token_id=0), ValueError,
     "also a marker"),
    (lambda: packfn.document_ids_from_eos(torch.tensor([[1, 2]]), []), TypeError, "non-empty list"),
    (lambda: packfn.document_ids_from_eos(torch.tensor([[1.0]]), 1), ValueError, "must hold integers"),
    (lambda: packfn.document_ids_from_position_ids(torch.tensor([0, 1])), ValueError, r"shape \[batch, sequence\]"),
    (lambda: packfn.document_ids_from_position_ids(torch.tensor([[0, 1]]), attention_mask=torch.ones(1, 3)),
     ValueError, "attention_mask must hold integers or bools \\(bool, uint8, int8, int16, int32 or int64"),
    (lambda: packfn.document_ids_from_position_ids(torch.tensor([[0, 1]]), start=-1), ValueError,
     "must not be negative"),
    (lambda: packfn.document_ids_from_cu_seqlens(torch.tensor([[0, 2]]), 4, batch=3), ValueError, "one table per row"),
    (lambda: packfn.document_ids_from_cu_seqlens(torch.tensor([0, 2]), 0), ValueError, "sequence must be positive"),
    (lambda: packfn.document_ids_from_cu_seqlens(torch.tensor([0, 2]), 4, attention_mask=torch.ones(2, 3) > 0),
     ValueError, r"attention_mask must have shape \(2, 4\), got \(2, 3\)"),
    (lambda: packfn.document_ids_from_seq_lens(torch.tensor([[2, 2]]), 4.0), TypeError, "sequence must be an int"),
    (lambda: packfn.thd_metadata(torch.tensor([[1, 1]]), max_documents=0), ValueError, "must be positive"),
    (lambda: packfn.seq_idx_from_document_ids(torch.tensor([[1, 1]]), pad_index=2**31), ValueError,
     "pad_index must fit in int32"),
]  # fmt: skip


@pytest.mark.parametrize(("call", "error", "message"), BAD_ARGUMENTS)
def test_bad_arguments_raise_at_call_time(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_an_all_padding_batch_has_empty_thd_boundaries():
    # A fully padded microbatch is no THD document at all, not one that "begins with padding".
    thd = packfn.thd_metadata(torch.zeros(2, 4, dtype=torch.int64), max_documents=2)
    assert thd.cu_seqlens.tolist() == [0, 0, 0, 0, 0]
    assert thd.cu_seqlens_padded.tolist() == [0, 8, 8, 8, 8]


def test_flat_cu_seqlens_that_end_before_the_last_row_leave_the_rest_padding():
    # No attention_mask: tokens past the last boundary are padding, whole rows of it included.
    assert packfn.document_ids_from_cu_seqlens(torch.tensor([0, 3]), 4, batch=2).tolist() == [[1, 1, 1, 0], [0] * 4]
    ids = packfn.document_ids_from_cu_seqlens(torch.tensor([0, 2, 3]), 3, batch=3)
    assert ids.tolist() == [[1, 1, 2], [0, 0, 0], [0, 0, 0]]


def test_narrow_dtypes_convert_as_their_int64_values_do():
    # A 256-token document then a 3-token one: uint8 positions wrap from 255 to 0 at the second.
    positions = torch.cat([torch.arange(256), torch.arange(3)]).unsqueeze(0)
    expected = packfn.document_ids_from_position_ids(positions)
    assert expected.unique(return_counts=True)[1].tolist() == [256, 3]
    assert_same(packfn.document_ids_from_position_ids(positions.to(torch.uint8)), expected)
    assert_same_outputs(ops.document_ids_from_position_ids_op, positions.to(torch.uint8), None, None, 0)
    # Ids a narrow dtype cannot hold match no token (compared as they are, 256 would match uint8 0, 265 match 9).
    tokens = torch.tensor([[5, 0, 7, 9, 0, 3]])
    expected = packfn.document_ids_from_eos(tokens, 9)
    for dtype in (torch.uint8, torch.int8):
        narrow = tokens.to(dtype)
        for pad in (256, -256, 2**40):
            assert_same(packfn.document_ids_from_eos(narrow, 9, pad_token_id=pad), expected)
        assert_same(packfn.document_ids_from_eos(narrow, [9, 265], vocab_size=300), expected)
        assert_same_outputs(ops.document_ids_from_eos_op, narrow, None, [9, 265], False, 256, 300, True, True, True)
        assert_same_outputs(ops.document_ids_from_eos_op, narrow, None, [9, 265], False, None, 300, True, True, True)


# --------------------------------------------------------- no host reads at all


def every_format(document_ids, position_ids, tokens, seq_lens, cu_rows, cu_flat, seq_idx):
    """Every conversion of the static path, on one packed batch in each format."""
    batch, sequence = document_ids.shape
    valid = document_ids > 0
    eos = packfn.document_ids_from_eos(tokens, 3, pad_token_id=0, vocab_size=16, eod_mask_loss=True)
    thd = packfn.thd_metadata(document_ids, max_documents=4)
    return (
        packfn.packed_position_ids(document_ids),
        packfn.document_ids_from_position_ids(position_ids, attention_mask=valid),
        *eos,
        packfn.document_ids_from_seq_lens(seq_lens, sequence),
        packfn.document_ids_from_cu_seqlens(cu_rows, sequence),
        packfn.document_ids_from_cu_seqlens(cu_flat, sequence, batch=batch, attention_mask=valid),
        packfn.document_ids_from_seq_idx(seq_idx, pad_index=-1),
        packfn.seq_idx_from_document_ids(document_ids),
        packfn.seq_lens_from_document_ids(document_ids, max_documents=4),
        thd.cu_seqlens,
        thd.cu_seqlens_padded,
    )


def test_static_path_reads_nothing_back_and_sizes_nothing_by_data():
    """Every op's decomposition (what compiled, exported and GPU code runs), in the graph AOTAutograd traces."""
    from scripts.benchmarks.common import DataDependentOps, aten_ops_of

    inputs = batch_in_every_format(24, seed=0)
    ops_seen = aten_ops_of(lambda: every_format(*inputs))
    assert {"cumsum", "cummax", "scatter"} <= set(ops_seen), "the ops did not decompose"
    assert not (set(ops_seen) & (DataDependentOps.HOST_READS | DataDependentOps.DATA_DEPENDENT)), ops_seen


# ---------------------------------------------------------------- torch.compile


@pytest.fixture(autouse=True)
def no_graph_breaks():
    counters.clear()
    yield
    assert not counters["graph_break"], dict(counters["graph_break"])


@functools.cache
def compiled_every_format():
    counter = CompileCounterWithBackend("inductor")
    return torch.compile(every_format, backend=counter, fullgraph=True, dynamic=True), counter


def test_one_dynamic_compile_across_sizes_and_contents_without_packfn_calls():
    compiled, counter = compiled_every_format()
    inputs = batch_in_every_format(16, seed=1)
    result, code = run_and_get_code(compiled, *inputs)
    assert_same(result, every_format(*inputs))
    assert "torch.ops.packfn" not in "\n".join(code) and "packfn::" not in "\n".join(code)
    # Sizes where the code paths change: 2 columns (the shifted comparisons are of one column), 3, 17, 64.
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed, sequence in enumerate((2, 3, 17, 64, 16, 16, 16)):
            inputs = batch_in_every_format(sequence, seed=seed + 2)
            assert_same(compiled(*inputs), every_format(*inputs))
    assert counter.frame_count == 1


def test_static_shapes_do_not_recompile_across_contents():
    """Guards are Dynamo's: AOTAutograd without Inductor shows them at a fraction of the compile time."""
    static = torch.compile(every_format, fullgraph=True, dynamic=False, backend="aot_eager")
    static(*batch_in_every_format(12, seed=0))
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed in range(1, 21):
            inputs = batch_in_every_format(12, seed=seed)
            assert_same(static(*inputs), every_format(*inputs))


# ----------------------------------------------------------------- torch.export


class EveryFormat(torch.nn.Module):
    def forward(self, document_ids, position_ids, tokens, seq_lens, cu_rows, cu_flat, seq_idx):
        return every_format(document_ids, position_ids, tokens, seq_lens, cu_rows, cu_flat, seq_idx)


def test_export_with_a_dynamic_sequence_then_runs_at_other_sizes():
    sequence, cu_entries = torch.export.Dim("S"), torch.export.Dim("N")
    per_token = {1: sequence}
    shapes = (per_token, per_token, per_token, None, None, {0: cu_entries}, per_token)
    program = torch.export.export(EveryFormat(), batch_in_every_format(8, seed=0), dynamic_shapes=shapes)
    nodes = {str(node.target) for node in program.graph.nodes if str(node.target).startswith("packfn.")}
    assert {
        "packfn.position_ids.default",
        "packfn.document_ids_from_eos.default",
        "packfn.thd_metadata.default",
    } <= nodes
    lowered = program.run_decompositions()
    assert not [node for node in lowered.graph.nodes if str(node.target).startswith("packfn.")]
    for seed, size in enumerate((2, 5, 31)):
        inputs = batch_in_every_format(size, seed=seed + 10)
        expected = every_format(*inputs)
        assert_same(tuple(program.module()(*inputs)), expected)
        assert_same(tuple(lowered.module()(*inputs)), expected)


# -------------------------------------------------------------- fakes, opcheck


FORMAT_OPS = sorted({name for name, _ in op_samples()})


def test_every_format_op_has_samples():
    registered = {name.split("::")[1].split(".")[0] for name in torch._C._dispatch_get_all_op_names()}
    formats = {name for name in registered if name.startswith(("document_ids_from_", "thd_", "seq_idx_from_"))}
    assert formats | {"position_ids", "document_positions"} == set(FORMAT_OPS)


def _meta(value):
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    return value


@pytest.mark.parametrize(
    ("name", "args"), list(op_samples()), ids=lambda value: value if isinstance(value, str) else ""
)
def test_fake_kernel_and_decomposition_agree(name, args):
    op = getattr(torch.ops.packfn, name).default
    fake = op(*(_meta(arg) for arg in args))
    for outputs in (op(*args), op.decompose(*args)):
        assert len(outputs) == len(fake)
        for real, meta in zip(outputs, fake, strict=True):
            assert (real.shape, real.dtype, real.is_contiguous()) == (meta.shape, meta.dtype, meta.is_contiguous())
    assert_same(tuple(op(*args)), tuple(op.decompose(*args)))


@pytest.mark.parametrize(
    ("name", "args"), list(op_samples()), ids=lambda value: value if isinstance(value, str) else ""
)
def test_opcheck(name, args):
    torch.library.opcheck(getattr(torch.ops.packfn, name).default, args)


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64], ids=str)
def test_eos_with_padding_checks_the_vocabulary_of_wide_unsigned_tokens(dtype):
    """aten has no CPU comparison of these dtypes: the padded path compares in int64 (a helper's fuzzing found
    ``lt_cpu not implemented for 'UInt16'``), as the padding-free path does by NumPy."""
    valid = torch.ones(1, 4, dtype=torch.bool)
    tokens = torch.tensor([[1, 2, 3, 9]], dtype=dtype)
    assert packfn.document_ids_from_eos(tokens, 2, vocab_size=10, attention_mask=valid).document_ids.tolist() == [
        [1, 1, 2, 2]
    ]
    with pytest.raises(RuntimeError, match=r"input_ids must lie in \[0, vocab_size=10\)"):
        packfn.document_ids_from_eos(tokens.clone().fill_(12), 2, vocab_size=10, attention_mask=valid)
