//! The daemon's TOML configuration (`vgpu-backend --config FILE`): the GPU model and its
//! sizes, the VMs with their sockets, weights and limits, the scheduler, the API socket.
//! Unknown keys are rejected and every value is range-checked, so a typo is an error at
//! start, not a silent default. `docs/vgpu-backend.example.toml` shows every key.
//!
//! [`FileConfig`] is the file as written (every key optional); [`FileConfig::resolve`]
//! applies the defaults and checks the ranges, giving a [`Config`] to run with. The
//! binary's command-line flags override the file (see `main.rs`).

use std::path::{Path, PathBuf};

use serde::Deserialize;
use thiserror::Error;

use crate::sched::{Policy, SchedConfig, DEFAULT_WEIGHT, MAX_WEIGHT, MIN_WEIGHT};
use crate::vm::session::VmLimits;

const MIB: u64 = 1 << 20;

/// Errors of loading or checking a configuration.
#[derive(Debug, Error)]
pub enum ConfigError {
    #[error("{path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("{key} = {value}: must be in {lo}..={hi}")]
    Range {
        key: String,
        value: u64,
        lo: u64,
        hi: u64,
    },
    #[error("{0}")]
    Invalid(String),
}

/// `[gpu]`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuSection {
    /// GPU model: `"sim"` (default), `"cuda"` or `"cuda:INDEX"`.
    pub model: Option<String>,
    pub vram_mib: Option<u64>,
    pub compute_engines: Option<u32>,
    pub max_channels: Option<u32>,
    pub max_contexts: Option<u32>,
}

/// `[api]`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApiSection {
    /// Unix socket of the control API (none: no API).
    pub socket: Option<PathBuf>,
}

/// `[scheduler]`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SchedSection {
    pub policy: Option<String>,
    pub interval_ms: Option<u32>,
    pub threshold_us: Option<u64>,
    pub unshadow_cap: Option<u32>,
    pub slice_ms: Option<u32>,
    pub sample_period_ms: Option<u32>,
    pub watchdog_ms: Option<u32>,
    pub charge_idle: Option<bool>,
}

/// `[sandbox]`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SandboxSection {
    /// What a syscall outside a thread's seccomp filter does: `"kill"` (default), `"log"`
    /// or `"off"` (no filters, capabilities kept).
    pub seccomp: Option<String>,
}

/// `[defaults]` and the per-VM part of `[[vm]]`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmSection {
    pub weight: Option<u32>,
    /// VRAM quota, MiB (default: the GPU's VRAM).
    pub vram_mib: Option<u64>,
    pub max_contexts: Option<u32>,
    pub max_channels: Option<u32>,
    /// Contexts and channels of the GPU kept for the VM whatever others take.
    pub reserved_contexts: Option<u32>,
    pub reserved_channels: Option<u32>,
    pub mapped_guest_mib: Option<u64>,
    /// VRAM objects beyond the quota, swapped to system memory, MiB (0: none).
    pub swap_mib: Option<u64>,
    /// GPU mappings at once, and the host memory (page tables) they may take, MiB.
    pub max_mappings: Option<u32>,
    pub page_table_mib: Option<u64>,
}

/// `[[vm]]`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmEntry {
    pub name: String,
    /// Default: `socket_dir/NAME.sock`.
    pub socket: Option<PathBuf>,
    // The keys of `VmSection` (serde's `flatten` would defeat `deny_unknown_fields`).
    pub weight: Option<u32>,
    pub vram_mib: Option<u64>,
    pub max_contexts: Option<u32>,
    pub max_channels: Option<u32>,
    pub reserved_contexts: Option<u32>,
    pub reserved_channels: Option<u32>,
    pub mapped_guest_mib: Option<u64>,
    pub swap_mib: Option<u64>,
    pub max_mappings: Option<u32>,
    pub page_table_mib: Option<u64>,
}

impl VmEntry {
    /// The VM's own settings.
    pub fn settings(&self) -> VmSection {
        VmSection {
            weight: self.weight,
            vram_mib: self.vram_mib,
            max_contexts: self.max_contexts,
            max_channels: self.max_channels,
            reserved_contexts: self.reserved_contexts,
            reserved_channels: self.reserved_channels,
            mapped_guest_mib: self.mapped_guest_mib,
            swap_mib: self.swap_mib,
            max_mappings: self.max_mappings,
            page_table_mib: self.page_table_mib,
        }
    }
}

/// The file as written.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    /// Directory of the VM sockets that name none of their own.
    pub socket_dir: Option<PathBuf>,
    #[serde(default)]
    pub gpu: GpuSection,
    #[serde(default)]
    pub api: ApiSection,
    #[serde(default)]
    pub scheduler: SchedSection,
    #[serde(default)]
    pub sandbox: SandboxSection,
    #[serde(default)]
    pub defaults: VmSection,
    #[serde(default)]
    pub vm: Vec<VmEntry>,
}

/// The GPU to create.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuConfig {
    /// `sim` or `cuda[:INDEX]`.
    pub model: vgpu_host_shim::GpuChoice,
    pub vram_bytes: u64,
    pub compute_engines: u32,
    pub max_channels: u32,
    pub max_contexts: u32,
}

/// One VM to serve.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmConfig {
    pub name: String,
    pub socket: PathBuf,
    pub weight: u32,
    pub limits: VmLimits,
}

/// A checked configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    pub gpu: GpuConfig,
    pub api_socket: Option<PathBuf>,
    /// `None`: no scheduler (the GPU's own round-robin).
    pub scheduler: SchedConfig,
    pub vms: Vec<VmConfig>,
    /// Seccomp filters per thread role (see `sandbox`).
    pub seccomp: vgpu_sandbox::Mode,
}

fn range(key: &str, value: u64, lo: u64, hi: u64) -> Result<u64, ConfigError> {
    if (lo..=hi).contains(&value) {
        Ok(value)
    } else {
        Err(ConfigError::Range {
            key: key.to_string(),
            value,
            lo,
            hi,
        })
    }
}

fn range32(key: &str, value: u32, lo: u32, hi: u32) -> Result<u32, ConfigError> {
    range(key, value.into(), lo.into(), hi.into()).map(|v| v as u32)
}

impl FileConfig {
    /// Parses TOML text; `path` names it in errors.
    pub fn parse(text: &str, path: &Path) -> Result<Self, ConfigError> {
        toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: path.to_path_buf(),
            message: e.to_string(),
        })
    }

    /// Reads and parses a file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Self::parse(&text, path)
    }

    /// Applies defaults and checks every value.
    pub fn resolve(&self) -> Result<Config, ConfigError> {
        let g = &self.gpu;
        let model: vgpu_host_shim::GpuChoice = match &g.model {
            Some(m) => m
                .parse()
                .map_err(|e| ConfigError::Invalid(format!("gpu.model: {e}")))?,
            None => vgpu_host_shim::GpuChoice::Sim,
        };
        let sim = vgpu_host_shim::SimConfig::default();
        let gpu = GpuConfig {
            model,
            vram_bytes: range(
                "gpu.vram_mib",
                g.vram_mib.unwrap_or(sim.vram_bytes / MIB),
                1,
                1 << 20,
            )? * MIB,
            compute_engines: range32(
                "gpu.compute_engines",
                g.compute_engines.unwrap_or(sim.compute_engines),
                1,
                64,
            )?,
            max_channels: range32(
                "gpu.max_channels",
                g.max_channels.unwrap_or(sim.max_channels),
                1,
                65536,
            )?,
            max_contexts: range32(
                "gpu.max_contexts",
                g.max_contexts.unwrap_or(sim.max_contexts),
                1,
                65536,
            )?,
        };
        let s = &self.scheduler;
        let policy: Policy = match &s.policy {
            Some(p) => p.parse().map_err(|_| {
                ConfigError::Invalid(format!(
                    "scheduler.policy = {p:?}: expected none, timeslice, fair or sampling"
                ))
            })?,
            None => Policy::Fair,
        };
        let d = SchedConfig::default();
        let scheduler = SchedConfig {
            policy,
            interval_ms: range32(
                "scheduler.interval_ms",
                s.interval_ms.unwrap_or(d.interval_ms),
                1,
                1000,
            )?,
            threshold_us: range(
                "scheduler.threshold_us",
                s.threshold_us.unwrap_or(d.threshold_us),
                0,
                crate::api::routes::MAX_THRESHOLD_US,
            )?,
            unshadow_cap: match s.unshadow_cap {
                Some(c) => Some(range32(
                    "scheduler.unshadow_cap",
                    c,
                    1,
                    crate::api::routes::MAX_UNSHADOW_CAP as u32,
                )?),
                None => None,
            },
            slice_ms: range32(
                "scheduler.slice_ms",
                s.slice_ms.unwrap_or(d.slice_ms),
                1,
                10_000,
            )?,
            sample_period_ms: range32(
                "scheduler.sample_period_ms",
                s.sample_period_ms.unwrap_or(d.sample_period_ms),
                10,
                600_000,
            )?,
            watchdog_ms: match s.watchdog_ms {
                Some(w) => Some(range32("scheduler.watchdog_ms", w, 1, 3_600_000)?),
                None => None,
            },
            charge_idle: s.charge_idle.unwrap_or(d.charge_idle),
        };
        let seccomp = match &self.sandbox.seccomp {
            Some(m) => m
                .parse()
                .map_err(|e| ConfigError::Invalid(format!("sandbox.seccomp: {e}")))?,
            None => vgpu_sandbox::Mode::Kill,
        };
        // `[defaults]` is checked even when no VM uses it.
        self.vm_settings("defaults", &VmSection::default(), gpu.vram_bytes)?;
        let mut vms = Vec::new();
        for v in &self.vm {
            if !crate::valid_name(&v.name) {
                return Err(ConfigError::Invalid(format!(
                    "vm name {:?}: 1-64 characters of A-Z a-z 0-9 - _ ., not starting with '.'",
                    v.name
                )));
            }
            if vms.iter().any(|o: &VmConfig| o.name == v.name) {
                return Err(ConfigError::Invalid(format!("vm {:?} twice", v.name)));
            }
            let socket = match (&v.socket, &self.socket_dir) {
                (Some(s), _) => s.clone(),
                (None, Some(dir)) => dir.join(format!("{}.sock", v.name)),
                (None, None) => {
                    return Err(ConfigError::Invalid(format!(
                        "vm {:?} has no socket and there is no socket_dir",
                        v.name
                    )))
                }
            };
            if socket.as_os_str().is_empty() {
                return Err(ConfigError::Invalid(format!(
                    "vm {:?}: empty socket path",
                    v.name
                )));
            }
            let (weight, limits) =
                self.vm_settings(&format!("vm[{}]", v.name), &v.settings(), gpu.vram_bytes)?;
            vms.push(VmConfig {
                name: v.name.clone(),
                socket,
                weight,
                limits,
            });
        }
        check_reserves(&vms, &gpu)?;
        Ok(Config {
            gpu,
            api_socket: self.api.socket.clone(),
            scheduler,
            vms,
            seccomp,
        })
    }

    /// A VM's weight and limits: its own settings, then `[defaults]`, then the built-in
    /// defaults. `name` prefixes the keys in errors.
    pub fn vm_settings(
        &self,
        name: &str,
        own: &VmSection,
        gpu_vram: u64,
    ) -> Result<(u32, VmLimits), ConfigError> {
        let d = &self.defaults;
        let builtin = VmLimits::default();
        let key = |k: &str| format!("{name}.{k}");
        let weight = range32(
            &key("weight"),
            own.weight.or(d.weight).unwrap_or(DEFAULT_WEIGHT),
            MIN_WEIGHT,
            MAX_WEIGHT,
        )?;
        let max_contexts = range32(
            &key("max_contexts"),
            own.max_contexts
                .or(d.max_contexts)
                .unwrap_or(builtin.max_contexts),
            1,
            65536,
        )?;
        let max_channels = range32(
            &key("max_channels"),
            own.max_channels
                .or(d.max_channels)
                .unwrap_or(builtin.max_channels),
            1,
            65536,
        )?;
        // A reserve given is checked against the limit; the built-in one follows it.
        let reserved = |what: &str, given: Option<u32>, builtin: u32, max: u32| match given {
            Some(r) if r > max => Err(ConfigError::Invalid(format!(
                "{name}.reserved_{what} = {r}: more than {name}.max_{what} = {max}"
            ))),
            Some(r) => Ok(r),
            None => Ok(builtin.min(max)),
        };
        let limits = VmLimits {
            vram_bytes: match own.vram_mib.or(d.vram_mib) {
                Some(m) => range(&key("vram_mib"), m, 1, 1 << 20)? * MIB,
                None => gpu_vram,
            },
            max_contexts,
            max_channels,
            reserved_contexts: reserved(
                "contexts",
                own.reserved_contexts.or(d.reserved_contexts),
                builtin.reserved_contexts,
                max_contexts,
            )?,
            reserved_channels: reserved(
                "channels",
                own.reserved_channels.or(d.reserved_channels),
                builtin.reserved_channels,
                max_channels,
            )?,
            mapped_guest_bytes: range(
                &key("mapped_guest_mib"),
                own.mapped_guest_mib
                    .or(d.mapped_guest_mib)
                    .unwrap_or(builtin.mapped_guest_bytes / MIB),
                1,
                1 << 24,
            )? * MIB,
            swap_bytes: range(
                &key("swap_mib"),
                own.swap_mib
                    .or(d.swap_mib)
                    .unwrap_or(builtin.swap_bytes / MIB),
                0,
                crate::vram::MAX_SWAP_STORE / MIB,
            )? * MIB,
            max_mappings: range32(
                &key("max_mappings"),
                own.max_mappings
                    .or(d.max_mappings)
                    .unwrap_or(builtin.max_mappings),
                1,
                1 << 20,
            )?,
            page_table_bytes: range(
                &key("page_table_mib"),
                own.page_table_mib
                    .or(d.page_table_mib)
                    .unwrap_or(builtin.page_table_bytes / MIB),
                1,
                1 << 20,
            )? * MIB,
        };
        Ok((weight, limits))
    }
}

/// The VMs' reserves together must fit the GPU (the backend admits a VM only then).
fn check_reserves(vms: &[VmConfig], gpu: &GpuConfig) -> Result<(), ConfigError> {
    let sum = |f: fn(&VmLimits) -> u32| vms.iter().map(|v| u64::from(f(&v.limits))).sum::<u64>();
    for (what, reserved, total) in [
        ("contexts", sum(|l| l.reserved_contexts), gpu.max_contexts),
        ("channels", sum(|l| l.reserved_channels), gpu.max_channels),
    ] {
        if reserved > u64::from(total) {
            return Err(ConfigError::Invalid(format!(
                "the VMs reserve {reserved} {what} together: more than gpu.max_{what} = {total}"
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(t: &str) -> Result<Config, ConfigError> {
        FileConfig::parse(t, Path::new("t.toml"))?.resolve()
    }

    #[test]
    fn the_example_config_parses() {
        let text = include_str!("../../docs/vgpu-backend.example.toml");
        let c = parse(text).expect("example config");
        assert_eq!(c.gpu.vram_bytes, 2048 * MIB);
        assert_eq!(c.vms.len(), 3);
        assert_eq!(c.vms[0].name, "vm0");
        assert_eq!(c.vms[1].weight, 300);
        assert_eq!(c.vms[1].limits.vram_bytes, 1024 * MIB);
        assert_eq!(c.vms[2].socket, PathBuf::from("/run/vgpu/special/vm2.sock"));
        assert_eq!(c.scheduler.policy, Policy::Fair);
        assert!(c.api_socket.is_some());
    }

    #[test]
    fn an_empty_socket_path_is_refused() {
        let e = parse("[[vm]]\nname = \"a\"\nsocket = \"\"\n").unwrap_err();
        assert!(e.to_string().contains("empty socket path"), "{e}");
    }

    #[test]
    fn defaults_apply() {
        let c = parse("socket_dir = \"/tmp/x\"\n[[vm]]\nname = \"a\"\n").expect("minimal");
        assert_eq!(c.vms[0].socket, PathBuf::from("/tmp/x/a.sock"));
        assert_eq!(c.vms[0].weight, DEFAULT_WEIGHT);
        assert_eq!(c.vms[0].limits.vram_bytes, c.gpu.vram_bytes);
        assert_eq!(c.scheduler, SchedConfig::default());
        assert_eq!(c.api_socket, None);
        assert_eq!(c.seccomp, vgpu_sandbox::Mode::Kill);
        let c = parse("[sandbox]\nseccomp = \"log\"\n").expect("sandbox");
        assert_eq!(c.seccomp, vgpu_sandbox::Mode::Log);
    }

    #[test]
    fn gpu_model_picks_sim_or_cuda() {
        use vgpu_host_shim::GpuChoice;
        let model = |t: &str| parse(t);
        assert_eq!(model("").unwrap().gpu.model, GpuChoice::Sim);
        assert_eq!(
            model("[gpu]\nmodel = \"cuda:1\"").unwrap().gpu.model,
            GpuChoice::Cuda { index: 1 }
        );
        assert_eq!(
            model("[gpu]\nmodel = \"cuda\"").unwrap().gpu.model,
            GpuChoice::Cuda { index: 0 }
        );
    }

    #[test]
    fn bad_values_are_clear_errors() {
        let cases = [
            ("bogus = 1", "unknown field"),
            ("[gpu]\nvram = 5", "unknown field"),
            ("[gpu]\nvram_mib = 0", "gpu.vram_mib = 0"),
            ("[gpu]\nmodel = \"rtx\"", "expected \"sim\", \"cuda\""),
            ("[gpu]\nmodel = \"cuda:x\"", "gpu.model"),
            ("[gpu]\nvram_mib = -4", "invalid value"),
            ("[scheduler]\ninterval_ms = 5000", "scheduler.interval_ms"),
            ("[scheduler]\npolicy = \"fast\"", "scheduler.policy"),
            ("[scheduler]\nunshadow_cap = 0", "unshadow_cap"),
            ("[defaults]\nweight = 0", "defaults.weight = 0"),
            (
                "socket_dir = \"/x\"\n[[vm]]\nname = \"a\"\nweight = 10001",
                "vm[a].weight = 10001",
            ),
            ("socket_dir = \"/x\"\n[[vm]]\nname = \"a/b\"", "vm name"),
            (
                "socket_dir = \"/x\"\n[[vm]]\nname = \"a\"\n[[vm]]\nname = \"a\"",
                "twice",
            ),
            ("[[vm]]\nname = \"a\"", "no socket_dir"),
            (
                "[[vm]]\nname = \"a\"\nsocket = \"/s\"\nweigth = 3",
                "unknown field",
            ),
            ("[gpu\n", "t.toml"),
            ("[sandbox]\nseccomp = \"trap\"", "sandbox.seccomp"),
            (
                "[defaults]\npage_table_mib = 0",
                "defaults.page_table_mib = 0",
            ),
            ("[defaults]\nmax_mappings = 0", "defaults.max_mappings = 0"),
            (
                "[defaults]\nmax_channels = 8\nreserved_channels = 9",
                "defaults.reserved_channels = 9: more than defaults.max_channels = 8",
            ),
            (
                "socket_dir = \"/x\"\n[gpu]\nmax_contexts = 2\n[defaults]\nreserved_contexts = 1\n\
                 [[vm]]\nname = \"a\"\n[[vm]]\nname = \"b\"\n[[vm]]\nname = \"c\"",
                "reserve 3 contexts together: more than gpu.max_contexts = 2",
            ),
        ];
        for (text, want) in cases {
            let e = parse(text).expect_err(text).to_string();
            assert!(e.contains(want), "{text:?}: {e:?} lacks {want:?}");
        }
    }
}
