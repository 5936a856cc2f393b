"""Model configs: a Llama-3.1-8B- or Llama-3.2-1B-shaped target and a 1-layer EAGLE-3 draft.

usage: python3 mkmodels.py OUTDIR [8b|1b] [DRAFT_VOCAB]
(config-only models, for --load-format dummy)

DRAFT_VOCAB: the draft head's vocabulary (EAGLE-3 drafts for Llama 3.1 use 32000); without it
the draft shares the target's 128256-token head, as the first runs of this kit did.
"""

from __future__ import annotations

import json
import os
import sys

VOCAB = 128256
SHAPES = {
    "8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
    ),
    "1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
    ),
}


def target_config(size: str) -> dict:
    return dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        vocab_size=VOCAB,
        **SHAPES[size],
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
        bos_token_id=128000,
        eos_token_id=128001,
        initializer_range=0.02,
        pretraining_tp=1,
        use_cache=True,
    )


def draft_config(size: str, draft_vocab_size: int | None = None) -> dict:
    return dict(
        target_config(size),
        architectures=["LlamaForCausalLMEagle3"],
        num_hidden_layers=1,
        draft_vocab_size=draft_vocab_size,
    )


def write(root: str, size: str, draft_vocab: int | None = None) -> None:
    suffix = f"-dv{draft_vocab}" if draft_vocab else ""
    for name, cfg in (
        (f"llama-{size}", target_config(size)),
        (f"eagle3-{size}{suffix}", draft_config(size, draft_vocab)),
    ):
        d = os.path.join(root, name)
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(cfg, f, indent=1)
        with open(os.path.join(d, "generation_config.json"), "w") as f:
            json.dump(dict(bos_token_id=128000, eos_token_id=128001), f)


if __name__ == "__main__":
    write(
        sys.argv[1],
        sys.argv[2] if len(sys.argv) > 2 else "8b",
        int(sys.argv[3]) if len(sys.argv) > 3 else None,
    )
    print("models in", sys.argv[1], sorted(os.listdir(sys.argv[1])))
