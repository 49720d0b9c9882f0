//! Gives the shared library the soname programs link against (`libcuda.so.1`), as
//! NVIDIA's driver library has.

fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libcuda.so.1");
}
