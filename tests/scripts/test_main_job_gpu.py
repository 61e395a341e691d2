"""The main job's GPU options, held on the CPU: parsing, the clear errors, and each attention path's inputs and math.

Nothing here compiles with Inductor or needs a GPU. ``varlen_attn`` has no
CPU kernel, so the varlen paths run through :func:`reference_varlen_attn`,
an SDPA reference of its signature that leaves NaN where the real kernel
leaves memory unwritten (and Dynamo traces :func:`sdpa_varlen_attn`); FlexAttention has no CPU backward (torch 2.13), so
the flex paths are compared forward only, eagerly.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_mask

from packfn import document_block_mask

from examples.packed_decoder import DecoderConfig, PackedDecoder, lengths_from_boundaries, packed_loss
from scripts import attention_paths, main_job, main_job_report
from scripts.batches import make_batches
from scripts.upstream import eager_block_causal_mask, upstream_loss_function

EXAMPLE_MASK = torch.tensor([[1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 0, 0]])
CPU = torch.device("cpu")


class _NaNTailGradient(torch.autograd.Function):
    """Identity forward; backward writes NaN into rows ``end`` and later, as an unwritten kernel buffer may hold."""

    @staticmethod
    def forward(ctx, values: torch.Tensor, end: int) -> torch.Tensor:
        ctx.end = end
        return values.clone()

    @staticmethod
    def backward(ctx, gradient: torch.Tensor):
        gradient = gradient.clone()
        gradient[ctx.end :] = float("nan")
        return gradient, None


def sdpa_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, window_size):
    """``varlen_attn``'s causal result over ``[rows, heads, dim]`` through SDPA, tensor ops only (Dynamo traces it)."""
    index = torch.arange(query.shape[0], device=query.device)
    document = torch.searchsorted(cu_seq_q[1:].long(), index, right=True)
    inside = index < cu_seq_q[-1]
    mask = (document[:, None] == document[None, :]) & (index[None, :] <= index[:, None]) & inside[None, :]
    query, key, value = (tensor.transpose(0, 1) for tensor in (query, key, value))
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask).transpose(0, 1)


def reference_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, window_size):
    """:func:`sdpa_varlen_attn` checking its arguments, rows past ``cu_seq_q[-1]`` NaN forward and backward."""
    assert window_size == (-1, 0) and torch.equal(cu_seq_q, cu_seq_k) and max_q == max_k
    assert max_q >= int(cu_seq_q.diff().max()), "the bound is below the longest document"
    end = int(cu_seq_q[-1])
    query, key, value = (_NaNTailGradient.apply(tensor, end) for tensor in (query, key, value))
    attended = sdpa_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, window_size=window_size)
    attended[end:] = float("nan")
    return attended


@pytest.fixture(scope="module")
def tiny():
    """A tiny model and one packed batch of random tokens: ``(model, input_ids, document_ids, labels)``."""
    batch = make_batches(1, batch=2, sequence=64, mean=16, vocab=64, alignment=16, max_documents=16)[0]
    config = DecoderConfig(sequence=64, max_documents=16, budget=batch.packed.budget, vocab=64, hidden=32, heads=2)
    torch.manual_seed(0)
    return PackedDecoder(config), batch.input_ids, batch.document_ids, batch.labels


def test_attention_defaults_to_dense_on_the_cpu_and_to_varlen_on_cuda():
    assert main_job.parse_args([]).attention == "dense"
    assert attention_paths.GPU_ATTENTION == "varlen"
    for device in ("cuda", "cuda:1"):
        assert main_job.parse_args(["--device", device]).attention == "varlen"


def test_gpu_options_parse(capsys):
    for attention in ("dense", "varlen", "flex"):
        arguments = main_job.parse_args(["--device", "cuda", "--attention", attention])
        assert (arguments.device, arguments.attention) == ("cuda", attention)
        assert main_job.parse_args(["--attention", attention]).attention == attention
    with pytest.raises(SystemExit) as exit:
        main_job.parse_args(["--attention", "sdpa"])
    assert exit.value.code == 2
    assert "invalid choice: 'sdpa'" in capsys.readouterr().err


@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_cuda_without_cuda_exits_with_the_reason_before_any_work(device, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit:
        main_job.main(["--device", device])
    message = str(exit.value.code)
    assert message.startswith(f"--device {device}: CUDA is not available (torch {torch.__version__}, ")
    assert message.endswith("leave --device out to run on the CPU")
    printed = capsys.readouterr()
    assert printed.out == printed.err == ""  # nothing began: no packing, no model


def test_varlen_on_the_cpu_exits_with_the_kernels_own_error(capsys):
    with pytest.raises(SystemExit) as exit:
        main_job.main(["--attention", "varlen"])
    message = str(exit.value.code)
    assert message.startswith("--attention varlen cannot train on cpu: NotImplementedError: ")
    assert "_flash_attention_forward" in message  # varlen_attn's FlashAttention kernel has no CPU backend
    assert message.endswith("; --attention dense runs everywhere")
    assert capsys.readouterr().err == ""


def test_varlen_without_varlen_attn_names_the_torch_it_needs(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.nn.attention.varlen", None)  # the import fails, as before torch 2.10
    error = attention_paths.attention_error("varlen", CPU)
    assert error == (
        "--attention varlen cannot train on cpu: RuntimeError: needs torch.nn.attention.varlen.varlen_attn with "
        f"window_size (torch 2.11 or later); this is torch {torch.__version__}"
    )
    assert attention_paths.attention_error("dense", CPU) is None


def test_varlen_streams_of_upstream_and_packfn_hold_the_same_boundaries_positions_and_tokens():
    # The documented example: both give cu_seqlens [0, 2, 5, 9] (packfn's then 9 repeated) and these positions.
    packfn = attention_paths.packfn_token_stream(EXAMPLE_MASK, max_documents=2)
    upstream = attention_paths.upstream_token_stream(EXAMPLE_MASK)
    assert packfn.cu_seqlens.tolist() == [0, 2, 5, 9, 9] and upstream.cu_seqlens.tolist() == [0, 2, 5, 9]
    assert upstream.position_ids.tolist() == [[0, 1, 0, 1, 2, 0, 1, 2, 3]]
    assert (packfn.max_seqlen, upstream.max_seqlen) == (6, 4)  # packfn's static bound, upstream's host read

    batches = make_batches(2, batch=4, sequence=256, mean=40, vocab=64, alignment=16, max_documents=16, seed=3)
    for document_ids in [EXAMPLE_MASK, *(batch.document_ids for batch in batches)]:
        max_documents = 2 if document_ids is EXAMPLE_MASK else 16
        packfn = attention_paths.packfn_token_stream(document_ids, max_documents=max_documents)
        upstream = attention_paths.upstream_token_stream(document_ids)
        tokens, rows = upstream.indices.numel(), document_ids.numel()
        assert tokens == int((document_ids > 0).sum())
        documents = upstream.cu_seqlens.numel()
        assert packfn.cu_seqlens.dtype == upstream.cu_seqlens.dtype == torch.int32
        assert torch.equal(packfn.cu_seqlens[:documents], upstream.cu_seqlens)
        assert packfn.cu_seqlens.numel() == document_ids.shape[0] * max_documents + 1
        assert (packfn.cu_seqlens[documents:] == tokens).all()
        longest = int(upstream.cu_seqlens.diff().max())
        assert packfn.max_seqlen == document_ids.shape[1] >= upstream.max_seqlen == longest
        assert upstream.valid is None and torch.equal(packfn.valid, torch.arange(rows) < tokens)
        assert torch.equal(packfn.indices[:tokens], upstream.indices)
        assert torch.equal(packfn.position_ids[:, :tokens], upstream.position_ids)
        values = torch.randn(*document_ids.shape, 3)
        packed = packfn.pack(values)
        assert packed.shape == (1, rows, 3) and torch.equal(packed[:, :tokens], upstream.pack(values))
        assert (packed[:, tokens:] == 0).all()
        assert torch.equal(packfn.restore(packed), values * (document_ids > 0).unsqueeze(-1))
        assert torch.equal(upstream.restore(upstream.pack(values)), values.flatten(0, 1)[upstream.indices])


def test_flex_block_masks_of_upstream_and_packfn_are_equal():
    from nemo_automodel.components.datasets.packing import build_packed_sequence_metadata
    from nemo_automodel.components.models.deepseek_v41.packing import packed_layout

    batches = make_batches(2, batch=2, sequence=512, mean=60, vocab=64, alignment=16, max_documents=16, seed=5)
    for batch in batches:
        config = DecoderConfig(sequence=512, max_documents=16, budget=batch.packed.budget, hidden=32, heads=2)
        layout = PackedDecoder(config).layout(batch.document_ids, None)
        metadata = build_packed_sequence_metadata(batch.document_ids)
        theirs = packed_layout(
            lengths_from_boundaries(metadata["cu_seqlens"]),
            seq_lens_padded=None,
            input_shape=tuple(batch.document_ids.shape),
            alignment=config.alignment,
            minimum_length=config.length,
        )
        assert torch.equal(layout.sequence_ids, theirs.sequence_ids)
        sequence_ids = layout.sequence_ids
        ours = document_block_mask(sequence_ids, block_size=attention_paths.FLEX_BLOCK_SIZE)
        upstream = attention_paths.upstream_block_mask(theirs.sequence_ids)
        assert ours.BLOCK_SIZE == upstream.BLOCK_SIZE == (128, 128)
        assert upstream.kv_num_blocks.shape[-1] == sequence_ids.shape[1] // 128 >= 4
        for name in ("kv_num_blocks", "full_kv_num_blocks"):
            assert torch.equal(getattr(ours, name), getattr(upstream, name)), name
        assert torch.equal(ours.to_dense(), upstream.to_dense())
        # Element by element, each mask_mod is the dense block-causal mask upstream's SDPA path takes.
        dense = eager_block_causal_mask(sequence_ids)
        batch_size, length = sequence_ids.shape
        for mask_mod in (ours.mask_mod, upstream.mask_mod):
            assert torch.equal(create_mask(mask_mod, batch_size, 1, length, length, device="cpu"), dense)


def test_flex_and_varlen_paths_compute_the_dense_loss_and_varlen_its_gradients(tiny):
    model, input_ids, document_ids, labels = tiny
    minimum_length = model.config.length
    arguments = (model, input_ids, document_ids, labels)
    dense = packed_loss(*arguments)
    assert torch.allclose(upstream_loss_function(minimum_length=minimum_length)(*arguments), dense, atol=1e-6)
    with torch.no_grad():  # FlexAttention's CPU kernels are forward only
        for loss in (
            attention_paths.packfn_loss_function("flex"),
            attention_paths.upstream_loss_for("flex", minimum_length=minimum_length, compiled_flex=False),
        ):
            assert torch.allclose(loss(*arguments), dense, atol=1e-6)
    dense.backward()
    expected = {name: parameter.grad.clone() for name, parameter in model.named_parameters()}
    for loss in (
        attention_paths.packfn_loss_function("varlen", varlen_kernel=reference_varlen_attn),
        attention_paths.upstream_loss_for("varlen", varlen_kernel=reference_varlen_attn),
    ):
        model.zero_grad(set_to_none=True)
        value = loss(*arguments)
        assert torch.allclose(value, dense, atol=1e-6)
        value.backward()  # packfn's stream has a tail the kernel leaves NaN both ways: none of it may leak
        for name, parameter in model.named_parameters():
            assert torch.allclose(parameter.grad, expected[name], atol=1e-6), name
    model.zero_grad(set_to_none=True)


def test_packfn_flex_and_varlen_steps_trace_as_one_graph(tiny):
    """``fullgraph=True`` on Dynamo alone (the eager backend: no Inductor compile here), as packfn's step compiles."""
    torch._dynamo.reset()
    flex = torch.compile(attention_paths.packfn_loss_function("flex"), backend="eager", fullgraph=True)
    varlen = attention_paths.packfn_loss_function("varlen", varlen_kernel=sdpa_varlen_attn)
    dense = packed_loss(*tiny).item()
    with torch.no_grad():
        assert flex(*tiny).item() == pytest.approx(dense, abs=1e-6)
    value = torch.compile(varlen, backend="eager", fullgraph=True)(*tiny)
    value.backward()
    assert value.item() == pytest.approx(dense, abs=1e-6)
    tiny[0].zero_grad(set_to_none=True)
    torch._dynamo.reset()


def test_the_cuda_report_names_precision_attention_cuda_graphs_and_peak_memory():
    batches = make_batches(2, batch=2, sequence=64, mean=16, vocab=64)
    config = DecoderConfig(sequence=64, budget=batches[0].packed.budget, hidden=32, heads=2)
    pipelines = main_job_report.Pipelines(
        documents=10,
        document_tokens=[12] * 10,
        source="test",
        packfn=batches,
        upstream=batches,
        packfn_s=0.01,
        upstream_s=0.01,
    )
    mib = 2**20
    drivers = {}
    peaks = {main_job_report.UPSTREAM_EAGER: 40, main_job_report.UPSTREAM_COMPILED: 36, main_job_report.PACKFN: 30}
    for name, peak in peaks.items():
        drivers[name] = main_job_report.Driver(
            name,
            seconds=[0.5, 0.01, 0.01],
            tokens=[100, 100, 100],
            warmup_steps=1,
            memory=[(99 * mib, 1 * mib), (peak * mib, 20 * mib), ((peak - 2) * mib, 20 * mib)],
        )
        if name != main_job_report.UPSTREAM_EAGER:
            drivers[name].graph_breaks, drivers[name].recompiles = 0, 0
    report = main_job_report.MainJobReport(
        config=config,
        batch=2,
        pipelines=pipelines,
        worst_case_length=304,
        drivers=drivers,
        upstream="run",
        trace_files=[],
        run_dir="profiles/test",
        attention="varlen",
        device="cuda:0",
        gpu="NVIDIA H200",
        cudagraph_skips=0,
    )
    lines = report.lines()
    assert "attention:    varlen: torch.nn.attention.varlen.varlen_attn over the unpadded tokens" in "\n".join(lines)
    device = next(line for line in lines if line.startswith("device:"))
    assert device.startswith("device:       NVIDIA H200 (cuda:0): bf16 autocast, TF32 for the matmuls left in float32")
    assert "CUDA graphs" in device and device.endswith("which Inductor skipped 0 times")
    memory = next(line for line in lines if line.startswith("peak memory:"))
    # The first step of each (its compile, 99 MiB) is left out, as from the medians.
    assert memory.startswith(
        "peak memory:  upstream eager 40 MiB (a step +20 MiB); upstream torch.compile 36 MiB (a step +16 MiB); "
        "packfn torch.compile(fullgraph=True) 30 MiB (a step +10 MiB)"
    )
    assert "its helpers (get_unpad_data) take" in "\n".join(lines)
    assert not any(line.startswith("area:") for line in lines)  # no aligned rows to compare under varlen
