//! CUDA: the PTX kernels of `kernels/compute.ptx`, loaded once per context, launched on
//! the device's stream. Expression nodes are evaluated one kernel per node into
//! temporary lanes (freed in stream order when dropped); columns are read in place
//! through devarrow's views; the host waits only for what must come back (an error word,
//! a null count, the aggregate's group table).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use arrow_schema::{DataType, Field};
use devarrow::bridge::{ColumnBuffer, DeviceBatch, DeviceColumn, Transfer, TransferOptions};
use devarrow::cuda::cudarc::driver::{
    CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg,
};
use devarrow::cuda::{BorrowedSlice, CudaArray, CudaDevice};

use super::aggregate::{AggKind, Groups, KeySource, Plan};
use super::expr::{Node, OnFail};
use super::host::frame_column;
use super::{ComputeError, DeviceExpr, ACC_WORDS, SELECTION};
use crate::error::BoxError;
use crate::frame::{schema_of, DeviceFrame, FrameColumn};
use crate::step::ExecDevice;

mod compact;
mod join;
mod strings;

pub(crate) use compact::compact;
pub(crate) use join::{
    booleans, gather_rows, join, join_expanded, kept_probe_rows, mark, DeviceTables, Marks, Probe,
};
use strings::{case_column, concat_column, pad_column, replace_column, substr_column};

/// The kernels' PTX.
pub const COMPUTE_PTX: &str = include_str!("../../../kernels/compute.ptx");

/// The kernels of one context, and the constant tables some of them read.
struct Kernels {
    /// The module the functions belong to (kept loaded).
    _module: Arc<CudaModule>,
    /// Unicode's case tables on the device (`strings::case_column`), uploaded at their
    /// first use in the context and kept: upper keys and maps, lower keys and maps, the
    /// alphanumeric, case-ignorable and cased ranges.
    case_tables: std::sync::OnceLock<[CudaSlice<u32>; 7]>,
    /// Regular expressions' automata on the device, by pattern, uploaded at their first
    /// use in the context and kept ([`Cx::regex_tables`]).
    regex_tables: Mutex<RegexCache>,
    load_lanes: CudaFunction,
    fill_lanes: CudaFunction,
    binary_lanes: CudaFunction,
    view_transform: CudaFunction,
    unary_lanes: CudaFunction,
    store_lanes: CudaFunction,
    pack_bits: CudaFunction,
    select_rows: CudaFunction,
    key_lanes: CudaFunction,
    key_string: CudaFunction,
    verify_group_strings: CudaFunction,
    copy_strings: CudaFunction,
    group_rows: CudaFunction,
    compact_groups: CudaFunction,
    accumulate: CudaFunction,
    gather_groups: CudaFunction,
    view_in: CudaFunction,
    compact_fixed: CudaFunction,
    compact_bits: CudaFunction,
    view_bytes: CudaFunction,
    compact_views: CudaFunction,
    kept_lengths: CudaFunction,
    compact_strings: CudaFunction,
    view_like: CudaFunction,
    view_regex: CudaFunction,
    view_regex_count: CudaFunction,
    view_regex_instr: CudaFunction,
    regex_replace_views: CudaFunction,
    view_key: CudaFunction,
    utf8_views: CudaFunction,
    join_verify_view: CudaFunction,
    select_lanes: CudaFunction,
    view_substr: CudaFunction,
    view_length: CudaFunction,
    unicode_case_views: CudaFunction,
    zone_lanes: CudaFunction,
    zone_utc: CudaFunction,
    expand_scan: CudaFunction,
    list_items: CudaFunction,
    compact_offsets: CudaFunction,
    union_marks: CudaFunction,
    union_offsets: CudaFunction,
    substr_strings: CudaFunction,
    concat_views: CudaFunction,
    replace_views: CudaFunction,
    view_strpos: CudaFunction,
    pad_views: CudaFunction,
    view_parse: CudaFunction,
    views_compare: CudaFunction,
    lanes_to_text: CudaFunction,
    join_probe: CudaFunction,
    gather_fixed: CudaFunction,
    gather_lengths: CudaFunction,
    gather_strings: CudaFunction,
    gather_bits: CudaFunction,
    join_count: CudaFunction,
    join_expand: CudaFunction,
    join_mark: CudaFunction,
    join_mark_rows: CudaFunction,
    select_andnot: CudaFunction,
}

/// The kernels in `cuda`'s context, loaded once per context.
fn kernels(cuda: &CudaDevice) -> Result<Arc<Kernels>, BoxError> {
    static MODULES: OnceLock<Mutex<HashMap<usize, Arc<Kernels>>>> = OnceLock::new();
    let context = cuda.primary_context().context();
    // The context's address identifies it while it lives; the primary context of a
    // device lives as long as the process holds it (the map holds it too).
    let key = Arc::as_ptr(context) as usize;
    let mut modules = MODULES
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some(kernels) = modules.get(&key) {
        return Ok(kernels.clone());
    }
    let module = devarrow::cuda::kernels::load_module(context, "compute.ptx", COMPUTE_PTX)?;
    // cuModuleGetFunction needs the module's context current on this thread.
    context.bind_to_thread()?;
    let f = |name: &str| module.load_function(name);
    let kernels = Arc::new(Kernels {
        _module: module.clone(),
        load_lanes: f("load_lanes")?,
        fill_lanes: f("fill_lanes")?,
        binary_lanes: f("binary_lanes")?,
        view_transform: f("view_transform")?,
        unary_lanes: f("unary_lanes")?,
        store_lanes: f("store_lanes")?,
        pack_bits: f("pack_bits")?,
        select_rows: f("select_rows")?,
        key_lanes: f("key_lanes")?,
        key_string: f("key_string")?,
        verify_group_strings: f("verify_group_strings")?,
        copy_strings: f("copy_strings")?,
        group_rows: f("group_rows")?,
        compact_groups: f("compact_groups")?,
        accumulate: f("accumulate")?,
        gather_groups: f("gather_groups")?,
        view_in: f("view_in")?,
        compact_fixed: f("compact_fixed")?,
        compact_bits: f("compact_bits")?,
        view_bytes: f("view_bytes")?,
        compact_views: f("compact_views")?,
        kept_lengths: f("kept_lengths")?,
        compact_strings: f("compact_strings")?,
        view_like: f("view_like")?,
        view_regex: f("view_regex")?,
        view_regex_count: f("view_regex_count")?,
        view_regex_instr: f("view_regex_instr")?,
        regex_replace_views: f("regex_replace_views")?,
        view_key: f("view_key")?,
        utf8_views: f("utf8_views")?,
        join_verify_view: f("join_verify_view")?,
        select_lanes: f("select_lanes")?,
        view_substr: f("view_substr")?,
        view_length: f("view_length")?,
        unicode_case_views: f("unicode_case_views")?,
        zone_lanes: f("zone_lanes")?,
        zone_utc: f("zone_utc")?,
        expand_scan: f("expand_scan")?,
        list_items: f("list_items")?,
        compact_offsets: f("compact_offsets")?,
        union_marks: f("union_marks")?,
        union_offsets: f("union_offsets")?,
        substr_strings: f("substr_strings")?,
        concat_views: f("concat_views")?,
        replace_views: f("replace_views")?,
        view_strpos: f("view_strpos")?,
        pad_views: f("pad_views")?,
        view_parse: f("view_parse")?,
        views_compare: f("views_compare")?,
        lanes_to_text: f("lanes_to_text")?,
        join_probe: f("join_probe")?,
        gather_fixed: f("gather_fixed")?,
        gather_lengths: f("gather_lengths")?,
        gather_strings: f("gather_strings")?,
        gather_bits: f("gather_bits")?,
        join_count: f("join_count")?,
        join_expand: f("join_expand")?,
        join_mark: f("join_mark")?,
        join_mark_rows: f("join_mark_rows")?,
        select_andnot: f("select_andnot")?,
        case_tables: std::sync::OnceLock::new(),
        regex_tables: Mutex::default(),
    });
    modules.insert(key, kernels.clone());
    Ok(kernels)
}

/// The most bytes of automata a context keeps on the device ([`Cx::regex_tables`]): a
/// pattern's table is a few KiB, at most [`MAX_TABLE_BYTES`](super::automaton::MAX_TABLE_BYTES)
/// and its start states. Past it, a pattern's tables are uploaded with each batch.
const REGEX_CACHE_BYTES: usize = 16 << 20;

/// A regular expression's automaton on the device (a [`RegexTable`](super::automaton::RegexTable)'s
/// tables, each a buffer).
struct RegexOnDevice {
    classes: CudaSlice<u8>,
    next: CudaSlice<u32>,
    kinds: CudaSlice<u8>,
    starts: CudaSlice<u32>,
    anchored: CudaSlice<u32>,
}

impl RegexOnDevice {
    fn bytes(&self) -> usize {
        self.classes.len()
            + self.kinds.len()
            + 4 * (self.next.len() + self.starts.len() + self.anchored.len())
    }
}

/// The automata a context keeps: never freed while the context's kernels are loaded
/// (a kernel of any stream may read them), so never more than [`REGEX_CACHE_BYTES`].
#[derive(Default)]
struct RegexCache {
    by_pattern: HashMap<String, Arc<RegexOnDevice>>,
    bytes: usize,
}

/// A kernel argument.
#[derive(Clone, Copy)]
enum A {
    U64(u64),
    U32(u32),
    I64(i64),
}

/// Everything a launch needs.
struct Cx<'a> {
    stream: &'a Arc<CudaStream>,
    k: Arc<Kernels>,
}

impl Cx<'_> {
    /// Launches `f` over `rows` (grid-stride: at most 1024 blocks of 256 threads);
    /// nothing for 0 rows.
    fn launch(&self, f: &CudaFunction, rows: usize, args: &[A]) -> Result<(), BoxError> {
        if rows == 0 {
            return Ok(());
        }
        let mut launch = self.stream.launch_builder(f);
        for a in args {
            match a {
                A::U64(v) => launch.arg(v),
                A::U32(v) => launch.arg(v),
                A::I64(v) => launch.arg(v),
            };
        }
        let cfg = LaunchConfig {
            grid_dim: (rows.div_ceil(256).clamp(1, 1024) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // Every kernel of compute.ptx takes the parameters its comment lists, in order
        // (u64 device addresses, u32 and s64 scalars), which the callers pass: addresses
        // of live allocations on this stream (or views kept alive until after the
        // launch, whose drop orders their release after it), each holding the elements
        // the kernel reads or writes for `rows` rows (checked or allocated so).
        // SAFETY: so the kernel reads and writes only memory it was given, in bounds.
        unsafe { launch.launch(cfg) }?;
        Ok(())
    }

    /// `n` lanes (values and validity flags), uninitialized: every kernel that writes
    /// lanes writes both of every row (`load_lanes`, `fill_lanes`, `binary_lanes`,
    /// `unary_lanes`, `select_lanes`, the `view_*` kernels, `select_rows`), so zeroing
    /// them first would be a memset per node and batch for nothing (the emulated
    /// driver fills fresh memory with a poison byte, so a kernel that skipped a row
    /// fails its tests).
    fn lanes(&self, n: usize) -> Result<Lanes, BoxError> {
        // SAFETY: device memory of `n.max(1)` elements on this stream; nothing reads it
        // before a kernel of this stream writes every element (above).
        let (values, valid) = unsafe {
            (
                self.stream.alloc::<i64>(n.max(1))?,
                self.stream.alloc::<u8>(n.max(1))?,
            )
        };
        Ok(Lanes { values, valid })
    }

    /// `table`'s automaton on the device: the context's copy, uploaded at the pattern's
    /// first use there and published once the copies completed (one wait of this stream,
    /// so that every stream reads it with no event, as the case tables); past
    /// [`REGEX_CACHE_BYTES`] kept, a copy for this launch only (uploaded on this stream,
    /// freed in order on it when the caller drops it after the launch).
    fn regex_tables(
        &self,
        table: &super::automaton::RegexTable,
    ) -> Result<Arc<RegexOnDevice>, BoxError> {
        let cache = || {
            self.k
                .regex_tables
                .lock()
                .unwrap_or_else(|e| e.into_inner())
        };
        if let Some(on_device) = cache().by_pattern.get(&table.pattern) {
            return Ok(on_device.clone());
        }
        let s = self.stream;
        let made = Arc::new(RegexOnDevice {
            classes: s.clone_htod(&table.classes)?,
            next: s.clone_htod(&table.next)?,
            kinds: s.clone_htod(&table.kinds)?,
            starts: s.clone_htod(&table.starts)?,
            anchored: s.clone_htod(&table.anchored)?,
        });
        let fits = |cache: &RegexCache| cache.bytes + made.bytes() <= REGEX_CACHE_BYTES;
        if !fits(&cache()) {
            return Ok(made);
        }
        // The wait outside the lock: other threads' patterns do not wait for it.
        s.synchronize()?;
        let mut cache = cache();
        if let Some(theirs) = cache.by_pattern.get(&table.pattern) {
            // Another thread published the pattern meanwhile: ours is freed when dropped.
            return Ok(theirs.clone());
        }
        if !fits(&cache) {
            return Ok(made);
        }
        cache.bytes += made.bytes();
        cache.by_pattern.insert(table.pattern.clone(), made.clone());
        Ok(made)
    }

    fn zeros<
        T: devarrow::cuda::cudarc::driver::DeviceRepr
            + devarrow::cuda::cudarc::driver::ValidAsZeroBits,
    >(
        &self,
        n: usize,
    ) -> Result<CudaSlice<T>, BoxError> {
        Ok(self.stream.alloc_zeros::<T>(n.max(1))?)
    }
}

/// The device address of a cudarc slice on `stream` (all of this module's work is on
/// the one stream, so no event is needed to order it).
fn addr<T>(slice: &CudaSlice<T>, stream: &Arc<CudaStream>) -> u64 {
    let (ptr, _record) = slice.device_ptr(stream);
    ptr
}

/// Lanes on the device: values and validity flags.
struct Lanes {
    values: CudaSlice<i64>,
    valid: CudaSlice<u8>,
}

/// The load width code of `load_lanes` for a type.
fn width_code(data_type: &DataType) -> Option<u32> {
    Some(match data_type {
        DataType::Boolean => 0,
        DataType::UInt8 => 1,
        DataType::Int8 => 2,
        DataType::Int16 => 3,
        DataType::Int32 | DataType::Date32 => 4,
        DataType::UInt16 => 5,
        DataType::UInt32 => 6,
        DataType::Int64 | DataType::Float64 | DataType::Timestamp(..) | DataType::Duration(_) => 8,
        DataType::Decimal128(..) => 16,
        _ => return None,
    })
}

/// A column as lanes (`load_lanes`), checked against its buffer.
fn load(cx: &Cx<'_>, column: &FrameColumn, name: &str, err: u64) -> Result<Lanes, BoxError> {
    let c = column.column();
    let n = c.len();
    let code = width_code(c.data_type()).ok_or_else(|| {
        ComputeError::Input(format!(
            "column `{name}` is {}, which the device does not compute on",
            c.data_type()
        ))
    })?;
    let values = c.values().ok_or("a column without a values buffer")?;
    let bytes_per_value: u64 = match code {
        0 => 0,
        1 | 2 => 1,
        3 | 5 => 2,
        6 => 4,
        other => other as u64,
    };
    let end = (c.offset() + n) as u64;
    let bits = if code == 0 {
        end
    } else {
        end * bytes_per_value * 8
    };
    if (values.len() as u64) * 8 < bits {
        return Err(ComputeError::Input(format!(
            "column `{name}`: a values buffer of {} bytes, {} bits needed",
            values.len(),
            bits
        ))
        .into());
    }
    aligned(values.address(), bytes_per_value.clamp(1, 8), name)?;
    let view = values.cuda_view::<u8>(cx.stream)?;
    let bitmap = c.cuda_validity(cx.stream)?;
    if let Some(b) = &bitmap {
        if (b.len() as u64) * 8 < (c.offset() + n) as u64 {
            return Err(ComputeError::Input(format!("column `{name}`: a bitmap too short")).into());
        }
    }
    let out = cx.lanes(n)?;
    cx.launch(
        &cx.k.load_lanes,
        n,
        &[
            A::U64(view.device_ptr()),
            A::U64(bitmap.as_ref().map_or(0, |b| b.device_ptr())),
            A::U64(c.offset() as u64),
            A::U64(n as u64),
            A::U32(code),
            A::U64(addr(&out.values, cx.stream)),
            A::U64(addr(&out.valid, cx.stream)),
            A::U64(err),
        ],
    )?;
    drop((view, bitmap));
    Ok(out)
}

/// Checks that a column read as views by the device is a `Utf8View` one.
fn check_view(c: &devarrow::bridge::DeviceColumn<'_>, name: &str) -> Result<(), BoxError> {
    if c.data_type() != &DataType::Utf8View {
        return Err(ComputeError::Input(format!(
            "column `{name}` is {}, not Utf8View",
            c.data_type()
        ))
        .into());
    }
    Ok(())
}

/// A `Utf8View` column (else an input error) and its views' buffer, long enough for its
/// rows and aligned for the kernels' 8-byte loads.
fn view_device_column<'a>(
    c: DeviceColumn<'a>,
    name: &str,
) -> Result<(DeviceColumn<'a>, ColumnBuffer<'a>), BoxError> {
    check_view(&c, name)?;
    let views = c.buffer(1).ok_or("a view column without views")?;
    if (views.len() as u64) < ((c.offset() + c.len()) as u64) * 16 {
        return Err(
            ComputeError::Input(format!("column `{name}`: a views buffer too short")).into(),
        );
    }
    aligned(views.address(), 8, name)?;
    Ok((c, views))
}

/// A string column's leading arguments to the kernels that read its values where they
/// lie (`view_in`, `view_like`, `view_key`, `view_substr`, `join_verify_view`): its
/// views, its validity bitmap (0: none), its offset, `n` rows, and its variadic buffers'
/// address and size tables with their count. It keeps them readable on the stream:
/// dropped after the launch.
///
/// A `Utf8View` column is read as it is. A `Utf8` or `LargeUtf8` column gets views made
/// of its offsets first (`utf8_views`: 16 bytes a row, on the device, for as long as the
/// arguments live), whose long values point into its data buffer, its one variadic
/// buffer: every string kernel reads both kinds, and no byte of the values moves.
struct ViewArgs<'a> {
    args: [A; 7],
    has_validity: bool,
    _keep: ViewsKept<'a>,
}

/// What a [`ViewArgs`]' addresses point into.
struct ViewsKept<'a> {
    /// The column's buffers (views, or offsets and data) and its bitmap, borrowed.
    _borrowed: Vec<BorrowedSlice<'a, u8>>,
    /// The views made of a `Utf8` or `LargeUtf8` column's offsets.
    _made: Option<CudaSlice<u128>>,
    /// The variadic buffers' address and size tables.
    _tables: (CudaSlice<u64>, CudaSlice<u64>),
}

impl ViewArgs<'_> {
    /// The address of the first row's view (the views' argument is that of the column's
    /// element 0, indexed by its offset).
    fn first_view(&self) -> u64 {
        match (self.args[0], self.args[2]) {
            (A::U64(views), A::U64(offset)) => views.wrapping_add(16 * offset),
            _ => unreachable!("a ViewArgs' views and offset are u64 arguments"),
        }
    }

    /// The variadic tables' arguments: addresses, sizes, count.
    fn tables(&self) -> [A; 3] {
        [self.args[4], self.args[5], self.args[6]]
    }
}

/// [`ViewArgs`] of `column` (`n` rows), errors of views made of offsets flagged at `err`.
fn view_args<'a>(
    cx: &Cx<'_>,
    column: &'a FrameColumn,
    name: &str,
    n: usize,
    err: u64,
) -> Result<ViewArgs<'a>, BoxError> {
    let s = cx.stream;
    let c = column.column();
    super::check_string(&c, name)?;
    if (c.len() as u64) < n as u64 {
        return Err(
            ComputeError::Input(format!("column `{name}`: fewer rows than its frame")).into(),
        );
    }
    let bitmap = c.cuda_validity(s)?;
    let bitmap_ptr = bitmap.as_ref().map_or(0, |b| b.device_ptr());
    let has_validity = bitmap.is_some();
    let offset = c.offset() as u64;
    let mut borrowed: Vec<BorrowedSlice<'a, u8>> = bitmap.into_iter().collect();
    if !matches!(c.data_type(), DataType::Utf8 | DataType::LargeUtf8) {
        let (c, views) = view_device_column(c, name)?;
        let (addresses, sizes, count) = variadic_tables(cx, &c)?;
        let views = views.cuda_view::<u8>(s)?;
        let args = [
            A::U64(views.device_ptr()),
            A::U64(bitmap_ptr),
            A::U64(offset),
            A::U64(n as u64),
            A::U64(addr(&addresses, s)),
            A::U64(addr(&sizes, s)),
            A::U64(count),
        ];
        borrowed.push(views);
        return Ok(ViewArgs {
            args,
            has_validity,
            _keep: ViewsKept {
                _borrowed: borrowed,
                _made: None,
                _tables: (addresses, sizes),
            },
        });
    }
    let (source, size) = string_source(&c, n, name, s, &mut borrowed)?;
    let (wide, data_ptr) = (source.wide, source.data);
    let views = cx.zeros::<u128>(n)?;
    let views_ptr = addr(&views, s);
    cx.launch(
        &cx.k.utf8_views,
        n,
        &[
            A::U64(source.offsets),
            A::U32(u32::from(wide)),
            A::U64(data_ptr),
            A::U64(size),
            A::U64(0),
            A::U64(n as u64),
            A::U64(views_ptr),
            A::U64(err),
        ],
    )?;
    // The data buffer is the views' one variadic buffer (a second entry: CUDA allocates
    // no empty buffer).
    let addresses = s.clone_htod(&[data_ptr, 0])?;
    let sizes = s.clone_htod(&[size, 0])?;
    let args = [
        // Row i's view at views + 16 * (offset + i), as for a column's own views.
        A::U64(views_ptr.wrapping_sub(16 * offset)),
        A::U64(bitmap_ptr),
        A::U64(offset),
        A::U64(n as u64),
        A::U64(addr(&addresses, s)),
        A::U64(addr(&sizes, s)),
        A::U64(1),
    ];
    Ok(ViewArgs {
        args,
        has_validity,
        _keep: ViewsKept {
            _borrowed: borrowed,
            _made: Some(views),
            _tables: (addresses, sizes),
        },
    })
}

/// Where an offset-based column's rows lie: its offsets at its first row, whether they
/// are i64 (else i32), and its data.
#[derive(Clone, Copy)]
struct StringSource {
    offsets: u64,
    wide: bool,
    data: u64,
}

/// [`StringSource`] of `c` (`Utf8`, `LargeUtf8`, `Binary` or `LargeBinary`; or a list's
/// offsets, `List`, `LargeList` or `Map`, of no data), its offsets checked to hold `rows`
/// rows (+ 1) and aligned, and its data's bytes (its address 0 and no bytes where it has
/// none); the buffers borrowed into `held`, readable on
/// `stream` until the launches that read them are done.
fn string_source<'a>(
    c: &DeviceColumn<'a>,
    rows: usize,
    name: &str,
    stream: &Arc<CudaStream>,
    held: &mut Vec<BorrowedSlice<'a, u8>>,
) -> Result<(StringSource, u64), BoxError> {
    let wide = matches!(
        c.data_type(),
        DataType::LargeUtf8 | DataType::LargeBinary | DataType::LargeList(_)
    );
    let width: u64 = if wide { 8 } else { 4 };
    let offsets = c
        .buffer(1)
        .ok_or_else(|| ComputeError::Input(format!("column `{name}` without offsets")))?;
    if (offsets.len() as u64) < width * (c.offset() + rows + 1) as u64 {
        return Err(
            ComputeError::Input(format!("column `{name}`: an offsets buffer too short")).into(),
        );
    }
    let offsets = offsets.cuda_view::<u8>(stream)?;
    let first = offsets.device_ptr() + width * c.offset() as u64;
    aligned(first, width, name)?;
    held.push(offsets);
    let (data, size) = match c.buffer(2).filter(|d| !d.is_empty()) {
        Some(data) => {
            let data = data.cuda_view::<u8>(stream)?;
            let at = (data.device_ptr(), data.len() as u64);
            held.push(data);
            at
        }
        None => (0, 0),
    };
    Ok((
        StringSource {
            offsets: first,
            wide,
            data,
        },
        size,
    ))
}

/// An offset-based array of `dt` of `rows` rows over `data`: `rows + 1` zeroed offsets of
/// the column's width (i64 where `wide`), written on the stream with the bytes by
/// `write`, given their address.
///
/// # Safety
/// `write` must make the offsets non-decreasing from 0 to `data.len()`, each value bytes
/// of a value of `dt` (UTF-8 for strings).
unsafe fn offset_array(
    cx: &Cx<'_>,
    dt: DataType,
    (wide, rows): (bool, usize),
    data: CudaSlice<u8>,
    validity: Option<(CudaSlice<u8>, Option<usize>)>,
    write: impl FnOnce(u64) -> Result<(), BoxError>,
) -> Result<CudaArray, BoxError> {
    let s = cx.stream;
    if wide {
        let offsets = cx.zeros::<i64>(rows + 1)?;
        write(addr(&offsets, s))?;
        // SAFETY: the offsets are as the caller promises.
        Ok(unsafe { CudaArray::from_offsets(dt, offsets, data, validity) }?)
    } else {
        let offsets = cx.zeros::<i32>(rows + 1)?;
        write(addr(&offsets, s))?;
        // SAFETY: as above.
        Ok(unsafe { CudaArray::from_offsets(dt, offsets, data, validity) }?)
    }
}

/// The variadic buffers of a view column (between the views and their sizes) as two
/// tables on the device, their addresses and sizes (u64 each), and their count. A buffer
/// the batch holds as NULL has address and size 0, so a view into it is out of bounds.
fn variadic_tables(
    cx: &Cx<'_>,
    c: &DeviceColumn<'_>,
) -> Result<(CudaSlice<u64>, CudaSlice<u64>, u64), BoxError> {
    let count = c.n_buffers().saturating_sub(3);
    let (mut addresses, mut sizes) = (Vec::with_capacity(count + 1), Vec::with_capacity(count + 1));
    for b in 2..2 + count {
        let buffer = c.buffer(b);
        addresses.push(buffer.map_or(0, |b| b.address()));
        sizes.push(buffer.map_or(0, |b| b.len() as u64));
    }
    // At least one entry: CUDA allocates no empty buffer.
    addresses.push(0);
    sizes.push(0);
    Ok((
        cx.stream.clone_htod(&addresses)?,
        cx.stream.clone_htod(&sizes)?,
        count as u64,
    ))
}

/// Checks that a buffer the kernels load `align`-byte words from is aligned for them (a
/// foreign producer's buffers may not be).
fn aligned(address: u64, align: u64, name: &str) -> Result<(), BoxError> {
    if !address.is_multiple_of(align) {
        return Err(ComputeError::Input(format!(
            "column `{name}`: a buffer at {address:#x}, not aligned to {align} bytes"
        ))
        .into());
    }
    Ok(())
}

/// Which start states a regular expression's kernel reads.
#[derive(Clone, Copy)]
enum Starts {
    /// None (`view_regex`: from the value's start only).
    None,
    /// An unanchored search's ([`RegexTable::starts`](super::automaton::RegexTable::starts)).
    Unanchored,
    /// An anchored search's ([`RegexTable::anchored`](super::automaton::RegexTable::anchored)).
    Anchored,
}

/// The lanes of a regular expression's `kernel` (`view_regex`, `view_regex_count`,
/// `view_regex_instr`) over the `n` rows of a string column: its parameters are the
/// column's view arguments, the automaton's tables (byte classes, transitions, kinds,
/// then the start states `starts` where read; the context's copy, [`Cx::regex_tables`]),
/// its stride, the kernel's own `scalars`, the lanes and the error word.
fn regex_lanes(
    cx: &Cx<'_>,
    (column, name): (&FrameColumn, &str),
    n: usize,
    table: &super::automaton::RegexTable,
    starts: Starts,
    (kernel, scalars): (&CudaFunction, &[A]),
    err: u64,
) -> Result<Lanes, BoxError> {
    let s = cx.stream;
    let view = view_args(cx, column, name, n, err)?;
    let tables = cx.regex_tables(table)?;
    let out = cx.lanes(n)?;
    let mut args: Vec<A> = view.args.to_vec();
    args.extend([
        A::U64(addr(&tables.classes, s)),
        A::U64(addr(&tables.next, s)),
        A::U64(addr(&tables.kinds, s)),
    ]);
    match starts {
        Starts::None => {}
        Starts::Unanchored => args.push(A::U64(addr(&tables.starts, s))),
        Starts::Anchored => args.push(A::U64(addr(&tables.anchored, s))),
    }
    args.push(A::U32(table.stride));
    args.extend_from_slice(scalars);
    args.extend([
        A::U64(addr(&out.values, s)),
        A::U64(addr(&out.valid, s)),
        A::U64(err),
    ]);
    cx.launch(kernel, n, &args)?;
    drop((view, tables));
    Ok(out)
}

/// Evaluates `node` over the frame's rows, errors flagged at `err`.
fn eval(cx: &Cx<'_>, node: &Node, frame: &DeviceFrame, err: u64) -> Result<Lanes, BoxError> {
    let n = frame.num_rows();
    let s = cx.stream;
    match node {
        Node::Column { index, name, .. } => load(cx, frame_column(frame, *index, name)?, name, err),
        Node::StrIn {
            index,
            name,
            words,
            negated,
        } => {
            let view = view_args(cx, frame_column(frame, *index, name)?, name, n, err)?;
            let mut flat: Vec<u64> = words.iter().flatten().copied().collect();
            // CUDA allocates no empty buffer (no word: equal to nothing).
            if flat.is_empty() {
                flat.extend([0, 0]);
            }
            let words_on_device = s.clone_htod(&flat)?;
            let out = cx.lanes(n)?;
            let args = view.args[..4].iter().copied().chain([
                A::U64(addr(&words_on_device, s)),
                A::U64(words.len() as u64),
                A::U32(u32::from(*negated)),
                A::U64(addr(&out.values, s)),
                A::U64(addr(&out.valid, s)),
            ]);
            cx.launch(&cx.k.view_in, n, &args.collect::<Vec<_>>())?;
            drop((view, words_on_device));
            Ok(out)
        }
        Node::StrLike {
            index,
            name,
            pattern,
            negated,
        } => {
            let view = view_args(cx, frame_column(frame, *index, name)?, name, n, err)?;
            // The pattern's bytes with a table of its pieces (start, length; bit 63 of the
            // length where the piece has no `_`, so it matches exactly its length).
            let mut bytes: Vec<u8> = Vec::new();
            let mut pieces: Vec<u64> = Vec::with_capacity(2 * pattern.pieces.len());
            for piece in &pattern.pieces {
                let exact = u64::from(!piece.contains(&super::expr::ANY_CHAR)) << 63;
                pieces.extend([bytes.len() as u64, piece.len() as u64 | exact]);
                bytes.extend_from_slice(piece);
            }
            // At least one entry each: CUDA allocates no empty buffer.
            bytes.push(0);
            pieces.push(0);
            let tables = (s.clone_htod(&bytes)?, s.clone_htod(&pieces)?);
            let flags = u32::from(pattern.anchored_start)
                | u32::from(pattern.anchored_end) << 1
                | u32::from(*negated) << 2
                | u32::from(pattern.fold) << 3;
            let out = cx.lanes(n)?;
            let args = view.args.iter().copied().chain([
                A::U64(addr(&tables.0, s)),
                A::U64(addr(&tables.1, s)),
                A::U64(pattern.pieces.len() as u64),
                A::U32(flags),
                A::U64(addr(&out.values, s)),
                A::U64(addr(&out.valid, s)),
                A::U64(err),
            ]);
            cx.launch(&cx.k.view_like, n, &args.collect::<Vec<_>>())?;
            drop((view, tables));
            Ok(out)
        }
        Node::StrRegexInstr {
            index,
            name,
            table,
            skip,
            nth,
        } => {
            let column = (frame_column(frame, *index, name)?, name.as_str());
            let kernel = (&cx.k.view_regex_instr, &[A::U64(*skip), A::U64(*nth)][..]);
            regex_lanes(cx, column, n, table, Starts::Anchored, kernel, err)
        }
        Node::StrRegexCount {
            index,
            name,
            table,
            skip,
        } => {
            let column = (frame_column(frame, *index, name)?, name.as_str());
            if table.matches_empty {
                // Empty matches need their starts: `view_regex_instr`'s anchored tries,
                // counted (`nth` 0).
                let kernel = (&cx.k.view_regex_instr, &[A::U64(*skip), A::U64(0)][..]);
                return regex_lanes(cx, column, n, table, Starts::Anchored, kernel, err);
            }
            let kernel = (&cx.k.view_regex_count, &[A::U64(*skip)][..]);
            regex_lanes(cx, column, n, table, Starts::Unanchored, kernel, err)
        }
        Node::StrRegex {
            index,
            name,
            table,
            negated,
        } => {
            let column = (frame_column(frame, *index, name)?, name.as_str());
            let kernel = (&cx.k.view_regex, &[A::U32(u32::from(*negated))][..]);
            regex_lanes(cx, column, n, table, Starts::None, kernel, err)
        }
        Node::StrKey { index, name, word } => {
            let view = view_args(cx, frame_column(frame, *index, name)?, name, n, err)?;
            let out = cx.lanes(n)?;
            let args = view.args.iter().copied().chain([
                A::U32(u32::from(*word)),
                A::U64(addr(&out.values, s)),
                A::U64(addr(&out.valid, s)),
                A::U64(err),
            ]);
            cx.launch(&cx.k.view_key, n, &args.collect::<Vec<_>>())?;
            drop(view);
            Ok(out)
        }
        Node::Substr { .. }
        | Node::SplitPart { .. }
        | Node::Trim { .. }
        | Node::StrCase { .. }
        | Node::Concat { .. }
        | Node::Replace { .. }
        | Node::RegexReplace { .. }
        | Node::Pad { .. }
        | Node::Transform { .. }
        | Node::ToText { .. }
        | Node::StrChoice { .. } => Err(ComputeError::Input(
            "a string value is a column, not a value of lanes".into(),
        )
        .into()),
        Node::StrCompare { sides, op } => {
            let out = cx.lanes(n)?;
            let lanes = (addr(&out.values, s), addr(&out.valid, s));
            strings::compare_strings(cx, frame, sides, *op, lanes, err)?;
            Ok(out)
        }
        Node::Parse {
            index,
            name,
            to,
            on_fail,
        } => {
            let view = view_args(cx, frame_column(frame, *index, name)?, name, n, err)?;
            let out = cx.lanes(n)?;
            let (mode, lo, hi) = to.kernel_args();
            let args = view.args.iter().copied().chain([
                A::U32(mode),
                A::I64(lo),
                A::I64(hi),
                A::U32((*on_fail == OnFail::Null) as u32),
                A::U64(addr(&out.values, s)),
                A::U64(addr(&out.valid, s)),
                A::U64(err),
            ]);
            cx.launch(&cx.k.view_parse, n, &args.collect::<Vec<_>>())?;
            drop(view);
            Ok(out)
        }
        Node::StrLength {
            index,
            name,
            measure,
            mul,
        } => {
            let view = view_args(cx, frame_column(frame, *index, name)?, name, n, err)?;
            let out = cx.lanes(n)?;
            let args = view.args.iter().copied().chain([
                A::U32(*measure),
                A::U64(*mul as u64),
                A::U64(addr(&out.values, s)),
                A::U64(addr(&out.valid, s)),
                A::U64(err),
            ]);
            cx.launch(&cx.k.view_length, n, &args.collect::<Vec<_>>())?;
            drop(view);
            Ok(out)
        }
        Node::StrPos {
            index,
            name,
            needle,
        } => {
            let view = view_args(cx, frame_column(frame, *index, name)?, name, n, err)?;
            // The needle on the device (at least one byte).
            let bytes = s.clone_htod(&[needle.as_slice(), &[0u8][..]].concat())?;
            let out = cx.lanes(n)?;
            let args = view.args.iter().copied().chain([
                A::U64(addr(&bytes, s)),
                A::U64(needle.len() as u64),
                A::U64(addr(&out.values, s)),
                A::U64(addr(&out.valid, s)),
                A::U64(err),
            ]);
            cx.launch(&cx.k.view_strpos, n, &args.collect::<Vec<_>>())?;
            drop((view, bytes));
            Ok(out)
        }
        Node::Valid { index, name } => {
            let c = frame_column(frame, *index, name)?.column();
            let out = cx.lanes(n)?;
            match c.cuda_validity(s)? {
                // The bitmap's bits as the values (`load_lanes`' boolean width), valid.
                Some(bitmap) => {
                    if (bitmap.len() as u64) * 8 < (c.offset() + n) as u64 {
                        return Err(ComputeError::Input(format!(
                            "column `{name}`: a bitmap too short"
                        ))
                        .into());
                    }
                    cx.launch(
                        &cx.k.load_lanes,
                        n,
                        &[
                            A::U64(bitmap.device_ptr()),
                            A::U64(0),
                            A::U64(c.offset() as u64),
                            A::U64(n as u64),
                            A::U32(0),
                            A::U64(addr(&out.values, s)),
                            A::U64(addr(&out.valid, s)),
                            A::U64(err),
                        ],
                    )?;
                }
                None => cx.launch(
                    &cx.k.fill_lanes,
                    n,
                    &[
                        A::U64(addr(&out.values, s)),
                        A::U64(addr(&out.valid, s)),
                        A::U64(n as u64),
                        A::I64(1),
                        A::U32(1),
                    ],
                )?,
            }
            Ok(out)
        }
        Node::Case {
            branches,
            otherwise,
        } => {
            // The last branch first, so that the first true condition wins.
            let mut out = eval(cx, otherwise, frame, err)?;
            for (condition, value) in branches.iter().rev() {
                let c = eval(cx, condition, frame, err)?;
                let v = eval(cx, value, frame, err)?;
                let next = cx.lanes(n)?;
                cx.launch(
                    &cx.k.select_lanes,
                    n,
                    &[
                        A::U64(addr(&c.values, s)),
                        A::U64(addr(&c.valid, s)),
                        A::U64(addr(&v.values, s)),
                        A::U64(addr(&v.valid, s)),
                        A::U64(addr(&out.values, s)),
                        A::U64(addr(&out.valid, s)),
                        A::U64(addr(&next.values, s)),
                        A::U64(addr(&next.valid, s)),
                        A::U64(n as u64),
                    ],
                )?;
                out = next;
            }
            Ok(out)
        }
        Node::Subquery(expr) => {
            let v = super::expr::subquery_value(expr)?;
            eval(cx, &Node::Literal(v), frame, err)
        }
        Node::Literal(v) => {
            let out = cx.lanes(n)?;
            cx.launch(
                &cx.k.fill_lanes,
                n,
                &[
                    A::U64(addr(&out.values, s)),
                    A::U64(addr(&out.valid, s)),
                    A::U64(n as u64),
                    A::I64(v.unwrap_or(0)),
                    A::U32(v.is_some() as u32),
                ],
            )?;
            Ok(out)
        }
        Node::Binary {
            op,
            left,
            right,
            lmul,
            rmul,
            lo,
            hi,
        } => {
            let a = eval(cx, left, frame, err)?;
            let b = eval(cx, right, frame, err)?;
            let out = cx.lanes(n)?;
            cx.launch(
                &cx.k.binary_lanes,
                n,
                &[
                    A::U64(addr(&a.values, s)),
                    A::U64(addr(&a.valid, s)),
                    A::U64(addr(&b.values, s)),
                    A::U64(addr(&b.valid, s)),
                    A::U64(addr(&out.values, s)),
                    A::U64(addr(&out.valid, s)),
                    A::U64(n as u64),
                    A::U32(*op),
                    A::I64(*lmul),
                    A::I64(*rmul),
                    A::I64(*lo),
                    A::I64(*hi),
                    A::U64(err),
                ],
            )?;
            Ok(out)
        }
        Node::ZoneUtc {
            local,
            value,
            zone,
            per_second,
            lo,
            hi,
        } => {
            let l = eval(cx, local, frame, err)?;
            let v = value
                .as_ref()
                .map(|v| eval(cx, v, frame, err))
                .transpose()?;
            let inputs = [
                A::U64(addr(&l.values, s)),
                A::U64(addr(&l.valid, s)),
                A::U64(v.as_ref().map_or(0, |v| addr(&v.values, s))),
            ];
            let zone = (zone.as_ref(), *per_second, (*lo, *hi));
            zone_launch(cx, &cx.k.zone_utc, &inputs, zone, n, err)
        }
        Node::ZoneLocal {
            input,
            zone,
            per_second,
            lo,
            hi,
        } => {
            let a = eval(cx, input, frame, err)?;
            let inputs = [A::U64(addr(&a.values, s)), A::U64(addr(&a.valid, s))];
            let zone = (zone.as_ref(), *per_second, (*lo, *hi));
            zone_launch(cx, &cx.k.zone_lanes, &inputs, zone, n, err)
        }
        Node::Unary {
            op,
            input,
            mul,
            lo,
            hi,
            on_fail,
        } => {
            let a = eval(cx, input, frame, err)?;
            let out = cx.lanes(n)?;
            cx.launch(
                &cx.k.unary_lanes,
                n,
                &[
                    A::U64(addr(&a.values, s)),
                    A::U64(addr(&a.valid, s)),
                    A::U64(addr(&out.values, s)),
                    A::U64(addr(&out.valid, s)),
                    A::U64(n as u64),
                    A::U32(*op),
                    A::I64(*mul),
                    A::I64(*lo),
                    A::I64(*hi),
                    A::U32((*on_fail == OnFail::Null) as u32),
                    A::U64(err),
                ],
            )?;
            Ok(out)
        }
    }
}

/// Launches `kernel` (`zone_lanes`, `zone_utc`) over `n` rows: its `inputs`, then the
/// lanes it writes, `n`, and the zone's spans (uploaded in one copy with each batch, a
/// few hundred: freed in stream order), its end, the units a second, the result's range
/// and the error word.
fn zone_launch(
    cx: &Cx<'_>,
    kernel: &CudaFunction,
    inputs: &[A],
    (zone, per_second, (lo, hi)): (&super::expr::ZoneTable, i64, (i64, i64)),
    n: usize,
    err: u64,
) -> Result<Lanes, BoxError> {
    let s = cx.stream;
    let out = cx.lanes(n)?;
    let spans = s.clone_htod(&[zone.starts.as_slice(), &zone.offsets].concat())?;
    let at = addr(&spans, s);
    let count = zone.starts.len() as u64;
    let args = inputs.iter().copied().chain([
        A::U64(addr(&out.values, s)),
        A::U64(addr(&out.valid, s)),
        A::U64(n as u64),
        A::U64(at),
        A::U64(at + 8 * count),
        A::U64(count),
        A::I64(zone.end),
        A::I64(per_second),
        A::I64(lo),
        A::I64(hi),
        A::U64(err),
    ]);
    cx.launch(kernel, n, &args.collect::<Vec<_>>())?;
    Ok(out)
}

/// Whether `node` reads an offset-based string column (`Utf8`, `LargeUtf8`): the views
/// made of its offsets (`utf8_views`) flag offsets outside its data in the error word,
/// so the word must come back even where the node itself cannot fail (`view_in`).
fn reads_offsets(node: &Node, frame: &DeviceFrame) -> Result<bool, BoxError> {
    let mut columns = Vec::new();
    node.columns(&mut columns);
    for (index, name) in columns {
        let c = frame_column(frame, index, name)?.column();
        if matches!(c.data_type(), DataType::Utf8 | DataType::LargeUtf8) {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Whether the frame columns `node` reads may hold nulls.
fn columns_have_nulls(node: &Node, frame: &DeviceFrame) -> Result<bool, BoxError> {
    let mut columns = Vec::new();
    node.columns(&mut columns);
    for (index, name) in columns {
        let c = frame_column(frame, index, name)?.column();
        if c.validity().is_some() && c.null_count() != Some(0) {
            return Ok(true);
        }
    }
    Ok(false)
}

fn context<'a>(cuda: &'a Arc<CudaDevice>) -> Result<Cx<'a>, BoxError> {
    let k = kernels(cuda)?;
    Ok(Cx {
        stream: cuda.stream(),
        k,
    })
}

pub(crate) fn evaluate(
    expr: &DeviceExpr,
    frame: &DeviceFrame,
    cuda: &Arc<CudaDevice>,
    device: &ExecDevice,
    defer: bool,
) -> Result<(FrameColumn, Option<ErrorWord>), BoxError> {
    let dt = expr.data_type().clone();
    let n = frame.num_rows();
    if n == 0 {
        return Ok((
            empty_column(Field::new(&expr.text, dt, false), device)?,
            None,
        ));
    }
    let cx = context(cuda)?;
    let s = cx.stream;
    let err = cx.zeros::<u32>(1)?;
    let e = addr(&err, s);
    let string = match (expr.node.as_ref(), super::expr::Bounds::of(&expr.node)) {
        (_, Some((bounds, index, name))) => {
            let column = frame_column(frame, index, name)?;
            Some(substr_column(&cx, cuda, column, name, bounds, e)?)
        }
        (Node::StrCase { index, name, case }, None) => {
            let column = frame_column(frame, *index, name)?;
            Some(case_column(&cx, cuda, column, name, *case, e)?)
        }
        (Node::Concat { parts, joined, out }, None) => {
            let joined = (*joined, None);
            Some(concat_column(&cx, cuda, frame, parts, joined, out, e)?)
        }
        (Node::StrChoice { which, parts, out }, None) => {
            let which = eval(&cx, which, frame, e)?;
            let choice = (super::expr::Joined::NullIfAny, Some(addr(&which.values, s)));
            let column = concat_column(&cx, cuda, frame, parts, choice, out, e);
            drop(which);
            Some(column?)
        }
        (
            Node::Replace {
                index,
                name,
                from,
                to,
                out,
            },
            None,
        ) => {
            let column = (frame_column(frame, *index, name)?, name.as_str());
            Some(replace_column(&cx, cuda, column, (from, to), out, e)?)
        }
        (
            Node::RegexReplace {
                index,
                name,
                table,
                replacement,
                global,
                out,
            },
            None,
        ) => {
            let column = (frame_column(frame, *index, name)?, name.as_str());
            let replace = (table.as_ref(), replacement.as_slice(), *global);
            Some(strings::regex_replace_column(
                &cx, cuda, column, replace, out, e,
            )?)
        }
        (
            Node::Pad {
                index,
                name,
                target,
                fill,
                right,
                out,
            },
            None,
        ) => {
            let column = (frame_column(frame, *index, name)?, name.as_str());
            let args = (*target, fill.as_slice(), *right);
            Some(pad_column(&cx, cuda, column, args, out, e)?)
        }
        (
            Node::Transform {
                index,
                name,
                op,
                out,
            },
            None,
        ) => {
            let column = (frame_column(frame, *index, name)?, name.as_str());
            Some(strings::transform_column(&cx, cuda, column, op, out, e)?)
        }
        (Node::ToText { input, text, out }, None) => {
            let lanes = eval(&cx, input, frame, e)?;
            let nullable = input.introduces_nulls() || columns_have_nulls(input, frame)?;
            let lanes_of = (&lanes, n, nullable);
            let column = strings::text_column(&cx, cuda, lanes_of, *text, out, e);
            drop(lanes);
            Some(column?)
        }
        _ => None,
    };
    if let Some(column) = string {
        let pending = pending(&cx, err, &expr.text, true, defer)?;
        let nullable = column.null_count() > 0;
        let schema = schema_of(vec![Field::new(&expr.text, dt, nullable)]);
        let batch = DeviceBatch::from_cuda_arrays(device.device().clone(), schema, vec![column])?;
        return Ok((FrameColumn::single(batch)?, pending));
    }
    let lanes = eval(&cx, &expr.node, frame, e)?;
    let nullable = expr.node.introduces_nulls() || columns_have_nulls(&expr.node, frame)?;
    let (column, narrow) = if dt == DataType::Boolean {
        (boolean_column(&cx, &lanes, n, nullable, e)?, true)
    } else {
        let narrow = store_width(&dt)? & 31 < 8;
        (store_column(&cx, &dt, &lanes, n, nullable, e)?, narrow)
    };
    let needed = expr.node.may_fail() || narrow || reads_offsets(&expr.node, frame)?;
    let pending = pending(&cx, err, &expr.text, needed, defer)?;
    drop(lanes);
    let nullable = column.null_count() > 0;
    let schema = schema_of(vec![Field::new(&expr.text, dt, nullable)]);
    let batch = DeviceBatch::from_cuda_arrays(device.device().clone(), schema, vec![column])?;
    Ok((FrameColumn::single(batch)?, pending))
}

/// The bytes per value `store_lanes` writes for an output of `dt` (32 added for an
/// unsigned type).
fn store_width(dt: &DataType) -> Result<u32, BoxError> {
    Ok(match dt {
        DataType::Decimal128(..) => 16,
        // A Float64's lanes are its bits.
        DataType::Int64 | DataType::Float64 | DataType::Timestamp(..) | DataType::Duration(_) => 8,
        DataType::Int32 | DataType::Date32 => 4,
        DataType::Int16 => 2,
        DataType::Int8 => 1,
        // Unsigned: 32 set, the lane zero-extended from its low bytes.
        DataType::UInt32 => 32 | 4,
        DataType::UInt16 => 32 | 2,
        DataType::UInt8 => 32 | 1,
        other => return Err(ComputeError::Input(format!("no CUDA output of {other}")).into()),
    })
}

/// `n` (at least 1) lanes stored as a column of `dt` (its width, a bitmap where
/// `nullable`).
fn store_column(
    cx: &Cx<'_>,
    dt: &DataType,
    lanes: &Lanes,
    n: usize,
    nullable: bool,
    e: u64,
) -> Result<CudaArray, BoxError> {
    let s = cx.stream;
    let width = store_width(dt)?;
    let bitmap = if nullable && n > 0 {
        let bits = cx.zeros::<u8>(n.div_ceil(8))?;
        cx.launch(
            &cx.k.pack_bits,
            n.div_ceil(8),
            &[
                A::U64(addr(&lanes.valid, s)),
                A::U64(addr(&bits, s)),
                A::U64(n as u64),
            ],
        )?;
        Some(bits)
    } else {
        None
    };
    fn array<T: devarrow::cuda::DeviceNative + devarrow::cuda::cudarc::driver::ValidAsZeroBits>(
        cx: &Cx<'_>,
        dt: &DataType,
        lanes: &Lanes,
        n: usize,
        width: u32,
        bitmap: Option<CudaSlice<u8>>,
        e: u64,
    ) -> Result<CudaArray, BoxError> {
        let out = cx.stream.alloc_zeros::<T>(n)?;
        cx.launch(
            &cx.k.store_lanes,
            n,
            &[
                A::U64(addr(&lanes.values, cx.stream)),
                A::U64(addr(&out, cx.stream)),
                A::U64(n as u64),
                A::U32(width),
                A::U64(e),
            ],
        )?;
        Ok(match bitmap {
            Some(bits) => CudaArray::with_validity(dt.clone(), out, bits, None)?,
            None => CudaArray::from_values(dt.clone(), out)?,
        })
    }
    let column = match width {
        16 => array::<i128>(cx, dt, lanes, n, width, bitmap, e)?,
        // The lanes' bits, stored as they are.
        8 if *dt == DataType::Float64 => array::<f64>(cx, dt, lanes, n, width, bitmap, e)?,
        8 => array::<i64>(cx, dt, lanes, n, width, bitmap, e)?,
        4 => array::<i32>(cx, dt, lanes, n, width, bitmap, e)?,
        2 => array::<i16>(cx, dt, lanes, n, width, bitmap, e)?,
        1 => array::<i8>(cx, dt, lanes, n, width, bitmap, e)?,
        36 => array::<u32>(cx, dt, lanes, n, width, bitmap, e)?,
        34 => array::<u16>(cx, dt, lanes, n, width, bitmap, e)?,
        _ => array::<u8>(cx, dt, lanes, n, width, bitmap, e)?,
    };
    Ok(column)
}

/// The error word of an evaluation, read back later ([`super::PendingCheck`]).
#[derive(Debug)]
pub(crate) struct ErrorWord {
    stream: Arc<CudaStream>,
    word: CudaSlice<u32>,
    what: String,
}

impl ErrorWord {
    /// Reads the word back (one synchronize of the stream): an overflow error if a
    /// kernel flagged one.
    pub(crate) fn check(self) -> Result<(), BoxError> {
        let mut word = [0u32; 1];
        self.stream.memcpy_dtoh(&self.word.slice(0..1), &mut word)?;
        self.stream.synchronize()?;
        overflow_of(word[0], &self.what)
    }
}

fn overflow_of(word: u32, what: &str) -> Result<(), BoxError> {
    if word & 4 != 0 {
        return Err(ComputeError::Input(format!(
            "`{what}`: a string view or offset points outside its buffers"
        ))
        .into());
    }
    if word & 1 != 0 {
        return Err(ComputeError::Overflow(format!(
            "`{what}` overflows the device's 64-bit lanes or its result's range"
        ))
        .into());
    }
    if word & 8 != 0 {
        return Err(ComputeError::HostOnly(format!(
            "`{what}` met a value (non-ASCII text under ILIKE, upper, lower or initcap; NaN or \
             -0.0 in a float min or max) whose answer is the host's"
        ))
        .into());
    }
    Ok(())
}

/// The error word checked now (`defer` false), handed back (`defer`), or dropped when
/// nothing can have set it (`needed` false).
fn pending(
    cx: &Cx<'_>,
    word: CudaSlice<u32>,
    what: &str,
    needed: bool,
    defer: bool,
) -> Result<Option<ErrorWord>, BoxError> {
    if !needed {
        return Ok(None);
    }
    let word = ErrorWord {
        stream: cx.stream.clone(),
        word,
        what: what.to_string(),
    };
    if defer {
        return Ok(Some(word));
    }
    word.check()?;
    Ok(None)
}

/// A Boolean result of `n` (at least 1) lanes of 0/1, on the device: the lanes narrowed
/// to flags (`store_lanes`, one byte each), packed as the values' bitmap (`pack_bits`),
/// and the validity flags packed as the validity bitmap where `nullable`.
fn boolean_column(
    cx: &Cx<'_>,
    lanes: &Lanes,
    n: usize,
    nullable: bool,
    e: u64,
) -> Result<CudaArray, BoxError> {
    let s = cx.stream;
    let pack = |flags: u64| -> Result<CudaSlice<u8>, BoxError> {
        let bits = cx.zeros::<u8>(n.div_ceil(8))?;
        cx.launch(
            &cx.k.pack_bits,
            n.div_ceil(8),
            &[A::U64(flags), A::U64(addr(&bits, s)), A::U64(n as u64)],
        )?;
        Ok(bits)
    };
    let flags = cx.zeros::<u8>(n)?;
    cx.launch(
        &cx.k.store_lanes,
        n,
        &[
            A::U64(addr(&lanes.values, s)),
            A::U64(addr(&flags, s)),
            A::U64(n as u64),
            A::U32(1),
            A::U64(e),
        ],
    )?;
    let bits = pack(addr(&flags, s))?;
    let validity = if nullable {
        Some((pack(addr(&lanes.valid, s))?, None))
    } else {
        None
    };
    Ok(CudaArray::from_bits(n, bits, validity)?)
}

/// A column's validity as devarrow-cuda's arrays take it: a bitmap and its null count
/// (`None`: to be counted).
type Validity = Option<(CudaSlice<u8>, Option<usize>)>;

/// The bitmap of a string kernel's per-row validity flags (`valid`, `n` bytes of 0 or
/// 1), packed on the device (`pack_bits`), where the column has one.
fn packed_validity(
    cx: &Cx<'_>,
    valid: &CudaSlice<u8>,
    n: usize,
    has_validity: bool,
) -> Result<Validity, BoxError> {
    if !has_validity {
        return Ok(None);
    }
    let s = cx.stream;
    let bits = cx.zeros::<u8>(n.div_ceil(8))?;
    cx.launch(
        &cx.k.pack_bits,
        n.div_ceil(8),
        &[
            A::U64(addr(valid, s)),
            A::U64(addr(&bits, s)),
            A::U64(n as u64),
        ],
    )?;
    Ok(Some((bits, None)))
}

/// The variadic buffers of a view column, copied whole on the device (a buffer the column
/// holds as NULL becomes one zero byte, which no valid view names), each source borrowed
/// into `held` until the copies are ordered.
fn variadic_copies<'a>(
    cx: &Cx<'_>,
    c: &DeviceColumn<'a>,
    held: &mut Vec<BorrowedSlice<'a, u8>>,
) -> Result<Vec<CudaSlice<u8>>, BoxError> {
    let s = cx.stream;
    let mut data = Vec::new();
    for b in 2..c.n_buffers().saturating_sub(1) {
        let Some(buffer) = c.buffer(b) else {
            data.push(cx.zeros::<u8>(1)?);
            continue;
        };
        let from = buffer.cuda_view::<u8>(s)?;
        let mut to = cx.zeros::<u8>(buffer.len())?;
        if !buffer.is_empty() {
            s.memcpy_dtod(
                &from.slice(0..buffer.len()),
                &mut to.slice_mut(0..buffer.len()),
            )?;
        }
        held.push(from);
        data.push(to);
    }
    Ok(data)
}

/// A column of no rows on `device` (CUDA allocates no empty buffer: an empty host
/// array, uploaded).
fn empty_column(field: Field, device: &ExecDevice) -> Result<FrameColumn, BoxError> {
    let batch = arrow_array::RecordBatch::new_empty(schema_of(vec![field]));
    let mut transfer = Transfer::new(device.device().clone(), TransferOptions::default());
    Ok(FrameColumn::single(transfer.to_device(&batch)?)?)
}

/// The frame's pending selection as lanes, if it has one.
fn prior_selection(cx: &Cx<'_>, frame: &DeviceFrame, err: u64) -> Result<Option<Lanes>, BoxError> {
    frame
        .selection()
        .map(|s| load(cx, s, SELECTION, err))
        .transpose()
}

/// `select_rows` of `pred` (None: every row) and the frame's selection: u8 per row.
fn selected(
    cx: &Cx<'_>,
    pred: Option<&Lanes>,
    frame: &DeviceFrame,
    err: u64,
) -> Result<CudaSlice<u8>, BoxError> {
    let n = frame.num_rows();
    let s = cx.stream;
    let prior = prior_selection(cx, frame, err)?;
    let out = cx.stream.alloc_zeros::<u8>(n)?;
    let ptrs = |l: Option<&Lanes>| l.map_or((0, 0), |l| (addr(&l.values, s), addr(&l.valid, s)));
    let (p, pv) = ptrs(pred);
    let (q, qv) = ptrs(prior.as_ref());
    cx.launch(
        &cx.k.select_rows,
        n,
        &[
            A::U64(p),
            A::U64(pv),
            A::U64(q),
            A::U64(qv),
            A::U64(addr(&out, s)),
            A::U64(n as u64),
        ],
    )?;
    Ok(out)
}

pub(crate) fn select(
    predicate: &DeviceExpr,
    frame: &DeviceFrame,
    cuda: &Arc<CudaDevice>,
    device: &ExecDevice,
    defer: bool,
) -> Result<(FrameColumn, Option<ErrorWord>), BoxError> {
    if frame.num_rows() == 0 {
        let field = Field::new(SELECTION, DataType::UInt8, false);
        return Ok((empty_column(field, device)?, None));
    }
    let cx = context(cuda)?;
    let err = cx.zeros::<u32>(1)?;
    let e = addr(&err, cx.stream);
    let lanes = eval(&cx, &predicate.node, frame, e)?;
    let mask = selected(&cx, Some(&lanes), frame, e)?;
    let needed = predicate.node.may_fail() || reads_offsets(&predicate.node, frame)?;
    let pending = pending(&cx, err, &predicate.text, needed, defer)?;
    drop(lanes);
    let column = CudaArray::from_values(DataType::UInt8, mask)?;
    let schema = schema_of(vec![Field::new(SELECTION, DataType::UInt8, false)]);
    let batch = DeviceBatch::from_cuda_arrays(device.device().clone(), schema, vec![column])?;
    Ok((FrameColumn::single(batch)?, pending))
}

/// Groups whose table comes back with the group count (one read-back); more take a
/// second.
const SPECULATIVE_GROUPS: usize = 64;

/// The accumulate kernel's kind code.
/// `accumulate`'s kind of an aggregate (over `Float64` lanes where `float`).
fn kind_code(kind: AggKind, float: bool) -> u32 {
    match (kind, float) {
        (AggKind::Sum | AggKind::Avg, false) => 0,
        (AggKind::Sum | AggKind::Avg, true) => 4,
        (AggKind::Count, _) => 1,
        (AggKind::Min, _) => 2,
        (AggKind::Max, _) => 3,
        (AggKind::BitOr, _) => 5,
        (AggKind::BitAnd, _) => 6,
        (AggKind::BitXor, _) => 7,
    }
}

pub(crate) fn groups(
    plan: &Plan,
    frame: &DeviceFrame,
    cuda: &Arc<CudaDevice>,
) -> Result<Groups, BoxError> {
    let n = frame.num_rows();
    if n == 0 {
        // (CUDA allocates no empty buffer.)
        return Ok(Groups::default());
    }
    let cx = context(cuda)?;
    let s = cx.stream;
    let width = plan.key_width();
    let naggs = plan.aggs.len();
    let accw = naggs * ACC_WORDS;
    // One read-back buffer: the status ([groups, overflow flags, then one error word per
    // key]), then the table of the first SPECULATIVE_GROUPS groups, gathered before the
    // count is known: one copy and one synchronize unless there are more groups.
    let head = 2 + plan.keys.len();
    let row = width + accw;
    let spec = n.min(SPECULATIVE_GROUPS);
    let status = cx.zeros::<u64>(head + spec * row)?;
    let status_at = addr(&status, s);
    let err = status_at + 8;
    let sel = selected(&cx, None, frame, err)?;
    let keys = cx.zeros::<u64>(n * width)?;
    let keys_at = addr(&keys, s);
    // The string keys' views, kept for the check of their groups and their bytes.
    let mut views = Vec::new();
    for (k, (source, _)) in plan.keys.iter().enumerate() {
        let key_err = status_at + 8 * (2 + k as u64);
        match source {
            KeySource::String { index, name } => {
                let column = frame_column(frame, *index, name)?;
                let view = view_args(&cx, column, name, n, key_err)?;
                let args = view.args.iter().copied().chain([
                    A::U64(keys_at),
                    A::U32(width as u32),
                    A::U32(k as u32),
                    A::U64(key_err),
                ]);
                cx.launch(&cx.k.key_string, n, &args.collect::<Vec<_>>())?;
                views.push((k, view));
            }
            KeySource::Value(node) => {
                let lanes = eval(&cx, node, frame, err)?;
                cx.launch(
                    &cx.k.key_lanes,
                    n,
                    &[
                        A::U64(addr(&lanes.values, s)),
                        A::U64(addr(&lanes.valid, s)),
                        A::U64(n as u64),
                        A::U64(keys_at),
                        A::U32(width as u32),
                        A::U32(k as u32),
                    ],
                )?;
            }
        }
    }
    let cap = (2 * n).next_power_of_two().max(16);
    let table = cx.zeros::<u64>(cap)?;
    let slot_of = cx.zeros::<u64>(n)?;
    let dense = cx.zeros::<u64>(cap)?;
    let rep = cx.zeros::<u64>(n)?;
    cx.launch(
        &cx.k.group_rows,
        n,
        &[
            A::U64(keys_at),
            A::U32(width as u32),
            A::U64(addr(&sel, s)),
            A::U64(n as u64),
            A::U64(addr(&table, s)),
            A::U64(cap as u64 - 1),
            A::U64(addr(&slot_of, s)),
        ],
    )?;
    cx.launch(
        &cx.k.compact_groups,
        cap,
        &[
            A::U64(addr(&table, s)),
            A::U64(cap as u64),
            A::U64(addr(&dense, s)),
            A::U64(addr(&rep, s)),
            A::U64(status_at),
        ],
    )?;
    // Long strings of one group agree in length, prefix and hash: their bytes must.
    for (k, view) in &views {
        let key_err = status_at + 8 * (2 + *k as u64);
        let args = view.args.iter().copied().chain([
            A::U64(addr(&slot_of, s)),
            A::U64(addr(&dense, s)),
            A::U64(addr(&rep, s)),
            A::U64(key_err),
        ]);
        cx.launch(&cx.k.verify_group_strings, n, &args.collect::<Vec<_>>())?;
    }
    let acc = cx.zeros::<u64>(n * accw)?;
    for (a, agg) in plan.aggs.iter().enumerate() {
        let lanes = agg
            .arg
            .as_ref()
            .map(|node| eval(&cx, node, frame, err))
            .transpose()?;
        let (values, valid) = lanes
            .as_ref()
            .map_or((0, 0), |l| (addr(&l.values, s), addr(&l.valid, s)));
        cx.launch(
            &cx.k.accumulate,
            n,
            &[
                A::U64(addr(&slot_of, s)),
                A::U64(addr(&dense, s)),
                A::U64(n as u64),
                A::U64(values),
                A::U64(valid),
                A::U64(addr(&acc, s)),
                A::U32(accw as u32),
                A::U32((a * ACC_WORDS) as u32),
                A::U32(kind_code(agg.kind, agg.is_float())),
            ],
        )?;
    }
    // Rows past the count read the table's row 0 (`rep` is zeroed) and zeroed states:
    // in bounds, and dropped below.
    let gather = |ng: usize, out: u64| {
        cx.launch(
            &cx.k.gather_groups,
            ng,
            &[
                A::U64(keys_at),
                A::U32(width as u32),
                A::U64(addr(&rep, s)),
                A::U64(addr(&acc, s)),
                A::U32(accw as u32),
                A::U64(ng as u64),
                A::U64(out),
            ],
        )
    };
    gather(spec, status_at + 8 * head as u64)?;
    let mut words = vec![0u64; head + spec * row];
    s.memcpy_dtoh(&status, &mut words)?;
    s.synchronize()?;
    if words[1] & 1 != 0 {
        return Err(ComputeError::Overflow(
            "an aggregate's argument or key overflows the device's 64-bit lanes".into(),
        )
        .into());
    }
    if words[1] & 8 != 0 {
        return Err(ComputeError::HostOnly(
            "a float min or max met NaN or -0.0 (DataFusion's answer depends on the rows' \
             order)"
                .into(),
        )
        .into());
    }
    for (k, (source, _)) in plan.keys.iter().enumerate() {
        // 8: two long strings of one group differ; 4: a view outside its buffers.
        if words[2 + k] & 8 != 0 {
            return Err(super::aggregate::collision(plan, k));
        }
        if words[2 + k] != 0 {
            let column = match source {
                KeySource::String { name, .. } => name.clone(),
                KeySource::Value(_) => format!("key {k}"),
            };
            return Err(ComputeError::Input(format!(
                "group key column `{column}`: a string outside its buffers"
            ))
            .into());
        }
    }
    let count = words[0] as usize;
    if count == 0 {
        return Ok(Groups::default());
    }
    let host = if count <= spec {
        words.drain(..head);
        words.truncate(count * row);
        words
    } else {
        // More groups than gathered: the whole table, a second copy.
        let out = cx.zeros::<u64>(count * row)?;
        gather(count, addr(&out, s))?;
        let mut host = vec![0u64; count * row];
        s.memcpy_dtoh(&out.slice(0..count * row), &mut host)?;
        s.synchronize()?;
        host
    };
    let mut groups = Groups {
        count,
        keys: Vec::with_capacity(count * width),
        accs: Vec::with_capacity(count * accw),
        long: vec![Vec::new(); plan.keys.len()],
    };
    for g in host.chunks_exact(row) {
        groups.keys.extend_from_slice(&g[..width]);
        groups.accs.extend_from_slice(&g[width..]);
    }
    for (k, view) in &views {
        groups.long[*k] = long_values(&cx, view, &groups, (*k, width), &rep)?;
    }
    // `sel` and the other temporaries are freed in stream order after the kernels.
    drop((views, sel, keys, table, slot_of, dense, rep, acc, status));
    Ok(groups)
}

/// The bytes of the values of string key `k` (of `width` words a row) longer than 12
/// bytes, per group (empty for the others; none at all where no group has one): their
/// group's first row's (`rep`), copied on the device into one buffer (`copy_strings`)
/// and read back, a second copy only where such values exist.
fn long_values(
    cx: &Cx<'_>,
    view: &ViewArgs<'_>,
    groups: &Groups,
    (k, width): (usize, usize),
    rep: &CudaSlice<u64>,
) -> Result<Vec<Vec<u8>>, BoxError> {
    let s = cx.stream;
    let count = groups.count;
    // Each group's length from its words (0: null, or at most 12 bytes: in the words).
    let lengths: Vec<usize> = (0..count)
        .map(|g| {
            let row = &groups.keys[g * width..(g + 1) * width];
            let len = (row[k * super::KEY_WORDS] & 0xFFFF_FFFF) as usize;
            if row[width - 1] >> k & 1 == 1 || len <= 12 {
                0
            } else {
                len
            }
        })
        .collect();
    let total: usize = lengths.iter().sum();
    if total == 0 {
        return Ok(Vec::new());
    }
    let mut offsets = Vec::with_capacity(count + 1);
    offsets.push(0i64);
    for len in &lengths {
        offsets.push(offsets.last().copied().unwrap_or(0) + *len as i64);
    }
    let on_device = s.clone_htod(&offsets)?;
    let out = cx.zeros::<u8>(total)?;
    let args = view.args.iter().copied().chain([
        A::U64(addr(rep, s)),
        A::U64(count as u64),
        A::U64(addr(&on_device, s)),
        A::U64(addr(&out, s)),
    ]);
    cx.launch(&cx.k.copy_strings, count, &args.collect::<Vec<_>>())?;
    let mut bytes = vec![0u8; total];
    s.memcpy_dtoh(&out, &mut bytes)?;
    s.synchronize()?;
    drop((on_device, out));
    Ok(offsets
        .windows(2)
        .map(|w| bytes[w[0] as usize..w[1] as usize].to_vec())
        .collect())
}
