"""Old spellings that keep working for one release, with a ``DeprecationWarning`` naming the new one.

Warned in eager only: Dynamo cannot trace ``warnings.warn``, and a
deprecated spelling must not become a graph break inside a compiled
forward (it still works there, silently).
"""

from __future__ import annotations

import functools
import importlib
import warnings
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["deprecated", "moved_names", "renamed_keywords"]


def deprecated(message: str, *, stacklevel: int = 3) -> None:
    """Warn ``message`` as a ``DeprecationWarning`` (in eager; nothing while compiling)."""
    if not torch.compiler.is_compiling():
        warnings.warn(message, DeprecationWarning, stacklevel=stacklevel)


def renamed_keywords(**renames: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Accept each old keyword (``old="new"``) for the new one, with a warning; both at once is a ``TypeError``."""

    def decorate(function: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(function)
        def call(*args: Any, **kwargs: Any) -> Any:
            for old, new in renames.items():
                if old in kwargs:
                    if new in kwargs:
                        raise TypeError(f"{function.__name__}() got both {old}= and its new name {new}=")
                    deprecated(f"{function.__name__}({old}=...) is deprecated; use {new}=...")
                    kwargs[new] = kwargs.pop(old)
            return function(*args, **kwargs)

        return call

    return decorate


def moved_names(module: str, names: dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that serves each moved name (``old: "package.module:new"``) with a warning."""

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        target, _, attribute = names[name].partition(":")
        deprecated(f"{module}.{name} is deprecated; use {target}.{attribute}", stacklevel=3)
        return getattr(importlib.import_module(target), attribute)

    return __getattr__
