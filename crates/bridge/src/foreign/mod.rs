//! Importing a foreign `ArrowDeviceArray` zero-copy: the [`Foreign`] array that a
//! device-resident [`DeviceBatch`](crate::DeviceBatch) imported by
//! [`DeviceBatch::import`](crate::DeviceBatch::import) keeps its buffers in, and how its
//! bytes are packed on the device for a download. It knows nothing of the batch that
//! holds it.
//!
//! [`Foreign::import`] checks the array against the device (type and id) and against
//! the schema (a struct array whose children match the fields, buffer and child counts
//! per type: [`devarrow_abi::layout::validate_structure`]), makes the device's stream
//! wait on the array's `sync_event` (no host blocking), and keeps the array, unreleased,
//! for as long as the batch or an export of it lives.
//!
//! Some sizes live on the device, not in the structs: the offsets of variable-length
//! arrays (strings, binaries, lists, maps), the offsets and sizes of list views, the views
//! of view types and the sizes of their variadic buffers, the type ids and offsets of
//! dense unions, the run ends of run-end encoded arrays. What the batch's rows reach in
//! every array of the tree is found from them ([`reach`]): they are gathered on the device
//! into one small scratch buffer by one batched copy ([`Device::copy_on_device`]), read
//! back with one device-to-host copy and one event wait per round (a batch not sliced
//! below its columns takes one round; a slice, one more per level of nesting whose data
//! it cuts), and validated (negative or decreasing offsets, ranges past the end of a
//! child, views past their buffers, dense union offsets past their child, run ends that
//! do not increase, ... are [`Error::InvalidOffsets`]). Nothing on the device is read by
//! the host. A zero-length array whose offsets buffer is NULL (nanoarrow's CUDA copy of
//! a 0-row column) is empty: nothing of it is read or moved (see
//! [`devarrow_abi::layout`], "NULL offsets of empty arrays").
//!
//! The sizes of the whole download are planned at import too, with checked arithmetic:
//! offsets that address more than the address space holds (`[0, i64::MAX]` in two
//! columns) are an error, never a wrapped size.
//!
//! # What a slice moves
//!
//! Moving an imported batch to the host ([`crate::Transfer::to_host`]) first packs, on the
//! device and with one batched copy, the bytes its rows reach into one allocation, then
//! downloads that image like a batch made by [`crate::Transfer::to_device`]. A slice moves
//! only its bytes, however the producer cut it (its own `offset` and `length` at any level,
//! a root struct with an offset, children left whole under a sliced parent), as
//! devarrow's own slices do ([`crate::plan`]): fixed-width values, bitmaps (at byte
//! granularity), offsets, type ids and views cut to the items moved; the data buffer or
//! child of an array with offsets cut to what the moved offsets address, recursively (the
//! `utf8` child of a sliced `list<utf8>` to the strings its moved lists hold); a list
//! view's child to what its moved views address; each child of a dense union to the items
//! its moved items reach; the runs of a run-end encoded array to those covering its moved
//! items; the variadic buffers of a view type to the byte ranges its moved views reach,
//! packed one after another into one buffer (more only past 2 GiB: view offsets are 32
//! bits) whatever the number of foreign buffers, those no moved view points into costing
//! nothing, not even the read of their sizes (views in a builder's order reach one range
//! per buffer; filtered, taken or sorted ones many, and the stretches between them stay
//! behind), when the views are worth reading back (see [`reach`]), else whole; struct,
//! fixed-size list and sparse union children to their parent's items; dictionaries whole
//! (every slice shares them). What the device copy cannot cut (offsets, dense union
//! offsets, run ends that do not start at 0, and the buffers and offsets of the views
//! into packed ranges) is rebased on the host, after the download, as
//! [`crate::slicing`] says (the arithmetic the planner uses too).
//! [`DeviceBatch::device_bytes`](crate::DeviceBatch::device_bytes) counts the bytes moved.

use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use arrow_schema::{DataType, Schema, UnionMode};
use devarrow_abi::device::{
    check_same_device, check_stream_device, Device, DeviceCopy, DeviceMemory, SyncEvent,
    BUFFER_ALIGNMENT,
};
use devarrow_abi::export_tree::ArrayNode;
use devarrow_abi::layout::{
    self, buffer_roles, child_types, fixed_bit_width, has_end_offsets, offset_width, BufferRole,
};
use devarrow_abi::{ArrowArray, ArrowDeviceType, DeviceArray, Error, Result};

use crate::plan::{Node, Placement, ViewRange};
use crate::slicing;

mod reach;

impl Foreign {
    /// Imports a foreign struct array (a record batch) of `schema` living on `device`,
    /// zero-copy: the work of [`DeviceBatch::import`](crate::DeviceBatch::import), which
    /// documents the rules. Returns the array, kept unreleased until the result drops,
    /// and the event recorded on `device` after its stream waited on the array's
    /// `sync_event`. On error the array is released before this returns.
    pub(crate) fn import(
        device: &Arc<dyn Device>,
        array: DeviceArray,
        schema: &Schema,
    ) -> Result<(Foreign, Arc<dyn SyncEvent>)> {
        check_device(device.as_ref(), &array)?;
        let struct_type = DataType::Struct(schema.fields().clone());
        // SAFETY: the array of a DeviceArray is well-formed (contract of the unsafe
        // `DeviceArray::try_new`).
        unsafe { layout::validate_structure(array.array(), &struct_type, "array")? };
        let root_nulls = array.array().null_count;
        if root_nulls > 0 {
            return Err(Error::InvalidArgument(format!(
                "a record batch cannot have top-level nulls, but the struct array has \
                 {root_nulls}"
            )));
        }
        let mut reads = Reads::default();
        // SAFETY: well-formed (see above), and just validated against `struct_type`.
        let mut root = unsafe { walk(array.array(), &struct_type, &mut reads) }?;
        // A record batch has no top-level validity: never read it.
        root.null_count = 0;
        // SAFETY: `check_device` accepted the array's device type for this device, so a
        // non-NULL `sync_event` is an event of this device's kind; the producer keeps it
        // alive until release, which cannot run while we hold `array`.
        unsafe { device.wait_sync_event(array.sync_event())? };
        let event = device.record_event()?;
        // The sizes at the arrays' own bounds, and what the batch's rows reach in every
        // array of the tree: read back round by round (see `reach`).
        reach::resolve(device.as_ref(), &mut root, reads)?;
        // The sizes just read may address more than the address space holds (offsets
        // [0, i64::MAX] in two columns): plan the download now (kept for every download),
        // so such an array is an error here rather than when it is moved to the host.
        let mut image = Image::default();
        let packed = Arc::new(pack_node(&root, &mut image)?);
        let foreign = Foreign {
            array,
            root,
            packed,
            image,
            device: device.clone(),
            last_use: Mutex::new(None),
            view_uses: Mutex::new(Vec::new()),
            in_order_on: None,
        };
        Ok((foreign, event))
    }
}

/// Checks that `device` can use the buffers of `array` where they are.
fn check_device(device: &dyn Device, array: &DeviceArray) -> Result<()> {
    let (found, id) = (array.device_type(), array.device_id());
    let own = device.device_type();
    check_stream_device(device, found)?;
    // Device memory must be this very device's; host memory (the CPU's, pinned, managed)
    // is visible to it whatever the id.
    if found == own && own != ArrowDeviceType::CPU && id != device.device_id() {
        return Err(Error::DeviceMismatch {
            device_type: found,
            expected: device.device_id(),
            found: id,
        });
    }
    Ok(())
}

/// The foreign array behind an imported [`DeviceBatch`](crate::DeviceBatch): released
/// when dropped.
#[derive(Debug)]
pub(crate) struct Foreign {
    /// Dropped (released) after `Drop::drop` below has run.
    array: DeviceArray,
    root: ForeignNode,
    /// The tree of a download: where each buffer lies in the packed image.
    packed: Arc<Node>,
    /// The copies that pack the image, from the foreign buffers, and its size.
    image: Image,
    device: Arc<dyn Device>,
    /// The event after the last device work that read the foreign buffers (a pack for
    /// download), and the device that work ran on: waited for before the producer's
    /// release frees them.
    last_use: Mutex<Option<LastUse>>,
    /// The events after the work callers enqueued with views of the buffers (see
    /// `crate::column`), the last one per stream: waited for before the release too.
    view_uses: Mutex<Vec<ViewUse>>,
    /// `(context, stream)` handles of the device's stream when the producer wrote the
    /// buffers and frees them in order on that stream (an array of this process's own,
    /// `DeviceBatch::from_cuda_arrays`): work enqueued there (packs, views) needs no
    /// event, nor host wait, before the release.
    pub(crate) in_order_on: Option<(usize, usize)>,
}

/// The last use of a [`Foreign`] array's buffers through views on one stream of the
/// caller's: an event recorded there after that work.
#[derive(Debug)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct ViewUse {
    /// The stream, kept alive (so its handle `key` names no other stream meanwhile).
    pub(crate) _stream: Arc<dyn std::any::Any + Send + Sync>,
    /// The stream's context and handle: a later use on the same stream supersedes an
    /// earlier one.
    pub(crate) key: (usize, usize),
    /// Recorded on the stream after the work.
    pub(crate) event: Arc<dyn SyncEvent>,
}

/// A packed copy of the bytes a [`Foreign`] array addresses, made by [`Foreign::pack`]
/// for a download.
pub(crate) struct PackedCopy {
    /// The tree over the image: where each buffer lies in it.
    pub(crate) root: Arc<Node>,
    /// The image: one fresh allocation on the device.
    pub(crate) memory: Arc<dyn DeviceMemory>,
    /// The event after the copy that fills the image.
    pub(crate) event: Arc<dyn SyncEvent>,
}

/// The last device work that read the buffers of a [`Foreign`] array: its event, and the
/// device it was enqueued on (synchronized when the event cannot be waited for).
#[derive(Debug)]
struct LastUse {
    event: Arc<dyn SyncEvent>,
    device: Arc<dyn Device>,
}

impl LastUse {
    /// Waits for the work; when the event fails, synchronizes its device instead (and
    /// returns the event's error, the work being then done or the device unusable).
    fn wait(&self) -> Result<()> {
        self.event.wait_host().inspect_err(|_| {
            let _ = self.device.synchronize();
        })
    }
}

impl Drop for Foreign {
    fn drop(&mut self) {
        let last = self.last_use.get_mut().unwrap_or_else(|e| e.into_inner());
        if let Some(last) = last.take() {
            let _ = last.wait();
        }
        let views = self.view_uses.get_mut().unwrap_or_else(|e| e.into_inner());
        for view in views.drain(..) {
            // A failed wait means the context is unusable, and runs nothing more.
            let _ = view.event.wait_host();
        }
    }
}

/// What the bridge knows of one foreign array (a struct of the imported tree).
#[derive(Debug)]
pub(crate) struct ForeignNode {
    pub(crate) data_type: DataType,
    pub(crate) length: usize,
    pub(crate) offset: usize,
    pub(crate) null_count: i64,
    /// Every buffer address (0 for NULL), in C data interface order.
    pub(crate) buffers: Vec<usize>,
    pub(crate) children: Vec<ForeignNode>,
    pub(crate) dictionary: Option<Box<ForeignNode>>,
    /// Where this node's device-resident sizes were gathered in the scratch buffer of the
    /// first read-back.
    reads: Vec<usize>,
    /// Those sizes, once read back and validated.
    extent: Extent,
    /// The items of this array that the batch's rows reach, and what they reach in its
    /// buffers and children: what a download moves of it.
    cut: reach::Cut,
}

/// Device-resident sizes of a [`ForeignNode`] at its own bounds (its `offset` and
/// `length`, as exported), read back and validated at import.
#[derive(Debug, Default)]
enum Extent {
    /// Nothing on the device sizes this node's buffers.
    #[default]
    None,
    /// The first and last offsets of the array's range (strings, binaries, lists, maps):
    /// the data bytes or child items it addresses.
    Offsets { first: usize, last: usize },
    /// The sizes of the variadic buffers of a view type that were read, as `(buffer,
    /// size)` sorted by buffer: every buffer's, or only those the moved views point into
    /// when the array has more buffers than moved items (see `reach`).
    Variadic(Vec<(usize, usize)>),
    /// The last run end of a run-end encoded array (at least its `offset + length`).
    LastRunEnd(i64),
}

/// The gather list of an import: `(source address, length, position in the scratch)`.
#[derive(Debug, Default)]
struct Reads {
    copies: Vec<(usize, usize, usize)>,
    total: usize,
}

impl Reads {
    /// Adds a read of `len` bytes at device address `src`; returns where it lands in the
    /// scratch, or an error when the scratch would outgrow the address space.
    fn push(&mut self, src: usize, len: usize) -> Result<usize> {
        let (at, total) = place(self.total, 8, len, "the sizes read back from the device")?;
        self.total = total;
        self.copies.push((src, len, at));
        Ok(at)
    }

    /// Whether nothing is to be read.
    fn is_empty(&self) -> bool {
        self.copies.is_empty()
    }
}

fn overflow(what: &str) -> Error {
    Error::InvalidArgument(format!("{what} overflows the address space"))
}

/// Where `len` bytes go after `total` bytes, at the next multiple of `align`, and the new
/// total: checked, so that no size wraps. A single range, and the whole, must fit in
/// `isize::MAX` bytes (what one allocation, and a pointer offset, can span).
fn place(total: usize, align: usize, len: usize, what: &str) -> Result<(usize, usize)> {
    const MAX: usize = isize::MAX as usize;
    if len > MAX {
        return Err(Error::InvalidArgument(format!(
            "{what}: a range of {len} bytes is larger than isize::MAX"
        )));
    }
    let at = total
        .checked_next_multiple_of(align)
        .ok_or_else(|| overflow(what))?;
    let end = at
        .checked_add(len)
        .filter(|&end| end <= MAX)
        .ok_or_else(|| overflow(what))?;
    Ok((at, end))
}

/// `items * width`, or an error when it overflows.
fn bytes(items: usize, width: usize) -> Result<usize> {
    items
        .checked_mul(width)
        .ok_or_else(|| overflow("a buffer size"))
}

/// `addr + offset`, or an error when it overflows.
fn address(addr: usize, offset: usize) -> Result<usize> {
    addr.checked_add(offset)
        .ok_or_else(|| overflow("a buffer address"))
}

/// Builds the node tree of a structurally valid `array` of `data_type`, adding the
/// device-resident sizes it needs to `reads`.
///
/// # Safety
/// `array` must be well-formed (its pointers valid for its counts, as in a
/// [`DeviceArray`]) and have passed [`layout::validate_structure`] for `data_type`.
unsafe fn walk(array: &ArrowArray, data_type: &DataType, reads: &mut Reads) -> Result<ForeignNode> {
    // `validate_structure` checked: non-negative, `offset + length` does not overflow,
    // buffer and child counts, and non-NULL buffers where bytes are needed.
    let (offset, length) = (array.offset as usize, array.length as usize);
    let end = offset + length;
    let buffers: Vec<usize> = (0..array.n_buffers as usize)
        // SAFETY: `array` is well-formed (contract of this function).
        .map(|i| unsafe { array.buffer(i) } as usize)
        .collect();
    let mut at = Vec::new();
    match data_type {
        // NULL offsets (of an empty array, the only case the layout checks let through,
        // see devarrow_abi::layout): nothing to read.
        dt if has_end_offsets(dt) && buffers[1] == 0 => {}
        dt if has_end_offsets(dt) => {
            let w = offset_width(dt);
            at.push(reads.push(address(buffers[1], bytes(offset, w)?)?, w)?);
            at.push(reads.push(address(buffers[1], bytes(end, w)?)?, w)?);
        }
        // The sizes of the variadic buffers of view types are read once the items moved
        // are known, and only those the moved views need (see `reach`).
        _ => {}
    }
    let children = child_types(data_type)
        .into_iter()
        .enumerate()
        .map(|(i, child_type)| {
            // SAFETY: `array` is well-formed (contract of this function).
            let child = unsafe { array.child(i) }.ok_or(Error::NullPointer {
                what: "ArrowArray child",
            })?;
            // SAFETY: validate_structure checked the child unreleased, hence well-formed
            // (C data interface), and valid for `child_type`.
            unsafe { walk(child, child_type, reads) }
        })
        .collect::<Result<Vec<_>>>()?;
    let dictionary = match data_type {
        DataType::Dictionary(_, value_type) => {
            // SAFETY: `array` is well-formed (contract of this function).
            let dict = unsafe { array.dictionary() }.ok_or(Error::NullPointer {
                what: "ArrowArray dictionary",
            })?;
            // SAFETY: as for the children: unreleased (checked), well-formed and valid.
            Some(Box::new(unsafe { walk(dict, value_type, reads) }?))
        }
        _ => None,
    };
    if let (DataType::RunEndEncoded(_, _), Some(ends)) = (data_type, children.first()) {
        // The last run end: how far the runs reach.
        if let (Some(last), Some(w)) = (ends.length.checked_sub(1), run_end_width(ends)) {
            let from = bytes(ends.offset + last, w)?;
            at.push(reads.push(address(ends.buffers[1], from)?, w)?);
        }
    }
    Ok(ForeignNode {
        data_type: data_type.clone(),
        length,
        offset,
        null_count: array.null_count,
        buffers,
        children,
        dictionary,
        reads: at,
        extent: Extent::None,
        cut: reach::Cut::default(),
    })
}

/// The width of the run ends of a run-end encoded array (its first child), in bytes.
fn run_end_width(ends: &ForeignNode) -> Option<usize> {
    match ends.data_type {
        DataType::Int16 => Some(2),
        DataType::Int32 => Some(4),
        DataType::Int64 => Some(8),
        _ => None,
    }
}

/// Gathers every read on the device into one scratch buffer (one batched copy), copies it
/// to the host in one copy and waits for it once.
fn read_back(device: &dyn Device, reads: &Reads) -> Result<Vec<u8>> {
    if reads.copies.is_empty() {
        return Ok(Vec::new());
    }
    let scratch = device.allocate(reads.total)?;
    let base = scratch.address() as usize;
    let copies: Vec<DeviceCopy> = reads
        .copies
        .iter()
        .map(|&(src, len, at)| DeviceCopy {
            src: src as *const c_void,
            dst: (base + at) as *mut c_void,
            len,
        })
        .collect();
    // Ordinary host memory: a few bytes per array, not worth a pinned allocation (the copy
    // to pageable memory may return only once done; we wait for it right after anyway).
    // Foreign lengths size it (list views): an allocation failure is an error, not an abort.
    let mut host = Vec::new();
    host.try_reserve_exact(reads.total).map_err(|e| {
        Error::Arrow(arrow_schema::ArrowError::MemoryError(format!(
            "{} bytes for the sizes read back from the device: {e}",
            reads.total
        )))
    })?;
    host.resize(reads.total, 0u8);
    let result = (|| {
        // Sources: ranges `DeviceArray::try_new`'s contract guarantees for the validated array
        // (offsets at `offset` and `offset + length`, list-view offsets and sizes, variadic
        // sizes), kept alive by the caller; the scratch is dropped only after the wait.
        // SAFETY: sources are valid as above; destinations are disjoint scratch ranges.
        unsafe { device.copy_on_device(&copies)? };
        // SAFETY: the scratch holds `total` bytes written by the copy above (in stream
        // order); `host` holds `total` bytes and is read only after the wait.
        unsafe { device.copy_to_host(scratch.address(), host.as_mut_ptr(), reads.total)? };
        device.record_event()?.wait_host()
    })();
    if let Err(e) = result {
        // Enqueued copies may still read the foreign buffers, which the caller releases
        // when it returns this error: let them finish first.
        let _ = device.synchronize();
        return Err(e);
    }
    Ok(host)
}

/// An integer of `width` bytes (2, 4 or 8, native-endian) at `at` in the read-back bytes.
fn read_int(bytes: &[u8], at: usize, width: usize) -> Result<i64> {
    let missing = || Error::InvalidArgument("a read-back value is missing".into());
    let b = bytes
        .get(at..at.checked_add(width).ok_or_else(missing)?)
        .ok_or_else(missing)?;
    Ok(match width {
        2 => i16::from_ne_bytes(b.try_into().expect("2 bytes")) as i64,
        4 => i32::from_ne_bytes(b.try_into().expect("4 bytes")) as i64,
        _ => i64::from_ne_bytes(b.try_into().map_err(|_| missing())?),
    })
}

/// Validates the read-back sizes of `node` and its descendants, and records them.
fn settle(node: &mut ForeignNode, bytes: &[u8], path: &str) -> Result<()> {
    let bad = |message: String| Error::InvalidOffsets {
        path: path.to_string(),
        message,
    };
    let dt = node.data_type.clone();
    match &dt {
        // An empty array with NULL offsets addresses nothing.
        dt if has_end_offsets(dt) && node.buffers[1] == 0 => {
            node.extent = Extent::Offsets { first: 0, last: 0 };
        }
        dt if has_end_offsets(dt) => {
            let w = offset_width(dt);
            let first = read_int(bytes, node.reads[0], w)?;
            let last = read_int(bytes, node.reads[1], w)?;
            let (first, last) = check_offsets(node, first, last, path)?;
            node.extent = Extent::Offsets { first, last };
        }
        DataType::RunEndEncoded(_, _) if node.length > 0 => {
            let end = node.offset + node.length;
            let w = node.children.first().and_then(run_end_width);
            let (Some(&at), Some(w)) = (node.reads.first(), w) else {
                return Err(bad(format!("no run ends for {} items", node.length)));
            };
            let last = read_int(bytes, at, w)?;
            if last < end as i64 {
                return Err(bad(format!(
                    "the last run end {last} is before the end of the array ({end})"
                )));
            }
            node.extent = Extent::LastRunEnd(last);
        }
        _ => {}
    }
    for (i, child) in node.children.iter_mut().enumerate() {
        settle(child, bytes, &format!("{path}.children[{i}]"))?;
    }
    if let Some(dict) = &mut node.dictionary {
        settle(dict, bytes, &format!("{path}.dictionary"))?;
    }
    Ok(())
}

/// Validates the offsets `first` and `last` read at two bounds of the offsets of `node`
/// (an array with offsets), as the data bytes or child items they address: not negative,
/// not decreasing, inside the child, and a data buffer where they address bytes.
fn check_offsets(node: &ForeignNode, first: i64, last: i64, path: &str) -> Result<(usize, usize)> {
    let bad = |message: String| Error::InvalidOffsets {
        path: path.to_string(),
        message,
    };
    if first < 0 {
        return Err(bad(format!("first offset {first} is negative")));
    }
    if last < first {
        return Err(bad(format!(
            "last offset {last} is less than the first offset {first}"
        )));
    }
    let (first, last) = (first as usize, last as usize);
    if let Some(child) = node.children.first() {
        if last > child.length {
            return Err(bad(format!(
                "last offset {last} is past the end of the child (length {})",
                child.length
            )));
        }
    } else if last > first && node.buffers[2] == 0 {
        return Err(Error::NullBuffer {
            path: path.to_string(),
            index: 2,
            role: BufferRole::Data.name(),
            bytes: last,
        });
    }
    Ok((first, last))
}

impl ForeignNode {
    /// The number of variadic buffers of a view type (0 for other types).
    pub(crate) fn variadic_count(&self) -> usize {
        match self.data_type {
            DataType::Utf8View | DataType::BinaryView => self.buffers.len().saturating_sub(3),
            _ => 0,
        }
    }

    /// The size of variadic buffer `buffer` of a view type, when it was read at import.
    pub(crate) fn variadic_size(&self, buffer: usize) -> Option<usize> {
        let Extent::Variadic(sizes) = &self.extent else {
            return None;
        };
        let k = sizes.binary_search_by_key(&buffer, |&(b, _)| b).ok()?;
        Some(sizes[k].1)
    }

    /// Whether the validity bitmap is to be read (the array may have nulls and has one).
    fn has_validity(&self) -> bool {
        buffer_roles(&self.data_type).first() == Some(&BufferRole::Validity)
            && self.null_count != 0
            && self.buffers[0] != 0
    }

    /// The bytes from the start of buffer `index` that items `[0, end)` of the array
    /// address (`end`: the array's `offset + length`, or less), as the C data interface
    /// lays the buffer out: bitmaps to the byte holding the last bit, values and offsets
    /// to the last item (offsets one past), the data of offsets types to the last offset
    /// read back at import, the variadic buffers of view types whole where their sizes
    /// were read at import (every one's, unless the array has more variadic buffers than
    /// moved items: then those its moved views point into), else 0. Saturating: sizes of
    /// validated arrays never overflow.
    pub(crate) fn buffer_len(&self, index: usize, end: usize) -> usize {
        let dt = &self.data_type;
        let value_type = match dt {
            DataType::Dictionary(key, _) => key.as_ref(),
            dt => dt,
        };
        let w = offset_width(dt);
        match buffer_role(dt, index, self.buffers.len()) {
            BufferRole::Validity => end.div_ceil(8),
            BufferRole::Values => {
                fixed_bit_width(value_type).map_or(0, |bits| end.saturating_mul(bits).div_ceil(8))
            }
            BufferRole::Offsets => match dt {
                DataType::Union(_, _) => end.saturating_mul(4),
                DataType::ListView(_) | DataType::LargeListView(_) => end.saturating_mul(w),
                _ => end.saturating_add(1).saturating_mul(w),
            },
            BufferRole::Sizes => end.saturating_mul(w),
            BufferRole::TypeIds => end,
            BufferRole::Views => end.saturating_mul(16),
            BufferRole::Data => match &self.extent {
                Extent::Offsets { last, .. } => *last,
                Extent::Variadic(_) => self.variadic_size(index.wrapping_sub(2)).unwrap_or(0),
                _ => 0,
            },
            BufferRole::VariadicSizes => self.variadic_count().saturating_mul(8),
        }
    }

    /// The array as it is, for re-export.
    fn export(&self) -> ArrayNode {
        ArrayNode {
            length: self.length as i64,
            null_count: self.null_count,
            offset: self.offset as i64,
            buffers: self.buffers.iter().map(|&b| b as *const c_void).collect(),
            children: self.children.iter().map(|c| c.export()).collect(),
            dictionary: self.dictionary.as_ref().map(|d| Box::new(d.export())),
        }
    }
}

/// The most bytes of one packed variadic buffer of a view type: views address their
/// bytes with 32-bit offsets (`int32` in the format).
const PACKED_VIEW_BUFFER_MAX: usize = i32::MAX as usize;

/// A packed image to fill on the device: `(source address, offset in the image, length)`.
#[derive(Debug, Default)]
struct Image {
    copies: Vec<(usize, usize, usize)>,
    total: usize,
}

impl Image {
    /// Places `len` bytes from device address `src` at the next 64-byte boundary; an
    /// error when the image would outgrow the address space (sizes come from foreign
    /// offsets, which may address anything).
    fn push(&mut self, src: usize, len: usize) -> Result<Option<Placement>> {
        let (offset, total) = place(self.total, BUFFER_ALIGNMENT, len, "the packed image")?;
        self.total = total;
        if len > 0 {
            self.copies.push((src, offset, len));
        }
        Ok(Some(Placement { offset, len }))
    }

    /// Places the byte ranges `pieces` (`(buffer, lo, hi)`, sorted) of the variadic
    /// buffers at device addresses `sources[buffer]` one after another, in as few
    /// buffers as hold them: the next range starts a new buffer (at the next 64-byte
    /// boundary) only where it would take the current one past `max` bytes. Returns
    /// those buffers and where each range went; what this costs follows the ranges, not
    /// the number of `sources`.
    fn push_view_pieces(
        &mut self,
        sources: &[usize],
        pieces: &[slicing::ViewPiece],
        max: usize,
    ) -> Result<(Vec<Option<Placement>>, Vec<ViewRange>)> {
        let mut packed: Vec<Placement> = Vec::new();
        let mut moved = Vec::with_capacity(pieces.len());
        for &(buffer, lo, hi) in pieces {
            let len = hi - lo;
            let src = *sources.get(buffer).ok_or_else(|| {
                Error::InvalidArgument(format!("variadic buffer {buffer} of {}", sources.len()))
            })?;
            let fits = packed
                .last()
                .and_then(|p| p.len.checked_add(len))
                .is_some_and(|total| total <= max);
            if !fits {
                let (offset, total) = place(self.total, BUFFER_ALIGNMENT, 0, "the packed image")?;
                self.total = total;
                packed.push(Placement { offset, len: 0 });
            }
            let index = packed.len() - 1;
            let current = &mut packed[index];
            // The current buffer ends where the image does: the range goes right after.
            let (at, total) = place(self.total, 1, len, "the packed image")?;
            self.total = total;
            self.copies.push((address(src, lo)?, at, len));
            moved.push(ViewRange {
                buffer,
                from: lo,
                packed: index,
                to: current.len,
            });
            current.len += len;
        }
        Ok((packed.into_iter().map(Some).collect(), moved))
    }
}

/// Plans the packed copy of what a download moves of `node` (its [`reach::Cut`], found
/// at import): the bytes its moved items reach go to `image`, the returned tree points
/// there.
///
/// Every range stays inside what the import validated: the items of every array are
/// inside its length, and what they reach in its buffers and children was read back and
/// checked (offsets, list views, views, dense union offsets, run ends).
fn pack_node(node: &ForeignNode, image: &mut Image) -> Result<Node> {
    let dt = &node.data_type;
    let (Some((l, n)), Some(found)) = (node.cut.range, node.cut.found.as_ref()) else {
        return Err(Error::InvalidArgument(format!(
            "what a download moves of a {dt} array was not found at import"
        )));
    };
    let reach::Bounds { p, base, m } = reach::bounds(node, l, n);
    let has_validity = node.has_validity();
    let whole = l == 0 && n == node.length;
    let null_count = if !has_validity {
        Some(0)
    } else if whole && node.null_count >= 0 {
        Some(node.null_count as usize)
    } else {
        None
    };
    let addr = |i: usize, from: usize| address(node.buffers[i], from);
    let mut buffers = Vec::new();
    let mut children = Vec::new();
    let mut dictionary = None;
    // Bitmaps can only be cut at a byte boundary: every buffer (and child) starts up to
    // 7 items early, at `base`, and the node keeps the difference as its offset.
    let mut offset = p - base;
    let mut rebase = None;
    let mut rebase_each = Vec::new();
    let mut view_ranges: Vec<ViewRange> = Vec::new();
    if buffer_roles(dt).first() == Some(&BufferRole::Validity) {
        buffers.push(if has_validity {
            image.push(addr(0, base / 8)?, m.div_ceil(8))?
        } else {
            None
        });
    }
    let pack_children = |image: &mut Image| {
        node.children
            .iter()
            .map(|child| pack_node(child, image))
            .collect::<Result<Vec<_>>>()
    };
    match (dt, found) {
        (DataType::Null, _) => {}
        (DataType::Boolean, _) => buffers.push(image.push(addr(1, base / 8)?, m.div_ceil(8))?),
        (dt, &reach::Found::Offsets { first, last }) if has_end_offsets(dt) => {
            let w = offset_width(dt);
            buffers.push(if node.buffers[1] == 0 {
                // An empty array with NULL offsets: no offsets, which arrow-rs reads as
                // empty too.
                image.push(0, 0)?
            } else {
                image.push(addr(1, bytes(base, w)?)?, bytes(m + 1, w)?)?
            });
            if node.children.is_empty() {
                buffers.push(image.push(addr(2, first)?, last - first)?);
            } else {
                children = pack_children(image)?;
            }
            rebase = (first > 0).then_some(first as i64);
        }
        (DataType::Utf8View | DataType::BinaryView, found) => {
            buffers.push(image.push(addr(1, bytes(base, 16)?)?, bytes(m, 16)?)?);
            let sources = &node.buffers[2..node.buffers.len() - 1];
            if let reach::Found::Views(pieces) = found {
                // Only the bytes the moved views reach, packed one after another into as
                // few buffers as hold them, whatever the number of foreign buffers: the
                // views are remapped to them on the host.
                let (packed, moved) =
                    image.push_view_pieces(sources, pieces, PACKED_VIEW_BUFFER_MAX)?;
                buffers.extend(packed);
                view_ranges = moved;
            } else {
                // Every buffer whole (their sizes were all read).
                for (i, &src) in sources.iter().enumerate() {
                    let size = node.variadic_size(i).ok_or_else(|| {
                        Error::InvalidArgument(format!("the size of {dt} buffer {i} was not read"))
                    })?;
                    buffers.push(image.push(src, size)?);
                }
            }
            // The variadic sizes: the host takes them from the lengths of the buffers.
            buffers.push(image.push(node.buffers[node.buffers.len() - 1], 0)?);
        }
        (
            DataType::ListView(_) | DataType::LargeListView(_),
            &reach::Found::ListView { lo, .. },
        ) => {
            let w = offset_width(dt);
            buffers.push(image.push(addr(1, bytes(base, w)?)?, bytes(m, w)?)?);
            buffers.push(image.push(addr(2, bytes(base, w)?)?, bytes(m, w)?)?);
            children = pack_children(image)?;
            rebase = Some(lo as i64);
        }
        (DataType::FixedSizeList(_, _) | DataType::Struct(_), _) => {
            children = pack_children(image)?;
        }
        (DataType::Union(_, mode), found) => {
            buffers.push(image.push(addr(0, p)?, n)?);
            if *mode == UnionMode::Dense {
                buffers.push(image.push(addr(1, bytes(p, 4)?)?, bytes(n, 4)?)?);
            }
            children = pack_children(image)?;
            if let reach::Found::Union(ranges) = found {
                rebase_each = ranges.iter().map(|&(lo, _)| lo).collect();
            }
        }
        (DataType::Dictionary(key, _), _) => {
            let width = key
                .primitive_width()
                .ok_or_else(|| Error::InvalidArgument(format!("dictionary keys of type {key}")))?;
            buffers.push(image.push(addr(1, bytes(base, width)?)?, bytes(m, width)?)?);
            let dict = node.dictionary.as_deref().ok_or(Error::NullPointer {
                what: "ArrowArray dictionary",
            })?;
            dictionary = Some(Box::new(pack_node(dict, image)?));
        }
        (DataType::RunEndEncoded(_, _), _) => {
            // The runs covering the items, their run ends made relative to the first item
            // on the host: offset 0, as arrow-rs and the planner lay a slice out.
            children = pack_children(image)?;
            offset = 0;
            let all_runs = p == 0 && matches!(node.extent, Extent::LastRunEnd(e) if e == n as i64);
            rebase = (n > 0 && !all_runs).then_some(p as i64);
        }
        (dt, _) => {
            let bits = fixed_bit_width(dt)
                .ok_or_else(|| Error::InvalidArgument(format!("unsupported data type {dt}")))?;
            let width = bits / 8;
            buffers.push(image.push(addr(1, bytes(base, width)?)?, bytes(m, width)?)?);
        }
    }
    if rebase_each.iter().all(|&b| b == 0) {
        rebase_each.clear();
    }
    if view_ranges
        .iter()
        .all(|r| r.buffer == r.packed && r.from == r.to)
    {
        view_ranges.clear(); // every view keeps its buffer and offset
    }
    Ok(Node {
        data_type: dt.clone(),
        len: n,
        null_count,
        offset,
        rebase,
        rebase_each,
        view_ranges,
        buffers,
        children,
        dictionary,
    })
}

/// The role of buffer `index` of `n` of an array of `data_type`: the fixed ones of its
/// layout, then (view types) the variadic data buffers and their sizes, last.
pub(crate) fn buffer_role(data_type: &DataType, index: usize, n: usize) -> BufferRole {
    let roles = buffer_roles(data_type);
    match roles.get(index) {
        Some(role) => *role,
        None if index + 1 == n => BufferRole::VariadicSizes,
        None => BufferRole::Data,
    }
}

impl Foreign {
    /// The imported tree (the root struct array, as imported).
    pub(crate) fn root(&self) -> &ForeignNode {
        &self.root
    }

    /// Records the last use, so far, of the buffers through views on a stream (kept alive
    /// by the entry): its event, recorded there after that work, is waited for
    /// before the producer's release. Supersedes the earlier uses on that stream (a
    /// stream runs its work in order).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn add_view_use(&self, view_use: ViewUse) {
        let mut uses = self.view_uses.lock().unwrap_or_else(|e| e.into_inner());
        uses.retain(|u| u.key != view_use.key);
        uses.push(view_use);
    }

    /// The number of items of the root array (the batch's rows).
    pub(crate) fn num_rows(&self) -> usize {
        self.root.length
    }

    /// The device type of the foreign buffers.
    pub(crate) fn device_type(&self) -> ArrowDeviceType {
        self.array.device_type()
    }

    /// The device id of the foreign buffers.
    pub(crate) fn device_id(&self) -> i64 {
        self.array.device_id()
    }

    /// The bytes of the foreign buffers that the batch's rows reach: what a download packs
    /// and moves (without the alignment between buffers).
    pub(crate) fn device_bytes(&self) -> usize {
        self.image
            .copies
            .iter()
            .fold(0usize, |total, &(_, _, len)| total.saturating_add(len))
    }

    /// The imported tree as it is, for re-export.
    pub(crate) fn export_root(&self) -> ArrayNode {
        self.root.export()
    }

    /// Packs the bytes the imported arrays address into one fresh allocation on `device`
    /// with one batched copy, enqueued after `ready` (the event of the batch holding this
    /// array): returns the packed image, the tree over it, and the event after the copy.
    ///
    /// `device` must be the device the array was imported on (same type and id; see
    /// [`check_same_device`]): another device could not address its buffers.
    pub(crate) fn pack(
        &self,
        device: &Arc<dyn Device>,
        ready: &Arc<dyn SyncEvent>,
    ) -> Result<PackedCopy> {
        check_same_device(self.device.as_ref(), device.as_ref())?;
        let image = &self.image;
        let memory = device.allocate(image.total)?;
        let base = memory.address() as usize;
        let copies: Vec<DeviceCopy> = image
            .copies
            .iter()
            .map(|&(src, at, len)| DeviceCopy {
                src: src as *const c_void,
                dst: (base + at) as *mut c_void,
                len,
            })
            .collect();
        // Where the producer frees the buffers in order on `device`'s own stream, the
        // copies below, enqueued there, come before the release without a wait.
        let in_order = self.in_order_on.is_some() && self.in_order_on == device.stream_handles();
        let mut last_use = self.last_use.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(previous) = last_use.as_ref().filter(|_| !in_order) {
            // Kept on error, so that `Drop` still waits for (or synchronizes) that work.
            previous.wait()?;
        }
        let enqueued = (|| {
            // SAFETY: `ready` is the batch's own live event (held by the caller), of the
            // kind of the device the batch was imported on.
            unsafe { device.wait_sync_event(ready.as_sync_event_ptr())? };
            // Sources lie inside what the import validated for the foreign buffers, kept
            // alive (unreleased) by `self` until the event recorded below has completed;
            // `device` is the import's device (checked above), so it addresses them.
            // SAFETY: sources valid as above; destinations are disjoint aligned ranges of
            // the fresh allocation of `image.total` bytes.
            unsafe { device.copy_on_device(&copies)? };
            device.record_event()
        })();
        let event = match enqueued {
            Ok(event) => event,
            Err(e) => {
                // Without an event to wait for, make sure no copy still reads the foreign
                // buffers when they are released.
                let _ = device.synchronize();
                return Err(e);
            }
        };
        if !in_order {
            *last_use = Some(LastUse {
                event: event.clone(),
                device: device.clone(),
            });
        }
        Ok(PackedCopy {
            root: self.packed.clone(),
            memory,
            event,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn view_pieces_pack_into_as_few_buffers_as_hold_them() {
        let sources = [0x1000, 0x2000, 0x3000];
        let mut image = Image::default();
        image.push(0x9000, 16).unwrap(); // the views, say
        let pieces = [(0, 5, 10), (0, 20, 30), (2, 0, 8), (2, 100, 104)];
        let (packed, moved) = image.push_view_pieces(&sources, &pieces, 20).unwrap();
        // 5 + 10 bytes fit in one buffer of at most 20; the next 8 do not.
        assert_eq!(
            packed,
            vec![
                Some(Placement {
                    offset: 64,
                    len: 15
                }),
                Some(Placement {
                    offset: 128,
                    len: 12
                }),
            ]
        );
        let range = |buffer, from, packed, to| ViewRange {
            buffer,
            from,
            packed,
            to,
        };
        assert_eq!(
            moved,
            vec![
                range(0, 5, 0, 0),
                range(0, 20, 0, 5),
                range(2, 0, 1, 0),
                range(2, 100, 1, 8),
            ]
        );
        assert_eq!(
            image.copies[1..],
            [
                (0x1005, 64, 5),
                (0x1014, 69, 10),
                (0x3000, 128, 8),
                (0x3064, 136, 4),
            ]
        );
        assert_eq!(image.total, 140);
        // A buffer that does not exist is an error, not a panic.
        assert!(image.push_view_pieces(&sources, &[(3, 0, 1)], 20).is_err());
        // No piece, no buffer.
        let (packed, moved) = image.push_view_pieces(&sources, &[], 20).unwrap();
        assert!(packed.is_empty() && moved.is_empty());
    }
}
