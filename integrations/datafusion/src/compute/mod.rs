//! Device compute for the device operators of a region: DataFusion's physical
//! expressions compiled for the device ([`DeviceExpr`]), row selections ([`select`]),
//! per-batch partial aggregates ([`DevicePartialAggregate`]) and hash joins
//! ([`join::DeviceHashJoin`]). On CUDA, PTX kernels
//! (`kernels/compute.ptx`); on the CPU device, the same arithmetic on the host.
//!
//! What cannot run on the device is refused when compiled, with the reason
//! ([`Unsupported`]): the optimizer rule leaves that node on the host and says why in
//! `EXPLAIN`.
//!
//! # Design
//!
//! Every value is a signed 64-bit lane plus a validity flag: a decimal its unscaled value
//! (precision at most 18 fits; a wider decimal column is accepted while its values fit,
//! else the query fails with [`ComputeError::Overflow`]), integers and dates themselves,
//! booleans 0 or 1, a Float64 its bits. An expression is a tree evaluated column-at-a-time, one elementwise
//! pass (one kernel launch on CUDA) per node, each node's lanes a temporary buffer of
//! `rows` i64s and `rows` validity bytes:
//!
//! - `Column`: Decimal128, Int8/16/32/64, Date32, Timestamp (any unit and time zone:
//!   its i64 count), Boolean, Float64 (and a `UInt8` selection);
//! - `Literal`: Decimal128 (its value within 64 bits), Int8/16/32/64, Date32, Timestamp,
//!   Boolean, and their nulls;
//! - `BinaryExpr`: `+ - *` on two decimals (the sum's operands aligned to the larger
//!   scale by multiplying by 10^k, as arrow does; the product at the sum of the scales;
//!   the result type the host expression's `data_type`, checked against those rules) or
//!   two integers (an Int32 result outside Int32's range is an overflow error where
//!   DataFusion would wrap); `= != < <= > >=` on decimals (aligned to the larger scale),
//!   integers, dates, timestamps of one unit and booleans; `+ - * /` and comparisons of two Float64s (IEEE 754,
//!   as arrow computes them); `AND`/`OR` with SQL's three-valued logic; `& | ^ << >>`
//!   of two signed integers (arrow's wrapping shifts);
//! - `NotExpr`, `IsNullExpr`, `IsNotNullExpr`, `NegativeExpr` (as `0 - x`);
//! - `CastExpr`/`TryCastExpr`: integer to integer, integer to decimal, decimal to a
//!   decimal of an equal or larger scale (exact: a multiplication by 10^k), the result
//!   checked against the target precision (or integer range): out of range is an error,
//!   or a null for `TRY_CAST` and a cast whose options are `safe`; an integer or decimal
//!   to Float64 (`(double) v / 10^scale`, arrow's formula).
//!
//! Nulls propagate (a null operand gives a null), except through `AND`/`OR` (SQL's
//! three-valued logic), `IS [NOT] NULL`, and a null predicate, which selects nothing.
//! Overflow of a 64-bit lane (or of a checked range) on a valid row fails the operator
//! with [`ComputeError::Overflow`], never a wrong value; null rows are never checked.
//!
//! A partial aggregate encodes each selected row's group key in fixed-width words
//! (`aggregate`'s docs: a string key of at most 12 bytes is its Arrow view, a longer one
//! its length, first 4 bytes and a 64-bit hash, its bytes compared with its group's first
//! row's: [`ComputeError::KeyCollision`] where they differ), finds the groups (a hash table on the host; on CUDA
//! one in device global memory, claimed with `atom.cas` by the first row of a key),
//! accumulates sums in 128 bits (two 64-bit atomics with carry on CUDA: no overflow for
//! fewer than 2^63 rows), counts and min/max, then builds the host batch of the
//! `AggregateExec`'s own output schema from the small group table.
//!
//! Outputs are arrays of exactly the expression's type; a computed column is a one-column
//! device batch (on the CPU device, a host batch exported in place; on CUDA, cudarc slices
//! written by the kernels, made a batch with `DeviceBatch::from_cuda_arrays`).
//!
//! # On CUDA
//!
//! `kernels/compute.ptx`, loaded once per context, launched on the device's stream
//! (grid-stride loops, at most 1024 blocks of 256 threads). The host waits (one
//! synchronize of that stream, never of the device) only where a result must come back:
//! - an expression whose nodes can overflow reads its error word back, at once
//!   ([`DeviceExpr::evaluate`], [`select`]) or when the caller checks
//!   ([`DeviceExpr::evaluate_deferred`], [`select_deferred`], [`PendingCheck`]: a region
//!   can check once per batch, when it reads its results back anyway);
//! - a nullable output counts its nulls (devarrow's `CudaArray::with_validity`);
//! - a Boolean output comes back to the host and is uploaded bit-packed (devarrow builds
//!   CUDA arrays of fixed-width values only): a projection of a predicate costs a round
//!   trip, a selection ([`select`]) does not;
//! - the aggregate reads its group count, its error words and the table of its first 64
//!   groups (keys of each group's first row, then the states) in one copy; more groups
//!   take a second copy of the whole table.
//!
//! A frame of no rows yields empty uploaded columns (CUDA allocates no empty buffer).
//! Temporaries are cudarc slices freed in
//! stream order when dropped, on every path, errors included; columns are read through
//! devarrow's views, which order the release of their batch after the kernels.

use std::fmt;
use std::sync::Arc;

use arrow_array::{RecordBatch, UInt8Array};
use arrow_schema::{DataType, Field, Schema};
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_plan::aggregates::AggregateExec;
use devarrow::abi::ArrowDeviceType;
use devarrow::bridge::{DeviceBatch, Transfer, TransferOptions};

use crate::error::BoxError;
use crate::frame::{schema_of, DeviceFrame, FrameColumn};
use crate::step::ExecDevice;

mod aggregate;
mod automaton;
mod convert;
#[cfg(feature = "cuda")]
mod cuda;
mod expr;
mod host;
pub mod join;
mod unicase;

/// u64 words of one group key (see the aggregate's encoding in the module docs).
pub(crate) const KEY_WORDS: usize = 2;
/// u64 words of one aggregate's state per group: `[lo, hi, count]`.
pub(crate) const ACC_WORDS: usize = 3;

/// Why an expression or an aggregate cannot run on the device (shown in `EXPLAIN`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unsupported(pub String);

impl fmt::Display for Unsupported {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Unsupported {}

/// Why device compute failed at run time (the operator fails the query with it).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ComputeError {
    /// A value does not fit: a 64-bit lane, an Int32 result, a cast's target precision.
    #[error("arithmetic overflow on the device: {0}")]
    Overflow(String),
    /// A value the device does not compute the way DataFusion does, found when the batch
    /// ran: non-ASCII text under `ILIKE`, `upper` or `lower` (Unicode case mapping), NaN
    /// or -0.0 in a float `min` or `max` (DataFusion's answer depends on the rows'
    /// order). The operator computes that batch on the host, as it does an overflowing
    /// one.
    #[error("a value the device leaves to the host: {0}")]
    HostOnly(String),
    /// Two different string group keys of more than 12 bytes in one batch whose key
    /// words (length, first 4 bytes and a 64-bit hash) agree: the device would take them
    /// for one group. The batch is aggregated on the host instead.
    #[error(
        "group key column `{column}`: two different strings of one 64-bit hash in a batch; \
         the device cannot group them"
    )]
    KeyCollision {
        /// The column.
        column: String,
    },
    /// An input the compiled expression does not fit (a missing column, another type, a
    /// device without kernels).
    #[error("device compute input: {0}")]
    Input(String),
}

impl ComputeError {
    /// The `ComputeError` that `error` is or has among its sources, if any: how an engine
    /// tells, from the boxed error a device operator returns, an overflow of the
    /// device's lanes (which the host can compute) from a failure.
    ///
    /// ```
    /// use devarrow_datafusion::compute::ComputeError;
    ///
    /// let boxed: Box<dyn std::error::Error + Send + Sync> =
    ///     ComputeError::Overflow("`a * b` at row 3".into()).into();
    /// assert!(matches!(ComputeError::find(boxed.as_ref()), Some(ComputeError::Overflow(_))));
    /// ```
    pub fn find<'a>(error: &'a (dyn std::error::Error + 'static)) -> Option<&'a ComputeError> {
        let mut current = Some(error);
        while let Some(e) = current {
            if let Some(found) = e.downcast_ref::<ComputeError>() {
                return Some(found);
            }
            current = e.source();
        }
        None
    }
}

/// A physical expression compiled for the device.
#[derive(Debug, Clone)]
pub struct DeviceExpr {
    data_type: DataType,
    node: Arc<expr::Node>,
    text: String,
    /// Strings it computes first, each a column after the input's (and the subs' before
    /// it): `upper(s)` in `upper(s) = 'A'`, `trim(s)` in `length(trim(s))`.
    subs: Vec<DeviceExpr>,
}

impl DeviceExpr {
    /// `expr` over `input`, or why it cannot run on the device.
    ///
    /// Where `expr` reads a string that a device kernel computes (`upper(s) = 'A'`,
    /// `length(trim(s))`, `concat(upper(a), b)`) but no single kernel reads it so, each
    /// such string is computed first into a column of its own, which `expr` then reads
    /// as it reads a column.
    pub fn compile(expr: &Arc<dyn PhysicalExpr>, input: &Schema) -> Result<Self, Unsupported> {
        match Self::compile_one(expr, input) {
            Ok(compiled) => Ok(compiled),
            Err(why) => Self::compile_with_strings(expr, input).ok_or(why),
        }
    }

    /// `expr` with each string sub-expression the device computes (below the root, not
    /// a column or a literal) made a column of the input ([`DeviceExpr::subs`]), inner
    /// ones first; `None` where the result does not compile either.
    fn compile_with_strings(expr: &Arc<dyn PhysicalExpr>, input: &Schema) -> Option<Self> {
        fn materialize(
            e: &Arc<dyn PhysicalExpr>,
            fields: &mut Vec<Field>,
            subs: &mut Vec<DeviceExpr>,
        ) -> Option<Arc<dyn PhysicalExpr>> {
            let e = with_children(e, fields, subs)?;
            let schema = Schema::new(fields.clone());
            if !e.data_type(&schema).is_ok_and(|t| string_type(&t)) {
                return Some(e);
            }
            match DeviceExpr::compile_one(&e, &schema) {
                Ok(sub) if string_type(&sub.data_type) => {
                    let index = fields.len();
                    let name = format!("__string{index}");
                    fields.push(Field::new(&name, sub.data_type.clone(), true));
                    subs.push(sub);
                    Some(Arc::new(
                        datafusion::physical_expr::expressions::Column::new(&name, index),
                    ))
                }
                _ => Some(e),
            }
        }
        fn with_children(
            e: &Arc<dyn PhysicalExpr>,
            fields: &mut Vec<Field>,
            subs: &mut Vec<DeviceExpr>,
        ) -> Option<Arc<dyn PhysicalExpr>> {
            let children = e.children();
            if children.is_empty() {
                return Some(e.clone());
            }
            let rewritten = children
                .into_iter()
                .map(|c| materialize(c, fields, subs))
                .collect::<Option<Vec<_>>>()?;
            e.clone().with_new_children(rewritten).ok()
        }
        let mut fields: Vec<Field> = input.fields().iter().map(|f| f.as_ref().clone()).collect();
        let mut subs = Vec::new();
        let rewritten = with_children(expr, &mut fields, &mut subs)?;
        if subs.is_empty() {
            return None;
        }
        let mut compiled = Self::compile_one(&rewritten, &Schema::new(fields)).ok()?;
        compiled.subs = subs;
        compiled.text = expr.to_string();
        Some(compiled)
    }

    /// `expr` as one device node ([`DeviceExpr::compile`] without computed strings).
    fn compile_one(expr: &Arc<dyn PhysicalExpr>, input: &Schema) -> Result<Self, Unsupported> {
        if let Some((node, data_type)) = expr::string_node(expr, input) {
            return Ok(Self {
                data_type,
                node: Arc::new(node),
                text: expr.to_string(),
                subs: Vec::new(),
            });
        }
        let (node, data_type) = expr::compile(expr, input)?;
        if !matches!(
            data_type,
            DataType::Boolean
                | DataType::Int8
                | DataType::Int16
                | DataType::Int32
                | DataType::Int64
                | DataType::UInt8
                | DataType::UInt16
                | DataType::UInt32
                | DataType::Date32
                | DataType::Timestamp(..)
                | DataType::Duration(_)
                | DataType::Decimal128(..)
                | DataType::Float64
        ) {
            return Err(Unsupported(format!("{data_type} has no device operator")));
        }
        Ok(Self {
            data_type,
            node: Arc::new(node),
            text: expr.to_string(),
            subs: Vec::new(),
        })
    }

    /// Whether it computes strings first ([`DeviceExpr::compile`]): an operator that
    /// reads its node alone (a join's keys) cannot take it.
    pub(crate) fn computes_strings(&self) -> bool {
        !self.subs.is_empty()
    }

    /// `frame` with the strings it computes first as columns after its own (none: `None`),
    /// and their deferred checks.
    fn with_strings(
        &self,
        frame: &DeviceFrame,
        device: &ExecDevice,
    ) -> Result<(Option<DeviceFrame>, Vec<PendingCheck>), BoxError> {
        if self.subs.is_empty() {
            return Ok((None, Vec::new()));
        }
        let mut extended = frame.clone();
        let mut checks = Vec::with_capacity(self.subs.len());
        for sub in &self.subs {
            let (column, check) = sub.evaluate_deferred(&extended, device)?;
            checks.push(check);
            let name = format!("__string{}", extended.columns().len());
            extended = extend_frame(&extended, vec![(name, column)])?;
        }
        Ok((Some(extended), checks))
    }

    /// Lane `word` (0 or 1) of a `Utf8View` column's values as a join key (a hash join's
    /// probe key: [`expr::string_key_lanes`]).
    pub(crate) fn string_key_word(
        column: &datafusion::physical_expr::expressions::Column,
        word: u8,
    ) -> Self {
        Self {
            data_type: DataType::Int64,
            node: Arc::new(expr::Node::StrKey {
                index: column.index(),
                name: column.name().to_string(),
                word,
            }),
            text: format!("{column} (join key lane {word})"),
            subs: Vec::new(),
        }
    }

    /// The type of its values (the host expression's).
    pub fn data_type(&self) -> &DataType {
        &self.data_type
    }

    /// Its values for every row of `frame` (selected or not), a new column on `device`.
    ///
    /// # Errors
    /// [`ComputeError::Overflow`] when a value does not fit (on CUDA, read back at once:
    /// see [`DeviceExpr::evaluate_deferred`] to check it later), devarrow's and the
    /// driver's errors.
    pub fn evaluate(
        &self,
        frame: &DeviceFrame,
        device: &ExecDevice,
    ) -> Result<FrameColumn, BoxError> {
        let (column, pending) = self.evaluate_deferred(frame, device)?;
        pending.check()?;
        Ok(column)
    }

    /// [`DeviceExpr::evaluate`] whose overflow check on CUDA is left to the caller
    /// ([`PendingCheck::check`], say once per batch where the region reads its results
    /// back anyway): the column must not be used for a result until it passed. On the
    /// CPU device, errors are raised at once and the check is empty.
    pub fn evaluate_deferred(
        &self,
        frame: &DeviceFrame,
        device: &ExecDevice,
    ) -> Result<(FrameColumn, PendingCheck), BoxError> {
        let (extended, checks) = self.with_strings(frame, device)?;
        let frame = extended.as_ref().unwrap_or(frame);
        let (column, check) = self.evaluate_one(frame, device)?;
        Ok((column, PendingCheck::all(checks.into_iter().chain([check]))))
    }

    /// [`DeviceExpr::evaluate_deferred`] of its node over `frame` (the strings it
    /// computes first already there).
    fn evaluate_one(
        &self,
        frame: &DeviceFrame,
        device: &ExecDevice,
    ) -> Result<(FrameColumn, PendingCheck), BoxError> {
        #[cfg(feature = "cuda")]
        if let Some(cuda) = device.cuda() {
            let (column, word) = cuda::evaluate(self, frame, cuda, device, true)?;
            return Ok((column, PendingCheck::of(word)));
        }
        check_cpu(device)?;
        let slice = expr::Bounds::of(&self.node);
        let array = match (self.node.as_ref(), slice) {
            (_, Some((bounds, index, name))) => {
                host::slices(host::frame_column(frame, index, name)?, name, bounds)?
            }
            (expr::Node::StrCase { index, name, case }, None) => {
                let column = host::frame_column(frame, *index, name)?;
                host::cased(column, name, *case)?
            }
            (expr::Node::Concat { parts, joined, out }, None) => {
                host::concat(frame, parts, (*joined, None), out, &self.text)?
            }
            (expr::Node::StrChoice { which, parts, out }, None) => {
                let which = host::eval(which, frame, &self.text)?;
                let choice = (expr::Joined::NullIfAny, Some(which.values.as_slice()));
                host::concat(frame, parts, choice, out, &self.text)?
            }
            (
                expr::Node::Replace {
                    index,
                    name,
                    from,
                    to,
                    out,
                },
                None,
            ) => {
                let column = host::frame_column(frame, *index, name)?;
                host::replaced(column, name, (from, to), out, &self.text)?
            }
            (
                expr::Node::RegexReplace {
                    index,
                    name,
                    table,
                    replacement,
                    global,
                    out,
                },
                None,
            ) => {
                let column = host::frame_column(frame, *index, name)?;
                let values = host::view_values(column, name)?;
                // A null row's answer is `None`, the default.
                let rows = host::regex_rows(&values, &self.text, |v| {
                    table.replace(v, replacement, *global).map(Some)
                })?;
                host::string_rows(rows, out, &self.text)?
            }
            (
                expr::Node::Pad {
                    index,
                    name,
                    target,
                    fill,
                    right,
                    out,
                },
                None,
            ) => {
                let column = host::frame_column(frame, *index, name)?;
                host::padded(column, name, (*target, fill, *right), out, &self.text)?
            }
            (
                expr::Node::Transform {
                    index,
                    name,
                    op,
                    out,
                },
                None,
            ) => {
                let column = host::frame_column(frame, *index, name)?;
                host::transformed(column, name, op, out, &self.text)?
            }
            (expr::Node::ToText { input, text, out }, None) => {
                let lanes = host::eval(input, frame, &self.text)?;
                host::texts(&lanes, *text, out, &self.text)?
            }
            (node, None) => {
                let lanes = host::eval(node, frame, &self.text)?;
                let values: Vec<Option<i64>> = (0..frame.num_rows())
                    .map(|i| lanes.is_valid(i).then(|| lanes.values[i]))
                    .collect();
                aggregate::values_array(&values, &self.data_type, &self.text)?
            }
        };
        let nullable = array.null_count() > 0;
        let schema = schema_of(vec![Field::new(
            &self.text,
            self.data_type.clone(),
            nullable,
        )]);
        let column = cpu_column(RecordBatch::try_new(schema, vec![array])?, device)?;
        Ok((column, PendingCheck::default()))
    }
}

/// The overflow check of a deferred evaluation ([`DeviceExpr::evaluate_deferred`],
/// [`select_deferred`]): on CUDA, the error word its kernels set, read back by
/// [`PendingCheck::check`] (one synchronize of the device's stream); empty when nothing
/// can overflow, and on the CPU device. Dropping it unchecked forgoes the check.
#[derive(Debug, Default)]
#[must_use = "an unchecked device evaluation may hide an overflow"]
pub struct PendingCheck {
    #[cfg(feature = "cuda")]
    words: Vec<cuda::ErrorWord>,
}

impl PendingCheck {
    #[cfg(feature = "cuda")]
    fn of(word: Option<cuda::ErrorWord>) -> Self {
        Self {
            words: word.into_iter().collect(),
        }
    }

    /// One check of all of `checks` (the first error, in their order).
    fn all(checks: impl IntoIterator<Item = PendingCheck>) -> Self {
        #[cfg(feature = "cuda")]
        return Self {
            words: checks.into_iter().flat_map(|c| c.words).collect(),
        };
        #[cfg(not(feature = "cuda"))]
        {
            checks.into_iter().for_each(drop);
            Self {}
        }
    }

    /// Whether there is anything to check (a read-back).
    pub fn is_pending(&self) -> bool {
        #[cfg(feature = "cuda")]
        return !self.words.is_empty();
        #[cfg(not(feature = "cuda"))]
        false
    }

    /// [`ComputeError::Overflow`] if a kernel flagged one.
    pub fn check(self) -> Result<(), BoxError> {
        #[cfg(feature = "cuda")]
        for word in self.words {
            word.check()?;
        }
        Ok(())
    }

    /// Checks every one of `checks` (the first error).
    pub fn check_all(checks: impl IntoIterator<Item = PendingCheck>) -> Result<(), BoxError> {
        checks.into_iter().try_for_each(PendingCheck::check)
    }
}

fn check_cpu(device: &ExecDevice) -> Result<(), BoxError> {
    if device.device().device_type() != ArrowDeviceType::CPU {
        return Err(
            ComputeError::Input(format!("no device compute for device {}", device.id())).into(),
        );
    }
    Ok(())
}

/// A one-column host batch as a column on the CPU device (exported in place).
fn cpu_column(batch: RecordBatch, device: &ExecDevice) -> Result<FrameColumn, BoxError> {
    let schema = batch.schema();
    let (array, _ffi_schema) = devarrow::abi::cpu::export_record_batch(&batch)?;
    let batch = DeviceBatch::import(device.device().clone(), array, schema)?;
    Ok(FrameColumn::single(batch)?)
}

/// `frame` with `extra` columns after its own (each named, nullable), its selection kept.
fn extend_frame(
    frame: &DeviceFrame,
    extra: Vec<(String, FrameColumn)>,
) -> Result<DeviceFrame, BoxError> {
    let mut fields: Vec<Field> = frame
        .schema()
        .fields()
        .iter()
        .map(|f| f.as_ref().clone())
        .collect();
    let mut columns = frame.columns().to_vec();
    for (name, column) in extra {
        fields.push(Field::new(name, column.data_type().clone(), true));
        columns.push(column);
    }
    Ok(DeviceFrame::try_new(
        schema_of(fields),
        columns,
        frame.num_rows(),
        frame.selection().cloned(),
    )?)
}

/// The name of a selection column.
const SELECTION: &str = "__selection";

/// The selection of `frame`'s rows where `predicate` (a `Boolean` expression) is true,
/// and-ed with the frame's own pending selection: a `UInt8` column (1 selected, 0 not)
/// on `device`.
pub fn select(
    predicate: &DeviceExpr,
    frame: &DeviceFrame,
    device: &ExecDevice,
) -> Result<FrameColumn, BoxError> {
    let (column, pending) = select_deferred(predicate, frame, device)?;
    pending.check()?;
    Ok(column)
}

/// [`select`] whose overflow check on CUDA is left to the caller (as
/// [`DeviceExpr::evaluate_deferred`]).
pub fn select_deferred(
    predicate: &DeviceExpr,
    frame: &DeviceFrame,
    device: &ExecDevice,
) -> Result<(FrameColumn, PendingCheck), BoxError> {
    if predicate.data_type != DataType::Boolean {
        return Err(
            ComputeError::Input(format!("a predicate of type {}", predicate.data_type)).into(),
        );
    }
    let (extended, checks) = predicate.with_strings(frame, device)?;
    let frame = extended.as_ref().unwrap_or(frame);
    let (column, check) = select_one(predicate, frame, device)?;
    Ok((column, PendingCheck::all(checks.into_iter().chain([check]))))
}

/// [`select_deferred`] of the predicate's node over `frame` (the strings it computes
/// first already there).
fn select_one(
    predicate: &DeviceExpr,
    frame: &DeviceFrame,
    device: &ExecDevice,
) -> Result<(FrameColumn, PendingCheck), BoxError> {
    #[cfg(feature = "cuda")]
    if let Some(cuda) = device.cuda() {
        let (column, word) = cuda::select(predicate, frame, cuda, device, true)?;
        return Ok((column, PendingCheck::of(word)));
    }
    check_cpu(device)?;
    let lanes = host::eval(&predicate.node, frame, &predicate.text)?;
    let before = host::selection(frame)?;
    let mask = UInt8Array::from_iter_values(
        (0..frame.num_rows())
            .map(|i| (lanes.is_valid(i) && lanes.values[i] != 0) as u8 & before[i]),
    );
    let schema = schema_of(vec![Field::new(SELECTION, DataType::UInt8, false)]);
    let column = cpu_column(RecordBatch::try_new(schema, vec![Arc::new(mask)])?, device)?;
    Ok((column, PendingCheck::default()))
}

/// Checks that a column the device reads as strings is one: `Utf8View`, or `Utf8` and
/// `LargeUtf8` (read through views made of their offsets).
pub(crate) fn check_string(
    c: &devarrow::bridge::DeviceColumn<'_>,
    name: &str,
) -> Result<(), BoxError> {
    if !string_type(c.data_type()) {
        return Err(ComputeError::Input(format!(
            "column `{name}` is {}, not a string",
            c.data_type()
        ))
        .into());
    }
    Ok(())
}

/// Whether the device reads a column of `data_type` as strings.
pub(crate) fn string_type(data_type: &DataType) -> bool {
    matches!(
        data_type,
        DataType::Utf8View | DataType::Utf8 | DataType::LargeUtf8
    )
}

/// The bytes per value of a fixed-width type [`compact`] moves on the device (the types
/// devarrow builds CUDA arrays of: integers, floats, dates, times, timestamps, durations,
/// decimals of 128 bits), `None` for other types.
pub(crate) fn fixed_width(data_type: &DataType) -> Option<u32> {
    Some(match data_type {
        DataType::Int8 | DataType::UInt8 => 1,
        DataType::Int16 | DataType::UInt16 => 2,
        DataType::Int32
        | DataType::UInt32
        | DataType::Float32
        | DataType::Date32
        | DataType::Time32(_)
        | DataType::Interval(arrow_schema::IntervalUnit::YearMonth) => 4,
        DataType::Int64
        | DataType::UInt64
        | DataType::Float64
        | DataType::Date64
        | DataType::Time64(_)
        | DataType::Timestamp(..)
        | DataType::Duration(_) => 8,
        DataType::Decimal128(..) => 16,
        _ => return None,
    })
}

/// Whether [`compact`] moves a column of this type on the device (and a join gathers
/// it): fixed-width values, booleans, string or binary views, and offset-based strings
/// and binaries (their kept lengths scanned, then their bytes copied:
/// `kept_lengths`, `compact_strings`; a join's `gather_lengths`, `gather_strings`), with
/// or without nulls.
pub(crate) fn compactable(data_type: &DataType) -> bool {
    fixed_width(data_type).is_some()
        || matches!(
            data_type,
            DataType::Boolean
                | DataType::Utf8View
                | DataType::BinaryView
                | DataType::Utf8
                | DataType::LargeUtf8
                | DataType::Binary
                | DataType::LargeBinary
        )
}

/// Whether [`compact`] moves a column of this type on the device: [`compactable`]'s
/// types, dictionaries of them (integer keys moved as fixed-width values, the values
/// copied whole, by the same kernels), and structs, fixed-size lists, variable-size
/// lists, maps and unions of any of these (each child moved as a column is, a list's
/// items by a scan of them, `expand_scan` or `list_items`, a dense union's by the scans
/// of its types' items; the validity too).
fn compacted(data_type: &DataType) -> bool {
    match data_type {
        DataType::Dictionary(keys, values) => keys.is_dictionary_key_type() && compactable(values),
        DataType::Struct(fields) => {
            !fields.is_empty() && fields.iter().all(|f| compacted(f.data_type()))
        }
        DataType::FixedSizeList(field, k) => *k > 0 && compacted(field.data_type()),
        DataType::List(field) | DataType::LargeList(field) | DataType::Map(field, _) => {
            compacted(field.data_type())
        }
        DataType::Union(fields, _) => {
            !fields.is_empty() && fields.iter().all(|(_, f)| compacted(f.data_type()))
        }
        data_type => compactable(data_type),
    }
}

/// The rows `frame`'s pending selection keeps, moved to the front on the device, so
/// that an unload brings back only them (the fewest bytes cross the link), not every row
/// for the host to filter after the download.
///
/// - `Ok(Some(Some(frame)))`: the kept rows, with no selection;
/// - `Ok(Some(None))`: no row is kept (nothing to bring back);
/// - `Ok(None)`: not here: no selection, or a column of a type the device does not
///   compact (list views, dictionaries of nested types: the host filters them after the
///   download), a struct, fixed-size list or union of an offset, a variable-size list of
///   no item or whose kept rows keep none, a dense union one of whose children keeps no
///   item, or a foreign view or offset that points outside its buffers.
///
/// Every column moves at its own width: fixed-width values (`compact_fixed`), bitmaps of
/// validity and booleans (`compact_bits`), string views with their long values gathered
/// into one buffer (`view_bytes`, devarrow's scan, `compact_views`), offset-based strings
/// and binaries by their kept rows' lengths (`kept_lengths`, devarrow's scan,
/// `compact_strings`); a dictionary's keys as fixed-width values, its values copied
/// whole by the same kernels (a scan that keeps them all); a struct's validity and each
/// of its children, as columns; a fixed-size list's validity and its items, by a scan of
/// the items made of the rows' (`expand_scan`); a variable-size list's (or map's)
/// validity, its offsets made anew of its kept rows' lengths (`kept_lengths`, devarrow's
/// scan, `compact_offsets`) and its items by a scan of them (`list_items`: each item's
/// row by a binary search of the offsets, which it checks); a union's type ids as
/// fixed-width values and its children as columns (sparse) or by the scans of the items
/// its kept rows use (dense: `union_marks`, devarrow's scan, `union_offsets`). On CUDA the PTX kernels of `kernels/compute.ptx` and devarrow's
/// scan, with one read-back (the kept row count, each column's null count and string
/// bytes, and the error word together); on the CPU device arrow's filter, on the
/// device's memory.
///
/// # Errors
/// The device's errors.
pub fn compact(
    frame: &DeviceFrame,
    device: &ExecDevice,
) -> Result<Option<Option<DeviceFrame>>, BoxError> {
    let Some(selection) = frame.selection() else {
        return Ok(None);
    };
    if frame.num_rows() == 0
        || !frame
            .schema()
            .fields()
            .iter()
            .all(|f| compacted(f.data_type()))
    {
        return Ok(None);
    }
    #[cfg(feature = "cuda")]
    if let Some(cuda) = device.cuda() {
        return cuda::compact(frame, selection, cuda, device);
    }
    #[cfg(not(feature = "cuda"))]
    let _ = selection;
    check_cpu(device)?;
    // The CPU device's memory is the host's: the frame's filter, as a download makes it,
    // and back on the device.
    let mut transfer = Transfer::new(device.device().clone(), TransferOptions::default());
    let kept = frame.download(&mut transfer)?;
    if kept.num_rows() == 0 {
        return Ok(Some(None));
    }
    let (array, _schema) = devarrow::abi::cpu::export_record_batch(&kept)?;
    let batch = DeviceBatch::import(device.device().clone(), array, kept.schema())?;
    Ok(Some(Some(DeviceFrame::from_batch(batch))))
}

/// An `AggregateExec` in `Partial` mode compiled for the device: per batch, the groups
/// and their partial states, read back as a host batch of the aggregate's own schema.
#[derive(Debug, Clone)]
pub struct DevicePartialAggregate {
    plan: Arc<aggregate::Plan>,
}

impl DevicePartialAggregate {
    /// `aggregate` (mode `Partial`), or why it cannot run on the device.
    pub fn compile(aggregate: &AggregateExec) -> Result<Self, Unsupported> {
        Ok(Self {
            plan: Arc::new(aggregate::compile(aggregate)?),
        })
    }

    /// The partial aggregate of `frame`'s selected rows: a host batch of the
    /// aggregate's output schema (one row per group present).
    pub fn run(&self, frame: &DeviceFrame, device: &ExecDevice) -> Result<RecordBatch, BoxError> {
        #[cfg(feature = "cuda")]
        if let Some(cuda) = device.cuda() {
            let groups = cuda::groups(&self.plan, frame, cuda)?;
            return aggregate::output(&self.plan, groups);
        }
        check_cpu(device)?;
        let groups = aggregate::cpu_groups(&self.plan, frame)?;
        aggregate::output(&self.plan, groups)
    }
}
