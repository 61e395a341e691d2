"""How densely and how fast packers pack the same document lengths: packfn against TRL and NeMo AutoModel.

Streams of 20,000 document lengths (seeded): exponential with means 96, 300
and 800, and a chat-like log-normal mix (mean about 850), each clipped to
the row (``sequence``), so every packer sees the same documents (TRL's
``bfd`` truncates longer ones; the others would have to split them). For
every sequence (512, 4096, 8192), alignment (1, 16, 128) and document cap
(16, 64, none):

- **packfn** ``pack_documents`` (best fit, the default) and
  ``strategy="next_fit"``, under the static budgets: aligned sizes against
  the default budget (the row length rounded up to the alignment), the cap;
- **BFD**: a plain best-fit-decreasing reference on the same aligned sizes
  with the same cap (what the targets compare with);
- **NeMo** AutoModel 0.7.0's ``greedy_knapsack`` (neat packing) and
  **TRL** 1.16.0's ``pack_dataset(strategy="bfd")`` as ``SFTTrainer`` runs
  it (``datasets.map`` batches of 1000), which know no alignment and no cap:
  their rows are aligned afterwards, and the report says how far past the
  budget (and the cap) they then go;
- the lower bound ``ceil(tokens / sequence)``.

Fill is real tokens over ``rows * sequence``. Then the time to pack 20,000
documents, medians of ``--rounds`` interleaved rounds: packfn's
``pack_documents`` with its tensors, next fit, a bare Python best-fit pass
(bins only), ``torch.ones(rows, sequence, dtype=torch.int64)`` (writing
the output once), TRL and NeMo; and the targets: fill within 0.5 points of
BFD at alignment 1 with no cap, at least BFD's at alignments 16 and 128,
packing at least 10 times faster than TRL and within 4 times the bare pass
plus two output writes.

The loader (``--parts loader``): ``packfn.data.PackedDataset`` over the
same lengths as token tensors (batch 8, sequence 4096, cap
``--max-documents``), with its per-batch packing statistics on and off,
two loaders advanced in turns (the one to go first alternating every batch,
so drift on a shared machine hits both alike), a whole pass of each per
round: the median pass of each over ``--rounds`` rounds in the CPU time of
the loading thread and in wall time, their ratio (the cost of the
statistics), and real tokens per second with them on.

    python scripts/bench_packer.py                       # the whole grid: a few minutes on 2 CPU cores
    python scripts/bench_packer.py --quick               # one sequence, fewer streams and rounds
    python scripts/bench_packer.py --parts loader        # the loader only, statistics on against off
    pip install trl==1.16.0 'datasets>=4.7,<4.8' && pip install --no-deps nemo-automodel==0.7.0
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a file: import from the repository root (scripts/__init__.py)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import bisect
import itertools
import json
import math
import platform
import statistics
import time
from collections.abc import Callable

import torch

import packfn
from packfn.data import PackedDataset
from packfn.data.stats import stats_dict

from scripts.benchmarks.common import round_up
from scripts.upstream import neat_packing

DOCUMENTS = 20_000
STREAMS = ("exponential 96", "exponential 300", "exponential 800", "chat mix")
SEQUENCES = (512, 4096, 8192)
ALIGNMENTS = (1, 16, 128)
CAPS = (16, 64, None)
PARTS = ("fills", "times", "loader")


def stream_lengths(name: str, sequence: int, count: int = DOCUMENTS, seed: int = 0) -> list[int]:
    """``count`` seeded document lengths of a stream, clipped to ``[1, sequence]``."""
    generator = torch.Generator().manual_seed(seed)
    if name.startswith("exponential"):
        mean = float(name.split()[1])
        lengths = torch.empty(count, dtype=torch.float64).exponential_(1 / mean, generator=generator)
    else:  # chat turns: 72% short (mean about 490), 28% long (mean about 1770)
        short = torch.empty(count, dtype=torch.float64).log_normal_(5.8, 0.9, generator=generator)
        long = torch.empty(count, dtype=torch.float64).log_normal_(7.3, 0.6, generator=generator)
        lengths = torch.where(torch.rand(count, generator=generator, dtype=torch.float64) < 0.72, short, long)
    return lengths.ceil().clamp(1, sequence).long().tolist()


# ------------------------------------------------------------------ the packers


def reference_bfd(lengths: list[int], alignment: int, capacity: int, cap: int | None) -> list[list[int]]:
    """Best-fit decreasing on aligned sizes, plainly: each document (longest first) into its tightest bin."""
    sizes = [round_up(length, alignment) for length in lengths]
    order = sorted(range(len(sizes)), key=lambda index: (-lengths[index], index))
    rooms: list[tuple[int, int]] = []  # sorted (room, bin) of the bins that can take more
    bins: list[list[int]] = []
    for index in order:
        size = sizes[index]
        position = bisect.bisect_left(rooms, (size, -1))
        if position < len(rooms):
            room, number = rooms.pop(position)
        else:
            room, number = capacity, len(bins)
            bins.append([])
        bins[number].append(index)
        if room - size > 0 and (cap is None or len(bins[number]) < cap):
            bisect.insort(rooms, (room - size, number))
    return bins


def bare_best_fit(lengths: list[int], capacity: int) -> int:
    """The bare Python best-fit-decreasing pass the time target names: bins only (their count)."""
    rooms: list[int] = []
    bins = 0
    for length in sorted(lengths, reverse=True):
        position = bisect.bisect_left(rooms, length)
        if position < len(rooms):
            room = rooms.pop(position) - length
        else:
            room, bins = capacity - length, bins + 1
        if room:
            bisect.insort(rooms, room)
    return bins


def trl_dataset(lengths: list[int]):
    """An in-memory ``datasets.Dataset`` with an int64 ``input_ids`` column of these lengths (as a tokenizer's)."""
    import pyarrow as pa
    from datasets import Dataset

    offsets = pa.array([0, *itertools.accumulate(lengths)], type=pa.int32())
    values = pa.array(torch.ones(sum(lengths), dtype=torch.int64).numpy())
    return Dataset(pa.table({"input_ids": pa.ListArray.from_arrays(offsets, values)}))


def trl_rows(dataset, sequence: int) -> list[list[int]]:
    """TRL's ``pack_dataset(strategy="bfd")`` as ``SFTTrainer`` calls it; each row's document lengths."""
    from trl import pack_dataset

    packed = pack_dataset(dataset, sequence, "bfd", {"num_proc": None})
    return [list(row) for row in packed.with_format("arrow").data.column("seq_lengths").to_pylist()]


def anchors_available() -> dict[str, str | None]:
    """Why each anchor cannot run (None when it can)."""
    status = {}
    try:
        import datasets  # noqa: F401
        import trl  # noqa: F401

        status["trl"] = None
    except ImportError as error:
        status["trl"] = f"not importable ({error}): pip install trl==1.16.0 'datasets>=4.7,<4.8'"
    try:
        neat_packing()
        status["nemo"] = None
    except (ImportError, FileNotFoundError) as error:
        status["nemo"] = f"not importable ({error}): pip install --no-deps nemo-automodel==0.7.0 (and datasets)"
    return status


# ------------------------------------------------------------------ measuring


def aligned_overflow(rows: list[list[int]], alignment: int, budget: int, cap: int | None) -> dict[str, float]:
    """What happens to an alignment-blind packer's rows when they are aligned: rows past the budget, past the cap."""
    aligned = [sum(round_up(length, alignment) for length in row) for row in rows]
    over = [size for size in aligned if size > budget]
    return {
        "rows_over_budget": len(over) / len(rows),
        "widest_aligned_row": max(aligned) / budget,
        "rows_over_cap": 0.0 if cap is None else sum(1 for row in rows if len(row) > cap) / len(rows),
        "most_documents": max(len(row) for row in rows),
    }


def fill(tokens: int, rows: int, sequence: int) -> float:
    return tokens / (rows * sequence)


def fill_grid(streams, sequences, status, documents: int = DOCUMENTS) -> list[dict]:
    """Rows and fill of every packer on every configuration."""
    results = []
    neat = neat_packing() if status["nemo"] is None else None
    for stream in streams:
        for sequence in sequences:
            lengths = stream_lengths(stream, sequence, documents)
            tokens = sum(lengths)
            anchors = {}
            if neat is not None:
                anchors["nemo"] = [[lengths[index] for index in row] for row in neat.greedy_knapsack(lengths, sequence)]
            if status["trl"] is None:
                anchors["trl"] = trl_rows(trl_dataset(lengths), sequence)
            for alignment in ALIGNMENTS:
                budget = round_up(sequence, alignment)
                for cap in CAPS:
                    documents = sequence if cap is None else cap
                    kwargs = {"sequence": sequence, "alignment": alignment, "max_documents": documents}
                    best = packfn.pack_documents(lengths, **kwargs)
                    nxt = packfn.pack_documents(lengths, **kwargs, strategy="next_fit")
                    reference = reference_bfd(lengths, alignment, budget, cap)
                    entry = {
                        "stream": stream,
                        "sequence": sequence,
                        "alignment": alignment,
                        "cap": cap,
                        "tokens": tokens,
                        "lower_bound_rows": math.ceil(tokens / sequence),
                        "packfn_rows": best.batch,
                        "packfn_fill": fill(tokens, best.batch, sequence),
                        "packfn_closed_by": dict(best.limits()),
                        "next_fit_rows": nxt.batch,
                        "next_fit_fill": fill(tokens, nxt.batch, sequence),
                        "bfd_rows": len(reference),
                        "bfd_fill": fill(tokens, len(reference), sequence),
                    }
                    for name, rows in anchors.items():
                        entry[f"{name}_rows"] = len(rows)
                        entry[f"{name}_fill"] = fill(tokens, len(rows), sequence)
                        entry[f"{name}_aligned"] = aligned_overflow(rows, alignment, budget, cap)
                    results.append(entry)
                    print(_fill_line(entry), flush=True)
    return results


def _fill_line(entry: dict) -> str:
    cap = "none" if entry["cap"] is None else entry["cap"]
    anchors = "".join(f"  {name} {entry[f'{name}_fill']:.3f}" for name in ("nemo", "trl") if f"{name}_fill" in entry)
    return (
        f"{entry['stream']:<16} S={entry['sequence']:<5} a={entry['alignment']:<4} cap={cap!s:<5} "
        f"packfn {entry['packfn_fill']:.3f}  next-fit {entry['next_fit_fill']:.3f}  BFD {entry['bfd_fill']:.3f}"
        f"{anchors}  bound {fill(entry['tokens'], entry['lower_bound_rows'], entry['sequence']):.3f}"
    )


def _median_time(functions: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Median seconds of each function over interleaved rounds (one warm-up call each first)."""
    for function in functions.values():
        function()
    seconds: dict[str, list[float]] = {name: [] for name in functions}
    for round_index in range(rounds):
        names = list(functions)
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            begin = time.perf_counter()
            functions[name]()
            seconds[name].append(time.perf_counter() - begin)
    return {name: statistics.median(values) for name, values in seconds.items()}


def time_grid(streams, sequences, status, rounds: int, cap: int, documents: int = DOCUMENTS) -> list[dict]:
    """Packing 20,000 documents: packfn (tensors included), next fit, the bare pass, one output write, the anchors."""
    results = []
    neat = neat_packing() if status["nemo"] is None else None
    for stream in streams:
        for sequence in sequences:
            lengths = stream_lengths(stream, sequence, documents)
            kwargs = {"sequence": sequence, "alignment": 1, "max_documents": cap}
            rows = packfn.pack_documents(lengths, **kwargs).batch
            functions: dict[str, Callable[[], object]] = {
                "packfn": lambda lengths=lengths, kwargs=kwargs: packfn.pack_documents(lengths, **kwargs),
                "next_fit": lambda lengths=lengths, kwargs=kwargs: packfn.pack_documents(
                    lengths, **kwargs, strategy="next_fit"
                ),
                "bare_best_fit": lambda lengths=lengths, sequence=sequence: bare_best_fit(lengths, sequence),
                "write_once": lambda rows=rows, sequence=sequence: torch.ones(rows, sequence, dtype=torch.int64),
            }
            if neat is not None:
                functions["nemo"] = lambda lengths=lengths, sequence=sequence: neat.greedy_knapsack(lengths, sequence)
            if status["trl"] is None:
                dataset = trl_dataset(lengths)
                functions["trl"] = lambda dataset=dataset, sequence=sequence: trl_rows(dataset, sequence)
            seconds = _median_time(functions, rounds)
            entry = {"stream": stream, "sequence": sequence, "max_documents": cap, "rows": rows, "seconds": seconds}
            entry["within_bound"] = seconds["packfn"] / (seconds["bare_best_fit"] + 2 * seconds["write_once"])
            if "trl" in seconds:
                entry["trl_over_packfn"] = seconds["trl"] / seconds["packfn"]
            results.append(entry)
            print(_time_line(entry), flush=True)
    return results


def _time_line(entry: dict) -> str:
    seconds = entry["seconds"]
    parts = "  ".join(f"{name} {value * 1e3:.1f}" for name, value in seconds.items())
    trl = f"; TRL / packfn {entry['trl_over_packfn']:.1f}x" if "trl_over_packfn" in entry else ""
    return (
        f"{entry['stream']:<16} S={entry['sequence']:<5} ms: {parts}; packfn / (bare + 2 writes) "
        f"{entry['within_bound']:.2f}{trl}"
    )


LOADER = {"batch": 8, "sequence": 4096}


def loader_grid(streams, rounds: int, cap: int, documents: int = DOCUMENTS) -> list[dict]:
    """The loader with packing statistics on and off, in turns batch by batch: the median pass of each, the ratio.

    Both loaders yield the same batches. Each ``next()`` is timed twice: the
    CPU time of this thread (what the loader costs: on a shared machine a
    wait for a core is not the loader's), and the wall clock. A batch's time
    is its median over the rounds, a pass the sum of those medians.
    """
    clocks = {"cpu": time.thread_time, "wall": time.perf_counter}
    results = []
    for stream in streams:
        lengths = stream_lengths(stream, LOADER["sequence"], documents)
        generator = torch.Generator().manual_seed(1)
        tokens = torch.randint(1, 32_000, (sum(lengths),), generator=generator)
        examples = list(tokens.split(lengths))
        kwargs = {**LOADER, "max_documents": cap}
        # Per clock and flag, per batch: its time in each round.
        seconds = {(clock, flag): [] for clock in clocks for flag in (True, False)}
        stats = []
        for round_index in range(rounds + 1):  # round 0 warms up, untimed
            loaders = {flag: iter(PackedDataset(examples, **kwargs, packing_stats=flag)) for flag in (True, False)}
            for batch_index in itertools.count():
                order = (True, False) if (round_index + batch_index) % 2 else (False, True)
                taken = {}
                for flag in order:
                    begin = {clock: read() for clock, read in clocks.items()}
                    taken[flag] = next(loaders[flag], None)
                    end = {clock: read() for clock, read in clocks.items()}
                    if round_index and taken[flag] is not None:
                        for clock in clocks:
                            if round_index == 1:
                                seconds[clock, flag].append([])
                            seconds[clock, flag][batch_index].append(end[clock] - begin[clock])
                if taken[True] is None:
                    break
                if round_index == 0:
                    stats.append(taken[True]["packing_stats"])
        passes = {key: sum(statistics.median(batch) for batch in values) for key, values in seconds.items()}
        total = stats_dict(torch.stack(stats))
        entry = {"stream": stream, **kwargs, "batches": len(stats), "packing_stats": total}
        for clock in clocks:
            on, off = passes[clock, True], passes[clock, False]
            entry[clock] = {
                "stats_on_s": on,
                "stats_off_s": off,
                "on_over_off": on / off,
                "stats_us_per_batch": (on - off) / len(stats) * 1e6,
            }
        entry["on_over_off"] = entry["cpu"]["on_over_off"]
        entry["real_tokens_per_s"] = total["real_tokens"] / entry["wall"]["stats_on_s"]
        results.append(entry)
        print(_loader_line(entry), flush=True)
    return results


def _loader_line(entry: dict) -> str:
    cpu, wall = entry["cpu"], entry["wall"]
    return (
        f"loader {entry['stream']:<16} S={entry['sequence']} B={entry['batch']} cap={entry['max_documents']}: "
        f"{entry['batches']} batches, fill {entry['packing_stats']['fill']:.3f}; a pass without / with statistics: "
        f"CPU {cpu['stats_off_s'] * 1e3:.0f} / {cpu['stats_on_s'] * 1e3:.0f} ms, {cpu['on_over_off']:.3f}x "
        f"({cpu['stats_us_per_batch']:+.0f} us a batch); wall {wall['on_over_off']:.3f}x; "
        f"{entry['real_tokens_per_s'] / 1e6:.2f} M real tokens/s"
    )


def targets(fills: list[dict], times: list[dict], loader: list[dict]) -> list[str]:
    """Each target, met or short, with the worst case (of the parts that ran)."""
    lines = []
    if fills:
        free = [entry for entry in fills if entry["alignment"] == 1 and entry["cap"] is None]
        worst = min(free, key=lambda entry: entry["packfn_fill"] - entry["bfd_fill"])
        gap = worst["packfn_fill"] - worst["bfd_fill"]
        within = sum(1 for entry in free if entry["packfn_fill"] - entry["bfd_fill"] >= -0.005)
        lines.append(
            f"alignment 1, no cap: packfn fill within 0.5 points of BFD on {within} of {len(free)}; worst {gap:+.4f} "
            f"({worst['stream']}, {worst['sequence']}): {'met' if gap >= -0.005 else 'SHORT'}"
        )
        aligned = [entry for entry in fills if entry["alignment"] > 1]
        short = [entry for entry in aligned if entry["packfn_fill"] < entry["bfd_fill"]]
        best = max(aligned, key=lambda entry: entry["packfn_fill"] - entry["bfd_fill"])
        lines.append(
            f"alignments 16, 128: packfn fill >= BFD on the aligned sizes with the same cap on "
            f"{len(aligned) - len(short)} of {len(aligned)}: {'met' if not short else 'SHORT'}; largest gain "
            f"{best['packfn_fill'] - best['bfd_fill']:+.3f} ({best['stream']}, {best['sequence']}, "
            f"a={best['alignment']}, cap {best['cap']})"
        )
    for entry in times:
        bound = entry["within_bound"]
        verdicts = [f"within 4x (bare + 2 writes): {bound:.2f}x {'met' if bound <= 4 else 'SHORT'}"]
        if "trl_over_packfn" in entry:
            ratio = entry["trl_over_packfn"]
            verdicts.append(f"10x faster than TRL: {ratio:.1f}x {'met' if ratio >= 10 else 'SHORT'}")
        lines.append(f"time {entry['stream']}, {entry['sequence']}: " + "; ".join(verdicts))
    if loader:
        worst = max(loader, key=lambda entry: entry["on_over_off"])
        ratio = worst["on_over_off"]
        lines.append(
            f"loader: packing statistics within 1.02x of the loader's CPU time without them on {len(loader)} streams; "
            f"worst {ratio:.3f}x ({worst['stream']}): {'met' if ratio <= 1.02 else 'SHORT'}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="sequence 4096 only, two streams, at most 3 rounds")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds (medians)")
    parser.add_argument("--max-documents", type=int, default=64, help="the cap of the timed packs")
    parser.add_argument("--documents", type=int, default=DOCUMENTS, help="documents per stream")
    parser.add_argument("--json", type=Path, default=Path("bench_results") / "packer.json")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: a DataLoader worker's setting, the default)"
    )
    parser.add_argument(
        "--parts",
        nargs="+",
        choices=PARTS,
        default=list(PARTS),
        help="fills: every packer's rows; times: packing time; loader: PackedDataset with statistics on and off",
    )
    arguments = parser.parse_args(argv)
    if arguments.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {arguments.rounds}")
    torch.set_num_threads(arguments.threads)
    streams = STREAMS[:2] if arguments.quick else STREAMS
    sequences = (4096,) if arguments.quick else SEQUENCES
    rounds = min(3, arguments.rounds) if arguments.quick else arguments.rounds
    try:
        import datasets

        datasets.disable_progress_bars()
    except ImportError:
        pass
    parts = set(arguments.parts)
    status = anchors_available() if parts & {"fills", "times"} else {}
    for name, why in status.items():
        if why is not None:
            print(f"{name}: {why}")
    header = (
        f"packer bench: torch {torch.__version__}, {platform.platform()}, {platform.processor() or 'cpu'}, "
        f"{time.strftime('%Y-%m-%d')}, {torch.get_num_threads()} torch threads"
    )
    print(header, flush=True)
    fills = fill_grid(streams, sequences, status, arguments.documents) if "fills" in parts else []
    times = (
        time_grid(streams, sequences, status, rounds, arguments.max_documents, arguments.documents)
        if "times" in parts
        else []
    )
    loader = loader_grid(streams, rounds, arguments.max_documents, arguments.documents) if "loader" in parts else []
    verdicts = targets(fills, times, loader)
    print("\n".join(["== targets ==", *verdicts]))
    arguments.json.parent.mkdir(parents=True, exist_ok=True)
    arguments.json.write_text(
        json.dumps({"header": header, "fills": fills, "times": times, "loader": loader, "targets": verdicts}, indent=1)
    )
    print(f"wrote {arguments.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
