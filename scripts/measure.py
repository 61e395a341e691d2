"""How the scripts time and count: device synchronization, a counting Inductor backend, graph-break counts."""

from __future__ import annotations

import torch
from torch._dynamo.utils import counters

__all__ = ["CountingInductor", "graph_breaks", "graph_breaks_since", "synchronize"]


def synchronize(device: str | torch.device) -> None:
    """Wait for ``device``'s queued work (CUDA), so that a clock read after it times the work, not its launch."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


class CountingInductor:
    """A ``torch.compile`` backend: Inductor, recording the compile id of every graph it is handed.

    A compile id ``(frame_id, frame_compile_id)`` names a frame and how many
    times it was compiled before: a graph with ``frame_compile_id > 0`` is a
    recompile (a guard failed: a new shape or value). Frames created by
    graph breaks (resume functions) have frame ids of their own.
    """

    def __init__(self) -> None:
        self.compile_ids: list[tuple[int, int]] = []

    def __call__(self, graph_module, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        compile_id = torch._guards.CompileContext.current_compile_id()
        if compile_id is not None and compile_id.frame_id is not None:
            self.compile_ids.append((compile_id.frame_id, compile_id.frame_compile_id or 0))
        return compile_fx(graph_module, example_inputs)

    @property
    def graphs(self) -> int:
        """Graphs compiled (each frame compile that captured one)."""
        return len(self.compile_ids)

    @property
    def frames(self) -> int:
        """Distinct frames compiled."""
        return len({frame for frame, _ in self.compile_ids})

    @property
    def recompiles(self) -> int:
        """Graphs compiled for a frame that had been compiled before."""
        return sum(1 for _, attempt in self.compile_ids if attempt > 0)


def graph_breaks() -> dict[str, int]:
    """Dynamo's graph breaks so far in this process, by reason (a snapshot for :func:`graph_breaks_since`)."""
    return dict(counters["graph_break"])


def graph_breaks_since(before: dict[str, int]) -> dict[str, int]:
    """The graph breaks, by reason, that Dynamo counted after the snapshot ``before`` of :func:`graph_breaks`."""
    return {
        reason: count - before.get(reason, 0)
        for reason, count in graph_breaks().items()
        if count > before.get(reason, 0)
    }
