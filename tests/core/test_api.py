"""The public API by layer: the core's names, and every deprecated spelling of the layering, still working."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings

import pytest
import torch

import packfn
import packfn.nemo_automodel
from packfn.packer import pack_documents

from tests.assertions import assert_layouts_equal, assert_same
from tests.compiling import traced
from tests.strategies import EXAMPLE

CORE_NAMES = {
    "BatchMetadata",
    "BudgetSuggestion",
    "CPShard",
    "CPVarlenMetadata",
    "DEFAULT_PACKED_SEQUENCE_CONTRACT",
    "EosDocuments",
    "PackedBatch",
    "PackedDataset",
    "PackedMaskType",
    "PackedSequenceContract",
    "PackedSequenceLayout",
    "PhysicalVarlenMetadata",
    "Piece",
    "Pieces",
    "ThdMetadata",
    "VarlenMetadata",
    "aligned_layout",
    "batch_metadata",
    "block_causal_mask",
    "cache_key_tag",
    "cp_block_causal_mask",
    "cp_document_block_mask",
    "cp_varlen_metadata",
    "document_block_mask",
    "document_ids_from_cu_seqlens",
    "document_ids_from_eos",
    "document_ids_from_position_ids",
    "document_ids_from_seq_idx",
    "document_ids_from_seq_lens",
    "document_mask_mod",
    "flatten_metadata",
    "pack_documents",
    "pack_stream",
    "packed_attention_inputs",
    "packed_position_ids",
    "pad",
    "physical_varlen_metadata",
    "safe_budget",
    "seq_idx_from_document_ids",
    "seq_lens_from_document_ids",
    "shard_packed_batch",
    "split_batch_metadata",
    "suggest_budgets",
    "thd_metadata",
    "unpad",
    "varlen_metadata",
}

DROP_IN_NAMES = {
    "DEFAULT_PACKED_SEQUENCE_CONTRACT",
    "PackedMaskType",
    "PackedSeqParams",
    "PackedSequenceContract",
    "PackedSequenceLayout",
    "PackedSequenceMetadata",
    "ShardLayout",
    "build_packed_sequence_metadata",
    "flatten_packed_sequence_metadata",
    "gather_sequence",
    "get_seqlens_in_batch",
    "get_unpad_data",
    "packed_attention_inputs",
    "packed_layout",
    "packed_seq_params_from_doc_ids",
    "resolve_packing_contract",
    "shard_cp_batch",
    "to_flash_attention_kwargs",
}


# ------------------------------------------------------------------ the layers


def test_top_level_all_is_exactly_the_core():
    assert set(packfn.__all__) == CORE_NAMES
    assert len(packfn.__all__) == len(CORE_NAMES)  # no name twice
    for name in packfn.__all__:
        assert getattr(packfn, name) is not None, name


def test_nemo_automodel_all_is_exactly_the_drop_ins():
    assert set(packfn.nemo_automodel.__all__) == DROP_IN_NAMES
    for name in packfn.nemo_automodel.__all__:
        assert getattr(packfn.nemo_automodel, name) is not None, name


def test_the_core_and_the_drop_ins_share_the_contract_types():
    for name in ("DEFAULT_PACKED_SEQUENCE_CONTRACT", "PackedMaskType", "PackedSequenceContract"):
        assert getattr(packfn.nemo_automodel, name) is getattr(packfn, name), name
    assert packfn.nemo_automodel.PackedSequenceLayout is packfn.PackedSequenceLayout


def test_import_packfn_does_not_import_the_drop_ins():
    """The core never imports the drop-in layer: checked in a fresh interpreter (this one has imported both)."""
    code = (
        "import sys\n"
        "import packfn\n"
        "assert 'packfn.nemo_automodel' not in sys.modules\n"
        "import packfn.attention, packfn.distributed, packfn.hf, packfn.packer\n"
        "leaked = sorted(name for name in sys.modules if name.startswith('packfn.nemo_automodel'))\n"
        "assert not leaked, leaked\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]


# ------------------------------------------------------------ deprecated spellings

NEMO = "packfn.nemo_automodel"

# (module, old name, new module, new name)
MOVED_NAMES = [
    *(
        ("packfn", name, NEMO, name)
        for name in (
            "PackedSeqParams",
            "PackedSequenceMetadata",
            "ShardLayout",
            "build_packed_sequence_metadata",
            "flatten_packed_sequence_metadata",
            "gather_sequence",
            "get_seqlens_in_batch",
            "get_unpad_data",
            "packed_layout",
            "packed_seq_params_from_doc_ids",
            "resolve_packing_contract",
            "shard_cp_batch",
            "to_flash_attention_kwargs",
        )
    ),
    ("packfn", "hf_model_inputs", "packfn.hf", "hf_model_inputs"),
    *(
        ("packfn.metadata", name, NEMO, name)
        for name in (
            "PackedSequenceMetadata",
            "build_packed_sequence_metadata",
            "flatten_packed_sequence_metadata",
            "get_seqlens_in_batch",
            "get_unpad_data",
        )
    ),
    ("packfn.layout", "packed_layout", NEMO, "packed_layout"),
    ("packfn.distributed", "ShardLayout", NEMO, "ShardLayout"),
    ("packfn.distributed", "shard_cp_batch", NEMO, "shard_cp_batch"),
    ("packfn.contract", "resolve_packing_contract", NEMO, "resolve_packing_contract"),
    (
        "packfn.contract",
        "_LEGACY_FLASH_ATTENTION_IMPLEMENTATIONS",
        "packfn.nemo_automodel.contract",
        "_LEGACY_FLASH_ATTENTION_IMPLEMENTATIONS",
    ),
    *(
        ("packfn.attention", name, module, name)
        for name, module in (
            ("block_causal_mask", "packfn.masks"),
            ("document_block_mask", "packfn.masks"),
            ("document_mask_mod", "packfn.masks"),
            ("PhysicalVarlenMetadata", "packfn.varlen"),
            ("physical_varlen_metadata", "packfn.varlen"),
            ("pad", "packfn.varlen"),
            ("unpad", "packfn.varlen"),
            ("packed_position_ids", "packfn.formats"),
            ("packed_attention_inputs", "packfn.contract"),
            ("PackedSeqParams", NEMO),
            ("packed_seq_params_from_doc_ids", NEMO),
            ("to_flash_attention_kwargs", NEMO),
        )
    ),
]


@pytest.mark.parametrize(
    ("module", "old", "new_module", "new"), MOVED_NAMES, ids=[f"{case[0]}.{case[1]}" for case in MOVED_NAMES]
)
def test_a_moved_name_still_works_and_warns_naming_its_new_place(module, old, new_module, new):
    with pytest.warns(DeprecationWarning, match=f"{module}.{old} is deprecated; use {new_module}.{new}") as caught:
        value = getattr(importlib.import_module(module), old)
    assert value is getattr(importlib.import_module(new_module), new)
    assert caught[0].filename == __file__  # the warning points at the code that used the old name


@pytest.mark.parametrize("module", sorted({case[0] for case in MOVED_NAMES}))
def test_an_unknown_name_is_still_an_attribute_error(module):
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        importlib.import_module(module).no_such_name  # noqa: B018


@pytest.mark.parametrize("function", [packfn.varlen_metadata, packfn.batch_metadata], ids=lambda f: f.__name__)
def test_attention_mask_keyword_still_works_and_warns(function):
    message = rf"{function.__name__}\(attention_mask=...\) is deprecated; use document_ids="
    with pytest.warns(DeprecationWarning, match=message):
        old = function(attention_mask=EXAMPLE, max_documents=2)
    assert_same(tuple(old), tuple(function(document_ids=EXAMPLE, max_documents=2)))
    assert_same(tuple(old), tuple(function(EXAMPLE, max_documents=2)))


def test_length_keyword_of_aligned_layout_still_works_and_warns():
    lengths, spans = torch.tensor([[3, 0, 5]]), torch.tensor([[4, 0, 5]])
    with pytest.warns(DeprecationWarning, match=r"aligned_layout\(length=...\) is deprecated; use budget="):
        old = packfn.aligned_layout(lengths, spans, sequence_length=9, alignment=4, length=12)
    assert_layouts_equal(old, packfn.aligned_layout(lengths, spans, sequence_length=9, alignment=4, budget=12))


@pytest.mark.parametrize(
    "call",
    [
        lambda: packfn.varlen_metadata(document_ids=EXAMPLE, attention_mask=EXAMPLE),
        lambda: packfn.batch_metadata(document_ids=EXAMPLE, attention_mask=EXAMPLE),
        lambda: packfn.aligned_layout(torch.tensor([[3]]), sequence_length=4, alignment=4, length=4, budget=4),
    ],
    ids=["varlen_metadata", "batch_metadata", "aligned_layout"],
)
def test_an_old_and_a_new_keyword_together_are_a_type_error(call):
    with pytest.raises(TypeError, match=r"got both (attention_mask|length)= and its new name (document_ids|budget)="):
        call()


def test_aligned_length_still_works_and_warns():
    with pytest.warns(DeprecationWarning, match=r"packfn\.aligned_length is deprecated; use packfn\.safe_budget"):
        assert packfn.aligned_length(9, 3, 4, 21) == packfn.safe_budget(9, 3, 4, 21) == 24
    with pytest.warns(DeprecationWarning, match="use packfn.safe_budget"):
        assert packfn.aligned_length(9, 3, 4) == packfn.safe_budget(9, 3, 4) == 16
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="sequence_length must not be negative"):
        packfn.aligned_length(-1, 3, 4)


def test_packed_batch_fill_still_works_and_warns():
    packed = pack_documents([5, 3, 6], sequence=16, alignment=4, max_documents=3)
    with pytest.warns(DeprecationWarning, match=r"PackedBatch\.fill is deprecated; use PackedBatch\.fill_ratio"):
        fill = packed.fill
    assert fill == packed.fill_ratio


@pytest.mark.parametrize("mask_type", ["block_causal", "document_ids", "flash_varlen"])
@pytest.mark.parametrize("metadata", [False, True], ids=["no_metadata", "metadata"])
def test_packed_attention_inputs_static_false_still_works_and_warns(mask_type, metadata):
    contract = packfn.contract._DefaultPackedSequenceContract(mask_type, metadata)
    tokens = EXAMPLE * 7
    message = (
        r"packed_attention_inputs\(static=False\) is deprecated; use packfn\.nemo_automodel\.packed_attention_inputs"
    )
    with pytest.warns(DeprecationWarning, match=message):
        old = packfn.packed_attention_inputs(EXAMPLE, contract, input_ids=tokens, static=False)
    assert_same(old, packfn.nemo_automodel.packed_attention_inputs(EXAMPLE, contract, input_ids=tokens))


def _deprecated_keywords(mask, seq_lens):
    flat = packfn.varlen_metadata(attention_mask=mask, max_documents=2)
    batch = packfn.batch_metadata(attention_mask=mask, max_documents=2)
    layout = packfn.aligned_layout(seq_lens, sequence_length=9, alignment=4, length=packfn.aligned_length(9, 3, 4))
    return flat.cu_seqlens, batch.cu_seqlens, layout.source_indices


def _new_keywords(mask, seq_lens):
    flat = packfn.varlen_metadata(document_ids=mask, max_documents=2)
    batch = packfn.batch_metadata(document_ids=mask, max_documents=2)
    layout = packfn.aligned_layout(seq_lens, sequence_length=9, alignment=4, budget=packfn.safe_budget(9, 3, 4))
    return flat.cu_seqlens, batch.cu_seqlens, layout.source_indices


def test_deprecated_spellings_work_silently_under_torch_compile():
    """packfn._deprecated warns in eager only: a compiled forward neither warns nor breaks its graph."""
    seq_lens = torch.tensor([[3, 0, 5]])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = traced(_deprecated_keywords)(EXAMPLE, seq_lens)
    assert not [str(warning.message) for warning in caught if issubclass(warning.category, DeprecationWarning)]
    assert_same(compiled, _new_keywords(EXAMPLE, seq_lens))
