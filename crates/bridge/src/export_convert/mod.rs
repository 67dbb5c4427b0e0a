//! The conversions of [`ExportOptions`] that rewrite an exported tree **on the device**
//! (libcudf's dialect, `ExportOptions::for_libcudf`): views to offsets, list views and
//! other lists to `int32` lists, wider decimals, signed dictionary indices, exact null
//! counts, and the refusal of what libcudf refuses.
//!
//! The walk runs on the host over the schema and the [`ArrayNode`] tree; every byte it
//! rewrites is rewritten by the device's kernels ([`DeviceKernels`]) on the device's
//! stream, into new device memory. The host reads back only what it must know to size a
//! buffer or label a type: a string column's total bytes, a list's last offset, whether
//! list views are in order, and the unknown null counts. Those reads are planned for the
//! whole batch (`rounds.rs`): one round (one device-to-host copy, one host wait) per
//! level of nesting, whatever the number of columns, and one for all the null counts.
//! A batch that needs nothing is returned untouched: no kernel, no readback, no memory.
//!
//! The conversions are split by concern, one file each, as libcudf's options are:
//! `views.rs` (views to offsets), `lists.rs` (list views, large and fixed-size lists,
//! maps), `gather.rs` (the gathers of list views' children), `decimals.rs` (wider
//! decimals), `dictionaries.rs` (signed indices), `null_counts.rs` (exact null counts) and
//! `refusals.rs` (what libcudf refuses: the [`Error::NotConvertible`] errors). This file
//! holds the walk ([`convert`], `Converter::array`, which sends each column to its
//! concern) and the helpers they share (device memory, kernels); `rounds.rs` the steps a
//! conversion waits in and the read-backs of a round. Each file is
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
mod gather;
mod lists;
mod null_counts;
mod refusals;
mod rounds;
mod views;

use rounds::{all, Read, Step};

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
        host: Vec::new(),
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
    let walked = all(
        &mut converter,
        schema.fields().iter().zip(children),
        |converter, (field, child)| converter.array(field.name(), field, child),
    )
    .and_then(|step| converter.finish(step));
    let converted = match walked {
        Ok(converted) => converted,
        Err(e) => {
            if converter.ran {
                // Copies from the host memory the walk holds may still be running.
                let _ = device.synchronize();
            }
            return Err(e);
        }
    };
    let mut fields = Vec::with_capacity(converted.len());
    let mut changed = false;
    for (field, (new_field, child)) in schema.fields().iter().zip(converted) {
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
    /// Host bytes copied to the device, kept until the walk has waited for the copies
    /// (every copy is followed by a round's wait; an error synchronizes the device).
    host: Vec<Box<[u8]>>,
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
    /// (one round: one copy, one wait).
    fn read_i64s(&mut self, addresses: &[*const c_void]) -> Result<Vec<i64>> {
        let reads: Vec<Read> = addresses.iter().map(|&a| Read::i64(a)).collect();
        self.read_round(&reads)
    }

    /// Enqueues a copy of `bytes` (host memory the walk keeps, see `Converter::host`) to
    /// the device address `dst`.
    ///
    /// # Safety
    /// `dst` must be device memory writable for `bytes.len()` bytes.
    unsafe fn copy_bytes_to_device(&mut self, bytes: Vec<u8>, dst: *mut c_void) -> Result<()> {
        let bytes = bytes.into_boxed_slice();
        // SAFETY: `dst` is the caller's guarantee; the bytes are kept (their heap memory
        // does not move) until the walk has waited for the copy.
        unsafe {
            self.device
                .copy_to_device(bytes.as_ptr(), dst, bytes.len())?
        };
        self.host.push(bytes);
        Ok(())
    }

    /// Converts one array (and its children) of `field`: its new field and node once its
    /// rounds are done.
    fn array(
        &mut self,
        path: &str,
        field: &FieldRef,
        mut node: ArrayNode,
    ) -> Result<Step<'a, (FieldRef, ArrayNode)>> {
        let o = self.options;
        let data_type = field.data_type().clone();
        let converted: Step<'a, (DataType, ArrayNode)> = match &data_type {
            DataType::Utf8View | DataType::BinaryView if o.views_to_offsets => {
                self.views_to_offsets(path, &data_type, node)?
            }
            DataType::ListView(child) | DataType::LargeListView(child) if o.lists_to_list32 => {
                let large = matches!(data_type, DataType::LargeListView(_));
                self.list_views(path, &data_type, child, large, node)?
                    .map(|(child, node)| (DataType::List(child), node))
            }
            DataType::LargeList(child) if o.lists_to_list32 => {
                let (path, child) = (path.to_string(), child.clone());
                self.large_list(&path, &data_type, node)?.and_then(
                    self,
                    move |converter, node| {
                        Ok(converter
                            .only_child(&path, &child, node)?
                            .map(|(child, node)| (DataType::List(child), node)))
                    },
                )?
            }
            DataType::FixedSizeList(child, size) if o.lists_to_list32 => {
                self.fixed_size_list(path, &data_type, *size, &mut node)?;
                self.only_child(path, child, node)?
                    .map(|(child, node)| (DataType::List(child), node))
            }
            DataType::Map(entries, _) if o.lists_to_list32 => self
                .only_child(path, entries, node)?
                .map(|(child, node)| (DataType::List(child), node)),
            DataType::List(child) => self
                .only_child(path, child, node)?
                .map(|(child, node)| (DataType::List(child), node)),
            DataType::LargeList(child) => self
                .only_child(path, child, node)?
                .map(|(child, node)| (DataType::LargeList(child), node)),
            DataType::FixedSizeList(child, size) => {
                let size = *size;
                self.only_child(path, child, node)?
                    .map(move |(child, node)| (DataType::FixedSizeList(child, size), node))
            }
            DataType::Map(entries, sorted) => {
                let sorted = *sorted;
                self.only_child(path, entries, node)?
                    .map(move |(child, node)| (DataType::Map(child, sorted), node))
            }
            DataType::ListView(child) => self
                .only_child(path, child, node)?
                .map(|(child, node)| (DataType::ListView(child), node)),
            DataType::LargeListView(child) => self
                .only_child(path, child, node)?
                .map(|(child, node)| (DataType::LargeListView(child), node)),
            DataType::Struct(fields) => {
                let children = std::mem::take(&mut node.children);
                all(self, fields.iter().zip(children), |converter, (f, c)| {
                    converter.array(&format!("{path}.{}", f.name()), f, c)
                })?
                .map(move |converted| {
                    let (new_fields, children): (Vec<FieldRef>, Vec<ArrayNode>) =
                        converted.into_iter().unzip();
                    node.children = children;
                    (DataType::Struct(Fields::from(new_fields)), node)
                })
            }
            DataType::Dictionary(key, value) => {
                self.dictionary(path, &data_type, key, value, node)?
            }
            DataType::Decimal32(..) | DataType::Decimal64(..) if o.widen_small_decimals => {
                let new_type = self.widen_decimal_column(path, &data_type, &mut node)?;
                Step::Done((new_type, node))
            }
            other => Step::Done((other.clone(), node)),
        };
        let (path, field) = (path.to_string(), field.clone());
        converted.and_then(self, move |converter, (new_type, mut node)| {
            if o.refuse_outside_libcudf {
                converter.check_libcudf_type(&path, &new_type, &node)?;
            }
            if o.exact_null_counts {
                converter.schedule_null_count(&new_type, &mut node);
            }
            let field = if &new_type == field.data_type() {
                field // unchanged: no new field (a batch that needs nothing stays free)
            } else {
                Arc::new(field.as_ref().clone().with_data_type(new_type))
            };
            Ok(Step::Done((field, node)))
        })
    }

    /// Converts the only child of a list-like node: the child's new field and the node
    /// holding the converted child.
    fn only_child(
        &mut self,
        path: &str,
        child: &FieldRef,
        mut node: ArrayNode,
    ) -> Result<Step<'a, (FieldRef, ArrayNode)>> {
        let Some(c) = node.children.pop() else {
            return Err(Error::InvalidArgument(format!(
                "{path}: a list array without its child"
            )));
        };
        Ok(self
            .array(&format!("{path}.{}", child.name()), child, c)?
            .map(move |(child, c)| {
                node.children.push(c);
                (child, node)
            }))
    }
}
