#!/usr/bin/env bash
# The tools the export tests validate with: Ray Serve's own schemas (ray[serve], pinned) and the Kubernetes
# object schemas (kubernetes-validate). Usage: tests/export/install_tools.sh VENV [VLLM_VENV]
# With VLLM_VENV (the CPU vLLM environment), VENV layers on it through a .pth file instead of copying it, so
# Ray Serve LLM (which imports vLLM) can load LLMConfig/PDServingArgs and run the exported app; VLLM_VENV is
# only read. Idempotent: a second run with the same pins does nothing.
set -euo pipefail
VENV=$1
VLLM_VENV=${2:-}
RAY_PIN="ray[serve]==2.60.0"
PINS=("$RAY_PIN" "kubernetes-validate==1.37.0" "pyyaml>=6" "pyarrow>=17" "smart_open" "fsspec" "jsonref>=1.1")
STAMP="$VENV/.pdctl-export-tools"
WANT="${PINS[*]} ${VLLM_VENV}"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
    exit 0
fi
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
rm -f "$SITE/pdctl-vllm-env.pth"
if [ -n "$VLLM_VENV" ]; then
    VLLM_SITE=$("$VLLM_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo "$VLLM_SITE" > "$SITE/pdctl-vllm-env.pth"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
"$VENV/bin/python" -m pip install -q "${PINS[@]}"
echo "$WANT" > "$STAMP"
