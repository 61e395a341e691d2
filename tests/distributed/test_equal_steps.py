"""Data parallel on gloo: every rank yields the same number of batches per epoch, across an epoch and a resume.

Each world (2 and 4 ranks, ``torch.multiprocessing`` spawn, loopback) runs
the real loop once: a tiny ``DistributedDataParallel`` model trains on its
rank's ``PackedDataset`` for two epochs, and in the second the loader is
checkpointed after a few steps and restored into a new dataset. Every step
first all-reduces the epoch each rank is in, so a rank that ran out of
batches and went on to the next epoch fails the step on every rank at
once, instead of leaving the others waiting in the gradient all-reduce.
Collectives time out after 60 s, and the parent kills any rank still
running after :data:`DEADLINE` seconds, so nothing hangs.
"""

from __future__ import annotations

import datetime
import itertools
import os
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from packfn.data import PackedDataset

from tests.distributed.ranks import collect, free_port, no_result

DEADLINE = 180.0  # the fork server imports torch once, then each rank trains in a few seconds on 2 shared cores
VOCAB, COUNT, RESUME_AT = 97, 289, 4
# 289 documents pack into 58 batches in epoch 0 and 57 in epoch 1: both epochs leave a round incomplete at
# world 4, epoch 1 at world 2.
SETTINGS = {"batch": 2, "sequence": 64, "max_documents": 8, "window": 64, "shuffle": True, "seed": 0, "split": True}


def _documents() -> list[list[int]]:
    lengths = torch.randint(1, 49, (COUNT,), generator=torch.Generator().manual_seed(0)).tolist()
    return [[1 + index % (VOCAB - 1)] * length for index, length in enumerate(lengths)]


def _pieces(batch: dict) -> list[tuple[int, int, int]]:
    """``(document, offset, length)`` of every slot of a batch that holds a piece."""
    return [
        (int(document), int(offset), int(length))
        for document, offset, length in zip(
            batch["documents"].flatten(), batch["document_offsets"].flatten(), batch["seq_lens"].flatten(), strict=True
        )
        if document >= 0
    ]


def _train(rank: int, world: int) -> dict:
    """Two epochs of the real loop on this rank, the second checkpointed and resumed; what each epoch saw."""
    documents = _documents()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Embedding(VOCAB, 8), torch.nn.Linear(8, VOCAB))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(batch: dict, epoch: int) -> None:
        # Every rank must be in the same epoch at the same step: a rank that ran out early is in the next one.
        epochs = torch.tensor([epoch, -epoch])
        dist.all_reduce(epochs, op=dist.ReduceOp.MAX)
        if epochs[0] != -epochs[1]:
            raise AssertionError(f"at one step the ranks are in epochs {-int(epochs[1])} to {int(epochs[0])}")
        logits = model(batch["input_ids"])
        loss = F.cross_entropy(logits.view(-1, VOCAB), batch["shift_labels"].view(-1), reduction="sum")
        optimizer.zero_grad()
        loss.backward()  # DDP's gradient all-reduce
        optimizer.step()

    dataset = PackedDataset(documents, **SETTINGS, rank=rank, world=world)
    seen: list[list[list[tuple[int, int, int]]]] = []
    for epoch in (0, 1):
        dataset.set_epoch(epoch)
        batches = []
        for batch in torch.utils.data.DataLoader(dataset, batch_size=None):
            step(batch, epoch)
            batches.append(_pieces(batch))
            if epoch == 1 and len(batches) == RESUME_AT:
                break
        if epoch == 1:  # a checkpoint after RESUME_AT steps, restored into a new dataset (as a new process would)
            state = dataset.state_dict()
            dataset = PackedDataset(documents, **SETTINGS, rank=rank, world=world)
            dataset.load_state_dict(state)
            for batch in torch.utils.data.DataLoader(dataset, batch_size=None):
                step(batch, epoch)
                batches.append(_pieces(batch))
        seen.append(batches)
    uninterrupted = PackedDataset(documents, **SETTINGS, rank=rank, world=world)
    uninterrupted.set_epoch(1)
    return {
        "seen": seen,
        "uninterrupted": [_pieces(batch) for batch in uninterrupted],
        "per_rank": [PackedDataset(documents, **SETTINGS, world=world).batches_per_rank(epoch) for epoch in (0, 1)],
    }


def _worker(rank: int, world: int, port: int, queue) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        queue.put((rank, _train(rank, world)))
    except Exception:  # reported to the parent, which fails the test
        queue.put((rank, traceback.format_exc()))
    dist.destroy_process_group()


def _spawn(world: int) -> list[dict | str]:
    """Run :func:`_train` on ``world`` gloo ranks; per rank, its result or its traceback (or why there is none)."""
    # A fork server that imported this module once starts each rank without importing torch again.
    context = mp.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    queue = context.Queue()
    port = free_port()
    processes = [context.Process(target=_worker, args=(rank, world, port, queue)) for rank in range(world)]
    results = collect(processes, queue, DEADLINE)
    return [result if result is not None else no_result(rank, processes[rank]) for rank, result in enumerate(results)]


@pytest.mark.parametrize("world", [2, 4])
def test_every_rank_trains_the_same_steps_across_an_epoch_and_a_resume_and_the_ranks_cover_the_documents(world):
    results = _spawn(world)
    failures = {rank: result for rank, result in enumerate(results) if isinstance(result, str)}
    assert not failures, "\n".join(f"rank {rank}:\n{error}" for rank, error in failures.items())
    documents = _documents()
    for epoch in (0, 1):
        counts = [len(result["seen"][epoch]) for result in results]
        assert counts == [results[0]["per_rank"][epoch]] * world, (epoch, counts)
        # Batch g of the epoch is rank g % world's (g // world)-th: the first batches tile every document once,
        # and the ones the last round needs past them are the epoch's first batches again.
        dealt = [results[number % world]["seen"][epoch][number // world] for number in range(counts[0] * world)]
        covered, tiled = 0, []
        while sum(length for _, _, length in tiled) < sum(map(len, documents)):
            tiled += dealt[covered]
            covered += 1
        _assert_tile(documents, tiled)
        assert counts[0] * world - covered < world
        assert dealt[covered:] == dealt[: counts[0] * world - covered]
    # The resumed epoch is the uninterrupted one, batch for batch.
    for result in results:
        assert result["seen"][1] == result["uninterrupted"]


def _assert_tile(documents: list[list[int]], pieces: list[tuple[int, int, int]]) -> None:
    """``pieces`` tile every document once (each piece starting where the one before it ended)."""
    by_document: dict[int, list[tuple[int, int]]] = {}
    for document, offset, length in pieces:
        by_document.setdefault(document, []).append((offset, length))
    assert sorted(by_document) == list(range(len(documents)))
    for document, parts in by_document.items():
        parts.sort()
        assert parts[0][0] == 0 and sum(length for _, length in parts) == len(documents[document])
        assert all(offset + length == following for (offset, length), (following, _) in itertools.pairwise(parts))
