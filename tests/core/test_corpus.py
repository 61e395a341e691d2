"""Corpora larger than memory: on-disk Arrow (save_to_disk, Parquet through datasets), pyarrow tables, streams.

NOTE [Reading an Arrow corpus in place] (packfn/data/examples.py): the
lengths come from the list offsets, never a row or a token (the bytes read
from the files are the offsets'); a rank reads the tokens of its own
batches only, from the files, and no page of the corpus stays mapped; an HF
``IterableDataset`` is read whole by every process (DataLoader workers
included), and one split by node raises.
"""

from __future__ import annotations

import contextlib
import pickle
from pathlib import Path
from unittest import mock

import pytest
import torch
from torch.utils.data import DataLoader

from packfn.data import PackedDataset
from packfn.data import examples as examples_module

with contextlib.suppress(ImportError):  # imported at collection, before a test can take modules out of sys.modules
    import datasets

    datasets.disable_progress_bars()

pytestmark = pytest.mark.filterwarnings("ignore::packfn.data.FillWarning")
LOADER = {"batch": 8, "sequence": 256, "max_documents": 32, "window": 500}
DOCUMENTS = 20_000


@pytest.fixture(autouse=True)
def one_thread():
    """The loader's setting in a DataLoader worker (which sets one thread): a busy machine's spinning intra-op
    threads do not multiply the time of its small ops."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def corpus_documents(count: int, mean: float = 12.0, seed: int = 0) -> list[list[int]]:
    """``count`` documents of seeded exponential lengths (clipped to a row), random positive ids."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.empty(count).exponential_(1 / mean, generator=generator).ceil().clamp(1, LOADER["sequence"])
    tokens = torch.randint(1, 50_000, (int(lengths.sum()),), generator=generator, dtype=torch.int32)
    return [piece.tolist() for piece in tokens.split(lengths.long().tolist())]


def arrow_column(documents: list[list[int]]):
    """The documents as an Arrow ``list<int32>`` column, built from flat arrays."""
    import numpy
    import pyarrow as pa

    lengths = numpy.array([len(document) for document in documents])
    offsets = numpy.concatenate([[0], numpy.cumsum(lengths)]).astype(numpy.int32)
    values = numpy.fromiter((token for document in documents for token in document), dtype=numpy.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[list[list[int]], Path]:
    """20,000 documents, and the directory ``save_to_disk`` wrote them to (Arrow record batches of 1,000 rows)."""
    import pyarrow as pa

    documents = corpus_documents(DOCUMENTS)
    path = tmp_path_factory.mktemp("corpus") / "saved"
    datasets.Dataset(pa.table({"input_ids": arrow_column(documents)})).save_to_disk(str(path))
    return documents, path


def assert_same_batches(first: list[dict], second: list[dict]) -> None:
    assert len(first) == len(second) > 0
    for one, other in zip(first, second, strict=True):
        assert one.keys() == other.keys()
        for key in one:
            assert torch.equal(one[key], other[key]), key


def assert_same_state(first, second) -> None:
    """Equal state dicts (their carried rows are tensors)."""
    if isinstance(first, dict):
        assert first.keys() == second.keys()
        for key in first:
            assert_same_state(first[key], second[key])
    elif isinstance(first, torch.Tensor):
        assert torch.equal(first, second)
    else:
        assert first == second


def read_documents(batches: list[dict]) -> set[int]:
    """The documents with a piece in ``batches``."""
    return {document for batch in batches for document in batch["documents"].flatten().tolist() if document >= 0}


def row_accessors_refused():
    """Patch every row accessor of ``datasets.Dataset`` to fail: nothing may read the corpus row by row."""

    def refused(*args, **kwargs):
        raise AssertionError("a row of the dataset was read through datasets.Dataset's row accessor")

    stack = contextlib.ExitStack()
    for name in ("__getitem__", "__getitems__", "_getitem", "__iter__", "iter"):
        stack.enter_context(mock.patch.object(datasets.Dataset, name, refused))
    return stack


def preads():
    """The bytes each ``pread`` of the dataset's files reads, and the patch that records them."""
    read: list[int] = []
    pread = examples_module._MappedFiles.pread

    def spy(descriptor, out, positions, sizes):
        read.append(int(sizes.sum()))
        return pread(descriptor, out, positions, sizes)

    return read, mock.patch.object(examples_module._MappedFiles, "pread", staticmethod(spy))


def offsets_bytes(dataset) -> int:
    """The bytes of the int32 offsets of a saved dataset's ``input_ids``: one more than its rows per record batch."""
    return 4 * (len(dataset) + dataset.data.table.column("input_ids").num_chunks)


def tokens_refused():
    """Patch the only reader of token values to fail: what runs under it reads lengths alone."""

    def refused(*args, **kwargs):
        raise AssertionError("token values were read")

    return mock.patch.object(examples_module._Chunks, "take", refused)


# ------------------------------------------------------------------ on disk, read in place


def test_an_on_disk_dataset_packs_as_the_same_documents_in_a_list(corpus):
    documents, path = corpus
    on_disk = datasets.load_from_disk(str(path))
    assert on_disk.data.table.column("input_ids").num_chunks > 1  # the shuffled windows cross record batches
    for rank in range(2):
        kwargs = {**LOADER, "shuffle": True, "seed": 5, "rank": rank, "world": 2}
        with row_accessors_refused():
            from_disk = list(PackedDataset(on_disk, **kwargs))
        assert_same_batches(from_disk, list(PackedDataset(documents, **kwargs)))


def test_lengths_come_from_the_offsets_without_reading_a_row_or_a_token(corpus):
    documents, path = corpus
    on_disk = datasets.load_from_disk(str(path))
    kwargs = {**LOADER, "shuffle": True, "world": 3}
    dataset = PackedDataset(on_disk, **kwargs)
    read, spy = preads()
    with row_accessors_refused(), tokens_refused(), spy:
        per_rank = dataset.batches_per_rank()
        state = dataset.state_after(5, num_workers=2)
        assert sum(read) == offsets_bytes(on_disk)  # the bytes read from the files: the offsets, once
        sample = examples_module.Examples(on_disk).read([19_999, 0, 7], lengths_only=True)
    assert per_rank == PackedDataset(documents, **kwargs).batches_per_rank()
    assert_same_state(state, PackedDataset(documents, **kwargs).state_after(5, num_workers=2))
    assert sample.length.tolist() == [len(documents[19_999]), len(documents[0]), len(documents[7])]
    assert sample.tokens is None


def test_a_rank_reads_the_tokens_of_its_own_batches_only(corpus):
    _, path = corpus
    on_disk = datasets.load_from_disk(str(path))
    take = examples_module._Chunks.take
    for rank in range(3):
        read: list[int] = []

        def spy(self, rows, length, read=read):
            read.extend(rows.tolist())
            return take(self, rows, length)

        with mock.patch.object(examples_module._Chunks, "take", spy):
            batches = list(PackedDataset(on_disk, **LOADER, shuffle=True, rank=rank, world=3))
        own = read_documents(batches)
        assert set(read) == own  # the documents read are those of its batches, and every one of them
        # Each document once, but those whose pieces a row carries from one window into the next (split=False:
        # none) or that the last round repeats.
        assert len(read) <= len(own) + LOADER["batch"] * LOADER["max_documents"]
        assert len(own) < 0.4 * DOCUMENTS  # about a third of the corpus


def test_tokens_come_from_the_files_and_no_page_of_the_corpus_stays_mapped(corpus):
    documents, path = corpus
    on_disk = datasets.load_from_disk(str(path))
    files = {str(Path(entry["filename"]).resolve()) for entry in on_disk.cache_files}

    def mapped_kib() -> int:
        """KiB of the corpus's file mappings resident in this process (/proc/self/smaps)."""
        total, inside = 0, False
        for line in Path("/proc/self/smaps").read_text().splitlines():
            fields = line.split()
            if fields and "-" in fields[0] and not fields[0].endswith(":"):
                inside = len(fields) > 5 and fields[5] in files
            elif inside and fields[0] == "Rss:":
                total += int(fields[1])
        return total

    read, spy = preads()
    take, taken = examples_module._Chunks.take, []

    def counted(self, rows, length):
        taken.extend(rows.tolist())
        return take(self, rows, length)

    with spy, mock.patch.object(examples_module._Chunks, "take", counted):
        iterator = iter(PackedDataset(on_disk, **LOADER, shuffle=True))
        assert next(iterator)["input_ids"].shape == (LOADER["batch"], LOADER["sequence"])
        assert mapped_kib() == 0  # the header pages load_from_disk read were unmapped; the rest was read by pread
        assert sum(1 for _ in iterator) > 0
        assert mapped_kib() == 0
    # Every byte read: the offsets once, then the tokens of each document each time it is taken.
    assert sum(read) == offsets_bytes(on_disk) + 4 * sum(len(documents[row]) for row in taken)
    assert set(taken) == set(range(DOCUMENTS))
    # The same reads through the mapping, its pages not given back, stay mapped: the check above sees them.
    file_kib = sum(Path(name).stat().st_size for name in files) // 1024
    with (
        mock.patch.object(examples_module._MappedFiles, "where", lambda self, address, size: None),
        mock.patch.object(examples_module._MappedFiles, "release", lambda self: None),
    ):
        assert len(list(PackedDataset(on_disk, **LOADER, shuffle=True))) > 0
        assert mapped_kib() > file_kib // 2


def test_a_pickled_loader_names_the_files_instead_of_copying_the_corpus(corpus):
    """What a DataLoader worker started by spawn or forkserver receives: the files by name, not their tokens."""
    _, path = corpus
    dataset = PackedDataset(datasets.load_from_disk(str(path)), **LOADER, shuffle=True)
    assert dataset.batches_per_rank() > 0  # the lengths were read: they are not pickled either
    blob = pickle.dumps(dataset)
    corpus_bytes = sum(file.stat().st_size for file in path.glob("*.arrow"))
    assert len(blob) < corpus_bytes // 50
    assert_same_batches(list(pickle.loads(blob)), list(dataset))


def test_a_shuffled_selection_and_columns_of_labels_and_a_mask_read_through_the_indices_mapping(tmp_path):
    import pyarrow as pa

    documents = corpus_documents(3000, mean=6, seed=1)
    labels = [[token % 97 for token in document] for document in documents]
    masks = [[position % 3 != 0 for position in range(len(document))] for document in documents]
    table = pa.table({"input_ids": arrow_column(documents), "labels": arrow_column(labels), "loss_mask": masks})
    datasets.Dataset(table).save_to_disk(str(tmp_path / "saved"))
    on_disk = datasets.load_from_disk(str(tmp_path / "saved")).shuffle(seed=3).select(range(0, 3000, 2))
    assert on_disk._indices is not None  # HF's indices mapping: example k is row indices[k]
    order = on_disk._indices.column(0).to_pylist()
    examples = [{"input_ids": documents[row], "labels": labels[row], "loss_mask": masks[row]} for row in order]
    kwargs = {**LOADER, "shuffle": True, "seed": 2, "rank": 1, "world": 2}
    assert_same_batches(list(PackedDataset(on_disk, **kwargs)), list(PackedDataset(examples, **kwargs)))


def test_parquet_files_through_load_dataset_and_a_pyarrow_table_pack_as_the_list(tmp_path):
    import pyarrow as pa
    import pyarrow.dataset
    import pyarrow.parquet as pq

    documents = corpus_documents(2000, seed=2)
    files = []
    for shard, part in enumerate((documents[:1200], documents[1200:])):
        files.append(str(tmp_path / f"part-{shard}.parquet"))
        pq.write_table(pa.table({"input_ids": arrow_column(part)}), files[-1], row_group_size=500)
    cached = datasets.load_dataset("parquet", data_files=files, split="train", cache_dir=str(tmp_path / "cache"))
    assert cached.cache_files  # written once as Arrow, memory-mapped
    kwargs = {**LOADER, "shuffle": True, "seed": 1}
    expected = list(PackedDataset(documents, **kwargs))
    assert_same_batches(list(PackedDataset(cached, **kwargs)), expected)
    table = pq.read_table(files[0])
    assert_same_batches(list(PackedDataset(table, **kwargs)), list(PackedDataset(documents[:1200], **kwargs)))
    with pytest.raises(TypeError, match=r"got FileSystemDataset: for Parquet files, datasets.load_dataset\('parquet'"):
        PackedDataset(pyarrow.dataset.dataset(files), **LOADER)


# ------------------------------------------------------------------ streams


def test_a_streamed_dataset_gives_every_rank_and_worker_the_whole_stream_and_equal_steps(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    documents = corpus_documents(1500, seed=3)
    files = []
    for shard in range(3):
        files.append(str(tmp_path / f"part-{shard}.parquet"))
        pq.write_table(pa.table({"input_ids": arrow_column(documents[shard * 500 : (shard + 1) * 500])}), files[-1])
    stream = datasets.load_dataset("parquet", data_files=files, split="train", streaming=True)
    assert stream.num_shards == 3
    plan = list(PackedDataset(documents, **LOADER))
    per_rank = -(-len(plan) // 2)
    for rank in range(2):
        streamed = PackedDataset(stream, **LOADER, rank=rank, world=2)
        assert streamed.batches_per_rank() == per_rank
        dealt = [plan[number % len(plan)] for number in range(rank, 2 * per_rank, 2)]
        assert_same_batches(list(streamed), dealt)
    # Inside DataLoader workers, the stream's own __iter__ would give each worker some of its shards; every worker
    # reads all of it instead, and the workers together send the plan's batches in order.
    loaded = list(DataLoader(PackedDataset(stream, **LOADER), batch_size=None, num_workers=2))
    assert_same_batches(loaded, plan)


def test_a_stream_split_by_node_raises_instead_of_packing_another_plan_per_rank():
    from datasets.distributed import split_dataset_by_node

    stream = datasets.Dataset.from_dict({"input_ids": [[1, 2], [3], [4, 5, 6], [7]]}).to_iterable_dataset()
    with pytest.raises(ValueError, match=r"examples is a stream split by node .*pass the whole stream to every rank"):
        PackedDataset(split_dataset_by_node(stream, rank=0, world_size=2), **LOADER, world=2)
    with pytest.raises(ValueError, match=r"the dataset has no 'input_ids' column \(columns: \['text'\]\)"):
        PackedDataset(datasets.Dataset.from_dict({"text": ["a"]}).to_iterable_dataset(), **LOADER)
