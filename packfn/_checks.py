"""Argument checks (types, shapes, dtypes, static arguments) shared by every public function.

They raise at call time, in eager and while tracing; checks of data are the
ops' rule flags instead (NOTE [One way to report a broken rule] in
:mod:`packfn._ops._registry`).
"""

from __future__ import annotations

import math
import numbers

import torch

__all__ = [
    "MASK_DTYPES",
    "check_bool",
    "check_fits_int64",
    "check_gatherable",
    "check_int",
    "check_int_or_none",
    "check_integer_tensor",
    "check_mask",
    "check_padding_mask",
    "check_positive_int",
    "check_scalar_fits",
    "check_table",
    "check_tensor",
    "check_token_ids",
    "integer_range",
    "is_int",
]

MASK_DTYPES = frozenset({torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64})
"""The dtypes a document-id mask may have."""
_MASK_DTYPE_NAMES = "bool, uint8, int8, int16, int32 or int64"


def is_int(value: object) -> bool:
    """Whether ``value`` is a Python int or a SymInt (a traced size), bools excluded."""
    return isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool)


def check_int(value: object, name: str, *, minimum: int | None = None) -> int:
    """Return ``value`` if it is an int64 (or a SymInt) of at least ``minimum``; raise ``TypeError`` / ``ValueError``.

    A SymInt is not compared with ``minimum``: that would guard on it.
    """
    if not is_int(value):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if isinstance(value, int) and not -(2**63) <= value < 2**63:  # every size and index here is an int64
        raise ValueError(f"{name}={value} is outside [{-(2**63)}, {2**63 - 1}], which torch.int64 cannot hold")
    if minimum is not None and isinstance(value, int) and value < minimum:
        bound = {0: "must not be negative", 1: "must be positive"}.get(minimum, f"must be at least {minimum}")
        raise ValueError(f"{name} {bound}, got {value}")
    return value


def check_positive_int(value: object, name: str) -> int:
    """Return ``value`` if it is a positive int (or a SymInt), else raise."""
    return check_int(value, name, minimum=1)


def check_tensor(value: object, name: str) -> torch.Tensor:
    """Return ``value`` if it is a tensor, else raise ``TypeError``."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def check_integer_tensor(value: object, name: str) -> torch.Tensor:
    """Return ``value`` if it is a tensor of integers (not bool), else raise ``TypeError`` / ``ValueError``."""
    check_tensor(value, name)
    if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
        raise ValueError(f"{name} must hold integers, got dtype {value.dtype}")
    return value


def check_mask(document_ids: object, *, name: str = "document_ids") -> torch.Tensor:
    """Return ``document_ids`` if it is a non-empty ``[batch, sequence]`` integer or bool tensor, else raise."""
    check_tensor(document_ids, name)
    if document_ids.ndim != 2:
        raise ValueError(f"{name} must have shape [batch, sequence], got {tuple(document_ids.shape)}")
    if document_ids.dtype not in MASK_DTYPES:
        raise ValueError(
            f"{name} must hold integer or bool document ids ({_MASK_DTYPE_NAMES}), got dtype {document_ids.dtype}"
        )
    if document_ids.numel() == 0:
        raise ValueError(f"{name} must not be empty, got shape {tuple(document_ids.shape)}")
    return document_ids


def check_int_or_none(value: object, name: str, *, minimum: int | None = None) -> int | None:
    """Return ``value`` if it is None or an int (or a SymInt) of at least ``minimum``, else raise."""
    return None if value is None else check_int(value, name, minimum=minimum)


def check_bool(value: object, name: str) -> bool:
    """Return ``value`` if it is a Python bool, else raise ``TypeError``."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def check_table(tensor: object, name: str, *, ranks: tuple[int, ...] = (2,), uint64: bool = False) -> torch.Tensor:
    """Return ``tensor`` if it is a non-empty integer (not bool) tensor of one of ``ranks``, else raise.

    uint64 only where ``uint64``: the ops read tables as int64, where its
    values from ``2**63`` on would turn negative (``-1``, a marker).
    """
    check_integer_tensor(tensor, name)
    if tensor.dtype == torch.uint64 and not uint64:
        raise ValueError(f"{name} must not be uint64: the ops read it as int64, where 2**63 and above turn negative")
    if tensor.ndim not in ranks:
        shapes = " or ".join({1: "[n]", 2: "[batch, sequence]"}.get(rank, f"rank {rank}") for rank in ranks)
        raise ValueError(f"{name} must have shape {shapes}, got {tuple(tensor.shape)}")
    if tensor.numel() == 0:
        raise ValueError(f"{name} must not be empty, got shape {tuple(tensor.shape)}")
    return tensor


def check_padding_mask(attention_mask: object, shape, name: str = "attention_mask") -> torch.Tensor | None:
    """Return ``attention_mask`` if it is None or an integer or bool tensor of ``shape``, else raise.

    ``shape`` may be None (any ``[batch, sequence]``).
    """
    if attention_mask is None:
        return None
    check_tensor(attention_mask, name)
    if attention_mask.dtype not in MASK_DTYPES:
        raise ValueError(
            f"{name} must hold integers or bools ({_MASK_DTYPE_NAMES}; nonzero: a real token), "
            f"got dtype {attention_mask.dtype}"
        )
    if attention_mask.ndim != 2 or (shape is not None and tuple(attention_mask.shape) != tuple(shape)):
        expected = "[batch, sequence]" if shape is None else str(tuple(shape))
        raise ValueError(f"{name} must have shape {expected}, got {tuple(attention_mask.shape)}")
    return attention_mask


def check_same_device(tensor: torch.Tensor | None, name: str, other: torch.Tensor, other_name: str) -> None:
    """Raise ``ValueError`` where ``tensor`` (None passes) is not on ``other``'s device: torch's errors name neither."""
    if tensor is not None and tensor.device != other.device:
        raise ValueError(f"{name} is on {tensor.device} but {other_name} on {other.device}: put them on one device")


def check_token_ids(token_ids: object, name: str, *, vocab_size: int | None = None) -> list[int]:
    """One token id or several as a list of ints, each in ``[0, vocab_size)`` (or not negative); else raise."""
    ids = [token_ids] if is_int(token_ids) else token_ids
    if not isinstance(ids, (list, tuple)) or not ids or not all(is_int(token) for token in ids):
        raise TypeError(f"{name} must be an int or a non-empty list of ints, got {token_ids!r}")
    for token in ids:
        if isinstance(token, int) and (token < 0 or (vocab_size is not None and token >= vocab_size)):
            where = "must not be negative" if vocab_size is None else f"is outside the vocabulary [0, {vocab_size})"
            raise ValueError(f"{name} {token} {where}")
    return list(ids)


def check_fits_int64(tensor: torch.Tensor, name: str, what: str = "values") -> None:
    """Raise ``ValueError`` where a uint64 ``tensor`` holds values of ``2**63`` or more (negative as int64)."""
    if tensor.dtype == torch.uint64 and tensor.numel() and bool((tensor.view(torch.int64) < 0).any()):
        raise ValueError(f"{name} holds {what} of 2**63 or more, which int64 cannot hold")


def check_gatherable(dtype: torch.dtype, name: str) -> None:
    """Raise ``ValueError`` for a dtype torch's gather and scatter kernels lack (uint16 / 32 / 64, 8-bit floats)."""
    if not (dtype.itemsize >= 2 if dtype.is_floating_point else dtype.is_complex or dtype in MASK_DTYPES):
        raise ValueError(
            f"{name} must be bool, an integer dtype up to int64 (not uint16, uint32 or uint64) or a floating "
            f"dtype of at least 16 bits, which torch's gathers support; got {dtype}"
        )


def integer_range(dtype: torch.dtype) -> tuple[int, int]:
    """The smallest and largest value an integral (or bool) ``dtype`` holds."""
    if dtype == torch.bool:
        return 0, 1
    info = torch.iinfo(dtype)
    return info.min, info.max


def check_scalar_fits(value: object, dtype: torch.dtype, name: str) -> int | float:
    """``value`` as ``dtype`` holds it (an int, or a float for a floating ``dtype``); else raise.

    ``TypeError`` for a non-number; ``ValueError`` where writing it into
    ``dtype`` would wrap, truncate or overflow: a fraction, infinity or NaN for
    an integral ``dtype``, an integer outside its range, a finite value past a
    floating ``dtype``'s largest finite value, an integer a floating ``dtype``
    would round (a float may round: infinity and NaN pass as they are).
    The float checks are comparisons only, which ``torch.compile`` traces on a
    float input as guards on its range (no recompile for another value).
    """
    if isinstance(value, torch.Tensor) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be an int or a float, got {type(value).__name__}")
    if dtype.is_complex:
        dtype = dtype.to_real()  # a real scalar fills the real part
    if dtype.is_floating_point:
        limit = torch.finfo(dtype).max
        if isinstance(value, numbers.Integral):
            if abs(value) > limit:
                raise ValueError(f"{name}={value!r} is outside [{-limit}, {limit}], the finite values of {dtype}")
            held = float(torch.tensor(float(value), dtype=torch.float64).to(dtype))
            if held != value:  # an exact comparison of an int and a float
                raise ValueError(f"{name}={value!r} is not exactly a value of {dtype}, which would round it to {held}")
            return held
        number = float(value)
        if number == number and limit < abs(number) < math.inf:  # NaN and infinities pass as they are
            raise ValueError(f"{name}={value!r} is outside [{-limit}, {limit}], the finite values of {dtype}")
        return number
    if not isinstance(value, numbers.Integral):
        number = float(value)
        if number != number or abs(number) == math.inf or number != int(number):
            raise ValueError(f"{name}={value!r} is not an integer, which {dtype} would truncate")
    low, high = integer_range(dtype)
    if not low <= int(value) <= high:
        raise ValueError(f"{name}={value!r} is outside [{low}, {high}], which {dtype} cannot hold")
    return int(value)
