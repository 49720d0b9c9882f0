#!/usr/bin/env bash
# Device run 11 of 2026-11-24 (issue 13): the whole cuda suite at the standard sizes after
# the fixes (as run 2). Carried in B as run 10.
set -u
B=${B:-.devbin/h13r10}
O=${OUT:-/tmp/out}
mkdir -p "$O"
nvcc -O2 -DVGPU_KERNELS_CU='"kernels.cu"' -I$B -o /tmp/cn $B/native.cu -lcuda 2>&1 | tail -3
echo "== whole cuda suite, standard sizes"
timeout 450 $B/vgpu-bench --json cuda --gpu cuda --baseline /tmp/cn --vram-mib 8192 \
  > "$O/cuda-full.json" 2> "$O/cuda-full.log"; echo "rc $?"
grep -E "ratio|b2b|latency|share|off_by|evict|pause" "$O/cuda-full.json" | cut -c1-140
