"""What an engine instance does (prefill, decode, or both: one colocated engine, connector "none") and how the
KV cache moves between a prefill and a decode (read: the decode pulls it; write: the prefill pushes it)."""

from __future__ import annotations

from typing import Literal, get_args

Role = Literal["prefill", "decode", "both"]
ROLES: tuple[Role, ...] = get_args(Role)
Mode = Literal["read", "write"]
MODES: tuple[Mode, ...] = get_args(Mode)


def parse_mode(value: object) -> Mode:
    """The transfer mode `value` names, in the user's words (lower case); vLLM's MoRIIO says READ / WRITE on its
    wire, so any case is read. ValueError for anything else."""
    if isinstance(value, str):
        for mode in MODES:
            if value.lower() == mode:
                return mode
    raise ValueError(f"the transfer mode must be {' or '.join(MODES)}, got {value!r}")
