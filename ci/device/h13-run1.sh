#!/usr/bin/env bash
# Device run 1 of 2026-11-24 (issue 13): GPU tests, the 3-VM VRAM stress on the GPU, the
# workloads at the realistic sizes. Binaries carried in .devbin/h13 (built here, stripped).
set -u
B=.devbin/h13
O=${OUT:-/tmp/out}
mkdir -p "$O"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$O/gpu.txt"
nvcc -O2 -o /tmp/cuda-native bench/cuda-native/native.cu -lcuda 2>&1 | tail -3
echo "== cuda_gpu"
timeout 240 $B/cuda_gpu --test-threads=1 2>&1 | tee "$O/cuda_gpu.txt" | grep -E "^test |result"
echo "== VRAM stress on the GPU"
VGPU_TEST_GPU=cuda VGPU_SWAP_SECS=${SECS:-60} VGPU_SWAP_EVICTIONS=${EVICTIONS:-4000} timeout 200 \
  $B/vram_swap three_vms --nocapture 2>&1 | tee "$O/vram_stress.txt" | grep -vE "^\s*$" | tail -8
echo "== workloads at the realistic sizes"
timeout 280 $B/vgpu-bench --json cuda --gpu cuda --baseline /tmp/cuda-native --vram-mib 8192 --large --only workloads \
  > "$O/cuda-large.json" 2> "$O/cuda-large.log"; echo "rc $?"
grep -E "_ms\"|ratio" "$O/cuda-large.json" | cut -c1-150
tail -3 "$O/cuda-large.log"
