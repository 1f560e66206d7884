"""Ray Serve LLM target: one serve config (`serve deploy`) running `ray.serve.llm:build_pd_openai_app`.

Each role becomes an LLMConfig (model, engine_kwargs with the same parallelism, vLLM flags and
kv_transfer_config as the node) and a deployment_config with the plan's replica count or autoscaling bounds.
Ray Serve's own orchestrator replaces pdctl's proxy: it picks a prefill replica, shapes the request for the
connector (NIXL, MoRIIO READ/WRITE, or the default protocol for ExampleConnector) and streams from decode.
"""

from __future__ import annotations

from typing import Any

from appliance.connector import RayServeBackend, get_connector
from appliance.errors import ExportError
from appliance.export.cluster import (
    ExportResult,
    Replicas,
    RoleShape,
    comment,
    dns_label,
    target_connectors,
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


def _backend(plan: Plan, shape: RoleShape) -> RayServeBackend:
    """What Ray's backend for the plan's connector takes for this role (the connector module says)."""
    backend = get_connector(plan.connector).ray_serve(shape.kv_transfer_config, shape.ports, plan.mode,
                                                      shape.engine_kwargs.get("block_size"))
    if backend is None:
        raise ExportError(f"connector '{plan.connector}' has no Ray Serve LLM backend",
                          fix=f"use {target_connectors('ray-serve')}")
    return backend


def llm_config(plan: Plan, shape: RoleShape, model_source: str, gpu_name: str | None) -> dict[str, Any]:
    """One role's ray.serve.llm.LLMConfig as data."""
    backend = _backend(plan, shape)
    config: dict[str, Any] = {
        "model_loading_config": {"model_id": plan.model.served_name, "model_source": model_source},
        "engine_kwargs": {**shape.engine_kwargs, "kv_transfer_config": backend.kv_transfer_config},
        "deployment_config": _deployment_config(shape.replicas),
    }
    if plan.platform == "cpu":
        config["accelerator_config"] = {"kind": "cpu"}
    elif accel := accelerator_type(gpu_name):
        config["accelerator_type"] = accel
    # a secret is a reference Ray expands from the environment its nodes were started with (`ray start`), so
    # serve.yaml can be committed; its value never leaves this node
    env = {**shape.env, **{name: f"${{{name}}}" for name in shape.secret_env}}
    if env:
        config["runtime_env"] = {"env_vars": env}
    if backend.experimental_configs:
        config["experimental_configs"] = backend.experimental_configs
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

    return "".join(comment(line) for line in (
        "Ray Serve LLM prefill/decode application, written by `pdctl export --target ray-serve`.",
        f"From the pdctl plan: {plan.platform}, connector {plan.connector} ({plan.mode}), model {plan.model.path}",
        f"  {role(prefill)}; {role(decode)}",
        f"Validated against ray[serve]=={RAY_VERSION}. Deploy: serve deploy serve.yaml (or: serve run serve.yaml)",
    ))


def export(plan: Plan, prefill: RoleShape, decode: RoleShape, *, model_source: str, gpu_name: str | None,
           http_host: str, http_port: int) -> ExportResult:
    """The Ray Serve files for the plan: serve.yaml (no entry module is needed: the builder is Ray's own)."""
    config = serve_config(plan, prefill, decode, model_source=model_source, gpu_name=gpu_name,
                          http_host=http_host, http_port=http_port)
    text = _header(plan, prefill, decode) + to_yaml(config)
    notes = list(_backend(plan, prefill).notes)
    secrets = sorted({*prefill.secret_env, *decode.secret_env})
    if secrets:
        notes.append(f"serve.yaml references {', '.join(secrets)} as ${{NAME}}: export them in the environment of "
                     "`ray start` on every node (their values are not in the file)")
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
