//! Key/value metadata in the encoding of `ArrowSchema.metadata`, as the async device
//! stream passes it: per task (`on_next_task`'s `metadata`), per stream
//! (`ArrowAsyncProducer.additional_metadata`) and with errors (`on_error`'s `metadata`).
//!
//! The encoding (C data interface, "Metadata"): an `int32` number of pairs, then for each
//! pair an `int32` byte length and the key's bytes, an `int32` byte length and the value's
//! bytes; integers in native byte order, no terminator, no alignment.

use std::ffi::c_char;

use crate::error::{Error, Result};

/// Ordered key/value metadata, keys and values UTF-8 (as arrow-rs's schema metadata).
///
/// Order and duplicate keys survive a round trip through [`Metadata::encode`] and
/// [`Metadata::decode`]; [`Metadata::get`] returns the first value of a key and
/// [`Metadata::insert`] replaces it.
///
/// Stream-level facts have keys of their own (in `additional_metadata`):
/// [`Metadata::NUM_ROWS`] and [`Metadata::NUM_BATCHES`], decimal integers, set with
/// [`Metadata::with_num_rows`] / [`Metadata::with_num_batches`] and read with
/// [`Metadata::num_rows`] / [`Metadata::num_batches`].
///
/// # Example
///
/// ```
/// use devarrow_abi::Metadata;
///
/// # fn main() -> devarrow_abi::Result<()> {
/// let metadata = Metadata::new().with("source", "lineitem").with_num_rows(6_001_215);
/// let bytes = metadata.encode()?; // the ArrowSchema.metadata encoding
/// let back = Metadata::decode(&bytes)?;
/// assert_eq!(back.get("source"), Some("lineitem"));
/// assert_eq!(back.num_rows()?, Some(6_001_215));
/// assert_eq!(back, metadata);
///
/// // A count that is no decimal integer is a typed error.
/// let bad = Metadata::new().with(Metadata::NUM_ROWS, "many");
/// assert!(bad.num_rows().is_err());
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Metadata {
    pairs: Vec<(String, String)>,
}

impl Metadata {
    /// The key of the total number of rows of a stream, when the producer knows it.
    pub const NUM_ROWS: &'static str = "devarrow.num_rows";
    /// The key of the total number of batches (tasks) of a stream, when the producer knows
    /// it.
    pub const NUM_BATCHES: &'static str = "devarrow.num_batches";

    /// No pairs.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets `key` to `value`, replacing (in place) its first value if it had one, which is
    /// returned; otherwise appends the pair.
    pub fn insert(&mut self, key: impl Into<String>, value: impl Into<String>) -> Option<String> {
        let (key, value) = (key.into(), value.into());
        match self.pairs.iter_mut().find(|(k, _)| *k == key) {
            Some((_, old)) => Some(std::mem::replace(old, value)),
            None => {
                self.pairs.push((key, value));
                None
            }
        }
    }

    /// [`Metadata::insert`], by value.
    pub fn with(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.insert(key, value);
        self
    }

    /// The first value of `key`.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.pairs
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// Removes every pair of `key`; returns the first value it had.
    pub fn remove(&mut self, key: &str) -> Option<String> {
        let first = self.get(key).map(str::to_owned);
        self.pairs.retain(|(k, _)| k != key);
        first
    }

    /// The number of pairs.
    pub fn len(&self) -> usize {
        self.pairs.len()
    }

    /// Whether there are no pairs.
    pub fn is_empty(&self) -> bool {
        self.pairs.is_empty()
    }

    /// The pairs, in order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = (&str, &str)> + '_ {
        self.pairs.iter().map(|(k, v)| (k.as_str(), v.as_str()))
    }

    /// With [`Metadata::NUM_ROWS`] set to `rows`.
    pub fn with_num_rows(self, rows: u64) -> Self {
        self.with(Self::NUM_ROWS, rows.to_string())
    }

    /// With [`Metadata::NUM_BATCHES`] set to `batches`.
    pub fn with_num_batches(self, batches: u64) -> Self {
        self.with(Self::NUM_BATCHES, batches.to_string())
    }

    /// The [`Metadata::NUM_ROWS`] fact: `None` when absent, [`Error::Metadata`] when it
    /// is not a decimal integer.
    pub fn num_rows(&self) -> Result<Option<u64>> {
        self.parse_count(Self::NUM_ROWS)
    }

    /// The [`Metadata::NUM_BATCHES`] fact: `None` when absent, [`Error::Metadata`] when it
    /// is not a decimal integer.
    pub fn num_batches(&self) -> Result<Option<u64>> {
        self.parse_count(Self::NUM_BATCHES)
    }

    fn parse_count(&self, key: &str) -> Result<Option<u64>> {
        self.get(key)
            .map(|v| {
                v.parse::<u64>().map_err(|e| {
                    Error::Metadata(format!("{key} = {v:?} is not a row or batch count: {e}"))
                })
            })
            .transpose()
    }

    /// Encodes the pairs as `ArrowSchema.metadata` does. Fails with [`Error::Metadata`]
    /// when a key, a value or the number of pairs exceeds `i32::MAX`.
    ///
    /// ```
    /// use devarrow_abi::Metadata;
    ///
    /// # fn main() -> devarrow_abi::Result<()> {
    /// let metadata = Metadata::new().with("origin", "sensor-7").with_num_rows(1000);
    /// let bytes = metadata.encode()?; // what a C `additional_metadata` points to
    /// let back = Metadata::decode(&bytes)?;
    /// assert_eq!(back.get("origin"), Some("sensor-7"));
    /// assert_eq!(back.num_rows()?, Some(1000));
    /// # Ok(())
    /// # }
    /// ```
    pub fn encode(&self) -> Result<Vec<u8>> {
        fn len_of(n: usize, what: &str) -> Result<[u8; 4]> {
            i32::try_from(n)
                .map(i32::to_ne_bytes)
                .map_err(|_| Error::Metadata(format!("{what} of {n} exceeds i32::MAX")))
        }
        let size = 4 + self
            .pairs
            .iter()
            .map(|(k, v)| 8 + k.len() + v.len())
            .sum::<usize>();
        let mut out = Vec::with_capacity(size);
        out.extend_from_slice(&len_of(self.pairs.len(), "a count")?);
        for (k, v) in &self.pairs {
            out.extend_from_slice(&len_of(k.len(), "a key length")?);
            out.extend_from_slice(k.as_bytes());
            out.extend_from_slice(&len_of(v.len(), "a value length")?);
            out.extend_from_slice(v.as_bytes());
        }
        Ok(out)
    }

    /// Decodes metadata encoded as `ArrowSchema.metadata`, all of `bytes` (trailing bytes
    /// are an error). Fails with [`Error::Metadata`] on a negative count or length, one
    /// past the end of `bytes`, or a key or value that is not UTF-8.
    pub fn decode(bytes: &[u8]) -> Result<Self> {
        let mut reader = SliceReader { bytes, at: 0 };
        let metadata = decode_with(&mut reader)?;
        if reader.at != bytes.len() {
            return Err(Error::Metadata(format!(
                "{} bytes after the last pair",
                bytes.len() - reader.at
            )));
        }
        Ok(metadata)
    }

    /// Decodes C metadata: `None` for NULL.
    ///
    /// Fails with [`Error::Metadata`] on a negative count or length, or a key or value that
    /// is not UTF-8.
    ///
    /// # Safety
    /// `ptr` must be NULL or point to metadata in the `ArrowSchema.metadata` encoding,
    /// valid for reads of all the bytes its counts and lengths announce (the encoding has no
    /// other end marker; a malformed length makes this read past it).
    pub unsafe fn from_c(ptr: *const c_char) -> Result<Option<Self>> {
        if ptr.is_null() {
            return Ok(None);
        }
        let mut reader = PtrReader {
            ptr: ptr.cast::<u8>(),
        };
        decode_with(&mut reader).map(Some)
    }
}

impl<K: Into<String>, V: Into<String>> FromIterator<(K, V)> for Metadata {
    /// Collects pairs in order (duplicates kept).
    fn from_iter<I: IntoIterator<Item = (K, V)>>(iter: I) -> Self {
        Self {
            pairs: iter
                .into_iter()
                .map(|(k, v)| (k.into(), v.into()))
                .collect(),
        }
    }
}

impl From<std::collections::HashMap<String, String>> for Metadata {
    /// The pairs sorted by key (a `HashMap` has no order of its own).
    fn from(map: std::collections::HashMap<String, String>) -> Self {
        let mut pairs: Vec<_> = map.into_iter().collect();
        pairs.sort();
        Self { pairs }
    }
}

impl From<Metadata> for std::collections::HashMap<String, String> {
    /// The first value of each key.
    fn from(metadata: Metadata) -> Self {
        let mut map = Self::with_capacity(metadata.len());
        for (k, v) in metadata.pairs {
            map.entry(k).or_insert(v);
        }
        map
    }
}

/// Where [`decode_with`] reads from.
trait Reader {
    /// The next `n` bytes.
    fn take(&mut self, n: usize) -> Result<Vec<u8>>;
}

struct SliceReader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Reader for SliceReader<'_> {
    fn take(&mut self, n: usize) -> Result<Vec<u8>> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&end| end <= self.bytes.len())
            .ok_or_else(|| {
                Error::Metadata(format!(
                    "{n} bytes wanted at offset {} of {}",
                    self.at,
                    self.bytes.len()
                ))
            })?;
        let out = self.bytes[self.at..end].to_vec();
        self.at = end;
        Ok(out)
    }
}

/// Reads from a C pointer; whoever makes one vouches for the bytes (see
/// [`Metadata::from_c`]).
struct PtrReader {
    ptr: *const u8,
}

impl Reader for PtrReader {
    fn take(&mut self, n: usize) -> Result<Vec<u8>> {
        // SAFETY: per `Metadata::from_c`'s contract the encoded metadata, whose counts and
        // lengths drive these reads, is readable to its end; bytes need no alignment.
        let out = unsafe { std::slice::from_raw_parts(self.ptr, n) }.to_vec();
        // SAFETY: as above: the `n` bytes just read lie within the metadata.
        self.ptr = unsafe { self.ptr.add(n) };
        Ok(out)
    }
}

fn decode_with(reader: &mut impl Reader) -> Result<Metadata> {
    fn int(reader: &mut impl Reader, what: &str) -> Result<usize> {
        let bytes = reader.take(4)?;
        let n = i32::from_ne_bytes(bytes.try_into().expect("4 bytes"));
        usize::try_from(n).map_err(|_| Error::Metadata(format!("negative {what} {n}")))
    }
    fn text(reader: &mut impl Reader, what: &str, index: usize) -> Result<String> {
        let len = int(reader, what)?;
        String::from_utf8(reader.take(len)?)
            .map_err(|e| Error::Metadata(format!("the {what} of pair {index} is not UTF-8: {e}")))
    }
    let count = int(reader, "pair count")?;
    let mut pairs = Vec::new();
    for index in 0..count {
        let key = text(reader, "key", index)?;
        let value = text(reader, "value", index)?;
        pairs.push((key, value));
    }
    Ok(Metadata { pairs })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_in_order_with_duplicates() {
        let m: Metadata = [("b", "2"), ("a", ""), ("b", "3"), ("ключ", "значение")]
            .into_iter()
            .collect();
        let bytes = m.encode().unwrap();
        assert_eq!(Metadata::decode(&bytes).unwrap(), m);
        // SAFETY: `bytes` is a complete encoding, alive for the call.
        let from_c = unsafe { Metadata::from_c(bytes.as_ptr().cast()) }.unwrap();
        assert_eq!(from_c, Some(m.clone()));
        assert_eq!(m.get("b"), Some("2"));
        // SAFETY: NULL is absent metadata.
        assert_eq!(unsafe { Metadata::from_c(std::ptr::null()) }.unwrap(), None);
    }

    #[test]
    fn encodes_as_the_c_data_interface_says() {
        let m = Metadata::new().with("key", "value");
        let mut expected = Vec::new();
        expected.extend_from_slice(&1i32.to_ne_bytes());
        expected.extend_from_slice(&3i32.to_ne_bytes());
        expected.extend_from_slice(b"key");
        expected.extend_from_slice(&5i32.to_ne_bytes());
        expected.extend_from_slice(b"value");
        assert_eq!(m.encode().unwrap(), expected);
        assert_eq!(Metadata::new().encode().unwrap(), 0i32.to_ne_bytes());
    }

    #[test]
    fn malformed_input_is_a_typed_error() {
        let good = Metadata::new().with("k", "v").encode().unwrap();
        for bad in [
            &good[..good.len() - 1],
            &good[..2],
            &(-1i32).to_ne_bytes()[..],
            &[good.as_slice(), &[0]].concat()[..],
        ] {
            assert!(matches!(Metadata::decode(bad), Err(Error::Metadata(_))));
        }
        let mut negative = 1i32.to_ne_bytes().to_vec();
        negative.extend_from_slice(&(-5i32).to_ne_bytes());
        assert!(matches!(
            Metadata::decode(&negative),
            Err(Error::Metadata(_))
        ));
        let mut not_utf8 = 1i32.to_ne_bytes().to_vec();
        not_utf8.extend_from_slice(&1i32.to_ne_bytes());
        not_utf8.push(0xff);
        not_utf8.extend_from_slice(&0i32.to_ne_bytes());
        assert!(matches!(
            Metadata::decode(&not_utf8),
            Err(Error::Metadata(_))
        ));
    }

    #[test]
    fn counts() {
        let m = Metadata::new().with_num_rows(12).with_num_batches(3);
        assert_eq!(m.num_rows().unwrap(), Some(12));
        assert_eq!(m.num_batches().unwrap(), Some(3));
        assert_eq!(Metadata::new().num_rows().unwrap(), None);
        let bad = Metadata::new().with(Metadata::NUM_ROWS, "many");
        assert!(matches!(bad.num_rows(), Err(Error::Metadata(_))));
        let mut m = m.with_num_rows(13);
        assert_eq!(m.len(), 2, "insert replaces");
        assert_eq!(m.remove(Metadata::NUM_ROWS).as_deref(), Some("13"));
        assert_eq!(m.num_rows().unwrap(), None);
    }
}
