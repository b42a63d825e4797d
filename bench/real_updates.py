"""Checkpoints produced by real gradients: a small Qwen3-named transformer trained on text.

The text is Python's own standard library source (it ships with every interpreter), read as
bytes (a 256-symbol vocabulary). The model trains with AdamW at a warm-up learning rate until
its weights have left the init distribution, then takes steps at RL learning rates (1e-6 ...)
with the same optimizer state; each step is cast to BF16 and handed out as `RawTensor`s, so
the codec benchmark measures the deltas a real update makes rather than a random one's.
Quantized views of the same steps come from the agent's converters (FP8 block, NVFP4).
This module only makes checkpoints; it never encodes or times anything.
"""

from __future__ import annotations

import math
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

VOCAB = 256  # bytes


@dataclass(frozen=True)
class TinyLM:
    hidden: int = 256
    layers: int = 2
    heads: int = 4
    intermediate: int = 768
    context: int = 64


def corpus_bytes(limit: int = 4 << 20) -> np.ndarray:
    """Up to `limit` bytes of the standard library's `.py` files, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= limit:
            break
    return np.frombuffer(b"".join(chunks)[:limit], dtype=np.uint8)


def _parameters(spec: TinyLM, generator) -> dict:
    """Qwen3's tensor names (so the precision plan quantizes the decoder linears)."""
    import torch

    h, f = spec.hidden, spec.intermediate

    def init(*shape: int):
        return (torch.randn(shape, generator=generator) * 0.02).requires_grad_()

    params = {"model.embed_tokens.weight": init(VOCAB, h)}
    for i in range(spec.layers):
        p = f"model.layers.{i}."
        params[p + "input_layernorm.weight"] = torch.ones(h).requires_grad_()
        params[p + "post_attention_layernorm.weight"] = torch.ones(h).requires_grad_()
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            params[p + f"self_attn.{name}.weight"] = init(h, h)
        params[p + "mlp.gate_proj.weight"] = init(f, h)
        params[p + "mlp.up_proj.weight"] = init(f, h)
        params[p + "mlp.down_proj.weight"] = init(h, f)
    params["model.norm.weight"] = torch.ones(h).requires_grad_()
    params["lm_head.weight"] = init(VOCAB, h)
    return params


def _loss(spec: TinyLM, params: dict, tokens):
    import torch
    import torch.nn.functional as F

    x = params["model.embed_tokens.weight"][tokens[:, :-1]]
    batch, length, h = x.shape
    heads = spec.heads
    mask = torch.ones(length, length, dtype=torch.bool).tril()
    for i in range(spec.layers):
        p = f"model.layers.{i}."
        y = F.rms_norm(x, (h,), params[p + "input_layernorm.weight"])
        q, k, v = (
            (y @ params[p + f"self_attn.{n}_proj.weight"].T)
            .view(batch, length, heads, h // heads)
            .transpose(1, 2)
            for n in "qkv"
        )
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = (
            x
            + attn.transpose(1, 2).reshape(batch, length, h)
            @ params[p + "self_attn.o_proj.weight"].T
        )
        y = F.rms_norm(x, (h,), params[p + "post_attention_layernorm.weight"])
        gate = F.silu(y @ params[p + "mlp.gate_proj.weight"].T)
        x = (
            x
            + (gate * (y @ params[p + "mlp.up_proj.weight"].T))
            @ params[p + "mlp.down_proj.weight"].T
        )
    x = F.rms_norm(x, (h,), params["model.norm.weight"])
    logits = x @ params["lm_head.weight"].T
    return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def config(spec: TinyLM) -> dict:
    """A config.json for the converters (they read names and shapes, not the config)."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": spec.hidden,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "intermediate_size": spec.intermediate,
        "vocab_size": VOCAB,
    }


def rl_checkpoints(
    spec: TinyLM,
    *,
    warmup_steps: int,
    warmup_lr: float,
    lrs: list[float],
    steps: int,
    batch: int = 8,
    seed: int = 0,
) -> Iterator[tuple[float, int, dict, float]]:
    """Yield (lr, step, BF16 torch state dict, loss): the warmed-up checkpoint as step 0 of
    each learning rate, then `steps` AdamW steps at that rate (each rate starts again from
    the same warmed-up weights and optimizer state)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    text = torch.from_numpy(corpus_bytes().astype(np.int64))
    params = _parameters(spec, generator)
    optimizer = torch.optim.AdamW(params.values(), lr=warmup_lr, weight_decay=0.01)

    def batch_tokens():
        starts = torch.randint(0, text.numel() - spec.context - 1, (batch,), generator=generator)
        return torch.stack([text[s : s + spec.context + 1] for s in starts.tolist()])

    def step(lr: float) -> float:
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
        loss = _loss(spec, params, batch_tokens())
        loss.backward()
        optimizer.step()
        return float(loss.detach())

    loss = math.nan
    for i in range(warmup_steps):  # linear warm-up over the first tenth, then constant
        loss = step(warmup_lr * min(1.0, (i + 1) / max(1, warmup_steps // 10)))
    warm = {k: v.detach().clone() for k, v in params.items()}
    warm_state = {k: v.clone() if torch.is_tensor(v) else v for k, v in
                  _flat_state(optimizer).items()}  # fmt: skip
    for lr in lrs:
        with torch.no_grad():
            for k, v in params.items():
                v.copy_(warm[k])
        _load_flat_state(optimizer, warm_state)
        yield lr, 0, _bf16(params), loss
        for s in range(1, steps + 1):
            loss = step(lr)
            yield lr, s, _bf16(params), loss


def _bf16(params: dict) -> dict:
    import torch

    return {k: v.detach().to(torch.bfloat16) for k, v in params.items()}


def _flat_state(optimizer) -> dict:
    import torch

    flat = {}
    for i, state in enumerate(optimizer.state.values()):
        for key, value in state.items():
            flat[(i, key)] = value.clone() if torch.is_tensor(value) else value
    return flat


def _load_flat_state(optimizer, flat: dict) -> None:
    for i, state in enumerate(optimizer.state.values()):
        for key in list(state):
            value = flat[(i, key)]
            if hasattr(value, "copy_") and value.dim() > 0:
                state[key].copy_(value)
            else:
                state[key] = value.clone() if hasattr(value, "clone") else value


def init_distance(state: dict) -> float:
    """RMS of the decoder linears divided by the init's 0.02: 1.0 means still at init scale."""
    linears = [v.float() for k, v in state.items() if ".layers." in k and v.dim() == 2]
    rms = math.sqrt(sum(float((v * v).sum()) for v in linears) / sum(v.numel() for v in linears))
    return rms / 0.02
