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
    /// Give every array of the tree an exact `null_count`, counting the set bits of its
    /// validity bitmap on the device where the count is unknown (-1: after a root offset
    /// was moved into the columns, or in a foreign array imported with -1). For consumers
    /// that read -1 as "no nulls", as libcudf does (its `has_nulls()` is
    /// `null_count > 0`). One readback for the whole batch, only when a count is unknown.
    pub exact_null_counts: bool,
    /// Convert `Utf8View` to `Utf8` (or `LargeUtf8` when the bytes its rows reference
    /// reach 2^31) and `BinaryView` to `Binary` (`LargeBinary`), on the device: one pass
    /// over the views for their sizes, a scan into offsets, and one gather of the bytes
    /// into a new data buffer. For consumers without view types.
    pub views_to_offsets: bool,
    /// Convert `ListView`, `LargeListView`, `LargeList`, `FixedSizeList` and `Map` to
    /// `List` (`int32` offsets), on the device. List views whose views are already in
    /// order and contiguous (checked on the device in the same pass as their sizes) keep
    /// their child zero-copy; others gather their child's values (fixed-width and boolean
    /// children; others are [`Error::NotConvertible`]). `LargeList` offsets are narrowed
    /// (an [`Error::NotConvertible`] past `i32::MAX`), `FixedSizeList` gets offsets
    /// `i × size`, a `Map` is relabelled as the list of structs it is. For consumers with
    /// only `int32` list offsets, as libcudf.
    pub lists_to_list32: bool,
    /// Widen `Decimal32` and `Decimal64` to `Decimal128` on the device (same precision
    /// and scale): for libcudf before 25.02, which refused the narrow decimals. Off in
    /// [`ExportOptions::for_libcudf`], which targets libcudf 25.02 and later.
    pub widen_small_decimals: bool,
    /// Relabel dictionaries with unsigned indices as signed indices of the same width,
    /// when the dictionary is short enough for every index to stay non-negative (else an
    /// [`Error::NotConvertible`]): libcudf refuses unsigned indices. No byte is touched.
    pub signed_dictionary_indices: bool,
    /// After the conversions, refuse with [`Error::NotConvertible`] (naming the column)
    /// what libcudf's `from_arrow_device` would refuse: the types of `docs/libcudf.md`'s
    /// "refused" rows, a root struct with nulls of its own, more than `i32::MAX` rows.
    /// Fails at the export instead of inside the consumer.
    pub refuse_outside_libcudf: bool,
}

impl ExportOptions {
    /// The export libcudf's `cudf::from_arrow_device` (25.02 and later) takes zero-copy
    /// wherever it can: every conversion on the device but
    /// [`ExportOptions::widen_small_decimals`], the root offset normalized, exact null
    /// counts, and what libcudf would refuse refused here, naming the column. A batch
    /// that needs no conversion is exported exactly as [`DeviceBatch::export`] does
    /// (zero-copy, no kernel, no readback). See `docs/libcudf.md` for the table of types.
    ///
    /// Needs a device with kernels ([`Device::kernels`]: the CPU device and CUDA) for a
    /// batch that needs a conversion; the converted buffers are new device memory, freed
    /// when the consumer releases the array.
    ///
    /// ```
    /// use std::sync::Arc;
    ///
    /// use arrow_array::{ArrayRef, RecordBatch, StringViewArray};
    /// use arrow_schema::DataType;
    /// use devarrow_bridge::select::{select_device, DeviceRequest};
    /// use devarrow_bridge::{DeviceBatch, ExportOptions, Transfer, TransferOptions};
    ///
    /// # fn main() -> devarrow_abi::Result<()> {
    /// let names: ArrayRef = Arc::new(StringViewArray::from(vec!["short", "a longer string value"]));
    /// let batch = RecordBatch::try_from_iter([("name", names)])?;
    /// let device = select_device(DeviceRequest::Cpu).expect("the CPU device").device;
    /// let mut transfer = Transfer::new(device.clone(), TransferOptions::default());
    /// let on_device = transfer.to_device(&batch)?;
    ///
    /// // Utf8View becomes Utf8 on the device: what libcudf views zero-copy.
    /// let (array, schema) = on_device.export_with(ExportOptions::for_libcudf())?;
    /// let imported = DeviceBatch::import_with_ffi_schema(device, array, &schema)?;
    /// assert_eq!(imported.schema().field(0).data_type(), &DataType::Utf8);
    /// let back = transfer.to_host(&imported)?;
    /// assert_eq!(back.column(0).as_ref(), &arrow_array::StringArray::from(vec!["short", "a longer string value"]) as &dyn arrow_array::Array);
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// [`DeviceBatch::export`]: crate::DeviceBatch::export
    /// [`Device::kernels`]: devarrow_abi::device::Device::kernels
    pub fn for_libcudf() -> Self {
        ExportOptions {
            normalize_root_offset: true,
            exact_null_counts: true,
            views_to_offsets: true,
            lists_to_list32: true,
            widen_small_decimals: false,
            signed_dictionary_indices: true,
            refuse_outside_libcudf: true,
        }
    }

    /// The options with [`ExportOptions::widen_small_decimals`] set to `widen` (for
    /// libcudf before 25.02: `ExportOptions::for_libcudf().widen_small_decimals(true)`).
    pub fn widen_small_decimals(mut self, widen: bool) -> Self {
        self.widen_small_decimals = widen;
        self
    }

    /// Whether these options rewrite the exported tree (anything beyond
    /// [`ExportOptions::normalize_root_offset`]).
    pub(crate) fn rewrites(&self) -> bool {
        self.exact_null_counts
            || self.views_to_offsets
            || self.lists_to_list32
            || self.widen_small_decimals
            || self.signed_dictionary_indices
            || self.refuse_outside_libcudf
    }

    /// The options with [`ExportOptions::normalize_root_offset`] set to `normalize`.
    pub fn normalize_root_offset(mut self, normalize: bool) -> Self {
        self.normalize_root_offset = normalize;
        self
    }

    /// The options with [`ExportOptions::exact_null_counts`] set to `v`.
    pub fn exact_null_counts(mut self, v: bool) -> Self {
        self.exact_null_counts = v;
        self
    }

    /// The options with [`ExportOptions::views_to_offsets`] set to `v`.
    pub fn views_to_offsets(mut self, v: bool) -> Self {
        self.views_to_offsets = v;
        self
    }

    /// The options with [`ExportOptions::lists_to_list32`] set to `v`.
    pub fn lists_to_list32(mut self, v: bool) -> Self {
        self.lists_to_list32 = v;
        self
    }

    /// The options with [`ExportOptions::signed_dictionary_indices`] set to `v`.
    pub fn signed_dictionary_indices(mut self, v: bool) -> Self {
        self.signed_dictionary_indices = v;
        self
    }

    /// The options with [`ExportOptions::refuse_outside_libcudf`] set to `v`.
    pub fn refuse_outside_libcudf(mut self, v: bool) -> Self {
        self.refuse_outside_libcudf = v;
        self
    }
}

/// Options of [`DeviceBatch::import_with_options`](crate::DeviceBatch::import_with_options).
///
/// ```
/// use std::sync::Arc;
///
/// use arrow_array::{ArrayRef, Int32Array, RecordBatch};
/// use devarrow_abi::device::CpuDevice;
/// use devarrow_bridge::{DeviceBatch, ImportOptions, Transfer, TransferOptions};
///
/// # fn main() -> devarrow_abi::Result<()> {
/// let x: ArrayRef = Arc::new(Int32Array::from(vec![1, 2, 3]));
/// let batch = RecordBatch::try_from_iter([("x", x)])?;
/// let device = Arc::new(CpuDevice::new());
/// let mut transfer = Transfer::new(device.clone(), TransferOptions::default());
/// let (array, _ffi_schema) = transfer.to_device(&batch)?.export()?;
///
/// // The default refuses arrays of another device; this one is ours anyway.
/// let options = ImportOptions::default().copy_from_other_device(true);
/// let imported = DeviceBatch::import_with_options(device, array, batch.schema(), options)?;
/// assert_eq!(transfer.to_host(&imported)?, batch);
/// # Ok(())
/// # }
/// ```
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
