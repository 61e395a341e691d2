"""The drop-ins of datasets.packed_seq (PackedSeqParams) against nemo_automodel 0.7.0: values, errors, the math."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from nemo_automodel.components.datasets import packed_seq as upstream

import packfn
import packfn.nemo_automodel as drop_ins

from tests.assertions import assert_same, assert_same_math, outcome
from tests.compiling import generated_code, no_packfn_fallback
from tests.references import forward_backward, per_document_attention, segments_attention
from tests.strategies import EXAMPLE, packing_masks
from tests.strategies_attention import packed_batches

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MATH_SETTINGS = settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def assert_same_params(ours, theirs) -> None:
    assert [field for field in vars(ours)] == [field for field in vars(theirs)]
    assert_same(ours.cu_seqlens, theirs.cu_seqlens)
    assert_same(ours.max_seqlen, theirs.max_seqlen)
    assert ours.doc_ids is theirs.doc_ids


def test_packed_seq_params_example():
    params = drop_ins.packed_seq_params_from_doc_ids(EXAMPLE)
    assert params.cu_seqlens.tolist() == [0, 2, 5, 6, 10, 12]
    assert params.max_seqlen == 4
    assert drop_ins.to_flash_attention_kwargs(params) == {
        "cu_seq_lens_q": params.cu_seqlens,
        "cu_seq_lens_k": params.cu_seqlens,
        "max_length_q": 4,
        "max_length_k": 4,
    }


@SETTINGS
@given(packing_masks(max_batch=4, max_sequence=64))
def test_packed_seq_params_matches_upstream(mask):
    before = mask.clone()
    ours, theirs = drop_ins.packed_seq_params_from_doc_ids(mask), upstream.packed_seq_params_from_doc_ids(mask)
    assert_same_params(ours, theirs)
    assert_same(drop_ins.to_flash_attention_kwargs(ours), upstream.to_flash_attention_kwargs(theirs))
    assert_same(drop_ins.to_flash_attention_kwargs(theirs), upstream.to_flash_attention_kwargs(ours))
    assert torch.equal(mask, before)


@pytest.mark.parametrize("shape", [(6,), (1, 2, 3)])
def test_packed_seq_params_rank_error_matches_upstream(shape):
    mask = torch.ones(shape, dtype=torch.int64)
    ours = outcome(drop_ins.packed_seq_params_from_doc_ids, mask)
    assert ours == outcome(upstream.packed_seq_params_from_doc_ids, mask)
    assert ours[1] is ValueError


@pytest.mark.parametrize(
    "mask",
    [torch.tensor([[1, 2, 1, 1, 0]]), torch.tensor([[1, -1, -1, 0], [3, 3, 2, 0]])],
    ids=["id_reappears", "negative_and_decreasing"],
)
def test_physical_segments_accept_any_integer_ids_like_upstream(mask):
    """Physical segments are runs of equal ids: nothing relies on ids increasing, so nothing is rejected."""
    assert_same_params(drop_ins.packed_seq_params_from_doc_ids(mask), upstream.packed_seq_params_from_doc_ids(mask))
    static = packfn.physical_varlen_metadata(mask)
    expected = upstream.packed_seq_params_from_doc_ids(mask).cu_seqlens
    assert torch.equal(static.cu_seqlens[: expected.numel()], expected)


@pytest.mark.parametrize(
    "dtype", [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.uint16, torch.uint32, torch.uint64]
)
def test_physical_segments_take_every_integer_dtype_like_upstream(dtype):
    """uint16/32/64 included (torch's ops lack them, so packfn reads them by their bits as signed ids)."""
    high = True if dtype == torch.bool else 2**64 - 1 if dtype == torch.uint64 else torch.iinfo(dtype).max
    mask = torch.tensor([[high, high, 0, 1], [1, 0, 0, high]], dtype=dtype)
    ours, theirs = drop_ins.packed_seq_params_from_doc_ids(mask), upstream.packed_seq_params_from_doc_ids(mask)
    assert_same_params(ours, theirs)
    assert ours.cu_seqlens.tolist() == [0, 2, 3, 4, 5, 7, 8]


@pytest.mark.parametrize(
    ("mask", "error", "message"),
    [
        (torch.tensor([[1.0, 0.0]]), ValueError, "integer or bool"),
        (torch.zeros(2, 0, dtype=torch.int64), ValueError, "must not be empty"),
        ([[1, 1]], TypeError, "torch.Tensor"),
    ],
)
def test_packed_seq_params_rejects_inconsistent_masks(mask, error, message):
    with pytest.raises(error, match=message):
        drop_ins.packed_seq_params_from_doc_ids(mask)


def physical_varlen(q, k, v, mask):
    """The HF flash_varlen path: flatten without unpadding, attend each physical segment alone."""
    params = drop_ins.packed_seq_params_from_doc_ids(mask)
    out = segments_attention(*(t.flatten(0, 1) for t in (q, k, v)), params.cu_seqlens)
    return out.reshape(q.shape)


@MATH_SETTINGS
@given(packed_batches())
def test_packing_keeps_the_math_with_the_drop_ins_physical_segments(mask):
    """tests/core/test_attention.py holds the other representations to the same math."""
    assert_same_math(forward_backward(physical_varlen, mask), forward_backward(per_document_attention, mask), mask)


def test_compiled_static_ops_and_drop_in_hold_no_packfn_call():
    def inputs(mask):
        varlen = packfn.physical_varlen_metadata(mask)
        params = drop_ins.packed_seq_params_from_doc_ids(mask)  # unbacked sizes, no graph break
        return packfn.block_causal_mask(mask), *varlen[:3], params.cu_seqlens, params.max_seqlen

    compiled = torch.compile(inputs, fullgraph=True)
    with generated_code() as codes:
        outputs = compiled(EXAMPLE)
    for code in codes:
        no_packfn_fallback(code)
    for got, want in zip(outputs, inputs(EXAMPLE), strict=True):
        assert_same(got, want)
