"""The drop-ins' trim step (packfn/nemo_automodel/_trim.py): data-dependent ints without graph breaks, rule errors."""

from __future__ import annotations

import re
from unittest import mock

import pytest
import torch

import packfn.nemo_automodel as drop_ins
from packfn._ops._registry import Rule
from packfn.nemo_automodel._trim import checked_ints, python_ints

# A drop-in's rules: one per flag of the core op, each with the message upstream raises for it.
RULES = (Rule("first rule"), Rule("upstream's second"), Rule("third rule"))


def test_python_ints_reads_values_in_eager():
    assert python_ints([torch.tensor(3), torch.tensor([5])], [10, 10]) == (3, 5)


def test_python_ints_clamps_into_the_declared_range():
    assert python_ints([torch.tensor(-2), torch.tensor(50)], [10, 10]) == (0, 10)


def test_checked_ints_names_the_first_broken_rule():
    broken = torch.tensor([False, True, True])
    with pytest.raises(ValueError, match=r"^upstream's second$"):
        checked_ints([torch.tensor(1)], [4], broken, RULES)
    with pytest.raises(ValueError, match=r"^third rule$"):
        checked_ints([torch.tensor(1)], [4], torch.tensor([False, False, True]), RULES)
    assert checked_ints([torch.tensor(1)], [4], torch.zeros(3, dtype=torch.bool), RULES) == (1,)


def test_unbacked_ints_under_compile_do_not_break_or_recompile():
    def prefix(values, broken):
        (count,) = checked_ints([values.sum()], [values.numel() * 4], broken, RULES)
        return torch.arange(count), count

    compiled = torch.compile(prefix, fullgraph=True)
    ok = torch.zeros(3, dtype=torch.bool)
    result, count = compiled(torch.tensor([1, 2, 0]), ok)
    assert count == 3 and torch.equal(result, torch.arange(3))
    with torch._dynamo.config.patch(error_on_recompile=True):
        result, count = compiled(torch.tensor([4, 2, 1]), ok)
        assert count == 7 and torch.equal(result, torch.arange(7))
        # Compiled drop-ins assert the drop-in (upstream) message, as eager raises it.
        with pytest.raises(RuntimeError, match="upstream's second"):
            compiled(torch.tensor([1, 1, 1]), torch.tensor([False, True, False]))


def test_opcheck_sizes_op():
    torch.library.opcheck(torch.ops.packfn._sizes.default, (torch.tensor([3, 0, 5]), [4, 4, 9]))


@pytest.mark.parametrize("exact", [True, False], ids=["exact_cpu_path", "static_path"])
@pytest.mark.parametrize(
    "dropin",
    [
        lambda mask: drop_ins.get_unpad_data(mask)[0],
        lambda mask: drop_ins.get_seqlens_in_batch(mask),
        lambda mask: drop_ins.build_packed_sequence_metadata(mask)["cu_seqlens"],
        lambda mask: drop_ins.packed_layout(mask, seq_lens_padded=None, input_shape=(1, 8), alignment=2).sequence_ids,
    ],
    ids=["get_unpad_data", "get_seqlens_in_batch", "build_packed_sequence_metadata", "packed_layout"],
)
def test_jit_trace_of_a_drop_in_raises_rather_than_record_data_sized_outputs(dropin, exact):
    """A trace would keep the sizes read from its example (silently wrong on other data), so the drop-ins refuse it."""
    with (
        mock.patch("packfn.nemo_automodel.metadata.exact_on_cpu", lambda *tensors: exact),
        mock.patch("packfn.nemo_automodel.layout.exact_on_cpu", lambda *tensors: exact),
        pytest.raises(RuntimeError, match=re.escape("which torch.jit.trace records as constants")),
    ):
        torch.jit.trace(dropin, torch.tensor([[1, 1, 0, 2]]))
