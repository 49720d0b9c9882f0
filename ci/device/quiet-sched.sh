#!/usr/bin/env bash
# The scheduler's figures of issue 15 on a quiet host: the device machine's 16 idle
# cores (no GPU used; the sim runs on the CPU), against the 2-vCPU dev machine where
# other builds and a nested rig share the cores. Binaries built here, carried in
# .devbin/quiet (vgpu-bench, vgpu-demo; release, stripped).
set -u
O=${OUT:-/tmp/out}
B=.devbin/quiet
mkdir -p "$O"
nproc; uptime
for i in 1 2 3; do
  echo "== scale --vms 64 (run $i)"
  timeout 120 $B/vgpu-bench scale --vms 64 > "$O/scale64-$i.txt" 2> "$O/scale64-$i.err"
  grep -E "sched_cpu|quiet|observed" "$O/scale64-$i.txt" | head -8
done
for i in 1 2 3; do
  echo "== sched --only mixed,hostile (run $i)"
  timeout 200 $B/vgpu-bench sched --only mixed,hostile > "$O/sched-mixed-$i.txt" 2> "$O/sched-mixed-$i.err"
  grep -E "mixed_|short_vs_long|channels16" "$O/sched-mixed-$i.txt"
done
for i in 1 2 3 4 5; do
  echo "== vgpu-demo (run $i)"
  timeout 90 $B/vgpu-demo > "$O/demo-$i.txt" 2>&1
  grep -i "verdict\|entitle" "$O/demo-$i.txt" | tail -12
done
