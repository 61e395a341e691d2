"""Ops with a separate eager kernel (NOTE [Eager kernels]) compute what their decomposition computes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from packfn._ops import layout as layout_ops
from packfn._ops import metadata as ops
from packfn._ops import varlen as varlen_ops
from packfn._ops._cpu import numpy_views
from packfn.layout import aligned_layout, safe_budget

from tests.assertions import assert_same, assert_same_outputs
from tests.strategies import packing_masks
from tests.strategies_layout import layout_inputs, random_values

EAGER_OPS = [ops.varlen_metadata_op, ops.batch_metadata_op]


def test_every_listed_op_has_its_own_eager_kernel():
    for op in EAGER_OPS:
        assert op.eager is not op.math


@pytest.mark.parametrize("op", EAGER_OPS, ids=lambda op: op.__name__)
@settings(max_examples=150, deadline=None)
@given(mask=packing_masks(max_sequence=96), capacity=st.sampled_from([1, 2, 5, 300, None]))
@example(mask=torch.tensor([[0, 0]]), capacity=None)
@example(mask=torch.tensor([[3, 0, 3, 5]], dtype=torch.uint8), capacity=2)
def test_eager_kernel_matches_decomposition(op, mask, capacity):
    assert_same_outputs(op, mask, capacity or mask.shape[1])


BROKEN = {
    "decreasing": [[2, 1, 0]],
    "negative before positive": [[-1, 0, 2]],
    "negative repeated": [[1, 0, -3, -3]],
    "too many documents": [[1, 2, 3, 4]],
    "decrease after padding": [[1, 2, 0, 1]],
}


@pytest.mark.parametrize("op", EAGER_OPS, ids=lambda op: op.__name__)
@pytest.mark.parametrize("name", sorted(BROKEN))
def test_eager_kernel_reports_the_same_first_broken_rule(op, name):
    mask = torch.tensor(BROKEN[name])
    assert_same_outputs(op, mask, 2)
    assert op.eager(mask, 2).broken.any()


@settings(max_examples=150, deadline=None)
@given(inputs=layout_inputs(broken=True), data=st.data())
def test_layout_eager_kernel_matches_decomposition(inputs, data):
    """``aligned_layout``'s eager ``input_positions`` (an indexed write) equals its decomposition's (a search)."""
    op = layout_ops.aligned_layout_op
    assert op.eager is not op.math
    batch, sequence = inputs.input_shape
    lengths = inputs.seq_lens.reshape(batch, -1)
    spans = lengths if inputs.seq_lens_padded is None else inputs.seq_lens_padded.reshape(batch, -1)
    alignment = inputs.alignment
    need = int(layout_ops.DocumentTable.build(lengths, spans, alignment, sequence).longest())
    blocks = data.draw(st.integers(max(0, -(-need // alignment) - 1), -(-need // alignment) + 2), label="blocks")
    assert_same_outputs(op, lengths, spans, sequence, alignment, blocks * alignment)


@settings(max_examples=60, deadline=None)
@given(
    inputs=layout_inputs(),
    trailing=st.sampled_from([(), (3,), (2, 3)]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.bool]),
    fill=st.sampled_from([0.0, 1.0, -1.0]),
)
def test_pack_and_restore_eager_kernels_match_their_decompositions(inputs, trailing, dtype, fill):
    """``pack`` / ``restore``: the eager flat row copy equals the decomposition's gather along the sequence axis."""
    batch, sequence = inputs.input_shape
    assume(sequence > 0)  # an empty input row has no column to gather the aligned row's padding from, in either form
    lengths = inputs.seq_lens.reshape(batch, -1)
    spans = lengths if inputs.seq_lens_padded is None else inputs.seq_lens_padded.reshape(batch, -1)
    budget = safe_budget(sequence, lengths.shape[1], inputs.alignment)
    layout = aligned_layout(lengths, spans, sequence_length=sequence, alignment=inputs.alignment, budget=budget)
    values = random_values((batch, sequence, *trailing), dtype)
    aligned = random_values((batch, budget, *trailing), dtype, seed=1)
    tables = (layout.source_indices, layout.input_positions)
    for op, args in (
        (layout_ops.pack_op, (values, *tables, fill)),
        (layout_ops.restore_op, (aligned, *reversed(tables))),
    ):
        assert op.eager is not op.math
        assert_same(op.eager(*args), op.math(*args))


@st.composite
def any_ids(draw) -> torch.Tensor:
    """``[batch, sequence]`` ids of any values (the physical view has no rules), in a mask dtype."""
    batch, sequence = draw(st.integers(1, 3)), draw(st.integers(1, 40))
    dtype = draw(st.sampled_from([torch.bool, torch.uint8, torch.int32, torch.int64]))
    low = -3 if dtype.is_signed else 0
    values = draw(st.lists(st.integers(low, 3), min_size=batch * sequence, max_size=batch * sequence))
    return torch.tensor(values).reshape(batch, sequence).to(dtype)


@settings(max_examples=150, deadline=None)
@given(ids=any_ids(), transpose=st.booleans())
def test_physical_varlen_eager_kernel_matches_decomposition(ids, transpose):
    """``physical_varlen_metadata``'s CPU eager kernel (one ``nonzero``) equals its decomposition (a scatter)."""
    op = varlen_ops.physical_varlen_metadata_op
    assert op.eager is not op.math
    if transpose:  # a non-contiguous input
        ids = ids.t().contiguous().t()
    assert_same(tuple(op.eager(ids)), tuple(op.math(ids)))


def test_numpy_gets_no_view_of_a_functorch_wrapper():
    """DLPack of a functionalize wrapper exports memory that is not its values: the wrapper gets no NumPy view."""
    seen = []

    def view(tensor):
        seen.append(numpy_views(tensor))
        return tensor

    torch.func.functionalize(view)(torch.tensor([[0, 1]]))
    torch.func.vmap(view)(torch.tensor([[0, 1]]))
    assert seen == [None, None]
    assert numpy_views(torch.tensor([[0, 1]])) is not None
