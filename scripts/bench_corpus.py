"""A corpus on disk, larger than a window by far: packfn's loader against TRL's packing and transformers' collator.

One HF ``datasets.Dataset`` saved with ``save_to_disk`` (memory-mapped
Arrow, ``input_ids`` int32): ``--documents`` documents (10**6 by default) of
seeded exponential lengths (mean ``--mean``, 300), clipped to the row
(``--sequence``, 4096) so that both pipelines see the same tokens (TRL's
``bfd`` truncates longer ones), random ids. It is written once under
``--corpus`` and reused while its settings match. Each pipeline then runs in
its own subprocess (so its peak RSS is its own), on one thread
(``torch.set_num_threads(1)``, pyarrow's pools at one thread), and walks
one whole epoch:

- **packfn**: ``PackedDataset(load_from_disk(corpus), batch=8, sequence=4096,
  max_documents=64, window=1000, shuffle=True)`` in a ``DataLoader(...,
  batch_size=None)``: static ``[8, 4096]`` batches;
- **trl**: ``trl.pack_dataset(load_from_disk(corpus), 4096, "bfd")`` as
  ``SFTTrainer`` calls it (``datasets.map`` batches of 1,000, its cache file
  written next to the corpus and removed after the run), then a
  ``DataLoader(packed, batch_size=8, shuffle=True)`` whose ``collate_fn``
  cuts each packed row into its documents (``seq_lengths``) and hands them
  to ``transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)``:
  one ``[1, tokens]`` row, positions restarting at every document.

Each reports the time to the first batch (from loading the corpus), the
epoch's wall time and CPU time (of the process: a wait for a core on a
shared machine is not the pipeline's) and its real tokens per second in
each, and its memory from ``/proc/self/status``: the peak RSS (``VmHWM``)
against the RSS once its modules are imported, and ``RssFile`` (mapped
files: the libraries, the corpus's pages) and ``RssAnon`` (the process's
own memory) sampled after loading the corpus and after every batch.
Targets: packfn at least 5 times the peer's tokens per second, and packfn's
own memory (its ``RssAnon`` peak over its ``RssAnon`` with the corpus
loaded) within twice the bytes of a window's tokens (int64).

    python scripts/bench_corpus.py                             # 10**6 documents, into /tmp/packfn_corpus
    python scripts/bench_corpus.py --documents 20000 --corpus /tmp/small
    python scripts/bench_corpus.py --remove                    # delete the corpus afterwards
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a file: import from the repository root (scripts/__init__.py)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import time

PIPELINES = ("packfn", "trl")
CORPUS_FILE = "packfn_corpus.json"  # the settings a corpus was written with
STATUS_FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssFile")


# ------------------------------------------------------------------ the corpus


def corpus_settings(arguments: argparse.Namespace) -> dict:
    return {"documents": arguments.documents, "mean": arguments.mean, "sequence": arguments.sequence, "seed": 0}


def make_corpus(path: Path, settings: dict) -> dict:
    """Write the corpus under ``path`` (``save_to_disk``) unless one with these settings is there; its totals."""
    import numpy as np

    recorded = path / CORPUS_FILE
    if recorded.exists():
        written = json.loads(recorded.read_text())
        if written["settings"] == settings:
            return written
    if path.exists():
        shutil.rmtree(path)
    import datasets
    import pyarrow as pa

    generator = np.random.default_rng(settings["seed"])
    lengths = generator.exponential(settings["mean"], settings["documents"])
    lengths = np.clip(np.ceil(lengths), 1, settings["sequence"]).astype(np.int64)
    batches = []
    for start in range(0, len(lengths), 100_000):
        part = lengths[start : start + 100_000]
        offsets = np.concatenate([[0], np.cumsum(part)]).astype(np.int32)
        values = generator.integers(1, 32_000, int(part.sum()), dtype=np.int32)
        column = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))
        batches.append(pa.RecordBatch.from_arrays([column], names=["input_ids"]))
    begin = time.perf_counter()
    datasets.Dataset(pa.Table.from_batches(batches)).save_to_disk(str(path))
    written = {
        "settings": settings,
        "tokens": int(lengths.sum()),
        "bytes": sum(file.stat().st_size for file in path.glob("*.arrow")),
        "seconds": time.perf_counter() - begin,
    }
    recorded.write_text(json.dumps(written))
    return written


# ------------------------------------------------------------------ memory


def status() -> dict[str, int]:
    """Bytes of this process's ``VmRSS``, ``VmHWM``, ``RssAnon`` and ``RssFile`` (Linux), or its peak RSS elsewhere."""
    try:
        lines = Path("/proc/self/status").read_text().splitlines()
    except OSError:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
        return {"VmHWM": peak, "VmRSS": peak}
    values = {}
    for line in lines:
        name, _, rest = line.partition(":")
        if name in STATUS_FIELDS:
            values[name] = int(rest.split()[0]) * 1024
    return values


class Memory:
    """:func:`status` once the modules are imported (``start``) and the corpus loaded, and each field's largest."""

    def __init__(self) -> None:
        self.start = status()
        self.loaded = self.start
        self.peak = dict(self.start)

    def sample(self) -> None:
        for name, value in status().items():
            self.peak[name] = max(self.peak.get(name, 0), value)

    def corpus_loaded(self) -> None:
        self.sample()
        self.loaded = status()

    def report(self) -> dict:
        self.sample()
        return {"start": self.start, "loaded": self.loaded, "peak": self.peak}


# ------------------------------------------------------------------ the pipelines (each in its own process)


def _one_thread() -> None:
    import pyarrow as pa
    import torch

    torch.set_num_threads(1)
    pa.set_cpu_count(1)
    pa.set_io_thread_count(1)


def run_packfn(corpus: Path, arguments: argparse.Namespace) -> dict:
    """One epoch of ``PackedDataset`` over the corpus read in place."""
    import datasets
    from torch.utils.data import DataLoader

    from packfn.data import PackedDataset

    memory = Memory()
    begin, cpu = time.perf_counter(), time.process_time()
    loaded = datasets.load_from_disk(str(corpus))
    memory.corpus_loaded()
    dataset = PackedDataset(
        loaded,
        batch=arguments.batch,
        sequence=arguments.sequence,
        max_documents=arguments.max_documents,
        window=arguments.window,
        shuffle=arguments.shuffle,
    )
    loader = DataLoader(dataset, batch_size=None, num_workers=0)
    return _epoch(loader, lambda batch: int(batch["seq_lens"].sum()), begin, cpu, memory)


def _flattened(collator, rows: list[dict]) -> dict:
    """The packed rows' documents (cut at their ``seq_lengths``) through ``DataCollatorWithFlattening``."""
    documents = []
    for row in rows:
        start = 0
        for length in row["seq_lengths"]:
            documents.append({"input_ids": row["input_ids"][start : start + length]})
            start += length
    return collator(documents)


def run_trl(corpus: Path, arguments: argparse.Namespace) -> dict:
    """One epoch of TRL's ``pack_dataset(..., "bfd")`` and ``DataCollatorWithFlattening`` over the corpus."""
    import functools

    import datasets
    import torch
    from torch.utils.data import DataLoader
    from transformers import DataCollatorWithFlattening
    from trl import pack_dataset

    memory = Memory()
    begin, cpu = time.perf_counter(), time.process_time()
    loaded = datasets.load_from_disk(str(corpus))
    memory.corpus_loaded()
    packed = pack_dataset(loaded, arguments.sequence, "bfd", {"num_proc": None, "load_from_cache_file": False})
    cache = [entry["filename"] for entry in packed.cache_files if Path(entry["filename"]).name.startswith("cache-")]
    collate = functools.partial(_flattened, DataCollatorWithFlattening(return_flash_attn_kwargs=True))
    loader = DataLoader(
        packed,
        batch_size=arguments.batch,
        shuffle=arguments.shuffle,
        generator=torch.Generator().manual_seed(0),
        collate_fn=collate,
    )
    try:
        return _epoch(loader, lambda batch: int(batch["input_ids"].numel()), begin, cpu, memory)
    finally:
        del loader, packed
        for name in cache:
            Path(name).unlink(missing_ok=True)


def _epoch(loader, real_tokens, begin: float, cpu: float, memory: Memory) -> dict:
    """Walk ``loader`` once, sampling the memory after every batch; the measures from ``begin`` (wall), ``cpu``."""
    first, tokens, batches = None, 0, 0
    for batch in loader:
        if first is None:
            first = time.perf_counter() - begin
        tokens += real_tokens(batch)
        batches += 1
        memory.sample()
    seconds, cpu_seconds = time.perf_counter() - begin, time.process_time() - cpu
    first = seconds if first is None else first
    return {
        "batches": batches,
        "real_tokens": tokens,
        "first_batch_s": first,
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "tokens_per_s": tokens / seconds,
        "tokens_per_cpu_s": tokens / cpu_seconds,
        "tokens_per_s_after_first": tokens / max(seconds - first, 1e-9),
        "memory": memory.report(),
    }


RUNNERS = {"packfn": run_packfn, "trl": run_trl}


def measure(pipeline: str, corpus: Path, arguments: argparse.Namespace, argv: list[str]) -> dict:
    """Run ``pipeline`` in a subprocess of this script; its result."""
    command = [sys.executable, str(Path(__file__).resolve()), *argv, "--run", pipeline, "--corpus", str(corpus)]
    environment = {**os.environ, "HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=environment, check=False)
    if done.returncode:
        raise RuntimeError(f"the {pipeline} pipeline failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------ the report


def window_bytes(arguments: argparse.Namespace) -> int:
    """The bytes of a window's tokens as int64: ``window * mean * 8``."""
    return arguments.window * arguments.mean * 8


def anonymous_growth(result: dict) -> int:
    """Bytes of the pipeline's own memory: its peak ``RssAnon`` over its ``RssAnon`` with the corpus loaded."""
    memory = result["memory"]
    return memory["peak"].get("RssAnon", 0) - memory["loaded"].get("RssAnon", 0)


def rows(results: dict[str, dict], arguments: argparse.Namespace) -> list[str]:
    mib = 2**20
    lines = [
        "| pipeline | batches | real tokens | first batch | epoch (wall) | tokens/s | tokens/s after the first batch "
        "| epoch (CPU) | tokens per CPU second | peak RSS (VmHWM) | RSS after imports | growth | peak RssFile "
        "| RssAnon growth over the loaded corpus |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, result in results.items():
        start, peak = result["memory"]["start"], result["memory"]["peak"]
        lines.append(
            f"| {name} | {result['batches']:,} | {result['real_tokens']:,} | {result['first_batch_s']:.2f} s | "
            f"{result['seconds']:.1f} s | {result['tokens_per_s'] / 1e6:.2f} M | "
            f"{result['tokens_per_s_after_first'] / 1e6:.2f} M | {result['cpu_seconds']:.1f} s | "
            f"{result['tokens_per_cpu_s'] / 1e6:.2f} M | {peak['VmHWM'] / mib:,.0f} MiB | "
            f"{start['VmRSS'] / mib:,.0f} MiB | {(peak['VmHWM'] - start['VmRSS']) / mib:,.0f} MiB | "
            f"{peak.get('RssFile', 0) / mib:,.0f} MiB | {anonymous_growth(result) / mib:,.1f} MiB |"
        )
    return lines


def targets(results: dict[str, dict], arguments: argparse.Namespace) -> list[str]:
    lines = []
    if "packfn" in results and "trl" in results:
        ratio = results["packfn"]["tokens_per_s"] / results["trl"]["tokens_per_s"]
        cpu = results["packfn"]["tokens_per_cpu_s"] / results["trl"]["tokens_per_cpu_s"]
        lines.append(
            f"packfn at least 5x TRL + flattening in tokens/s: {ratio:.1f}x {'met' if ratio >= 5 else 'SHORT'} "
            f"(per CPU second: {cpu:.1f}x)"
        )
        first = results["trl"]["first_batch_s"] / results["packfn"]["first_batch_s"]
        lines.append(f"time to the first batch: TRL + flattening / packfn {first:.0f}x")
    if "packfn" in results:
        memory = results["packfn"]["memory"]
        window, growth = window_bytes(arguments), anonymous_growth(results["packfn"])
        total = memory["peak"]["VmHWM"] - memory["start"]["VmRSS"]
        lines.append(
            f"packfn RSS within 2x a window's tokens ({window / 2**20:.1f} MiB as int64): its own memory (RssAnon "
            f"over the loaded corpus) {growth / 2**20:.1f} MiB, {growth / window:.1f}x "
            f"{'met' if growth <= 2 * window else 'SHORT'}; peak RSS over the imports {total / 2**20:.0f} MiB"
        )
    return lines


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, default=Path("/tmp/packfn_corpus"), help="where the corpus lives")
    parser.add_argument("--documents", type=int, default=1_000_000)
    parser.add_argument("--mean", type=int, default=300, help="mean document length (exponential)")
    parser.add_argument("--sequence", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-documents", type=int, default=64, help="packfn's cap")
    parser.add_argument("--window", type=int, default=1000, help="packfn's window of documents")
    parser.add_argument("--no-shuffle", dest="shuffle", action="store_false", help="read the corpus in order")
    parser.add_argument("--pipelines", nargs="+", choices=PIPELINES, default=list(PIPELINES))
    parser.add_argument("--remove", action="store_true", help="delete the corpus at the end")
    parser.add_argument("--json", type=Path, default=Path("bench_results") / "corpus.json")
    parser.add_argument("--run", choices=PIPELINES, help=argparse.SUPPRESS)  # inside the subprocess of one pipeline
    arguments = parser.parse_args(argv)
    for name in ("documents", "mean", "sequence", "batch", "max_documents", "window"):
        if getattr(arguments, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(arguments, name)}")
    return arguments


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    arguments = parse(argv)
    if arguments.run is not None:  # the subprocess of one pipeline
        _one_thread()
        print(json.dumps(RUNNERS[arguments.run](arguments.corpus, arguments)))
        return 0
    import torch

    written = make_corpus(arguments.corpus, corpus_settings(arguments))
    load = os.getloadavg()
    header = (
        f"corpus bench: {arguments.documents:,} documents, {written['tokens']:,} tokens, "
        f"{written['bytes'] / 2**20:,.0f} MiB of Arrow in {arguments.corpus}; torch {torch.__version__}, "
        f"{platform.platform()}, {os.cpu_count()} CPUs, load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}, "
        f"{time.strftime('%Y-%m-%d')}"
    )
    print(header, flush=True)
    child = [item for item in argv if item != "--remove"]
    results = {}
    for pipeline in arguments.pipelines:
        results[pipeline] = measure(pipeline, arguments.corpus, arguments, child)
        print(f"{pipeline}: {json.dumps(results[pipeline])}", flush=True)
    table, verdicts = rows(results, arguments), targets(results, arguments)
    load = os.getloadavg()
    print("\n".join([*table, "== targets ==", *verdicts, f"load average at the end {load[0]:.1f}"]))
    for pipeline, result in results.items():
        if result["real_tokens"] != written["tokens"]:
            print(f"{pipeline} sent {result['real_tokens']:,} real tokens of the corpus's {written['tokens']:,}")
    arguments.json.parent.mkdir(parents=True, exist_ok=True)
    arguments.json.write_text(
        json.dumps({"header": header, "corpus": written, "results": results, "targets": verdicts}, indent=1)
    )
    print(f"wrote {arguments.json}")
    if arguments.remove:
        shutil.rmtree(arguments.corpus)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
