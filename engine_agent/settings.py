"""The engine agent's one settings object, read from flags and `TETHER_AGENT_*` variables.

A few values are shared with other Tether processes and also read from their common
variable: the token from `TETHER_TOKEN`, the store URL from `TETHER_STORE`, the control
plane from `TETHER_CONTROL_PLANE`. Owns configuration only; starts nothing.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import AliasChoices, Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from engine_agent.engines.base import PauseMode
from wire import EngineKind, Precision


class AgentSettings(BaseSettings):
    """Everything one engine agent process needs (one agent per engine)."""

    model_config = SettingsConfigDict(env_prefix="TETHER_AGENT_", extra="ignore")

    engine_url: str
    # The engine's kind: `sglang` (SGLang or the reference engine) or `vllm`.
    engine_kind: EngineKind = EngineKind.SGLANG
    precision: Precision
    run: str = Field(validation_alias=AliasChoices("run", "TETHER_AGENT_RUN", "TETHER_RUN"))
    store: str = Field(validation_alias=AliasChoices("store", "TETHER_AGENT_STORE", "TETHER_STORE"))
    # One control-plane URL, or several separated by commas (replicas without a load
    # balancer in front): the agent talks to the first that answers and fails over.
    control_plane: str | None = Field(
        default=None,
        validation_alias=AliasChoices(
            "control_plane", "TETHER_AGENT_CONTROL_PLANE", "TETHER_CONTROL_PLANE"
        ),
    )
    token: str | None = Field(
        default=None,
        repr=False,
        validation_alias=AliasChoices("token", "TETHER_AGENT_TOKEN", "TETHER_TOKEN"),
    )
    # The agent's own proxy: the URL it registers, where clients and the router send requests.
    host: str = "127.0.0.1"
    port: int = Field(default=0, ge=0, le=65535)
    advertise_url: str | None = None
    # The checkpoint the engine booted from: config/tokenizer files for staged folders, the
    # NVFP4 input scales, and (BF16 boot) the canonical tensors of `boot_version`.
    boot_model: Path | None = None
    boot_version: int | None = Field(default=None, ge=0)
    work_dir: Path = Path("./.tether/agent")
    pause_mode: PauseMode = PauseMode.IN_PLACE
    accelerator: str = "cpu"
    capacity: int = Field(default=1, ge=1)
    # Connections the proxy may hold open to the engine: the most requests it forwards at
    # once (more wait for a connection). Keep it above the engine's own running-request
    # limit, or it, not the engine, caps the batch.
    engine_connections: int = Field(default=1024, ge=1)
    labels: dict[str, str] = Field(default_factory=dict)
    # Timing knobs (seconds).
    admission_wait_s: float = Field(default=30.0, gt=0)
    exact_drain_s: float = Field(default=30.0, ge=0)
    quiesce_drain_s: float = Field(default=60.0, ge=0)
    pointer_poll_s: float = Field(default=1.0, gt=0)
    long_poll_s: float = Field(default=20.0, gt=0)
    engine_probe_s: float = Field(default=1.0, gt=0)
    engine_load_timeout_s: float = Field(default=600.0, gt=0)
    retry_initial_s: float = Field(default=1.0, gt=0)
    retry_max_s: float = Field(default=30.0, gt=0)
    log_level: str = "info"
    # Once booted, collect cycles once and freeze what exists (imports, the engine's
    # description, the boot tensors' holders), so later collections never rescan it
    # (`runtime/collector.py`); off: CPython's defaults (each full collection rescans the
    # ~0.3 M objects of torch's and transformers' imports while requests wait).
    gc_settle: bool = True
    # Once the agent starts, and while the engine loads: fold a small shipped delta of each
    # canonical dtype (`store/codecs/warm.py`) and convert a small layer to the engine's
    # precision (`engine_agent/precision/warm.py`), so the decoders' and converters'
    # imports and compiled kernels are loaded before the first catch-up rather than during
    # it, while serving.
    warm_codecs: bool = True
    # Peer-assisted fetch (docs/peers.md): with a control plane, fetch version files from
    # the peers its fetch plan names (verified against the store's digests) before the
    # store, and serve the files this agent holds to peers (engine role required).
    peer_fetch: bool = True
    # How long a peer may hold a request for a file it is still fetching itself, and how
    # long a transfer may deliver nothing before the peer counts as stalled.
    peer_wait_s: float = Field(default=30.0, ge=0)
    peer_stall_s: float = Field(default=5.0, gt=0)
    # A transfer from a peer or fetch source slower than this overall (bytes/s, once its
    # first byte came, with `peer_stall_s` of slack) counts as stalled and the file is read
    # elsewhere. Lower it where links are slow (a file of size S may take up to
    # peer_stall_s + S / this), or a whole subtree of the fetch tree falls back to the store.
    peer_min_bytes_per_s: float = Field(default=float(1 << 20), gt=0)
    # How long a new agent's first catch-up waits for its registration, and so for a fetch
    # plan, before it reads everything from the store (later passes wait 5 s for a new id).
    # An engine is routed to only once registered, so waiting costs no serving time; a
    # fleet started together under a slow control plane would otherwise read each version
    # from the store once per engine. 0: never wait longer than later passes.
    peer_first_plan_wait_s: float = Field(default=30.0, ge=0)
    # Serving: concurrent uploads, their shared bandwidth (bytes/s, 0: unlimited), and how
    # many versions back from the applied one the fetched files are kept to serve.
    peer_upload_slots: int = Field(default=8, ge=1)
    peer_upload_bytes_per_s: float = Field(default=0.0, ge=0)
    peer_keep_versions: int = Field(default=4, ge=1)
    # The piece a file is passed on in while it arrives (cut-through): the store is read in
    # ranges of this size when peers may be waiting, and uploads are paced in pieces of at
    # most this (and 256 KiB).
    peer_chunk_bytes: int = Field(default=64 << 20, ge=1024)
    # Other places that hold the store's files under the same keys, tried after the peers
    # and before the store, verified the same way: http(s):// base URLs (an HTTP cache, a
    # Dragonfly or Kraken proxy) or store URLs of a mirror (s3://..., a folder).
    fetch_sources: list[str] = Field(default_factory=list)

    @field_validator("engine_url", "advertise_url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        return None if value is None else _http_url(value)

    @field_validator("control_plane", mode="before")
    @classmethod
    def _control_plane_urls(cls, value: object) -> str | None:
        """Accept a list (the CLI's repeated --control-plane) or comma-separated URLs."""
        if value is None:
            return None
        parts = value if isinstance(value, list | tuple) else str(value).split(",")
        urls = [_http_url(str(p).strip()) for p in parts if str(p).strip()]
        return ",".join(urls) or None

    @property
    def control_planes(self) -> list[str]:
        """Every control-plane URL given, in the order the agent tries them."""
        return self.control_plane.split(",") if self.control_plane else []

    @field_validator("fetch_sources", mode="before")
    @classmethod
    def _fetch_sources(cls, value: object) -> object:
        """Accept comma-separated URLs (an environment variable) as well as a list."""
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("labels", mode="before")
    @classmethod
    def _labels(cls, value: object) -> object:
        """Accept `["k=v", ...]` (the CLI's repeated --label) as well as a mapping."""
        if isinstance(value, list | tuple):
            labels = {}
            for item in value:
                key, sep, val = str(item).partition("=")
                if not sep or not key:
                    raise ValueError(f"labels must look like key=value, found {item!r}")
                labels[key] = val
            return labels
        return value


def _http_url(value: str) -> str:
    if not value.startswith(("http://", "https://")):
        raise ValueError(f"expected an http:// or https:// URL, found {value!r}")
    return value.rstrip("/")
