#!/usr/bin/env bash
# On the GPU machine, from the repository root, after the shared kit's device_stage.sh unpacked vLLM to
# /tmp/site: one whole measuring step in one device call. Bring up one shape with `pdctl up`
# (supervisord), sweep several workloads with `pdctl bench`, snapshot every engine's Prometheus /metrics
# (vLLM's own vllm:nixl_* transfer histograms) after each, keep the engines' logs, pack everything into
# $OUT/SHAPE.tar.gz, take the shape down. Every workload and rate stops at the deadline, keeping its data.
#   benchmarks/gpu/run_step.sh SHAPE WORKLOAD [WORKLOAD...]
#   SHAPE: disagg-read | disagg-write | colocated-N | colocated-N-mbtB (B = max_num_batched_tokens)
#   WORKLOAD: IN:OUT:RATES:N:LIFETIMES, e.g. 2000:1000:3,6:20:1 (`pdctl bench` --input-len, --output-len,
#             --rates, -n: the fewest measured per rate, --lifetimes: the steady window; every listed rate runs)
# Environment: MODEL_SHAPE (qwen3-32b), DEADLINE_S (seconds from start, default 540), KEEP_UP=1 leaves the
# shape running for a next warm call; PDCTL_* variables reach pdctl as settings overrides. A disaggregated
# shape that does not come up with cross-layer KV blocks is brought up once more without them.
set -uo pipefail
shape=$1; shift
t0=$(date +%s)
deadline=$(( t0 + ${DEADLINE_S:-540} ))
model_shape=${MODEL_SHAPE:-qwen3-32b}
kit=$(cd "${KIT_BIN:-.gpu/bin}" && pwd)
sd=${PDCTL_STATE_DIR:-/tmp/pdctl}   # state_dir in h200x2.toml
work=/tmp/step/$shape
rm -rf "$work"; mkdir -p "$work"
# shellcheck disable=SC1091
source "$kit/device_env.sh"
src=$(cd "${PDCTL_SRC:-.}" && pwd)
cd "$src"   # `python -m` puts the working folder first on sys.path: make it the source we mean
export PYTHONPATH="$src${PYTHONPATH:+:$PYTHONPATH}"
cfg=$src/benchmarks/gpu/h200x2.toml
model=/tmp/models/$model_shape
[ -f "$model/config.json" ] || python3 "$kit/make_model.py" "$model_shape" "$model"
pd() { python3 -m appliance --config "$cfg" "$@"; }
say() { echo "[$shape +$(( $(date +%s) - t0 ))s] $*" | tee -a "$work/steps.txt"; }
if [[ $shape =~ ^disagg-(read|write)$ ]]; then
    flags=(--connector nixl --mode "${BASH_REMATCH[1]}")
elif [[ $shape =~ ^colocated-([0-9]+)(-mbt([0-9]+))?$ ]]; then
    flags=(--connector none); export PDCTL_COLOCATED__INSTANCES=${BASH_REMATCH[1]}
    [ -z "${BASH_REMATCH[3]}" ] || export PDCTL_COLOCATED__MAX_NUM_BATCHED_TOKENS=${BASH_REMATCH[3]}
else
    echo "unknown shape $shape" >&2; exit 2
fi
export PDCTL_MODEL__PATH=$model PDCTL_MODEL__SERVED_NAME=$model_shape

pack() {
    local logs=$sd/supervisor/logs
    mkdir -p "$work/logs"
    for f in "$logs"/*.log; do
        [ -f "$f" ] || continue
        # the whole log is MBs of access lines: keep vLLM's own reports, warnings and errors
        grep -E -a "KV Transfer metrics|ERROR|Error|WARN|Traceback|cross layer|Registering|layout|block_size|UCX|ucp|proto|Avg|throughput|Maximum concurrency|KV cache|CUDA graph|compil|model runner|Model Runner|cuda_ipc|cuda_copy|gdr_copy|rc_mlx5|rc_verbs|dc_mlx5|tcp/|sysv/|posix/|cma/|zero-copy" "$f" \
            | tail -n 4000 > "$work/logs/$(basename "$f")" || true
        tail -n 300 "$f" > "$work/logs/$(basename "$f" .log).tail.log"
    done
    env | grep -E "^(PDCTL_|UCX_|VLLM_|NCCL_|NVSHMEM_|TORCH_SYMM)" | sort > "$work/env.txt"
    mkdir -p "${OUT:-/tmp/out}"
    tar -C /tmp/step -czf "${OUT:-/tmp/out}/$shape.tar.gz" "$shape"
    say "packed $(du -h "${OUT:-/tmp/out}/$shape.tar.gz" | cut -f1)"
}

snapshot() {   # every instance's /metrics now (cumulative: the report takes differences)
    python3 - "$work/plan.json" "$work/metrics-$1.json" <<'EOF'
import json, sys, time, urllib.request
plan = json.load(open(sys.argv[1]))
out = {"t": time.time(), "instances": {}}
for inst in plan["instances"]:
    try:
        with urllib.request.urlopen(inst["url"] + "/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError as exc:
        text = f"# unreachable: {exc}"
    keep = [l for l in text.splitlines() if l.startswith(("vllm:nixl", "vllm:num_", "vllm:kv_cache", "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:num_preemptions", "vllm:request_success", "vllm:e2e", "vllm:time_to_first", "vllm:inter_token", "vllm:request_prefill_time", "vllm:request_decode_time", "vllm:request_queue_time", "# unreachable"))]
    out["instances"][inst["name"]] = "\n".join(keep)
json.dump(out, open(sys.argv[2], "w"))
EOF
}

nvidia-smi topo -m > "$work/topo.txt" 2>&1 || true
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv > "$work/gpus.txt" 2>&1 || true
python3 -c 'import vllm, nixl, torch; print("vllm", vllm.__version__, "torch", torch.__version__)' > "$work/versions.txt" 2>&1 || true
up() {   # bounded: a start that hangs must still leave time to pack the logs that say why
    pd down >/dev/null 2>&1 || true
    timeout $(( deadline - $(date +%s) - 45 )) python3 -m appliance --config "$cfg" up "${flags[@]}" \
        > "$work/up$1.log" 2>&1
}
if ! up ""; then
    say "pdctl up failed"; tail -n 40 "$work/up.log"; pd logs > "$work/logs-first.txt" 2>&1 || true
    if [[ $shape == disagg-* ]] && [ $(( deadline - $(date +%s) )) -gt 300 ]; then
        export PDCTL_CONNECTOR__EXTRA_CONFIG='{"enable_cross_layers_blocks": false}'
        say "again without cross-layer blocks"
        up "-again" || { say "failed again"; tail -n 40 "$work/up-again.log"; pd logs > "$work/logs.txt" 2>&1
                         pd down >/dev/null 2>&1; pack; exit 1; }
    else
        pd down >/dev/null 2>&1 || true; pack; exit 1
    fi
fi
say "healthy"
cp "$sd/plan.json" "$work/plan.json"   # what `up` deployed
url=$(python3 -c '
import json, sys
proxy = json.load(open(sys.argv[1]))["proxy"]
host = proxy["host"]
print(proxy.get("url") or "http://%s:%s" % ("[%s]" % host if ":" in host else host, proxy["port"]))' "$work/plan.json")
snapshot up
for w in "$@"; do
    IFS=: read -r in outlen rates n lifetimes <<< "$w"
    tag=w${in}x${outlen}
    [ ! -e "$work/$tag" ] || tag=${tag}r${rates//,/_}   # the same workload again: keep both
    left=$(( deadline - $(date +%s) - 25 ))
    if [ "$left" -lt 30 ]; then say "no time left for $w"; continue; fi
    say "workload $w ($left s left)"
    timeout -s INT "$left" python3 -m appliance --config "$cfg" bench --url "$url" --engine vllm \
        --rates "$rates" --stop-on none -n "$n" --lifetimes "$lifetimes" --input-len "$in" \
        --output-len "$outlen" --token-range 1000:30000 --seed 7 --model "$model_shape" --label "$shape" \
        --out "$work/$tag" --no-plots > "$work/$tag.txt" 2>&1
    say "workload $w done (rc $?)"
    tail -n 30 "$work/$tag.txt"
    snapshot "$tag"
done
pack
[ "${KEEP_UP:-0}" = 1 ] || pd down > /dev/null
say "end"
