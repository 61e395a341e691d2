"""Shared benchmark inputs (SPEC section 5) and the ``Case`` record every family returns."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "FLOOR",
    "Case",
    "DataDependentOps",
    "Inputs",
    "aten_ops_of",
    "compiled_variant",
    "count_data_dependent",
    "floor_variant",
    "make_inputs",
    "round_up",
]


@dataclass
class Case:
    """One measured job: several variants of the same work, timed side by side.

    ``variants`` maps a label (``"upstream"``, ``"packfn eager"``,
    ``"packfn compiled"``, ``"clone"``, ...) to a zero-argument callable.
    Ratios are reported as ``time(baseline) / time(variant)`` (above 1 means
    the variant is faster).
    """

    family: str
    name: str
    sequence: int
    variants: dict[str, Callable[[], object]]
    baseline: str = "upstream"
    notes: dict[str, str] = field(default_factory=dict)
    floor: str | None = None
    """A variant whose time is the floor of the job (one pass over the mask); rows report time over it."""
    counts: dict[str, dict[str, int]] = field(default_factory=dict)
    """Per variant, its host reads and data-dependent ops in one call (:func:`count_data_dependent`)."""


class DataDependentOps(TorchDispatchMode):
    """Counts the aten calls of eager code that read a value back to the host, or size an output by the data.

    Host reads: ``_local_scalar_dense`` (``.item()``, ``int(t)``, ``if t``),
    ``equal``. Data-dependent ops: ``nonzero`` (``t[mask]`` and
    ``nonzero``), ``masked_select``, boolean ``index`` / ``index_put``,
    ``repeat_interleave`` and ``unique``. ``.tolist()`` reads the host without
    an aten call, so it is not seen.
    """

    HOST_READS = frozenset({"_local_scalar_dense", "equal"})
    DATA_DEPENDENT = frozenset(
        {
            "nonzero",
            "nonzero_static",
            "masked_select",
            "repeat_interleave",
            "unique_consecutive",
            "_unique2",
            "unique_dim",
        }
    )

    def __init__(self) -> None:
        super().__init__()
        self.host_reads = 0
        self.data_dependent = 0
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops[name] = self.ops.get(name, 0) + 1
        if name in self.HOST_READS:
            self.host_reads += 1
        boolean_index = name in ("index", "index_put", "index_put_") and any(
            isinstance(index, torch.Tensor) and index.dtype == torch.bool for index in (args[1] or ())
        )
        if name in self.DATA_DEPENDENT or boolean_index:
            self.data_dependent += 1
        return func(*args, **(kwargs or {}))


def count_data_dependent(function: Callable[[], object], *, decompose: bool = False) -> dict[str, int]:
    """Host reads and data-dependent ops of one call of ``function``.

    Without ``decompose``, counted under :class:`DataDependentOps` in eager
    (a packfn op is one call, whatever its eager kernel does). With it, in
    the aten graph AOTAutograd traces (packfn's ops decompose there: the
    static path that compiled, exported and GPU code runs); a host read would
    be a ``_local_scalar_dense`` node, or a graph break (``fullgraph``).
    """
    if not decompose:
        mode = DataDependentOps()
        with mode:
            function()
        return {"host_reads": mode.host_reads, "data_dependent_ops": mode.data_dependent}
    names = aten_ops_of(function)  # a boolean-mask index traces to nonzero, counted with the rest
    return {
        "host_reads": sum(names.get(name, 0) for name in DataDependentOps.HOST_READS),
        "data_dependent_ops": sum(names.get(name, 0) for name in DataDependentOps.DATA_DEPENDENT),
    }


def aten_ops_of(function: Callable[[], object]) -> dict[str, int]:
    """How often each aten op appears in the forward graph AOTAutograd traces of ``function`` (``fullgraph``)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs: list[torch.fx.GraphModule] = []

    def capture(graph_module, example_inputs):
        graphs.append(graph_module)
        return make_boxed_func(graph_module.forward)

    torch.compile(function, backend=aot_autograd(fw_compiler=capture), fullgraph=True)()
    names: dict[str, int] = {}
    for graph in graphs:
        for node in graph.graph.nodes:
            if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
                name = node.target.overloadpacket.__name__
                names[name] = names.get(name, 0) + 1
    return names


def compiled_variant(function: Callable[..., object], *args, dynamic: bool | None = None) -> Callable[[], object]:
    """A zero-argument call of ``torch.compile(function, fullgraph=True, dynamic=dynamic)`` on ``args``.

    It compiles here, before it is returned: outside the timed calls.
    """
    compiled = torch.compile(function, fullgraph=True, dynamic=dynamic)
    compiled(*args)
    return lambda: compiled(*args)


def round_up(value, multiple: int):
    """``value`` (an int or an integer tensor) rounded up to a multiple of ``multiple``."""
    return -(-value // multiple) * multiple


FLOOR = "floor: (mask > 0).sum()"


def floor_variant(mask: torch.Tensor) -> dict[str, Callable[[], object]]:
    """The floor of a mask op: one pass over the mask (SPEC section 6)."""
    return {FLOOR: lambda: (mask > 0).sum()}


@dataclass
class Inputs:
    """SPEC section 5 inputs: ``batch`` rows of exponential-length documents.

    Attributes:
        batch, sequence, mean: the shape and mean document length.
        lengths: per row, the document lengths (rows filled until the next
            document would not fit, the rest padding).
        device: where tensors live.
    """

    batch: int
    sequence: int
    mean: int
    lengths: list[list[int]]
    device: torch.device
    hidden: int = 1024

    @cached_property
    def max_documents(self) -> int:
        """The most documents in any row (a packer's real cap)."""
        return max(1, max(len(row) for row in self.lengths))

    @cached_property
    def document_ids(self) -> torch.Tensor:
        """int64 ``[batch, sequence]``: 1-based document ids, 0 at padding."""
        mask = torch.zeros(self.batch, self.sequence, dtype=torch.int64)
        for row, lengths in enumerate(self.lengths):
            start = 0
            for document, length in enumerate(lengths, start=1):
                mask[row, start : start + length] = document
                start += length
        return mask.to(self.device)

    @cached_property
    def seq_lens(self) -> torch.Tensor:
        """int64 ``[batch, max_documents]``: document lengths, 0 for absent slots."""
        table = torch.zeros(self.batch, self.max_documents, dtype=torch.int64)
        for row, lengths in enumerate(self.lengths):
            table[row, : len(lengths)] = torch.tensor(lengths, dtype=torch.int64)
        return table.to(self.device)

    @cached_property
    def values(self) -> torch.Tensor:
        """float32 ``[batch, sequence, hidden]`` activations."""
        generator = torch.Generator().manual_seed(1)
        return torch.randn(self.batch, self.sequence, self.hidden, generator=generator).to(self.device)


def make_inputs(
    sequence: int, mean: int, *, batch: int = 8, seed: int = 0, device: str | torch.device = "cpu", hidden: int = 1024
) -> Inputs:
    """Draw document lengths from an exponential distribution (at least 1 token)."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(batch):
        lengths, used = [], 0
        while True:
            uniform = torch.rand((), generator=generator).item()
            length = max(1, math.ceil(-mean * math.log1p(-uniform)))
            if used + length > sequence:
                break
            lengths.append(length)
            used += length
        rows.append(lengths)
    return Inputs(batch, sequence, mean, rows, torch.device(device), hidden)
