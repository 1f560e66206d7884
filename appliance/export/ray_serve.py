"""Ray Serve LLM target: one serve config (`serve deploy`) running `ray.serve.llm:build_pd_openai_app`.

Each role becomes an LLMConfig (model, engine_kwargs with the same parallelism, vLLM flags and
kv_transfer_config as the node) and a deployment_config with the plan's replica count or autoscaling bounds.
Ray Serve's own orchestrator replaces pdctl's proxy: it picks a prefill replica, shapes the request for the
connector (NIXL, MoRIIO READ/WRITE, or the default protocol for ExampleConnector) and streams from decode.
"""

from __future__ import annotations

from typing import Any

from appliance.export.cluster import (
    ExportError,
    ExportResult,
    Replicas,
    RoleShape,
    dns_label,
    strip_moriio_node_keys,
    to_yaml,
)
from appliance.plan import Plan

IMPORT_PATH = "ray.serve.llm:build_pd_openai_app"
# The Ray release whose schemas the tests validate against (see tests/export/install_tools.sh).
RAY_VERSION = "2.60.0"

# Ray's accelerator_type names (ray.util.accelerators) for the GPU names pdctl's inventory reports.
_ACCELERATOR_TYPES = [
    ("mi300x", "AMD-Instinct-MI300X-OAM"),
    ("mi325x", "AMD-Instinct-MI325X-OAM"),
    ("mi350x", "AMD-Instinct-MI350X-OAM"),
    ("mi355x", "AMD-Instinct-MI355X-OAM"),
    ("mi308x", "AMD-Instinct-MI308X"),
    ("mi300a", "AMD-Instinct-MI300A"),
    ("gb200", "GB200"),
    ("gb300", "GB300"),
    ("b200", "B200"),
    ("b300", "B300"),
    ("h200", "H200"),
    ("h100", "H100"),
    ("h20", "H20"),
    ("a100", "A100"),
    ("l40s", "L40S"),
]


def accelerator_type(gpu_name: str | None) -> str | None:
    """Ray's accelerator_type for a GPU name ('AMD Instinct MI300X' -> 'AMD-Instinct-MI300X-OAM'), or None."""
    if not gpu_name:
        return None
    lowered = gpu_name.lower().replace(" ", "").replace("-", "")
    for key, value in _ACCELERATOR_TYPES:
        if key in lowered:
            return value
    return None


def _deployment_config(replicas: Replicas) -> dict[str, Any]:
    if replicas.fixed:
        return {"num_replicas": replicas.min}
    # For DP > 1, Ray counts a DP group as one replica and multiplies these bounds by the DP size itself.
    return {
        "autoscaling_config": {
            "min_replicas": replicas.min,
            "max_replicas": replicas.max,
            "initial_replicas": replicas.initial,
        }
    }


def _kv_config(plan: Plan, shape: RoleShape) -> tuple[dict[str, Any], dict[str, Any]]:
    """(kv_transfer_config, experimental_configs) for Ray's connector backend of the plan's connector."""
    kv = shape.kv_transfer_config
    experimental: dict[str, Any] = {}
    if plan.connector == "moriio":
        kv = strip_moriio_node_keys(kv)
        extra = kv["kv_connector_extra_config"]
        # Ray's MoRIIO backend derives each replica's ports from these bases (plus a replica offset) and
        # overwrites the per-engine keys, so the node's bases move to where it reads them.
        experimental["MORI_HANDSHAKE_PORT_BASE"] = int(extra.pop("handshake_port", shape.ports["handshake"][0]))
        experimental["MORI_NOTIFY_PORT_BASE"] = int(extra.pop("notify_port", shape.ports["notify"][0]))
    elif plan.connector == "nixl":
        if plan.mode == "write":
            raise ExportError("Ray Serve LLM's P/D router drives NIXL in READ (pull) mode only",
                              fix="export the plan with --mode read")
        # Ray's NIXL backend sets VLLM_NIXL_SIDE_CHANNEL_PORT = base + replica offset, and the host to the node IP.
        experimental["NIXL_SIDE_CHANNEL_PORT_BASE"] = shape.ports["side_channel"][0]
    elif plan.connector != "example":
        raise ExportError(f"connector '{plan.connector}' has no Ray Serve LLM backend",
                          fix="use moriio (AMD), nixl (NVIDIA) or example (CPU)")
    return kv, experimental


def llm_config(plan: Plan, shape: RoleShape, model_source: str, gpu_name: str | None) -> dict[str, Any]:
    """One role's ray.serve.llm.LLMConfig as data."""
    kv, experimental = _kv_config(plan, shape)
    config: dict[str, Any] = {
        "model_loading_config": {"model_id": plan.model.served_name, "model_source": model_source},
        "engine_kwargs": {**shape.engine_kwargs, "kv_transfer_config": kv},
        "deployment_config": _deployment_config(shape.replicas),
    }
    if plan.platform == "cpu":
        config["accelerator_config"] = {"kind": "cpu"}
    elif accel := accelerator_type(gpu_name):
        config["accelerator_type"] = accel
    if shape.env:
        config["runtime_env"] = {"env_vars": dict(shape.env)}
    if experimental:
        config["experimental_configs"] = experimental
    return config


def serve_config(plan: Plan, prefill: RoleShape, decode: RoleShape, *, model_source: str, gpu_name: str | None,
                 http_host: str, http_port: int, app_name: str | None = None) -> dict[str, Any]:
    """The `serve deploy` config (ray.serve.schema.ServeDeploySchema as data) for the plan's P/D app."""
    name = app_name or dns_label(f"pd-{plan.model.served_name}")
    return {
        "proxy_location": "EveryNode",
        "http_options": {"host": http_host, "port": http_port},
        "applications": [
            {
                "name": name,
                "route_prefix": "/",
                "import_path": IMPORT_PATH,
                "args": {
                    "prefill_config": llm_config(plan, prefill, model_source, gpu_name),
                    "decode_config": llm_config(plan, decode, model_source, gpu_name),
                },
            }
        ],
    }


def _header(plan: Plan, prefill: RoleShape, decode: RoleShape) -> str:
    def role(s: RoleShape) -> str:
        count = f"{s.replicas.min}" if s.replicas.fixed else f"{s.replicas.min}..{s.replicas.max}"
        return f"{count} x {s.role} (TP{s.tp} x DP{s.dp}, {s.gpus_per_replica or 'no'} GPU(s) each)"

    return (
        "# Ray Serve LLM prefill/decode application, written by `pdctl export --target ray-serve`.\n"
        f"# From the pdctl plan: {plan.platform}, connector {plan.connector} ({plan.mode}), model {plan.model.path}\n"
        f"#   {role(prefill)}; {role(decode)}\n"
        f"# Validated against ray[serve]=={RAY_VERSION}. Deploy: serve deploy serve.yaml (or: serve run serve.yaml)\n"
    )


def export(plan: Plan, prefill: RoleShape, decode: RoleShape, *, model_source: str, gpu_name: str | None,
           http_host: str, http_port: int) -> ExportResult:
    """The Ray Serve files for the plan: serve.yaml (no entry module is needed: the builder is Ray's own)."""
    config = serve_config(plan, prefill, decode, model_source=model_source, gpu_name=gpu_name,
                          http_host=http_host, http_port=http_port)
    text = _header(plan, prefill, decode) + to_yaml(config)
    notes = []
    if plan.connector == "example":
        path = prefill.kv_transfer_config.get("kv_connector_extra_config", {}).get("shared_storage_path")
        notes.append(f"ExampleConnector stores KV under {path}: on more than one node it must be shared storage")
        # Its producer stores the first (L-1)//B*B prompt tokens, its consumer loads (L-2)//B*B: whole blocks only.
        block = prefill.engine_kwargs.get("block_size") or "the engine's block size (128 on CPU)"
        notes.append(f"ExampleConnector hands over whole KV blocks only: a prompt of at most {block} + 1 tokens "
                     "is recomputed by decode (usage cached_tokens 0)")
    if plan.model.generate:
        notes.append(f"the embedded tiny model must exist at {model_source} on every node "
                     f"(python -m appliance.engine.tinymodel {model_source})")
    return ExportResult(
        target="ray-serve",
        files={"ray-serve/serve.yaml": text},
        next_steps=[
            f"pip install 'ray[serve,llm]=={RAY_VERSION}' on every node (or use the rayproject/ray-llm image)",
            "ray start --head   # then on each worker: ray start --address=HEAD:6379",
            "serve deploy {out}/ray-serve/serve.yaml   # the OpenAI API is on "
            f"http://HEAD:{http_port}/v1",
        ],
        notes=notes,
    )
