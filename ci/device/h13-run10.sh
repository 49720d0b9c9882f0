#!/usr/bin/env bash
# Device run 10 of 2026-11-24 (issue 13): after the fixes (sgemm's full tiles unrolled in
# kernels.cu, used by both sides; NVRTC to sm_90 CUBIN; the guest's wait naps capped at
# 100 µs): the GPU tests, then the workloads at the realistic sizes side by side with
# native CUDA (the invocation of run 1). Carried in B: vgpu-bench, cuda_gpu (stripped),
# native.cu, kernels.cu, this script and run 11's.
set -u
B=${B:-.devbin/h13r10}
O=${OUT:-/tmp/out}
mkdir -p "$O"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$O/gpu.txt"
nvcc -O2 -DVGPU_KERNELS_CU='"kernels.cu"' -I$B -o /tmp/cuda-native $B/native.cu -lcuda 2>&1 | tail -3
echo "== cuda_gpu"
timeout 240 $B/cuda_gpu --test-threads=1 2>&1 | tee "$O/cuda_gpu.txt" | grep -E "^test |result"
echo "== workloads at the realistic sizes"
timeout 330 $B/vgpu-bench --json cuda --gpu cuda --baseline /tmp/cuda-native --vram-mib 8192 --large --only workloads \
  > "$O/cuda-large.json" 2> "$O/cuda-large.log"; echo "rc $?"
grep -E "_ms\"|ratio" "$O/cuda-large.json" | cut -c1-150
tail -3 "$O/cuda-large.log"
