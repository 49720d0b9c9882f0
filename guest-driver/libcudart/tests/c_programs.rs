//! The guest `libcudart.so` under a runtime-API program as `nvcc -cudart shared` builds
//! it (`tests/c/runtime_program.c`: nvcc's generated registration and launch code written
//! out, since CI has no nvcc), compiled with the system C compiler, linked against the
//! library by its soname and run as its own process with vgpu's `libcuda.so.1` beside it,
//! against a `vgpu-backend` process over the real vhost-user socket (a worker per VM on
//! the fake CUDA device, as `vgpu-libcuda`'s tests do; the `sim` refuses the module).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use vgpu_test_support::{BackendLauncher, BackendProcess};

const PTX: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../host-shim/tests/data/test_module.ptx"
);

/// A directory with `program` (from `tests/c/<program>.c`) and both libraries under
/// their sonames.
fn bin_dir(program: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("vgpu-libcudart-{program}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("program directory");
    let exe = std::env::current_exe().expect("test executable");
    let deps = exe.parent().expect("target/<profile>/deps");
    for (built, soname) in [
        ("libcudart.so", "libcudart.so.13"),
        ("libcuda.so", "libcuda.so.1"),
    ] {
        let lib = deps.join(built);
        assert!(lib.exists(), "{} not built beside the test", lib.display());
        let link = dir.join(soname);
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&lib, &link).expect("soname link");
    }
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/c");
    let out = Command::new("cc")
        .args(["-O1", "-Wall", "-Werror", "-I"])
        .arg(&src)
        .arg(src.join(format!("{program}.c")))
        .arg("-o")
        .arg(dir.join(program))
        .arg(format!("-L{}", dir.display()))
        .arg("-l:libcudart.so.13")
        .output()
        .expect("cc");
    assert!(
        out.status.success(),
        "cc {program}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    dir
}

fn launcher(tag: &str, gpu: &str, args: &[&str]) -> BackendLauncher {
    let body = format!("[gpu]\nmodel = \"{gpu}\"\nvram_mib = 256\n[[vm]]\nname = \"a\"\n");
    BackendLauncher::new(tag, &body).args(args)
}

fn run(backend: &BackendProcess, dir: &Path, args: &[&str]) -> Output {
    run_program(backend, dir, "runtime_program", args)
}

/// `out`'s stdout, after checking the program exited 0 (else its stderr and the
/// backend's log tail say why).
fn succeeded(out: &Output, backend: &BackendProcess) -> String {
    assert!(
        out.status.success(),
        "{}\nstderr: {}\nbackend: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr),
        backend.log_tail()
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn run_program(backend: &BackendProcess, dir: &Path, program: &str, args: &[&str]) -> Output {
    let sock = backend.socket("a");
    let t = std::time::Instant::now();
    while !sock.exists() {
        assert!(
            t.elapsed().as_secs() < 30,
            "no socket: {}",
            backend.log_tail()
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    Command::new(dir.join(program))
        .args(args)
        .env("LD_LIBRARY_PATH", dir)
        .env("VGPU_LOOPBACK_SOCKET", &sock)
        .output()
        .expect(program)
}

#[test]
fn a_runtime_program_runs_through_the_guest_libraries() {
    let dir = bin_dir("runtime_program");
    let l = launcher(
        "libcudart-program",
        "cuda",
        &vgpu_test_support::gpu_worker_args(),
    );
    let backend = l.start();
    let out = run(&backend, &dir, &[PTX, "65536"]);
    let stdout = succeeded(&out, &backend);
    let n: u64 = 65536;
    let sum: u64 = (0..n).map(|i| i * 7 + 1_000_000 - i).sum();
    assert_eq!(
        stdout.trim(),
        // The fake device's compute capability and SMs, through cudaGetDeviceProperties.
        format!("runtime_program n={n} sum={sum} global=4242 symbol=777 cc=9.0 sms=132")
    );
    backend.stop();

    // The sim runs no guest modules: the first launch says so, in the runtime's words.
    let l = launcher("libcudart-sim", "sim", &["--seccomp", "off"]);
    let backend = l.start();
    let out = run(&backend, &dir, &[PTX, "1024"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "ran on the sim: {stderr}");
    assert!(stderr.contains("cudaErrorNotSupported"), "{stderr}");
    backend.stop();
}

/// The program the nested rig's L2 guests run over `/dev/vgpu` (`devvgpu_runtime.c`: the
/// runtime API without kernels), here over the loopback transport on the sim, as the
/// rig's backend runs: what it prints is what `ci/rig/l2-guest-checks.sh` looks for.
#[test]
fn the_rigs_runtime_program_runs_on_the_sim() {
    let dir = bin_dir("devvgpu_runtime");
    let l = launcher("libcudart-devvgpu", "sim", &["--seccomp", "off"]);
    let backend = l.start();
    let out = run_program(&backend, &dir, "devvgpu_runtime", &[]);
    let stdout = succeeded(&out, &backend);
    assert_eq!(stdout.trim(), "devvgpu_runtime ok mib=256 bytes=1048576");
    // cudaGetDeviceProperties asks every attribute it fills: none may be unknown.
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("not supported"), "{stderr}");
    backend.stop();
}
