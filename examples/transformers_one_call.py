"""A transformers model trained on packed rows: one packfn call patches it, the compiled step takes the document ids.

``packfn.integrations.hf.apply_packfn(model)`` patches the model in place (it
stays a ``LlamaForCausalLM``, so ``save_pretrained`` writes the plain model):
its forward also takes the packer's ``document_ids`` and turns them into the
model's inputs with ``hf_model_inputs`` (position ids that restart per
document, the attention mask of the model's backend, labels that never cross
documents), with static shapes and no host sync, so the whole training step
compiles into one graph. The loss equals the mean loss of every document run
alone (the unpatched forward: without ``document_ids`` the model is unchanged).

    python examples/transformers_one_call.py --steps 2
"""

from __future__ import annotations

import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import packfn
from packfn.integrations.hf import apply_packfn


def per_document_loss(model: LlamaForCausalLM, documents: list[torch.Tensor]) -> torch.Tensor:
    """The loss over every document run alone, each weighted by its number of targets."""
    total = sum(model(input_ids=d[None], labels=d[None]).loss * (d.numel() - 1) for d in documents if d.numel() > 1)
    return total / sum(d.numel() - 1 for d in documents)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--sequence", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    arguments = parser.parse_args(argv)
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=arguments.sequence,
        attn_implementation=arguments.attn,
        use_cache=False,
    )
    model = apply_packfn(LlamaForCausalLM(config))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    @torch.compile(fullgraph=True)
    def loss_of(document_ids: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return model(input_ids=tokens, document_ids=document_ids, labels=tokens).loss

    lengths = torch.randint(2, arguments.sequence // 2, (1_000,)).tolist()
    documents = [torch.randint(1, config.vocab_size, (n,)) for n in lengths]
    stream = packfn.pack_stream(
        lengths, batch=arguments.batch, sequence=arguments.sequence, alignment=1, max_documents=8
    )
    with torch._dynamo.config.patch(error_on_recompile=True):
        for step, packed in zip(range(arguments.steps), stream, strict=False):
            tokens = packed.gather(documents)
            loss = loss_of(packed.document_ids, tokens)
            in_batch = [documents[piece.document] for row in packed.rows for piece in row]
            with torch.no_grad():
                torch.testing.assert_close(loss, per_document_loss(model, in_batch), rtol=1e-4, atol=1e-5)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            print(f"step {step}: loss {loss.item():.4f} over {len(in_batch)} documents == each document alone")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
