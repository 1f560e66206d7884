"""The example connector's own settings: the table [connector.example] of pdctl.toml."""

from __future__ import annotations

from pydantic import Field

from appliance.connector.base import OwnSettings


class ExampleSettings(OwnSettings):
    """Where the KV goes between prefill and decode."""

    shared_storage_path: str = Field(default="", description="The KV folder; default: <state_dir>/kv-store")
