#!/usr/bin/env bash
# The whole test suite: unit, integration and property tests of every crate, then a
# bounded cargo-fuzz run of every fuzz target. Installs what it needs (idempotent).
set -euo pipefail
cd "$(dirname "$0")/.."

FUZZ_SECONDS="${FUZZ_SECONDS:-30}"

echo "== cargo test (workspace)"
cargo test --workspace --release 2>&1

if [ "${SKIP_FUZZ:-0}" != "1" ]; then
    ci/install-fuzz.sh
    # Every parser of guest input has a fuzz target: the protocol decoders and the
    # backend's request handling (a whole session driven by arbitrary bytes).
    for crate in protocol vgpu-backend; do
        for target in $(cd "$crate" && cargo fuzz list); do
            echo "== fuzz $crate/$target for ${FUZZ_SECONDS}s"
            rm -rf "$crate/fuzz/artifacts/$target"
            # cargo-fuzz needs nightly flags; RUSTC_BOOTSTRAP lets stable accept them.
            (cd "$crate" && RUSTC_BOOTSTRAP=1 cargo fuzz run "$target" -- \
                -max_total_time="$FUZZ_SECONDS" -rss_limit_mb=2048 2>&1 \
                | grep -E "^Done|panicked|SUMMARY|deadly" || true)
            if [ -n "$(ls -A "$crate/fuzz/artifacts/$target" 2>/dev/null)" ]; then
                echo "fuzz target $crate/$target found a crash:"
                ls "$crate/fuzz/artifacts/$target"
                exit 1
            fi
        done
    done
fi
echo "== all tests passed"
