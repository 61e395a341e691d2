"""Mask parsing under torch.compile, torch.export and opcheck: fused, static, no graph breaks."""

from __future__ import annotations

import pytest
import torch
from assertions import assert_same
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

import packfn

CAPACITY = 4


def random_mask(batch: int, sequence: int, seed: int, *, documents: int = CAPACITY, dtype=torch.int64):
    """Rows of up to ``documents`` contiguous documents, random padding at the end and inside."""
    generator = torch.Generator().manual_seed(seed)
    cuts = torch.rand(batch, sequence, generator=generator) < (documents - 1) / sequence
    cuts[:, 0] = False
    ids = (cuts.cumsum(1) + 1).clamp_max(documents)
    keep = torch.rand(batch, sequence, generator=generator) > 0.1
    used = torch.randint(0, sequence + 1, (batch, 1), generator=generator)
    ids = ids * keep * (torch.arange(sequence) < used)
    ids[0, 0] = 1  # at least one valid token
    return (ids > 0) if dtype == torch.bool else ids.to(dtype)


def static_path(mask):
    flat = packfn.varlen_metadata(mask, max_documents=CAPACITY)
    batch = packfn.batch_metadata(mask, max_documents=CAPACITY)
    flattened = packfn.flatten_metadata(batch.packed_token_indices, batch.cu_seqlens)
    return (*flat[:6], *batch[:4], *flattened[:6])


def drop_in_path(mask):
    indices, cu_seqlens, max_seqlen = packfn.get_unpad_data(mask)
    metadata = packfn.build_packed_sequence_metadata(mask)
    flat = packfn.flatten_packed_sequence_metadata(
        metadata["packed_token_indices"],
        metadata["cu_seqlens"],
        batch_size=mask.shape[0],
        sequence_length=mask.shape[1],
    )
    return indices, cu_seqlens, max_seqlen, metadata, flat, packfn.get_seqlens_in_batch(mask)


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
compiled_drop_ins = torch.compile(drop_in_path, fullgraph=True)


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


def test_drop_ins_compile_without_graph_breaks_or_recompiles():
    first = random_mask(3, 16, seed=0)
    result, code = run_and_get_code(compiled_drop_ins, first)
    assert_same(result, drop_in_path(first))
    assert "packfn" not in "\n".join(code)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed in range(1, 21):
            mask = random_mask(3, 16, seed=seed)
            assert_same(compiled_drop_ins(mask), drop_in_path(mask))


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


class ExportedDropIns(torch.nn.Module):
    def forward(self, mask):
        indices, cu_seqlens, max_seqlen = packfn.get_unpad_data(mask)
        return indices, cu_seqlens, max_seqlen


def packfn_nodes(program) -> set[str]:
    return {str(node.target) for node in program.graph.nodes if str(node.target).startswith("packfn.")}


def test_export_keeps_named_ops_and_decomposes_them():
    program = torch.export.export(ExportedMetadata(), (random_mask(3, 16, seed=0),))
    assert {"packfn.varlen_metadata.default", "packfn.batch_metadata.default"} <= packfn_nodes(program)
    lowered = program.run_decompositions()
    assert packfn_nodes(lowered) == set()
    for seed in (1, 2):
        mask = random_mask(3, 16, seed=seed)
        assert_same(tuple(program.module()(mask)), static_path(mask))
        assert_same(tuple(lowered.module()(mask)), static_path(mask))


def test_export_of_drop_ins_has_unbacked_sizes():
    program = torch.export.export(ExportedDropIns(), (random_mask(3, 16, seed=0),))
    assert "packfn._sizes.default" in packfn_nodes(program)
    lowered = program.run_decompositions()
    assert packfn_nodes(lowered) == set()
    for seed in (4, 5):
        mask = random_mask(3, 16, seed=seed)
        expected = packfn.get_unpad_data(mask)
        for candidate in (program, lowered):
            indices, cu_seqlens, max_seqlen = candidate.module()(mask)
            assert torch.equal(indices, expected[0]) and torch.equal(cu_seqlens, expected[1])
            assert int(max_seqlen) == expected[2]


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


def test_opcheck_sizes_op():
    torch.library.opcheck(torch.ops.packfn._sizes.default, (torch.tensor([3, 0, 5]), [4, 4, 9]))
