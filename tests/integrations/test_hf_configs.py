"""hf_model_inputs reads every config flag that changes what attention sees, or refuses the config.

Each honoured config is checked the way the model defines it: the logits of
every real token of a packed batch equal each document run alone, with no
mask, on sdpa and eager. The batch has padding before, inside, between and
after documents.
"""

from __future__ import annotations

import pytest
import torch
import transformers

import packfn
from packfn.integrations.hf import hf_model_inputs

from tests.integrations import SIZES
from tests.references import document_spans

DOCUMENT_IDS = torch.tensor(
    [
        [1, 1, 1, 0, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 0, 0],
        [0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 0, 3, 3, 3],
    ]
)
GEMMA = dict(head_dim=8, query_pre_attn_scalar=8)
LAYERS = ["sliding_attention", "full_attention"]
GEMMA4 = dict(
    head_dim=8, sliding_window=8, layer_types=LAYERS, hidden_size_per_layer_input=8, vocab_size_per_layer_input=64
)

HONOURED = {
    "gemma3 bidirectional": (
        lambda: transformers.Gemma3TextConfig(
            **SIZES, **GEMMA, sliding_window=6, layer_types=LAYERS, use_bidirectional_attention=True
        ),
        transformers.Gemma3ForCausalLM,
    ),
    "gemma3 causal": (
        lambda: transformers.Gemma3TextConfig(**SIZES, **GEMMA, sliding_window=6, layer_types=LAYERS),
        transformers.Gemma3ForCausalLM,
    ),
    "llama is_causal=False": (
        lambda: transformers.LlamaConfig(**SIZES, is_causal=False),
        transformers.LlamaForCausalLM,
    ),
    "mistral window 4, is_causal=False": (
        lambda: transformers.MistralConfig(**SIZES, sliding_window=4, is_causal=False),
        transformers.MistralForCausalLM,
    ),
    "gemma4 all": (
        lambda: transformers.Gemma4TextConfig(**SIZES, **GEMMA4, use_bidirectional_attention="all"),
        transformers.Gemma4ForCausalLM,
    ),
    "gemma4 vision (text causal)": (
        lambda: transformers.Gemma4TextConfig(**SIZES, **GEMMA4, use_bidirectional_attention="vision"),
        transformers.Gemma4ForCausalLM,
    ),
    "llama4 chunks of 4": (
        lambda: transformers.Llama4TextConfig(
            **SIZES,
            head_dim=8,
            intermediate_size_mlp=64,
            num_local_experts=2,
            num_experts_per_tok=1,
            attention_chunk_size=4,
            no_rope_layers=[1, 0],
        ),
        transformers.Llama4ForCausalLM,
    ),
}


def _max_difference(net, config, implementation: str, **options) -> float:
    tokens = torch.randint(1, 64, DOCUMENT_IDS.shape, generator=torch.Generator().manual_seed(1))
    inputs = hf_model_inputs(DOCUMENT_IDS, config, input_ids=tokens, attn_implementation=implementation, **options)
    net.config._attn_implementation = implementation
    with torch.no_grad():
        packed = net(**inputs, use_cache=False).logits
        worst = 0.0
        for row, positions in document_spans(DOCUMENT_IDS):
            alone = net(input_ids=tokens[row, positions][None], use_cache=False).logits[0]
            worst = max(worst, (packed[row, positions] - alone).abs().max().item())
    return worst


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("name", list(HONOURED))
def test_packed_logits_equal_each_document_alone(name, implementation):
    make_config, model_class = HONOURED[name]
    config = make_config()
    torch.manual_seed(0)
    net = model_class(config).eval()
    assert _max_difference(net, config, implementation) < 1e-5


def test_a_forward_time_is_causal_false_is_honoured_by_the_causal_argument():
    config = transformers.LlamaConfig(**SIZES)
    torch.manual_seed(0)
    net = transformers.LlamaForCausalLM(config).eval()
    tokens = torch.randint(1, 64, DOCUMENT_IDS.shape, generator=torch.Generator().manual_seed(1))
    inputs = hf_model_inputs(DOCUMENT_IDS, config, input_ids=tokens, attn_implementation="sdpa", causal=False)
    with torch.no_grad():
        packed = net(**inputs, use_cache=False, is_causal=False).logits
        for row, positions in document_spans(DOCUMENT_IDS):
            alone = net(input_ids=tokens[row, positions][None], use_cache=False, is_causal=False).logits[0]
            torch.testing.assert_close(packed[row, positions], alone, rtol=1e-5, atol=1e-5)
        causal = net(**hf_model_inputs(DOCUMENT_IDS, config, input_ids=tokens, attn_implementation="sdpa")).logits
    assert not torch.allclose(causal, packed)  # the flag changes the masks


def test_bidirectional_windows_are_exclusive_for_gemma3_and_inclusive_for_is_causal_false():
    gemma3 = transformers.Gemma3TextConfig(
        **SIZES, **GEMMA, sliding_window=6, layer_types=LAYERS, use_bidirectional_attention=True
    )
    mistral = transformers.MistralConfig(**SIZES, sliding_window=4, is_causal=False)
    positions = packfn.packed_position_ids(DOCUMENT_IDS)
    distance = (positions.unsqueeze(2) - positions.unsqueeze(1)).abs().unsqueeze(1)
    same = (DOCUMENT_IDS.unsqueeze(2) == DOCUMENT_IDS.unsqueeze(1)) & (DOCUMENT_IDS != 0).unsqueeze(2)
    sliding = hf_model_inputs(DOCUMENT_IDS, gemma3, attn_implementation="sdpa")["attention_mask"]["sliding_attention"]
    assert torch.equal(sliding, same.unsqueeze(1) & (distance < gemma3.sliding_window))
    every = hf_model_inputs(DOCUMENT_IDS, mistral, attn_implementation="sdpa")["attention_mask"]
    assert torch.equal(every, same.unsqueeze(1) & (distance <= 4))


def test_a_composite_config_is_read_through_its_text_config():
    text = transformers.Gemma3TextConfig(**SIZES, **GEMMA, sliding_window=6, layer_types=LAYERS)
    config = transformers.Gemma3Config(text_config=text.to_dict(), vision_config={"hidden_size": 16})
    masks = hf_model_inputs(DOCUMENT_IDS, config, attn_implementation="sdpa")["attention_mask"]
    assert set(masks) == set(LAYERS)
    assert not torch.equal(masks["sliding_attention"], masks["full_attention"])


REFUSED = [
    (lambda: transformers.GemmaConfig(**SIZES, use_bidirectional_attention=True), {}, "flips only its attention"),
    (lambda: transformers.Gemma2Config(**SIZES, use_bidirectional_attention=True), {}, "flips only its attention"),
    (
        lambda: transformers.LlamaConfig(**SIZES, is_causal=False),
        {"attn_implementation": "flex_attention"},
        "FlexAttention block masks",
    ),
    (HONOURED["llama4 chunks of 4"][0], {"attn_implementation": "flex_attention"}, "FlexAttention block masks"),
    (HONOURED["llama4 chunks of 4"][0], {"attn_implementation": "flash_attention_2"}, "chunks of 4 positions"),
    (
        lambda: transformers.Llama4TextConfig(**SIZES, head_dim=8, floor_scale=8),
        {"attn_implementation": "sdpa"},
        "attn_temperature_tuning",
    ),
    (
        lambda: transformers.LlamaConfig(**SIZES, is_causal=False),
        {"attn_implementation": "sdpa", "labels": DOCUMENT_IDS},
        "labels are shifted",
    ),
    (lambda: transformers.Qwen3NextConfig(**SIZES), {"attn_implementation": "sdpa"}, "linear_attention"),
    (lambda: transformers.Lfm2Config(**SIZES, full_attn_idxs=[1]), {"attn_implementation": "sdpa"}, "'conv'"),
]


@pytest.mark.parametrize(("make_config", "options", "message"), REFUSED)
def test_configs_no_mask_can_match_are_refused_by_name(make_config, options, message):
    with pytest.raises(ValueError, match=message):
        hf_model_inputs(DOCUMENT_IDS, make_config(), **{"attn_implementation": "sdpa", **options})


def test_chunks_longer_than_the_row_pass_on_flash():
    config = HONOURED["llama4 chunks of 4"][0]()
    config.attention_chunk_size = DOCUMENT_IDS.shape[1]
    assert "cu_seq_lens_q" in hf_model_inputs(DOCUMENT_IDS, config, attn_implementation="flash_attention_2")


def test_causal_must_be_a_bool():
    with pytest.raises(TypeError, match="causal must be None or a bool"):
        hf_model_inputs(DOCUMENT_IDS, transformers.LlamaConfig(**SIZES), attn_implementation="sdpa", causal=1)


@pytest.mark.parametrize("implementation", ["flash_attention_2", "flash_attention_3", "flash_attention_4"])
def test_every_flash_backend_gets_the_varlen_arguments(implementation):
    inputs = hf_model_inputs(DOCUMENT_IDS, transformers.LlamaConfig(**SIZES), attn_implementation=implementation)
    assert "attention_mask" not in inputs
    assert torch.equal(inputs["cu_seq_lens_q"], packfn.physical_varlen_metadata(DOCUMENT_IDS).cu_seqlens)
    assert inputs["max_length_q"] == inputs["max_length_k"] == DOCUMENT_IDS.shape[1]
