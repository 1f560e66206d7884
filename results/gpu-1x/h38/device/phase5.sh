# a third visit (after the five staging calls): is vLLM's API server the node's ceiling? Two engines of the 8-layer
# shape, each with 3 API server processes (`--api-server-count 3`), 8 clients: the direct ceiling first, then
# direct against the proxy with 4 workers at the same streams if the call has the time
set -u
SECONDS=0
[ -f /tmp/site/.kit_sha256 ] || { echo "kit not unpacked: the machine went cold"; exit 3; }
source .gpu/bin/device_env.sh || exit 1
export M=/tmp/models/qwen3-0.6b-l8
source results/gpu-1x/h38/device/env.sh
E=http://127.0.0.1:8100,http://127.0.0.1:8101
python3 results/gpu-1x/h38/device/make_small.py $M --layers 8
nvidia-smi --query-gpu=name,memory.total --format=csv | tee $W/gpu.txt; nproc
for i in 0 1; do
  bash $K/device_serve.sh start e$i 810$i $M --max-model-len 1024 --max-num-seqs 1024 --gpu-memory-utilization 0.3 \
    --kv-cache-memory-bytes 20G --disable-uvicorn-access-log --api-server-count ${APIS:-3}
done
timeout 300 bash $K/device_serve.sh wait --timeout 290 e0 e1 || { pack fail5; exit 1; }
echo "== engines up after $SECONDS s"
scale ladder-api 150 --direct-only --clients 8 --concurrency ${C5:-256} --rounds 1 --lifetimes 3
left=$((575 - SECONDS)); echo "== $SECONDS s used, $left s left"
[ $left -gt 100 ] && scale w4-api $left --workers 4 --clients 8 --concurrency ${C5:-256} --rounds 1 --lifetimes 3
for i in 0 1; do grep -E "Avg prompt throughput|generation throughput" /tmp/vllm_logs/e$i.log | tail -4; done
pack p5
