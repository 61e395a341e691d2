"""Context parallelism on torch.distributed: gloo ranks against the single-process run and upstream.

Each world (2 and 4 ranks, ``torch.multiprocessing`` spawn, loopback) is
spawned once for the module and runs every check of :data:`CHECKS` in
order; each test then reads its check's outcome on every rank. Collectives
time out after 60 s, and the parent kills any rank still running after
:data:`DEADLINE` seconds, so nothing hangs. Every sharded check runs for
each ``balance`` (contiguous, per-document head-tail, rotated head-tail).

The single-process references use only the existing packfn ops on the whole
packed row (``aligned_layout``, ``block_causal_mask``,
``physical_varlen_metadata``), none of the code under test.
"""

from __future__ import annotations

import copy
import datetime
import json
import math
import os
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import packfn
import packfn.nemo_automodel as drop_ins
from packfn.distributed import (
    all_gather_sequence,
    cp_block_causal_mask,
    cp_varlen_metadata,
    shard_packed_batch,
)

from tests.assertions import assert_same, outcome
from tests.distributed.ranks import collect, free_port, no_result
from tests.references import masked_attention, varlen_attention

WORLDS = (2, 4)
DEADLINE = 300.0  # a world runs every check for three balances; 2 cores shared with other jobs
SEQUENCE, DOCUMENTS, BUDGET, ALIGNMENT, HIDDEN, VOCAB = 16, 3, 32, 2, 16, 32
BALANCES = ("contiguous", "rotated", "head_tail")
# A balanced shard rounds each document up to 2 * world * alignment columns (16 at world 4): three
# documents take at most 48, so the balanced runs use a budget of 64.
BUDGETS = {"contiguous": BUDGET, "rotated": 64, "head_tail": 64}


# ------------------------------------------------------------ the harness


def _worker(rank: int, world: int, port: int, names: tuple[str, ...], queue) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    results = {}
    for name in names:
        try:
            CHECKS[name](rank, world)
            results[name] = None
        except Exception:  # reported to the parent, which fails the test
            results[name] = traceback.format_exc()
    queue.put((rank, results))
    dist.destroy_process_group()


def spawn(world: int, names: tuple[str, ...]) -> list[dict[str, str | None]]:
    """Run the checks ``names`` on ``world`` gloo ranks; per rank, each check's traceback or None.

    The parent polls: it stops waiting once every rank has reported or
    exited, or at :data:`DEADLINE`, then kills what still runs.
    """
    context = mp.get_context("spawn")
    queue = context.Queue()
    port = free_port()
    processes = [context.Process(target=_worker, args=(rank, world, port, names, queue)) for rank in range(world)]
    results = collect(processes, queue, DEADLINE)
    return [
        checks if checks is not None else dict.fromkeys(names, no_result(rank, processes[rank]))
        for rank, checks in enumerate(results)
    ]


@pytest.fixture(scope="module", params=WORLDS, ids=lambda world: f"world{world}")
def ranks(request):
    return spawn(request.param, MODULE_CHECKS)


def assert_passed(ranks, name: str) -> None:
    failures = {rank: checks[name] for rank, checks in enumerate(ranks) if checks[name] is not None}
    assert not failures, "\n".join(f"rank {rank}:\n{error}" for rank, error in failures.items())


# --------------------------------------------------------- shared inputs


def packed_inputs(seed: int):
    """``seq_lens [2, 3]`` (absent slots included), tokens and labels ``[2, 16]``: the same on every rank.

    Seeds 4 and 5 are edge rows: one-token documents, documents shorter than
    ``2 * world``, an all-padding row; seed 5 a document of more than one chunk.
    """
    generator = torch.Generator().manual_seed(seed)
    seq_lens = torch.randint(0, 6, (2, DOCUMENTS), generator=generator)
    seq_lens[0, 1] = 0 if seed % 2 else seq_lens[0, 1]  # an absent slot
    if seed == 4:
        seq_lens = torch.tensor([[1, 1, 3], [0, 0, 0]])
    if seed == 5:
        seq_lens = torch.tensor([[0, 0, 0], [12, 1, 2]])
    tokens = torch.randint(1, VOCAB, (2, SEQUENCE), generator=generator)
    labels = torch.randint(0, VOCAB, (2, SEQUENCE), generator=generator)
    labels[:, ::5] = -100
    return seq_lens, tokens, labels


def parameters(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shapes = {"embed": (VOCAB, HIDDEN), "wq": (HIDDEN, HIDDEN), "wk": (HIDDEN, HIDDEN), "wv": (HIDDEN, HIDDEN)}
    shapes["head"] = (HIDDEN, VOCAB)
    return {
        name: (torch.randn(shape, generator=generator, dtype=torch.float64) / math.sqrt(shape[0])).requires_grad_()
        for name, shape in shapes.items()
    }


def tiny_attention(params, input_ids, labels, attend, gather, count):
    """One attention layer and an LM head; the loss sums this rank's tokens over the batch's ``count``."""
    x = params["embed"][input_ids]
    keys = gather(x @ params["wk"])
    values = gather(x @ params["wv"])
    out = attend(x @ params["wq"], keys, values)
    logits = (out + x) @ params["head"]
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum") / count


def single_process_run(seed: int, kind: str):
    """Loss and gradients of the whole packed row in one process, from the existing ops only."""
    seq_lens, tokens, labels = packed_inputs(seed)
    layout = packfn.aligned_layout(seq_lens, sequence_length=SEQUENCE, alignment=ALIGNMENT, budget=BUDGET)
    sequence_ids = layout.sequence_ids
    if kind == "block_causal":
        attend = masked_attention(packfn.block_causal_mask(sequence_ids).squeeze(1) | torch.eye(BUDGET, dtype=bool))
    else:
        cu_seqlens = packfn.physical_varlen_metadata(sequence_ids).cu_seqlens
        attend = varlen_attention(cu_seqlens, cu_seqlens)
    params = parameters()
    count = (labels != -100).sum()
    loss = tiny_attention(params, layout.pack(tokens), layout.pack(labels, fill=-100), attend, lambda t: t, count)
    loss.backward()
    return loss.detach(), {name: param.grad for name, param in params.items()}


def sharded_run(seed: int, kind: str, rank: int, world: int, balance: str, step=None):
    """Loss and gradients of the same batch sharded over the group, summed over ranks."""
    seq_lens, tokens, labels = packed_inputs(seed)
    params = parameters()
    count = (labels != -100).sum()
    if step is None:
        step = sharded_loss
    loss = step(params, seq_lens, tokens, labels, count, rank, world, kind, balance)
    loss.backward()
    dist.all_reduce(loss := loss.detach().clone())
    grads = {}
    for name, param in params.items():
        dist.all_reduce(grad := param.grad.clone())
        grads[name] = grad
    return loss, grads


def shard_of(seq_lens, tokens, labels, rank, world, balance):
    budget = BUDGETS[balance]
    return shard_packed_batch(
        seq_lens,
        input_ids=tokens,
        labels=labels,
        rank=rank,
        world=world,
        budget=budget,
        alignment=ALIGNMENT,
        balance=balance,
    )


def sharded_attention(shard, kind: str):
    """``(attend, gather)``: this rank's attention over the gathered keys, and the gather of keys and values."""
    group = dist.group.WORLD
    if kind == "block_causal":
        # Padding queries attend themselves (their gathered column), so no row of the mask is empty.
        budget = shard.key_sequence_ids.shape[1]
        own = torch.arange(budget) == torch.arange(shard.start, shard.start + shard.local)[:, None]
        return masked_attention(cp_block_causal_mask(shard).squeeze(1) | own), lambda t: all_gather_sequence(t, group)
    metadata = cp_varlen_metadata(shard)
    attend = varlen_attention(metadata.cu_seqlens_q, metadata.cu_seqlens_k)
    return attend, lambda t: metadata.keys(all_gather_sequence(t, group))


def sharded_loss(params, seq_lens, tokens, labels, count, rank, world, kind, balance):
    shard = shard_of(seq_lens, tokens, labels, rank, world, balance)
    attend, gather = sharded_attention(shard, kind)
    return tiny_attention(params, shard.input_ids, shard.labels, attend, gather, count)


def assert_same_run(actual, expected) -> None:
    torch.testing.assert_close(actual[0], expected[0], atol=1e-10, rtol=1e-10)
    for name in expected[1]:
        torch.testing.assert_close(actual[1][name], expected[1][name], atol=1e-10, rtol=1e-10, msg=name)


# ---------------------------------------------------------------- checks


# Seeds per balance: random rows and the edge rows (4 and 5), so that each balance meets both.
SEEDS = {"contiguous": (0, 1, 4), "rotated": (1, 4, 5), "head_tail": (0, 5)}
VARLEN_SEEDS = {"contiguous": (2, 3, 4), "rotated": (3, 4, 5), "head_tail": (2, 5)}


def check_block_causal_matches_single_process(rank, world):
    for balance in BALANCES:
        for seed in SEEDS[balance]:
            expected = single_process_run(seed, "block_causal")
            assert_same_run(sharded_run(seed, "block_causal", rank, world, balance), expected)


def check_varlen_matches_single_process(rank, world):
    for balance in BALANCES:
        for seed in VARLEN_SEEDS[balance]:
            assert_same_run(sharded_run(seed, "varlen", rank, world, balance), single_process_run(seed, "varlen"))


def check_restored_outputs_match_single_process(rank, world):
    # The attention outputs of every rank, gathered and restored to the input columns, and the gradient of a
    # loss on them: those of the whole row, restored the same way.
    for balance in BALANCES:
        for seed in (0, 5):
            seq_lens, tokens, labels = packed_inputs(seed)
            layout = packfn.aligned_layout(seq_lens, sequence_length=SEQUENCE, alignment=ALIGNMENT, budget=BUDGET)
            weights = torch.randn(
                2, SEQUENCE, HIDDEN, generator=torch.Generator().manual_seed(seed), dtype=torch.float64
            )
            runs = []
            for sharded in (False, True):
                params = parameters()
                if sharded:
                    shard = shard_of(seq_lens, tokens, labels, rank, world, balance)
                    attend, gather = sharded_attention(shard, "block_causal")
                    x = params["embed"][shard.input_ids]
                    out = attend(x @ params["wq"], gather(x @ params["wk"]), gather(x @ params["wv"]))
                    restored = shard.layout.restore(all_gather_sequence(out, dist.group.WORLD))
                else:
                    mask = packfn.block_causal_mask(layout.sequence_ids).squeeze(1) | torch.eye(BUDGET, dtype=bool)
                    x = params["embed"][layout.pack(tokens)]
                    restored = layout.restore(
                        masked_attention(mask)(x @ params["wq"], x @ params["wk"], x @ params["wv"])
                    )
                (restored * weights).sum().backward()
                grads = {name: param.grad.clone() for name, param in params.items() if param.grad is not None}
                if sharded:
                    for grad in grads.values():
                        dist.all_reduce(grad)  # each rank's gradient is of its own queries' outputs
                    grads = {name: grad / world for name, grad in grads.items()}  # every rank restored all
                runs.append((restored.detach(), grads))
            real = layout.input_positions >= 0
            torch.testing.assert_close(runs[1][0][real], runs[0][0][real], atol=1e-10, rtol=1e-10)
            assert not runs[1][0][~real].any()
            for name in runs[0][1]:
                torch.testing.assert_close(runs[1][1][name], runs[0][1][name], atol=1e-10, rtol=1e-10, msg=name)


def check_compiled_step_matches_eager_without_recompiles(rank, world):
    # aot_eager: Dynamo and AOTAutograd trace the whole sharded step (the
    # functional collectives included) exactly as for Inductor, without
    # Inductor's C++ compile, which takes minutes in 4 processes on 2 cores.
    # Inductor compiles the local part in tests/distributed/test_distributed_local.py.
    # head_tail traces the graph of rotated with a zero rotation.
    for balance in ("contiguous", "rotated"):
        torch._dynamo.reset()
        compiled = torch.compile(sharded_loss, fullgraph=True, backend="aot_eager", dynamic=False)
        try:
            for seed in (0, 1, 4):
                assert_same_run(
                    sharded_run(seed, "block_causal", rank, world, balance, step=compiled),
                    sharded_run(seed, "block_causal", rank, world, balance),
                )
                torch._dynamo.config.error_on_recompile = True
        finally:
            torch._dynamo.config.error_on_recompile = False


def check_gather_sequence_matches_upstream(rank, world):
    from nemo_automodel.components.models.deepseek_v41.cp import gather_sequence as upstream

    group = dist.group.WORLD
    weights = torch.randn(2, 3 * world, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    # The drop-in, and the core's static form: upstream's values and gradients both.
    for ours in (drop_ins.gather_sequence, all_gather_sequence):
        grads = []
        for gather in (ours, upstream):
            shard = (torch.arange(24, dtype=torch.float64).view(2, 3, 4) * (rank + 1)).requires_grad_()
            gathered = gather(shard, group)
            (gathered * gathered * weights).sum().backward()
            grads.append((gathered.detach(), shard.grad))
        assert_same(grads[0], grads[1])
        torch._dynamo.reset()
        compiled = torch.compile(ours, fullgraph=True, backend="aot_eager")
        for dtype in (torch.int64, torch.bool, torch.float32):
            shard = (torch.arange(6).view(2, 3) + 10 * rank).to(dtype)
            assert_same(ours(shard, group), upstream(shard, group))
            assert_same(compiled(shard, group), upstream(shard, group))
        shard = torch.ones(2, 3)
        assert ours(shard, None) is shard


def _cp_batches(rank: int, world: int):
    """``(batch, keyword arguments)`` pairs for shard_cp_batch, packed and not, some rank-dependent."""
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(1, VOCAB, (2, 10), generator=generator)
    labels = torch.randint(0, VOCAB, (2, 10), generator=generator)
    loss_mask = (torch.rand(2, 10, generator=generator) > 0.3).long()
    seq_lens = torch.tensor([[3, 0, 4], [2, 5, -1000]])
    spans = torch.tensor([[4, 0, 5], [2, 6, -1000]])
    ranked = torch.tensor([[1 + rank, 2], [3, 2 * rank + 1]])  # rank-dependent: sync_packed_length matters
    return [
        ({"input_ids": tokens, "labels": labels, "seq_lens": seq_lens}, {"packed_alignment": 2, "pad_multiple": 4}),
        (
            {"input_ids": tokens, "labels": labels, "seq_lens": seq_lens, "seq_lens_padded": spans},
            {"loss_mask": loss_mask, "packed_alignment": 4, "padding_token_id": None},
        ),
        (
            {"input_ids": tokens, "labels": labels, "seq_lens": ranked, "loss_mask": loss_mask},
            {"packed_alignment": 4, "sync_packed_length": True, "padding_token_id": 3},
        ),
        (
            {
                "input_ids": tokens,
                "labels": labels,
                "position_ids": torch.arange(10)[None],
                "attention_mask": loss_mask,
            },
            {"loss_mask": loss_mask, "pad_multiple": 3},
        ),
        ({"input_ids": tokens}, {"loss_mask": loss_mask}),
        ({"input_ids": tokens, "labels": labels, "padding_mask": loss_mask == 0}, {"pad_multiple": 5}),
        ({"input_ids": tokens}, {}),  # no labels: upstream's KeyError
        ({"input_ids": tokens, "inputs_embeds": tokens[..., None].double()}, {}),
    ]


def _assert_same_shard(ours, theirs) -> None:
    if ours[0] == "error" or theirs[0] == "error":
        assert ours == theirs
        return
    (our_context, our_batch, our_layout), (their_context, their_batch, their_layout) = ours[1], theirs[1]
    assert our_context is their_context
    assert our_batch.pop("cp_group") is their_batch.pop("cp_group")
    assert_same(our_batch, their_batch)
    for field in ("local_token_global_indices", "original_seq_len", "padded_seq_len", "input_row_shape"):
        assert_same(getattr(our_layout, field), getattr(their_layout, field))
    assert_same(our_layout.input_token_stream_positions, their_layout.input_token_stream_positions)


def check_shard_cp_batch_matches_upstream(rank, world):
    from nemo_automodel.components.models.deepseek_v41.cp import shard_cp_batch as upstream

    mesh = init_device_mesh("cpu", (world,))
    for cp_mesh in (mesh, None):
        for batch, kwargs in _cp_batches(rank, world):
            given = copy.deepcopy(batch)
            theirs = outcome(upstream, cp_mesh, None, copy.deepcopy(batch), **copy.deepcopy(kwargs))
            ours = outcome(drop_ins.shard_cp_batch, cp_mesh, None, batch, **kwargs)
            assert_same(batch, given)  # packfn leaves the given dict alone
            _assert_same_shard(ours, theirs)


def check_budget_not_divisible_by_world_raises(rank, world):
    seq_lens, tokens, labels = packed_inputs(0)
    budget = world * ALIGNMENT * 4 + ALIGNMENT  # a multiple of alignment, not of world * alignment
    with pytest.raises(ValueError, match=rf"budget={budget} must be a multiple of world \* alignment"):
        shard_packed_batch(
            seq_lens,
            input_ids=tokens,
            labels=labels,
            rank=rank,
            world=world,
            budget=budget,
            alignment=ALIGNMENT,
            balance="contiguous",
        )
    budget = world * ALIGNMENT * 5  # a multiple of world * alignment, not of 2 * world * alignment
    with pytest.raises(ValueError, match=rf"budget={budget} must be a multiple of 2 \* world \* alignment"):
        shard_packed_batch(
            seq_lens, input_ids=tokens, labels=labels, rank=rank, world=world, budget=budget, alignment=ALIGNMENT
        )


def check_gather_of_different_shapes_raises_on_every_rank(rank, world):
    group = dist.group.WORLD
    shard = torch.zeros(2, 4 + (rank == world - 1), 3)
    # The drop-in: in eager a ValueError that names every rank's shard, as upstream's.
    with pytest.raises(ValueError, match=r"same shape.*rank 0: \(2, 4, 3\).*rank \d: \(2, 5, 3\)"):
        drop_ins.gather_sequence(shard, group)
    with pytest.raises(ValueError, match=r"requires_grad"):
        drop_ins.gather_sequence(torch.zeros(2, 4).requires_grad_(rank == 0), group)
    # A tensor of one axis on one rank only: every rank raises (none waits in the gather), and the
    # next gather is not paired with the failed one.
    one_axis_on_rank_0 = torch.zeros(6) if rank == 0 else torch.zeros(2, 3)
    nine_axes_on_rank_0 = torch.zeros((1,) * (9 if rank == 0 else 2))
    with pytest.raises(ValueError, match=r"2 to 8 axes.*rank 0: \(6,\)"):
        drop_ins.gather_sequence(one_axis_on_rank_0, group)
    with pytest.raises(ValueError, match=r"2 to 8 axes.*9 axes"):
        drop_ins.gather_sequence(nine_axes_on_rank_0, group)
    full = torch.full((1, 1), float(rank))
    assert torch.equal(drop_ins.gather_sequence(full, group), torch.arange(float(world)).view(1, -1))
    # The core's static form: the same checks as one sync-free assert on every rank, in eager too.
    for broken in (shard, torch.zeros(2, 4).requires_grad_(rank == 0), one_axis_on_rank_0, nine_axes_on_rank_0):
        with pytest.raises(RuntimeError, match="shards differ in shape, dtype or requires_grad across ranks"):
            all_gather_sequence(broken, group)
    assert torch.equal(all_gather_sequence(full, group), torch.arange(float(world)).view(1, -1))
    # Compiled, the check is a sync-free assert that fires before the gather, on every rank.
    for gather in (drop_ins.gather_sequence, all_gather_sequence):
        torch._dynamo.reset()
        compiled = torch.compile(lambda t, gather=gather: gather(t, group) * 2, fullgraph=True, backend="aot_eager")
        with pytest.raises(RuntimeError, match="shards differ in shape, dtype or requires_grad across ranks"):
            compiled(shard)
    # The group is still usable afterwards.
    assert all_gather_sequence(torch.zeros(2, 4), group).shape == (2, 4 * world)


CHECKS = {
    "block_causal": check_block_causal_matches_single_process,
    "varlen": check_varlen_matches_single_process,
    "restore": check_restored_outputs_match_single_process,
    "compiled": check_compiled_step_matches_eager_without_recompiles,
    "gather_upstream": check_gather_sequence_matches_upstream,
    "shard_upstream": check_shard_cp_batch_matches_upstream,
    "budget_error": check_budget_not_divisible_by_world_raises,
    "shape_error": check_gather_of_different_shapes_raises_on_every_rank,
}
MODULE_CHECKS = tuple(CHECKS)


# ----------------------------------------------------------------- tests


def test_block_causal_loss_and_grads_equal_single_process(ranks):
    assert_passed(ranks, "block_causal")


def test_varlen_loss_and_grads_equal_single_process(ranks):
    assert_passed(ranks, "varlen")


def test_restored_outputs_and_their_grads_equal_single_process(ranks):
    assert_passed(ranks, "restore")


def test_compiled_sharded_step_fullgraph_without_recompiles(ranks):
    assert_passed(ranks, "compiled")


def test_gather_sequence_matches_upstream_values_and_grads(ranks):
    assert_passed(ranks, "gather_upstream")


def test_shard_cp_batch_matches_upstream(ranks):
    assert_passed(ranks, "shard_upstream")


def test_budget_not_divisible_by_world_times_alignment_raises_on_every_rank(ranks):
    assert_passed(ranks, "budget_error")


def test_gather_of_different_shapes_raises_on_every_rank(ranks):
    assert_passed(ranks, "shape_error")


def test_a_rank_that_dies_is_reported_not_waited_for():
    # The harness itself: a rank that dies fails its checks at once, and the others are not left hanging.
    started = time.monotonic()
    reports = spawn(2, ("die",))
    assert reports[0]["die"] is None
    assert "rank 1 gave no result (exit code 3)" in reports[1]["die"]
    assert time.monotonic() - started < DEADLINE / 2


def _die(rank, world):
    if rank == 1:
        os._exit(3)


CHECKS["die"] = _die


def test_bench_cp_smoke_writes_a_row_per_job(tmp_path):
    from scripts import bench_cp

    path = tmp_path / "bench_cp.json"
    argv = ["--worlds", "2", "--sequences", "256", "--means", "64", "--repeats", "1", "--no-compile"]
    assert bench_cp.main([*argv, "--hidden", "8", "--timeout", "60", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["rows"]
    assert [(row["world"], row["job"]) for row in rows] == [(2, "shard"), (2, "gather")]
    assert set(rows[0]) >= {"upstream", "packfn drop-in", "packfn static eager", "budget"}
    assert rows[0]["budget"] % (2 * bench_cp.ALIGNMENT) == 0


def test_bench_cp_balance_family_smoke(tmp_path):
    from scripts import bench_cp

    path = tmp_path / "bench_cp_balance.json"
    argv = ["--family", "balance", "--streams", "packed mean 300, S=8192", "--worlds", "2", "--documents", "250"]
    assert bench_cp.main([*argv, "--repeats", "1", "--json", str(path)]) == 0
    (row,) = json.loads(path.read_text())["rows"]
    assert row["batches"] >= 1 and set(row) >= {"padding %", "rows %", "times", *bench_cp.SHARDINGS}
    assert row["rotated"]["worst"] <= 1.05
    assert row["host reads"] == {kind: {"host_reads": 0, "data_dependent_ops": 0} for kind in ("eager", "traced")}
    theirs = {"torch indices", "torch indices + shard"} if bench_cp.torch_balancer() else set()
    assert set(row["times"]) == {"packfn shard", "packfn shard + varlen", *theirs}
