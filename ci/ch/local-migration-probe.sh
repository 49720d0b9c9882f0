# A probe, not a test: a local live migration of VM 0 under Cloud Hypervisor, run in L1
# by `ci/rig/l2-vgpu.sh --ch BIN --l1-monitor ci/ch/local-migration-probe.sh` (with
# `--l2-cmd ci/rig/l2-migrate-checks.sh` and `-- --add <ch-remote>:/bin/ch-remote`).
# Once the guest is ready it starts a second cloud-hypervisor, `ch-remote
# receive-migration` on it and `ch-remote send-migration local=on` on the first: both
# attach the same backend socket (the configuration travels with the VM). It prints
# "CH-MIG ..." lines, both VMMs' logs, the destination's serial log and the backend's
# migration lines, and always exits 0: read the lines (the guest's verdict is in the
# serial logs). Findings of 2026-11-26: docs/design/cloud-hypervisor.md.
# The destination runs with `--seccomp log` (v53.0's filters stop the device-state
# transfer; the source needs RIG_CH_ARGS="--seccomp log" for the same reason).
for i in $(seq 1 1500); do grep -a -q L2-MIGRATE-READY /tmp/l2-0.log 2>/dev/null && break; sleep 0.2; done
echo "CH-MIG guest ready"
sleep 3
cp /tmp/l2-0.log /tmp/l2-0.before.log
cloud-hypervisor -v --seccomp log --api-socket path=/tmp/dst.api > /tmp/vmm-0.dst.log 2>&1 &
dst=$!
for i in $(seq 1 50); do [ -S /tmp/dst.api ] && break; sleep 0.1; done
ch-remote --api-socket /tmp/dst.api receive-migration receiver_url=unix:/tmp/mig.sock > /tmp/recv.out 2>&1 &
recv=$!
for i in $(seq 1 50); do [ -S /tmp/mig.sock ] && break; sleep 0.1; done
read -r t0 _ < /proc/uptime
ch-remote --api-socket /tmp/vmm-0.api send-migration destination_url=unix:/tmp/mig.sock,local=on > /tmp/send.out 2>&1
src=$?
read -r t1 _ < /proc/uptime
echo "CH-MIG send rc=$src in $(awk -v a=$t0 -v b=$t1 'BEGIN{printf "%.2f", b-a}')s"; cat /tmp/send.out
# The API answers at once; the migration runs in the source VMM.
for i in $(seq 1 600); do grep -a -q -E "Migration completed|Migration failed" /tmp/vmm-0.log && break; sleep 0.2; done
read -r t2 _ < /proc/uptime
echo "CH-MIG outcome after $(awk -v a=$t0 -v b=$t2 'BEGIN{printf "%.2f", b-a}')s:"; grep -a -E "Migration|igrat.*(rror|ail)|Downtime" /tmp/vmm-0.log | tail -n 8
wait $recv; echo "CH-MIG receive rc=$?"; cat /tmp/recv.out
# The guest goes on at the destination until it powers off (or 200 s).
i=0
while kill -0 $dst 2>/dev/null && [ $i -lt 200 ]; do sleep 1; i=$((i + 1)); done
kill -0 $dst 2>/dev/null && { echo "CH-MIG destination still running after ${i}s: killed"; kill -KILL $dst; }
wait $dst; echo "CH-MIG destination rc=$?"
echo "==== CH-MIG source cloud-hypervisor log"; grep -a -v unregistered /tmp/vmm-0.log | tail -n 25
echo "==== CH-MIG destination cloud-hypervisor log"; grep -a -v unregistered /tmp/vmm-0.dst.log | tail -n 40
echo "==== CH-MIG serial after the move"; tr -d '\r' < /tmp/l2-0.log | grep -a -v '^$' | tail -n 40
echo "==== CH-MIG backend"; grep -a -i -E "vm0|state|migrat|load|save" /tmp/backend.log | tail -n 30
exit 0
