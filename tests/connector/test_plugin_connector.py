"""A connector defined only in this module, registered at test time, is planned, rendered, simulated, proxied and
exported, and help texts name it: adding a connector is one module and one registry line, nothing else in the
house changes.

The "ticket" connector: the prefill engine finishes its one-token leg with a ticket for the KV it holds, the proxy
carries the ticket from the prefill's answer into the decode leg, and the decode engine redeems it for the prompt's
KV. Engines and proxy run in this process (the registration is in-process) on real sockets.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from click.testing import CliRunner

import appliance.connector as registry
from appliance.cli.main import cli
from appliance.connector import Connector, HandoffError, InstanceContext, Peer, RayServeBackend, register
from appliance.connector.base import SimOptions
from appliance.engine.sim import SimServer
from appliance.engine.sim.cli import sim_config, sim_engine
from appliance.engine.sim.connectors import BadKVParams, ConnectorSim
from appliance.engine.sim.engine import Sequence
from appliance.errors import ExportError
from appliance.export import ExportOptions, build_export
from appliance.inventory import load_inventory
from appliance.plan import Plan, plan
from appliance.proxy.app import Proxy
from appliance.proxy.config import ProxyConfig
from appliance.render.supervisor import render_supervisor
from appliance.render.systemd import render_systemd
from appliance.roles import Mode
from appliance.settings import Settings

# tickets the prefill engines issued and the decode engines have not redeemed: ticket -> prompt tokens covered
ISSUED: dict[str, int] = {}


class TicketSim(ConnectorSim):
    """The simulated engine's side: prefill legs issue a ticket, decode legs redeem it for the prompt's KV."""

    def prepare(self, seq: Sequence) -> None:
        params = seq.kv_params or {}
        if not params.get("do_remote_prefill"):
            return
        if params.get("ticket") not in ISSUED:
            raise BadKVParams(f"unknown ticket {params.get('ticket')!r}")
        seq.kv_source = self._redeem

    async def _redeem(self, seq: Sequence) -> int:
        self.stats["kv_pulls"] += 1
        return ISSUED.pop(str((seq.kv_params or {})["ticket"]))

    def on_finish(self, seq: Sequence) -> bool:
        if (seq.kv_params or {}).get("do_remote_decode"):
            ticket = uuid.uuid4().hex
            ISSUED[ticket] = len(seq.prompt)
            seq.kv_result = {"ticket": ticket}
        return False


class TicketConnector(Connector):
    """The whole connector: engine flags and ports, simulated flow, and the proxy's two legs."""

    name = "ticket"
    vllm_class = "TicketConnector"
    modes = frozenset({"read"})
    platforms = frozenset({"cuda", "cpu"})
    sim_flow = f"{__name__}:TicketSim"
    # where this node's ticket office listens: a cluster sets its own
    node_local_env = frozenset({"TICKET_OFFICE_HOST"})

    def port_ranges(self, ctx: InstanceContext) -> dict[str, range]:
        return {"ticket_office": range(ctx.handshake_port, ctx.handshake_port + ctx.ranks)}

    def kv_transfer_config(self, ctx: InstanceContext) -> dict[str, Any]:
        return {"kv_connector": self.vllm_class, "kv_role": ctx.kv_role}

    def env(self, ctx: InstanceContext) -> dict[str, str]:
        return {"TICKET_OFFICE_HOST": ctx.host, "TICKET_CLASS": "first"}

    def ray_serve(self, kv: dict[str, Any], ports: Mapping[str, list[int]], mode: Mode,
                  block_size: int | None) -> RayServeBackend:
        return RayServeBackend(kv)

    def sim_args(self, ctx: InstanceContext) -> list[str]:
        return ["--kv-transfer-us-per-token", "0"]

    def check_sim(self, options: SimOptions) -> None:
        if options.role == "both":
            raise ValueError("connector 'ticket' hands KV from a prefill to a decode engine")

    def prefill_body(self, body: dict[str, Any], prefill: Peer, decode: Peer, handoff: dict[str, Any]) -> dict[str, Any]:
        return {**super().prefill_body(body, prefill, decode, handoff), "kv_transfer_params": {"do_remote_decode": True}}

    def decode_body(self, body: dict[str, Any], prefill: Peer, decode: Peer, prefill_rank: int | None,
                    prefill_kv: dict[str, Any] | None, handoff: dict[str, Any]) -> dict[str, Any]:
        if not prefill_kv or "ticket" not in prefill_kv:
            raise HandoffError(502, f"prefill instance {prefill.name} issued no ticket")
        return {**body, "kv_transfer_params": {"do_remote_prefill": True, "ticket": prefill_kv["ticket"]}}


@pytest.fixture
def ticket(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The ticket connector in the registry for this test only."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    register("ticket", f"{__name__}:TicketConnector")
    yield
    ISSUED.clear()


def _plan(state_dir: Path) -> Plan:
    settings = Settings.model_validate({"connector": {"name": "ticket"}, "engine": {"kind": "sim"},
                                        "state_dir": str(state_dir)})
    return plan(settings, load_inventory("sim:cpu"))


def test_unregistered_connector_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown connector"):
        Settings.model_validate({"connector": {"name": "ticket"}})


def test_planned_and_rendered(ticket: None, tmp_path: Path) -> None:
    p = _plan(tmp_path)
    assert (p.connector, p.layout, p.proxy.registration.enabled) == ("ticket", "disaggregated", False)
    for inst in p.instances:
        assert inst.kv_transfer_config == {"kv_connector": "TicketConnector", "kv_role": inst.kv_transfer_config["kv_role"]}
        assert inst.ports["ticket_office"] == [inst.ports["ticket_office"][0]]
        assert inst.argv[inst.argv.index("--connector") + 1] == "ticket"
        assert inst.argv[-2:] == ["--kv-transfer-us-per-token", "0"]
    units = [f.text for f in render_systemd(p).units if "appliance.engine.sim" in f.text]
    assert len(units) == 2 and all("--connector ticket" in text for text in units)
    assert any("--connector ticket" in f.text for f in render_supervisor(p))
    # the CLI's --connector choice is the registry's
    result = CliRunner().invoke(cli, ["plan", "--json", "--connector", "ticket", "--engine", "sim", "--inventory",
                                      "sim:cpu"], env={"PDCTL_STATE_DIR": str(tmp_path)})
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["connector"] == "ticket"


def test_simulated_and_proxied(ticket: None, tmp_path: Path) -> None:
    p = _plan(tmp_path)

    async def scenario() -> tuple[int, dict[str, Any], list[dict[str, Any]]]:
        engines = {}
        for inst in p.instances:
            # the planned sim-engine command line, parsed by the sim-engine CLI; port 0 instead of the planned one
            args = inst.argv[inst.argv.index("appliance.engine.sim") + 1:]
            options = sim_engine.make_context("sim-engine", args).params
            options.pop("log_level")
            engines[inst.name] = SimServer(sim_config({**options, "port": 0}))
        for server in engines.values():
            await server.start()
        raw = p.proxy.model_dump(mode="json")
        raw.update(port=0, admin={"port": 0})
        for backend in raw["backends"]:
            backend["url"] = engines[backend["name"]].url
        proxy = Proxy(ProxyConfig.model_validate(raw))
        await proxy.start()
        try:
            while not proxy.ready()[0]:
                await asyncio.sleep(0.02)
            async with aiohttp.ClientSession() as session, session.post(
                f"http://127.0.0.1:{proxy.api_port}/v1/completions",
                json={"model": p.model.served_name, "prompt": "one two three four five six", "max_tokens": 5},
            ) as resp:
                answer = await resp.json()
                status = resp.status
            return status, answer, [server.connector.info() | dict(server.connector.stats) for server in engines.values()]
        finally:
            await proxy.stop()
            for server in engines.values():
                await server.stop()

    status, answer, engines = asyncio.run(scenario())
    assert status == 200, answer
    assert answer["usage"]["completion_tokens"] == 5
    # the decode engine computed nothing of the prompt itself: its KV came with the redeemed ticket
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == answer["usage"]["prompt_tokens"]
    assert [e["connector"] for e in engines] == ["ticket", "ticket"]
    assert sum(e.get("kv_pulls", 0) for e in engines) == 1
    assert ISSUED == {}


def test_exported_and_named_in_help_texts(ticket: None, tmp_path: Path) -> None:
    """The export drops the env the connector pins to this node and keeps the rest; the fixes that list
    connectors list it where it has the target's hook, with its platforms."""
    settings = Settings.model_validate({"connector": {"name": "ticket"}, "state_dir": str(tmp_path)})
    p = plan(settings, load_inventory("sim:cpu"))
    assert {"TICKET_OFFICE_HOST", "TICKET_CLASS"} <= p.instances[0].env.keys()
    files = build_export(p, settings, ExportOptions(target="ray-serve")).files
    serve = next(text for path, text in files.items() if path.endswith("serve.yaml"))
    assert "TICKET_CLASS: first" in serve and "TICKET_OFFICE_HOST" not in serve
    # no llm_d hook: llm-d refuses it (on a GPU node: llm-d refuses the CPU), naming the connectors it drives
    gpu = plan(settings, load_inventory("sim:h200-8"))
    with pytest.raises(ExportError) as refused:
        build_export(gpu, settings, ExportOptions(target="llm-d"))
    assert refused.value.fix == "use moriio (AMD) or nixl (any platform)"
    colocated = Settings.model_validate({"connector": {"name": "none"}, "state_dir": str(tmp_path)})
    with pytest.raises(ExportError) as refused:
        build_export(plan(colocated, load_inventory("sim:cpu")), colocated, ExportOptions(target="ray-serve"))
    assert refused.value.fix == ("choose a KV connector ray-serve deploys: moriio (AMD), nixl (any platform), "
                                 "example (any platform) or ticket (NVIDIA, CPU)")
