#!/bin/bash
# Seccomp on the cuda GPU (run on the GPU machine, binaries built elsewhere):
#   BIN=dir-with-vgpu-backend-and-vgpuctl OUT=dir-for-logs ci/device/seccomp-cuda.sh
# Starts vgpu-backend --gpu cuda in log mode (then prints the kernel's type=1326
# records) and in kill mode, exercises the control API with vgpuctl and stops it with
# SIGTERM. docs/operator-guide.md, "Sandboxing".
B=${BIN:-$(dirname "$0")}
OUT=${OUT:-$(mktemp -d)}
run_mode() {
  mode=$1; d=$(mktemp -d)
  echo "== --seccomp $mode"
  RUST_LOG=info $B/vgpu-backend --gpu cuda --vram-mib 2048 --socket-dir $d --vm a --vm b --api-socket $d/api.sock --seccomp $mode > $OUT/backend-$mode.log 2>&1 &
  P=$!
  sleep 8
  if kill -0 $P 2>/dev/null; then echo "alive after 8 s"; else wait $P; echo "DIED rc=$?"; tail -20 $OUT/backend-$mode.log; return; fi
  grep -E "Seccomp|NoNewPrivs|CapEff" /proc/$P/status
  for t in /proc/$P/task/*; do echo "$(cat $t/comm) $(grep Seccomp_filters $t/status 2>/dev/null)"; done | sort | uniq -c
  $B/vgpuctl --socket $d/api.sock info 2>&1 | head -15
  $B/vgpuctl --socket $d/api.sock vm list 2>&1 | head -5
  $B/vgpuctl --socket $d/api.sock vm set-weight a 300 2>&1 | head -3
  sleep 2
  kill -0 $P 2>/dev/null && echo "alive after API calls" || { wait $P; echo "DIED rc=$?"; }
  kill -TERM $P; wait $P; echo "exit rc=$?"
  tail -5 $OUT/backend-$mode.log
}
dmesg -C 2>/dev/null
run_mode log
dmesg 2>/dev/null | grep "type=1326" | grep -o "comm=[^ ]* .*syscall=[0-9]*" | sed 's/ exe=.*syscall/ syscall/' | sort | uniq -c | head -20
run_mode kill
