#!/usr/bin/env bash
# Device run 6 (2026-11-24, issue 13): is the sgemm gap the compile path? vgpu compiles
# kernels.cu with NVRTC to compute_90 PTX (--fmad=false) and the driver JIT-compiles it at
# load; the native baseline includes the same kernels.cu and is built by nvcc. Native
# built three ways, alternating: nvcc's default, PTX only for compute_90 (JIT at load, as
# vgpu), and SASS for sm_90 — the last two with --fmad=false as vgpu.
set -u
O=${OUT:-/tmp/out}
mkdir -p "$O"
nvcc -O2 -o /tmp/cn bench/cuda-native/native.cu -lcuda 2>&1 | tail -3
nvcc -O2 -fmad=false -gencode arch=compute_90,code=compute_90 -o /tmp/cn-ptx bench/cuda-native/native.cu -lcuda 2>&1 | tail -3
nvcc -O2 -fmad=false -gencode arch=compute_90,code=sm_90 -o /tmp/cn-sm90 bench/cuda-native/native.cu -lcuda 2>&1 | tail -3
for round in 1 2; do
  for v in cn cn-ptx cn-sm90; do
    echo "== native $v --large (round $round)"
    timeout 120 /tmp/$v --large --only workloads > "$O/native-$v-$round.txt" 2>&1
    grep -E "sgemm|hotspot" "$O/native-$v-$round.txt" | head -4
  done
done
