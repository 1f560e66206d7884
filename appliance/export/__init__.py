"""Hand a plan to a cluster engine: the same model, roles, parallelism and KV connector as Ray Serve LLM
or llm-d files. Pure: Plan (+ the settings it came from) -> files; `write_files` is the only side effect."""

from __future__ import annotations

from dataclasses import dataclass

from appliance.errors import ExportError
from appliance.export.cluster import (
    ExportResult,
    Target,
    check_exportable,
    parse_replicas,
    role_shape,
    write_files,
)
from appliance.inventory.models import Inventory
from appliance.plan import Plan
from appliance.settings import Settings

__all__ = ["ExportError", "ExportOptions", "ExportResult", "TARGETS", "build_export", "write_files"]

TARGETS: tuple[Target, ...] = ("ray-serve", "llm-d")


@dataclass(frozen=True)
class ExportOptions:
    """What the plan does not say about a cluster: where the model comes from, images, names, scaling."""

    target: Target
    model_source: str | None = None  # default: the plan's model path
    prefill_replicas: str | None = None  # "N" or "MIN:MAX"; default: the plan's prefill instances
    decode_replicas: str | None = None
    # ray-serve: where Serve's HTTP proxy listens on every node; loopback as pdctl's own listeners, since
    # Serve asks no client for a key (docs/threat-model.md): 0.0.0.0 is the user's choice, behind their own
    http_host: str = "127.0.0.1"
    http_port: int | None = None  # ray-serve: default the pdctl proxy's port
    namespace: str = "llm-d"  # llm-d
    image: str | None = None  # llm-d: the vLLM image
    sidecar_image: str | None = None  # llm-d: the routing sidecar image
    model_pvc: str = "model-weights"  # llm-d: the PVC holding a local model directory


def build_export(plan: Plan, settings: Settings, options: ExportOptions, inventory: Inventory | None = None
                 ) -> ExportResult:
    """The target's files for the plan, or an ExportError saying what to change."""
    check_exportable(plan, options.target)
    prefill = role_shape(plan, "prefill", parse_replicas(options.prefill_replicas,
                                                         len(plan.role_instances("prefill")), "--prefill-replicas"))
    decode = role_shape(plan, "decode", parse_replicas(options.decode_replicas,
                                                       len(plan.role_instances("decode")), "--decode-replicas"))
    model_source = options.model_source or plan.model.path
    if options.target == "ray-serve":
        from appliance.export import ray_serve

        gpus = inventory.gpus if inventory else []
        return ray_serve.export(plan, prefill, decode, model_source=model_source,
                                gpu_name=gpus[0].name if gpus else None, http_host=options.http_host,
                                http_port=options.http_port or plan.proxy.port)
    if options.target == "llm-d":
        from appliance.export import llm_d

        return llm_d.export(plan, prefill, decode, model_source=model_source, namespace=options.namespace,
                            image=options.image, sidecar_image=options.sidecar_image, model_pvc=options.model_pvc,
                            health_timeout_s=settings.engine.health_timeout_s)
    raise ExportError(f"unknown export target '{options.target}'", fix=f"use one of {', '.join(TARGETS)}")
