#!/usr/bin/env bash
# Device run 4 of 2026-11-24 (issue 13): guest work through the sandboxed daemon on the
# GPU (the sandboxed_daemon test with VGPU_TEST_GPU=cuda; vgpu-smoke --loopback against
# `vgpu-backend --gpu cuda` in seccomp kill mode), and the native fairness under MPS.
set -u
B=.devbin/h13
O=${OUT:-/tmp/out}
mkdir -p "$O"
echo "== sandboxed_daemon on the GPU"
VGPU_TEST_GPU=cuda VGPU_BACKEND_BIN=$B/vgpu-backend timeout 180 $B/sandboxed_daemon --nocapture 2>&1 \
  | tee "$O/sandboxed_daemon-cuda.txt" | grep -E "^test |result|panicked" 
echo "== vgpu-smoke through vgpu-backend --gpu cuda --seccomp kill"
d=$(mktemp -d)
$B/vgpu-backend --gpu cuda --vram-mib 4096 --socket-dir $d --vm a --vm b --seccomp kill > "$O/backend-smoke.log" 2>&1 &
P=$!
for i in $(seq 50); do [ -S $d/a.sock ] && break; sleep 0.2; done
timeout 120 $B/vgpu-smoke --loopback $d/a.sock > "$O/smoke-a.txt" 2>&1; echo "smoke a rc $?"
timeout 120 $B/vgpu-smoke --loopback $d/b.sock --rounds 3 > "$O/smoke-b.txt" 2>&1; echo "smoke b rc $?"
tail -1 "$O/smoke-a.txt" "$O/smoke-b.txt"
grep FAIL "$O/smoke-a.txt" "$O/smoke-b.txt" | head
kill -0 $P && echo "backend alive" || echo "backend DIED"
kill -TERM $P; wait $P; echo "backend exit rc=$?"
echo "== MPS"
nvcc -O2 -o /tmp/cn bench/cuda-native/native.cu -lcuda 2>&1 | tail -3
if command -v nvidia-cuda-mps-control >/dev/null; then
  timeout 60 /tmp/cn --only fairness | tee "$O/fairness-timeslicing.txt"
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
  nvidia-cuda-mps-control -d && echo "MPS started"
  timeout 60 /tmp/cn --only fairness | tee "$O/fairness-mps.txt"
  echo quit | nvidia-cuda-mps-control
  cat /tmp/mps-log/control.log 2>/dev/null | tail -5
else
  echo "no nvidia-cuda-mps-control on this machine" | tee "$O/fairness-mps.txt"
fi
