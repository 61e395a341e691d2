"""Reading tokenized examples: an HF ``datasets.Dataset``, dicts, token lists or tensors, as flat int64 tokens."""

from __future__ import annotations

import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import NamedTuple

import torch

from packfn._checks import check_fits_int64
from packfn.formats import IGNORE_INDEX

__all__ = [
    "IGNORE_INDEX",
    "Examples",
    "Tokens",
    "check_lengths",
    "concatenate",
    "decode_example",
    "is_hf_dataset",
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
    labels = None
    if any(labels is not None for _, labels in decoded):
        labels = torch.cat([tokens if labels is None else labels for tokens, labels in decoded])
    return Tokens(torch.tensor(documents, dtype=torch.int64), length, tokens, labels)


def is_hf_dataset(value: object) -> bool:
    """Whether ``value`` is an HF ``datasets.Dataset``, by its interface.

    A streaming ``IterableDataset`` has no length and is not one: it is read
    as any re-iterable is.
    """
    return hasattr(value, "column_names") and hasattr(value, "with_format") and hasattr(value, "__len__")


class Examples:
    """The user's examples behind one interface: indexed reads (lists, HF datasets) or one pass (other iterables)."""

    def __init__(self, examples: object) -> None:
        self.examples = examples
        self.arrow = None
        if is_hf_dataset(examples):
            columns = list(examples.column_names)
            if "input_ids" not in columns:
                raise ValueError(f"the dataset has no 'input_ids' column (columns: {columns})")
            kept = [name for name in ("input_ids", "labels", "loss_mask") if name in columns]
            self.arrow = examples.select_columns(kept).with_format("arrow")
            self.count: int | None = len(examples)
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
            raise TypeError(
                "examples must be a datasets.Dataset, a sequence or a re-iterable of examples, "
                f"got {type(examples).__name__}"
            )

    def read(self, documents: list[int], *, lengths_only: bool = False) -> Tokens:
        """The examples at ``documents`` (indexable examples only)."""
        if self.arrow is not None:
            return self._read_arrow(documents, lengths_only)
        return concatenate(
            documents, [decode_example(self.examples[index], index) for index in documents], lengths_only
        )

    def _read_arrow(self, documents: list[int], lengths_only: bool) -> Tokens:
        import pyarrow as pa
        import pyarrow.compute as pc

        if not documents:  # nothing to read (an empty dataset's column may even be typed null)
            nothing = torch.zeros(0, dtype=torch.int64)
            return Tokens(nothing, nothing, None if lengths_only else nothing, None)
        table = self.arrow[documents]
        columns = {name: table.column(name).combine_chunks() for name in table.column_names}
        for name, column in columns.items():
            if not (
                pa.types.is_list(column.type)
                or pa.types.is_large_list(column.type)
                or pa.types.is_fixed_size_list(column.type)  # Sequence(..., length=N)
            ):
                raise TypeError(f"column {name!r} must hold lists of token ids, got {column.type}")
            value_type = column.type.value_type
            if name != "loss_mask" and not pa.types.is_integer(value_type):
                raise TypeError(f"column {name!r} must hold integer token ids, got {value_type}")
        ids = columns["input_ids"]
        length = torch.from_numpy(
            pc.list_value_length(ids).fill_null(0).to_numpy(zero_copy_only=False, writable=True)
        ).long()
        check_lengths(documents, length, ids.is_null().to_numpy(zero_copy_only=False, writable=True))
        if lengths_only:
            return Tokens(torch.tensor(documents, dtype=torch.int64), length, None, None)
        for name in ("labels", "loss_mask"):
            if name in columns:
                counts = pc.list_value_length(columns[name]).fill_null(-1).to_numpy(zero_copy_only=False, writable=True)
                wrong = torch.nonzero(torch.from_numpy(counts).long() != length).reshape(-1)
                if wrong.numel():
                    null = " (it is null: give every example one, or drop the column)" if counts[wrong[0]] < 0 else ""
                    raise ValueError(
                        f"example {documents[int(wrong[0])]}: {name} must have as many entries as input_ids{null}"
                    )
        values = {name: column.flatten() for name, column in columns.items()}
        for name, flat_values in values.items():
            if flat_values.null_count:  # a bit count of the validity bitmap at most (none without nulls)
                position = pc.index(flat_values.is_null(), True).as_py()
                example = int(torch.searchsorted(torch.cumsum(length, 0), position, right=True))
                raise _null_entry(documents[example], name, position - int(length[:example].sum()))
        flat = {
            name: torch.from_numpy(flat_values.to_numpy(zero_copy_only=False, writable=True))
            for name, flat_values in values.items()
        }
        for name in ("input_ids", "labels"):
            if name in flat:
                check_fits_int64(flat[name], f"column {name!r}", "token ids")
        tokens = flat["input_ids"].to(torch.int64)
        labels = flat["labels"].to(torch.int64) if "labels" in flat else None
        if "loss_mask" in flat:
            labels = (tokens if labels is None else labels).masked_fill(flat["loss_mask"] == 0, IGNORE_INDEX)
        return Tokens(torch.tensor(documents, dtype=torch.int64), length, tokens, labels)

    def stream(self) -> Iterator[tuple[int, object]]:
        """``(index, example)`` over all examples in order."""
        if self.count is None:
            return enumerate(self.examples)
        return ((index, self.examples[index]) for index in range(self.count))


def check_lengths(documents: list[int], length: torch.Tensor, null) -> None:
    """Raise for an example with no ``input_ids`` (a null) or none at all (an empty list)."""
    null = torch.as_tensor(null, dtype=torch.bool)
    if bool(null.any()):
        raise ValueError(f"example {documents[int(torch.nonzero(null)[0, 0])]} has no 'input_ids' (null)")
    if bool((length == 0).any()):
        raise ValueError(
            f"example {documents[int(torch.nonzero(length == 0)[0, 0])]} is empty: a document needs at least one token"
        )
