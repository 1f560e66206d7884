"""llm-d target: prefill and decode Deployments in llm-d's P/D layout, plus the InferencePool values.

The layout follows llm-d's P/D guides: both roles carry `llm-d.ai/inferenceServing: "true"` and an
`llm-d.ai/role` label the scheduler's prefill/decode filters select on; prefill serves vLLM on 8000; decode
runs vLLM on 8200 behind llm-d's routing sidecar on 8000 (a native sidecar: an init container with
restartPolicy Always), which runs the prefill leg and hands the KV over with the same connector as the node.
GPUs per pod are the plan's GPUs per instance (amd.com/gpu on AMD, nvidia.com/gpu on NVIDIA).
"""

from __future__ import annotations

import math
import posixpath
from typing import Any

from appliance.connector import LlmdPod, get_connector
from appliance.errors import ExportError
from appliance.export.cluster import (
    ExportResult,
    RoleShape,
    argv_from_engine_kwargs,
    comment,
    dns_label,
    target_connectors,
    to_yaml,
    to_yaml_all,
)
from appliance.plan import Plan

# The Kubernetes release whose object schemas the tests validate against (kubernetes-validate, strict).
KUBERNETES_VERSION = "1.33.0"
GPU_RESOURCE = {"rocm": "amd.com/gpu", "cuda": "nvidia.com/gpu"}
DEFAULT_IMAGE = {"rocm": "ghcr.io/llm-d/llm-d-rocm", "cuda": "ghcr.io/llm-d/llm-d-cuda"}
DEFAULT_SIDECAR_IMAGE = "ghcr.io/llm-d/llm-d-routing-sidecar"
SERVE_PORT = 8000  # what the InferencePool targets on every pod: prefill's vLLM, decode's sidecar
DECODE_VLLM_PORT = 8200  # decode's vLLM, behind the sidecar
PROBE_PERIOD_S = 30
POD_IP = {"valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}


def _pod(plan: Plan, shape: RoleShape, vllm_port: int) -> LlmdPod:
    """What one role's pods need for the plan's connector (the connector module says)."""
    pod = get_connector(plan.connector).llm_d(shape.kv_transfer_config, shape.ports, plan.mode, vllm_port,
                                              shape.tp, shape.dp)
    if pod is None:
        raise ExportError(
            f"connector '{plan.connector}' is not one llm-d's routing sidecar drives",
            fix=f"use {target_connectors('llm-d')}",
        )
    return pod


def _ports(pod: LlmdPod, shape: RoleShape, vllm_port: int) -> list[dict[str, Any]]:
    ports: list[dict[str, Any]] = [{"name": "vllm", "containerPort": vllm_port, "protocol": "TCP"}]
    for purpose, numbers in shape.ports.items():
        if purpose not in pod.port_names:
            continue
        for rank, number in enumerate(numbers):
            ports.append({"name": f"{pod.port_names[purpose]}-{rank}", "containerPort": number, "protocol": "TCP"})
    return ports


def _model_volume(model_source: str, pvc: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A local model directory comes from a PVC mounted at its parent; a hub name needs no volume."""
    if not model_source.startswith("/"):
        return [], []
    parent = posixpath.dirname(model_source.rstrip("/")) or "/"
    mounts = [{"name": "model", "mountPath": parent, "readOnly": True}]
    volumes = [{"name": "model", "persistentVolumeClaim": {"claimName": pvc, "readOnly": True}}]
    return mounts, volumes


def _secret_ref(secret: str, key: str) -> dict[str, Any]:
    """An env entry whose value Kubernetes reads from key `key` of Secret `secret`: the manifest holds no value."""
    return {"name": key, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}


def _vllm_container(plan: Plan, shape: RoleShape, *, image: str, model_source: str, vllm_port: int,
                    health_timeout_s: float, model_mounts: list[dict[str, Any]], env_secret: str) -> dict[str, Any]:
    pod = _pod(plan, shape, vllm_port)
    args = [model_source, f"--served-model-name={plan.model.served_name}", f"--port={vllm_port}",
            *argv_from_engine_kwargs({**shape.engine_kwargs, "kv_transfer_config": pod.kv_transfer_config})]
    env = ([{"name": k, "value": v} for k, v in shape.env.items()] + [_secret_ref(env_secret, k) for k in shape.secret_env]
           + [{"name": k, **POD_IP} for k in pod.pod_ip_env] + [{"name": k, "value": v} for k, v in pod.env.items()])
    gpus = {GPU_RESOURCE[plan.platform]: str(shape.gpus_per_replica)}
    container: dict[str, Any] = {
        "name": "vllm",
        "image": image,
        "command": ["vllm", "serve"],
        "args": args,
        "env": env,
        "ports": _ports(pod, shape, vllm_port),
        "resources": {"limits": dict(gpus), "requests": dict(gpus)},
        "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}, *model_mounts],
        # The same patience as the node's health_timeout_s: a large model loads for many minutes.
        "startupProbe": {
            "httpGet": {"path": "/health", "port": vllm_port},
            "periodSeconds": PROBE_PERIOD_S,
            "failureThreshold": max(1, math.ceil(health_timeout_s / PROBE_PERIOD_S)),
        },
        "readinessProbe": {"httpGet": {"path": "/v1/models", "port": vllm_port}, "periodSeconds": 10},
        "livenessProbe": {"httpGet": {"path": "/health", "port": vllm_port}, "periodSeconds": 10,
                          "failureThreshold": 3},
    }
    if pod.ipc_lock:
        container["securityContext"] = {"capabilities": {"add": ["IPC_LOCK"]}}
    return container


def _sidecar(plan: Plan, decode: RoleShape, image: str) -> dict[str, Any]:
    args = [f"--port={SERVE_PORT}", f"--vllm-port={DECODE_VLLM_PORT}", "--kv-connector=nixlv2",
            "--secure-proxy=false"]
    env: list[dict[str, Any]] = []
    if decode.dp > 1:
        args.append(f"--data-parallel-size={decode.dp}")
    args += _pod(plan, decode, DECODE_VLLM_PORT).sidecar_args
    if any("$(POD_IP)" in arg for arg in args):
        env.append({"name": "POD_IP", **POD_IP})
    sidecar: dict[str, Any] = {
        "name": "routing-proxy",
        "image": image,
        "args": args,
        "ports": [{"name": "sidecar", "containerPort": SERVE_PORT, "protocol": "TCP"}],
        "restartPolicy": "Always",
        "securityContext": {"allowPrivilegeEscalation": False, "runAsNonRoot": True},
    }
    if env:
        sidecar["env"] = env
    return sidecar


def deployment(plan: Plan, shape: RoleShape, *, name: str, labels: dict[str, str], image: str, sidecar_image: str,
               model_source: str, model_pvc: str, health_timeout_s: float, env_secret: str) -> dict[str, Any]:
    """One role's apps/v1 Deployment (as data)."""
    vllm_port = DECODE_VLLM_PORT if shape.role == "decode" else SERVE_PORT
    mounts, volumes = _model_volume(model_source, model_pvc)
    pod_labels = {**labels, "llm-d.ai/role": shape.role}
    spec: dict[str, Any] = {
        "containers": [_vllm_container(plan, shape, image=image, model_source=model_source, vllm_port=vllm_port,
                                       health_timeout_s=health_timeout_s, model_mounts=mounts,
                                       env_secret=env_secret)],
        "volumes": [{"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}}, *volumes],
        "terminationGracePeriodSeconds": 90,
    }
    if shape.role == "decode":
        spec["initContainers"] = [_sidecar(plan, shape, sidecar_image)]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": f"{name}-{shape.role}", "labels": pod_labels},
        "spec": {
            "replicas": shape.replicas.min,
            "selector": {"matchLabels": pod_labels},
            "template": {"metadata": {"labels": pod_labels}, "spec": spec},
        },
    }


def inferencepool_values(labels: dict[str, str]) -> dict[str, Any]:
    """Values for the InferencePool chart with llm-d's scheduler and its prefill/decode profiles."""
    pd_config = {
        "apiVersion": "inference.networking.x-k8s.io/v1alpha1",
        "kind": "EndpointPickerConfig",
        "plugins": [
            {"type": "prefill-header-handler"},
            {"type": "prefill-filter"},
            {"type": "decode-filter"},
            {"type": "max-score-picker"},
            {"type": "queue-scorer"},
            # threshold 0: every request is disaggregated, as on the pdctl node.
            {"type": "pd-profile-handler", "parameters": {"threshold": 0}},
        ],
        "schedulingProfiles": [
            {"name": "prefill", "plugins": [{"pluginRef": "prefill-filter"},
                                            {"pluginRef": "queue-scorer", "weight": 1.0},
                                            {"pluginRef": "max-score-picker"}]},
            {"name": "decode", "plugins": [{"pluginRef": "decode-filter"},
                                           {"pluginRef": "queue-scorer", "weight": 1.0},
                                           {"pluginRef": "max-score-picker"}]},
        ],
    }
    return {
        "inferenceExtension": {
            "image": {"name": "llm-d-inference-scheduler", "hub": "ghcr.io/llm-d"},
            "pluginsConfigFile": "pd-config.yaml",
            "pluginsCustomConfig": {"pd-config.yaml": to_yaml(pd_config)},
        },
        "inferencePool": {"modelServers": {"matchLabels": dict(labels)}},
    }


def export(plan: Plan, prefill: RoleShape, decode: RoleShape, *, model_source: str, namespace: str,
           image: str | None, sidecar_image: str | None, model_pvc: str, health_timeout_s: float) -> ExportResult:
    """The llm-d files for the plan: modelserver.yaml, kustomization.yaml, inferencepool.values.yaml."""
    if plan.platform not in GPU_RESOURCE:
        raise ExportError("llm-d runs on GPU nodes and this plan is for the CPU",
                          fix="plan for the cluster's nodes, e.g. --inventory sim:mi300x-8 or sim:h200-8")
    for shape in (prefill, decode):
        if not shape.replicas.fixed:
            raise ExportError(
                f"{shape.role}: replica ranges are a Ray Serve option; llm-d's Deployments get a fixed count",
                fix=f"give --{shape.role}-replicas a single number (llm-d scales with its workload-variant-autoscaler)",
            )
    name = dns_label(f"pdctl-{plan.model.served_name}")
    labels = {"llm-d.ai/inferenceServing": "true", "llm-d.ai/model": dns_label(plan.model.served_name, 63),
              "app.kubernetes.io/managed-by": "pdctl"}
    common: dict[str, Any] = {"name": name, "labels": labels, "image": image or DEFAULT_IMAGE[plan.platform],
              "sidecar_image": sidecar_image or DEFAULT_SIDECAR_IMAGE, "model_source": model_source,
              "model_pvc": model_pvc, "health_timeout_s": health_timeout_s, "env_secret": f"{name}-env"}
    objects = [deployment(plan, prefill, **common), deployment(plan, decode, **common)]
    header = "".join(comment(line) for line in (
        "llm-d prefill/decode model servers, written by `pdctl export --target llm-d`.",
        f"From the pdctl plan: {plan.platform}, connector {plan.connector} ({plan.mode}), "
        f"{prefill.replicas.min} prefill x {prefill.gpus_per_replica} GPU, "
        f"{decode.replicas.min} decode x {decode.gpus_per_replica} GPU.",
        f"Validated against the Kubernetes {KUBERNETES_VERSION} object schemas (strict).",
    ))
    manifests = header + to_yaml_all(objects)
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "namespace": namespace,
        "resources": ["modelserver.yaml"],
    }
    values = inferencepool_values(labels)
    notes = list(_pod(plan, prefill, SERVE_PORT).notes)
    secrets = sorted({*prefill.secret_env, *decode.secret_env})
    create_secret = []
    if secrets:
        # the manifests reference the values; the Secret holding them is made apart, never written by pdctl
        literals = " ".join(f"--from-literal={k}=..." for k in secrets)
        create_secret = [f"kubectl create secret generic {name}-env -n {namespace} {literals}"]
        notes.append(f"the pods read {', '.join(secrets)} from Secret {name}-env, which you create (see the next "
                     "steps): modelserver.yaml holds no secret value")
    if model_source.startswith("/"):
        notes.append(f"pods mount PVC '{model_pvc}' at {posixpath.dirname(model_source.rstrip('/'))}: it must hold "
                     f"{posixpath.basename(model_source.rstrip('/'))}/ (or pass --model-source HUB/NAME)")
    return ExportResult(
        target="llm-d",
        files={
            "llm-d/modelserver.yaml": manifests,
            "llm-d/kustomization.yaml": to_yaml(kustomization),
            "llm-d/inferencepool.values.yaml": to_yaml(values),
        },
        next_steps=[
            f"kubectl create namespace {namespace}   # llm-d's prerequisites (Gateway API + inference CRDs) installed",
            *create_secret,
            "kubectl apply -k {out}/llm-d/",
            f"helm install {name} oci://registry.k8s.io/gateway-api-inference-extension/charts/inferencepool "
            f"-n {namespace} -f {{out}}/llm-d/inferencepool.values.yaml   # then route your Gateway's HTTPRoute to it",
        ],
        notes=notes,
    )
