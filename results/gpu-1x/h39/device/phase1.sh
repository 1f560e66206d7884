# call 5 (after the four staging calls): serve at budget 512, calibrate, predict calibrated, sweep 3000/300
set -u
SECONDS=0
[ -f /tmp/site/.kit_sha256 ] || { echo "kit not unpacked: the machine went cold"; exit 3; }
source .gpu/bin/device_env.sh || exit 1
source .gpurun/env.sh
python3 $K/make_model.py qwen3-8b $M >/dev/null
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem,power.limit --format=csv | tee $W/gpu.txt
# the uncalibrated advice on this node (its NVML inventory), as a user sees it: the calibration command
pd plan --suggest --input-len 3000 --output-len 300 --rate 2 > $W/suggest-uncalibrated.txt 2>&1
grep -o 'pdctl bench --rates [^`]*' $W/suggest-uncalibrated.txt | head -1 | tee $W/calibration-command.txt
serve --max-num-batched-tokens 512 || { pack fail1; exit 1; }
echo "== calibration start $(date -u +%FT%TZ)"
CAL=$(sed 's/^pdctl //; s#--out calibration#--out '$W'/calibration#' $W/calibration-command.txt)
timeout 180 python3 -m appliance $CAL --url http://127.0.0.1:8100 --label colocated-1-mbt512 2>&1 | tail -8
echo "== calibrated predictions $(date -u +%FT%TZ)"
for w in "3000 300 50" "1500 150 30"; do set -- $w
  pd plan --suggest --json --profile $W/calibration/bench.json --input-len $1 --output-len $2 --itl-ms $3 --rate 2 \
    > $W/predicted-calibrated-w$1x$2-itl$3.json 2>&1; done
date -u +%FT%TZ > $W/predicted-calibrated.time
sweep s1-mbt512 colocated-1-mbt512 11 auto:4:16 3000 300 50 40 $((480 - SECONDS))
left=$((560 - SECONDS)); echo "== $SECONDS s used, $left s left"
[ $left -gt 60 ] && sweep held-out-mbt512 colocated-1-mbt512 12 auto:8:40 1500 150 30 40 $left
pack p1
