"""NumPy on CPU tensors, for eager kernels where no device waits (NOTE [Eager kernels] in :mod:`._registry`).

An eager kernel on a CPU tensor has no device to synchronize with, so a
data-dependent size costs nothing but the call; NumPy's versions of a few
such calls are several times faster than aten's on the CPU. Everything here
returns None where NumPy is missing or the bridge fails, and the caller
takes its torch path.
"""

from __future__ import annotations

import torch

from packfn._compat import is_functorch_wrapper

try:
    import numpy
except ImportError:  # torch runs without numpy; so does packfn
    numpy = None

__all__ = ["cpu_nonzero", "numpy", "numpy_view", "numpy_views"]


def numpy_view(tensor: torch.Tensor):
    """A NumPy view of a CPU tensor's memory, or None without NumPy or where the bridge fails.

    By DLPack: unlike ``tensor.numpy()``, which marks the storage as not
    resizable for good, it leaves the tensor (a caller's input, or an output
    NumPy writes into) exactly as it was. A wrapper of functorch
    (``functionalize``, ``vmap``, ``grad``) gets none: DLPack would export
    memory that is not its values.
    """
    if numpy is None or is_functorch_wrapper(tensor):
        return None
    try:
        return numpy.from_dlpack(tensor)
    except (AttributeError, BufferError, RuntimeError, TypeError):  # an old NumPy, or a tensor DLPack refuses
        return None


def numpy_views(*tensors: torch.Tensor) -> tuple | None:
    """Writeable NumPy views of CPU ``tensors`` (see :func:`numpy_view`), or None where any is not to be had."""
    views = tuple(numpy_view(tensor) for tensor in tensors)
    return None if any(view is None or not view.flags.writeable for view in views) else views


def cpu_nonzero(flags: torch.Tensor) -> torch.Tensor | None:
    """The positions of the True entries of a 1-d bool CPU tensor, by NumPy; None without it.

    NumPy's ``flatnonzero`` of a bool array is several times faster than
    aten's CPU ``nonzero`` (18 against 78 us for 32768 flags on a 2-core
    machine). The positions come back as an int64 tensor that owns its
    memory (resizable, as aten's).
    """
    array = numpy_view(flags)
    if array is None:
        return None
    return torch.from_numpy(numpy.flatnonzero(array)).to(torch.int64, copy=True)
