# call 5 of a second visit: the held-out workload (1500/150, ITL 30 ms) on a finer grid and a second seed, budget 512
set -u
[ -f /tmp/site/.kit_sha256 ] || { echo "kit not unpacked: the machine went cold"; exit 3; }
source .gpu/bin/device_env.sh || exit 1
source .gpurun/env.sh
python3 $K/make_model.py qwen3-8b $M >/dev/null
nvidia-smi --query-gpu=name,memory.total --format=csv | tee $W/gpu.txt
serve --max-num-batched-tokens 512 || { pack fail4; exit 1; }
STOP="--stop-on none"
sweep held-out-fine-s21 colocated-1-mbt512 21 14,15,16 1500 150 30 40 190
sweep held-out-fine-s12 colocated-1-mbt512 12 15 1500 150 30 40 90
pack p4
