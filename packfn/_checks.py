"""Argument checks shared by the public functions (shapes, dtypes, static args)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

try:
    import numpy
except ImportError:  # torch runs without numpy; so does packfn
    numpy = None

__all__ = [
    "MASK_DTYPES",
    "check_mask",
    "check_positive_int",
    "cpu_nonzero",
    "exact_on_cpu",
    "numpy_views",
]

MASK_DTYPES = frozenset({torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64})


def check_mask(attention_mask: torch.Tensor, *, name: str = "attention_mask") -> None:
    """Raise ``ValueError`` unless ``attention_mask`` is a non-empty ``[batch, sequence]`` integer or bool tensor."""
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(attention_mask).__name__}")
    if attention_mask.ndim != 2:
        raise ValueError(f"{name} must have shape [batch, sequence], got {tuple(attention_mask.shape)}")
    if attention_mask.dtype not in MASK_DTYPES:
        raise ValueError(f"{name} must hold integer or bool document ids, got dtype {attention_mask.dtype}")
    if attention_mask.numel() == 0:
        raise ValueError(f"{name} must not be empty, got shape {tuple(attention_mask.shape)}")


def check_positive_int(value: object, name: str) -> int:
    """Return ``value`` if it is a positive Python int, else raise."""
    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if isinstance(value, int) and value < 1:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


def exact_on_cpu(*tensors: torch.Tensor) -> bool:
    """Whether a drop-in may work at exact sizes (NOTE [Exact sizes on the CPU] in :mod:`packfn.metadata`).

    Plain CPU tensors in eager: not traced, under no dispatch mode, no subclass.
    """
    return (
        not torch.compiler.is_compiling()
        and _get_current_dispatch_mode() is None
        and all(type(tensor) is torch.Tensor and tensor.device.type == "cpu" for tensor in tensors)
    )


def _numpy_view(tensor: torch.Tensor):
    """A NumPy view of a CPU tensor's memory, or None without NumPy or where the bridge fails.

    By DLPack: unlike ``tensor.numpy()``, which marks the storage as not
    resizable for good, it leaves the tensor (a caller's input, or an output
    NumPy writes into) exactly as it was. A wrapper of functorch
    (``functionalize``, ``vmap``, ``grad``), a plain ``torch.Tensor`` by
    type, gets none: DLPack would export memory that is not its values.
    """
    if numpy is None or torch._C._functorch.is_functorch_wrapped_tensor(tensor) or torch._is_functional_tensor(tensor):
        return None
    try:
        return numpy.from_dlpack(tensor)
    except (AttributeError, BufferError, RuntimeError, TypeError):  # an old NumPy, or a tensor DLPack refuses
        return None


def cpu_nonzero(flags: torch.Tensor) -> torch.Tensor:
    """``flags.nonzero().squeeze(1)`` for a 1-d bool CPU tensor, by NumPy where it is installed.

    NumPy's ``flatnonzero`` of a bool array is several times faster than
    aten's CPU ``nonzero`` (18 against 78 us for 32768 flags on the 2-core
    machine), and the exact CPU paths run two or three of them
    (NOTE [Exact sizes on the CPU] in :mod:`packfn.metadata`), as does
    ``physical_varlen_metadata``'s CPU eager kernel. The positions
    come back as an int64 tensor that owns its memory (resizable, as
    aten's).
    """
    array = _numpy_view(flags)
    if array is None:
        return flags.nonzero().squeeze(1)
    return torch.from_numpy(numpy.flatnonzero(array)).to(torch.int64, copy=True)


def numpy_views(*tensors: torch.Tensor) -> tuple | None:
    """Writeable NumPy views of CPU ``tensors`` (see :func:`_numpy_view`), or None where any is not to be had."""
    views = tuple(_numpy_view(tensor) for tensor in tensors)
    return None if any(view is None or not view.flags.writeable for view in views) else views
