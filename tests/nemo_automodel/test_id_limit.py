"""build_packed_sequence_metadata sizes its rows by the largest id: ids past 2**62 - 1 get one clear error."""

from __future__ import annotations

import pytest
import torch

import packfn.nemo_automodel as nemo

MESSAGE = r"a document id above 4611686018427387903 cannot size build_packed_sequence_metadata's cu_seqlens"


COMPILED = torch.compile(nemo.build_packed_sequence_metadata, fullgraph=True)


@pytest.mark.parametrize("largest", [2**62, 2**63 - 1])
@pytest.mark.parametrize("exact_cpu_path", [True, False], ids=["exact_cpu_path", "static_path"])
def test_an_id_past_the_limit_raises_a_clear_error_eager(largest, exact_cpu_path, monkeypatch):
    if not exact_cpu_path:
        monkeypatch.setattr("packfn.nemo_automodel.metadata.exact_on_cpu", lambda *tensors: False)
    with pytest.raises(ValueError, match=MESSAGE):
        nemo.build_packed_sequence_metadata(torch.tensor([[1, largest, 0], [1, 1, 0]]))


@pytest.mark.parametrize("largest", [2**62, 2**63 - 1])
def test_an_id_past_the_limit_asserts_the_same_message_compiled(largest):
    with pytest.raises(RuntimeError, match=MESSAGE):
        COMPILED(torch.tensor([[1, largest, 0], [1, 1, 0]]))


def test_the_other_rules_are_reported_first():
    with pytest.raises(ValueError, match="must not decrease"):
        nemo.build_packed_sequence_metadata(torch.tensor([[2**62, 1, 0]]))


def test_ids_up_to_the_limit_keep_upstreams_width():
    metadata = nemo.build_packed_sequence_metadata(torch.tensor([[1, 1, 40, 0]]))
    assert metadata["cu_seqlens"].shape == (1, 41)
