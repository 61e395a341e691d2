"""packfn.integrations.megatron against megatron-core: the ltor masks drop-in and THD PackedSeqParams.

The oracle is megatron-core's ``_get_ltor_masks_and_position_ids``: 0.16.1
on Python 3.11 (the test extra), 0.19.2 on Python 3.12 (``.ci/run`` runs this
file there too); the function is the same in both.
"""

from __future__ import annotations

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


@pytest.mark.parametrize(
    "switches", [(True, False, False, False), (False, False, True, True), (False, False, False, True)]
)
def test_ltor_errors_and_shapes_outside_one_dimension_are_megatron_s(switches):
    data = torch.tensor([[5, 0, 6, 7]])
    ours, theirs = (
        outcome(megatron.get_ltor_masks_and_position_ids, data, 0, *switches),
        outcome(upstream_ltor(), data, 0, *switches),
    )
    assert ours[0] == theirs[0]
    if ours[0] == "error":
        assert ours[1:] == theirs[1:]
    else:
        assert_same(ours[1], theirs[1])


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
