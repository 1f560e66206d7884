"""The example connector's own settings: the table [connector.example] of pdctl.toml."""

from __future__ import annotations

from pydantic import Field

from appliance.connector.base import OwnSettings


class ExampleSettings(OwnSettings):
    """Where the KV goes between prefill and decode, and how much of it is kept."""

    shared_storage_path: str = Field(default="", description="The KV folder; default: <state_dir>/kv-store")
    # vLLM writes every new prompt's KV there and deletes none: the proxy evicts the least recently used
    # prompts beyond these bounds (docs/operations.md, "The CPU connector's KV store")
    max_store_mib: float = Field(default=1024, gt=0, description=(
        "The KV folder's size beyond which the proxy evicts the least recently used prompts' KV"))
    max_age_s: float = Field(default=3600, gt=0, description=(
        "A prompt's KV not written or read for this long is evicted"))
