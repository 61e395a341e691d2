"""Benchmark packfn against the upstream helpers, side by side in one process.

Every op family (``scripts/benchmarks/<family>.py``) builds ``Case``s from the
SPEC section 5 inputs: ``batch=8``, document lengths drawn from an exponential
distribution (mean 300 and 800 tokens), rows filled until the next document
would not fit. Each variant of a case is timed in interleaved rounds (so
drift on a shared machine hits all variants alike), a fast variant repeated
within a sample until the sample lasts about ``--sample-ms``; the median
time per call is reported with the ratio ``baseline / variant`` (above 1:
faster than the baseline).

    python scripts/bench.py                       # full run: sequence 4096 and 32768
    python scripts/bench.py --sequences 256 --repeats 3 --families metadata --json out.json
    python scripts/bench.py --replot docs/bench.json --plot docs/bench.png   # redraw a saved run

Mask ops also report their time over the floor, one pass over the mask
(``(mask > 0).sum()`` on the same input, timed in the same rounds). Writes
JSON (``--json``) and, where matplotlib is installed, a plot (``--plot``):
one panel per function, each packfn variant's speed over its baseline
(``baseline time / variant time``) at every size.

``--keep-freed-memory`` has glibc keep freed blocks of up to 32 MiB for
reuse (see :func:`keep_freed_memory`), so that the mask ops' timings are the
kernels' and not the page faults of fresh buffers; larger blocks (the layout
family's activations) still come from ``mmap``. The JSON records the setting.
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a file: import from the repository root (scripts/__init__.py)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import ctypes
import importlib
import json
import math
import platform
import statistics
import time

import torch

from scripts.benchmarks.common import Case, make_inputs
from scripts.measure import synchronize

FAMILIES = ("metadata", "layout", "attention", "formats")


def keep_freed_memory() -> None:
    """Have glibc keep freed blocks of up to 32 MiB for reuse, as jemalloc, tcmalloc and CUDA's caching allocator do.

    By default glibc hands large freed blocks back to the kernel, so an op
    that allocates megabytes pays for fresh pages again on many calls: on
    the 2-core VM, a compiled ``varlen_metadata`` call at batch 8, sequence
    32768 took 490 page faults and 2.8 ms, against none and 0.87 ms with
    these settings. Larger blocks still come from ``mmap`` (and fault on
    every call). The settings hold for the rest of the process.

    Raises:
        RuntimeError: the C library is not glibc, or it refused a setting.
    """
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError) as error:
        raise RuntimeError(f"--keep-freed-memory needs glibc's mallopt: {error}") from None
    # M_TRIM_THRESHOLD (-1): never give the top of the heap back. M_MMAP_THRESHOLD
    # (-3): blocks up to 32 MiB (the most older glibc accepts) come from the heap.
    if not (mallopt(-1, 2**31 - 1) and mallopt(-3, 32 * 2**20)):
        raise RuntimeError("glibc's mallopt refused the --keep-freed-memory settings")


def calls_per_sample(case: Case, device: torch.device, sample_s: float) -> dict[str, int]:
    """How many back-to-back calls make one sample of each variant last about ``sample_s`` (one call at least).

    Sub-millisecond variants are timed over many calls per sample, so that a
    sample is not one call's scheduler noise; the count comes from the
    fastest of three calls, so one slow call cannot set it.
    """
    calls = {}
    for label, function in case.variants.items():
        fastest = math.inf
        for _ in range(3):
            synchronize(device)
            begin = time.perf_counter()
            function()
            synchronize(device)
            fastest = min(fastest, time.perf_counter() - begin)
        calls[label] = max(1, min(1000, round(sample_s / max(fastest, 1e-9))))
    return calls


def time_case(case: Case, repeats: int, device: torch.device, budget_s: float, sample_s: float) -> dict[str, float]:
    """Median seconds per call of each variant over interleaved rounds (fewer rounds if a variant is very slow)."""
    calls = calls_per_sample(case, device, sample_s)
    samples: dict[str, list[float]] = {label: [] for label in case.variants}
    started = time.perf_counter()
    for round_index in range(repeats):
        for label, function in case.variants.items():
            synchronize(device)
            begin = time.perf_counter()
            for _ in range(calls[label]):
                function()
                synchronize(device)  # each call's latency on an accelerator, not a queue's throughput
            samples[label].append((time.perf_counter() - begin) / calls[label])
        if round_index >= 2 and time.perf_counter() - started > budget_s:
            break
    return {label: statistics.median(values) for label, values in samples.items()}


def run(
    sequences: list[int],
    means: list[int],
    families: list[str],
    repeats: int,
    device: str,
    budget_s: float,
    sample_s: float = 0.01,
) -> list[dict]:
    rows = []
    for sequence in sequences:
        for mean in means:
            inputs = make_inputs(sequence, mean, device=device)
            for family in families:
                module = importlib.import_module(f"scripts.benchmarks.{family}")  # formats imports its anchors
                for case in module.cases(inputs):
                    for label in case.variants:
                        case.variants[label]()  # warm every variant once
                    medians = time_case(case, repeats, inputs.device, budget_s, sample_s)
                    base = medians[case.baseline]
                    floor = medians[case.floor] if case.floor else None
                    for label, seconds in medians.items():
                        row = {
                            "family": case.family,
                            "case": case.name,
                            "sequence": sequence,
                            "mean": mean,
                            "variant": label,
                            "baseline": case.baseline,
                            "median_ms": seconds * 1e3,
                            "speedup": base / seconds,
                            "over_floor": seconds / floor if floor else None,
                            "notes": case.notes,
                            **case.counts.get(label, {}),
                        }
                        rows.append(row)
                        over_floor = f"  floor x{seconds / floor:6.1f}" if floor else ""
                        counted = case.counts.get(label)
                        if counted:
                            over_floor += (
                                f"  reads {counted['host_reads']} data-dependent {counted['data_dependent_ops']}"
                            )
                        print(
                            f"{case.family:>9} {case.name:<34} S={sequence:<6} mean={mean:<4} "
                            f"{label:<34} {seconds * 1e3:10.3f} ms  x{base / seconds:7.2f} vs {case.baseline}"
                            f"{over_floor}",
                            flush=True,
                        )
    return rows


def plot(rows: list[dict], path: Path) -> bool:
    """One panel per function: each packfn variant's speed over its baseline at each size; False without matplotlib.

    A bar is ``baseline time / variant time`` on a log scale from 1 (up:
    faster than the baseline, down: slower), labelled with its value; one
    legend for the figure, a variant the same color in every panel.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib import ticker
    except ImportError:
        return False
    panels: dict[tuple[str, str, str], list[dict]] = {}
    for row in rows:
        if row["variant"] != row["baseline"]:
            panels.setdefault((row["family"], row["case"], row["baseline"]), []).append(row)
    for key, selected in panels.items():  # packfn's variants, where the case has any
        ours = [row for row in selected if row["variant"].startswith("packfn")]
        panels[key] = ours or selected
    variants = list(dict.fromkeys(row["variant"] for selected in panels.values() for row in selected))
    palette = plt.get_cmap("tab10").colors
    colors = {variant: palette[index % len(palette)] for index, variant in enumerate(variants)}
    columns = min(4, len(panels))
    lines = -(-len(panels) // columns)
    figure, axes = plt.subplots(lines, columns, figsize=(4.4 * columns, 3.3 * lines + 0.8), squeeze=False)
    for axis, ((family, name, baseline), selected) in zip(axes.flat, sorted(panels.items()), strict=False):
        sizes = sorted({(row["sequence"], row["mean"]) for row in selected})
        shown = [variant for variant in variants if any(row["variant"] == variant for row in selected)]
        width = 0.8 / len(shown)
        for offset, variant in enumerate(shown):
            for position, size in enumerate(sizes):
                row = next(
                    (row for row in selected if (row["sequence"], row["mean"]) == size and row["variant"] == variant),
                    None,
                )
                if row is None:
                    continue
                ratio = row["speedup"]
                x = position - 0.4 + width * (offset + 0.5)
                axis.bar(x, ratio - 1, bottom=1, width=width, color=colors[variant])
                axis.annotate(
                    f"{ratio:.2g}x" if ratio < 100 else f"{ratio:.0f}x",
                    (x, ratio),
                    ha="center",
                    va="bottom" if ratio >= 1 else "top",
                    fontsize=6 if len(shown) < 4 else 5,
                    xytext=(0, 1 if ratio >= 1 else -1),
                    textcoords="offset points",
                )
        axis.axhline(1, color="black", linewidth=0.8)
        axis.set_yscale("log")
        low, high = axis.get_ylim()
        axis.set_ylim(min(low, 0.5), max(high, 2) * 1.6)  # room for the labels
        axis.yaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
        axis.yaxis.set_major_formatter(ticker.FuncFormatter(lambda value, _: f"{value:g}x"))
        axis.yaxis.set_minor_formatter(ticker.NullFormatter())
        axis.grid(axis="y", linewidth=0.3, alpha=0.5)
        axis.set_xticks(range(len(sizes)), [f"S={sequence}\nmean {mean}" for sequence, mean in sizes], fontsize=7)
        against = "" if baseline == "upstream" or " vs " in name else f" vs {baseline}"
        axis.set_title(f"{family}: {name}{against}", fontsize=9)
        axis.set_ylabel(f"{baseline} time / packfn time", fontsize=7)
        axis.tick_params(axis="y", labelsize=7)
    spare = list(axes.flat)[len(panels) :]
    for axis in spare:
        axis.axis("off")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[variant]) for variant in variants]
    figure.suptitle("packfn against the function it replaces: baseline time / packfn time (above 1: packfn is faster)")
    if spare:  # the legend in the first empty panel
        spare[0].legend(handles, variants, loc="center", fontsize=9, frameon=False, title="variant")
        figure.tight_layout(rect=(0, 0, 1, 0.97))
    else:
        legend_rows = -(-len(variants) // min(4, len(variants)))
        figure.legend(handles, variants, loc="lower center", ncol=min(4, len(variants)), fontsize=8, frameon=False)
        figure.tight_layout(rect=(0, 0.035 * legend_rows + 0.01, 1, 0.97))
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sequences", type=int, nargs="+", default=[4096, 32768])
    parser.add_argument("--means", type=int, nargs="+", default=[300, 800])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    parser.add_argument("--repeats", type=int, default=7, help="interleaved timing rounds per case")
    parser.add_argument("--budget", type=float, default=20.0, help="seconds per case before rounds stop (min 3)")
    parser.add_argument(
        "--sample-ms", type=float, default=10.0, help="a sample repeats a fast variant until it lasts about this long"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--keep-freed-memory",
        action="store_true",
        help="have glibc keep freed blocks of up to 32 MiB for reuse (fewer page faults for fresh buffers)",
    )
    parser.add_argument("--json", type=Path, default=Path("bench_results/bench.json"))
    parser.add_argument("--plot", type=Path, default=Path("bench_results/bench.png"))
    parser.add_argument(
        "--replot",
        type=Path,
        metavar="JSON",
        help="draw --plot from the rows of a JSON this script wrote; time nothing",
    )
    arguments = parser.parse_args(argv)
    if arguments.replot is not None:
        try:
            rows = json.loads(arguments.replot.read_text())["rows"]
        except (OSError, ValueError, KeyError, TypeError) as error:
            parser.error(f"--replot {arguments.replot}: not a JSON this script wrote ({error})")
        arguments.plot.parent.mkdir(parents=True, exist_ok=True)
        if not plot(rows, arguments.plot):
            parser.error("--replot needs matplotlib: pip install -e '.[profile]'")
        print(f"wrote {arguments.plot}")
        return 0
    if not 0 < arguments.sample_ms < math.inf:
        parser.error(f"--sample-ms must be a positive number of milliseconds, got {arguments.sample_ms}")
    if arguments.keep_freed_memory:
        try:
            keep_freed_memory()
        except RuntimeError as error:
            parser.error(str(error))
    rows = run(
        arguments.sequences,
        arguments.means,
        arguments.families,
        arguments.repeats,
        arguments.device,
        arguments.budget,
        arguments.sample_ms / 1e3,
    )
    arguments.json.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "threads": torch.get_num_threads(),
        "device": arguments.device,
        "keep_freed_memory": arguments.keep_freed_memory,
        "rows": rows,
    }
    arguments.json.write_text(json.dumps(report, indent=1))
    print(f"wrote {arguments.json}")
    arguments.plot.parent.mkdir(parents=True, exist_ok=True)
    if plot(rows, arguments.plot):
        print(f"wrote {arguments.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
