"""`pdctl inventory`: the GPUs of this node, their links and what runs on them."""

from __future__ import annotations

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from appliance.cli.options import console as cli_console
from appliance.inventory import Inventory, load_inventory

_LINK_STYLE = {"XGMI": "green", "NVLINK": "green", "PCIE": "yellow", "UNKNOWN": "dim"}
_MAX_PROCESSES_SHOWN = 3


def _processes_cell(inventory: Inventory, index: int) -> str:
    gpu = inventory.by_index()[index]
    parts = []
    for proc in gpu.processes[:_MAX_PROCESSES_SHOWN]:
        memory = f" {proc.memory_used_mib} MiB" if proc.memory_used_mib is not None else ""
        parts.append(escape(f"{proc.pid} {proc.name or '?'}{memory}"))
    if len(gpu.processes) > _MAX_PROCESSES_SHOWN:
        parts.append(f"+{len(gpu.processes) - _MAX_PROCESSES_SHOWN} more")
    return "\n".join(parts) or "-"


def gpu_table(inventory: Inventory) -> Table:
    """One row per GPU: name, memory, utilisation, NUMA node, PCI address, health, processes."""
    title = f"GPUs ({inventory.source}{', ' + inventory.library if inventory.library else ''})"
    table = Table(title=title, title_justify="left")
    # AMD compute partitions: the mode, and which physical GPU each logical one is on when they are split.
    partitions = any(g.compute_partition for g in inventory.gpus)
    headers = ["#", "name", "memory used/total", "util", "NUMA", "PCI", "health", "processes"]
    if partitions:
        headers.insert(1, "partition")
    for header in headers:
        table.add_column(header, justify="right" if header in ("#", "util", "NUMA") else "left")
    for gpu in sorted(inventory.gpus, key=lambda g: g.index):
        cells = [str(gpu.index)]
        if partitions:
            on = (
                f" of GPU {gpu.physical_gpu}"
                if inventory.partitioned and gpu.physical_gpu is not None
                else ""
            )
            cells.append(f"{gpu.compute_partition or '-'}{on}")
        memory = f"{gpu.memory_used_mib:,} / {gpu.memory_total_mib:,} MiB"
        util = f"{gpu.utilization_pct:.0f}%" if gpu.utilization_pct is not None else "-"
        numa = str(gpu.numa_node) if gpu.numa_node is not None else "-"
        # Data is escaped: a name or error text holding "[...]" must not be read as rich markup.
        health = "[green]ok[/]" if gpu.healthy else f"[red]BAD[/] {escape(gpu.health_detail)}".rstrip()
        table.add_row(
            *cells,
            escape(gpu.name),
            memory,
            util,
            numa,
            gpu.pci_bdf or "-",
            health,
            _processes_cell(inventory, gpu.index),
        )
    return table


def link_matrix(inventory: Inventory) -> Table:
    """GPU-to-GPU link types (XGMI, NVLINK, PCIE) as a square matrix, like `nvidia-smi topo -m`. Compute
    partitions share their physical GPU's links: a partitioned node shows the matrix of physical GPUs, each
    through its first partition."""
    if inventory.partitioned:
        groups = inventory.physical_gpus()
        indices = [group[0] for group in groups]
        labels = {group[0]: f"GPU{n} ({group[0]}-{group[-1]})" for n, group in enumerate(groups)}
        table = Table(title="Links between physical GPUs (their partitions)", title_justify="left")
    else:
        indices = sorted(g.index for g in inventory.gpus)
        labels = {i: f"GPU{i}" for i in indices}
        table = Table(title="Links", title_justify="left")
    table.add_column("")
    for b in indices:
        table.add_column(labels[b].split(" ")[0], justify="center")
    for a in indices:
        cells = []
        for b in indices:
            kind = "X" if a == b else inventory.link(a, b)
            cells.append(kind if a == b else f"[{_LINK_STYLE[kind]}]{kind}[/]")
        table.add_row(labels[a], *cells)
    return table


def render(inventory: Inventory, console: Console) -> None:
    """Print the inventory for people: the GPU table and the link matrix, or why there are no GPUs."""
    if not inventory.gpus:
        console.print(f"No GPUs found (source: {inventory.source}).", highlight=False)
    else:
        console.print(gpu_table(inventory))
        if len(inventory.gpus) > 1:
            console.print(link_matrix(inventory))
    for note in inventory.notes:
        console.print(f"  - {note}", highlight=False, markup=False)


@click.command()
@click.option(
    "--json", "as_json", is_flag=True, help="Print the inventory as JSON (accepted back by --inventory FILE)."
)
@click.pass_context
def inventory(ctx: click.Context, as_json: bool) -> None:
    """Show the GPUs of this node (or of --inventory), their links, health and processes."""
    source = (ctx.obj or {}).get("inventory_source")
    found = load_inventory(source)
    if as_json:
        click.echo(found.model_dump_json(indent=2))
        return
    # Piped output gets a wide page instead of rich's 80-column default, so rows do not fold.
    # No emoji codes: ":ab:" in the PCI address 0000:ab:00.0 would otherwise print as an emoji.
    console = cli_console()
    render(found, console)
