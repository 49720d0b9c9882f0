//! Gives the shared library the soname of the CUDA 13 runtime (`libcudart.so.13`): a
//! program built with `nvcc -cudart shared` of CUDA 13 asks for it by that name
//! (docs/guest-cuda.md says how to install it for other CUDA versions).

fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libcudart.so.13");
}
