"""What an engine instance does (prefill, decode, or both: one colocated engine, connector "none") and how the
KV cache moves between a prefill and a decode (read: the decode pulls it; write: the prefill pushes it)."""

from __future__ import annotations

from typing import Literal

Role = Literal["prefill", "decode", "both"]
ROLES: tuple[Role, ...] = ("prefill", "decode", "both")
Mode = Literal["read", "write"]
