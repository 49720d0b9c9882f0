#!/usr/bin/env bash
# Device run 2 of 2026-11-24 (issue 13): the native baseline's code generation (nvcc's
# default target vs sm_90), and the whole cuda suite at the standard sizes with the GPU's
# own REF writes. Binaries carried in .devbin/h13.
set -u
B=.devbin/h13
O=${OUT:-/tmp/out}
mkdir -p "$O"
nvcc -O2 -o /tmp/cn bench/cuda-native/native.cu -lcuda 2>&1 | tail -3
nvcc -O2 -arch=sm_90 -o /tmp/cn90 bench/cuda-native/native.cu -lcuda 2>&1 | tail -3
for v in cn cn90; do
  echo "== native $v --large workloads"
  timeout 100 /tmp/$v --large --only workloads | tee "$O/native-$v-large.txt"
done
echo "== whole cuda suite, standard sizes"
timeout 400 $B/vgpu-bench --json cuda --gpu cuda --baseline /tmp/cn --vram-mib 8192 \
  > "$O/cuda-full.json" 2> "$O/cuda-full.log"; echo "rc $?"
grep -E "ratio|b2b|latency|share|off_by|evict|pause" "$O/cuda-full.json" | cut -c1-140
