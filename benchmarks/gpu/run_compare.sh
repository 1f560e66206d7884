#!/usr/bin/env bash
# On the GPU machine, from the repository root, after the shared kit's device_stage.sh unpacked vLLM to
# /tmp/site: `pdctl bench --compare` as a user of a one-GPU node runs it (pdctl brings each shape up with its
# own supervisord, sweeps it through pdctl's proxy, takes it down), then packs bench.json and the engines'
# logs into $OUT/compare.tar.gz. tomli_w (which --compare needs) comes as a carried wheel in $WHEELS.
#   benchmarks/gpu/run_compare.sh SHAPES BUDGETS IN:OUT:RATES:N:LIFETIMES
#   e.g. run_compare.sh colocated 512,2048 3000:300:3,4.5,7:60:2
# Environment: MODEL_SHAPE (qwen3-8b), TTFT_MS (1000), ITL_MS (50), DEADLINE_S (540), WHEELS (.whl).
set -uo pipefail
shapes=$1 budgets=$2 workload=$3
t0=$(date +%s)
kit=$(cd "${KIT_BIN:-.gpu/bin}" && pwd)
model_shape=${MODEL_SHAPE:-qwen3-8b}
# shellcheck disable=SC1091
source "$kit/device_env.sh"
src=$(cd "${PDCTL_SRC:-.}" && pwd)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-extra "$src/${WHEELS:-.whl}"/*.whl || exit 1
cd "$src"
export PYTHONPATH="$src:/tmp/site-extra${PYTHONPATH:+:$PYTHONPATH}"
# --compare runs `pdctl up/down` as the console script a pip install would make
mkdir -p /tmp/bin && printf '#!/bin/sh\nexec python3 -m appliance "$@"\n' > /tmp/bin/pdctl && chmod +x /tmp/bin/pdctl
export PATH=/tmp/bin:$PATH
model=/tmp/models/$model_shape
[ -f "$model/config.json" ] || python3 "$kit/make_model.py" "$model_shape" "$model"
export PDCTL_MODEL__PATH=$model PDCTL_MODEL__SERVED_NAME=$model_shape
work=/tmp/step/compare
rm -rf "$work"; mkdir -p "$work"
IFS=: read -r in outlen rates n lifetimes <<< "$workload"
left=$(( t0 + ${DEADLINE_S:-540} - $(date +%s) - 30 ))
timeout -s INT "$left" pdctl --config benchmarks/gpu/h200x2.toml bench --compare --deploy processes \
    --shapes "$shapes" --budgets "$budgets" --rates "$rates" --stop-on none -n "$n" --lifetimes "$lifetimes" \
    --input-len "$in" --output-len "$outlen" --token-range 1000:30000 --seed 7 --ttft-ms "${TTFT_MS:-1000}" \
    --itl-ms "${ITL_MS:-50}" --out "$work/bench" --no-plots > "$work/compare.txt" 2>&1
echo "bench --compare rc $? after $(( $(date +%s) - t0 )) s"
tail -n 60 "$work/compare.txt"
logs=/tmp/pdctl/supervisor/logs
mkdir -p "$work/logs"
for f in "$logs"/*.log; do
    [ -f "$f" ] && grep -E -a "ERROR|Error|WARN|Traceback|KV cache|CUDA graph|compil|Maximum concurrency" "$f" \
        | tail -n 2000 > "$work/logs/$(basename "$f")"
done
pdctl --config benchmarks/gpu/h200x2.toml down > /dev/null 2>&1
mkdir -p "${OUT:-/tmp/out}"
tar -C /tmp/step -czf "${OUT:-/tmp/out}/compare.tar.gz" compare
