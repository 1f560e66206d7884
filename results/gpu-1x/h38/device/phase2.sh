# call 6 (warm, engines still up): the same with 1 worker (what one core gives), then 4 workers at a higher
# concurrency if the ladder said the engines have room
set -u
SECONDS=0
curl -sf -m 3 -o /dev/null http://127.0.0.1:8100/health || { echo "engines gone: the machine went cold"; exit 3; }
source .gpu/bin/device_env.sh || exit 1
source results/gpu-1x/h38/device/env.sh
scale w1 280 --workers 1 --concurrency ${C1:-256} --rounds 2 --lifetimes 3
left=$((570 - SECONDS)); echo "== $SECONDS s used, $left s left"
[ $left -gt 90 ] && scale w4-high $left --workers 4 --concurrency ${C2:-384} --rounds 2 --lifetimes 3
pack p2
