"""A tiny random Qwen3-architecture checkpoint with its own offline tokenizer.

Owns `init_tiny_model`: a Hugging Face folder (config.json, BF16 safetensors + index,
tokenizer.json, tokenizer_config.json with a chat template, generation_config.json) small
enough for tests and the CPU demo. Must never touch the network: the tokenizer is built
here from a fixed vocabulary with the `tokenizers` library.

The vocabulary makes every number 0-99 one token (the demo asks for sums of two digits),
keeps `+`, `=`, whitespace and a few words as tokens, and decodes by concatenation, so
`decode(encode(s)) == s` for any string the vocabulary covers.
"""

from __future__ import annotations

import json
import string
from dataclasses import dataclass
from pathlib import Path

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END, UNK_TOKEN)

WORDS = [
    "system",
    "user",
    "assistant",
    "what",
    "is",
    "the",
    "sum",
    "of",
    "and",
    "plus",
    "minus",
    "equals",
    "answer",
    "question",
    "You",
    "are",
    "a",
    "helpful",
    "add",
    "two",
    "numbers",
    "digits",
    "Answer",
    "Question",
    "Sum",
    "yes",
    "no",
    "ok",
]

# Numbers first so "12" wins over "1"; then words, single characters, whitespace runs.
SPLIT_PATTERN = r"\d{1,2}|[A-Za-z]+|\n|[ ]|[^\sA-Za-z\d]"

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of the tiny model. Defaults give FP8 128-blocks and NVFP4 16-groups that fit,
    plus a k/v projection (64 rows) that exercises ceil-divided FP8 blocks."""

    seed: int = 0
    hidden: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    intermediate: int = 384
    max_position_embeddings: int = 2048


def build_vocabulary() -> dict[str, int]:
    """Token → id, fixed order: special tokens, numbers 0-99, words, printable characters."""
    tokens: list[str] = list(SPECIAL_TOKENS)
    tokens += [str(n) for n in range(100)]
    tokens += [w for w in WORDS if w not in tokens]
    for ch in string.ascii_letters + string.punctuation + " \n":
        if ch not in tokens:
            tokens.append(ch)
    return {tok: i for i, tok in enumerate(tokens)}


def _write_tokenizer(out: Path) -> int:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = build_vocabulary()
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 2048,
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": PAD_TOKEN,
        "unk_token": UNK_TOKEN,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    special_map = {"eos_token": IM_END, "pad_token": PAD_TOKEN, "unk_token": UNK_TOKEN}
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")
    return len(vocab)


def tiny_config(spec: TinyModelSpec, vocab_size: int, eos_id: int, pad_id: int) -> dict:
    """The config.json dict of a tiny Qwen3 model."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": vocab_size,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": None,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "torch_dtype": "bfloat16",
    }


def init_tiny_model(out_dir: str | Path, spec: TinyModelSpec | None = None) -> Path:
    """Write a random tiny Qwen3 checkpoint to `out_dir`; identical bytes for the same spec."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from engine_agent.precision.checkpoint import write_safetensors_folder

    spec = spec or TinyModelSpec()
    if spec.hidden != spec.heads * spec.head_dim:
        raise ValueError(
            f"hidden ({spec.hidden}) must equal heads × head_dim "
            f"({spec.heads} × {spec.head_dim}); change --hidden, --heads or --head-dim"
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab_size = _write_tokenizer(out)
    vocab = build_vocabulary()
    config = tiny_config(spec, vocab_size, vocab[IM_END], vocab[PAD_TOKEN])
    hf_config = Qwen3Config(**{k: v for k, v in config.items() if k != "architectures"})

    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(spec.seed)
        model = Qwen3ForCausalLM(hf_config)
    finally:
        torch.random.set_rng_state(generator_state)
    tensors = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}

    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    generation = {"eos_token_id": vocab[IM_END], "pad_token_id": vocab[PAD_TOKEN]}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    write_safetensors_folder(out, tensors)
    return out
