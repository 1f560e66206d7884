"""The proxy's event-loop pauses (loopwatch.py) on a real proxy process: exported, moved by a blocked loop, and
not caused by the health probes however many sockets the host holds (issue 38)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
import urllib.request
from collections.abc import Iterator

from prometheus_client.parser import text_string_to_metric_families

from tests.proxy.cluster import Cluster, cluster, proxy_config, static_backends

LAG = "pdctl_proxy_event_loop_lag_seconds"
PAUSE = "pdctl_proxy_event_loop_max_pause_seconds"


def scrape(url: str) -> dict[tuple[str, str], float]:
    """The proxy's loop figures: (sample name, its `le` label or "") -> value."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {(s.name, s.labels.get("le", "")): s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name.startswith((LAG, PAUSE))}


def late_over(figures: dict[tuple[str, str], float], bound: str) -> float:
    """How many timer ticks came later than `bound` seconds (a bucket bound, as exported)."""
    return figures[(LAG + "_bucket", "+Inf")] - figures[(LAG + "_bucket", bound)]


@contextlib.contextmanager
def proxy_with_one_engine(**health: float) -> Iterator[Cluster]:
    """A sim engine and a proxy in front of it (health settings from `health`), both ready."""
    with cluster() as c:
        sim = c.sim("both-0", "both", "none")
        sim.wait_ready()
        c.start_proxy(proxy_config("none", backends=static_backends(("both-0", "both", sim)),
                                   health={"warmup_timeout_s": 0, **health}))
        c.ready()
        assert c.proxy is not None
        c.proxy.wait_http(c.proxy.url + "/health")
        yield c


def test_the_loops_longest_pause_is_exported_and_moves_when_the_loop_is_blocked() -> None:
    """The lag histogram counts the timer's ticks; a proxy whose loop cannot run for 0.5 s (SIGSTOP) shows a tick
    that late in the histogram and as the longest pause of the window."""
    with proxy_with_one_engine() as c:
        assert c.proxy is not None
        time.sleep(0.5)
        before = scrape(c.proxy.url)
        assert before[(LAG + "_count", "")] >= 10, before  # 100 ticks a second
        assert (PAUSE, "") in before
        os.kill(c.proxy.popen.pid, signal.SIGSTOP)
        try:
            time.sleep(0.5)
        finally:
            os.kill(c.proxy.popen.pid, signal.SIGCONT)
        after = scrape(c.proxy.url)
        assert after[(PAUSE, "")] >= 0.4, after  # 0.5 s less at most one 10 ms tick
        assert late_over(after, "0.25") >= late_over(before, "0.25") + 1, (before, after)
        assert after[(LAG + "_count", "")] > before[(LAG + "_count", "")]


def time_waits(n: int) -> None:
    """Leave `n` loopback connections in TIME_WAIT (closed by this side first): rows of the kernel's TCP table."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1024)
        for _ in range(n // 512):
            clients = [socket.create_connection(server.getsockname()) for _ in range(512)]
            accepted = [server.accept()[0] for _ in clients]
            for sock in clients + accepted:  # the client closes first: the client side waits
                sock.close()


def test_health_probes_do_not_pause_the_loop_however_many_sockets_the_host_holds() -> None:
    """Probes that check who owns each instance's listener (here every 50 ms) ask the kernel for the LISTEN
    sockets alone: with thousands of connections in TIME_WAIT on the host the loop keeps its pace. Reading all
    of /proc/net/tcp per check paused it for tens to hundreds of ms each time (issue 38)."""
    time_waits(8192)
    with proxy_with_one_engine(probe_interval_s=0.05, listener_check_interval_s=0.05) as c:
        assert c.proxy is not None
        before = scrape(c.proxy.url)
        time.sleep(3)  # 60 probes, each checking the listener
        after = scrape(c.proxy.url)
        stalls = late_over(after, "0.05") - late_over(before, "0.05")
        # a loaded shared host may deschedule the proxy a few times; a stall per probe is 60
        assert stalls <= 3, (before, after)


def test_the_longest_pause_is_of_the_last_window_only() -> None:
    """LoopWatch.longest: the longest lateness of the WINDOW_S seconds before now; older ones age out."""
    from appliance.proxy.loopwatch import WINDOW_S, LoopWatch

    watch = LoopWatch()
    assert watch.longest(100.0) == 0.0
    watch.observe(0.300, 100.2)
    watch.observe(0.002, 100.9)
    watch.observe(0.040, 103.5)
    assert watch.longest(104.0) == 0.300
    assert watch.longest(100.0 + WINDOW_S + 0.5) == 0.040  # the 300 ms pause is more than WINDOW_S old
    watch.observe(0.001, 100.0 + 2 * WINDOW_S)
    assert watch.longest(100.0 + 2 * WINDOW_S) == 0.001
    assert watch.lag.count == 4
