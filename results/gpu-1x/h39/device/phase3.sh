# call 5 (warm): vLLM's default budget on 3000/300
set -u
source .gpu/bin/device_env.sh; source .gpurun/env.sh
serve || { pack fail3; exit 1; }
sweep s1-default colocated-1 13 auto:0.5:2 3000 300 50 20
pack p3
