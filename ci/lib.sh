# Shared functions of the CI scripts: the step timer of .ci/run and ci/test.sh, and the
# setup of the rig and QEMU scripts (ci/rig/l2-*.sh, ci/qemu/guest-test.sh): where the
# binaries are, the static (musl) build, the rig's Debian kernel and its virtio modules,
# the guest driver, and the stripped guest tools for an L2 initramfs.
#
# Source it after setting ROOT (the repository root) and defining die():
#   ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
#   die() { echo "my-script: $*" >&2; exit 1; }
#   . "$ROOT/ci/lib.sh"
# Sourcing sets:
#   TARGET_DIR  cargo's target directory: $CARGO_TARGET_DIR, default <repo>/target
#   MUSL        where the static release binaries are
#   HOSTBIN     where the host (glibc) release binaries are
#   GUEST_TOOLS the static guest tools an L2 carries
#   VIRTIO_MODS the virtio modules L2 loads, in dependency order
#               (modprobe --show-depends virtio_pci)

TARGET_DIR="${CARGO_TARGET_DIR:-$ROOT/target}"
MUSL="$TARGET_DIR/x86_64-unknown-linux-musl/release"
HOSTBIN="$TARGET_DIR/release"
GUEST_TOOLS="vgpu-smoke vgpu-throttle vgpu-guest-bench"
VIRTIO_MODS="virtio_ring virtio virtio_pci_modern_dev virtio_pci_legacy_dev virtio_pci"

# musl_build CARGO-BUILD-ARGS...: a static release build (installs the musl target first
# if missing); cargo's output goes to stderr.
musl_build() {
    rustup target list --installed | grep -q x86_64-unknown-linux-musl \
        || rustup target add x86_64-unknown-linux-musl >&2
    (cd "$ROOT" && cargo build --release --target x86_64-unknown-linux-musl "$@" >&2)
}

# musl_build_guest_tools: the static guest tools (they build on the guest runtime alone:
# no backend, VMM or sim).
musl_build_guest_tools() {
    local bins=() t
    for t in $GUEST_TOOLS; do bins+=(--bin "$t"); done
    musl_build -p vgpu-guest-tools "${bins[@]}"
}

# rig_kernel [KVER]: the rig's L1 image (built by ci/rig/build-l1.sh if missing) and its
# Debian kernel. Sets KERNEL (the bzImage), KVER (its version, or the one given) and
# MODDIR (that version's virtio modules).
rig_kernel() {
    [ -f "$ROOT/ci/cache/rig/l1.cpio.gz" ] || "$ROOT/ci/rig/build-l1.sh" >&2
    KERNEL="$(readlink -f "$ROOT/ci/cache/rig/vmlinuz")"
    KVER="${1:-$(basename "$KERNEL" | sed 's/^vmlinuz-//')}"
    MODDIR="$ROOT/ci/cache/rig/kernel-$KVER/lib/modules/$KVER/kernel/drivers/virtio"
}

# build_guest_driver: vgpu.ko for the rig kernel (rig_kernel first), installing that
# kernel's headers if missing.
build_guest_driver() {
    local kdir="/usr/src/linux-headers-$KVER"
    [ -d "$kdir" ] || apt-get install -y --no-install-recommends "linux-headers-$KVER" >&2
    make -C "$ROOT/guest-driver/kernel" KDIR="$kdir" >&2
}

# add_virtio_mods ARRAY: appends "--add <module>:/mods/<module>.ko" for every module of
# VIRTIO_MODS to the array named ARRAY (l2-initramfs.sh arguments; rig_kernel first).
add_virtio_mods() {
    local -n adds_ref="$1"
    local m
    for m in $VIRTIO_MODS; do
        [ -f "$MODDIR/$m.ko" ] || die "no $MODDIR/$m.ko (rebuild the rig: ci/rig/build-l1.sh)"
        adds_ref+=(--add "$MODDIR/$m.ko:/mods/$m.ko")
    done
}

# add_guest_tools DIR ARRAY: strips the static guest tools into DIR (the L2 initramfs
# rides inside L1's) and appends "--add DIR/<tool>:/bin/<tool>" for each to ARRAY.
add_guest_tools() {
    local dir="$1" t
    local -n tools_ref="$2"
    for t in $GUEST_TOOLS; do
        [ -x "$MUSL/$t" ] || die "no static $t in $MUSL (drop --no-build)"
        strip -o "$dir/$t" "$MUSL/$t"
        tools_ref+=(--add "$dir/$t:/bin/$t")
    done
}

# build_guest_cuda: the guest libcuda.so.1 and libcudart.so.13 as a guest installs them
# (no loopback VM in them: --no-default-features; in a target directory of their own, so
# the workspace's libraries keep their features) and the C programs the rig's guests run
# against them over /dev/vgpu (guest-driver/libcuda/tests/c/devvgpu_program.c, the
# driver API; guest-driver/libcudart/tests/c/devvgpu_runtime.c, the runtime API), in
# $TARGET_DIR/guest-cuda.
build_guest_cuda() {
    local t="$TARGET_DIR/guest-cuda" c="$ROOT/guest-driver/libcuda/tests/c"
    local rt="$ROOT/guest-driver/libcudart/tests/c"
    CARGO_TARGET_DIR="$t" cargo build --release -p vgpu-libcuda --no-default-features >&2
    CARGO_TARGET_DIR="$t" cargo build --release -p vgpu-libcudart >&2
    mkdir -p "$t/lib"
    strip -o "$t/lib/libcuda.so.1" "$t/release/libcuda.so"
    strip -o "$t/lib/libcudart.so.13" "$t/release/libcudart.so"
    gcc -O2 -Wall -Werror -I "$c" -o "$t/cuda-program" "$c/devvgpu_program.c" \
        -L"$t/lib" -l:libcuda.so.1 >&2
    gcc -O2 -Wall -Werror -I "$rt" -o "$t/cuda-runtime-program" "$rt/devvgpu_runtime.c" \
        -L"$t/lib" -l:libcudart.so.13 >&2
}

# add_guest_cuda ARRAY: the guest libraries (at /lib/vgpu), the C programs
# (/bin/cuda-program, /bin/cuda-runtime-program) and the C libraries they need, as --add
# arguments appended to the array named ARRAY; nothing if build_guest_cuda has not run.
add_guest_cuda() {
    local t="$TARGET_DIR/guest-cuda" lib prog
    local -n cuda_ref="$1"
    [ -x "$t/cuda-program" ] || return 0
    cuda_ref+=(--add "$t/cuda-program:/bin/cuda-program" --add "$t/lib/libcuda.so.1:/lib/vgpu/libcuda.so.1")
    if [ -x "$t/cuda-runtime-program" ]; then
        cuda_ref+=(--add "$t/cuda-runtime-program:/bin/cuda-runtime-program"
                   --add "$t/lib/libcudart.so.13:/lib/vgpu/libcudart.so.13")
    fi
    for prog in "$t/cuda-program" "$t/cuda-runtime-program"; do
        [ -x "$prog" ] && LD_LIBRARY_PATH="$t/lib" ldd "$prog"
    done | grep -o '/[^ ]*' | sort -u > "$t/needed"
    while read -r lib; do
        case "$lib" in "$t"/*) ;; *) cuda_ref+=(--add "$lib:$lib") ;; esac
    done < "$t/needed"
}

# --- step times -----------------------------------------------------------------------
# ci_steps_begin: the outermost script that calls it (.ci/run, or ci/test.sh run alone)
# prints a table of every step's wall time when it exits, nested ones' steps included
# (they share the file VGPU_CI_STEPS names).
ci_steps_begin() {
    [ -z "${VGPU_CI_STEPS:-}" ] || return 0
    VGPU_CI_STEPS="$(mktemp)"
    export VGPU_CI_STEPS
    CI_STEPS_START=$SECONDS
    trap ci_steps_summary EXIT
}

# ci_step NAME COMMAND...: runs COMMAND (a program or a function; a function runs
# without errexit, so it must return its failures), prints "== step NAME (N s)" and
# records the time; returns COMMAND's status.
ci_step() {
    local name="$1" t0=$SECONDS rc=0 dt
    shift
    echo "== $name"
    "$@" || rc=$?
    dt=$((SECONDS - t0))
    echo "== step $name ($dt s)$([ "$rc" = 0 ] || echo ", failed with status $rc")"
    [ -z "${VGPU_CI_STEPS:-}" ] || printf '%s\t%s\t%s\n' "$dt" "$rc" "$name" >> "$VGPU_CI_STEPS"
    return "$rc"
}

ci_steps_summary() {
    local rc=$? secs status name
    if [ -s "$VGPU_CI_STEPS" ]; then
        echo "== step times (wall, s)"
        while IFS=$'\t' read -r secs status name; do
            printf '%7s  %s%s\n' "$secs" "$name" "$([ "$status" = 0 ] || echo "  (failed)")"
        done < "$VGPU_CI_STEPS"
        printf '%7s  %s\n' "$((SECONDS - CI_STEPS_START))" "total"
    fi
    rm -f "$VGPU_CI_STEPS"
    return "$rc"
}
