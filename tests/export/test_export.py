"""pdctl export: the plan -> Ray Serve LLM / llm-d translation, its errors, and the CLI writing the files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from appliance.export import ExportError, ExportOptions, build_export
from appliance.export.cluster import (
    argv_from_engine_kwargs,
    engine_kwargs_from_argv,
    parse_replicas,
    write_files,
)
from appliance.inventory import load_inventory
from appliance.plan import Plan, plan
from appliance.settings import Settings

REPO = Path(__file__).resolve().parents[2]

# The MI300X reference node: 1P(TP4) + 1D(TP4), MORI-IO in WRITE mode (etc/pdctl.toml's shape).
REFERENCE = {
    "model": {"path": "/models/Qwen3-235B-A22B-FP8", "served_name": "qwen3-235b", "max_model_len": 8192},
    "connector": {"name": "moriio", "mode": "write"},
    "prefill": {"gpus": [0, 1, 2, 3], "tp": 4, "max_num_batched_tokens": 16384, "extra_args": ["--block-size", "16"]},
    "decode": {"gpus": [4, 5, 6, 7], "tp": 4, "max_num_seqs": 128, "enable_prefix_caching": False},
}
# An xPyD NVIDIA node: 2 prefill instances of TP2 on GPUs 0-3, one TP4 decode on GPUs 4-7, NIXL.
XPYD_NVIDIA = {
    "model": {"path": "Qwen/Qwen3-32B", "served_name": "qwen3-32b"},
    "connector": {"name": "nixl"},
    "prefill": {"gpu_count": 4, "instances": 2},
    "decode": {"gpu_count": 4, "instances": 1, "env": {"UCX_TLS": "cuda_ipc,cuda_copy,tcp"}},
}


def make_plan(overrides: dict[str, Any], inventory: str) -> tuple[Settings, Plan]:
    settings = Settings.model_validate(overrides)
    return settings, plan(settings, load_inventory(inventory))


def export(overrides: dict[str, Any], inventory: str, **options: Any) -> tuple[Plan, dict[str, Any]]:
    settings, p = make_plan(overrides, inventory)
    result = build_export(p, settings, ExportOptions(**options), load_inventory(inventory))
    docs = {}
    for name, text in result.files.items():
        loaded = list(yaml.safe_load_all(text))
        docs[name] = loaded if len(loaded) > 1 else loaded[0]
    return p, docs


def app_args(docs: dict[str, Any]) -> dict[str, Any]:
    (app,) = docs["ray-serve/serve.yaml"]["applications"]
    assert app["import_path"] == "ray.serve.llm:build_pd_openai_app"
    return app["args"]


def containers(deployment: dict[str, Any]) -> dict[str, dict[str, Any]]:
    spec = deployment["spec"]["template"]["spec"]
    return {c["name"]: c for c in spec["containers"] + spec.get("initContainers", [])}


def test_reference_plan_to_ray_serve() -> None:
    p, docs = export(REFERENCE, "sim:mi300x-8", target="ray-serve")
    args = app_args(docs)
    prefill, decode = args["prefill_config"], args["decode_config"]
    for cfg in (prefill, decode):
        assert cfg["model_loading_config"] == {"model_id": "qwen3-235b", "model_source": "/models/Qwen3-235B-A22B-FP8"}
        assert cfg["engine_kwargs"]["tensor_parallel_size"] == 4
        assert cfg["engine_kwargs"]["max_model_len"] == 8192
        assert cfg["deployment_config"] == {"num_replicas": 1}
        assert cfg["accelerator_type"] == "AMD-Instinct-MI300X-OAM"
        assert cfg["runtime_env"]["env_vars"]["VLLM_ROCM_USE_AITER"] == "1"
        # GPU pinning is the cluster scheduler's business, never copied from the node.
        assert not {"CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"} & set(cfg["runtime_env"]["env_vars"])
        extra = cfg["engine_kwargs"]["kv_transfer_config"]["kv_connector_extra_config"]
        assert extra["read_mode"] is False and extra["backend"] == "rdma"
        assert extra["proxy_ip"] == "" and "host_ip" not in extra and "handshake_port" not in extra
    assert prefill["engine_kwargs"]["kv_transfer_config"]["kv_role"] == "kv_producer"
    assert decode["engine_kwargs"]["kv_transfer_config"]["kv_role"] == "kv_consumer"
    # Role-specific vLLM flags travel with their role only.
    assert prefill["engine_kwargs"]["max_num_batched_tokens"] == 16384 and prefill["engine_kwargs"]["block_size"] == 16
    assert decode["engine_kwargs"]["max_num_seqs"] == 128 and decode["engine_kwargs"]["enable_prefix_caching"] is False
    assert "max_num_seqs" not in prefill["engine_kwargs"]
    # The node's MoRIIO port bases become Ray's per-role bases.
    assert prefill["experimental_configs"] == {"MORI_HANDSHAKE_PORT_BASE": 6301, "MORI_NOTIFY_PORT_BASE": 6105}
    assert decode["experimental_configs"] == {"MORI_HANDSHAKE_PORT_BASE": 7301, "MORI_NOTIFY_PORT_BASE": 7501}
    assert docs["ray-serve/serve.yaml"]["http_options"] == {"host": "0.0.0.0", "port": p.proxy.port}


def test_reference_plan_to_llm_d() -> None:
    _, docs = export(REFERENCE, "sim:mi300x-8", target="llm-d")
    prefill, decode = docs["llm-d/modelserver.yaml"]
    assert [d["metadata"]["name"] for d in (prefill, decode)] == ["pdctl-qwen3-235b-prefill", "pdctl-qwen3-235b-decode"]
    for dep, role, port in ((prefill, "prefill", 8000), (decode, "decode", 8200)):
        assert dep["spec"]["replicas"] == 1
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert labels["llm-d.ai/role"] == role and labels["llm-d.ai/inferenceServing"] == "true"
        assert dep["spec"]["selector"]["matchLabels"] == labels
        vllm = containers(dep)["vllm"]
        assert vllm["resources"]["limits"] == {"amd.com/gpu": "4"} == vllm["resources"]["requests"]
        args = vllm["args"]
        assert args[:3] == ["/models/Qwen3-235B-A22B-FP8", "--served-model-name=qwen3-235b", f"--port={port}"]
        assert "--tensor-parallel-size=4" in args and "--max-model-len=8192" in args
        kv = json.loads(args[args.index("--kv-transfer-config") + 1])
        assert kv["kv_connector"] == "MoRIIOConnector"
        assert kv["kv_connector_extra_config"]["http_port"] == str(port)
        assert kv["kv_connector_extra_config"]["proxy_ip"] == ""
        env = {e["name"]: e for e in vllm["env"]}
        assert env["VLLM_HOST_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert "HIP_VISIBLE_DEVICES" not in env
        assert vllm["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
    assert "--block-size=16" in containers(prefill)["vllm"]["args"]
    assert "--no-enable-prefix-caching" in containers(decode)["vllm"]["args"]
    sidecar = containers(decode)["routing-proxy"]
    assert sidecar["restartPolicy"] == "Always"
    assert {"--kv-connector=nixlv2", "--vllm-port=8200", "--moriio-tp-size=4", "--moriio-write-mode"} <= set(
        sidecar["args"])
    assert "routing-proxy" not in containers(prefill)
    # 1800 s of engine start-up patience, as on the node.
    assert containers(prefill)["vllm"]["startupProbe"]["failureThreshold"] * 30 >= 1800
    values = docs["llm-d/inferencepool.values.yaml"]
    assert values["inferencePool"]["modelServers"]["matchLabels"]["llm-d.ai/model"] == "qwen3-235b"
    pd = yaml.safe_load(values["inferenceExtension"]["pluginsCustomConfig"]["pd-config.yaml"])
    assert [p["name"] for p in pd["schedulingProfiles"]] == ["prefill", "decode"]
    assert docs["llm-d/kustomization.yaml"]["resources"] == ["modelserver.yaml"]


def test_xpyd_nvidia_plan_to_both_targets() -> None:
    p, docs = export(XPYD_NVIDIA, "sim:h200-8", target="ray-serve")
    assert [(i.name, i.tp) for i in p.instances] == [("prefill-0", 2), ("prefill-1", 2), ("decode-0", 4)]
    args = app_args(docs)
    prefill, decode = args["prefill_config"], args["decode_config"]
    assert prefill["deployment_config"] == {"num_replicas": 2} and decode["deployment_config"] == {"num_replicas": 1}
    assert prefill["engine_kwargs"]["tensor_parallel_size"] == 2 and decode["engine_kwargs"]["tensor_parallel_size"] == 4
    assert prefill["engine_kwargs"]["kv_transfer_config"] == {
        "kv_connector": "NixlConnector", "kv_role": "kv_producer",
        "kv_connector_extra_config": {"enable_cross_layers_blocks": True}}
    assert prefill["engine_kwargs"]["block_size"] == decode["engine_kwargs"]["block_size"] == 128
    assert prefill["experimental_configs"] == {"NIXL_SIDE_CHANNEL_PORT_BASE": p.instances[0].ports["side_channel"][0]}
    assert decode["runtime_env"]["env_vars"]["UCX_TLS"] == "cuda_ipc,cuda_copy,tcp"
    assert not any(k.startswith("VLLM_NIXL") for k in decode["runtime_env"]["env_vars"])
    assert prefill["accelerator_type"] == "H200"

    _, docs = export(XPYD_NVIDIA, "sim:h200-8", target="llm-d")
    pre, dec = docs["llm-d/modelserver.yaml"]
    assert (pre["spec"]["replicas"], dec["spec"]["replicas"]) == (2, 1)
    assert containers(pre)["vllm"]["resources"]["limits"] == {"nvidia.com/gpu": "2"}
    assert containers(dec)["vllm"]["resources"]["limits"] == {"nvidia.com/gpu": "4"}
    env = {e["name"]: e for e in containers(dec)["vllm"]["env"]}
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["UCX_TLS"]["value"] == "cuda_ipc,cuda_copy,tcp"
    # A hub model needs no volume; the sidecar speaks NIXL without MoRIIO flags.
    assert [v["name"] for v in pre["spec"]["template"]["spec"]["volumes"]] == ["shm"]
    assert not any(a.startswith("--moriio") for a in containers(dec)["routing-proxy"]["args"])


def test_autoscaling_bounds_and_dp_groups() -> None:
    overrides = {**XPYD_NVIDIA, "decode": {"gpu_count": 4, "dp": 2}}
    _, docs = export(overrides, "sim:h200-8", target="ray-serve", prefill_replicas="1:6", decode_replicas="3")
    args = app_args(docs)
    assert args["prefill_config"]["deployment_config"] == {
        "autoscaling_config": {"min_replicas": 1, "max_replicas": 6, "initial_replicas": 2}}
    decode = args["decode_config"]
    assert decode["deployment_config"] == {"num_replicas": 3}  # DP groups: Ray multiplies by DP itself
    assert decode["engine_kwargs"]["data_parallel_size"] == 2 and decode["engine_kwargs"]["tensor_parallel_size"] == 2
    assert "data_parallel_rpc_port" not in decode["engine_kwargs"]
    # the KV events go to the node's own proxy (prefix affinity): a cluster has none listening there
    affinity = {**overrides, "proxy": {"routing": "prefix_affinity"}}
    _, docs = export(affinity, "sim:h200-8", target="ray-serve")
    assert all("kv_events_config" not in app_args(docs)[f"{role}_config"]["engine_kwargs"] for role in ("prefill", "decode"))
    _, docs = export(affinity, "sim:h200-8", target="llm-d")
    assert not any("kv-events" in arg for pod in docs["llm-d/modelserver.yaml"] for arg in containers(pod)["vllm"]["args"])
    with pytest.raises(ExportError, match="replica ranges are a Ray Serve option"):
        export(XPYD_NVIDIA, "sim:h200-8", target="llm-d", prefill_replicas="1:6")


@pytest.mark.parametrize(("overrides", "inventory", "target", "message"), [
    ({"connector": {"name": "none"}}, "sim:h200-8", "ray-serve", "colocated"),
    ({"connector": {"name": "example"}}, "sim:cpu", "llm-d", "GPU nodes"),
    ({**XPYD_NVIDIA, "engine": {"kind": "sim"}}, "sim:h200-8", "llm-d", "simulated engine"),
])
def test_plans_a_target_cannot_express(overrides: dict[str, Any], inventory: str, target: str, message: str) -> None:
    with pytest.raises(ExportError, match=message) as info:
        export(overrides, inventory, target=target)
    assert info.value.fix


def test_engine_arguments_round_trip() -> None:
    argv = ["py", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m", "--tensor-parallel-size", "4",
            "--enable-expert-parallel", "--no-enable-prefix-caching", "--gpu-memory-utilization", "0.9",
            "--kv-transfer-config", '{"kv_connector":"NixlConnector","kv_role":"kv_consumer"}', "--dtype=bfloat16"]
    kwargs = engine_kwargs_from_argv(argv)
    assert kwargs == {"model": "/m", "tensor_parallel_size": 4, "enable_expert_parallel": True,
                      "enable_prefix_caching": False, "gpu_memory_utilization": 0.9,
                      "kv_transfer_config": {"kv_connector": "NixlConnector", "kv_role": "kv_consumer"},
                      "dtype": "bfloat16"}
    assert engine_kwargs_from_argv(["x", "vllm.entrypoints.openai.api_server", *argv_from_engine_kwargs(kwargs)]) == kwargs


@pytest.mark.parametrize("text", ["zero", "4:1", "-1", "0:0", "1:x"])
def test_bad_replica_counts(text: str) -> None:
    with pytest.raises(ExportError):
        parse_replicas(text, 1, "--decode-replicas")


def test_write_files_is_atomic_and_reports_unwritable(tmp_path: Path) -> None:
    target = tmp_path / "out"
    paths = write_files(target, {"a/b.yaml": "x: 1\n"})
    assert [p.read_text() for p in paths] == ["x: 1\n"]
    assert not [p for p in (target / "a").iterdir() if p.name.endswith(".tmp")]
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ExportError, match="cannot write"):
        write_files(blocker, {"x.yaml": ""})


@pytest.fixture(autouse=True)
def _state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The shipped file's state_dir is the host's /var/lib/pdctl, whose layout.json `pdctl export` would apply.
    monkeypatch.setenv("PDCTL_STATE_DIR", str(tmp_path / "state"))


def pdctl(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("PDCTL_") or k == "PDCTL_STATE_DIR"}
    base["PDCTL_CONFIG"] = str(REPO / "etc" / "pdctl.toml")
    return subprocess.run([sys.executable, "-m", "appliance", *args], capture_output=True, text=True,
                          env={**base, **(env or {})}, timeout=120)


def test_cli_writes_both_targets_from_the_settings_file(tmp_path: Path) -> None:
    for target in ("ray-serve", "llm-d"):
        r = pdctl("export", "--target", target, "--out", str(tmp_path), "--inventory", "sim:mi300x-8")
        assert r.returncode == 0, r.stderr
        assert "next, on the cluster:" in r.stdout
    serve = yaml.safe_load((tmp_path / "ray-serve" / "serve.yaml").read_text())
    assert serve["applications"][0]["args"]["decode_config"]["model_loading_config"]["model_id"] == "qwen3-235b"
    assert (tmp_path / "llm-d" / "modelserver.yaml").exists() and (tmp_path / "llm-d" / "kustomization.yaml").exists()


def test_cli_errors_are_one_line(tmp_path: Path) -> None:
    cases = [
        ("export", "--target", "llm-d", "--out", str(tmp_path), "--connector", "none", "--inventory", "sim:h200-8"),
        ("export", "--target", "llm-d", "--out", str(tmp_path), "--inventory", "sim:cpu", "--connector", "example"),
        ("export", "--target", "ray-serve", "--out", str(tmp_path), "--inventory", "sim:mi300x-8",
         "--decode-replicas", "3:1"),
    ]
    for args in cases:
        r = pdctl(*args)
        assert r.returncode != 0, args
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("pdctl: error:") and "fix:" in lines[0], (args, r.stderr)


def test_cli_exports_the_layout_a_rebalance_left(tmp_path: Path) -> None:
    """`pdctl export` writes the shape that runs here: layout.json over pdctl.toml, as `plan` and `up` see it."""
    from appliance.node import pinned

    state = tmp_path / "state"
    state.mkdir()
    rebalanced = plan(Settings.model_validate({**REFERENCE, "prefill": {"gpus": [0, 1], "tp": 2},
                                               "decode": {"gpus": [2, 3, 4, 5, 6, 7], "instances": 3, "tp": 2}}),
                      load_inventory("sim:mi300x-8"))
    (state / "layout.json").write_text(json.dumps({"written_by": "pdctl rebalance", "overrides": pinned(rebalanced)}))
    r = pdctl("export", "--target", "ray-serve", "--out", str(tmp_path / "out"), "--inventory", "sim:mi300x-8",
              env={"PDCTL_STATE_DIR": str(state)})
    assert r.returncode == 0, r.stderr
    args = yaml.safe_load((tmp_path / "out" / "ray-serve" / "serve.yaml").read_text())["applications"][0]["args"]
    assert args["prefill_config"]["engine_kwargs"]["tensor_parallel_size"] == 2
    assert args["decode_config"]["engine_kwargs"]["tensor_parallel_size"] == 2


# An [engine] env secret (a name the units keep in 0600 files) beside a plain variable.
SECRET = "hf_do_not_commit_0123456789"
WITH_SECRET = {**XPYD_NVIDIA, "engine": {"env": {"HF_TOKEN": SECRET, "NCCL_DEBUG": "WARN"}}}


def test_secret_env_is_a_reference_never_a_value() -> None:
    """[engine] env secrets reach neither file meant to be committed: llm-d's pods read them from a Secret
    (secretKeyRef), Ray expands ${HF_TOKEN} from its nodes' environment; plain variables keep their values."""
    for target in ("ray-serve", "llm-d"):
        settings, p = make_plan(WITH_SECRET, "sim:h200-8")
        result = build_export(p, settings, ExportOptions(target=target), load_inventory("sim:h200-8"))
        assert not [name for name, text in result.files.items() if SECRET in text], target
        assert any("HF_TOKEN" in note for note in result.notes), result.notes
    _, docs = export(WITH_SECRET, "sim:h200-8", target="ray-serve")
    for cfg in app_args(docs).values():
        assert cfg["runtime_env"]["env_vars"]["HF_TOKEN"] == "${HF_TOKEN}"
        assert cfg["runtime_env"]["env_vars"]["NCCL_DEBUG"] == "WARN"
    _, docs = export(WITH_SECRET, "sim:h200-8", target="llm-d")
    for dep in docs["llm-d/modelserver.yaml"]:
        env = {e["name"]: e for e in containers(dep)["vllm"]["env"]}
        assert env["HF_TOKEN"] == {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": f"{dep['metadata']['name'].rsplit('-', 1)[0]}-env", "key": "HF_TOKEN"}}}
        assert env["NCCL_DEBUG"]["value"] == "WARN"


@pytest.mark.parametrize("breaker", ["\n", "\r", "\x85", "\u2028"])
def test_a_line_break_in_a_value_adds_no_key(breaker: str) -> None:
    """A model path holding a line break stays inside its comment and its string: serve.yaml and the manifests
    load to exactly the keys pdctl writes, and the path reads back whole."""
    path = f"/models/x{breaker}injected: true{breaker}proxy_location: Disabled"
    hostile = {**XPYD_NVIDIA, "model": {"path": path, "served_name": "qwen3-32b"}}
    _, docs = export(hostile, "sim:h200-8", target="ray-serve")
    serve = docs["ray-serve/serve.yaml"]
    assert set(serve) == {"proxy_location", "http_options", "applications"} and serve["proxy_location"] == "EveryNode"
    assert app_args(docs)["decode_config"]["model_loading_config"]["model_source"] == path
    _, docs = export(hostile, "sim:h200-8", target="llm-d")
    for dep in docs["llm-d/modelserver.yaml"]:
        assert set(dep) == {"apiVersion", "kind", "metadata", "spec"}
        assert containers(dep)["vllm"]["args"][0] == path


@pytest.mark.parametrize("key, value", [("slo.ttft_ms", "inf"), ("slo.itl_ms", "nan"),
                                         ("proxy.limits.body_timeout_s", "inf"),
                                         ("engine.sim.prefill_us_per_token", "nan"),
                                         ("connector.extra_config.x", "-inf"), ("decode.tp", "inf")])
def test_non_finite_numbers_are_refused_in_one_line(tmp_path: Path, key: str, value: str) -> None:
    """inf and nan in any setting (typed or free-form) are refused at settings time in one line, so that no
    generated file (grafana.json, engine argv JSON, proxy.json) can carry them."""
    *tables, name = key.split(".")
    toml = tmp_path / "pdctl.toml"
    toml.write_text(f"[{'.'.join(tables)}]\n{name} = {value}\n")
    r = pdctl("export", "grafana", "-o", str(tmp_path / "g.json"), env={"PDCTL_CONFIG": str(toml)})
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode != 0 and len(lines) == 1 and key in lines[0] and "finite" in lines[0], r.stderr
    assert not (tmp_path / "g.json").exists()


def test_grafana_export_is_strict_json(tmp_path: Path) -> None:
    """The dashboard `pdctl export grafana` writes parses under a JSON parser that refuses Infinity and NaN."""
    toml = tmp_path / "pdctl.toml"
    toml.write_text("[slo]\nttft_ms = 1e308\nitl_ms = 25.5\n")
    r = pdctl("export", "grafana", "-o", str(tmp_path / "g.json"), env={"PDCTL_CONFIG": str(toml)})
    assert r.returncode == 0, r.stderr

    def refuse(constant: str) -> None:
        raise ValueError(f"not JSON: {constant}")

    board = json.loads((tmp_path / "g.json").read_text(), parse_constant=refuse)
    assert board["panels"]
