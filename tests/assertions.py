"""Assertions shared by the test modules."""

from __future__ import annotations

import torch

from tests.strategies_layout import LAYOUT_FIELDS


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


def assert_same_outcome(ours, theirs) -> None:
    """Two :func:`outcome` s: the same result (:func:`assert_same`), or the same error type and message."""
    assert ours[0] == theirs[0], (ours, theirs)
    if ours[0] == "ok":
        assert_same(ours[1], theirs[1])
    else:
        assert ours[1:] == theirs[1:]


def assert_layouts_equal(actual, expected) -> None:
    """Two ``PackedSequenceLayout`` s (packfn's or upstream's) with equal fields, dtypes and devices."""
    for name in LAYOUT_FIELDS:
        left, right = getattr(actual, name), getattr(expected, name)
        assert left.dtype == right.dtype and left.device == right.device, name
        assert left.shape == right.shape and torch.equal(left, right), name


def assert_all_equal(actual, expected) -> None:
    """Two sequences of tensors, equal one for one in dtype, shape and value."""
    assert len(actual) == len(expected)
    for left, right in zip(actual, expected, strict=True):
        assert left.dtype == right.dtype and left.shape == right.shape
        torch.testing.assert_close(left, right, rtol=0, atol=0)


def assert_same_math(actual, expected, mask, atol=1e-10, rtol=1e-10) -> None:
    """Two ``(output, (grad_q, grad_k, grad_v))`` of :func:`tests.references.forward_backward`, equal at valid tokens.

    And no gradient at padding: no query reads it, and padding outputs carry none.
    """
    valid = (mask != 0).reshape(*mask.shape, 1, 1)
    for got, want in zip((actual[0], *actual[1]), (expected[0], *expected[1]), strict=True):
        torch.testing.assert_close(got.to(want.dtype) * valid, want * valid, atol=atol, rtol=rtol)
    for grad in actual[1]:  # no query reads padding, and padding outputs carry no gradient
        assert not (grad * ~valid).any()


def assert_same_outputs(op, *args, body=None) -> None:
    """An op's eager kernel (or ``body``) and decomposition agree (NOTE [Eager kernels]): equal outputs where
    no rule breaks, otherwise the same first broken rule."""
    expected, actual = op.math(*args), (body or op.eager)(*args)
    if expected.broken.any() or actual.broken.any():
        assert expected.broken.any() and actual.broken.any(), (args, expected.broken, actual.broken)
        assert int(expected.broken.int().argmax()) == int(actual.broken.int().argmax()), (args, expected, actual)
    else:
        assert_same(tuple(actual), tuple(expected))
