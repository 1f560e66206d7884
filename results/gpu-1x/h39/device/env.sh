# sourced on the device after .gpu/bin/device_env.sh: pdctl from .gpurun, its settings, the work folder
R=/tmp/pdrun; [ -d $R/appliance ] || { mkdir -p $R && tar xJf .gpurun/pdctl.tar.xz -C $R; }
export PYTHONPATH=$R:$R/pylib:$PYTHONPATH PDCTL_CONFIG=$R/pdctl.toml PYTHONUNBUFFERED=1 COLUMNS=1000
python3 -c "import msgpack, psutil, yaml, prometheus_client, pydantic_settings" 2>/dev/null || export PYTHONPATH=$PYTHONPATH:$R/pylib-last
K=.gpu/bin; M=/tmp/models/qwen3-8b; W=/tmp/h39; mkdir -p $W
pd() { python3 -m appliance "$@"; }
serve() {  # serve BUDGET_ARGS...: one vLLM engine on the GPU, the Qwen3-8B shape, dummy weights
  bash $K/device_serve.sh stop s0 >/dev/null 2>&1
  bash $K/device_serve.sh start s0 8100 $M --max-model-len 4096 --no-enable-prefix-caching "$@" \
    && timeout 300 bash $K/device_serve.sh wait s0
}
sweep() {  # sweep NAME LABEL SEED RATES IN OUT ITL [N] [LIMIT_S]: pdctl bench against the engine, as a user would
  echo "== $1 start $(date -u +%FT%TZ)"
  timeout ${9:-280} python3 -m appliance bench --url http://127.0.0.1:8100 --label $2 --seed $3 --rates $4 -n ${8:-40} \
    --input-len $5 --output-len $6 --ttft-ms 1000 --itl-ms $7 ${STOP:-} --no-plots --out $W/$1 2>&1 | tail -25
  echo "== $1 end $(date -u +%FT%TZ)"
}
pack() { cp /tmp/vllm_logs/s0.log $W/vllm-s0-$1.log 2>/dev/null; tar czf $OUT/h39-$1.tgz -C /tmp h39; }
