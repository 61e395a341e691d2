"""Assertions shared by the test modules."""

from __future__ import annotations

import torch


def assert_same(actual, expected) -> None:
    """Equal values, dtypes, shapes and Python types, recursively."""
    assert type(actual) is type(expected), (type(actual), type(expected))
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype
        assert actual.shape == expected.shape
        assert actual.device == expected.device
        assert torch.equal(actual, expected), (actual, expected)
    elif isinstance(expected, dict):
        assert list(actual) == list(expected)
        for key in expected:
            assert_same(actual[key], expected[key])
    elif isinstance(expected, (tuple, list)):
        assert len(actual) == len(expected)
        for left, right in zip(actual, expected, strict=True):
            assert_same(left, right)
    else:
        assert actual == expected


def outcome(function, *args, **kwargs):
    """``("ok", result)`` or ``("error", type, message)``: what a call did."""
    try:
        return ("ok", function(*args, **kwargs))
    except Exception as error:  # the oracle's exception is the thing compared
        return ("error", type(error), str(error))


def assert_same_outputs(op, *args) -> None:
    """An op's eager kernel and decomposition agree (NOTE [Eager kernels]): equal outputs where no rule
    breaks, otherwise the same first broken rule."""
    expected, actual = op.math(*args), op.eager(*args)
    if expected.broken.any() or actual.broken.any():
        assert expected.broken.any() and actual.broken.any(), (args, expected.broken, actual.broken)
        assert int(expected.broken.int().argmax()) == int(actual.broken.int().argmax()), (args, expected, actual)
    else:
        assert_same(tuple(actual), tuple(expected))
