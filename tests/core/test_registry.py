"""The op machinery: rule flags turned into sync-free asserts (NOTE [One way to report a broken rule])."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
import torch

import packfn
import packfn.distributed
import packfn.nemo_automodel
from packfn._ops._registry import ASSERT_MESSAGE_BYTES, Rule, assert_rules, device_assert

RULES = (Rule("first rule"), Rule("second rule"), Rule("third rule"))


def test_assert_rules_raises_with_the_rule_in_eager():
    with pytest.raises(RuntimeError, match="third rule"):
        assert_rules(torch.tensor([False, False, True]), RULES)


# ------------------------------------------ NOTE [Assert messages fit CUDA's buffer]

PACKFN = Path(packfn.__file__).parent
WIDEST = -(2**63)  # the widest int a named value can print: 20 characters


def _calls(tree: ast.AST, name: str) -> list[ast.Call]:
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and (getattr(node.func, "attr", None) == name or getattr(node.func, "id", None) == name)
    ]


def _sources() -> dict[str, ast.Module]:
    return {str(path.relative_to(PACKFN)): ast.parse(path.read_text()) for path in sorted(PACKFN.rglob("*.py"))}


def test_device_assert_refuses_a_message_cuda_would_refuse():
    device_assert(torch.tensor(True), "x" * ASSERT_MESSAGE_BYTES)
    with pytest.raises(AssertionError, match="255 bytes, past the 254 CUDA takes"):
        device_assert(torch.tensor(True), "x" * (ASSERT_MESSAGE_BYTES + 1))
    with pytest.raises(AssertionError, match="past the 254"):  # bytes, not characters
        device_assert(torch.tensor(True), "é" * 128)


def test_only_device_assert_calls_torch_assert_async():
    """Every sync-free assert goes through the one function that holds its message to CUDA's limit."""
    callers = [name for name, tree in _sources().items() for _ in _calls(tree, "_assert_async")]
    assert callers == ["_ops/_registry.py"], f"torch._assert_async called outside device_assert: {callers}"


def _message_builders():
    """Every function that puts a value into a message, called with int64's widest values."""
    from packfn._ops import formats, layout, metadata
    from packfn.distributed import balanced

    return {
        "mask_rules": metadata.mask_rules(WIDEST, "attention_mask"),
        "layout_rules": layout.layout_rules(WIDEST),
        "position_id_rules": formats.position_id_rules(WIDEST),
        "eos_rules": formats.eos_rules(WIDEST),
        "fit_message": (Rule(balanced.fit_message(WIDEST, WIDEST)),),
    }


def test_every_message_builder_is_measured():
    """A new function that formats values into a message joins :func:`_message_builders`."""
    builders = {
        function.name
        for tree in _sources().values()
        for function in ast.walk(tree)
        if isinstance(function, ast.FunctionDef) and _calls(function, "named_value")
    }
    assert builders == set(_message_builders()), builders ^ set(_message_builders())


def _all_rules():
    for name, rules in _message_builders().items():
        for rule in rules:
            yield name, rule
    for module in sorted(sys.modules):
        if module == "packfn" or module.startswith("packfn."):
            for name, value in vars(sys.modules[module]).items():
                rules = value if isinstance(value, tuple) else (value,)
                if rules and all(isinstance(rule, Rule) for rule in rules):
                    yield from ((f"{module}.{name}", rule) for rule in rules)


@pytest.mark.parametrize("name", sorted({name for name, _ in _all_rules()}))
def test_every_rule_message_fits_cuda_at_the_widest_values(name):
    for rule_name, rule in _all_rules():
        if rule_name == name:
            size = len(rule.message.encode())
            assert size <= ASSERT_MESSAGE_BYTES, f"{name}: {size} bytes: {rule.message}"
