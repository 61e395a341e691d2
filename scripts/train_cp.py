"""Train a small packed model with data parallelism times load-balanced context parallelism, on gloo.

Launch with torchrun; the ranks form a ``dp x cp`` ``DeviceMesh``:

    torchrun --nproc-per-node 4 scripts/train_cp.py --dp 2 --cp 2 --steps 10
    torchrun --nproc-per-node 4 scripts/train_cp.py --dp 2 --cp 2 --check --dtype float64

Each data-parallel rank reads its own batches from
``packfn.data.PackedDataset(rank=dp_rank, world=dp)``, packed with
``pad_to_multiple_of=2 * cp * alignment`` so that every batch fits a balanced
shard at ``budget=sequence``. Inside its context-parallel group every rank
keeps its ``sequence // cp`` columns of each row (``packfn.shard_packed_batch``,
``--balance``, default ``rotated``), gathers the keys and values of the
whole row (``packfn.distributed.all_gather_sequence``) and attends under
``packfn.cp_block_causal_mask``. The gradients are summed over the world and
averaged over ``dp`` (what DDP does), then every rank takes the same AdamW
step. No length is read back and no collective decides a shape: the step
compiles once (``--compile``, ``fullgraph=True``) and never recompiles.

Rank 0 prints each step's loss (the mean over the data-parallel batches) and
a table of every rank's attention work (attended query-key pairs over the
steps, ``packfn.cp_attention_work``, with what contiguous shards would have
given) and its median step time. ``--check`` also trains a copy of the model
in every process on the whole rows of the same batches (all data-parallel
ranks' batches, no collective) and fails unless every step's loss and the
final weights equal the distributed run's.
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a file: import from the repository root (scripts/__init__.py)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import datetime
import math
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import packfn
from packfn.distributed import all_gather_sequence


class TinyDecoder(torch.nn.Module):
    """Token and position embeddings, ``layers`` pre-norm attention blocks with an MLP, and a head."""

    def __init__(self, vocab: int, sequence: int, hidden: int, heads: int, layers: int) -> None:
        super().__init__()
        self.heads = heads
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.position = torch.nn.Embedding(sequence, hidden)
        self.blocks = torch.nn.ModuleList(
            torch.nn.ModuleDict(
                {
                    "norm": torch.nn.LayerNorm(hidden),
                    "qkv": torch.nn.Linear(hidden, 3 * hidden),
                    "out": torch.nn.Linear(hidden, hidden),
                    "mlp": torch.nn.Sequential(
                        torch.nn.LayerNorm(hidden),
                        torch.nn.Linear(hidden, 4 * hidden),
                        torch.nn.GELU(),
                        torch.nn.Linear(4 * hidden, hidden),
                    ),
                }
            )
            for _ in range(layers)
        )
        self.head = torch.nn.Linear(hidden, vocab)

    def forward(self, input_ids, position_ids, mask, gather=lambda tensor: tensor):
        """Logits ``[batch, queries, vocab]``; ``mask`` bool ``[batch, 1, queries, keys]``, keys from ``gather``."""
        x = self.embed(input_ids) + self.position(position_ids)
        batch, queries, hidden = x.shape
        for block in self.blocks:
            q, k, v = block["qkv"](block["norm"](x)).chunk(3, dim=-1)
            k, v = gather(k), gather(v)

            def heads(t):
                return t.unflatten(-1, (self.heads, -1)).transpose(1, 2)

            out = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), attn_mask=mask)
            x = x + block["out"](out.transpose(1, 2).reshape(batch, queries, hidden))
            x = x + block["mlp"](x)
        return self.head(x)


def examples(count: int, mean: int, vocab: int, seed: int) -> list[list[int]]:
    """Token lists of exponential lengths (at least 1), the same in every process."""
    generator = torch.Generator().manual_seed(seed)
    lengths = (torch.empty(count).exponential_(generator=generator) * mean).ceil().long().tolist()
    return [torch.randint(1, vocab, (length,), generator=generator).tolist() for length in lengths]


def batches(args, dp_rank: int) -> list[dict[str, torch.Tensor]]:
    """The first ``--steps`` batches of one data-parallel rank."""
    dataset = packfn.PackedDataset(
        examples(args.examples, args.mean, args.vocab, args.seed),
        batch=args.batch,
        sequence=args.sequence,
        max_documents=args.max_documents,
        alignment=args.alignment,
        pad_to_multiple_of=2 * args.cp * args.alignment,
        split=True,
        rank=dp_rank,
        world=args.dp,
    )
    taken = []
    for batch in dataset:
        taken.append(batch)
        if len(taken) == args.steps:
            return taken
    raise SystemExit(f"data-parallel rank {dp_rank} has {len(taken)} batches, fewer than --steps {args.steps}")


def shard_of(batch, cp_rank: int, args, balance: str) -> packfn.CPShard:
    """This rank's shard of a data-parallel batch, at ``budget=sequence``."""
    return packfn.shard_packed_batch(
        batch["seq_lens"],
        batch["seq_lens_padded"],
        input_ids=batch["input_ids"],
        labels=batch["shift_labels"],
        rank=cp_rank,
        world=args.cp,
        budget=args.sequence,
        alignment=args.alignment,
        balance=balance,
    )


def sharded_loss(model, batch, *, cp_rank, group, args):
    """This rank's part of its data-parallel batch's mean loss, and its attention work."""
    shard = shard_of(batch, cp_rank, args, args.balance)
    # Padding queries attend their own key (gathered column start + i), so that no mask row is empty.
    columns = torch.arange(args.sequence)
    own = columns == torch.arange(shard.start, shard.start + shard.local).unsqueeze(1)
    mask = packfn.cp_block_causal_mask(shard) | own
    logits = model(
        shard.input_ids, shard.position_ids, mask, lambda t: all_gather_sequence(t, group, check_shapes=False)
    )
    count = (batch["shift_labels"] != -100).sum()
    loss = F.cross_entropy(logits.flatten(0, 1), shard.labels.flatten(), ignore_index=-100, reduction="sum") / count
    return loss, packfn.cp_attention_work(shard).sum()


def whole_row_loss(model, batch, args):
    """The mean loss of one batch on its whole rows, in one process."""
    layout = packfn.aligned_layout(
        batch["seq_lens"],
        batch["seq_lens_padded"],
        sequence_length=args.sequence,
        alignment=args.alignment,
        budget=args.sequence,
    )
    mask = packfn.block_causal_mask(layout.sequence_ids) | torch.eye(args.sequence, dtype=torch.bool)
    logits = model(layout.pack(batch["input_ids"]), layout.position_ids, mask)
    labels = layout.pack(batch["shift_labels"], fill=-100)
    count = (labels != -100).sum()
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum") / count


def contiguous_work(batch, cp_rank: int, args) -> int:
    """This rank's attention work had its shard been contiguous (metadata only)."""
    return int(packfn.cp_attention_work(shard_of(batch, cp_rank, args, "contiguous")).sum())


def new_model(args) -> TinyDecoder:
    torch.manual_seed(args.seed)  # the same weights in every process
    return TinyDecoder(args.vocab, args.sequence, args.hidden, args.heads, args.layers).to(args.dtype)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, default=2, help="data-parallel ranks (dp * cp = WORLD_SIZE)")
    parser.add_argument("--cp", type=int, default=2, help="context-parallel ranks per data-parallel group")
    parser.add_argument("--balance", default="rotated", choices=("rotated", "head_tail", "contiguous"))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--sequence", type=int, default=512)
    parser.add_argument("--alignment", type=int, default=1)
    parser.add_argument("--max-documents", type=int, default=32)
    parser.add_argument("--mean", type=int, default=96, help="mean document length")
    parser.add_argument("--examples", type=int, default=400)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    parser.add_argument("--compile", action="store_true", help="torch.compile the sharded loss (fullgraph=True)")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (aot_eager: no C++ build)")
    parser.add_argument("--check", action="store_true", help="compare with the whole rows in one process")
    args = parser.parse_args(argv)
    args.dtype = getattr(torch, args.dtype)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.dp * args.cp != world:
        raise SystemExit(f"--dp {args.dp} times --cp {args.cp} must be the {world} ranks torchrun started")
    if args.sequence % (2 * args.cp * args.alignment) != 0:
        raise SystemExit(f"--sequence must be a multiple of 2 * cp * alignment = {2 * args.cp * args.alignment}")
    mesh = init_device_mesh("cpu", (args.dp, args.cp), mesh_dim_names=("dp", "cp"))
    dp_rank, cp_rank = mesh["dp"].get_local_rank(), mesh["cp"].get_local_rank()
    group = mesh["cp"].get_group()
    mine = batches(args, dp_rank)
    model = new_model(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    step = sharded_loss
    if args.compile:
        step = torch.compile(sharded_loss, fullgraph=True, backend=args.backend, dynamic=False)
    losses, times, work, contiguous = [], [], 0, 0
    for index, batch in enumerate(mine):
        begin = time.perf_counter()
        loss, attended = step(model, batch, cp_rank=cp_rank, group=group, args=args)
        loss.backward()
        for param in model.parameters():  # the sum over the world, averaged over data-parallel ranks
            dist.all_reduce(param.grad)
            param.grad /= args.dp
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - begin)
        if args.compile and index == 0:
            torch._dynamo.config.error_on_recompile = True  # every later batch reuses the one graph
        dist.all_reduce(total := loss.detach().clone())
        losses.append(float(total) / args.dp)
        work += int(attended)
        contiguous += contiguous_work(batch, cp_rank, args)
    report = {"rank": rank, "dp": dp_rank, "cp": cp_rank, "work": work, "contiguous": contiguous}
    report["step_ms"] = statistics.median(times[1:] if len(times) > 1 else times) * 1e3
    everyone = [None] * world
    dist.all_gather_object(everyone, report)
    failed = False
    if args.check:
        failed = not check(args, model, losses)
    if rank == 0:
        for index, loss in enumerate(losses):
            print(f"step {index}: loss {loss:.6f}")
        print(f"{'rank':>4} {'dp':>3} {'cp':>3} {'attention work':>15} {'contiguous':>12} {'step ms':>9}")
        for row in everyone:
            print(
                f"{row['rank']:>4} {row['dp']:>3} {row['cp']:>3} {row['work']:>15,} {row['contiguous']:>12,} "
                f"{row['step_ms']:>9.1f}"
            )
        for name, key in ((f"balance={args.balance!r}", "work"), ("contiguous", "contiguous")):
            per_cp = [sum(row[key] for row in everyone if row["cp"] == cp) for cp in range(args.cp)]
            print(f"{name}: attention work max / mean over cp ranks = {max(per_cp) / statistics.mean(per_cp):.3f}")
    dist.destroy_process_group()
    return 1 if failed else 0


def check(args, trained: torch.nn.Module, losses: list[float]) -> bool:
    """Train a copy on every data-parallel rank's whole rows in this process; compare losses and weights."""
    everyone = [batches(args, dp_rank) for dp_rank in range(args.dp)]
    model = new_model(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    tolerance = 1e-9 if args.dtype == torch.float64 else 1e-4
    worst = 0.0
    for index in range(args.steps):
        loss = sum(whole_row_loss(model, dp_batches[index], args) for dp_batches in everyone) / args.dp
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        expected = float(loss.detach())
        worst = max(worst, abs(expected - losses[index]) / max(1.0, abs(expected)))
    for ours, theirs in zip(trained.parameters(), model.parameters(), strict=True):
        difference = float((ours - theirs).detach().abs().max())
        worst = max(worst, difference)
        if not math.isfinite(difference):
            worst = math.inf
    ok = worst <= tolerance
    if dist.get_rank() == 0:
        verdict = "equal" if ok else "NOT equal"
        print(f"check: losses and weights {verdict} to the single-process run (largest difference {worst:.2e})")
    return ok


if __name__ == "__main__":
    raise SystemExit(main())
