"""Regression tests for the behaviours issue 8 listed as broken (fixed in 80d66d4).

Each test names the behaviour it pins. The tests of cases 1-8 fail on the
code before the fix (3a96ee9), except
``test_narrow_mask_of_ids_at_most_one_counts_as_bool``, which keeps the new
overflow rule from firing where upstream counts in int64. The last block pins
mutation survivors with deterministic inputs. Shapes are tiny except where a
size must cross a threshold.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import re
import warnings
from unittest import mock

import pytest
import torch
from assertions import assert_same, outcome
from nemo_automodel.components.datasets import packing as upstream
from nemo_automodel.components.models.common.packing import (
    flatten_packed_sequence_metadata as upstream_flatten,
)
from nemo_automodel.components.models.deepseek_v41.packing import packed_layout as upstream_packed_layout
from torch._dynamo.testing import CompileCounterWithBackend
from torch.export import Dim
from torch.nn.attention.flex_attention import create_block_mask

import packfn
from packfn.contract import _DefaultPackedSequenceContract

# ------------------------------------------------------------------ helpers

# Cases 1 and 2 compile with Inductor (an Inductor stride bug; the README's compiled model).
# The others regressed in what Dynamo and AOTAutograd trace (guards, unbacked sizes, the
# checks a drop-in emits while compiling): aot_eager traces the same graphs, decompositions
# and asserts without Inductor's C++ build, which keeps this file fast.
traced = functools.partial(torch.compile, fullgraph=True, backend="aot_eager")


def document_mask(batch: int, sequence: int, *, seed: int, documents: int = 4) -> torch.Tensor:
    """int64 ``[batch, sequence]``: up to ``documents`` contiguous documents per row, then padding."""
    generator = torch.Generator().manual_seed(seed)
    cuts = torch.rand(batch, sequence, generator=generator) < (documents - 1) / sequence
    cuts[:, 0] = False
    ids = (cuts.cumsum(1) + 1).clamp_max(documents)
    used = torch.randint(sequence // 2, sequence + 1, (batch, 1), generator=generator)
    ids = ids * (torch.arange(sequence) < used)
    ids[:, 0] = 1  # every row holds a token
    return ids


def layout_fields(layout: packfn.PackedSequenceLayout) -> tuple[torch.Tensor, ...]:
    return layout.source_indices, layout.input_positions, layout.position_ids, layout.sequence_ids


def export_dynamic(module: torch.nn.Module, args: tuple, dynamic_shapes: tuple) -> torch.nn.Module:
    """``module`` exported with ``dynamic_shapes`` (one entry per positional input), as a callable module."""
    if isinstance(module, Fn):
        dynamic_shapes = {"args": dynamic_shapes}
    return torch.export.export(module, args, dynamic_shapes=dynamic_shapes).module()


class Fn(torch.nn.Module):
    """A module whose forward is ``fn`` (to export plain functions)."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


# ------------------------------------------ 1. compiled packed_layout backward


def _round_trip_loss(lens: torch.Tensor, x: torch.Tensor, fill: float) -> torch.Tensor:
    layout = packfn.packed_layout(lens, seq_lens_padded=None, input_shape=tuple(x.shape[:2]), alignment=4)
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


# ---------------------------------- 2. dynamic shapes across size thresholds


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


def _metadata_everywhere(mask):
    flat = packfn.varlen_metadata(mask, max_documents=16)
    batch = packfn.batch_metadata(mask, max_documents=16)
    flattened = packfn.flatten_metadata(batch.packed_token_indices, batch.cu_seqlens)
    indices, cu_seqlens, max_seqlen = packfn.get_unpad_data(mask)
    metadata = packfn.build_packed_sequence_metadata(mask)
    return (
        *flat[:6],
        *batch[:4],
        *flattened[:6],
        indices,
        cu_seqlens,
        max_seqlen,
        metadata["packed_token_indices"],
        metadata["cu_seqlens"],
        metadata["max_seqlen"],
    )


def test_export_metadata_with_dynamic_sequence_runs_at_other_lengths():
    exported = export_dynamic(
        Fn(_metadata_everywhere), (document_mask(2, 64, seed=0),), ({1: Dim("S", min=16, max=4096)},)
    )
    for sequence in (40, 3000):
        mask = document_mask(2, sequence, seed=sequence)
        assert_same(tuple(exported(mask)), _metadata_everywhere(mask))


# ------------------------------------------- 3. layouts and attention export


class AlignedRoundTrip(torch.nn.Module):
    def forward(self, lens, values):
        sequence = values.shape[1]
        length = packfn.aligned_length(sequence, lens.shape[1], 4)
        layout = packfn.aligned_layout(lens, sequence_length=sequence, alignment=4, length=length)
        packed = layout.pack(values, fill=-1)
        return (*layout_fields(layout), packed, layout.restore(packed))


class PackedRoundTrip(torch.nn.Module):
    def forward(self, lens, values):
        layout = packfn.packed_layout(lens, seq_lens_padded=None, input_shape=values.shape[:2], alignment=4)
        packed = layout.pack(values, fill=-1)
        return (*layout_fields(layout), packed, layout.restore(packed))


def _layout_inputs(sequence: int, trailing: tuple[int, ...]):
    lens = torch.tensor([[3, 5, sequence - 8], [1, -1000, 2]])  # the first row fills the sequence
    values = torch.randn(2, sequence, *trailing, generator=torch.Generator().manual_seed(sequence))
    return lens, values


@pytest.mark.parametrize(
    ("module", "trailing"),
    [(AlignedRoundTrip(), ()), (PackedRoundTrip(), (3,))],
    ids=["aligned_layout", "packed_layout"],
)
def test_export_layout_with_dynamic_sequence_runs_at_other_lengths(module, trailing):
    exported = export_dynamic(module, _layout_inputs(32, trailing), (None, {1: Dim("S", min=16, max=4096)}))
    for sequence in (20, 40, 3000):
        inputs = _layout_inputs(sequence, trailing)
        assert_same(tuple(exported(*inputs)), module(*inputs))


_METADATA_VARLEN = _DefaultPackedSequenceContract("flash_varlen", True)


def _attention_inputs(document_ids):
    # document_block_mask is left out: BlockMask.from_kv_blocks (torch) guards on the
    # number of blocks, so it does not export with a Dim on the sequence.
    inputs = packfn.packed_attention_inputs(document_ids, _METADATA_VARLEN, max_documents=16)
    varlen = packfn.physical_varlen_metadata(document_ids)
    return (
        packfn.block_causal_mask(document_ids),
        *varlen[:3],
        inputs["cu_seq_lens_q"],
        inputs["packed_token_indices"],
        inputs["cu_seqlens"],
    )


def test_export_attention_inputs_with_dynamic_sequence_runs_at_other_lengths():
    exported = export_dynamic(
        Fn(_attention_inputs), (document_mask(2, 64, seed=0),), ({1: Dim("S", min=16, max=4096)},)
    )
    for sequence in (40, 300):
        mask = document_mask(2, sequence, seed=sequence)
        assert_same(tuple(exported(mask)), _attention_inputs(mask))


# ------------------------------ 4. compiled flatten_packed_sequence_metadata


def _flatten(indices, cu_seqlens, batch_size, sequence_length):
    return packfn.flatten_packed_sequence_metadata(
        indices, cu_seqlens, batch_size=batch_size, sequence_length=sequence_length
    )


_compiled_flatten = traced(_flatten)


def _upstream_error(function, *args, **kwargs) -> str:
    with pytest.raises(ValueError) as info:
        function(*args, **kwargs)
    return str(info.value)


@pytest.mark.parametrize(
    ("indices", "cu_seqlens", "batch", "sequence", "message"),
    [
        (
            [0, 1, 2],
            [1, 2, 3],
            1,
            3,
            "Flat packed sequence metadata must start at zero and cover every token index",
        ),
        (
            [[-1, -1, -1]],
            [[0, -1]],
            1,
            3,
            "Each packed sequence metadata row must start at zero, be monotonic, and cover its valid tokens",
        ),
    ],
    ids=["flat_not_from_zero", "batch_major_without_document"],
)
def test_compiled_flatten_packed_sequence_metadata_raises_upstreams_message(
    indices, cu_seqlens, batch, sequence, message
):
    indices, cu_seqlens = torch.tensor(indices), torch.tensor(cu_seqlens, dtype=torch.int32)
    assert _upstream_error(upstream_flatten, indices, cu_seqlens, batch_size=batch, sequence_length=sequence) == message
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        _flatten(indices, cu_seqlens, batch, sequence)
    with pytest.raises(RuntimeError, match=re.escape(message)):
        _compiled_flatten(indices, cu_seqlens, batch, sequence)


# ------------------------------------------------------ 5. narrow mask dtypes

_DROP_INS = ("get_seqlens_in_batch", "get_unpad_data", "build_packed_sequence_metadata")
_compiled_drop_ins = {name: traced(getattr(packfn, name)) for name in _DROP_INS}
_NARROW_SEQUENCE = 310  # one shape for every narrow mask below: one compile per drop-in and dtype


def _narrow_mask(dtype: torch.dtype, length: int, document_id: int = 2) -> torch.Tensor:
    """One row: a 2-token document 1, then ``length`` tokens of ``document_id``, then padding."""
    row = [1, 1] + [document_id] * length
    return torch.tensor([row + [0] * (_NARROW_SEQUENCE - len(row))], dtype=dtype)


def _overflow_message(dtype: torch.dtype) -> str:
    # NOTE [Narrow mask dtypes] in packfn/metadata.py.
    return f"a document of more than {torch.iinfo(dtype).max} tokens does not fit attention_mask's dtype {dtype}"


@pytest.mark.parametrize("name", _DROP_INS)
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8], ids=str)
def test_narrow_mask_document_at_dtype_maximum_is_legal_and_one_more_raises(name, dtype):
    limit = torch.iinfo(dtype).max
    fits = _narrow_mask(dtype, limit)
    expected = getattr(upstream, name)(fits)
    assert_same(getattr(packfn, name)(fits), expected)
    assert_same(_compiled_drop_ins[name](fits), expected)

    overflows = _narrow_mask(dtype, limit + 1)
    with pytest.raises(ValueError, match=f"^{re.escape(_overflow_message(dtype))}"):
        getattr(packfn, name)(overflows)
    with pytest.raises(RuntimeError, match=re.escape(_overflow_message(dtype))):
        _compiled_drop_ins[name](overflows)


@pytest.mark.parametrize("name", ["get_unpad_data", "build_packed_sequence_metadata"])
def test_narrow_mask_of_ids_at_most_one_counts_as_bool(name):
    # Upstream counts a mask of ids at most 1 as bool (in int64): 300 tokens fit.
    mask = _narrow_mask(torch.uint8, 298, document_id=1)
    expected = getattr(upstream, name)(mask)
    assert_same(getattr(packfn, name)(mask), expected)
    assert_same(_compiled_drop_ins[name](mask), expected)


# ------------------------------------------ 6. block mask sentinel collision


@pytest.mark.parametrize("ids", [[[5, 5, 0, 0]], [[7, 7, 0, 0, 0, 0]]], ids=["blocks2", "blocks3"])
def test_document_block_mask_equals_create_block_mask_when_an_id_is_blocks_times_block_size_plus_one(ids):
    document_ids = torch.tensor(ids)
    batch, sequence = document_ids.shape
    assert document_ids.max() == -(-sequence // 2) * 2 + 1
    ours = packfn.document_block_mask(document_ids, block_size=2)
    reference = create_block_mask(
        packfn.document_mask_mod(document_ids), batch, 1, sequence, sequence, device="cpu", BLOCK_SIZE=2
    )
    for field in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        assert_same(getattr(ours, field), getattr(reference, field))


# ------------------------------- 7. packed_attention_inputs(static=False) traced

_EXAMPLE_IDS = torch.tensor([[1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 0, 0]])


@pytest.mark.parametrize("mask_type", ["block_causal", "document_ids", "flash_varlen"])
def test_compiled_exact_attention_inputs_equal_eager_for_metadata_contracts(mask_type):
    contract = _DefaultPackedSequenceContract(mask_type, True)
    compiled = traced(functools.partial(packfn.packed_attention_inputs, contract=contract, static=False))
    assert_same(compiled(_EXAMPLE_IDS), packfn.packed_attention_inputs(_EXAMPLE_IDS, contract, static=False))


@pytest.mark.parametrize("mask_type", ["block_causal", "document_ids", "flash_varlen"])
def test_compiled_exact_attention_inputs_without_metadata_say_use_static(mask_type):
    contract = _DefaultPackedSequenceContract(mask_type, False)
    compiled = traced(functools.partial(packfn.packed_attention_inputs, contract=contract, static=False))
    # Under fullgraph Dynamo wraps the ValueError raised while tracing in
    # Unsupported, whose text quotes it.
    with pytest.raises((ValueError, torch._dynamo.exc.Unsupported), match=r"use static=True under torch\.compile"):
        compiled(_EXAMPLE_IDS)


# ------------------------------------------------------------ 8. clear errors


def test_aligned_layout_negative_sequence_length_raises_value_error():
    with pytest.raises(ValueError, match="sequence_length"):
        packfn.aligned_layout(torch.tensor([[1]]), sequence_length=-1, alignment=4, length=4)


def test_flatten_metadata_without_document_slot_raises_value_error_naming_the_shape():
    with pytest.raises(ValueError, match=re.escape("(2, 1)")):
        packfn.flatten_metadata(torch.tensor([[0, -1], [0, 1]]), torch.tensor([[0], [0]], dtype=torch.int32))


@pytest.mark.parametrize("name", ["get_unpad_data", "build_packed_sequence_metadata"])
def test_compiled_drop_in_on_all_padding_mask_says_at_least_one_valid_token(name):
    with pytest.raises(RuntimeError, match="at least one valid token"):
        _compiled_drop_ins[name](torch.zeros(2, 5, dtype=torch.int64))


def test_exported_get_unpad_data_on_all_padding_mask_says_at_least_one_valid_token():
    exported = torch.export.export(Fn(packfn.get_unpad_data), (_EXAMPLE_IDS,)).module()
    with pytest.raises(RuntimeError, match="at least one valid token"):
        exported(torch.zeros_like(_EXAMPLE_IDS))


# ---------------------------------------------- 12. mutation survivors


@pytest.mark.parametrize("which", ["packed_token_indices", "cu_seqlens"])
def test_flatten_metadata_rejects_bool_metadata(which):
    tensors = {"packed_token_indices": torch.tensor([[0, -1]]), "cu_seqlens": torch.tensor([[0, 1]])}
    tensors[which] = tensors[which] >= 0
    with pytest.raises(ValueError, match=f"{which} must hold integers, got dtype torch.bool"):
        packfn.flatten_metadata(tensors["packed_token_indices"], tensors["cu_seqlens"])


def _packed_layout_fields(lens, values, minimum_length):
    layout = packfn.packed_layout(
        lens, seq_lens_padded=None, input_shape=values.shape[:2], alignment=4, minimum_length=minimum_length
    )
    return layout_fields(layout)


@pytest.mark.parametrize("minimum_length", [16, 18, 20])
def test_traced_packed_layout_honours_minimum_length(minimum_length):
    lens, values = torch.tensor([[3, 2], [1, 0]]), torch.zeros(2, 6)  # the rows need 8 columns
    expected = layout_fields(
        upstream_packed_layout(
            lens, seq_lens_padded=None, input_shape=(2, 6), alignment=4, minimum_length=minimum_length
        )
    )
    assert expected[0].shape[1] == -(-minimum_length // 4) * 4
    function = functools.partial(_packed_layout_fields, minimum_length=minimum_length)
    assert_same(_packed_layout_fields(lens, values, minimum_length), expected)
    assert_same(traced(function)(lens, values), expected)
    assert_same(tuple(torch.export.export(Fn(function), (lens, values)).module()(lens, values)), expected)


def _brute_force_aligned_length(sequence: int, documents: int, alignment: int, minimum_length: int) -> int:
    """The longest row length of upstream's packed_layout rule over every valid table (order is irrelevant).

    Row length: ``max(minimum_length, 1, sum of the lengths rounded up to alignment)`` rounded up to
    ``alignment``; a valid table holds at most ``documents`` present lengths summing to at most ``sequence``.
    """

    def partitions(tokens: int, parts: int, largest: int):
        # Multisets of at most `parts` positive lengths summing to at most `tokens`.
        yield ()
        if parts == 0:
            return
        for first in range(1, min(tokens, largest) + 1):
            for rest in partitions(tokens - first, parts - 1, first):
                yield (first, *rest)

    floor = -(-max(minimum_length, 1) // alignment) * alignment
    longest = max(
        sum(-(-n // alignment) * alignment for n in table) for table in partitions(sequence, documents, sequence)
    )
    return max(floor, longest)


_ALIGNED_LENGTH_CASES = [
    (sequence, documents, alignment, minimum_length)
    for sequence, documents, alignment in itertools.product(range(0, 9), range(0, 11), range(1, 6))
    for minimum_length in (0, 5)
]


def test_aligned_length_equals_brute_force_over_every_valid_table():
    mismatches = [
        (case, packfn.aligned_length(*case), _brute_force_aligned_length(*case))
        for case in _ALIGNED_LENGTH_CASES
        if packfn.aligned_length(*case) != _brute_force_aligned_length(*case)
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
        pytest.param((5, 9, 4, 21), 24, id="minimum_length_above_need"),
        pytest.param((5, 9, 4, 20), 20, id="minimum_length_equal_to_need"),
    ],
)
def test_aligned_length_reaches_upstream_row_length(arguments, expected):
    assert packfn.aligned_length(*arguments) == expected
    sequence, documents, alignment, *minimum = arguments
    # The worst table (documents - 1 one-token documents and one of the rest) reaches it in upstream.
    fitting = min(documents, sequence)
    lengths = [1] * max(fitting - 1, 0) + ([sequence - fitting + 1] if fitting else []) + [0] * (documents - fitting)
    if documents:
        layout = upstream_packed_layout(
            torch.tensor([lengths]),
            seq_lens_padded=None,
            input_shape=(1, sequence),
            alignment=alignment,
            minimum_length=minimum[0] if minimum else 0,
        )
        assert layout.source_indices.shape[1] == expected


def test_resolve_packing_contract_treats_an_equal_default_contract_as_explicit():
    ours = _DefaultPackedSequenceContract()
    theirs = upstream._DefaultPackedSequenceContract()
    assert ours == packfn.DEFAULT_PACKED_SEQUENCE_CONTRACT and ours is not packfn.DEFAULT_PACKED_SEQUENCE_CONTRACT
    with warnings.catch_warnings(record=True) as upstream_warnings:
        warnings.simplefilter("always")
        assert upstream.resolve_packing_contract(theirs, "flash_attention_2") is theirs
    with warnings.catch_warnings(record=True) as our_warnings:
        warnings.simplefilter("always")
        assert packfn.resolve_packing_contract(ours, "flash_attention_2") is ours
    assert [(w.category, str(w.message)) for w in our_warnings] == [
        (w.category, str(w.message)) for w in upstream_warnings
    ]
    assert [w.category for w in our_warnings] == [FutureWarning]
    assert "ignored" in str(our_warnings[0].message)


# ------------------------------ the flat search and the exact CPU paths, under review
# (NOTE [One flat search] in packfn/_ops/metadata.py, NOTE [Exact sizes on the CPU] in packfn/metadata.py)


def _layout_fields(layout) -> tuple[torch.Tensor, ...]:
    return (layout.source_indices, layout.input_positions, layout.position_ids, layout.sequence_ids)


def test_layouts_of_an_empty_batch_match_upstream():
    seq_lens = torch.zeros(0, 3, dtype=torch.int64)
    kwargs = {"seq_lens_padded": None, "input_shape": (0, 5), "alignment": 2}
    assert_same(
        _layout_fields(packfn.packed_layout(seq_lens, **kwargs)),
        _layout_fields(upstream_packed_layout(seq_lens, **kwargs)),
    )
    layout = packfn.aligned_layout(seq_lens, sequence_length=5, alignment=2, length=4)
    assert layout.source_indices.shape == (0, 4) and layout.input_positions.shape == (0, 5)


class _SearchingOps(torch.nn.Module):
    def forward(self, mask, seq_lens):
        layout = packfn.aligned_layout(seq_lens, sequence_length=mask.shape[1], alignment=2, length=2 * mask.shape[1])
        return (*packfn.batch_metadata(mask, max_documents=4)[:4], *_layout_fields(layout))


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


def test_huge_spans_of_one_row_change_no_other_row():
    """Spans near int64's limit (a broken table) must not wrap the flat running sum into the next row."""
    lengths, spans = torch.tensor([[3], [3]]), torch.tensor([[2**62], [2**62]])
    both = packfn._ops.layout.aligned_layout(lengths, spans, 8, 1, 4)
    for row in range(2):
        alone = packfn._ops.layout.aligned_layout(lengths[row : row + 1], spans[row : row + 1], 8, 1, 4)
        for name in ("source_indices", "input_positions", "position_ids", "sequence_ids"):
            assert torch.equal(getattr(both, name)[row : row + 1], getattr(alone, name)), (row, name)


def test_exact_cpu_path_follows_the_masks_device_not_the_default_device():
    mask = torch.tensor([[1, 1, 2, 0], [1, 1, 1, 0]])
    expected = packfn.build_packed_sequence_metadata(mask)
    with torch.device("meta"):
        got = packfn.build_packed_sequence_metadata(mask)
    assert_same(got, expected)


@pytest.mark.parametrize("op", ["varlen_metadata", "batch_metadata"])
def test_static_ops_accept_non_contiguous_masks(op):
    mask = torch.tensor([[1, 1, 0], [2, 1, 0], [2, 1, 1], [0, 1, 2]]).t()  # [3, 4], not contiguous
    assert not mask.is_contiguous()
    function = getattr(packfn, op)
    assert_same(tuple(function(mask, max_documents=3)), tuple(function(mask.contiguous(), max_documents=3)))


@pytest.mark.parametrize("mask", [[[1, 1, 2, 0, 5], [1, 1, 1, 0, 0]], [[1, 1, 2, 0, 0, 0]]], ids=["batch_2", "batch_1"])
@pytest.mark.parametrize("exact", [True, False], ids=["exact_cpu_path", "static_path"])
def test_build_packed_sequence_metadata_cu_seqlens_is_a_new_tensor_like_upstreams(exact, mask):
    """Contiguous, with upstream's strides, and no larger buffer kept alive behind it (batch one included)."""
    mask = torch.tensor(mask)
    with mock.patch("packfn.metadata.exact_on_cpu", lambda *tensors: exact):
        ours = packfn.build_packed_sequence_metadata(mask)
    theirs = upstream.build_packed_sequence_metadata(mask)
    assert ours["cu_seqlens"].stride() == theirs["cu_seqlens"].stride()
    assert ours["cu_seqlens"].untyped_storage().nbytes() == ours["cu_seqlens"].nbytes
    assert_same(ours, theirs)


@pytest.mark.parametrize("exact", [True, False], ids=["exact_cpu_path", "static_path"])
@pytest.mark.parametrize("lengths", [[[1, 2**63 - 1]], [[2**62, 2**62]], [[3, 2**63 - 2]]])
def test_layout_lengths_near_int64s_limit_raise_upstreams_error(exact, lengths):
    """Running sums of such spans wrapped int64 and hid the broken row; the tables are clamped past the row."""
    lengths = torch.tensor(lengths)
    kwargs = {"seq_lens_padded": None, "input_shape": (1, 8), "alignment": 1}
    with pytest.raises(ValueError) as theirs:
        upstream_packed_layout(lengths, **kwargs)
    with mock.patch("packfn.layout.exact_on_cpu", lambda *tensors: exact), pytest.raises(ValueError) as ours:
        packfn.packed_layout(lengths, **kwargs)
    assert str(ours.value) == str(theirs.value)
    assert packfn._ops.layout.aligned_layout(lengths, lengths, 8, 1, 8).broken.any()


@pytest.mark.parametrize("with_numpy", [True, False])
def test_get_unpad_data_indices_own_resizable_memory(with_numpy):
    """The exact CPU path's positions (NumPy's) come back as a tensor that owns its memory, as aten's."""
    mask = torch.tensor([[1, 1, 0, 2], [0, 3, 3, 0]])
    with contextlib.nullcontext() if with_numpy else mock.patch("packfn._checks.numpy", None):
        indices, cu_seqlens, _ = packfn.get_unpad_data(mask)
    indices.resize_(16)
    cu_seqlens.resize_(16)


@pytest.mark.parametrize("exact", [True, False], ids=["exact_cpu_path", "static_path"])
@pytest.mark.parametrize(
    "dropin",
    [
        lambda mask: packfn.get_unpad_data(mask)[0],
        lambda mask: packfn.get_seqlens_in_batch(mask),
        lambda mask: packfn.build_packed_sequence_metadata(mask)["cu_seqlens"],
        lambda mask: packfn.packed_layout(mask, seq_lens_padded=None, input_shape=(1, 8), alignment=2).sequence_ids,
    ],
    ids=["get_unpad_data", "get_seqlens_in_batch", "build_packed_sequence_metadata", "packed_layout"],
)
def test_jit_trace_of_a_drop_in_raises_rather_than_record_data_sized_outputs(dropin, exact):
    """A trace would keep the sizes read from its example (silently wrong on other data), so the drop-ins refuse it."""
    with (
        mock.patch("packfn.metadata.exact_on_cpu", lambda *tensors: exact),
        mock.patch("packfn.layout.exact_on_cpu", lambda *tensors: exact),
        pytest.raises(RuntimeError, match=re.escape("which torch.jit.trace records as constants")),
    ):
        torch.jit.trace(dropin, torch.tensor([[1, 1, 0, 2]]))


# ------------------------------------- review of the NumPy flatten path and physical varlen (stop 16)


def test_flatten_rejects_decreasing_uint8_boundaries_on_every_path():
    """A decrease of uint8 boundaries wraps when subtracted; the rule compares them instead."""
    indices, bounds = torch.tensor([[0, 1, 2]]), torch.tensor([[0, 5, 3]], dtype=torch.uint8)
    keywords = {"batch_size": 1, "sequence_length": 3}
    with pytest.raises(ValueError) as theirs:
        upstream_flatten(indices, bounds, **keywords)
    for numpy in (contextlib.nullcontext(), mock.patch("packfn._checks.numpy", None)):
        with numpy, pytest.raises(ValueError) as ours:
            packfn.flatten_packed_sequence_metadata(indices, bounds, **keywords)
        assert str(ours.value) == str(theirs.value)


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64])
def test_flatten_of_wide_unsigned_metadata_does_what_upstream_does(dtype):
    """NumPy takes uint16 and wider, aten's ops of the other paths (and upstream's) do not: all paths agree."""
    indices, bounds = torch.tensor([[0, 1, 2, 3]]).to(dtype), torch.tensor([[0, 1, 4]])
    keywords = {"batch_size": 1, "sequence_length": 4}
    theirs = outcome(upstream_flatten, indices, bounds, **keywords)
    for numpy in (contextlib.nullcontext(), mock.patch("packfn._checks.numpy", None)):
        with numpy:
            ours = outcome(packfn.flatten_packed_sequence_metadata, indices, bounds, **keywords)
        assert ours[0] == theirs[0] == "error" and ours[1] is theirs[1]


def test_cpu_paths_follow_the_inputs_device_not_the_default_device():
    indices, bounds = torch.tensor([[0, 1, -1], [0, 1, 2]]), torch.tensor([[0, 2, -1], [0, 1, 3]], dtype=torch.int32)
    ids = torch.tensor([[1, 1, 2], [3, 0, 0]])
    keywords = {"batch_size": 2, "sequence_length": 3}

    def both():
        flat = packfn.flatten_packed_sequence_metadata(indices, bounds, **keywords)
        return (*flat, *packfn._ops.attention.physical_varlen_metadata(ids))

    expected = both()
    with torch.device("meta"):
        got = both()
    assert_same(got, expected)


def test_numpy_gets_no_view_of_a_functorch_wrapper():
    """DLPack of a functionalize wrapper exports memory that is not its values: the wrapper gets no NumPy view."""
    seen = []

    def view(tensor):
        seen.append(packfn._checks.numpy_views(tensor))
        return tensor

    torch.func.functionalize(view)(torch.tensor([[0, 1]]))
    torch.func.vmap(view)(torch.tensor([[0, 1]]))
    assert seen == [None, None]
    assert packfn._checks.numpy_views(torch.tensor([[0, 1]])) is not None


def test_flatten_error_traceback_holds_no_numpy_view_of_the_inputs():
    """A view in a frame of the traceback would outlive a resize of the input it shows."""
    indices, bounds = torch.tensor([[0, 1]]), torch.tensor([[0, 1]], dtype=torch.int32)
    with pytest.raises(ValueError) as error:
        packfn.flatten_packed_sequence_metadata(indices, bounds, batch_size=1, sequence_length=2)
    frames = [entry.frame.f_locals for entry in error.traceback]
    numpy_type = type(packfn._checks.numpy_views(indices)[0])
    assert not any(isinstance(value, numpy_type) for local in frames for value in local.values())


def test_physical_varlen_metadata_compiled_with_dynamic_shapes_on_one_token_rows():
    """Spare slots shared by blocks of 4096 positions (a floor division in the scatter's index) made Inductor's
    code skip the scatter's last partial block: ``[5, 1]`` ids gave ``cu_seqlens`` all 5 under dynamic shapes."""
    op = packfn._ops.attention.physical_varlen_metadata
    compiled = torch.compile(op, fullgraph=True, dynamic=True)
    for shape in [(2, 1), (5, 1), (4097, 1), (3, 5)]:
        ids = torch.arange(shape[0] * shape[1]).reshape(shape) // 2
        assert_same(tuple(compiled(ids)), tuple(op.math(ids)))
