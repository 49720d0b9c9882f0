/work/main/target-budget/release/deps/bitflags-32fae2215a89adb5.d: /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/bitflags-1.3.2/src/lib.rs

/work/main/target-budget/release/deps/libbitflags-32fae2215a89adb5.rlib: /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/bitflags-1.3.2/src/lib.rs

/work/main/target-budget/release/deps/libbitflags-32fae2215a89adb5.rmeta: /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/bitflags-1.3.2/src/lib.rs

/root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/bitflags-1.3.2/src/lib.rs:
