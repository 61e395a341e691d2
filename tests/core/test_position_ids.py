"""Position ids that restart per document: against a reference, compiled, and against NeMo AutoModel's collater."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import sys
import types
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch._inductor.utils import run_and_get_code

import packfn

from tests.references import position_ids_reference
from tests.strategies import packing_masks

SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
EXAMPLE = torch.tensor(
    [[1, 1, 1, 0, 2, 2, 3, 0, 0, 4, 4, 4, 4, 4, 4, 0], [0, 0, 1, 1, 1, 1, 1, 1, 1, 2, 3, 3, 0, 0, 0, 0]]
)


@SETTINGS
@given(packing_masks(max_batch=4, max_sequence=48))
@example(torch.zeros(2, 3, dtype=torch.int64))
def test_packed_position_ids_match_reference(mask):
    ours = packfn.packed_position_ids(mask)
    assert ours.dtype == torch.int64
    assert torch.equal(ours, position_ids_reference(mask))


def test_packed_position_ids_compile_dynamic_with_no_fallback():
    compiled = torch.compile(packfn.packed_position_ids, fullgraph=True, dynamic=True)
    for mask in (EXAMPLE, torch.tensor([[0, 3, 3, 0, 3, 7, 7, 9] + [9] * 30 + [0, 0]] * 3)):
        torch._dynamo.reset()
        result, code = run_and_get_code(compiled, mask)
        assert torch.equal(result, position_ids_reference(mask))
        assert not any("torch.ops.packfn" in source for source in code)


def test_packed_position_ids_assert_decreasing_ids():
    with pytest.raises(RuntimeError, match="document ids must not decrease"):
        packfn.packed_position_ids(torch.tensor([[2, 2, 1]]))


@functools.cache
def upstream_pad_pack():
    """NeMo AutoModel's ``_tensorize_and_pad_pack``, loaded from its file.

    Its module imports Hugging Face ``datasets`` for other functions; where
    that is not installed, a stub stands in while the module loads
    (``_pad_pack`` does not use it).
    """
    import nemo_automodel

    path = nemo_automodel.__path__[0] + "/components/datasets/llm/packed_sequence.py"
    stub = (
        {}
        if importlib.util.find_spec("datasets")
        else {"datasets": types.SimpleNamespace(Dataset=type("Dataset", (), {}), DatasetDict=dict)}
    )
    spec = importlib.util.spec_from_file_location("packfn_tests_upstream_packed_sequence", path)
    module = importlib.util.module_from_spec(spec)
    # Patch only with a stub: patch.dict takes back every module imported inside it, datasets' too, and a second
    # import of datasets then fails (pyarrow keeps its extension types registered).
    with mock.patch.dict(sys.modules, stub) if stub else contextlib.nullcontext():
        spec.loader.exec_module(module)
    return module._tensorize_and_pad_pack


@SETTINGS
@given(st.lists(st.lists(st.integers(1, 12), min_size=1, max_size=6), min_size=1, max_size=3), st.integers(0, 7))
def test_packed_position_ids_equal_nemo_collater(rows, slack):
    """The collater's position ids (restart per document, trailing padding continues the last one)."""
    pad_pack = upstream_pad_pack()
    sequence = max(sum(lengths) for lengths in rows) + slack
    expected, mask = [], []
    for lengths in rows:
        positions = [p for n in lengths for p in range(n)]
        pack = {"input_ids": positions, "labels": positions, "position_ids": positions, "seq_lens": lengths}
        expected.append(pad_pack(pack, padding_idx=0, packed_sequence_size=sequence)["position_ids"])
        ids = [d + 1 for d, n in enumerate(lengths) for _ in range(n)]
        mask.append(ids + [0] * (sequence - len(ids)))
    assert torch.equal(packfn.packed_position_ids(torch.tensor(mask)), torch.stack(expected))
