"""Integer helpers shared by the ops, the core functions and the packer."""

from __future__ import annotations

__all__ = ["cdiv", "round_up"]


def cdiv(value, divisor):
    """``ceil(value / divisor)`` for non-negative ints, SymInts or integer tensors (``divisor > 0``).

    Written as one floor division of the sum, so that it stays a single
    expression for a traced size and an elementwise op for a tensor.
    """
    return (value + divisor - 1) // divisor


def round_up(value, multiple):
    """``value`` rounded up to a multiple of ``multiple`` (ints, SymInts or integer tensors, ``multiple > 0``)."""
    return cdiv(value, multiple) * multiple
