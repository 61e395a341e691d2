"""Load-balanced context parallelism of a packed batch on two processes (gloo, one machine).

Each rank keeps ``budget // world`` columns of every row
(``packfn.shard_packed_batch``; by default a head chunk and a tail chunk of
every document, so that the ranks share the causal attention work evenly),
gathers the keys and values of the whole row from every rank
(``packfn.distributed.all_gather_sequence``) and attends its queries to them
under ``packfn.cp_block_causal_mask``. Every length is known from
``[batch, sequence]``, the budget and the world size: no length is read back
and no collective decides a shape. The gathered outputs go back to the input
columns with ``shard.layout.restore``; rank 0 checks that they equal one
process attending the whole row, and every rank prints its attention work
(``packfn.cp_attention_work``) for each ``balance``.

    python examples/context_parallel.py
"""

from __future__ import annotations

import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import packfn
from packfn.distributed import all_gather_sequence

BATCH, SEQUENCE, ALIGNMENT, HIDDEN, VOCAB = 2, 24, 4, 16, 64
# A balanced shard rounds each document up to 2 * world * alignment columns (16 here): the packer
# guarantees a fitting budget with pad_to_multiple_of=2 * world * alignment.
BUDGET = 48


def attention(x: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(x[:, None], keys[:, None], values[:, None], attn_mask=mask)[:, 0]


def batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same packed batch on every rank: ``seq_lens [2, 3]``, tokens and labels ``[2, 24]``."""
    seq_lens = torch.tensor([[5, 9, 3], [11, 0, 2]])  # 0: an absent slot
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(1, VOCAB, (BATCH, SEQUENCE), generator=generator)
    return seq_lens, input_ids, input_ids.roll(-1, 1)


def run(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)  # the same weights on every rank
    embed, project = torch.nn.Embedding(VOCAB, HIDDEN), torch.nn.Linear(HIDDEN, 2 * HIDDEN)
    seq_lens, input_ids, labels = batch()
    for balance in ("rotated", "contiguous"):
        shard = packfn.shard_packed_batch(
            seq_lens,
            input_ids=input_ids,
            labels=labels,
            rank=rank,
            world=world,
            budget=BUDGET,
            alignment=ALIGNMENT,
            balance=balance,
        )
        x = embed(shard.input_ids)  # [batch, budget // world, hidden]
        keys, values = all_gather_sequence(project(x), dist.group.WORLD).chunk(2, dim=-1)  # [batch, budget, hidden]
        out = attention(x, keys, values, packfn.cp_block_causal_mask(shard))  # [batch, budget // world, hidden]
        restored = shard.layout.restore(all_gather_sequence(out.contiguous(), dist.group.WORLD))  # [batch, sequence]
        work = int(packfn.cp_attention_work(shard).sum())
        print(f"balance={balance!r}: rank {rank} attends {work} query-key pairs", flush=True)
        if rank == 0:
            layout = packfn.aligned_layout(seq_lens, sequence_length=SEQUENCE, alignment=ALIGNMENT, budget=BUDGET)
            whole = embed(layout.pack(input_ids))
            keys, values = project(whole).chunk(2, dim=-1)
            expected = layout.restore(attention(whole, keys, values, packfn.block_causal_mask(layout.sequence_ids)))
            real = layout.input_positions >= 0
            torch.testing.assert_close(restored[real], expected[real])
        dist.barrier()
    if rank == 0:
        print(f"{world} ranks: the sharded attention equals one process attending the whole row")
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    arguments = parser.parse_args(argv)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.spawn(run, args=(arguments.world, port), nprocs=arguments.world)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
