"""The proxy's door: bearer-secret checks, JSON nesting bounded before parsing, and capped listeners."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import resource
from collections.abc import Callable
from typing import Any

from aiohttp import web

log = logging.getLogger("appliance.proxy")

# A JSON string, or what is left of the text after an unterminated one. It matches at every quote it is tried
# at, so re.sub's scan goes on after the match and never starts over inside it: one pass over the text. A
# pattern that can fail there (an unterminated string) is retried at each later quote: quadratic (issue 36).
STRING = re.compile(rb'"[^"\\]*(?:\\[\s\S][^"\\]*)*(?:"|\\?\Z)')
# keep only brackets, and make every { a [ and every } a ]: nesting depth does not depend on the kind
_SQUARE = bytes.maketrans(b"{}", b"[]")
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
_OPENERS = bytes(b for b in range(256) if b not in b"[{")
# a \u escape of a surrogate (U+D800-U+DFFF): a body may hold a lone one only where this occurs
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
# Descriptors one client connection can hold at once: its socket, a prefill leg and a decode leg.
_FDS_PER_CONNECTION = 3
_FD_RESERVE = 128  # listeners, the ZMQ socket, health probes, log files, refused connections still lingering


def bearer_matches(header: str | None, secret: str) -> bool:
    """True when an Authorization header is `Bearer <secret>`; compared in constant time.

    aiohttp hands header bytes that are not UTF-8 over as surrogate escapes: they are encoded back to the
    bytes the client sent, which then simply do not match (a 401, never an encoding error).
    """
    scheme, _, given = (header or "").partition(" ")
    try:
        sent = given.strip().encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return False
    return scheme.lower() == "bearer" and hmac.compare_digest(sent, secret.encode())


def json_too_deep(raw: bytes, limit: int) -> bool:
    """True when the JSON text nests arrays/objects more than `limit` deep; decided without parsing it.

    Strings are cut out and the rest reduced to brackets; each pass of bytes.replace then removes the
    innermost pairs, one level, all in C: a body of few brackets costs one translate() whatever its size.
    Unbalanced text is left to the parser, which says what is wrong with it.
    """
    if len(raw.translate(None, _OPENERS)) <= limit:
        return False
    brackets = STRING.sub(b"", raw).translate(_SQUARE, _NOT_BRACKET)
    if b"[" * (limit + 1) in brackets:
        return True
    for _ in range(limit):
        shorter = brackets.replace(b"[]", b"")
        if not shorter or len(shorter) == len(brackets):
            return False
        brackets = shorter
    return True


def lone_surrogate(raw: bytes, value: Any) -> bool:
    """Whether the JSON text `raw`, parsed as `value`, holds a string (a key too) with a lone surrogate: json
    takes `"\\ud800"`, but no UTF-8 encoder does, and the proxy (routing, metrics labels) and the engines encode
    what they get. Most bodies have no surrogate escape at all, which one search of the raw bytes tells."""
    if _SURROGATE_ESCAPE.search(raw) is None:
        return False
    try:
        json.dumps(value, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return True
    return False


_BUSY_BODY = json.dumps({"error": {"message": "the proxy has too many open connections; retry shortly",
                                   "type": "ServiceUnavailable", "code": 503}}).encode()
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
         b"Connection: close\r\nContent-Length: %d\r\n\r\n%b" % (len(_BUSY_BODY), _BUSY_BODY))


class _Refused(asyncio.Protocol):
    """A connection over the cap: answered 503 at once; closed once the client's request is read (then the
    503 is followed by a FIN, not a reset that could drop it), after 1 s, or at once when many linger."""

    lingering = 0  # refused connections still open, across the process
    MAX_LINGERING = 64

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.Transport = transport  # type: ignore[assignment]
        self.transport.write(_BUSY)
        self.timer: asyncio.TimerHandle | None = None
        if _Refused.lingering >= _Refused.MAX_LINGERING:
            self.transport.close()
            return
        _Refused.lingering += 1
        self.timer = asyncio.get_running_loop().call_later(1.0, self.transport.close)

    def data_received(self, data: bytes) -> None:
        self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
            _Refused.lingering -= 1


def capped(server: web.Server, max_connections: int) -> Callable[[], asyncio.BaseProtocol]:
    """A protocol factory that serves through `server` until it holds max_connections, then refuses with 503."""

    def factory() -> asyncio.BaseProtocol:
        if len(server.connections) >= max_connections:
            return _Refused()
        return server()

    return factory


def fit_to_descriptors(max_connections: int, what: str) -> int:
    """The connection cap this process can honour: raises RLIMIT_NOFILE towards what the cap needs, or
    lowers the cap (with a warning) so a full house still leaves descriptors for the engine legs."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = _FDS_PER_CONNECTION * max_connections + _FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < need:
        raised = need if hard == resource.RLIM_INFINITY else min(need, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
        soft = raised
    if soft != resource.RLIM_INFINITY and soft < need:
        fitted = max(1, (soft - _FD_RESERVE) // _FDS_PER_CONNECTION)
        log.warning("%s: max_connections %d needs %d file descriptors, the limit is %d: serving at most %d "
                    "connections (raise LimitNOFILE)", what, max_connections, need, soft, fitted)
        return fitted
    return max_connections
