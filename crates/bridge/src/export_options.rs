//! How a [`DeviceBatch`](crate::DeviceBatch) is exported ([`ExportOptions`]).

use devarrow_abi::export_tree::ArrayNode;
use devarrow_abi::{Error, Result};

/// Options of [`DeviceBatch::export_with`](crate::DeviceBatch::export_with).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ExportOptions {
    /// Export a root struct array with a nonzero `offset` (possible for a batch imported
    /// from a producer that exported a slice) as `offset` 0, moving the offset into each
    /// column (their `offset` grows by it, their `length` shrinks by it, a `null_count`
    /// that is no longer known becomes -1). No byte is copied.
    ///
    /// Why: the C data interface allows a record batch's root to carry an offset, but
    /// some consumers refuse one: pyarrow's and Arrow C++'s `ImportRecordBatch` fail with
    /// "Cannot construct record batch from struct array with non-zero offset". Batches
    /// uploaded by devarrow itself always export offset 0, so this only matters for
    /// re-exported foreign batches. A root with nulls of its own cannot be normalized this
    /// way and is an [`Error::InvalidArgument`].
    pub normalize_root_offset: bool,
}

impl ExportOptions {
    /// The options with [`ExportOptions::normalize_root_offset`] set to `normalize`.
    pub fn normalize_root_offset(mut self, normalize: bool) -> Self {
        self.normalize_root_offset = normalize;
        self
    }
}

/// Options of [`DeviceBatch::import_with_options`](crate::DeviceBatch::import_with_options).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ImportOptions {
    /// An array in the memory of another device of the importing device's type (on
    /// CUDA GPU 0, an `ARROW_DEVICE_CUDA` array whose `device_id` is 1): refused with
    /// [`Error::DeviceMismatch`] when `false` (**the default**: the importing device
    /// cannot address those buffers); when `true`, imported on that device
    /// ([`Device::peer_device`](devarrow_abi::device::Device::peer_device), its stream
    /// waiting on the array's `sync_event`) and copied here
    /// ([`DeviceBatch::copy_to`](crate::DeviceBatch::copy_to): one peer copy where the
    /// devices allow it, else staged through host memory). The result is then a packed
    /// batch of the importing device, and the foreign array is released once that copy
    /// has been read (as the import's rules say), when this returns.
    pub copy_from_other_device: bool,
}

impl ImportOptions {
    /// The options with [`ImportOptions::copy_from_other_device`] set to `copy`.
    pub fn copy_from_other_device(mut self, copy: bool) -> Self {
        self.copy_from_other_device = copy;
        self
    }
}

/// Moves the root's offset into its children (see [`ExportOptions::normalize_root_offset`]).
pub(crate) fn normalize_root_offset(mut root: ArrayNode) -> Result<ArrayNode> {
    let shift = root.offset;
    if shift == 0 {
        return Ok(root);
    }
    let root_has_nulls = root.buffers.first().is_some_and(|b| !b.is_null()) && root.null_count != 0;
    if root_has_nulls {
        return Err(Error::InvalidArgument(format!(
            "a root struct array with offset {shift} and a validity bitmap (null_count {}) \
             cannot have its offset moved into its columns",
            root.null_count
        )));
    }
    if let Some(validity) = root.buffers.first_mut() {
        *validity = std::ptr::null();
    }
    root.null_count = 0;
    root.offset = 0;
    for child in &mut root.children {
        child.offset += shift;
        child.length -= shift;
        if child.null_count != 0 {
            child.null_count = -1;
        }
    }
    Ok(root)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn leaf(length: i64, offset: i64, null_count: i64) -> ArrayNode {
        ArrayNode {
            length,
            offset,
            null_count,
            buffers: vec![std::ptr::null(), 8 as *const _],
            ..Default::default()
        }
    }

    #[test]
    fn the_root_offset_moves_into_the_columns() {
        let root = ArrayNode {
            length: 3,
            offset: 5,
            null_count: 0,
            buffers: vec![std::ptr::null()],
            children: vec![leaf(10, 0, 0), leaf(12, 2, 4)],
            dictionary: None,
        };
        let out = normalize_root_offset(root).unwrap();
        assert_eq!((out.offset, out.length, out.null_count), (0, 3, 0));
        let c: Vec<_> = out
            .children
            .iter()
            .map(|c| (c.offset, c.length, c.null_count))
            .collect();
        assert_eq!(c, [(5, 5, 0), (7, 7, -1)]);
    }

    #[test]
    fn a_root_with_nulls_is_refused() {
        let root = ArrayNode {
            length: 3,
            offset: 1,
            null_count: 1,
            buffers: vec![16 as *const _],
            children: vec![leaf(4, 0, 0)],
            dictionary: None,
        };
        let err = normalize_root_offset(root).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    }
}
