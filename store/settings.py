"""The store's settings, read from `TETHER_*` environment variables.

One typed object; every process that opens a store (CLI, publisher, engine agent) reads it
the same way. It holds no secrets beyond what the environment already does.
"""

from __future__ import annotations

from pathlib import Path

from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_STORE_URL = "./.tether/store"


class StoreSettings(BaseSettings):
    """`TETHER_STORE` (URL), `TETHER_S3_ENDPOINT_URL`, `TETHER_CACHE_DIR`."""

    model_config = SettingsConfigDict(env_prefix="TETHER_", extra="ignore")

    store: str = DEFAULT_STORE_URL
    s3_endpoint_url: str | None = None
    cache_dir: Path | None = None
