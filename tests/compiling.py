"""Helpers shared by the tests that compile or export: tracers, exported callables, generated code."""

from __future__ import annotations

import contextlib
import functools
from unittest import mock

import torch
from torch._inductor.graph import GraphLowering

# Dynamo and AOTAutograd trace the same graphs, decompositions and asserts
# as for Inductor without Inductor's C++ build: for tests about what is
# traced (guards, unbacked sizes, the checks a drop-in emits while
# compiling), which keeps them fast.
traced = functools.partial(torch.compile, fullgraph=True, backend="aot_eager")


class Fn(torch.nn.Module):
    """A module whose forward is ``fn`` (to export plain functions)."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def export_dynamic(module: torch.nn.Module, args: tuple, dynamic_shapes: tuple) -> torch.nn.Module:
    """``module`` exported with ``dynamic_shapes`` (one entry per positional input), as a callable module."""
    if isinstance(module, Fn):
        dynamic_shapes = {"args": dynamic_shapes}
    return torch.export.export(module, args, dynamic_shapes=dynamic_shapes).module()


def packfn_nodes(program) -> set[str]:
    """The ``packfn.*`` call targets of an exported program's graph."""
    return {str(node.target) for node in program.graph.nodes if str(node.target).startswith("packfn.")}


def no_packfn_fallback(code: str) -> None:
    """Inductor's code calls no packfn op (each op decomposed into fused kernels)."""
    assert "torch.ops.packfn" not in code
    assert "packfn::" not in code


@contextlib.contextmanager
def generated_code():
    """Collect Inductor's output code (``run_and_get_code`` without its ``torch._dynamo.reset()``)."""
    codes: list[str] = []
    with mock.patch.object(GraphLowering, "save_output_code", codes.append):
        yield codes
