#!/usr/bin/env bash
# Installs cargo-fuzz from crates.io unless it is already there.
set -euo pipefail
if ! cargo fuzz --version >/dev/null 2>&1; then
    cargo install cargo-fuzz --locked --version 0.13.2
fi
