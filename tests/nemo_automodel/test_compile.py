"""The metadata drop-ins under torch.compile and torch.export: unbacked sizes, no graph break, upstream's messages.

Several tests pin the behaviours issue 8 listed as broken (fixed in 80d66d4;
each fails on the code before the fix, 3a96ee9), by its case numbers.
"""

from __future__ import annotations

import re

import pytest
import torch
from nemo_automodel.components.datasets import packing as upstream
from nemo_automodel.components.models.common.packing import flatten_packed_sequence_metadata as upstream_flatten
from torch._inductor.utils import run_and_get_code
from torch.export import Dim

import packfn
import packfn.nemo_automodel as drop_ins

from tests.assertions import assert_same
from tests.compiling import Fn, export_dynamic, packfn_nodes, traced
from tests.strategies import EXAMPLE, document_mask, random_mask


def drop_in_path(mask):
    indices, cu_seqlens, max_seqlen = drop_ins.get_unpad_data(mask)
    metadata = drop_ins.build_packed_sequence_metadata(mask)
    flat = drop_ins.flatten_packed_sequence_metadata(
        metadata["packed_token_indices"],
        metadata["cu_seqlens"],
        batch_size=mask.shape[0],
        sequence_length=mask.shape[1],
    )
    return indices, cu_seqlens, max_seqlen, metadata, flat, drop_ins.get_seqlens_in_batch(mask)


compiled_drop_ins = torch.compile(drop_in_path, fullgraph=True)


def test_drop_ins_compile_without_graph_breaks_or_recompiles(no_graph_breaks):
    first = random_mask(3, 16, seed=0)
    result, code = run_and_get_code(compiled_drop_ins, first)
    assert_same(result, drop_in_path(first))
    assert "packfn" not in "\n".join(code)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed in range(1, 21):
            mask = random_mask(3, 16, seed=seed)
            assert_same(compiled_drop_ins(mask), drop_in_path(mask))


class ExportedDropIns(torch.nn.Module):
    def forward(self, mask):
        indices, cu_seqlens, max_seqlen = drop_ins.get_unpad_data(mask)
        return indices, cu_seqlens, max_seqlen


def test_export_of_drop_ins_has_unbacked_sizes(no_graph_breaks):
    program = torch.export.export(ExportedDropIns(), (random_mask(3, 16, seed=0),))
    assert "packfn._sizes.default" in packfn_nodes(program)
    lowered = program.run_decompositions()
    assert packfn_nodes(lowered) == set()
    for seed in (4, 5):
        mask = random_mask(3, 16, seed=seed)
        expected = drop_ins.get_unpad_data(mask)
        for candidate in (program, lowered):
            indices, cu_seqlens, max_seqlen = candidate.module()(mask)
            assert torch.equal(indices, expected[0]) and torch.equal(cu_seqlens, expected[1])
            assert int(max_seqlen) == expected[2]


# ------------------------------------------ issue 8, case 2: dynamic shapes


def _segments(mask):
    params = drop_ins.packed_seq_params_from_doc_ids(mask)
    return params.cu_seqlens, params.max_seqlen, params.doc_ids


@pytest.mark.parametrize("function", [drop_ins.get_unpad_data, _segments], ids=["unpad", "segments"])
def test_drop_ins_with_sliced_unbacked_sizes_compile_with_dynamic_shapes(function):
    # Each slices an op's output by a size read back. torch 2.11 compiled neither with dynamic=True
    # (PendingUnbackedSymbolNotFound) until python_ints stated that size's symbolic bound; packfn then
    # needed no out-of-place scatter or index_select in their place.
    compiled = torch.compile(function, fullgraph=True, dynamic=True)
    for mask in (torch.tensor([[1, 1, 2, 0], [1, 0, 0, 0]]), torch.tensor([[1, 1, 2, 0, 3], [1, 0, 0, 0, 2]])):
        assert_same(compiled(mask), function(mask))


def _metadata_everywhere(mask):
    flat = packfn.varlen_metadata(mask, max_documents=16)
    batch = packfn.batch_metadata(mask, max_documents=16)
    flattened = packfn.flatten_metadata(batch.packed_token_indices, batch.cu_seqlens)
    indices, cu_seqlens, max_seqlen = drop_ins.get_unpad_data(mask)
    metadata = drop_ins.build_packed_sequence_metadata(mask)
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


# ------------------------------ issue 8, case 4: compiled flatten_packed_sequence_metadata


def _flatten(indices, cu_seqlens, batch_size, sequence_length):
    return drop_ins.flatten_packed_sequence_metadata(
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


def test_compiled_flatten_refuses_a_flat_total_the_boundaries_dtype_would_wrap():
    """As in eager (tests/nemo_automodel/test_metadata.py): 128 int8 boundaries' total is one past 127."""
    indices, cu_seqlens = torch.arange(64).repeat(2, 1), torch.tensor([[0, 64], [0, 64]], dtype=torch.int8)
    with pytest.raises(RuntimeError, match="the flat total of the valid tokens is past 127"):
        _compiled_flatten(indices, cu_seqlens, 2, 64)
    indices[1, -1] = -1
    assert _compiled_flatten(indices, cu_seqlens - torch.tensor([[0, 0], [0, 1]], dtype=torch.int8), 2, 64)[
        1
    ].tolist() == [0, 64, 127]


# ------------------------------------------------------ issue 8, case 5: narrow mask dtypes

_DROP_INS = ("get_seqlens_in_batch", "get_unpad_data", "build_packed_sequence_metadata")
_compiled_drop_ins = {name: traced(getattr(drop_ins, name)) for name in _DROP_INS}
_NARROW_SEQUENCE = 310  # one shape for every narrow mask below: one compile per drop-in and dtype


def _narrow_mask(dtype: torch.dtype, length: int, document_id: int = 2) -> torch.Tensor:
    """One row: a 2-token document 1, then ``length`` tokens of ``document_id``, then padding."""
    row = [1, 1] + [document_id] * length
    return torch.tensor([row + [0] * (_NARROW_SEQUENCE - len(row))], dtype=dtype)


def _overflow_message(dtype: torch.dtype) -> str:
    # NOTE [Narrow mask dtypes] in packfn/nemo_automodel/metadata.py.
    return f"a document of more than {torch.iinfo(dtype).max} tokens does not fit attention_mask's dtype {dtype}"


@pytest.mark.parametrize("name", _DROP_INS)
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8], ids=str)
def test_narrow_mask_document_at_dtype_maximum_is_legal_and_one_more_raises(name, dtype):
    limit = torch.iinfo(dtype).max
    fits = _narrow_mask(dtype, limit)
    expected = getattr(upstream, name)(fits)
    assert_same(getattr(drop_ins, name)(fits), expected)
    assert_same(_compiled_drop_ins[name](fits), expected)

    overflows = _narrow_mask(dtype, limit + 1)
    with pytest.raises(ValueError, match=f"^{re.escape(_overflow_message(dtype))}"):
        getattr(drop_ins, name)(overflows)
    with pytest.raises(RuntimeError, match=re.escape(_overflow_message(dtype))):
        _compiled_drop_ins[name](overflows)


@pytest.mark.parametrize("name", ["get_unpad_data", "build_packed_sequence_metadata"])
def test_narrow_mask_of_ids_at_most_one_counts_as_bool(name):
    # Upstream counts a mask of ids at most 1 as bool (in int64): 300 tokens fit.
    mask = _narrow_mask(torch.uint8, 298, document_id=1)
    expected = getattr(upstream, name)(mask)
    assert_same(getattr(drop_ins, name)(mask), expected)
    assert_same(_compiled_drop_ins[name](mask), expected)


# ------------------------------------------------------------ issue 8, case 8: clear errors


@pytest.mark.parametrize("name", ["get_unpad_data", "build_packed_sequence_metadata"])
def test_compiled_drop_in_on_all_padding_mask_says_at_least_one_valid_token(name):
    with pytest.raises(RuntimeError, match="at least one valid token"):
        _compiled_drop_ins[name](torch.zeros(2, 5, dtype=torch.int64))


def test_exported_get_unpad_data_on_all_padding_mask_says_at_least_one_valid_token():
    exported = torch.export.export(Fn(drop_ins.get_unpad_data), (EXAMPLE,)).module()
    with pytest.raises(RuntimeError, match="at least one valid token"):
        exported(torch.zeros_like(EXAMPLE))
