"""packfn inside transformers models: packed batches equal per-document forwards, losses and gradients.

Tiny models built from a config (random weights, nothing downloaded): Llama
(one mask), Qwen2 with a full and a sliding layer (a mask per layer type)
and Mistral (one sliding window). The reference runs each document alone.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.testing
from hypothesis import HealthCheck, example, given, settings
from torch.nn.attention.flex_attention import BlockMask
from transformers import (
    AttentionInterface,
    AttentionMaskInterface,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

import packfn
from packfn.integrations.hf import hf_model_inputs

from tests.integrations import SIZES
from tests.references import document_spans, segments_attention, shift_labels_reference
from tests.strategies import packing_masks
from tests.strategies_attention import packed_batches

SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# (config class, model class, extra config): Qwen2's second layer slides
# (layer_types [full, sliding]), Mistral slides in every layer.
ARCHITECTURES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(use_sliding_window=True, sliding_window=5, max_window_layers=1)),
    "mistral": (MistralConfig, MistralForCausalLM, dict(sliding_window=5)),
}
VARLEN = "packfn_cpu_varlen"  # a CPU stand-in for flash attention's varlen path (below)
EXAMPLE = torch.tensor(
    [[1, 1, 1, 0, 2, 2, 3, 0, 0, 4, 4, 4, 4, 4, 4, 0], [0, 0, 1, 1, 1, 1, 1, 1, 1, 2, 3, 3, 0, 0, 0, 0]]
)


def cpu_varlen_attention(module, query, key, value, attention_mask, *, scaling=None, dropout=0.0, **kwargs):
    """Flash attention's varlen contract on the CPU: causal attention inside each ``cu_seq_lens_q`` segment.

    Reads exactly the keyword arguments transformers' flash path reads, over
    the flattened ``[batch * sequence]`` stream, and checks the length bound;
    without them, each row is one sequence (as flash attention without a mask).
    """
    assert attention_mask is None, "the varlen path takes no attention_mask"
    batch, heads, sequence, dim = query.shape
    if "cu_seq_lens_q" in kwargs:
        cu_seqlens, longest = kwargs["cu_seq_lens_q"], kwargs["max_length_q"]
        assert kwargs["cu_seq_lens_k"] is cu_seqlens and kwargs["max_length_k"] == longest
        assert int(cu_seqlens.diff().max()) <= longest
    else:  # an unpacked batch (the per-document reference): one sequence per row
        cu_seqlens = torch.arange(0, batch * sequence + 1, sequence)

    def tokens(x):  # [batch, heads, sequence, dim] -> [batch * sequence, heads, dim]
        return x.repeat_interleave(heads // x.shape[1], dim=1).transpose(1, 2).reshape(batch * sequence, heads, dim)

    q, k, v = tokens(query * (scaling * dim**0.5)), tokens(key), tokens(value)
    out = segments_attention(q, k, v, cu_seqlens)
    return out.reshape(batch, sequence, heads, dim), None


AttentionInterface.register(VARLEN, cpu_varlen_attention)
AttentionMaskInterface.register(VARLEN, lambda *args, **kwargs: None)


def build(architecture: str, implementation: str, *, seed: int = 0, **overrides):
    config_class, model_class, extra = ARCHITECTURES[architecture]
    torch.manual_seed(seed)
    config = config_class(**SIZES, **extra, **overrides, attn_implementation=implementation)
    return model_class(config).eval()


MODELS: dict[tuple[str, str], torch.nn.Module] = {}


def model(architecture: str, implementation: str) -> torch.nn.Module:
    """One model per (architecture, backend), same weights for every backend of an architecture."""
    key = (architecture, implementation)
    if key not in MODELS:
        MODELS[key] = build(architecture, implementation)
    return MODELS[key]


def tokens_for(mask: torch.Tensor, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, SIZES["vocab_size"], mask.shape, generator=generator)


def inputs_for(mask, tokens, net, implementation=None, **kwargs):
    implementation = implementation or net.config._attn_implementation
    if implementation == VARLEN:
        implementation = "flash_attention_2"  # packfn builds the flash kwargs; the stand-in consumes them
    return hf_model_inputs(
        mask, net.config, input_ids=tokens, attn_implementation=implementation, block_size=16, **kwargs
    )


def per_document_logits(net, mask, tokens) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """``(row, positions, logits)`` of each document run alone."""
    return [
        (row, positions, net(input_ids=tokens[row, positions][None]).logits[0])
        for row, positions in document_spans(mask)
    ]


def assert_logits_match(net, mask, tokens, logits, atol=2e-5) -> None:
    """Each document's logits equal its run alone; flex's reference runs on sdpa (same weights), as
    compiled CPU FlexAttention would compile anew for every document length."""
    if net.config._attn_implementation == "flex_attention":
        net = model(next(name for name, key in ARCHITECTURES.items() if isinstance(net.config, key[0])), "sdpa")
    for row, positions, reference in per_document_logits(net, mask, tokens):
        torch.testing.assert_close(logits[row, positions], reference, atol=atol, rtol=1e-4)


# ------------------------------------------------------------------ forwards


@pytest.mark.parametrize("architecture", list(ARCHITECTURES))
@pytest.mark.parametrize("implementation", ["sdpa", "eager", VARLEN, "flex_attention"])
@SETTINGS
@given(mask=packed_batches(max_batch=3, max_sequence=48, dtypes=(torch.int64, torch.int32, torch.bool)))
@example(mask=EXAMPLE)
def test_packed_forward_equals_each_document_alone(architecture, implementation, mask):
    if implementation == "flex_attention":  # one shape: CPU FlexAttention compiles a kernel per shape
        mask = torch.nn.functional.pad(mask, (0, 48 - mask.shape[1], 0, 3 - mask.shape[0]))
    net = model(architecture, implementation)
    tokens = tokens_for(mask)
    with torch.no_grad():
        logits = net(**inputs_for(mask, tokens, net)).logits
        assert_logits_match(net, mask, tokens, logits)


@pytest.mark.parametrize("implementation", ["sdpa", "eager", "flex_attention"])
def test_padding_inside_a_document_does_not_split_it(implementation):
    """Logits and loss: a target across the gap comes from the document's token before it, not from padding."""
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 2, 0, 2, 2, 0, 3, 3, 3, 0, 0]])
    net = model("qwen2", implementation)
    tokens = tokens_for(mask)
    with torch.no_grad():
        output = net(**inputs_for(mask, tokens, net, labels=tokens))
        assert_logits_match(net, mask, tokens, output.logits)
        torch.testing.assert_close(output.loss, reference_loss(model("qwen2", "sdpa"), mask, tokens))


# ------------------------------------------------------------ training step


def reference_loss(net, mask, tokens) -> torch.Tensor:
    """Each document alone, its loss weighted by its targets: the mean over every document's targets."""
    total, targets = 0.0, 0
    for row, positions in document_spans(mask):
        if positions.numel() > 1:
            document = tokens[row, positions][None]
            total = total + net(input_ids=document, labels=document).loss * (positions.numel() - 1)
            targets += positions.numel() - 1
    return total / targets


def gradients(net, loss) -> dict[str, torch.Tensor]:
    net.zero_grad(set_to_none=True)
    loss.backward()
    return {name: parameter.grad.clone() for name, parameter in net.named_parameters() if parameter.grad is not None}


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
@pytest.mark.parametrize("implementation", ["sdpa", "eager", VARLEN])
@settings(SETTINGS, max_examples=6)
@given(mask=packed_batches(max_batch=3, max_sequence=32, dtypes=(torch.int64,)))
@example(mask=EXAMPLE)
def test_training_step_loss_and_gradients_equal_each_document_alone(architecture, implementation, mask):
    if sum(positions.numel() > 1 for _, positions in document_spans(mask)) == 0:
        mask = EXAMPLE  # no document with a target: the loss is undefined both ways
    net = model(architecture, implementation).train()
    tokens = tokens_for(mask)
    loss = net(**inputs_for(mask, tokens, net, labels=tokens)).loss
    packed = gradients(net, loss)
    expected = reference_loss(net, mask, tokens)
    reference = gradients(net, expected)
    net.eval()
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)
    assert packed.keys() == reference.keys()
    for name in reference:
        torch.testing.assert_close(packed[name], reference[name], atol=1e-5, rtol=1e-4, msg=name)


def test_labels_ignore_padding_and_each_documents_first_token():
    net = model("llama", "sdpa")
    labels = torch.arange(EXAMPLE.numel()).view(EXAMPLE.shape) + 100
    kept = hf_model_inputs(EXAMPLE, net.config, labels=labels)["labels"] != -100
    first = torch.tensor(
        [[1, 0, 0, 0, 1, 0, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0], [0, 0, 1, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0]]
    )
    assert torch.equal(kept, (EXAMPLE != 0) & (first == 0))


@SETTINGS
@given(packing_masks(max_batch=3, max_sequence=24, dtypes=(torch.int64, torch.int32, torch.bool)))
@example(EXAMPLE)
def test_shift_labels_skip_padding_and_stop_at_each_document_end(mask):
    labels = torch.arange(mask.numel()).view(mask.shape) + 100
    inputs = hf_model_inputs(mask, model("llama", "sdpa").config, labels=labels)
    assert torch.equal(inputs["shift_labels"], shift_labels_reference(mask, labels))
    assert torch.equal(labels, torch.arange(mask.numel()).view(mask.shape) + 100)  # not mutated


def test_sliding_window_override_for_a_config_the_architecture_ignores():
    """A Llama config carrying a sliding_window (Llama ignores it): sliding_window=None gives the right masks."""
    net = model("llama", "sdpa")
    config = LlamaConfig(**SIZES, sliding_window=3, attn_implementation="sdpa")
    tokens = tokens_for(EXAMPLE)
    with torch.no_grad():
        inputs = hf_model_inputs(EXAMPLE, config, input_ids=tokens, sliding_window=None)
        assert_logits_match(net, EXAMPLE, tokens, net(**inputs).logits)
        windowed = hf_model_inputs(EXAMPLE, config, input_ids=tokens)["attention_mask"]
        assert not torch.equal(windowed, inputs["attention_mask"])


# ---------------------------------------------------------- compiled steps


def test_compiled_training_step_has_no_graph_break_and_no_recompile():
    """10 batches of one shape, different contents: one compile, fullgraph, losses equal eager."""
    net = build("qwen2", "sdpa").train()
    # Through AOTAutograd (its guards recompile too), not the eager backend.
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")

    def step(mask, tokens):
        return net(**hf_model_inputs(mask, net.config, input_ids=tokens, labels=tokens)).loss

    generator = torch.Generator().manual_seed(0)
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = torch.compile(step, backend=counter, fullgraph=True)
        for index in range(10):
            lengths = torch.randint(1, 9, (5,), generator=generator).tolist()  # 5 to 40 tokens: 2 rows of 24 hold them
            mask = packfn.pack_documents(lengths, sequence=24, alignment=1, max_documents=8, batch=2).document_ids
            tokens = tokens_for(mask, seed=index)
            loss = compiled(mask, tokens)
            loss.backward()
            torch.testing.assert_close(loss, step(mask, tokens), atol=1e-6, rtol=1e-6)
    assert counter.frame_count == 1
    torch._dynamo.reset()


# ------------------------------------------------------------- the pitfall


def test_transformers_own_packed_path_needs_use_cache_false():
    """NOTE [transformers' own packed path needs use_cache=False] (packfn/integrations/hf.py).

    If this fails on the first assertion, transformers now detects packed
    sequences with the default ``use_cache=True``: update the README's pitfall.
    """
    mask = EXAMPLE
    net = model("llama", "sdpa")
    assert net.config.use_cache, "the pitfall is about the config's default use_cache=True"
    tokens = tokens_for(mask)
    positions = packfn.packed_position_ids(mask)
    with torch.no_grad():
        default = net(input_ids=tokens, position_ids=positions).logits
        worst = max(
            (default[row, p] - ref).abs().max().item() for row, p, ref in per_document_logits(net, mask, tokens)
        )
        assert worst > 1e-2, (
            f"transformers {__import__('transformers').__version__} now separates packed documents with the default "
            f"use_cache=True (max logit difference {worst:.2e}): the README's pitfall is stale"
        )
        assert_logits_match(net, mask, tokens, net(input_ids=tokens, position_ids=positions, use_cache=False).logits)
        for use_cache in (True, False):
            ours = net(**hf_model_inputs(mask, net.config, input_ids=tokens), use_cache=use_cache).logits
            assert_logits_match(net, mask, tokens, ours)


# ------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    ("config", "kwargs", "error", "message"),
    [
        (LlamaConfig(), {}, ValueError, "got None"),
        (LlamaConfig(), {"attn_implementation": "paged|sdpa"}, ValueError, "attn_implementation must be a registered"),
        (
            Qwen2Config(layer_types=["linear_attention"], num_hidden_layers=1),
            {"attn_implementation": "sdpa"},
            ValueError,
            "linear_attention",
        ),
        (MistralConfig(sliding_window=0), {"attn_implementation": "sdpa"}, ValueError, "sliding_window"),
        (LlamaConfig(), {"attn_implementation": "flex_attention", "block_size": 0}, ValueError, "block_size"),
        (
            LlamaConfig(),
            {"attn_implementation": "sdpa", "labels": torch.zeros(3, dtype=torch.int64)},
            ValueError,
            "labels",
        ),
        (
            LlamaConfig(),
            {"attn_implementation": "sdpa", "labels": torch.zeros(2, 16, dtype=torch.uint8)},
            TypeError,
            "int32 or int64",
        ),
        (
            LlamaConfig(),
            {"attn_implementation": "sdpa", "input_ids": torch.zeros(2, 16)},
            TypeError,
            "input_ids must be an integer",
        ),
        (LlamaConfig(), {"attn_implementation": "eager", "dtype": torch.int64}, TypeError, "floating"),
        (
            LlamaConfig(),
            {"attn_implementation": "sdpa", "labels": torch.zeros(2, 16, dtype=torch.int64, device="meta")},
            ValueError,
            "labels is on meta but document_ids on cpu",
        ),
        (LlamaConfig(), {"attn_implementation": "sdpa", "sliding_window": 0}, ValueError, "sliding_window"),
    ],
)
def test_hf_model_inputs_errors(config, kwargs, error, message):
    with pytest.raises(error, match=message):
        hf_model_inputs(EXAMPLE, config, **kwargs)


def test_flash_keys_and_dict_masks():
    qwen = model("qwen2", "sdpa")
    flash = hf_model_inputs(EXAMPLE, qwen.config, attn_implementation="flash_attention_2")
    assert set(flash) == {"position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"}
    assert flash["max_length_q"] == EXAMPLE.shape[1] and flash["cu_seq_lens_q"].dtype == torch.int32
    masks = hf_model_inputs(EXAMPLE, qwen.config)["attention_mask"]
    assert set(masks) == {"full_attention", "sliding_attention"}
    assert torch.equal(masks["full_attention"], packfn.block_causal_mask(EXAMPLE))
    flex = hf_model_inputs(EXAMPLE, qwen.config, attn_implementation="flex_attention", block_size=16)
    assert all(isinstance(mask, BlockMask) for mask in flex["attention_mask"].values())
    eager = hf_model_inputs(EXAMPLE, model("llama", "eager").config, dtype=torch.float64)["attention_mask"]
    assert eager.dtype == torch.float64
    assert torch.equal(eager == 0, packfn.block_causal_mask(EXAMPLE))
