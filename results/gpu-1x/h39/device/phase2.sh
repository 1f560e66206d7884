# call 4 (warm): the held-out workload, 1500/150 at ITL 30 ms, on the budget-512 engine still up
set -u
source .gpu/bin/device_env.sh; source .gpurun/env.sh
sweep held-out-mbt512 colocated-1-mbt512 12 auto:8:40 1500 150 30
pack p2
