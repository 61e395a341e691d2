"""The Triton kernels of NOTE [Two launches on a GPU], run on the CPU by Triton's interpreter.

Not collected by itself: ``tests/core/test_triton_rows.py`` runs this file
in a pytest of its own with ``TRITON_INTERPRET=1`` set before anything
imports Triton (Triton 3.6, torch 2.11's, interprets only what was decorated
with the interpreter on, ``tl.max`` and ``tl.sum`` included). The kernels
are held to the aten bodies on generated masks. Small blocks and row groups
make a short row span several blocks and a small batch several groups, so
every carry from block to block and every sum over the rows before is
exercised; one test keeps the shipped sizes.
"""

from __future__ import annotations

import contextlib
import os
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from torch.library import wrap_triton
from triton.runtime import interpreter

import packfn
from packfn._ops import _registry, triton_rows
from packfn._ops import formats as format_ops
from packfn._ops import layout as layout_ops
from packfn._ops import masks as mask_ops
from packfn._ops import metadata as ops
from packfn._ops import varlen as varlen_ops
from packfn.layout import as_rows

from tests.assertions import assert_same, assert_same_outputs
from tests.core.test_eager_kernels import BROKEN
from tests.strategies import packing_masks, random_mask
from tests.strategies_formats import PackedRows, packed_rows
from tests.strategies_layout import layout_fields, layout_inputs

assert os.environ.get("TRITON_INTERPRET") == "1", "run by tests/core/test_triton_rows.py, with the interpreter on"

THD = format_ops.thd_metadata_op
POSITIONS = format_ops.position_ids_op
GPU_OPS = [ops.varlen_metadata_op, ops.batch_metadata_op, THD]
PHYSICAL = varlen_ops.physical_varlen_metadata_op
OUTPUTS = {
    ops.varlen_metadata_op: ops.VarlenOutputs,
    ops.batch_metadata_op: ops.BatchOutputs,
    THD: format_ops.ThdOutputs,
    ops.flatten_metadata_op: ops.FlattenOutputs,
    format_ops.position_ids_op: format_ops.PositionOutputs,
    PHYSICAL: varlen_ops.PhysicalVarlenOutputs,
}
# THD's own rules, after the mask rules: padding inside a document, a first row that begins with padding.
THD_BROKEN = {
    "padding inside a document": [[1, 0, 1, 2]],
    "padding inside a later row's document": [[1, 1, 0, 0], [2, 0, 2, 0]],
    "first row begins with padding": [[0, 1, 1, 2]],
}


@pytest.fixture(autouse=True)
def _scalar_index():
    """Triton 3.6 indexes with a scalar argument (``range(0, sequence, BLOCK)``) by ``int()`` of a one-element
    array, which NumPy 2.4 refuses; from 3.7 on the interpreter takes the element (``squeeze``), as here."""
    patch_tensor = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor, scope):
        patch_tensor(tensor, scope)
        tensor.__index__ = lambda self: int(self.handle.data.squeeze())  # restored with the scope's own patches

    with mock.patch.object(interpreter, "_patch_lang_tensor", patch_lang_tensor):
        yield


@pytest.fixture(autouse=True)
def _interpreted_launch():
    """torch 2.11's ``wrap_triton`` takes only ``triton.jit`` kernels, where the interpreter makes them
    ``InterpretedFunction``; there the kernels launch unwrapped, as ``wrap_triton`` launches them in eager."""
    try:
        wrap_triton(triton_rows._row_stats)
    except RuntimeError:
        with mock.patch.object(triton_rows, "wrap_triton", lambda kernel: kernel):
            yield
    else:
        yield


def _sized(block: int, rows: int, chunk: int):
    return mock.patch.multiple(triton_rows, BLOCK=block, ROWS=rows, CHUNK=chunk)


@pytest.fixture
def small():
    """Blocks of 8 columns, groups of 2 rows, chunks of 4 attention blocks."""
    with _sized(8, 2, 4):
        yield triton_rows


def _kernels(module, op):
    """The op's Triton kernels in ``module``: ``varlen_metadata_op``'s are ``varlen_kernels``."""
    name = "position_ids_op" if op is POSITIONS else op.__name__.removesuffix("_metadata_op")
    kernels = getattr(module, name.removesuffix("_ids_op") + "_kernels")
    return lambda *args: OUTPUTS[op](*kernels(*args))


@pytest.mark.parametrize("op", GPU_OPS, ids=lambda op: op.__name__)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mask=packing_masks(max_sequence=40, max_batch=5), capacity=st.sampled_from([1, 2, 5, 300, None]))
@example(mask=torch.tensor([[0, 0]]), capacity=None)
@example(mask=torch.tensor([[3, 0, 3, 5]], dtype=torch.uint8), capacity=2)
@example(mask=torch.tensor([[1] * 8 + [2] * 8 + [0] * 8 + [2, 3]]), capacity=None)  # a document across blocks
def test_kernels_match_the_decomposition(small, op, mask, capacity):
    assert_same_outputs(op, mask, capacity or mask.shape[1], body=_kernels(small, op))


@pytest.mark.parametrize("op", GPU_OPS, ids=lambda op: op.__name__)
@pytest.mark.parametrize("name", sorted(BROKEN))
def test_kernels_report_the_same_first_broken_rule(small, op, name):
    mask = torch.tensor(BROKEN[name])
    assert_same_outputs(op, mask, 2, body=_kernels(small, op))
    assert _kernels(small, op)(mask, 2).broken.any()


@pytest.mark.parametrize("name", sorted(THD_BROKEN))
def test_thd_kernels_report_the_same_first_broken_rule(small, name):
    mask = torch.tensor(THD_BROKEN[name])
    for ids in (mask, mask > 0, mask.to(torch.uint8)):
        assert_same_outputs(THD, ids, 2, body=_kernels(small, THD))
        assert _kernels(small, THD)(ids, 2).broken.any()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=packed_rows(max_batch=5, max_sequence=40))
def test_thd_kernels_match_on_what_a_packer_emits(small, rows: PackedRows):
    """Contiguous documents from column 0: no rule breaks, so every boundary is compared."""
    for capacity in (rows.max_documents, rows.sequence):
        assert not THD.math(rows.document_ids, capacity).broken.any()
        assert_same_outputs(THD, rows.document_ids, capacity, body=_kernels(small, THD))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mask=packing_masks(max_sequence=40, max_batch=5))
@example(mask=torch.tensor([[1] * 9 + [0] * 9 + [1] * 3 + [2] * 10]))  # padding inside a document, across blocks
@example(mask=torch.tensor([[0, 0, 3, 3, 0], [0, 0, 0, 0, 0]]))  # padding first, and a row of padding
def test_position_kernels_match_the_decomposition(small, mask):
    assert_same_outputs(POSITIONS, mask, body=_kernels(small, POSITIONS))


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_position_kernels_report_the_same_first_broken_rule(small, name):
    mask = torch.tensor(BROKEN[name])
    assert_same_outputs(POSITIONS, mask, body=_kernels(small, POSITIONS))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mask=packing_masks(max_sequence=40, max_batch=5))
@example(mask=torch.tensor([[-1, -1, -1]]))  # negative ids that never decrease
@example(mask=torch.tensor([[2, 1, 2], [0, 0, 0]]))  # a decrease, and a row of padding
def test_mask_flags_kernels_equal_the_parse(small, mask):
    """Every flag, not only the first broken one: with ``D = sequence`` no row can hold too many documents."""
    assert_same(small.mask_flags_kernels(mask), ops.parse_mask(mask, mask.shape[1]).broken)
    for name in sorted(BROKEN):
        broken = torch.tensor(BROKEN[name])
        assert_same(small.mask_flags_kernels(broken), ops.parse_mask(broken, broken.shape[1]).broken)


FLATTEN = ops.flatten_metadata_op


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    mask=packing_masks(max_sequence=40, max_batch=5),
    capacity=st.sampled_from([1, 2, 5, 300]),
    dtypes=st.sampled_from([(torch.int64, torch.int32), (torch.int32, torch.int64)]),
)
def test_flatten_kernels_match_on_batch_metadata(small, mask, capacity, dtypes):
    """What batch_metadata (and split_batch_metadata) hand flatten_metadata: every output is compared."""
    parsed = ops.batch_metadata_op.math(mask, capacity)
    assume(not parsed.broken.any())
    indices, bounds = parsed.packed_token_indices.to(dtypes[0]), parsed.cu_seqlens.to(dtypes[1])
    assert not FLATTEN.math(indices, bounds).broken.any()
    assert_same_outputs(FLATTEN, indices, bounds, body=_kernels(small, FLATTEN))


@st.composite
def any_metadata(draw):
    """Batch-major metadata of any values: most of it breaks a rule, in every order of rules."""
    batch, sequence, slots = draw(st.integers(1, 4)), draw(st.integers(1, 20)), draw(st.integers(2, 12))
    indices = draw(st.lists(st.integers(-2, sequence), min_size=batch * sequence, max_size=batch * sequence))
    bounds = draw(st.lists(st.integers(-1, sequence + 1), min_size=batch * slots, max_size=batch * slots))
    return torch.tensor(indices).view(batch, sequence), torch.tensor(bounds).view(batch, slots)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(metadata=any_metadata())
@example(metadata=(torch.tensor([[0, 1, 2, -1]]), torch.tensor([[0, -1, 3]])))  # a boundary after -1
@example(metadata=(torch.tensor([[0, 1, 2, -1]]), torch.tensor([[0, 2, 1, 3]])))  # not monotonic
@example(metadata=(torch.tensor([[0, 1, -1, -1]] * 3), torch.tensor([[0, 1, 2, -1, -1, -1, -1, -1, -1, -1]] * 3)))
def test_flatten_kernels_report_the_same_first_broken_rule(small, metadata):
    assert_same_outputs(FLATTEN, *metadata, body=_kernels(small, FLATTEN))


@st.composite
def any_ids(draw):
    """``[batch, sequence]`` ids of any values and order (physical segments take any integer ids)."""
    batch, sequence = draw(st.integers(1, 5)), draw(st.integers(1, 40))
    values = draw(st.lists(st.integers(-3, 3), min_size=batch * sequence, max_size=batch * sequence))
    ids = torch.tensor(values).view(batch, sequence)
    return draw(st.sampled_from([ids, ids.to(torch.int32), ids > 0, ids.abs().to(torch.uint8)]))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=any_ids())
@example(ids=torch.tensor([[5] * 20]))  # one segment across blocks
@example(ids=torch.tensor([[1, 1], [1, 1], [1, 1]]))  # rows of the same id stay apart
def test_physical_kernels_match_the_decomposition(small, ids):
    assert_same(tuple(_kernels(small, PHYSICAL)(ids)), tuple(PHYSICAL.math(ids)))


@pytest.mark.parametrize("op", [*GPU_OPS, PHYSICAL, POSITIONS, ops.flatten_metadata_op], ids=lambda op: op.__name__)
def test_kernels_at_their_shipped_sizes(op):
    """1024 columns a block, 128 rows a group: rows of 2100 span three blocks, 130 rows two groups (a program per
    row makes 130 rows cost the interpreter a minute an op: batch_metadata and THD sum the rows before as
    varlen_metadata does, and position ids take no sum)."""
    shipped = triton_rows
    assert (shipped.BLOCK, shipped.ROWS) == (1024, 128)
    masks = [random_mask(2, 2100, seed=0, documents=40)]
    if op in (ops.varlen_metadata_op, ops.flatten_metadata_op, PHYSICAL):  # each sums the rows before its own way
        masks.append(random_mask(130, 5, seed=1, documents=2))
    for mask in masks:
        if op is PHYSICAL:
            assert_same(tuple(_kernels(shipped, op)(mask)), tuple(op.math(mask)))
        elif op is POSITIONS:
            assert_same_outputs(op, mask, body=_kernels(shipped, op))
        elif op is ops.flatten_metadata_op:  # D = sequence: boundaries of 2101 slots span three blocks too
            parsed = ops.batch_metadata_op.math(mask, mask.shape[1])
            metadata = (parsed.packed_token_indices, parsed.cu_seqlens)
            assert_same_outputs(op, *metadata, body=_kernels(shipped, op))
        else:
            assert_same_outputs(op, mask, mask.shape[1], body=_kernels(shipped, op))


PUBLIC = {
    "varlen_metadata": lambda mask: packfn.varlen_metadata(mask, max_documents=6),
    "batch_metadata": lambda mask: packfn.batch_metadata(mask, max_documents=6),
    "physical_varlen_metadata": packfn.physical_varlen_metadata,
    "thd_metadata": lambda mask: packfn.thd_metadata(mask, max_documents=6),
    "flatten_metadata": lambda mask: packfn.flatten_metadata(*_batch_major(mask)),
    "packed_position_ids": packfn.packed_position_ids,
}


def _batch_major(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    parsed = ops.batch_metadata_op.math(mask, 6)  # the aten body: no kernel of its own
    return parsed.packed_token_indices, parsed.cu_seqlens


@contextlib.contextmanager
def _as_on_a_gpu(module):
    """Ops take their Triton kernels from ``module`` as on a CUDA tensor; yields the names launched, in order."""
    launched = []

    def body(kernels):
        launched.append(kernels)
        return getattr(module, kernels)

    with (
        mock.patch.object(_registry, "gpu_kernels", lambda tensor: True),
        mock.patch.object(_registry, "gpu_body", body),
    ):
        yield launched


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_public_functions_take_the_kernels_on_a_gpu_tensor(small, name):
    """In eager the op's kernel launches the Triton kernels where ``gpu_kernels`` says (a CUDA tensor)."""
    mask = PackedRows(30, ((5, 7, 3), (30,), (4, 4, 1, 1))).document_ids  # as a packer emits it: THD's rules hold
    expected = PUBLIC[name](mask)
    with _as_on_a_gpu(small) as launched:
        assert_same(tuple(PUBLIC[name](mask)), tuple(expected))
    assert launched == [{"packed_position_ids": "position"}.get(name, name.removesuffix("_metadata")) + "_kernels"]


TABLES = mask_ops.document_block_tables_op


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    mask=packing_masks(max_sequence=40, max_batch=4),
    block_size=st.sampled_from([1, 2, 3, 8, 64]),
    window=st.one_of(st.none(), st.integers(1, 12)),
    separate=st.booleans(),
    by_position=st.booleans(),
)
@example(  # a block of padding inside a document: its blocks are not one range
    mask=torch.tensor([[1] * 9 + [0] * 9 + [1] * 3 + [2] * 10]),
    block_size=2,
    window=None,
    separate=True,
    by_position=False,
)
@example(mask=torch.tensor([[1, 1, 0, 0, 1, 1]]), block_size=2, window=4, separate=True, by_position=True)
@example(mask=torch.tensor([[1] * 8]), block_size=2, window=1, separate=True, by_position=False)  # window = distance
@example(mask=torch.tensor([[1] * 8]), block_size=2, window=3, separate=True, by_position=False)  # full to the window
@example(mask=torch.tensor([[1] * 4]), block_size=1, window=None, separate=True, by_position=False)  # full diagonal
def test_block_tables_kernels_match_the_decomposition(small, mask, block_size, window, separate, by_position):
    """All eight tables (query side included) and the flags; chunks of 4 blocks make the tables span several."""
    positions = packfn.packed_position_ids(mask) if by_position else None
    arguments = (mask, block_size, window, separate, positions, True)
    assert_same(tuple(small.block_tables_kernels(*arguments)), tuple(TABLES.math(*arguments)))


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_block_tables_kernels_report_the_same_broken_rules(small, name):
    mask = torch.tensor(BROKEN[name])
    for check in (True, False):
        arguments = (mask, 1, None, True, None, check)
        assert_same(tuple(small.block_tables_kernels(*arguments)), tuple(TABLES.math(*arguments)))


def test_block_tables_kernels_at_their_shipped_chunk():
    """1024 blocks a chunk, most of it masked off here (crossing chunks is tested with chunks of 4: a program
    per block makes 1025 blocks take minutes in the interpreter)."""
    assert triton_rows.CHUNK == 1024
    mask = random_mask(2, 100, seed=2, documents=8)
    arguments = (mask, 8, 40, True, None, True)
    assert_same(tuple(triton_rows.block_tables_kernels(*arguments)), tuple(TABLES.math(*arguments)))


def test_document_block_mask_takes_the_kernels_on_a_gpu_tensor(small):
    """The BlockMask the public function builds from the kernels' tables is the one it builds on the CPU."""
    mask = PackedRows(30, ((5, 7, 3), (30,), (4, 4, 1, 1))).document_ids
    expected = packfn.document_block_mask(mask, block_size=4, window=6)
    with _as_on_a_gpu(small) as launched:
        got = packfn.document_block_mask(mask, block_size=4, window=6)
    assert launched == ["block_tables_kernels", "mask_flags_kernels"]
    fields = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")
    fields += tuple(field.replace("kv", "q") for field in fields)
    assert_same(tuple(getattr(got, field) for field in fields), tuple(getattr(expected, field) for field in fields))


# ------------------------------------------------------------------ conversions

EOS = format_ops.document_ids_from_eos_op
SEQ_LENS = format_ops.document_ids_from_seq_lens_op
CU_SEQLENS = format_ops.document_ids_from_cu_seqlens_op
FROM_POSITIONS = format_ops.document_ids_from_position_ids_op


def _conversion(module, op):
    """The conversion op's kernels in ``module``, with its named outputs."""
    kernels = {SEQ_LENS: "seq_lens_kernels", CU_SEQLENS: "cu_seqlens_kernels", FROM_POSITIONS: "position_id_kernels"}
    kernels[EOS] = "eos_kernels"
    outputs = format_ops.EosDocumentsOutputs if op is EOS else format_ops.IdsOutputs
    return lambda *args: outputs(*getattr(module, kernels[op])(*args))


def _table(draw, batch: int, width: int, low: int, high: int) -> torch.Tensor:
    values = draw(st.lists(st.integers(low, high), min_size=batch * width, max_size=batch * width))
    table = torch.tensor(values).view(batch, width)
    return draw(st.sampled_from([table, table.to(torch.int32)]))


@st.composite
def seq_lens_tables(draw):
    """A packer's lengths (zeros after them), or lengths of any values: most of those break a rule."""
    if draw(st.booleans()):
        rows = draw(packed_rows(max_batch=4, max_sequence=30))
        return rows.seq_lens, rows.sequence
    batch, width, sequence = draw(st.integers(1, 4)), draw(st.integers(1, 20)), draw(st.integers(1, 30))
    return _table(draw, batch, width, -1, 6), sequence


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(table=seq_lens_tables())
@example(table=(torch.tensor([[0, 0, 3, 0, 0, 0, 0, 0, 0, 2, 0]]), 12))  # empty documents, ends across blocks
@example(table=(torch.tensor([[5, 5], [12, 1]]), 10))  # a row that ends at its last column, one that overruns
def test_seq_lens_kernels_match_the_decomposition(small, table):
    assert_same_outputs(SEQ_LENS, *table, body=_conversion(small, SEQ_LENS))


@st.composite
def cu_seqlens_tables(draw):
    """One table per row or one flat table, as packfn writes them (trailing -1) or of any values, a mask or not."""
    rows = draw(packed_rows(max_batch=4, max_sequence=30))
    batch, sequence = rows.batch, rows.sequence
    flat = draw(st.booleans())
    if draw(st.booleans()):  # a packer's boundaries: the segments of every row, padding runs included when flat
        table = packfn.physical_varlen_metadata(rows.document_ids).cu_seqlens if flat else rows.cu_seqlens
        table = torch.cat([table, table.new_full((*table.shape[:-1], draw(st.integers(0, 9))), -1)], -1)
    else:
        width = draw(st.integers(1, 20))
        table = _table(draw, 1 if flat else batch, width, -2, (batch if flat else 1) * sequence + 1)
        table = table[0] if flat else table
    mask = draw(st.sampled_from([None, rows.document_ids > 0, (rows.document_ids > 0).to(torch.int32)]))
    return table, batch, sequence, mask


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(arguments=cu_seqlens_tables())
@example(arguments=(torch.tensor([0, 3, 9, 12]), 2, 6, None))  # a segment across the row boundary
@example(arguments=(torch.tensor([0, 3, 6, 12, -1, -1, -1, -1, -1, -1]), 2, 6, None))  # rows that close: none
@example(arguments=(torch.tensor([[0, 2, 2, 5, -1]]), 1, 5, None))  # an empty segment
@example(arguments=(torch.tensor([[0, 2, -1, 5]]), 1, 5, None))  # a boundary after -1
def test_cu_seqlens_kernels_match_the_decomposition(small, arguments):
    assert_same_outputs(CU_SEQLENS, *arguments, body=_conversion(small, CU_SEQLENS))


@st.composite
def position_tables(draw):
    """A packer's position ids with their padding (a mask or a pad position), or positions of any values."""
    if draw(st.booleans()):
        rows = draw(packed_rows(max_batch=4, max_sequence=30))
        ids = rows.document_ids
        positions = torch.where(ids > 0, packfn.packed_position_ids(ids), -1)
        padding = draw(st.sampled_from(["mask", "pad", "none"]))
        mask = (ids > 0) if padding == "mask" else None
        pad = -1 if padding == "pad" else draw(st.sampled_from([None, 2**70]))
        return positions, mask, pad, draw(st.sampled_from([0, None]))
    batch, sequence = draw(st.integers(1, 4)), draw(st.integers(1, 30))
    positions = _table(draw, batch, sequence, -2, 6)
    mask = draw(st.sampled_from([None, positions != 3, (positions != 3).to(torch.uint8)]))
    return positions, mask, draw(st.sampled_from([None, 0, 2])), draw(st.sampled_from([0, 1, None]))


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(arguments=position_tables())
@example(arguments=(torch.tensor([[0, 1, 2, 9, 9, 9, 9, 9, 9, 3, 4, 0]]), None, 9, 0))  # padding across blocks
@example(arguments=(torch.tensor([[-1, 0, 1]]), None, None, None))  # -1 first: the row's start begins none
@example(arguments=(torch.tensor([[9, 1, 2]]), None, 9, None))  # a first valid token begins one at any position
def test_position_id_kernels_match_the_decomposition(small, arguments):
    assert_same_outputs(FROM_POSITIONS, *arguments, body=_conversion(small, FROM_POSITIONS))


def test_conversion_kernels_at_their_shipped_size():
    """1024 columns a block: rows of 2100 span three blocks, 1101 lengths (or boundaries) two."""
    assert triton_rows.BLOCK == 1024
    rows = PackedRows(2100, ((1, 7, 1800, 200), (2100,), (1,) * 1100 + (600,)))
    valid = rows.document_ids > 0
    positions = torch.where(valid, packfn.packed_position_ids(rows.document_ids), -1)
    flat = packfn.physical_varlen_metadata(rows.document_ids).cu_seqlens
    for op, arguments in [
        (SEQ_LENS, (rows.seq_lens, 2100)),
        (CU_SEQLENS, (rows.cu_seqlens, 3, 2100, None)),
        (CU_SEQLENS, (flat, 3, 2100, valid)),
        (FROM_POSITIONS, (positions, valid, None, 0)),
        (FROM_POSITIONS, (positions, None, -1, 0)),
        (EOS, (rows.document_ids, valid, [1, 3], False, None, 5000, True, True, True)),
        (EOS, (rows.document_ids, None, [2], True, 0, None, True, True, False)),
    ]:
        assert not op.math(*arguments).broken.any()
        assert_same_outputs(op, *arguments, body=_conversion(triton_rows, op))


def _eos_tokens(ids: torch.Tensor) -> torch.Tensor:
    """A document's tokens are 5, its last 6 (its EOS); padding is 0."""
    last = ids != F.pad(ids, (0, 1))[:, 1:]
    return torch.where(ids > 0, 5 + last.long(), 0)


CONVERSIONS = {  # a conversion, its inputs from packed rows, and the kernels it launches on a GPU tensor
    "seq_lens": (packfn.document_ids_from_seq_lens, lambda rows: (rows.seq_lens, rows.sequence), "seq_lens_kernels"),
    "cu_seqlens": (packfn.document_ids_from_cu_seqlens, lambda rows: (rows.cu_seqlens, rows.sequence),
                   "cu_seqlens_kernels"),
    "position_ids": (
        lambda positions, valid: packfn.document_ids_from_position_ids(positions, attention_mask=valid),
        lambda rows: (packfn.packed_position_ids(rows.document_ids), rows.document_ids > 0),
        "position_id_kernels",
    ),
    "eos": (
        lambda tokens: packfn.document_ids_from_eos(tokens, [6, 7], attention_mask=tokens > 0).document_ids,
        lambda rows: (_eos_tokens(rows.document_ids),),
        "eos_kernels",
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(CONVERSIONS))
def test_conversions_take_the_kernels_on_a_gpu_tensor(small, name):
    convert, inputs, kernels = CONVERSIONS[name]
    rows = PackedRows(30, ((5, 7, 3), (30,), (4, 4, 1, 1)))
    arguments = inputs(rows)
    with _as_on_a_gpu(small) as launched:
        assert_same(convert(*arguments), rows.document_ids)
    assert launched == [kernels]


@st.composite
def eos_arguments(draw):
    """Tokens of any values (some below 0, some past the vocabulary), up to five markers (past four: the aten
    body), padding by a mask or a pad token, every flag."""
    batch, sequence = draw(st.integers(1, 4)), draw(st.integers(1, 30))
    values = draw(st.lists(st.integers(-1, 7), min_size=batch * sequence, max_size=batch * sequence))
    tokens = torch.tensor(values).view(batch, sequence)
    tokens = draw(st.sampled_from([tokens, tokens.to(torch.int32), tokens.abs().to(torch.uint8)]))
    markers = draw(st.lists(st.integers(0, 7), min_size=1, max_size=5, unique=True))
    mask = draw(st.sampled_from([None, tokens != 2, (tokens != 2).to(torch.int32)]))
    pad = draw(st.sampled_from([None, 1, 300]))
    vocab = draw(st.sampled_from([None, 6, 300]))
    flags = [draw(st.booleans()) for _ in range(4)]
    return tokens, mask, markers, flags[0], pad, vocab, *flags[1:]


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(arguments=eos_arguments())
@example(arguments=(torch.tensor([[5, 5, 0] * 4 + [1] * 6 + [5, 0]]), None, [0], False, 1, 8, True, True, True))
@example(arguments=(torch.tensor([[0, 5, 5, 0, 2, 2, 2, 2, 2, 0, 5]]), torch.tensor([[1] * 4 + [0] * 5 + [1] * 2]),
                    [0], True, None, None, True, True, False))  # fmt: skip
@example(arguments=(torch.tensor([[0, 6, 1]]), None, [0], False, None, 6, True, True, True))  # a token at vocab_size
def test_eos_kernels_match_the_decomposition(small, arguments):
    """Padding across blocks, a marker that begins (``bos``) or ends a document, and all the outputs."""
    assert_same_outputs(EOS, *arguments, body=_conversion(small, EOS))


PAD = varlen_ops.pad_op


@pytest.fixture
def small_pad():
    """Programs of 4 positions, rows moved 2 elements at a time."""
    with mock.patch.multiple(triton_rows, PAD_BLOCK=4, PAD_WIDTH=2):
        yield triton_rows


def _pad_matches(module, values, indices, num_tokens, sequence):
    """``pad_kernels`` flags what the aten body flags, and where no rule breaks moves the same rows."""
    expected, actual = (
        PAD.math(values, indices, num_tokens, sequence),
        module.pad_kernels(values, indices, num_tokens, sequence),
    )
    assert_same(actual[1], expected[1])
    if not expected[1].any():
        assert_same(actual[0], expected[0])
    return bool(expected[1].any())


@st.composite
def pad_arguments(draw):
    """A mask's varlen permutation, as varlen_metadata makes it or edited (most edits break the rule), and values
    of a dtype pad moves by its kernel, with 0 to 2 trailing axes."""
    mask = draw(packing_masks(max_sequence=12, max_batch=3))
    metadata = ops.varlen_metadata_op.math(mask, mask.shape[1])
    indices, num_tokens = metadata.indices, metadata.num_tokens
    total = indices.numel()
    edit = draw(st.sampled_from(["none", "none", "count", "swap", "any"]))
    if edit == "count":
        num_tokens = num_tokens + draw(st.sampled_from([-1, 1, total + 1]))
    elif edit == "swap" and total > 1:
        first, second = draw(st.integers(0, total - 1)), draw(st.integers(0, total - 1))
        indices = indices.clone()
        indices[[first, second]] = indices[[second, first]]
    elif edit == "any":
        indices = torch.tensor(draw(st.lists(st.integers(-1, total), min_size=total, max_size=total)))
    dtype = draw(st.sampled_from(sorted(triton_rows.PAD_DTYPES, key=str)))
    trailing = draw(st.sampled_from([(), (1,), (3,), (2, 3)]))
    values = (torch.randn(total, *trailing) * 100).to(dtype)
    return values, indices, num_tokens, mask.shape[1]


# Permutations of 2 rows of [1, 1, 0, 2] and [0, 3, 3, 0] (valid positions 0 1 3 5 6, padding 2 4 7) that break the
# rule where the aten body's own check alone would not, or only barely.
VALID = [0, 1, 3, 5, 6, 2, 4, 7]
PAD_BROKEN = {
    "num_tokens past the positions": ([0, 1, 2, 3, 4, 5, 6, 7], 9),
    "num_tokens below 0": ([0, 1, 2, 3, 4, 5, 6, 7], -1),
    "valid part not ascending": ([1, 0, 3, 5, 6, 2, 4, 7], 5),
    "padding part not ascending": ([0, 1, 3, 5, 6, 4, 2, 7], 5),
    "an entry past the positions": ([0, 1, 3, 5, 6, 2, 4, 8], 5),
    "an entry below 0": ([-1, 1, 3, 5, 6, 2, 4, 7], 5),
    "a position in both parts": ([0, 1, 3, 5, 6, 2, 3, 7], 5),
}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(arguments=pad_arguments())
@example(arguments=(torch.arange(8.0).view(8, 1), torch.tensor(VALID), torch.tensor(5), 4))  # moved across programs
@example(arguments=(torch.ones(1, 3), torch.tensor([0]), torch.tensor(-1), 1))  # one position, num_tokens -1
def test_pad_kernels_match_the_decomposition(small_pad, arguments):
    _pad_matches(small_pad, *arguments)


@pytest.mark.parametrize("name", sorted(PAD_BROKEN))
def test_pad_kernels_flag_each_broken_permutation(small_pad, name):
    indices, num_tokens = PAD_BROKEN[name]
    values = torch.randn(8, 3)
    assert _pad_matches(small_pad, values, torch.tensor(indices), torch.tensor(num_tokens), 4)


def test_pad_kernels_at_their_shipped_sizes():
    """32 positions a program, 128 elements a move: 4200 positions are 132 programs, rows of 130 two moves."""
    assert (triton_rows.PAD_BLOCK, triton_rows.PAD_WIDTH) == (32, 128)
    metadata = ops.varlen_metadata_op.math(random_mask(2, 2100, seed=5, documents=40), 2100)
    values = torch.randn(4200, 2, 65).to(torch.bfloat16)
    assert not _pad_matches(triton_rows, values, metadata.indices, metadata.num_tokens, 2100)


@pytest.mark.parametrize("dtype", [torch.float32, torch.complex64], ids=str)
def test_pad_takes_its_kernel_on_a_gpu_tensor(small_pad, dtype):
    """Forward, and as unpad's backward; a dtype Triton cannot move (complex) takes the aten body in its place."""
    metadata = packfn.varlen_metadata(torch.tensor([[1, 1, 0, 2], [0, 3, 3, 0]]))
    values = torch.randn(2, 4, 3, dtype=dtype, requires_grad=True)
    unpadded = packfn.unpad(values, metadata)
    expected = packfn.pad(unpadded, metadata)
    (gradient,) = torch.autograd.grad(unpadded, values, unpadded.detach())
    with _as_on_a_gpu(small_pad) as launched:
        assert_same(packfn.pad(unpadded, metadata), expected)
        assert_same(torch.autograd.grad(packfn.unpad(values, metadata), values, unpadded.detach())[0], gradient)
    assert launched == ["pad_kernels", "pad_kernels"]


# ------------------------------------------------------------------ aligned layout

LAYOUT = layout_ops.aligned_layout_op


def _layout_matches(module, *arguments) -> bool:
    """``layout_kernels`` gives every output of the aten body (the decomposition), broken tables included."""
    expected = LAYOUT.math(*arguments)
    assert_same(tuple(module.layout_kernels(*arguments)), tuple(expected))
    return bool(expected.broken.any())


@st.composite
def layout_arguments(draw):
    """A layout's tables, valid or broken, at a budget that fits them, falls a block short or leaves blocks over;
    alignments up to 64 (wider ones only lengthen the aligned rows the interpreter walks, 8 columns a block)."""
    inputs = draw(layout_inputs(broken=draw(st.booleans())))
    lengths = as_rows(inputs.seq_lens)
    spans = lengths if inputs.seq_lens_padded is None else as_rows(inputs.seq_lens_padded)
    sequence, alignment = inputs.input_shape[1], draw(st.sampled_from([1, 2, 3, 4, 8, 64]))
    need = int(LAYOUT.math(lengths, spans, sequence, alignment, alignment).longest)
    blocks = max(1, -(-need // alignment) + draw(st.integers(-1, 2)))
    return lengths, spans, sequence, alignment, blocks * alignment


# Two rows whose first broken document sits in a later block of the first row than the second row's; a row whose
# first broken document breaks a rule of a lower bit than a later one's; rows that end at the input row's end; an
# absent slot's negative span; spans that break two rules at once; spans near int64's limit; a document longer than
# the row (its length is clamped to the row and one column more); a table wider than a block of slots whose
# documents span blocks.
LAYOUT_CASES = {
    "the first broken row wins": ([[1] * 9 + [-1], [-2] + [0] * 9], None, 12, 1, 12),
    "two rules of one document": ([[2, 3]], [[2, 1]], 3, 2, 8),
    "spans near int64's limit": ([[3], [3]], [[2**62], [2**62]], 8, 1, 4),
    "a document longer than the input row": ([[20, 2]], None, 8, 4, 8),
    "slots across blocks": ([[0, 0, 3, 0, 0, 0, 0, 0, 0, 2, 0, 9], [1] * 12], [[0, 0, 5, 0, 0, 0, 0, 0, 0, 2, 0, 9],
                            [1] * 12], 16, 4, 48),
    "no document": ([[0, 0, 0]], None, 5, 2, 4),
    "an absent document with a negative span": ([[2, 0]], [[2, -1]], 4, 1, 4),
    "rows that fill the input row": ([[3, 4], [7, 0]], [[3, 4], [7, 0]], 7, 1, 7),
    "a row's first broken document, not its worst": ([[-1] + [1] * 9 + [3]], [[-1] + [1] * 9 + [2]], 16, 1, 16),
}  # fmt: skip


@triton.jit
def _clamp(values, clamped, sequence, BLOCK: tl.constexpr):
    column = tl.arange(0, BLOCK)
    tl.store(clamped + column, triton_rows._clamped(tl.load(values + column).to(tl.int64), sequence))


def test_lengths_clamp_at_int32s_widest_row():
    """Triton takes a row length below 2**31 as int32, where ``sequence + 1`` wraps: the clamp of every length
    (``_length_rows``, ``_layout_rows``) is taken in int64 (at ``2**31 - 1`` every length became ``-2**31``)."""
    values = torch.tensor([5, -3, 2**31 - 1, 0], dtype=torch.int32)
    for sequence in (2**31 - 1, 2**31 - 2, 4):
        clamped = torch.empty(4, dtype=torch.int64)
        _clamp[(1,)](values, clamped, sequence, BLOCK=4)
        assert_same(clamped, values.to(torch.int64).clamp(0, sequence + 1))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(arguments=layout_arguments())
def test_layout_kernels_match_the_decomposition(small, arguments):
    _layout_matches(small, *arguments)


@pytest.mark.parametrize("name", sorted(LAYOUT_CASES))
def test_layout_kernels_at_named_tables(small, name):
    lengths, spans, sequence, alignment, budget = LAYOUT_CASES[name]
    lengths = torch.tensor(lengths)
    _layout_matches(small, lengths, lengths if spans is None else torch.tensor(spans), sequence, alignment, budget)


def test_layout_kernels_at_their_shipped_size():
    """1024 columns a block: 1101 document slots span two blocks, rows of 2100 columns three, the aligned rows of
    9400 (the 1100 one-token documents take 8 columns each) ten."""
    assert triton_rows.BLOCK == 1024
    rows = PackedRows(2100, ((1, 7, 1800, 200), (2100,), (1,) * 1100 + (600,)))
    arguments = (rows.seq_lens, rows.seq_lens, 2100, 8, 9400)
    assert not _layout_matches(triton_rows, *arguments)


def test_aligned_layout_takes_its_kernels_on_a_gpu_tensor(small):
    """The public function and its pack / restore, against the CPU's."""
    lengths, spans = torch.tensor([[3, 4, 0], [1, 1, 5]]), torch.tensor([[4, 4, 0], [1, 2, 5]])
    values = torch.randn(2, 9, 3)
    expected = packfn.aligned_layout(lengths, spans, sequence_length=9, alignment=4, budget=16)
    with _as_on_a_gpu(small) as launched:
        layout = packfn.aligned_layout(lengths, spans, sequence_length=9, alignment=4, budget=16)
    assert launched == ["layout_kernels"]
    assert_same(layout_fields(layout), layout_fields(expected))
    assert_same(layout.restore(layout.pack(values)), expected.restore(expected.pack(values)))
