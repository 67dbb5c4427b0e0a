//! Hash joins on the device: an equi-join's build side made into a table once per
//! partition ([`DeviceHashJoin::build`]), its probe side a frame of the region, probed on
//! the device ([`BuiltJoin::probe`]).
//!
//! # Design
//!
//! - **The build side is built on the host, probed on the device.** It reaches the join
//!   as host batches (a host plan, or another region's unload), so the host hashes it
//!   where it already is: its key columns (evaluated by DataFusion, as i64 lanes: a
//!   string key two, [`string_key_lanes`]),
//!   an open-addressing table of u32 slots (a power of two, at least twice the rows: a
//!   slot holds the build row + 1 of its key, linear probing from the key's hash), and
//!   the columns the join's output takes. All three are uploaded once per partition
//!   through the slot's `Transfer`.
//! - **Probing marks rows, it moves none.** Each probe row finds the build row with its
//!   keys (`join_probe`), or none. An inner join whose build keys are unique (each probe
//!   row matches at most one build row: a key of the build side, the common case of a
//!   fact table joined to a dimension) is then the probe frame itself, its columns
//!   untouched, with a selection of the rows that matched and the build columns gathered
//!   to the probe rows (`gather_fixed`, `gather_bits`; a view column's views gathered and
//!   its data buffers copied whole on the device, so every view still points into
//!   them). A semi join is only the selection, an anti join its complement. A right join
//!   keeps the frame's selection, its build columns null where a row matched nothing. No
//!   count is read back: the join costs no host wait.
//! - **Joins whose output is build rows** (`LeftSemi`, `LeftAnti`, and `Left`'s and
//!   `Full`'s rows that match nothing) mark, per frame, the build rows its probe rows match (`join_mark`,
//!   one byte per build row, on the device), and emit at the end of the partition
//!   ([`BuiltJoin::finish`]): the marks read back once, merged on the host with those of
//!   the other partitions where they share the build side (the last to end emits), the
//!   kept rows gathered on the device. A left join's frames are its inner join's, a full
//!   join's its right join's.
//! - **What the device does not join** is refused when compiled, with the reason that
//!   `EXPLAIN` shows: keys
//!   that are not integers, dates, decimals (up to 18 digits) or strings (`Utf8View`,
//!   `Utf8`, `LargeUtf8`) of one type on both sides, null-equal or null-aware joins, a
//!   fetch, output columns of types the device does not gather (nested types,
//!   dictionaries).
//! - **Duplicate build keys** (an inner join whose probe rows may match several build
//!   rows) are found when the table is built ([`BuiltJoin::is_unique`] is false; the rows
//!   of a key are chained). Each frame then makes one row per matching pair: the matches
//!   counted per probe row (`join_count`), scanned, their total read back (the one host
//!   wait: it sizes the output), the pairs written (`join_expand`), and both sides'
//!   columns gathered to them.
//!
//! Null keys never match (DataFusion's `NullEqualsNothing`): a build row with a null
//! key is not in the table; a probe row with one matches nothing (and an anti join keeps
//! it, as DataFusion's does).

use std::sync::Arc;

use arrow_array::cast::AsArray;
use arrow_array::types::Int64Type;
use arrow_array::{Array, RecordBatch, UInt32Array, UInt8Array};
use arrow_schema::{DataType, Field, Schema, SchemaRef};
use datafusion::arrow::compute::{cast, concat_batches, take};
use datafusion::common::{JoinSide, JoinType, NullEquality};
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_plan::joins::{HashJoinExec, PartitionMode};
use datafusion::physical_plan::ExecutionPlan;
use devarrow::bridge::{DeviceBatch, Transfer};

use datafusion::execution::memory_pool::{MemoryConsumer, MemoryPool, MemoryReservation};

use super::expr::hash;
use super::{check_cpu, compactable, cpu_column, host, ComputeError, DeviceExpr, Unsupported};
use crate::error::{BoxError, DeviceExecError};
use crate::frame::{schema_of, DeviceFrame, FrameColumn};
use crate::step::ExecDevice;

/// The row index of a probe row with no match.
pub(crate) const NO_ROW: u32 = u32::MAX;

/// The name of a right join's all-true build column, whose gather is the validity of the
/// build columns (the last column of the payload; never in the output).
pub(crate) const MATCHED: &str = "__matched";

/// The kinds of join the device runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum JoinKind {
    /// The probe rows that match, each with its build row's columns.
    Inner,
    /// The probe rows that match (`RightSemi`).
    Semi,
    /// The probe rows that do not (`RightAnti`).
    Anti,
    /// Every probe row, with its build row's columns, null where it has none (`Right`).
    Right,
    /// The build rows some probe row matches (`LeftSemi`), emitted when the probe side
    /// has ended.
    LeftSemi,
    /// The build rows no probe row matches (`LeftAnti`), emitted at the end.
    LeftAnti,
    /// The inner join's rows, then (at the end) the build rows no probe row matched,
    /// their probe columns null (`Left`).
    Left,
    /// A right join's rows, then (at the end) a left join's unmatched build rows
    /// (`Full`).
    Full,
    /// Every probe row, with a Boolean of whether it matched (`RightMark`: `EXISTS` under
    /// `OR`).
    Mark,
    /// Every build row, with a Boolean of whether some probe row matched it, emitted at
    /// the end (`LeftMark`: `EXISTS` under `OR` over the larger side).
    LeftMark,
}

impl JoinKind {
    /// Whether its output includes build rows found only when the probe side has ended
    /// (the probe marks the build rows it matches).
    pub(crate) fn marks(self) -> bool {
        matches!(
            self,
            Self::LeftSemi | Self::LeftAnti | Self::Left | Self::Full | Self::LeftMark
        )
    }

    /// Whether every selected probe row is in its output, with null build columns where
    /// it matched nothing.
    pub(crate) fn keeps_probe_rows(self) -> bool {
        matches!(self, Self::Right | Self::Full)
    }

    /// Whether its output has the build rows no probe row matched, their probe columns
    /// null.
    fn emits_unmatched(self) -> bool {
        matches!(self, Self::Left | Self::Full)
    }

    /// Whether each probe frame gives no output (only marks).
    fn marks_only(self) -> bool {
        matches!(self, Self::LeftSemi | Self::LeftAnti | Self::LeftMark)
    }
}

/// Where an output column comes from.
#[derive(Debug, Clone, Copy)]
enum Out {
    /// Column `j` of the gathered build columns.
    Build(usize),
    /// Column `i` of the probe frame.
    Probe(usize),
    /// A mark join's Boolean: whether the probe row matched.
    Mark,
}

/// How the host makes one lane of a build row's keys (the lanes of `probe_keys`, in
/// their order).
#[derive(Debug)]
enum BuildLane {
    /// A key's value (an integer, date or decimal).
    Value(Arc<dyn PhysicalExpr>),
    /// Lane `word` of string key `key` ([`super::expr::string_key_lanes`]).
    Word { key: usize, word: u8 },
}

/// A string join key: a string column of the probe side (or one a string expression
/// computes on the device, appended to the probe frame), its two lanes hashing a value
/// of more than 12 bytes, so that where lanes agree the probe compares that value's bytes
/// with the build row's (kept by the table).
#[derive(Debug)]
pub(crate) struct StringKey {
    build: Arc<dyn PhysicalExpr>,
    /// The probe column (its index in the probe schema, or past it for a computed key;
    /// its name).
    pub(crate) probe: usize,
    pub(crate) probe_name: String,
    /// The expression that computes the probe column, where it is not one of the probe
    /// side's (`upper(s)`, `substr(s, 1, 3)`, `a || b`, ...).
    computed: Option<DeviceExpr>,
}

#[derive(Debug)]
pub(crate) struct Plan {
    pub(crate) kind: JoinKind,
    /// The probe side's key lanes (a string key has two).
    pub(crate) probe_keys: Vec<DeviceExpr>,
    build_keys: Vec<BuildLane>,
    pub(crate) string_keys: Vec<StringKey>,
    build_schema: SchemaRef,
    /// The build columns the output takes, in the order of [`Out::Build`].
    build_columns: Vec<usize>,
    output: Vec<Out>,
    schema: SchemaRef,
    /// The join's filter: its predicate over its own schema, whose columns are these.
    filter: Option<(DeviceExpr, SchemaRef, Vec<Out>)>,
}

impl Plan {
    /// Whether a probe frame's output keeps each of its selected rows, with null build
    /// columns where it matched nothing (a right or full join without a filter; with
    /// one, the rows without a pair that passed make a frame of their own).
    fn keeps_rows_in_frame(&self) -> bool {
        self.kind.keeps_probe_rows() && self.filter.is_none()
    }

    /// The probe columns the output (then the filter) takes, in that order, each once.
    fn probe_columns(&self) -> Vec<usize> {
        let mut columns = Vec::new();
        let filter = self.filter.iter().flat_map(|(_, _, columns)| columns);
        for out in self.output.iter().chain(filter) {
            if let Out::Probe(i) = *out {
                if !columns.contains(&i) {
                    columns.push(i);
                }
            }
        }
        columns
    }
}

/// A `HashJoinExec` compiled for the device: build its table from the build side's
/// batches once ([`DeviceHashJoin::build`]), then probe frames of the probe side
/// ([`BuiltJoin::probe`]). The region's `DeviceHashJoinExec` does this per partition;
/// here by hand, on the CPU device:
///
/// ```
/// use datafusion::physical_plan::joins::HashJoinExec;
/// use datafusion::physical_plan::{collect, ExecutionPlan};
/// use datafusion::prelude::SessionContext;
/// use devarrow::bridge::{Transfer, TransferOptions};
/// use devarrow_datafusion::compute::join::DeviceHashJoin;
/// use devarrow_datafusion::{DeviceFrame, ExecDevice};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// let ctx = SessionContext::new();
/// for sql in [
///     "CREATE TABLE dim (k INT, name VARCHAR) AS VALUES (1, 'one'), (2, 'two')",
///     "CREATE TABLE fact (fk INT, qty INT) AS VALUES (1, 10), (2, 20), (3, 30), (2, 40)",
/// ] {
///     ctx.sql(sql).await?.collect().await?;
/// }
/// let plan = ctx
///     .sql("SELECT qty, name FROM fact JOIN dim ON fk = k")
///     .await?
///     .create_physical_plan()
///     .await?;
/// // DataFusion's join: its left child is the build side, its right child the probe side.
/// let mut nodes = vec![plan];
/// let node = loop {
///     let node = nodes.pop().expect("a hash join in the plan");
///     if node.downcast_ref::<HashJoinExec>().is_some() {
///         break node;
///     }
///     nodes.extend(node.children().into_iter().cloned());
/// };
/// let join = node.downcast_ref::<HashJoinExec>().unwrap();
/// let compiled = DeviceHashJoin::compile(join)?;
///
/// let device = ExecDevice::cpu();
/// let mut transfer = Transfer::new(device.device().clone(), TransferOptions::default());
/// let build = collect(join.left().clone(), ctx.task_ctx()).await?;
/// let built = compiled.build(&build, &device, &mut transfer)?;
/// let mut rows = 0;
/// for batch in collect(join.right().clone(), ctx.task_ctx()).await? {
///     let probe = DeviceFrame::from_batch(transfer.to_device(&batch)?);
///     // The probe rows, a selection of those that matched, the build columns gathered
///     // (no frame for a join that only marks build rows, two for an outer join with a
///     // filter).
///     for joined in built.probe(&probe, &device)? {
///         rows += joined.download(&mut transfer)?.num_rows();
///     }
/// }
/// // What the join emits when its probe side has ended: nothing for an inner join (a
/// // left join's unmatched build rows, a left semi join's matched ones).
/// assert!(built.finish(&device)?.is_none());
/// assert_eq!(rows, 3);
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct DeviceHashJoin {
    plan: Arc<Plan>,
}

/// Whether the device joins on keys of this type (as i64 lanes: a decimal's unscaled
/// value, which fits 64 bits up to precision 18; an unsigned integer of up to 32 bits
/// zero-extended).
fn key_type(data_type: &DataType) -> bool {
    match data_type {
        DataType::Int8
        | DataType::Int16
        | DataType::Int32
        | DataType::Int64
        | DataType::UInt8
        | DataType::UInt16
        | DataType::UInt32
        | DataType::Date32
        | DataType::Timestamp(..) => true,
        DataType::Decimal128(p, s) => *p <= 18 && *s >= 0,
        DataType::Utf8View | DataType::Utf8 | DataType::LargeUtf8 => true,
        _ => false,
    }
}

/// A build key's values as i64 lanes: the device's lanes of its type (a decimal's
/// unscaled value, an integer or date widened).
fn key_lanes(array: &arrow_array::ArrayRef) -> Result<arrow_array::Int64Array, BoxError> {
    if let DataType::Decimal128(..) = array.data_type() {
        // At most 18 digits (`key_type`): the unscaled value fits 64 bits.
        let values = array.as_primitive::<arrow_array::types::Decimal128Type>();
        return Ok(values.unary(|v| v as i64));
    }
    Ok(cast(array, &DataType::Int64)?
        .as_primitive::<Int64Type>()
        .clone())
}

impl DeviceHashJoin {
    /// `join` on the device, or why not.
    pub fn compile(join: &HashJoinExec) -> Result<Self, Unsupported> {
        let kind = match join.join_type() {
            JoinType::Inner => JoinKind::Inner,
            JoinType::RightSemi => JoinKind::Semi,
            JoinType::RightAnti => JoinKind::Anti,
            JoinType::Right => JoinKind::Right,
            JoinType::LeftSemi => JoinKind::LeftSemi,
            JoinType::LeftAnti => JoinKind::LeftAnti,
            JoinType::Left => JoinKind::Left,
            JoinType::Full => JoinKind::Full,
            JoinType::RightMark => JoinKind::Mark,
            JoinType::LeftMark => JoinKind::LeftMark,
        };
        if join.null_equality() != NullEquality::NullEqualsNothing || join.null_aware {
            return Err(Unsupported(
                "a join where nulls match (or a null-aware anti join) has no device operator"
                    .into(),
            ));
        }
        if join.fetch().is_some() {
            return Err(Unsupported(
                "a join with a fetch (LIMIT) stays on the host".into(),
            ));
        }
        if !matches!(
            join.partition_mode(),
            PartitionMode::CollectLeft | PartitionMode::Partitioned
        ) {
            return Err(Unsupported(format!(
                "a join of mode {:?} has no device operator",
                join.partition_mode()
            )));
        }
        let (left, right) = (join.left().schema(), join.right().schema());
        let mut probe_keys = Vec::with_capacity(join.on().len());
        let mut build_keys = Vec::with_capacity(join.on().len());
        let mut string_keys = Vec::new();
        for (l, r) in join.on() {
            let lt = l
                .data_type(&left)
                .map_err(|e| Unsupported(format!("the type of `{l}`: {e}")))?;
            let rt = r
                .data_type(&right)
                .map_err(|e| Unsupported(format!("the type of `{r}`: {e}")))?;
            if lt != rt || !key_type(&lt) {
                return Err(Unsupported(format!(
                    "join keys `{l}` ({lt}) and `{r}` ({rt}): the device joins on integers, \
                     dates, decimals of at most 18 digits and strings, of one type"
                )));
            }
            if super::string_type(&lt) {
                use datafusion::physical_expr::expressions::Column;
                // A column of the probe side, or a string expression of it computed into
                // a column appended to the probe frame.
                let (column, computed) = match r.downcast_ref::<Column>() {
                    Some(column) => (column.clone(), None),
                    None => {
                        let computed = DeviceExpr::compile(r, &right)
                            .map_err(|u| Unsupported(format!("join key `{r}`: {}", u.0)))?;
                        if !super::string_type(computed.data_type()) {
                            return Err(Unsupported(format!(
                                "join key `{r}`: a string key of the probe side is a column \
                                 or a string expression on the device"
                            )));
                        }
                        let extra = string_keys
                            .iter()
                            .filter(|k: &&StringKey| k.computed.is_some())
                            .count();
                        let name = format!("join key {}", string_keys.len());
                        let index = right.fields().len() + extra;
                        (Column::new(&name, index), Some(computed))
                    }
                };
                let column = &column;
                let key = string_keys.len();
                for word in 0..2 {
                    probe_keys.push(DeviceExpr::string_key_word(column, word));
                    build_keys.push(BuildLane::Word { key, word });
                }
                string_keys.push(StringKey {
                    build: l.clone(),
                    probe: column.index(),
                    probe_name: column.name().to_string(),
                    computed,
                });
                continue;
            }
            let key = DeviceExpr::compile(r, &right)?;
            // The join evaluates a key's node alone, over the probe frame.
            if key.computes_strings() {
                return Err(Unsupported(format!(
                    "join key `{r}`: a value of a computed string has no device kernel here"
                )));
            }
            probe_keys.push(key);
            build_keys.push(BuildLane::Value(l.clone()));
        }
        let all: Vec<Out> = match kind {
            JoinKind::Inner | JoinKind::Right | JoinKind::Left | JoinKind::Full => {
                (0..left.fields().len())
                    .map(Out::Build)
                    .chain((0..right.fields().len()).map(Out::Probe))
                    .collect()
            }
            JoinKind::Semi | JoinKind::Anti => (0..right.fields().len()).map(Out::Probe).collect(),
            JoinKind::Mark => (0..right.fields().len())
                .map(Out::Probe)
                .chain([Out::Mark])
                .collect(),
            JoinKind::LeftSemi | JoinKind::LeftAnti => {
                (0..left.fields().len()).map(Out::Build).collect()
            }
            JoinKind::LeftMark => (0..left.fields().len())
                .map(Out::Build)
                .chain([Out::Mark])
                .collect(),
        };
        let picked: Vec<Out> = match &join.projection {
            Some(projection) => projection.iter().map(|&i| all[i]).collect(),
            None => all,
        };
        // Build columns renumbered in the order the output (then the filter) takes them.
        let mut build_columns = Vec::new();
        let mut renumber = |out: Out| match out {
            Out::Build(i) => {
                let j = build_columns
                    .iter()
                    .position(|&c| c == i)
                    .unwrap_or_else(|| {
                        build_columns.push(i);
                        build_columns.len() - 1
                    });
                Out::Build(j)
            }
            probe => probe,
        };
        let output: Vec<Out> = picked.into_iter().map(&mut renumber).collect();
        let filter = match join.filter() {
            None => None,
            Some(filter) => {
                let predicate = DeviceExpr::compile(filter.expression(), filter.schema())?;
                if predicate.data_type() != &DataType::Boolean {
                    return Err(Unsupported(format!(
                        "a join filter of type {}",
                        predicate.data_type()
                    )));
                }
                let columns = filter
                    .column_indices()
                    .iter()
                    .map(|c| {
                        renumber(match c.side {
                            JoinSide::Left => Out::Build(c.index),
                            _ => Out::Probe(c.index),
                        })
                    })
                    .collect();
                Some((predicate, filter.schema().clone(), columns))
            }
        };
        let plan = Plan {
            kind,
            probe_keys,
            build_keys,
            string_keys,
            build_schema: left.clone(),
            build_columns,
            output,
            schema: join.schema(),
            filter,
        };
        // Build columns are gathered to the probe rows; probe columns to the pairs of
        // matching rows where build keys repeat (known only when the table is built).
        let build = plan.build_columns.iter().map(|&i| ("build", left.field(i)));
        let probe = plan
            .probe_columns()
            .into_iter()
            .map(|i| ("probe", right.field(i)));
        for (side, field) in build.chain(probe) {
            if !compactable(field.data_type()) {
                return Err(Unsupported(format!(
                    "{side} column `{}` is {}, which the device does not gather",
                    field.name(),
                    field.data_type()
                )));
            }
        }
        Ok(Self {
            plan: Arc::new(plan),
        })
    }

    /// Whether its output has build rows emitted when the probe side has ended (left
    /// semi, anti and outer joins): the partitions that probe a shared table merge what
    /// they matched, and the last to end emits them.
    pub fn emits_build_rows(&self) -> bool {
        self.plan.kind.marks()
    }

    /// The table of the build side `batches` (of the join's left schema), uploaded to
    /// `device` through `upload` where the device is not the host's: [`DeviceHashJoin::table`]
    /// then [`DeviceHashJoin::bind_table`].
    ///
    /// # Errors
    /// DataFusion's (evaluating the build keys), devarrow's (the upload), and
    /// [`ComputeError::Input`] for a build side of 2^32 - 1 rows or more.
    pub fn build(
        &self,
        batches: &[RecordBatch],
        device: &ExecDevice,
        upload: &mut Transfer,
    ) -> Result<BuiltJoin, BoxError> {
        let table = self.table(Arc::new(batches.to_vec()))?;
        self.bind_table(Arc::new(table), device, upload)
    }

    /// The table of `batches` on the host (the work every partition of a query can
    /// share: their keys hashed, the columns the output takes; it keeps no reference to
    /// `batches` themselves, only to the arrays of the columns it takes).
    ///
    /// # Errors
    /// As [`DeviceHashJoin::build`], without the upload's.
    pub fn table(&self, batches: Arc<Vec<RecordBatch>>) -> Result<JoinTable, BoxError> {
        self.shared_table(batches, 1)
    }

    /// [`DeviceHashJoin::table`] for `partitions` partitions that probe it (a collected
    /// build side's, shared by the query's partitions): a join whose output is build
    /// rows emits them when the last of them has ended ([`BuiltJoin::finish`]).
    ///
    /// # Errors
    /// As [`DeviceHashJoin::table`].
    pub fn shared_table(
        &self,
        batches: Arc<Vec<RecordBatch>>,
        partitions: usize,
    ) -> Result<JoinTable, BoxError> {
        let plan = &self.plan;
        let batch = concat_batches(&plan.build_schema, batches.iter())?;
        let rows = batch.num_rows();
        if rows >= NO_ROW as usize {
            return Err(ComputeError::Input(format!(
                "a join's build side of {rows} rows (the device table holds fewer than 2^32 - 1)"
            ))
            .into());
        }
        let k = plan.build_keys.len();
        let mut keys = vec![0i64; k * rows];
        let mut valid = vec![true; rows];
        // The string keys' values, kept for the probe to compare.
        let strings = plan
            .string_keys
            .iter()
            .map(|key| {
                let array = key.build.evaluate(&batch)?.into_array(rows)?;
                Ok(cast(&array, &DataType::Utf8View)?)
            })
            .collect::<Result<Vec<_>, BoxError>>()?;
        for (j, lane) in plan.build_keys.iter().enumerate() {
            let slots = &mut keys[j * rows..(j + 1) * rows];
            match lane {
                BuildLane::Value(expr) => {
                    let array = expr.evaluate(&batch)?.into_array(rows)?;
                    let values = key_lanes(&array)?;
                    for (r, slot) in slots.iter_mut().enumerate() {
                        if values.is_null(r) {
                            valid[r] = false;
                        } else {
                            *slot = values.value(r);
                        }
                    }
                }
                BuildLane::Word { key, word } => {
                    let values = strings[*key].as_string_view();
                    for (r, slot) in slots.iter_mut().enumerate() {
                        if values.is_null(r) {
                            valid[r] = false;
                        } else {
                            let lanes = super::expr::string_key_lanes(values.value(r).as_bytes());
                            *slot = lanes[*word as usize];
                        }
                    }
                }
            }
        }
        let capacity = (2 * rows).next_power_of_two().max(16);
        let mask = capacity as u64 - 1;
        let mut slots = vec![0u32; capacity];
        let mut next = vec![0u32; rows];
        let mut unique = true;
        for r in (0..rows).filter(|&r| valid[r]) {
            let key = |row: usize, j: usize| keys[j * rows + row];
            let mut at = hash((0..k).map(|j| key(r, j))) & mask;
            loop {
                let slot = slots[at as usize];
                if slot == 0 {
                    slots[at as usize] = r as u32 + 1;
                    break;
                }
                let other = (slot - 1) as usize;
                if (0..k).all(|j| key(other, j) == key(r, j)) {
                    // Strings of more than 12 bytes have hashes as lanes: two different
                    // ones with the same would be one key to the probe.
                    let same = |a: &arrow_array::ArrayRef| {
                        let a = a.as_string_view();
                        a.value(other) == a.value(r)
                    };
                    if !strings.iter().all(same) {
                        return Err(ComputeError::Input(format!(
                            "two different string join keys of the build side (rows {other} \
                             and {r}) have the same 64-bit hash; the device cannot join them"
                        ))
                        .into());
                    }
                    // The row goes first in its key's chain.
                    unique = false;
                    next[r] = slot;
                    slots[at as usize] = r as u32 + 1;
                    break;
                }
                at = (at + 1) & mask;
            }
        }
        let mut payload = batch.project(&plan.build_columns)?;
        if plan.keeps_rows_in_frame() {
            // All true: gathered to the probe rows, false (null) where a row has no
            // build row, it is the build columns' validity.
            let mut fields = payload.schema().fields().to_vec();
            fields.push(Arc::new(Field::new(MATCHED, DataType::Boolean, false)));
            let mut columns = payload.columns().to_vec();
            columns.push(Arc::new(arrow_array::BooleanArray::from(vec![true; rows])));
            payload = RecordBatch::try_new(Arc::new(Schema::new(fields)), columns)?;
        }
        let strings = (!strings.is_empty())
            .then(|| {
                let fields: Vec<Field> = (0..strings.len())
                    .map(|i| Field::new(format!("key{i}"), DataType::Utf8View, true))
                    .collect();
                RecordBatch::try_new(Arc::new(Schema::new(fields)), strings)
            })
            .transpose()?;
        Ok(JoinTable {
            plan: plan.clone(),
            rows,
            strings,
            unique,
            mask,
            slots,
            next,
            keys,
            payload,
            visited: std::sync::Mutex::new(Visited {
                flags: vec![0; if plan.kind.marks() { rows } else { 0 }],
                partitions: partitions.max(1),
            }),
            devices: std::sync::Mutex::new(OnDevices {
                binds: partitions.max(1),
                ..OnDevices::default()
            }),
            moved_on_host: std::sync::atomic::AtomicUsize::new(0),
        })
    }

    /// `table` on `device` for one partition: the table uploaded through `upload` where
    /// the device is not the host's, unless a partition bound there already did
    /// ([`JoinTable::on_device`]: the partitions of a query on one device share one
    /// upload).
    ///
    /// # Errors
    /// devarrow's (the upload).
    pub fn bind_table(
        &self,
        table: Arc<JoinTable>,
        device: &ExecDevice,
        upload: &mut Transfer,
    ) -> Result<BuiltJoin, BoxError> {
        let (on_device, _) = table.on_device(device, upload, None)?;
        self.bind_on(table, on_device, device, upload)
    }

    /// `table`, already on the partition's device as `on_device`, bound to one
    /// partition: where the join emits build rows, the partition's marks (uploaded
    /// through `upload` on CUDA).
    ///
    /// # Errors
    /// devarrow's (the upload).
    pub(crate) fn bind_on(
        &self,
        table: Arc<JoinTable>,
        on_device: Arc<DeviceTable>,
        device: &ExecDevice,
        upload: &mut Transfer,
    ) -> Result<BuiltJoin, BoxError> {
        let marks = if self.plan.kind.marks() {
            vec![0; table.rows]
        } else {
            Vec::new()
        };
        self.bind_marked(table, on_device, device, upload, marks)
    }

    /// `built` (bound where its table is on the host) bound again on `device`, its table
    /// there as `on_device`: the marks its probes made so far go with it (uploaded
    /// through `upload` on CUDA).
    ///
    /// # Errors
    /// devarrow's (the upload).
    pub(crate) fn moved(
        &self,
        built: &BuiltJoin,
        on_device: Arc<DeviceTable>,
        device: &ExecDevice,
        upload: &mut Transfer,
    ) -> Result<BuiltJoin, BoxError> {
        let marks =
            std::mem::take(&mut *built.host_marks.lock().unwrap_or_else(|e| e.into_inner()));
        self.bind_marked(built.table.clone(), on_device, device, upload, marks)
    }

    /// [`DeviceHashJoin::bind_on`] with the partition's marks so far (a flag per build
    /// row where the join emits build rows, else none).
    fn bind_marked(
        &self,
        table: Arc<JoinTable>,
        on_device: Arc<DeviceTable>,
        device: &ExecDevice,
        upload: &mut Transfer,
        marks: Vec<u8>,
    ) -> Result<BuiltJoin, BoxError> {
        #[allow(unused_mut)] // set on CUDA only
        let mut built = BuiltJoin {
            table,
            on_device,
            host_marks: std::sync::Mutex::new(Vec::new()),
            #[cfg(feature = "cuda")]
            marks: None,
        };
        #[cfg(feature = "cuda")]
        if !marks.is_empty() && built.on_device.tables.is_some() {
            let flags = RecordBatch::try_new(
                schema_of(vec![Field::new("marks", DataType::UInt8, false)]),
                vec![Arc::new(UInt8Array::from(marks))],
            )?;
            // The marks are the device's.
            built.marks = Some(super::cuda::Marks::new(upload.to_device(&flags)?));
            return Ok(built);
        }
        built.host_marks = std::sync::Mutex::new(marks);
        let _ = (device, upload);
        Ok(built)
    }
}

/// The two i64 lanes a string join key is hashed and compared by: the first 8 bytes of
/// its `Utf8View` view (its length, then its first 4 bytes), then the view's last 8
/// bytes where it has at most 12 bytes (the rest of it, zero-padded: the lanes are the
/// value), else a 64-bit hash of all its bytes. Two values of more than 12 bytes whose
/// lanes agree are compared byte by byte after the probe (`join_verify_view` on CUDA),
/// so a hash collision never makes a wrong match; two such values on the build side
/// fail the query ([`ComputeError::Input`]).
///
/// ```
/// use devarrow_datafusion::compute::join::string_key_lanes;
///
/// let [first, rest] = string_key_lanes(b"short");
/// assert_eq!(first as u64 & 0xFFFF_FFFF, 5); // the length
/// assert_eq!(&first.to_le_bytes()[4..], b"shor");
/// assert_eq!(&rest.to_le_bytes()[..1], b"t");
/// // A longer value: its length and prefix, then a hash of its bytes.
/// let [first, _hash] = string_key_lanes(b"a value longer than twelve bytes");
/// assert_eq!(first as u64 & 0xFFFF_FFFF, 32);
/// ```
pub fn string_key_lanes(bytes: &[u8]) -> [i64; 2] {
    super::expr::string_key_lanes(bytes)
}

/// A join's build side made into a table on the host ([`DeviceHashJoin::table`]): what
/// the partitions of a query that read the same build side share.
#[derive(Debug)]
pub struct JoinTable {
    pub(crate) plan: Arc<Plan>,
    pub(crate) rows: usize,
    unique: bool,
    pub(crate) mask: u64,
    slots: Vec<u32>,
    /// The next build row of each row's key + 1 (0: the last).
    next: Vec<u32>,
    keys: Vec<i64>,
    /// The values of the string keys (`Utf8View`, one column per key), for the probe to
    /// compare with its own where lanes agree.
    strings: Option<RecordBatch>,
    payload: RecordBatch,
    /// The build rows the partitions that ended matched, for a join whose output is
    /// build rows.
    visited: std::sync::Mutex<Visited>,
    /// The table on each device where partitions probe it (by the device's id).
    devices: std::sync::Mutex<OnDevices>,
    /// The bytes the query's partitions moved over the link joining on the host
    /// ([`JoinTable::moved_on_host`]).
    moved_on_host: std::sync::atomic::AtomicUsize,
}

/// A table's uploads, by device: held until each partition that probes the table has
/// bound (however far apart they start, the query's partitions on one device share one
/// upload), then while one of them holds it.
#[derive(Debug, Default)]
struct OnDevices {
    tables: Vec<(String, std::sync::Weak<DeviceTable>)>,
    held: Vec<Arc<DeviceTable>>,
    /// The partitions yet to bind.
    binds: usize,
}

/// A join's table on one device: uploaded once per device by the first partition of the
/// query bound there, shared by the others bound there while one of them holds it, its
/// device memory reserved in the query's `MemoryPool` until the last of them drops it.
#[derive(Debug)]
pub struct DeviceTable {
    /// On CUDA (none on the CPU device, which probes the host table in place, nor for
    /// an empty table).
    #[cfg(feature = "cuda")]
    tables: Option<super::cuda::DeviceTables>,
    /// Its device memory (on the CPU device, the host table's).
    device_bytes: usize,
    _reservation: Option<MemoryReservation>,
}

impl DeviceTable {
    /// Its device memory (on the CPU device, the host table's).
    pub fn device_bytes(&self) -> usize {
        self.device_bytes
    }
}

/// The build rows the probe partitions of a table matched, gathered as they end.
#[derive(Debug)]
struct Visited {
    /// A flag per build row (none for a join whose output is not build rows).
    flags: Vec<u8>,
    /// The partitions yet to end.
    partitions: usize,
}

impl JoinTable {
    /// The bytes an upload of the table moves (its columns' used ranges, its keys, its
    /// slots and chains): what the CPU device counts too, which joins in place.
    pub fn link_bytes(&self) -> usize {
        crate::frame::batch_bytes(&self.payload)
            + self.strings.as_ref().map_or(0, crate::frame::batch_bytes)
            + self.keys.len() * size_of::<i64>()
            + (self.slots.len() + self.next.len()) * size_of::<u32>()
    }

    /// The table where it is, for a partition that joins on the host (run-time
    /// placement): uploaded nowhere, counted as the partition's bind (see
    /// [`JoinTable::on_device`]).
    pub(crate) fn on_host(&self) -> Arc<DeviceTable> {
        let mut devices = self.devices.lock().unwrap_or_else(|e| e.into_inner());
        devices.binds = devices.binds.saturating_sub(1);
        if devices.binds == 0 {
            devices.held.clear();
        }
        Arc::new(DeviceTable {
            #[cfg(feature = "cuda")]
            tables: None,
            device_bytes: 0,
            _reservation: None,
        })
    }

    /// Adds `bytes` that a partition joining on the host (the table not uploaded) moved
    /// over the link for a frame (its rows down, its join up).
    pub(crate) fn moved_on_host(&self, bytes: usize) {
        self.moved_on_host
            .fetch_add(bytes, std::sync::atomic::Ordering::AcqRel);
    }

    /// Whether the query's host joins have moved as many bytes over the link as the
    /// table holds (when it is cheaper to upload it after all).
    pub(crate) fn host_joins_outweigh_it(&self) -> bool {
        self.moved_on_host
            .load(std::sync::atomic::Ordering::Acquire)
            >= self.link_bytes()
    }

    /// The host memory the table holds.
    fn host_bytes(&self) -> usize {
        self.payload.get_array_memory_size()
            + self
                .strings
                .as_ref()
                .map_or(0, |s| s.get_array_memory_size())
            + self.keys.len() * size_of::<i64>()
            + (self.slots.len() + self.next.len()) * size_of::<u32>()
    }

    /// The table on `device`, shared by the partitions of the query bound there: the
    /// first uploads it through `upload` (on its slot's stream: the others' streams wait
    /// for the upload's event when they read it), reserved in `reserve`'s pool for its
    /// partition if given (a refusal is [`DeviceExecError::Memory`]). With the bytes this
    /// call moved over the link ([`JoinTable::link_bytes`] when it uploaded, else 0).
    ///
    /// # Errors
    /// devarrow's (the upload), the reservation's.
    pub fn on_device(
        &self,
        device: &ExecDevice,
        upload: &mut Transfer,
        reserve: Option<(&Arc<dyn MemoryPool>, usize)>,
    ) -> Result<(Arc<DeviceTable>, usize), BoxError> {
        let key = device.id().to_string();
        // Held while the table is uploaded: a partition bound to the same device waits,
        // then shares it.
        let mut devices = self.devices.lock().unwrap_or_else(|e| e.into_inner());
        devices.binds = devices.binds.saturating_sub(1);
        let last = devices.binds == 0;
        devices.tables.retain(|(_, table)| table.strong_count() > 0);
        let found = devices
            .tables
            .iter()
            .find(|(id, _)| *id == key)
            .and_then(|(_, table)| table.upgrade());
        if last {
            // Every partition has bound: the uploads live as long as they hold them.
            devices.held.clear();
        }
        if let Some(table) = found {
            return Ok((table, 0));
        }
        #[cfg(feature = "cuda")]
        let tables = if device.cuda().is_some() && self.rows > 0 {
            Some(self.upload(upload)?)
        } else {
            None
        };
        #[cfg(feature = "cuda")]
        let device_bytes = tables.as_ref().map_or_else(
            || self.host_bytes(),
            |t| {
                t.payload.device_bytes()
                    + t.strings.as_ref().map_or(0, DeviceBatch::device_bytes)
                    + t.keys.device_bytes()
                    + t.slots.device_bytes()
            },
        );
        #[cfg(not(feature = "cuda"))]
        let device_bytes = {
            let _ = upload;
            self.host_bytes()
        };
        let reservation = match reserve {
            None => None,
            Some((pool, partition)) => {
                let reservation =
                    MemoryConsumer::new(format!("DeviceJoinTable@{key}")).register(pool);
                reservation
                    .try_grow(device_bytes)
                    .map_err(|e| DeviceExecError::Memory {
                        partition,
                        device: key.clone(),
                        bytes: device_bytes,
                        reason: e.to_string(),
                    })?;
                Some(reservation)
            }
        };
        let table = Arc::new(DeviceTable {
            #[cfg(feature = "cuda")]
            tables,
            device_bytes,
            _reservation: reservation,
        });
        devices.tables.push((key, Arc::downgrade(&table)));
        if !last {
            devices.held.push(table.clone());
        }
        Ok((table, self.link_bytes()))
    }

    #[cfg(feature = "cuda")]
    fn upload(&self, upload: &mut Transfer) -> Result<super::cuda::DeviceTables, BoxError> {
        use arrow_array::{ArrayRef, Int64Array};

        let one = |name: &str, array: ArrayRef| {
            let field = Field::new(name, array.data_type().clone(), false);
            RecordBatch::try_new(schema_of(vec![field]), vec![array])
        };
        let keys = one("keys", Arc::new(Int64Array::from(self.keys.clone())))?;
        let table: Vec<u32> = self.slots.iter().chain(&self.next).copied().collect();
        let slots = one("slots", Arc::new(UInt32Array::from(table)))?;
        Ok(super::cuda::DeviceTables {
            payload: upload.to_device(&self.payload)?,
            strings: self
                .strings
                .as_ref()
                .map(|s| upload.to_device(s))
                .transpose()?,
            keys: upload.to_device(&keys)?,
            slots: upload.to_device(&slots)?,
        })
    }

    /// Adds a partition's `flags` (the build rows it matched): the flags of every
    /// partition when it was the last to end, else `None`.
    fn merge(&self, flags: &[u8]) -> Result<Option<Vec<u8>>, BoxError> {
        let mut visited = self.visited.lock().unwrap_or_else(|e| e.into_inner());
        if flags.len() != visited.flags.len() || visited.partitions == 0 {
            return Err(ComputeError::Input(format!(
                "a join's build rows matched by one more partition ({} flags, {} expected, \
                 {} partitions to end)",
                flags.len(),
                visited.flags.len(),
                visited.partitions
            ))
            .into());
        }
        for (all, &one) in visited.flags.iter_mut().zip(flags) {
            *all |= one;
        }
        visited.partitions -= 1;
        Ok((visited.partitions == 0).then(|| std::mem::take(&mut visited.flags)))
    }
}

/// A row index per output row of a join (`NO_ROW`: none), where the device or the host
/// made them.
enum Rows {
    Host(Vec<u32>),
    #[cfg(feature = "cuda")]
    Device(devarrow::cuda::cudarc::driver::CudaSlice<u32>),
}

/// Each output row's build row, and its probe row (`None`: output row `i` is probe row
/// `i`, as where no build key repeats).
struct Pairs {
    build: Rows,
    probe: Option<Rows>,
}

/// A join's table bound to one partition's device ([`DeviceHashJoin::bind_table`]).
#[derive(Debug)]
pub struct BuiltJoin {
    table: Arc<JoinTable>,
    /// The table on the partition's device (shared with the query's other partitions
    /// there).
    on_device: Arc<DeviceTable>,
    /// The build rows this partition's probe rows matched, on the host (the CPU
    /// device's; the CUDA device's are on it).
    host_marks: std::sync::Mutex<Vec<u8>>,
    /// The build rows this partition's probe rows matched, on the device.
    #[cfg(feature = "cuda")]
    marks: Option<super::cuda::Marks>,
}

impl std::ops::Deref for BuiltJoin {
    type Target = JoinTable;

    fn deref(&self) -> &JoinTable {
        &self.table
    }
}

impl BuiltJoin {
    /// Whether each probe row matches at most one build row (no two build rows share
    /// their keys), or the join is a semi or anti join, where only a match's existence
    /// counts: then [`BuiltJoin::probe`] moves no row (else it makes one per matching
    /// pair).
    pub fn is_unique(&self) -> bool {
        self.unique
            || (matches!(
                self.plan.kind,
                JoinKind::Semi
                    | JoinKind::Anti
                    | JoinKind::LeftSemi
                    | JoinKind::LeftAnti
                    | JoinKind::Mark
                    | JoinKind::LeftMark
            ) && self.plan.filter.is_none())
    }

    /// The build side's rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// The table on the host.
    pub fn table(&self) -> &Arc<JoinTable> {
        &self.table
    }

    /// The table on the partition's device.
    pub fn on_device(&self) -> &Arc<DeviceTable> {
        &self.on_device
    }

    /// The device memory this partition holds of its own (its marks, where the join
    /// emits build rows): the table's is [`DeviceTable`]'s, shared.
    pub fn partition_bytes(&self) -> usize {
        #[cfg(feature = "cuda")]
        if let Some(marks) = &self.marks {
            return marks.flags.device_bytes();
        }
        self.host_marks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .len()
    }

    /// The device's table on CUDA.
    #[cfg(feature = "cuda")]
    fn device_tables(&self) -> Option<&super::cuda::DeviceTables> {
        self.on_device.tables.as_ref()
    }

    /// What the CUDA probe reads of the join.
    #[cfg(feature = "cuda")]
    fn device_probe(&self) -> Result<super::cuda::Probe<'_>, BoxError> {
        let tables = self
            .device_tables()
            .ok_or_else(|| ComputeError::Input("a join's table is not on the device".into()))?;
        let kind = self.plan.kind;
        // With a filter, only the pairs that pass it mark their build rows
        // (`BuiltJoin::mark_passed`).
        let marks = if kind.marks() && self.plan.filter.is_none() {
            Some(
                self.marks
                    .as_ref()
                    .ok_or_else(|| ComputeError::Input("a join without its marks".into()))?,
            )
        } else {
            None
        };
        Ok(super::cuda::Probe {
            tables,
            keys: &self.plan.probe_keys,
            strings: self
                .plan
                .string_keys
                .iter()
                .map(|key| (key.probe, key.probe_name.as_str()))
                .collect(),
            rows: self.rows,
            mask: self.mask,
            // With a filter, a semi or anti join probes as an inner join, then keeps the
            // probe rows with (or without) a pair that passed (`BuiltJoin::semi_filtered`).
            anti: kind == JoinKind::Anti && self.plan.filter.is_none(),
            right: self.plan.keeps_rows_in_frame(),
            gathers: !matches!(kind, JoinKind::Semi | JoinKind::Anti | JoinKind::Mark)
                || self.plan.filter.is_some(),
            marks,
        })
    }

    /// The build row whose keys are `key(0..k)`, if any (the probe of `join_probe`).
    fn find(&self, key: impl Fn(usize) -> i64) -> Option<u32> {
        let k = self.plan.build_keys.len();
        let mut at = hash((0..k).map(&key)) & self.mask;
        loop {
            let slot = self.slots[at as usize];
            if slot == 0 {
                return None;
            }
            let row = (slot - 1) as usize;
            if (0..k).all(|j| self.keys[j * self.rows + row] == key(j)) {
                return Some(slot - 1);
            }
            at = (at + 1) & self.mask;
        }
    }

    /// The join of `frame` (of the join's right schema), on `device`: the probe rows
    /// with a selection where [`is_unique`](BuiltJoin::is_unique), else one row per
    /// matching pair (see the [module](self)): one frame. None for a join whose output
    /// is only build rows (left semi, anti and mark joins), which marks the build rows
    /// `frame` matches and emits them at the end ([`BuiltJoin::finish`]). Two for a
    /// right or full join with a filter: the pairs that passed it, then the probe rows
    /// with none (their build columns null).
    ///
    /// # Errors
    /// The device's errors, [`ComputeError::Overflow`] for a key expression that
    /// overflows.
    pub fn probe(
        &self,
        frame: &DeviceFrame,
        device: &ExecDevice,
    ) -> Result<Vec<DeviceFrame>, BoxError> {
        let computed: Vec<&StringKey> = self
            .plan
            .string_keys
            .iter()
            .filter(|k| k.computed.is_some())
            .collect();
        if computed.is_empty() {
            return self.probe_frame(frame, device);
        }
        // The computed keys' columns appended to the frame (every output column is one of
        // the join's own, so none of them leaves the join); their overflow checks read
        // once the probe is done (a column that failed one is never output).
        let mut fields: Vec<_> = frame.schema().fields().iter().cloned().collect();
        let mut columns = frame.columns().to_vec();
        let mut checks = Vec::with_capacity(computed.len());
        for key in computed {
            let Some(expr) = &key.computed else { continue };
            let (column, check) = expr.evaluate_deferred(frame, device)?;
            fields.push(Arc::new(Field::new(
                &key.probe_name,
                expr.data_type().clone(),
                true,
            )));
            columns.push(column);
            checks.push(check);
        }
        let schema = Arc::new(Schema::new(fields));
        let with_keys = DeviceFrame::try_new(
            schema,
            columns,
            frame.num_rows(),
            frame.selection().cloned(),
        )?;
        let out = self.probe_frame(&with_keys, device)?;
        for check in checks {
            check.check()?;
        }
        Ok(out)
    }

    /// [`BuiltJoin::probe`] of `frame`, its computed keys' columns appended.
    fn probe_frame(
        &self,
        frame: &DeviceFrame,
        device: &ExecDevice,
    ) -> Result<Vec<DeviceFrame>, BoxError> {
        let kind = self.plan.kind;
        if kind.keeps_probe_rows() && self.plan.filter.is_some() {
            return self.outer_filtered(frame, device);
        }
        if kind.marks() && self.plan.filter.is_some() {
            // The pairs that pass the filter mark their build rows: the inner join with
            // its filter, its selected rows' build rows marked.
            let (joined, pairs) = self.joined_rows(frame, device)?;
            if let Some(pairs) = pairs {
                self.mark_passed(&joined, pairs.build, device)?;
            }
            return Ok(if kind == JoinKind::Left {
                vec![joined]
            } else {
                Vec::new()
            });
        }
        if matches!(kind, JoinKind::Semi | JoinKind::Anti) && self.plan.filter.is_some() {
            return Ok(vec![self.semi_filtered(frame, device)?]);
        }
        if kind == JoinKind::Mark {
            return Ok(vec![self.marked(frame, device)?]);
        }
        if !kind.marks_only() {
            return Ok(vec![self.joined(frame, device)?]);
        }
        if frame.num_rows() == 0 || self.rows == 0 {
            return Ok(Vec::new());
        }
        #[cfg(feature = "cuda")]
        if let Some(cuda) = device.cuda() {
            super::cuda::mark(&self.device_probe()?, frame, cuda)?;
            return Ok(Vec::new());
        }
        check_cpu(device)?;
        self.probe_on_host(frame)?;
        Ok(Vec::new())
    }

    /// A right or full join with a filter: the inner join with the filter (a full join
    /// marks the build rows of its pairs that passed), then the selected probe rows
    /// with no pair that passed, their build columns null: two frames (one where no
    /// pair can exist).
    fn outer_filtered(
        &self,
        frame: &DeviceFrame,
        device: &ExecDevice,
    ) -> Result<Vec<DeviceFrame>, BoxError> {
        let n = frame.num_rows();
        if n == 0 {
            return Ok(Vec::new());
        }
        let (joined, pairs) = self.joined_rows(frame, device)?;
        let passed = match pairs {
            None => None,
            Some(Pairs { build, probe }) => {
                if self.plan.kind == JoinKind::Full {
                    self.mark_passed(&joined, build, device)?;
                }
                Some((joined.clone(), probe))
            }
        };
        let paired = passed.is_some();
        let unpaired = self.kept_probe_rows(frame, passed, true, device)?;
        let nulls = Arc::new(self.null_build_columns(n, device)?);
        let rest = self.unfiltered_frame_of(n, Some(unpaired), |out| match out {
            Out::Probe(i) => Ok(frame
                .column(i)
                .ok_or_else(|| ComputeError::Input(format!("no probe column {i}")))?
                .clone()),
            Out::Build(j) => Ok(FrameColumn::new(nulls.clone(), j)?),
            Out::Mark => Err(ComputeError::Input("an outer join outputs no mark".into()).into()),
        })?;
        Ok(if paired {
            vec![joined, rest]
        } else {
            vec![rest]
        })
    }

    /// What the join emits once the partition's probe side has ended: for a join whose
    /// output is build rows (left semi, anti and outer joins), the build rows it keeps
    /// (the matched ones; the others, their probe columns null), gathered on the device;
    /// where the query's partitions share the build side, by the last of them to end
    /// (their marks merged on the host: one read-back of a byte per build row each).
    /// `None` for the others, and where no row is kept.
    ///
    /// # Errors
    /// The device's errors.
    pub fn finish(&self, device: &ExecDevice) -> Result<Option<DeviceFrame>, BoxError> {
        let kind = self.plan.kind;
        if !kind.marks() {
            return Ok(None);
        }
        let flags = self.marks(device)?;
        let Some(flags) = self.table.merge(&flags)? else {
            return Ok(None);
        };
        if kind == JoinKind::LeftMark {
            return self.left_marked(&flags, device);
        }
        let keep = kind == JoinKind::LeftSemi;
        let rows: Vec<u32> = (0..flags.len() as u32)
            .filter(|&r| (flags[r as usize] != 0) == keep)
            .collect();
        if rows.is_empty() {
            return Ok(None);
        }
        let m = rows.len();
        let gathered = if self.plan.build_columns.is_empty() {
            None
        } else {
            Some(self.gather_rows(&rows, device)?)
        };
        let nulls = kind
            .emits_unmatched()
            .then(|| self.null_probe_columns(m, device))
            .transpose()?;
        let gathered = gathered.map(Arc::new);
        let nulls = nulls.map(Arc::new);
        self.unfiltered_frame_of(m, None, |out| {
            let (batch, at) = match out {
                Out::Mark => {
                    return Err(ComputeError::Input("a mark join emits no build row".into()).into())
                }
                Out::Build(j) => (&gathered, j),
                Out::Probe(i) => (
                    &nulls,
                    self.plan
                        .output
                        .iter()
                        .filter(|o| matches!(o, Out::Probe(_)))
                        .position(|o| matches!(o, Out::Probe(p) if *p == i))
                        .ok_or_else(|| ComputeError::Input(format!("no probe column {i}")))?,
                ),
            };
            let batch = batch
                .as_ref()
                .ok_or_else(|| ComputeError::Input("no build rows gathered".into()))?;
            Ok(FrameColumn::new(batch.clone(), at)?)
        })
        .map(Some)
    }

    /// A left mark join's output, once every partition's marks are merged (`flags`):
    /// every build row, with a Boolean of whether a probe row matched it (uploaded).
    fn left_marked(
        &self,
        flags: &[u8],
        device: &ExecDevice,
    ) -> Result<Option<DeviceFrame>, BoxError> {
        let m = flags.len();
        if m == 0 {
            return Ok(None);
        }
        let field = self.mark_field()?;
        let mark = Arc::new(booleans_on(field, flags.iter().map(|&f| f != 0), device)?);
        let all: Vec<u32> = (0..m as u32).collect();
        let gathered = if self.plan.build_columns.is_empty() {
            None
        } else {
            Some(Arc::new(self.gather_rows(&all, device)?))
        };
        self.unfiltered_frame_of(m, None, |out| match out {
            Out::Mark => Ok(FrameColumn::new(mark.clone(), 0)?),
            Out::Build(j) => {
                let batch = gathered
                    .as_ref()
                    .ok_or_else(|| ComputeError::Input("no build rows gathered".into()))?;
                Ok(FrameColumn::new(batch.clone(), j)?)
            }
            Out::Probe(_) => {
                Err(ComputeError::Input("a left mark join outputs no probe column".into()).into())
            }
        })
        .map(Some)
    }

    /// The output's field of a mark join's Boolean.
    fn mark_field(&self) -> Result<Field, BoxError> {
        Ok(self
            .plan
            .output
            .iter()
            .zip(self.plan.schema.fields())
            .find(|(out, _)| matches!(out, Out::Mark))
            .map(|(_, f)| f.as_ref().clone())
            .ok_or_else(|| ComputeError::Input("a mark join without its mark".into()))?)
    }

    /// A mark join: every probe row of `frame` (its selection kept), with a Boolean of
    /// whether it matched a build row.
    fn marked(&self, frame: &DeviceFrame, device: &ExecDevice) -> Result<DeviceFrame, BoxError> {
        let n = frame.num_rows();
        if n == 0 {
            return empty_frame(&self.plan.schema, device);
        }
        let field = self.mark_field()?;
        let mark = Arc::new(if self.plan.filter.is_some() && self.rows > 0 {
            self.filtered_marks_of(frame, field, device)?
        } else {
            self.marks_of(frame, field, device)?
        });
        self.unfiltered_frame_of(n, frame.selection().cloned(), |out| match out {
            Out::Probe(i) => Ok(frame
                .column(i)
                .ok_or_else(|| ComputeError::Input(format!("no probe column {i}")))?
                .clone()),
            Out::Mark => Ok(FrameColumn::new(mark.clone(), 0)?),
            Out::Build(_) => {
                Err(ComputeError::Input("a mark join outputs no build column".into()).into())
            }
        })
    }

    /// Whether each row of `frame` matches a build row, as a Boolean column (`field`).
    fn marks_of(
        &self,
        frame: &DeviceFrame,
        field: Field,
        device: &ExecDevice,
    ) -> Result<DeviceBatch, BoxError> {
        let n = frame.num_rows();
        #[cfg(feature = "cuda")]
        if let Some(cuda) = device.cuda() {
            if self.rows > 0 {
                let (hits, _, _) = super::cuda::join(&self.device_probe()?, frame, cuda, device)?;
                return super::cuda::booleans(&hits, field, cuda, device);
            }
        }
        let hits = if self.rows == 0 {
            vec![0; n]
        } else {
            check_cpu(device)?;
            self.probe_on_host(frame)?.1
        };
        booleans_on(field, hits.iter().map(|&h| h != 0), device)
    }

    /// A mark join's Booleans with a filter: whether each probe row of `frame` has a
    /// pair that passes it (the inner join with the filter, as a semi join's).
    fn filtered_marks_of(
        &self,
        frame: &DeviceFrame,
        field: Field,
        device: &ExecDevice,
    ) -> Result<DeviceBatch, BoxError> {
        let (joined, pairs) = self.joined_rows(frame, device)?;
        let passed = pairs.map(|pairs| (joined, pairs.probe));
        let kept = self.kept_probe_rows(frame, passed, false, device)?;
        #[cfg(feature = "cuda")]
        if let Some(cuda) = device.cuda() {
            return super::cuda::booleans(&kept, field, cuda, device);
        }
        check_cpu(device)?;
        let flags = host::load(&kept, "kept rows")?;
        booleans_on(field, flags.values.iter().map(|&f| f != 0), device)
    }

    /// A right semi or anti join with a filter: the probe rows with a pair that passes
    /// it (semi), or the selected ones without (anti), as a selection of `frame`'s rows.
    fn semi_filtered(
        &self,
        frame: &DeviceFrame,
        device: &ExecDevice,
    ) -> Result<DeviceFrame, BoxError> {
        let n = frame.num_rows();
        let anti = self.plan.kind == JoinKind::Anti;
        if n == 0 || (self.rows == 0 && !anti) {
            return empty_frame(&self.plan.schema, device);
        }
        let selection = if self.rows == 0 {
            // An anti join with an empty build side keeps every selected row.
            frame.selection().cloned()
        } else {
            // The inner join with the filter: a row per pair, kept where it passed.
            let (joined, pairs) = self.joined_rows(frame, device)?;
            let passed = pairs.map(|pairs| (joined, pairs.probe));
            Some(self.kept_probe_rows(frame, passed, anti, device)?)
        };
        self.unfiltered_frame_of(n, selection, |out| match out {
            Out::Probe(i) => Ok(frame
                .column(i)
                .ok_or_else(|| ComputeError::Input(format!("no probe column {i}")))?
                .clone()),
            Out::Build(_) | Out::Mark => Err(ComputeError::Input(
                "a semi or anti join outputs no build column".into(),
            )
            .into()),
        })
    }

    /// The selection of `frame`'s rows a semi join keeps (those with a pair that passed:
    /// `passed`'s output rows that its selection keeps, each its probe row, or output
    /// row `i` probe row `i`), or an anti join (the selected rows without one).
    fn kept_probe_rows(
        &self,
        frame: &DeviceFrame,
        passed: Option<(DeviceFrame, Option<Rows>)>,
        anti: bool,
        device: &ExecDevice,
    ) -> Result<FrameColumn, BoxError> {
        let n = frame.num_rows();
        #[cfg(feature = "cuda")]
        if let Some(cuda) = device.cuda() {
            let passed = match &passed {
                None => None,
                Some((joined, probe)) => {
                    let selection = joined.selection().ok_or_else(|| {
                        ComputeError::Input("a join filter without a selection".into())
                    })?;
                    let probe = match probe {
                        None => None,
                        Some(Rows::Device(rows)) => Some(rows),
                        Some(Rows::Host(_)) => {
                            return Err(ComputeError::Input(
                                "a join's rows are not on the device".into(),
                            )
                            .into())
                        }
                    };
                    Some((selection, probe, joined.num_rows()))
                }
            };
            return super::cuda::kept_probe_rows(frame, passed, anti, cuda, device);
        }
        check_cpu(device)?;
        let selected = host::selection(frame)?;
        let mut with_pair = vec![0u8; n];
        if let Some((joined, probe)) = &passed {
            let pass = host::selection(joined)?;
            match probe {
                None => with_pair.copy_from_slice(&pass[..n]),
                Some(Rows::Host(rows)) => {
                    for (&row, &pass) in rows.iter().zip(&pass) {
                        if pass != 0 {
                            if let Some(flag) = with_pair.get_mut(row as usize) {
                                *flag = 1;
                            }
                        }
                    }
                }
                #[cfg(feature = "cuda")]
                Some(Rows::Device(_)) => {
                    return Err(ComputeError::Input("a join's rows are on a device".into()).into())
                }
            }
        }
        let kept: Vec<u8> = selected
            .iter()
            .zip(&with_pair)
            .map(|(&s, &p)| if anti { (s != 0 && p == 0) as u8 } else { p })
            .collect();
        let schema = schema_of(vec![Field::new(super::SELECTION, DataType::UInt8, false)]);
        let kept = RecordBatch::try_new(schema, vec![Arc::new(UInt8Array::from(kept))])?;
        cpu_column(kept, device)
    }

    /// Marks the build rows (`rows`) of the rows of `joined` that its selection keeps.
    fn mark_passed(
        &self,
        joined: &DeviceFrame,
        rows: Rows,
        device: &ExecDevice,
    ) -> Result<(), BoxError> {
        match rows {
            #[cfg(feature = "cuda")]
            Rows::Device(rows) => {
                let n = joined.num_rows();
                let (Some(cuda), Some(marks)) = (device.cuda(), &self.marks) else {
                    return Err(
                        ComputeError::Input("a join's marks are not on the device".into()).into(),
                    );
                };
                let selection = joined.selection().ok_or_else(|| {
                    ComputeError::Input("a join filter without a selection".into())
                })?;
                marks.mark_rows(cuda, &rows, selection, n)
            }
            Rows::Host(rows) => {
                let _ = device;
                let passed = host::selection(joined)?;
                let mut marks = self.host_marks.lock().unwrap_or_else(|e| e.into_inner());
                for (&row, &passed) in rows.iter().zip(&passed) {
                    if passed != 0 {
                        if let Some(flag) = marks.get_mut(row as usize) {
                            *flag = 1;
                        }
                    }
                }
                Ok(())
            }
        }
    }

    /// The build rows this partition's probe rows matched (a flag each), taken.
    fn marks(&self, device: &ExecDevice) -> Result<Vec<u8>, BoxError> {
        #[cfg(feature = "cuda")]
        if let (Some(cuda), Some(marks)) = (device.cuda(), &self.marks) {
            return marks.read(cuda);
        }
        let _ = device;
        let mut marks = self.host_marks.lock().unwrap_or_else(|e| e.into_inner());
        if marks.len() != self.rows {
            return Err(ComputeError::Input("a join's marks were taken".into()).into());
        }
        Ok(std::mem::take(&mut *marks))
    }

    /// The payload's rows `rows` on `device` (gathered there).
    fn gather_rows(&self, rows: &[u32], device: &ExecDevice) -> Result<DeviceBatch, BoxError> {
        #[cfg(feature = "cuda")]
        if let (Some(cuda), Some(tables)) = (device.cuda(), self.device_tables()) {
            return super::cuda::gather_rows(tables, rows, cuda, device);
        }
        check_cpu(device)?;
        taken(&self.payload, &UInt32Array::from(rows.to_vec()), device)
    }

    /// The output's probe columns, every value null, for `n` rows (uploaded; in the
    /// order the output takes them).
    fn null_probe_columns(&self, n: usize, device: &ExecDevice) -> Result<DeviceBatch, BoxError> {
        let fields: Vec<Field> = self
            .plan
            .output
            .iter()
            .zip(self.plan.schema.fields())
            .filter(|(out, _)| matches!(out, Out::Probe(_)))
            .map(|(_, f)| f.as_ref().clone().with_nullable(true))
            .collect();
        null_batch(fields, n, device)
    }

    /// The join of `frame` when the output has probe rows (see [`BuiltJoin::probe`]).
    fn joined(&self, frame: &DeviceFrame, device: &ExecDevice) -> Result<DeviceFrame, BoxError> {
        self.joined_rows(frame, device).map(|(joined, _)| joined)
    }

    /// [`BuiltJoin::joined`], with the build row of each output row where it is known
    /// (a row that matched; `None`: no output row has one).
    fn joined_rows(
        &self,
        frame: &DeviceFrame,
        device: &ExecDevice,
    ) -> Result<(DeviceFrame, Option<Pairs>), BoxError> {
        if !self.is_unique() {
            return self.expand(frame, device);
        }
        let n = frame.num_rows();
        let right = self.plan.keeps_rows_in_frame();
        if n == 0 || (self.rows == 0 && !right && self.plan.kind != JoinKind::Anti) {
            return Ok((empty_frame(&self.plan.schema, device)?, None));
        }
        if self.rows == 0 {
            // An anti join with an empty build side keeps every probe row it is given, a
            // right join too, its build columns null.
            let nulls = right
                .then(|| self.null_build_columns(n, device))
                .transpose()?;
            let joined = self.output(frame, frame.selection().cloned(), nulls, device)?;
            return Ok((joined, None));
        }
        #[cfg(feature = "cuda")]
        if let Some(cuda) = device.cuda() {
            let (selection, gathered, idx) =
                super::cuda::join(&self.device_probe()?, frame, cuda, device)?;
            // A right join keeps the frame's rows: its selection is the frame's.
            let selection = if right {
                frame.selection().cloned()
            } else {
                Some(selection)
            };
            let joined = self.output(frame, selection, gathered, device)?;
            let pairs = Pairs {
                build: Rows::Device(idx),
                probe: None,
            };
            return Ok((joined, Some(pairs)));
        }
        check_cpu(device)?;
        let (rows, hits) = self.probe_on_host(frame)?;
        let build_rows = || Pairs {
            build: Rows::Host(rows.iter().map(|r| r.unwrap_or(NO_ROW)).collect()),
            probe: None,
        };
        if right {
            let indices = UInt32Array::from(rows.clone());
            let gathered = taken(&self.payload, &indices, device)?;
            let joined = self.output(frame, frame.selection().cloned(), Some(gathered), device)?;
            return Ok((joined, Some(build_rows())));
        }
        let schema = schema_of(vec![Field::new(super::SELECTION, DataType::UInt8, false)]);
        let selection = RecordBatch::try_new(schema, vec![Arc::new(UInt8Array::from(hits))])?;
        let selection = cpu_column(selection, device)?;
        let gathered = if self.plan.build_columns.is_empty() {
            None
        } else {
            // A row with no match takes build row 0 (there is one: the table is not
            // empty): not selected, it is never seen, and it brings no null into a
            // column that declares none.
            let indices = UInt32Array::from_iter_values(rows.iter().map(|r| r.unwrap_or(0)));
            Some(taken(&self.payload, &indices, device)?)
        };
        let joined = self.output(frame, Some(selection), gathered, device)?;
        Ok((joined, Some(build_rows())))
    }

    /// Each probe row's build row (the first of its key's chain), and whether it is in
    /// the output (a match; no match for an anti join), on the host.
    fn probe_on_host(&self, frame: &DeviceFrame) -> Result<(Vec<Option<u32>>, Vec<u8>), BoxError> {
        let selected = host::selection(frame)?;
        let lanes = self
            .plan
            .probe_keys
            .iter()
            .map(|key| host::eval(&key.node, frame, &key.text))
            .collect::<Result<Vec<_>, _>>()?;
        // The string keys' values, probe side and build side: where lanes agree, the
        // values must (a long value's lanes hold its hash).
        let strings = self
            .plan
            .string_keys
            .iter()
            .map(|key| {
                let column = host::frame_column(frame, key.probe, &key.probe_name)?;
                host::view_values(column, &key.probe_name)
            })
            .collect::<Result<Vec<_>, BoxError>>()?;
        let build_strings = self.strings.as_ref().map(|b| b.columns());
        let same = |i: usize, row: u32| {
            strings.iter().enumerate().all(|(j, probe)| {
                let build = build_strings.and_then(|columns| columns.get(j));
                build.is_some_and(|b| {
                    probe[i] == Some(b.as_string_view().value(row as usize).as_bytes())
                })
            })
        };
        let mut rows = Vec::with_capacity(selected.len());
        let mut hits = Vec::with_capacity(selected.len());
        for (i, &selected) in selected.iter().enumerate() {
            let found = (selected != 0 && lanes.iter().all(|l| l.is_valid(i)))
                .then(|| self.find(|j| lanes[j].values[i]))
                .flatten()
                .filter(|&row| same(i, row));
            let marks = self.plan.kind.marks() && self.plan.filter.is_none();
            if let Some(first) = found.filter(|_| marks) {
                let mut marks = self.host_marks.lock().unwrap_or_else(|e| e.into_inner());
                let mut row = Some(first);
                while let Some(r) = row {
                    if let Some(flag) = marks.get_mut(r as usize) {
                        *flag = 1;
                    }
                    row = self.next[r as usize].checked_sub(1);
                }
            }
            rows.push(found);
            hits.push(match self.plan.kind {
                JoinKind::Anti if self.plan.filter.is_none() => {
                    (selected != 0 && found.is_none()) as u8
                }
                _ => found.is_some() as u8,
            });
        }
        Ok((rows, hits))
    }

    /// An inner join whose build keys repeat: one output row per matching pair, the
    /// pairs in probe order, each side's columns gathered to them; no selection.
    fn expand(
        &self,
        frame: &DeviceFrame,
        device: &ExecDevice,
    ) -> Result<(DeviceFrame, Option<Pairs>), BoxError> {
        let n = frame.num_rows();
        if n == 0 {
            return Ok((empty_frame(&self.plan.schema, device)?, None));
        }
        let probe_columns = self.plan.probe_columns();
        #[cfg(feature = "cuda")]
        if let Some(cuda) = device.cuda() {
            let expanded = super::cuda::join_expanded(
                &self.device_probe()?,
                frame,
                &probe_columns,
                cuda,
                device,
            )?;
            if expanded.rows == 0 {
                return Ok((empty_frame(&self.plan.schema, device)?, None));
            }
            let joined = self.output_pairs(
                expanded.rows,
                &probe_columns,
                expanded.build,
                expanded.probe,
                device,
            )?;
            let pairs = match (expanded.build_rows, expanded.probe_rows) {
                (Some(build), Some(probe)) => Some(Pairs {
                    build: Rows::Device(build),
                    probe: Some(Rows::Device(probe)),
                }),
                _ => None,
            };
            return Ok((joined, pairs));
        }
        check_cpu(device)?;
        let (rows, _hits) = self.probe_on_host(frame)?;
        let selected = host::selection(frame)?;
        let (mut build_rows, mut probe_rows) = (Vec::new(), Vec::new());
        for (i, first) in rows.iter().enumerate() {
            if first.is_none() && self.plan.keeps_rows_in_frame() && selected[i] != 0 {
                // A right join keeps a selected row with no match, its build columns null.
                build_rows.push(None);
                probe_rows.push(i as u32);
            }
            let mut row = *first;
            while let Some(r) = row {
                build_rows.push(Some(r));
                probe_rows.push(i as u32);
                row = self.next[r as usize].checked_sub(1);
            }
        }
        if build_rows.is_empty() {
            return Ok((empty_frame(&self.plan.schema, device)?, None));
        }
        let pairs = build_rows.len();
        let rows_of_pairs = Pairs {
            build: Rows::Host(build_rows.iter().map(|r| r.unwrap_or(NO_ROW)).collect()),
            probe: Some(Rows::Host(probe_rows.clone())),
        };
        let build = if self.plan.build_columns.is_empty() {
            None
        } else {
            Some(taken(
                &self.payload,
                &UInt32Array::from(build_rows),
                device,
            )?)
        };
        let probe = if probe_columns.is_empty() {
            None
        } else {
            let mut transfer = Transfer::new(
                device.device().clone(),
                devarrow::bridge::TransferOptions::default(),
            );
            let picked = frame.project(&probe_columns)?;
            let unselected = DeviceFrame::try_new(
                picked.schema().clone(),
                picked.columns().to_vec(),
                picked.num_rows(),
                None,
            )?;
            let host = unselected.download(&mut transfer)?;
            Some(taken(&host, &UInt32Array::from(probe_rows), device)?)
        };
        let joined = self.output_pairs(pairs, &probe_columns, build, probe, device)?;
        Ok((joined, Some(rows_of_pairs)))
    }

    /// The output frame of `rows` pairs: the build columns (`build`, in the order of the
    /// plan's build columns) and the probe columns at `probe_columns` (`probe`), gathered
    /// to the pairs; the filter's selection, if the join has one.
    fn output_pairs(
        &self,
        rows: usize,
        probe_columns: &[usize],
        build: Option<DeviceBatch>,
        probe: Option<DeviceBatch>,
        device: &ExecDevice,
    ) -> Result<DeviceFrame, BoxError> {
        let build = build.map(Arc::new);
        let probe = probe.map(Arc::new);
        self.frame_of(rows, None, device, |out| {
            let (batch, at) = match out {
                Out::Mark => {
                    return Err(ComputeError::Input("a mark join makes no pairs".into()).into())
                }
                Out::Build(j) => (&build, j),
                Out::Probe(i) => (
                    &probe,
                    probe_columns
                        .iter()
                        .position(|&c| c == i)
                        .ok_or_else(|| ComputeError::Input(format!("no probe column {i}")))?,
                ),
            };
            let batch = batch
                .as_ref()
                .ok_or_else(|| ComputeError::Input("no gathered columns".into()))?;
            Ok(FrameColumn::new(batch.clone(), at)?)
        })
    }

    /// The output frame: the probe frame's rows, `selection`, the build columns
    /// `gathered` to the probe rows (one batch, in the order of the plan's build
    /// columns), the output columns picked; and the filter, if the join has one.
    pub(crate) fn output(
        &self,
        frame: &DeviceFrame,
        selection: Option<FrameColumn>,
        gathered: Option<DeviceBatch>,
        device: &ExecDevice,
    ) -> Result<DeviceFrame, BoxError> {
        let gathered = gathered.map(Arc::new);
        if self.plan.output.iter().any(|o| matches!(o, Out::Mark)) {
            // A mark join with a filter joins for the pairs that pass it: the selection
            // alone (its output is made of the marks).
            let (predicate, schema, columns) = self.plan.filter.as_ref().ok_or_else(|| {
                ComputeError::Input("a mark join's pairs without a filter".into())
            })?;
            let columns = columns
                .iter()
                .map(|&c| self.joined_column(frame, &gathered, c))
                .collect::<Result<_, _>>()?;
            let rows = frame.num_rows();
            let intermediate = DeviceFrame::try_new(schema.clone(), columns, rows, selection)?;
            let passed = super::select(predicate, &intermediate, device)?;
            let none = Arc::new(Schema::empty());
            return Ok(DeviceFrame::try_new(none, Vec::new(), rows, Some(passed))?);
        }
        self.frame_of(frame.num_rows(), selection, device, |out| {
            self.joined_column(frame, &gathered, out)
        })
    }

    /// An output column of the join of `frame`: one of its own, or one of the build
    /// columns `gathered` to its rows.
    fn joined_column(
        &self,
        frame: &DeviceFrame,
        gathered: &Option<Arc<DeviceBatch>>,
        out: Out,
    ) -> Result<FrameColumn, BoxError> {
        match out {
            Out::Mark => Err(ComputeError::Input("a mark join's mark is its own".into()).into()),
            Out::Probe(i) => Ok(frame
                .column(i)
                .ok_or_else(|| ComputeError::Input(format!("no probe column {i}")))?
                .clone()),
            Out::Build(j) => {
                let batch = gathered
                    .as_ref()
                    .ok_or_else(|| ComputeError::Input("no gathered build columns".into()))?;
                Ok(FrameColumn::new(batch.clone(), j)?)
            }
        }
    }

    /// The output frame of `rows` rows whose columns `column` finds, with `selection`
    /// and-ed with the join filter's, if the join has one.
    fn frame_of(
        &self,
        rows: usize,
        selection: Option<FrameColumn>,
        device: &ExecDevice,
        column: impl Fn(Out) -> Result<FrameColumn, BoxError>,
    ) -> Result<DeviceFrame, BoxError> {
        let selection = match &self.plan.filter {
            None => selection,
            Some((predicate, schema, columns)) => {
                let columns = columns
                    .iter()
                    .map(|&c| column(c))
                    .collect::<Result<_, _>>()?;
                let intermediate = DeviceFrame::try_new(schema.clone(), columns, rows, selection)?;
                Some(super::select(predicate, &intermediate, device)?)
            }
        };
        self.unfiltered_frame_of(rows, selection, column)
    }

    /// The output frame of `rows` rows whose columns `column` finds, with `selection`
    /// (the join filter's already applied: the build rows a join emits at the end passed
    /// it or had no pair that did).
    fn unfiltered_frame_of(
        &self,
        rows: usize,
        selection: Option<FrameColumn>,
        column: impl Fn(Out) -> Result<FrameColumn, BoxError>,
    ) -> Result<DeviceFrame, BoxError> {
        let columns = self
            .plan
            .output
            .iter()
            .map(|&c| column(c))
            .collect::<Result<_, _>>()?;
        Ok(DeviceFrame::try_new(
            self.plan.schema.clone(),
            columns,
            rows,
            selection,
        )?)
    }
}

impl BuiltJoin {
    /// A right join's build columns for `n` probe rows when its build side is empty:
    /// every value null (uploaded).
    fn null_build_columns(&self, n: usize, device: &ExecDevice) -> Result<DeviceBatch, BoxError> {
        let schema = self.payload.schema();
        let fields: Vec<Field> = schema
            .fields()
            .iter()
            .map(|f| f.as_ref().clone().with_nullable(true))
            .collect();
        null_batch(fields, n, device)
    }
}

/// `values` as a batch of one Boolean column (`field`, no nulls) on `device` (uploaded).
fn booleans_on(
    field: Field,
    values: impl Iterator<Item = bool>,
    device: &ExecDevice,
) -> Result<DeviceBatch, BoxError> {
    let column = Arc::new(arrow_array::BooleanArray::from_iter(values.map(Some)));
    let batch = RecordBatch::try_new(schema_of(vec![field.with_nullable(false)]), vec![column])?;
    let mut transfer = Transfer::new(
        device.device().clone(),
        devarrow::bridge::TransferOptions::default(),
    );
    Ok(transfer.to_device(&batch)?)
}

/// `n` rows of `fields`, every value null, on `device` (uploaded).
fn null_batch(fields: Vec<Field>, n: usize, device: &ExecDevice) -> Result<DeviceBatch, BoxError> {
    let columns = fields
        .iter()
        .map(|f| arrow_array::new_null_array(f.data_type(), n))
        .collect();
    let options = arrow_array::RecordBatchOptions::new().with_row_count(Some(n));
    let batch =
        RecordBatch::try_new_with_options(Arc::new(Schema::new(fields)), columns, &options)?;
    let mut transfer = Transfer::new(
        device.device().clone(),
        devarrow::bridge::TransferOptions::default(),
    );
    Ok(transfer.to_device(&batch)?)
}

/// The rows `indices` of every column of `batch` (a host batch), as a batch of nullable
/// columns on the CPU device (exported in place).
fn taken(
    batch: &RecordBatch,
    indices: &UInt32Array,
    device: &ExecDevice,
) -> Result<DeviceBatch, BoxError> {
    let mut fields = Vec::with_capacity(batch.num_columns());
    let mut columns = Vec::with_capacity(batch.num_columns());
    for (field, column) in batch.schema().fields().iter().zip(batch.columns()) {
        fields.push(field.as_ref().clone().with_nullable(true));
        columns.push(take(column.as_ref(), indices, None)?);
    }
    let batch = RecordBatch::try_new(Arc::new(Schema::new(fields)), columns)?;
    let (array, _schema) = devarrow::abi::cpu::export_record_batch(&batch)?;
    Ok(DeviceBatch::import(
        device.device().clone(),
        array,
        batch.schema(),
    )?)
}

/// A frame of no rows of `schema` on `device` (an empty batch, uploaded).
fn empty_frame(schema: &SchemaRef, device: &ExecDevice) -> Result<DeviceFrame, BoxError> {
    let batch = RecordBatch::new_empty(schema.clone());
    let mut transfer = Transfer::new(
        device.device().clone(),
        devarrow::bridge::TransferOptions::default(),
    );
    Ok(DeviceFrame::from_batch(transfer.to_device(&batch)?))
}
