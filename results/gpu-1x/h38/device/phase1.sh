# call 5 (after the four staging calls): four vLLM engines of the Qwen3-0.6B shape on the one GPU, the engines'
# ceiling direct, then direct against the proxy with 4 workers
set -u
SECONDS=0
[ -f /tmp/site/.kit_sha256 ] || { echo "kit not unpacked: the machine went cold"; exit 3; }
source .gpu/bin/device_env.sh || exit 1
source results/gpu-1x/h38/device/env.sh
python3 results/gpu-1x/h38/device/make_small.py $M
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv | tee $W/gpu.txt
nproc | tee -a $W/gpu.txt
python3 -c "import appliance.proxy.keeper, vllm; print('imports ok', vllm.__version__)" || exit 1
for i in 0 1 2 3; do
  bash $K/device_serve.sh start e$i 810$i $M --max-model-len 1024 --max-num-seqs 512 --gpu-memory-utilization 0.2 \
    --kv-cache-memory-bytes 13G --disable-uvicorn-access-log
done
timeout 330 bash $K/device_serve.sh wait --timeout 320 e0 e1 e2 e3 || { pack fail1; exit 1; }
echo "== engines up after $SECONDS s"
scale ladder 150 --direct-only --concurrency 128,256 --rounds 1 --lifetimes 2
left=$((570 - SECONDS)); echo "== $SECONDS s used, $left s left"
[ $left -gt 90 ] && scale w4 $left --workers 4 --concurrency 256 --rounds 2 --lifetimes 3
pack p1
