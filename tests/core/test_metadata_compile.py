"""The static metadata ops under torch.compile, torch.export and opcheck: fused, static, no graph breaks."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code
from torch.export import Dim

import packfn

from tests.assertions import assert_same
from tests.compiling import packfn_nodes
from tests.strategies import document_mask, random_mask
from tests.strategies_layout import layout_fields

CAPACITY = 4  # the most documents random_mask puts in a row


def static_path(mask):
    flat = packfn.varlen_metadata(mask, max_documents=CAPACITY)
    batch = packfn.batch_metadata(mask, max_documents=CAPACITY)
    flattened = packfn.flatten_metadata(batch.packed_token_indices, batch.cu_seqlens)
    return (*flat[:6], *batch[:4], *flattened[:6])


class VarlenProjection(torch.nn.Module):
    """Unpads by the static permutation, projects the real tokens, pads back with zeros."""

    def __init__(self, hidden: int = 8):
        super().__init__()
        self.proj = torch.nn.Linear(hidden, hidden)

    def forward(self, x, mask):
        meta = packfn.varlen_metadata(mask, max_documents=CAPACITY)
        tokens = self.proj(x.flatten(0, 1)[meta.indices])
        real = (torch.arange(tokens.shape[0]) < meta.num_tokens).unsqueeze(1)
        padded = torch.zeros_like(tokens).index_copy(0, meta.indices, torch.where(real, tokens, 0.0))
        return padded.reshape(x.shape), meta.cu_seqlens, meta.max_seqlen


@pytest.fixture(autouse=True)
def fresh_counters():
    counters.clear()
    yield
    assert not counters["graph_break"], dict(counters["graph_break"])


compiled_static = torch.compile(static_path, fullgraph=True)


def test_static_ops_compile_to_fused_code_without_packfn_calls():
    mask = random_mask(3, 16, seed=0)
    result, code = run_and_get_code(compiled_static, mask)
    assert_same(result, static_path(mask))
    assert "packfn" not in "\n".join(code)


def test_static_ops_do_not_recompile_across_contents():
    compiled_static(random_mask(3, 16, seed=100))
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed in range(20):
            mask = random_mask(3, 16, seed=seed)
            assert_same(compiled_static(mask), static_path(mask))


@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8, torch.int32])
def test_static_ops_compile_for_other_mask_dtypes(dtype):
    mask = random_mask(2, 8, seed=3, dtype=dtype)
    compiled = torch.compile(lambda mask: static_path(mask), fullgraph=True)
    assert_same(compiled(mask), static_path(mask))


def default_capacity_path(mask):
    """The default capacity ``D = sequence`` is symbolic under dynamic shapes."""
    flat, batch = packfn.varlen_metadata(mask), packfn.batch_metadata(mask)
    return (*flat[:6], *batch[:4])


@pytest.mark.parametrize("path", [static_path, default_capacity_path])
def test_one_dynamic_compile_serves_several_sequence_lengths(path):
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(lambda mask: path(mask), backend=counter, fullgraph=True, dynamic=True)
    for sequence in (12, 20, 33):
        mask = random_mask(2, sequence, seed=sequence)
        assert_same(compiled(mask), path(mask))
    assert counter.frame_count == 1


def test_changing_capacity_compiles_without_graph_breaks():
    """A capacity that changes between calls becomes a SymInt (automatic dynamic), which messages must survive."""
    compiled = torch.compile(lambda mask, capacity: packfn.varlen_metadata(mask, max_documents=capacity)[:6])
    mask = random_mask(2, 16, seed=1)
    for capacity in (4, 5, 6):
        assert_same(compiled(mask, capacity), packfn.varlen_metadata(mask, max_documents=capacity)[:6])


def test_large_sequence_compiles_to_the_eager_result():
    """Inductor has miscompiled cumsum-then-pad at large sizes before: check 32768 columns."""
    mask = random_mask(2, 32768, seed=7)

    def large(mask):
        flat = packfn.varlen_metadata(mask, max_documents=CAPACITY)
        batch = packfn.batch_metadata(mask, max_documents=CAPACITY)
        return (*flat[:6], *batch[:4])

    assert_same(torch.compile(large, fullgraph=True)(mask), large(mask))


def test_module_using_static_metadata_compiles_and_matches_eager():
    torch.manual_seed(0)
    module = VarlenProjection()
    compiled = torch.compile(module, fullgraph=True)
    for seed in range(3):
        mask = random_mask(3, 16, seed=seed)
        x = torch.randn(3, 16, 8)
        expected, actual = module(x, mask), compiled(x, mask)
        torch.testing.assert_close(actual[0], expected[0])
        assert_same(actual[1:], expected[1:])


class ExportedMetadata(torch.nn.Module):
    def forward(self, mask):
        return static_path(mask)


def test_export_keeps_named_ops_and_decomposes_them():
    program = torch.export.export(ExportedMetadata(), (random_mask(3, 16, seed=0),))
    assert {"packfn.varlen_metadata.default", "packfn.batch_metadata.default"} <= packfn_nodes(program)
    lowered = program.run_decompositions()
    assert packfn_nodes(lowered) == set()
    for seed in (1, 2):
        mask = random_mask(3, 16, seed=seed)
        assert_same(tuple(program.module()(mask)), static_path(mask))
        assert_same(tuple(lowered.module()(mask)), static_path(mask))


MASKS = [
    random_mask(3, 10, seed=1),
    random_mask(2, 7, seed=2, dtype=torch.bool),
    random_mask(1, 5, seed=3, dtype=torch.uint8),
]


@pytest.mark.parametrize("mask", MASKS, ids=["int64", "bool", "uint8"])
def test_opcheck_mask_ops(mask):
    torch.library.opcheck(torch.ops.packfn.varlen_metadata.default, (mask, CAPACITY))
    torch.library.opcheck(torch.ops.packfn.batch_metadata.default, (mask, CAPACITY))
    batch = packfn.batch_metadata(mask, max_documents=CAPACITY)
    torch.library.opcheck(torch.ops.packfn.flatten_metadata.default, (batch.packed_token_indices, batch.cu_seqlens))


# ------------------------------------------------ dynamic shapes across size thresholds


class Block(torch.nn.Module):
    """The README's compiled-forward example."""

    def __init__(self, hidden, max_documents=16):
        super().__init__()
        self.proj = torch.nn.Linear(hidden, hidden)
        self.max_documents = max_documents

    def forward(self, x, document_ids):  # [batch, sequence, hidden], [batch, sequence]
        meta = packfn.varlen_metadata(document_ids, max_documents=self.max_documents)
        tokens = x.flatten(0, 1)[meta.indices]  # valid tokens first, then padding
        tokens = self.proj(tokens)  # a varlen kernel would take meta.cu_seqlens here
        out = torch.zeros_like(tokens).index_copy(0, meta.indices, tokens)
        return out.view_as(x), meta.cu_seqlens, meta.max_seqlen


class Blocks(torch.nn.Module):
    """The README's Block with a real cap (16) and with the default capacity (D = sequence), in one graph."""

    def __init__(self, hidden):
        super().__init__()
        self.capped = Block(hidden, max_documents=16)
        self.default = Block(hidden, max_documents=None)

    def forward(self, x, document_ids):
        return (*self.capped(x, document_ids), *self.default(x, document_ids))


def test_dynamic_compile_is_one_frame_across_sequence_lengths():
    # With the cap 16, the choice between binary search and scatter once flipped at
    # sequence = 32 * (batch * 16 + 1) / batch (between 512 and 1024 at batch 2): a recompile
    # under dynamic=True and a Dim range that export could not keep.
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = Blocks(64)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend=counter)
    for step, sequence in enumerate([8, 256, 512, 1024, 2048]):
        x = torch.randn(2, sequence, 64, generator=torch.Generator().manual_seed(sequence))
        mask = document_mask(2, sequence, seed=sequence)
        with torch._dynamo.config.patch(error_on_recompile=step > 0):
            outputs = compiled(x, mask)
        for index, (actual, expected) in enumerate(zip(outputs, model(x, mask), strict=True)):
            if index % 3 == 0:  # the projected activations
                torch.testing.assert_close(actual, expected)
            else:
                assert_same(actual, expected)
    assert counter.frame_count == 1


class _SearchingOps(torch.nn.Module):
    def forward(self, mask, seq_lens):
        layout = packfn.aligned_layout(seq_lens, sequence_length=mask.shape[1], alignment=2, budget=2 * mask.shape[1])
        return (*packfn.batch_metadata(mask, max_documents=4)[:4], *layout_fields(layout))


def _searching_inputs(batch: int, sequence: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    mask = torch.tensor([[1, 1, 2, 0, 3, 3, 3, 0]] * batch)[:, :sequence]
    return mask, torch.tensor([[2, 1, 3, 0]] * batch)  # 4 slots: no batch size equals it (duck sizing)


def test_no_batch_size_is_special_to_the_searches():
    """One dynamic compile serves batches 3, 2 and 5; export with a batch Dim from 2 runs at 2."""
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(_SearchingOps(), backend=counter, fullgraph=True, dynamic=True)
    for batch in (3, 2, 5):
        assert_same(compiled(*_searching_inputs(batch)), _SearchingOps()(*_searching_inputs(batch)))
    assert counter.frame_count == 1
    batch_dim = Dim("batch", min=2, max=64)
    exported = torch.export.export(
        _SearchingOps(), _searching_inputs(3), dynamic_shapes=({0: batch_dim}, {0: batch_dim})
    ).run_decompositions()
    for batch in (2, 4):
        assert_same(exported.module()(*_searching_inputs(batch)), _SearchingOps()(*_searching_inputs(batch)))
