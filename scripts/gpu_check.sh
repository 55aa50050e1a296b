#!/usr/bin/env bash
# The GPU checks in one call of a lent GPU machine (the device tool; see docs/performance.md,
# "GPU"): the CUDA tests, the shard's optimizer update against the device's memory bandwidth,
# a training run, a step breakdown and the transport with the parts on the GPU. Each step is cut
# off at its own limit so that the rest still runs; the logs and JSON land in $OUT.
# At most 8 files come back from the device tool: all.log, four JSON files, a run's summary.
#   usage: bash scripts/gpu_check.sh            (wheels in .whl/ are installed first, if any)
set -u
OUT=${OUT:-/tmp/gradps-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 GRADPS_LOG_LEVEL=WARNING
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
# The `gradps` command without installing the package (the image's Python lacks pip's network).
mkdir -p /tmp/gradps-bin && printf '#!/bin/sh\nexec python3 -m client.cli "$@"\n' >/tmp/gradps-bin/gradps
chmod +x /tmp/gradps-bin/gradps && export PATH=/tmp/gradps-bin:$PATH

step() {  # step NAME SECONDS COMMAND...: run it, append its output to $OUT/all.log, say how it ended
  local name=$1 limit=$2 start=$SECONDS
  shift 2
  echo "=== $name: $*" | tee -a "$OUT/all.log"
  timeout "$limit" "$@" >"/tmp/$name.log" 2>&1
  local rc=$?
  cat "/tmp/$name.log" >>"$OUT/all.log"
  tail -n "${TAIL:-12}" "/tmp/$name.log"
  echo "--- $name: rc=$rc in $((SECONDS - start)) s" | tee -a "$OUT/all.log"
}

DEVICE=${DEVICE:-cuda}  # DEVICE=cpu tries the script on a machine without a GPU
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
python3 -c 'import sys, torch, grpc, google.protobuf as pb; print(sys.version.split()[0], torch.__version__, grpc.__version__, pb.__version__)'
echo "cores: $(nproc)"; df -h /dev/shm | tail -1
# The benches' shared segments need room in /dev/shm (a VM or container may give it 64 MiB).
if [ "$(df --output=size -B1G /dev/shm | tail -1)" -lt 4 ] && [ "$(id -u)" = 0 ]; then
  mount -o remount,size=16G /dev/shm && echo "/dev/shm remounted at 16G"
fi
# In one process, without pyproject's options: the machine's Python may lack pytest-xdist.
step cuda_tests 150 python3 -m pytest -q -p no:cacheprovider -o addopts= tests/test_cuda.py tests/test_optimizer.py
step adam 150 bash -c "gradps bench adam --params 100000000 --device $DEVICE --steps 20 --json $OUT/adam.json \
  && gradps bench adam --params 100000000 --device $DEVICE --steps 20 --part-size 64 \
  && gradps bench adam --params 100000000 --device $DEVICE --steps 20 --optimizer sgd"
step pinned 60 python3 - "$DEVICE" <<'PY'
import sys, time, torch
from gradps.shared_memory import ALIGN, Segment
device, n = sys.argv[1], 16 << 20  # 64 MiB of float32
sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
def seconds(fn, k=20):
    fn(); sync(); start = time.perf_counter()
    for _ in range(k): fn()
    sync(); return (time.perf_counter() - start) / k
on_device = torch.randn(n, device=device)
for pin in (False, True):
    segment = Segment.create(4 * n); segment.release()
    pinned = segment.pin() if pin else False
    view = segment.floats(ALIGN, n)
    to_device = seconds(lambda: on_device.copy_(view))
    from_device = seconds(lambda: segment.write(ALIGN, on_device))
    print(f"64 MiB segment, pin asked {pin}, pinned {pinned}: to {device} {4 * n / to_device / 1e9:.1f} GB/s, "
          f"from {device} {4 * n / from_device / 1e9:.1f} GB/s")
PY
step train 150 gradps train --local --device "$DEVICE" --no-progress --out /tmp/run
cp /tmp/run/summary.json "$OUT/train_summary.json" 2>/dev/null
step step 150 gradps bench step --model resnet18 --dataset synthetic-images --scheme asgd --workers 2 \
  --device "$DEVICE" --json "$OUT/step.json"
step step_wagma 120 gradps bench step --model resnet18 --dataset synthetic-images --scheme wagma --workers 2 \
  --device "$DEVICE"
step transport 200 gradps bench transport --sizes 64 --shards 1,2 --workers 1,2 --rounds 5 --device "$DEVICE" --transport shm,stream \
  --json "$OUT/transport.json"
# On 16 cores the loopback sockets no longer share two cores with the copies: does a shard beside
# each worker (colocated) reach 1.5x gloo there?
step transport_host 200 gradps bench transport --sizes 64 --shards 2 --workers 2 --codec none,int8 --rounds 5 \
  --device cpu --transport shm,stream,grpc,colocated --json "$OUT/transport_host.json"
