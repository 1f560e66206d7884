"""NIXL's own settings: the table [connector.nixl] of pdctl.toml."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from appliance.connector.base import OwnSettings


class NixlSettings(OwnSettings):
    """Where NIXL stages the KV it hands over."""

    kv_buffer_device: Literal["cuda", "cpu"] | None = Field(
        default=None, description="cuda or cpu; default: the GPU on NVIDIA, host memory on CPU")
