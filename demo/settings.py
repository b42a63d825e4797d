"""The demo's one settings object, read from flags and `TETHER_DEMO_*` variables.

Owns configuration only: sizes of the run, where its state lives, the training
hyper-parameters. Starts nothing.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

PRECISIONS = ("bf16", "fp8", "nvfp4")
# Engine kinds the demo can start: the CPU reference engine, or vLLM's CPU build (BF16).
KINDS = ("reference", "vllm")


def parse_engines(text: str) -> tuple[int, tuple[tuple[str, str], ...] | None]:
    """`--engines`: a count (`3`: BF16/FP8/NVFP4 reference engines in turn) or a list of
    `precision[:kind]` (`bf16:vllm,fp8:reference,nvfp4`); ValueError names the fix."""
    text = text.strip()
    if text.isdigit():
        return int(text), None
    layout = []
    for item in text.split(","):
        precision, _, kind = item.strip().partition(":")
        kind = kind or "reference"
        if precision not in PRECISIONS:
            raise ValueError(
                f"engines: {item.strip()!r}: precision must be one of {', '.join(PRECISIONS)}"
            )
        if kind not in KINDS:
            raise ValueError(f"engines: {item.strip()!r}: kind must be one of {', '.join(KINDS)}")
        if kind == "vllm" and precision != "bf16":
            raise ValueError(
                f"engines: {item.strip()!r}: the demo's vLLM engine (CPU build) serves bf16; "
                "use bf16:vllm"
            )
        layout.append((precision, kind))
    return len(layout), tuple(layout)


class DemoSettings(BaseSettings):
    """Everything `tether demo` can be told (`--steps` = `TETHER_DEMO_STEPS`, ...)."""

    model_config = SettingsConfigDict(env_prefix="TETHER_DEMO_", extra="ignore")

    steps: int = Field(default=40, ge=1, le=100_000)
    engines: int = Field(default=3, ge=1, le=64)
    # (precision, kind) per engine; None: `engines` reference engines, BF16/FP8/NVFP4 in turn.
    layout: tuple[tuple[str, str], ...] | None = None
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

    @model_validator(mode="after")
    def _count_layout(self) -> DemoSettings:
        if self.layout is not None:
            self.engines = len(self.layout)
        return self

    def precision_of(self, index: int) -> str:
        """The layout's precision, else BF16, FP8, NVFP4 in turn."""
        if self.layout is not None:
            return self.layout[index][0]
        return PRECISIONS[index % len(PRECISIONS)]

    def kind_of(self, index: int) -> str:
        """The layout's engine kind, else the reference engine."""
        return self.layout[index][1] if self.layout is not None else "reference"
