"""Running a test's worker on several local processes: a free port, and each rank's result collected."""

from __future__ import annotations

import queue as queue_module
import socket
import time
from typing import Any

__all__ = ["collect", "free_port", "no_result"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a rendezvous)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def collect(processes: list, queue, deadline_s: float) -> list[Any]:
    """Start ``processes`` (rank ``r`` at index ``r``), which put ``(rank, result)`` on ``queue``; each rank's result.

    The parent polls: it stops waiting once every rank has reported or
    exited, or after ``deadline_s`` seconds, then joins the processes and
    kills what still runs. A rank that gave nothing has None
    (:func:`no_result` says why).
    """
    for process in processes:
        process.start()
    results: list[Any] = [None] * len(processes)
    deadline = time.monotonic() + deadline_s
    while None in results and time.monotonic() < deadline:
        try:
            rank, result = queue.get(timeout=0.5)
            results[rank] = result
        except queue_module.Empty:
            if not any(process.is_alive() for process in processes) and queue.empty():
                break
    for process in processes:
        process.join(timeout=5)
        if process.is_alive():
            process.kill()
            process.join()
    return results


def no_result(rank: int, process) -> str:
    """Why rank ``rank`` has no result: its exit code (None: it was killed at the deadline)."""
    return f"rank {rank} gave no result (exit code {process.exitcode})"
