"""Run by test_eagle3.py with the Python of an environment that has vLLM's `speculators`
package: builds a small random Eagle3 drafter with the package itself, saves it with the
package's save_pretrained, and writes the package's own draft logits for fixed inputs.

    python speculators_reference.py OUT_DIR

OUT_DIR/checkpoint: the package's checkpoint; OUT_DIR/reference.pt: inputs and logits of two
draft steps (the second reads the first's outputs, as a tree's second level does).
"""

import sys
from pathlib import Path

import torch
from transformers import DynamicCache, LlamaConfig

from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig

HIDDEN, VOCAB, DRAFT_VOCAB, TOKENS = 64, 200, 120, 9


def main(out: Path) -> None:
    layer = LlamaConfig(hidden_size=HIDDEN, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=32, num_hidden_layers=1, vocab_size=VOCAB, rms_norm_eps=1e-6,
                        rope_theta=10000.0, max_position_embeddings=256)
    layer._attn_implementation = "eager"
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=DRAFT_VOCAB, norm_before_residual=False,
        eagle_aux_hidden_state_layer_ids=[1, 3, 5],
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy", verifier=VerifierConfig.from_config(layer, name_or_path=None)))
    model = Eagle3DraftModel(config).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.copy_(torch.rand(p.shape, generator=generator) + 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
        ids = torch.sort(torch.randperm(VOCAB, generator=generator)[:DRAFT_VOCAB]).values
        model.d2t.copy_(ids - torch.arange(DRAFT_VOCAB))
        model.t2d.zero_()
        model.t2d[ids] = True
    model.save_pretrained(str(out / "checkpoint"))

    fused = torch.randn(1, TOKENS, 3 * HIDDEN, generator=generator)
    tokens = torch.randint(VOCAB, (1, TOKENS), generator=generator)
    second = torch.randint(VOCAB, (1, TOKENS), generator=generator)
    positions = torch.arange(TOKENS)[None]
    first_layer = model.layers[0]
    cache = DynamicCache()
    with torch.no_grad():
        # Step 1: the fused features of committed positions, causally.
        x = torch.cat([model.embed_tokens(tokens), model.fc(fused)], dim=-1)
        causal = torch.full((TOKENS, TOKENS), float("-inf")).triu(1)[None, None]
        out1 = first_layer(x, attention_mask=causal, position_ids=positions, past_key_values=cache,
                           use_cache=True, cache_position=torch.arange(TOKENS),
                           position_embeddings=model.rotary_emb(x, positions))
        logits1 = model.lm_head(model.norm(out1))
        # Step 2: each position's own next draft, reading step 1's output at that position;
        # row i sees step 1's rows up to i and itself (a second tree level).
        x2 = torch.cat([model.embed_tokens(second), out1], dim=-1)
        mask = torch.full((TOKENS, 2 * TOKENS), float("-inf"))
        for i in range(TOKENS):
            mask[i, :i + 1] = 0.0
            mask[i, TOKENS + i] = 0.0
        out2 = first_layer(x2, attention_mask=mask[None, None], position_ids=positions + 1, past_key_values=cache,
                           use_cache=True, cache_position=torch.arange(TOKENS, 2 * TOKENS),
                           position_embeddings=model.rotary_emb(x2, positions + 1))
        logits2 = model.lm_head(model.norm(out2))
    torch.save({"fused": fused[0], "tokens": tokens[0], "second": second[0], "logits1": logits1[0],
                "logits2": logits2[0]}, out / "reference.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
