//! Guest modules on the fake device: a **test device**, not a GPU. It "loads" a PTX text
//! by reading its `.entry` names with their `.param` lists and its `.global` variables,
//! and runs a handful of test kernels, chosen by name, on the CPU. Every pointer such a
//! kernel touches is checked against memory the fake handed out (device allocations,
//! globals, registered host memory); a wild one poisons the device as an illegal address
//! loses a real context. Any other entry loads, but launching it is `Unsupported`. It
//! exists so that CI can test the plumbing of guest modules end to end
//! (docs/design/guest-modules.md, "Test device").

use vgpu_protocol::module::ParamInfo;
use vgpu_protocol::module_image::{fatbin_ptx, FATBIN_MAGIC};

use super::error::DeviceError;

/// The kernels the fake runs, by their `.entry` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TestKernel {
    /// `(u32* a, u32* b, u32* c, u32 n)`: `c[i] = a[i] + b[i]` (wrapping).
    VaddU32,
    /// `(f32* a, f32* b, f32* c, u32 n)`: `c[i] = a[i] + b[i]`.
    VaddF32,
    /// `(u32 v)`: writes `v` to the module's global `vgpu_test_counter`.
    SetGlobal,
    /// `(u32* dst, u32* src, u32 n)`: `dst[i] = src[i]`.
    CopyU32,
    /// `(u32* p)`: writes `0xdead` at `p` (tests aim it at nothing).
    WildWrite,
    /// `(node* head, u32* out, u32 n)`: follows `n` nodes of a linked list from `head`
    /// (a node: the next node's address, then a `u32` value) and writes the values' sum
    /// at `out`: pointers read from memory, as identity addressing must serve.
    Chase,
}

impl TestKernel {
    fn by_name(name: &str) -> Option<Self> {
        Some(match name {
            "vgpu_test_vadd_u32" => TestKernel::VaddU32,
            "vgpu_test_vadd_f32" => TestKernel::VaddF32,
            "vgpu_test_set_global" => TestKernel::SetGlobal,
            "vgpu_test_copy_u32" => TestKernel::CopyU32,
            "vgpu_test_wild_write" => TestKernel::WildWrite,
            "vgpu_test_chase" => TestKernel::Chase,
            _ => return None,
        })
    }

    /// The parameter sizes the kernel's code expects.
    fn signature(self) -> &'static [u32] {
        match self {
            TestKernel::VaddU32 | TestKernel::VaddF32 => &[8, 8, 8, 4],
            TestKernel::SetGlobal => &[4],
            TestKernel::CopyU32 => &[8, 8, 4],
            TestKernel::WildWrite => &[8],
            TestKernel::Chase => &[8, 8, 4],
        }
    }
}

/// The global `vgpu_test_set_global` writes.
pub const TEST_GLOBAL: &str = "vgpu_test_counter";

/// An `.entry` of a parsed PTX text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PtxEntry {
    pub name: String,
    pub params: Vec<ParamInfo>,
}

/// A `.global` variable of a parsed PTX text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PtxGlobal {
    pub name: String,
    pub size: u64,
}

/// What the fake reads from a PTX text.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PtxModule {
    pub entries: Vec<PtxEntry>,
    pub globals: Vec<PtxGlobal>,
}

/// Bytes of a PTX scalar type (`.u32`, `.f64`, `.b8`...).
fn type_bytes(tok: &str) -> Option<u32> {
    let t = tok.strip_prefix('.')?;
    let (kind, bits) = t.split_at(1);
    if !matches!(kind, "u" | "s" | "b" | "f") {
        return None;
    }
    match bits {
        "8" => Some(1),
        "16" => Some(2),
        "32" => Some(4),
        "64" => Some(8),
        _ => None,
    }
}

/// `name[N]` → (`name`, N); `name` → (`name`, 1).
fn split_array(tok: &str) -> Option<(&str, u32)> {
    let tok = tok.trim_end_matches([',', ';']);
    match tok.split_once('[') {
        Some((name, rest)) => Some((name, rest.strip_suffix(']')?.parse().ok()?)),
        None => Some((tok, 1)),
    }
}

/// One declaration's (name, bytes, alignment) from its tokens after `.param`/`.global`.
fn declaration(tokens: &[&str]) -> Option<(String, u32, u32)> {
    let mut align = None;
    let mut i = 0;
    while i < tokens.len() {
        let t = tokens[i];
        if t == ".align" {
            align = tokens.get(i + 1)?.parse::<u32>().ok();
            i += 2;
            continue;
        }
        if let Some(b) = type_bytes(t) {
            let (name, count) = split_array(tokens.get(i + 1)?)?;
            let size = b.checked_mul(count)?;
            let align = align.unwrap_or(b).max(1);
            return (!name.is_empty()).then(|| (name.to_string(), size, align));
        }
        i += 1;
    }
    None
}

/// Parses the entries and globals of a PTX text (or of a fatbin's PTX entry); `None` when
/// it is not PTX text the fake understands (the module load fails then, as the driver's
/// would on garbage).
pub fn parse_ptx(image: &[u8]) -> Option<PtxModule> {
    let image = match image.get(..4) {
        Some(m) if u32::from_le_bytes([m[0], m[1], m[2], m[3]]) == FATBIN_MAGIC => {
            fatbin_ptx(image)?
        }
        _ => std::borrow::Cow::Borrowed(image),
    };
    // The NUL that ends the text, and a fatbin entry's padding.
    let len = image.iter().rposition(|&b| b != 0).map_or(0, |i| i + 1);
    let text = std::str::from_utf8(&image[..len]).ok()?;
    if !text.contains(".version") || !text.contains(".target") {
        return None;
    }
    // A truncated text ends inside a function body, as a compiler would notice.
    let (open, close) = (text.matches('{').count(), text.matches('}').count());
    if open != close {
        return None;
    }
    let mut m = PtxModule::default();
    let mut lines = text.lines().map(str::trim).peekable();
    while let Some(line) = lines.next() {
        let tokens: Vec<&str> = line.split_whitespace().collect();
        if let Some(at) = tokens.iter().position(|&t| t == ".entry") {
            let name = tokens.get(at + 1)?.split('(').next()?.to_string();
            let mut params = Vec::new();
            let mut end = 0u32;
            // Parameters follow, one per line, until the closing parenthesis.
            let mut rest = line.split_once('(').map(|(_, r)| r.to_string());
            loop {
                let l = match rest.take() {
                    Some(r) => r,
                    None => lines.next()?.to_string(),
                };
                let toks: Vec<&str> = l.split_whitespace().collect();
                if let Some(p) = toks.iter().position(|&t| t == ".param") {
                    let (_, size, align) = declaration(&toks[p + 1..])?;
                    let offset = end.next_multiple_of(align);
                    params.push(ParamInfo { offset, size });
                    end = offset.checked_add(size)?;
                }
                if l.contains(')') {
                    break;
                }
            }
            m.entries.push(PtxEntry { name, params });
        } else if !tokens.contains(&".param")
            && tokens
                .iter()
                .take_while(|t| t.starts_with('.'))
                .any(|&t| t == ".global")
        {
            let at = tokens.iter().position(|&t| t == ".global")?;
            let (name, size, _) = declaration(&tokens[at + 1..])?;
            m.globals.push(PtxGlobal {
                name: name.split('=').next()?.trim().to_string(),
                size: size.into(),
            });
        }
    }
    Some(m)
}

/// A launch resolved at issue time: which kernel, its parameter buffer and its grid's
/// threads.
#[derive(Debug, Clone)]
pub struct FakeLaunch {
    pub kernel: Option<TestKernel>,
    pub params: std::sync::Arc<[u8]>,
    pub threads: u64,
    /// The module's `vgpu_test_counter`, if it has one.
    pub global: Option<(u64, u64)>,
}

/// Whether `ptr..ptr+len` lies in memory the fake handed out.
pub type Reachable<'a> = dyn Fn(u64, u64) -> bool + 'a;

fn param_u64(p: &[u8], at: usize) -> u64 {
    p.get(at..at + 8)
        .and_then(|b| b.try_into().ok())
        .map_or(0, u64::from_le_bytes)
}

fn param_u32(p: &[u8], at: usize) -> u32 {
    p.get(at..at + 4)
        .and_then(|b| b.try_into().ok())
        .map_or(0, u32::from_le_bytes)
}

/// Runs a test kernel on the CPU. `Err` is the illegal address it hit (the caller
/// poisons the device); no byte is written by a launch that fails its checks.
pub fn run(l: &FakeLaunch, reachable: &Reachable<'_>) -> Result<(), u64> {
    let Some(kernel) = l.kernel else {
        return Ok(());
    };
    let p = &l.params;
    let check = |ptr: u64, len: u64| {
        if len == 0 || reachable(ptr, len) {
            Ok(())
        } else {
            Err(ptr)
        }
    };
    match kernel {
        TestKernel::VaddU32 | TestKernel::VaddF32 => {
            let (a, b, c) = (param_u64(p, 0), param_u64(p, 8), param_u64(p, 16));
            let n = u64::from(param_u32(p, 24)).min(l.threads);
            let len = n * 4;
            check(a, len)?;
            check(b, len)?;
            check(c, len)?;
            for i in 0..n {
                let at = i * 4;
                // SAFETY: all three ranges were checked against the fake's memory above.
                unsafe {
                    let x = std::ptr::read_unaligned((a + at) as *const u32);
                    let y = std::ptr::read_unaligned((b + at) as *const u32);
                    let z = if kernel == TestKernel::VaddU32 {
                        x.wrapping_add(y)
                    } else {
                        (f32::from_bits(x) + f32::from_bits(y)).to_bits()
                    };
                    std::ptr::write_unaligned((c + at) as *mut u32, z);
                }
            }
        }
        TestKernel::SetGlobal => {
            let (g, size) = l.global.ok_or(0u64)?;
            if size < 4 || l.threads == 0 {
                return Err(g);
            }
            check(g, 4)?;
            // SAFETY: the module's global, 4 bytes checked above.
            unsafe { std::ptr::write_unaligned(g as *mut u32, param_u32(p, 0)) };
        }
        TestKernel::CopyU32 => {
            let (dst, src) = (param_u64(p, 0), param_u64(p, 8));
            let n = u64::from(param_u32(p, 16)).min(l.threads);
            check(dst, n * 4)?;
            check(src, n * 4)?;
            // SAFETY: both ranges checked above; `copy` allows overlap.
            unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, (n * 4) as usize) };
        }
        TestKernel::WildWrite => {
            let ptr = param_u64(p, 0);
            check(ptr, 4)?;
            // SAFETY: checked above (tests aim it at nothing, so this rarely runs).
            unsafe { std::ptr::write_unaligned(ptr as *mut u32, 0xdead) };
        }
        TestKernel::Chase => {
            let (mut node, out) = (param_u64(p, 0), param_u64(p, 8));
            check(out, 4)?;
            let mut sum = 0u32;
            for _ in 0..param_u32(p, 16) {
                check(node, 12)?;
                // SAFETY: the node's 12 bytes were checked just above.
                let (next, value) = unsafe {
                    (
                        std::ptr::read_unaligned(node as *const u64),
                        std::ptr::read_unaligned((node + 8) as *const u32),
                    )
                };
                sum = sum.wrapping_add(value);
                node = next;
            }
            // SAFETY: checked at the start.
            unsafe { std::ptr::write_unaligned(out as *mut u32, sum) };
        }
    }
    Ok(())
}

/// The test kernel behind an entry, if its parameters are the ones the kernel expects.
pub fn test_kernel(entry: &PtxEntry) -> Option<TestKernel> {
    let k = TestKernel::by_name(&entry.name)?;
    let sizes: Vec<u32> = entry.params.iter().map(|p| p.size).collect();
    (sizes == k.signature()).then_some(k)
}

/// The error a launch of an entry the fake does not implement gets.
pub fn unsupported() -> DeviceError {
    DeviceError::Unsupported("the fake device runs only its test kernels")
}

#[cfg(test)]
mod tests {
    use super::*;

    pub const PTX: &str = r#"
.version 8.0
.target sm_90
.address_size 64

.visible .global .align 4 .u32 vgpu_test_counter = 0;
.global .align 8 .b8 table[24];

.visible .entry vgpu_test_vadd_u32(
	.param .u64 .ptr .global .align 1 vgpu_test_vadd_u32_param_0,
	.param .u64 vgpu_test_vadd_u32_param_1,
	.param .u64 vgpu_test_vadd_u32_param_2,
	.param .u32 vgpu_test_vadd_u32_param_3
)
{
	ld.global.u32 %r1, [%rd1];
	ret;
}

.visible .entry other(
	.param .u32 other_param_0,
	.param .align 8 .b8 other_param_1[12]
)
{
	ret;
}
"#;

    #[test]
    fn reads_entries_params_and_globals() {
        let m = parse_ptx(PTX.as_bytes()).expect("parses");
        assert_eq!(m.entries.len(), 2);
        let v = &m.entries[0];
        assert_eq!(v.name, "vgpu_test_vadd_u32");
        let offs: Vec<(u32, u32)> = v.params.iter().map(|p| (p.offset, p.size)).collect();
        assert_eq!(offs, [(0, 8), (8, 8), (16, 8), (24, 4)]);
        assert_eq!(test_kernel(v), Some(TestKernel::VaddU32));
        let o = &m.entries[1];
        let offs: Vec<(u32, u32)> = o.params.iter().map(|p| (p.offset, p.size)).collect();
        assert_eq!(offs, [(0, 4), (8, 12)]);
        assert_eq!(test_kernel(o), None);
        assert_eq!(
            m.globals,
            [
                PtxGlobal {
                    name: "vgpu_test_counter".into(),
                    size: 4
                },
                PtxGlobal {
                    name: "table".into(),
                    size: 24
                }
            ]
        );
    }

    /// A fatbin of one ELF entry (ignored) and one PTX entry, each with a 64-byte header
    /// and padded payload, as nvcc lays them out.
    fn fatbin(ptx: &[u8]) -> Vec<u8> {
        let entry = |kind: u16, payload: &[u8]| {
            let padded = payload.len().next_multiple_of(8) + 8;
            let mut e = vec![0u8; 64];
            e[..2].copy_from_slice(&kind.to_le_bytes());
            e[4..8].copy_from_slice(&64u32.to_le_bytes());
            e[8..16].copy_from_slice(&(padded as u64).to_le_bytes());
            e.extend(payload);
            e.resize(64 + padded, 0);
            e
        };
        let mut body = entry(2, b"\x7fELF not read");
        body.extend(entry(vgpu_protocol::module_image::FATBIN_PTX, ptx));
        let mut f = Vec::new();
        f.extend(FATBIN_MAGIC.to_le_bytes());
        f.extend(1u16.to_le_bytes());
        f.extend(16u16.to_le_bytes());
        f.extend((body.len() as u64).to_le_bytes());
        f.extend(body);
        f
    }

    #[test]
    fn a_fatbins_ptx_entry_is_read() {
        let m = parse_ptx(&fatbin(PTX.as_bytes())).expect("parses");
        assert_eq!(m.entries.len(), 2);
        // A fatbin without PTX, or one whose entry runs past its end, is refused.
        let mut f = fatbin(PTX.as_bytes());
        f.truncate(f.len() - 40);
        assert_eq!(parse_ptx(&f), None);
        let mut f = fatbin(b"");
        f[16] = 3;
        assert_eq!(parse_ptx(&f), None);
    }

    #[test]
    fn garbage_is_not_ptx() {
        assert_eq!(parse_ptx(b"\x7fELF garbage"), None);
        assert_eq!(parse_ptx(&[0xff; 64]), None);
        // Truncated in the middle of a parameter list.
        let cut = &PTX[..PTX.find("vgpu_test_vadd_u32_param_2").unwrap()];
        assert_eq!(parse_ptx(cut.as_bytes()), None);
    }

    #[test]
    fn kernels_check_every_pointer() {
        let mut a = [1u32, 2, 3];
        let mut b = [10u32, 20, 30];
        let mut c = [0u32; 3];
        let mut params = Vec::new();
        for p in [a.as_mut_ptr(), b.as_mut_ptr(), c.as_mut_ptr()] {
            params.extend((p as u64).to_le_bytes());
        }
        params.extend(3u32.to_le_bytes());
        let ranges = [a.as_ptr() as u64, b.as_ptr() as u64, c.as_ptr() as u64];
        let inside = move |p: u64, n: u64| ranges.iter().any(|&s| p >= s && p + n <= s + 12);
        let l = FakeLaunch {
            kernel: Some(TestKernel::VaddU32),
            params: params.clone().into(),
            threads: 2,
            global: None,
        };
        run(&l, &inside).unwrap();
        // Two threads: the third element is untouched.
        assert_eq!(c, [11, 22, 0]);
        let nowhere = |_: u64, _: u64| false;
        assert_eq!(run(&l, &nowhere), Err(a.as_ptr() as u64));
    }
}
