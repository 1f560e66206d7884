"""A small synchronous client for the proxy's admin API (used by `pdctl mode`, `pdctl drain`, rebalance)."""

from __future__ import annotations

import http.client
import json
import socket
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from appliance.errors import PdctlError


class ProxyAdminError(PdctlError):
    """The proxy's admin API could not be reached or refused the request."""


class PortTaken(ProxyAdminError):
    """Another service answers on the proxy's admin port."""


class AdminRefused(ProxyAdminError):
    """The proxy answers but refuses pdctl's admin token (401), or the token file cannot be read."""


class AdminClient:
    """Talks to one proxy's admin API; every method returns the decoded JSON answer."""

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:10002",
        *,
        token: str | None = None,
        token_file: str | None = None,
        timeout: float = 10.0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        if token is None and token_file is not None:
            try:
                token = Path(token_file).read_text().strip()
            except OSError as exc:
                raise AdminRefused(f"cannot read the proxy's admin token {token_file}: {exc.strerror}",
                                   fix="run pdctl as the user that ran `pdctl up` (or root)") from None
        self.token = token
        self.timeout = timeout

    def _call(self, method: str, path: str, body: Any = None, timeout: float | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base_url + path, data=data, method=method)
        if data is not None:
            request.add_header("Content-Type", "application/json")
        if self.token:
            request.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(request, timeout=timeout or self.timeout) as response:
                return json.loads(response.read() or b"null")
        except urllib.error.HTTPError as exc:
            try:
                message = json.loads(exc.read()).get("error", exc.reason)
            except ValueError:
                message = exc.reason
            if exc.code == 401:
                raise AdminRefused(f"proxy admin {path} answered 401: {message}",
                                   fix="the proxy's admin token changed or is missing: run `pdctl up` (it writes "
                                       "one and restarts the proxy)") from None
            raise ProxyAdminError(f"proxy admin {path} answered {exc.code}: {message}") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            if isinstance(reason, TimeoutError) and self._speaks_first():
                raise self._not_the_proxy(path, "it spoke first, as a ZMQ socket does") from None
            raise ProxyAdminError(
                f"cannot reach the proxy admin API at {self.base_url}: {reason}",
                fix="is pd-proxy running? (`pdctl status`)",
            ) from None
        except (http.client.HTTPException, ValueError) as exc:
            raise self._not_the_proxy(path, type(exc).__name__) from None

    def _not_the_proxy(self, path: str, why: str) -> PortTaken:
        # The planner's "port is free" check is advisory (something can bind the port after it): say whose
        # port it is rather than wait on, or misread, another service's answer.
        parts = urllib.parse.urlsplit(self.base_url)
        return PortTaken(
            f"port {parts.port} on {parts.hostname} (proxy.admin_port) is taken by another service: "
            f"{self.base_url}{path} did not answer as the pdctl proxy admin API ({why})",
            fix="stop what holds that port, or set [proxy] admin_port to a free one",
        )

    def _speaks_first(self) -> bool:
        """True when the admin port sends bytes before any request (an HTTP server never does; ZMQ does)."""
        parts = urllib.parse.urlsplit(self.base_url)
        try:
            with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 80), timeout=1) as sock:
                return bool(sock.recv(1))
        except OSError:
            return False

    def state(self) -> dict[str, Any]:
        """Mode, connector and every instance (name, role, url, healthy, draining, in_flight, last_seen)."""
        result: dict[str, Any] = self._call("GET", "/admin/state")
        return result

    def set_mode(self, mode: str) -> dict[str, Any]:
        """Switch the proxy's transfer mode; the answer says whether engines must restart (moriio)."""
        result: dict[str, Any] = self._call("POST", "/admin/mode", {"mode": mode})
        return result

    def drain(self, instance: str, timeout_s: float = 60.0) -> dict[str, Any]:
        """Stop new requests to `instance` and wait until its in-flight ones finish (or timeout_s passes)."""
        result: dict[str, Any] = self._call(
            "POST", "/admin/drain", {"instance": instance, "timeout_s": timeout_s}, timeout=timeout_s + self.timeout
        )
        return result

    def undrain(self, instance: str) -> dict[str, Any]:
        """Let `instance` take new requests again."""
        result: dict[str, Any] = self._call("POST", "/admin/undrain", {"instance": instance})
        return result

    def stopping(self, instance: str, hold_s: float, drain_timeout_s: float, expires_in_s: float,
                 crashed: bool = False) -> dict[str, Any]:
        """A stop of `instance` begins (planned, or `crashed`: its process ended by itself and its manager
        restarts it): drain it (bounded) and hold its role's requests while it is away."""
        body = {"instance": instance, "hold_s": hold_s, "drain_timeout_s": drain_timeout_s,
                "expires_in_s": expires_in_s} | ({"crashed": True} if crashed else {})
        result: dict[str, Any] = self._call("POST", "/admin/stopping", body, timeout=drain_timeout_s + self.timeout)
        return result

    def started(self, instance: str) -> dict[str, Any]:
        """The planned stop of `instance` is over: it takes requests again (once the proxy's probe passes)."""
        result: dict[str, Any] = self._call("POST", "/admin/started", {"instance": instance})
        return result

    def set_instances(self, backends: list[dict[str, Any]]) -> dict[str, Any]:
        """Replace the static backend set (list of Backend dicts); returns the new state."""
        result: dict[str, Any] = self._call("POST", "/admin/instances", backends)
        return result

    def hold(self, wait_s: float, expires_in_s: float = 600.0) -> dict[str, Any]:
        """Let requests wait up to wait_s for a role that has no routable instance (0 ends the hold)."""
        result: dict[str, Any] = self._call("POST", "/admin/hold", {"wait_s": wait_s, "expires_in_s": expires_in_s})
        return result
