"""Budgets for a tokenized dataset: ``python -m packfn budgets``, and the functions behind it.

It reads the document lengths of a dataset (an HF ``datasets.Dataset``
saved with ``save_to_disk``, or a JSONL file of token lists), runs
:func:`~packfn.suggest_budgets` on them, prints the fill of the rows under
budgets and caps around the suggestion, and draws the length distribution
and the fill per cap (``--plot``, with matplotlib)::

    python -m packfn budgets data/train --sequence 4096 --alignment 128 --plot budgets.png

HF ``datasets`` (for a saved dataset) and matplotlib (for ``--plot``) are
imported only when they are needed.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import torch

from packfn._checks import check_positive_int
from packfn._utils import round_up
from packfn.data.examples import Examples, decode_example
from packfn.data.fit import Items, checked_budgets, lengths_tensor
from packfn.data.packer import plan_rows
from packfn.data.suggest import BudgetSuggestion, suggest_budgets

__all__ = [
    "BudgetReport",
    "CapFill",
    "Lengths",
    "add_budgets_command",
    "budget_report",
    "plot_format",
    "plot_report",
    "read_lengths",
    "report_lines",
]

PLOT_INSTALL = "pip install matplotlib (or packfn's profile extra: pip install -e '.[profile]')"


class Lengths(NamedTuple):
    """Document lengths read from a dataset.

    Attributes:
        lengths: int64 ``[n]``: the lengths of the documents read (all of
            them, or a seeded sample).
        documents: Documents in the dataset.
        source: What was read, for the report (path, split, format).
    """

    lengths: torch.Tensor
    documents: int
    source: str


class CapFill(NamedTuple):
    """The rows a sample packs into under one budget and cap (best fit, ``split=True``).

    Attributes:
        budget: Aligned row length.
        max_documents: Document cap, or None for none.
        rows: Rows.
        fill: Real tokens over ``rows * sequence``.
        aligned_fill: Real tokens over ``rows * budget``.
        documents_mean: Documents (pieces) per row.
        documents_max: The most documents a row holds.
        at_cap: Rows that hold ``max_documents`` documents (0 with no cap).
    """

    budget: int
    max_documents: int | None
    rows: int
    fill: float
    aligned_fill: float
    documents_mean: float
    documents_max: int
    at_cap: int


class BudgetReport(NamedTuple):
    """What :func:`budget_report` found.

    Attributes:
        suggestion: :func:`~packfn.suggest_budgets`' result.
        sequence, alignment, pad_to_multiple_of: The packing settings.
        table: :class:`CapFill` for the default and the suggested budget, at
            caps around the suggestion (a quarter, half, the suggestion,
            twice, none).
        curve: :class:`CapFill` at every power of two of the cap up to the
            first that binds no row, and the table's caps (for the plot),
            or empty.
        lengths: int64 ``[n]``: the lengths it packed.
    """

    suggestion: BudgetSuggestion
    sequence: int
    alignment: int
    pad_to_multiple_of: int
    table: list[CapFill]
    curve: list[CapFill]
    lengths: torch.Tensor


# ------------------------------------------------------------------ reading


def read_lengths(path: str | Path, *, split: str | None = None, sample: int | None = None, seed: int = 0) -> Lengths:
    """Read the document lengths of a tokenized dataset.

    Args:
        path: A directory written by ``datasets.Dataset.save_to_disk`` (or
            ``DatasetDict.save_to_disk``) with an ``input_ids`` column of
            token lists, or a JSONL file: per line ``{"input_ids": [...]}``
            or a bare list of token ids (blank lines skipped).
        split: The split of a saved ``DatasetDict`` (needed when it has
            more than one).
        sample: Read at most this many documents, a seeded random sample
            (only those lines of a JSONL file are parsed); all when None.
        seed: Seed of the sample.

    Returns:
        :class:`Lengths`.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError, TypeError: a directory that is not a saved dataset, a
            split that is not there, a line that is not JSON, a document
            with no ``input_ids``, non-integer or no tokens (each naming
            the line or the example); no document at all.
        ImportError: a saved dataset without HF ``datasets`` installed.
    """
    path = Path(path)
    if sample is not None:
        check_positive_int(sample, "sample")
    if not path.exists():
        raise FileNotFoundError(f"no such file or directory: {path}")
    if path.is_dir():
        return _read_saved(path, split, sample, seed)
    if split is not None:
        raise ValueError(f"split={split!r} names a split of a saved DatasetDict; {path} is a file")
    return _read_jsonl(path, sample, seed)


def _chosen(count: int, sample: int | None, seed: int) -> list[int]:
    """Indices of the documents to read, in order: all, or a seeded sample of ``sample``."""
    if sample is None or sample >= count:
        return list(range(count))
    generator = torch.Generator().manual_seed(seed)
    return torch.randperm(count, generator=generator)[:sample].sort().values.tolist()


def _read_saved(path: Path, split: str | None, sample: int | None, seed: int) -> Lengths:
    try:
        import datasets
    except ImportError as error:
        raise ImportError(
            f"reading {path}, a saved dataset, needs HF datasets: pip install datasets ({error})"
        ) from None
    try:
        dataset = datasets.load_from_disk(str(path))
    except FileNotFoundError:
        raise ValueError(
            f"{path} is a directory but not a dataset saved with save_to_disk; pass that directory or a JSONL file"
        ) from None
    source = str(path)
    if isinstance(dataset, datasets.DatasetDict):
        splits = list(dataset)
        if split is None and len(splits) == 1:
            split = splits[0]
        if split not in splits:
            wanted = "pass --split" if split is None else f"it has no split {split!r}"
            raise ValueError(f"{path} holds a DatasetDict with splits {splits}: {wanted}")
        dataset, source = dataset[split], f"{path} (split {split!r})"
    elif split is not None:
        raise ValueError(f"split={split!r} names a split of a saved DatasetDict; {path} holds one Dataset")
    documents = len(dataset)
    if not documents:
        raise ValueError(f"no documents in {source}")
    lengths = Examples(dataset).read(_chosen(documents, sample, seed), lengths_only=True).length
    return Lengths(lengths, documents, source)


def _read_jsonl(path: Path, sample: int | None, seed: int) -> Lengths:
    with path.open("rb") as handle:
        lines = [(number, line) for number, line in enumerate(handle, 1) if line.strip()]
    if not lines:
        raise ValueError(f"no documents in {path}: it has no non-blank line")
    lengths = []
    for index in _chosen(len(lines), sample, seed):
        number, line = lines[index]
        try:
            example = json.loads(line)
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"{path}, line {number}: not JSON ({error})") from None
        try:
            tokens, _ = decode_example(example, index)
        except (TypeError, ValueError) as error:
            raise type(error)(f"{path}, line {number}: {error}") from None
        lengths.append(tokens.shape[0])
    return Lengths(torch.tensor(lengths, dtype=torch.int64), len(lines), f"{path} (JSONL)")


# ------------------------------------------------------------------ measuring


def _fill(items: Items, tokens: int, sequence: int, alignment: int, multiple: int, budget: int, cap: int | None):
    no_carry = torch.zeros(0, dtype=torch.int64)
    most = max(1, sequence // multiple)  # no row holds more: each document spans a multiple at least
    plan = plan_rows(items, no_carry, checked_budgets(sequence, alignment, cap or most, budget, multiple, True))
    return CapFill(
        budget=budget,
        max_documents=cap,
        rows=plan.rows,
        fill=tokens / (plan.rows * sequence),
        aligned_fill=tokens / (plan.rows * budget),
        documents_mean=plan.row.shape[0] / plan.rows,
        documents_max=int(plan.count.max()),
        at_cap=int((plan.count == cap).sum()) if cap is not None else 0,
    )


def budget_report(
    lengths: Sequence[int] | torch.Tensor,
    *,
    sequence: int,
    alignment: int = 1,
    pad_to_multiple_of: int = 1,
    tolerance: float = 0.01,
    curve: bool = False,
) -> BudgetReport:
    """Run :func:`~packfn.suggest_budgets` and pack the lengths under budgets and caps around its suggestion.

    Args:
        lengths: Document lengths (a sample of a few thousand is plenty).
        sequence, alignment, pad_to_multiple_of, tolerance: As
            :func:`~packfn.suggest_budgets`.
        curve: Also pack at every power of two of the cap (for
            :func:`plot_report`).

    Returns:
        :class:`BudgetReport`.

    Raises:
        TypeError, ValueError: as :func:`~packfn.suggest_budgets`.
    """
    suggestion = suggest_budgets(
        lengths, sequence=sequence, alignment=alignment, pad_to_multiple_of=pad_to_multiple_of, tolerance=tolerance
    )
    values = lengths_tensor(lengths)
    count, tokens = values.shape[0], int(values.sum())
    items = Items(torch.arange(count), torch.zeros(count, dtype=torch.int64), values, values)
    budgets = sorted({round_up(sequence, alignment), suggestion.budget})
    chosen = suggestion.max_documents
    caps: list[int | None] = [*sorted({max(1, chosen // 4), max(1, chosen // 2), chosen, 2 * chosen}), None]
    table = [
        _fill(items, tokens, sequence, alignment, pad_to_multiple_of, budget, cap) for budget in budgets for cap in caps
    ]
    points = []
    if curve:
        done = {(entry.budget, entry.max_documents): entry for entry in table}
        for budget in budgets:
            most = done[(budget, None)].documents_max  # a cap of at least this binds no row
            cap = 1
            while True:  # powers of two, up to the first that binds no row
                if (budget, cap) not in done:
                    done[(budget, cap)] = _fill(items, tokens, sequence, alignment, pad_to_multiple_of, budget, cap)
                if cap >= most:
                    break
                cap *= 2
        points = sorted(
            (entry for entry in done.values() if entry.max_documents is not None),
            key=lambda entry: (entry.budget, entry.max_documents),
        )
    return BudgetReport(suggestion, sequence, alignment, pad_to_multiple_of, table, points, values)


# ------------------------------------------------------------------ telling


def report_lines(report: BudgetReport, read: Lengths | None = None) -> list[str]:
    """The printed report: the documents, the suggestion, and the fill per budget and cap."""
    suggestion, lengths = report.suggestion, report.lengths.tolist()
    sampled = f"{len(lengths):,} documents"
    if read is not None:
        sampled = (
            f"{len(lengths):,} of {read.documents:,} documents (a seeded sample)"
            if len(lengths) < read.documents
            else f"{read.documents:,} documents"
        )
        sampled += f" of {read.source}"
    # The packer splits a document longer than an empty row holds: its span must fit the row (a multiple of
    # pad_to_multiple_of) and its aligned size the budget, never narrower than the row here.
    longest = checked_budgets(report.sequence, report.alignment, 1, None, report.pad_to_multiple_of, True).longest
    longer = sum(1 for length in lengths if length > longest)
    lines = [
        f"documents:  {sampled}: {sum(lengths):,} tokens, mean {statistics.mean(lengths):,.0f}, median "
        f"{statistics.median(lengths):,.0f}, longest {max(lengths):,}"
        + (f"; {longer:,} longer than the {longest:,} tokens a row holds, split" if longer else ""),
        f"settings:   sequence={report.sequence}, alignment={report.alignment}, "
        f"pad_to_multiple_of={report.pad_to_multiple_of}",
        f"suggestion: budget={suggestion.budget}, max_documents={suggestion.max_documents}: {suggestion.rows:,} rows, "
        f"fill {suggestion.fill:.3f} of rows x sequence, {suggestion.fill_ratio:.3f} of rows x budget",
        f"            at least {suggestion.lower_bound_rows:,} rows (tokens / sequence), "
        f"{suggestion.unlimited_rows:,} with no cap and no aligned budget;",
        f"            without a cap a row holds up to {suggestion.most_documents} documents",
        "",
        f"{'budget':>8}  {'max_documents':>13}  {'rows':>7}  {'fill':>6}  {'aligned fill':>12}  "
        f"{'documents/row':>13}  {'rows at the cap':>15}",
    ]
    for entry in report.table:
        chosen = (entry.budget, entry.max_documents) == (suggestion.budget, suggestion.max_documents)
        cap = "none" if entry.max_documents is None else str(entry.max_documents)
        lines.append(
            f"{entry.budget:>8}  {cap:>13}  {entry.rows:>7,}  {entry.fill:>6.3f}  {entry.aligned_fill:>12.3f}  "
            f"{entry.documents_mean:>13.1f}  {entry.at_cap:>15,}" + ("  <- suggested" if chosen else "")
        )
    lines.append("fill: real tokens over rows x sequence; aligned fill: over rows x budget (the aligned layout);")
    lines.append("rows at the cap: rows that hold max_documents documents")
    return lines


def _pyplot():
    """matplotlib's pyplot on the Agg backend; ImportError naming the install when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError(f"plotting needs matplotlib: {PLOT_INSTALL}") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_format(path: str | Path) -> str:
    """The file format :func:`plot_report` writes ``path`` in: its suffix's, or PNG for a name without one.

    The format is tried on an empty figure, so a suffix matplotlib cannot
    write here (``.txt``, or ``.pgf`` without LaTeX) is refused before any
    work.

    Raises:
        ImportError: matplotlib is not installed.
        ValueError: matplotlib cannot write files with ``path``'s suffix
            (the message names the suffix and the ones it writes).
    """
    plt = _pyplot()
    suffix = Path(path).suffix
    written = suffix[1:].lower() or "png"
    figure = plt.figure()
    try:
        supported = figure.canvas.get_supported_filetypes()
        if written not in supported:
            raise ValueError(
                f"matplotlib cannot write {suffix} files: name a file ending in "
                f"{', '.join('.' + name for name in sorted(supported))}, or with no suffix for a PNG"
            )
        try:
            figure.savefig(io.BytesIO(), format=written)
        except (OSError, RuntimeError, ValueError) as error:
            raise ValueError(f"matplotlib cannot write {suffix} files here: {error}") from None
    finally:
        plt.close(figure)
    return written


def plot_report(report: BudgetReport, path: str | Path, *, title: str | None = None) -> Path:
    """Write the length distribution and the fill per cap under each budget to ``path``.

    Args:
        report: From :func:`budget_report` (with ``curve=True`` for the
            fill curve; else the table's caps are drawn).
        path: The file to write, exactly this path (its folder is
            created), in the format of its suffix (:func:`plot_format`):
            a PNG for ``.png`` or no suffix, a PDF for ``.pdf``, ...
        title: A title over both panels.

    Returns:
        ``path``.

    Raises:
        ImportError: matplotlib is not installed.
        ValueError: matplotlib cannot write files with ``path``'s suffix.
    """
    written = plot_format(path)
    plt = _pyplot()
    suggestion, lengths = report.suggestion, report.lengths
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    longest = int(lengths.max())
    left.hist(lengths.numpy(), bins=min(60, max(10, longest // 8)), color="#4c72b0")
    left.axvline(report.sequence, color="#c44e52", linestyle="--", label=f"row length {report.sequence}")
    mean = float(lengths.double().mean())
    left.axvline(mean, color="#555555", linestyle=":", label=f"mean {mean:,.0f}")
    left.set(xlabel="document length (tokens)", ylabel="documents", title=f"{lengths.shape[0]:,} document lengths")
    left.legend(loc="upper right", fontsize=8)

    points = report.curve or [entry for entry in report.table if entry.max_documents is not None]
    colors = ["#4c72b0", "#dd8452", "#55a868"]
    for color, budget in zip(colors, sorted({entry.budget for entry in points}), strict=False):
        group = [entry for entry in points if entry.budget == budget]
        right.plot(
            [entry.max_documents for entry in group],
            [entry.aligned_fill for entry in group],
            marker="o",
            color=color,
            label=f"budget {budget}",
        )
    right.plot(
        [suggestion.max_documents],
        [suggestion.fill_ratio],
        marker="*",
        markersize=15,
        color="#c44e52",
        linestyle="none",
        label=f"suggested: budget {suggestion.budget}, max_documents {suggestion.max_documents}",
    )
    bound = int(lengths.sum()) / (suggestion.lower_bound_rows * report.sequence)
    right.axhline(bound, color="#555555", linestyle=":", label="every row full")
    right.set_xscale("log", base=2)
    caps = sorted({entry.max_documents for entry in points})
    right.set_xticks(caps, [str(cap) for cap in caps])
    right.minorticks_off()
    right.set(
        xlabel="max_documents (cap)",
        ylabel="fill: real tokens / (rows x budget)",
        title=f"fill per cap (sequence {report.sequence}, alignment {report.alignment})",
        ylim=(0, 1.05),
    )
    right.legend(loc="lower right", fontsize=8)
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110, format=written)
    plt.close(figure)
    return path


# ------------------------------------------------------------------ the command


def add_budgets_command(commands) -> argparse.ArgumentParser:
    """Add ``budgets`` to the subparsers of ``python -m packfn``."""
    parser = commands.add_parser(
        "budgets",
        help="propose a budget and a document cap for a tokenized dataset",
        description=(
            "Read the document lengths of a tokenized dataset, run packfn.suggest_budgets on them, print the "
            "fill of the rows under budgets and caps around the suggestion, and (--plot) draw the length "
            "distribution and the fill per cap."
        ),
    )
    parser.add_argument(
        "data",
        type=Path,
        help="a directory written by datasets' save_to_disk (an input_ids column), or a JSONL file: per line "
        '{"input_ids": [...]} or a list of token ids',
    )
    parser.add_argument("--sequence", type=int, required=True, help="tokens per row")
    parser.add_argument("--alignment", type=int, default=1, help="alignment of document starts (default 1)")
    parser.add_argument(
        "--pad-to-multiple-of", type=int, default=1, help="each document's span a multiple of this (default 1)"
    )
    parser.add_argument(
        "--tolerance", type=float, default=0.01, help="fill the cap may cost, a fraction (default 0.01)"
    )
    parser.add_argument("--split", help="the split of a saved DatasetDict")
    parser.add_argument("--sample", type=int, default=10_000, help="documents to read, a seeded sample (default 10000)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sample (default 0)")
    parser.add_argument(
        "--plot",
        type=Path,
        help="write the length distribution and the fill per cap to this file: a PNG (.png or no suffix), or "
        "another format matplotlib writes by its suffix (.pdf, .svg, ...)",
    )
    parser.set_defaults(run=_run_budgets, parser=parser)
    return parser


def _run_budgets(arguments: argparse.Namespace) -> int:
    parser = arguments.parser
    for name in ("sequence", "alignment", "pad_to_multiple_of", "sample"):
        if getattr(arguments, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {getattr(arguments, name)}")
    if not 0 <= arguments.tolerance < 1:
        parser.error(f"--tolerance must be in [0, 1), got {arguments.tolerance}")
    if arguments.pad_to_multiple_of > arguments.sequence:
        parser.error(f"--pad-to-multiple-of {arguments.pad_to_multiple_of} exceeds --sequence {arguments.sequence}")
    if arguments.plot is not None:
        if arguments.plot.is_dir():
            parser.error(f"--plot {arguments.plot} is a directory: name the PNG to write")
        try:
            plot_format(arguments.plot)
        except ImportError as error:
            parser.error(f"--plot: {error}")
        except ValueError as error:
            parser.error(f"--plot {arguments.plot}: {error}")
    try:
        read = read_lengths(arguments.data, split=arguments.split, sample=arguments.sample, seed=arguments.seed)
    except (FileNotFoundError, ImportError, TypeError, ValueError) as error:
        parser.error(str(error))
    report = budget_report(
        read.lengths,
        sequence=arguments.sequence,
        alignment=arguments.alignment,
        pad_to_multiple_of=arguments.pad_to_multiple_of,
        tolerance=arguments.tolerance,
        curve=arguments.plot is not None,
    )
    print("\n".join(report_lines(report, read)))
    if arguments.plot is not None:
        try:
            written = plot_report(report, arguments.plot, title=read.source)
        except OSError as error:
            parser.error(f"--plot: cannot write {arguments.plot}: {error}")
        print(f"wrote {written}")
    return 0
