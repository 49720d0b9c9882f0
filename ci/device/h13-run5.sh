#!/usr/bin/env bash
# Device run 5 (2026-11-24, issue 13): is the sgemm/hotspot gap at the realistic sizes
# vgpu's `--fmad=false`? vgpu compiles its kernels with NVRTC `--fmad=false` (results
# bit-identical to the CPU references); the native baseline was built by plain `nvcc -O2`,
# which contracts a*b+c into FMA. Native both ways, alternating, then the VM against the
# no-FMA baseline, side by side in one run. Binaries carried in .devbin/h13.
set -u
B=.devbin/h13
O=${OUT:-/tmp/out}
mkdir -p "$O"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$O/gpu.txt"
nvcc -O2 -o /tmp/cn bench/cuda-native/native.cu -lcuda 2>&1 | tail -3
nvcc -O2 -fmad=false -o /tmp/cn-nofma bench/cuda-native/native.cu -lcuda 2>&1 | tail -3
for round in 1 2; do
  for v in cn cn-nofma; do
    echo "== native $v --large (round $round)"
    timeout 120 /tmp/$v --large --only workloads > "$O/native-$v-$round.txt" 2>&1
    grep -E "sgemm|hotspot|saxpy|stencil" "$O/native-$v-$round.txt" | head -8
  done
done
echo "== VM vs the no-FMA baseline, --large"
timeout 300 $B/vgpu-bench --json cuda --gpu cuda --baseline /tmp/cn-nofma --vram-mib 8192 --large --only workloads \
  > "$O/cuda-large-nofma.json" 2> "$O/cuda-large-nofma.log"; echo "rc $?"
grep -E "_ms\"|ratio" "$O/cuda-large-nofma.json" | cut -c1-160
tail -3 "$O/cuda-large-nofma.log"
