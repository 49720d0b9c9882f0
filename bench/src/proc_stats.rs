//! This process's resources as Linux reports them in `/proc/self`: what the scale suite
//! measures and the churn test compares before and after.

/// Resident set size of this process, bytes.
pub fn rss() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |pages| pages * 4096)
}

pub fn open_fds() -> u64 {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count() as u64)
}

pub fn threads() -> u64 {
    std::fs::read_dir("/proc/self/task").map_or(0, |d| d.count() as u64)
}

/// CPU time (ns) of this process's threads named `name` so far: the scheduler's own
/// runtime in `schedstat` (exact), else `stat`'s utime + stime (in 10 ms ticks).
pub fn thread_cpu_ns(name: &str) -> u64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    let mut total = 0;
    for t in tasks.flatten() {
        let p = t.path();
        let comm = std::fs::read_to_string(p.join("comm")).unwrap_or_default();
        if comm.trim() != name {
            continue;
        }
        total += schedstat_ns(&p).unwrap_or_else(|| stat_ns(&p));
    }
    total
}

fn schedstat_ns(task: &std::path::Path) -> Option<u64> {
    std::fs::read_to_string(task.join("schedstat"))
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

fn stat_ns(task: &std::path::Path) -> u64 {
    let tick_ns = 1e9 / 100.0; // USER_HZ
    let stat = std::fs::read_to_string(task.join("stat")).unwrap_or_default();
    // Fields after the parenthesised comm: state is 3rd, utime 14th, stime 15th.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = rest.split_whitespace().collect();
    let (u, s) = (
        f.get(11).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0),
        f.get(12).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0),
    );
    ((u + s) * tick_ns) as u64
}

/// This process's (open fds, threads) once they have held still for 200 ms (at most
/// 10 s): a backend makes the next listener after a teardown and a reaper joins the last
/// connection's thread, so a single sample can land in between.
pub fn steady_fds_threads() -> (u64, u64) {
    let t0 = std::time::Instant::now();
    let mut last = (open_fds(), threads());
    let mut still = 0;
    while still < 10 && t0.elapsed() < std::time::Duration::from_secs(10) {
        std::thread::sleep(std::time::Duration::from_millis(20));
        let now = (open_fds(), threads());
        still = if now == last { still + 1 } else { 0 };
        last = now;
    }
    last
}

/// This process's children: (live, zombies).
pub fn children() -> (usize, usize) {
    let me = std::process::id().to_string();
    let (mut live, mut zombies) = (0, 0);
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else {
            continue;
        };
        // pid (comm) state ppid ...: comm may hold spaces, so split after its ')'.
        let Some(rest) = stat.rsplit_once(')').map(|r| r.1) else {
            continue;
        };
        let f: Vec<&str> = rest.split_whitespace().collect();
        if f.get(1) == Some(&me.as_str()) {
            if f[0] == "Z" {
                zombies += 1;
            } else {
                live += 1;
            }
        }
    }
    (live, zombies)
}
