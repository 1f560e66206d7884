#!/usr/bin/env bash
# On the GPU machine, from the repository root, after the shared kit's device_stage.sh unpacked vLLM to
# /tmp/site: bring up one deployment shape with pdctl (supervisord), sweep it with `pdctl bench`, keep the
# results and logs under $OUT/SHAPE, take it down.
#   benchmarks/gpu/run_shape.sh SHAPE RATES N [MODEL_SHAPE]
#   SHAPE: disagg-read | disagg-write | colocated-N | colocated-N-mbtB (B = max_num_batched_tokens)
#   RATES: e.g. 1,2,4 or auto:1     N: requests per rate (the fewest measured, with the steady window)
#   BENCH_ARGS: more `pdctl bench` flags, e.g. "--lifetimes 2 --stop-on run"
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
if [[ $shape =~ ^disagg-(read|write)$ ]]; then
    flags=(--connector nixl --mode "${BASH_REMATCH[1]}")
elif [[ $shape =~ ^colocated-([0-9]+)(-mbt([0-9]+))?$ ]]; then
    flags=(--connector none); export PDCTL_COLOCATED__INSTANCES=${BASH_REMATCH[1]}
    [ -z "${BASH_REMATCH[3]}" ] || export PDCTL_COLOCATED__MAX_NUM_BATCHED_TOKENS=${BASH_REMATCH[3]}
else
    echo "unknown shape $shape" >&2; exit 2
fi
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
    --token-range 1000:30000 --seed 7 --model "$model_shape" --label "$shape" --out "$out" --no-plots \
    ${BENCH_ARGS:-}
echo "[$shape] swept after $(( $(date +%s) - t0 )) s"
[ "${KEEP_UP:-0}" = 1 ] || pd down > /dev/null
