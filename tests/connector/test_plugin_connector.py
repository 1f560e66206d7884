"""A connector that lives outside pdctl's tree, named "module:Class" in pdctl.toml with a table of its own
settings, is planned, rendered, exported and run: `pdctl up` starts supervisord, two simulated engines and the
proxy as separate processes, each of which imports the connector from PYTHONPATH, and a request is served end to
end through the real proxy with its KV handed over by the connector. Nothing in pdctl's tree names it.

The "ticket" connector: the prefill engine finishes its one-token leg with a ticket for the KV it holds, filed in
its ticket office (a folder: the connector's own setting `office`), the proxy carries the ticket from the
prefill's answer into the decode leg, and the decode engine redeems it for the prompt's KV.
"""

from __future__ import annotations

import json
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from appliance.connector import get_connector, names
from appliance.errors import ExportError, PlanError
from appliance.export import ExportOptions, build_export
from appliance.inventory import load_inventory
from appliance.plan import plan
from appliance.render.supervisor import render_supervisor
from appliance.settings import Settings
from tests.support.pdctl import complete, pdctl, status, write_config

TARGET = "ticketing.connector:TicketConnector"

PACKAGE = {
    "__init__.py": '"""A KV connector outside pdctl: tickets for KV, filed in an office."""\n',
    "connector.py": '''
        """The whole connector: its settings, engine flags and ports, simulated flow, and the proxy's two legs."""

        from __future__ import annotations

        from collections.abc import Mapping
        from typing import Any

        from appliance.connector import Connector, HandoffError, InstanceContext, ProxySide, RayServeBackend
        from appliance.connector.base import Alone, Handoff, OwnSettings, Pairing, SimOptions, one_token
        from appliance.roles import Mode


        class TicketSettings(OwnSettings):
            """[connector.ticket]: where tickets are filed."""

            office: str


        class TicketConnector(Connector):
            """Tickets for KV, carried by the proxy from the prefill's answer to the decode leg."""

            name = "ticket"
            vllm_class = "TicketConnector"
            modes = frozenset({"read"})
            platforms = frozenset({"cuda", "cpu"})
            settings_model = TicketSettings
            sim_flow = "ticketing.sim:TicketSim"
            node_local_env = frozenset({"TICKET_OFFICE_HOST"})

            def _office(self, ctx: InstanceContext) -> str:
                assert isinstance(ctx.settings, TicketSettings)
                return ctx.settings.office

            def port_ranges(self, ctx: InstanceContext) -> dict[str, range]:
                return {"ticket_office": range(ctx.handshake_port, ctx.handshake_port + ctx.ranks)}

            def kv_transfer_config(self, ctx: InstanceContext) -> dict[str, Any]:
                return {"kv_connector": self.vllm_class, "kv_role": ctx.kv_role,
                        "kv_connector_extra_config": {"office": self._office(ctx)}}

            def env(self, ctx: InstanceContext) -> dict[str, str]:
                return {"TICKET_OFFICE_HOST": ctx.host, "TICKET_CLASS": "first"}

            def kv_folders(self, kv_transfer_config: Mapping[str, Any]) -> list[str]:
                return [kv_transfer_config["kv_connector_extra_config"]["office"]]

            def ray_serve(self, kv: dict[str, Any], ports: Mapping[str, list[int]], mode: Mode,
                          block_size: int | None) -> RayServeBackend:
                return RayServeBackend(kv)

            def sim_args(self, ctx: InstanceContext) -> list[str]:
                return ["--shared-storage", self._office(ctx), "--kv-transfer-us-per-token", "0"]

            def check_sim(self, options: SimOptions) -> None:
                if options.role == "both" or not options.shared_storage:
                    raise ValueError("connector 'ticket' hands KV from a prefill to a decode engine via an office")

            def proxy_side(self, mode: Mode) -> ProxySide:
                return Tickets(mode)


        class Tickets(ProxySide):
            """The proxy's side: the ticket goes from the prefill's answer into the decode leg."""

            def alone(self) -> Alone:
                return Alone(True, "a decode without a ticket computes the prompt itself")

            def handoff(self) -> Handoff:
                return Handoff(serial=True, one_request=True, lengths=False, releases=False, fixed_mode=False)

            def release(self, decode_body: dict[str, Any], path: str) -> None:
                return None  # an unredeemed ticket costs a file in the office

            def prefill_body(self, body: dict[str, Any], pairing: Pairing) -> dict[str, Any]:
                return {**one_token(body), "kv_transfer_params": {"do_remote_decode": True}}

            def decode_body(self, body: dict[str, Any], pairing: Pairing, prefill_rank: int | None,
                            prefill_kv: dict[str, Any] | None) -> dict[str, Any]:
                if not prefill_kv or "ticket" not in prefill_kv:
                    raise HandoffError(502, f"prefill instance {pairing.prefill.name} issued no ticket")
                return {**body, "kv_transfer_params": {"do_remote_prefill": True, "ticket": prefill_kv["ticket"]}}
    ''',
    "sim.py": '''
        """The simulated engine's side: a prefill files a ticket in the office, a decode redeems it."""

        from __future__ import annotations

        import json
        import os
        import uuid

        from appliance.connector.sim import BadKVParams, ConnectorSim, SimSequence


        class TicketSim(ConnectorSim):
            """Tickets are files: {"tokens": prompt tokens covered, "issued_by": the prefill's PID}."""

            def _path(self, ticket: str) -> str:
                assert self.cfg.shared_storage is not None
                return os.path.join(self.cfg.shared_storage, ticket)

            def prepare(self, seq: SimSequence) -> None:
                params = seq.kv_params or {}
                if not params.get("do_remote_prefill"):
                    return
                ticket = str(params.get("ticket"))
                if not ticket.isalnum() or not os.path.exists(self._path(ticket)):
                    raise BadKVParams(f"unknown ticket {ticket!r}")
                seq.kv_source = self._redeem

            async def _redeem(self, seq: SimSequence) -> int:
                ticket = str((seq.kv_params or {})["ticket"])
                with open(self._path(ticket)) as fh:
                    filed = json.load(fh)
                os.rename(self._path(ticket), self._path(f"redeemed-{ticket}"))
                with open(self._path(f"redeemed-{ticket}"), "w") as fh:
                    json.dump({**filed, "redeemed_by": os.getpid()}, fh)
                self.stats["kv_pulls"] += 1
                return int(filed["tokens"])

            def on_finish(self, seq: SimSequence) -> bool:
                if (seq.kv_params or {}).get("do_remote_decode"):
                    ticket = uuid.uuid4().hex
                    with open(self._path(ticket), "w") as fh:
                        json.dump({"tokens": len(seq.prompt), "issued_by": os.getpid()}, fh)
                    seq.kv_result = {"ticket": ticket}
                return False
    ''',
}


@pytest.fixture
def plugins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The ticketing package written to a folder outside the tree, importable by this process too."""
    folder = tmp_path / "plugins"
    (folder / "ticketing").mkdir(parents=True)
    for name, text in PACKAGE.items():
        (folder / "ticketing" / name).write_text(textwrap.dedent(text).lstrip())
    monkeypatch.syspath_prepend(str(folder))
    yield folder
    for module in [m for m in sys.modules if m == "ticketing" or m.startswith("ticketing.")]:
        del sys.modules[module]


def _settings(tmp_path: Path) -> Settings:
    return Settings.model_validate({"connector": {"name": TARGET, "ticket": {"office": str(tmp_path / "office")}},
                                    "engine": {"kind": "sim"}, "state_dir": str(tmp_path / "state")})


def test_an_unknown_or_wrong_module_class_is_one_clear_error(plugins: Path) -> None:
    for target, why in (("nowhere.at_all:Thing", "cannot import nowhere.at_all"),
                        ("ticketing.sim:TicketSim", "is not a subclass of appliance.connector.Connector"),
                        ("ticketing.connector:Missing", "is not a subclass")):
        with pytest.raises(ValueError, match=why):
            Settings.model_validate({"connector": {"name": target}})
    # its own table is validated by its own model, and only the chosen one's table is known
    with pytest.raises(ValueError, match="connector.ticket.office: Field required"):
        Settings.model_validate({"connector": {"name": TARGET, "ticket": {}}})
    with pytest.raises(ValueError, match="unknown setting connector.ticket"):
        Settings.model_validate({"connector": {"name": "nixl", "ticket": {"office": "/x"}}})
    assert TARGET not in names() and get_connector(TARGET).name == "ticket"


def test_a_connector_that_leaves_an_answer_out_is_refused(plugins: Path) -> None:
    """Every connector answers, in each of its modes, what it sends alone, how it hands over and how it releases
    (ProxySide's abstract methods): one that leaves an answer out is refused when it is named, with what it
    lacks, before anything is planned or routed."""
    source = (plugins / "ticketing" / "connector.py").read_text()
    without_release = source.replace("    def release(self, decode_body", "    def _release(self, decode_body")
    without_side = source.replace("    def proxy_side(self, mode", "    def _proxy_side(self, mode")
    (plugins / "ticketing" / "no_release.py").write_text(without_release)
    (plugins / "ticketing" / "no_side.py").write_text(without_side)
    for target, lacks in (("ticketing.no_release:TicketConnector", "its proxy side in read mode does not answer"),
                          ("ticketing.no_side:TicketConnector", "does not define proxy_side")):
        with pytest.raises(ValueError, match=lacks) as refused:
            Settings.model_validate({"connector": {"name": target, "ticket": {"office": "/x"}}})
        print(refused.value)
        assert "release" in str(refused.value) or "proxy_side" in str(refused.value)
        with pytest.raises(PlanError, match=lacks):
            get_connector(target)


def test_planned_rendered_and_exported(plugins: Path, tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    p = plan(settings, load_inventory("sim:cpu"))
    assert (p.connector, p.layout, p.proxy.registration.enabled) == (TARGET, "disaggregated", False)
    office = str(tmp_path / "office")
    for inst in p.instances:
        assert inst.kv_transfer_config is not None
        assert inst.kv_transfer_config["kv_connector_extra_config"] == {"office": office}
        assert inst.argv[inst.argv.index("--connector") + 1] == TARGET
        assert inst.argv[inst.argv.index("--shared-storage") + 1] == office
    assert any(f"--connector {TARGET}" in f.text for f in render_supervisor(p))
    vllm = settings.model_copy(update={"engine": settings.engine.model_copy(update={"kind": "vllm"})})
    exported = plan(vllm, load_inventory("sim:cpu"))
    assert {"TICKET_OFFICE_HOST", "TICKET_CLASS"} <= exported.instances[0].env.keys()
    files = build_export(exported, vllm, ExportOptions(target="ray-serve")).files
    serve = next(text for path, text in files.items() if path.endswith("serve.yaml"))
    assert "TICKET_CLASS: first" in serve and "TICKET_OFFICE_HOST" not in serve
    with pytest.raises(ExportError):  # no llm_d hook: llm-d refuses it
        build_export(plan(vllm, load_inventory("sim:h200-8")), vllm, ExportOptions(target="llm-d"))


def test_runs_across_real_processes(plugins: Path, tmp_path: Path) -> None:
    office = tmp_path / "office"
    config = write_config(tmp_path, tmp_path / "state", extra=(
        f'[connector]\nname = "{TARGET}"\n[connector.ticket]\noffice = {json.dumps(str(office))}\n'))
    # supervisord, the engines and the proxy inherit it from `pdctl up`, as from an operator's shell
    env = {"PYTHONPATH": str(plugins)}
    try:
        up = pdctl(config, "up", "--json", env=env)
        assert up.returncode == 0, up.stderr
        assert json.loads(up.stdout)["healthy"] is True
        doc = status(config, env=env)
        pids = {i["name"]: i["pid"] for i in doc["instances"]}
        assert doc["state"] == "healthy" and len({*pids.values(), doc["proxy"]["pid"]}) == 3
        # the office holds prompts' KV: pdctl made it private, as it does the example connector's store
        assert office.stat().st_mode & 0o777 == 0o700
        answer = complete(doc["proxy"]["url"])
        assert answer["usage"]["completion_tokens"] == 4
        # the decode engine computed nothing of the prompt itself: its KV came with the redeemed ticket
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == answer["usage"]["prompt_tokens"]
        filed = [json.loads(path.read_text()) for path in office.iterdir()]
        assert filed == [{"tokens": answer["usage"]["prompt_tokens"], "issued_by": pids["prefill-0"],
                          "redeemed_by": pids["decode-0"]}]
    finally:
        pdctl(config, "down", env=env)
