//! Little-endian encoding of migration records: an append-only writer and a bounds-checked
//! reader for hostile input (a truncated or oversized field is an error, never a panic or
//! an allocation larger than what is left of the input).

use zerocopy::{FromBytes, IntoBytes};

use super::MigrationError;

/// Builds a record.
#[derive(Debug, Default)]
pub struct Enc(pub Vec<u8>);

impl Enc {
    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.0.push(v);
        self
    }
    pub fn u16(&mut self, v: u16) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn bool(&mut self, v: bool) -> &mut Self {
        self.u8(u8::from(v))
    }
    /// A length-prefixed byte string.
    pub fn bytes(&mut self, v: &[u8]) -> &mut Self {
        self.u64(v.len() as u64);
        self.0.extend_from_slice(v);
        self
    }
    /// A KVM structure as its bytes (length-prefixed, so a reader can check its size).
    pub fn pod<T: IntoBytes + zerocopy::Immutable>(&mut self, v: &T) -> &mut Self {
        self.bytes(v.as_bytes())
    }
}

/// Reads a record.
#[derive(Debug)]
pub struct Dec<'a> {
    buf: &'a [u8],
    what: &'static str,
}

impl<'a> Dec<'a> {
    /// `what` names the record in errors.
    pub fn new(buf: &'a [u8], what: &'static str) -> Self {
        Dec { buf, what }
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8], MigrationError> {
        if self.buf.len() < n {
            return Err(MigrationError::Truncated(self.what));
        }
        let (h, t) = self.buf.split_at(n);
        self.buf = t;
        Ok(h)
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N], MigrationError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }
    pub fn u8(&mut self) -> Result<u8, MigrationError> {
        Ok(self.array::<1>()?[0])
    }
    pub fn u16(&mut self) -> Result<u16, MigrationError> {
        Ok(u16::from_le_bytes(self.array()?))
    }
    pub fn u32(&mut self) -> Result<u32, MigrationError> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    pub fn u64(&mut self) -> Result<u64, MigrationError> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    pub fn bool(&mut self) -> Result<bool, MigrationError> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(MigrationError::Invalid(self.what, "bad boolean")),
        }
    }
    pub fn bytes(&mut self) -> Result<&'a [u8], MigrationError> {
        let n = usize::try_from(self.u64()?).map_err(|_| MigrationError::Truncated(self.what))?;
        self.take(n)
    }
    /// A KVM structure written by [`Enc::pod`]; its size must match this build's.
    pub fn pod<T: FromBytes>(&mut self) -> Result<T, MigrationError> {
        let b = self.bytes()?;
        T::read_from_bytes(b).map_err(|_| MigrationError::Invalid(self.what, "KVM structure size"))
    }
    /// A count of items each at least `min_item` bytes long, checked against what is
    /// left (so a corrupt count cannot ask for a huge allocation).
    pub fn count(&mut self, min_item: usize) -> Result<usize, MigrationError> {
        let n = usize::try_from(self.u32()?).map_err(|_| MigrationError::Truncated(self.what))?;
        if n.saturating_mul(min_item.max(1)) > self.buf.len() {
            return Err(MigrationError::Truncated(self.what));
        }
        Ok(n)
    }
    /// Fails unless every byte was read.
    pub fn end(&self) -> Result<(), MigrationError> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(MigrationError::Invalid(self.what, "trailing bytes"))
        }
    }
}
