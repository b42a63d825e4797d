"""The demo's one settings object, read from flags and `TETHER_DEMO_*` variables.

Owns configuration only: sizes of the run, where its state lives, the training
hyper-parameters. Starts nothing.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

PRECISIONS = ("bf16", "fp8", "nvfp4")


class DemoSettings(BaseSettings):
    """Everything `tether demo` can be told (`--steps` = `TETHER_DEMO_STEPS`, ...)."""

    model_config = SettingsConfigDict(env_prefix="TETHER_DEMO_", extra="ignore")

    steps: int = Field(default=40, ge=1, le=100_000)
    engines: int = Field(default=3, ge=1, le=64)
    seed: int = 0
    # None: a folder store and a SQLite file under the work dir.
    store: str | None = None
    db: str | None = None
    workdir: Path = Path("./.tether/demo")
    run_id: str | None = None
    # GRPO: prompts per step, samples per prompt.
    prompts_per_step: int = Field(default=12, ge=1)
    group_size: int = Field(default=4, ge=2)
    # Requests accept versions at most this far behind the latest at request time. The next
    # batch is sampled while the trainer trains, so it learns from tokens up to lag + 1 old.
    max_lag: int = Field(default=0, ge=0)
    learning_rate: float = Field(default=1e-2, gt=0)
    # Parameter-name prefixes that learn (the rest stay frozen).
    trainable: tuple[str, ...] = ("lm_head",)
    temperature: float = Field(default=1.0, gt=0)
    # Publishing.
    codec: str = "sparse"
    anchor_every: int = Field(default=10, ge=1)
    # How long to wait for the fleet to start, and for one rollout.
    start_deadline_s: float = Field(default=180.0, gt=0)
    rollout_deadline_s: float = Field(default=60.0, gt=0)
    concurrency: int = Field(default=16, ge=1)

    def precision_of(self, index: int) -> str:
        """Engines take BF16, FP8, NVFP4 in turn."""
        return PRECISIONS[index % len(PRECISIONS)]
