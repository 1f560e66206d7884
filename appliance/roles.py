"""What an engine instance does: prefill, decode, or both (one colocated engine, connector "none")."""

from __future__ import annotations

from typing import Literal

Role = Literal["prefill", "decode", "both"]
ROLES: tuple[Role, ...] = ("prefill", "decode", "both")
