# a fresh visit (after the five staging calls): the Qwen3-0.6B width with 8 layers (a quarter of the KV a token:
# the 28-layer shape was bound by the KV reads at ~50k tok/s), four engines, 8 clients; direct ceiling, then
# direct against the proxy with 4 workers
set -u
SECONDS=0
[ -f /tmp/site/.kit_sha256 ] || { echo "kit not unpacked: the machine went cold"; exit 3; }
source .gpu/bin/device_env.sh || exit 1
export M=/tmp/models/qwen3-0.6b-l8
source results/gpu-1x/h38/device/env.sh
python3 results/gpu-1x/h38/device/make_small.py $M --layers 8
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv | tee $W/gpu.txt
for i in 0 1 2 3; do
  bash $K/device_serve.sh start e$i 810$i $M --max-model-len 1024 --max-num-seqs 1024 --gpu-memory-utilization 0.2 \
    --kv-cache-memory-bytes 13G --disable-uvicorn-access-log
done
timeout 330 bash $K/device_serve.sh wait --timeout 320 e0 e1 e2 e3 || { pack fail3; exit 1; }
echo "== engines up after $SECONDS s"
scale ladder-l8 120 --direct-only --clients 8 --concurrency 128,256 --rounds 1 --lifetimes 2
left=$((570 - SECONDS)); echo "== $SECONDS s used, $left s left"
[ $left -gt 90 ] && scale w4-l8 $left --workers 4 --clients 8 --concurrency ${C3:-256} --rounds 2 --lifetimes 3
pack p3
