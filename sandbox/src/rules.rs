//! An allow-list of syscalls and its compilation into BPF.

use std::collections::BTreeMap;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule,
};

use crate::{target_arch, Mode, Role, SandboxError};

/// One argument condition: `args[index] op value` (`op` may mask first).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Arg {
    pub index: u8,
    pub op: SeccompCmpOp,
    pub value: u64,
    /// Compare only the low 32 bits (ints and ioctl request numbers).
    pub dword: bool,
}

impl Arg {
    /// `args[index] == value` on the low 32 bits.
    pub fn eq32(index: u8, value: u64) -> Arg {
        Arg {
            index,
            op: SeccompCmpOp::Eq,
            value,
            dword: true,
        }
    }

    /// `args[index] == value`, all 64 bits.
    pub fn eq64(index: u8, value: u64) -> Arg {
        Arg {
            index,
            op: SeccompCmpOp::Eq,
            value,
            dword: false,
        }
    }

    /// `args[index] & mask == value` on the low 32 bits.
    pub fn masked32(index: u8, mask: u64, value: u64) -> Arg {
        Arg {
            index,
            op: SeccompCmpOp::MaskedEq(mask),
            value,
            dword: true,
        }
    }

    fn condition(&self) -> Result<SeccompCondition, seccompiler::BackendError> {
        let len = if self.dword {
            SeccompCmpArgLen::Dword
        } else {
            SeccompCmpArgLen::Qword
        };
        SeccompCondition::new(self.index, len, self.op.clone(), self.value)
    }
}

/// What a syscall may do: anything, or match one of some argument conditions (each a
/// conjunction).
#[derive(Debug, Clone, PartialEq, Eq)]
enum Allowed {
    Always,
    When(Vec<Vec<Arg>>),
}

/// An allow-list of syscalls by number.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Rules {
    map: BTreeMap<i64, Allowed>,
}

impl Rules {
    pub fn new() -> Rules {
        Rules::default()
    }

    /// Allows each of `syscalls` with any arguments.
    pub fn allow(mut self, syscalls: &[i64]) -> Rules {
        for nr in syscalls {
            self.map.insert(*nr, Allowed::Always);
        }
        self
    }

    /// Allows `syscall` when all of `args` hold (in addition to what it allowed before).
    pub fn allow_if(mut self, syscall: i64, args: Vec<Arg>) -> Rules {
        match self.map.get_mut(&syscall) {
            Some(Allowed::Always) => {}
            Some(Allowed::When(v)) => v.push(args),
            None => {
                self.map.insert(syscall, Allowed::When(vec![args]));
            }
        }
        self
    }

    /// Everything `self` or `other` allows.
    pub fn union(mut self, other: &Rules) -> Rules {
        for (nr, a) in &other.map {
            match a {
                Allowed::Always => {
                    self.map.insert(*nr, Allowed::Always);
                }
                Allowed::When(conds) => {
                    for c in conds {
                        self = self.allow_if(*nr, c.clone());
                    }
                }
            }
        }
        self
    }

    /// Whether `syscall` is allowed at all (with any arguments or some).
    pub fn mentions(&self, syscall: i64) -> bool {
        self.map.contains_key(&syscall)
    }

    /// Whether `syscall` is allowed with any arguments.
    pub fn allows_always(&self, syscall: i64) -> bool {
        self.map.get(&syscall) == Some(&Allowed::Always)
    }

    /// Whether every call `other` allows is allowed here too (conservatively: a
    /// conditional rule of `other` must appear here as is, or the syscall be free here).
    pub fn covers(&self, other: &Rules) -> bool {
        other.map.iter().all(|(nr, a)| match (self.map.get(nr), a) {
            (Some(Allowed::Always), _) => true,
            (Some(Allowed::When(mine)), Allowed::When(theirs)) => {
                theirs.iter().all(|c| mine.contains(c))
            }
            _ => false,
        })
    }

    /// The syscalls this list allows in some way, by number.
    pub fn syscalls(&self) -> impl Iterator<Item = i64> + '_ {
        self.map.keys().copied()
    }

    /// Compiles the list for `mode` (not `Off`): a syscall outside it kills the process or
    /// is logged.
    pub fn compile(&self, role: Role, mode: Mode) -> Result<BpfProgram, SandboxError> {
        let mismatch = match mode {
            Mode::Kill | Mode::Off => SeccompAction::KillProcess,
            Mode::Log => SeccompAction::Log,
        };
        self.compile_with(role, mismatch, SeccompAction::Allow)
    }

    /// Compiles the list as a filter that makes each listed syscall fail with `errno` and
    /// lets every other pass (stacked over an allow-list that allows them: the calls a
    /// library makes to probe something, which must fail, not kill).
    pub fn compile_errno(&self, role: Role, errno: i32) -> Result<BpfProgram, SandboxError> {
        self.compile_with(
            role,
            SeccompAction::Allow,
            SeccompAction::Errno(errno as u32),
        )
    }

    fn compile_with(
        &self,
        role: Role,
        mismatch: SeccompAction,
        matched: SeccompAction,
    ) -> Result<BpfProgram, SandboxError> {
        let err = |source| SandboxError::Compile { role, source };
        let mut rules: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
        for (nr, a) in &self.map {
            let v = match a {
                Allowed::Always => Vec::new(),
                Allowed::When(conds) => conds
                    .iter()
                    .map(|c| {
                        let cs = c
                            .iter()
                            .map(Arg::condition)
                            .collect::<Result<Vec<_>, _>>()?;
                        SeccompRule::new(cs)
                    })
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(err)?,
            };
            rules.insert(*nr, v);
        }
        let filter = SeccompFilter::new(rules, mismatch, matched, target_arch()?).map_err(err)?;
        BpfProgram::try_from(filter).map_err(err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn union_keeps_the_wider_rule() {
        let a = Rules::new().allow_if(1, vec![Arg::eq32(0, 2)]);
        let b = Rules::new().allow(&[1, 3]);
        let u = a.clone().union(&b);
        assert!(u.allows_always(1) && u.allows_always(3));
        assert!(u.covers(&a) && u.covers(&b));
        assert!(!a.covers(&b));
        let c = a
            .clone()
            .union(&Rules::new().allow_if(1, vec![Arg::eq32(0, 5)]));
        assert!(c.covers(&a) && !a.covers(&c));
    }

    #[test]
    fn compiles_for_this_arch() {
        let r = Rules::new()
            .allow(&[libc::SYS_read])
            .allow_if(libc::SYS_ioctl, vec![Arg::eq32(1, 0x5421)]);
        for mode in [Mode::Kill, Mode::Log] {
            assert!(!r
                .compile(Role::GpuEngine, mode)
                .expect("compile")
                .is_empty());
        }
        assert!(!r
            .compile_errno(Role::GpuEngine, libc::EACCES)
            .expect("compile")
            .is_empty());
    }
}
