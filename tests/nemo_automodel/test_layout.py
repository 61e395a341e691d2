"""The drop-in packed_layout: parity with nemo_automodel 0.7.0, its exact CPU path, compile and export."""

from __future__ import annotations

import functools
import re
from unittest import mock

import numpy
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nemo_automodel.components.models.deepseek_v41 import packing as upstream
from torch._inductor.utils import run_and_get_code
from torch.export import Dim

from packfn._ops import layout as layout_ops
from packfn.layout import aligned_layout, safe_budget
from packfn.nemo_automodel import packed_layout

from tests.assertions import assert_all_equal, assert_layouts_equal, assert_same
from tests.compiling import Fn, export_dynamic, traced
from tests.strategies_layout import (
    LAYOUT_FIELDS,
    UPSTREAM_ABSENT,
    layout_fields,
    layout_inputs,
    layout_kwargs,
    random_values,
    round_trip_inputs,
)

VALUE_DTYPES = (torch.float32, torch.bfloat16, torch.int64, torch.bool)
HYPOTHESIS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def upstream_outcome(inputs):
    """Upstream's layout, or the message of the ValueError it raises."""
    try:
        return upstream.packed_layout(inputs.seq_lens, **inputs.kwargs())
    except ValueError as error:
        return str(error)


def exact_cpu_path(enabled: bool):
    """A context in which the drop-in takes (or not) its exact CPU path (NOTE [Exact sizes on the CPU])."""
    return mock.patch("packfn.nemo_automodel.layout.exact_on_cpu", lambda *tensors: enabled)


# ---------------------------------------------------------------- parity with upstream


@HYPOTHESIS
@given(inputs=layout_inputs(absent=UPSTREAM_ABSENT))
def test_packed_layout_matches_upstream(inputs):
    expected = upstream.packed_layout(inputs.seq_lens, **inputs.kwargs())
    assert_layouts_equal(packed_layout(inputs.seq_lens, **inputs.kwargs()), expected)


@HYPOTHESIS
@given(inputs=layout_inputs(broken=True, absent=UPSTREAM_ABSENT))
def test_packed_layout_data_errors_match_upstream(inputs):
    expected = upstream_outcome(inputs)
    if isinstance(expected, str):
        with pytest.raises(ValueError, match=re.escape(expected)):
            packed_layout(inputs.seq_lens, **inputs.kwargs())
    else:
        assert_layouts_equal(packed_layout(inputs.seq_lens, **inputs.kwargs()), expected)


def _outcome(inputs):
    try:
        return packed_layout(inputs.seq_lens, **inputs.kwargs())
    except ValueError as error:
        return str(error)


@HYPOTHESIS
@given(inputs=layout_inputs(broken=True, absent=UPSTREAM_ABSENT))
def test_exact_cpu_path_equals_the_static_path(inputs):
    """NOTE [Exact sizes on the CPU] in packfn/nemo_automodel/metadata.py: the same layouts and the same errors."""
    exact = _outcome(inputs)
    with exact_cpu_path(False):
        static = _outcome(inputs)
    if isinstance(exact, str) or isinstance(static, str):
        assert exact == static
    else:
        assert_layouts_equal(exact, static)
        for name in LAYOUT_FIELDS:
            assert getattr(exact, name).is_contiguous(), name


@pytest.mark.parametrize(
    "spans",
    [
        [[2, 2], [4, 1]],  # row 0 breaks the span rule before row 1's absent document with a span
        [[3, 2], [4, 1]],  # only row 1's absent document with a span
        [[3, 2], [4, 0]],  # row 1's absent document first, then its next document runs past the row
        [[4, 4], [0, 1]],  # spans past the row in row 0 only
    ],
)
def test_data_errors_report_the_first_broken_document_like_upstream(spans):
    lengths, kwargs = torch.tensor([[3, 2], [0, 1]]), layout_kwargs(torch.tensor(spans), (2, 7), 4)
    with pytest.raises(ValueError) as expected:
        upstream.packed_layout(lengths, **kwargs)
    with pytest.raises(ValueError, match=re.escape(str(expected.value))):
        packed_layout(lengths, **kwargs)


LENGTHS = torch.tensor([[3, 0, 5], [2, 2, -1000]])
ARGUMENT_ERRORS = {
    "zero alignment": (LENGTHS, layout_kwargs(None, (2, 9), 0)),
    "negative alignment": (LENGTHS, layout_kwargs(LENGTHS, (2, 9), -3)),
    "float lengths": (LENGTHS.float(), layout_kwargs(None, (2, 9), 4)),
    "bool lengths": (LENGTHS > 0, layout_kwargs(None, (2, 9), 4)),
    "int16 lengths": (LENGTHS.short(), layout_kwargs(None, (2, 9), 4)),
    "float spans": (LENGTHS, layout_kwargs(LENGTHS.double(), (2, 9), 4)),
    "int16 spans before shape": (LENGTHS, layout_kwargs(LENGTHS[:1].short(), (2, 9), 4)),
    "batch mismatch": (LENGTHS, layout_kwargs(None, (3, 9), 4)),
    "span shape mismatch": (LENGTHS, layout_kwargs(LENGTHS[:, :2], (2, 9), 4)),
    "three-dimensional lengths": (LENGTHS.unsqueeze(0), layout_kwargs(None, (1, 9), 4)),
    "scalar lengths": (torch.tensor(3), layout_kwargs(None, (1, 9), 4)),
    "one-dimensional lengths for batch two": (LENGTHS[0], layout_kwargs(None, (2, 9), 4)),
    "one-dimensional spans for batch one": (LENGTHS[:1], layout_kwargs(LENGTHS[0] + 1, (1, 12), 4)),
    "numpy integers": (LENGTHS[1:].abs(), layout_kwargs(None, (1, 9), numpy.int64(4), numpy.int32(13))),
    "zero numpy alignment": (LENGTHS, layout_kwargs(None, (2, 9), numpy.int64(0))),
}


@pytest.mark.parametrize("name", sorted(ARGUMENT_ERRORS))
def test_packed_layout_argument_errors_match_upstream(name):
    seq_lens, kwargs = ARGUMENT_ERRORS[name]
    try:
        expected = upstream.packed_layout(seq_lens, **kwargs)
    except ValueError as error:
        with pytest.raises(ValueError, match=re.escape(str(error))):
            packed_layout(seq_lens, **kwargs)
    else:
        assert_layouts_equal(packed_layout(seq_lens, **kwargs), expected)


def test_packed_layout_without_documents_or_columns_matches_upstream():
    for seq_lens, shape, minimum_length in (
        (torch.zeros(3, 0, dtype=torch.int64), (3, 5), 0),
        (torch.zeros(2, 4, dtype=torch.int32), (2, 0), 9),
        (torch.full((1, 2), -1000), (1, 0), -4),
    ):
        kwargs = layout_kwargs(None, shape, 8, minimum_length)
        assert_layouts_equal(packed_layout(seq_lens, **kwargs), upstream.packed_layout(seq_lens, **kwargs))


def test_layouts_of_an_empty_batch_match_upstream():
    seq_lens = torch.zeros(0, 3, dtype=torch.int64)
    kwargs = {"seq_lens_padded": None, "input_shape": (0, 5), "alignment": 2}
    assert_same(
        layout_fields(packed_layout(seq_lens, **kwargs)), layout_fields(upstream.packed_layout(seq_lens, **kwargs))
    )


def test_documented_example():
    layout = packed_layout(
        torch.tensor([[3, 0, 5]]), seq_lens_padded=torch.tensor([[4, 0, 5]]), input_shape=(1, 9), alignment=4
    )
    assert layout.source_indices.tolist() == [[0, 1, 2, -1, 4, 5, 6, 7, 8, -1, -1, -1]]
    assert layout.position_ids.tolist() == [[0, 1, 2, 0, 0, 1, 2, 3, 4, 0, 0, 0]]
    assert layout.sequence_ids.tolist() == [[1, 1, 1, 0, 3, 3, 3, 3, 3, 0, 0, 0]]
    assert layout.input_positions.tolist() == [[0, 1, 2, -1, 4, 5, 6, 7, 8]]
    assert layout.pack(torch.arange(9)[None], fill=-7).tolist() == [[0, 1, 2, -7, 4, 5, 6, 7, 8, -7, -7, -7]]


@pytest.mark.parametrize("exact", [True, False], ids=["exact_cpu_path", "static_path"])
@pytest.mark.parametrize("lengths", [[[1, 2**63 - 1]], [[2**62, 2**62]], [[3, 2**63 - 2]]])
def test_layout_lengths_near_int64s_limit_raise_upstreams_error(exact, lengths):
    """Running sums of such spans wrapped int64 and hid the broken row; the tables are clamped past the row."""
    lengths = torch.tensor(lengths)
    kwargs = {"seq_lens_padded": None, "input_shape": (1, 8), "alignment": 1}
    with pytest.raises(ValueError) as theirs:
        upstream.packed_layout(lengths, **kwargs)
    with exact_cpu_path(exact), pytest.raises(ValueError) as ours:
        packed_layout(lengths, **kwargs)
    assert str(ours.value) == str(theirs.value)
    assert layout_ops.aligned_layout_op(lengths, lengths, 8, 1, 8).broken.any()


@pytest.mark.parametrize(("alignment", "minimum_length"), [(2**62, 0), (2**63 - 1, 0), (4, 2**63 - 3)])
def test_an_alignment_or_minimum_length_whose_rows_pass_int64_is_named(alignment, minimum_length):
    """Upstream fails inside torch.full (an overflow, or an allocation); the aligned spans would wrap int64."""
    kwargs = {"seq_lens_padded": None, "input_shape": (1, 4), "alignment": alignment, "minimum_length": minimum_length}
    with pytest.raises(ValueError, match=f"alignment={alignment} and minimum_length={minimum_length} allow rows of"):
        packed_layout(torch.tensor([[2, 2]]), **kwargs)
    assert packed_layout(
        torch.tensor([[2, 2]]), **{**kwargs, "alignment": 2**20, "minimum_length": 0}
    ).position_ids.shape == (1, 2**21)


# ---------------------------------------------------------------- pack and restore


@HYPOTHESIS
@given(
    inputs=layout_inputs(absent=UPSTREAM_ABSENT),
    dtype=st.sampled_from(VALUE_DTYPES),
    trailing=st.sampled_from([(), (3,), (2, 3)]),
    fill=st.sampled_from([0, 1, -2.5, True]),
)
def test_pack_and_restore_match_upstream(inputs, dtype, trailing, fill):
    batch, sequence = inputs.input_shape
    expected = upstream.packed_layout(inputs.seq_lens, **inputs.kwargs())
    layout = packed_layout(inputs.seq_lens, **inputs.kwargs())
    if dtype == torch.bool:
        fill = bool(fill)  # -2 is no bool: a fill the dtype cannot hold is refused (tests/core/test_edge_inputs.py)
    elif not dtype.is_floating_point and isinstance(fill, float):
        fill = int(fill)
    if sequence > 0:  # upstream cannot gather from an empty row
        values = random_values((batch, sequence, *trailing), dtype)
        packed = layout.pack(values, fill=fill)
        assert packed.dtype == dtype and torch.equal(packed, expected.pack(values, fill=fill))
        real = layout.input_positions >= 0
        assert torch.equal(layout.restore(packed)[real], values[real])
    aligned = random_values((batch, layout.source_indices.shape[1], *trailing), dtype, seed=1)
    restored = layout.restore(aligned)
    assert restored.dtype == dtype and torch.equal(restored, expected.restore(aligned))


def test_packed_layout_is_the_aligned_layout_at_its_row_length():
    """The layout tests/core/test_layout.py builds with aligned_layout (its SMALL) is packed_layout's.

    Upstream's -1000 (absent) is the core's 0, in lengths and in an absent slot's span.
    """
    spans = torch.tensor([[4, 0, 5], [2, 3, -1000]])
    drop_in = packed_layout(LENGTHS, seq_lens_padded=spans, input_shape=(2, 10), alignment=4)
    static = aligned_layout(*core_tables(LENGTHS, spans), sequence_length=10, alignment=4, budget=12)
    assert_layouts_equal(drop_in, static)


def test_pack_restore_and_layouts_do_not_mutate_inputs():
    seq_lens, spans = torch.tensor([[3, 0, 5]], dtype=torch.int32), torch.tensor([[4, 0, 5]])
    copies = (seq_lens.clone(), spans.clone())
    layout = packed_layout(seq_lens, seq_lens_padded=spans, input_shape=(1, 9), alignment=4)
    aligned_layout(seq_lens, spans, sequence_length=9, alignment=4, budget=16)
    fields = [getattr(layout, name).clone() for name in LAYOUT_FIELDS]
    values = torch.randn(1, 9, 2)
    aligned = torch.randn(1, 12, 2)
    value_copies = (values.clone(), aligned.clone())
    layout.pack(values, fill=3)
    layout.restore(aligned)
    assert torch.equal(seq_lens, copies[0]) and torch.equal(spans, copies[1])
    assert all(torch.equal(getattr(layout, name), field) for name, field in zip(LAYOUT_FIELDS, fields, strict=True))
    assert torch.equal(values, value_copies[0]) and torch.equal(aligned, value_copies[1])


# ---------------------------------------------------------------- compile and export

STATIC_LENGTHS = (torch.tensor([[3, 0, 5], [2, 2, -1000]]), torch.tensor([[4, 0, 5], [2, 3, -1000]]))


def random_tables(seed: int, batch: int = 2, documents: int = 3, sequence: int = 12):
    """Length tables of one shape with different contents (absent slots and inner padding included)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 4, (batch, documents), generator=generator)
    absent = torch.rand(batch, documents, generator=generator) < 0.25
    lengths = torch.where(absent, torch.tensor(-1000) * (torch.rand(batch, documents) < 0.5), lengths)
    spans = torch.where(absent, lengths, lengths + torch.randint(0, 2, (batch, documents), generator=generator))
    assert int(spans.clamp_min(0).sum(1).max()) <= sequence
    return lengths, spans


def core_tables(seq_lens, seq_lens_padded):
    """Upstream's tables as the core takes them: -1000 (absent) is 0."""
    return seq_lens.masked_fill(seq_lens == -1000, 0), seq_lens_padded.masked_fill(seq_lens_padded == -1000, 0)


def layout_step(seq_lens, seq_lens_padded, values):
    """The static layout and the drop-in layout, each packing and restoring ``values``."""
    core = core_tables(seq_lens, seq_lens_padded)
    static = aligned_layout(*core, sequence_length=12, alignment=4, budget=safe_budget(12, 3, 4))
    drop_in = packed_layout(seq_lens, seq_lens_padded=seq_lens_padded, input_shape=(2, 12), alignment=4)
    outputs = []
    for layout, fill in ((static, -1.0), (drop_in, 2)):
        packed = layout.pack(values, fill=fill)
        outputs += [*layout_fields(layout), packed, layout.restore(packed * 2)]
    return outputs


def layout_loss(outputs):
    """A loss that reaches every packed and restored tensor (one weight per layout)."""
    return outputs[4].sum() + (outputs[5] ** 2).sum() + 3 * outputs[10].sum() + (outputs[11] ** 3).sum()


compiled_step = torch.compile(layout_step, fullgraph=True)


def test_compiled_forward_and_backward_are_fused_gathers(no_graph_breaks):
    values = torch.randn(2, 12, 3, requires_grad=True)

    def step(values):
        outputs = compiled_step(*STATIC_LENGTHS, values)
        layout_loss(outputs).backward()
        return outputs

    outputs, code = run_and_get_code(step, values)
    compiled_grad, values.grad = values.grad, None
    expected = layout_step(*STATIC_LENGTHS, values)
    layout_loss(expected).backward()
    assert_all_equal([output.detach() for output in outputs], [output.detach() for output in expected])
    torch.testing.assert_close(compiled_grad, values.grad)
    assert len(code) == 2  # one forward and one backward graph
    generated = "\n".join(code)
    assert "packfn" not in generated
    for forbidden in ("scatter", "atomic_add", "index_put"):
        assert forbidden not in generated


def test_compiled_layouts_do_not_recompile_across_contents(no_graph_breaks):
    values = torch.randn(2, 12, 3, requires_grad=True)
    compiled_step(*random_tables(100), values)
    widths = set()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed in range(20):
            tables = random_tables(seed)
            outputs = compiled_step(*tables, values)
            widths.add(outputs[6].shape[1])
            assert_all_equal(outputs, layout_step(*tables, values))
    assert len(widths) > 1  # the drop-in's row length really varied without a recompile


class AlignedMixer(torch.nn.Module):
    """Projects tokens in aligned rows (static layout) and in drop-in rows, then restores both."""

    def __init__(self, hidden: int = 4):
        super().__init__()
        self.proj = torch.nn.Linear(hidden, hidden)

    def forward(self, values, seq_lens, seq_lens_padded):
        static = aligned_layout(*core_tables(seq_lens, seq_lens_padded), sequence_length=12, alignment=4, budget=16)
        drop_in = packed_layout(seq_lens, seq_lens_padded=seq_lens_padded, input_shape=(2, 12), alignment=4)
        mixed = static.restore(self.proj(static.pack(values)))
        return mixed + drop_in.restore(self.proj(drop_in.pack(values, fill=1))), static.position_ids


def test_export_keeps_packfn_nodes_and_decomposes_to_aten():
    torch.manual_seed(0)
    module = AlignedMixer()
    values = torch.randn(2, 12, 4)
    exported = torch.export.export(module, (values, *STATIC_LENGTHS))
    targets = {str(node.target) for node in exported.graph.nodes if node.op == "call_function"}
    assert {"packfn.aligned_layout.default", "packfn.pack.default", "packfn.restore.default"} <= targets
    decomposed = exported.run_decompositions()
    assert not any("packfn" in str(node.target) for node in decomposed.graph.nodes)
    for seed in range(3):
        tables = random_tables(seed)
        expected = module(values, *tables)
        for program in (exported, decomposed):
            assert_all_equal(program.module()(values, *tables), expected)


class PackedRoundTrip(torch.nn.Module):
    def forward(self, lens, values):
        layout = packed_layout(lens, seq_lens_padded=None, input_shape=values.shape[:2], alignment=4)
        packed = layout.pack(values, fill=-1)
        return (*layout_fields(layout), packed, layout.restore(packed))


def test_export_packed_layout_with_dynamic_sequence_runs_at_other_lengths():
    module = PackedRoundTrip()
    exported = export_dynamic(module, round_trip_inputs(32, (3,), -1000), (None, {1: Dim("S", min=16, max=4096)}))
    for sequence in (20, 40, 3000):
        inputs = round_trip_inputs(sequence, (3,), -1000)
        assert_same(tuple(exported(*inputs)), module(*inputs))


# Issue 8, case 1: a compiled packed_layout backward (Inductor).


def _round_trip_loss(lens: torch.Tensor, x: torch.Tensor, fill: float) -> torch.Tensor:
    layout = packed_layout(lens, seq_lens_padded=None, input_shape=tuple(x.shape[:2]), alignment=4)
    weights = torch.arange(x.numel(), dtype=x.dtype).reshape(x.shape)  # a gradient that differs per element
    return (layout.restore(layout.pack(x, fill=fill)) * weights).sum()


def _round_trip_losses(lens_a, x_a, lens_b, x_b):
    return _round_trip_loss(lens_a, x_a, 0.0) + _round_trip_loss(lens_b, x_b, 7.0)


def test_compiled_packed_layout_backward_at_batch_above_one():
    # Rows shorter than the bound (8 and 12 columns): the layout is trimmed to an unbacked width,
    # which Inductor once saved for the backward with other strides than it planned for.
    generator = torch.Generator().manual_seed(0)
    inputs = (
        torch.tensor([[4], [4]]),
        torch.randn(2, 8, generator=generator, requires_grad=True),
        torch.tensor([[3, 2], [1, 0], [5, -1000]]),  # batch 3, trailing dims, fill 7
        torch.randn(3, 9, 2, generator=generator, requires_grad=True),
    )
    eager_loss = _round_trip_losses(*inputs)
    eager_grads = torch.autograd.grad(eager_loss, inputs[1::2])
    compiled_loss = torch.compile(_round_trip_losses, fullgraph=True)(*inputs)
    compiled_grads = torch.autograd.grad(compiled_loss, inputs[1::2])
    torch.testing.assert_close(compiled_loss, eager_loss)
    for compiled_grad, eager_grad in zip(compiled_grads, eager_grads, strict=True):
        assert torch.equal(compiled_grad, eager_grad)


def _packed_layout_fields(lens, values, minimum_length):
    layout = packed_layout(
        lens, seq_lens_padded=None, input_shape=values.shape[:2], alignment=4, minimum_length=minimum_length
    )
    return layout_fields(layout)


@pytest.mark.parametrize("minimum_length", [16, 18, 20])
def test_traced_packed_layout_honours_minimum_length(minimum_length):
    lens, values = torch.tensor([[3, 2], [1, 0]]), torch.zeros(2, 6)  # the rows need 8 columns
    expected = layout_fields(
        upstream.packed_layout(
            lens, seq_lens_padded=None, input_shape=(2, 6), alignment=4, minimum_length=minimum_length
        )
    )
    assert expected[0].shape[1] == -(-minimum_length // 4) * 4
    function = functools.partial(_packed_layout_fields, minimum_length=minimum_length)
    assert_same(_packed_layout_fields(lens, values, minimum_length), expected)
    assert_same(traced(function)(lens, values), expected)
    assert_same(tuple(torch.export.export(Fn(function), (lens, values)).module()(lens, values)), expected)
