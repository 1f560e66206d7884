# on the device, after the GPU kit's staging calls (.gpu/bin/device_stage.sh; carry ".gpu/bin" and ".gpurun", whose
# pdctl.tar.xz holds pdctl's Python dependencies): tests/engine/test_vllm_nixl_release.py on vLLM 0.24.0's CUDA build,
# the plain, prefill and decode engines sharing the one GPU (PDCTL_TEST_VLLM_DEVICE=cuda); K=expr picks tests
set -u
[ -f /tmp/site/.kit_sha256 ] || { echo "kit not unpacked: the machine went cold"; exit 3; }
source .gpu/bin/device_env.sh
R=/tmp/pdt; mkdir -p $R
[ -d $R/pylib ] || tar xJf .gpurun/pdctl.tar.xz -C $R pylib pylib-last
export PYTHONPATH=$PWD:$R/pylib:$PYTHONPATH  # the image has pytest
python3 -c "import msgpack, psutil, prometheus_client" 2>/dev/null || export PYTHONPATH=$PYTHONPATH:$R/pylib-last
export PDCTL_TEST_VLLM_PYTHON=$(command -v python3) PDCTL_TEST_VLLM_DEVICE=cuda
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import vllm, nixl._api; print('vllm', vllm.__version__)"
timeout ${T:-560} python3 -m pytest tests/engine/test_vllm_nixl_release.py ${K:+-k "$K"} -p no:cacheprovider -rA -s -v \
  --basetemp=$R/bt --junitxml=$OUT/junit.xml > $OUT/pytest.log 2>&1; rc=$?
tail -120 $OUT/pytest.log
mkdir -p $OUT/logs; find $R/bt -name '*.log' -size -3M | while read f; do cp "$f" "$OUT/logs/$(echo ${f#$R/bt/} | tr / _)"; done
exit $rc
