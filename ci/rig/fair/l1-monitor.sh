# L1 side of the rig fairness run: while the VMs run, sample each VM's GPU share over the
# last second through the control API (vgpuctl), keep the samples in which both VMs used
# the GPU, and print their mean. Arguments: the vgpu-vmm pids (the run ends with them).
# FAIR_EXPECT="lo hi" bounds vm0's mean share (default: no check).
share() {
    vgpuctl --json vm stats "$1" 2>/dev/null | tr -d ' \n' \
        | grep -o '"window_s":1,"covered_s":[0-9.eE+-]*,"share":[0-9.eE+-]*' | head -n 1 \
        | sed 's/.*"share"://'
}
alive() { for p in "$@"; do kill -0 "$p" 2>/dev/null && return 0; done; return 1; }
n=0 sum=0
while alive "$@"; do
    sleep 2
    a=$(share vm0); b=$(share vm1)
    [ -n "$a" ] && [ -n "$b" ] || continue
    echo "FAIR-SAMPLE vm0=$a vm1=$b"
    if awk -v a="$a" -v b="$b" 'BEGIN { exit !(a > 0.02 && b > 0.02) }'; then
        n=$((n + 1)); sum=$(awk -v s="$sum" -v a="$a" 'BEGIN { print s + a }')
    fi
done
policy=$(vgpuctl --json sched show 2>/dev/null | tr -d ' \n' | grep -o '"policy":"[a-z]*"' | cut -d'"' -f4)
mean=$(awk -v s="$sum" -v n="$n" 'BEGIN { if (n) printf "%.3f", s / n; else print "nan" }')
echo "FAIR-RESULT policy=${policy:-?} both_busy_samples=$n vm0_mean_share=$mean"
[ "$n" -ge 3 ] || { echo "FAIR-RESULT too few samples with both VMs busy"; exit 1; }
if [ -n "$FAIR_EXPECT" ]; then
    set -- $FAIR_EXPECT
    awk -v m="$mean" -v lo="$1" -v hi="$2" 'BEGIN { exit !(m >= lo && m <= hi) }' \
        || { echo "FAIR-RESULT vm0 share $mean outside [$1, $2]"; exit 1; }
fi
exit 0
