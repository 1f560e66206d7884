# the next warm call: 8 workers, then 1 worker, at phase 3's concurrency
set -u
SECONDS=0
curl -sf -m 3 -o /dev/null http://127.0.0.1:8100/health || { echo "engines gone: the machine went cold"; exit 3; }
source .gpu/bin/device_env.sh || exit 1
export M=/tmp/models/qwen3-0.6b-l8
source results/gpu-1x/h38/device/env.sh
scale w8-l8 280 --workers 8 --clients 8 --concurrency ${C3:-256} --rounds 2 --lifetimes 3
left=$((570 - SECONDS)); echo "== $SECONDS s used, $left s left"
[ $left -gt 90 ] && scale w1-l8 $left --workers 1 --clients 8 --concurrency ${C3:-256} --rounds 1 --lifetimes 3
pack p4
