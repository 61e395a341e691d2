"""Benchmark context-parallel shard and gather against upstream, side by side in one gloo process group.

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

from scripts.benchmarks.common import make_inputs, round_up

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
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sequences", type=int, nargs="+", default=[4096, 32768])
    parser.add_argument("--means", type=int, nargs="+", default=[300, 800])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--hidden", type=int, default=256, help="activation width for the gather job")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait for a world")
    parser.add_argument("--json", type=Path, default=Path("bench_results/bench_cp.json"))
    args = parser.parse_args(argv)
    rows = []
    for world in args.worlds:
        rows += run_world(world, args)
    report(rows)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    meta = {"torch": torch.__version__, "repeats": args.repeats, "hidden": args.hidden}
    args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
