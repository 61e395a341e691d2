"""Varlen inputs: physical boundaries against upstream's packed_seq, unpad / pad, their backward and compile."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from nemo_automodel.components.datasets import packed_seq as upstream

import packfn
from packfn._ops import varlen as varlen_ops

from tests.assertions import assert_same
from tests.compiling import generated_code, no_packfn_fallback
from tests.strategies import EXAMPLE, packing_masks

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ------------------------------------------------------------ flash varlen


@SETTINGS
@given(packing_masks(max_batch=4, max_sequence=64))
def test_physical_varlen_repeats_total_past_last_segment(mask):
    theirs = upstream.packed_seq_params_from_doc_ids(mask)
    ours = packfn.physical_varlen_metadata(mask)
    segments = theirs.cu_seqlens.numel() - 1
    assert ours.cu_seqlens.dtype == torch.int32 and ours.cu_seqlens.shape == (mask.numel() + 1,)
    assert torch.equal(ours.cu_seqlens[: segments + 1], theirs.cu_seqlens)
    assert (ours.cu_seqlens[segments:] == mask.numel()).all()
    assert ours.max_seqlen.dtype == torch.int32 and ours.max_seqlen.item() == theirs.max_seqlen
    assert ours.num_segments.dtype == torch.int64 and ours.num_segments.item() == segments
    assert ours.max_seqlen_bound == mask.shape[1]


def test_physical_varlen_metadata_compiled_with_dynamic_shapes_on_one_token_rows():
    """Spare slots shared by blocks of 4096 positions (a floor division in the scatter's index) made Inductor's
    code skip the scatter's last partial block: ``[5, 1]`` ids gave ``cu_seqlens`` all 5 under dynamic shapes."""
    op = varlen_ops.physical_varlen_metadata_op
    compiled = torch.compile(op, fullgraph=True, dynamic=True)
    for shape in [(2, 1), (5, 1), (4097, 1), (3, 5)]:
        ids = torch.arange(shape[0] * shape[1]).reshape(shape) // 2
        assert_same(tuple(compiled(ids)), tuple(op.math(ids)))


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64])
def test_physical_varlen_metadata_takes_unsigned_ids_by_their_runs(dtype):
    """Runs of equal ids are all that counts: ids near each dtype's maximum give the int64 ids' boundaries."""
    top = 2**64 - 1 if dtype == torch.uint64 else torch.iinfo(dtype).max
    ids = torch.tensor([[top, top, 0, top - 1], [1, 1, 1, top]], dtype=dtype)
    expected = packfn.physical_varlen_metadata(torch.tensor([[3, 3, 0, 2], [1, 1, 1, 3]]))
    assert_same(tuple(packfn.physical_varlen_metadata(ids)), tuple(expected))
    with pytest.raises(ValueError, match=r"document_ids must hold integer or bool document ids \(any integer dtype\)"):
        packfn.physical_varlen_metadata(ids.to(torch.float32) if dtype != torch.uint64 else torch.zeros(2, 4))


# --------------------------------------------------------------- unpad / pad


@pytest.mark.parametrize(
    ("dtype", "trailing"),
    [(torch.float32, ()), (torch.bfloat16, (3,)), (torch.int32, (2, 2)), (torch.bool, (1,)), (torch.complex64, (2,))],
)
def test_unpad_pad_round_trip_any_dtype(dtype, trailing):
    metadata = packfn.varlen_metadata(EXAMPLE)
    values = (torch.arange(12 * max(1, torch.Size(trailing).numel())).reshape(2, 6, *trailing) + 1).to(dtype)
    before = values.clone()
    unpadded = packfn.unpad(values, metadata)
    assert unpadded.shape == (12, *trailing) and unpadded.dtype == dtype
    assert torch.equal(unpadded[:9], values.flatten(0, 1)[metadata.indices[:9]])
    assert not unpadded[9:].any()  # rows past num_tokens are zeros
    padded = packfn.pad(unpadded, metadata)
    assert torch.equal(padded, torch.where((EXAMPLE != 0).reshape(2, 6, *[1] * len(trailing)), values, 0).to(dtype))
    assert torch.equal(values, before)


@pytest.mark.parametrize("trailing", [(), (2,)])
@pytest.mark.parametrize(
    ("dtype", "signed"), [(torch.uint16, torch.int16), (torch.uint32, torch.int32), (torch.uint64, torch.int64)]
)
def test_unpad_pad_move_unsigned_dtypes_index_select_lacks_by_their_bits(dtype, signed, trailing):
    """Values near each dtype's maximum (negative in the signed dtype) come back unchanged, zeros at padding."""
    metadata = packfn.varlen_metadata(EXAMPLE)
    bits = -1 - torch.arange(12 * max(1, torch.Size(trailing).numel()), dtype=signed).reshape(2, 6, *trailing)
    values = bits.view(dtype)
    unpadded = packfn.unpad(values, metadata)
    assert unpadded.dtype == dtype and torch.equal(unpadded.view(signed), packfn.unpad(bits, metadata))
    padded = packfn.pad(unpadded, metadata)
    valid = (EXAMPLE != 0).reshape(2, 6, *[1] * len(trailing))
    assert padded.dtype == dtype and torch.equal(padded.view(signed), torch.where(valid, bits, 0))


def test_unpad_pad_round_trip_a_batch_without_padding():
    """Every row valid: num_tokens is batch * sequence, and pad keeps the last token."""
    metadata = packfn.varlen_metadata(torch.tensor([[1, 1, 2, 2]]))
    values = torch.arange(1.0, 5.0).reshape(1, 4)
    assert packfn.pad(packfn.unpad(values, metadata), metadata).tolist() == [[1.0, 2.0, 3.0, 4.0]]


def test_pad_writes_zeros_over_a_nan_tail():
    metadata = packfn.varlen_metadata(EXAMPLE)
    values = torch.randn(12, 3, dtype=torch.float64)
    values[9:] = float("nan")
    values.requires_grad_()
    padded = packfn.pad(values, metadata)
    assert not padded.isnan().any() and (padded[EXAMPLE == 0] == 0).all()
    (padded * 2).sum().backward()
    assert torch.equal(values.grad, torch.cat([torch.full((9, 3), 2.0), torch.zeros(3, 3)]).double())


def test_unpad_and_pad_are_each_others_backward():
    metadata = packfn.varlen_metadata(EXAMPLE)
    values = torch.randn(2, 6, 3, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(12, 3, dtype=torch.float64)
    (unpadded,) = torch.autograd.grad(packfn.unpad(values, metadata), values, grad)
    assert torch.equal(unpadded, packfn.pad(grad, metadata))
    rows = torch.randn(12, 3, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(2, 6, 3, dtype=torch.float64)
    (padded,) = torch.autograd.grad(packfn.pad(rows, metadata), rows, grad)
    assert torch.equal(padded, packfn.unpad(grad, metadata))
    assert torch.autograd.gradcheck(lambda x: packfn.pad(packfn.unpad(x, metadata) * 3, metadata), (values,))


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda m: packfn.unpad(torch.zeros(12), m), ValueError, r"\[batch, sequence, \.\.\.\]"),
        (lambda m: packfn.unpad(torch.zeros(2, 5, 3), m), ValueError, "do not match the mask"),
        (lambda m: packfn.unpad(torch.zeros(3, 6), m), ValueError, "do not match the mask"),
        (lambda m: packfn.unpad([[0.0]], m), TypeError, "values must be a torch.Tensor"),
        (lambda m: packfn.unpad(torch.zeros(2, 6), m.indices), TypeError, "VarlenMetadata"),
        (lambda m: packfn.unpad(torch.zeros(2, 6), m._replace(indices=m.indices.int())), ValueError, "int64"),
        (lambda m: packfn.unpad(torch.zeros(2, 6), m._replace(num_tokens=m.num_tokens.float())), ValueError, "0-d"),
        (lambda m: packfn.unpad(torch.zeros(2, 6), m._replace(max_seqlen_bound=5)), ValueError, "multiple"),
        (lambda m: packfn.pad(torch.zeros(11, 2), m), ValueError, "12 rows"),
        (lambda m: packfn.pad(torch.zeros(()), m), ValueError, r"\[batch \* sequence, \.\.\.\]"),
        (lambda m: packfn.pad(torch.zeros(12), m._replace(indices=m.indices.flip(0))), RuntimeError, "permutation"),
        (lambda m: packfn.pad(torch.zeros(12), m._replace(num_tokens=m.num_tokens + 1)), RuntimeError, "permutation"),
        (lambda m: packfn.pad(torch.zeros(12), m._replace(num_tokens=m.num_tokens + 4)), RuntimeError, "permutation"),
    ],
)
def test_unpad_pad_errors(call, error, message):
    with pytest.raises(error, match=message):
        call(packfn.varlen_metadata(EXAMPLE))


@pytest.mark.parametrize(
    ("indices", "num_tokens"),
    [
        ([0, 1, 2, 3], 5),  # num_tokens past the positions: every position is found, nothing would be left out
        ([0, 1, 2, 3], -1),
        ([1, 0, 2, 3], 4),  # a permutation, its valid part not ascending
        ([0, 3, 2, 1], 1),  # its padding part not ascending
    ],
)
def test_pad_flags_metadata_varlen_metadata_cannot_make(indices, num_tokens):
    metadata = packfn.varlen_metadata(torch.ones(1, 4, dtype=torch.int64))
    edited = metadata._replace(indices=torch.tensor(indices), num_tokens=torch.tensor(num_tokens))
    with pytest.raises(RuntimeError, match="num_tokens its count of valid tokens"):
        packfn.pad(torch.zeros(4), edited)


def test_compiled_unpad_pad_backward_is_a_gather():
    metadata = packfn.varlen_metadata(EXAMPLE)

    def step(values, rows, indices, cu_seqlens, seqlens, max_seqlen, num_tokens, num_documents):
        m = packfn.VarlenMetadata(indices, cu_seqlens, seqlens, max_seqlen, num_tokens, num_documents, 6)
        return packfn.unpad(values, m) * 2, packfn.pad(rows, m) * 3

    values = torch.randn(2, 6, 4, requires_grad=True)
    rows = torch.randn(12, 4, requires_grad=True)
    compiled = torch.compile(step, fullgraph=True)

    with generated_code() as codes:
        unpadded, padded = compiled(values, rows, *metadata[:-1])
        (unpadded.sum() + padded.sum()).backward()
    assert len(codes) == 2  # forward and backward
    for code in codes:
        no_packfn_fallback(code)
        assert not re.search(r"atomic_add|scatter|index_put", code)
        assert "index_select" in code  # the fused kernel is a gather
    assert torch.equal(unpadded, packfn.unpad(values, metadata) * 2)
    assert torch.equal(padded, packfn.pad(rows, metadata) * 3)
    assert torch.equal(values.grad, packfn.pad(torch.full((12, 4), 2.0), metadata))
    assert torch.equal(rows.grad, packfn.unpad(torch.full((2, 6, 4), 3.0), metadata))
