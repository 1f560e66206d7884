"""The admin API (loopback HTTP, JSON): state, mode switch, drain/undrain, live backend set, holds and
planned stops (restarts)."""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Annotated, Any

from aiohttp import web
from pydantic import Field, TypeAdapter, ValidationError

from appliance.proxy.config import Backend
from appliance.proxy.guard import bearer_matches, json_too_deep, lone_surrogate
from appliance.proxy.state import ProxyState
from appliance.roles import parse_mode

_BACKENDS = TypeAdapter(list[Backend])
MAX_SECONDS = 86_400.0
_SECONDS = TypeAdapter(Annotated[float, Field(ge=0, le=MAX_SECONDS, allow_inf_nan=False, strict=True)])
MAX_CONNECTIONS = 64  # pdctl makes one call at a time; a few operators' scripts besides
_MAX_DEPTH = 16  # the deepest admin body (a backend list) nests 4 deep
_PROXY_KEY: web.AppKey[ProxyState] = web.AppKey("proxy")


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


def state(proxy: ProxyState) -> dict[str, Any]:
    """Everything `pdctl status` wants to know about the proxy."""
    ready, counts = proxy.ready()
    return {
        "pid": os.getpid(),  # a planned restart (a handover) is done once another process answers
        "mode": proxy.mode,
        "connector": proxy.config.connector,
        "routing": proxy.config.routing,
        "model": proxy.config.model,
        "ready": ready,
        "healthy": counts,
        "hold_wait_s": proxy.hold_wait(),
        "holds": {
            "requests": proxy.metrics.held_requests,
            "max_wait_s": round(proxy.metrics.max_hold_s, 3),
            "engine_crashes": proxy.metrics.engine_crashes,
            "proxy_crashes": proxy.metrics.proxy_crash_count,
        },
        "requests": proxy.metrics.request_totals(),
        "planned_stops": sorted(proxy.planned.active),
        "panic": proxy.panic(),
        "instances": [{**inst.state(), "prefix_source": proxy.router.policy.prefix_source(inst)}
                      for inst in proxy.registry.instances.values()],
    }


@web.middleware
async def _auth(request: web.Request, handler: Any) -> web.StreamResponse:
    token = request.app[_PROXY_KEY].admin_token
    if token is not None and not bearer_matches(request.headers.get("Authorization"), token):
        return _error(401, "admin token missing or wrong: send 'Authorization: Bearer <token>'")
    response: web.StreamResponse = await handler(request)
    return response


async def _json(request: web.Request) -> Any:
    proxy = request.app[_PROXY_KEY]
    try:
        raw = await asyncio.wait_for(request.read(), proxy.config.limits.body_timeout_s)
    except asyncio.TimeoutError:
        raise web.HTTPRequestTimeout(text=json.dumps({"error": "the body did not arrive in time"}),
                                     content_type="application/json", headers={"Connection": "close"}) from None
    if json_too_deep(raw, _MAX_DEPTH):
        raise web.HTTPBadRequest(text=json.dumps({"error": f"body is nested more than {_MAX_DEPTH} deep"}),
                                 content_type="application/json")
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise web.HTTPBadRequest(
            text=json.dumps({"error": f"body is not valid JSON: {reason}"}), content_type="application/json"
        ) from None
    if lone_surrogate(raw, value):
        # a name or address with one would be a metrics label /metrics cannot encode
        raise web.HTTPBadRequest(text=json.dumps({"error": "body is not valid JSON: a string holds a lone surrogate"}),
                                 content_type="application/json")
    return value


def _instance_name(body: Any) -> str:
    name = body.get("instance") if isinstance(body, dict) else None
    if not isinstance(name, str) or not name:
        raise web.HTTPBadRequest(text=json.dumps({"error": "'instance' (a name) is required"}),
                                 content_type="application/json")
    return name


async def everywhere(proxy: ProxyState) -> dict[str, Any]:
    """state(), with the other worker processes' loads and counters added (docs/proxy-workers.md)."""
    view = state(proxy)
    if proxy.others is None:
        return view
    others = await proxy.others.loads()
    view["workers"] = [{"worker": 0, "pid": view["pid"], "requests": view["requests"]["total"],
                        "connections": proxy.client_connections(), "ready": view["ready"],
                        "healthy": view["healthy"]},
                       *({key: got[key] for key in ("worker", "pid", "connections", "ready")} | {"requests":
                         got["requests"]["total"], "healthy": got.get("healthy", {})}
                         for got in sorted(others, key=lambda got: int(got["worker"])))]
    for inst in view["instances"]:
        for got in others:
            in_flight, routed = got["instances"].get(inst["name"], [0, 0])
            inst["in_flight"] += in_flight
            inst["routed"] += routed
    requests, holds = view["requests"], view["holds"]
    for got in others:
        theirs = got["requests"]
        for key in ("total", "leg_failures", "client_aborts"):
            requests[key] += theirs[key]
        for status, count in theirs["by_status"].items():
            requests["by_status"][status] = requests["by_status"].get(status, 0) + count
        holds["requests"] += got["held_requests"]
        holds["max_wait_s"] = max(holds["max_wait_s"], round(got["max_hold_s"], 3))
        # a worker started after a crash knows the keeper's count then; the leader may be older
        holds["proxy_crashes"] = max(holds["proxy_crashes"], got["proxy_crashes"])
    return view


async def get_state(request: web.Request) -> web.Response:
    return web.json_response(await everywhere(request.app[_PROXY_KEY]))


async def post_mode(request: web.Request) -> web.Response:
    proxy = request.app[_PROXY_KEY]
    body = await _json(request)
    try:
        mode = parse_mode(body.get("mode") if isinstance(body, dict) else None)
    except ValueError as exc:
        return _error(400, f"'mode': {exc}")
    if not proxy.connector.disaggregated:
        return _error(400, f"connector {proxy.config.connector!r} (colocated) has no transfer mode")
    try:
        proxy.connector.check_mode(mode)
    except ValueError as exc:
        return _error(400, str(exc))
    previous, proxy.mode = proxy.mode, mode
    await proxy.share()
    return web.json_response({
        "mode": mode,
        "previous": previous,
        # a connector that fixes the mode when the engine starts (MORI-IO) needs its engines restarted
        "engines_restart_required": proxy.connector.mode_fixed_at_start and previous != mode,
    })


async def post_drain(request: web.Request) -> web.Response:
    proxy = request.app[_PROXY_KEY]
    body = await _json(request)
    name = _instance_name(body)
    timeout = _seconds(body, "timeout_s", 60.0)
    inst = proxy.registry.get(name)
    if inst is None:
        return _error(404, f"no instance named {name!r}; known: {', '.join(sorted(proxy.registry.instances))}")
    inst.draining = True
    await proxy.share()
    started = time.monotonic()
    deadline = started + float(timeout)
    while (routed := await proxy.routed_everywhere(name)) > 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return web.json_response({
        "instance": name,
        "drained": routed == 0,
        "in_flight": routed,
        "waited_s": round(time.monotonic() - started, 3),
    })


async def post_undrain(request: web.Request) -> web.Response:
    proxy = request.app[_PROXY_KEY]
    name = _instance_name(await _json(request))
    inst = proxy.registry.get(name)
    if inst is None:
        return _error(404, f"no instance named {name!r}")
    inst.draining = False
    await proxy.share()
    return web.json_response({"instance": name, "draining": False})


async def post_hold(request: web.Request) -> web.Response:
    """Requests for a role with no routable instance wait up to wait_s (for expires_in_s); wait_s 0 ends it."""
    proxy = request.app[_PROXY_KEY]
    body = await _json(request)
    values = {key: _seconds(body, key, default) for key, default in (("wait_s", None), ("expires_in_s", 600.0))}
    proxy.hold_wait_s = values["wait_s"]
    proxy.hold_until = time.monotonic() + values["expires_in_s"] if values["wait_s"] > 0 else 0.0
    await proxy.share()
    return web.json_response({"hold_wait_s": proxy.hold_wait_s, "expires_in_s": values["expires_in_s"]})


def _seconds(body: Any, key: str, default: float | None) -> float:
    """A duration field of an admin body: a finite number of seconds from 0 to a day (JSON lets a client
    spell NaN, Infinity and 1e400, and a wait of forever is never what an operator meant)."""
    value = body.get(key, default) if isinstance(body, dict) else default
    try:
        return _SECONDS.validate_python(value)
    except ValidationError:
        raise web.HTTPBadRequest(
            text=json.dumps({"error": f"'{key}' must be a number of seconds from 0 to {MAX_SECONDS:g}, got {value!r}"}),
            content_type="application/json") from None


async def post_stopping(request: web.Request) -> web.Response:
    """A planned stop begins: no new requests to the instance, its role's requests wait (bounded) while it has
    no other routable instance; answers once the instance's requests finished (or drain_timeout_s passed)."""
    proxy = request.app[_PROXY_KEY]
    body = await _json(request)
    name = _instance_name(body)
    hold_s = _seconds(body, "hold_s", 120.0)
    drain_s = _seconds(body, "drain_timeout_s", 30.0)
    expires = _seconds(body, "expires_in_s", 600.0)
    inst = proxy.registry.get(name)
    if inst is None:
        return _error(404, f"no instance named {name!r}; known: {', '.join(sorted(proxy.registry.instances))}")
    # a crash reported while a planned stop is in force is that stop's end (under systemd: ExecStopPost after
    # an engine that exited non-zero on its SIGTERM), not a crash
    if isinstance(body, dict) and body.get("crashed") is True and name not in proxy.planned.active:
        proxy.metrics.observe_crash(name)
    proxy.planned.begin(inst, hold_s, max(expires, drain_s))
    await proxy.share()
    started = time.monotonic()
    deadline = started + drain_s
    while (routed := await proxy.routed_everywhere(name)) > 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    others = [i.name for i in proxy.registry.by_role[inst.role] if proxy.router.routable(i)]
    return web.json_response({
        "instance": name,
        "drained": routed == 0,
        "in_flight": routed,
        "waited_s": round(time.monotonic() - started, 3),
        # with no other routable instance of its role, new requests wait (up to hold_s) instead of failing
        "holding": not others,
    })


async def post_started(request: web.Request) -> web.Response:
    """A planned stop is over (the instance answers /health again): probe it now and put it back in rotation."""
    proxy = request.app[_PROXY_KEY]
    name = _instance_name(await _json(request))
    inst = proxy.registry.get(name)
    if inst is None:
        return _error(404, f"no instance named {name!r}")
    if proxy.planned.unseen_restart(name):
        # a new engine process that no probe saw come (the old one went between two probes): warmed up before it
        # is routable; one the probes saw go is warmed up on its way back anyway
        proxy.health.restarted(inst)
    healthy = await proxy.health.probe(inst, fresh=True)
    if healthy:
        was_stopping = proxy.planned.end(name, "reported started")
    else:
        # not answering yet: held requests keep waiting, and the first probe that passes ends the stop
        was_stopping = proxy.planned.reported_back(name)
    await proxy.share()
    return web.json_response({"instance": name, "healthy": healthy, "was_stopping": was_stopping})


async def post_instances(request: web.Request) -> web.Response:
    proxy = request.app[_PROXY_KEY]
    try:
        backends = _BACKENDS.validate_python(await _json(request))
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        return _error(400, f"backends: {where}: {first['msg']}")
    names = [b.name for b in backends]
    if len(set(names)) != len(names):
        return _error(400, "backend names must be unique")
    proxy.set_backends(backends)
    await proxy.registry.close_retired()
    await proxy.share()
    return web.json_response(await everywhere(proxy))


def build_app(proxy: ProxyState) -> web.Application:
    """The admin aiohttp application."""
    app = web.Application(middlewares=[_auth], client_max_size=1024 * 1024)
    app[_PROXY_KEY] = proxy
    app.router.add_get("/admin/state", get_state)
    app.router.add_post("/admin/mode", post_mode)
    app.router.add_post("/admin/drain", post_drain)
    app.router.add_post("/admin/undrain", post_undrain)
    app.router.add_post("/admin/instances", post_instances)
    app.router.add_post("/admin/hold", post_hold)
    app.router.add_post("/admin/stopping", post_stopping)
    app.router.add_post("/admin/started", post_started)
    return app
