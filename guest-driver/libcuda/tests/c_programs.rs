//! The guest `libcuda.so.1` under C programs written as a CUDA user writes them
//! (`tests/c/`): each is compiled with the system C compiler, linked against the library
//! by its soname, and run as its own process against a `vgpu-backend` process over the
//! real vhost-user socket (the library's loopback VM: `VGPU_LOOPBACK_SOCKET`). The GPU is
//! the `cuda` GPU with a worker per VM on the CPU test device (`cuda-fake`), or the real
//! GPU when `VGPU_WORKER_GPU=cuda` (with `VGPU_BACKEND_BIN`, as `ci/device/run.sh run
//! libcuda` does); `api_edges` also runs on the `sim`, which refuses guest modules.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::sync::OnceLock;

use vgpu_test_support::{BackendLauncher, BackendProcess};

const PTX: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../host-shim/tests/data/test_module.ptx"
);

/// The test programs, each built from `tests/c/NAME.c`.
const PROGRAMS: &[&str] = &[
    "vector_add",
    "streams_events",
    "device_global",
    "wild_write",
    "api_edges",
    "launch_rate",
    "vadd_loop",
    "devvgpu_program",
    "device_attributes",
    "pointer_chase",
];

/// `device_attributes`'s output as `name → value` ("cc", "attr N").
fn attributes(out: &str) -> std::collections::HashMap<String, String> {
    out.lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// Where the built programs and the library's soname link live: built once per run, or
/// `VGPU_LIBCUDA_PROGRAMS` (a directory `ci/device/run.sh pack libcuda` made on another
/// machine: the programs and `libcuda.so.1`).
fn bin_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        if let Some(d) = std::env::var_os("VGPU_LIBCUDA_PROGRAMS") {
            return PathBuf::from(d);
        }
        let dir = std::env::temp_dir().join(format!("vgpu-libcuda-c-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("program directory");
        // `target/<profile>/deps/<test>` → `target/<profile>/deps/libcuda.so`: built
        // with the test (the copy one level up is refreshed only by `cargo build`).
        let exe = std::env::current_exe().expect("test executable");
        let profile = exe
            .parent()
            .and_then(Path::parent)
            .expect("target/<profile>");
        let lib = [profile.join("deps/libcuda.so"), profile.join("libcuda.so")]
            .into_iter()
            .find(|p| p.exists())
            .expect("libcuda.so built beside the test (cargo builds the cdylib with it)");
        // Programs ask for the soname, as they do of NVIDIA's library.
        let link = dir.join("libcuda.so.1");
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&lib, &link).expect("soname link");
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/c");
        for prog in PROGRAMS {
            let out = Command::new("cc")
                .args(["-O1", "-Wall", "-Werror", "-I"])
                .arg(&src)
                .arg(src.join(format!("{prog}.c")))
                .arg("-o")
                .arg(dir.join(prog))
                .arg(format!("-L{}", dir.display()))
                .arg("-l:libcuda.so.1")
                .output()
                .expect("cc");
            assert!(
                out.status.success(),
                "cc {prog}.c: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        dir
    })
}

fn launcher(tag: &str, gpu: &str, args: &[&str]) -> BackendLauncher {
    let body = format!(
        "[gpu]\nmodel = \"{gpu}\"\nvram_mib = 256\n[[vm]]\nname = \"a\"\n[[vm]]\nname = \"b\"\n"
    );
    BackendLauncher::new(tag, &body).args(args)
}

/// The backend with a worker per VM: on the fake device, or on the real GPU when
/// `VGPU_WORKER_GPU` says `cuda`.
fn workers(tag: &str) -> BackendLauncher {
    launcher(tag, "cuda", &vgpu_test_support::gpu_worker_args())
}

/// Runs a test program as a guest process of VM `vm`.
fn run(backend: &BackendProcess, vm: &str, prog: &str, args: &[&str]) -> Output {
    let dir = bin_dir();
    let sock = backend.socket(vm);
    let t = std::time::Instant::now();
    while !sock.exists() {
        assert!(
            t.elapsed() < std::time::Duration::from_secs(30),
            "no socket {}: {}",
            sock.display(),
            backend.log_tail()
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    Command::new(dir.join(prog))
        .args(args)
        .env("LD_LIBRARY_PATH", dir)
        .env("VGPU_LOOPBACK_SOCKET", &sock)
        .env("VGPU_CUDA_LOG", "info")
        .output()
        .expect("test program")
}

/// Runs it and expects success; its stdout.
fn run_ok(backend: &BackendProcess, vm: &str, prog: &str, args: &[&str]) -> String {
    let out = run(backend, vm, prog, args);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{prog} {args:?}: {}\nstdout: {stdout}\nstderr: {}\nbackend: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr),
        backend.log_tail()
    );
    stdout
}

#[test]
fn programs_run_through_the_library_as_through_the_driver() {
    let l = workers("libcuda-programs");
    let backend = l.start();
    let out = run_ok(&backend, "a", "vector_add", &[PTX, "65536"]);
    // The sum the CPU reference gives (the program checks every element itself).
    let n: u64 = 65536;
    let want: u64 = (0..n)
        .map(|i| {
            let a = (i as u32).wrapping_mul(2654435761);
            let b = (!(i as u32)).wrapping_add(7);
            u64::from(a.wrapping_add(b))
        })
        .sum();
    assert_eq!(out.trim(), format!("vector_add n={n} sum={want}"));
    let out = run_ok(&backend, "a", "streams_events", &[PTX, "16384"]);
    assert!(
        out.starts_with("streams_events n=16384 streams=4 sum="),
        "{out}"
    );
    let out = run_ok(&backend, "b", "device_global", &[PTX, "0x1234567"]);
    assert_eq!(
        out.trim(),
        format!(
            "device_global value=19088743 copied_in={}",
            0x1234567u32 ^ 0x5a5a5a5a
        )
    );
    let out = run_ok(&backend, "b", "api_edges", &[PTX]);
    assert_eq!(out.trim(), "api_edges modules=loaded");
    // The GPU's attributes as the worker's device reports them (the fake device's: an
    // H100's compute capability, SMs and limits), the virtual device's own features.
    let a = attributes(&run_ok(&backend, "a", "device_attributes", &[]));
    for (k, want) in [
        ("cc", "9.0"),
        ("attr 75", "9"),
        ("attr 16", "132"),
        ("attr 38", "52428800"),
        ("attr 97", "232448"),
        ("attr 1", "1024"),
        ("attr 10", "32"),
        ("attr 41", "0"),
        ("attr 19", "0"),
        ("attr 33", "0"),
        ("attr 24", "unsupported"),
    ] {
        assert_eq!(a.get(k).map(String::as_str), Some(want), "{k}: {a:?}");
    }
    // Identity addressing: a kernel follows pointers the program stored in device
    // memory (guest addresses of 2 MiB-page buffers are the device's own, and small
    // allocations are pieces of such buffers), in two VMs at once.
    let chase = |vm: &'static str| {
        let b = &backend;
        move || run_ok(b, vm, "pointer_chase", &[PTX, "20000"])
    };
    let (x, y) = std::thread::scope(|s| {
        let x = s.spawn(chase("a"));
        let y = s.spawn(chase("b"));
        (x.join(), y.join())
    });
    for out in [x, y] {
        let out = out.expect("pointer_chase thread");
        assert!(out.starts_with("pointer_chase nodes=20000 sum="), "{out}");
        assert!(out.trim_end().ends_with(" small=300"), "{out}");
    }
    // The benchmark programs, at sizes for a CPU (they check their own results).
    let out = run_ok(&backend, "a", "launch_rate", &[PTX, "200", "256"]);
    assert!(out.starts_with("launch_rate kernels=200 n=256 "), "{out}");
    let out = run_ok(&backend, "b", "vadd_loop", &[PTX, "5", "65536", "8"]);
    assert!(
        out.starts_with("vadd_loop iterations=5 n=65536 cold_mib=8 "),
        "{out}"
    );
    backend.stop();
}

#[test]
fn a_wild_kernel_fails_its_program_and_no_other() {
    let l = workers("libcuda-wild");
    let backend = Arc::new(l.start());
    // VM b runs verified vector adds the whole time.
    let stop = Arc::new(AtomicBool::new(false));
    let (s, b) = (stop.clone(), backend.clone());
    let other = std::thread::spawn(move || {
        let mut runs = 0;
        while !s.load(Ordering::Relaxed) || runs < 2 {
            run_ok(&b, "b", "vector_add", &[PTX, "16384"]);
            runs += 1;
        }
        runs
    });
    let out = run_ok(&backend, "a", "wild_write", &[PTX]);
    assert!(
        out.starts_with("wild_write fault=CUDA_ERROR_") && out.contains("then=CUDA_ERROR_"),
        "{out}"
    );
    // VM a gets a new worker: a new program there runs.
    let again = run_ok(&backend, "a", "vector_add", &[PTX, "4096"]);
    assert!(again.starts_with("vector_add n=4096"), "{again}");
    stop.store(true, Ordering::Relaxed);
    let runs = other.join().expect("the other VM's programs");
    assert!(runs >= 2, "the other VM ran {runs} programs");
    backend.stop();
}

#[test]
fn on_the_sim_module_loads_are_refused_clearly() {
    let l = launcher("libcuda-sim", "sim", &["--seccomp", "off"]);
    let backend = l.start();
    let out = run_ok(&backend, "a", "api_edges", &[]);
    assert_eq!(
        out.trim(),
        "api_edges modules=refused (CUDA_ERROR_NOT_SUPPORTED)"
    );
    // The sim tells no GPU attributes: what holds without one, and no more.
    let a = attributes(&run_ok(&backend, "a", "device_attributes", &[]));
    for (k, want) in [
        ("cc", "unsupported"),
        ("attr 16", "unsupported"),
        ("attr 10", "32"),
        ("attr 41", "0"),
    ] {
        assert_eq!(a.get(k).map(String::as_str), Some(want), "{k}: {a:?}");
    }
    // The program the rig's guests run over /dev/vgpu, here over the loopback transport:
    // the library logs the device's own reason for the refused module.
    let out = run(&backend, "b", "devvgpu_program", &[]);
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert_eq!(
        stdout.trim(),
        "devvgpu_program ok module_load=CUDA_ERROR_NOT_SUPPORTED"
    );
    assert!(
        stderr.contains("guest modules need the cuda GPU"),
        "{stderr}"
    );
    backend.stop();
}
