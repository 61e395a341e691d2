"""``python -m packfn budgets`` (packfn.data.report): both input kinds end to end, the PNG, and clear errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from packfn import pack_documents, suggest_budgets
from packfn.__main__ import main
from packfn.data.report import budget_report, plot_format, plot_report, read_lengths, report_lines

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
LENGTHS = [
    int(value) for value in torch.empty(300).exponential_(1 / 40, generator=torch.Generator().manual_seed(0)).ceil()
]


def write_jsonl(path, documents, *, bare_every: int = 2) -> None:
    """One document a line: ``{"input_ids": [...]}``, every ``bare_every``-th as a bare list, and a blank line."""
    lines = [
        json.dumps(tokens if index % bare_every == 0 else {"input_ids": tokens, "text": "x"})
        for index, tokens in enumerate(documents)
    ]
    path.write_text("\n".join([*lines[:3], "", *lines[3:]]) + "\n")


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    write_jsonl(path, [[7] * length for length in LENGTHS])
    return path


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    datasets = pytest.importorskip("datasets")
    folder = tmp_path_factory.mktemp("saved")
    datasets.disable_progress_bars()
    dataset = datasets.Dataset.from_dict({"input_ids": [[5] * length for length in LENGTHS]})
    dataset.save_to_disk(str(folder / "one"))
    datasets.DatasetDict({"train": dataset, "test": dataset.select(range(10))}).save_to_disk(str(folder / "two"))
    return folder


def run(argv, capsys) -> tuple[int, str, str]:
    """``python -m packfn`` in-process: ``(exit status, stdout, stderr)``."""
    try:
        code = main(argv)
    except SystemExit as exit_info:
        code = exit_info.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# ------------------------------------------------------------------ reading


def test_a_jsonl_file_and_a_saved_dataset_give_the_same_lengths(jsonl, saved):
    from_jsonl = read_lengths(jsonl)
    from_disk = read_lengths(saved / "one")
    assert from_jsonl.lengths.tolist() == from_disk.lengths.tolist() == LENGTHS
    assert from_jsonl.documents == from_disk.documents == len(LENGTHS)
    assert read_lengths(saved / "two", split="test").lengths.tolist() == LENGTHS[:10]


def test_a_sample_is_seeded_and_a_subset(jsonl):
    first, again = read_lengths(jsonl, sample=50, seed=3), read_lengths(jsonl, sample=50, seed=3)
    assert first.lengths.tolist() == again.lengths.tolist() and first.lengths.shape == (50,)
    assert first.documents == len(LENGTHS)
    assert read_lengths(jsonl, sample=50, seed=4).lengths.tolist() != first.lengths.tolist()
    assert read_lengths(jsonl, sample=10 * len(LENGTHS)).lengths.tolist() == LENGTHS


# ------------------------------------------------------------------ the report


def test_the_table_holds_the_suggestion_and_its_fill_is_the_packers(jsonl):
    report = budget_report(LENGTHS, sequence=256, alignment=16)
    suggestion = suggest_budgets(LENGTHS, sequence=256, alignment=16)
    assert report.suggestion == suggestion
    (chosen,) = [
        entry
        for entry in report.table
        if (entry.budget, entry.max_documents) == (suggestion.budget, suggestion.max_documents)
    ]
    assert chosen.rows == suggestion.rows
    packed = pack_documents(
        LENGTHS,
        sequence=256,
        alignment=16,
        max_documents=suggestion.max_documents,
        budget=suggestion.budget,
        split=True,
    )
    assert chosen.rows == packed.batch
    assert chosen.fill == pytest.approx(sum(LENGTHS) / (packed.batch * 256))
    assert chosen.aligned_fill == pytest.approx(packed.fill_ratio)
    assert {entry.max_documents for entry in report.table} >= {suggestion.max_documents, None}
    assert report.curve == []


def _split_by_the_packer(lengths, **settings) -> int:
    """Documents ``pack_documents(..., split=True)`` cuts into pieces."""
    packed = pack_documents(lengths, max_documents=len(lengths), split=True, **settings)
    pieces = packed.pieces
    return len(set(pieces.document[pieces.length != pieces.total].tolist()))


@pytest.mark.parametrize(
    ("settings", "longest"),
    [
        ({"sequence": 256, "alignment": 16}, 256),
        # Spans are multiples of 16: a row of 100 columns holds a document of 96 tokens at most.
        ({"sequence": 100, "alignment": 1, "pad_to_multiple_of": 16}, 96),
    ],
)
def test_documents_longer_than_a_row_are_those_the_packer_splits_at_the_boundary(settings, longest):
    fits = [longest, 10, 3]
    first = report_lines(budget_report(fits, **settings))[0]
    assert _split_by_the_packer(fits, **settings) == 0
    assert "longer than" not in first, first
    over = [longest + 1, longest, 10]
    if longest < settings["sequence"]:
        over.append(settings["sequence"])
    split = _split_by_the_packer(over, **settings)
    assert split == len(over) - 2
    first = report_lines(budget_report(over, **settings))[0]
    assert first.endswith(f"; {split} longer than the {longest} tokens a row holds, split"), first


def test_the_fill_curve_stops_at_the_first_power_of_two_cap_that_binds_no_row():
    report = budget_report(LENGTHS, sequence=256, alignment=16, curve=True)
    budgets = sorted({entry.budget for entry in report.table})
    assert budgets[0] == 256 and len(budgets) == 2
    for budget in budgets:
        row = [entry for entry in report.table if entry.budget == budget]
        (uncapped,) = [entry for entry in row if entry.max_documents is None]
        stop = 1 << (uncapped.documents_max - 1).bit_length()  # the first power of two >= the most a row holds
        curve = {entry.max_documents: entry for entry in report.curve if entry.budget == budget}
        table_caps = {entry.max_documents for entry in row} - {None}
        assert set(curve) == {1 << power for power in range(stop.bit_length())} | table_caps
        assert (curve[stop].rows, curve[stop].fill) == (uncapped.rows, uncapped.fill)  # it binds no row
    # The boundary itself: under budget 256 a row holds at most a power of two of these documents, and the curve
    # stops at that cap, not at the next power (which no table cap is).
    most = next(entry.documents_max for entry in report.table if (entry.budget, entry.max_documents) == (256, None))
    caps = {entry.max_documents for entry in report.curve if entry.budget == 256}
    assert most & (most - 1) == 0 and most in caps and 2 * most not in caps


def test_the_command_reads_jsonl_prints_the_table_and_writes_a_png(jsonl, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "plots" / "budgets.png"
    code, out, err = run(["budgets", str(jsonl), "--sequence", "256", "--alignment", "16", "--plot", str(png)], capsys)
    assert code == 0, err
    suggestion = suggest_budgets(LENGTHS, sequence=256, alignment=16)
    assert f"documents:  {len(LENGTHS)} documents of {jsonl} (JSONL)" in out
    assert f"suggestion: budget={suggestion.budget}, max_documents={suggestion.max_documents}:" in out
    rows = [line for line in out.splitlines() if line.endswith("<- suggested")]
    assert len(rows) == 1 and rows[0].split()[:3] == [
        str(suggestion.budget),
        str(suggestion.max_documents),
        str(suggestion.rows),
    ]
    assert f"wrote {png}" in out
    assert png.read_bytes().startswith(PNG_SIGNATURE)


def test_the_command_reads_a_saved_dataset_and_its_splits(saved, capsys):
    code, out, err = run(["budgets", str(saved / "one"), "--sequence", "256", "--sample", "100"], capsys)
    assert code == 0, err
    assert f"100 of {len(LENGTHS)} documents (a seeded sample) of {saved / 'one'}" in out
    code, out, err = run(["budgets", str(saved / "two"), "--sequence", "256"], capsys)
    assert code == 2
    assert "holds a DatasetDict with splits ['train', 'test']: pass --split" in err
    code, out, err = run(["budgets", str(saved / "two"), "--sequence", "256", "--split", "test"], capsys)
    assert code == 0, err
    assert "10 documents of" in out and "(split 'test')" in out
    code, _, err = run(["budgets", str(saved / "two"), "--sequence", "256", "--split", "dev"], capsys)
    assert code == 2 and "it has no split 'dev'" in err


def test_python_dash_m_packfn_runs_as_a_user_runs_it(jsonl, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "out.png"
    command = [sys.executable, "-m", "packfn", "budgets", str(jsonl), "--sequence", "128", "--plot", str(png)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "suggestion: budget=128" in result.stdout
    assert png.read_bytes().startswith(PNG_SIGNATURE)
    usage = subprocess.run([sys.executable, "-m", "packfn"], capture_output=True, text=True, timeout=300, check=False)
    assert usage.returncode == 2 and "usage: python -m packfn" in usage.stderr and "budgets" in usage.stderr


def test_the_command_module_imports_neither_matplotlib_nor_datasets():
    code = (
        "import sys\n"
        "import packfn, packfn.data, packfn.data.report, packfn.__main__\n"
        "heavy = sorted(name for name in ('matplotlib', 'datasets') if name in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]


# ------------------------------------------------------------------ errors


def test_paths_that_are_not_datasets_are_named(tmp_path, jsonl, capsys):
    code, _, err = run(["budgets", str(tmp_path / "missing.jsonl"), "--sequence", "64"], capsys)
    assert code == 2 and f"no such file or directory: {tmp_path / 'missing.jsonl'}" in err
    pytest.importorskip("datasets")
    code, _, err = run(["budgets", str(tmp_path), "--sequence", "64"], capsys)
    assert code == 2 and f"{tmp_path} is a directory but not a dataset saved with save_to_disk" in err
    code, _, err = run(["budgets", str(jsonl), "--sequence", "64", "--plot", str(tmp_path)], capsys)
    assert code == 2 and "is a directory: name the PNG to write" in err
    code, _, err = run(["budgets", str(jsonl), "--sequence", "64", "--split", "train"], capsys)
    assert code == 2 and "names a split of a saved DatasetDict" in err


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (['{"input_ids": [1, 2]}', "{not json"], "line 2: not JSON"),
        (['{"input_ids": [1, 2]}', '{"text": "hello"}'], "line 2: example 1 has no 'input_ids' (keys: ['text'])"),
        (['["a", "b"]'], "line 1: example 0: input_ids must be a sequence of integer token ids"),
        (["[1, 2]", "", "[]"], "line 3: example 1 is empty: a document needs at least one token"),
        (["", "  "], "has no non-blank line"),
        (['"text"'], "line 1: example 0 must be a mapping with 'input_ids' or a sequence of token ids, got str"),
    ],
)
def test_bad_lines_are_named_by_their_line(tmp_path, capsys, lines, message):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    code, out, err = run(["budgets", str(path), "--sequence", "64"], capsys)
    assert code == 2 and message in err, err
    assert not out


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--sequence", "0"], "--sequence must be positive, got 0"),
        (["--sequence", "64", "--alignment", "-1"], "--alignment must be positive, got -1"),
        (["--sequence", "64", "--tolerance", "1.5"], "--tolerance must be in [0, 1), got 1.5"),
        (["--sequence", "64", "--sample", "0"], "--sample must be positive, got 0"),
        (["--sequence", "8", "--pad-to-multiple-of", "16"], "--pad-to-multiple-of 16 exceeds --sequence 8"),
        ([], "the following arguments are required: --sequence"),
        (["--sequence", "many"], "argument --sequence: invalid int value: 'many'"),
    ],
)
def test_bad_arguments_are_usage_errors(jsonl, capsys, arguments, message):
    code, out, err = run(["budgets", str(jsonl), *arguments], capsys)
    assert code == 2 and message in err, err
    assert "usage: python -m packfn budgets" in err and not out


def test_plot_writes_exactly_the_path_it_prints_a_png_when_the_name_has_no_suffix(jsonl, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    target = tmp_path / "budgets"
    code, out, err = run(["budgets", str(jsonl), "--sequence", "64", "--plot", str(target)], capsys)
    assert code == 0, err
    assert out.splitlines()[-1] == f"wrote {target}"
    assert target.read_bytes().startswith(PNG_SIGNATURE)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["budgets"]


def test_plot_a_suffix_matplotlib_cannot_write_is_a_usage_error_before_any_work(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    target, missing = tmp_path / "out.txt", tmp_path / "missing.jsonl"
    # The data does not exist: the refusal comes before anything is read.
    code, out, err = run(["budgets", str(missing), "--sequence", "64", "--plot", str(target)], capsys)
    assert code == 2 and f"--plot {target}: matplotlib cannot write .txt files: name a file ending in" in err, err
    assert ".png" in err and ".pdf" in err
    assert not out and not target.exists()


def test_plot_reads_the_suffix_in_any_case(tmp_path):
    pytest.importorskip("matplotlib")
    assert plot_format("figure.PDF") == "pdf" and plot_format("figure.Svg") == "svg"
    assert plot_format(tmp_path / "budgets") == "png"
    target = tmp_path / "budgets.PDF"
    assert plot_report(budget_report(LENGTHS, sequence=64), target) == target
    assert target.read_bytes().startswith(b"%PDF")


def test_plot_a_format_matplotlib_lists_but_cannot_write_here_is_refused_before_any_work(tmp_path, capsys, monkeypatch):
    """The format is tried on an empty figure: a writer that fails here (a Pillow without the encoder) is refused."""
    pytest.importorskip("matplotlib")
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    def no_encoder(*args, **kwargs):
        raise OSError("no WebP encoder")

    monkeypatch.setattr(FigureCanvasAgg, "print_webp", no_encoder)
    target, missing = tmp_path / "out.webp", tmp_path / "missing.jsonl"
    code, out, err = run(["budgets", str(missing), "--sequence", "64", "--plot", str(target)], capsys)
    assert code == 2 and f"--plot {target}: matplotlib cannot write .webp files here: no WebP encoder" in err, err
    assert not out and not target.exists()


def test_plot_without_matplotlib_says_how_to_install_it_before_reading(jsonl, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    png = tmp_path / "out.png"
    code, out, err = run(["budgets", str(tmp_path / "missing.jsonl"), "--sequence", "64", "--plot", str(png)], capsys)
    assert code == 2 and "--plot: plotting needs matplotlib: pip install matplotlib" in err
    assert not png.exists() and not out
