"""The documents the scripts train on, with nothing downloaded: the Python standard library's own sources.

Every Python installation ships its standard library as ``.py`` files. Each
top-level module (``<stdlib>/*.py``, in name order) is cut into documents
at its top-level statements: a function or class (with its decorators) is
a document, and each run of other top-level statements (imports,
assignments, ``if __name__ == ...`` blocks) is one more. The lengths are
those of real code: a few tokens to tens of thousands, heavy-tailed.

Tokens come from a ``tokenizers`` BPE trained on the fly on the documents
used (byte-level, so nothing is unknown, when the vocabulary has room for
the 256 bytes; otherwise over characters, the rarest mapped to ``<unk>``).
The tokenizer and the documents are deterministic: the same vocabulary and
token count give the same token ids on every machine with the same Python.

:func:`exponential_documents` gives random ids in documents of seeded
exponential lengths instead. A script picks one with ``--data``
(:func:`add_data_argument`) and reads it with :func:`training_documents`.
"""

from __future__ import annotations

import argparse
import ast
import math
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import torch

__all__ = [
    "add_data_argument",
    "document_lengths",
    "documents_source",
    "exponential_documents",
    "stdlib_documents",
    "token_documents",
    "train_tokenizer",
    "training_documents",
]

_DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _module_documents(source: str) -> Iterator[str]:
    """The documents of one module's source: its top-level definitions, and the runs of statements between them."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return
    lines = source.splitlines(keepends=True)
    pending: list[str] = []
    for node in tree.body:
        start = min([node.lineno, *(decorator.lineno for decorator in getattr(node, "decorator_list", []))]) - 1
        text = "".join(lines[start : node.end_lineno])
        if isinstance(node, _DEFINITIONS):
            if pending:
                yield "".join(pending)
                pending = []
            yield text
        else:
            pending.append(text)
    if pending:
        yield "".join(pending)


def stdlib_documents(characters: int | None = None) -> list[str]:
    """Documents of the standard library's top-level modules, in order, until they hold ``characters`` (all: None)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    documents: list[str] = []
    total = 0
    for path in sorted(root.glob("*.py")):
        for document in _module_documents(path.read_text(encoding="utf-8", errors="replace")):
            if document.strip():
                documents.append(document)
                total += len(document)
        if characters is not None and total >= characters:
            break
    return documents


def train_tokenizer(texts: list[str], vocab: int):
    """A ``tokenizers.Tokenizer`` (BPE, ``vocab`` ids at most) trained on ``texts``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab >= 512:  # byte-level: every byte has an id, nothing is unknown
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
        )
    else:  # over characters: the vocab - 1 most frequent ones (and merges if there is room), the rest <unk>
        tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
        tokenizer.pre_tokenizer = pre_tokenizers.Split(" ", behavior="isolated")
        trainer = trainers.BpeTrainer(
            vocab_size=vocab, limit_alphabet=vocab - 1, special_tokens=["<unk>"], show_progress=False
        )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def token_documents(vocab: int, tokens: int, *, ratio: float = 3.0) -> list[list[int]]:
    """Tokenized standard-library documents holding at least ``tokens`` tokens (all of them if fewer), in order.

    Reads about ``ratio`` characters per token wanted, trains the tokenizer
    on them, and reads more if they come out short.
    """
    characters = max(4096, int(tokens * ratio))
    while True:
        texts = stdlib_documents(characters)
        tokenizer = train_tokenizer(texts, vocab)
        documents = [encoding.ids for encoding in tokenizer.encode_batch(texts)]
        documents = [ids for ids in documents if ids]
        if sum(map(len, documents)) >= tokens or sum(map(len, texts)) < characters:  # enough, or all there is
            return documents
        characters *= 2


def document_lengths(mean: int, seed: int) -> Iterator[int]:
    """An endless seeded stream of document lengths: exponential with mean ``mean``, at least 1 token."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        for uniform in torch.rand(256, generator=generator, dtype=torch.float64).tolist():
            yield max(1, math.ceil(-mean * math.log1p(-uniform)))


def exponential_documents(tokens: int, *, vocab: int, mean: int, seed: int = 0) -> list[list[int]]:
    """Seeded random ids in ``[1, vocab)``, in documents of :func:`document_lengths`, at least ``tokens`` in all."""
    generator = torch.Generator().manual_seed(10_000 + seed)
    documents, total = [], 0
    for length in document_lengths(mean, seed):
        documents.append(torch.randint(1, vocab, (length,), generator=generator).tolist())
        total += length
        if total >= tokens:
            return documents
    raise AssertionError("unreachable: the stream is endless")


def add_data_argument(parser: argparse.ArgumentParser) -> None:
    """``--data``: the documents of :func:`training_documents` (the script has ``--vocab`` and ``--mean`` too)."""
    parser.add_argument(
        "--data",
        choices=("stdlib", "exponential"),
        default="stdlib",
        help="documents: the standard library's sources, BPE-tokenized (vocabulary --vocab), or random ids of "
        "exponential lengths (mean --mean)",
    )


def training_documents(arguments: argparse.Namespace, tokens: int) -> list[list[int]]:
    """At least ``tokens`` tokens of the ``--data`` documents (fewer only when the standard library runs out)."""
    if arguments.data == "stdlib":
        return token_documents(arguments.vocab, tokens)
    seed = getattr(arguments, "seed", 0)
    return exponential_documents(tokens, vocab=arguments.vocab, mean=arguments.mean, seed=seed)


def documents_source(arguments: argparse.Namespace) -> str:
    """What the ``--data`` documents are, for a report."""
    if arguments.data == "stdlib":
        return f"the standard library's sources, a BPE of {arguments.vocab} ids trained on them"
    return f"random ids, exponential lengths of mean {arguments.mean}, seed {getattr(arguments, 'seed', 0)}"
