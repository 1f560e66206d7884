"""The exports are accepted by the targets' own code: Ray Serve's config/LLM schemas and Kubernetes' object schemas.

The validators run in the tools environment (tests/export/install_tools.sh; PDCTL_TEST_EXPORT_PYTHON names its
python) because Ray and the Kubernetes schemas are too heavy for pdctl itself. With the CPU vLLM environment
layered in, Ray Serve LLM's PDServingArgs/LLMConfig/VLLMEngineConfig and build_pd_openai_app run too.
The end-to-end proof (a local Ray head serving the exported app on the CPU) is marked `vllm` and opt-in:
it takes minutes on 2 cores, so it runs only with PDCTL_TEST_RAY_PROOF=1.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from appliance.export import ExportOptions, build_export, write_files
from appliance.export.llm_d import KUBERNETES_VERSION
from appliance.inventory import load_inventory
from appliance.plan import PlanError, plan
from appliance.settings import Settings

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
from test_export import REFERENCE, WITH_SECRET, XPYD_NVIDIA  # noqa: E402


def tools_python() -> str:
    explicit = os.environ.get("PDCTL_TEST_EXPORT_PYTHON")
    candidate = explicit or str(REPO / ".venv-export" / "bin" / "python")
    if not Path(candidate).exists():
        pytest.skip("no export tools environment: run tests/export/install_tools.sh .venv-export [.venv-vllm]")
    return candidate


def validate(kind: str, *args: str) -> dict[str, dict[str, Any]]:
    """Each file's report from one run of the validator (file path -> its report)."""
    r = subprocess.run([tools_python(), str(HERE / "validate_with_targets.py"), kind, *args],
                       capture_output=True, text=True, timeout=900)
    reports = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert reports, f"validator printed nothing (rc {r.returncode}): {r.stderr[-2000:]}"
    assert (r.returncode == 0) == all(one["ok"] for one in reports), reports
    return {one["file"]: one for one in reports}

CASES = {
    "mi300x-1p1d-moriio-write": (REFERENCE, "sim:mi300x-8", {}),
    "mi300x-1p1d-moriio-read": ({**REFERENCE, "connector": {"name": "moriio", "mode": "read"}}, "sim:mi300x-8", {}),
    "h200-2p1d-nixl": (XPYD_NVIDIA, "sim:h200-8", {}),
    "h200-dp2-autoscaled": ({**XPYD_NVIDIA, "decode": {"gpu_count": 4, "dp": 2}}, "sim:h200-8",
                            {"prefill_replicas": "1:4"}),
    # secrets as references: llm-d's secretKeyRef and Ray's ${NAME} pass the targets' own schemas
    "h200-2p1d-nixl-secret-env": (WITH_SECRET, "sim:h200-8", {}),
}


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("exports")
    dirs = {}
    for name, (overrides, inventory, extra) in CASES.items():
        settings = Settings.model_validate(overrides)
        inv = load_inventory(inventory)
        p = plan(settings, inv)
        for target in ("ray-serve", "llm-d"):
            options = {**extra} if target == "ray-serve" else {}
            result = build_export(p, settings, ExportOptions(target=target, **options), inv)  # type: ignore[arg-type]
            write_files(out / name, result.files)
        dirs[name] = out / name
    return dirs


def _misspelt_import_path(serve: dict[str, Any]) -> dict[str, Any]:
    serve["applications"][0]["import_pth"] = serve["applications"][0].pop("import_path")
    return serve


def _unknown_engine_argument(serve: dict[str, Any]) -> dict[str, Any]:
    serve["applications"][0]["args"]["decode_config"]["engine_kwargs"]["max_num_seqz"] = 8
    return serve


# A broken copy of an export per check the validators must fail: (case, how it is broken).
BROKEN_SERVE = {"misspelt-import-path": ("h200-2p1d-nixl", _misspelt_import_path),
                "unknown-engine-argument": ("mi300x-1p1d-moriio-write", _unknown_engine_argument)}


@pytest.fixture(scope="module")
def ray_reports(exported: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Ray's verdict on every case's serve.yaml and on each BROKEN_SERVE copy (by name): one validator run, as
    Ray Serve LLM's checks import Ray and vLLM (seconds each on two cores)."""
    files = {name: d / "ray-serve" / "serve.yaml" for name, d in exported.items()}
    broken = tmp_path_factory.mktemp("broken-serve")
    for name, (case, breaks) in BROKEN_SERVE.items():
        files[name] = broken / f"{name}.yaml"
        files[name].write_text(yaml.safe_dump(breaks(yaml.safe_load(files[case].read_text()))))
    reports = validate("ray-serve", *map(str, files.values()))
    return {name: reports[str(path)] for name, path in files.items()}


def test_ray_serve_exports_pass_rays_own_schemas(ray_reports: dict[str, dict[str, Any]]) -> None:
    reports = [ray_reports[name] for name in CASES]
    assert all(r["ok"] for r in reports), [r["error"] for r in reports]
    schema_lines = [c for r in reports for c in r["checked"] if c.startswith("ServeDeploySchema")]
    assert len(schema_lines) == len(CASES)
    if any(c.startswith("skipped") for r in reports for c in r["checked"]):
        pytest.skip("Ray's ServeDeploySchema passed; LLMConfig checks need vLLM in the tools environment")
    built = [c for r in reports for c in r["checked"] if c.startswith("build_pd_openai_app")]
    assert len(built) == len(CASES)


def test_llm_d_manifests_pass_the_kubernetes_schemas(exported: dict[str, Path]) -> None:
    files = [str(d / "llm-d" / "modelserver.yaml") for d in exported.values()]
    reports = validate("k8s", KUBERNETES_VERSION, *files)
    assert all(r["ok"] for r in reports.values()), [r["error"] for r in reports.values()]
    assert sum(len(r["checked"]) for r in reports.values()) == 2 * len(files)


def test_validators_reject_what_the_targets_reject(exported: dict[str, Path], ray_reports: dict[str, dict[str, Any]],
                                                   tmp_path: Path) -> None:
    """The validators are the real ones: a misspelt field fails each target's schema."""
    report = ray_reports["misspelt-import-path"]
    assert not report["ok"] and "import_path" in report["error"]

    docs = list(yaml.safe_load_all((exported["h200-2p1d-nixl"] / "llm-d" / "modelserver.yaml").read_text()))
    docs[1]["spec"]["template"]["spec"]["containers"][0]["resource"] = {"limits": {"nvidia.com/gpu": "4"}}
    bad_k8s = tmp_path / "bad.yaml"
    bad_k8s.write_text(yaml.safe_dump_all(docs))
    report = validate("k8s", KUBERNETES_VERSION, str(bad_k8s))[str(bad_k8s)]
    assert not report["ok"] and "resource" in report["error"]


def test_llm_level_validation_catches_an_unknown_engine_argument(ray_reports: dict[str, dict[str, Any]]) -> None:
    report = ray_reports["unknown-engine-argument"]
    if report["ok"] and any(c.startswith("skipped") for c in report["checked"]):
        pytest.skip("LLMConfig checks need vLLM in the tools environment")
    assert not report["ok"] and "max_num_seqz" in report["error"]


@pytest.mark.vllm
@pytest.mark.timeout(1800)
def test_exported_app_serves_on_a_local_ray_head(tmp_path: Path) -> None:
    """Proof on this machine: the CPU plan's export runs on Ray Serve; decode reports prefill's KV as cached."""
    if os.environ.get("PDCTL_TEST_RAY_PROOF") != "1":
        pytest.skip("opt-in: the Ray proof takes minutes on 2 cores; set PDCTL_TEST_RAY_PROOF=1 to run it")
    python = tools_python()
    check = subprocess.run([python, "-c", "import vllm, ray.serve.llm"], capture_output=True, timeout=600)
    if check.returncode != 0:
        pytest.skip("the tools environment has no vLLM (install_tools.sh VENV .venv-vllm)")
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs root and unshare to give Ray a loopback-only network namespace")
    model, kv = tmp_path / "model", tmp_path / "kv"
    subprocess.run([python, "-m", "appliance.engine.tinymodel", str(model)], check=True, cwd=REPO, timeout=600,
                   env={**os.environ, "PYTHONPATH": str(REPO)})
    settings = Settings.model_validate({
        "state_dir": str(tmp_path / "state"),
        "model": {"path": str(model), "served_name": "tiny", "max_model_len": 512},
        "engine": {"kind": "vllm", "cpu_kv_cache_mib": 256},
        "connector": {"name": "example", "mode": "read", "shared_storage_path": str(kv)},
        "prefill": {"max_num_seqs": 4},
        # vLLM reports prompt_tokens_details.cached_tokens only with this frontend flag.
        "decode": {"max_num_seqs": 4, "extra_args": ["--enable-prompt-tokens-details"]},
    })
    inv = load_inventory("sim:cpu")
    result = build_export(plan(settings, inv), settings,
                          ExportOptions(target="ray-serve", http_host="127.0.0.1", http_port=8000), inv)
    (config,) = write_files(tmp_path / "out", result.files)
    work = tmp_path / "work"
    work.mkdir()
    r = subprocess.run(
        ["unshare", "--net", "--", "sh", "-c", 'ip link set lo up && exec "$0" "$@"', python,
         str(HERE / "ray_proof.py"), str(config), str(work), str(model), str(kv)],
        capture_output=True, text=True, timeout=1700,
    )
    lines = [line for line in r.stdout.splitlines() if line.startswith("{")]
    assert lines, r.stderr[-3000:]
    report = json.loads(lines[-1])
    # The measured figures (pytest -s shows them): request seconds, whole run, cached vs expected tokens.
    print(json.dumps({k: report.get(k) for k in ("completion", "usage", "block_size", "expected_cached",
                                                 "kv_folders", "seconds", "total_seconds")}))
    assert report["ok"], {k: report.get(k) for k in ("stage", "error", "usage", "kv_files", "log_tail")}
    # ExampleConnector hands over the prompt's whole blocks: exactly (L-2)//B*B tokens, stored under the folder
    # named by those tokens' hash (not md5 of nothing, which a prompt shorter than a block gives).
    cached = report["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == report["expected_cached"] >= report["block_size"] > 0, report["usage"]
    assert report["kv_folder_expected"] in report["kv_folders"], report["kv_folders"]


def test_example_connector_export_has_one_block_size(tmp_path: Path) -> None:
    """ExampleConnector's folder names hash block-aligned prompt tokens, so both roles need one block size: the
    planner gives a size one role names to the other and refuses two different ones, and the export carries it."""
    base = {
        "state_dir": str(tmp_path / "state"),
        "model": {"path": str(tmp_path / "model"), "served_name": "tiny", "max_model_len": 512},
        "engine": {"kind": "vllm"},
        "connector": {"name": "example", "mode": "read", "shared_storage_path": str(tmp_path / "kv")},
    }
    inv = load_inventory("sim:cpu")
    options = ExportOptions(target="ray-serve", http_host="127.0.0.1", http_port=8000)
    for decode_args in (["--block-size", "32"], []):
        settings = Settings.model_validate({**base, "prefill": {"extra_args": ["--block-size", "32"]},
                                            "decode": {"extra_args": decode_args}})
        result = build_export(plan(settings, inv), settings, options, inv)
        args = yaml.safe_load(result.files["ray-serve/serve.yaml"])["applications"][0]["args"]
        assert args["prefill_config"]["engine_kwargs"]["block_size"] == 32
        assert args["decode_config"]["engine_kwargs"]["block_size"] == 32
        assert any("whole KV blocks" in n and "32 + 1 tokens" in n for n in result.notes)
    unequal = Settings.model_validate({**base, "prefill": {"extra_args": ["--block-size", "32"]},
                                       "decode": {"extra_args": ["--block-size", "64"]}})
    with pytest.raises(PlanError, match="same KV block size"):
        plan(unequal, inv)


def test_human_readable_vllm_integers_become_engine_kwargs_integers() -> None:
    """vLLM's CLI takes '256M' for --kv-cache-memory-bytes; EngineArgs (Ray's engine_kwargs) needs the integer."""
    from appliance.engine.command import VLLM_ENTRYPOINT
    from appliance.errors import ExportError
    from appliance.export.cluster import engine_kwargs_from_argv

    kwargs = engine_kwargs_from_argv(["python", "-m", VLLM_ENTRYPOINT, "--kv-cache-memory-bytes", "256M",
                                      "--max-model-len=25.6k", "--max-num-batched-tokens", "2048", "--dtype", "float32"])
    assert kwargs == {"kv_cache_memory_bytes": 256 * 2**20, "max_model_len": 25600, "max_num_batched_tokens": 2048,
                      "dtype": "float32"}
    with pytest.raises(ExportError, match="no decimals"):
        engine_kwargs_from_argv(["python", "-m", VLLM_ENTRYPOINT, "--kv-cache-memory-bytes", "1.5M"])
    with pytest.raises(ExportError, match="not an integer"):
        engine_kwargs_from_argv(["python", "-m", VLLM_ENTRYPOINT, "--max-num-batched-tokens", "lots"])
