"""MORI-IO's own settings: the table [connector.moriio] of pdctl.toml."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from appliance.connector.base import OwnSettings


class MoriioSettings(OwnSettings):
    """How MORI-IO moves the KV."""

    backend: Literal["rdma", "xgmi"] = Field(default="rdma", description="rdma (NICs) or xgmi (GPU links, one node)")
