//! The conversions of [`ExportOptions`] that rewrite an exported tree **on the device**
//! (libcudf's dialect, `ExportOptions::for_libcudf`): views to offsets, list views and
//! other lists to `int32` lists, wider decimals, signed dictionary indices, exact null
//! counts, and the refusal of what libcudf refuses.
//!
//! The walk runs on the host over the schema and the [`ArrayNode`] tree; every byte it
//! rewrites is rewritten by the device's kernels ([`DeviceKernels`]) on the device's
//! stream, into new device memory. The host reads back only what it must know to size a
//! buffer or label a type: a string column's total bytes, a list's last offset, whether
//! list views are in order, and the unknown null counts (one readback for all of them).
//! A batch that needs nothing is returned untouched: no kernel, no readback, no memory.

use std::ffi::c_void;
use std::sync::Arc;

use arrow_schema::{DataType, Field, FieldRef, Fields, Schema};
use devarrow_abi::device::{Device, DeviceKernels, DeviceMemory, RowIntegers, SyncEvent, Validity};
use devarrow_abi::export_tree::ArrayNode;
use devarrow_abi::{Error, Result};

use crate::export_options::ExportOptions;

const DIALECT: &str = "libcudf";

/// A tree after the conversions.
pub(crate) struct Converted {
    /// The exported tree.
    pub root: ArrayNode,
    /// Its schema, `None` when no type changed.
    pub schema: Option<Schema>,
    /// The device memory the conversions wrote (kept alive with the export).
    pub memory: Vec<Arc<dyn DeviceMemory>>,
    /// Recorded after the conversions' kernels (the export's `sync_event`); `None` when
    /// no kernel ran.
    pub event: Option<Arc<dyn SyncEvent>>,
}

/// Applies `options`' conversions to the tree `root` of `schema` on `device` (the batch's
/// own, where its buffers can be read; its stream already ordered after the batch's
/// writes).
pub(crate) fn convert(
    device: &dyn Device,
    schema: &Schema,
    mut root: ArrayNode,
    options: &ExportOptions,
) -> Result<Converted> {
    if options.refuse_outside_libcudf {
        let root_has_nulls =
            root.buffers.first().is_some_and(|b| !b.is_null()) && root.null_count != 0;
        if root_has_nulls {
            return Err(Error::NotConvertible {
                path: "(root)".into(),
                data_type: "Struct".into(),
                dialect: DIALECT,
                reason: "a record batch whose root struct has nulls of its own: a cudf table \
                         has no row validity, and libcudf would drop it silently"
                    .into(),
            });
        }
        if root.length > i32::MAX as i64 {
            return Err(Error::NotConvertible {
                path: "(root)".into(),
                data_type: "Struct".into(),
                dialect: DIALECT,
                reason: format!(
                    "{} rows, more than cudf::size_type indexes (i32::MAX): export slices of \
                     the batch (zero-copy) instead",
                    root.length
                ),
            });
        }
    }
    let mut converter = Converter {
        device,
        options,
        memory: Vec::new(),
        ran: false,
        counts: Vec::new(),
    };
    let children = std::mem::take(&mut root.children);
    if children.len() != schema.fields().len() {
        return Err(Error::InvalidArgument(format!(
            "a batch of {} fields exported with {} columns",
            schema.fields().len(),
            children.len()
        )));
    }
    let mut fields = Vec::with_capacity(children.len());
    let mut changed = false;
    for (field, child) in schema.fields().iter().zip(children) {
        let (new_field, child) = converter.array(field.name(), field, child)?;
        changed |= !Arc::ptr_eq(field, &new_field);
        fields.push(new_field);
        root.children.push(child);
    }
    converter.resolve_null_counts(&mut root)?;
    let schema =
        changed.then(|| Schema::new_with_metadata(Fields::from(fields), schema.metadata().clone()));
    let event = if converter.ran {
        Some(device.record_event()?)
    } else {
        None
    };
    Ok(Converted {
        root,
        schema,
        memory: converter.memory,
        event,
    })
}

/// A device address `bytes` past `base` (never dereferenced here; wrapping, so that
/// the host never does pointer arithmetic it could not justify on device memory).
fn at(base: *const c_void, bytes: u64) -> *const c_void {
    base.cast::<u8>().wrapping_add(bytes as usize).cast()
}

/// As [`at`], writable.
fn at_mut(base: *mut c_void, bytes: u64) -> *mut c_void {
    base.cast::<u8>().wrapping_add(bytes as usize).cast()
}

/// The rows of list views whose child is gathered into list order.
struct Gather {
    /// The views' offsets (from the list's first row).
    view_offsets: RowIntegers,
    /// The rows.
    n: u64,
    /// The rows' new offsets (`n + 1` `int64`s, non-decreasing, null rows empty).
    new_offsets: *const c_void,
    /// The values gathered (the last new offset).
    total: u64,
}

/// `null_count` of a node whose count is pending: `-(2 + slot)`.
fn pending(slot: usize) -> i64 {
    -2 - slot as i64
}

struct Converter<'a> {
    device: &'a dyn Device,
    options: &'a ExportOptions,
    memory: Vec<Arc<dyn DeviceMemory>>,
    /// Whether a kernel or a copy was enqueued.
    ran: bool,
    /// Null counts to compute: (bitmap, bit offset, length) per pending slot.
    counts: Vec<(*const c_void, u64, u64)>,
}

impl<'a> Converter<'a> {
    fn kernels(&mut self, path: &str, data_type: &DataType) -> Result<&'a dyn DeviceKernels> {
        self.ran = true;
        self.device.kernels().ok_or_else(|| Error::NotConvertible {
            path: path.into(),
            data_type: data_type.to_string(),
            dialect: DIALECT,
            reason: format!(
                "converting it needs device kernels, which this {} device does not have",
                self.device.device_type()
            ),
        })
    }

    /// New device memory of `len` bytes (at least 1), kept with the export.
    fn allocate(&mut self, len: u64) -> Result<*mut c_void> {
        let memory = self.device.allocate(len.max(1) as usize)?;
        let address = memory.address();
        self.memory.push(memory);
        Ok(address)
    }

    /// Reads the `int64`s at `addresses` back to the host, after the work enqueued so far
    /// (one wait for all of them).
    fn read_i64s(&mut self, addresses: &[*const c_void]) -> Result<Vec<i64>> {
        let mut values = vec![0i64; addresses.len()];
        for (value, &address) in values.iter_mut().zip(addresses) {
            // SAFETY: every address is device memory of 8 bytes written by this walk's
            // kernels (or the batch's own buffers, in range); `values` outlives the copy,
            // waited for below.
            unsafe {
                self.device
                    .copy_to_host(address, (value as *mut i64).cast::<u8>(), 8)?
            };
        }
        self.device.record_event()?.wait_host()?;
        Ok(values)
    }

    /// Reads one integer of `width` bytes (4: signed `int32`, 8: `int64`) at `address`.
    fn read_int(&mut self, address: *const c_void, width: u64) -> Result<i64> {
        let mut bytes = [0u8; 8];
        // SAFETY: `address` holds `width` bytes of the batch's buffers (the caller's
        // range); `bytes` outlives the copy, waited for below.
        unsafe {
            self.device
                .copy_to_host(address, bytes.as_mut_ptr(), width as usize)?
        };
        self.device.record_event()?.wait_host()?;
        Ok(if width == 4 {
            i32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]) as i64
        } else {
            i64::from_le_bytes(bytes)
        })
    }

    fn refuse(&self, path: &str, data_type: &DataType, reason: impl Into<String>) -> Error {
        Error::NotConvertible {
            path: path.into(),
            data_type: data_type.to_string(),
            dialect: DIALECT,
            reason: reason.into(),
        }
    }

    /// Converts one array (and its children) of `field`.
    fn array(
        &mut self,
        path: &str,
        field: &FieldRef,
        mut node: ArrayNode,
    ) -> Result<(FieldRef, ArrayNode)> {
        let o = self.options;
        let data_type = field.data_type().clone();
        let new_type = match &data_type {
            DataType::Utf8View | DataType::BinaryView if o.views_to_offsets => {
                let large = self.views(path, &data_type, &mut node)?;
                match (&data_type, large) {
                    (DataType::Utf8View, false) => DataType::Utf8,
                    (DataType::Utf8View, true) => DataType::LargeUtf8,
                    (_, false) => DataType::Binary,
                    (_, true) => DataType::LargeBinary,
                }
            }
            DataType::ListView(child) | DataType::LargeListView(child) if o.lists_to_list32 => {
                let large = matches!(data_type, DataType::LargeListView(_));
                let child = self.list_views(path, &data_type, child, large, &mut node)?;
                DataType::List(child)
            }
            DataType::LargeList(child) if o.lists_to_list32 => {
                self.large_list(path, &data_type, &mut node)?;
                DataType::List(self.only_child(path, child, &mut node)?)
            }
            DataType::FixedSizeList(child, size) if o.lists_to_list32 => {
                self.fixed_size_list(path, &data_type, *size, &mut node)?;
                DataType::List(self.only_child(path, child, &mut node)?)
            }
            DataType::Map(entries, _) if o.lists_to_list32 => {
                DataType::List(self.only_child(path, entries, &mut node)?)
            }
            DataType::List(child) => DataType::List(self.only_child(path, child, &mut node)?),
            DataType::LargeList(child) => {
                DataType::LargeList(self.only_child(path, child, &mut node)?)
            }
            DataType::FixedSizeList(child, size) => {
                DataType::FixedSizeList(self.only_child(path, child, &mut node)?, *size)
            }
            DataType::Map(entries, sorted) => {
                DataType::Map(self.only_child(path, entries, &mut node)?, *sorted)
            }
            DataType::ListView(child) => {
                DataType::ListView(self.only_child(path, child, &mut node)?)
            }
            DataType::LargeListView(child) => {
                DataType::LargeListView(self.only_child(path, child, &mut node)?)
            }
            DataType::Struct(fields) => {
                let children = std::mem::take(&mut node.children);
                let mut new_fields = Vec::with_capacity(fields.len());
                for (f, c) in fields.iter().zip(children) {
                    let (f, c) = self.array(&format!("{path}.{}", f.name()), f, c)?;
                    new_fields.push(f);
                    node.children.push(c);
                }
                DataType::Struct(Fields::from(new_fields))
            }
            DataType::Dictionary(key, value) => {
                let key = self.dictionary_key(path, &data_type, key, &node)?;
                let value_field: FieldRef =
                    Arc::new(Field::new("values", value.as_ref().clone(), true));
                let dictionary = node.dictionary.take().ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "{path}: a dictionary array without its dictionary"
                    ))
                })?;
                let (value_field, dictionary) =
                    self.array(&format!("{path}.values"), &value_field, *dictionary)?;
                node.dictionary = Some(Box::new(dictionary));
                DataType::Dictionary(Box::new(key), Box::new(value_field.data_type().clone()))
            }
            DataType::Decimal32(p, s) | DataType::Decimal64(p, s) if o.widen_small_decimals => {
                let width = if matches!(data_type, DataType::Decimal32(..)) {
                    4
                } else {
                    8
                };
                self.widen_decimals(path, &data_type, width, &mut node)?;
                DataType::Decimal128(*p, *s)
            }
            other => other.clone(),
        };
        if o.refuse_outside_libcudf {
            self.check_libcudf_type(path, &new_type, &node)?;
        }
        if o.exact_null_counts {
            self.schedule_null_count(&new_type, &mut node);
        }
        let field = if &new_type == field.data_type() {
            field.clone() // unchanged: no new field (a batch that needs nothing stays free)
        } else {
            Arc::new(field.as_ref().clone().with_data_type(new_type))
        };
        Ok((field, node))
    }

    /// Converts the only child of a list-like node.
    fn only_child(
        &mut self,
        path: &str,
        child: &FieldRef,
        node: &mut ArrayNode,
    ) -> Result<FieldRef> {
        let Some(c) = node.children.pop() else {
            return Err(Error::InvalidArgument(format!(
                "{path}: a list array without its child"
            )));
        };
        let (child, c) = self.array(&format!("{path}.{}", child.name()), child, c)?;
        node.children.push(c);
        Ok(child)
    }

    /// `Utf8View` / `BinaryView` to offsets and one data buffer; whether the offsets are
    /// `int64` (the bytes reach 2^31).
    fn views(&mut self, path: &str, data_type: &DataType, node: &mut ArrayNode) -> Result<bool> {
        let (n, offset) = (node.length as u64, node.offset as u64);
        let rows = offset + n;
        if node.buffers.len() < 3 {
            return Err(Error::InvalidArgument(format!(
                "{path}: a view array with {} buffers",
                node.buffers.len()
            )));
        }
        let validity = Validity::new(node.buffers[0], offset);
        let views = at(node.buffers[1], 16 * offset);
        let variadic: Vec<u64> = node.buffers[2..node.buffers.len() - 1]
            .iter()
            .map(|&b| b as u64)
            .collect();
        let table = if variadic.is_empty() {
            std::ptr::null_mut()
        } else {
            let table = self.allocate(8 * variadic.len() as u64)?;
            // SAFETY: `table` holds the 8 bytes per address just allocated; `variadic`
            // outlives the copy (the readback below waits for it).
            unsafe {
                self.device
                    .copy_to_device(variadic.as_ptr().cast(), table, 8 * variadic.len())?
            };
            table
        };
        let offsets = self.allocate(8 * (rows + 1))?;
        let kernels = self.kernels(path, data_type)?;
        // `offsets` holds rows + 1 int64s; the first `offset` are zeroed (2 int32s
        // each), then rows offset.. get the sizes of the n views (16 bytes each from
        // the array's offset, in the batch's buffer, as is the validity), and the scan
        // runs over all of them.
        // SAFETY: the ranges just described, for every call of the block.
        unsafe {
            kernels.fill_offsets_i32(offsets, 2 * offset, 0)?;
            kernels.row_sizes(
                RowIntegers {
                    address: views,
                    stride: 16,
                    wide: false,
                },
                validity,
                n,
                at_mut(offsets, 8 * offset),
            )?;
            kernels.inclusive_scan_i64(offsets, rows + 1)?;
        }
        let total = self.read_i64s(&[at(offsets, 8 * rows)])?[0];
        drop(variadic); // copied: the readback waited
        let total = u64::try_from(total).map_err(|_| {
            self.refuse(
                path,
                data_type,
                format!("its views add up to {total} bytes"),
            )
        })?;
        let data = self.allocate(total)?;
        let large = total > i32::MAX as u64;
        let kernels = self.kernels(path, data_type)?;
        // SAFETY: the views and validity as above; `table` holds the variadic buffers'
        // addresses (the views' buffer indices were checked at import or written by
        // devarrow's own upload); `offsets` the scan; `data` its `total` bytes.
        unsafe {
            kernels.gather_view_bytes(views, validity, n, table, at(offsets, 8 * offset), data)?
        };
        let offsets = if large {
            offsets
        } else {
            let narrow = self.allocate(4 * (rows + 1))?;
            let kernels = self.kernels(path, data_type)?;
            // SAFETY: rows + 1 int64s to as many int32s, each fitting (at most `total`).
            unsafe { kernels.narrow_i64_to_i32(offsets, rows + 1, narrow)? };
            narrow
        };
        node.buffers = vec![node.buffers[0], offsets, data];
        node.children.clear();
        Ok(large)
    }

    /// List views (`int32` or `int64` offsets and sizes) to a list with `int32` offsets,
    /// gathering the child when the views are not in order; the new child field.
    fn list_views(
        &mut self,
        path: &str,
        data_type: &DataType,
        child_field: &FieldRef,
        large: bool,
        node: &mut ArrayNode,
    ) -> Result<FieldRef> {
        let width = if large { 8 } else { 4 };
        let (n, offset) = (node.length as u64, node.offset as u64);
        let rows = offset + n;
        if node.buffers.len() != 3 || node.children.len() != 1 {
            return Err(Error::InvalidArgument(format!(
                "{path}: a malformed list view array"
            )));
        }
        let validity = Validity::new(node.buffers[0], offset);
        let view_offsets = RowIntegers {
            address: at(node.buffers[1], width * offset),
            stride: width,
            wide: large,
        };
        let sizes = RowIntegers {
            address: at(node.buffers[2], width * offset),
            stride: width,
            wide: large,
        };
        // The first row's offset: the list's offsets start there, so that views already
        // in order keep their child as it is.
        let base = if n == 0 {
            0
        } else {
            self.read_int(view_offsets.address, width)?.max(0)
        };
        let offsets = self.allocate(8 * (rows + 1))?;
        let mismatch = self.allocate(8)?; // read back as an int64 below
        let base_bytes = base.to_le_bytes();
        let kernels = self.kernels(path, data_type)?;
        // `offsets` holds rows + 1 int64s (the first `offset` zeroed, then the sizes of
        // the n rows, their first slot overwritten with `base`, in order on the
        // stream), `mismatch` 8 bytes (zeroed); the sizes, offsets and validity are the
        // batch's buffers from the array's offset; `base_bytes` outlives the copy (the
        // readback below waits).
        // SAFETY: the ranges just described, for every call of the block.
        unsafe {
            kernels.fill_offsets_i32(offsets, 2 * offset, 0)?;
            kernels.fill_offsets_i32(mismatch, 2, 0)?;
            kernels.row_sizes(sizes, validity, n, at_mut(offsets, 8 * offset))?;
            self.device
                .copy_to_device(base_bytes.as_ptr(), at_mut(offsets, 8 * offset), 8)?;
            kernels.inclusive_scan_i64(offsets, rows + 1)?;
            kernels.compare_list_offsets(view_offsets, n, at(offsets, 8 * offset), mismatch)?;
        }
        let [last, differs] = self.read_i64s(&[at(offsets, 8 * rows), mismatch])?[..] else {
            unreachable!("two values read")
        };
        let differs = differs & 0xffff_ffff != 0;
        if last > i32::MAX as i64 {
            return Err(self.refuse(
                path,
                data_type,
                format!("its lists reach child index {last}, past int32 offsets: export slices of the batch"),
            ));
        }
        let child = node.children.pop().expect("one child");
        let child_path = format!("{path}.{}", child_field.name());
        let list_offsets = self.allocate(4 * (rows + 1))?;
        let (child_field, child) = if !differs {
            let kernels = self.kernels(path, data_type)?;
            // SAFETY: rows + 1 int64s, each at most `last`, to as many int32s.
            unsafe { kernels.narrow_i64_to_i32(offsets, rows + 1, list_offsets)? };
            self.array(&child_path, child_field, child)?
        } else {
            // Out of order: gather the child's values into list order, from offset 0.
            let kernels = self.kernels(path, data_type)?;
            // SAFETY: as above; the sizes are scanned again from 0 over the same slots.
            unsafe {
                kernels.fill_offsets_i32(offsets, 2 * (offset + 1), 0)?;
                kernels.row_sizes(sizes, validity, n, at_mut(offsets, 8 * offset))?;
                kernels.inclusive_scan_i64(offsets, rows + 1)?;
                kernels.narrow_i64_to_i32(offsets, rows + 1, list_offsets)?;
            }
            let total = self.read_i64s(&[at(offsets, 8 * rows)])?[0].max(0) as u64;
            let rows_gathered = Gather {
                view_offsets,
                n,
                new_offsets: at(offsets, 8 * offset),
                total,
            };
            let gathered = self.gather(
                &child_path,
                child_field.data_type(),
                child,
                0,
                &rows_gathered,
            )?;
            // then converted as any child (a gathered view child becomes offsets, say)
            self.array(&child_path, child_field, gathered)?
        };
        node.buffers = vec![node.buffers[0], list_offsets];
        node.children = vec![child];
        Ok(child_field)
    }

    /// A child of list views put in list order: the values the views of `rows` reach,
    /// one after another (`rows.total` of them, offset 0), for fixed-width, boolean,
    /// string and binary (offsets or views) children and structs of them; their validity
    /// gathered too. `extra` is added to every child index (a struct's offset, for its
    /// fields). Other children are [`Error::NotConvertible`].
    fn gather(
        &mut self,
        path: &str,
        data_type: &DataType,
        mut child: ArrayNode,
        extra: u64,
        rows: &Gather,
    ) -> Result<ArrayNode> {
        let base = extra + child.offset as u64;
        let total = rows.total;
        let words = total.div_ceil(32);
        let cannot = |what: &str| Error::NotConvertible {
            path: path.into(),
            data_type: data_type.to_string(),
            dialect: DIALECT,
            reason: format!(
                "the list views over it are not in order, and {what} (fixed-width, boolean, \
                 string and binary children, and structs of them, are gathered)"
            ),
        };
        let has_validity = !matches!(
            data_type,
            DataType::Null | DataType::Union(..) | DataType::RunEndEncoded(..)
        );
        let validity = match child.buffers.first() {
            Some(&bits) if has_validity && !bits.is_null() => {
                let out = self.allocate(4 * words)?;
                let kernels = self.kernels(path, data_type)?;
                // SAFETY: the child's bitmap covers every index the valid views reach
                // (checked at import, or written by devarrow's upload); `out` holds
                // `words` words.
                unsafe {
                    kernels.gather_list_bits(
                        bits,
                        base,
                        rows.view_offsets,
                        rows.n,
                        rows.new_offsets,
                        out,
                    )?
                };
                out.cast_const()
            }
            _ => std::ptr::null(),
        };
        let value_width = match data_type {
            DataType::Boolean => Some(0),
            DataType::Utf8View | DataType::BinaryView => Some(16),
            dt if dt.is_primitive() => dt.primitive_width().map(|w| w as u64),
            DataType::FixedSizeBinary(w) => Some(*w as u64),
            _ => None,
        };
        let buffers = match (data_type, value_width) {
            (DataType::Struct(fields), _) => {
                let children = std::mem::take(&mut child.children);
                for (field, c) in fields.iter().zip(children) {
                    let c = self.gather(
                        &format!("{path}.{}", field.name()),
                        field.data_type(),
                        c,
                        base,
                        rows,
                    )?;
                    child.children.push(c);
                }
                vec![validity]
            }
            (_, Some(0)) => {
                let out = self.allocate(4 * words)?;
                let kernels = self.kernels(path, data_type)?;
                // SAFETY: as for the validity, the values' bits.
                unsafe {
                    kernels.gather_list_bits(
                        child.buffers[1],
                        base,
                        rows.view_offsets,
                        rows.n,
                        rows.new_offsets,
                        out,
                    )?
                };
                vec![validity, out]
            }
            (_, Some(width)) => {
                let out = self.allocate(width * total)?;
                let kernels = self.kernels(path, data_type)?;
                // SAFETY: the child's values cover every index the valid views reach;
                // `out` holds `total` values.
                unsafe {
                    kernels.gather_list_values(
                        child.buffers[1],
                        width,
                        base,
                        rows.view_offsets,
                        rows.n,
                        rows.new_offsets,
                        out,
                    )?
                };
                // views keep their variadic buffers (and their sizes) as they are
                let mut buffers = vec![validity, out];
                buffers.extend_from_slice(&child.buffers[2..]);
                buffers
            }
            (
                DataType::Utf8 | DataType::Binary | DataType::LargeUtf8 | DataType::LargeBinary,
                _,
            ) => {
                let (data, offsets) =
                    self.gather_strings(path, data_type, &child, base, rows, validity)?;
                vec![validity, offsets, data]
            }
            _ => {
                return Err(cannot(&format!(
                    "gathering a {data_type} on the device is not supported"
                )))
            }
        };
        child.buffers = buffers;
        child.length = total as i64;
        child.offset = 0;
        child.null_count = if validity.is_null() { 0 } else { -1 };
        Ok(child)
    }

    /// The strings (or binaries) of a child with offsets at the indices list views reach,
    /// in list order: their views (`DeviceKernels::offsets_to_views` over an index map,
    /// itself a gather of `0, 1, 2, ...`), then the bytes gathered as a view column's are.
    /// Gives the new data and offsets (`int32` for `Utf8`/`Binary`, `int64` for the large
    /// types).
    fn gather_strings(
        &mut self,
        path: &str,
        data_type: &DataType,
        child: &ArrayNode,
        base: u64,
        rows: &Gather,
        validity: *const c_void,
    ) -> Result<(*mut c_void, *mut c_void)> {
        let large = matches!(data_type, DataType::LargeUtf8 | DataType::LargeBinary);
        let width = if large { 8 } else { 4 };
        // the physical indices of the child's values: every index gathered is below it
        let reach = child.offset as u64 + child.length as u64;
        let end = self.read_int(at(child.buffers[1], width * reach), width)?;
        if reach > i32::MAX as u64 || end > u32::MAX as i64 {
            return Err(self.refuse(
                path,
                data_type,
                "the list views over it are not in order, and it is too large to gather \
                 (2^31 values or 4 GiB): export slices of the batch",
            ));
        }
        let total = rows.total;
        let iota = self.allocate(4 * reach)?;
        let indices = self.allocate(4 * total)?;
        let views = self.allocate(16 * total)?;
        let offsets = self.allocate(8 * (total + 1))?;
        let table = self.allocate(8)?;
        let data_address = (child.buffers[2] as u64).to_le_bytes();
        let kernels = self.kernels(path, data_type)?;
        // `iota` holds `reach` int32s, `indices` one per gathered value, `views` 16
        // bytes each, `offsets` total + 1 int64s, `table` the data's address (copied
        // from `data_address`, alive until the readback below waits); the child's
        // offsets cover every index below `reach` and its data their bytes.
        // SAFETY: the ranges just described, for every call of the block.
        unsafe {
            kernels.fill_offsets_i32(iota, reach, 1)?;
            kernels.gather_list_values(
                iota,
                4,
                base,
                rows.view_offsets,
                rows.n,
                rows.new_offsets,
                indices,
            )?;
            let child_offsets = RowIntegers {
                address: child.buffers[1],
                stride: width,
                wide: large,
            };
            kernels.offsets_to_views(child_offsets, child.buffers[2], indices, total, views)?;
            let sizes = RowIntegers {
                address: views,
                stride: 16,
                wide: false,
            };
            kernels.row_sizes(sizes, Validity::new(validity, 0), total, offsets)?;
            kernels.inclusive_scan_i64(offsets, total + 1)?;
            self.device
                .copy_to_device(data_address.as_ptr(), table, 8)?;
        }
        let bytes = self.read_i64s(&[at(offsets, 8 * total)])?[0].max(0) as u64;
        if !large && bytes > i32::MAX as u64 {
            return Err(self.refuse(
                path,
                data_type,
                "gathered, its values pass int32 offsets: export slices of the batch",
            ));
        }
        let data = self.allocate(bytes)?;
        let kernels = self.kernels(path, data_type)?;
        // SAFETY: the views made above (one variadic buffer, the child's data, its address
        // in `table`), `offsets` their scan, `data` its `bytes`.
        unsafe {
            kernels.gather_view_bytes(
                views,
                Validity::new(validity, 0),
                total,
                table,
                offsets,
                data,
            )?
        };
        if large {
            return Ok((data, offsets));
        }
        let narrow = self.allocate(4 * (total + 1))?;
        // SAFETY: total + 1 int64s, each at most `bytes` (which fits), to as many int32s.
        unsafe { kernels.narrow_i64_to_i32(offsets, total + 1, narrow)? };
        Ok((data, narrow))
    }

    /// `LargeList` offsets narrowed to `int32`.
    fn large_list(&mut self, path: &str, data_type: &DataType, node: &mut ArrayNode) -> Result<()> {
        let rows = node.offset as u64 + node.length as u64;
        if node.buffers.len() != 2 {
            return Err(Error::InvalidArgument(format!(
                "{path}: a malformed large list array"
            )));
        }
        let last = self.read_int(at(node.buffers[1], 8 * rows), 8)?;
        if !(0..=i32::MAX as i64).contains(&last) {
            return Err(self.refuse(
                path,
                data_type,
                format!(
                    "its last offset {last} does not fit int32 offsets: export slices of the batch"
                ),
            ));
        }
        let narrow = self.allocate(4 * (rows + 1))?;
        let kernels = self.kernels(path, data_type)?;
        // SAFETY: the batch's rows + 1 int64 offsets (every one at most the last, which
        // fits) to as many int32s in new memory.
        unsafe { kernels.narrow_i64_to_i32(node.buffers[1], rows + 1, narrow)? };
        node.buffers[1] = narrow;
        Ok(())
    }

    /// `FixedSizeList(size)` gets offsets `i × size`.
    fn fixed_size_list(
        &mut self,
        path: &str,
        data_type: &DataType,
        size: i32,
        node: &mut ArrayNode,
    ) -> Result<()> {
        let rows = node.offset as u64 + node.length as u64;
        if rows.saturating_mul(size.max(0) as u64) > i32::MAX as u64 {
            return Err(self.refuse(
                path,
                data_type,
                "its values reach past int32 offsets: export slices of the batch",
            ));
        }
        let offsets = self.allocate(4 * (rows + 1))?;
        let kernels = self.kernels(path, data_type)?;
        // SAFETY: rows + 1 int32s of new memory.
        unsafe { kernels.fill_offsets_i32(offsets, rows + 1, size as u32)? };
        node.buffers = vec![
            node.buffers.first().copied().unwrap_or(std::ptr::null()),
            offsets,
        ];
        Ok(())
    }

    /// `Decimal32`/`Decimal64` values widened to 16 bytes.
    fn widen_decimals(
        &mut self,
        path: &str,
        data_type: &DataType,
        width: u64,
        node: &mut ArrayNode,
    ) -> Result<()> {
        let rows = node.offset as u64 + node.length as u64;
        if node.buffers.len() != 2 {
            return Err(Error::InvalidArgument(format!(
                "{path}: a malformed decimal array"
            )));
        }
        let wide = self.allocate(16 * rows)?;
        let kernels = self.kernels(path, data_type)?;
        // SAFETY: the batch's `rows` values of `width` bytes to as many 16-byte ones.
        unsafe { kernels.widen_decimals(node.buffers[1], width, rows, wide)? };
        node.buffers[1] = wide;
        Ok(())
    }

    /// The index type of a dictionary: unsigned relabelled as signed when every index of
    /// the dictionary stays non-negative.
    fn dictionary_key(
        &self,
        path: &str,
        data_type: &DataType,
        key: &DataType,
        node: &ArrayNode,
    ) -> Result<DataType> {
        if !self.options.signed_dictionary_indices {
            return Ok(key.clone());
        }
        let (signed, max) = match key {
            DataType::UInt8 => (DataType::Int8, i8::MAX as i64),
            DataType::UInt16 => (DataType::Int16, i16::MAX as i64),
            DataType::UInt32 => (DataType::Int32, i32::MAX as i64),
            DataType::UInt64 => (DataType::Int64, i64::MAX),
            other => return Ok(other.clone()),
        };
        let keys = node.dictionary.as_ref().map_or(0, |d| d.length);
        if keys - 1 > max {
            return Err(self.refuse(
                path,
                data_type,
                format!("{keys} dictionary values are too many for {signed} indices (libcudf refuses unsigned ones)"),
            ));
        }
        Ok(signed)
    }

    /// Refuses what libcudf's `from_arrow_device` refuses (docs/libcudf.md).
    fn check_libcudf_type(&self, path: &str, data_type: &DataType, node: &ArrayNode) -> Result<()> {
        use DataType::*;
        if node.length > i32::MAX as i64 {
            return Err(self.refuse(path, data_type, "more rows than cudf::size_type indexes"));
        }
        let reason = match data_type {
            Null | Boolean | Int8 | Int16 | Int32 | Int64 | UInt8 | UInt16 | UInt32 | UInt64
            | Float32 | Float64 | Decimal32(..) | Decimal64(..) | Decimal128(..) | Date32
            | Timestamp(..) | Duration(..) | Utf8 | LargeUtf8 | List(_) | Struct(_) => {
                return Ok(())
            }
            Dictionary(key, _) if key.is_signed_integer() => return Ok(()),
            Dictionary(..) => "unsigned dictionary indices (set signed_dictionary_indices)",
            Utf8View | BinaryView => "view types (set views_to_offsets)",
            ListView(_) | LargeListView(_) | LargeList(_) | FixedSizeList(..) | Map(..) => {
                "only int32 lists (set lists_to_list32)"
            }
            Binary | LargeBinary | FixedSizeBinary(_) => {
                "libcudf has no binary type: cast the column to Utf8 if its bytes are strings"
            }
            Float16 => "libcudf has no half-precision type: cast to Float32",
            Decimal256(..) => "libcudf has no 256-bit decimal: cast to Decimal128",
            Date64 => "libcudf refuses date64: cast to Timestamp(Millisecond)",
            Time32(_) | Time64(_) => "libcudf refuses time types: cast to Duration",
            Interval(_) => "libcudf has no interval type",
            Union(..) => "libcudf has no union type",
            RunEndEncoded(..) => "libcudf has no run-end encoding: decode it first",
        };
        Err(self.refuse(path, data_type, reason))
    }

    /// Marks a node with an unknown null count (and a validity bitmap) for counting; a
    /// node without a bitmap has none, a null array as many as its rows.
    fn schedule_null_count(&mut self, data_type: &DataType, node: &mut ArrayNode) {
        if node.null_count >= 0 {
            return;
        }
        match data_type {
            DataType::Null => node.null_count = node.length,
            DataType::Union(..) | DataType::RunEndEncoded(..) => {}
            _ => match node.buffers.first() {
                Some(bitmap) if !bitmap.is_null() => {
                    node.null_count = pending(self.counts.len());
                    self.counts
                        .push((*bitmap, node.offset as u64, node.length as u64));
                }
                _ => node.null_count = 0,
            },
        }
    }

    /// Counts the scheduled null counts (one readback) and writes them into the tree.
    fn resolve_null_counts(&mut self, root: &mut ArrayNode) -> Result<()> {
        if self.counts.is_empty() {
            return Ok(());
        }
        let out = self.allocate(8 * self.counts.len() as u64)?;
        let counts = std::mem::take(&mut self.counts);
        let kernels = self.kernels("(null counts)", &DataType::Null)?;
        for (slot, &(bitmap, bit_offset, len)) in counts.iter().enumerate() {
            // SAFETY: each bitmap covers its node's `offset + length` bits (the batch's
            // own buffers); `out` holds one u64 per slot.
            unsafe {
                kernels.count_set_bits(bitmap, bit_offset, len, at_mut(out, 8 * slot as u64))?
            };
        }
        let addresses: Vec<_> = (0..counts.len()).map(|s| at(out, 8 * s as u64)).collect();
        let set = self.read_i64s(&addresses)?;
        fn patch(node: &mut ArrayNode, counts: &[(*const c_void, u64, u64)], set: &[i64]) {
            if node.null_count <= -2 {
                let slot = (-2 - node.null_count) as usize;
                node.null_count = counts[slot].2 as i64 - set[slot];
            }
            for child in &mut node.children {
                patch(child, counts, set);
            }
            if let Some(d) = &mut node.dictionary {
                patch(d, counts, set);
            }
        }
        patch(root, &counts, &set);
        Ok(())
    }
}
