//! Which GPU to run on: `sim` or `cuda[:INDEX]`, as the tools' `--gpu` flags and the
//! backend's `gpu.model` key spell it.

use std::fmt;
use std::str::FromStr;

use thiserror::Error;

/// A GPU model.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum GpuChoice {
    /// The software GPU (always available).
    #[default]
    Sim,
    /// NVIDIA GPU number `index` through the CUDA driver.
    Cuda { index: u32 },
}

#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("GPU {0:?}: expected \"sim\", \"cuda\" or \"cuda:INDEX\"")]
pub struct BadGpuChoice(pub String);

impl FromStr for GpuChoice {
    type Err = BadGpuChoice;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || BadGpuChoice(s.to_string());
        match s {
            "sim" => Ok(GpuChoice::Sim),
            "cuda" => Ok(GpuChoice::Cuda { index: 0 }),
            _ => {
                let idx = s.strip_prefix("cuda:").ok_or_else(bad)?;
                if idx.is_empty() || !idx.bytes().all(|b| b.is_ascii_digit()) {
                    return Err(bad());
                }
                idx.parse()
                    .map(|index| GpuChoice::Cuda { index })
                    .map_err(|_| bad())
            }
        }
    }
}

impl fmt::Display for GpuChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GpuChoice::Sim => f.write_str("sim"),
            GpuChoice::Cuda { index } => write!(f, "cuda:{index}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints() {
        assert_eq!("sim".parse(), Ok(GpuChoice::Sim));
        assert_eq!("cuda".parse(), Ok(GpuChoice::Cuda { index: 0 }));
        assert_eq!("cuda:3".parse(), Ok(GpuChoice::Cuda { index: 3 }));
        for bad in [
            "",
            "gpu",
            "cuda:",
            "cuda:-1",
            "cuda:+1",
            "cuda:x",
            "cuda:99999999999",
            "Sim",
        ] {
            assert!(bad.parse::<GpuChoice>().is_err(), "{bad}");
        }
        assert_eq!(GpuChoice::Cuda { index: 2 }.to_string(), "cuda:2");
        assert_eq!(GpuChoice::Sim.to_string(), "sim");
    }
}
