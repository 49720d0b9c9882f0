#!/usr/bin/env bash
# Device run 3 of 2026-11-24 (issue 13): submit latency and back-to-back kernels with the
# GPU's own REF writes (vgpu-bench) against the front end's REF stores (vgpu-bench-before),
# alternating; then the swap suite's oversubscription on the GPU.
set -u
B=.devbin/h13
O=${OUT:-/tmp/out}
mkdir -p "$O"
nvcc -O2 -o /tmp/cn bench/cuda-native/native.cu -lcuda 2>&1 | tail -3
for i in 1 2 3; do
  for v in vgpu-bench-before vgpu-bench; do
    timeout 60 $B/$v --json cuda --gpu cuda --baseline /tmp/cn --vram-mib 2048 --only latency,b2b 2>/dev/null \
      | grep -E "submit_to_kernel_start_p50_vm|submit_latency|b2b_empty_kernels_vm|b2b_vm_vs" \
      | sed "s/^/$v run$i /" | tee -a "$O/latency-b2b.txt" | cut -c1-160
  done
done
echo "== swap suite on the GPU"
timeout 420 $B/vgpu-bench --json swap --gpu cuda > "$O/swap-cuda.json" 2> "$O/swap-cuda.log"; echo "rc $?"
grep -E "slowdown\"|convergence|in_swap|moved" "$O/swap-cuda.json" | cut -c1-140
tail -3 "$O/swap-cuda.log"
