"""Ports for test deployments: below the kernel's ephemeral range and never handed out twice, across
processes too (parallel flows of the fault matrix and other test runs share one host)."""

from __future__ import annotations

import subprocess
import sys

from appliance.ports import _ephemeral_start, free_ports, port_free


def test_free_ports_are_distinct_below_the_ephemeral_range_and_unique_across_processes() -> None:
    mine = free_ports(40) + free_ports(40)  # two flows' worth, one after the other, nothing bound yet
    assert len(set(mine)) == len(mine)
    assert all(port < _ephemeral_start() and port_free("127.0.0.1", port) for port in mine)
    code = "from appliance.ports import free_ports; print(*free_ports(200))"
    theirs = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert not set(mine) & {int(p) for p in theirs.stdout.split()}
