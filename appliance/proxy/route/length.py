"""The prompt's length from an engine, for a connector whose hand-off depends on it where the body does not
settle it (Router.needs_count): the one await of the routing pipeline, made before its pass."""

from __future__ import annotations

import json
from typing import Any

from appliance.proxy.instances import BackendState
from appliance.proxy.upstream import UpstreamError


async def count_tokens(inst: BackendState, request: dict[str, Any] | None, headers: list[tuple[str, str]],
                       timeout: float) -> int | None:
    """The token count `inst`'s /tokenize gives `request` (prompts.tokenize_request's body; None: the request has
    no single prompt); None when it cannot tell (an error, an answer that is not a count): the router then takes
    the way that works for every length."""
    if request is None:
        return None
    payload = json.dumps(request, separators=(",", ":")).encode()
    try:
        conn, head = await inst.pool.open("POST", "/tokenize", headers, payload, collect=True, head_timeout=timeout)
    except UpstreamError:
        return None
    assert conn.done_fut is not None
    try:
        answer = await conn.done_fut
    except UpstreamError:
        return None
    except BaseException:
        conn.abort()
        raise
    inst.pool.release(conn)
    if head.status != 200:
        return None
    try:
        count = json.loads(answer or b"").get("count")
    except (ValueError, AttributeError):
        return None
    return count if isinstance(count, int) else None
