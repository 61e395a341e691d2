"""The op machinery: rule flags turned into sync-free asserts (NOTE [One way to report a broken rule])."""

from __future__ import annotations

import pytest
import torch

from packfn._ops._registry import Rule, assert_rules

RULES = (Rule("first rule"), Rule("second rule"), Rule("third rule"))


def test_assert_rules_raises_with_the_rule_in_eager():
    with pytest.raises(RuntimeError, match="third rule"):
        assert_rules(torch.tensor([False, False, True]), RULES)
