//! The compaction of a frame's kept rows on CUDA ([`crate::compute::compact`]): the
//! selection scanned, then every column moved to the front at its own width: fixed-width
//! values (`compact_fixed`), bitmaps (`compact_bits`), string views and their long values
//! (`view_bytes`, a scan, `compact_views`), offset-based strings and binaries (`kept_lengths`,
//! a scan, `compact_strings`); structs and fixed-size lists by their children, and
//! variable-size lists and maps by their kept rows' lengths (`kept_lengths`, a scan,
//! `compact_offsets`) and a scan of their items (`list_items`); unions by their type ids
//! and children (dense: `union_marks`, a scan, `union_offsets`). One read-back in all.

use std::sync::Arc;

use arrow_schema::{DataType, UnionFields, UnionMode};
use devarrow::abi::device::DeviceKernels;
use devarrow::bridge::{DeviceBatch, DeviceColumn};
use devarrow::cuda::cudarc::driver::{CudaSlice, ValidAsZeroBits};
use devarrow::cuda::{CudaArray, CudaDevice, DeviceNative};

use super::{
    addr, aligned, context, load, offset_array, string_source, variadic_tables, Cx, StringSource, A,
};
use crate::compute::{fixed_width, ComputeError, SELECTION};
use crate::error::BoxError;
use crate::frame::{DeviceFrame, FrameColumn};
use crate::step::ExecDevice;

/// What one column needs once the kept row count is known, prepared before the
/// read-back.
enum Prepared {
    /// A struct or a fixed-size list: its validity and children only.
    Struct,
    /// A union: its type ids (at its first row) moved as fixed-width values, its
    /// children as columns (sparse) or by their kept items (dense).
    Union {
        type_ids: u64,
        dense: Option<DenseUnion>,
    },
    /// A variable-size list (or a map): its offsets made anew of the kept rows' lengths,
    /// its items moved by their own scan.
    List {
        /// The slot of the kept items' count among the read-back scalars.
        slot: usize,
        /// The inclusive scan of each row's kept items.
        lengths: CudaSlice<i64>,
        /// i64 offsets (`LargeList`), else i32.
        wide: bool,
        /// The items' count (the child's rows).
        items: usize,
    },
    Fixed {
        /// The values at the column's first row.
        values: u64,
        width: u32,
    },
    Bits {
        /// The values' bitmap, compacted.
        bits: CudaSlice<u8>,
    },
    Strings {
        /// Where the rows lie: the offsets at the column's first row, their width, the
        /// data.
        source: StringSource,
        /// The slot of the kept values' bytes among the read-back scalars.
        slot: usize,
        /// The inclusive scan of each row's kept bytes.
        bytes: CudaSlice<i64>,
    },
    Views {
        /// The views at the column's first row.
        views: u64,
        /// The validity bitmap (0: none) and the bit of the first row.
        bitmap: u64,
        offset: u64,
        /// The slot of the long values' bytes among the read-back scalars.
        slot: usize,
        /// The variadic buffers' addresses, on the device.
        buffers: CudaSlice<u64>,
        /// The inclusive scan of each row's long-value bytes.
        bytes: CudaSlice<i64>,
    },
}

/// A dense union's offsets (at its first row) and its children's kept items.
struct DenseUnion {
    offsets: u64,
    children: Vec<UnionChild>,
}

/// A dense union's child: its type id, the scan of the items its kept rows use, its
/// items, and the read-back slot of their count.
struct UnionChild {
    type_id: i8,
    scan: CudaSlice<i64>,
    len: usize,
    slot: usize,
}

/// A column's validity, compacted: the bitmap, and the slot of its valid kept rows.
struct Validity {
    bits: CudaSlice<u8>,
    slot: usize,
}

/// [`crate::compute::compact`] on CUDA. `Some(None)` when no row is kept; `None` where
/// a foreign view points outside its buffers (or the long values exceed one buffer's
/// 2 GiB): the caller filters on the host.
pub(crate) fn compact(
    frame: &DeviceFrame,
    selection: &FrameColumn,
    cuda: &Arc<CudaDevice>,
    device: &ExecDevice,
) -> Result<Option<Option<DeviceFrame>>, BoxError> {
    let n = frame.num_rows();
    let cx = context(cuda)?;
    let s = cx.stream;
    let columns: Vec<DeviceColumn<'_>> = frame.columns().iter().map(|c| c.column()).collect();
    // Every array moved: each column, then its dictionary's values (moved whole, every
    // value kept) or its struct children (each moved as the column is), and theirs.
    let mut arrays = Vec::new();
    for c in &columns {
        if !arrays_of(c, &mut arrays) {
            return Ok(None);
        }
    }
    // The buffer tables of view arrays go up first (a copy from pageable memory may wait
    // for the stream).
    let mut tables = Vec::with_capacity(arrays.len());
    for c in &arrays {
        tables.push(match c.data_type() {
            DataType::Utf8View | DataType::BinaryView => Some(variadic_tables(&cx, c)?),
            _ => None,
        });
    }
    // Read back at once: [kept rows, error word, then per array, in that order: valid
    // kept rows, long values' bytes].
    // After them, one slot a dense union's child: its kept items.
    let unions: usize = arrays
        .iter()
        .filter(|c| matches!(c.data_type(), DataType::Union(_, UnionMode::Dense)))
        .map(|c| c.num_children())
        .sum();
    let scalars = cx.zeros::<i64>(2 + 2 * arrays.len() + unions)?;
    let base = addr(&scalars, s);
    let e = base + 8;
    let incl = load(&cx, selection, SELECTION, e)?;
    // Selected: valid and non-zero, as 0/1 lanes (a null selection keeps no row).
    let keep = cx.lanes(n)?;
    cx.launch(
        &cx.k.select_rows,
        n,
        &[
            A::U64(addr(&incl.values, s)),
            A::U64(addr(&incl.valid, s)),
            A::U64(0),
            A::U64(0),
            A::U64(addr(&keep.valid, s)),
            A::U64(n as u64),
        ],
    )?;
    drop(incl);
    let all_valid = cx.zeros::<u8>(n)?;
    cx.launch(
        &cx.k.load_lanes,
        n,
        &[
            A::U64(addr(&keep.valid, s)),
            A::U64(0),
            A::U64(0),
            A::U64(n as u64),
            A::U32(1),
            A::U64(addr(&keep.values, s)),
            A::U64(addr(&all_valid, s)),
            A::U64(e),
        ],
    )?;
    let scan = addr(&keep.values, s);
    // SAFETY: `keep.values` holds `n` i64s on this device, written by the launches above
    // on the device's stream, the stream the scan runs on (in order after them).
    unsafe { cuda.inclusive_scan_i64(scan as *mut std::ffi::c_void, n as u64) }?;
    let mut scalars = scalars;
    copy_last(&cx, &keep.values, n, &mut scalars, 0)?;

    let mut moves = Moves {
        cx: &cx,
        cuda,
        base,
        e,
        scalars,
        held: Vec::new(),
        tables: tables.into_iter(),
        next: 0,
        next_extra: 2 + 2 * arrays.len(),
    };
    let mut prepared = Vec::with_capacity(columns.len());
    for (i, c) in columns.iter().enumerate() {
        let name = frame.schema().field(i).name();
        prepared.push(moves.prepare(c, name, (scan, n))?);
    }

    let Moves { scalars, held, .. } = moves;
    // The scans of the dictionaries' values, held until their launches are enqueued.
    let mut scans = Vec::new();
    let mut read = vec![0i64; scalars.len()];
    s.memcpy_dtoh(&scalars, &mut read)?;
    s.synchronize()?;
    // The error word: 4 for a view outside its buffers (`view_bytes`).
    if read[1] != 0 {
        return Ok(None);
    }
    let m = read[0].max(0) as usize;
    if m == 0 {
        return Ok(Some(None));
    }
    let mut arrays = Vec::with_capacity(columns.len());
    for (moved, field) in prepared.into_iter().zip(frame.schema().fields()) {
        match moved.array(&cx, field.data_type(), (scan, n, m), &read, &mut scans)? {
            Some(array) => arrays.push(array),
            None => return Ok(None),
        }
    }
    // The borrowed buffers are released in stream order after the launches above.
    drop((held, scans, keep, all_valid, scalars));
    let batch =
        DeviceBatch::from_cuda_arrays(device.device().clone(), frame.schema().clone(), arrays)?;
    Ok(Some(Some(DeviceFrame::from_batch(batch))))
}

/// The arrays [`compact`] moves, prepared one by one before the read-back: the context,
/// the read-back scalars (at `base`; the error word at `e`) and what they hold.
struct Moves<'c, 'a> {
    cx: &'c Cx<'c>,
    cuda: &'c Arc<CudaDevice>,
    base: u64,
    e: u64,
    scalars: CudaSlice<i64>,
    /// Views of the frame's buffers, held until the launches that read them are enqueued.
    held: Vec<devarrow::cuda::BorrowedSlice<'a, u8>>,
    /// The view tables of the arrays, in [`arrays_of`]'s order (`None`: not a view).
    tables: std::vec::IntoIter<Option<ViewTables>>,
    /// The next array's index in that order (its read-back slots).
    next: usize,
    /// The next slot after the arrays' (a dense union child's kept items).
    next_extra: usize,
}

/// A view array's buffer tables ([`variadic_tables`]): the variadic buffers' addresses
/// and sizes on the device, and their count.
type ViewTables = (CudaSlice<u64>, CudaSlice<u64>, u64);

/// Every array [`compact`] moves of `c`, pushed on `out` in the order it prepares them:
/// `c`, then its dictionary's values (and theirs), then its struct children or its
/// fixed-size list's or variable-size list's items (and theirs). `false` for a struct
/// or a fixed-size list of an offset (its children's rows would be shifted by it; a
/// packed batch has none), and for a variable-size list of no item (nothing to allocate
/// its items' scan in): the host's.
fn arrays_of<'a>(c: &DeviceColumn<'a>, out: &mut Vec<DeviceColumn<'a>>) -> bool {
    out.push(*c);
    if let Some(values) = c.dictionary() {
        if !arrays_of(&values, out) {
            return false;
        }
    }
    if let DataType::Struct(_) | DataType::FixedSizeList(..) = c.data_type() {
        if c.offset() != 0 {
            return false;
        }
        for child in c.children() {
            if !arrays_of(&child, out) {
                return false;
            }
        }
    }
    if let DataType::Union(_, mode) = c.data_type() {
        // A union of an offset, or a dense one's child of no item (nothing to allocate its
        // marks in): the host's.
        if c.offset() != 0 {
            return false;
        }
        for child in c.children() {
            if (*mode == UnionMode::Dense && child.is_empty()) || !arrays_of(&child, out) {
                return false;
            }
        }
    }
    if let DataType::List(_) | DataType::LargeList(_) | DataType::Map(..) = c.data_type() {
        match c.child(0) {
            Some(items) if !items.is_empty() => return arrays_of(&items, out),
            _ => return false,
        }
    }
    true
}

/// One array moved: what it needs once the kept row count is known, its validity, its
/// dictionary's values and its struct children.
struct Moved {
    prepared: Prepared,
    validity: Option<Validity>,
    dictionary: Option<Box<WholeArray>>,
    children: Vec<Moved>,
    /// A fixed-size or variable-size list's: the scan of its items (`expand_scan`'s,
    /// `list_items`').
    items: Option<CudaSlice<i64>>,
}

/// A dictionary's values, every one kept: moved by a scan of their own (1, 2, ... `rows`).
struct WholeArray {
    moved: Moved,
    rows: usize,
    scan: CudaSlice<i64>,
}

impl<'a> Moves<'_, 'a> {
    /// The read-back slot `i`'s address.
    fn slot(&self, i: usize) -> u64 {
        self.base + 8 * i as u64
    }

    /// Prepares array `c` (a column, a struct's child, or a dictionary's values: its own
    /// offset and `n` rows; for a dictionary, its keys, then its values; for a struct,
    /// its validity, then its children) of the rows `scan` keeps, its read-back slots and
    /// view table the next of [`arrays_of`]'s order.
    fn prepare(
        &mut self,
        c: &DeviceColumn<'a>,
        name: &str,
        (scan, n): (u64, usize),
    ) -> Result<Moved, BoxError> {
        let index = self.next;
        self.next += 1;
        let table = self.tables.next().flatten();
        let (cx, cuda) = (self.cx, self.cuda);
        let s = cx.stream;
        let (valid_slot, bytes_slot) = (2 + 2 * index, 3 + 2 * index);
        let words = n.div_ceil(32);
        let offset = c.offset() as u64;
        let validity = match c.cuda_validity(s)? {
            Some(bitmap) => {
                if (bitmap.len() as u64) * 8 < offset + n as u64 {
                    return Err(ComputeError::Input(format!(
                        "column `{name}`: a bitmap too short"
                    ))
                    .into());
                }
                let bits = cx.zeros::<u8>(4 * words)?;
                let count = self.slot(valid_slot);
                compact_bits(cx, scan, bitmap.device_ptr(), offset, &bits, n, count)?;
                self.held.push(bitmap);
                Some(Validity {
                    bits,
                    slot: valid_slot,
                })
            }
            None => None,
        };
        if let DataType::Union(fields, mode) = c.data_type() {
            return self.prepare_union(c, name, (fields, *mode), (scan, n));
        }
        if let DataType::Struct(_) = c.data_type() {
            let children = c.children();
            let mut moved = Vec::with_capacity(children.len());
            for child in &children {
                moved.push(self.prepare(child, name, (scan, n))?);
            }
            return Ok(Moved {
                prepared: Prepared::Struct,
                validity,
                dictionary: None,
                children: moved,
                items: None,
            });
        }
        if let DataType::FixedSizeList(_, k) = c.data_type() {
            // The items move with their rows: a scan of the items made of the rows'.
            let k = usize::try_from(*k).unwrap_or(0);
            let items = n.saturating_mul(k);
            let scan_items = cx.lanes(items.max(1))?;
            let at = addr(&scan_items.values, s);
            cx.launch(
                &cx.k.expand_scan,
                items,
                &[A::U64(scan), A::U64(n as u64), A::U64(k as u64), A::U64(at)],
            )?;
            let child = c
                .child(0)
                .ok_or_else(|| ComputeError::Input(format!("column `{name}`: no list items")))?;
            let moved = self.prepare(&child, name, (at, items))?;
            return Ok(Moved {
                prepared: Prepared::Struct,
                validity,
                dictionary: None,
                children: vec![moved],
                items: Some(scan_items.values),
            });
        }
        if let DataType::List(_) | DataType::LargeList(_) | DataType::Map(..) = c.data_type() {
            return self.prepare_list(c, name, (scan, n), validity, bytes_slot);
        }
        let values = c
            .values()
            .or_else(|| c.buffer(1))
            .ok_or_else(|| ComputeError::Input(format!("column `{name}` without values")))?;
        let view = values.cuda_view::<u8>(s)?;
        let start = view.device_ptr();
        let e = self.e;
        let prepared = match c.data_type() {
            DataType::Boolean => {
                if (values.len() as u64) * 8 < offset + n as u64 {
                    return Err(
                        ComputeError::Input(format!("column `{name}`: values too short")).into(),
                    );
                }
                let bits = cx.zeros::<u8>(4 * words)?;
                compact_bits(cx, scan, start, offset, &bits, n, 0)?;
                Prepared::Bits { bits }
            }
            DataType::Utf8 | DataType::LargeUtf8 | DataType::Binary | DataType::LargeBinary => {
                let (source, size) = string_source(c, n, name, s, &mut self.held)?;
                let bytes = cx.zeros::<i64>(n)?;
                cx.launch(
                    &cx.k.kept_lengths,
                    n,
                    &[
                        A::U64(scan),
                        A::U64(source.offsets),
                        A::U32(u32::from(source.wide)),
                        A::U64(size),
                        A::U64(n as u64),
                        A::U64(addr(&bytes, s)),
                        A::U64(e),
                    ],
                )?;
                let at = addr(&bytes, s);
                // SAFETY: `bytes` holds `n` i64s on this device, written by `kept_lengths`
                // on the stream the scan runs on (in order after it).
                unsafe { cuda.inclusive_scan_i64(at as *mut std::ffi::c_void, n as u64) }?;
                copy_last(cx, &bytes, n, &mut self.scalars, bytes_slot)?;
                self.held.push(view);
                Prepared::Strings {
                    source,
                    slot: bytes_slot,
                    bytes,
                }
            }
            DataType::Utf8View | DataType::BinaryView => {
                let (buffers, sizes, count) = table.ok_or("a view column without tables")?;
                if (values.len() as u64) < 16 * (offset + n as u64) {
                    return Err(
                        ComputeError::Input(format!("column `{name}`: views too short")).into(),
                    );
                }
                let views = start + 16 * offset;
                aligned(views, 8, name)?;
                let bitmap = c.validity().map_or(0, |b| b.address());
                let bytes = view_bytes(cx, c, views, scan, (&sizes, count), n, e)?;
                let at = addr(&bytes, s);
                // SAFETY: `bytes` holds `n` i64s on this device, written by `view_bytes`
                // on the stream the scan runs on (in order after it).
                unsafe { cuda.inclusive_scan_i64(at as *mut std::ffi::c_void, n as u64) }?;
                copy_last(cx, &bytes, n, &mut self.scalars, bytes_slot)?;
                self.held.push(view);
                // The sizes stay until the launch above is done: freed in stream order.
                drop(sizes);
                Prepared::Views {
                    views,
                    bitmap,
                    offset,
                    slot: bytes_slot,
                    buffers,
                    bytes,
                }
            }
            data_type => {
                // A dictionary's keys move as the fixed-width integers they are.
                let width = match data_type {
                    DataType::Dictionary(key_type, _) => fixed_width(key_type),
                    _ => fixed_width(data_type),
                };
                let width = width.ok_or_else(|| {
                    ComputeError::Input(format!("column `{name}`: {data_type} is not compacted"))
                })?;
                if (values.len() as u64) < u64::from(width) * (offset + n as u64) {
                    return Err(
                        ComputeError::Input(format!("column `{name}`: values too short")).into(),
                    );
                }
                let values = start + u64::from(width) * offset;
                aligned(values, u64::from(width.min(8)), name)?;
                self.held.push(view);
                Prepared::Fixed { values, width }
            }
        };
        let dictionary = match c.dictionary() {
            Some(values) => Some(Box::new(self.prepare_whole(&values, name)?)),
            None => None,
        };
        Ok(Moved {
            prepared,
            validity,
            dictionary,
            children: Vec::new(),
            items: None,
        })
    }

    /// Prepares union `c` (of `fields` in `mode`, `n` rows at offset 0, kept by `scan`):
    /// its type ids as fixed-width values; a sparse union's children as columns are; a
    /// dense union's children by their kept items' scans (`union_marks` of each type, a
    /// scan, the count read back at the next extra slot), its offsets made anew once the
    /// counts are known (`union_offsets`).
    fn prepare_union(
        &mut self,
        c: &DeviceColumn<'a>,
        name: &str,
        (fields, mode): (&UnionFields, UnionMode),
        (scan, n): (u64, usize),
    ) -> Result<Moved, BoxError> {
        let (cx, cuda, e) = (self.cx, self.cuda, self.e);
        let s = cx.stream;
        let type_ids = c
            .buffer(0)
            .ok_or_else(|| ComputeError::Input(format!("column `{name}`: no type ids")))?;
        if (type_ids.len() as u64) < n as u64 {
            return Err(ComputeError::Input(format!("column `{name}`: type ids too short")).into());
        }
        let type_ids = type_ids.cuda_view::<u8>(s)?;
        let ids_at = type_ids.device_ptr();
        self.held.push(type_ids);
        let children = c.children();
        let mut moved = Vec::with_capacity(children.len());
        let dense = match mode {
            UnionMode::Sparse => {
                for child in &children {
                    moved.push(self.prepare(child, name, (scan, n))?);
                }
                None
            }
            UnionMode::Dense => {
                let offsets = c.buffer(1).ok_or_else(|| {
                    ComputeError::Input(format!("column `{name}`: no union offsets"))
                })?;
                if (offsets.len() as u64) < 4 * n as u64 {
                    return Err(ComputeError::Input(format!(
                        "column `{name}`: union offsets too short"
                    ))
                    .into());
                }
                let offsets = offsets.cuda_view::<u8>(s)?;
                let offsets_at = offsets.device_ptr();
                aligned(offsets_at, 4, name)?;
                self.held.push(offsets);
                let mut kinds = Vec::with_capacity(children.len());
                for ((type_id, _), child) in fields.iter().zip(&children) {
                    let len = child.len();
                    let marks = cx.zeros::<i64>(len)?;
                    let at = addr(&marks, s);
                    cx.launch(
                        &cx.k.union_marks,
                        n,
                        &[
                            A::U64(scan),
                            A::U64(ids_at),
                            A::U64(offsets_at),
                            A::U64(n as u64),
                            A::U32(type_id as i32 as u32),
                            A::U64(len as u64),
                            A::U64(at),
                            A::U64(e),
                        ],
                    )?;
                    // SAFETY: `marks` holds `len` i64s on this device, zeroed and marked on
                    // the stream the scan runs on (in order after them).
                    unsafe { cuda.inclusive_scan_i64(at as *mut std::ffi::c_void, len as u64) }?;
                    let slot = self.next_extra;
                    self.next_extra += 1;
                    copy_last(cx, &marks, len, &mut self.scalars, slot)?;
                    moved.push(self.prepare(child, name, (at, len))?);
                    kinds.push(UnionChild {
                        type_id,
                        scan: marks,
                        len,
                        slot,
                    });
                }
                Some(DenseUnion {
                    offsets: offsets_at,
                    children: kinds,
                })
            }
        };
        Ok(Moved {
            prepared: Prepared::Union {
                type_ids: ids_at,
                dense,
            },
            validity: None,
            dictionary: None,
            children: moved,
            items: None,
        })
    }

    /// Prepares variable-size list `c` (a `List`, `LargeList` or `Map` of `n` rows, kept
    /// by `scan`; its bitmap already compacted into `validity`): its kept rows' lengths
    /// (`kept_lengths`, bounded by its items) scanned, their sum read back at `slot`,
    /// and the scan of its items (`list_items`) by which its items are prepared.
    fn prepare_list(
        &mut self,
        c: &DeviceColumn<'a>,
        name: &str,
        (scan, n): (u64, usize),
        validity: Option<Validity>,
        slot: usize,
    ) -> Result<Moved, BoxError> {
        let (cx, cuda, e) = (self.cx, self.cuda, self.e);
        let s = cx.stream;
        let child = c
            .child(0)
            .ok_or_else(|| ComputeError::Input(format!("column `{name}`: no list items")))?;
        let items = child.len();
        let (source, _) = string_source(c, n, name, s, &mut self.held)?;
        let lengths = cx.zeros::<i64>(n)?;
        cx.launch(
            &cx.k.kept_lengths,
            n,
            &[
                A::U64(scan),
                A::U64(source.offsets),
                A::U32(u32::from(source.wide)),
                A::U64(items as u64),
                A::U64(n as u64),
                A::U64(addr(&lengths, s)),
                A::U64(e),
            ],
        )?;
        let at = addr(&lengths, s);
        // SAFETY: `lengths` holds `n` i64s on this device, written by `kept_lengths` on the
        // stream the scan runs on (in order after it).
        unsafe { cuda.inclusive_scan_i64(at as *mut std::ffi::c_void, n as u64) }?;
        copy_last(cx, &lengths, n, &mut self.scalars, slot)?;
        let scan_items = cx.zeros::<i64>(items)?;
        let items_at = addr(&scan_items, s);
        cx.launch(
            &cx.k.list_items,
            n.max(items),
            &[
                A::U64(scan),
                A::U64(source.offsets),
                A::U32(u32::from(source.wide)),
                A::U64(n as u64),
                A::U64(at),
                A::U64(items as u64),
                A::U64(items_at),
                A::U64(e),
            ],
        )?;
        let moved = self.prepare(&child, name, (items_at, items))?;
        Ok(Moved {
            prepared: Prepared::List {
                slot,
                lengths,
                wide: source.wide,
                items,
            },
            validity,
            dictionary: None,
            children: vec![moved],
            items: Some(scan_items),
        })
    }

    /// Prepares every value of `values` (a dictionary's) as [`Moves::prepare`] does: a
    /// scan that keeps them all (`fill_lanes`, devarrow's scan).
    fn prepare_whole(
        &mut self,
        values: &DeviceColumn<'a>,
        name: &str,
    ) -> Result<WholeArray, BoxError> {
        let (cx, s) = (self.cx, self.cx.stream);
        let rows = values.len();
        let all = cx.lanes(rows.max(1))?;
        cx.launch(
            &cx.k.fill_lanes,
            rows,
            &[
                A::U64(addr(&all.values, s)),
                A::U64(addr(&all.valid, s)),
                A::U64(rows as u64),
                A::I64(1),
                A::U32(1),
            ],
        )?;
        let at = addr(&all.values, s);
        // SAFETY: `all.values` holds at least `rows` i64s on this device, written by
        // `fill_lanes` on the stream the scan runs on (in order after it).
        unsafe {
            self.cuda
                .inclusive_scan_i64(at as *mut std::ffi::c_void, rows as u64)
        }?;
        let moved = self.prepare(values, name, (at, rows))?;
        Ok(WholeArray {
            moved,
            rows,
            scan: all.values,
        })
    }
}

impl Moved {
    /// The moved array of `dt` (`m` rows of `n`, kept by `scan`), once the read-back
    /// scalars are `read`; `None` where the strings kept exceed their offsets' range.
    /// The scans of dictionaries' values go to `scans`, held until the launches that
    /// read them are enqueued.
    fn array(
        self,
        cx: &Cx<'_>,
        dt: &DataType,
        (scan, n, m): (u64, usize, usize),
        read: &[i64],
        scans: &mut Vec<CudaSlice<i64>>,
    ) -> Result<Option<CudaArray>, BoxError> {
        let s = cx.stream;
        let validity = self.validity.map(|v| {
            let nulls = m.saturating_sub(read[v.slot].max(0) as usize);
            (v.bits, Some(nulls))
        });
        match (self.dictionary, dt) {
            (Some(values), DataType::Dictionary(key_type, value_type)) => {
                let keys = self
                    .prepared
                    .flat(cx, key_type, (scan, n, m), read, validity)?;
                let Some(keys) = keys else {
                    return Ok(None);
                };
                let WholeArray {
                    moved,
                    rows,
                    scan: all,
                } = *values;
                let at = addr(&all, s);
                scans.push(all);
                let Some(values) = moved.array(cx, value_type, (at, rows, rows), read, scans)?
                else {
                    return Ok(None);
                };
                // SAFETY: the keys are the column's own, moved: each valid one indexes the
                // dictionary's values, all of them moved in order.
                return Ok(Some(unsafe { CudaArray::from_dictionary(keys, values) }?));
            }
            (None, DataType::Union(fields, mode)) => {
                let Prepared::Union { type_ids, dense } = self.prepared else {
                    return Err(ComputeError::Input(format!("{dt}: no union moved")).into());
                };
                let ids = cx.zeros::<i8>(m)?;
                cx.launch(
                    &cx.k.compact_fixed,
                    n,
                    &[
                        A::U64(scan),
                        A::U64(type_ids),
                        A::U32(1),
                        A::U64(addr(&ids, s)),
                        A::U64(n as u64),
                    ],
                )?;
                let mut children = Vec::with_capacity(fields.len());
                let offsets = match dense {
                    None => {
                        for (child, (_, field)) in self.children.into_iter().zip(fields.iter()) {
                            match child.array(cx, field.data_type(), (scan, n, m), read, scans)? {
                                Some(child) => children.push(child),
                                None => return Ok(None),
                            }
                        }
                        None
                    }
                    Some(DenseUnion {
                        offsets,
                        children: kinds,
                    }) => {
                        let out = cx.zeros::<i32>(m)?;
                        let moved = self.children.into_iter().zip(fields.iter());
                        for ((child, (_, field)), kind) in moved.zip(kinds) {
                            // A child none of whose items is kept: the host's (nothing
                            // to allocate them in).
                            let kept = read[kind.slot].max(0) as usize;
                            if kept == 0 {
                                return Ok(None);
                            }
                            let at = addr(&kind.scan, s);
                            cx.launch(
                                &cx.k.union_offsets,
                                n,
                                &[
                                    A::U64(scan),
                                    A::U64(type_ids),
                                    A::U64(offsets),
                                    A::U64(n as u64),
                                    A::U32(kind.type_id as i32 as u32),
                                    A::U64(at),
                                    A::U64(addr(&out, s)),
                                ],
                            )?;
                            scans.push(kind.scan);
                            let items = (at, kind.len, kept);
                            match child.array(cx, field.data_type(), items, read, scans)? {
                                Some(child) => children.push(child),
                                None => return Ok(None),
                            }
                        }
                        Some(out)
                    }
                };
                // The type ids are the column's own, moved with their rows; a dense
                // union's offsets each its row's item among its child's kept ones
                // (`union_marks` checked every kept row's offset against its child).
                // SAFETY: so every type id is one of the fields', every offset in its
                // child.
                return Ok(Some(unsafe {
                    CudaArray::from_union(fields.clone(), *mode, ids, offsets, children)
                }?));
            }
            (None, DataType::Struct(fields)) => {
                let mut children = Vec::with_capacity(fields.len());
                for (child, field) in self.children.into_iter().zip(fields.iter()) {
                    match child.array(cx, field.data_type(), (scan, n, m), read, scans)? {
                        Some(child) => children.push(child),
                        None => return Ok(None),
                    }
                }
                return Ok(Some(CudaArray::from_struct(
                    fields.clone(),
                    children,
                    validity,
                )?));
            }
            (None, DataType::FixedSizeList(field, k)) => {
                let (Some(items), Some(child)) = (self.items, self.children.into_iter().next())
                else {
                    return Err(ComputeError::Input(format!("{dt}: no items moved")).into());
                };
                let k = usize::try_from(*k).unwrap_or(0);
                let kept = (addr(&items, s), n * k, m * k);
                scans.push(items);
                let Some(values) = child.array(cx, field.data_type(), kept, read, scans)? else {
                    return Ok(None);
                };
                return Ok(Some(CudaArray::from_fixed_size_list(
                    field.clone(),
                    k,
                    values,
                    validity,
                )?));
            }
            (
                None,
                DataType::List(field) | DataType::LargeList(field) | DataType::Map(field, _),
            ) => {
                let (
                    Prepared::List {
                        slot,
                        lengths,
                        wide,
                        items,
                    },
                    Some(scan_items),
                    Some(child),
                ) = (self.prepared, self.items, self.children.into_iter().next())
                else {
                    return Err(ComputeError::Input(format!("{dt}: no items moved")).into());
                };
                // No item kept (nothing to allocate them in), or more than i32 offsets
                // reach: the host's.
                let total = read[slot].max(0) as usize;
                if total == 0 || (!wide && total > i32::MAX as usize) {
                    return Ok(None);
                }
                let kept = (addr(&scan_items, s), items, total);
                scans.push(scan_items);
                let Some(values) = child.array(cx, field.data_type(), kept, read, scans)? else {
                    return Ok(None);
                };
                let launch = |out: u64| {
                    cx.launch(
                        &cx.k.compact_offsets,
                        n,
                        &[
                            A::U64(scan),
                            A::U64(addr(&lengths, s)),
                            A::U32(u32::from(wide)),
                            A::U64(n as u64),
                            A::U64(out),
                        ],
                    )
                };
                // `compact_offsets` writes each kept row's end (the scan of the lengths
                // `kept_lengths` read from the rows' own checked ranges) after the first
                // offset, 0: non-decreasing to `total`, the items moved (`list_items`
                // checked every row's offsets, else the error word left this to the host).
                let array = if wide {
                    let offsets = cx.zeros::<i64>(m + 1)?;
                    launch(addr(&offsets, s))?;
                    // SAFETY: so the offsets delimit the moved items.
                    unsafe { CudaArray::from_list(dt.clone(), offsets, values, validity) }?
                } else {
                    let offsets = cx.zeros::<i32>(m + 1)?;
                    launch(addr(&offsets, s))?;
                    // SAFETY: as above.
                    unsafe { CudaArray::from_list(dt.clone(), offsets, values, validity) }?
                };
                scans.push(lengths);
                return Ok(Some(array));
            }
            _ => {}
        }
        self.prepared.flat(cx, dt, (scan, n, m), read, validity)
    }
}

impl Prepared {
    /// The moved values of a flat array of `dt` (a dictionary's keys too), with
    /// `validity`.
    fn flat(
        self,
        cx: &Cx<'_>,
        dt: &DataType,
        (scan, n, m): (u64, usize, usize),
        read: &[i64],
        validity: Option<(CudaSlice<u8>, Option<usize>)>,
    ) -> Result<Option<CudaArray>, BoxError> {
        let s = cx.stream;
        let dt = dt.clone();
        Ok(Some(match self {
            Prepared::Struct | Prepared::List { .. } | Prepared::Union { .. } => {
                return Err(ComputeError::Input(format!("{dt} is not a flat type")).into())
            }
            Prepared::Fixed { values, width } => Fixed {
                scan,
                values,
                width,
                n,
                m,
            }
            .array(cx, dt, validity)?,
            Prepared::Bits { bits } => CudaArray::from_bits(m, bits, validity)?,
            Prepared::Strings {
                source,
                slot,
                bytes,
            } => {
                let total = read[slot].max(0) as usize;
                if !source.wide && total > i32::MAX as usize {
                    return Ok(None);
                }
                compacted_strings(cx, dt, (scan, n, m), source, &bytes, total, validity)?
            }
            Prepared::Views {
                views,
                bitmap,
                offset,
                slot,
                buffers,
                bytes,
            } => {
                let total = read[slot].max(0) as usize;
                if total > i32::MAX as usize {
                    return Ok(None);
                }
                let out_views = cx.zeros::<u128>(m)?;
                let out_data = cx.zeros::<u8>(total.max(1))?;
                cx.launch(
                    &cx.k.compact_views,
                    n,
                    &[
                        A::U64(scan),
                        A::U64(views),
                        A::U64(bitmap),
                        A::U64(offset),
                        A::U64(addr(&buffers, s)),
                        A::U64(addr(&bytes, s)),
                        A::U64(addr(&out_views, s)),
                        A::U64(addr(&out_data, s)),
                        A::U64(n as u64),
                    ],
                )?;
                // `compact_views` wrote a view per kept row, on this stream: inline values
                // as they were, long ones copied into `out_data` (sized by the scan).
                // SAFETY: so every view lies in `out_data` (bounds checked by
                // `view_bytes`), and the bytes are the column's: still UTF-8.
                unsafe { CudaArray::from_views(dt, out_views, vec![out_data], validity) }?
            }
        }))
    }
}

/// Copies the last of `n` i64s of `from` into `to[at]` (stream order, no host wait).
pub(super) fn copy_last(
    cx: &Cx<'_>,
    from: &CudaSlice<i64>,
    n: usize,
    to: &mut CudaSlice<i64>,
    at: usize,
) -> Result<(), BoxError> {
    cx.stream
        .memcpy_dtod(&from.slice(n - 1..n), &mut to.slice_mut(at..at + 1))?;
    Ok(())
}

/// `compact_bits` of the bitmap at `bits` (bit `offset` for the first row) into `out`,
/// adding its set bits to the i64 at `count` (0: not counted).
fn compact_bits(
    cx: &Cx<'_>,
    scan: u64,
    bits: u64,
    offset: u64,
    out: &CudaSlice<u8>,
    n: usize,
    count: u64,
) -> Result<(), BoxError> {
    launch_bits(cx, &cx.k.compact_bits, scan, bits, offset, out, n, count)
}

/// A kernel that writes a bitmap of `n` rows as whole u32 words, one thread per word
/// (`compact_bits` of rows kept by the scan at `rows`, `gather_bits` of the rows at
/// `rows`), from the bitmap at `bits` (bit `offset` for row 0) into `out`, adding its set
/// bits to the i64 at `count` (0: not counted).
#[allow(clippy::too_many_arguments)]
pub(super) fn launch_bits(
    cx: &Cx<'_>,
    kernel: &devarrow::cuda::cudarc::driver::CudaFunction,
    rows: u64,
    bits: u64,
    offset: u64,
    out: &CudaSlice<u8>,
    n: usize,
    count: u64,
) -> Result<(), BoxError> {
    cx.launch(
        kernel,
        n.div_ceil(32),
        &[
            A::U64(rows),
            A::U64(bits),
            A::U64(offset),
            A::U64(addr(out, cx.stream)),
            A::U64(n as u64),
            A::U64(count),
        ],
    )
}

/// A fixed-width column's kept rows (`compact_fixed`): `width`-byte values at `values`,
/// `n` rows scanned (`scan`), `m` kept.
struct Fixed {
    scan: u64,
    values: u64,
    width: u32,
    n: usize,
    m: usize,
}

impl Fixed {
    /// The kept rows as an array of `dt`, with `validity`.
    fn array(
        &self,
        cx: &Cx<'_>,
        dt: DataType,
        validity: Option<(CudaSlice<u8>, Option<usize>)>,
    ) -> Result<CudaArray, BoxError> {
        fixed_array(cx, dt, self.width, self.m, validity, |out| {
            cx.launch(
                &cx.k.compact_fixed,
                self.n,
                &[
                    A::U64(self.scan),
                    A::U64(self.values),
                    A::U32(self.width),
                    A::U64(out),
                    A::U64(self.n as u64),
                ],
            )
        })
    }
}

/// An array of `dt` of `m` rows of `width`-byte values, with `validity`: its values
/// allocated zeroed on the stream, then written by `fill`, given their address.
pub(super) fn fixed_array(
    cx: &Cx<'_>,
    dt: DataType,
    width: u32,
    m: usize,
    validity: Option<(CudaSlice<u8>, Option<usize>)>,
    fill: impl FnOnce(u64) -> Result<(), BoxError>,
) -> Result<CudaArray, BoxError> {
    fn typed<T: DeviceNative + ValidAsZeroBits>(
        cx: &Cx<'_>,
        dt: DataType,
        m: usize,
        validity: Option<(CudaSlice<u8>, Option<usize>)>,
        fill: impl FnOnce(u64) -> Result<(), BoxError>,
    ) -> Result<CudaArray, BoxError> {
        let out = cx.stream.alloc_zeros::<T>(m)?;
        fill(addr(&out, cx.stream))?;
        Ok(match validity {
            Some((bits, nulls)) => CudaArray::with_validity(dt, out, bits, nulls)?,
            None => CudaArray::from_values(dt, out)?,
        })
    }
    macro_rules! first_fit {
        ($($t:ty),*) => {
            $(if <$t>::fits(&dt) && size_of::<$t>() == width as usize {
                return typed::<$t>(cx, dt, m, validity, fill);
            })*
        };
    }
    first_fit!(i8, u8, i16, u16, i32, u32, f32, i64, u64, f64, i128);
    Err(ComputeError::Input(format!("no CUDA array of {dt}")).into())
}

/// The bytes of data buffers each kept row's view names (`view_bytes`, into `n` i64s:
/// the rows of `c`, a view column whose views start at `views`, its first row; kept where
/// the inclusive scan at `scan` steps), each view checked to lie in its buffer (error word
/// 4 at `err` where one does not). `tables`: its variadic buffers' sizes and their count
/// ([`variadic_tables`]).
pub(super) fn view_bytes(
    cx: &Cx<'_>,
    c: &DeviceColumn<'_>,
    views: u64,
    scan: u64,
    tables: (&CudaSlice<u64>, u64),
    n: usize,
    err: u64,
) -> Result<CudaSlice<i64>, BoxError> {
    let s = cx.stream;
    let (sizes, count) = tables;
    let bytes = cx.zeros::<i64>(n)?;
    cx.launch(
        &cx.k.view_bytes,
        n,
        &[
            A::U64(scan),
            A::U64(views),
            A::U64(c.validity().map_or(0, |b| b.address())),
            A::U64(c.offset() as u64),
            A::U64(addr(sizes, s)),
            A::U64(count),
            A::U64(addr(&bytes, s)),
            A::U64(n as u64),
            A::U64(err),
        ],
    )?;
    Ok(bytes)
}

/// The kept rows of an offset-based column of `dt` (`n` rows, `m` kept by the
/// selection's scan `scan`; their lengths scanned in `bytes`, `total` in all): their
/// offsets and bytes (`compact_strings`).
fn compacted_strings(
    cx: &Cx<'_>,
    dt: DataType,
    (scan, n, m): (u64, usize, usize),
    source: StringSource,
    bytes: &CudaSlice<i64>,
    total: usize,
    validity: Option<(CudaSlice<u8>, Option<usize>)>,
) -> Result<CudaArray, BoxError> {
    let s = cx.stream;
    let data = cx.zeros::<u8>(total)?;
    let data_at = addr(&data, s);
    // `compact_strings` writes the m + 1 offsets (0, then each kept row's end: the scan
    // of the lengths `kept_lengths` read from the column's own checked ranges) and
    // copies each kept row's bytes, in bounds of `data` (`total`, the scan's last).
    // SAFETY: so the offsets are non-decreasing from 0 to `data.len()`, each value bytes
    // of a value of the column's own type (UTF-8 where it was).
    unsafe {
        offset_array(cx, dt, (source.wide, m), data, validity, |out_offsets| {
            cx.launch(
                &cx.k.compact_strings,
                n,
                &[
                    A::U64(scan),
                    A::U64(addr(bytes, s)),
                    A::U64(source.offsets),
                    A::U32(u32::from(source.wide)),
                    A::U64(source.data),
                    A::U64(n as u64),
                    A::U64(out_offsets),
                    A::U64(data_at),
                ],
            )
        })
    }
}
