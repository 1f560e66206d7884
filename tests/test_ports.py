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


def test_runs_of_free_ports_are_claimed_whole() -> None:
    bases = free_ports(3, width=16)
    spans = [set(range(base, base + 16)) for base in bases]
    assert all(port_free("127.0.0.1", port) and port < _ephemeral_start() for span in spans for port in span)
    assert len(set().union(*spans)) == 48  # no two runs overlap
    # a later single port is none of them, in this process or another
    assert not set(free_ports(20)) & set().union(*spans)
    code = "from appliance.ports import free_ports; print(*free_ports(200))"
    theirs = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert not set().union(*spans) & {int(p) for p in theirs.stdout.split()}
