"""packfn.integrations.megatron against megatron-core: the ltor masks drop-in and THD PackedSeqParams.

The oracle is megatron-core's ``_get_ltor_masks_and_position_ids``: 0.16.1
on Python 3.11 (the test extra), 0.19.2 on Python 3.12 (``.ci/run`` runs this
file there too); the function is the same in both.
"""

from __future__ import annotations

import itertools

import megatron.core.packed_seq_params as megatron_packed_seq_params
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

import packfn
from packfn.integrations import megatron

from tests.assertions import assert_same, outcome
from tests.strategies_formats import PackedRows, packed_rows


def upstream_ltor():
    return _get_ltor_masks_and_position_ids


SWITCHES = st.tuples(st.booleans(), st.booleans(), st.booleans(), st.booleans())


def assert_same_as_megatron_for_every_switch(data: torch.Tensor, eod: object) -> None:
    """Equal outputs, or the same exception type and message, as upstream's for all 16 switch settings."""
    for switches in itertools.product([False, True], repeat=4):
        ours = outcome(megatron.get_ltor_masks_and_position_ids, data, eod, *switches)
        theirs = outcome(upstream_ltor(), data, eod, *switches)
        assert ours[0] == theirs[0], (switches, ours, theirs)
        if ours[0] == "error":
            assert ours[1:] == theirs[1:], switches
        else:
            assert_same(ours[1], theirs[1])


@settings(max_examples=80)
@given(
    data=st.lists(st.integers(0, 5), min_size=1, max_size=40).map(torch.tensor),
    eod=st.integers(0, 6),
    switches=SWITCHES,
)
@example(data=torch.tensor([0, 5, 6, 0, 0, 7]), eod=0, switches=(True, True, True, True))
@example(data=torch.tensor([5, 6, 7]), eod=0, switches=(True, True, False, True))
def test_ltor_masks_and_position_ids_equal_megatron(data, eod, switches):
    assert_same(megatron.get_ltor_masks_and_position_ids(data, eod, *switches), upstream_ltor()(data, eod, *switches))


@pytest.mark.parametrize("data", [torch.tensor([[5, 0, 6, 7]]), torch.tensor(0), torch.zeros(0, dtype=torch.int64)])
def test_ltor_errors_and_shapes_outside_one_dimension_are_megatron_s(data):
    assert_same_as_megatron_for_every_switch(data, 0)


NARROW = [(torch.int8, 128), (torch.int8, -129), (torch.uint8, -1), (torch.uint8, 256), (torch.int16, 2**15)]


@pytest.mark.parametrize(("dtype", "eod"), NARROW)
def test_ltor_an_eod_token_the_dtype_cannot_hold_wraps_as_megatron_s(dtype, eod):
    info = torch.iinfo(dtype)
    wrapped = (eod - info.min) % (info.max - info.min + 1) + info.min
    data = torch.tensor([1, wrapped, 3, 4], dtype=dtype)
    assert_same_as_megatron_for_every_switch(data, eod)
    _, loss_mask, position_ids = megatron.get_ltor_masks_and_position_ids(data, eod, True, True, True, False)
    assert loss_mask.tolist() == [1, 0, 1, 1] and position_ids.tolist() == [0, 1, 0, 1]
    if eod >= 0:  # The core conversion keeps its rule: an id the dtype cannot hold matches no token.
        assert packfn.document_ids_from_eos(data[None], eod).document_ids.tolist() == [[1, 1, 1, 1]]


@pytest.mark.parametrize(
    "eod", [torch.tensor(3), torch.tensor(3, dtype=torch.int8), torch.tensor(3.0), torch.tensor([3])]
)
def test_ltor_a_tensor_eod_token_is_compared_as_megatron_compares_it(eod):
    data = torch.tensor([1, 3, 2, 3, 5])
    assert_same_as_megatron_for_every_switch(data, eod)
    assert megatron.get_ltor_masks_and_position_ids(data, eod, True, True, True, False)[2].tolist() == [0, 1, 0, 1, 0]


@pytest.mark.parametrize(
    "eod",
    [2**70, torch.tensor([3, 4]), torch.tensor([[3]]), None, "3"],
    ids=["past int64", "two ids", "[[3]]", "None", "str"],
)
def test_ltor_eod_tokens_megatron_refuses_or_ignores_fare_the_same(eod):
    assert_same_as_megatron_for_every_switch(torch.tensor([1, 3, 2, 3, 5]), eod)


def test_ltor_is_megatron_s_private_name_too():
    assert megatron._get_ltor_masks_and_position_ids is megatron.get_ltor_masks_and_position_ids


def test_ltor_compiles_without_graph_breaks():
    compiled = torch.compile(megatron.get_ltor_masks_and_position_ids, fullgraph=True, backend="aot_eager")
    data = torch.tensor([5, 6, 0, 7, 8, 9, 0, 4])
    assert_same(compiled(data, 0, True, True, True, True), upstream_ltor()(data, 0, True, True, True, True))


@settings(max_examples=30)
@given(rows=packed_rows())
def test_packed_seq_params_are_static_thd(rows: PackedRows):
    params = megatron.packed_seq_params(rows.document_ids, max_documents=rows.max_documents)
    thd = packfn.thd_metadata(rows.document_ids, max_documents=rows.max_documents)
    assert params.qkv_format == "thd"
    assert params.cu_seqlens_q is params.cu_seqlens_kv and params.cu_seqlens_q_padded is params.cu_seqlens_kv_padded
    assert_same(params.cu_seqlens_q, thd.cu_seqlens)
    assert_same(params.cu_seqlens_q_padded, thd.cu_seqlens_padded)
    assert params.max_seqlen_q == params.max_seqlen_kv == rows.sequence and type(params.max_seqlen_q) is int
    assert params.cu_seqlens_q.shape == (rows.batch * rows.max_documents + 1,)


def test_packed_seq_params_fill_megatron_s_class_when_it_is_loaded():
    upstream = megatron_packed_seq_params
    params = megatron.packed_seq_params(torch.tensor([[1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 0, 0]]), max_documents=2)
    assert type(params) is upstream.PackedSeqParams
    own = {field for field in megatron.MegatronPackedSeqParams.__dataclass_fields__}
    assert set(upstream.PackedSeqParams.__dataclass_fields__) <= own
    # megatron's own seq_idx from the padded boundaries (its __post_init__, data-sized) covers every token.
    if "total_tokens" in upstream.PackedSeqParams.__dataclass_fields__:  # megatron-core 0.19
        sized = upstream.PackedSeqParams(cu_seqlens_q_padded=params.cu_seqlens_q_padded, total_tokens=12)
        assert sized.seq_idx.tolist() == [[0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2]]


def test_packed_seq_params_without_megatron_use_packfn_s_dataclass():
    params = megatron.packed_seq_params(torch.tensor([[1, 1, 0]]), params_class=megatron.MegatronPackedSeqParams)
    assert type(params) is megatron.MegatronPackedSeqParams and params.cp_group is None
