#!/usr/bin/env bash
# Device run 7 of 2026-11-24 (issue 13): where the sgemm gap comes from. The native
# baseline with its buffers filled with the workloads' random data instead of zeros, with
# an idle pause before each timed loop (vgpu's workloads run their CPU reference between
# timed loops), and with all buffers in one block (as vgpu's VRAM); vgpu with the kernels
# as sm_90 CUBIN (new default), compute_90 PTX (before) and compute_75 PTX, with each
# entry's GPU time logged. The GPU's clocks and power sampled throughout.
# Carried in B (built here, stripped): vgpu-bench, native.cu, kernels.cu, this script.
set -u
B=${B:-.devbin/h13r7}
O=${OUT:-/tmp/out}
mkdir -p "$O"
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active \
  --format=csv -lms 100 > "$O/smi.csv" 2>&1 &
SMI=$!
nvcc -O2 -DVGPU_KERNELS_CU='"kernels.cu"' -I$B -o /tmp/cn $B/native.cu -lcuda 2>&1 | tail -3
W="--large --only workloads --workloads sgemm,hotspot"
for round in 1 2; do
  for v in "" "--fill random" "--idle-ms 2000" "--fill random --idle-ms 2000" "--one-block" "--one-block --fill random"; do
    echo "== native $v (round $round)"
    date +%T.%N
    timeout 120 /tmp/cn $W $v 2>&1 | tee -a "$O/native.txt"
  done
done
for arch in "" compute_90 compute_75; do
  echo "== vgpu arch=${arch:-default}"
  date +%T.%N
  VGPU_NVRTC_ARCH=$arch RUST_LOG=info,vgpu_host_shim::cuda::frontend=trace timeout 150 \
    $B/vgpu-bench --json cuda --gpu cuda --baseline /tmp/cn --vram-mib 8192 $W --reps 3 \
    > "$O/vgpu-${arch:-default}.json" 2> "$O/vgpu-${arch:-default}.log"; echo "rc $?"
  grep -E "_ms\"|ratio" "$O/vgpu-${arch:-default}.json" | cut -c1-150
  grep -E "kernels compiled" "$O/vgpu-${arch:-default}.log" | head -2
  grep -oE "entry ran [0-9]{6,} ns" "$O/vgpu-${arch:-default}.log" | awk '{printf "%.3f ", $3/1e6} END {print ""}'
done
kill $SMI
