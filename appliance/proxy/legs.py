"""The request flows: colocated (one leg), READ (prefill, then decode) and WRITE (both at once, supervised)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from typing import Any, cast

from aiohttp import HttpVersion11, web

from appliance.connector import HandoffError, ProxySide
from appliance.proxy.continuation import CONTINUE_PATH, Tracker, continuation_body, plan
from appliance.proxy.instances import BackendState, Booking, Lease
from appliance.proxy.policies import RequestFacts
from appliance.proxy.prompts import tokenize_request
from appliance.proxy.route import Refused, Route, Unroutable
from appliance.proxy.route.length import count_tokens
from appliance.proxy.state import ProxyState
from appliance.proxy.upstream import Connection, Unchunked, UpstreamError

log = logging.getLogger("appliance.proxy.legs")

# how a request ended when its HTTP status does not say it (a stream that ended with an error event)
OUTCOME: web.RequestKey[str] = web.RequestKey("pdctl_outcome", str)
# how far a request got, for counting where clients leave: body, answer, stream, end (pdctl_proxy_client_aborts)
STAGE: web.RequestKey[str] = web.RequestKey("pdctl_stage", str)
# the route a request took, as its x-pdctl-route response header says it (docs/bench.md, "Routes")
ROUTE: web.RequestKey[str] = web.RequestKey("pdctl_route", str)
# a streamed request's tokens as relayed, for a continuation should its engine leg die (continuation.py)
CONTINUE: web.RequestKey[Tracker] = web.RequestKey("pdctl_continue", Tracker)
# the engines' headers of a request (their key), for the legs of a continuation
HEADERS: web.RequestKey[list[tuple[str, str]]] = web.RequestKey("pdctl_headers", list)
# the route a request was served on (its bookings), which a stream cut and continued elsewhere lets go of
BOOKED: web.RequestKey[Route] = web.RequestKey("pdctl_booked", Route)

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    408: "BadRequestError",
    413: "BadRequestError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


def error_payload(status: int, message: str) -> dict[str, Any]:
    """The OpenAI-style error object."""
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "APIError"), "code": status}}


def error_response(status: int, message: str) -> web.Response:
    """A JSON error response in the OpenAI shape."""
    return web.json_response(error_payload(status, message), status=status)


def _engine_message(answer: bytes) -> str:
    """The message of an engine's error answer (OpenAI-shaped JSON), or its first bytes."""
    try:
        doc = json.loads(answer)
        error = doc.get("error", doc) if isinstance(doc, dict) else doc
        message = error.get("message") if isinstance(error, dict) else None
        return str(message if message is not None else error)[:300]
    except (ValueError, UnicodeDecodeError):
        return answer[:300].decode("utf-8", "replace")


class LegFailure(HandoffError):
    """A leg failed in a way the client should hear about as `status` with `message`."""

    def __init__(self, status: int, message: str, body: bytes | None = None, content_type: str | None = None) -> None:
        super().__init__(status, message)
        self.body = body  # an engine's own 4xx answer, passed through as it is
        self.content_type = content_type
        self.inst: BackendState | None = None  # the instance whose leg failed, where a caller says which


class EngineLost(LegFailure):
    """A leg whose engine could not be reached or closed its connection before its answer began (a prefill that died
    before its hand-off, a decode before its first token): the client has had nothing, so the request can run again
    elsewhere."""

    def __init__(self, role: str, inst: BackendState, failure: LegFailure) -> None:
        super().__init__(failure.status, failure.message)
        self.role = role
        self.lost = self.inst = inst


class EngineError(LegFailure):
    """A decode leg whose engine ended its stream with an error event after tokens (vLLM does so for its streams
    when its engine core dies, then exits): a cut, continued where the stream can be."""

    reason = "engine_error"

    def __init__(self, inst: BackendState, error: dict[str, Any]) -> None:
        detail = error.get("error")
        message = detail.get("message") if isinstance(detail, dict) else detail
        super().__init__(502, f"decode leg on {inst.name} ended with an error: {str(message)[:300]}")


def leg_lost(leg: str, inst: BackendState, exc: UpstreamError) -> LegFailure:
    """The client's error for a leg whose engine's connection failed before its answer began: EngineLost where the
    engine is gone (refused, reset), which a new route may serve."""
    failure = upstream_failure(leg, inst, exc)
    if exc.reason in ("connect", "reset") and not exc.timed_out:
        return EngineLost(leg, inst, failure)
    return failure


def upstream_failure(leg: str, inst: BackendState, exc: Exception) -> LegFailure:
    """The client's error for a leg the engine's connection failed; says so when the instance is being restarted."""
    if inst.stopping:
        return LegFailure(503, f"{leg} instance {inst.name} was stopped for a restart before it finished this "
                               f"request ({exc}); send the request again")
    return LegFailure(502, f"{leg} leg on {inst.name} failed: {exc}")


def _content_type(conn: Connection) -> str:
    assert conn.head is not None
    return conn.head.headers.get("content-type", "application/json").split(";")[0].strip() or "application/json"


async def _race(fut: asyncio.Future[Any], supervisor: asyncio.Task[Any] | None, timeout: float) -> Any:
    """Await `fut` for at most `timeout`; if the supervising prefill task fails first, raise its error."""
    if supervisor is None or supervisor.done() and supervisor.exception() is None:
        return await asyncio.wait_for(asyncio.shield(fut), timeout)
    deadline = time.monotonic() + timeout
    if not supervisor.done():
        done, _ = await asyncio.wait((fut, supervisor), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if not done:
            raise asyncio.TimeoutError
        if fut in done:
            return fut.result()
    exc = supervisor.exception()
    if exc is not None:
        raise exc
    return await asyncio.wait_for(asyncio.shield(fut), max(0.0, deadline - time.monotonic()))


class Relay:
    """Watches a decode leg whose chunks the engine connection relays to the client by itself."""

    __slots__ = ("proxy", "conn", "inst", "error", "finished", "timer", "loop")

    def __init__(self, proxy: ProxyState, conn: Connection, inst: BackendState) -> None:
        self.proxy = proxy
        self.conn = conn
        self.inst = inst
        self.error: Exception | None = None
        self.finished = False
        self.loop = asyncio.get_running_loop()
        self.timer: asyncio.TimerHandle | None = None

    def start_watchdog(self) -> None:
        self.timer = self.loop.call_later(self.proxy.config.timeouts.between_tokens_s, self._watch)

    def _watch(self) -> None:
        if self.finished:
            return
        limit = self.proxy.config.timeouts.between_tokens_s
        idle = time.monotonic() - self.conn.last_rx
        if self.conn.paused or idle < limit:
            self.timer = self.loop.call_later(max(limit - idle, 0.01), self._watch)
            return
        self.fail(LegFailure(504, f"decode instance {self.inst.name} sent no token for {limit:g}s"))

    def client_gone(self, exc: Exception) -> None:
        """The client's transport refused a write: end the relay (the connection aborts the engine leg)."""
        self.fail(ConnectionResetError(f"client went away: {exc}"))

    def fail(self, exc: Exception) -> None:
        """End the relay with an error (supervisor, watchdog, client gone): aborts the engine leg."""
        if self.finished or self.error is not None:
            return
        self.error = exc
        self.conn.abort()

    def stop(self) -> None:
        self.finished = True
        if self.timer is not None:
            self.timer.cancel()


async def run_prefill(
    proxy: ProxyState, inst: BackendState, rank: int | None, path: str, body: dict[str, Any],
    headers: list[tuple[str, str]], abandoned: Callable[[dict[str, Any]], None] | None = None,
) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """The prefill leg, bounded by timeouts.prefill_s; returns the engine's kv_transfer_params and its answer.
    `abandoned` (given where the connector can release them: Handoff.releases) gets the KV's parameters when the
    leg answered but its request was cancelled (client gone); a leg still waiting for its answer then is kept
    until it comes."""
    limit = proxy.config.timeouts.prefill_s
    until = time.monotonic() + limit
    # a task of our own rather than asyncio.wait_for's: when this leg is cancelled while the engine's answer
    # is failing it, the failure is still retrieved (no "Task exception was never retrieved" traceback)
    leg = asyncio.ensure_future(_prefill(proxy, inst, rank, path, body, headers, abandoned))
    leg.add_done_callback(_retrieve)
    kept = False
    try:
        done, _ = await asyncio.wait((leg,), timeout=limit)
    except asyncio.CancelledError:
        if abandoned is not None and leg.done() and not leg.cancelled() and leg.exception() is None:
            kv = leg.result()[0]
            if kv:
                abandoned(kv)
        elif abandoned is not None and not leg.done():
            # vLLM frees a prefill it is still computing when its leg is aborted, but not one it has finished
            # and whose answer is on its way (the blocks wait for a decode or the lease), and the proxy cannot
            # tell the two apart: it reads the answer, whose kv_transfer_params the release needs
            kept = keep_prefill(proxy, inst, leg, until, abandoned)
        raise
    finally:
        if not leg.done() and not kept:
            leg.cancel()
            await asyncio.wait((leg,))  # its clean-up (abort the engine leg, release the counts) runs first
    if not done:
        proxy.metrics.leg_failures.labels("prefill", "timeout").inc()
        proxy.health.leg_failed(inst, timed_out=True)
        raise LegFailure(504, f"prefill on {inst.name} did not finish within {limit:g}s")
    return leg.result()


def keep_prefill(proxy: ProxyState, inst: BackendState, leg: asyncio.Future[Any], until: float,
                 abandoned: Callable[[dict[str, Any]], None]) -> bool:
    """Read a prefill leg whose client left to its end (at most until `until`, monotonic) and hand its KV to
    `abandoned`; False, and the leg is to be aborted, when proxy.keep_cap legs are kept already."""
    if len(proxy.kept) >= proxy.keep_cap:
        proxy.metrics.kept_prefills.labels("over_cap").inc()
        return False
    booking = inst.book()  # a drain of the prefill instance waits for the leg, as it did for its request
    task = asyncio.get_running_loop().create_task(_keep(proxy, booking, leg, until, abandoned))
    proxy.kept.add(task)
    task.add_done_callback(proxy.kept.discard)
    return True


async def _keep(proxy: ProxyState, booking: Booking, leg: asyncio.Future[Any], until: float,
                abandoned: Callable[[dict[str, Any]], None]) -> None:
    inst = booking.inst
    outcome = "stopped"  # cancelled: the proxy is stopping
    try:
        done, _ = await asyncio.wait((leg,), timeout=max(0.0, until - time.monotonic()))
        if not done:
            outcome = "timeout"
            proxy.metrics.leg_failures.labels("prefill", "timeout").inc()
            proxy.health.leg_failed(inst, timed_out=True)
        elif leg.cancelled() or leg.exception() is not None:
            outcome = "failed"  # counted by the leg itself
        else:
            outcome = "answered"
            kv = leg.result()[0]
            if kv:
                abandoned(kv)
    finally:
        if not leg.done():
            leg.cancel()
            await asyncio.wait((leg,))  # the leg aborts its engine connection and releases its counts
        booking.end()
        proxy.metrics.kept_prefills.labels(outcome).inc()


def _retrieve(task: asyncio.Future[Any]) -> None:
    # the failure is reported through the client's answer; retrieving it here keeps asyncio from logging it
    if not task.cancelled():
        task.exception()


async def _prefill(
    proxy: ProxyState, inst: BackendState, rank: int | None, path: str, body: dict[str, Any],
    headers: list[tuple[str, str]], abandoned: Callable[[dict[str, Any]], None] | None,
) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    with inst.lease(rank):
        conn: Connection | None = None
        try:
            if rank is not None:
                headers = [*headers, ("X-data-parallel-rank", str(rank))]
            payload = json.dumps(body, separators=(",", ":")).encode()
            conn, head = await inst.pool.open(
                "POST", path, headers, payload, collect=True, head_timeout=proxy.config.timeouts.prefill_s
            )
            assert conn.done_fut is not None
            answer = await asyncio.shield(conn.done_fut)
            inst.pool.release(conn)
            conn = None
            if head.status != 200:
                if 400 <= head.status < 500:
                    # the engine rejected the client's request (prompt too long, bad parameter): say so as it is
                    raise LegFailure(head.status, "engine rejected the request", answer, head.headers.get("content-type"))
                # An answer, even a 5xx, shows the engine is up; what made it fail may be this request's content,
                # so it does not count toward ejection (docs/threat-model.md: the ejection rule).
                proxy.metrics.leg_failures.labels("prefill", "status").inc()
                snippet = (answer or b"")[:200].decode("utf-8", "replace")
                raise LegFailure(502, f"prefill instance {inst.name} answered {head.status}: {snippet}")
            try:
                data = json.loads(answer or b"")
            except ValueError:
                proxy.metrics.leg_failures.labels("prefill", "protocol").inc()
                raise LegFailure(502, f"prefill instance {inst.name} returned invalid JSON") from None
            if not isinstance(data, dict):
                proxy.metrics.leg_failures.labels("prefill", "protocol").inc()
                raise LegFailure(502, f"prefill instance {inst.name} returned no JSON object")
            proxy.health.leg_ok(inst)
            kv = data.get("kv_transfer_params")
            return (kv if isinstance(kv, dict) else None), data
        except UpstreamError as exc:
            proxy.metrics.leg_failures.labels("prefill", exc.reason).inc()
            proxy.health.leg_failed(inst, exc.timed_out)
            raise leg_lost("prefill", inst, exc) from None
        except asyncio.CancelledError:
            if conn is not None:
                # the engine's answer may have come in while this leg was being cancelled: its KV is held all the same
                done = conn.done_fut
                if abandoned is not None and done is not None and done.done() and not done.cancelled() \
                        and done.exception() is None:
                    kv = _kv_of(done.result())
                    if kv:
                        abandoned(kv)
                conn.abort()
            raise
        except BaseException:
            if conn is not None:
                conn.abort()
            raise


def _kv_of(answer: bytes | None) -> dict[str, Any] | None:
    """The kv_transfer_params of a prefill engine's answer, if it is a JSON object that has them."""
    try:
        data = json.loads(answer or b"")
    except ValueError:
        return None
    kv = data.get("kv_transfer_params") if isinstance(data, dict) else None
    return kv if isinstance(kv, dict) else None


def _sse_error(status: int, message: str) -> bytes:
    event = b"data: " + json.dumps(error_payload(status, message)).encode() + b"\n\n"
    return b"%x\r\n%b\r\n" % (len(event), event)


def _leg_failed(proxy: ProxyState, inst: BackendState, reason: str, eject: bool = True, timed_out: bool = False) -> None:
    """Count a failed decode leg by reason and (unless the engine answered for itself) toward ejection;
    `timed_out`: it got no answer in time, rather than refused, reset or broken."""
    proxy.metrics.leg_failures.labels("decode", reason).inc()
    if eject:
        proxy.health.leg_failed(inst, timed_out)


async def run_decode(
    proxy: ProxyState,
    request: web.Request,
    inst: BackendState,
    rank: int | None,
    path: str,
    body: dict[str, Any],
    headers: list[tuple[str, str]],
    started: float,
    supervisor: asyncio.Task[Any] | None = None,
    unsent: Callable[[], None] | None = None,
) -> web.StreamResponse:
    """The decode (or colocated) leg: answers the client, streaming or not. `unsent` is called when the leg
    is cancelled (client gone) before it was sent to the engine."""
    stream = body.get("stream") is True
    with inst.lease(rank) as lease:
        conn: Connection | None = None
        try:
            if rank is not None:
                headers = [*headers, ("X-data-parallel-rank", str(rank))]
            payload = json.dumps(body, separators=(",", ":")).encode()
            try:
                conn = await inst.pool.send("POST", path, headers, payload, collect=not stream)
            except UpstreamError as exc:
                _leg_failed(proxy, inst, exc.reason, timed_out=exc.timed_out)
                raise leg_lost("decode", inst, exc) from None
            whole = await _first_answer(proxy, inst, conn, stream, supervisor)
            if whole is not None:
                return whole
            return await _relay_stream(proxy, request, inst, conn, started, supervisor, lease)
        except asyncio.CancelledError:
            if conn is not None:
                conn.abort()
            elif unsent is not None:
                unsent()
            raise
        except BaseException:
            if conn is not None:
                conn.abort()
            raise


async def _first_answer(
    proxy: ProxyState, inst: BackendState, conn: Connection, stream: bool, supervisor: asyncio.Task[Any] | None
) -> web.Response | None:
    """Wait for the engine's answer head: a whole answer (not streamed, or an error) as the client's response,
    or None once the first streamed token has come."""
    timeouts = proxy.config.timeouts
    assert conn.head_fut is not None and conn.first_fut is not None and conn.done_fut is not None
    try:
        head = await _race(conn.head_fut, supervisor, timeouts.first_token_s)
        if head.status != 200 or not stream:
            answer = await _race(conn.done_fut, supervisor, timeouts.first_token_s)
            inst.pool.release(conn)
            if head.status >= 500:
                # not counted toward ejection: see the prefill leg
                _leg_failed(proxy, inst, "status", eject=False)
                if head.status not in (503, 504):
                    # An engine's internal error (e.g. a KV handoff that timed out) is a bad gateway from
                    # the client's side: a 500 from the proxy would read as a proxy bug. 503/504 keep
                    # their meaning (overloaded, timed out) and pass through; the engine's words stay.
                    message = _engine_message(answer)
                    raise LegFailure(502, f"decode leg on {inst.name} answered {head.status}: {message}")
            else:
                proxy.health.leg_ok(inst)
            return web.Response(status=head.status, body=answer, content_type=_content_type(conn))
        await _race(conn.first_fut, supervisor, timeouts.first_token_s)
        return None
    except asyncio.TimeoutError:
        _leg_failed(proxy, inst, "timeout", timed_out=True)
        raise LegFailure(504, f"decode on {inst.name} sent no token within {timeouts.first_token_s:g}s") from None
    except UpstreamError as exc:
        _leg_failed(proxy, inst, exc.reason, timed_out=exc.timed_out)
        raise leg_lost("decode", inst, exc) from None


async def _relay_stream(
    proxy: ProxyState,
    request: web.Request,
    inst: BackendState,
    conn: Connection,
    started: float,
    supervisor: asyncio.Task[Any] | None,
    lease: Lease,
) -> web.StreamResponse:
    """Relay the engine's stream to the client until it ends; a failure mid-stream continues it on another leg
    where it can be (continuation.py), and ends it with an error event where not. `lease`: the first leg's."""
    assert conn.done_fut is not None
    response = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    # HTTP/1.0 has no chunked encoding: its stream goes out unframed and ends when the connection closes, also
    # for a client that asked for keep-alive (aiohttp would leave that connection open: the stream never ends)
    http10 = request.version < HttpVersion11
    if http10:
        response.force_close()
    else:
        response.enable_chunked_encoding()
    await response.prepare(request)
    request[STAGE] = "stream"
    transport = request.transport
    if transport is None:
        raise ConnectionResetError("client went away")
    out = Unchunked(transport.write).write if http10 else transport.write
    tracker = request.get(CONTINUE)
    if tracker is not None and tracker.why is not None:
        tracker = None  # relayed as it comes; a cut ends it (counted by why)
    first = conn
    # what the leg streaming now holds: its lease and its route's bookings, let go of when it is cut and continued
    booked = request.get(BOOKED)
    held: list[Lease | Booking] = [lease, *(booked.bookings if booked is not None else ())]
    proxy.metrics.ttft.observe(time.monotonic() - started)
    with contextlib.ExitStack() as legs:  # a continuation's route, lease and prefill
        try:
            while True:
                relay = Relay(proxy, conn, inst)
                sink = out if tracker is None else tracker.sink(transport.write, framed=not http10)
                assert conn.done_fut is not None
                conn.relay_to(transport, proxy.metrics.itl, relay.client_gone, sink)
                relay.start_watchdog()
                _supervise(relay, supervisor)
                error: BaseException | None = None
                try:
                    await conn.done_fut
                except UpstreamError as exc:
                    error = relay.error or exc
                    if isinstance(error, ConnectionResetError):
                        proxy.metrics.streamed_chunks += conn.chunks
                        raise error from None
                if error is None and tracker is not None and tracker.engine_error is not None:
                    # the engine ended the stream with an error event (vLLM's engine core died under it): a cut
                    error = EngineError(inst, tracker.engine_error)
                    conn.abort()  # its API server is going down: not a connection to keep
                if error is not None:
                    proxy.metrics.streamed_chunks += conn.chunks
                    relay.stop()
                    cut = conn.cut_mid_chunk and tracker is None
                    why = "off" if request.get(CONTINUE) is None else (request[CONTINUE].why or "")
                    if tracker is not None:
                        _count_cut(proxy, inst, error)
                        blamed = _blamed(error, inst, supervisor)
                        held = _let_go(held, inst, supervisor is not None and not supervisor.done())
                        nxt = await _continue(proxy, request, tracker, blamed, legs, held, error)
                        if isinstance(nxt, dict):  # the continuation's prefill answered its last token
                            proxy.metrics.continuations.labels("continued", getattr(error, "reason", "stream")).inc()
                            tracker.sink(transport.write, framed=not http10)
                            tracker.answered(nxt)
                            await _write_end(proxy, request, response)
                            return response
                        if not isinstance(nxt, str):
                            proxy.metrics.continuations.labels("continued", getattr(error, "reason", "stream")).inc()
                            inst, conn, supervisor = nxt
                            continue
                        why = nxt
                    proxy.metrics.continuations.labels("ended", why).inc()
                    await _end_stream_with_error(proxy, request, response, transport, inst, error, out, cut,
                                                 counted=tracker is not None, why=why)
                    return response
                relay.stop()
                proxy.metrics.streamed_chunks += conn.chunks
                proxy.health.leg_ok(inst)
                inst.pool.release(conn)
                await _write_end(proxy, request, response)
                return response
        except BaseException:
            relay.stop()
            if conn is not first:
                conn.abort()  # a continuation's leg (run_decode aborts the first)
            raise


def _supervise(relay: Relay, supervisor: asyncio.Task[Any] | None) -> None:
    """Fail `relay` when its supervising prefill leg (WRITE mode) fails."""
    if supervisor is not None and not supervisor.done():
        supervisor.add_done_callback(
            lambda t: relay.fail(t.exception()) if not t.cancelled() and t.exception() is not None else None  # type: ignore[arg-type]
        )
    elif supervisor is not None and not supervisor.cancelled() and supervisor.exception() is not None:
        relay.fail(supervisor.exception())  # type: ignore[arg-type]


# legs of one cut's continuation that may fail before their first token (each instance that failed one avoided
# after it: Avoided) before the stream ends with an error event (legs_failed)
FAILED_CONTINUATION_LEGS = 4


def _let_go(held: list[Lease | Booking], cut: BackendState, prefilling: bool) -> list[Lease | Booking]:
    """End what a cut leg held (its lease, its route's bookings): the stream's continuation is routed anew and never
    connects to them again, so a drain of the cut instance (its manager's stop, which a restart waits for) does not
    wait for a stream held until an instance of the role is back (the crash bench's systemd decode: its ExecStopPost
    waited drain_timeout_s, 30 s, for the held streams before the engine could restart). A booking of an instance
    other than `cut` is kept while a supervising prefill leg may still run there (`prefilling`). What is kept."""
    kept: list[Lease | Booking] = []
    for hold in held:
        if prefilling and isinstance(hold, Booking) and hold.inst is not cut:
            kept.append(hold)
        else:
            hold.end()
    return kept


class Avoided:
    """The instances a request's next leg is not sent to: each failed it (cut its stream, refused or failed a leg
    of it) and no probe has found it down since (health.py's `downs`: its engine stopped, or is being restarted).
    A stopping engine (vLLM on SIGTERM) can still answer on a connection it kept alive what it refuses on a new
    one, and stays in rotation until a probe finds it gone: another leg on it fails in milliseconds, as each of a
    continuation's capped legs did (the crash bench's TERM of a decode)."""

    def __init__(self) -> None:
        self._downs: dict[BackendState, int] = {}
        self._lost: set[BackendState] = set()  # those whose engine went away (not a stall: see wait)

    def add(self, inst: BackendState, error: BaseException | None = None) -> None:
        """Avoid `inst` until a probe finds it down; its kept-alive connections are not used again. `error`: how
        it failed the request (a 504 is a stall: its engine is there, but sent nothing in time)."""
        self._downs[inst] = inst.downs
        if not (isinstance(error, HandoffError) and error.status == 504):
            self._lost.add(inst)
        inst.pool.drop_idle()

    def now(self) -> list[BackendState]:
        """The instances avoided now."""
        return [i for i, downs in self._downs.items() if i.downs == downs and not i.removed]

    async def wait(self, proxy: ProxyState) -> list[BackendState]:
        """Probe the avoided instances still in rotation, then wait for a route off them, within the hold bound
        and at least health.crash_grace_s (a stopping engine's manager reports it within that); what to avoid
        then: none where no other instance came (the one that failed may have been well: a starved engine that
        the watchdog cut, a supervising prefill that failed under it)."""
        for inst in self.now():
            if inst.healthy:
                await proxy.health.probe(inst, fresh=True)
        # an engine that went away is reported by its manager within crash_grace_s: wait that long for it; one
        # that stalled is still there (its manager reports nothing), so its client waits no longer than the hold
        grace = proxy.config.health.crash_grace_s if self._lost.intersection(self.now()) else 0.0
        if self.now() or proxy.hold_wait() > 0:
            await proxy.wait_for_instances(self.now, grace)
        avoid = self.now()
        return avoid if not proxy.missing_roles(avoid) else []


def _blamed(error: BaseException, inst: BackendState, supervisor: asyncio.Task[Any] | None) -> BackendState | None:
    """The instance whose failure cut a decode leg on `inst` with `error`: a lost engine's, none for a supervising
    prefill's other failure (the decode was well), else `inst`."""
    if isinstance(error, LegFailure) and error.inst is not None:
        return error.inst
    if supervisor is not None and supervisor.done() and not supervisor.cancelled() \
            and supervisor.exception() is error:
        return None
    return inst


async def _continue(proxy: ProxyState, request: web.Request, tracker: Tracker, dead: BackendState | None,
                    legs: contextlib.ExitStack, held: list[Lease | Booking], cut: BaseException | None = None,
                    ) -> tuple[BackendState, Connection, asyncio.Task[Any] | None] | dict[str, Any] | str:
    """Open a leg that continues `tracker`'s stream, cut by `dead`'s failure, on a new route off the instances
    that failed it (waiting for its role within the hold bound: Avoided): its instance, connection (its first token
    come) and supervising prefill; the prefill's whole answer where its one token ends the stream; or why not. The
    leg's lease and route's bookings are added to `held`."""
    limit = proxy.config.max_continuations
    failed = 0  # legs that failed before their first token: not continuations, but bounded all the same
    avoided = Avoided()
    if dead is not None:
        avoided.add(dead, cut)
    while (why := tracker.why_not(limit)) is None:
        if failed >= FAILED_CONTINUATION_LEGS:
            return "legs_failed"
        body = continuation_body(tracker.body, cast(list[int], tracker.prompt), tracker.resume())
        if body is None:
            return "finished"
        avoid = await avoided.wait(proxy)
        try:
            route = proxy.router.route(RequestFacts(CONTINUE_PATH, body), avoid=avoid)
        except Unroutable:
            return "no_instance"
        except Refused:
            return "refused"
        legs.enter_context(route)
        held.extend(route.bookings)
        proxy.metrics.routes.labels(route.name, route.reason).inc()
        try:
            return await _continuation_leg(proxy, request, tracker, route, body, legs, held)
        except (LegFailure, HandoffError) as exc:
            log.warning("could not continue a stream on %s: %s", route.header(), exc)
            avoided.add(exc.inst if isinstance(exc, LegFailure) and exc.inst is not None else route.decode, exc)
            held[:] = _let_go(held, route.decode, route.prefill is not None)
            # it relayed nothing: the next try is still this cut's continuation (on another instance, or on this
            # one once a probe has found it down and back), not one of max_continuations
            tracker.continued -= 1
            failed += 1
    return why


async def _continuation_leg(proxy: ProxyState, request: web.Request, tracker: Tracker, route: Route,
                            body: dict[str, Any], legs: contextlib.ExitStack, held: list[Lease | Booking],
                            ) -> tuple[BackendState, Connection, asyncio.Task[Any] | None] | dict[str, Any]:
    """The legs of one continuation on `route`, up to its first token, or the prefill's whole answer where its one
    token ends the stream; raises LegFailure where they failed."""
    side = route.side
    headers = list(request.get(HEADERS, []))
    inst, rank, supervisor = route.decode, route.decode_rank, None
    if route.prefill is None:
        leg = body if route.name == "colocated" else side.alone_body(body)[0]
    else:
        handoff = side.handoff()
        assert handoff is not None  # a route with a prefill instance hands over
        pairing = side.pair(route.prefill, inst, None)
        headers.append(("X-Request-Id", pairing.request_id))
        prefill_body = side.prefill_body(body, pairing)
        if handoff.serial:
            try:
                kv, answer = await run_prefill(proxy, route.prefill, route.prefill_rank, CONTINUE_PATH,
                                               prefill_body, headers)
            except LegFailure as exc:
                exc.inst = exc.inst or route.prefill
                raise
            if kv is None and ended_at_prefill(body, answer):
                return answer  # its one token ends the stream (the last one left, or a stop): no decode leg
            leg = side.decode_body(body, pairing, route.prefill_rank, kv)
        else:
            leg = side.decode_body(body, pairing, route.prefill_rank, None)
            task = asyncio.ensure_future(run_prefill(proxy, route.prefill, route.prefill_rank, CONTINUE_PATH,
                                                     prefill_body, headers))
            task.add_done_callback(_retrieve)
            legs.callback(task.cancel)
            supervisor = task
    held.append(legs.enter_context(inst.lease(rank)))
    if rank is not None:
        headers.append(("X-data-parallel-rank", str(rank)))
    payload = json.dumps(leg, separators=(",", ":")).encode()
    try:
        conn = await inst.pool.send("POST", CONTINUE_PATH, headers, payload, collect=False)
    except UpstreamError as exc:
        _leg_failed(proxy, inst, exc.reason, timed_out=exc.timed_out)
        raise upstream_failure("decode", inst, exc) from None
    try:
        whole = await _first_answer(proxy, inst, conn, True, supervisor)
    except BaseException:
        conn.abort()
        raise
    if whole is not None:
        raise LegFailure(502, f"decode leg on {inst.name} answered {whole.status}: "
                              f"{_engine_message(cast(bytes, whole.body))}")
    return inst, conn, supervisor


async def _end_stream_with_error(
    proxy: ProxyState,
    request: web.Request,
    response: web.StreamResponse,
    transport: asyncio.BaseTransport,
    inst: BackendState,
    error: BaseException,
    out: Any,
    cut_mid_chunk: bool,
    counted: bool = False,
    why: str = "",
) -> None:
    """A stream that failed after its first token and was not continued (`why`; `counted`: its failure was
    counted already): count why, and end it with an SSE error event and the closing chunk, which leave the
    client's keep-alive connection reusable (its head promised that). A stream cut inside a chunk can take
    neither: its connection is closed, and the client sees an incomplete body."""
    status, message = (_failure(inst, error) if counted else _count_cut(proxy, inst, error))
    if why and why != "off":
        message += f"; not continued on another instance ({why})"
    log.warning("stream from %s ended with an error: %s", inst.name, message)
    request[OUTCOME] = "stream_error"
    if cut_mid_chunk:
        transport.close()
    elif not transport.is_closing():
        out(_sse_error(status, message))
        await _write_end(proxy, request, response)


def _failure(inst: BackendState, error: BaseException) -> tuple[int, str]:
    """The client's status and message for a decode leg that failed mid-stream with `error`."""
    if isinstance(error, UpstreamError):
        error = upstream_failure("decode", inst, error)
    status = error.status if isinstance(error, HandoffError) else 502
    message = error.message if isinstance(error, LegFailure) else f"decode leg on {inst.name} failed: {error}"
    return status, message


def _count_cut(proxy: ProxyState, inst: BackendState, error: BaseException) -> tuple[int, str]:
    """Count a decode leg that failed mid-stream with `error` (and toward its instance's ejection); the client's
    status and message for it."""
    if isinstance(error, UpstreamError):
        # the engine's connection ended mid-stream (e.g. the instance stopped): an error event, not a cut
        _leg_failed(proxy, inst, error.reason, timed_out=error.timed_out)
    elif not isinstance(error, LegFailure):
        _leg_failed(proxy, inst, getattr(error, "reason", "stream"))
    elif error.status == 504:
        proxy.metrics.leg_failures.labels("decode", "timeout").inc()
    return _failure(inst, error)


async def _write_end(proxy: ProxyState, request: web.Request, response: web.StreamResponse) -> None:
    """The stream's closing chunk; a client that closed after the last event (after [DONE]) has its whole
    answer, so that is counted, not an error."""
    request[STAGE] = "end"
    try:
        await response.write_eof()
    except ConnectionResetError:
        proxy.metrics.client_aborts.labels("end").inc()
        log.debug("client %s closed before the stream's closing chunk", request.remote)


def ended_at_prefill(body: dict[str, Any], answer: dict[str, Any]) -> bool:
    """True when the prefill leg's one token ends the client's request: every choice stopped (EOS or a stop
    string), or the client asked for one token."""
    choices = answer.get("choices")
    if not isinstance(choices, list) or not choices:
        return False
    reasons = {c.get("finish_reason") if isinstance(c, dict) else None for c in choices}
    one_token = body.get("max_completion_tokens", body.get("max_tokens")) == 1
    return reasons == {"stop"} or (one_token and reasons <= {"stop", "length"})


def answer_from_prefill(body: dict[str, Any], answer: dict[str, Any]) -> web.Response:
    """The client's answer made from the prefill leg's (non-streamed) one: as JSON, or as the SSE events a
    streamed request expects (one chunk per choice, the usage chunk if asked for, [DONE])."""
    answer = {k: v for k, v in answer.items() if k != "kv_transfer_params"}  # pdctl's, never the client's
    if body.get("stream") is not True:
        return web.json_response(answer)
    chat = answer.get("object") == "chat.completion"
    head: dict[str, Any] = {k: answer[k] for k in ("id", "created", "model") if k in answer}
    head["object"] = "chat.completion.chunk" if chat else "text_completion"
    events: list[dict[str, Any]] = []
    for choice in answer.get("choices", []):
        out: dict[str, Any]
        if chat:
            message = choice.get("message") or {}
            out = {"index": choice.get("index", 0), "logprobs": choice.get("logprobs"),
                   "delta": {"role": "assistant", "content": message.get("content") or ""},
                   "finish_reason": choice.get("finish_reason")}
        else:
            out = {k: choice.get(k) for k in ("index", "text", "logprobs", "finish_reason", "stop_reason")}
        events.append({**head, "choices": [out]})
    options = body.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage") and "usage" in answer:
        events.append({**head, "choices": [], "usage": answer["usage"]})
    sse = b"".join(b"data: " + json.dumps(e, separators=(",", ":")).encode() + b"\n\n" for e in events)
    return web.Response(body=sse + b"data: [DONE]\n\n",
                        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})


async def handle_completion(proxy: ProxyState, request: web.Request, path: str, body: dict[str, Any]) -> web.StreamResponse:
    """Route one validated request and serve it on the legs its route, connector and mode call for; a request whose
    engine died before the client had a byte (a prefill before its hand-off, a decode before its first token) is run
    again on a new route, once."""
    started = time.monotonic()
    # the engines' own key, when they have one; the client's key is never forwarded to an engine
    headers: list[tuple[str, str]] = []
    if proxy.engine_key is not None:
        headers.append(("Authorization", f"Bearer {proxy.engine_key}"))
    request[HEADERS] = headers
    if body.get("stream") is True and proxy.config.max_continuations:
        tracker = request[CONTINUE] = Tracker(path, body, plan(path, body))
        body = tracker.engine_body(body)
    try:
        return await _serve(proxy, request, path, body, list(headers), started)
    except EngineLost as exc:
        if not proxy.config.max_continuations:
            raise
        log.warning("%s; running it again on another route", exc.message)
        avoided = Avoided()
        avoided.add(exc.lost)  # not again on the lost engine (nor its kept-alive connections) until seen down
        avoid = await avoided.wait(proxy)
        if proxy.missing_roles():
            raise  # no instance to run it on: the client hears what failed, not that none is in rotation
        proxy.metrics.continuations.labels("rerun", exc.role).inc()
        return await _serve(proxy, request, path, body, list(headers), started, avoid)


async def _serve(proxy: ProxyState, request: web.Request, path: str, body: dict[str, Any],
                 headers: list[tuple[str, str]], started: float,
                 avoid: list[BackendState] | None = None) -> web.StreamResponse:
    """Route the request (off the instances in `avoid`) and serve it on its route's legs."""
    facts = RequestFacts(path, body)
    timeout = proxy.config.timeouts.prefill_s
    try:
        route = await proxy.router.routed(facts, lambda inst: count_tokens(
            inst, tokenize_request(path, body, proxy.config.model), headers, timeout), avoid or ())
    except Unroutable as exc:
        raise LegFailure(503, f"no healthy {exc} instance is available; try again shortly") from None
    except Refused as exc:
        proxy.metrics.routes.labels("refused", exc.reason).inc()
        raise LegFailure(400, str(exc)) from None
    with route:
        proxy.metrics.routes.labels(route.name, route.reason).inc()
        request[ROUTE] = route.header()
        request[BOOKED] = route
        # the client's X-Request-Id reaches the leg that answers it (vLLM's answer id is cmpl-<X-Request-Id>)
        client_id = request.headers.get("X-Request-Id") or None
        if route.prefill is not None:
            return await _disaggregated(proxy, request, path, body, headers, started, route, client_id)
        if client_id is not None:
            headers.append(("X-Request-Id", client_id))
        if route.name == "colocated":
            return await run_decode(proxy, request, route.decode, route.decode_rank, path, body, headers, started)
        return await _decode_only(proxy, request, route, path, body, headers, started)


async def _decode_only(proxy: ProxyState, request: web.Request, route: Route, path: str, body: dict[str, Any],
                       headers: list[tuple[str, str]], started: float) -> web.StreamResponse:
    """A request of a disaggregated node that its decode instance prefills itself: the connector's alone_body,
    which no hand-off can be waited for or read from."""
    side = route.side
    alone, mend = side.alone_body(body)
    response = await run_decode(proxy, request, route.decode, route.decode_rank, path, alone, headers, started)
    if mend and isinstance(response, web.Response) and response.status == 200 and response.body:
        answer = json.loads(response.body or b"")  # type: ignore[arg-type]
        return web.json_response(side.alone_answer(body, answer))
    return response


def release_handoff(proxy: ProxyState, side: ProxySide, decode: BackendState, rank: int | None, path: str,
                    decode_body: dict[str, Any], headers: list[tuple[str, str]]) -> None:
    """Ask the decode instance to have the prefill free the KV it holds for a decode leg to `path` that will not
    be sent (the client left after the prefill answered), rather than hold it until the connector's own timeout."""
    release = side.release(decode_body, path)
    if release is None:
        return
    task = asyncio.get_running_loop().create_task(_send_release(proxy, decode, rank, *release, headers))
    proxy.releases.add(task)
    task.add_done_callback(proxy.releases.discard)


async def _send_release(proxy: ProxyState, inst: BackendState, rank: int | None, path: str, body: dict[str, Any],
                        headers: list[tuple[str, str]]) -> None:
    if rank is not None:
        headers = [*headers, ("X-data-parallel-rank", str(rank))]
    payload = json.dumps(body, separators=(",", ":")).encode()
    try:
        conn, _ = await inst.pool.open("POST", path, headers, payload, collect=True,
                                       head_timeout=proxy.config.timeouts.first_token_s)
        assert conn.done_fut is not None
        await conn.done_fut
    except UpstreamError as exc:
        proxy.metrics.handoff_releases.labels("failed").inc()
        log.warning("could not release a prefill's KV through decode instance %s: %s", inst.name, exc)
        return
    inst.pool.release(conn)
    proxy.metrics.handoff_releases.labels("answered").inc()


async def _disaggregated(
    proxy: ProxyState,
    request: web.Request,
    path: str,
    body: dict[str, Any],
    headers: list[tuple[str, str]],
    started: float,
    route: Route,
    client_id: str | None = None,
) -> web.StreamResponse:
    """The prefill and decode legs of one request on the route picked for it; `client_id`: the client's
    X-Request-Id, which leads the id both legs carry."""
    side, handoff = route.side, route.side.handoff()
    prefill, prefill_rank, decode, decode_rank = route.prefill, route.prefill_rank, route.decode, route.decode_rank
    assert prefill is not None and handoff is not None  # a route without a prefill instance is one leg
    pairing = side.pair(prefill, decode, client_id)
    prefill_body = side.prefill_body(body, pairing)
    # Both legs carry the same id: connectors match the two halves of a request by it (NIXL push does).
    headers.append(("X-Request-Id", pairing.request_id))
    for name, value in headers:
        # registration data reaches the request id: nothing may end a header line or leave latin-1 ASCII
        if not (value.isascii() and value.isprintable()):
            raise LegFailure(502, f"refusing to send an unsafe {name} header to the engines")
    if handoff.serial:
        def abandoned(kv: dict[str, Any]) -> None:
            try:
                leg = side.decode_body(body, pairing, prefill_rank, kv)
            except HandoffError:
                return  # an answer no decode leg could have used: nothing of it to release
            release_handoff(proxy, side, decode, decode_rank, path, leg, headers)

        kv, answer = await run_prefill(proxy, prefill, prefill_rank, path, prefill_body, headers,
                                       abandoned if handoff.releases else None)
        if kv is None and ended_at_prefill(body, answer):
            # vLLM hands no KV over for a prefill that finished the request (its one token was EOS or a stop;
            # MoRIIO, and the shared-storage connector always): the prefill's answer is the whole answer.
            proxy.metrics.ttft.observe(time.monotonic() - started)
            return answer_from_prefill(body, answer)
        # a connector whose decode needs the prefill's kv_transfer_params raises HandoffError without them
        decode_body = side.decode_body(body, pairing, prefill_rank, kv)
        return await run_decode(proxy, request, decode, decode_rank, path, decode_body, headers, started,
                                unsent=lambda: release_handoff(proxy, side, decode, decode_rank, path, decode_body,
                                                               headers))

    decode_body = side.decode_body(body, pairing, prefill_rank, None)
    prefill_task = asyncio.ensure_future(run_prefill(proxy, prefill, prefill_rank, path, prefill_body, headers))
    # its failure is reported through the decode leg (or not at all when the decode leg failed first)
    prefill_task.add_done_callback(_retrieve)
    try:
        return await run_decode(proxy, request, decode, decode_rank, path, decode_body, headers, started, prefill_task)
    finally:
        if not prefill_task.done():
            prefill_task.cancel()
