#!/usr/bin/env bash
# Runs on a GPU machine that has the CUDA driver and toolkit but no Rust toolchain, in two
# halves (ci/device/README.md):
#
#   ci/device/run.sh pack [--dir DIR] SUITE...     on a build machine: builds what the
#       suites need (release, stripped) into DIR (default target/device); copy DIR along
#       with a checkout of the same commit to the GPU machine.
#   ci/device/run.sh run [--dir DIR] [--out DIR] SUITE...   on the GPU machine, from the
#       repository root: runs the suites with the binaries in DIR, writes every log and
#       JSON file to the --out directory (default $OUT, else target/device-out) and prints
#       a summary of each.
#   ci/device/run.sh list                          the suites and what each needs.
#
# Suites (GPU: the cuda GPU; CPU: the sim, for a quiet many-core host):
#   gpu         GPU   host-shim's cuda_gpu tests
#   vram        GPU   the 3-VM VRAM stress on the GPU (bench/tests/vram_swap.rs three_vms:
#                     in process, then through GPU workers; SECS, default 60, EVICTIONS,
#                     default 4000)
#   large       GPU   vgpu-bench cuda --large --only workloads against native CUDA
#   cuda        GPU   the whole vgpu-bench cuda suite, standard sizes, against native CUDA
#   saxpy-step  GPU   issue 34: what costs each saxpy step ~1.5 us of GPU time in the VM
#                     (--only loop-overhead, RUNS rounds, default 2): native CUDA plain,
#                     with the prior REF write (--prior-ref) and built for sm_90; the VM
#                     as built, with every owed REF write at a mark, and with its kernels
#                     JIT-compiled from compute_75 PTX as nvcc's default build's are
#   owed-ref    GPU   issue 34: the owed-REF rule's A/B, RUNS rounds (default 5), each the
#                     standard workloads (saxpy, sgemm, hotspot) VM / CUDA native with the
#                     kernels' stores (--mark-owed-ref-over-us never, the rule before
#                     2026-12-08) then with the default (marks on untimed or long
#                     channels); then loop-overhead and b2b,latency twice with the default
#   swap        GPU   vgpu-bench swap --gpu cuda (oversubscription)
#   sandboxed   GPU   the sandboxed_daemon test on the GPU, and vgpu-smoke --loopback
#                     through `vgpu-backend --gpu cuda --seccomp kill`
#   mps         GPU   native CUDA's two-process fairness, time-sliced and under MPS
#   seccomp     GPU   vgpu-backend --gpu cuda in seccomp log mode (the kernel's records of
#                     what it would have killed) and kill mode, driven through vgpuctl
#   quiet-sched CPU   vgpu-bench scale --vms 64 and sched --only mixed,hostile three times
#                     each, vgpu-demo five times (RUNS scales all three counts)
#   workers     GPU   a GPU worker process per VM (issue 30): the cuda cases through a
#                     worker, two workers time-slicing against one, CYCLES (default 100)
#                     killed workers beside three verified ones, vgpu-smoke through
#                     vgpu-backend --gpu-workers in seccomp log mode (with the kernel's
#                     records) and kill mode
#   granularity GPU   a worker per VM against a worker per guest process (issue 30):
#                     vgpu-bench cuda --workers --only granularity (PROCS processes of one
#                     VM, default 4: device memory per worker, first-context time, kernel
#                     time kept), and the per-process worker test on the GPU
#   modules     GPU   guest modules (issue 31): the module cases through a worker on the GPU
#                     (PTX JIT-compiled by the driver), and the end-to-end test through
#                     vgpu-backend --gpu-workers (vector adds, a global, hostile inputs, a
#                     wild kernel losing its VM's worker beside another VM)
#   libcuda     GPU   the guest libcuda.so.1 (issue 31): the C programs of
#                     guest-driver/libcuda/tests/c through vgpu-backend --gpu-workers, then
#                     the same binaries with NVIDIA's libcuda.so.1 and with vgpu's, side by
#                     side (RUNS rounds, default 3): identical results, the launch rate of
#                     10,000 small kernels and the time of a large vector add, as ratios;
#                     a runtime-API matrix multiply (<<<>>>) built here with nvcc -cudart
#                     shared, with NVIDIA's libraries and with vgpu's libcudart.so.13
#   migration   GPU   migrate_loopback's cases through GPU workers (a VM per worker, a
#                     worker per guest process, a VM's own module and its variable moving
#                     with it), and the module variables a migration would carry for an
#                     nvcc-built program's fatbin
#   fuzz        CPU   every cargo-fuzz target at once in libFuzzer's fork mode for SECS
#                     seconds (default 560); WORKERS="virtqueue=3 session=3 ..." picks the
#                     targets and worker counts (default: 2 workers each)
#
# The native CUDA baseline (bench/cuda-native/native.cu with host-shim's kernels.cu) is
# compiled on the GPU machine with nvcc.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$ROOT"
die() { echo "device/run: $*" >&2; exit 1; }

ALL_SUITES="gpu vram large cuda saxpy-step owed-ref swap sandboxed mps seccomp quiet-sched workers granularity modules libcuda migration fuzz"
FUZZ_CRATES="protocol vgpu-backend"

# What each suite needs from the build machine: "bin:CRATE:NAME[:FEATURES]",
# "test:CRATE:NAME", "example:CRATE:NAME", "fuzz" and "libcuda" (the guest library as
# libcuda.so.1 and the C test programs linked against it, in DIR/libcuda).
needs() {
    case "$1" in
        gpu) echo "test:vgpu-host-shim:cuda_gpu" ;;
        vram) echo "test:vgpu-bench:vram_swap bin:vgpu-backend:vgpu-backend" ;;
        large|cuda|saxpy-step|owed-ref|swap) echo "bin:vgpu-bench:vgpu-bench" ;;
        sandboxed) echo "test:vgpu-backend:sandboxed_daemon bin:vgpu-backend:vgpu-backend" \
                        "bin:vgpu-guest-tools:vgpu-smoke:native,loopback" ;;
        mps) ;;
        seccomp) echo "bin:vgpu-backend:vgpu-backend bin:vgpu-backend:vgpuctl" ;;
        quiet-sched) echo "bin:vgpu-bench:vgpu-bench bin:vgpu-bench:vgpu-demo" ;;
        workers) echo "test:vgpu-gpu-worker:worker_cuda bin:vgpu-gpu-worker:vgpu-gpu-worker" \
                      "test:vgpu-backend:sandboxed_workers" \
                      "example:vgpu-gpu-worker:worker_faults example:vgpu-gpu-worker:worker_timeslice" \
                      "bin:vgpu-backend:vgpu-backend bin:vgpu-backend:vgpuctl" \
                      "bin:vgpu-guest-tools:vgpu-smoke:native,loopback" ;;
        granularity) echo "bin:vgpu-bench:vgpu-bench bin:vgpu-backend:vgpu-backend" \
                          "test:vgpu-bench:worker_processes" ;;
        modules) echo "test:vgpu-gpu-worker:worker_cuda bin:vgpu-gpu-worker:vgpu-gpu-worker" \
                      "test:vgpu-backend:guest_modules bin:vgpu-backend:vgpu-backend" ;;
        libcuda) echo "test:vgpu-libcuda:c_programs bin:vgpu-backend:vgpu-backend" \
                      "bin:vgpu-backend:vgpuctl libcuda" ;;
        migration) echo "test:vgpu-bench:migrate_loopback bin:vgpu-backend:vgpu-backend" \
                        "example:vgpu-protocol:module_variables" ;;
        fuzz) echo "fuzz" ;;
        *) die "unknown suite: $1 (one of: $ALL_SUITES)" ;;
    esac
}

# --- pack: on the build machine --------------------------------------------------------
# The path of a test binary cargo builds (from its JSON messages): the artifact of the
# test target itself, not the last executable cargo reports (a test that runs a binary
# of its crate, CARGO_BIN_EXE_*, makes cargo build and report that binary too, often
# last).
test_binary() {
    # Only the test target's artifact: binaries the test runs (CARGO_BIN_EXE) are built
    # and listed too.
    cargo test --release -p "$1" --test "$2" --no-run --message-format=json \
        | grep '"kind":\["test"\]' | grep "\"name\":\"$2\"" \
        | grep -o '"executable":"[^"]*"' | cut -d'"' -f4 | tail -n 1
}

pack() {
    local dir="$1"; shift
    local target_dir="${CARGO_TARGET_DIR:-$ROOT/target}"
    mkdir -p "$dir"
    local suite need kind crate name features exe
    for suite in "$@"; do
        for need in $(needs "$suite"); do
            IFS=: read -r kind crate name features <<<"$need"
            case "$kind" in
                bin)
                    cargo build --release -p "$crate" --bin "$name" \
                        ${features:+--features "$features"} >&2
                    strip -o "$dir/$name" "$target_dir/release/$name" ;;
                example)
                    cargo build --release -p "$crate" --example "$name" >&2
                    strip -o "$dir/$name" "$target_dir/release/examples/$name" ;;
                test)
                    exe="$(test_binary "$crate" "$name")" || exe=""
                    [ -n "$exe" ] || die "cargo built no test binary $crate/$name"
                    strip -o "$dir/$name" "$exe" ;;
                libcuda)
                    cargo build --release -p vgpu-libcuda -p vgpu-libcudart >&2
                    mkdir -p "$dir/libcuda"
                    strip -o "$dir/libcuda/libcuda.so.1" "$target_dir/release/libcuda.so"
                    strip -o "$dir/libcuda/libcudart.so.13" "$target_dir/release/libcudart.so"
                    local c prog
                    for c in guest-driver/libcuda/tests/c/*.c; do
                        prog="$(basename "$c" .c)"
                        cc -O2 -Wall -Werror -I guest-driver/libcuda/tests/c "$c" \
                            -o "$dir/libcuda/$prog" -L"$dir/libcuda" -l:libcuda.so.1
                    done ;;
                fuzz)
                    # cargo-fuzz needs nightly flags; RUSTC_BOOTSTRAP lets stable accept them.
                    ci/install-fuzz.sh
                    mkdir -p "$dir/fuzz/corpus"
                    for crate in $FUZZ_CRATES; do
                        (cd "$crate" && RUSTC_BOOTSTRAP=1 cargo fuzz build >&2)
                        for name in $(cd "$crate" && cargo fuzz list); do
                            # cargo puts them under CARGO_TARGET_DIR when that is set.
                            exe="${CARGO_TARGET_DIR:-$crate/fuzz/target}/x86_64-unknown-linux-gnu/release/$name"
                            [ -x "$exe" ] || exe="$crate/fuzz/target/x86_64-unknown-linux-gnu/release/$name"
                            strip -o "$dir/fuzz/$name" "$exe"
                            if [ -d "$crate/fuzz/corpus/$name" ]; then
                                mkdir -p "$dir/fuzz/corpus/$name"
                                cp -r "$crate/fuzz/corpus/$name/." "$dir/fuzz/corpus/$name/"
                            fi
                        done
                    done ;;
            esac
        done
    done
    echo "device/run: packed $* into $dir ($(du -sh "$dir" | cut -f1))" >&2
}

# --- run: on the GPU machine -----------------------------------------------------------
native_baseline() {
    [ -x "$WORK/cuda-native" ] && return
    nvcc -O2 -fmad=false -o "$WORK/cuda-native" bench/cuda-native/native.cu -lcuda 2>&1 | tail -3
}

suite_gpu() {
    timeout 240 "$B/cuda_gpu" --test-threads=1 2>&1 | tee "$O/cuda_gpu.txt" | grep -E "^test |result"
}

suite_vram() {
    # three_vms_through_workers: the workers are this vgpu-backend, on the GPU. One test
    # at a time: two stresses on one GPU lengthen each other's pauses.
    VGPU_TEST_GPU=cuda VGPU_WORKER_GPU=cuda VGPU_BACKEND_BIN="$B/vgpu-backend" \
        VGPU_SWAP_SECS="${SECS:-60}" VGPU_SWAP_EVICTIONS="${EVICTIONS:-4000}" \
        timeout 400 "$B/vram_swap" three_vms --nocapture --test-threads 1 2>&1 \
        | tee "$O/vram_stress.txt" \
        | grep -vE "^\s*$" | tail -8
}

suite_large() {
    native_baseline
    timeout 330 "$B/vgpu-bench" --json cuda --gpu cuda --baseline "$WORK/cuda-native" --vram-mib 8192 \
        --large --only workloads > "$O/cuda-large.json" 2> "$O/cuda-large.log"; echo "rc $?"
    grep -E "_ms\"|ratio" "$O/cuda-large.json" | cut -c1-150
    tail -3 "$O/cuda-large.log"
}

suite_cuda() {
    native_baseline
    timeout 450 "$B/vgpu-bench" --json cuda --gpu cuda --baseline "$WORK/cuda-native" --vram-mib 8192 \
        > "$O/cuda-full.json" 2> "$O/cuda-full.log"; echo "rc $?"
    grep -E "ratio|b2b|latency|share|off_by|evict|pause" "$O/cuda-full.json" | cut -c1-140
}

# One VM loop-overhead run for suite_saxpy-step: NAME, then vgpu-bench's extra arguments;
# prints the saxpy loop's GPU span and step p50.
saxpy_step_vm() {
    local n=$1; shift
    timeout 100 "$B/vgpu-bench" --json cuda --gpu cuda --baseline "$WORK/cuda-native" \
        --vram-mib 8192 --only loop-overhead "$@" > "$O/saxpy-step-$n.json" 2> "$O/saxpy-step-$n.log"
    echo "$n (rc $?): $(grep -hoE '"loop_vm_saxpy_(step_p50|warm_gpu_span)_us","value":[0-9.]+' \
        "$O/saxpy-step-$n.json" | tr '\n' ' ')"
}

suite_saxpy-step() {
    native_baseline
    nvcc -O2 -fmad=false -arch=sm_90 -o "$WORK/cuda-native-sm90" bench/cuda-native/native.cu -lcuda 2>&1 | tail -3
    local r runs="${RUNS:-2}"
    for r in $(seq "$runs"); do
        echo "-- round $r"
        timeout 60 "$WORK/cuda-native" --only loop-overhead > "$O/saxpy-step-native-$r.txt"
        timeout 60 "$WORK/cuda-native" --only loop-overhead --prior-ref > "$O/saxpy-step-native-prior-$r.txt"
        timeout 60 "$WORK/cuda-native-sm90" --only loop-overhead > "$O/saxpy-step-native-sm90-$r.txt"
        grep -HE "gpu_span|step_p50" "$O"/saxpy-step-native*-"$r".txt
        saxpy_step_vm "vm-$r"
        saxpy_step_vm "vm-marks-$r" --mark-owed-ref-over-us 0
        VGPU_NVRTC_ARCH=compute_75 saxpy_step_vm "vm-compute75-$r"
    done
}

# One vgpu-bench cuda run for suite_owed-ref: NAME, then vgpu-bench's extra arguments;
# prints the VM / CUDA native ratios and the issue-34 figures the run has.
owed_ref_run() {
    local n=$1; shift
    timeout 150 "$B/vgpu-bench" --json cuda --gpu cuda --baseline "$WORK/cuda-native" \
        --vram-mib 8192 "$@" > "$O/owed-ref-$n.json" 2> "$O/owed-ref-$n.log"
    echo "$n (rc $?): $(grep -hoE '"([a-z]+_vm_vs_cuda_native(_after_idle)?_device|b2b_vm_vs_cuda_direct|submit_latency_vm_minus_cuda_direct_p50|loop_vm_saxpy_(warm_gpu_span|step_p50)_us)","value":[0-9.-]+' \
        "$O/owed-ref-$n.json" | sed 's/"value"://; s/"//g' | tr '\n' ' ')"
}

suite_owed-ref() {
    native_baseline
    local r runs="${RUNS:-5}"
    for r in $(seq "$runs"); do
        owed_ref_run "never-$r" --only workloads --workloads saxpy,sgemm,hotspot --mark-owed-ref-over-us never
        owed_ref_run "default-$r" --only workloads --workloads saxpy,sgemm,hotspot
    done
    for r in 1 2; do
        owed_ref_run "loop-$r" --only loop-overhead
        owed_ref_run "b2b-$r" --only b2b,latency
    done
}

suite_swap() {
    timeout 420 "$B/vgpu-bench" --json swap --gpu cuda > "$O/swap-cuda.json" 2> "$O/swap-cuda.log"
    echo "rc $?"
    grep -E "slowdown\"|convergence|in_swap|moved" "$O/swap-cuda.json" | cut -c1-140
    tail -3 "$O/swap-cuda.log"
}

suite_sandboxed() {
    echo "-- sandboxed_daemon on the GPU"
    VGPU_TEST_GPU=cuda VGPU_BACKEND_BIN="$B/vgpu-backend" timeout 180 "$B/sandboxed_daemon" --nocapture 2>&1 \
        | tee "$O/sandboxed_daemon-cuda.txt" | grep -E "^test |result|panicked"
    echo "-- vgpu-smoke through vgpu-backend --gpu cuda --seccomp kill"
    local d="$WORK/sandboxed" p i
    mkdir -p "$d"
    "$B/vgpu-backend" --gpu cuda --gpu-workers=off --vram-mib 4096 --socket-dir "$d" --vm a --vm b --seccomp kill \
        > "$O/backend-smoke.log" 2>&1 &
    p=$!
    for i in $(seq 50); do [ -S "$d/a.sock" ] && break; sleep 0.2; done
    timeout 120 "$B/vgpu-smoke" --loopback "$d/a.sock" > "$O/smoke-a.txt" 2>&1; echo "smoke a rc $?"
    timeout 120 "$B/vgpu-smoke" --loopback "$d/b.sock" --rounds 3 > "$O/smoke-b.txt" 2>&1; echo "smoke b rc $?"
    tail -1 "$O/smoke-a.txt" "$O/smoke-b.txt"
    grep FAIL "$O/smoke-a.txt" "$O/smoke-b.txt" | head
    kill -0 $p && echo "backend alive" || echo "backend DIED"
    kill -TERM $p; wait $p; echo "backend exit rc=$?"
}

suite_workers() {
    export VGPU_GPU_WORKER="$B/vgpu-gpu-worker"
    # Workers run under their own seccomp filter (the worker's default is kill). First in
    # log mode, so what the filter lacks on this driver shows as the kernel's records
    # instead of a dead worker; every later step runs them in kill mode.
    dmesg -C 2>/dev/null
    workers_smoke log
    echo "-- the cuda cases through a worker, seccomp log"
    VGPU_WORKER_SECCOMP=log VGPU_WORKER_GPU=cuda timeout 300 "$B/worker_cuda" --test-threads=1 2>&1 \
        | tee "$O/worker_cuda-log.txt" | grep -E "result"
    echo "-- seccomp records in log mode (none expected):"
    seccomp_records | tee "$O/workers-seccomp-log.txt"
    dmesg -C 2>/dev/null
    echo "-- sandboxed_workers on the GPU (backend and workers under kill)"
    VGPU_WORKER_GPU=cuda VGPU_BACKEND_BIN="$B/vgpu-backend" VGPUCTL_BIN="$B/vgpuctl" \
        timeout 180 "$B/sandboxed_workers" \
        --test-threads=1 --nocapture 2>&1 | tee "$O/sandboxed_workers-cuda.txt" \
        | grep -E "^test |result|panicked"
    echo "-- the cuda cases through a worker"
    VGPU_WORKER_GPU=cuda timeout 300 "$B/worker_cuda" --test-threads=1 2>&1 \
        | tee "$O/worker_cuda.txt" | grep -E "^test |result"
    echo "-- two workers time-slicing against one"
    for _ in 1 2 3; do timeout 120 "$B/worker_timeslice" cuda 20000 2>&1 | grep -v INFO; done \
        | tee "$O/worker_timeslice.txt"
    echo "-- ${CYCLES:-100} killed workers beside three verified ones"
    timeout 600 "$B/worker_faults" cuda "${CYCLES:-100}" 2>&1 | grep -v INFO \
        | tee "$O/worker_faults.txt" | tail -6
    workers_smoke kill
    echo "-- seccomp kills in kill mode (none expected):"
    seccomp_records | tee "$O/workers-seccomp-kill.txt"
}

suite_granularity() {
    echo "-- a worker per VM against a worker per guest process, ${PROCS:-4} processes"
    VGPU_BACKEND_BIN="$B/vgpu-backend" timeout 420 "$B/vgpu-bench" --json cuda --gpu cuda \
        --workers --only granularity --processes "${PROCS:-4}" --vram-mib 8192 \
        > "$O/granularity.json" 2> "$O/granularity.log"; echo "rc $?"
    grep -E "granularity" "$O/granularity.json" | cut -c1-140
    echo "-- worker_processes on the GPU (a worker per guest process, one killed)"
    VGPU_WORKER_GPU=cuda VGPU_BACKEND_BIN="$B/vgpu-backend" timeout 180 "$B/worker_processes" \
        --test-threads=1 --nocapture 2>&1 | tee "$O/worker_processes-cuda.txt" \
        | grep -E "^test |result|panicked"
}

# The kernel's seccomp records (type=1326) since the last `dmesg -C`, counted by
# process name and syscall number.
seccomp_records() {
    dmesg 2>/dev/null | grep "type=1326" | grep -o "comm=[^ ]* .*syscall=[0-9]*" \
        | sed 's/ exe=.*syscall/ syscall/' | sort | uniq -c | head -20
}

# vgpu-smoke through `vgpu-backend --gpu cuda --gpu-workers --seccomp MODE`: the launcher,
# the workers (their filters), three smoke runs (a reconnect among them), nothing left.
workers_smoke() {
    local mode=$1 d="$WORK/workers-$1" p s l w
    mkdir -p "$d"
    echo "-- vgpu-smoke through vgpu-backend --gpu-workers --seccomp $mode"
    RUST_LOG=info "$B/vgpu-backend" --gpu cuda --gpu-workers --seccomp "$mode" --socket-dir "$d" \
        --vm a --vm b > "$O/backend-workers-$mode.log" 2>&1 &
    p=$!
    for _ in $(seq 50); do [ -S "$d/b.sock" ] && break; sleep 0.2; done
    for s in a a b; do
        timeout 120 "$B/vgpu-smoke" --loopback "$d/$s.sock" --seed $RANDOM 2>&1 | grep -vE "PASS"
    done | tee "$O/smoke-workers-$mode.txt"
    l=$(pgrep -P $p -f worker-launcher || true)
    ps -o pid,ppid,stat,cmd --ppid "$p${l:+,$l}" | tee -a "$O/smoke-workers-$mode.txt"
    for w in $(pgrep -P "${l:-0}" || true); do
        echo "worker $w: $(grep -E '^(Seccomp|NoNewPrivs|CapEff):' /proc/$w/status | tr -s '\t\n' '  ')"
    done | tee -a "$O/smoke-workers-$mode.txt"
    kill -0 $p 2>/dev/null || echo "backend DIED"
    kill -TERM $p; wait $p; echo "backend exit rc=$?"
    sleep 1; echo "launcher or workers left: $(pgrep -fc 'vgpu-backend worker' || true)"
}

suite_modules() {
    export VGPU_GPU_WORKER="$B/vgpu-gpu-worker" VGPU_BACKEND_BIN="$B/vgpu-backend"
    echo "-- the module cases through a worker"
    VGPU_WORKER_GPU=cuda timeout 300 "$B/worker_cuda" module --test-threads=1 2>&1 \
        | tee "$O/worker_cuda_modules.txt" | grep -E "^test |result"
    echo "-- guest modules end to end through vgpu-backend --gpu-workers"
    VGPU_WORKER_GPU=cuda timeout 300 "$B/guest_modules" --test-threads=1 2>&1 \
        | tee "$O/guest_modules.txt" | grep -E "^test |result"
}

# The same program binary with NVIDIA's libcuda.so.1 (native) and with vgpu's through
# a backend with a worker per VM; prints both outputs' last lines.
libcuda_pair() {
    local name=$1; shift
    local p="$B/libcuda/$name"
    [ -x "$p" ] || p="$WORK/$name"
    native_out="$(LD_LIBRARY_PATH="${CUDA_LIB:-/usr/local/cuda/lib64}" timeout 120 "$p" "$@" \
        2>>"$O/libcuda-native.err")" || native_out="FAILED $?"
    vgpu_out="$(LD_LIBRARY_PATH="$B/libcuda" VGPU_LOOPBACK_SOCKET="$LIBCUDA_SOCK" \
        VGPU_LOOPBACK_MEM_MIB=1024 timeout 120 "$p" "$@" 2>>"$O/libcuda-vgpu.err")" \
        || vgpu_out="FAILED $?"
    echo "native: $native_out" | tee -a "$O/libcuda-bench.txt"
    echo "vgpu:   $vgpu_out" | tee -a "$O/libcuda-bench.txt"
}

# A field KEY=VALUE of a program's output line.
field() { tr ' ' '\n' <<<"$1" | sed -n "s/^$2=//p"; }

# The share of the GPU time VM $2 used in the last 10 s, from `vgpuctl --json vm list`
# in file $1.
vm_share() {
    awk -v vm="$2" '/"name":/ { gsub(/[",]/, "", $2); cur = $2 }
        /"gpu_share_10s":/ && cur == vm { gsub(/,/, "", $2); print $2 }' "$1"
}

# Two VMs of weights 1:2 running user programs of different kernel lengths (a vector add
# of 2^24 and of 2^26 elements, about 75 and 290 us) through vgpu's libcuda, each VM's
# share of the GPU time read from the API; then one VM oversubscribed 2x with a cold set.
libcuda_sharing() {
    local ptx=$1 d="$WORK/libcuda-fair" p r pa pb env
    mkdir -p "$d"
    echo "-- two VMs, weights 1:2, kernels of 75 and 290 us"
    RUST_LOG=info "$B/vgpu-backend" --gpu cuda --gpu-workers --vram-mib 16384 --socket-dir "$d" \
        --vm a --vm b --vm-weight a=100 --vm-weight b=200 --api-socket "$d/api.sock" \
        > "$O/libcuda-fair-backend.log" 2>&1 &
    p=$!
    for r in $(seq 100); do [ -S "$d/b.sock" ] && [ -S "$d/api.sock" ] && break; sleep 0.1; done
    env="LD_LIBRARY_PATH=$B/libcuda VGPU_LOOPBACK_MEM_MIB=1024"
    env $env VGPU_LOOPBACK_SOCKET="$d/a.sock" timeout 60 "$B/libcuda/vadd_loop" "$ptx" 600000 16777216 \
        > "$O/libcuda-fair-a.txt" 2>&1 &
    pa=$!
    env $env VGPU_LOOPBACK_SOCKET="$d/b.sock" timeout 60 "$B/libcuda/vadd_loop" "$ptx" 200000 67108864 \
        > "$O/libcuda-fair-b.txt" 2>&1 &
    pb=$!
    sleep 14
    for r in 1 2 3; do
        "$B/vgpuctl" --socket "$d/api.sock" --json vm list > "$O/libcuda-fair-$r.json"
        echo "weights_1_2_user_programs share a $(vm_share "$O/libcuda-fair-$r.json" a)" \
            "b $(vm_share "$O/libcuda-fair-$r.json" b) (targets 0.333 0.667)" \
            | tee -a "$O/libcuda-bench.txt"
        sleep 3
    done
    kill $pa $pb 2>/dev/null; wait $pa $pb 2>/dev/null
    kill -TERM $p; wait $p
    echo "-- one VM oversubscribed 2x: a 1 GiB quota, a 192 MiB hot set, 1,856 MiB cold"
    d="$WORK/libcuda-swap"; mkdir -p "$d"
    RUST_LOG=info "$B/vgpu-backend" --gpu cuda --gpu-workers --vram-mib 8192 --vm-vram-mib 1024 \
        --vm-swap-mib 4096 --socket-dir "$d" --vm a > "$O/libcuda-swap-backend.log" 2>&1 &
    p=$!
    for r in $(seq 100); do [ -S "$d/a.sock" ] && break; sleep 0.1; done
    local plain cold
    for r in 1 2 3; do
        plain="$(env $env VGPU_LOOPBACK_SOCKET="$d/a.sock" timeout 120 "$B/libcuda/vadd_loop" \
            "$ptx" 2000 16777216 0 2>>"$O/libcuda-vgpu.err")"
        cold="$(env $env VGPU_LOOPBACK_SOCKET="$d/a.sock" timeout 120 "$B/libcuda/vadd_loop" \
            "$ptx" 2000 16777216 1856 2>>"$O/libcuda-vgpu.err")"
        echo "plain: $plain" | tee -a "$O/libcuda-bench.txt"
        echo "cold:  $cold" | tee -a "$O/libcuda-bench.txt"
        echo "oversubscribed_2x_time_over_plain $(awk -v c="$(field "$cold" seconds)" \
            -v p="$(field "$plain" seconds)" 'BEGIN { if (p > 0) printf "%.3f", c / p; else print "n/a" }')" \
            | tee -a "$O/libcuda-bench.txt"
    done
    kill -TERM $p; wait $p
    grep -E "evict|swap" "$O/libcuda-swap-backend.log" | tail -3
}

suite_libcuda() {
    export VGPU_BACKEND_BIN="$B/vgpu-backend" VGPU_LIBCUDA_PROGRAMS="$B/libcuda"
    local ptx=host-shim/tests/data/test_module.ptx d="$WORK/libcuda" p r runs="${RUNS:-3}"
    echo "-- the C programs through vgpu-backend --gpu-workers (VGPU_WORKER_GPU=cuda)"
    VGPU_WORKER_GPU=cuda timeout 300 "$B/c_programs" --test-threads=1 2>&1 \
        | tee "$O/libcuda_programs.txt" | grep -E "^test |result"
    echo "-- the same binaries: NVIDIA's libcuda.so.1, then vgpu's"
    mkdir -p "$d"
    RUST_LOG=info "$B/vgpu-backend" --gpu cuda --gpu-workers --vram-mib 8192 --socket-dir "$d" \
        --vm a > "$O/libcuda-backend.log" 2>&1 &
    p=$!
    LIBCUDA_SOCK="$d/a.sock"
    for r in $(seq 100); do [ -S "$LIBCUDA_SOCK" ] && break; sleep 0.1; done
    : > "$O/libcuda-bench.txt"
    for r in vector_add:1048576 streams_events:262144 device_global:0x5eed \
            pointer_chase:131072; do
        libcuda_pair "${r%%:*}" "$ptx" "${r#*:}"
        [ "$native_out" = "$vgpu_out" ] && echo "identical: ${r%%:*}" \
            || echo "DIFFERENT: ${r%%:*}"
    done | tee -a "$O/libcuda-bench.txt"
    local rates="" times="" ratio
    for r in $(seq "$runs"); do
        echo "-- round $r"
        libcuda_pair launch_rate "$ptx" 10000 256
        ratio=$(awk -v v="$(field "$vgpu_out" rate)" -v n="$(field "$native_out" rate)" \
            'BEGIN { printf "%.3f", v / n }')
        rates="$rates $ratio"
        echo "launch_rate_vm_over_native $ratio" | tee -a "$O/libcuda-bench.txt"
        libcuda_pair vadd_loop "$ptx" 200 67108864
        ratio=$(awk -v v="$(field "$vgpu_out" seconds)" -v n="$(field "$native_out" seconds)" \
            'BEGIN { printf "%.3f", v / n }')
        times="$times $ratio"
        echo "vadd_loop_time_vm_over_native $ratio" | tee -a "$O/libcuda-bench.txt"
    done
    echo "-- the device's attributes and properties: the lines that differ (native < > vgpu)"
    libcuda_pair device_attributes >/dev/null
    diff <(echo "$native_out") <(echo "$vgpu_out") | grep '^[<>]' \
        | tee "$O/libcuda-attributes-diff.txt" | head -80
    echo "attributes_differing $(grep -c '^<' "$O/libcuda-attributes-diff.txt")" \
        | tee -a "$O/libcuda-bench.txt"
    nvcc -O2 -cudart shared -o "$WORK/device_props" guest-driver/libcudart/tests/cu/device_props.cu \
        2>&1 | tail -3
    libcuda_pair device_props >/dev/null
    diff <(echo "$native_out") <(echo "$vgpu_out") | grep '^[<>]' \
        | tee "$O/libcudart-props-diff.txt" | head -60
    echo "properties_differing $(grep -c '^<' "$O/libcudart-props-diff.txt")" \
        | tee -a "$O/libcuda-bench.txt"
    echo "-- a runtime-API program whose kernels store and follow pointers (identity addressing)"
    nvcc -O2 -cudart shared -o "$WORK/linked_list" guest-driver/libcudart/tests/cu/linked_list.cu \
        2>&1 | tail -3
    libcuda_pair linked_list 1048576
    [ "$native_out" = "$vgpu_out" ] && echo "identical: linked_list" \
        || echo "DIFFERENT: linked_list"
    echo "-- a runtime-API program (<<<>>>) built here with nvcc -cudart shared"
    nvcc -O2 -cudart shared -o "$WORK/matmul" guest-driver/libcudart/tests/cu/matmul.cu 2>&1 | tail -3
    nm -D --undefined-only "$WORK/matmul" | grep -i cuda | tee "$O/matmul-symbols.txt"
    local mm=""
    for r in $(seq "$runs"); do
        libcuda_pair matmul 1024 20
        { [ "${native_out%%$'\n'*}" = "${vgpu_out%%$'\n'*}" ] && echo "identical: matmul" \
            || echo "DIFFERENT: matmul"; } | tee -a "$O/libcuda-bench.txt"
        ratio=$(awk -v v="$(field "$(tail -1 <<<"$vgpu_out")" ms_per_kernel)" \
            -v n="$(field "$(tail -1 <<<"$native_out")" ms_per_kernel)" \
            'BEGIN { if (n > 0) printf "%.3f", v / n; else print "n/a" }')
        mm="$mm $ratio"
        echo "matmul_time_vm_over_native $ratio" | tee -a "$O/libcuda-bench.txt"
    done
    # The medians of the rounds (each round's two runs one right after the other).
    median() { tr ' ' '\n' | grep . | sort -n | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'; }
    echo "launch_rate_vm_over_native_median $(median <<<"$rates") of$rates" \
        | tee -a "$O/libcuda-bench.txt"
    echo "vadd_loop_time_vm_over_native_median $(median <<<"$times") of$times" \
        | tee -a "$O/libcuda-bench.txt"
    echo "matmul_time_vm_over_native_median $(median <<<"$mm") of$mm" \
        | tee -a "$O/libcuda-bench.txt"
    libcuda_sharing "$ptx"
    kill -TERM $p; wait $p
    grep -iE "error|panic" "$O/libcuda-backend.log" | head -5
}

# Live migration between two backends on the GPU with a worker per VM (and per guest
# process), and a VM's own module moving with its variable; then which variables of an
# nvcc-built program's fatbin a migration would carry.
suite_migration() {
    export VGPU_BACKEND_BIN="$B/vgpu-backend"
    echo "-- migrate_loopback through GPU workers (VGPU_WORKER_GPU=cuda)"
    VGPU_WORKER_GPU=cuda timeout 400 "$B/migrate_loopback" --test-threads=1 workers own_module \
        2>&1 | tee "$O/migrate_loopback.txt" | grep -E "^test |result|^migration"
    echo "-- the variables of nvcc-built fatbins"
    nvcc -O2 -cudart shared -o "$WORK/matmul" guest-driver/libcudart/tests/cu/matmul.cu 2>&1 | tail -3
    objcopy -O binary --only-section=.nv_fatbin "$WORK/matmul" "$WORK/matmul.fatbin"
    "$B/module_variables" "$WORK/matmul.fatbin" 2>&1 | tee "$O/module_variables.txt"
    nvcc -O2 -cudart shared -arch=sm_90 -o "$WORK/matmul90" guest-driver/libcudart/tests/cu/matmul.cu 2>&1 | tail -3
    objcopy -O binary --only-section=.nv_fatbin "$WORK/matmul90" "$WORK/matmul90.fatbin"
    "$B/module_variables" "$WORK/matmul90.fatbin" 2>&1 | tee -a "$O/module_variables.txt"
}

suite_mps() {
    native_baseline
    if ! command -v nvidia-cuda-mps-control >/dev/null; then
        echo "no nvidia-cuda-mps-control on this machine" | tee "$O/fairness-mps.txt"
        return
    fi
    timeout 60 "$WORK/cuda-native" --only fairness | tee "$O/fairness-timeslicing.txt"
    export CUDA_MPS_PIPE_DIRECTORY="$WORK/mps-pipe" CUDA_MPS_LOG_DIRECTORY="$WORK/mps-log"
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    nvidia-cuda-mps-control -d && echo "MPS started"
    timeout 60 "$WORK/cuda-native" --only fairness | tee "$O/fairness-mps.txt"
    echo quit | nvidia-cuda-mps-control
    tail -5 "$CUDA_MPS_LOG_DIRECTORY/control.log" 2>/dev/null
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
}

# One seccomp mode: start the backend, show its filters, drive the API, stop it.
seccomp_mode() {
    local mode=$1 d="$WORK/seccomp-$1" p t
    mkdir -p "$d"
    echo "-- --seccomp $mode"
    RUST_LOG=info "$B/vgpu-backend" --gpu cuda --gpu-workers=off --vram-mib 2048 --socket-dir "$d" --vm a --vm b \
        --api-socket "$d/api.sock" --seccomp "$mode" > "$O/backend-$mode.log" 2>&1 &
    p=$!
    sleep 8
    if ! kill -0 $p 2>/dev/null; then
        wait $p; echo "DIED rc=$?"; tail -20 "$O/backend-$mode.log"; return
    fi
    echo "alive after 8 s"
    grep -E "Seccomp|NoNewPrivs|CapEff" /proc/$p/status
    for t in /proc/$p/task/*; do echo "$(cat "$t/comm") $(grep Seccomp_filters "$t/status" 2>/dev/null)"; done \
        | sort | uniq -c
    "$B/vgpuctl" --socket "$d/api.sock" info 2>&1 | head -15
    "$B/vgpuctl" --socket "$d/api.sock" vm list 2>&1 | head -5
    "$B/vgpuctl" --socket "$d/api.sock" vm set-weight a 300 2>&1 | head -3
    sleep 2
    kill -0 $p 2>/dev/null && echo "alive after API calls" || { wait $p; echo "DIED rc=$?"; }
    kill -TERM $p; wait $p; echo "exit rc=$?"
    tail -5 "$O/backend-$mode.log"
}

suite_seccomp() {
    dmesg -C 2>/dev/null
    seccomp_mode log
    dmesg 2>/dev/null | grep "type=1326" | grep -o "comm=[^ ]* .*syscall=[0-9]*" \
        | sed 's/ exe=.*syscall/ syscall/' | sort | uniq -c | head -20
    seccomp_mode kill
}

suite_quiet-sched() {
    local runs="${RUNS:-3}" i
    nproc; uptime
    for i in $(seq "$runs"); do
        echo "-- scale --vms 64 (run $i)"
        timeout 120 "$B/vgpu-bench" scale --vms 64 > "$O/scale64-$i.txt" 2> "$O/scale64-$i.err"
        grep -E "sched_cpu|quiet|observed" "$O/scale64-$i.txt" | head -8
    done
    for i in $(seq "$runs"); do
        echo "-- sched --only mixed,hostile (run $i)"
        timeout 200 "$B/vgpu-bench" sched --only mixed,hostile > "$O/sched-mixed-$i.txt" 2> "$O/sched-mixed-$i.err"
        grep -E "mixed_|short_vs_long|channels16" "$O/sched-mixed-$i.txt"
    done
    for i in $(seq $((runs * 5 / 3))); do
        echo "-- vgpu-demo (run $i)"
        timeout 90 "$B/vgpu-demo" > "$O/demo-$i.txt" 2>&1
        grep -i "verdict\|entitle" "$O/demo-$i.txt" | tail -12
    done
}

suite_fuzz() {
    local f="$B/fuzz" secs="${SECS:-560}" workers="${WORKERS:-}" tw t w c
    if [ -z "$workers" ]; then
        for t in $(ls "$f" | grep -v '^corpus$'); do workers="$workers $t=2"; done
    fi
    for tw in $workers; do
        t=${tw%=*}; w=${tw#*=}
        c="$WORK/corpus/$t"; mkdir -p "$c" "$O/crash-$t"
        [ ! -d "$f/corpus/$t" ] || cp -r "$f/corpus/$t/." "$c/"
        ( cd "$O/crash-$t" && timeout $((secs + 30)) "$f/$t" -fork="$w" -max_total_time="$secs" \
            -rss_limit_mb=2048 -ignore_crashes=0 "$c" > "$O/fuzz-$t.log" 2>&1 ) &
    done
    wait
    for tw in $workers; do
        t=${tw%=*}; w=${tw#*=}
        echo "$t workers=$w secs=$secs: $(grep -E '^#[0-9]+' "$O/fuzz-$t.log" | tail -1)"
        grep -E "ERROR|panicked|deadly|SUMMARY" "$O/fuzz-$t.log" | head -3
        ls "$O/crash-$t" | head -3
    done
}

run() {
    local s
    if [ -d "$1" ]; then
        B="$(cd "$1" && pwd)"
    else
        for s in "${@:3}"; do
            [ -z "$(needs "$s")" ] || die "no binaries in $1 (ci/device/run.sh pack ${*:3}, then copy it here)"
        done
        B="$1"
    fi
    O="$2"; shift 2
    mkdir -p "$O"; O="$(cd "$O" && pwd)"
    WORK="$(mktemp -d)"
    trap 'rm -rf "$WORK"' EXIT
    # B and O are absolute: a suite may change directory.
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$O/gpu.txt"
    fi
    local suite t0
    # A suite's commands may fail: each prints its status and the run goes on.
    set +e
    for suite in "$@"; do
        t0=$(date +%s)
        echo "== $suite"
        "suite_$suite"
        echo "== $suite done ($(( $(date +%s) - t0 )) s)"
    done
    # Everything once more in one archive: a lent machine may send back only a few of
    # the files a run leaves (the name sorts first).
    tar czf "$WORK/all-results.tgz" -C "$O" --exclude all-results.tgz . \
        && mv "$WORK/all-results.tgz" "$O/all-results.tgz"
}

[ $# -gt 0 ] || { sed -n '2,33p' "$0"; exit 2; }
CMD="$1"; shift
DIR="target/device"
OUT_DIR="${OUT:-target/device-out}"
while [ $# -gt 0 ]; do
    case "$1" in
        --dir) DIR="$2"; shift 2 ;;
        --out) OUT_DIR="$2"; shift 2 ;;
        -h|--help) sed -n '2,33p' "$0"; exit 0 ;;
        -*) die "unknown option: $1" ;;
        *) break ;;
    esac
done
case "$CMD" in
    list)
        for s in $ALL_SUITES; do printf '%-12s %s\n' "$s" "$(needs "$s" | tr '\n' ' ')"; done ;;
    pack|run)
        [ $# -gt 0 ] || die "name the suites (ci/device/run.sh list)"
        for s in "$@"; do needs "$s" >/dev/null; done
        if [ "$CMD" = pack ]; then pack "$DIR" "$@"; else run "$DIR" "$OUT_DIR" "$@"; fi ;;
    *) die "pack, run or list (ci/device/run.sh --help)" ;;
esac
