//! `vgpuctl`: the operator's command line over the `vgpu-backend` control API (HTTP/JSON on
//! a unix socket). Tables for people, `--json` for scripts (the API's JSON, unchanged).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use serde::Serialize;
use serde_json::json;
use vgpu_backend::api::client::{ApiClient, ClientError};
use vgpu_backend::api::types::*;

/// Default API socket (as in the example configuration).
const DEFAULT_SOCKET: &str = "/run/vgpu/api.sock";

#[derive(Parser)]
#[command(name = "vgpuctl", version, about = "Control a running vgpu-backend")]
struct Cli {
    /// The backend's API socket [env: VGPU_API_SOCKET; default: /run/vgpu/api.sock].
    #[arg(long, global = true, value_name = "PATH")]
    socket: Option<PathBuf>,
    /// Print the API's JSON instead of tables.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// The backend: version, GPU, policy.
    Info,
    /// VMs: list, show, weights, quotas, statistics, pause.
    #[command(subcommand)]
    Vm(VmCmd),
    /// The scheduler: policy and tunables.
    #[command(subcommand)]
    Sched(SchedCmd),
    /// The Prometheus metrics, as the backend serves them.
    Metrics,
}

#[derive(Subcommand)]
enum VmCmd {
    /// All VMs with weight, VRAM and GPU share.
    List,
    /// One VM in detail.
    Show { name: String },
    /// Sets a VM's scheduling weight (1..=10000).
    SetWeight { name: String, weight: u64 },
    /// Sets a VM's VRAM quota for new allocations (bytes; K, M, G, T suffixes are powers
    /// of 1024).
    SetVramQuota { name: String, bytes: String },
    /// GPU shares over 1/10/60 s, per process, VRAM and channels.
    Stats { name: String },
    /// The VM's last live migration here: phase, pre-copy rounds, bytes, dirty rate,
    /// expected downtime.
    Migration { name: String },
    /// VRAM swapping: resident and swapped bytes, evictions, swap-ins, bytes moved and
    /// pauses, for the VM and per process (`--json`: the `vram` part of the VM's stats).
    Vram { name: String },
    /// Stalls the VM's GPU submissions (shadows all its channels).
    Pause { name: String },
    /// Lets the VM's GPU submissions run again.
    Resume { name: String },
    /// Pauses, then waits until the GPU completed the VM's released work.
    Drain {
        name: String,
        /// Give up after this long (1..=60000 ms; default 10000).
        #[arg(long)]
        timeout_ms: Option<u64>,
    },
}

#[derive(Subcommand)]
enum SchedCmd {
    /// Policy, tunables and counters.
    Show,
    /// Changes the policy or tunables (what is not given stays).
    Set {
        #[arg(long)]
        policy: Option<String>,
        #[arg(long)]
        interval_ms: Option<u64>,
        #[arg(long)]
        threshold_us: Option<u64>,
        /// Entries per interval, or `none`.
        #[arg(long)]
        unshadow_cap: Option<String>,
    },
}

/// Parses `4096`, `512M`, `2GiB`, `1g`.
fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num.parse().map_err(|_| format!("bad size {s:?}"))?;
    let shift = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => return Err(format!("bad size unit in {s:?}")),
    };
    n.checked_mul(1 << shift)
        .ok_or_else(|| format!("size {s:?} too large"))
}

fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut i = 0;
    while v >= 1024.0 && i + 1 < UNITS.len() {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", UNITS[i])
    }
}

/// One resource of the GPU as a line: used, total, reserved and free.
fn headroom(h: &HeadroomBody) -> String {
    format!(
        "{} used of {} ({} reserved for VMs, {} free to borrow)",
        h.used, h.total, h.reserved, h.free
    )
}

fn pct(x: Option<f64>) -> String {
    x.map_or_else(|| "-".to_string(), |v| format!("{:.1}%", 100.0 * v))
}

/// Prints rows as aligned columns (the first row is the header).
fn table(rows: &[Vec<String>]) {
    let cols = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..cols)
        .map(|c| {
            rows.iter()
                .filter_map(|r| r.get(c))
                .map(|s| s.chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    for r in rows {
        let line: Vec<String> = r
            .iter()
            .enumerate()
            .map(|(i, s)| format!("{s:<w$}", w = widths[i]))
            .collect();
        println!("{}", line.join("  ").trim_end());
    }
}

fn print_json<T: Serialize>(v: &T) -> Result<(), ClientError> {
    let s = serde_json::to_string_pretty(v).map_err(|e| ClientError::Malformed(e.to_string()))?;
    println!("{s}");
    Ok(())
}

fn window(ws: &[WindowShare], s: u32) -> Option<&WindowShare> {
    ws.iter().find(|w| w.window_s == s)
}

fn show_sched(s: &SchedulerBody) {
    let c = &s.config;
    table(&[
        vec!["policy".into(), c.policy.clone()],
        vec!["running".into(), s.running.to_string()],
        vec!["interval_ms".into(), c.interval_ms.to_string()],
        vec!["threshold_us".into(), c.threshold_us.to_string()],
        vec![
            "unshadow_cap".into(),
            c.unshadow_cap.map_or("none".into(), |v| v.to_string()),
        ],
        vec!["intervals".into(), s.stats.intervals.to_string()],
        vec!["shadows".into(), s.stats.shadows.to_string()],
        vec!["unshadows".into(), s.stats.unshadows.to_string()],
        vec!["shadowed_now".into(), s.stats.shadowed_now.to_string()],
        vec!["failures".into(), s.stats.failures.to_string()],
        vec![
            "tick_us (last/max)".into(),
            format!(
                "{:.1} / {:.1}",
                s.stats.tick_ns_last as f64 / 1e3,
                s.stats.tick_ns_max as f64 / 1e3
            ),
        ],
    ]);
}

fn ms(ns: u64) -> String {
    format!("{:.3}", ns as f64 / 1e6)
}

/// The VRAM swap figures: the VM's as rows of name and value, then one row per process.
fn show_vram(v: &VmVramBody) {
    table(&[
        vec!["resident".into(), human_bytes(v.resident_bytes)],
        vec!["swapped".into(), human_bytes(v.swapped_bytes)],
        vec![
            "footprint (with small-object frames)".into(),
            human_bytes(v.footprint_bytes),
        ],
        vec![
            "quota / share / swap limit".into(),
            format!(
                "{} / {} / {}",
                human_bytes(v.quota_bytes),
                human_bytes(v.share_bytes),
                human_bytes(v.swap_limit_bytes)
            ),
        ],
        vec![
            "evictions (bytes out)".into(),
            format!("{} ({})", v.evictions, human_bytes(v.bytes_out)),
        ],
        vec![
            "swap-ins (bytes in)".into(),
            format!("{} ({})", v.swap_ins, human_bytes(v.bytes_in)),
        ],
        vec!["spilled chunks".into(), v.spilled_chunks.to_string()],
        vec!["pauses".into(), v.pauses.to_string()],
        vec![
            "pause ms (total/p50/p99/max)".into(),
            format!(
                "{} / {} / {} / {}",
                ms(v.pause_ns_total),
                ms(v.pause_p50_ns),
                ms(v.pause_p99_ns),
                ms(v.pause_ns_max)
            ),
        ],
        vec!["drain timeouts".into(), v.drain_timeouts.to_string()],
        vec!["move failures".into(), v.move_failures.to_string()],
    ]);
    if !v.processes.is_empty() {
        println!();
        show_vram_procs(&v.processes);
    }
}

fn show_vram_procs(procs: &[ProcVramBody]) {
    let mut rows = vec![[
        "PID",
        "RESIDENT",
        "SWAPPED",
        "EVICTIONS",
        "SWAP-INS",
        "OUT",
        "IN",
        "PAUSED ms",
    ]
    .map(String::from)
    .to_vec()];
    for p in procs {
        rows.push(vec![
            p.pid.to_string(),
            human_bytes(p.resident_bytes),
            human_bytes(p.swapped_bytes),
            p.evictions.to_string(),
            p.swap_ins.to_string(),
            human_bytes(p.bytes_out),
            human_bytes(p.bytes_in),
            ms(p.pause_ns),
        ]);
    }
    table(&rows);
}

fn show_pause(p: &PauseBody) {
    let mut line = format!(
        "{}: {} ({} channel(s), {} switched)",
        p.name,
        if p.paused { "paused" } else { "running" },
        p.channels,
        p.switched
    );
    if let Some(w) = p.waited_ms {
        line.push_str(&format!(", drained in {w:.1} ms"));
    }
    println!("{line}");
}

fn run(cli: Cli) -> Result<(), ClientError> {
    let socket = cli
        .socket
        .or_else(|| std::env::var_os("VGPU_API_SOCKET").map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from(DEFAULT_SOCKET));
    let c = ApiClient::new(socket);
    let json = cli.json;
    match cli.cmd {
        Cmd::Info => {
            let i = c.info()?;
            if json {
                return print_json(&i);
            }
            let mut rows = vec![
                vec!["version".into(), i.version],
                vec!["api".into(), i.api_version],
                vec!["gpu".into(), i.gpu.model],
                vec!["vram".into(), human_bytes(i.gpu.vram_bytes)],
                vec!["compute engines".into(), i.gpu.compute_engines.to_string()],
                vec!["policy".into(), i.policy],
                vec!["vms".into(), i.vms.to_string()],
                vec!["contexts".into(), headroom(&i.capacity.contexts)],
                vec!["channels".into(), headroom(&i.capacity.channels)],
                vec!["uptime".into(), format!("{:.0} s", i.uptime_s)],
            ];
            if let Some(w) = &i.gpu_workers {
                rows.push(vec![
                    "gpu workers".into(),
                    format!(
                        "a worker per {}: {} running, {} started, {} lost",
                        if w.granularity == "process" {
                            "guest process"
                        } else {
                            "VM"
                        },
                        w.running,
                        w.started,
                        w.lost
                    ),
                ]);
                for (vm, v) in &w.vms {
                    rows.push(vec![
                        format!("  vm {vm}"),
                        format!(
                            "{} running, {} started, {} lost",
                            v.running, v.started, v.lost
                        ),
                    ]);
                }
            }
            table(&rows);
        }
        Cmd::Metrics => print!("{}", c.metrics()?),
        Cmd::Vm(VmCmd::List) => {
            let l = c.vms()?;
            if json {
                return print_json(&l);
            }
            let mut rows = vec![[
                "NAME",
                "STATE",
                "SUBMISSION",
                "WEIGHT",
                "VRAM",
                "QUOTA",
                "CHANNELS",
                "GPU 10s",
            ]
            .map(String::from)
            .to_vec()];
            for v in l.vms {
                let state = match (v.connected, v.paused) {
                    (_, true) => "paused",
                    (true, false) => "connected",
                    (false, false) => "idle",
                };
                rows.push(vec![
                    v.name,
                    state.into(),
                    v.submission,
                    v.weight.to_string(),
                    human_bytes(v.vram_bytes),
                    human_bytes(v.vram_quota_bytes),
                    v.channels.to_string(),
                    pct(v.gpu_share_10s),
                ]);
            }
            table(&rows);
        }
        Cmd::Vm(VmCmd::Show { name }) => {
            let v = c.vm(&name)?;
            if json {
                return print_json(&v);
            }
            table(&[
                vec!["name".into(), v.name],
                vec!["socket".into(), v.socket],
                vec!["connected".into(), v.connected.to_string()],
                vec!["submission".into(), v.submission],
                vec!["paused".into(), v.paused.to_string()],
                vec!["weight".into(), v.weight.to_string()],
                vec![
                    "vram".into(),
                    format!(
                        "{} of {} quota",
                        human_bytes(v.usage.vram_bytes),
                        human_bytes(v.limits.vram_bytes)
                    ),
                ],
                vec![
                    "contexts".into(),
                    format!(
                        "{} of {} ({} reserved)",
                        v.usage.contexts, v.limits.max_contexts, v.limits.reserved_contexts
                    ),
                ],
                vec![
                    "channels".into(),
                    format!(
                        "{} of {} ({} reserved, {} shadowed)",
                        v.usage.channels,
                        v.limits.max_channels,
                        v.limits.reserved_channels,
                        v.shadow.shadowed_now
                    ),
                ],
                vec![
                    "mapped guest memory".into(),
                    format!(
                        "{} of {}",
                        human_bytes(v.usage.mapped_guest_bytes),
                        human_bytes(v.limits.mapped_guest_bytes)
                    ),
                ],
                vec![
                    "mappings".into(),
                    format!(
                        "{} of {} ({} of {} page tables)",
                        v.usage.mappings,
                        v.limits.max_mappings,
                        human_bytes(v.usage.page_table_bytes),
                        human_bytes(v.limits.page_table_bytes)
                    ),
                ],
                vec![
                    "requests (errors)".into(),
                    format!("{} ({})", v.counters.requests, v.counters.errors),
                ],
                vec!["disconnects".into(), v.counters.disconnects.to_string()],
            ]);
        }
        Cmd::Vm(VmCmd::SetWeight { name, weight }) => {
            // Out-of-range values go to the server, which explains the range.
            let body = json!({ "weight": weight });
            let r: serde_json::Value = c.put_json(&format!("/api/v1/vms/{name}/weight"), &body)?;
            if json {
                return print_json(&r);
            }
            println!("{name}: weight {}", r["weight"]);
        }
        Cmd::Vm(VmCmd::SetVramQuota { name, bytes }) => {
            let b = parse_bytes(&bytes).map_err(ClientError::Malformed)?;
            let r = c.set_vram_quota(&name, b)?;
            if json {
                return print_json(&r);
            }
            println!(
                "{name}: VRAM quota {} ({} bytes)",
                human_bytes(r.bytes),
                r.bytes
            );
        }
        Cmd::Vm(VmCmd::Migration { name }) => {
            let m = c.vm_migration(&name)?;
            if json {
                return print_json(&m);
            }
            println!(
                "{name}: migration {}, {} sent/received, dirty rate {}/s, expected downtime {:.1} ms, drain {:.1} ms, write tracking {}",
                m.phase,
                human_bytes(m.bytes),
                human_bytes(m.dirty_rate_bytes_per_s),
                m.expected_downtime_us as f64 / 1e3,
                m.drain_us as f64 / 1e3,
                if m.write_tracking { "on" } else { "off (stop-and-copy)" }
            );
            for r in &m.rounds {
                println!(
                    "  round {:>2}{}: {} chunks, {} in {:.1} ms",
                    r.round,
                    if r.last { " (paused)" } else { "" },
                    r.chunks,
                    human_bytes(r.bytes),
                    r.duration_us as f64 / 1e3
                );
            }
            if let Some(e) = &m.error {
                println!("  failed: {e}");
            }
            if let Some(p) = &m.policy {
                println!("  {}", p.note);
            }
        }
        Cmd::Vm(VmCmd::Stats { name }) => {
            let s = c.vm_stats(&name)?;
            if json {
                return print_json(&s);
            }
            println!(
                "{}: weight {}, {}, GPU time {:.3} s, VRAM {} resident / {} swapped / {} quota, watchdog kills {}",
                s.name,
                s.weight,
                if s.paused { "paused" } else { "running" },
                s.gpu_busy_ns as f64 / 1e9,
                human_bytes(s.vram_resident_bytes),
                human_bytes(s.vram_swapped_bytes),
                human_bytes(s.vram_quota_bytes),
                s.watchdog_kills
            );
            let v = &s.vram;
            println!(
                "VRAM swapping: {} evictions ({} out), {} swap-ins ({} in), {} pauses ({} ms total, {} ms max)",
                v.evictions,
                human_bytes(v.bytes_out),
                v.swap_ins,
                human_bytes(v.bytes_in),
                v.pauses,
                ms(v.pause_ns_total),
                ms(v.pause_ns_max)
            );
            let share_cols = |ws: &[WindowShare]| -> Vec<String> {
                let mut c: Vec<String> = [1, 10, 60]
                    .iter()
                    .map(|w| pct(window(ws, *w).map(|x| x.share)))
                    .collect();
                // What it was owed over the last 10 s, and how far it is from that.
                let w10 = window(ws, 10);
                c.push(pct(w10.and_then(|x| x.entitled)));
                c.push(
                    w10.and_then(|x| x.deviation_pp)
                        .map_or("-".to_string(), |d| format!("{d:+.1} pp")),
                );
                c
            };
            let mut rows = vec![[
                "WHO",
                "GPU TIME s",
                "SHARE 1s",
                "SHARE 10s",
                "SHARE 60s",
                "ENTITLED 10s",
                "DEVIATION 10s",
            ]
            .map(String::from)
            .to_vec()];
            let mut first = vec![
                "vm".to_string(),
                format!("{:.3}", s.gpu_busy_ns as f64 / 1e9),
            ];
            first.extend(share_cols(&s.windows));
            rows.push(first);
            for p in &s.processes {
                let mut r = vec![
                    format!("pid {}", p.pid),
                    format!("{:.3}", p.gpu_busy_ns as f64 / 1e9),
                ];
                r.extend(share_cols(&p.windows));
                rows.push(r);
            }
            table(&rows);
            if !s.channels.is_empty() {
                println!();
                let mut rows = vec![[
                    "CHANNEL",
                    "PID",
                    "SHADOWED",
                    "BACKLOG",
                    "GPU TIME s",
                    "ERROR",
                ]
                .map(String::from)
                .to_vec()];
                for ch in &s.channels {
                    rows.push(vec![
                        ch.channel.to_string(),
                        ch.pid.to_string(),
                        ch.shadowed.to_string(),
                        ch.backlog.to_string(),
                        format!("{:.3}", ch.gpu_busy_ns as f64 / 1e9),
                        ch.error.clone().unwrap_or_else(|| "-".into()),
                    ]);
                }
                table(&rows);
            }
            if !s.vram.processes.is_empty() {
                println!();
                show_vram_procs(&s.vram.processes);
            }
        }
        Cmd::Vm(VmCmd::Vram { name }) => {
            let s = c.vm_stats(&name)?;
            if json {
                return print_json(&s.vram);
            }
            println!("{}: VRAM", s.name);
            show_vram(&s.vram);
        }
        Cmd::Vm(VmCmd::Pause { name }) => {
            let p = c.pause(&name)?;
            if json {
                return print_json(&p);
            }
            show_pause(&p);
        }
        Cmd::Vm(VmCmd::Resume { name }) => {
            let p = c.resume(&name)?;
            if json {
                return print_json(&p);
            }
            show_pause(&p);
        }
        Cmd::Vm(VmCmd::Drain { name, timeout_ms }) => {
            let p = c.drain(&name, timeout_ms)?;
            if json {
                return print_json(&p);
            }
            show_pause(&p);
        }
        Cmd::Sched(SchedCmd::Show) => {
            let s = c.scheduler()?;
            if json {
                return print_json(&s);
            }
            show_sched(&s);
        }
        Cmd::Sched(SchedCmd::Set {
            policy,
            interval_ms,
            threshold_us,
            unshadow_cap,
        }) => {
            let mut m = serde_json::Map::new();
            if let Some(p) = policy {
                m.insert("policy".into(), json!(p));
            }
            if let Some(v) = interval_ms {
                m.insert("interval_ms".into(), json!(v));
            }
            if let Some(v) = threshold_us {
                m.insert("threshold_us".into(), json!(v));
            }
            if let Some(v) = unshadow_cap {
                let cap = if v == "none" {
                    serde_json::Value::Null
                } else {
                    json!(v
                        .parse::<u64>()
                        .map_err(|_| ClientError::Malformed(format!(
                            "--unshadow-cap {v:?}: a number or none"
                        )))?)
                };
                m.insert("unshadow_cap".into(), cap);
            }
            let s = c.set_scheduler(&serde_json::Value::Object(m))?;
            if json {
                return print_json(&s);
            }
            show_sched(&s);
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("vgpuctl: {e}");
            ExitCode::FAILURE
        }
    }
}
