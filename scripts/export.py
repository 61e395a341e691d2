"""Export the example model (``examples/packed_decoder.py``), lower it, package it with AOTInductor and run the package.

Steps, each checked:

1. ``torch.export.export`` of ``PackedDecoder`` on ``(input_ids, document_ids)``:
   the packfn ops stay whole, one ``packfn.*`` node each;
2. ``ExportedProgram.run_decompositions()``: no ``packfn.*`` node is left
   (the ops lower to aten), and the decomposed program matches eager;
3. ``torch._inductor.aoti_compile_and_package`` writes a ``.pt2`` (into
   ``--out``, or a temporary folder), ``torch._inductor.aoti_load_package``
   loads it, and its logits match eager (``allclose``) on batches other than
   the one exported with (same shape, different documents).

    python scripts/export.py                              # small sizes
    python scripts/export.py --batch 2 --sequence 64 --hidden 32 --layers 1 --out /tmp/pt2
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a file: import from the repository root (scripts/__init__.py)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from examples.packed_decoder import PackedDecoder
from scripts.batches import add_model_arguments, batches_and_config

__all__ = ["ExportReport", "main", "packfn_nodes", "run"]


def packfn_nodes(program: torch.export.ExportedProgram) -> Counter[str]:
    """The ``packfn.*`` call nodes of an exported program, by op name."""
    return Counter(
        str(node.target)
        for node in program.graph.nodes
        if node.op == "call_function" and str(node.target).startswith("packfn.")
    )


@dataclass
class ExportReport:
    """What :func:`run` checked."""

    exported_packfn_nodes: dict[str, int]
    decomposed_packfn_nodes: dict[str, int]
    decomposed_max_error: float
    package_path: str
    package_bytes: int
    aoti_max_errors: list[float] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return bool(self.exported_packfn_nodes) and not self.decomposed_packfn_nodes and bool(self.aoti_max_errors)

    def lines(self) -> list[str]:
        nodes = ", ".join(f"{name} x{count}" for name, count in sorted(self.exported_packfn_nodes.items()))
        times = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.seconds.items())
        errors = ", ".join(f"{error:.1e}" for error in self.aoti_max_errors)
        return [
            "== packfn export report ==",
            f"torch.export:        packfn nodes: {nodes or 'NONE'}",
            f"run_decompositions:  packfn nodes left: {sum(self.decomposed_packfn_nodes.values())}, "
            f"max |decomposed - eager| {self.decomposed_max_error:.1e}",
            f"AOTInductor package: {self.package_path} ({self.package_bytes / 1e6:.1f} MB)",
            f"loaded package:      max |aoti - eager| per batch: {errors} (allclose)",
            f"times:               {times}",
            f"result:              {'OK' if self.ok else 'FAILED'}",
        ]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser, batch=2, sequence=128, mean=32, hidden=64, layers=2, vocab=128)
    parser.add_argument("--batches", type=int, default=3, help="batches the loaded package is checked on")
    parser.add_argument("--out", type=Path, default=None, help="folder for packed_decoder.pt2 (default: temporary)")
    parser.add_argument("--atol", type=float, default=1e-4)
    parser.add_argument("--rtol", type=float, default=1e-4)
    return parser.parse_args(argv)


def _max_error(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float, what: str) -> float:
    if not torch.allclose(actual, expected, atol=atol, rtol=rtol):
        raise AssertionError(f"{what} differs from eager: max |diff| {(actual - expected).abs().max().item():.3e}")
    return (actual - expected).abs().max().item()


def run(arguments: argparse.Namespace) -> ExportReport:
    """Export, decompose, package, load and check (raises ``AssertionError`` on a failed check)."""
    device = torch.device(arguments.device)
    batches, config = batches_and_config(arguments, arguments.batches + 1)
    torch.manual_seed(0)
    model = PackedDecoder(config).to(device).eval()
    example = (batches[0].input_ids, batches[0].document_ids)
    seconds = {}

    with torch.no_grad():
        begin = time.perf_counter()
        exported = torch.export.export(model, example)
        seconds["export"] = time.perf_counter() - begin
        exported_nodes = packfn_nodes(exported)
        if not exported_nodes:
            raise AssertionError("torch.export kept no packfn.* node (the ops were traced through)")

        begin = time.perf_counter()
        decomposed = exported.run_decompositions()
        seconds["run_decompositions"] = time.perf_counter() - begin
        decomposed_nodes = packfn_nodes(decomposed)
        if decomposed_nodes:
            raise AssertionError(f"run_decompositions left packfn nodes: {dict(decomposed_nodes)}")
        decomposed_error = _max_error(
            decomposed.module()(*example), model(*example), arguments.atol, arguments.rtol, "the decomposed program"
        )

        folder = arguments.out or Path(tempfile.mkdtemp(prefix="packfn_export_"))
        folder.mkdir(parents=True, exist_ok=True)
        begin = time.perf_counter()
        package = torch._inductor.aoti_compile_and_package(exported, package_path=str(folder / "packed_decoder.pt2"))
        seconds["aoti_compile_and_package"] = time.perf_counter() - begin
        begin = time.perf_counter()
        loaded = torch._inductor.aoti_load_package(package)
        seconds["aoti_load_package"] = time.perf_counter() - begin
        errors = []
        for batch in batches[1:]:
            inputs = (batch.input_ids, batch.document_ids)
            errors.append(_max_error(loaded(*inputs), model(*inputs), arguments.atol, arguments.rtol, "AOTI output"))

    return ExportReport(
        exported_packfn_nodes=dict(exported_nodes),
        decomposed_packfn_nodes=dict(decomposed_nodes),
        decomposed_max_error=decomposed_error,
        package_path=str(package),
        package_bytes=Path(package).stat().st_size,
        aoti_max_errors=errors,
        seconds=seconds,
    )


def main(argv: list[str] | None = None) -> int:
    report = run(parse_args(argv))
    print("\n".join(report.lines()), flush=True)
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
