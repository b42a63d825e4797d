"""A real megatron-core GPT, tensor-parallel over two gloo ranks on CPU, published through
the Publisher and served by transformers' Qwen3 with the same logits.

Two spawned ranks build a tiny Qwen3-shaped GPT (RMSNorm, SwiGLU, rotary, QK-norm, GQA,
head_dim != hidden / heads, vocabulary padded for TP) with megatron-core's local layer spec,
run its forward pass, gather the shards with `megatron_hf_state_dict` and publish the result
as a float32 version. The test loads that version from the store into
`Qwen3ForCausalLM` and compares logits; a gate/up swap in one layer must be caught.

megatron-core 0.16.1 assumes CUDA in three places at forward time; each is avoided here
without touching megatron's files (see docs/megatron.md):
- the RNG tracker forks CUDA RNG state around attention dropout:
  `model_parallel_cuda_manual_seed(..., inference_rng_tracker=True)` installs its no-op
  tracker;
- the default causal mask is allocated on "cuda": an explicit mask is passed;
- `RotaryEmbedding.get_emb` moves `inv_freq` to `torch.cuda.current_device()` when it is
  on the CPU: the rank wraps that one method so the move targets the CPU (`_cpu_rotary`);
- a fourth, not in the issue: unfused attention takes its score buffer from megatron's
  global memory buffer, which allocates on `torch.cuda.current_device()` unless a large
  enough buffer of that name and dtype exists: the rank places a CPU one there first
  (`_cpu_attention_buffer`);
- a fifth: gathering vocabulary-parallel logits (`parallel_output=False`) allocates on
  `torch.cuda.current_device()`: the model returns its slices and the rank all-gathers them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from launcher.processes import free_port
from store.store import Store
from store.torch_bridge import to_torch
from trainer_client.megatron import DenseTransformerConfig, megatron_hf_state_dict
from trainer_client.publisher import Publisher

pytest.importorskip("megatron.core", reason="megatron-core is installed by `make install`")
transformers = pytest.importorskip("transformers")

RUN = "megatron-real"
RUN_BF16 = "megatron-real-bf16"
TP = 2
SEQ = 7
BATCH = 2
# Qwen3-shaped: 4 query heads in 2 KV groups of head_dim 16 on a hidden size of 32.
SHAPE = DenseTransformerConfig(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=48,
    vocab_size=61,
    head_dim=16,
)
PADDED_VOCAB = 64  # what Megatron holds: divisible by TP; rows 61..63 are padding
ROPE_THETA = 10000.0
EPS = 1e-6
# Measured on CPU fp32: about 1e-6 (summation order differs between the TP=2 row-parallel
# all-reduce and the dense matmul); the gate/up swap moves logits by order 1.
FP32_TOLERANCE = 2e-5
# BF16 keeps 8 bits of mantissa: weights move by up to 2**-9 relative; measured 0.04
# on logits of standard deviation 1.8.
BF16_TOLERANCE = 0.15


def hf_config() -> Any:
    return transformers.Qwen3Config(
        vocab_size=SHAPE.vocab_size,
        hidden_size=SHAPE.hidden_size,
        intermediate_size=SHAPE.ffn_hidden_size,
        num_hidden_layers=SHAPE.num_layers,
        num_attention_heads=SHAPE.num_attention_heads,
        num_key_value_heads=SHAPE.num_query_groups,
        head_dim=SHAPE.head_dim,
        rms_norm_eps=EPS,
        rope_theta=ROPE_THETA,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        attention_bias=False,
        attn_implementation="eager",
    )


def input_ids() -> torch.Tensor:
    return torch.randint(
        0, SHAPE.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(3)
    )


# ------------------------------------------------------------------ the megatron ranks


def _megatron_model() -> Any:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=SHAPE.num_layers,
        hidden_size=SHAPE.hidden_size,
        num_attention_heads=SHAPE.num_attention_heads,
        num_query_groups=SHAPE.num_query_groups,
        kv_channels=SHAPE.kv_channels,
        ffn_hidden_size=SHAPE.ffn_hidden_size,
        tensor_model_parallel_size=TP,
        normalization="RMSNorm",
        layernorm_epsilon=EPS,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        qk_layernorm=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.3,  # large enough that logits are far from uniform
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        # The fused kernels are CUDA-only.
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )
    spec = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=PADDED_VOCAB,
        max_sequence_length=64,
        position_embedding_type="rope",
        rotary_base=int(ROPE_THETA),
        share_embeddings_and_output_weights=False,
        # Each rank returns its vocabulary slice of the logits; megatron's own gather
        # (parallel_output=False) allocates its output on CUDA, so the rank gathers them.
        parallel_output=True,
    )


def _perturb_norms(model: torch.nn.Module) -> None:
    """Norm weights start at one, which would hide a q_norm/k_norm or norm-order mix-up;
    every rank draws the same values (they are replicated)."""
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "norm" in name:
                param.copy_(1.0 + 0.3 * torch.randn(param.shape, generator=gen))


@contextmanager
def _cpu_rotary(model: Any) -> Iterator[None]:
    """megatron-core 0.16.1's `RotaryEmbedding.get_emb` moves a CPU `inv_freq` to
    `torch.cuda.current_device()` on first use, which a CPU-only torch cannot do. For the
    duration of the forward, only that method sees a `current_device` that is the CPU."""
    rotary = model.rotary_pos_emb
    original = type(rotary).get_emb
    current_device = torch.cuda.current_device

    def get_emb(max_seq_len: int, offset: int = 0) -> torch.Tensor:
        torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
        try:
            return original(rotary, max_seq_len, offset)
        finally:
            torch.cuda.current_device = current_device  # type: ignore[assignment]

    rotary.get_emb = get_emb
    try:
        yield
    finally:
        del rotary.get_emb


def _cpu_attention_buffer() -> None:
    """Give megatron's global memory buffer a CPU tensor for the attention scores
    ([batch * local heads, seq, seq] floats under the name "mpu"), which it reuses instead
    of allocating on CUDA."""
    from megatron.core import parallel_state

    heads = SHAPE.num_attention_heads // TP
    buffer = parallel_state.get_global_memory_buffer().buffer
    buffer[("mpu", torch.float32)] = torch.empty(BATCH * heads * SEQ * SEQ)


def _rank(rank: int, port: int, out_dir: str) -> None:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=TP)
    try:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP)
        model_parallel_cuda_manual_seed(1, inference_rng_tracker=True)
        torch.manual_seed(0)  # CPU initialisation draws each full weight, then keeps a slice
        model = _megatron_model().eval()
        _perturb_norms(model)
        _cpu_attention_buffer()
        ids = input_ids()
        positions = torch.arange(SEQ).expand(BATCH, SEQ)
        causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)  # True: masked
        with torch.no_grad(), _cpu_rotary(model):
            local_logits = model(ids, positions, causal[None, None])
        slices = [torch.empty_like(local_logits) for _ in range(TP)]
        dist.all_gather(slices, local_logits.contiguous())
        logits = torch.cat(slices, dim=-1)
        local_rows = model.embedding.word_embeddings.weight.shape[0]
        hf_state = megatron_hf_state_dict(model, SHAPE)
        if rank == 0:
            with Publisher(str(Path(out_dir, "store")), RUN, progress=False) as publisher:
                report = publisher.claim(0, hf_state, canonical_dtype="F32")
            with Publisher(str(Path(out_dir, "store")), RUN_BF16, progress=False) as publisher:
                publisher.claim(0, hf_state)  # the default canonical dtype, BF16
            torch.save(logits[..., : SHAPE.vocab_size].clone(), Path(out_dir, "megatron.pt"))
            Path(out_dir, "rank0.json").write_text(
                json.dumps(
                    {
                        "version": None if report is None else report.version,
                        "local_vocab_rows": local_rows,
                        "padded_logit_columns": logits.shape[-1],
                    }
                )
            )
        parallel_state.destroy_model_parallel()
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------ the specification


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("megatron")
    mp.spawn(_rank, args=(free_port(), str(out)), nprocs=TP, join=True)
    return out


def qwen3_logits(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    model = transformers.Qwen3ForCausalLM(hf_config()).eval()
    model.load_state_dict(tensors, strict=True)
    with torch.no_grad():
        return model(input_ids()).logits


def published_tensors(out: Path, run: str = RUN) -> dict[str, torch.Tensor]:
    raw = Store(str(out / "store")).materialize(run, 0)
    return {name: to_torch(t) for name, t in raw.items()}


def test_the_real_model_publishes_one_full_float32_version_with_the_vocabulary_unpadded(
    published: Path,
) -> None:
    report = json.loads((published / "rank0.json").read_text())
    assert report == {
        "version": 0,
        "local_vocab_rows": PADDED_VOCAB // TP,
        "padded_logit_columns": PADDED_VOCAB,
    }
    tensors = published_tensors(published)
    assert {t.dtype for t in tensors.values()} == {torch.float32}
    assert tensors["model.embed_tokens.weight"].shape == (SHAPE.vocab_size, SHAPE.hidden_size)
    assert tensors["lm_head.weight"].shape == (SHAPE.vocab_size, SHAPE.hidden_size)


def test_qwen3_loaded_from_the_published_version_computes_megatrons_logits(
    published: Path,
) -> None:
    megatron = torch.load(published / "megatron.pt")
    hf = qwen3_logits(published_tensors(published))
    assert hf.shape == megatron.shape == (BATCH, SEQ, SHAPE.vocab_size)
    assert megatron.std() > 0.5  # far from uniform, so agreement means something
    assert (hf - megatron).abs().max() < FP32_TOLERANCE


def test_the_bf16_version_computes_megatrons_fp32_logits_within_bf16_rounding(
    published: Path,
) -> None:
    megatron = torch.load(published / "megatron.pt")
    tensors = published_tensors(published, RUN_BF16)
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    error = (qwen3_logits({k: v.float() for k, v in tensors.items()}) - megatron).abs().max()
    assert FP32_TOLERANCE < error < BF16_TOLERANCE


def test_a_gate_up_swap_in_one_layer_is_caught_by_the_logit_comparison(published: Path) -> None:
    megatron = torch.load(published / "megatron.pt")
    tensors = published_tensors(published)
    gate, up = "model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight"
    tensors[gate], tensors[up] = tensors[up], tensors[gate]
    assert (qwen3_logits(tensors) - megatron).abs().max() > 100 * FP32_TOLERANCE
