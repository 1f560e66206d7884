#!/usr/bin/env bash
# On the GPU machine, from the repository root, after the shared kit's device_stage.sh unpacked vLLM to
# /tmp/site: bring up one deployment shape with pdctl (supervisord), sweep it with `pdctl bench`, keep the
# results and logs under $OUT/SHAPE, take it down.
#   benchmarks/gpu/run_shape.sh SHAPE RATES N [MODEL_SHAPE]
#   SHAPE: disagg-read | colocated-2 | colocated-1     RATES: e.g. 1,2,4     N: requests per rate
set -euo pipefail
shape=$1 rates=$2 n=$3 model_shape=${4:-qwen3-32b}
kit=$(cd "${KIT_BIN:-.gpu/bin}" && pwd)
out=${OUT:-/tmp/out}/$shape
mkdir -p "$out"
# shellcheck disable=SC1091
source "$kit/device_env.sh"
src=$(cd "${PDCTL_SRC:-.}" && pwd)
cd "$src"   # `python -m` puts the working folder first on sys.path: make it the source we mean
export PYTHONPATH="$src:$PYTHONPATH"
cfg=$src/benchmarks/gpu/h200x2.toml
model=/tmp/models/$model_shape
[ -f "$model/config.json" ] || python3 "$kit/make_model.py" "$model_shape" "$model"
pd() { python3 -m appliance --config "$cfg" "$@"; }
case "$shape" in
    disagg-read) flags=(--connector nixl --mode read) ;;
    colocated-2) flags=(--connector none); export PDCTL_COLOCATED__INSTANCES=2 ;;
    colocated-1) flags=(--connector none); export PDCTL_COLOCATED__INSTANCES=1 ;;
    *) echo "unknown shape $shape" >&2; exit 2 ;;
esac
export PDCTL_MODEL__PATH=$model PDCTL_MODEL__SERVED_NAME=$model_shape
t0=$(date +%s)
pd down >/dev/null 2>&1 || true
if ! pd up "${flags[@]}" > "$out/up.log" 2>&1; then
    cat "$out/up.log"; pd logs > "$out/logs.txt" 2>&1 || true; exit 1
fi
echo "[$shape] healthy after $(( $(date +%s) - t0 )) s"
cp /tmp/pdctl/plan.json "$out/plan.json"   # what `up` deployed (state_dir in h200x2.toml)
pd status --json > "$out/status.json" || true
url=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["proxy"]["url"])' "$out/plan.json")
pd bench --url "$url" --engine vllm --rates "$rates" -n "$n" --input-len 2000 --output-len 1000 \
    --token-range 1000:30000 --seed 7 --model "$model_shape" --label "$shape" --out "$out" --no-plots
echo "[$shape] swept after $(( $(date +%s) - t0 )) s"
[ "${KEEP_UP:-0}" = 1 ] || pd down > /dev/null
