"""Settings of the sandbox backends, read from `TETHER_SANDBOX_*` environment variables.

Owns configuration only; it never probes the machine or starts anything.
"""

from __future__ import annotations

from pathlib import Path

from pydantic_settings import BaseSettings, SettingsConfigDict


class SandboxSettings(BaseSettings):
    """Where sandboxes keep their files and which host uids they may run as.

    `uid_first`..`uid_first + uid_count - 1` are leased one per live sandbox when the host
    user is root, so RLIMIT_NPROC of one sandbox never counts another's processes. No real
    account may use these uids: everything they own is killed when a sandbox closes.
    """

    model_config = SettingsConfigDict(env_prefix="TETHER_SANDBOX_")

    bwrap: str = "bwrap"
    scratch_dir: Path | None = None
    uid_first: int = 64000
    uid_count: int = 1000
    lease_dir: Path = Path("/tmp/tether-sandbox-uids")
    allow_unisolated: bool = False
    modal_app: str = "tether-sandboxes"
