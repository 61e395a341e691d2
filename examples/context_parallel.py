"""Context parallelism of a packed batch on two processes (gloo, one machine).

Each rank keeps a contiguous ``budget // world`` shard of every aligned row
(``packfn.shard_packed_batch``), gathers the keys and values of the whole
row from every rank (``packfn.distributed.all_gather_sequence``) and attends
its queries to them under ``packfn.cp_block_causal_mask``. Every length is
known from ``[batch, sequence]``, the budget and the world size: no length
is read back and no collective decides a shape. Rank 0 checks that the
gathered outputs equal one process attending the whole row.

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

BATCH, SEQUENCE, BUDGET, ALIGNMENT, HIDDEN, VOCAB = 2, 24, 32, 4, 16, 64


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
    shard = packfn.shard_packed_batch(
        seq_lens, input_ids=input_ids, labels=labels, rank=rank, world=world, budget=BUDGET, alignment=ALIGNMENT
    )
    x = embed(shard.input_ids)  # [batch, budget // world, hidden]
    keys, values = all_gather_sequence(project(x), dist.group.WORLD).chunk(2, dim=-1)  # [batch, budget, hidden]
    out = attention(x, keys, values, packfn.cp_block_causal_mask(shard))  # [batch, budget // world, hidden]
    gathered = all_gather_sequence(out.contiguous(), dist.group.WORLD)
    if rank == 0:
        layout = packfn.aligned_layout(seq_lens, sequence_length=SEQUENCE, alignment=ALIGNMENT, budget=BUDGET)
        whole = embed(layout.pack(input_ids))
        keys, values = project(whole).chunk(2, dim=-1)
        expected = attention(whole, keys, values, packfn.block_causal_mask(layout.sequence_ids))
        real = layout.sequence_ids != 0
        torch.testing.assert_close(gathered[real], expected[real])
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
