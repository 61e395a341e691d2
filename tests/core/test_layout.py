"""Aligned layouts, pack and restore: parity with nemo_automodel 0.7.0, autograd, opcheck, compile, export."""

from __future__ import annotations

import re
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nemo_automodel.components.models.deepseek_v41 import packing as upstream
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

from packfn._ops import layout as layout_ops
from packfn.layout import aligned_layout, aligned_length, packed_layout
from tests.strategies_layout import ALIGNMENTS, layout_inputs, length_tables, random_values

FIELDS = ("source_indices", "input_positions", "position_ids", "sequence_ids")
VALUE_DTYPES = (torch.float32, torch.bfloat16, torch.int64, torch.bool)
HYPOTHESIS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def assert_layouts_equal(actual, expected):
    for name in FIELDS:
        left, right = getattr(actual, name), getattr(expected, name)
        assert left.dtype == right.dtype and left.device == right.device, name
        assert left.shape == right.shape and torch.equal(left, right), name


def upstream_outcome(inputs):
    """Upstream's layout, or the message of the ValueError it raises."""
    try:
        return upstream.packed_layout(inputs.seq_lens, **inputs.kwargs())
    except ValueError as error:
        return str(error)


# ---------------------------------------------------------------- parity with upstream


@HYPOTHESIS
@given(inputs=layout_inputs())
def test_packed_layout_matches_upstream(inputs):
    expected = upstream.packed_layout(inputs.seq_lens, **inputs.kwargs())
    assert_layouts_equal(packed_layout(inputs.seq_lens, **inputs.kwargs()), expected)


@HYPOTHESIS
@given(inputs=layout_inputs(broken=True))
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
@given(inputs=layout_inputs(broken=True))
def test_exact_cpu_path_equals_the_static_path(inputs):
    """NOTE [Exact sizes on the CPU] in packfn/metadata.py: the same layouts and the same errors."""
    exact = _outcome(inputs)
    with mock.patch("packfn.layout.exact_on_cpu", lambda *tensors: False):
        static = _outcome(inputs)
    if isinstance(exact, str) or isinstance(static, str):
        assert exact == static
    else:
        assert_layouts_equal(exact, static)
        for name in FIELDS:
            assert getattr(exact, name).is_contiguous(), name


def _kwargs(spans, input_shape, alignment, minimum_length=0):
    return {
        "seq_lens_padded": spans,
        "input_shape": input_shape,
        "alignment": alignment,
        "minimum_length": minimum_length,
    }


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
    lengths, kwargs = torch.tensor([[3, 2], [0, 1]]), _kwargs(torch.tensor(spans), (2, 7), 4)
    with pytest.raises(ValueError) as expected:
        upstream.packed_layout(lengths, **kwargs)
    with pytest.raises(ValueError, match=re.escape(str(expected.value))):
        packed_layout(lengths, **kwargs)


LENGTHS = torch.tensor([[3, 0, 5], [2, 2, -1000]])
ARGUMENT_ERRORS = {
    "zero alignment": (LENGTHS, _kwargs(None, (2, 9), 0)),
    "negative alignment": (LENGTHS, _kwargs(LENGTHS, (2, 9), -3)),
    "float lengths": (LENGTHS.float(), _kwargs(None, (2, 9), 4)),
    "bool lengths": (LENGTHS > 0, _kwargs(None, (2, 9), 4)),
    "int16 lengths": (LENGTHS.short(), _kwargs(None, (2, 9), 4)),
    "float spans": (LENGTHS, _kwargs(LENGTHS.double(), (2, 9), 4)),
    "int16 spans before shape": (LENGTHS, _kwargs(LENGTHS[:1].short(), (2, 9), 4)),
    "batch mismatch": (LENGTHS, _kwargs(None, (3, 9), 4)),
    "span shape mismatch": (LENGTHS, _kwargs(LENGTHS[:, :2], (2, 9), 4)),
    "three-dimensional lengths": (LENGTHS.unsqueeze(0), _kwargs(None, (1, 9), 4)),
    "scalar lengths": (torch.tensor(3), _kwargs(None, (1, 9), 4)),
    "one-dimensional lengths for batch two": (LENGTHS[0], _kwargs(None, (2, 9), 4)),
    "one-dimensional spans for batch one": (LENGTHS[:1], _kwargs(LENGTHS[0] + 1, (1, 12), 4)),
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
        kwargs = _kwargs(None, shape, 8, minimum_length)
        assert_layouts_equal(packed_layout(seq_lens, **kwargs), upstream.packed_layout(seq_lens, **kwargs))


def test_documented_example():
    layout = packed_layout(
        torch.tensor([[3, 0, 5]]), seq_lens_padded=torch.tensor([[4, 0, 5]]), input_shape=(1, 9), alignment=4
    )
    assert layout.source_indices.tolist() == [[0, 1, 2, -1, 4, 5, 6, 7, 8, -1, -1, -1]]
    assert layout.position_ids.tolist() == [[0, 1, 2, 0, 0, 1, 2, 3, 4, 0, 0, 0]]
    assert layout.sequence_ids.tolist() == [[1, 1, 1, 0, 3, 3, 3, 3, 3, 0, 0, 0]]
    assert layout.input_positions.tolist() == [[0, 1, 2, -1, 4, 5, 6, 7, 8]]
    assert layout.pack(torch.arange(9)[None], fill=-7).tolist() == [[0, 1, 2, -7, 4, 5, 6, 7, 8, -7, -7, -7]]
    assert aligned_length(9, 3, 4) == 16


# ---------------------------------------------------------------- the static API


@HYPOTHESIS
@given(inputs=layout_inputs(), extra_blocks=st.integers(0, 2))
def test_aligned_layout_at_aligned_length_is_packed_layout_then_padding(inputs, extra_blocks):
    batch, sequence = inputs.input_shape
    documents = inputs.seq_lens.shape[-1]
    length = aligned_length(sequence, documents, inputs.alignment, inputs.minimum_length)
    length += extra_blocks * inputs.alignment
    static = aligned_layout(
        inputs.seq_lens, inputs.seq_lens_padded, sequence_length=sequence, alignment=inputs.alignment, length=length
    )
    expected = upstream.packed_layout(inputs.seq_lens, **inputs.kwargs())
    width = expected.source_indices.shape[1]
    assert width <= length
    assert torch.equal(static.input_positions, expected.input_positions)
    for name, padding in (("source_indices", -1), ("position_ids", 0), ("sequence_ids", 0)):
        field = getattr(static, name)
        assert field.shape == (batch, length) and field.dtype == torch.int64
        assert torch.equal(field[:, :width], getattr(expected, name))
        assert (field[:, width:] == padding).all()


@HYPOTHESIS
@given(
    sequence=st.integers(0, 300),
    documents=st.integers(0, 12),
    alignment=ALIGNMENTS,
    minimum_length=st.integers(-5, 300),
)
def test_aligned_length_is_reached_by_one_token_documents_and_one_long_one(
    sequence, documents, alignment, minimum_length
):
    bound = aligned_length(sequence, documents, alignment, minimum_length)
    fitting = min(documents, sequence)
    lengths = [1] * max(0, fitting - 1) + ([sequence - fitting + 1] if fitting else [])
    seq_lens = torch.tensor(lengths + [0] * (documents - len(lengths)), dtype=torch.int64).reshape(1, documents)
    kwargs = _kwargs(None, (1, sequence), alignment, minimum_length)
    assert bound == upstream.packed_layout(seq_lens, **kwargs).source_indices.shape[1]
    assert bound % alignment == 0 and bound >= max(minimum_length, 1)


@HYPOTHESIS
@given(tables=length_tables(), alignment=ALIGNMENTS)
def test_aligned_length_fits_every_valid_table(tables, alignment):
    lengths, spans, _ = tables
    seq_lens = torch.tensor(lengths).reshape(len(lengths), -1)
    sequence = max(
        sum(span for span, length in zip(span_row, row, strict=True) if length not in (0, -1000))
        for span_row, row in zip(spans, lengths, strict=True)
    )
    need = int(layout_ops.DocumentTable.build(seq_lens, seq_lens, alignment, sequence).longest())
    assert need <= aligned_length(sequence, seq_lens.shape[1], alignment)


DATA_RULES = {
    "absent document with a span": ([[3, 0]], [[3, 2]], 9, 8, layout_ops.layout_rules(8)[0].message),
    "negative length": ([[3, -2]], [[3, -2]], 9, 8, layout_ops.layout_rules(8)[1].message),
    "span shorter than its length": ([[3, 4]], [[3, 3]], 9, 8, layout_ops.layout_rules(8)[2].message),
    "spans past the input row": ([[3, 4], [1, 0]], [[4, 4], [1, 0]], 7, 8, layout_ops.layout_rules(8)[3].message),
    "documents do not fit length": ([[3, 4], [1, 1]], None, 9, 4, "do not fit length=4"),
}


@pytest.mark.parametrize("name", sorted(DATA_RULES))
def test_aligned_layout_asserts_on_broken_data(name):
    lengths, spans, sequence, length, message = DATA_RULES[name]
    spans = None if spans is None else torch.tensor(spans)
    with pytest.raises(RuntimeError, match=re.escape(message)):
        aligned_layout(torch.tensor(lengths), spans, sequence_length=sequence, alignment=4, length=length)


@pytest.mark.parametrize(
    ("keywords", "error", "message"),
    [
        ({"alignment": 0}, ValueError, "alignment must be positive"),
        ({"alignment": 2.0}, TypeError, "alignment must be an int"),
        ({"length": 6}, ValueError, "must be a multiple of alignment"),
        ({"length": 0}, ValueError, "length must be positive"),
        ({"sequence_length": 9.0}, TypeError, "sequence_length must be an int"),
        ({"seq_lens": LENGTHS.float()}, ValueError, "seq_lens must hold int32 or int64"),
        ({"seq_lens_padded": LENGTHS[:, :2]}, ValueError, "matching [batch, documents] shapes"),
        ({"seq_lens": [3, 4]}, TypeError, "seq_lens must be a torch.Tensor"),
    ],
)
def test_aligned_layout_rejects_bad_arguments(keywords, error, message):
    arguments = {"seq_lens": LENGTHS, "seq_lens_padded": None, "sequence_length": 9, "alignment": 4, "length": 12}
    arguments.update(keywords)
    with pytest.raises(error, match=re.escape(message)):
        aligned_layout(arguments.pop("seq_lens"), arguments.pop("seq_lens_padded"), **arguments)


def test_aligned_length_rejects_bad_arguments():
    with pytest.raises(ValueError, match="must not be negative"):
        aligned_length(-1, 3, 4)
    with pytest.raises(TypeError, match="documents must be an int"):
        aligned_length(8, 3.0, 4)
    with pytest.raises(ValueError, match="alignment must be positive"):
        aligned_length(8, 3, 0)


# ---------------------------------------------------------------- pack and restore


@HYPOTHESIS
@given(
    inputs=layout_inputs(),
    dtype=st.sampled_from(VALUE_DTYPES),
    trailing=st.sampled_from([(), (3,), (2, 3)]),
    fill=st.sampled_from([0, 1, -2.5, True]),
)
def test_pack_and_restore_match_upstream(inputs, dtype, trailing, fill):
    batch, sequence = inputs.input_shape
    expected = upstream.packed_layout(inputs.seq_lens, **inputs.kwargs())
    layout = packed_layout(inputs.seq_lens, **inputs.kwargs())
    if dtype.is_floating_point is False and isinstance(fill, float):
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


SMALL = packed_layout(
    torch.tensor([[3, 0, 5], [2, 2, -1000]]),
    seq_lens_padded=torch.tensor([[4, 0, 5], [2, 3, -1000]]),
    input_shape=(2, 10),
    alignment=4,
)


def test_pack_and_restore_gradients_pass_gradcheck():
    values = torch.randn(2, 10, 3, dtype=torch.float64, requires_grad=True)
    aligned = torch.randn(2, 12, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: SMALL.pack(x, fill=0.5), (values,))
    assert torch.autograd.gradcheck(SMALL.restore, (aligned,))
    assert torch.autograd.gradgradcheck(lambda x: SMALL.pack(x, fill=0.5), (values,))


def test_gradients_reach_real_tokens_only_and_match_upstream():
    upstream_layout = upstream.PackedSequenceLayout(*(getattr(SMALL, name) for name in FIELDS))
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


def test_pack_restore_and_layouts_do_not_mutate_inputs():
    seq_lens, spans = torch.tensor([[3, 0, 5]], dtype=torch.int32), torch.tensor([[4, 0, 5]])
    copies = (seq_lens.clone(), spans.clone())
    layout = packed_layout(seq_lens, seq_lens_padded=spans, input_shape=(1, 9), alignment=4)
    aligned_layout(seq_lens, spans, sequence_length=9, alignment=4, length=16)
    fields = [getattr(layout, name).clone() for name in FIELDS]
    values = torch.randn(1, 9, 2)
    aligned = torch.randn(1, 12, 2)
    value_copies = (values.clone(), aligned.clone())
    layout.pack(values, fill=3)
    layout.restore(aligned)
    assert torch.equal(seq_lens, copies[0]) and torch.equal(spans, copies[1])
    assert all(torch.equal(getattr(layout, name), field) for name, field in zip(FIELDS, fields, strict=True))
    assert torch.equal(values, value_copies[0]) and torch.equal(aligned, value_copies[1])


def test_pack_and_restore_reject_bad_arguments():
    with pytest.raises(ValueError, match=re.escape("values must have shape [batch=2, sequence=10, ...]")):
        SMALL.pack(torch.zeros(2, 12))
    with pytest.raises(ValueError, match=re.escape("values must have shape [batch=2, length=12, ...]")):
        SMALL.restore(torch.zeros(3, 12))
    with pytest.raises(ValueError, match="values must have shape"):
        SMALL.restore(torch.zeros(2))
    with pytest.raises(TypeError, match="fill must be an int or float"):
        SMALL.pack(torch.zeros(2, 10), fill=torch.tensor(1.0))
    with pytest.raises(TypeError, match=re.escape("values must be a torch.Tensor")):
        SMALL.restore([[0.0] * 12] * 2)


# ---------------------------------------------------------------- opcheck


def _op_samples():
    seq_lens, spans = torch.tensor([[3, 0, 5], [2, 2, -1000]]), torch.tensor([[4, 0, 5], [2, 3, -1000]])
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


def layout_step(seq_lens, seq_lens_padded, values):
    """The static layout and the drop-in layout, each packing and restoring ``values``."""
    static = aligned_layout(seq_lens, seq_lens_padded, sequence_length=12, alignment=4, length=aligned_length(12, 3, 4))
    drop_in = packed_layout(seq_lens, seq_lens_padded=seq_lens_padded, input_shape=(2, 12), alignment=4)
    outputs = []
    for layout, fill in ((static, -1.0), (drop_in, 2)):
        packed = layout.pack(values, fill=fill)
        outputs += [*(getattr(layout, name) for name in FIELDS), packed, layout.restore(packed * 2)]
    return outputs


def layout_loss(outputs):
    """A loss that reaches every packed and restored tensor (one weight per layout)."""
    return outputs[4].sum() + (outputs[5] ** 2).sum() + 3 * outputs[10].sum() + (outputs[11] ** 3).sum()


compiled_step = torch.compile(layout_step, fullgraph=True)


def assert_all_equal(actual, expected):
    assert len(actual) == len(expected)
    for left, right in zip(actual, expected, strict=True):
        assert left.dtype == right.dtype and left.shape == right.shape
        torch.testing.assert_close(left, right, rtol=0, atol=0)


@pytest.fixture
def no_graph_breaks():
    counters.clear()
    yield
    assert not counters["graph_break"], dict(counters["graph_break"])


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


def test_one_dynamic_compile_serves_several_sequence_lengths(no_graph_breaks):
    def step(seq_lens, values):
        sequence = values.shape[1]
        length = aligned_length(sequence, seq_lens.shape[1], 4)
        layout = aligned_layout(seq_lens, sequence_length=sequence, alignment=4, length=length)
        return layout.pack(values), layout.input_positions

    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(step, backend=counter, fullgraph=True, dynamic=True)
    for sequence in (9, 14, 23):
        seq_lens = torch.tensor([[2, sequence - 4, 0], [1, 1, 1]])
        values = torch.randn(2, sequence, 2)
        assert_all_equal(compiled(seq_lens, values), step(seq_lens, values))
    assert counter.frame_count == 1


class AlignedMixer(torch.nn.Module):
    """Projects tokens in aligned rows (static layout) and in drop-in rows, then restores both."""

    def __init__(self, hidden: int = 4):
        super().__init__()
        self.proj = torch.nn.Linear(hidden, hidden)

    def forward(self, values, seq_lens, seq_lens_padded):
        static = aligned_layout(seq_lens, seq_lens_padded, sequence_length=12, alignment=4, length=16)
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
