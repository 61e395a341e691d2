"""Aligned layouts of a fixed budget, safe_budget, pack and restore: upstream's rows, autograd, opcheck, export."""

from __future__ import annotations

import itertools
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nemo_automodel.components.models.deepseek_v41 import packing as upstream
from torch._dynamo.testing import CompileCounterWithBackend
from torch.export import Dim

import packfn
from packfn._ops import layout as layout_ops
from packfn.layout import aligned_layout, safe_budget

from tests.assertions import assert_all_equal, assert_same
from tests.compiling import export_dynamic
from tests.references import brute_force_safe_budget
from tests.strategies_layout import (
    ALIGNMENTS,
    LAYOUT_FIELDS,
    layout_fields,
    layout_inputs,
    layout_kwargs,
    length_tables,
    random_values,
    round_trip_inputs,
)

HYPOTHESIS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LENGTHS = torch.tensor([[3, 0, 5], [2, 2, 0]])


def test_documented_example():
    """The example of the layout format (packfn/_ops/layout.py) at the budget it shows."""
    layout = aligned_layout(
        torch.tensor([[3, 0, 5]]), torch.tensor([[4, 0, 5]]), sequence_length=9, alignment=4, budget=12
    )
    assert layout.source_indices.tolist() == [[0, 1, 2, -1, 4, 5, 6, 7, 8, -1, -1, -1]]
    assert layout.position_ids.tolist() == [[0, 1, 2, 0, 0, 1, 2, 3, 4, 0, 0, 0]]
    assert layout.sequence_ids.tolist() == [[1, 1, 1, 0, 3, 3, 3, 3, 3, 0, 0, 0]]
    assert layout.input_positions.tolist() == [[0, 1, 2, -1, 4, 5, 6, 7, 8]]
    assert layout.pack(torch.arange(9)[None], fill=-7).tolist() == [[0, 1, 2, -7, 4, 5, 6, 7, 8, -7, -7, -7]]
    assert safe_budget(9, 3, 4) == 16


# ---------------------------------------------------------------- the static API


@HYPOTHESIS
@given(inputs=layout_inputs(), extra_blocks=st.integers(0, 2))
def test_aligned_layout_at_safe_budget_is_packed_layout_then_padding(inputs, extra_blocks):
    batch, sequence = inputs.input_shape
    documents = inputs.seq_lens.shape[-1]
    budget = safe_budget(sequence, documents, inputs.alignment, inputs.minimum_length)
    budget += extra_blocks * inputs.alignment
    static = aligned_layout(
        inputs.seq_lens, inputs.seq_lens_padded, sequence_length=sequence, alignment=inputs.alignment, budget=budget
    )
    expected = upstream.packed_layout(inputs.seq_lens, **inputs.kwargs())
    width = expected.source_indices.shape[1]
    assert width <= budget
    assert torch.equal(static.input_positions, expected.input_positions)
    for name, padding in (("source_indices", -1), ("position_ids", 0), ("sequence_ids", 0)):
        field = getattr(static, name)
        assert field.shape == (batch, budget) and field.dtype == torch.int64
        assert torch.equal(field[:, :width], getattr(expected, name))
        assert (field[:, width:] == padding).all()


@HYPOTHESIS
@given(
    sequence=st.integers(0, 300),
    documents=st.integers(0, 12),
    alignment=ALIGNMENTS,
    minimum_budget=st.integers(-5, 300),
)
def test_safe_budget_is_reached_by_one_token_documents_and_one_long_one(sequence, documents, alignment, minimum_budget):
    bound = safe_budget(sequence, documents, alignment, minimum_budget)
    fitting = min(documents, sequence)
    lengths = [1] * max(0, fitting - 1) + ([sequence - fitting + 1] if fitting else [])
    seq_lens = torch.tensor(lengths + [0] * (documents - len(lengths)), dtype=torch.int64).reshape(1, documents)
    kwargs = layout_kwargs(None, (1, sequence), alignment, minimum_budget)
    assert bound == upstream.packed_layout(seq_lens, **kwargs).source_indices.shape[1]
    assert bound % alignment == 0 and bound >= max(minimum_budget, 1)


@HYPOTHESIS
@given(tables=length_tables(), alignment=ALIGNMENTS)
def test_safe_budget_fits_every_valid_table(tables, alignment):
    lengths, spans, _ = tables
    seq_lens = torch.tensor(lengths).reshape(len(lengths), -1)
    sequence = max(
        sum(span for span, length in zip(span_row, row, strict=True) if length != 0)
        for span_row, row in zip(spans, lengths, strict=True)
    )
    need = int(layout_ops.DocumentTable.build(seq_lens, seq_lens, alignment, sequence).longest())
    assert need <= safe_budget(sequence, seq_lens.shape[1], alignment)


_SAFE_BUDGET_CASES = [
    (sequence, documents, alignment, minimum_budget)
    for sequence, documents, alignment in itertools.product(range(0, 9), range(0, 11), range(1, 6))
    for minimum_budget in (0, 5)
]


def test_safe_budget_equals_brute_force_over_every_valid_table():
    mismatches = [
        (case, safe_budget(*case), brute_force_safe_budget(*case))
        for case in _SAFE_BUDGET_CASES
        if safe_budget(*case) != brute_force_safe_budget(*case)
    ]
    assert not mismatches


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        pytest.param((5, 9, 4), 20, id="more_documents_than_tokens"),  # five one-token documents
        pytest.param((3, 9, 1), 3, id="more_documents_than_tokens_alignment_1"),
        pytest.param((5, 5, 4), 20, id="documents_equal_tokens"),
        pytest.param((9, 3, 4), 16, id="docstring_example"),  # 1 + 1 + 7 tokens
        pytest.param((6, 2, 4), 12, id="rest_fills_whole_blocks"),  # 1 + 5 tokens
        pytest.param((8, 1, 4), 8, id="one_document"),
        pytest.param((0, 3, 4), 4, id="no_token"),  # the floor of one block
        pytest.param((9, 0, 4), 4, id="no_document_slot"),
        pytest.param((5, 9, 4, 21), 24, id="minimum_budget_above_need"),
        pytest.param((5, 9, 4, 20), 20, id="minimum_budget_equal_to_need"),
    ],
)
def test_safe_budget_reaches_upstream_row_length(arguments, expected):
    assert safe_budget(*arguments) == expected
    sequence, documents, alignment, *minimum = arguments
    # The worst table (documents - 1 one-token documents and one of the rest) reaches it in upstream.
    fitting = min(documents, sequence)
    lengths = [1] * max(fitting - 1, 0) + ([sequence - fitting + 1] if fitting else []) + [0] * (documents - fitting)
    if documents:
        layout = upstream.packed_layout(
            torch.tensor([lengths]),
            seq_lens_padded=None,
            input_shape=(1, sequence),
            alignment=alignment,
            minimum_length=minimum[0] if minimum else 0,
        )
        assert layout.source_indices.shape[1] == expected


DATA_RULES = {
    "absent document with a span": ([[3, 0]], [[3, 2]], 9, 8, layout_ops.layout_rules(8)[0].message),
    "negative length": ([[3, -2]], [[3, -2]], 9, 8, layout_ops.layout_rules(8)[1].message),
    "span shorter than its length": ([[3, 4]], [[3, 3]], 9, 8, layout_ops.layout_rules(8)[2].message),
    "spans past the input row": ([[3, 4], [1, 0]], [[4, 4], [1, 0]], 7, 8, layout_ops.layout_rules(8)[3].message),
    "one span alone past the input row": ([[3]], [[8]], 7, 8, layout_ops.layout_rules(8)[3].message),
    "documents do not fit budget": ([[3, 4], [1, 1]], None, 9, 4, "do not fit budget=4"),
}


@pytest.mark.parametrize("name", sorted(DATA_RULES))
def test_aligned_layout_asserts_on_broken_data(name):
    lengths, spans, sequence, budget, message = DATA_RULES[name]
    spans = None if spans is None else torch.tensor(spans)
    with pytest.raises(RuntimeError, match=re.escape(message)):
        aligned_layout(torch.tensor(lengths), spans, sequence_length=sequence, alignment=4, budget=budget)


@pytest.mark.parametrize(
    ("keywords", "error", "message"),
    [
        ({"alignment": 0}, ValueError, "alignment must be positive"),
        ({"alignment": 2.0}, TypeError, "alignment must be an int"),
        ({"budget": 6}, ValueError, "must be a multiple of alignment"),
        ({"budget": 0}, ValueError, "budget must be positive"),
        ({"sequence_length": 9.0}, TypeError, "sequence_length must be an int"),
        ({"seq_lens": LENGTHS.float()}, ValueError, "seq_lens must hold int32 or int64"),
        ({"seq_lens_padded": LENGTHS[:, :2]}, ValueError, "matching [batch, documents] shapes"),
        ({"seq_lens": [3, 4]}, TypeError, "seq_lens must be a torch.Tensor"),
    ],
)
def test_aligned_layout_rejects_bad_arguments(keywords, error, message):
    arguments = {"seq_lens": LENGTHS, "seq_lens_padded": None, "sequence_length": 9, "alignment": 4, "budget": 12}
    arguments.update(keywords)
    with pytest.raises(error, match=re.escape(message)):
        aligned_layout(arguments.pop("seq_lens"), arguments.pop("seq_lens_padded"), **arguments)


def test_aligned_layout_negative_sequence_length_raises_value_error():
    with pytest.raises(ValueError, match="sequence_length"):
        aligned_layout(torch.tensor([[1]]), sequence_length=-1, alignment=4, budget=4)


def test_aligned_layout_marks_absent_slots_by_zero_only():
    """The core has one absent marker, 0: NeMo AutoModel's -1000 is a negative length here (its drop-in maps it)."""
    with pytest.raises(RuntimeError, match="seq_lens must not hold negative document lengths"):
        aligned_layout(torch.tensor([[3, -1000, 2]]), sequence_length=9, alignment=4, budget=12)
    with pytest.raises(RuntimeError, match=re.escape("an absent document (length 0) must not have a physical span")):
        aligned_layout(torch.tensor([[3, 0]]), torch.tensor([[3, 2]]), sequence_length=9, alignment=4, budget=12)


def test_safe_budget_rejects_bad_arguments():
    with pytest.raises(ValueError, match="must not be negative"):
        safe_budget(-1, 3, 4)
    with pytest.raises(TypeError, match="documents must be an int"):
        safe_budget(8, 3.0, 4)
    with pytest.raises(ValueError, match="alignment must be positive"):
        safe_budget(8, 3, 0)


def test_aligned_layout_of_an_empty_batch():
    layout = aligned_layout(torch.zeros(0, 3, dtype=torch.int64), sequence_length=5, alignment=2, budget=4)
    assert layout.source_indices.shape == (0, 4) and layout.input_positions.shape == (0, 5)


def test_huge_spans_of_one_row_change_no_other_row():
    """Spans near int64's limit (a broken table) must not wrap the flat running sum into the next row."""
    lengths, spans = torch.tensor([[3], [3]]), torch.tensor([[2**62], [2**62]])
    both = layout_ops.aligned_layout_op(lengths, spans, 8, 1, 4)
    for row in range(2):
        alone = layout_ops.aligned_layout_op(lengths[row : row + 1], spans[row : row + 1], 8, 1, 4)
        for name in LAYOUT_FIELDS:
            assert torch.equal(getattr(both, name)[row : row + 1], getattr(alone, name)), (row, name)


# ---------------------------------------------------------------- pack and restore

# The layout of LENGTHS in rows of 10 (document 1 with one padding column, document 5 of row 1 with one).
SMALL = aligned_layout(LENGTHS, torch.tensor([[4, 0, 5], [2, 3, 0]]), sequence_length=10, alignment=4, budget=12)


def test_pack_and_restore_gradients_pass_gradcheck():
    values = torch.randn(2, 10, 3, dtype=torch.float64, requires_grad=True)
    aligned = torch.randn(2, 12, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: SMALL.pack(x, fill=0.5), (values,))
    assert torch.autograd.gradcheck(SMALL.restore, (aligned,))
    assert torch.autograd.gradgradcheck(lambda x: SMALL.pack(x, fill=0.5), (values,))


def test_gradients_reach_real_tokens_only_and_match_upstream():
    upstream_layout = upstream.PackedSequenceLayout(*layout_fields(SMALL))
    for step in ("pack", "restore"):
        width = 10 if step == "pack" else 12
        values = torch.randn(2, width, 3, requires_grad=True)
        weights = torch.randn(2, 22 - width, 3)
        (getattr(SMALL, step)(values) * weights).sum().backward()
        mine = values.grad
        values.grad = None
        (getattr(upstream_layout, step)(values) * weights).sum().backward()
        torch.testing.assert_close(mine, values.grad, rtol=0, atol=0)
        real = (SMALL.input_positions if step == "pack" else SMALL.source_indices) >= 0
        assert (mine[~real] == 0).all() and (mine[real] != 0).all()


def test_pack_and_restore_reject_bad_arguments():
    with pytest.raises(ValueError, match=re.escape("values must have shape [batch=2, sequence=10, ...]")):
        SMALL.pack(torch.zeros(2, 12))
    with pytest.raises(ValueError, match=re.escape("values must have shape [batch=2, length=12, ...]")):
        SMALL.restore(torch.zeros(3, 12))
    with pytest.raises(ValueError, match="values must have shape"):
        SMALL.restore(torch.zeros(2))
    with pytest.raises(TypeError, match="fill must be an int or a float"):
        SMALL.pack(torch.zeros(2, 10), fill=torch.tensor(1.0))
    with pytest.raises(TypeError, match=re.escape("values must be a torch.Tensor")):
        SMALL.restore([[0.0] * 12] * 2)


# ---------------------------------------------------------------- opcheck


def _op_samples():
    seq_lens, spans = torch.tensor([[3, 0, 5], [2, 2, 0]]), torch.tensor([[4, 0, 5], [2, 3, 0]])
    yield torch.ops.packfn.aligned_layout.default, (seq_lens, spans, 10, 4, 16)
    yield torch.ops.packfn.aligned_layout.default, (seq_lens.int(), seq_lens, 9, 1, 12)
    yield torch.ops.packfn.aligned_layout.default, (torch.zeros(2, 0, dtype=torch.int64),) * 2 + (5, 8, 8)
    tables = (SMALL.source_indices, SMALL.input_positions)
    for dtype, trailing in (
        (torch.float32, (2, 3)),
        (torch.float64, ()),
        (torch.bfloat16, (3,)),
        (torch.int64, (3,)),
        (torch.bool, ()),
    ):
        grad = dtype in (torch.float32, torch.float64)
        values = random_values((2, 10, *trailing), dtype).requires_grad_(grad)
        aligned = random_values((2, 12, *trailing), dtype).requires_grad_(grad)
        yield torch.ops.packfn.pack.default, (values, *tables, 1.0 if dtype == torch.bool else -1.5)
        yield torch.ops.packfn.restore.default, (aligned, *tables[::-1])


@pytest.mark.parametrize(("op", "args"), list(_op_samples()))
def test_opcheck(op, args):
    torch.library.opcheck(op, args)


# ---------------------------------------------------------------- compile and export


def test_one_dynamic_compile_serves_several_sequence_lengths(no_graph_breaks):
    def step(seq_lens, values):
        sequence = values.shape[1]
        budget = safe_budget(sequence, seq_lens.shape[1], 4)
        layout = aligned_layout(seq_lens, sequence_length=sequence, alignment=4, budget=budget)
        return layout.pack(values), layout.input_positions

    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(step, backend=counter, fullgraph=True, dynamic=True)
    for sequence in (9, 14, 23):
        seq_lens = torch.tensor([[2, sequence - 4, 0], [1, 1, 1]])
        values = torch.randn(2, sequence, 2)
        assert_all_equal(compiled(seq_lens, values), step(seq_lens, values))
    assert counter.frame_count == 1


class AlignedRoundTrip(torch.nn.Module):
    def forward(self, lens, values):
        sequence = values.shape[1]
        budget = packfn.safe_budget(sequence, lens.shape[1], 4)
        layout = packfn.aligned_layout(lens, sequence_length=sequence, alignment=4, budget=budget)
        packed = layout.pack(values, fill=-1)
        return (*layout_fields(layout), packed, layout.restore(packed))


@pytest.mark.parametrize("trailing", [(), (3, 5)])
def test_export_aligned_layout_with_dynamic_sequence_runs_at_other_lengths(trailing):
    module = AlignedRoundTrip()
    exported = export_dynamic(module, round_trip_inputs(32, trailing), (None, {1: Dim("S", min=16, max=4096)}))
    for sequence in (20, 40, 3000):
        inputs = round_trip_inputs(sequence, trailing)
        assert_same(tuple(exported(*inputs)), module(*inputs))
