"""Specification of the Megatron TP-shard ⇄ Hugging Face adapter.

The distributed tests run two real gloo ranks on CPU (127.0.0.1, a free port) that hold
Megatron-layout shards, check that the sharded column/row-parallel layers compute what the
dense HF layers compute, and gather the shards back into HF names bit for bit.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from launcher.processes import free_port
from trainer_client.megatron import (
    DenseTransformerConfig,
    MegatronLayoutError,
    gather_hf_state_dict,
    megatron_hf_state_dict,
    merge_tensor_parallel_shards,
    split_for_tensor_parallel,
)

# Qwen3-like: GQA, head_dim != hidden / heads, q/k norms, untied head, odd vocabulary.
CONFIG = DenseTransformerConfig(
    num_layers=2,
    hidden_size=16,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=24,
    vocab_size=37,
    head_dim=8,
)
PADDED_VOCAB = 40


def reference_state(config: DenseTransformerConfig, dtype=torch.float32, bias=False):
    gen = torch.Generator().manual_seed(1234)
    h, d, f = config.hidden_size, config.kv_channels, config.ffn_hidden_size

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    state = {"model.embed_tokens.weight": rand(config.vocab_size, h), "model.norm.weight": rand(h)}
    if not config.tie_word_embeddings:
        state["lm_head.weight"] = rand(config.vocab_size, h)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        state |= {
            p + "input_layernorm.weight": rand(h),
            p + "post_attention_layernorm.weight": rand(h),
            p + "self_attn.q_proj.weight": rand(config.num_attention_heads * d, h),
            p + "self_attn.k_proj.weight": rand(config.num_query_groups * d, h),
            p + "self_attn.v_proj.weight": rand(config.num_query_groups * d, h),
            p + "self_attn.o_proj.weight": rand(h, config.num_attention_heads * d),
            p + "self_attn.q_norm.weight": rand(d),
            p + "self_attn.k_norm.weight": rand(d),
            p + "mlp.gate_proj.weight": rand(f, h),
            p + "mlp.up_proj.weight": rand(f, h),
            p + "mlp.down_proj.weight": rand(h, f),
        }
        if bias:
            state |= {
                p + "self_attn.q_proj.bias": rand(config.num_attention_heads * d),
                p + "self_attn.k_proj.bias": rand(config.num_query_groups * d),
                p + "self_attn.v_proj.bias": rand(config.num_query_groups * d),
            }
    return state


# ------------------------------------------------------------------ layers, dense and sharded


def rms_norm(x, weight):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight


def attention(q, k, v, heads_per_group):
    """q [S, H, d], k/v [S, G, d]; head h attends with key/value group h // heads_per_group."""
    k = k.repeat_interleave(heads_per_group, dim=1)
    v = v.repeat_interleave(heads_per_group, dim=1)
    scores = torch.einsum("shd,thd->hst", q, k) / math.sqrt(q.shape[-1])
    return torch.einsum("hst,thd->shd", scores.softmax(-1), v).reshape(q.shape[0], -1)


def dense_block(state, x, config):
    p, d = "model.layers.0.", config.kv_channels
    q = (x @ state[p + "self_attn.q_proj.weight"].T).unflatten(-1, (-1, d))
    k = (x @ state[p + "self_attn.k_proj.weight"].T).unflatten(-1, (-1, d))
    v = (x @ state[p + "self_attn.v_proj.weight"].T).unflatten(-1, (-1, d))
    q, k = (
        rms_norm(q, state[p + "self_attn.q_norm.weight"]),
        rms_norm(k, state[p + "self_attn.k_norm.weight"]),
    )
    attn = attention(q, k, v, config.heads_per_group) @ state[p + "self_attn.o_proj.weight"].T
    gate = x @ state[p + "mlp.gate_proj.weight"].T
    up = x @ state[p + "mlp.up_proj.weight"].T
    mlp = (F.silu(gate) * up) @ state[p + "mlp.down_proj.weight"].T
    return attn, mlp


def sharded_block(local, x, config):
    """Rank-local Megatron computation: column-parallel fused layers, row-parallel + all-reduce."""
    p, d, per = "decoder.layers.0.", config.kv_channels, config.heads_per_group
    fused = (x @ local[p + "self_attention.linear_qkv.weight"].T).unflatten(-1, (-1, per + 2, d))
    q, k, v = fused[:, :, :per].flatten(1, 2), fused[:, :, per], fused[:, :, per + 1]
    q = rms_norm(q, local[p + "self_attention.q_layernorm.weight"])
    k = rms_norm(k, local[p + "self_attention.k_layernorm.weight"])
    attn = attention(q, k, v, per) @ local[p + "self_attention.linear_proj.weight"].T
    gate, up = (x @ local[p + "mlp.linear_fc1.weight"].T).chunk(2, dim=-1)
    mlp = (F.silu(gate) * up) @ local[p + "mlp.linear_fc2.weight"].T
    dist.all_reduce(attn)
    dist.all_reduce(mlp)
    return attn, mlp


DTYPES = ("float32", "bfloat16")


def _tp_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        for dtype_name in DTYPES:
            _check_rank(rank, world, Path(out_dir, f"rank{rank}-{dtype_name}.json"), dtype_name)
    finally:
        dist.destroy_process_group()


def _check_rank(rank: int, world: int, out: Path, dtype_name: str) -> None:
    dtype = getattr(torch, dtype_name)
    reference = reference_state(CONFIG, dtype)
    shards = split_for_tensor_parallel(reference, CONFIG, world, PADDED_VOCAB)
    local = {f"module.{k}": v.clone() for k, v in shards[rank].items()}
    local["module.decoder.layers.0.mlp.linear_fc1._extra_state"] = None
    x = torch.randn(5, CONFIG.hidden_size, generator=torch.Generator().manual_seed(7))
    sharded = sharded_block(
        {k.removeprefix("module."): v.float() for k, v in local.items() if v is not None},
        x,
        CONFIG,
    )
    dense = dense_block({k: v.float() for k, v in reference.items()}, x, CONFIG)
    gathered = gather_hf_state_dict(local, CONFIG)
    report = {
        "local_vocab_rows": local["module.embedding.word_embeddings.weight"].shape[0],
        "keys_equal": sorted(gathered) == sorted(reference),
        "mismatched": sorted(
            k for k in reference if k not in gathered or not torch.equal(gathered[k], reference[k])
        ),
        "dtypes": sorted({str(t.dtype) for t in gathered.values()}),
        "forward_error": max(
            float((s - r).abs().max()) for s, r in zip(sharded, dense, strict=True)
        ),
    }
    out.write_text(json.dumps(report))


def test_two_gloo_ranks_gather_sharded_layers_into_the_exact_hf_state_dict(tmp_path):
    mp.spawn(_tp_rank, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank, dtype_name in ((r, d) for r in range(2) for d in DTYPES):
        report = json.loads((tmp_path / f"rank{rank}-{dtype_name}.json").read_text())
        assert report["local_vocab_rows"] == PADDED_VOCAB // 2
        assert report["keys_equal"]
        assert report["mismatched"] == []
        assert report["dtypes"] == [f"torch.{dtype_name}"]
        assert report["forward_error"] < 1e-4


# ------------------------------------------------------------------ pure layout rules


def test_fused_qkv_rows_are_grouped_query_heads_then_key_then_value():
    config = _unit_config(num_attention_heads=4, ffn_hidden_size=2)
    q0, q1, q2, q3, k0, k1, v0, v1 = (float(i) for i in range(8))
    rank0 = [[q0], [q1], [k0], [v0]]
    rank1 = [[q2], [q3], [k1], [v1]]
    shards = [_minimal_shard(config, rows) for rows in (rank0, rank1)]
    hf = merge_tensor_parallel_shards(shards, config)
    assert hf["model.layers.0.self_attn.q_proj.weight"].flatten().tolist() == [q0, q1, q2, q3]
    assert hf["model.layers.0.self_attn.k_proj.weight"].flatten().tolist() == [k0, k1]
    assert hf["model.layers.0.self_attn.v_proj.weight"].flatten().tolist() == [v0, v1]


def test_fused_gate_up_holds_each_ranks_gate_slice_then_its_up_slice():
    config = _unit_config(num_attention_heads=2, ffn_hidden_size=4)
    shards = [_minimal_shard(config, [[0.0], [0.0], [0.0]]) for _ in range(2)]
    shards[0]["decoder.layers.0.mlp.linear_fc1.weight"] = torch.tensor(
        [[1.0], [2.0], [10.0], [20.0]]
    )
    shards[1]["decoder.layers.0.mlp.linear_fc1.weight"] = torch.tensor(
        [[3.0], [4.0], [30.0], [40.0]]
    )
    hf = merge_tensor_parallel_shards(shards, config)
    assert hf["model.layers.0.mlp.gate_proj.weight"].flatten().tolist() == [1, 2, 3, 4]
    assert hf["model.layers.0.mlp.up_proj.weight"].flatten().tolist() == [10, 20, 30, 40]


def _unit_config(num_attention_heads: int, ffn_hidden_size: int) -> DenseTransformerConfig:
    """One layer, hidden size and head size 1, two query groups: one per TP rank."""
    return DenseTransformerConfig(
        num_layers=1,
        hidden_size=1,
        num_attention_heads=num_attention_heads,
        num_query_groups=2,
        ffn_hidden_size=ffn_hidden_size,
        vocab_size=2,
        head_dim=1,
    )


def _minimal_shard(config, qkv_rows):
    """One rank's tensors for a 1-layer model, hidden size 1, local (non-TE) norm names."""
    tp_ffn = config.ffn_hidden_size // 2
    return {
        "embedding.word_embeddings.weight": torch.zeros(1, 1),
        "output_layer.weight": torch.zeros(1, 1),
        "decoder.final_layernorm.weight": torch.ones(1),
        "decoder.layers.0.input_layernorm.weight": torch.ones(1),
        "decoder.layers.0.pre_mlp_layernorm.weight": torch.ones(1),
        "decoder.layers.0.self_attention.linear_qkv.weight": torch.tensor(qkv_rows),
        "decoder.layers.0.self_attention.linear_proj.weight": torch.zeros(1, 1),
        "decoder.layers.0.mlp.linear_fc1.weight": torch.zeros(2 * tp_ffn, 1),
        "decoder.layers.0.mlp.linear_fc2.weight": torch.zeros(1, tp_ffn),
    }


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("tied", [False, True])
def test_split_then_merge_returns_the_hf_tensors_exactly(tp, tied):
    config = dataclasses.replace(CONFIG, tie_word_embeddings=tied)
    reference = reference_state(config, bias=True)
    shards = split_for_tensor_parallel(reference, config, tp)
    merged = merge_tensor_parallel_shards(shards, config)
    assert sorted(merged) == sorted(reference)
    assert all(torch.equal(merged[k], reference[k]) for k in reference)


def test_config_from_a_hugging_face_config_dict():
    config = DenseTransformerConfig.from_hf_config(
        {
            "num_hidden_layers": 28,
            "hidden_size": 1024,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "intermediate_size": 3072,
            "vocab_size": 151936,
            "head_dim": 128,
            "tie_word_embeddings": True,
        }
    )
    assert (config.kv_channels, config.heads_per_group, config.tie_word_embeddings) == (
        128,
        2,
        True,
    )


def test_unknown_tensors_and_uneven_splits_are_refused_with_a_clear_error():
    shards = split_for_tensor_parallel(reference_state(CONFIG), CONFIG, 2, PADDED_VOCAB)
    shards[0]["decoder.layers.0.mlp.router.weight"] = torch.zeros(1)
    shards[1]["decoder.layers.0.mlp.router.weight"] = torch.zeros(1)
    with pytest.raises(MegatronLayoutError, match="unknown Megatron tensor"):
        merge_tensor_parallel_shards(shards, CONFIG)
    with pytest.raises(MegatronLayoutError, match="does not divide"):
        split_for_tensor_parallel(reference_state(CONFIG), CONFIG, 4)
    shards = split_for_tensor_parallel(reference_state(CONFIG), CONFIG, 2)
    del shards[1]["output_layer.weight"]
    with pytest.raises(MegatronLayoutError, match="rank 1 holds different tensors"):
        merge_tensor_parallel_shards(shards, CONFIG)


def test_wrapping_a_megatron_model_without_megatron_core_says_how_to_install_it(monkeypatch):
    # `make install` installs megatron-core; a None entry makes its import fail as if absent.
    monkeypatch.setitem(sys.modules, "megatron", None)
    monkeypatch.setitem(sys.modules, "megatron.core", None)
    with pytest.raises(MegatronLayoutError, match=r"tether\[megatron\]"):
        megatron_hf_state_dict(torch.nn.Linear(1, 1), CONFIG)
