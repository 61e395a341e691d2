"""The hand-written fakes, and the private hook that keeps them out of tracing.

Every tracer (FakeTensor propagation, opcheck, torch.compile, torch.export)
runs a packfn op's decomposition, not its fake (NOTE [One body, three roles]
in ``packfn/_ops/_registry.py``), so nothing else checks the fakes. Here each
op runs on the same inputs on the ``meta`` device, which dispatches to the
fake, and on the CPU through its kernel and through its decomposition:
shapes, dtypes and strides must agree. ``_sizes``, whose fake needs a
ShapeEnv, runs its fake under FakeTensorMode.

The hook section checks that the decompositions still replace the ops where
packfn relies on it (``run_decompositions()`` and AOTAutograd).
"""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch._C import DispatchKey
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv, free_unbacked_symbols

import packfn
import packfn.nemo_automodel
from packfn._ops import layout as layout_ops
from packfn._ops import metadata as metadata_ops

from tests.strategies import EXAMPLE
from tests.strategies_formats import op_samples
from tests.strategies_layout import random_values

NAMESPACE = "packfn"


def registered_ops() -> list[str]:
    """Names of every op in the packfn namespace (from the dispatcher, so a new op shows up here)."""
    names = {
        name.split("::", 1)[1].split(".", 1)[0]
        for name in torch._C._dispatch_get_all_op_names()
        if name.startswith(f"{NAMESPACE}::")
    }
    assert names, "no packfn op is registered"
    return sorted(names)


# ---------------------------------------------------------------- samples


def _random_mask(batch: int, sequence: int, documents: int, seed: int) -> torch.Tensor:
    """Rows of up to ``documents`` ids, never decreasing, with padding inside and at the end."""
    generator = torch.Generator().manual_seed(seed)
    cuts = torch.rand(batch, sequence, generator=generator) < documents / sequence
    ids = cuts.cumsum(1).clamp(1, documents)
    keep = torch.rand(batch, sequence, generator=generator) > 0.2
    return ids * keep


LONG = _random_mask(3, 300, 40, seed=0)  # more than _SEARCH_MAX_DOCUMENTS slots take the scatter path
MASKS = {
    "int64": EXAMPLE,
    "int32": EXAMPLE.int(),
    "uint8": EXAMPLE.to(torch.uint8),
    "bool": EXAMPLE > 0,
    "all_padding": torch.zeros(1, 1, dtype=torch.int64),
    "one_row": torch.tensor([[0, 3, 3, 0, 7]], dtype=torch.int32),
    "long": LONG,
}


def _metadata_samples():
    for name, mask in MASKS.items():
        sequence = mask.shape[1]
        for documents in sorted({1, 2, sequence, sequence + 3, 257}):
            yield f"{name}-D{documents}", (mask, documents)


def _flatten_samples():
    for name, mask in MASKS.items():
        for documents in (1, 3, mask.shape[1]):
            indices, cu_seqlens = metadata_ops.batch_metadata_op(mask, documents)[:2]
            yield f"{name}-D{documents}-int32", (indices, cu_seqlens)
            yield f"{name}-D{documents}-int64", (indices, cu_seqlens.long())
    yield "int32-indices", (EXAMPLE.int(), torch.tensor([[0, 2, 5], [0, 4, -1]]))


def _layout_tables():
    lengths, spans = torch.tensor([[3, 0, 5], [2, 2, 0]]), torch.tensor([[4, 0, 5], [2, 3, 0]])
    yield "int64", (lengths, spans, 10, 4, 16)
    yield "int32-lengths", (lengths.int(), lengths, 9, 1, 12)
    yield "int32-both", (lengths.int(), spans.int(), 12, 8, 64)
    yield "no-documents", (torch.zeros(2, 0, dtype=torch.int64),) * 2 + (5, 8, 8)
    yield "no-columns", (torch.zeros(1, 2, dtype=torch.int64),) * 2 + (0, 4, 4)
    yield "one-row", (torch.tensor([[7]]), torch.tensor([[7]]), 7, 128, 256)


VALUE_CASES = [
    (torch.float32, ()),
    (torch.float32, (2, 3)),
    (torch.bfloat16, (3,)),
    (torch.float64, (1,)),
    (torch.int64, (4,)),
    (torch.int32, ()),
    (torch.bool, (2,)),
]


def _pack_samples(restore: bool):
    tables = layout_ops.aligned_layout_op(*next(_layout_tables())[1])
    source_indices, input_positions = tables[0], tables[3]
    for dtype, trailing in VALUE_CASES:
        name = f"{dtype}-{trailing}"
        if restore:
            values = random_values((2, source_indices.shape[1], *trailing), dtype)
            yield name, (values, input_positions, source_indices)
        else:
            values = random_values((2, input_positions.shape[1], *trailing), dtype)
            yield name, (values, source_indices, input_positions, -1.5 if dtype.is_floating_point else 1.0)
    # A non-contiguous input (the sequence axis last in memory).
    width = source_indices.shape[1] if restore else input_positions.shape[1]
    strided = random_values((2, 3, width), torch.float32).transpose(1, 2)
    if restore:
        yield "transposed", (strided, input_positions, source_indices)
    else:
        yield "transposed", (strided, source_indices, input_positions, 0.0)


def _varlen(mask, documents=None):
    return metadata_ops.varlen_metadata_op(mask, mask.shape[1] if documents is None else documents)


def _unpad_samples():
    for mask_name in ("int64", "bool", "all_padding", "long"):
        mask = MASKS[mask_name]
        metadata = _varlen(mask)
        for dtype, trailing in VALUE_CASES:
            values = random_values((*mask.shape, *trailing), dtype)
            yield f"{mask_name}-{dtype}-{trailing}", (values, metadata.indices, metadata.num_tokens)
    metadata = _varlen(EXAMPLE)
    strided = random_values((2, 3, 6), torch.float32).transpose(1, 2)
    yield "transposed", (strided, metadata.indices, metadata.num_tokens)


def _pad_samples():
    for mask_name in ("int64", "bool", "all_padding", "long"):
        mask = MASKS[mask_name]
        metadata = _varlen(mask)
        for dtype, trailing in VALUE_CASES:
            values = random_values((mask.numel(), *trailing), dtype)
            yield f"{mask_name}-{dtype}-{trailing}", (values, metadata.indices, metadata.num_tokens, mask.shape[1])
    metadata = _varlen(EXAMPLE)
    strided = random_values((3, 12), torch.float32).t()
    yield "transposed", (strided, metadata.indices, metadata.num_tokens, 6)


def _document_ids_samples():
    for name, mask in MASKS.items():
        yield name, (mask,)
    yield "negative-ids", (torch.tensor([[1, -1, -1, 0], [3, 3, 2, 0]]),)


def _checked_document_ids_samples():
    """As :func:`_document_ids_samples`, for the mask ops that take ``check`` (NOTE [Check once])."""
    for name, (mask,) in _document_ids_samples():
        yield f"{name}-checked", (mask, True)
    yield "int64-unchecked", (EXAMPLE, False)


def _kv_block_samples():
    for name, mask in MASKS.items():
        for block_size, window, separate in ((1, None, True), (4, 2, False), (7, 3, True), (128, None, False)):
            yield f"{name}-b{block_size}-w{window}-{separate}", (mask, block_size, window, separate, None, True)
        positions = torch.arange(mask.shape[1]).expand(mask.shape).contiguous()
        yield f"{name}-b4-w2-positions", (mask, 4, 2, True, positions, True)
    yield "int64-b4-unchecked", (EXAMPLE, 4, None, True, None, False)


SAMPLES = {
    "varlen_metadata": _metadata_samples,
    "batch_metadata": _metadata_samples,
    "flatten_metadata": _flatten_samples,
    "aligned_layout": _layout_tables,
    "pack": lambda: _pack_samples(restore=False),
    "restore": lambda: _pack_samples(restore=True),
    "block_causal_mask": _checked_document_ids_samples,
    "physical_varlen_metadata": _document_ids_samples,
    "position_ids": _document_ids_samples,
    "document_positions": _document_ids_samples,
    "document_block_tables": _kv_block_samples,
    "unpad": _unpad_samples,
    "pad": _pad_samples,
}
"""Sample inputs per op whose fake runs on the ``meta`` device. ``_sizes`` (its fake needs a ShapeEnv) is below."""


def _format_samples(op_name: str):
    """The format ops' samples (tests/strategies_formats.py), for the fake checks here."""
    return lambda: ((str(index), args) for index, (name, args) in enumerate(op_samples()) if name == op_name)


SAMPLES.update(
    {name: _format_samples(name) for name in dict.fromkeys(name for name, _ in op_samples()) if name not in SAMPLES}
)

SHAPE_ENV_FAKES = {"_sizes"}


# ---------------------------------------------------------------- fake against eager


def _to_meta(value):
    if isinstance(value, torch.Tensor):
        # Keep the strides: a non-contiguous sample stays non-contiguous on meta.
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    return value


def _significant_strides(tensor: torch.Tensor) -> tuple[tuple[int, int], ...]:
    """``(dim, stride)`` of each dimension whose stride matters (size above 1, and any element at all)."""
    if tensor.numel() == 0:
        return ()
    return tuple(
        (dim, stride) for dim, (size, stride) in enumerate(zip(tensor.shape, tensor.stride(), strict=True)) if size > 1
    )


def assert_matches_fake(name: str, eager, fake) -> None:
    eager = eager if isinstance(eager, tuple) else (eager,)
    fake = fake if isinstance(fake, tuple) else (fake,)
    assert len(fake) == len(eager), f"{name}: the fake returns {len(fake)} outputs, the kernel {len(eager)}"
    for index, (real, meta) in enumerate(zip(eager, fake, strict=True)):
        where = f"{name}, output {index}"
        assert meta.device.type == "meta", where
        assert meta.dtype == real.dtype, f"{where}: fake dtype {meta.dtype}, kernel dtype {real.dtype}"
        assert meta.shape == real.shape, f"{where}: fake shape {tuple(meta.shape)}, kernel shape {tuple(real.shape)}"
        assert meta.is_contiguous() == real.is_contiguous(), (
            f"{where}: fake contiguous={meta.is_contiguous()}, kernel contiguous={real.is_contiguous()}"
        )
        assert _significant_strides(meta) == _significant_strides(real), (
            f"{where}: fake strides {meta.stride()}, kernel strides {real.stride()} (shape {tuple(real.shape)})"
        )
        if real.numel():
            assert meta.storage_offset() == real.storage_offset(), f"{where}: storage offsets differ"


def _cases():
    for op_name, samples in SAMPLES.items():
        for sample_name, args in samples():
            yield pytest.param(op_name, args, id=f"{op_name}-{sample_name}")


@pytest.mark.parametrize("op_name", registered_ops())
def test_every_op_has_fake_samples(op_name):
    """A new op must get samples here (a fake nothing runs is a fake nothing checks)."""
    assert op_name in SAMPLES or op_name in SHAPE_ENV_FAKES, (
        f"packfn::{op_name} has no sample in tests/core/test_fakes.py: "
        "add inputs to SAMPLES so that its fake is checked"
    )
    if op_name in SAMPLES:
        assert len(list(SAMPLES[op_name]())) >= 3, f"give packfn::{op_name} several samples"


def test_samples_name_registered_ops():
    assert set(SAMPLES) | SHAPE_ENV_FAKES <= set(registered_ops())


@pytest.mark.parametrize(("op_name", "args"), list(_cases()))
def test_fake_matches_eager_kernel(op_name, args):
    op = getattr(torch.ops.packfn, op_name).default
    fake = op(*(_to_meta(arg) for arg in args))
    # The op's kernel (what eager runs), then its decomposition (what every tracer runs) on the same inputs.
    assert_matches_fake(f"packfn::{op_name} (kernel)", op(*args), fake)
    decomposed = op.decompose(*args)
    assert decomposed is not NotImplemented, HOOK_BROKEN.format(f"packfn::{op_name} has no decomposition")
    assert_matches_fake(f"packfn::{op_name} (decomposition)", decomposed, fake)


@pytest.mark.parametrize(
    ("values", "bounds"),
    [
        (torch.tensor([3, 0, 5]), [4, 4, 9]),
        (torch.tensor([7]), [7]),
        (torch.tensor([0, 1], dtype=torch.int32), [0, 1]),
        (torch.tensor([], dtype=torch.int64), []),
    ],
    ids=["three", "one", "int32", "none"],
)
def test_sizes_fake_gives_bounded_unbacked_sizes(values, bounds):
    """``_sizes``'s fake, run by FakeTensorMode itself (its decomposition set aside), against the kernel."""
    op = torch.ops.packfn._sizes.default
    eager = op(values, bounds)
    assert eager.shape == (*values.tolist(), 0) and eager.dtype == values.dtype
    shape_env = ShapeEnv()
    with FakeTensorMode(shape_env=shape_env) as mode:
        fake_values = mode.from_tensor(values)
        # FakeTensorMode prefers an op's CompositeImplicitAutograd kernel over its fake; without it the
        # registered fake runs, with a real ShapeEnv (which ``new_dynamic_size`` needs).
        kernels = dict(op.py_kernels)
        kernels.pop(DispatchKey.CompositeImplicitAutograd, None)
        with mock.patch.object(op, "py_kernels", kernels):
            fake = op(fake_values, bounds)
    assert fake.dtype == eager.dtype, f"fake dtype {fake.dtype}, kernel dtype {eager.dtype}"
    assert fake.ndim == eager.ndim and fake.shape[-1] == 0, f"fake shape {fake.shape}, kernel shape {eager.shape}"
    assert fake.is_contiguous()
    for size, bound in zip(fake.shape[:-1], bounds, strict=True):
        assert isinstance(size, torch.SymInt) and free_unbacked_symbols(size), f"{size} is not an unbacked size"
        ranges = shape_env.var_to_range[size.node.expr]
        assert (int(ranges.lower), int(ranges.upper)) == (0, bound), f"{size} ranges over {ranges}, not [0, {bound}]"


def _decomposition_graph(op_name: str, args: tuple) -> torch.fx.Graph:
    """The op's decomposition, traced to aten."""
    op = getattr(torch.ops.packfn, op_name).default
    return make_fx(lambda *args: op.decompose(*args))(*args).graph


@pytest.mark.parametrize(("op_name", "args"), list(_cases()))
def test_decomposition_searches_and_sums_compile_for_triton(op_name, args):
    """What Inductor's Triton lowering compiles, at every length, on torch 2.11 too.

    NOTE [One flat search]: a ``searchsorted`` over a sequence of rows fails in
    a 2-D tiled kernel, and one over a view of a computed tensor fails the
    lowering's stride read ("NotImplementedError: View"). NOTE [Scans that
    never split]: a ``cumsum`` along the rows of a 2-D tensor becomes a split
    scan past 8192 columns, which torch 2.11 cannot write.
    """
    for node in _decomposition_graph(op_name, args).nodes:
        if node.target == torch.ops.aten.searchsorted.Tensor:
            sequence = node.args[0]
            dims = sequence.meta["val"].dim()
            assert dims == 1, f"packfn::{op_name} searches a sequence of {dims} dimensions: use search_running_sums"
            view = isinstance(sequence.target, torch._ops.OpOverload) and sequence.target.is_view
            assert not view, f"packfn::{op_name} searches a view ({sequence.target}): compute the sequence in 1-D"
        elif node.target == torch.ops.aten.cumsum.default:
            dims = node.args[0].meta["val"].dim()
            assert dims == 1, f"packfn::{op_name} sums along the rows of a {dims}-D tensor: use running_sum"


@st.composite
def running_searches(draw):
    """``(increments [batch, n], queries [m], right)``: increments never negative, queries up to past every total."""
    batch, n, m = draw(st.integers(0, 5)), draw(st.integers(1, 8)), draw(st.integers(0, 9))
    rows = draw(st.lists(st.lists(st.integers(0, 6), min_size=n, max_size=n), min_size=batch, max_size=batch))
    right = draw(st.booleans())
    queries = draw(st.lists(st.integers(0 if right else 1, 50), min_size=m, max_size=m))
    return torch.tensor(rows, dtype=torch.int64).reshape(batch, n), torch.tensor(queries, dtype=torch.int64), right


@settings(max_examples=300)
@given(search=running_searches())
@example(search=(torch.tensor([[0, 0, 0]]), torch.tensor([1, 2]), False))
@example(search=(torch.tensor([[2, 0], [0, 0], [0, 3]]), torch.tensor([0, 2, 3]), True))
def test_search_running_sums_is_searchsorted_row_by_row(search):
    increments, queries, right = search
    batch, n = increments.shape
    expected = torch.searchsorted(increments.cumsum(1), queries.expand(batch, -1).contiguous(), right=right)
    local = metadata_ops.search_running_sums(increments, queries, right=right) - torch.arange(batch).unsqueeze(1) * n
    inside = expected < n
    assert torch.equal(local[inside], expected[inside]), (increments, queries, local, expected)
    assert bool((local[~inside] >= n).all()), (increments, queries, local, expected)


# ---------------------------------------------------------------- the private hook

HOOK_BROKEN = (
    "the private py_impl(CompositeImplicitAutograd) hook of packfn/_ops/_registry.py no longer decomposes "
    f"packfn ops on this torch release (torch {torch.__version__}): {{}}"
)


class StaticMetadata(torch.nn.Module):
    def forward(self, mask, values):
        metadata = packfn.varlen_metadata(mask, max_documents=4)
        return packfn.unpad(values, metadata), metadata.cu_seqlens


def _packfn_targets(graph: torch.fx.Graph) -> list[str]:
    return sorted({str(node.target) for node in graph.nodes if NAMESPACE in str(node.target)})


def test_hook_is_registered():
    for op_name in registered_ops():
        op = getattr(torch.ops.packfn, op_name).default
        assert DispatchKey.CompositeImplicitAutograd in op.py_kernels, HOOK_BROKEN.format(
            f"packfn::{op_name} has no Python CompositeImplicitAutograd kernel"
        )


def test_hook_decomposes_under_run_decompositions():
    inputs = (EXAMPLE, torch.randn(2, 6, 3))
    exported = torch.export.export(StaticMetadata(), inputs)
    kept = _packfn_targets(exported.graph)
    assert kept == ["packfn.unpad.default", "packfn.varlen_metadata.default"], kept  # export keeps named nodes
    lowered = exported.run_decompositions()
    left = _packfn_targets(lowered.graph)
    assert not left, HOOK_BROKEN.format(f"ExportedProgram.run_decompositions() left {left}")
    for got, want in zip(lowered.module()(*inputs), StaticMetadata()(*inputs), strict=True):
        assert torch.equal(got, want)


def test_hook_decomposes_under_aot_autograd():
    """What Inductor sees: the AOTAutograd forward and backward graphs hold aten ops only."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs: list[torch.fx.GraphModule] = []

    def capture(graph_module, example_inputs):
        graphs.append(graph_module)
        return make_boxed_func(graph_module.forward)

    backend = aot_autograd(fw_compiler=capture, bw_compiler=capture)
    compiled = torch.compile(StaticMetadata(), backend=backend, fullgraph=True)
    values = torch.randn(2, 6, 3, requires_grad=True)
    unpadded, cu_seqlens = compiled(EXAMPLE, values)
    unpadded.sum().backward()
    assert len(graphs) == 2, graphs  # forward and backward
    left = sorted({target for graph in graphs for target in _packfn_targets(graph.graph)})
    assert not left, HOOK_BROKEN.format(f"the AOTAutograd graphs that Inductor compiles call {left}")
    expected = StaticMetadata()(EXAMPLE, values.detach())
    assert torch.equal(unpadded, expected[0]) and torch.equal(cu_seqlens, expected[1])


# ---------------------------------------------------------------- Hypothesis profile


def test_hypothesis_profile_is_loaded():
    """tests/conftest.py loads a profile whose failures are reproducible from a CI log."""
    ci = os.environ.get("CI", "").lower() not in ("", "0", "false", "no")
    for current in (settings.default, settings(max_examples=3)):  # a test-level settings object inherits it
        assert current.print_blob is True
        assert current.deadline is None
        assert current.derandomize is ci
