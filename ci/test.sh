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
    for target in $(cd protocol && cargo fuzz list); do
        echo "== fuzz protocol/$target for ${FUZZ_SECONDS}s"
        # cargo-fuzz needs nightly flags; RUSTC_BOOTSTRAP lets the stable toolchain accept them.
        (cd protocol && RUSTC_BOOTSTRAP=1 cargo fuzz run "$target" -- \
            -max_total_time="$FUZZ_SECONDS" -rss_limit_mb=2048 2>&1 | grep -E "^(Done|#[0-9]+.*DONE)|panicked|SUMMARY" || true)
        (cd protocol && test ! -d "fuzz/artifacts/$target" -o -z "$(ls -A "fuzz/artifacts/$target" 2>/dev/null)") || {
            echo "fuzz target $target found a crash:"; ls "protocol/fuzz/artifacts/$target"; exit 1; }
    done
fi
echo "== all tests passed"
