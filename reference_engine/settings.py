"""Settings of one reference engine process (flags or `TETHER_REFERENCE_*` variables).

Owns the defaults: loopback host, SGLang's port 30000 and `"default"` weight version, fp32
compute (BF16 values are exact in fp32 and tiny matmuls are faster there on CPU), one
torch thread per engine so several engines share a small machine. Must never load models.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class ReferenceEngineSettings(BaseSettings):
    """Everything a reference engine process needs to start."""

    model_config = SettingsConfigDict(env_prefix="TETHER_REFERENCE_", extra="ignore")

    model_path: Path
    host: str = "127.0.0.1"
    port: int = Field(30000, ge=0, le=65535)
    precision: Literal["auto", "bf16", "fp8", "nvfp4"] = "auto"
    weight_version: str = "default"
    served_model_name: str | None = None
    dtype: Literal["float32", "bfloat16"] = "float32"
    threads: int = Field(1, ge=1)
    max_running_requests: int = Field(16, ge=1)
    health_generate: bool = True
    health_check_timeout_s: float = Field(20.0, gt=0)
    log_level: str = "info"
