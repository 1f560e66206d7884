"""`pdctl export`: write the node's plan as a Ray Serve LLM app or llm-d manifests, for when one node is not enough;
`pdctl export grafana|prometheus`: the node's dashboard and the scrape config that feeds it."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from appliance.cli.options import layout_option, node_overrides, obtain, obtain_plan, plan_options
from appliance.export import TARGETS, ExportError, ExportOptions, build_export, write_files
from appliance.node import Node
from appliance.settings import Settings, load_settings


@click.group(invoke_without_command=True)
@click.option("--target", type=click.Choice(TARGETS), help="Cluster engine to hand off to.")
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
def export(ctx: click.Context, /, target: str | None, out_dir: str, model_source: str | None, prefill_replicas: str | None,
           decode_replicas: str | None, http_host: str, http_port: int | None, namespace: str, image: str | None,
           sidecar_image: str | None, model_pvc: str, **plan_flags: Any) -> None:
    """Write the plan as a multi-node deployment (--target), or the node's Grafana dashboard or Prometheus config.

    `pdctl export --target ray-serve|llm-d` keeps the model, roles, parallelism and KV connector;
    `pdctl export grafana` and `pdctl export prometheus` are the node's monitoring."""
    if ctx.invoked_subcommand is not None:
        given = [f"--{name.replace('_', '-')}" for name in ctx.params
                 if ctx.get_parameter_source(name) not in (click.core.ParameterSource.DEFAULT, None)]
        if given:
            raise ExportError(f"{', '.join(given)}: an option of `pdctl export --target`, not of "
                              f"`pdctl export {ctx.invoked_subcommand}`",
                              fix=f"run `pdctl export {ctx.invoked_subcommand} --help` for its options")
        return
    if target is None:
        raise ExportError("say what to export: --target ray-serve|llm-d, or grafana or prometheus",
                          fix="run `pdctl export --help`")
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


def _settings(ctx: click.Context) -> Settings:
    """The node's settings (no inventory: monitoring depends on none)."""
    return load_settings((ctx.find_root().obj or {}).get("config_path"))


def _emit(text: str, out: str | None) -> None:
    """`text` to stdout, or atomically to the file `out`."""
    if out is None:
        sys.stdout.write(text)
        return
    path = Path(out)
    for written in write_files(path.parent, {path.name: text}, fix="choose a writable path for -o"):
        click.echo(f"wrote {written}", err=True)


@export.command()
@click.option("-o", "--output", "out", type=click.Path(dir_okay=False), help="Write the JSON here [default: stdout].")
@click.pass_context
def grafana(ctx: click.Context, /, out: str | None) -> None:
    """The node's Grafana dashboard (JSON), with the [slo] bounds of its settings; docs/grafana.md says how to
    import it."""
    from appliance.export.grafana import dashboard

    # strict JSON: Grafana's import refuses Infinity and NaN (settings refuse them first; this is the guard)
    _emit(json.dumps(dashboard(_settings(ctx).slo), indent=2, allow_nan=False) + "\n", out)


@export.command()
@click.option("-o", "--output", "out", type=click.Path(dir_okay=False), help="Write the YAML here [default: stdout].")
@click.option("--host", help="Address Prometheus reaches the node at [default: the deployed plan's addresses].")
@click.pass_context
def prometheus(ctx: click.Context, /, out: str | None, host: str | None) -> None:
    """Prometheus scrape_configs for the deployed node: the proxy's /metrics and each engine's."""
    from appliance.export.cluster import to_yaml
    from appliance.export.grafana import scrape_config

    plan_ = Node(_settings(ctx)).deployed()
    header = "# pdctl node: the proxy's and the engines' /metrics, written by `pdctl export prometheus`.\n"
    _emit(header + to_yaml(scrape_config(plan_, host)), out)
