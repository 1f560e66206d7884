"""The proxy: OpenAI API in front, engine legs behind, registration listener, health probes, admin API."""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import time
from typing import Any

import zmq
from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage

from appliance.connector import HandoffError, ProxyListener, get_connector
from appliance.proxy import admin
from appliance.proxy.body import INLINE_BYTES, BodyReader, BodyRules
from appliance.proxy.columns import Columns, Queues
from appliance.proxy.config import ProxyConfig
from appliance.proxy.guard import bearer_matches, capped, fit_to_descriptors
from appliance.proxy.kv_events import relay_endpoint
from appliance.proxy.kvstore import KvStoreSweeper
from appliance.proxy.legs import OUTCOME, ROUTE, STAGE, LegFailure, error_response, handle_completion
from appliance.proxy.metrics import CONTENT_TYPE
from appliance.proxy.policies.prefix_affinity import PrefixAffinity
from appliance.proxy.state import ProxyState
from appliance.proxy.tenants import ANONYMOUS, client_salt_problem
from appliance.proxy.workers import Broadcast, Follower, Leader, WorkerRole, node_metrics

log = logging.getLogger("appliance.proxy")

_CHECKED_HEADERS = ("Authorization", "X-Request-Id")
# a client asks for its request's route by sending this header (any value); the answer carries it (docs/bench.md)
ROUTE_HEADER = "x-pdctl-route"
TENANT: web.RequestKey[str] = web.RequestKey("pdctl_tenant", str)  # the API key's name (tenants.py)



# The OpenAI endpoints an engine has but a prefill/decode split cannot serve: what to use instead.
_NOT_SPLIT = {
    "/v1/responses": "the Responses API is not served through the prefill/decode split; "
                     "use /v1/chat/completions or /v1/completions",
}


async def _route_header(request: web.Request, response: web.StreamResponse) -> None:
    # aiohttp calls this as the response's head is about to be sent: the header precedes the body's first byte
    # on every path, streamed, whole or an error after routing. Only a client that asks gets it, about its own
    # request, and the instances only when it sent a key: under prefix affinity (or conditional routing's
    # cached-prefix) the instance a prompt went to says what the instances hold, which a tenant's cache salt
    # keeps to that tenant; clients without keys share one cache (docs/threat-model.md)
    route = request.get(ROUTE)
    if route is None or ROUTE_HEADER not in request.headers:
        return
    keyed = request.get(TENANT, ANONYMOUS) != ANONYMOUS
    response.headers[ROUTE_HEADER] = route if keyed else route.split(";", 1)[0]


@web.middleware
async def _json_route_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Unknown paths and methods answer OpenAI-shaped JSON (clients such as `openai` parse it), not text."""
    try:
        response: web.StreamResponse = await handler(request)
        return response
    except web.HTTPNotFound:
        why = _NOT_SPLIT.get(request.path.rstrip("/"), "no such endpoint; pdctl serves /v1/chat/completions, "
                             "/v1/completions and /v1/models")
        return error_response(404, f"{request.path}: {why}")
    except web.HTTPMethodNotAllowed as exc:
        allowed = ", ".join(sorted(exc.allowed_methods))
        return error_response(405, f"{request.method} {request.path} is not allowed (use {allowed})")


class _OneLineBadRequests(logging.Filter):
    """aiohttp logs each unparsable request (a client's mistake) with a traceback; make it one warning line."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, BadHttpMessage):
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.msg, record.args = "dropped a malformed HTTP request: %s", (" ".join(str(exc).split())[:200],)
            record.exc_info = record.exc_text = None
        return True


class Proxy(ProxyState):
    """One running proxy; `start()` binds every socket, `stop()` closes them."""

    def __init__(self, config: ProxyConfig, listeners: tuple[socket.socket, ...] | None = None,
                 role: WorkerRole | None = None) -> None:
        super().__init__(config)
        # (API, admin) sockets bound by the keeper ((API,) for a worker other than the leader), or None to bind them
        self.listeners = listeners
        self.role = role  # which of several worker processes this is (workers.py); None: the only one
        self.leader = Leader(self, role) if role is not None and role.leader else None
        self.follower = Follower(self, role) if role is not None and not role.leader else None
        self.others = self.leader
        # prefix affinity's records, shared with the other workers (None: this process is the only one)
        self.broadcast: Broadcast | None = None
        if role is not None:
            self.share_loads(Columns(role.peers, role.generation, role.index, config.workers))
            self.router.queues = Queues(role.peers, role.generation)
            if isinstance(self.router.policy, PrefixAffinity):
                self.broadcast = Broadcast(self.router.policy, self.registry, role,
                                           lambda result: self.metrics.prefix_records.labels(result).inc())
            if self.kv_events is not None:
                # the engines' tcp endpoints (DP > 1) are the leader's to bind: it relays them to the others
                self.kv_events.relay = lambda name, rank: relay_endpoint(role.peers, role.generation, name, rank)
                self.kv_events.follows = not role.leader
        self.stopping = False
        self._registration_bind: asyncio.Task[None] | None = None
        self.listener: ProxyListener | None = None
        self._runners: list[web.AppRunner] = []
        self._servers: list[asyncio.AbstractServer] = []
        store = config.kv_store
        self.kv_sweeper = KvStoreSweeper(store, self.metrics.observe_kv_store) if store is not None else None
        self.api_port = config.port
        self.admin_port = config.admin.port
        limits = config.limits
        self.bodies = BodyReader(BodyRules(model=config.model, max_tokens_limit=config.max_tokens_limit,
                                           max_json_depth=limits.max_json_depth,
                                           max_json_values=config.max_json_values, max_n=limits.max_n,
                                           max_model_len=config.max_model_len), limits.large_bodies)

    # lifecycle
    async def start(self, serve: bool = True) -> None:
        """Bind the API, the admin API and (connectors that register) the registration socket; start probing.

        serve=False (a successor taking over the keeper's sockets): the sockets are served by `serve_once_ready`,
        and the registration socket is bound once the proxy before it has released it."""
        server_log = logging.getLogger("aiohttp.server")
        if not any(isinstance(f, _OneLineBadRequests) for f in server_log.filters):
            server_log.addFilter(_OneLineBadRequests())
        api = web.Application(client_max_size=self.config.client_max_size, handler_args={"max_field_size": 16384},
                              middlewares=[_json_route_errors])
        api.on_response_prepare.append(_route_header)
        api.on_response_prepare.append(self._closing_header)
        api.router.add_post("/v1/completions", self._completions)
        api.router.add_post("/v1/chat/completions", self._chat)
        api.router.add_get("/v1/models", self._models)
        api.router.add_get("/health", self._health)
        api.router.add_get("/metrics", self._metrics)
        # handler_cancellation: a client that disconnects cancels its handler, which aborts both legs
        limits = self.config.limits
        # with several workers each takes its share of the node's connections (the kernel spreads them evenly)
        share = limits.max_connections // self.config.workers if self.role is not None else limits.max_connections
        cap = fit_to_descriptors(max(share, 1), "client API")
        self.keep_cap = min(cap, limits.max_kept_prefills)
        api_sock, admin_sock = (*self.listeners, None)[:2] if self.listeners else (None, None)
        self.api_port = await self._serve(api, self.config.host, self.config.port, cap, api_sock, serve)
        if self.broadcast is not None:
            self.broadcast.start()
        if self.follower is not None:
            # the leader alone serves the admin API, registrations, probes and the KV store's bound
            await self.follower.serve()
            self.metrics.loop.start()
            if self.kv_events is not None:
                self.kv_events.start()
            log.info("proxy worker %d on %s:%d", self.follower.role.index, self.config.host, self.api_port)
            return
        self.admin_port = await self._serve(admin.build_app(self), self.config.admin.host, self.config.admin.port,
                                            admin.MAX_CONNECTIONS, admin_sock, serve)
        if self.leader is not None:
            await self.leader.serve()
            self.leader.start()
        if self.admin_token is None:
            # a proxy.json written by hand or by a pdctl before admin tokens (`pdctl up` writes one now)
            log.warning("the admin API on %s:%d has no token (admin.token_file): any local process can replace "
                        "the backends and read every prompt; run `pdctl up`, or set admin.token_file",
                        self.config.admin.host, self.admin_port)
        connector = get_connector(self.config.connector)
        if self.config.registration.enabled and not connector.registers_with_proxy:
            log.warning("registration.enabled is ignored: connector %s's engines do not register", self.config.connector)
        elif self.config.registration.enabled and serve:
            self.listener = self._registration_listener()
            self.listener.start()
        elif self.config.registration.enabled:
            self._registration_bind = asyncio.create_task(self._bind_registration())
        self.health.start()
        self.metrics.loop.start()
        if self.kv_events is not None:
            self.kv_events.start()
        if self.kv_sweeper is not None:
            self.kv_sweeper.start()
        log.info(
            "proxy on %s:%d (admin %s:%d), connector %s, mode %s, %d static backends",
            self.config.host, self.api_port, self.config.admin.host, self.admin_port,
            self.config.connector, self.mode, len(self.config.backends),
        )

    def _registration_listener(self) -> ProxyListener:
        """The connector's registration socket (one whose engines register with the proxy), not yet bound."""
        listener = get_connector(self.config.connector).registration_listener(
            self.config.registration,
            self.registry.find_by_address,
            lambda: self.mode,
            lambda result: self.metrics.registrations.labels(result).inc(),
        )
        if listener is None:
            raise TypeError(f"connector {self.config.connector} registers_with_proxy but has no registration_listener")
        return listener

    async def _bind_registration(self) -> None:
        """Bind the registration socket as soon as the proxy this one takes over from has released it."""
        while True:
            listener = self._registration_listener()
            try:
                listener.start()
            except zmq.ZMQError as exc:
                await listener.stop()
                if exc.errno != errno.EADDRINUSE:
                    raise
                await asyncio.sleep(0.1)
                continue
            self.listener = listener
            log.info("registration socket bound on port %d", listener.port)
            return

    async def serve_once_ready(self, wait_s: float) -> None:
        """Start serving the sockets once the engines answer (or after wait_s): a successor that served at once
        would answer 503 until its first health probes passed, while the proxy before it could still serve."""
        deadline = time.monotonic() + wait_s
        while not self._takes_over() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for server in self._servers:
            await server.start_serving()

    def client_connections(self) -> int:
        """Open client API connections of this process (the API's runner is the first)."""
        server = self._runners[0].server if self._runners else None
        return len(server.connections) if server is not None else 0

    def _takes_over(self) -> bool:
        """A successor serves once its engines answer and, as a worker other than the leader, once it has the
        leader's control state (a drain or hold set since the plan)."""
        synced = self.follower is None or self.follower.synced.is_set()
        return synced and self.ready()[0]

    async def _serve(self, app: web.Application, host: str, port: int, max_connections: int,
                     sock: socket.socket | None, serve: bool) -> int:
        # keepalive_timeout: aiohttp closes a connection that has no complete request head this long after it
        # opened or after its last answer (slow heads and idle sockets alike); shutdown_timeout: how long a
        # stopping proxy lets its requests finish
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                               keepalive_timeout=self.config.limits.idle_timeout_s,
                               shutdown_timeout=self.config.limits.stop_drain_s)
        await runner.setup()
        assert runner.server is not None
        # our own listener instead of web.TCPSite: its protocol factory answers 503 past the connection cap
        loop = asyncio.get_running_loop()
        factory = capped(runner.server, max_connections)
        if sock is None:
            server = await loop.create_server(factory, host, port, backlog=1024, reuse_address=True,
                                              start_serving=serve)
        else:
            server = await loop.create_server(factory, sock=sock, backlog=1024, start_serving=serve)
        self._runners.append(runner)
        self._servers.append(server)
        return int(server.sockets[0].getsockname()[1])

    async def stop(self, retire: bool = False) -> None:
        """Stop accepting, let the requests in flight finish (limits.stop_drain_s), close every socket and pool.

        retire (under the keeper, whose listening sockets outlive this proxy): a kept-alive client connection is
        closed only after an answer that says so, or when it has been idle for limits.idle_timeout_s, as it
        would be anyway; never while the client may be sending its next request on it."""
        self.stopping = True
        for worker in (self.follower, self.leader):
            if worker is not None:
                await worker.close()
        if self.broadcast is not None:
            self.broadcast.close()
        if self._registration_bind is not None:
            self._registration_bind.cancel()
        if self.listener is not None:
            await self.listener.stop()  # the successor binds it
        for server in self._servers:
            server.close()
        deadline = time.monotonic() + self.config.limits.stop_drain_s
        if retire:
            await self._connections_closed(deadline)
        await self.health.stop()
        await self.metrics.loop.stop()
        if self.kv_sweeper is not None:
            await self.kv_sweeper.stop()
        await self.planned.close()
        if self.kv_events is not None:
            self.kv_events.close()
        for runner in reversed(self._runners):
            if runner.server is not None:
                # what is left: requests in flight get the rest of the drain, idle connections close now
                await runner.server.shutdown(max(deadline - time.monotonic(), 0.0))
            await runner.cleanup()
        self._runners.clear()
        await self._finish_after_clients(deadline)
        self._servers.clear()
        self.bodies.close()
        await self.registry.close()

    async def _connections_closed(self, deadline: float) -> None:
        """Until the deadline, while any client connection is open: each closes after its next answer (which
        says `Connection: close`), when its client closes it, or at its idle timeout (aiohttp's keep-alive)."""
        while time.monotonic() < deadline and any(r.server is not None and r.server.connections
                                                  for r in self._runners):
            await asyncio.sleep(0.05)

    async def _finish_after_clients(self, deadline: float) -> None:
        # kept prefill legs and releases outlive their clients' requests: they get what is left of the drain
        # time, then the kept legs are aborted (vLLM frees a prefill that is still computing) and nothing is left
        while (work := self.kept | self.releases) and (left := deadline - time.monotonic()) > 0:
            await asyncio.wait(work, timeout=left, return_when=asyncio.FIRST_COMPLETED)
        while work := self.kept | self.releases:
            for task in work:
                task.cancel()
            await asyncio.wait(work)

    async def _closing_header(self, request: web.Request, response: web.StreamResponse) -> None:
        # A stopping proxy closes each client connection after its answer (aiohttp's shutdown): an answer whose
        # head is still to be sent says so, so that the client's next request opens a new connection (to the
        # proxy taking over) rather than fail on this one. A stream whose head went out before cannot say it.
        if self.stopping:
            response.force_close()
            response.headers["Connection"] = "close"

    # handlers
    def _unauthorized(self, request: web.Request) -> web.Response | None:
        tenant = self.tenants.identify(request.headers.get("Authorization"))
        if tenant is not None:
            request[TENANT] = tenant
            return None
        return error_response(401, "missing or wrong API key: send 'Authorization: Bearer <key>'")

    async def _models(self, request: web.Request) -> web.Response:
        if (denied := self._unauthorized(request)) is not None:
            return denied
        return web.json_response(
            {
                "object": "list",
                "data": [{"id": self.config.model, "object": "model", "created": int(self.started_at), "owned_by": "pdctl",
                          **_context_card(self.config.max_model_len)}],
            }
        )

    async def _health(self, request: web.Request) -> web.Response:
        ok, counts = self.ready()
        body: dict[str, Any] = {"status": "ok" if ok else "not ready", "mode": self.mode,
                                "connector": self.config.connector, "healthy": counts}
        if not ok:
            # A role with no instance in rotation may still be served by its stand-in (panic routing: out for
            # silence alone): the node serves, so a load balancer in front must keep sending to it; it says so.
            needed = ("prefill", "decode") if self.connector.disaggregated else ("both",)
            missing = [r for r in needed if not counts.get(r)]
            stand_ins = {r: self.router.stand_in(r) for r in missing}
            if all(stand_ins.values()):
                body["status"] = "degraded"
                body["stand_in"] = {r: inst.name for r, inst in stand_ins.items() if inst is not None}
                return web.json_response(body, status=200)
        return web.json_response(body, status=200 if ok else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        # the counters say what every client's requests did (prefix hits among them): the node's token only,
        # never an API key; without a token, open only while every client is the one tenant (no API key)
        token = self.metrics_token
        if token is None and self.tenants.required:
            return error_response(403, "/metrics needs the proxy's metrics_token_file, which is not set")
        if token is not None and not bearer_matches(request.headers.get("Authorization"), token):
            return error_response(401, "missing or wrong metrics token: send 'Authorization: Bearer <token>'")
        body = self.metrics.render() if self.role is None else await node_metrics(self, self.role)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "/v1/completions", chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "/v1/chat/completions", chat=True)

    async def _generate(self, request: web.Request, path: str, chat: bool) -> web.StreamResponse:
        mode_label = self.mode if self.connector.disaggregated else "colocated"
        status: str = "500"
        try:
            if (denied := self._unauthorized(request)) is not None:
                status = "401"
                return denied
            body, problem = await self._read_body(request, chat)
            if problem is not None:
                status = str(problem.status)
                return problem
            assert body is not None
            if (problem := self._salt(request, body)) is not None:
                status = "400"
                return problem
            if self.hold_wait() > 0:
                await self.wait_for_instances()
            response = await handle_completion(self, request, path, body)
            status = request.get(OUTCOME, str(response.status))
            return response
        except HandoffError as exc:
            status = str(exc.status)
            return _failure_response(exc)
        except asyncio.CancelledError:
            status = "client_abort"
            self.metrics.client_aborts.labels(request.get(STAGE, "body")).inc()
            raise
        except ConnectionResetError as exc:
            # a client going away is normal (a cut stream, a closed tab): counted, one debug line, no traceback
            status = "client_abort"
            self.metrics.client_aborts.labels(request.get(STAGE, "body")).inc()
            log.debug("client %s left %s (%s): %s", request.remote, path, request.get(STAGE, "body"), exc)
            return _client_left(request)
        except Exception:
            log.exception("unexpected error while proxying %s", path)
            return error_response(500, "internal proxy error (see the proxy log)")
        finally:
            self.metrics.requests.labels(status, mode_label).inc()

    def _salt(self, request: web.Request, body: dict[str, Any]) -> web.Response | None:
        """Give the request its tenant's cache salt (combined with the client's own, if any), before it is
        routed: the engines and the proxy's prefix affinity both key on it."""
        given = body.get("cache_salt")
        if (why := client_salt_problem(given)) is not None:
            return error_response(400, why)
        salt = self.tenants.salt(request[TENANT], given)
        if salt is not None:
            body["cache_salt"] = salt
        return None

    async def _read_body(self, request: web.Request, chat: bool) -> tuple[dict[str, Any] | None, web.Response | None]:
        for name in _CHECKED_HEADERS:
            value = request.headers.get(name)
            # X-Request-Id is forwarded to the engines as latin-1 HTTP: only printable ASCII can cross safely
            if value is not None and (not value.isascii() or not value.isprintable() or len(value) > 1024):
                return None, error_response(400, f"header {name} must be printable ASCII of at most 1024 characters")
        limits = self.config.limits
        size = request.content_length
        if size is not None and size > self.config.client_max_size:
            return None, error_response(413, f"request body is larger than {self.config.client_max_size} bytes")
        if size is not None and size <= INLINE_BYTES:
            return await self._checked(request, chat)
        # a large (or chunked, of unknown size) body waits for one of a bounded number of turns before it is
        # read: the memory large bodies hold at once is bounded, and so is the worker's queue
        try:
            await asyncio.wait_for(self.bodies.slots.acquire(), limits.body_timeout_s)
        except asyncio.TimeoutError:
            busy = error_response(503, f"the proxy is reading {limits.large_bodies} large request bodies; retry shortly")
            busy.force_close()
            return None, busy
        try:
            return await self._checked(request, chat)
        finally:
            self.bodies.slots.release()

    async def _checked(self, request: web.Request, chat: bool) -> tuple[dict[str, Any] | None, web.Response | None]:
        limits = self.config.limits
        try:
            raw = await asyncio.wait_for(request.read(), limits.body_timeout_s)
        except web.HTTPRequestEntityTooLarge:
            return None, error_response(413, f"request body is larger than {self.config.client_max_size} bytes")
        except asyncio.TimeoutError:
            slow = error_response(408, f"the request body did not arrive within {limits.body_timeout_s:g}s")
            slow.force_close()
            return None, slow
        request[STAGE] = "answer"
        checked, in_worker = await self.bodies.parse(raw, chat)
        self.metrics.bodies.labels("worker" if in_worker else "loop").inc()
        if isinstance(checked, tuple):
            return None, error_response(*checked)
        return checked, None


def _context_card(max_model_len: int | None) -> dict[str, int]:
    """The context the plan serves, as vLLM's model card says it (clients such as `pdctl bench` size prompts by it)."""
    return {} if max_model_len is None else {"max_model_len": max_model_len}


def _client_left(request: web.Request) -> web.Response:
    """The handler's answer once the client has gone: the connection is closed, so aiohttp sends nothing."""
    if request.transport is not None:
        request.transport.abort()
    return web.Response(status=499)


def _failure_response(exc: HandoffError) -> web.Response:
    """The client's answer for a failed leg; an engine's own 4xx body is passed on with its content type.

    The engine's header value may carry parameters ("application/json; charset=utf-8"), which aiohttp refuses
    in content_type=, so it goes in as a header as it is.
    """
    if isinstance(exc, LegFailure) and exc.body is not None:
        return web.Response(status=exc.status, body=exc.body,
                            headers={"Content-Type": exc.content_type or "application/json"})
    return error_response(exc.status, exc.message)
