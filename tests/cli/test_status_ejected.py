"""`pdctl status` says why the proxy holds an instance out of rotation, and which instance takes a role's requests
when none of it is in rotation (panic routing, docs/operations.md): a deployment of simulated engines under
supervisord whose decode gets no CPU (SIGSTOP) until the proxy's probes, silent twice in a row, take it out."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from tests.support.pdctl import pdctl, status, write_config


def test_status_names_why_an_instance_is_out_and_which_one_stands_in(tmp_path: Path) -> None:
    config = write_config(tmp_path, tmp_path / "state")
    pdctl(config, "up", check=True)
    pid = 0
    try:
        doc = status(config)
        pid = next(i["pid"] for i in doc["instances"] if i["name"] == "decode-0")
        assert doc["proxy"]["panic"] == {} and all(r["ejected_for"] is None for r in doc["proxy"]["registered"]), doc
        os.kill(pid, signal.SIGSTOP)
        deadline = time.monotonic() + 60  # two silent probes of 2 s, 2 s apart, and each status' own round
        while (view := status(config)["proxy"])["panic"] != {"decode": "decode-0"}:
            assert time.monotonic() < deadline, view
        decode = next(r for r in view["registered"] if r["name"] == "decode-0")
        assert decode["healthy"] is False and decode["ejected_for"] == "timeout", view
        text = pdctl(config, "status").stdout
        assert "decode-0(decode, unhealthy: timeout, takes the requests: none of its role is in rotation)" in \
            " ".join(text.split()), text
    finally:
        if pid:
            os.kill(pid, signal.SIGCONT)
        pdctl(config, "down", check=True)
