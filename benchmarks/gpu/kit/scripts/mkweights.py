"""Write the large-margin successor target and its EAGLE-3 draft (see crafted.py) as safetensors.

usage: python3 mkweights.py OUTDIR [8b|1b]     (makes OUTDIR/succ-SIZE and OUTDIR/succ-eagle3-SIZE)
Needs torch and safetensors (the GPU host has both); builds on the GPU when there is one.
The 8b target is ~16 GB of bf16: it is written in shards of at most SHARD_BYTES (each copied to
the CPU only while it is written) with a model.safetensors.index.json, and the time of each
stage (build + verify on the device, copy + write) is printed.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import crafted
from mkmodels import SHAPES, draft_config, target_config

GATE_SCALE = 8.0  # silu(8) ~ 8: a neuron fires only on its own token's code
SHARD_BYTES = 4 << 30  # one shard's bytes (the 1b target fits one: model.safetensors)


def codes(hidden: int, device: str) -> torch.Tensor:
    """+-1 codes g[t] for every crafted token (unit RMS, so RMSNorm leaves them unchanged)."""
    gen = torch.Generator(device="cpu").manual_seed(20261130)
    n = len(crafted.all_tokens())
    return (torch.randint(0, 2, (n, hidden), generator=gen) * 2 - 1).to(device, torch.float32)


def make_tensors(shape: dict, device: str) -> tuple[dict, dict]:
    """(target, draft) state dicts in the checkpoint names SGLang loads."""
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    heads, kv_heads, head_dim = (
        shape["num_attention_heads"],
        shape["num_key_value_heads"],
        shape["head_dim"],
    )
    vocab, layers = crafted.VOCAB, shape["num_hidden_layers"]
    tokens = list(crafted.all_tokens())
    index = {t: i for i, t in enumerate(tokens)}
    g = codes(hidden, device)
    ids = torch.tensor(tokens, device=device)
    bf16 = torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(7)

    def small(*dims: int) -> torch.Tensor:
        return (torch.randn(*dims, generator=gen, device=device) * 0.02).to(bf16)

    embed = torch.zeros(vocab, hidden, device=device)
    embed[ids] = g
    head = torch.zeros(vocab, hidden, device=device)
    head[ids] = g[[index[crafted.pred(t)] for t in tokens]]  # row s = g[pred(s)]: argmax succ(t)
    embed, head = embed.to(bf16), head.to(bf16)

    target: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": embed,
        "lm_head.weight": head,
        "model.norm.weight": torch.ones(hidden, dtype=bf16, device=device),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        target[p + "self_attn.q_proj.weight"] = small(heads * head_dim, hidden)
        target[p + "self_attn.k_proj.weight"] = small(kv_heads * head_dim, hidden)
        target[p + "self_attn.v_proj.weight"] = small(kv_heads * head_dim, hidden)
        target[p + "self_attn.o_proj.weight"] = torch.zeros(
            hidden, heads * head_dim, dtype=bf16, device=device
        )
        target[p + "mlp.gate_proj.weight"] = small(inter, hidden)
        target[p + "mlp.up_proj.weight"] = small(inter, hidden)
        target[p + "mlp.down_proj.weight"] = torch.zeros(hidden, inter, dtype=bf16, device=device)
        target[p + "input_layernorm.weight"] = torch.ones(hidden, dtype=bf16, device=device)
        target[p + "post_attention_layernorm.weight"] = torch.ones(
            hidden, dtype=bf16, device=device
        )

    # Draft: fc picks the first aux state (= g[t]); the MLP adds g[d(t)] - g[t] (one neuron per
    # crafted token, firing on its code); attention contributes nothing (o_proj = 0).
    n = len(tokens)
    if n > inter:
        raise SystemExit(f"{n} crafted tokens need an intermediate size >= {n}")
    gate = torch.zeros(inter, hidden, device=device)
    up = torch.zeros(inter, hidden, device=device)
    down = torch.zeros(hidden, inter, device=device)
    gate[:n] = g * (GATE_SCALE / hidden)
    up[:n] = g / hidden
    nxt = g[[index[crafted.draft_next(t)] for t in tokens]]
    silu = torch.nn.functional.silu(torch.tensor(GATE_SCALE)).item()
    down[:, :n] = ((nxt - g) / silu).T
    fc = torch.zeros(hidden, 3 * hidden, device=device)
    fc[:, :hidden] = torch.eye(hidden, device=device)
    ones = torch.ones(hidden, dtype=bf16, device=device)
    draft = {
        "fc.weight": fc.to(bf16),
        "embed_tokens.weight": embed,
        "lm_head.weight": head,
        "norm.weight": ones,
        "midlayer.self_attn.q_proj.weight": small(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": small(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": small(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": torch.zeros(
            hidden, heads * head_dim, dtype=bf16, device=device
        ),
        "midlayer.mlp.gate_proj.weight": gate.to(bf16),
        "midlayer.mlp.up_proj.weight": up.to(bf16),
        "midlayer.mlp.down_proj.weight": down.to(bf16),
        "midlayer.input_layernorm.weight": ones,
        "midlayer.hidden_norm.weight": ones,
        "midlayer.post_attention_layernorm.weight": ones,
    }
    return target, draft


def shards(tensors: dict, limit: int) -> list[list[str]]:
    """Tensor names in order, grouped so that each group holds at most ``limit`` bytes (a
    larger tensor gets a group of its own)."""
    groups: list[list[str]] = [[]]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if groups[-1] and size + nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    return groups


def save_sharded(tensors: dict, directory: str) -> int:
    """Write ``tensors`` as safetensors shards (+ index when more than one); bytes written."""
    from safetensors.torch import save_file

    groups = shards(tensors, SHARD_BYTES)
    names = (
        ["model.safetensors"]
        if len(groups) == 1
        else [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    )
    weight_map, total = {}, 0
    for file_name, group in zip(names, groups, strict=True):
        part = {k: tensors[k].detach().cpu().contiguous() for k in group}
        save_file(part, os.path.join(directory, file_name), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in part.values())
        weight_map |= dict.fromkeys(group, file_name)
    if len(groups) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=1)
    return total


def build(size: str, out_dir: str) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.time()
    target, draft = make_tensors(SHAPES[size], device)
    verify(target, draft, SHAPES[size]["hidden_size"])
    print(f"built and verified on {device} in {time.time() - t0:.1f}s", flush=True)
    vocab = crafted.VOCAB
    for name, cfg, tensors in (
        (f"succ-{size}", target_config(size), target),
        (f"succ-eagle3-{size}", draft_config(size, draft_vocab_size=vocab), draft),
    ):
        d = os.path.join(out_dir, name)
        os.makedirs(d, exist_ok=True)
        for stale in os.listdir(d):  # shards of an earlier run with another layout
            if stale.endswith((".safetensors", ".safetensors.index.json")):
                os.remove(os.path.join(d, stale))
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(cfg, f, indent=1)
        with open(os.path.join(d, "generation_config.json"), "w") as f:
            json.dump({"bos_token_id": 128000, "eos_token_id": 128001}, f)
        t = time.time()
        written = save_sharded(tensors, d)
        took = time.time() - t
        print(f"{name}: {written / 2**30:.1f} GiB written in {took:.1f}s "
              f"({written / 2**30 / max(took, 1e-9):.2f} GiB/s)", flush=True)


def verify(target: dict, draft: dict, hidden: int) -> None:
    """Replay both models' arithmetic on every crafted token; exit if any prediction is off.

    Target: last hidden = embedding (residual contributions are zero), argmax must be succ(t).
    Draft: fc -> first aux state, MLP adds g[d(t)] - g[t]; step k must propose succ(d^k(t)).
    """
    tokens = list(crafted.all_tokens())
    ids = torch.tensor(tokens, device=target["lm_head.weight"].device)
    f32 = torch.float32

    def rms(x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)

    head = target["lm_head.weight"].to(f32)
    h = target["model.embed_tokens.weight"].to(f32)[ids]
    logits = rms(h) @ head.T
    top2 = logits.topk(2, dim=-1)
    margin = (top2.values[:, 0] - top2.values[:, 1]).min().item()
    want = torch.tensor([crafted.succ(t) for t in tokens], device=ids.device)
    bad = int((top2.indices[:, 0] != want).sum())
    x = torch.cat([h, h, h], dim=-1) @ draft["fc.weight"].to(f32).T
    expect = list(tokens)
    draft_bad = 0
    for _ in range(3):
        m = rms(x)
        mlp = torch.nn.functional.silu(m @ draft["midlayer.mlp.gate_proj.weight"].to(f32).T)
        mlp = mlp * (m @ draft["midlayer.mlp.up_proj.weight"].to(f32).T)
        x = x + mlp @ draft["midlayer.mlp.down_proj.weight"].to(f32).T
        proposed = (rms(x) @ draft["lm_head.weight"].to(f32).T).argmax(-1).tolist()
        expect = [crafted.draft_next(t) for t in expect]
        draft_bad += sum(p != crafted.succ(e) for p, e in zip(proposed, expect, strict=True))
    print(
        f"verify: target wrong on {bad}/{len(tokens)} tokens, min margin {margin:.1f} "
        f"(hidden {hidden}); draft wrong on {draft_bad}/{3 * len(tokens)} step proposals"
    )
    if bad or draft_bad or margin < hidden / 4:
        raise SystemExit("crafted weights do not compute what crafted.py says")


if __name__ == "__main__":
    t0 = time.time()
    build(sys.argv[2] if len(sys.argv) > 2 else "1b", sys.argv[1])
    print(f"crafted models written to {sys.argv[1]} in {time.time() - t0:.1f}s")
