"""Benchmark context parallelism: shard and gather against upstream (gloo), and the balance of the shardings.

Spawns ``world`` gloo ranks (2 and 4 by default) on this machine. On the
SPEC section 5 inputs (``batch=8``, ``sequence`` 4096 and 32768, exponential
document lengths with mean 300 and 800, ``alignment=128``), every rank times,
in interleaved rounds:

- ``upstream``: ``nemo_automodel``'s ``shard_cp_batch(..., packed_alignment=128,
  sync_packed_length=True)`` (a host read of the packed length and an
  all-reduce of it, then the pack and the contiguous shard);
- ``packfn drop-in``: :func:`packfn.nemo_automodel.shard_cp_batch`, same arguments, same results;
- ``packfn static``: :func:`packfn.distributed.shard_packed_batch` at a fixed
  budget (the same row length, rounded to ``world * 128``: what a packer
  guarantees), eager, and compiled with ``fullgraph=True`` (``--compile``);
- ``gather``: upstream's ``gather_sequence`` against packfn's (with and without
  its shape check) on ``[batch, local, --hidden]`` float32 activations.

A round runs each variant once on every rank between barriers; a variant's
time is the slowest rank's, and the table reports medians over rounds with
the ratio ``upstream / variant`` (above 1: faster than upstream).

    python scripts/bench_cp.py                                  # worlds 2 and 4, both sequences
    python scripts/bench_cp.py --worlds 2 --sequences 4096 --means 300 --repeats 5

``--family balance`` (one process, no gloo) measures the attention work of
each sharding instead: on the streams of :data:`STREAMS` (exponential
lengths packed best fit by ``pack_documents``, 3,000 documents, batches of
8 rows; and the loader's streaming packer
``pack_stream`` on the SPEC section 5 means), every batch packed with
``pad_to_multiple_of=2 * world * alignment`` and sharded at
``budget=sequence`` over ``world`` ranks:

- the attention-work imbalance, max over ranks / mean of the attended
  query-key pairs summed over a batch (mean and worst over batches), of
  ``contiguous``, whole-row zigzag (torch's ``_HeadTailLoadBalancer``:
  chunks ``r`` and ``2W - 1 - r`` of the whole row), per-document
  ``head_tail`` and ``rotated`` (packfn's default);
- the padding the multiple costs: extra columns over the documents rounded
  to ``alignment``, in % of the real tokens, and the extra rows it packs into;
- the time to build one rank's shard (tokens, labels, positions, ids) and
  its varlen inputs, against torch's ``_PerDocumentHeadTailLoadBalancer``
  on the same rows (its indices from Python lists, and with the gathers of
  a rank's tokens, labels and positions), eager (and compiled with
  ``--compiled``, Inductor, ``fullgraph=True``), medians of interleaved
  rounds, one thread; and the host reads of packfn's build, in eager and in
  the graph that AOTAutograd traces (the static path).

    python scripts/bench_cp.py --family balance                # every stream, worlds 2, 4 and 8
    python scripts/bench_cp.py --family balance --streams "packed mean 300" --worlds 8 --alignment 16
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a file: import from the repository root (scripts/__init__.py)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import copy
import datetime
import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from scripts.benchmarks.common import count_data_dependent, make_inputs, round_up

ALIGNMENT = 128


def _variants(inputs, world: int, rank: int, hidden: int, compile_static: bool):
    """``{label: callable}`` for the shard and the gather jobs of one input."""
    from nemo_automodel.components.models.deepseek_v41.cp import gather_sequence as upstream_gather
    from nemo_automodel.components.models.deepseek_v41.cp import shard_cp_batch as upstream_shard
    from torch.distributed.device_mesh import init_device_mesh

    from packfn import shard_packed_batch
    from packfn.nemo_automodel import gather_sequence, shard_cp_batch

    mesh = init_device_mesh("cpu", (world,))
    generator = torch.Generator().manual_seed(0)
    seq_lens = inputs.seq_lens
    tokens = torch.randint(1, 32000, (inputs.batch, inputs.sequence), generator=generator)
    batch = {"input_ids": tokens, "labels": tokens.clone(), "seq_lens": seq_lens}
    aligned = round_up(seq_lens.clamp_min(0), ALIGNMENT)
    budget = round_up(max(int(aligned.sum(-1).max()), inputs.sequence), world * ALIGNMENT)

    def static():
        return shard_packed_batch(
            seq_lens,
            input_ids=tokens,
            labels=batch["labels"],
            rank=rank,
            world=world,
            budget=budget,
            alignment=ALIGNMENT,
            balance="contiguous",  # upstream's sharding
        )

    shard_jobs = {
        "upstream": lambda: upstream_shard(
            mesh, None, copy.copy(batch), packed_alignment=ALIGNMENT, sync_packed_length=True
        ),
        "packfn drop-in": lambda: shard_cp_batch(
            mesh, None, batch, packed_alignment=ALIGNMENT, sync_packed_length=True
        ),
        "packfn static eager": static,
    }
    if compile_static:
        compiled = torch.compile(static, fullgraph=True, dynamic=False)
        compiled()  # compile outside the timed rounds
        shard_jobs["packfn static compiled"] = compiled
    group = mesh.get_group()
    activations = torch.randn(inputs.batch, budget // world, hidden, generator=generator)
    gather_jobs = {
        "upstream": lambda: upstream_gather(activations, group),
        "packfn": lambda: gather_sequence(activations, group),
        "packfn no shape check": lambda: gather_sequence(activations, group, check_shapes=False),
    }
    return {"shard": shard_jobs, "gather": gather_jobs}, budget


def _time(jobs, repeats: int) -> dict[str, list[float]]:
    """Per variant, this rank's seconds per round (interleaved, between barriers)."""
    samples: dict[str, list[float]] = {label: [] for label in jobs}
    for function in jobs.values():
        function()  # warm-up
    for _ in range(repeats):
        for label, function in jobs.items():
            dist.barrier()
            begin = time.perf_counter()
            function()
            samples[label].append(time.perf_counter() - begin)
    return samples


def _worker(rank: int, world: int, port: int, args, queue) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
    rows = []
    for sequence in args.sequences:
        for mean in args.means:
            inputs = make_inputs(sequence, mean)
            jobs, budget = _variants(inputs, world, rank, args.hidden, args.compile)
            for job, variants in jobs.items():
                mine = _time(variants, args.repeats)
                everyone = [None] * world
                dist.all_gather_object(everyone, mine)
                if rank == 0:
                    # The slowest rank's time in each round, then the median over rounds.
                    medians = {
                        label: statistics.median(
                            max(times[label][i] for times in everyone) for i in range(args.repeats)
                        )
                        for label in variants
                    }
                    rows.append(
                        {"world": world, "sequence": sequence, "mean": mean, "budget": budget, "job": job, **medians}
                    )
    if rank == 0:
        queue.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_world(world: int, args) -> list[dict]:
    context = mp.get_context("spawn")
    queue = context.Queue()
    port = _free_port()
    processes = [context.Process(target=_worker, args=(rank, world, port, args, queue)) for rank in range(world)]
    for process in processes:
        process.start()
    try:
        rows = queue.get(timeout=args.timeout)
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    return rows


# ------------------------------------------------------------------ the balance family

STREAMS = {
    "packed mean 8000, S=32768": (8000, 32768, "documents"),
    "packed mean 800, S=32768": (800, 32768, "documents"),
    "packed mean 300, S=8192": (300, 8192, "documents"),
    "stream mean 300, S=8192": (300, 8192, "stream"),
    "stream mean 800, S=8192": (800, 8192, "stream"),
    "stream mean 300, S=32768": (300, 32768, "stream"),
    "stream mean 800, S=32768": (800, 32768, "stream"),
}
"""name: (mean length, sequence, packer): ``pack_documents`` over 3,000 documents, or ``pack_stream``."""
SHARDINGS = ("contiguous", "zigzag", "head_tail", "rotated")


def stream_batches(mean: int, sequence: int, packer: str, multiple: int, alignment: int, args):
    """``(seq_lens, seq_lens_padded)`` per batch of 8 rows, and the rows packed."""
    import packfn

    generator = torch.Generator().manual_seed(args.seed)
    lengths = (torch.empty(args.documents).exponential_(generator=generator) * mean).ceil().long().tolist()
    options = {"sequence": sequence, "alignment": alignment, "max_documents": max(64, sequence // 64)}
    options.update(pad_to_multiple_of=multiple, split=True)
    if packer == "documents":
        packed = packfn.pack_documents(lengths, **options)
        rows = packed.batch
        batches = [
            (packed.seq_lens[first : first + 8], packed.seq_lens_padded[first : first + 8])
            for first in range(0, rows - 7, 8)
        ]
        return batches, rows
    batches = [(packed.seq_lens, packed.seq_lens_padded) for packed in packfn.pack_stream(lengths, batch=8, **options)]
    return batches, 8 * len(batches)


def rank_work(seq_lens, seq_lens_padded, world: int, sequence: int, alignment: int, sharding: str) -> torch.Tensor:
    """int64 ``[world]``: every rank's attended pairs over the batch."""
    import packfn

    tokens = torch.zeros(seq_lens.shape[0], sequence, dtype=torch.int64)
    if sharding == "zigzag":
        layout = packfn.aligned_layout(
            seq_lens, seq_lens_padded, sequence_length=sequence, alignment=alignment, budget=sequence
        )
        work = torch.where(layout.sequence_ids > 0, layout.position_ids + 1, 0)
        chunks = work.view(work.shape[0], 2 * world, -1).sum((0, 2))
        return chunks[:world] + chunks.flip(0)[:world]
    shard = packfn.shard_packed_batch(
        seq_lens,
        seq_lens_padded,
        input_ids=tokens,
        labels=tokens,
        rank=0,
        world=world,
        budget=sequence,
        alignment=alignment,
        balance=sharding,
    )
    # The gathered layout holds every rank's shard: rank r's columns are [r * local, (r + 1) * local).
    layout = shard.layout
    work = torch.where(layout.sequence_ids > 0, layout.position_ids + 1, 0)
    return work.view(work.shape[0], world, -1).sum((0, 2))


def _median_times(jobs: dict, repeats: int) -> dict[str, float]:
    samples: dict[str, list[float]] = {label: [] for label in jobs}
    for function in jobs.values():
        function()
    for _ in range(repeats):
        for label, function in jobs.items():
            begin = time.perf_counter()
            function()
            samples[label].append(time.perf_counter() - begin)
    return {label: statistics.median(times) for label, times in samples.items()}


def torch_balancer():
    """torch's ``_PerDocumentHeadTailLoadBalancer`` class, or None on a torch without it."""
    try:
        from torch.distributed.tensor.experimental._context_parallel import _load_balancer
    except ImportError:
        return None
    return getattr(_load_balancer, "_PerDocumentHeadTailLoadBalancer", None)


def build_jobs(seq_lens, seq_lens_padded, world: int, sequence: int, alignment: int, compiled: bool = False):
    """``{label: callable}``: one rank's shard and varlen inputs, packfn's and torch's per-document balancer."""
    import packfn

    batch = seq_lens.shape[0]
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(1, 32000, (batch, sequence), generator=generator)
    rank, local = world - 1, sequence // world
    multiple = 2 * world * alignment

    def shard():
        return packfn.shard_packed_batch(
            seq_lens,
            seq_lens_padded,
            input_ids=tokens,
            labels=tokens,
            rank=rank,
            world=world,
            budget=sequence,
            alignment=alignment,
        )

    def shard_and_varlen():
        return packfn.cp_varlen_metadata(shard())

    # torch takes Python lists of spans that are multiples of 2 * world, covering the row: the documents'
    # widths, then the row's padding; its rows are already laid out at those widths.
    widths = (-(-seq_lens.clamp_min(0) // multiple) * multiple).tolist()
    lists = [[*row, sequence - sum(row)] for row in widths]
    layout = packfn.aligned_layout(
        seq_lens, seq_lens_padded, sequence_length=sequence, alignment=multiple, budget=sequence
    )
    row_tokens, row_positions = layout.pack(tokens), layout.position_ids
    columns = slice(rank * local, (rank + 1) * local)

    def torch_indices():
        return balancer(lists, world, "cpu")._generate_indices()

    def torch_shard():
        index = torch_indices()[:, columns]
        return [values.gather(1, index) for values in (row_tokens, row_tokens, row_positions)]

    jobs = {"packfn shard": shard, "packfn shard + varlen": shard_and_varlen}
    if compiled:
        torch._dynamo.reset()
        step = torch.compile(shard_and_varlen, fullgraph=True, dynamic=False)
        step()  # compile outside the timed rounds
        jobs["packfn shard + varlen compiled"] = step
    balancer = torch_balancer()
    if balancer is not None:
        jobs.update({"torch indices": torch_indices, "torch indices + shard": torch_shard})
    torch._dynamo.reset()  # trace at these shapes, not dynamic ones from the last stream
    reads = {
        "eager": count_data_dependent(shard_and_varlen),
        "traced": count_data_dependent(shard_and_varlen, decompose=True),
    }
    return jobs, reads


def balance_family(args) -> list[dict]:
    rows = []
    for name in args.streams:
        mean, sequence, packer = STREAMS[name]
        for world in args.worlds:
            multiple = 2 * world * args.alignment
            batches, packed_rows = stream_batches(mean, sequence, packer, multiple, args.alignment, args)
            _, plain_rows = stream_batches(mean, sequence, packer, args.alignment, args.alignment, args)
            row = {"stream": name, "world": world, "alignment": args.alignment, "batches": len(batches)}
            for sharding in SHARDINGS:
                ratios = []
                for seq_lens, seq_lens_padded in batches:
                    work = rank_work(seq_lens, seq_lens_padded, world, sequence, args.alignment, sharding).double()
                    ratios.append(float(work.max() / work.mean()))
                row[sharding] = {"mean": statistics.mean(ratios), "worst": max(ratios)}
            lengths = torch.cat([seq_lens.flatten() for seq_lens, _ in batches])
            lengths = lengths[lengths > 0]
            extra = round_up(lengths, multiple).sum() - round_up(lengths, args.alignment).sum()
            row["padding %"] = float(extra / lengths.sum() * 100)
            row["rows %"] = (packed_rows / plain_rows - 1) * 100
            jobs, reads = build_jobs(*batches[0], world, sequence, args.alignment, args.compiled)
            row["times"] = _median_times(jobs, args.repeats)
            row["host reads"] = reads
            rows.append(row)
            print(balance_line(row), flush=True)
    return rows


def balance_line(row: dict) -> str:
    cells = " | ".join(f"{name} {row[name]['mean']:.3f} ({row[name]['worst']:.3f})" for name in SHARDINGS)
    times = ", ".join(f"{label} {seconds * 1e3:.2f} ms" for label, seconds in row["times"].items())
    return (
        f"{row['stream']}, world {row['world']}, {row['batches']} batches: {cells} | padding {row['padding %']:.2f}% "
        f"(rows +{row['rows %']:.1f}%) | {times} | host reads {row['host reads']}"
    )


def report(rows: list[dict]) -> None:
    for row in rows:
        base = row["upstream"]
        cells = ", ".join(
            f"{label} {row[label] * 1e3:.2f} ms ({base / row[label]:.2f}x)"
            for label in row
            if label not in ("world", "sequence", "mean", "budget", "job", "upstream")
        )
        print(
            f"world {row['world']} S={row['sequence']} mean {row['mean']} budget {row['budget']} {row['job']}: "
            f"upstream {base * 1e3:.2f} ms; {cells}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=None, help="default: 2 4 (shard), 2 4 8 (balance)")
    parser.add_argument("--sequences", type=int, nargs="+", default=[4096, 32768])
    parser.add_argument("--means", type=int, nargs="+", default=[300, 800])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--hidden", type=int, default=256, help="activation width for the gather job")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait for a world")
    parser.add_argument("--json", type=Path, default=None, help="default: bench_results/bench_cp[_balance].json")
    parser.add_argument("--family", choices=("shard", "balance"), default="shard")
    parser.add_argument("--streams", nargs="+", default=list(STREAMS), choices=list(STREAMS), help="balance family")
    parser.add_argument("--alignment", type=int, default=1, help="balance family: alignment of the documents")
    parser.add_argument("--documents", type=int, default=3000, help="balance family: documents per stream")
    parser.add_argument("--compiled", action="store_true", help="balance family: also time the build compiled")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.family == "balance":
        args.worlds = args.worlds or [2, 4, 8]
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # steadier timings on a shared machine
        try:
            rows = balance_family(args)
        finally:
            torch.set_num_threads(threads)
        path = args.json or Path("bench_results/bench_cp_balance.json")
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = {"torch": torch.__version__, "repeats": args.repeats, "documents": args.documents}
        path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
        return 0
    rows = []
    for world in args.worlds or [2, 4]:
        rows += run_world(world, args)
    report(rows)
    args.json = args.json or Path("bench_results/bench_cp.json")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    meta = {"torch": torch.__version__, "repeats": args.repeats, "hidden": args.hidden}
    args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
