"""`tether model init-tiny` writes a deterministic, loadable Qwen3 model with a tokenizer."""

from __future__ import annotations

import hashlib
import json

import torch
from typer.testing import CliRunner

from cli import app
from reference_engine.tiny_model import TinyModelSpec, init_tiny_model


def digest(path) -> str:
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


def test_same_seed_gives_identical_bytes_and_another_seed_differs(tiny, tmp_path):
    again = init_tiny_model(tmp_path / "again", TinyModelSpec(seed=0))
    assert digest(again) == digest(tiny.bf16)
    assert digest(tiny.bf16_other) != digest(tiny.bf16)


def test_tiny_model_loads_offline_with_transformers_auto_classes(tiny):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = json.loads((tiny.bf16 / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["torch_dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(tiny.bf16, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(tiny.bf16, local_files_only=True)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    ids = tokenizer("3+5=").input_ids
    logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), config["vocab_size"])


def test_numbers_up_to_eighteen_are_single_tokens_and_text_round_trips(tiny):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny.bf16, local_files_only=True)
    for n in range(19):
        assert len(tokenizer(str(n)).input_ids) == 1, n
    text = "what is the sum of 12 and 7?\n12+7=19"
    assert tokenizer.decode(tokenizer(text).input_ids) == text
    assert tokenizer("3+5=").input_ids == [tokenizer.convert_tokens_to_ids(t) for t in "3+5="]


def test_chat_template_wraps_messages_and_opens_the_assistant_turn(tiny):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny.bf16, local_files_only=True)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "3+5="}], add_generation_prompt=True, tokenize=False
    )
    assert prompt == "<|im_start|>user\n3+5=<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.eos_token == "<|im_end|>"


def test_cli_init_tiny_writes_a_model_and_refuses_inconsistent_shapes(tmp_path):
    runner = CliRunner()
    ok = runner.invoke(app, ["model", "init-tiny", "--out", str(tmp_path / "m"), "--layers", "3"])
    assert ok.exit_code == 0, ok.output
    assert json.loads((tmp_path / "m" / "config.json").read_text())["num_hidden_layers"] == 3
    bad = runner.invoke(
        app, ["model", "init-tiny", "--out", str(tmp_path / "x"), "--hidden", "100"]
    )
    assert bad.exit_code == 2
    assert "heads × head_dim" in bad.output
