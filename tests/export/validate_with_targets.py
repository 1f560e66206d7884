"""Validate exported files with the targets' own code; run with the tools Python (see install_tools.sh).

    python validate_with_targets.py ray-serve FILE...   -> Ray's ServeDeploySchema, then for each app
        PDServingArgs (prefill/decode LLMConfig), VLLMEngineConfig (every engine kwarg must be an
        AsyncEngineArgs/FrontendArgs field) and build_pd_openai_app (the Serve application graph)
    python validate_with_targets.py k8s VERSION FILE...  -> kubernetes-validate, strict schemas

Prints one JSON line per file {"file": str, "ok": bool, "checked": [...], "error": str|null}, so one run (one
import of Ray and vLLM, seconds each) judges valid and invalid files alike; exits 0 when every file is valid.
Ray Serve LLM imports vLLM: when vLLM is missing, the LLM-level checks are reported as skipped.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml


def check_ray(path: str) -> list[str]:
    from ray.serve.schema import ServeDeploySchema

    data = yaml.safe_load(Path(path).read_text())
    schema = ServeDeploySchema.model_validate(data)
    checked = [f"ServeDeploySchema: {len(schema.applications)} application(s)"]
    try:
        import vllm  # noqa: F401
    except ImportError:
        return [*checked, "skipped: LLM-level checks (vLLM not importable)"]
    from ray.llm._internal.serve.serving_patterns.prefill_decode.builder import PDServingArgs
    from ray.serve.llm import build_pd_openai_app

    for app in schema.applications:
        if app.import_path != "ray.serve.llm:build_pd_openai_app":
            raise ValueError(f"unexpected import_path {app.import_path}")
        args: dict[str, Any] = app.args or {}
        pd = PDServingArgs.model_validate(json.loads(json.dumps(args)))
        for role, cfg in (("prefill", pd.prefill_config), ("decode", pd.decode_config)):
            engine = cfg.get_engine_config()  # raises on any kwarg vLLM's AsyncEngineArgs/FrontendArgs lacks
            checked.append(f"{role}: LLMConfig + VLLMEngineConfig ({len(engine.engine_kwargs)} engine, "
                           f"{len(engine.frontend_kwargs)} frontend kwargs, {len(engine.placement_bundles)} bundle(s))")
        build_pd_openai_app(json.loads(json.dumps(args)))
        checked.append(f"build_pd_openai_app({app.name}): application graph built")
    return checked


def check_k8s(path: str, version: str) -> list[str]:
    import kubernetes_validate

    checked = []
    for doc in yaml.safe_load_all(Path(path).read_text()):
        if doc is None:
            continue
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = "/".join(str(p) for p in exc.path)
            raise ValueError(f"{doc.get('kind')} {doc.get('metadata', {}).get('name')}: {where}: {exc.message}") from None
        checked.append(f"{doc['kind']} {doc['metadata']['name']}: valid ({version}, strict)")
    return checked


def report(path: str, check: Callable[[str], list[str]]) -> dict[str, Any]:
    """One file's verdict: what was checked, or why the target rejects it."""
    try:
        checked = check(path)
    except Exception as exc:  # report any rejection as data for the test
        return {"file": path, "ok": False, "checked": [], "error": f"{type(exc).__name__}: {exc}"}
    return {"file": path, "ok": True, "checked": checked, "error": None}


def main(argv: list[str]) -> int:
    kind = argv[1]
    if kind == "ray-serve":
        reports = [report(path, check_ray) for path in argv[2:]]
    else:
        version = argv[2]
        reports = [report(path, lambda p: check_k8s(p, version)) for path in argv[3:]]
    for one in reports:
        print(json.dumps(one), flush=True)
    return 0 if all(one["ok"] for one in reports) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
