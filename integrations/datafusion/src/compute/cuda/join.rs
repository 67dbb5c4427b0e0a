//! A device hash join on CUDA ([`crate::compute::join`]): the probe (`join_probe`) and
//! the build columns gathered to the probe rows (`gather_fixed`, `gather_bits`; a view
//! column's views gathered, its data buffers copied whole). No host wait, except one
//! read-back of the null counts when a gathered build column has a validity bitmap.

use std::sync::Arc;

use arrow_schema::{DataType, Field, Schema};
use devarrow::bridge::{DeviceBatch, DeviceColumn};
use devarrow::cuda::cudarc::driver::CudaSlice;
use devarrow::cuda::{CudaArray, CudaDevice, CudaSyncEvent};

use super::compact::{fixed_array, launch_bits, view_bytes};
use super::{
    addr, aligned, context, eval, offset_array, pending, selected, string_source, variadic_copies,
    variadic_tables, view_args, view_device_column, Cx, StringSource, A,
};
use crate::compute::host::frame_column;
use crate::compute::{fixed_width, ComputeError, DeviceExpr, SELECTION};
use crate::error::BoxError;
use crate::frame::{schema_of, DeviceFrame, FrameColumn};
use crate::step::ExecDevice;

/// The address of `c`'s buffer `b` at its first row (`width` bytes per row), checked to
/// hold `rows` rows from there, and the view that keeps it readable on the stream.
fn at_first_row<'a>(
    cx: &Cx<'_>,
    c: &DeviceColumn<'a>,
    b: usize,
    width: u64,
    name: &str,
) -> Result<(u64, devarrow::cuda::BorrowedSlice<'a, u8>), BoxError> {
    let buffer = c
        .buffer(b)
        .ok_or_else(|| ComputeError::Input(format!("column `{name}` without buffer {b}")))?;
    let end = (c.offset() + c.len()) as u64;
    if (buffer.len() as u64) < width * end {
        return Err(ComputeError::Input(format!("column `{name}`: buffer {b} too short")).into());
    }
    let view = buffer.cuda_view::<u8>(cx.stream)?;
    let start = view.device_ptr() + width * c.offset() as u64;
    aligned(start, width.clamp(1, 8), name)?;
    Ok((start, view))
}

/// The build side's table on the device: its columns the output takes, its keys (one
/// `Int64` column of `k * rows` lanes, key-major) and its slots then each row's next row
/// of its key + 1 (one `UInt32` column of `capacity + rows`).
#[derive(Debug)]
pub(crate) struct DeviceTables {
    pub(crate) payload: DeviceBatch,
    /// The string keys' values (`Utf8View`, a column per key), compared with a probe
    /// value's where their lanes agree (`join_verify_view`).
    pub(crate) strings: Option<DeviceBatch>,
    pub(crate) keys: DeviceBatch,
    pub(crate) slots: DeviceBatch,
}

/// The build rows a partition's probe rows matched (`join_mark`): one `UInt8` column of a
/// flag per build row, uploaded zeroed when the table is bound, written on the device by
/// each frame's probe (on the stream of the frame's slot) and read once when the
/// partition's probe side has ended ([`Marks::read`]).
#[derive(Debug)]
pub(crate) struct Marks {
    pub(crate) flags: DeviceBatch,
    /// The events after each frame's marks, on whichever stream the frame ran: the read
    /// waits for them on its own (on the device). Those already complete are dropped
    /// as new ones come.
    events: std::sync::Mutex<Vec<CudaSyncEvent>>,
}

impl Marks {
    /// Flags uploaded zeroed (`zeros`, a batch of one `UInt8` column of the build rows).
    pub(crate) fn new(flags: DeviceBatch) -> Self {
        Self {
            flags,
            events: std::sync::Mutex::default(),
        }
    }

    /// The flags on the host, once every frame's marks are done: this stream waits for
    /// them (on the device), then one read-back.
    pub(crate) fn read(&self, cuda: &Arc<CudaDevice>) -> Result<Vec<u8>, BoxError> {
        let cx = context(cuda)?;
        let events = std::mem::take(&mut *self.events.lock().unwrap_or_else(|e| e.into_inner()));
        for event in &events {
            event.wait_on(cx.stream)?;
        }
        let c = self.flags.column(0).ok_or("no marks")?;
        let (_, view) = at_first_row(&cx, &c, 1, 1, "marks")?;
        let rows = c.len();
        let mut flags = vec![0u8; rows];
        if rows > 0 {
            let from = c.offset()..c.offset() + rows;
            cx.stream.memcpy_dtoh(&view.slice(from), &mut flags)?;
        }
        cx.stream.synchronize()?;
        drop((view, events));
        Ok(flags)
    }

    /// Marks the build rows `rows` (a join's output rows' build rows, ~0: none) of the
    /// rows `selection` keeps (those that passed the join's filter), and remembers when
    /// they are done. On the stream `rows` and `selection` were made on.
    pub(crate) fn mark_rows(
        &self,
        cuda: &Arc<CudaDevice>,
        rows: &CudaSlice<u32>,
        selection: &FrameColumn,
        n: usize,
    ) -> Result<(), BoxError> {
        let cx = context(cuda)?;
        let sel = selection.column();
        if sel.len() != n || sel.data_type() != &DataType::UInt8 || rows.len() < n {
            return Err(ComputeError::Input("a join's output rows of another size".into()).into());
        }
        let (sel_at, sel_view) = at_first_row(&cx, &sel, 1, 1, "selection")?;
        // Every row index `join_mark_rows` follows is below the build rows (the table's
        // rows, gathered by them).
        let rows = A::U64(addr(rows, cx.stream));
        self.write(
            &cx,
            &cx.k.join_mark_rows,
            n,
            [rows, A::U64(sel_at), A::U64(n as u64)],
        )?;
        drop(sel_view);
        Ok(())
    }

    /// Launches `kernel` over `n` rows with `args` then the flags' address (a kernel that
    /// writes into them), and remembers when it is done.
    fn write(
        &self,
        cx: &Cx<'_>,
        kernel: &devarrow::cuda::cudarc::driver::CudaFunction,
        n: usize,
        args: [A; 3],
    ) -> Result<(), BoxError> {
        let c = self.flags.column(0).ok_or("no marks")?;
        let (flags, view) = at_first_row(cx, &c, 1, 1, "marks")?;
        // The kernel writes into the flags: a buffer devarrow uploaded for this bound join
        // alone (never handed out), one byte per build row, at the build rows its
        // arguments name (the callers say why they are below the build rows).
        let [a, b, c] = args;
        cx.launch(kernel, n, &[a, b, c, A::U64(flags)])?;
        drop(view);
        let event = CudaSyncEvent::record(cx.stream)?;
        let mut events = self.events.lock().unwrap_or_else(|e| e.into_inner());
        events.retain(|e| !e.is_complete().unwrap_or(false));
        events.push(event);
        Ok(())
    }

    /// Marks the build rows of each probe row's key (`idx`: each probe row's first
    /// build row, or ~0; `next`: the chains' address) and remembers when they are done.
    fn mark(&self, cx: &Cx<'_>, idx: &CudaSlice<u32>, next: u64, n: usize) -> Result<(), BoxError> {
        // Every row index `join_mark` follows is a build row of the table's chains.
        let idx = A::U64(addr(idx, cx.stream));
        self.write(
            cx,
            &cx.k.join_mark,
            n,
            [idx, A::U64(next), A::U64(n as u64)],
        )
    }
}

/// What a probe on the device reads of a join (`crate::compute::join::BuiltJoin`).
pub(crate) struct Probe<'a> {
    /// The build side's table.
    pub(crate) tables: &'a DeviceTables,
    /// The probe side's key lanes, one per lane of the build keys.
    pub(crate) keys: &'a [DeviceExpr],
    /// The probe columns of the string keys among them (index, name), in the order of
    /// the table's string key columns (compared byte by byte where lanes agree).
    pub(crate) strings: Vec<(usize, &'a str)>,
    /// The build side's rows.
    pub(crate) rows: usize,
    /// The slots' count - 1 (a power of two - 1).
    pub(crate) mask: u64,
    /// An anti join: a selected row that matches nothing is in the output.
    pub(crate) anti: bool,
    /// A right join: the build columns' last is the all-true matched one, and a selected
    /// row that matches nothing is kept.
    pub(crate) right: bool,
    /// Whether the output takes build columns (an inner, right or left join).
    pub(crate) gathers: bool,
    /// Where the probe marks the build rows it matches (a join whose output is build
    /// rows, without a filter): the partition's marks.
    pub(crate) marks: Option<&'a Marks>,
}

/// The join of `frame` with `p`'s table on the device: the output's selection
/// (`UInt8`), the build columns gathered to the probe rows (where the output or its
/// filter takes some), and each probe row's build row (~0: none).
pub(crate) fn join(
    p: &Probe<'_>,
    frame: &DeviceFrame,
    cuda: &Arc<CudaDevice>,
    device: &ExecDevice,
) -> Result<(FrameColumn, Option<DeviceBatch>, CudaSlice<u32>), BoxError> {
    let n = frame.num_rows();
    let cx = context(cuda)?;
    let (idx, hit, _) = probe(&cx, p, frame)?;
    let selection = CudaArray::from_values(DataType::UInt8, hit)?;
    let schema = schema_of(vec![Field::new(SELECTION, DataType::UInt8, false)]);
    let selection =
        DeviceBatch::from_cuda_arrays(device.device().clone(), schema, vec![selection])?;
    let selection = FrameColumn::single(selection)?;
    if !p.gathers || p.tables.payload.schema().fields().is_empty() {
        return Ok((selection, None, idx));
    }
    let gathered = gather_batch(&cx, &p.tables.payload, &idx, n, device, p.right)?;
    Ok((selection, Some(gathered), idx))
}

/// The probe of `frame` in `p`'s table for its marks only (a left semi or anti join:
/// the build rows its rows match, marked on the device).
pub(crate) fn mark(
    p: &Probe<'_>,
    frame: &DeviceFrame,
    cuda: &Arc<CudaDevice>,
) -> Result<(), BoxError> {
    let cx = context(cuda)?;
    let (idx, hit, sel) = probe(&cx, p, frame)?;
    drop((idx, hit, sel));
    Ok(())
}

/// The selection of `frame`'s rows that a semi join with a filter keeps (those with a
/// pair that passed), or an anti join (the selected rows without one). `passed`: the
/// inner join's selection over its output rows (a pair each, kept where it passed), each
/// output row's probe row (`None`: output row `i` is probe row `i`), and the output rows;
/// `None` where the join made no pair.
pub(crate) fn kept_probe_rows(
    frame: &DeviceFrame,
    passed: Option<(&FrameColumn, Option<&CudaSlice<u32>>, usize)>,
    anti: bool,
    cuda: &Arc<CudaDevice>,
    device: &ExecDevice,
) -> Result<FrameColumn, BoxError> {
    let n = frame.num_rows();
    let cx = context(cuda)?;
    let s = cx.stream;
    let err = cx.zeros::<u32>(1)?;
    let selected = selected(&cx, None, frame, addr(&err, s))?;
    let mut with_pair = cx.zeros::<u8>(n)?;
    if let Some((selection, probe_rows, rows)) = passed {
        let pass = selection.column();
        if pass.len() != rows || pass.data_type() != &DataType::UInt8 {
            return Err(ComputeError::Input("a join's selection of another size".into()).into());
        }
        let (pass_at, pass_view) = at_first_row(&cx, &pass, 1, 1, "selection")?;
        match probe_rows {
            // Every probe row index is below the frame's rows (the pairs were made of
            // them); `with_pair` holds a byte per frame row.
            Some(probe_rows) if probe_rows.len() >= rows => cx.launch(
                &cx.k.join_mark_rows,
                rows,
                &[
                    A::U64(addr(probe_rows, s)),
                    A::U64(pass_at),
                    A::U64(rows as u64),
                    A::U64(addr(&with_pair, s)),
                ],
            )?,
            Some(_) => {
                return Err(ComputeError::Input("a join's pairs of another size".into()).into())
            }
            None if rows == n => {
                let from = pass.offset()..pass.offset() + n;
                s.memcpy_dtod(&pass_view.slice(from), &mut with_pair.slice_mut(0..n))?;
            }
            None => return Err(ComputeError::Input("a join's rows of another size".into()).into()),
        }
        drop(pass_view);
    }
    let kept = if anti {
        let kept = cx.zeros::<u8>(n)?;
        cx.launch(
            &cx.k.select_andnot,
            n,
            &[
                A::U64(addr(&selected, s)),
                A::U64(addr(&with_pair, s)),
                A::U64(addr(&kept, s)),
                A::U64(n as u64),
            ],
        )?;
        kept
    } else {
        with_pair
    };
    drop((selected, err));
    let column = CudaArray::from_values(DataType::UInt8, kept)?;
    let schema = schema_of(vec![Field::new(SELECTION, DataType::UInt8, false)]);
    let batch = DeviceBatch::from_cuda_arrays(device.device().clone(), schema, vec![column])?;
    Ok(FrameColumn::single(batch)?)
}

/// `flags` (a `UInt8` column: 0 or not) as a batch of one Boolean column (`field`):
/// packed into its values' bitmap on the device (`pack_bits`), no validity.
pub(crate) fn booleans(
    flags: &FrameColumn,
    field: Field,
    cuda: &Arc<CudaDevice>,
    device: &ExecDevice,
) -> Result<DeviceBatch, BoxError> {
    let cx = context(cuda)?;
    let c = flags.column();
    let n = c.len();
    if c.data_type() != &DataType::UInt8 {
        return Err(ComputeError::Input("flags that are not UInt8".into()).into());
    }
    let (at, view) = at_first_row(&cx, &c, 1, 1, "flags")?;
    let bits = cx.zeros::<u8>(n.div_ceil(8))?;
    // `pack_bits` reads the `n` flags at `at` (checked to hold them) and writes
    // ceil(n / 8) bytes into `bits`.
    cx.launch(
        &cx.k.pack_bits,
        n.div_ceil(8),
        &[A::U64(at), A::U64(addr(&bits, cx.stream)), A::U64(n as u64)],
    )?;
    drop(view);
    let column = CudaArray::from_bits(n, bits, None)?;
    Ok(DeviceBatch::from_cuda_arrays(
        device.device().clone(),
        Arc::new(Schema::new(vec![field.with_nullable(false)])),
        vec![column],
    )?)
}

/// The rows `rows` (below the build rows) of the table's payload, gathered on the
/// device (the index uploaded: 4 bytes a row).
pub(crate) fn gather_rows(
    tables: &DeviceTables,
    rows: &[u32],
    cuda: &Arc<CudaDevice>,
    device: &ExecDevice,
) -> Result<DeviceBatch, BoxError> {
    let cx = context(cuda)?;
    let idx = cx.stream.clone_htod(rows)?;
    gather_batch(&cx, &tables.payload, &idx, rows.len(), device, false)
}

/// What `join_probe` gives: each row's build row (or ~0), whether it is in the output,
/// and whether it was selected (u8 per row each).
type Probed = (CudaSlice<u32>, CudaSlice<u8>, CudaSlice<u8>);

/// `join_probe` of `frame` (its keys evaluated, its selection) in `built`'s table: each
/// row's build row (or ~0) and whether it is in the output (a match; no match for an
/// anti join).
fn probe(cx: &Cx<'_>, p: &Probe<'_>, frame: &DeviceFrame) -> Result<Probed, BoxError> {
    let tables = p.tables;
    let n = frame.num_rows();
    let s = cx.stream;
    let err = cx.zeros::<u32>(1)?;
    let e = addr(&err, s);
    let k = p.keys.len();
    let mut keys = cx.zeros::<i64>(k * n)?;
    let mut valid = cx.zeros::<u8>(k * n)?;
    let mut may_fail = false;
    for (j, key) in p.keys.iter().enumerate() {
        let lanes = eval(cx, &key.node, frame, e)?;
        s.memcpy_dtod(
            &lanes.values.slice(0..n),
            &mut keys.slice_mut(j * n..(j + 1) * n),
        )?;
        s.memcpy_dtod(
            &lanes.valid.slice(0..n),
            &mut valid.slice_mut(j * n..(j + 1) * n),
        )?;
        may_fail |= key.node.may_fail();
    }
    let sel = selected(cx, None, frame, e)?;
    let idx = cx.zeros::<u32>(n)?;
    let hit = cx.zeros::<u8>(n)?;
    let slots = tables.slots.column(0).ok_or("a join table without slots")?;
    let (slots_at, slots_view) = at_first_row(cx, &slots, 1, 4, "slots")?;
    let build_keys = tables.keys.column(0).ok_or("a join table without keys")?;
    let (keys_at, keys_view) = at_first_row(cx, &build_keys, 1, 8, "keys")?;
    if slots.len() as u64 != p.mask + 1 + p.rows as u64 || build_keys.len() != k * p.rows {
        return Err(ComputeError::Input("a join table of another size".into()).into());
    }
    cx.launch(
        &cx.k.join_probe,
        n,
        &[
            A::U64(addr(&keys, s)),
            A::U64(addr(&valid, s)),
            A::U64(addr(&sel, s)),
            A::U64(n as u64),
            A::U32(k as u32),
            A::U64(slots_at),
            A::U64(p.mask),
            A::U64(keys_at),
            A::U64(p.rows as u64),
            A::U64(addr(&idx, s)),
            A::U64(addr(&hit, s)),
            A::U32(p.anti as u32),
        ],
    )?;
    for (j, &key) in p.strings.iter().enumerate() {
        verify_strings(cx, p, frame, j, key, (&idx, &hit), e)?;
    }
    if let Some(marks) = p.marks {
        marks.mark(cx, &idx, slots_at + 4 * (p.mask + 1), n)?;
    }
    // The keys' overflow, if one can overflow (one read-back).
    if let Some(word) = pending(cx, err, "a join key", may_fail, true)? {
        word.check()?;
    }
    drop((slots_view, keys_view, keys, valid));
    Ok((idx, hit, sel))
}

/// `join_verify_view` for string key `j` (the probe column `index`, `name`, of
/// `frame`): each probe row whose build row was found by lanes that hash a long value
/// compares that value's bytes with the build row's, and matches nothing where they
/// differ.
fn verify_strings(
    cx: &Cx<'_>,
    p: &Probe<'_>,
    frame: &DeviceFrame,
    j: usize,
    (index, name): (usize, &str),
    (idx, hit): (&CudaSlice<u32>, &CudaSlice<u8>),
    err: u64,
) -> Result<(), BoxError> {
    let s = cx.stream;
    let n = frame.num_rows();
    let probe = view_args(cx, frame_column(frame, index, name)?, name, n, err)?;
    let strings = p
        .tables
        .strings
        .as_ref()
        .and_then(|b| b.column(j))
        .ok_or("a join table without its string keys")?;
    if strings.len() != p.rows {
        return Err(ComputeError::Input("a join table of another size".into()).into());
    }
    let (build, _) = view_device_column(strings, "string key")?;
    let (build_at, build_views) = at_first_row(cx, &build, 1, 16, "string key")?;
    let build_tables = variadic_tables(cx, &build)?;
    // Writes only idx and hit, each row its own (n of each, made by `probe`).
    cx.launch(
        &cx.k.join_verify_view,
        n,
        &[
            A::U64(addr(idx, s)),
            A::U64(addr(hit, s)),
            A::U64(n as u64),
            A::U32(p.anti as u32),
            A::U64(probe.first_view()),
        ]
        .into_iter()
        .chain(probe.tables())
        .chain([
            A::U64(build_at),
            A::U64(addr(&build_tables.0, s)),
            A::U64(addr(&build_tables.1, s)),
            A::U64(build_tables.2),
            A::U64(err),
        ])
        .collect::<Vec<_>>(),
    )?;
    drop((probe, build_views, build_tables));
    Ok(())
}

/// What an inner join whose build keys repeat makes of a probe frame on the device.
pub(crate) struct Expanded {
    /// The output rows (one per matching pair).
    pub(crate) rows: usize,
    /// The build columns, gathered to the pairs.
    pub(crate) build: Option<DeviceBatch>,
    /// The probe columns at `probe_columns`, gathered to the pairs.
    pub(crate) probe: Option<DeviceBatch>,
    /// The build row of each pair (~0: none; none when there are no pairs).
    pub(crate) build_rows: Option<CudaSlice<u32>>,
    /// The probe row of each pair (none when there are no pairs).
    pub(crate) probe_rows: Option<CudaSlice<u32>>,
}

/// The inner or right join of `frame` with `p`'s table whose keys repeat: the pairs of
/// matching rows (`join_probe`, `join_count`, devarrow's scan, one read-back of the
/// pair count, `join_expand`), each side's columns gathered to them (the probe frame's
/// `probe_columns`).
pub(crate) fn join_expanded(
    p: &Probe<'_>,
    frame: &DeviceFrame,
    probe_columns: &[usize],
    cuda: &Arc<CudaDevice>,
    device: &ExecDevice,
) -> Result<Expanded, BoxError> {
    use devarrow::abi::device::DeviceKernels;

    let tables = p.tables;
    let n = frame.num_rows();
    let cx = context(cuda)?;
    let s = cx.stream;
    let (idx, hit, sel) = probe(&cx, p, frame)?;
    drop(hit);
    let right = p.right;
    let table = tables.slots.column(0).ok_or("a join table without slots")?;
    let (slots_at, slots_view) = at_first_row(&cx, &table, 1, 4, "slots")?;
    let next = slots_at + 4 * (p.mask + 1);
    let incl = cx.zeros::<i64>(n)?;
    cx.launch(
        &cx.k.join_count,
        n,
        &[
            A::U64(addr(&idx, s)),
            A::U64(next),
            A::U64(addr(&incl, s)),
            A::U64(n as u64),
            A::U64(addr(&sel, s)),
            A::U32(right as u32),
        ],
    )?;
    let scan = addr(&incl, s);
    // SAFETY: `incl` holds `n` i64s on this device, written by `join_count` on the
    // device's stream, the stream the scan runs on (in order after it).
    unsafe { cuda.inclusive_scan_i64(scan as *mut std::ffi::c_void, n as u64) }?;
    // The probe side's view columns are gathered with their buffers copied whole: the
    // views of the rows that will be gathered are checked to lie in their buffers first
    // (`view_bytes`, error word 4), as the compaction checks them (a frame's columns may
    // come from a foreign import).
    let err = cx.zeros::<u32>(1)?;
    let e = addr(&err, s);
    let mut checked = Vec::new();
    for &i in probe_columns {
        let c = frame.columns()[i].column();
        if !matches!(c.data_type(), DataType::Utf8View | DataType::BinaryView) {
            continue;
        }
        let name = frame.schema().field(i).name();
        let (views, view) = at_first_row(&cx, &c, 1, 16, name)?;
        let (_buffers, sizes, count) = variadic_tables(&cx, &c)?;
        let bytes = view_bytes(&cx, &c, views, scan, (&sizes, count), n, e)?;
        checked.push((view, sizes, bytes));
    }
    let (mut total, mut word) = ([0i64], [0u32]);
    s.memcpy_dtoh(&incl.slice(n - 1..n), &mut total)?;
    s.memcpy_dtoh(&err, &mut word)?;
    s.synchronize()?;
    drop(checked);
    if word[0] != 0 {
        return Err(
            ComputeError::Input("a probe column's view points outside its buffers".into()).into(),
        );
    }
    let rows = total[0].max(0) as usize;
    if rows == 0 {
        drop((slots_view, idx, incl, sel));
        return Ok(Expanded {
            rows,
            build: None,
            probe: None,
            build_rows: None,
            probe_rows: None,
        });
    }
    let out_build = cx.zeros::<u32>(rows)?;
    let out_probe = cx.zeros::<u32>(rows)?;
    cx.launch(
        &cx.k.join_expand,
        n,
        &[
            A::U64(addr(&idx, s)),
            A::U64(next),
            A::U64(scan),
            A::U64(n as u64),
            A::U64(addr(&out_build, s)),
            A::U64(addr(&out_probe, s)),
        ],
    )?;
    drop((slots_view, idx, incl, sel));
    let build = if tables.payload.schema().fields().is_empty() {
        None
    } else {
        Some(gather_batch(
            &cx,
            &tables.payload,
            &out_build,
            rows,
            device,
            right,
        )?)
    };
    let probe = if probe_columns.is_empty() {
        None
    } else {
        let columns: Vec<_> = probe_columns
            .iter()
            .map(|&i| (frame.columns()[i].column(), frame.schema().field(i).clone()))
            .collect();
        Some(gather(&cx, &columns, &out_probe, rows, device, false)?)
    };
    Ok(Expanded {
        rows,
        build,
        probe,
        build_rows: Some(out_build),
        probe_rows: Some(out_probe),
    })
}

/// A Boolean column's values bitmap (buffer 1), readable on the stream.
fn values_bits<'a>(
    cx: &Cx<'_>,
    c: &DeviceColumn<'a>,
    what: &str,
) -> Result<devarrow::cuda::BorrowedSlice<'a, u8>, BoxError> {
    let values = c
        .buffer(1)
        .ok_or_else(|| ComputeError::Input(format!("{what}: no buffer")))?;
    Ok(values.cuda_view::<u8>(cx.stream)?)
}

/// `bitmap`, a bitmap of column `c` (its validity, or a Boolean's values: bit
/// `c.offset() + r` for row `r`), checked to hold the column's rows, then gathered by the
/// rows at `idx` to `n` rows (`gather_bits`: a zero bit where a row is ~0), its set bits
/// added to the i64 at `count` (0: not counted).
fn gather_bitmap(
    cx: &Cx<'_>,
    c: &DeviceColumn<'_>,
    bitmap: &devarrow::cuda::BorrowedSlice<'_, u8>,
    idx: u64,
    n: usize,
    count: u64,
    what: &str,
) -> Result<CudaSlice<u8>, BoxError> {
    if (bitmap.len() as u64) * 8 < (c.offset() + c.len()) as u64 {
        return Err(ComputeError::Input(format!("{what}: too short")).into());
    }
    let bits = cx.zeros::<u8>(4 * n.div_ceil(32))?;
    let offset = c.offset() as u64;
    launch_bits(
        cx,
        &cx.k.gather_bits,
        idx,
        bitmap.device_ptr(),
        offset,
        &bits,
        n,
        count,
    )?;
    Ok(bits)
}

/// A gathered column's array, made once its null count is known.
/// Its arguments: the validity with its null count, and the read-back scalars.
type Build<'a> = Box<
    dyn FnOnce(Option<(CudaSlice<u8>, Option<usize>)>, &[i64]) -> Result<CudaArray, BoxError> + 'a,
>;

/// Every column of `payload` gathered to `n` rows by `idx` (a build row, or none: zero
/// bits), as one batch of nullable columns.
fn gather_batch(
    cx: &Cx<'_>,
    payload: &DeviceBatch,
    idx: &CudaSlice<u32>,
    n: usize,
    device: &ExecDevice,
    right: bool,
) -> Result<DeviceBatch, BoxError> {
    let schema = payload.schema();
    let mut columns = Vec::with_capacity(schema.fields().len());
    for (i, field) in schema.fields().iter().enumerate() {
        let c = payload
            .column(i)
            .ok_or_else(|| ComputeError::Input(format!("no build column {i}")))?;
        columns.push((c, field.as_ref().clone()));
    }
    gather(cx, &columns, idx, n, device, right)
}

/// `columns` gathered to `n` rows by `idx` (a row of theirs, or none: zero bits), as one
/// batch of nullable columns. With `right` (a right join's build side), the last column
/// is the all-true matched one (`crate::compute::join::MATCHED`): gathered, it is the validity of the columns that have
/// none (null where a row has no build row), and it is not in the batch.
fn gather(
    cx: &Cx<'_>,
    columns: &[(DeviceColumn<'_>, Field)],
    idx: &CudaSlice<u32>,
    n: usize,
    device: &ExecDevice,
    right: bool,
) -> Result<DeviceBatch, BoxError> {
    let s = cx.stream;
    let at = addr(idx, s);
    let words = n.div_ceil(32);
    // Read back: each column's valid rows, each string column's bytes, the error word.
    let slots = columns.len();
    let mut counts = cx.zeros::<i64>(2 * slots + 1)?;
    let error = addr(&counts, s) + 8 * (2 * slots) as u64;
    let mut nullable = false;
    let mut strings = false;
    let mut held = Vec::new();
    let (columns, matched) = match columns.split_last() {
        Some(((c, _), rest)) if right => {
            if c.data_type() != &DataType::Boolean {
                return Err(
                    ComputeError::Input("a right join without its matched column".into()).into(),
                );
            }
            let slot = rest.len();
            let values = values_bits(cx, c, "the matched column")?;
            let count = addr(&counts, s) + 8 * slot as u64;
            let bits = gather_bitmap(cx, c, &values, at, n, count, "the matched column")?;
            held.push(values);
            nullable = true;
            (rest, Some((bits, slot)))
        }
        _ => (columns, None),
    };
    let mut pending = Vec::with_capacity(columns.len());
    for (i, (c, field)) in columns.iter().enumerate() {
        let name = field.name();
        let dt = field.data_type().clone();
        // The validity: bit offset + row of the bitmap, gathered, its set bits counted.
        let validity = match c.cuda_validity(s)? {
            Some(bitmap) if c.null_count() != Some(0) => {
                let count = addr(&counts, s) + 8 * i as u64;
                let what = format!("column `{name}`'s bitmap");
                let bits = gather_bitmap(cx, c, &bitmap, at, n, count, &what)?;
                held.push(bitmap);
                nullable = true;
                Some((bits, i))
            }
            // A right join's column without nulls: null where a row has no build row.
            _ => match &matched {
                Some((bits, slot)) => {
                    let mut copy = cx.zeros::<u8>(4 * words)?;
                    s.memcpy_dtod(bits, &mut copy)?;
                    Some((copy, *slot))
                }
                None => None,
            },
        };
        let build: Build<'_> = match &dt {
            DataType::Boolean => {
                let what = format!("column `{name}`'s values");
                let values = values_bits(cx, c, &what)?;
                let bits = gather_bitmap(cx, c, &values, at, n, 0, &what)?;
                held.push(values);
                Box::new(move |validity, _| Ok(CudaArray::from_bits(n, bits, validity)?))
            }
            DataType::Utf8View | DataType::BinaryView => {
                let (views, view) = at_first_row(cx, c, 1, 16, name)?;
                let out = cx.zeros::<u128>(n)?;
                cx.launch(
                    &cx.k.gather_fixed,
                    n,
                    &[
                        A::U64(at),
                        A::U64(views),
                        A::U32(16),
                        A::U64(addr(&out, s)),
                        A::U64(n as u64),
                    ],
                )?;
                held.push(view);
                // The data buffers, copied whole: every gathered view names the buffer
                // it named, at the same offset.
                let data = variadic_copies(cx, c, &mut held)?;
                let dt = dt.clone();
                Box::new(move |validity, _| {
                    // Each view is the column's (or zero: an empty value), the column
                    // one devarrow uploaded (a build side's) or checked (a probe side's:
                    // `join_expanded`), naming the same buffer, copied whole, at the same
                    // offset.
                    // SAFETY: so it lies inside it; the bytes are the column's, UTF-8
                    // where they were.
                    Ok(unsafe { CudaArray::from_views(dt, out, data, validity) }?)
                })
            }
            DataType::Utf8 | DataType::LargeUtf8 | DataType::Binary | DataType::LargeBinary => {
                let cuda = device
                    .cuda()
                    .ok_or("a gather on CUDA of a device that is not CUDA's")?;
                let gathered = GatheredStrings::lengths(cx, cuda, c, at, n, name, error)?;
                let slot = slots + i;
                if n > 0 {
                    super::compact::copy_last(cx, &gathered.lens, n, &mut counts, slot)?;
                }
                held.extend(gathered.held);
                strings = true;
                let (dt, lens, source) = (dt.clone(), gathered.lens, gathered.source);
                Box::new(move |validity, read| {
                    let bytes = read[slot].max(0) as usize;
                    gathered_strings(cx, dt, (at, n), source, &lens, bytes, validity)
                })
            }
            _ => {
                let width = fixed_width(&dt).ok_or_else(|| {
                    ComputeError::Input(format!("build column `{name}` of {dt} is not gathered"))
                })?;
                let (values, view) = at_first_row(cx, c, 1, u64::from(width), name)?;
                held.push(view);
                let dt = dt.clone();
                Box::new(move |validity, _| {
                    fixed_array(cx, dt, width, n, validity, |out| {
                        cx.launch(
                            &cx.k.gather_fixed,
                            n,
                            &[
                                A::U64(at),
                                A::U64(values),
                                A::U32(width),
                                A::U64(out),
                                A::U64(n as u64),
                            ],
                        )
                    })
                })
            }
        };
        pending.push((validity, build));
    }
    // One read-back of the valid rows' counts (where a column has a bitmap) and the
    // string columns' bytes (where there is one).
    let mut read = vec![0i64; counts.len()];
    if nullable || strings {
        s.memcpy_dtoh(&counts, &mut read)?;
        s.synchronize()?;
    }
    if read[2 * slots] != 0 {
        return Err(ComputeError::Input(
            "a string column's offsets outside its data, gathered on the device".into(),
        )
        .into());
    }
    let mut arrays = Vec::with_capacity(pending.len());
    for (validity, build) in pending {
        let validity =
            validity.map(|(bits, slot)| (bits, Some(n.saturating_sub(read[slot].max(0) as usize))));
        arrays.push(build(validity, &read)?);
    }
    drop((held, counts, matched));
    let fields: Vec<Field> = columns
        .iter()
        .map(|(_, f)| f.clone().with_nullable(true))
        .collect();
    Ok(DeviceBatch::from_cuda_arrays(
        device.device().clone(),
        Arc::new(Schema::new(fields)),
        arrays,
    )?)
}

/// An offset-based string column's lengths gathered by `idx`, scanned (`gather_lengths`,
/// devarrow's scan): the scan, where the rows lie, and the column's buffers, borrowed
/// until the gather.
struct GatheredStrings<'a> {
    lens: CudaSlice<i64>,
    source: StringSource,
    held: Vec<devarrow::cuda::BorrowedSlice<'a, u8>>,
}

impl<'a> GatheredStrings<'a> {
    /// The lengths of `c`'s rows at `idx` (`n` of them, 0 where ~0), scanned in place;
    /// offsets outside its data flagged at `err`.
    fn lengths(
        cx: &Cx<'_>,
        cuda: &Arc<CudaDevice>,
        c: &DeviceColumn<'a>,
        idx: u64,
        n: usize,
        name: &str,
        err: u64,
    ) -> Result<Self, BoxError> {
        use devarrow::abi::device::DeviceKernels;

        let s = cx.stream;
        let mut held = Vec::new();
        let (source, size) = string_source(c, c.len(), name, s, &mut held)?;
        let lens = cx.zeros::<i64>(n)?;
        cx.launch(
            &cx.k.gather_lengths,
            n,
            &[
                A::U64(idx),
                A::U64(source.offsets),
                A::U32(u32::from(source.wide)),
                A::U64(size),
                A::U64(n as u64),
                A::U64(addr(&lens, s)),
                A::U64(err),
            ],
        )?;
        if n > 0 {
            let at = addr(&lens, s);
            // SAFETY: `lens` holds `n` i64s on this device, written by `gather_lengths` on
            // the device's stream, the stream the scan runs on (in order after it).
            unsafe { cuda.inclusive_scan_i64(at as *mut std::ffi::c_void, n as u64) }?;
        }
        Ok(Self { lens, source, held })
    }
}

/// The gathered column of `dt` (`n` rows at `idx`, the source's, `bytes` of values in
/// all, their lengths scanned in `lens`): its offsets and bytes (`gather_strings`).
fn gathered_strings(
    cx: &Cx<'_>,
    dt: DataType,
    (idx, n): (u64, usize),
    source: StringSource,
    lens: &CudaSlice<i64>,
    bytes: usize,
    validity: Option<(CudaSlice<u8>, Option<usize>)>,
) -> Result<CudaArray, BoxError> {
    let s = cx.stream;
    if !source.wide && bytes > i32::MAX as usize {
        return Err(ComputeError::Input(format!(
            "{bytes} bytes of {dt} gathered: more than its i32 offsets hold"
        ))
        .into());
    }
    let data = cx.zeros::<u8>(bytes)?;
    let data_at = addr(&data, s);
    // `gather_strings` writes the n + 1 offsets (0, then each row's end: the scan of
    // lengths `gather_lengths` read from the column's own checked ranges) and copies each
    // row's bytes, in bounds of `data` (`bytes`, the scan's last).
    // SAFETY: so the offsets are non-decreasing from 0 to `data.len()`, each value bytes
    // of a value of the column's own type (UTF-8 where it was).
    unsafe {
        offset_array(cx, dt, (source.wide, n), data, validity, |out_offsets| {
            cx.launch(
                &cx.k.gather_strings,
                n,
                &[
                    A::U64(idx),
                    A::U64(source.offsets),
                    A::U32(u32::from(source.wide)),
                    A::U64(source.data),
                    A::U64(addr(lens, s)),
                    A::U64(n as u64),
                    A::U64(out_offsets),
                    A::U64(data_at),
                ],
            )
        })
    }
}
