"""`[proxy] scheduling` (docs/proxy-workers.md, "CPU scheduling"): real keepers and workers over simulated engines;
each worker's policy read back from the kernel."""

from __future__ import annotations

import os
import re
from pathlib import Path

import psutil
import pytest

from tests.reliability.node import Node
from tests.reliability.test_attacks import http
from tests.support.waiting import wait_until


def _workers_serving(tmp_path: Path, launcher: tuple[str, ...] = (), **overrides: object) -> tuple[Node, list[int]]:
    """A keeper of 2 workers in front of one simulated engine, with `overrides` on its config: the node, once a
    completion went through it, and its workers' pids."""
    node = Node(tmp_path)
    url = node.engine("both-0", "both", "none")
    proc = node.proxy("none", [{"name": "both-0", "role": "both", "url": url}], launcher,
                      module="appliance.proxy.keeper", workers=2, **overrides)
    node.wait_http(proc, node.proxy_url + "/health")
    keeper = psutil.Process(proc.popen.pid)  # setpriv, a launcher, execs the keeper in its own process
    wait_until(lambda: len(keeper.children()) == 2, what="2 workers")
    status, _, body = http(node.proxy_port, "POST", "/v1/completions",
                           {"model": "sim-model", "prompt": "one two three", "max_tokens": 4})
    assert status == 200, body[:300]
    return node, [p.pid for p in keeper.children()]


def test_fifo_puts_every_worker_under_sched_fifo_and_default_leaves_them_alone(tmp_path: Path) -> None:
    for policy, expected in (("fifo", os.SCHED_FIFO), ("default", os.SCHED_OTHER)):
        (tmp_path / policy).mkdir()
        node, workers = _workers_serving(tmp_path / policy, scheduling=policy)
        try:
            assert [os.sched_getscheduler(pid) for pid in workers] == [expected, expected], policy
            assert os.sched_getscheduler(node.procs[-1].popen.pid) == os.SCHED_OTHER  # the keeper relays nothing
            if policy == "fifo":
                assert [os.sched_getparam(pid).sched_priority for pid in workers] == [1, 1]
        finally:
            node.stop()


@pytest.mark.skipif(os.geteuid() != 0, reason="drops a capability root has")
def test_a_worker_the_kernel_refuses_fifo_says_so_and_serves_under_the_fair_share(tmp_path: Path) -> None:
    # without CAP_SYS_NICE (and root's real-time limit of 0) sched_setscheduler is EPERM
    node, workers = _workers_serving(tmp_path, ("setpriv", "--bounding-set=-sys_nice", "--inh-caps=-sys_nice"),
                                     scheduling="fifo")
    try:
        assert [os.sched_getscheduler(pid) for pid in workers] == [os.SCHED_OTHER, os.SCHED_OTHER]
        said = re.findall(r"scheduling = \"fifo\": the kernel refused SCHED_FIFO \(([^)]*)\)",
                          node.procs[-1].output())
        assert len(said) == 2 and all("not permitted" in why for why in said), node.procs[-1].output()[-2000:]
    finally:
        node.stop()
