"""The fleet configuration: pools of rollout replicas on named accelerators, read from TOML.

Owns the `fleet.toml` schema (pydantic), the accelerator → precision table and the SGLang
flags each precision needs. Both the Modal app and `tether deploy` read a fleet through
`load_fleet`; neither re-derives a pool's precision or flags on its own.

Must never import `modal`, start a process or touch the network: a fleet is plain data,
so it can be checked on a laptop without credentials.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

Precision = Literal["bf16", "fp8", "nvfp4"]
PRECISIONS: tuple[str, ...] = ("bf16", "fp8", "nvfp4")

# Blackwell serves NVFP4 natively (SGLang's modelopt_fp4 needs SM100), Hopper has FP8
# tensor cores, and Ampere/Ada pools stay on the canonical BF16 bytes.
DEFAULT_PRECISION_TABLE: dict[str, Precision] = {
    "B300": "nvfp4",
    "B200": "nvfp4",
    "H200": "fp8",
    "H100": "fp8",
    "A100": "bf16",
    "L40S": "bf16",
}

# What SGLang needs to load each of the agent's checkpoints. FP8 block and NVFP4 folders
# carry their quantization_config, but naming the method keeps old SGLang versions (which
# mapped "modelopt" to FP8) from guessing wrong.
DEFAULT_SGLANG_FLAGS: dict[str, list[str]] = {
    "bf16": ["--dtype", "bfloat16"],
    "fp8": ["--dtype", "bfloat16", "--quantization", "fp8"],
    "nvfp4": ["--dtype", "bfloat16", "--quantization", "modelopt_fp4"],
}

_NAME = re.compile(r"^[a-z][a-z0-9-]{0,30}$")


class FleetConfigError(ValueError):
    """A fleet file that cannot be used; the message names the field and the fix."""


def accelerator_family(accelerator: str) -> str:
    """`A100-80GB` → `A100`, `H100!` → `H100`, `B200+` → `B200`, `H200:8` → `H200`: the
    key of the precision table (Modal's `!` pins the exact type, `+` allows a newer one
    of the same family, `:N` is the count)."""
    name = accelerator.strip().split(":", 1)[0].rstrip("!+")
    return name.split("-", 1)[0].upper()


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSection(_Section):
    """The run's base BF16 checkpoint, as a folder every replica can read."""

    path: str = "/models/base"
    volume: str | None = "tether-models"
    mount: str = "/models"
    boot_version: int = Field(default=0, ge=0)


class StoreSection(_Section):
    """Where versions live: an S3 URL (recommended) or a Modal Volume mounted as a folder."""

    url: str = "s3://tether/store"
    secret: str | None = "tether-store"
    volume: str | None = None
    mount: str = "/store"

    @property
    def effective_url(self) -> str:
        return f"file://{self.mount}" if self.volume else self.url


class ControlPlaneSection(_Section):
    image: str = "python:3.12-slim"
    secret: str = "tether-controlplane"
    port: int = Field(default=8700, gt=0, lt=65536)
    min_replicas: int = Field(default=1, ge=1)
    max_replicas: int = Field(default=3, ge=1)
    concurrency: int = Field(default=256, ge=1)
    url: str | None = None


# The newest SGLang release with evidence of a published image (Docker Hub digest seen
# 2026-10-07); releases from 0.5.20 on ship CUDA 13 only, hence the explicit -cu130 tag.
DEFAULT_SGLANG_IMAGE = "lmsysorg/sglang:v0.5.21-cu130"


class EngineSection(_Section):
    image: str = DEFAULT_SGLANG_IMAGE
    secret: str = "tether-engine"
    sglang_port: int = Field(default=30000, gt=0, lt=65536)
    agent_port: int = Field(default=8800, gt=0, lt=65536)
    work_dir: str = "/tmp/tether"
    startup_timeout_s: int = Field(default=1200, gt=0)


class SGLangSection(_Section):
    common: list[str] = Field(default_factory=list)
    flags: dict[str, list[str]] = Field(default_factory=dict)

    @field_validator("flags")
    @classmethod
    def _known_precisions(cls, value: dict[str, list[str]]) -> dict[str, list[str]]:
        unknown = sorted(set(value) - set(PRECISIONS))
        if unknown:
            raise ValueError(f"[sglang.flags] has {unknown}; keys must be among {PRECISIONS}")
        return value


class PoolConfig(_Section):
    """One pool: replicas of one accelerator type, each an SGLang engine plus its agent."""

    name: str
    accelerator: str
    gpus: int = Field(default=1, ge=1, le=8)
    precision: Precision | None = None
    min_replicas: int = Field(default=1, ge=0)
    max_replicas: int = Field(default=1, ge=1)
    capacity: int = Field(default=64, ge=1)
    labels: dict[str, str] = Field(default_factory=dict)
    sglang_flags: list[str] = Field(default_factory=list)
    image: str | None = None

    @field_validator("name")
    @classmethod
    def _dns_name(cls, value: str) -> str:
        if not _NAME.match(value):
            raise ValueError(
                f"pool name {value!r} must be lower-case letters, digits and '-' "
                "(it becomes a Modal class and a Kubernetes name)"
            )
        return value

    @property
    def gpu(self) -> str:
        """Modal's GPU string: `H100`, or `H100:2` for a tensor-parallel replica."""
        return self.accelerator if self.gpus == 1 else f"{self.accelerator}:{self.gpus}"


class FleetConfig(_Section):
    app: str = "tether"
    run: str
    model: ModelSection = Field(default_factory=ModelSection)
    store: StoreSection = Field(default_factory=StoreSection)
    controlplane: ControlPlaneSection = Field(default_factory=ControlPlaneSection)
    engine: EngineSection = Field(default_factory=EngineSection)
    precision: dict[str, Precision] = Field(default_factory=dict)
    sglang: SGLangSection = Field(default_factory=SGLangSection)
    pools: list[PoolConfig]

    @field_validator("pools")
    @classmethod
    def _pools(cls, pools: list[PoolConfig]) -> list[PoolConfig]:
        if not pools:
            raise ValueError("declare at least one [[pools]] entry")
        names = [p.name for p in pools]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"pool names must be unique; repeated: {twice}")
        for pool in pools:
            if pool.min_replicas > pool.max_replicas:
                raise ValueError(
                    f"pool {pool.name!r}: min_replicas {pool.min_replicas} > "
                    f"max_replicas {pool.max_replicas}"
                )
        return pools

    def precision_table(self) -> dict[str, Precision]:
        """The default table with the file's `[precision]` entries laid over it."""
        table = dict(DEFAULT_PRECISION_TABLE)
        table.update({accelerator_family(k): v for k, v in self.precision.items()})
        return table

    def precision_for(self, pool: PoolConfig) -> Precision:
        """The pool's own `precision`, else the table's entry for its accelerator."""
        if pool.precision is not None:
            return pool.precision
        family = accelerator_family(pool.accelerator)
        table = self.precision_table()
        if family not in table:
            raise FleetConfigError(
                f"pool {pool.name!r}: no precision for accelerator {pool.accelerator!r} "
                f'(known: {", ".join(sorted(table))}); set precision = "bf16"|"fp8"|'
                f'"nvfp4" on the pool or add {family} = "..." under [precision]'
            )
        return table[family]

    def sglang_flags_for(self, pool: PoolConfig) -> list[str]:
        """Precision flags (file over defaults), then the common flags, then the pool's."""
        precision = self.precision_for(pool)
        flags = self.sglang.flags.get(precision, DEFAULT_SGLANG_FLAGS[precision])
        return [*flags, *self.sglang.common, *pool.sglang_flags]


def parse_fleet(text: str, source: str = "fleet.toml") -> FleetConfig:
    """Parse TOML text into a checked fleet; every problem becomes a `FleetConfigError`."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise FleetConfigError(f"{source} is not valid TOML: {exc}") from exc
    try:
        fleet = FleetConfig.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '(top level)'}: {e['msg']}"
            for e in exc.errors()
        )
        raise FleetConfigError(f"{source} is not a valid fleet: {problems}") from exc
    for pool in fleet.pools:
        fleet.precision_for(pool)
    return fleet


def load_fleet(path: str | Path) -> FleetConfig:
    """Read and check a fleet file (see deploy/fleet.example.toml)."""
    file = Path(path)
    try:
        text = file.read_text()
    except OSError as exc:
        raise FleetConfigError(
            f"cannot read the fleet file {file}: {exc.strerror}; "
            "start from deploy/fleet.example.toml"
        ) from exc
    return parse_fleet(text, str(file))
