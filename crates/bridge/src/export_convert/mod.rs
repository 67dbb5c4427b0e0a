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
//!
//! The conversions are split by concern, one file each, as libcudf's options are:
//! `views.rs` (views to offsets), `lists.rs` (list views, large and fixed-size lists,
//! maps, and the gathers of list views' children), `decimals.rs` (wider decimals),
//! `dictionaries.rs` (signed indices), `null_counts.rs` (exact null counts) and
//! `refusals.rs` (what libcudf refuses: the [`Error::NotConvertible`] errors). This file
//! holds the walk ([`convert`], `Converter::array`, which sends each column to its
//! concern) and the helpers they share (device memory, kernels, readbacks). Each file is
//! what a new libcudf option extends without touching the others: a new option is an arm
//! of the walk and a method in its concern's file (or a new file beside them).

use std::ffi::c_void;
use std::sync::Arc;

use arrow_schema::{DataType, FieldRef, Fields, Schema};
use devarrow_abi::device::{Device, DeviceKernels, DeviceMemory, SyncEvent};
use devarrow_abi::export_tree::ArrayNode;
use devarrow_abi::{Error, Result};

use crate::export_options::ExportOptions;

mod decimals;
mod dictionaries;
mod lists;
mod null_counts;
mod refusals;
mod views;

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
        refusals::check_libcudf_root(&root)?;
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
                self.views_to_offsets(path, &data_type, &mut node)?
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
                self.dictionary(path, &data_type, key, value, &mut node)?
            }
            DataType::Decimal32(..) | DataType::Decimal64(..) if o.widen_small_decimals => {
                self.widen_decimal_column(path, &data_type, &mut node)?
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
}
