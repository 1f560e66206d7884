# sourced on the device after .gpu/bin/device_env.sh: pdctl's dependencies from .gpurun (the checkout's own code
# first), the model and the work folder, and the engines' start
R=/tmp/pdrun; [ -d $R/pylib ] || { mkdir -p $R && tar xJf .gpurun/pdctl.tar.xz -C $R; }
export PYTHONPATH=$PWD:$R/pylib:$PYTHONPATH PYTHONUNBUFFERED=1 COLUMNS=1000
python3 -c "import msgpack, psutil, yaml, prometheus_client, pydantic_settings" 2>/dev/null || export PYTHONPATH=$PYTHONPATH:$R/pylib-last
ulimit -n $(ulimit -Hn)
K=.gpu/bin; M=${M:-/tmp/models/qwen3-0.6b}; W=/tmp/h38; mkdir -p $W
E=http://127.0.0.1:8100,http://127.0.0.1:8101,http://127.0.0.1:8102,http://127.0.0.1:8103
scale() {  # scale NAME LIMIT_S ARGS...: benchmarks/gpu/serve_scale.py over the four engines
  local name=$1 limit=$2; shift 2
  echo "== $name start $(date -u +%FT%TZ)"
  timeout $limit python3 benchmarks/gpu/serve_scale.py --engines $E --model $(basename $M) --tokenizer $M \
    --out $W/$name "$@" 2>&1 | tail -30
  echo "== $name end $(date -u +%FT%TZ)"
}
pack() {
  for i in 0 1 2 3; do cp /tmp/vllm_logs/e$i.log $W/vllm-e$i.log 2>/dev/null; done
  nvidia-smi > $W/nvidia-smi-$1.txt 2>&1
  tar czf $OUT/h38-$1.tgz -C /tmp h38
}
