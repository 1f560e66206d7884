"""`pdctl export`: write the node's plan as a Ray Serve LLM app or llm-d manifests, for when one node is not enough."""

from __future__ import annotations

from typing import Any

import click

from appliance.cli.options import layout_option, node_overrides, obtain, obtain_plan, plan_options
from appliance.export import TARGETS, ExportOptions, build_export, write_files
from appliance.node import Node


@click.command()
@click.option("--target", type=click.Choice(TARGETS), required=True, help="Cluster engine to hand off to.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="export", show_default=True,
              help="Directory to write into (ray-serve/ or llm-d/ below it).")
@click.option("--model-source", help="Where cluster nodes load the model: a hub name or a path [default: the plan's].")
@click.option("--prefill-replicas", metavar="N|MIN:MAX",
              help="Prefill replicas (default: the plan's instances); MIN:MAX autoscales (ray-serve).")
@click.option("--decode-replicas", metavar="N|MIN:MAX", help="Decode replicas, as --prefill-replicas.")
@click.option("--http-host", default="0.0.0.0", show_default=True, help="ray-serve: Serve's HTTP host.")
@click.option("--http-port", type=click.IntRange(1, 65535), help="ray-serve: Serve's HTTP port [default: proxy.port].")
@click.option("--namespace", default="llm-d", show_default=True, help="llm-d: Kubernetes namespace.")
@click.option("--image", help="llm-d: vLLM image [default: ghcr.io/llm-d/llm-d-rocm or -cuda].")
@click.option("--sidecar-image", help="llm-d: routing sidecar image.")
@click.option("--model-pvc", default="model-weights", show_default=True,
              help="llm-d: PVC holding a local model directory.")
@plan_options
@layout_option
@click.pass_context
def export(ctx: click.Context, /, target: str, out_dir: str, model_source: str | None, prefill_replicas: str | None,
           decode_replicas: str | None, http_host: str, http_port: int | None, namespace: str, image: str | None,
           sidecar_image: str | None, model_pvc: str, **plan_flags: Any) -> None:
    """Write the plan as a multi-node deployment: same model, roles, parallelism and KV connector."""
    # The shape that runs here: a rebalance's layout.json over pdctl.toml (unless --ignore-layout), as `pdctl plan`
    # and `pdctl up` see it.
    node_settings, _ = obtain(ctx)
    overrides, layout_note = node_overrides(Node(node_settings), plan_flags)
    # A cluster runs real vLLM whatever this node's engine.kind says.
    overrides.setdefault("engine", {})["kind"] = "vllm"
    settings, inventory, plan_ = obtain_plan(ctx, overrides)
    options = ExportOptions(target=target, model_source=model_source, prefill_replicas=prefill_replicas,  # type: ignore[arg-type]
                            decode_replicas=decode_replicas, http_host=http_host, http_port=http_port,
                            namespace=namespace, image=image, sidecar_image=sidecar_image, model_pvc=model_pvc)
    result = build_export(plan_, settings, options, inventory)
    for path in write_files(out_dir, result.files):
        click.echo(f"wrote {path}")
    for note in ([layout_note] if layout_note else []) + result.notes:
        click.echo(f"note: {note}")
    click.echo("next, on the cluster:")
    for step in result.next_steps:
        click.echo("  " + step.replace("{out}", out_dir))
