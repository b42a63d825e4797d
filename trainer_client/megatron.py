"""Megatron tensor-parallel shards ⇄ Hugging Face tensors for dense Llama/Qwen3-style models.

Owns the layout rules, so the Publisher can publish a Megatron-trained policy under the
names SGLang loads:

| Megatron key (per TP rank; `…` = `decoder.layers.N.`) | split | Hugging Face (`…` = layer N)  |
|-------------------------------------------------------|-------|-------------------------------|
| `embedding.word_embeddings.weight`                    | dim 0 | `model.embed_tokens.weight`   |
| `…self_attention.linear_qkv.{weight,bias}` (fused)    | dim 0 | `…self_attn.{q,k,v}_proj.*`   |
| `…self_attention.linear_proj.weight`                  | dim 1 | `…self_attn.o_proj.weight`    |
| `…self_attention.{q,k}_layernorm.weight`              | —     | `…self_attn.{q,k}_norm.weight`|
| `…mlp.linear_fc1.weight` (fused gate‖up)              | dim 0 | `…mlp.{gate,up}_proj.weight`  |
| `…mlp.linear_fc2.weight`                              | dim 1 | `…mlp.down_proj.weight`       |
| `…linear_qkv.layer_norm_weight` / `…input_layernorm`  | —     | `…input_layernorm.weight`     |
| `…linear_fc1.layer_norm_weight` / `…pre_mlp_layernorm`| —     | `…post_attention_layernorm.*` |
| `decoder.final_layernorm.weight`                      | —     | `model.norm.weight`           |
| `output_layer.weight`                                 | dim 0 | `lm_head.weight`              |

Fused QKV: for each query group, Megatron stores that group's query heads, then its key
head, then its value head, rows of `head_dim` each; a TP rank holds `num_query_groups / tp`
whole groups. Fused gate‖up: each rank holds its slice of gate followed by its slice of up.
Vocab-parallel tensors hold the padded vocabulary; padding rows are cut off.

The merge and split rules are plain functions of tensors and a `DenseTransformerConfig`, so
they run (and are tested) without megatron-core. `gather_hf_state_dict` is the collective
form over a `torch.distributed` TP group; `megatron_hf_state_dict` wraps a megatron-core
model and is the only code that imports megatron (lazily).

This module must never write to a store or cast dtypes: it returns the tensors it gathered.
Pipeline parallelism is out of scope (layer numbering must be global, pipeline size 1).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


class MegatronLayoutError(ValueError):
    """A state dict does not match the dense Llama/Qwen3 Megatron layout this adapter knows."""


@dataclass(frozen=True)
class DenseTransformerConfig:
    """The shape facts the layout rules need; `head_dim` defaults to hidden / heads."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    ffn_hidden_size: int
    vocab_size: int
    head_dim: int | None = None
    tie_word_embeddings: bool = False

    @property
    def kv_channels(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_query_groups:
            raise MegatronLayoutError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_query_groups ({self.num_query_groups})"
            )

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> DenseTransformerConfig:
        """Build from a `transformers` config object or its dict (Llama/Qwen2/Qwen3 keys)."""
        source = hf_config if isinstance(hf_config, Mapping) else hf_config.__dict__
        get: Callable[[str], Any] = source.get
        heads = get("num_attention_heads")
        return cls(
            num_layers=get("num_hidden_layers"),
            hidden_size=get("hidden_size"),
            num_attention_heads=heads,
            num_query_groups=get("num_key_value_heads") or heads,
            ffn_hidden_size=get("intermediate_size"),
            vocab_size=get("vocab_size"),
            head_dim=get("head_dim"),
            tie_word_embeddings=bool(get("tie_word_embeddings") or False),
        )

    def check_tensor_parallel(self, tp_size: int) -> None:
        """Raise unless every split dimension divides evenly across `tp_size` ranks."""
        problems = [
            f"{name} ({value})"
            for name, value in (
                ("num_query_groups", self.num_query_groups),
                ("num_attention_heads", self.num_attention_heads),
                ("ffn_hidden_size", self.ffn_hidden_size),
            )
            if value % tp_size
        ]
        if problems:
            raise MegatronLayoutError(
                f"tensor-parallel size {tp_size} does not divide {', '.join(problems)}; "
                "this adapter does not replicate key/value heads across ranks"
            )


# ----------------------------------------------------------------------------- the rules

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_REPLICATED_LAYER_SUFFIXES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "input_layernorm.weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
}
_ROW_LAYER_SUFFIXES = {
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
_VOCAB_KEYS = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "output_layer.weight": "lm_head.weight",
}
_REPLICATED_KEYS = {"decoder.final_layernorm.weight": "model.norm.weight"}


def _normalise_key(key: str) -> str:
    while key.startswith("module."):
        key = key[len("module.") :]
    return key


def _merge_qkv(parts: Sequence[Tensor], config: DenseTransformerConfig) -> list[Tensor]:
    groups, per_group, dim = config.num_query_groups, config.heads_per_group, config.kv_channels
    fused = torch.cat(list(parts), dim=0)
    trailing = fused.shape[1:]
    grouped = fused.reshape(groups, (per_group + 2) * dim, *trailing)
    q, k, v = torch.split(grouped, [per_group * dim, dim, dim], dim=1)
    return [t.reshape(-1, *trailing).contiguous() for t in (q, k, v)]


def _split_qkv(q: Tensor, k: Tensor, v: Tensor, config: DenseTransformerConfig, tp: int):
    groups, per_group, dim = config.num_query_groups, config.heads_per_group, config.kv_channels
    trailing = q.shape[1:]
    fused = torch.cat(
        [
            q.reshape(groups, per_group * dim, *trailing),
            k.reshape(groups, dim, *trailing),
            v.reshape(groups, dim, *trailing),
        ],
        dim=1,
    )
    return [c.reshape(-1, *trailing).contiguous() for c in fused.chunk(tp, dim=0)]


def _merge_gate_up(parts: Sequence[Tensor]) -> list[Tensor]:
    halves = [p.chunk(2, dim=0) for p in parts]
    gate = torch.cat([h[0] for h in halves], dim=0)
    up = torch.cat([h[1] for h in halves], dim=0)
    return [gate, up]


@dataclass(frozen=True)
class _Rule:
    """How one Megatron key's rank-local tensors become one or more HF tensors."""

    hf_names: tuple[str, ...]
    merge: Callable[[Sequence[Tensor]], list[Tensor]]
    replicated: bool = False


def _rule_for(key: str, config: DenseTransformerConfig) -> _Rule:
    if key in _VOCAB_KEYS:
        return _Rule(
            (_VOCAB_KEYS[key],),
            lambda parts: [torch.cat(list(parts), dim=0)[: config.vocab_size].contiguous()],
        )
    if key in _REPLICATED_KEYS:
        return _Rule((_REPLICATED_KEYS[key],), lambda parts: [parts[0]], replicated=True)
    match = _LAYER.match(key)
    if not match:
        raise MegatronLayoutError(f"unknown Megatron tensor {key!r}: not part of a dense model")
    layer, suffix = int(match.group(1)), match.group(2)
    if layer >= config.num_layers:
        raise MegatronLayoutError(
            f"{key!r} names layer {layer} but the config has {config.num_layers} layers"
        )
    prefix = f"model.layers.{layer}."
    if suffix in _REPLICATED_LAYER_SUFFIXES:
        hf = prefix + _REPLICATED_LAYER_SUFFIXES[suffix]
        return _Rule((hf,), lambda parts: [parts[0]], replicated=True)
    if suffix in _ROW_LAYER_SUFFIXES:
        hf = prefix + _ROW_LAYER_SUFFIXES[suffix]
        return _Rule((hf,), lambda parts: [torch.cat(list(parts), dim=1).contiguous()])
    for kind in ("weight", "bias"):
        if suffix == f"self_attention.linear_qkv.{kind}":
            names = tuple(f"{prefix}self_attn.{p}_proj.{kind}" for p in "qkv")
            return _Rule(names, lambda parts: _merge_qkv(parts, config))
    if suffix == "mlp.linear_fc1.weight":
        names = (f"{prefix}mlp.gate_proj.weight", f"{prefix}mlp.up_proj.weight")
        return _Rule(names, _merge_gate_up)
    raise MegatronLayoutError(
        f"unknown Megatron tensor {key!r}: this adapter handles dense attention + gated MLP"
    )


def _megatron_keys(shard: Mapping[str, Tensor]) -> dict[str, Tensor]:
    return {
        _normalise_key(k): v
        for k, v in shard.items()
        if not k.endswith("_extra_state") and isinstance(v, Tensor)
    }


def _finish(hf: dict[str, Tensor], config: DenseTransformerConfig) -> dict[str, Tensor]:
    if config.tie_word_embeddings:
        hf.pop("lm_head.weight", None)
    return hf


def merge_tensor_parallel_shards(
    shards: Sequence[Mapping[str, Tensor]], config: DenseTransformerConfig
) -> dict[str, Tensor]:
    """Merge every TP rank's local Megatron state dict (rank order) into HF-named tensors.

    Keys may carry `module.` prefixes; `_extra_state` entries are ignored. Every rank must
    hold the same keys. Tied embeddings publish no `lm_head.weight`.
    """
    if not shards:
        raise MegatronLayoutError("no shards given: pass one state dict per TP rank")
    config.check_tensor_parallel(len(shards))
    normalised = [_megatron_keys(s) for s in shards]
    keys = list(normalised[0])
    for rank, shard in enumerate(normalised[1:], start=1):
        if set(shard) != set(keys):
            missing = sorted(set(keys) ^ set(shard))
            raise MegatronLayoutError(f"TP rank {rank} holds different tensors: {missing[:5]}")
    hf: dict[str, Tensor] = {}
    for key in keys:
        rule = _rule_for(key, config)
        merged = rule.merge([s[key] for s in normalised])
        hf.update(zip(rule.hf_names, merged, strict=True))
    return _finish(hf, config)


def split_for_tensor_parallel(
    hf_state: Mapping[str, Tensor],
    config: DenseTransformerConfig,
    tp_size: int,
    padded_vocab_size: int | None = None,
) -> list[dict[str, Tensor]]:
    """The inverse of `merge_tensor_parallel_shards`: HF tensors → one Megatron dict per rank.

    Uses the TE-fused norm names (`linear_qkv.layer_norm_weight`, …). The vocabulary is
    zero-padded to `padded_vocab_size` (default: the next multiple of `tp_size`).
    """
    config.check_tensor_parallel(tp_size)
    padded = padded_vocab_size or -(-config.vocab_size // tp_size) * tp_size
    if padded % tp_size or padded < config.vocab_size:
        raise MegatronLayoutError(
            f"padded vocab {padded} must be >= vocab {config.vocab_size} and divisible by "
            f"tp {tp_size}"
        )
    shards: list[dict[str, Tensor]] = [{} for _ in range(tp_size)]

    def put(key: str, chunks: Sequence[Tensor]) -> None:
        for shard, chunk in zip(shards, chunks, strict=True):
            shard[key] = chunk.contiguous()

    def vocab(t: Tensor) -> list[Tensor]:
        pad = t.new_zeros(padded - t.shape[0], *t.shape[1:])
        return list(torch.cat([t, pad]).chunk(tp_size, dim=0))

    put("embedding.word_embeddings.weight", vocab(hf_state["model.embed_tokens.weight"]))
    if not config.tie_word_embeddings:
        put("output_layer.weight", vocab(hf_state["lm_head.weight"]))
    put("decoder.final_layernorm.weight", [hf_state["model.norm.weight"]] * tp_size)
    replicated = {v: k for k, v in _REPLICATED_LAYER_SUFFIXES.items() if "layer_norm_weight" in k}
    replicated.update(
        {
            "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
            "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
        }
    )
    for layer in range(config.num_layers):
        hf, mg = f"model.layers.{layer}.", f"decoder.layers.{layer}."
        for hf_suffix, mg_suffix in replicated.items():
            if hf + hf_suffix in hf_state:
                put(mg + mg_suffix, [hf_state[hf + hf_suffix]] * tp_size)
        for mg_suffix, hf_suffix in _ROW_LAYER_SUFFIXES.items():
            put(mg + mg_suffix, hf_state[hf + hf_suffix].chunk(tp_size, dim=1))
        for kind in ("weight", "bias"):
            names = [f"{hf}self_attn.{p}_proj.{kind}" for p in "qkv"]
            if names[0] in hf_state:
                q, k, v = (hf_state[n] for n in names)
                put(f"{mg}self_attention.linear_qkv.{kind}", _split_qkv(q, k, v, config, tp_size))
        gate = hf_state[hf + "mlp.gate_proj.weight"].chunk(tp_size, dim=0)
        up = hf_state[hf + "mlp.up_proj.weight"].chunk(tp_size, dim=0)
        put(
            mg + "mlp.linear_fc1.weight", [torch.cat([g, u]) for g, u in zip(gate, up, strict=True)]
        )
    return shards


# ----------------------------------------------------------------------------- collectives


def gather_hf_state_dict(
    local_state: Mapping[str, Tensor],
    config: DenseTransformerConfig,
    group: Any = None,
) -> dict[str, Tensor]:
    """Collective: every rank of TP `group` passes its local Megatron state dict and gets
    the full HF-named state dict back (replicated tensors are taken from the local rank).

    All ranks must call it with the same keys; sharded tensors are all-gathered one by one
    (so peak extra memory is one full tensor), in sorted key order.
    """
    import torch.distributed as dist

    world = dist.get_world_size(group)
    config.check_tensor_parallel(world)
    normalised = _megatron_keys(local_state)
    hf: dict[str, Tensor] = {}
    for key in sorted(normalised):
        rule = _rule_for(key, config)
        local = normalised[key].contiguous()
        if rule.replicated:
            parts = [local]
        else:
            parts = [torch.empty_like(local) for _ in range(world)]
            dist.all_gather(parts, local, group=group)
        hf.update(zip(rule.hf_names, rule.merge(parts), strict=True))
    return _finish(hf, config)


def megatron_hf_state_dict(model: Any, config: DenseTransformerConfig) -> dict[str, Tensor]:
    """Gather a megatron-core GPT model's TP shards into HF tensors (collective on TP ranks).

    Unwraps DDP / Float16Module wrappers (`.module`), uses megatron's tensor-parallel group
    and refuses pipeline parallelism. Needs megatron-core (`pip install tether[megatron]`).
    """
    try:
        from megatron.core import parallel_state
    except ImportError as exc:
        raise MegatronLayoutError(
            "megatron-core is not installed; install tether[megatron], or pass plain tensors "
            "to gather_hf_state_dict / merge_tensor_parallel_shards"
        ) from exc
    if parallel_state.get_pipeline_model_parallel_world_size() != 1:
        raise MegatronLayoutError(
            "pipeline-parallel models are not supported: gather with pipeline size 1"
        )
    while hasattr(model, "module"):
        model = model.module
    group = parallel_state.get_tensor_model_parallel_group()
    return gather_hf_state_dict(model.state_dict(), config, group=group)
