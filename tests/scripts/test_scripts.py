"""End-to-end runs of the scripts at tiny sizes: the main job (and its TensorBoard view), export, bench.

Each script is called in-process through its ``main(argv)`` (imported from the repository root, as
``scripts.<name>``), and every entry script also runs as a file from another folder; timings are never checked.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from scripts import main_job
from tests.distributed.ranks import free_port

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts"
# The files a user runs (``python scripts/<name>.py``): the modules of scripts/ with a __main__ block.
ENTRY_SCRIPTS = sorted(path.stem for path in SCRIPTS.glob("*.py") if 'if __name__ == "__main__":' in path.read_text())
BOOTSTRAP = """
if not __package__:  # run as a file: import from the repository root (scripts/__init__.py)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
"""

TINY_MODEL = ["--batch", "2", "--sequence", "64", "--mean", "16", "--hidden", "32", "--heads", "2", "--layers", "1"]
PROFILE_INSTALL = "pip install -e '.[profile]'"
TENSORBOARD_WAIT_S = 90


@pytest.fixture(scope="module")
def profiled(tmp_path_factory) -> tuple[Path, str]:
    """Run ``scripts/main_job.py`` once at tiny sizes: ``(out folder, printed output)``, stdout and stderr in order."""
    import contextlib
    import io

    out = tmp_path_factory.mktemp("profiles")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        argv = [*TINY_MODEL, "--vocab", "64", "--steps", "3", "--rounds", "1", "--out", str(out), "--run-name", "tiny"]
        code = main_job.main(argv)
    assert code == 0
    return out, printed.getvalue()


def _report(printed: str) -> str:
    return printed[printed.index("== packfn main job report ==") :]


def test_main_job_writes_a_trace_and_packfn_compiles_once_with_no_graph_break(profiled):
    out, printed = profiled
    traces = list((out / "tiny").glob("*.pt.trace.json*"))
    assert traces, f"no trace file under {out / 'tiny'}"
    report = _report(printed)
    assert "packfn graph: 0 graph breaks, 0 recompiles (frames compiled: 1, 6 steps" in report
    row = next(line for line in report.splitlines() if line.startswith("packfn torch.compile(fullgraph=True)"))
    assert row.split()[-4:-2] == ["0", "0"], row  # graph breaks, recompiles
    assert "0 packfn:: calls" in report  # the compiled step calls back into no packfn op
    for step in range(6):
        assert f"step {step:>3}  packfn compiled" in printed


def test_main_job_says_what_it_is_doing_before_each_phase_and_draws_each_pass_as_a_bar(profiled):
    _, printed = profiled
    lines = printed[: printed.index("== packfn main job report ==")].splitlines()

    def first(text: str) -> int:
        return next(index for index, line in enumerate(lines) if text in line)

    # Each phase is announced, stamped with the time since the start, before it runs: the compiles above all.
    phases = ["] documents: ", "] packing: ", "] packfn compiled: a first pass", "] upstream compiled: a first pass"]
    phases += ["] timed rounds: ", "] report: ", "] done"]
    at = [first(phase) for phase in phases]
    assert at == sorted(at), at
    assert at[2] < first("step   0  packfn compiled") and at[3] < first("step   0  upstream compiled")
    assert "compiles" in lines[at[2]] and "compiles" in lines[at[3]]
    # Each pass is a bar of its steps, from 0 to its total, the step lines between (not a terminal: a line each).
    passes = [
        ("packfn compiled, first pass (compiling, profiled)", 3),  # --steps 3
        ("upstream compiled, first pass (compiling)", None),  # the batches neat packing made
        ("timed rounds, round 1 of 1", None),
    ]
    for label, steps in passes:
        bars = [line for line in lines if f"] {label} [" in line]
        total = steps or int(bars[0].rsplit("/", 1)[1].split()[0])
        assert bars[0].endswith(f"[{'.' * 24}] 0/{total} steps"), bars[0]
        assert bars[-1].endswith(f"[{'#' * 24}] {total}/{total} steps"), bars[-1]
        assert len(bars) == total + 1


def test_main_job_packs_under_the_packer_budget_not_the_worst_case(profiled):
    _, printed = profiled
    report = _report(printed)
    # sequence 64, alignment 16, 16 documents: the packer's budget is 64 columns, the worst case 304.
    assert "max_documents=16, budget=64 aligned columns (without the packer: safe_budget(64, 16, 16) = 304)" in report
    packfn = next(line for line in report.splitlines() if line.startswith("packfn:"))
    fill = packfn.split("real tokens fill ")[1].split()[0]
    assert 0 < float(fill.rstrip("%")) <= 100


def test_main_job_reports_three_drivers_on_equal_losses(profiled):
    _, printed = profiled
    report = _report(printed).splitlines()
    titles = ["upstream eager", "upstream torch.compile", "packfn torch.compile(fullgraph=True)"]
    rows = [next(line for line in report if line.startswith(title + " ")) for title in titles]
    for row in rows:
        assert " ms " in row
        assert float(row.split(" ms ")[1].split()[0].replace(",", "")) > 0  # tokens per second
    assert rows[0].split()[-3:] == ["-", "-", "-"]  # eager: no graph breaks, recompiles or compile time
    graph_breaks, recompiles = (int(value) for value in rows[1].split()[-4:-2])
    assert graph_breaks > 0  # upstream's .item() / .tolist() / nonzero break the graph
    assert recompiles >= 0
    ratios = next(line for line in report if line.startswith("real tokens/s:"))
    assert "packfn compiled " in ratios and "x upstream eager" in ratios and "x upstream torch.compile" in ratios
    parity = next(line for line in report if line.startswith("loss parity:"))
    assert float(parity.rsplit("|diff| ", 1)[1].rstrip(")")) < 1e-4


def test_main_job_speaks_in_measurements_and_draws_a_png_beside_the_trace(profiled):
    out, printed = profiled
    report = _report(printed)
    for internal in ("target", "SHORT", " met", "fastest"):
        assert internal not in report, internal
    png = out / "tiny" / "main_job.png"
    assert f"summary:      {png}" in report
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_main_job_on_the_cpu_trains_float32_over_the_dense_mask_and_reports_no_gpu_lines(profiled):
    _, printed = profiled
    assert " attention=dense device=cpu" in printed  # the CPU default: SDPA over the bool block-causal mask
    report = _report(printed).splitlines()
    for gpu_line in ("attention:", "device:", "peak memory:"):  # the attention path, bf16 / CUDA graphs, memory
        assert not any(line.startswith(gpu_line) for line in report), gpu_line
    assert "its helpers (build_packed_sequence_metadata, packed_layout, get_unpad_data) take" in "\n".join(report)


def test_no_file_in_scripts_shadows_the_standard_library():
    """``python scripts/<name>.py`` puts ``scripts/`` on sys.path (before the stdlib): no file there may shadow it."""
    names = {path.stem for path in SCRIPTS.glob("*.py")}
    assert not names & set(sys.stdlib_module_names), names & set(sys.stdlib_module_names)


def test_every_entry_script_starts_with_the_one_bootstrap():
    """Each entry script puts the repository root on sys.path with the same lines, before any project import."""
    assert set(ENTRY_SCRIPTS) == {
        "bench",
        "bench_corpus",
        "bench_cp",
        "bench_packer",
        "export",
        "gpu_check",
        "hf_train",
        "main_job",
        "train_cp",
    }
    for name in ENTRY_SCRIPTS:
        source = (SCRIPTS / f"{name}.py").read_text()
        assert BOOTSTRAP in source, f"scripts/{name}.py lacks the bootstrap"
        head = source[: source.index(BOOTSTRAP)]
        imports = [line for line in head.splitlines() if line.startswith(("import ", "from "))]
        assert imports == ["from __future__ import annotations", "import sys", "from pathlib import Path"], name


def test_every_module_imports_from_the_repository_root():
    """No module of scripts/ imports a sibling as a top-level name (only ``python scripts/x.py`` would find it)."""
    names = [
        ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        for path in SCRIPTS.rglob("*.py")
    ]
    for name in sorted(names):
        importlib.import_module(name)


# Runs each entry script as ``python <script> --help`` would, one after another in this one process (a
# process each would import torch eight times): sys.path starts with the script's folder, not the repository
# root, and the modules of this repository are forgotten in between, so each script's bootstrap runs again.
_HELP_OF_EACH = """
import contextlib, io, json, runpy, sys
from pathlib import Path

root, scripts = Path(sys.argv[1]), sys.argv[2:]
rest = sys.path[1:]  # sys.path[0] is this command's folder, which is not the repository root
results = {}


def from_this_repository(name, module):  # scripts.*, examples.*: not packfn, which is installed
    path = Path(getattr(module, "__file__", None) or "/").resolve()
    return path.is_relative_to(root) and name.split(".")[0] != "packfn"


for script in scripts:
    for name in [name for name, module in sys.modules.items() if from_this_repository(name, module)]:
        del sys.modules[name]
    sys.path[:] = [str(Path(script).parent), *rest]
    sys.argv = [script, "--help"]
    printed, errors = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(errors):
            runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as exit:
        code = exit.code
    except BaseException as error:
        code, errors = repr(error), io.StringIO(repr(error))
    results[Path(script).stem] = [code, printed.getvalue()[:500], errors.getvalue()[-3000:]]
print(json.dumps(results))
"""


def test_every_entry_script_runs_as_a_file_from_another_folder(tmp_path):
    scripts = [str(SCRIPTS / f"{name}.py") for name in ENTRY_SCRIPTS]
    result = subprocess.run(
        [sys.executable, "-c", _HELP_OF_EACH, str(REPO), *scripts],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads(result.stdout.splitlines()[-1])
    assert list(results) == ENTRY_SCRIPTS
    for name, (code, printed, errors) in results.items():
        assert code == 0, (name, errors)
        assert printed.startswith("usage: "), (name, printed)


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as response:
        assert response.status == 200, url
        return response.read()


def _get_json(base: str, route: str, **query: str):
    return json.loads(_get(f"{base}/{route}?{urllib.parse.urlencode(query)}"))


def test_tensorboard_profiler_plugin_serves_the_run(profiled, tmp_path):
    try:
        import tensorboard  # noqa: F401
        import torch_tb_profiler  # noqa: F401
    except ImportError as error:
        pytest.fail(f"TensorBoard with torch-tb-profiler is needed ({error}): {PROFILE_INSTALL}")
    out, _ = profiled
    port = free_port()
    log = tmp_path / "tensorboard.log"
    command = [sys.executable, "-m", "tensorboard.main", "--logdir", str(out), "--host", "127.0.0.1"]
    with log.open("w") as sink:
        server = subprocess.Popen([*command, "--port", str(port)], stdout=sink, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}/data/plugin/pytorch_profiler"
    try:
        deadline = time.monotonic() + TENSORBOARD_WAIT_S
        runs: dict = {}
        while time.monotonic() < deadline:
            if server.poll() is not None:
                pytest.fail(f"tensorboard exited with {server.returncode}:\n{log.read_text()[-3000:]}")
            try:
                runs = _get_json(base, "runs")
            except (urllib.error.URLError, ConnectionError, json.JSONDecodeError):
                runs = {}
            if "tiny" in runs.get("runs", []) and not runs.get("loading", True):
                break
            time.sleep(1)
        else:
            pytest.fail(f"the profiler plugin did not list the run within {TENSORBOARD_WAIT_S} s: {runs}")

        views = _get_json(base, "views", run="tiny")
        assert "Overview" in views and "Trace" in views
        workers = _get_json(base, "workers", run="tiny", view="Overview")
        assert workers
        spans = _get_json(base, "spans", run="tiny", worker=workers[0])
        assert spans
        profile = {"run": "tiny", "worker": workers[0], "span": spans[0]}
        overview = _get_json(base, "overview", **profile)
        assert overview["steps"]["rows"], overview
        operations = _get_json(base, "operation/table", group_by="Operation", **profile)
        assert operations["data"]
        assert _get(f"{base}/trace?{urllib.parse.urlencode(profile)}")
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


# The smallest bench run: one tiny size, one round, 1 ms samples.
_TINY_BENCH = ["--sequences", "64", "--means", "16", "--repeats", "1", "--sample-ms", "1"]


def test_bench_smoke_writes_rows_of_the_documented_shape(tmp_path):
    from scripts import bench

    json_path, plot_path = tmp_path / "b.json", tmp_path / "b.png"
    argv = [*_TINY_BENCH, "--families", "metadata", "layout"]
    assert bench.main([*argv, "--json", str(json_path), "--plot", str(plot_path)]) == 0
    assert plot_path.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    result = json.loads(json_path.read_text())
    assert {"torch", "rows"} <= set(result) and result["keep_freed_memory"] is False
    assert {row["family"] for row in result["rows"]} == {"metadata", "layout"}
    for row in result["rows"]:
        assert {"family", "case", "sequence", "mean", "variant", "median_ms", "speedup"} <= set(row)
        assert row["sequence"] == 64 and row["mean"] == 16
    bounds = {row["case"]: set() for row in result["rows"] if row["case"].endswith(" vs clone")}
    for row in result["rows"]:
        if row["case"] in bounds:
            bounds[row["case"]].add(row["variant"])
    # pack writes the longer aligned rows: it is also timed against a copy of its own output.
    assert bounds == {
        "pack vs clone": {"clone", "packfn compiled", "clone of the output"},
        "restore vs clone": {"clone", "packfn compiled"},
    }


def test_bench_replot_draws_ratios_from_a_saved_json_and_names_a_bad_one(tmp_path, capsys):
    from scripts import bench

    rows = [
        {
            "family": "metadata",
            "case": "get_unpad_data",
            "sequence": 64,
            "mean": 16,
            "variant": variant,
            "baseline": "upstream",
            "speedup": speedup,
        }
        for variant, speedup in (("upstream", 1.0), ("packfn static compiled", 4.0), ("packfn drop-in eager", 0.8))
    ]
    saved, png = tmp_path / "b.json", tmp_path / "b.png"
    saved.write_text(json.dumps({"rows": rows}))
    assert bench.main(["--replot", str(saved), "--plot", str(png)]) == 0
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--replot", str(tmp_path / "missing.json"), "--plot", str(png)])
    assert exit_info.value.code == 2
    assert "not a JSON this script wrote" in capsys.readouterr().err


class _FakeLibc:
    """Stands in for glibc: records ``mallopt`` calls and answers ``accept``."""

    def __init__(self, accept: int = 1) -> None:
        self.calls: list[tuple[int, int]] = []
        self.accept = accept

    def mallopt(self, parameter: int, value: int) -> int:
        self.calls.append((parameter, value))
        return self.accept


def test_bench_keep_freed_memory_sets_glibc_thresholds_and_records_them(tmp_path, monkeypatch):
    from scripts import bench

    libc = _FakeLibc()
    monkeypatch.setattr(bench.ctypes, "CDLL", lambda name: libc if name == "libc.so.6" else None)
    json_path = tmp_path / "b.json"
    argv = [*_TINY_BENCH, "--families", "metadata"]
    assert bench.main([*argv, "--keep-freed-memory", "--json", str(json_path), "--plot", str(tmp_path / "b.png")]) == 0
    # M_TRIM_THRESHOLD: never trim; M_MMAP_THRESHOLD: 32 MiB, the most older glibc accepts.
    assert libc.calls == [(-1, 2**31 - 1), (-3, 32 * 2**20)]
    assert json.loads(json_path.read_text())["keep_freed_memory"] is True


def test_bench_keep_freed_memory_says_when_it_cannot(monkeypatch, tmp_path, capsys):
    from scripts import bench

    monkeypatch.setattr(bench.ctypes, "CDLL", lambda name: _FakeLibc(accept=0))
    with pytest.raises(RuntimeError, match="mallopt refused"):
        bench.keep_freed_memory()

    def no_glibc(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(bench.ctypes, "CDLL", no_glibc)
    with pytest.raises(RuntimeError, match="needs glibc's mallopt"):
        bench.keep_freed_memory()
    monkeypatch.setattr(bench.ctypes, "CDLL", lambda name: object())  # a C library without mallopt
    with pytest.raises(RuntimeError, match="needs glibc's mallopt"):
        bench.keep_freed_memory()
    # From the command line: a usage error before anything runs.
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--keep-freed-memory", "--json", str(tmp_path / "unused.json")])
    assert exit_info.value.code == 2
    assert "--keep-freed-memory needs glibc's mallopt" in capsys.readouterr().err
    assert not (tmp_path / "unused.json").exists()


# Allocates an 8 MiB block in a fresh process, then frees it; prints how many blocks glibc took
# from mmap for it and how many bytes its heap keeps after the free (glibc's mallinfo2).
_ALLOCATE_AND_FREE = """
import ctypes, sys
from scripts.bench import keep_freed_memory
if sys.argv[1] == "keep":
    keep_freed_memory()
class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
before = libc.mallinfo2().hblks
block = libc.malloc(8 << 20)
mapped = libc.mallinfo2().hblks - before
libc.free(block)
print(mapped, libc.mallinfo2().arena)
"""


def test_bench_keep_freed_memory_keeps_freed_blocks_in_the_heap():
    """The real call, in fresh processes (the settings last for the process): an 8 MiB block is heap memory
    that stays after its free (so the next op reuses its pages), where by default it is an mmap given back.

    Read from glibc's own accounting, not from page faults, which depend on the kernel and the machine.
    """

    def allocate_and_free(mode: str) -> tuple[int, int]:
        command = [sys.executable, "-c", _ALLOCATE_AND_FREE, mode]
        # From the repository root, which Python puts first on sys.path for ``-c``.
        run = subprocess.run(command, cwd=REPO, check=True, timeout=120, capture_output=True, text=True)
        mapped, kept = run.stdout.split()[-2:]
        return int(mapped), int(kept)

    mapped, kept = allocate_and_free("keep")
    assert mapped == 0 and kept >= 8 << 20
    mapped, _ = allocate_and_free("plain")
    assert mapped == 1  # glibc's default: a block this large is its own mmap, returned to the kernel on free


def test_bench_pack_bound_copies_the_packed_output():
    """``clone of the output`` copies what ``pack`` writes (the longer aligned rows), not its input."""
    import torch

    from scripts.benchmarks import layout
    from scripts.benchmarks.common import make_inputs

    inputs = make_inputs(64, 16, batch=2, hidden=8)
    (bound,) = [case for case in layout.cases(inputs) if case.name == "pack vs clone"]
    packed, copied = bound.variants["packfn compiled"](), bound.variants["clone of the output"]()
    assert packed.shape != inputs.values.shape
    assert torch.equal(copied, packed)


GPU_CHECK_WALK = [
    *("--batches", "3", "--sequences", "64", "65", "--static", "3x65", "--codegen-sequence", "64"),
    *("--mean", "16", "--hidden", "8", "--repeats", "1", "--alignment", "8"),
    *("--only", "varlen_metadata", "document_ids_from_seq_lens"),
    *("--model-sequence", "64", "--model-batch", "2", "--model-hidden", "32", "--model-layers", "1"),
    *("--model-steps", "2", "--device", "cpu"),
]


def test_gpu_check_walks_its_sections_on_the_cpu(tmp_path):
    """``scripts/gpu_check.py --device cpu``: the device check cannot rot between sessions lent a GPU."""
    from scripts import gpu_check

    json_path = tmp_path / "gpu_check.json"
    assert gpu_check.main([*GPU_CHECK_WALK, "--json", str(json_path)]) == 0
    summary = json.loads(json_path.read_text())
    result = summary["sections"]
    assert list(result) == list(gpu_check.SECTIONS)
    assert summary["failures"] == [] and summary["skipped"] == []
    functions = result["correctness"]["functions"]
    assert set(functions) == {"varlen_metadata", "document_ids_from_seq_lens"}
    # Every function at every size eagerly and with dynamic shapes, with static shapes at the --static size.
    for outcomes in functions.values():
        assert set(outcomes) == {"3x64", "3x65"}
        assert {size: set(modes) for size, modes in outcomes.items() if "static" in modes} == {
            "3x65": {"eager", "dynamic", "static"}
        }
        assert all(outcome == "ok" for modes in outcomes.values() for outcome in modes.values())
    assert set(result["correctness"]["backward"].values()) == {"ok"}
    # The launches of the Triton code Inductor writes for an H200, from this CPU.
    codegen = result["codegen"]["functions"]["varlen_metadata"]
    assert codegen["launches"] == len(codegen["kernels"]) > 0 and codegen["packfn_calls"] == 0
    assert any(kernel.startswith("triton_") for kernel in codegen["kernels"])
    assert "skipped" in result["sync"]  # CUDA only
    assert len(result["upstream"]) == 5 and all(row["speedup"] > 0 for row in result["upstream"].values())
    assert result["model"]["graph_breaks"] == 0
    assert result["model"]["first_step_loss_difference"] < 1e-4


def test_gpu_check_records_every_failure_and_goes_on(tmp_path, monkeypatch, capsys):
    """A function that fails (here: compiled, it differs from the CPU's eager result) is recorded; the others
    and the sections after it still run, and the run exits 1 naming each failure."""
    import torch

    from scripts import catalog, gpu_check

    original = catalog.catalog

    def broken(*args, **kwargs):
        entries = original(*args, **kwargs)
        entry = entries["document_ids_from_seq_lens"]
        entries["document_ids_from_seq_lens"] = dataclasses.replace(
            entry, function=lambda seq_lens, mask: entry.function(seq_lens, mask) + torch.compiler.is_compiling()
        )
        return entries

    monkeypatch.setattr(catalog, "catalog", broken)
    json_path = tmp_path / "gpu_check.json"
    argv = [*GPU_CHECK_WALK, "--sections", "correctness", "sync", "--json", str(json_path)]
    assert gpu_check.main(argv) == 1
    summary = json.loads(json_path.read_text())
    assert list(summary["sections"]) == ["correctness", "sync"]
    functions = summary["sections"]["correctness"]["functions"]
    assert functions["varlen_metadata"]["3x65"] == {"eager": "ok", "dynamic": "ok", "static": "ok"}
    assert functions["document_ids_from_seq_lens"]["3x64"] == {"eager": "ok", "dynamic": "MISMATCH"}
    assert len(summary["failures"]) == 2 + 1  # dynamic at every size, static at 3x65
    assert "FAILED correctness document_ids_from_seq_lens 3x65 static: MISMATCH" in capsys.readouterr().out


def test_gpu_check_without_cuda_says_so(capsys, monkeypatch, tmp_path):
    import torch

    from scripts import gpu_check

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--json", str(tmp_path / "unused.json")]) == 2
    assert "CUDA is not available" in capsys.readouterr().err
