"""The op machinery: data-dependent ints without graph breaks, rule flags turned into errors."""

from __future__ import annotations

import pytest
import torch

from packfn._ops._registry import Rule, assert_rules, checked_ints, python_ints

RULES = (Rule("first rule"), Rule("second rule", "upstream's second"), Rule("third rule"))


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


def test_assert_rules_raises_with_the_rule_in_eager():
    with pytest.raises(RuntimeError, match="third rule"):
        assert_rules(torch.tensor([False, False, True]), RULES)


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
