"""Packing contracts and resolve_packing_contract behave exactly like nemo_automodel 0.7.0's."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
from nemo_automodel.components.datasets import packing as upstream

import packfn.nemo_automodel as drop_ins
from packfn.nemo_automodel import contract

NAMES = ["flash_attention_2", "flash_attention_3", "flash_attention_4", "sdpa", "eager", "flex_attention", ""]


def resolve(module, packing, name):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = module.resolve_packing_contract(packing, name)
    return result, [(warning.category, str(warning.message)) for warning in caught]


def test_defaults_match_upstream():
    ours, theirs = contract._DefaultPackedSequenceContract(), upstream._DefaultPackedSequenceContract()
    assert dataclasses.asdict(ours) == dataclasses.asdict(theirs)
    assert contract._LEGACY_FLASH_ATTENTION_IMPLEMENTATIONS == upstream._LEGACY_FLASH_ATTENTION_IMPLEMENTATIONS
    assert contract._DefaultPackedSequenceContract() == drop_ins.DEFAULT_PACKED_SEQUENCE_CONTRACT
    assert drop_ins.PackedMaskType.__args__ == upstream.PackedMaskType.__args__
    with pytest.raises(dataclasses.FrozenInstanceError):
        drop_ins.DEFAULT_PACKED_SEQUENCE_CONTRACT.packed_mask_type = "flash_varlen"


@pytest.mark.parametrize("name", NAMES)
def test_default_contract_resolves_like_upstream(name):
    ours, our_warnings = resolve(drop_ins, drop_ins.DEFAULT_PACKED_SEQUENCE_CONTRACT, name)
    theirs, their_warnings = resolve(upstream, upstream.DEFAULT_PACKED_SEQUENCE_CONTRACT, name)
    assert dataclasses.asdict(ours) == dataclasses.asdict(theirs)
    assert type(ours) is contract._DefaultPackedSequenceContract
    assert ours is not drop_ins.DEFAULT_PACKED_SEQUENCE_CONTRACT
    assert our_warnings == their_warnings and our_warnings[0][0] is FutureWarning


@pytest.mark.parametrize("name", NAMES)
def test_explicit_contract_is_returned_unchanged_with_a_warning(name):
    explicit = contract._DefaultPackedSequenceContract(packed_mask_type="document_ids")
    upstream_explicit = upstream._DefaultPackedSequenceContract(packed_mask_type="document_ids")
    ours, our_warnings = resolve(drop_ins, explicit, name)
    _, their_warnings = resolve(upstream, upstream_explicit, name)
    assert ours is explicit
    assert our_warnings == their_warnings and "ignored" in our_warnings[0][1]


def test_none_returns_the_contract_without_warning():
    for packing in (drop_ins.DEFAULT_PACKED_SEQUENCE_CONTRACT, contract._DefaultPackedSequenceContract("flash_varlen")):
        result, caught = resolve(drop_ins, packing, None)
        assert result is packing and caught == []


def test_warning_points_at_the_callers_caller():
    def collate():
        return drop_ins.resolve_packing_contract(drop_ins.DEFAULT_PACKED_SEQUENCE_CONTRACT, "sdpa")

    with pytest.warns(FutureWarning) as caught:
        collate()  # this line is the caller of the caller
    assert caught[0].filename == __file__


def test_resolve_packing_contract_treats_an_equal_default_contract_as_explicit():
    ours = contract._DefaultPackedSequenceContract()
    theirs = upstream._DefaultPackedSequenceContract()
    assert ours == drop_ins.DEFAULT_PACKED_SEQUENCE_CONTRACT and ours is not drop_ins.DEFAULT_PACKED_SEQUENCE_CONTRACT
    with warnings.catch_warnings(record=True) as upstream_warnings:
        warnings.simplefilter("always")
        assert upstream.resolve_packing_contract(theirs, "flash_attention_2") is theirs
    with warnings.catch_warnings(record=True) as our_warnings:
        warnings.simplefilter("always")
        assert drop_ins.resolve_packing_contract(ours, "flash_attention_2") is ours
    assert [(w.category, str(w.message)) for w in our_warnings] == [
        (w.category, str(w.message)) for w in upstream_warnings
    ]
    assert [w.category for w in our_warnings] == [FutureWarning]
    assert "ignored" in str(our_warnings[0].message)
