"""Reading tokenized examples: HF datasets, Arrow tables, dicts, token lists or tensors, as flat int64 tokens."""

from __future__ import annotations

import array
import ctypes
import mmap
import os
import sys
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import NamedTuple

import torch

from packfn._checks import check_fits_int64
from packfn.formats import IGNORE_INDEX

__all__ = [
    "IGNORE_INDEX",
    "STREAM_ROWS",
    "ArrowTokens",
    "Examples",
    "Tokens",
    "check_lengths",
    "concatenate",
    "decode_example",
    "is_hf_dataset",
    "is_hf_stream",
    "token_tensor",
]


class Tokens(NamedTuple):
    """A window's documents: their indices, int64 ``[documents]`` lengths, and flat int64 tokens and labels."""

    document: torch.Tensor
    length: torch.Tensor
    tokens: torch.Tensor | None  # None when only lengths were read
    labels: torch.Tensor | None  # None when the labels are the tokens


# ------------------------------------------------------------------ reading examples


def token_tensor(values: object, index: int, name: str, *, kind: str = "example") -> torch.Tensor:
    """A 1-D int64 tensor of an example's (or a collator feature's) ``name`` (``input_ids``, ``labels``)."""
    if isinstance(values, list) and values and type(values[0]) is not bool:
        # Ints through a C array: several times faster than torch.as_tensor on a list. The array refuses
        # floats and strings (TypeError: the checks below name them) and ids past int64.
        try:
            return torch.frombuffer(array.array("q", values), dtype=torch.int64)
        except OverflowError:
            raise ValueError(f"{kind} {index}: {name} holds token ids outside int64") from None
        except TypeError:
            pass
    try:
        tensor = torch.as_tensor(values)
    except (TypeError, ValueError, RuntimeError):
        _raise_if_null(values, index, name, kind)
        raise TypeError(
            f"{kind} {index}: {name} must be a sequence of integer token ids, got {type(values).__name__}"
        ) from None
    if tensor.numel() == 0 and tensor.ndim == 1:
        return tensor.to(torch.int64)  # an empty example: its caller names the problem
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool:
        raise TypeError(f"{kind} {index}: {name} must hold integer token ids, got dtype {tensor.dtype}")
    if tensor.ndim != 1:
        raise ValueError(f"{kind} {index}: {name} must be 1-D, got shape {tuple(tensor.shape)}")
    check_fits_int64(tensor, f"{kind} {index}: {name}", "token ids")
    return tensor.to(torch.int64)


def _null_entry(index: int, name: str, position: int, *, kind: str = "example") -> TypeError:
    """The error of a null (``None``) entry inside an example's ``name`` list, at token ``position``."""
    return TypeError(f"{kind} {index}: {name} holds a null (None) at token {position}: give every token a value")


def _raise_if_null(values: object, index: int, name: str, kind: str = "example") -> None:
    """Raise :func:`_null_entry` for the first ``None`` of a list or tuple (called once a conversion has failed)."""
    if isinstance(values, (list, tuple)):
        position = next((position for position, value in enumerate(values) if value is None), None)
        if position is not None:
            raise _null_entry(index, name, position, kind=kind) from None


def decode_example(example: object, index: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(input_ids, labels or None)`` of one example: a mapping with ``input_ids`` or the token ids themselves."""
    labels = loss_mask = None
    if isinstance(example, Mapping):
        if "input_ids" not in example:
            raise ValueError(f"example {index} has no 'input_ids' (keys: {sorted(map(str, example))})")
        if example["input_ids"] is None:
            raise ValueError(f"example {index} has no 'input_ids' (null)")
        tokens = token_tensor(example["input_ids"], index, "input_ids")
        if example.get("labels") is not None:
            labels = token_tensor(example["labels"], index, "labels")
        if example.get("loss_mask") is not None:
            try:
                loss_mask = torch.as_tensor(example["loss_mask"])
            except (TypeError, ValueError, RuntimeError):
                _raise_if_null(example["loss_mask"], index, "loss_mask")
                raise TypeError(
                    f"example {index}: loss_mask must be a sequence of 0 / 1 (or bool) entries, "
                    f"got {type(example['loss_mask']).__name__}"
                ) from None
    else:
        token_like = isinstance(example, (Sequence, torch.Tensor)) or hasattr(example, "__array_interface__")
        if isinstance(example, (str, bytes)) or not token_like:
            raise TypeError(
                f"example {index} must be a mapping with 'input_ids' or a sequence of token ids, "
                f"got {type(example).__name__}"
            )
        tokens = token_tensor(example, index, "input_ids")
    if tokens.numel() == 0:
        raise ValueError(f"example {index} is empty: a document needs at least one token")
    for name, values in (("labels", labels), ("loss_mask", loss_mask)):
        if values is not None and values.shape != tokens.shape:
            raise ValueError(
                f"example {index}: {name} must have as many entries as input_ids, "
                f"got {tuple(values.shape)} and {tuple(tokens.shape)}"
            )
    if loss_mask is not None:
        labels = (tokens if labels is None else labels).masked_fill(loss_mask == 0, IGNORE_INDEX)
    return tokens, labels


def concatenate(
    documents: list[int], decoded: list[tuple[torch.Tensor, torch.Tensor | None]], lengths_only: bool
) -> Tokens:
    length = torch.tensor([tokens.shape[0] for tokens, _ in decoded], dtype=torch.int64)
    if lengths_only:
        return Tokens(torch.tensor(documents, dtype=torch.int64), length, None, None)
    tokens = torch.cat([tokens for tokens, _ in decoded]) if decoded else torch.zeros(0, dtype=torch.int64)
    check_token_ids(documents, length, tokens)
    labels = None
    if any(labels is not None for _, labels in decoded):
        labels = torch.cat([tokens if labels is None else labels for tokens, labels in decoded])
    return Tokens(torch.tensor(documents, dtype=torch.int64), length, tokens, labels)


def is_hf_dataset(value: object) -> bool:
    """Whether ``value`` is an HF ``datasets.Dataset``, by its interface.

    A streaming ``IterableDataset`` has no length and is not one
    (:func:`is_hf_stream`).
    """
    return hasattr(value, "column_names") and hasattr(value, "with_format") and hasattr(value, "__len__")


def is_hf_stream(value: object) -> bool:
    """Whether ``value`` is an HF streaming ``datasets.IterableDataset``, by its interface (``iter``, no length)."""
    return (
        hasattr(value, "column_names")
        and hasattr(value, "with_format")
        and hasattr(value, "iter")
        and not hasattr(value, "__len__")
    )


def _arrow_table(value: object):
    """``value`` as a ``pyarrow.Table`` when it is a Table or a RecordBatch, else None (pyarrow is not imported)."""
    pa = sys.modules.get("pyarrow")
    if pa is None:
        return None
    if isinstance(value, pa.RecordBatch):
        return pa.Table.from_batches([value])
    return value if isinstance(value, pa.Table) else None


def _arrow_tokens(examples: object) -> ArrowTokens:
    """The :class:`ArrowTokens` of a ``pyarrow.Table`` (or RecordBatch) or an HF ``datasets.Dataset``."""
    table = _arrow_table(examples)
    if table is not None:
        return ArrowTokens(table)
    columns = list(examples.column_names)
    if "input_ids" not in columns:
        raise ValueError(f"the dataset has no 'input_ids' column (columns: {columns})")
    # The rows of a selected, shuffled or filtered dataset go through its indices mapping (None without one).
    indices = getattr(examples, "_indices", None)
    files = [entry["filename"] for entry in getattr(examples, "cache_files", ())]  # its memory-mapped Arrow files
    return ArrowTokens(examples.data.table, None if indices is None else indices.column(0), files)


STREAM_ROWS = 1000
"""Rows an HF ``IterableDataset`` is read in at a time (one Arrow table each)."""

TOKEN_COLUMNS = ("input_ids", "labels", "loss_mask")


class Examples:
    """The user's examples behind one interface: indexed reads (lists, Arrow tables, HF datasets) or one pass (streams).

    An HF ``datasets.Dataset`` and a ``pyarrow.Table`` are read in place
    through Arrow (:class:`ArrowTokens`); an HF ``IterableDataset`` in Arrow
    tables of :data:`STREAM_ROWS` rows, every process reading all of it
    (NOTE [Reading an Arrow corpus in place]).
    """

    def __init__(self, examples: object) -> None:
        self.examples = examples
        self.arrow: ArrowTokens | None = None
        self.hf_stream = None
        if _arrow_table(examples) is not None or is_hf_dataset(examples):
            self.arrow = _arrow_tokens(examples)
            self.count: int | None = self.arrow.count
        elif is_hf_stream(examples):
            if getattr(examples, "_distributed", None) is not None:
                # Ranks that read other documents pack other plans and would count other numbers of batches.
                raise ValueError(
                    "examples is a stream split by node (datasets.distributed.split_dataset_by_node): pass the whole "
                    "stream to every rank, PackedDataset deals the batches to the ranks itself (rank=, world=)"
                )
            columns = examples.column_names  # None where the stream does not know its features
            if columns is not None and "input_ids" not in columns:
                raise ValueError(f"the dataset has no 'input_ids' column (columns: {list(columns)})")
            kept = None if columns is None else [name for name in TOKEN_COLUMNS if name in columns]
            self.hf_stream = (examples if kept is None else examples.select_columns(kept)).with_format("arrow")
            self.count = None
        elif isinstance(examples, Sequence) and not isinstance(examples, (str, bytes)):
            self.count = len(examples)
        elif isinstance(examples, Iterable) and not isinstance(examples, (str, bytes)):
            if iter(examples) is examples:
                raise TypeError(
                    "examples must be re-iterable (a list, a datasets.Dataset, or an object whose __iter__ starts "
                    "over): a one-shot iterator cannot be split across workers, shuffled or resumed"
                )
            self.count = None
        else:
            hint = ""
            if hasattr(examples, "to_table") and hasattr(examples, "count_rows"):  # a pyarrow.dataset.Dataset
                hint = (
                    ": for Parquet files, datasets.load_dataset('parquet', data_files=...) writes them once as "
                    "memory-mapped Arrow, read in place (or streaming=True, read in one pass)"
                )
            raise TypeError(
                "examples must be a datasets.Dataset or IterableDataset, a pyarrow.Table, a sequence or a "
                f"re-iterable of examples, got {type(examples).__name__}{hint}"
            )

    def __getstate__(self) -> dict:
        # Pickled (a DataLoader worker started by spawn or forkserver), an HF dataset names its memory-mapped
        # files, while its Arrow columns would be copied whole: the worker reads them again from the examples.
        return {**self.__dict__, "arrow": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if self.count is not None and (_arrow_table(self.examples) is not None or is_hf_dataset(self.examples)):
            self.arrow = _arrow_tokens(self.examples)

    def read(self, documents: list[int], *, lengths_only: bool = False) -> Tokens:
        """The examples at ``documents`` (indexable examples only)."""
        if self.arrow is not None:
            return self.arrow.read(documents, lengths_only=lengths_only)
        return concatenate(
            documents, [decode_example(self.examples[index], index) for index in documents], lengths_only
        )

    def stream(self) -> Iterator[tuple[int, tuple[torch.Tensor, torch.Tensor | None]]]:
        """``(index, (input_ids, labels or None))`` of every example in order, decoded."""
        if self.hf_stream is not None:
            return self._stream_arrow()
        if self.count is None:
            return ((index, decode_example(example, index)) for index, example in enumerate(self.examples))
        return ((index, decode_example(self.examples[index], index)) for index in range(self.count))

    def _stream_arrow(self) -> Iterator[tuple[int, tuple[torch.Tensor, torch.Tensor | None]]]:
        # iter(), not __iter__: inside a DataLoader worker, __iter__ gives the worker only some of the stream's
        # shards, and every worker must read all of it to pack the same plan.
        first = 0
        for table in self.hf_stream.iter(batch_size=STREAM_ROWS):
            if not table.num_rows:
                continue
            documents = list(range(first, first + table.num_rows))
            tokens = ArrowTokens(table, first=first).read(documents)
            first += table.num_rows
            counts = tokens.length.tolist()
            pieces = tokens.tokens.split(counts)
            labels = [None] * len(counts) if tokens.labels is None else tokens.labels.split(counts)
            yield from zip(documents, zip(pieces, labels, strict=True), strict=True)


# ------------------------------------------------------------------ Arrow tables read in place

# NOTE [Reading an Arrow corpus in place]
# A datasets.Dataset saved with save_to_disk (or cached by load_dataset, Parquet files included) is a table of
# memory-mapped Arrow record batches; a list column is an offsets buffer ([rows + 1] ints) and a values buffer
# (the tokens). The loader asks for two things, and each reads only what it needs:
# - the lengths of a window's documents (every process, for the plan): at the first read, each record batch's
#   offsets are copied once (4 bytes a document, 8 with large_list offsets; with HF's indices mapping, from
#   select, shuffle or filter, its rows too, 8 bytes a document); a length is offsets[row + 1] - offsets[row].
#   No row and no token is read for it.
# - the tokens of the documents of its own batches: from offsets[row] to offsets[row + 1] in the values of the
#   row's record batch, gathered record batch by record batch into one flat int64 array in the documents' order.
# Memory. Pages of a file mapping that a process touches count in its RSS, and a kernel that maps whole large
# folios on a fault maps hundreds of KiB around every document read at random: reading a window through the
# mapping would add hundreds of MiB, and reading an epoch through it the whole share. So where a buffer lies in
# a read-only mapping of the dataset's own Arrow files (its cache_files, found in /proc/self/maps), its bytes
# are read from the file with pread instead (the page cache serves them, nothing is mapped); elsewhere (a table
# in memory, another system) through the buffer itself. What does go through the mapping (the file headers
# that load_from_disk reads, the Arrow take kept for values with nulls or bits) is unmapped after each read with
# madvise(MADV_DONTNEED), which for a read-only file mapping drops pages from the process only. A process then
# holds the offsets and its window, whatever the corpus size, and reads no token of a batch it does not build.
# A stream (IterableDataset) has no offsets to read ahead: it is read whole, in Arrow tables, by every process.


class _MappedFiles:
    """The read-only mappings of some files in this process (Linux): their bytes by ``pread``, their pages unmapped.

    NOTE [Reading an Arrow corpus in place]. The mappings are read from
    ``/proc/self/maps`` at the first call; where it is missing, no buffer
    lies in them (they are read through the buffers) and nothing is unmapped.
    """

    def __init__(self, files: Iterable[str]) -> None:
        self.files = {os.path.realpath(name) for name in files}
        self.maps: list[tuple[int, int, int, str]] | None = None  # start, end, file offset, path
        self.descriptors: dict[str, int] = {}
        self.touched = True  # pages may be mapped (load_from_disk read the files' headers through the mapping)
        weakref.finalize(self, _close_all, self.descriptors)

    def _find(self) -> None:
        self.maps = []
        try:
            with open("/proc/self/maps") as maps:
                lines = maps.read().splitlines()
        except OSError:
            return
        for line in lines:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and "w" not in fields[1] and fields[5] in self.files:
                start, end = (int(value, 16) for value in fields[0].split("-"))
                self.maps.append((start, end, int(fields[2], 16), fields[5]))
        self.maps.sort()

    def where(self, address: int, size: int) -> tuple[int, int] | None:
        """``(descriptor, position)`` in the file of bytes ``[address, address + size)``, if one mapping holds them."""
        if self.maps is None:
            self._find()
        for start, end, offset, path in self.maps:
            if start <= address and address + size <= end:
                if path not in self.descriptors:
                    try:
                        self.descriptors[path] = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                    except OSError:  # gone since it was mapped: read through the mapping
                        return None
                return self.descriptors[path], address - start + offset
        return None

    @staticmethod
    def pread(descriptors, out, positions, sizes) -> None:
        """Read ``sizes[k]`` bytes at ``positions[k]`` of file ``descriptors[k]``, for each ``k`` in turn, into ``out``.

        Ranges that continue one another in the same file are read at once.
        """
        import numpy as np

        view = memoryview(out).cast("B")
        ends = positions + sizes
        breaks = np.flatnonzero((positions[1:] != ends[:-1]) | (descriptors[1:] != descriptors[:-1])) + 1
        firsts = np.concatenate([[0], breaks])
        lasts = np.concatenate([breaks, [len(positions)]]) - 1
        runs = ends[lasts] - positions[firsts]
        cursors = np.cumsum(runs) - runs
        # One call a run, through plain ints: the loop's cost is about that of the system call.
        for descriptor, position, size, cursor in zip(
            descriptors[firsts].tolist(), positions[firsts].tolist(), runs.tolist(), cursors.tolist(), strict=True
        ):
            done = os.preadv(descriptor, [view[cursor : cursor + size]], position)
            while done < size:  # a short read (a signal, or a file that ended)
                if done <= 0:
                    raise OSError(f"the dataset's file ended {size} bytes early at byte {position}")
                cursor, position, size = cursor + done, position + done, size - done
                done = os.preadv(descriptor, [view[cursor : cursor + size]], position)

    def release(self) -> None:
        """Unmap the pages of the files' mappings, if a read went through them (a later read maps them again)."""
        if not self.touched:
            return
        self.touched = False
        if self.maps is None:
            self._find()
        if self.maps and hasattr(mmap, "MADV_DONTNEED"):
            madvise = ctypes.CDLL(None, use_errno=True).madvise
            madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
            for start, end, _, _ in self.maps:
                madvise(start, end - start, mmap.MADV_DONTNEED)


def _close_all(descriptors: dict[str, int]) -> None:
    for descriptor in descriptors.values():
        os.close(descriptor)
    descriptors.clear()


def _buffer_bytes(array, index: int, width: int, first: int, count: int) -> tuple[int, int]:
    """``(address, size)`` of elements ``first, ..., first + count - 1`` of buffer ``index`` of an Arrow array."""
    return array.buffers()[index].address + (array.offset + first) * width, count * width


class _Chunks:
    """A list ``pyarrow.ChunkedArray`` (or one of integers) addressed by row: each row's chunk and values."""

    def __init__(self, column, files: _MappedFiles | None = None) -> None:
        import numpy as np
        import pyarrow as pa

        self.type, self.files = column.type, files
        self.fixed = column.type.list_size if pa.types.is_fixed_size_list(column.type) else None
        self.chunks = [chunk for chunk in column.chunks if len(chunk)]
        sizes = np.array([len(chunk) for chunk in self.chunks], dtype=np.int64)
        self.ends = np.cumsum(sizes)
        self.starts = self.ends - sizes
        self.offsets = None  # every chunk's offsets one after another (rows + 1 each), copied at the first read
        self.null = None  # whether each row is null, where any is
        self.in_files = None  # each chunk's values in the files (descriptors, bytes of value 0), at the first read

    def _read(self, chunk, index: int, width: int, first: int, count: int, dtype):
        """Elements ``first ... first + count - 1`` of buffer ``index`` of ``chunk``, from the file where it can."""
        import numpy as np

        address, size = _buffer_bytes(chunk, index, width, first, count)
        located = None if self.files is None else self.files.where(address, size)
        if located is None:
            return None
        out = np.empty(count, dtype=dtype)
        _MappedFiles.pread(np.array([located[0]]), out, np.array([located[1]]), np.array([size]))
        return out

    def prepare(self) -> None:
        """Copy the offsets and the nulls (the first read of lengths)."""
        import numpy as np
        import pyarrow as pa

        if self.in_files is not None:  # done
            return
        if self.fixed is None:
            dtype = np.int64 if pa.types.is_large_list(self.type) else np.int32
            width = np.dtype(dtype).itemsize
            offsets = np.empty(int(self.ends[-1]) + len(self.chunks) if self.chunks else 0, dtype=dtype)
            for number, chunk in enumerate(self.chunks):
                place = int(self.starts[number]) + number
                copied = self._read(chunk, 1, width, 0, len(chunk) + 1, dtype)
                offsets[place : place + len(chunk) + 1] = chunk.offsets.to_numpy() if copied is None else copied
            self.offsets = offsets
        if any(chunk.null_count for chunk in self.chunks):
            if self.files is not None:
                self.files.touched = True
            self.null = np.concatenate([~chunk.is_valid().to_numpy(zero_copy_only=False) for chunk in self.chunks])
        self.in_files = self._values_in_files()

    def _values_in_files(self):
        """Each chunk's file descriptor and the file byte of its value 0 (int64 NumPy ``[chunks]`` each).

        Only when the values of every chunk are integers without nulls lying
        in a mapping of the files; else ``(None, None)``.
        """
        import numpy as np
        import pyarrow as pa

        if self.files is None or not self.chunks or not pa.types.is_integer(self.type.value_type):
            return None, None
        descriptors, positions = [], []
        width = self.type.value_type.bit_width // 8
        for chunk in self.chunks:
            values = chunk.values
            located = None if values.null_count else self.files.where(*_buffer_bytes(values, 1, width, 0, len(values)))
            if located is None:
                return None, None
            descriptors.append(located[0])
            positions.append(located[1])
        return np.array(descriptors, dtype=np.int64), np.array(positions, dtype=np.int64)

    def integers(self):
        """int64 NumPy ``[rows]``: every entry of a column of integers (the indices mapping)."""
        import numpy as np

        if self.files is not None:
            self.files.touched = True
        if not self.chunks:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([chunk.to_numpy(zero_copy_only=False).astype(np.int64) for chunk in self.chunks])

    def bounds(self, rows):
        """int64 NumPy ``[rows]`` each: where each row's values start and end among its chunk's values."""
        import numpy as np

        self.prepare()
        number = np.searchsorted(self.ends, rows, side="right")
        local = rows - self.starts[number]
        if self.fixed is not None:
            shift = np.array([chunk.offset for chunk in self.chunks], dtype=np.int64)[number]
            begin = (shift + local) * self.fixed
            return begin, begin + self.fixed
        place = rows + number  # chunk k's offsets start at row starts[k] + k of the copy
        return self.offsets[place].astype(np.int64), self.offsets[place + 1].astype(np.int64)

    def lengths(self, rows):
        """int64 NumPy ``[rows]`` list lengths (0 where null) and bool ``[rows]`` nulls, from the offsets alone."""
        import numpy as np

        begin, end = self.bounds(rows)
        length = end - begin
        null = np.zeros(len(rows), dtype=bool) if self.null is None else self.null[rows]
        length[null] = 0
        return length, null

    def locate(self, rows) -> list[tuple[int, object, object]]:
        """``(chunk, where, local)`` per chunk holding some of ``rows``: their positions in ``rows``, in the chunk."""
        import numpy as np

        if not len(rows):
            return []
        chunk = np.searchsorted(self.ends, rows, side="right")
        if (chunk == chunk[0]).all():
            return [(int(chunk[0]), np.arange(len(rows)), rows - self.starts[chunk[0]])]
        order = np.argsort(chunk, kind="stable")
        numbers, firsts = np.unique(chunk[order], return_index=True)
        parts = []
        for number, where in zip(numbers.tolist(), np.split(order, firsts[1:]), strict=True):
            parts.append((number, where, rows[where] - self.starts[number]))
        return parts

    def take(self, rows, length) -> list[tuple[object, object, object]]:
        """``(where, length, values)`` per chunk: the flat list values of ``rows`` it holds.

        Integer values without nulls come back as NumPy: read from the files
        for all rows at once (where every chunk's values lie in a mapping of
        the files), else gathered from a view of each chunk's values; others
        (nulls, a bool mask) as Arrow, by an Arrow take.
        """
        import numpy as np
        import pyarrow as pa

        begin, _ = self.bounds(rows)
        descriptors, positions = self.in_files
        if descriptors is not None:  # every row at once, in their order, from the files
            number = np.searchsorted(self.ends, rows, side="right")
            width = self.type.value_type.bit_width // 8
            out = np.empty(int(length.sum()), dtype=self.type.value_type.to_pandas_dtype())
            _MappedFiles.pread(descriptors[number], out, positions[number] + begin * width, length * width)
            return [(np.arange(len(rows)), length, out)]
        parts = []
        for number, where, local in self.locate(rows):
            chunk, count = self.chunks[number], length[where]
            values = chunk.values
            if values.null_count or not pa.types.is_integer(values.type):
                if self.files is not None:
                    self.files.touched = True
                parts.append((where, count, chunk.take(pa.array(local)).flatten()))
                continue
            # Each row's values in turn: begin[k], begin[k] + 1, ... (count[k] of them).
            shift = np.repeat(begin[where] - (np.cumsum(count) - count), count)
            parts.append((where, count, values.to_numpy()[np.arange(len(shift)) + shift]))
        return parts


def _check_column(name: str, column_type) -> None:
    import pyarrow as pa

    if not (
        pa.types.is_list(column_type)
        or pa.types.is_large_list(column_type)
        or pa.types.is_fixed_size_list(column_type)  # Sequence(..., length=N)
    ):
        raise TypeError(f"column {name!r} must hold lists of token ids, got {column_type}")
    if name != "loss_mask" and not pa.types.is_integer(column_type.value_type):
        raise TypeError(f"column {name!r} must hold integer token ids, got {column_type.value_type}")


class ArrowTokens:
    """The token columns of an Arrow table, read in place (NOTE [Reading an Arrow corpus in place]).

    ``table`` is a ``pyarrow.Table`` with an ``input_ids`` list column (and
    optionally ``labels``, ``loss_mask``); ``indices`` maps example ``k``
    to table row ``indices[k]`` (HF's indices mapping), None for row ``k``;
    ``files`` are the Arrow files the table maps (an HF dataset's
    ``cache_files``), read with ``pread``; ``first`` is the index of its
    first example (a stream's table: ``read`` takes the examples' indices,
    and errors name them).
    """

    def __init__(self, table, indices=None, files: Iterable[str] = (), first: int = 0) -> None:
        names = list(table.column_names)
        if "input_ids" not in names:
            raise ValueError(f"the dataset has no 'input_ids' column (columns: {names})")
        files = list(files)
        self.files = _MappedFiles(files) if files else None
        self.columns = {name: _Chunks(table.column(name), self.files) for name in TOKEN_COLUMNS if name in names}
        self.indices = None if indices is None else _Chunks(indices, self.files)
        self.count = table.num_rows if indices is None else len(indices)
        self.row = None  # with an indices mapping: each example's row, at the first read
        self.prepared = False
        self.first = first

    def _prepare(self) -> None:
        """Check the columns' types; copy the offsets, and the rows of an indices mapping (the first read)."""
        for name, column in self.columns.items():
            _check_column(name, column.type)
        for column in self.columns.values():
            column.prepare()
        if self.indices is not None:
            self.row = self.indices.integers()
        self.prepared = True

    def read(self, documents: list[int], *, lengths_only: bool = False) -> Tokens:
        """The examples at ``documents``: their lengths from the offsets, and unless ``lengths_only`` their tokens."""
        import numpy as np

        if not documents:  # nothing to read (an empty dataset's column may even be typed null)
            nothing = torch.zeros(0, dtype=torch.int64)
            return Tokens(nothing, nothing, None if lengths_only else nothing, None)
        try:
            if not self.prepared:
                self._prepare()
            positions = np.asarray(documents, dtype=np.int64) - self.first
            rows = positions if self.row is None else self.row[positions]
            length, null = self.columns["input_ids"].lengths(rows)
            check_lengths(documents, torch.from_numpy(length), torch.from_numpy(null))
            tokens = labels = None
            if not lengths_only:
                tokens, labels = self._tokens(documents, rows, length)
                check_token_ids(documents, torch.from_numpy(length), tokens)
        finally:
            if self.files is not None:
                self.files.release()
        return Tokens(torch.tensor(documents, dtype=torch.int64), torch.from_numpy(length), tokens, labels)

    def _tokens(self, documents: list[int], rows, length) -> tuple[torch.Tensor, torch.Tensor | None]:
        import numpy as np

        for name in ("labels", "loss_mask"):
            if name in self.columns:
                counts, missing = self.columns[name].lengths(rows)
                wrong = np.flatnonzero((counts != length) | missing)
                if len(wrong):
                    null_note = " (it is null: give every example one, or drop the column)" if missing[wrong[0]] else ""
                    raise ValueError(
                        f"example {documents[int(wrong[0])]}: {name} must have as many entries as input_ids{null_note}"
                    )
        starts = np.cumsum(length) - length
        flat = {
            name: self._values(name, column, rows, length, starts, documents) for name, column in self.columns.items()
        }
        tokens = flat["input_ids"]
        labels = flat.get("labels")
        if "loss_mask" in flat:
            labels = (tokens if labels is None else labels).masked_fill(flat["loss_mask"] == 0, IGNORE_INDEX)
        return tokens, labels

    def _values(self, name: str, column: _Chunks, rows, length, starts, documents: list[int]) -> torch.Tensor:
        """The flat values of column ``name`` at ``rows``, in their order: int64 (token ids) or as stored (a mask)."""
        import numpy as np

        parts = column.take(rows, length)
        nulls = []  # (position among the documents, token) of each part's first null
        for where, count, values in parts:
            if getattr(values, "null_count", 0):
                example, token = _first_null(values, count)
                nulls.append((int(where[example]), token))
        if nulls:
            position, token = min(nulls)
            raise _null_entry(documents[position], name, token)
        arrays = []
        for where, count, values in parts:
            array = values if isinstance(values, np.ndarray) else values.to_numpy(zero_copy_only=False)
            if name != "loss_mask":
                if array.dtype == np.uint64:
                    check_fits_int64(torch.from_numpy(array.copy()), f"column {name!r}", "token ids")
                array = array.astype(np.int64, copy=False)
            arrays.append((where, count, array))
        if len(arrays) == 1 and np.array_equal(arrays[0][0], np.arange(len(rows))):
            array = arrays[0][2]
            return torch.from_numpy(array if array.flags.writeable else array.copy())
        out = np.empty(int(length.sum()), dtype=arrays[0][2].dtype)
        for where, count, array in arrays:
            # Each document's values go to its place in the documents' order.
            shift = np.repeat(starts[where] - (np.cumsum(count) - count), count)
            out[np.arange(len(array)) + shift] = array
        return torch.from_numpy(out)


def _first_null(values, count) -> tuple[int, int]:
    """Which list of ``count`` lengths holds the first null of their flat ``values``, and at which of its tokens."""
    import pyarrow.compute as pc

    return _holder(count, pc.index(values.is_null(), True).as_py())


def _holder(count, position: int) -> tuple[int, int]:
    """Which list of ``count`` lengths (an array) holds entry ``position`` of their flat values, and at which index."""
    import numpy as np

    ends = np.cumsum(count)
    example = int(np.searchsorted(ends, position, side="right"))
    return example, position - int(ends[example] - count[example])


def check_token_ids(documents: list[int], length: torch.Tensor, tokens: torch.Tensor) -> None:
    """Raise ``ValueError`` naming the first example whose ``input_ids`` hold a negative id (one pass, no copy)."""
    if not tokens.numel() or int(tokens.min()) >= 0:
        return
    first = int((tokens < 0).nonzero()[0, 0])
    example, _ = _holder(length.numpy(), first)
    raise ValueError(f"example {documents[example]}: input_ids holds a negative token id ({int(tokens[first])})")


def check_lengths(documents: list[int], length: torch.Tensor, null) -> None:
    """Raise for an example with no ``input_ids`` (a null) or none at all (an empty list)."""
    null = torch.as_tensor(null, dtype=torch.bool)
    if bool(null.any()):
        raise ValueError(f"example {documents[int(torch.nonzero(null)[0, 0])]} has no 'input_ids' (null)")
    if bool((length == 0).any()):
        raise ValueError(
            f"example {documents[int(torch.nonzero(length == 0)[0, 0])]} is empty: a document needs at least one token"
        )
