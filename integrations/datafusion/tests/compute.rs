//! Device compute (`devarrow_datafusion::compute`) on the CPU device, against DataFusion's
//! own evaluation: each expression kind and type (nulls, decimal scale alignment,
//! overflow), selections against DataFusion's filter, and the partial aggregates of TPC-H
//! Q1 and Q6 against DataFusion's own `Partial` `AggregateExec` on the same batches, then
//! a `Final` aggregate over the device's partials against DataFusion's.
//!
//! The checks take the device: `tests/gpu.rs` runs them on CUDA (the PTX kernels).

mod common;

use std::sync::Arc;

use arrow_array::{
    Array, ArrayRef, BooleanArray, Date32Array, Decimal128Array, Int32Array, Int64Array,
    RecordBatch, StringArray, UInt8Array,
};
use arrow_schema::{DataType, Field, Schema};
use datafusion::arrow::compute::{concat_batches, filter_record_batch};
use datafusion::arrow::util::pretty::pretty_format_batches;
use datafusion::datasource::memory::MemorySourceConfig;
use datafusion::datasource::MemTable;
use datafusion::physical_plan::aggregates::{AggregateExec, AggregateMode};
use datafusion::physical_plan::filter::FilterExec;
use datafusion::physical_plan::projection::ProjectionExec;
use datafusion::physical_plan::{collect, collect_partitioned, ExecutionPlan};
use datafusion::prelude::{SessionConfig, SessionContext};
use devarrow::bridge::{DeviceBatch, Transfer, TransferOptions};
use devarrow_datafusion::compute::{
    select, ComputeError, DeviceExpr, DevicePartialAggregate, Unsupported,
};
use devarrow_datafusion::frame::{DeviceFrame, FrameColumn};
use devarrow_datafusion::ExecDevice;

use common::*;

/// Whether these are the CPU tests of this file (not its checks included by gpu.rs).
fn own_tests() -> bool {
    !module_path!().contains("compute_checks")
}

pub const Q1: &str = "select l_returnflag, l_linestatus, sum(l_quantity) as sum_qty, \
    sum(l_extendedprice) as sum_base_price, sum(l_extendedprice * (1 - l_discount)) as \
    sum_disc_price, sum(l_extendedprice * (1 - l_discount) * (1 + l_tax)) as sum_charge, \
    avg(l_quantity) as avg_qty, avg(l_extendedprice) as avg_price, avg(l_discount) as \
    avg_disc, count(*) as count_order from lineitem where l_shipdate <= date '1998-12-01' - \
    interval '90' day group by l_returnflag, l_linestatus order by l_returnflag, l_linestatus";

pub const Q6: &str = "select sum(l_extendedprice * l_discount) as revenue from lineitem \
    where l_shipdate >= date '1994-01-01' and l_shipdate < date '1994-01-01' + interval '1' \
    year and l_discount between 0.06 - 0.01 and 0.06 + 0.01 and l_quantity < 24";

/// A frame of `batch` on `device`.
pub fn upload(batch: &RecordBatch, device: &ExecDevice) -> DeviceFrame {
    let mut transfer = Transfer::new(device.device().clone(), TransferOptions::default());
    DeviceFrame::from_batch(transfer.to_device(batch).expect("upload"))
}

/// `batch` on `device` as an imported batch whose root struct has an offset: uploaded
/// with `skip` more rows in front, exported, the root's offset and length set to the
/// rows of `batch`, and imported again (every column then has a non-zero offset into
/// buffers that begin before its first row, as a foreign producer's slice has).
pub fn upload_with_offset(batch: &RecordBatch, skip: usize, device: &ExecDevice) -> DeviceFrame {
    let front = batch.slice(0, skip.min(batch.num_rows()));
    let padded = concat_batches(&batch.schema(), [&front, batch]).unwrap();
    let mut transfer = Transfer::new(device.device().clone(), TransferOptions::default());
    let whole = transfer.to_device(&padded).expect("upload");
    let (array, _schema) = whole.export().expect("export");
    let mut raw = array.into_raw();
    raw.array.offset = front.num_rows() as i64;
    raw.array.length = batch.num_rows() as i64;
    // SAFETY: the export's own struct, released by the import; only its root's offset
    // and length changed, to rows its children hold.
    let array = unsafe { devarrow::abi::DeviceArray::try_new(raw) }.expect("a live array");
    let imported = DeviceBatch::import(device.device().clone(), array, batch.schema())
        .expect("import with an offset");
    let frame = DeviceFrame::from_batch(imported);
    for column in frame.columns() {
        assert_eq!(
            column.column().offset(),
            front.num_rows(),
            "an offset column"
        );
    }
    frame
}

/// `text`, a projection over `table` of `ctx`, compiled for the device and evaluated on
/// `device` over the table's rows and the slices `[start, start + len)` of them (each
/// uploaded as it is and imported with an offset), equals DataFusion's evaluation of the
/// same physical expression. Returns the compiled expression.
pub async fn assert_evaluates_as_datafusion(
    ctx: &SessionContext,
    table: &str,
    text: &str,
    slices: &[(usize, usize)],
    device: &ExecDevice,
) -> DeviceExpr {
    let (e, schema, batches) = projection_of(ctx, table, text).await;
    let compiled =
        DeviceExpr::compile(&e, &schema).unwrap_or_else(|u| panic!("`{text}` ({e}) refused: {u}"));
    let input = concat_batches(&schema, &batches).unwrap();
    let mut inputs = vec![input.clone()];
    inputs.extend(slices.iter().map(|&(start, len)| input.slice(start, len)));
    for batch in inputs {
        let want = e
            .evaluate(&batch)
            .unwrap()
            .into_array(batch.num_rows())
            .unwrap();
        for frame in [
            upload(&batch, device),
            upload_with_offset(&batch, 3, device),
        ] {
            let got = compiled
                .evaluate(&frame, device)
                .unwrap_or_else(|err| panic!("`{text}` failed: {err}"));
            assert_eq!(&download(&got, device), &want, "`{text}` ({e})");
        }
    }
    compiled
}

/// `text` over a table of one column `c` of `values`: on all but the last value, the
/// device's values are DataFusion's; with the last, both fail.
async fn assert_edge_as_datafusion(values: ArrayRef, text: &str, device: &ExecDevice) {
    let batch = RecordBatch::try_from_iter([("c", values)]).unwrap();
    let ctx = session_of("e", &batch);
    let (e, schema, _) = projection_of(&ctx, "e", text).await;
    let compiled = DeviceExpr::compile(&e, &schema).unwrap();
    let fits = batch.slice(0, batch.num_rows() - 1);
    let want = e
        .evaluate(&fits)
        .unwrap()
        .into_array(fits.num_rows())
        .unwrap();
    let got = compiled.evaluate(&upload(&fits, device), device).unwrap();
    assert_eq!(&download(&got, device), &want, "`{text}`");
    assert_fails_as_datafusion(&ctx, "e", text, Some(&batch), device).await;
}

/// A computed column back on the host.
pub fn download(column: &FrameColumn, device: &ExecDevice) -> ArrayRef {
    let schema = Arc::new(Schema::new(vec![column.field().clone()]));
    let frame = DeviceFrame::try_new(schema, vec![column.clone()], column.len(), None).unwrap();
    let mut transfer = Transfer::new(device.device().clone(), TransferOptions::default());
    frame
        .download(&mut transfer)
        .expect("download")
        .column(0)
        .clone()
}

/// The plan's first node of type `T`, depth first.
pub fn find<T: ExecutionPlan>(plan: &Arc<dyn ExecutionPlan>) -> Option<Arc<dyn ExecutionPlan>> {
    if plan.downcast_ref::<T>().is_some() {
        return Some(plan.clone());
    }
    plan.children().into_iter().find_map(|c| find::<T>(c))
}

/// A table of every supported type, with nulls.
pub fn typed_batch() -> RecordBatch {
    let n = 40;
    let a = Decimal128Array::from(
        (0..n)
            .map(|i| (i % 7 != 3).then_some((i as i128 - 20) * 12_345 + 7))
            .collect::<Vec<_>>(),
    )
    .with_precision_and_scale(15, 2)
    .unwrap();
    let b = Decimal128Array::from(
        (0..n)
            .map(|i| (i % 5 != 1).then_some(i as i128 * 9_999 - 123_456))
            .collect::<Vec<_>>(),
    )
    .with_precision_and_scale(12, 4)
    .unwrap();
    let x = Int32Array::from(
        (0..n)
            .map(|i| (i % 6 != 2).then_some(i * 1_000 - 17_000))
            .collect::<Vec<_>>(),
    );
    let y = Int64Array::from((0..n).map(|i| i as i64 * 77 - 1_000).collect::<Vec<_>>());
    let d = Date32Array::from((0..n).map(|i| 10_000 + i * 3).collect::<Vec<_>>());
    let f = BooleanArray::from(
        (0..n)
            .map(|i| (i % 4 != 0).then_some(i % 3 == 0))
            .collect::<Vec<_>>(),
    );
    let k = StringArray::from(
        (0..n)
            .map(|i| {
                (i % 9 != 4).then(|| ["A", "bb", "", "twelve bytes", "ünïcödé"][i as usize % 5])
            })
            .collect::<Vec<_>>(),
    );
    let big = Decimal128Array::from(
        (0..n)
            .map(|i| Some(900_000_000_000_000_000 - i as i128))
            .collect::<Vec<_>>(),
    )
    .with_precision_and_scale(18, 0)
    .unwrap();
    let small = arrow_array::Int16Array::from(
        (0..n)
            .map(|i| (i % 8 != 5).then_some((i as i16 - 20) * 500))
            .collect::<Vec<_>>(),
    );
    RecordBatch::try_from_iter([
        ("small", Arc::new(small) as ArrayRef),
        ("a", Arc::new(a)),
        ("b", Arc::new(b)),
        ("x", Arc::new(x)),
        ("y", Arc::new(y)),
        ("d", Arc::new(d)),
        ("f", Arc::new(f)),
        ("k", Arc::new(k)),
        ("big", Arc::new(big)),
    ])
    .unwrap()
}

/// A session with one table, `name`, of one batch (`batch`, its one partition).
pub fn session_of(name: &str, batch: &RecordBatch) -> SessionContext {
    let ctx = SessionContext::new();
    let table = MemTable::try_new(batch.schema(), vec![vec![batch.clone()]]).unwrap();
    ctx.register_table(name, Arc::new(table)).unwrap();
    ctx
}

/// A session with `t`: the typed batch, in two partitions (so aggregates are
/// Partial/Final).
pub fn typed_session() -> SessionContext {
    let batch = typed_batch();
    let ctx = SessionContext::new_with_config(SessionConfig::new().with_target_partitions(2));
    let parts = vec![vec![batch.slice(0, 17)], vec![batch.slice(17, 23)]];
    let table = MemTable::try_new(batch.schema(), parts).unwrap();
    ctx.register_table("t", Arc::new(table)).unwrap();
    ctx
}

/// The projection expression of `SELECT {expr} AS v FROM t` and its input's batches.
async fn projection(
    ctx: &SessionContext,
    expr: &str,
) -> (
    Arc<dyn datafusion::physical_expr::PhysicalExpr>,
    Arc<Schema>,
    Vec<RecordBatch>,
) {
    projection_of(ctx, "t", expr).await
}

/// [`projection`] over table `table`.
pub async fn projection_of(
    ctx: &SessionContext,
    table: &str,
    expr: &str,
) -> (
    Arc<dyn datafusion::physical_expr::PhysicalExpr>,
    Arc<Schema>,
    Vec<RecordBatch>,
) {
    let plan = ctx
        .sql(&format!("SELECT {expr} AS v FROM {table}"))
        .await
        .unwrap()
        .create_physical_plan()
        .await
        .unwrap();
    let node = find::<ProjectionExec>(&plan).unwrap_or_else(|| panic!("no projection: {expr}"));
    let projection = node.downcast_ref::<ProjectionExec>().unwrap();
    let e = projection.expr()[0].expr.clone();
    let input = projection.input().clone();
    let batches = collect(input.clone(), ctx.task_ctx()).await.unwrap();
    (e, input.schema(), batches)
}

/// Every expression evaluated on `device` equals DataFusion's evaluation of the same
/// physical expression on the same batch (values and type).
pub async fn check_expressions(device: &ExecDevice) {
    let ctx = typed_session();
    let exprs = [
        "round(a)",
        "round(a, 1)",
        "round(a, 2)",
        "round(a, 5)",
        "round(b, 3)",
        "round(a, -1)",
        "round(a, -4)",
        "round(big, -2)",
        "round(CAST(x AS DECIMAL(10,0)), -3)",
        "round(a + b, 1) * 2",
        "trunc(a)",
        "trunc(a, 1)",
        "trunc(b, 2)",
        "trunc(b, 9)",
        "trunc(a, -2)",
        "trunc(big, -5)",
        "floor(a)",
        "ceil(a)",
        "floor(b)",
        "ceil(b * 2)",
        "floor(big)",
        "ceil(CAST(x AS DECIMAL(10,3)) / 7)",
        "greatest(x, y)",
        "least(x, y)",
        "greatest(a, b)",
        "least(b, a, CAST(0 AS DECIMAL(3,0)))",
        "greatest(x, small, y, -900)",
        "least(d, DATE '1997-09-01')",
        "greatest(CAST(NULL AS INT), x)",
        "a",
        "a + b",
        "a - b",
        "b - a",
        "a * b",
        "a + 1",
        "1 - a",
        "a * (1 - a)",
        "a * CAST('2.5' AS DECIMAL(3,1))",
        "(a + b) * (a - b)",
        "x + y",
        "x * 3",
        "x - 7",
        "y * y",
        "x",
        "d",
        "a > b",
        "a = b",
        "a <= CAST('100.5' AS DECIMAL(4,1))",
        "a < 0",
        "d < DATE '1970-01-01' + INTERVAL '10050' DAY",
        "d >= DATE '1997-06-01'",
        "x <> -5000",
        "x >= y",
        "f = true",
        "f",
        "(a > 0) AND f",
        "(a > 0) OR f",
        "NOT f",
        "f IS NULL",
        "a IS NOT NULL",
        "NOT (a IS NULL OR x > 0)",
        "CAST(x AS DECIMAL(12,2))",
        "CAST(a AS DECIMAL(20,4))",
        // To a smaller scale (rounded half away from zero: `b`'s rows 9, 19, ... end in
        // a 5, of both signs) and to integers (truncated).
        "CAST(a AS DECIMAL(15,0))",
        "CAST(a AS DECIMAL(14,1))",
        "CAST(b AS DECIMAL(12,3))",
        "CAST(b AS DECIMAL(10,0))",
        "CAST(a * b AS DECIMAL(20,2))",
        "CAST(a AS BIGINT)",
        "CAST(b AS INT)",
        "TRY_CAST(a AS TINYINT)",
        "TRY_CAST(b AS DECIMAL(2,1))",
        "CAST(x AS BIGINT)",
        "TRY_CAST(a AS DECIMAL(5,2))",
        "CAST(NULL AS INT) + x",
        "-a",
        "small",
        "small + small",
        "small * 2",
        "CAST(small AS DECIMAL(10,2)) + a",
        "small < x",
        "-x + y",
        "-(a - b)",
        "a + CAST(NULL AS DECIMAL(15,2))",
        // Division: decimals (the quotient's scale the dividend's + 4, truncated toward
        // zero as arrow divides), integers, negative operands, a null divisor.
        "a / b",
        "b / a",
        "a / CAST('7.25' AS DECIMAL(4,2))",
        "CAST(x AS DECIMAL(12,2)) / a",
        "y / 7",
        "-y / (x + 17001)",
        "x / CAST(NULL AS INT)",
        // `%`: the sign of the dividend; decimals aligned to the larger scale.
        "x % 7",
        "-y % (x + 17001)",
        "a % b",
        "b % a",
        // abs, nullif (CASEs of DataFusion's own expressions) and coalesce (a CASE).
        "abs(x)",
        "abs(a)",
        "abs(-small)",
        "abs(y - 5000)",
        "nullif(x, -4000)",
        "nullif(x % 3000, 0)",
        "nullif(a, b)",
        "nullif(y, x)",
        "coalesce(x, y, 0)",
        "coalesce(a, b)",
    ];
    for text in exprs {
        let (e, schema, batches) = projection(&ctx, text).await;
        let compiled = DeviceExpr::compile(&e, &schema)
            .unwrap_or_else(|u| panic!("`{text}` ({e}) refused: {u}"));
        assert_eq!(
            compiled.data_type(),
            &e.data_type(&schema).unwrap(),
            "{text}"
        );
        for batch in &batches {
            let want = e
                .evaluate(batch)
                .unwrap()
                .into_array(batch.num_rows())
                .unwrap();
            let frame = upload(batch, device);
            if compiled.data_type() == &DataType::Boolean {
                // As a selection too.
                let want = want.as_any().downcast_ref::<BooleanArray>().unwrap();
                let mask = download(&select(&compiled, &frame, device).unwrap(), device);
                let mask = mask.as_any().downcast_ref::<UInt8Array>().unwrap();
                for i in 0..batch.num_rows() {
                    assert_eq!(
                        mask.value(i) == 1,
                        want.is_valid(i) && want.value(i),
                        "{text}"
                    );
                }
            }
            let got = compiled
                .evaluate(&frame, device)
                .unwrap_or_else(|err| panic!("`{text}` failed: {err}"));
            assert_eq!(got.data_type(), compiled.data_type(), "{text}");
            if device.device().device_type() == devarrow::abi::ArrowDeviceType::CUDA {
                // Every result stays on the device, Boolean ones included: the kernels'
                // output as CUDA arrays, not values read back and uploaded again.
                assert!(got.batch().is_imported(), "`{text}` went through the host");
            }
            let got = download(&got, device);
            assert_eq!(got.data_type(), want.data_type(), "{text}");
            assert_eq!(&got, &want, "`{text}` ({e})");
        }
    }
}

/// Overflow is a typed error, never a wrong answer; a cast out of precision errors as
/// DataFusion's does, and a TRY_CAST is null.
pub async fn check_overflow(device: &ExecDevice) {
    // `floor` and `ceil` of a decimal past its precision (DataFusion fails).
    let edge = |values: &[i128]| -> ArrayRef {
        Arc::new(
            Decimal128Array::from_iter_values(values.iter().copied())
                .with_precision_and_scale(5, 2)
                .unwrap(),
        )
    };
    let (low, high) = ([150, -250, 99_999, -99_901], [150, -250, -99_999, 99_901]);
    assert_edge_as_datafusion(edge(&low), "floor(c)", device).await;
    assert_edge_as_datafusion(edge(&high), "ceil(c)", device).await;
    let ctx = typed_session();
    for text in [
        "big * big",
        "big * 100",
        "x * x * x",
        "small * small",
        "CAST(a AS DECIMAL(5,2))",
        "CAST(a AS TINYINT)",
        "CAST(b AS DECIMAL(2,1))",
        "big + big * 10",
    ] {
        let (e, schema, batches) = projection(&ctx, text).await;
        let compiled = DeviceExpr::compile(&e, &schema)
            .unwrap_or_else(|u| panic!("`{text}` ({e}) refused: {u}"));
        let batch = &batches[0];
        let frame = upload(batch, device);
        let err = compiled
            .evaluate(&frame, device)
            .expect_err(&format!("`{text}` overflows"));
        let typed = err.downcast_ref::<ComputeError>();
        assert!(
            matches!(typed, Some(ComputeError::Overflow(_))),
            "`{text}`: {err}"
        );
        // Deferred: at once on the CPU device, at the check on CUDA.
        let err = match compiled.evaluate_deferred(&frame, device) {
            Err(err) => err,
            Ok((_column, pending)) => {
                assert!(pending.is_pending(), "`{text}`");
                pending.check().expect_err("the deferred check fails")
            }
        };
        assert!(
            matches!(
                err.downcast_ref::<ComputeError>(),
                Some(ComputeError::Overflow(_))
            ),
            "`{text}`: {err}"
        );
    }
}

/// What the device refuses, with a reason.
pub async fn check_refusals() {
    let ctx = typed_session();
    for (text, why) in [
        (
            "arrow_cast(x, 'UInt64') & arrow_cast(3, 'UInt64')",
            "UInt64",
        ),
        ("abs(CAST(x AS REAL))", "Float32"),
        ("a / CAST(b AS DECIMAL(30,15))", "past 64 bits"),
        ("CAST(a AS REAL)", "Float32"),
        ("round(a, x)", "not a literal"),
        ("trunc(a, x)", "not a literal"),
        (
            "ln(CAST(x AS DOUBLE))",
            "function `ln` has no device kernel",
        ),
        ("k", "Utf8"),
        ("gcd(a, a)", "gcd of Decimal128"),
        ("least(x, y, 1, 2, 3)", "more than 4 arguments"),
    ] {
        let (e, schema, _) = projection(&ctx, text).await;
        let Err(Unsupported(reason)) = DeviceExpr::compile(&e, &schema) else {
            panic!("`{text}` compiled");
        };
        assert!(reason.contains(why), "`{text}`: {reason}");
    }
}

/// `select` against DataFusion's filter, alone and and-ed with a pending selection.
pub async fn check_select(device: &ExecDevice) {
    let ctx = typed_session();
    for text in [
        "a > b",
        "f",
        "(a > 0) OR f",
        "x IS NULL",
        "d >= DATE '1997-06-01' AND a < 0",
        "NOT f",
    ] {
        let (e, schema, batches) = projection(&ctx, &format!("({text})")).await;
        let compiled = DeviceExpr::compile(&e, &schema).unwrap();
        for batch in &batches {
            let want = e
                .evaluate(batch)
                .unwrap()
                .into_array(batch.num_rows())
                .unwrap();
            let want = want.as_any().downcast_ref::<BooleanArray>().unwrap();
            let frame = upload(batch, device);
            let selection = select(&compiled, &frame, device).unwrap();
            assert_eq!(selection.data_type(), &DataType::UInt8);
            let mask = download(&selection, device);
            let mask = mask.as_any().downcast_ref::<UInt8Array>().unwrap();
            for i in 0..batch.num_rows() {
                assert_eq!(
                    mask.value(i) == 1,
                    want.is_valid(i) && want.value(i),
                    "{text} row {i}"
                );
                assert!(mask.value(i) <= 1);
            }
            // The frame's download with the selection is DataFusion's filter.
            let filtered = frame.clone().with_selection(selection).unwrap();
            let mut transfer = Transfer::new(device.device().clone(), TransferOptions::default());
            let got = filtered.download(&mut transfer).unwrap();
            assert_eq!(got, filter_record_batch(batch, want).unwrap(), "{text}");
            // And-ed with a pending selection (every third row, one of them null).
            let pending = UInt8Array::from(
                (0..batch.num_rows())
                    .map(|i| (i != 1).then_some((i % 3 != 0) as u8 * 7))
                    .collect::<Vec<_>>(),
            );
            let pending = selection_column(pending, device);
            let frame = frame.with_selection(pending).unwrap();
            let both = select(&compiled, &frame, device).unwrap();
            let both = download(&both, device);
            let both = both.as_any().downcast_ref::<UInt8Array>().unwrap();
            for i in 0..batch.num_rows() {
                let before = i != 1 && i % 3 != 0;
                assert_eq!(
                    both.value(i) == 1,
                    before && want.is_valid(i) && want.value(i),
                    "{text} row {i} and-ed"
                );
            }
        }
    }
}

/// A `UInt8` selection column on `device`.
pub fn selection_column(mask: UInt8Array, device: &ExecDevice) -> FrameColumn {
    let nullable = mask.null_count() > 0;
    let schema = Arc::new(Schema::new(vec![Field::new(
        "sel",
        DataType::UInt8,
        nullable,
    )]));
    let batch = RecordBatch::try_new(schema, vec![Arc::new(mask)]).unwrap();
    let mut transfer = Transfer::new(device.device().clone(), TransferOptions::default());
    let on_device: DeviceBatch = transfer.to_device(&batch).unwrap();
    FrameColumn::single(on_device).unwrap()
}

/// The rows of batches as sorted lines (any order).
fn lines(batches: &[RecordBatch]) -> Vec<String> {
    let text = pretty_format_batches(batches).unwrap().to_string();
    // Cells trimmed: column widths follow the column names.
    let mut rows: Vec<String> = text
        .lines()
        .filter(|l| l.starts_with('|'))
        .skip(1)
        .map(|l| l.split('|').map(str::trim).collect::<Vec<_>>().join("|"))
        .collect();
    rows.sort();
    rows
}

/// `got` and `want` ([`lines`]) equal, but for floats (cells that parse as `f64` both):
/// within a relative 1e-12 of each other, as sums of doubles added in another order are
/// (the device's atomic adds), NaN equal to NaN.
fn assert_close(got: Vec<String>, want: Vec<String>, what: &str) {
    let close = |a: &str, b: &str| {
        a == b
            || match (a.parse::<f64>(), b.parse::<f64>()) {
                // An infinity is close only to itself.
                (Ok(x), Ok(y)) => {
                    (x.is_nan() && y.is_nan())
                        || x == y
                        || (x.is_finite()
                            && y.is_finite()
                            && (x - y).abs() <= 1e-12 * x.abs().max(y.abs()))
                }
                _ => false,
            }
    };
    let same = got.len() == want.len()
        && got.iter().zip(&want).all(|(g, w)| {
            let (g, w): (Vec<&str>, Vec<&str>) = (g.split('|').collect(), w.split('|').collect());
            g.len() == w.len() && g.iter().zip(&w).all(|(a, b)| close(a, b))
        });
    assert!(same, "{what}\n  got: {got:?}\n want: {want:?}");
}

/// The `Partial` `AggregateExec` of `sql`'s physical plan in `ctx`.
async fn partial_aggregate_of(ctx: &SessionContext, sql: &str) -> AggregateExec {
    let plan = ctx
        .sql(sql)
        .await
        .unwrap()
        .create_physical_plan()
        .await
        .unwrap();
    let mut node = find::<AggregateExec>(&plan).expect("an aggregate");
    if node.downcast_ref::<AggregateExec>().unwrap().mode() != &AggregateMode::Partial {
        node = find::<AggregateExec>(&node.children()[0].clone()).expect("a partial aggregate");
    }
    node.downcast_ref::<AggregateExec>().unwrap().clone()
}

/// DataFusion's own `mode` aggregate of `partial`'s parameters over `batches`.
async fn datafusion_aggregate(
    partial: &AggregateExec,
    mode: AggregateMode,
    batches: Vec<RecordBatch>,
    schema: Arc<Schema>,
    ctx: &SessionContext,
) -> Vec<RecordBatch> {
    let input = MemorySourceConfig::try_new_exec(&[batches], schema, None).unwrap();
    let group_by = match mode {
        AggregateMode::Partial => partial.group_expr().clone(),
        _ => partial.group_expr().as_final(),
    };
    let aggregate = AggregateExec::try_new(
        mode,
        group_by,
        partial.aggr_expr().to_vec(),
        partial.filter_expr().to_vec(),
        input,
        partial.input_schema(),
    )
    .unwrap();
    collect(Arc::new(aggregate), ctx.task_ctx()).await.unwrap()
}

/// The query's Partial aggregate on `device` over every input batch (all rows, then
/// every other row selected, then none) equals DataFusion's Partial over the same rows;
/// a Final over the device's partials equals DataFusion's Final over its own.
pub async fn check_partial_aggregate(ctx: &SessionContext, sql: &str, device: &ExecDevice) {
    check_partial_aggregate_with(ctx, sql, device, false).await
}

/// [`check_partial_aggregate`], and (`whole_query`) the Final over the device's partials
/// equals the query's own result (a query whose select list is its aggregate's output).
pub async fn check_partial_aggregate_with(
    ctx: &SessionContext,
    sql: &str,
    device: &ExecDevice,
    whole_query: bool,
) {
    let partial = &partial_aggregate_of(ctx, sql).await;
    assert_eq!(*partial.mode(), AggregateMode::Partial, "{sql}");
    let compiled =
        DevicePartialAggregate::compile(partial).unwrap_or_else(|u| panic!("refused: {u}"));
    let input = partial.input().clone();
    let in_schema = input.schema();
    let partitions = collect_partitioned(input, ctx.task_ctx()).await.unwrap();
    let (mut device_partials, mut df_partials) = (Vec::new(), Vec::new());
    let mut groups = 0;
    for batch in partitions.iter().flatten() {
        let frame = upload(batch, device);
        let got = compiled.run(&frame, device).unwrap();
        assert_eq!(got.schema(), partial.schema(), "{sql}");
        let want = datafusion_aggregate(
            partial,
            AggregateMode::Partial,
            vec![batch.clone()],
            in_schema.clone(),
            ctx,
        )
        .await;
        assert_close(lines(std::slice::from_ref(&got)), lines(&want), sql);
        groups += got.num_rows();
        device_partials.push(got);
        df_partials.extend(want);

        // Every other row selected.
        let n = batch.num_rows();
        let mask = UInt8Array::from_iter_values((0..n).map(|i| (i % 2) as u8));
        let keep = BooleanArray::from((0..n).map(|i| i % 2 == 1).collect::<Vec<_>>());
        let selected = frame
            .clone()
            .with_selection(selection_column(mask, device))
            .unwrap();
        let got = compiled.run(&selected, device).unwrap();
        let want = datafusion_aggregate(
            partial,
            AggregateMode::Partial,
            vec![filter_record_batch(batch, &keep).unwrap()],
            in_schema.clone(),
            ctx,
        )
        .await;
        assert_close(
            lines(std::slice::from_ref(&got)),
            lines(&want),
            &format!("{sql}, half"),
        );

        // None selected.
        let none = UInt8Array::from_iter_values((0..n).map(|_| 0u8));
        let empty = frame
            .with_selection(selection_column(none, device))
            .unwrap();
        let got = compiled.run(&empty, device).unwrap();
        let want = datafusion_aggregate(
            partial,
            AggregateMode::Partial,
            vec![batch.slice(0, 0)],
            in_schema.clone(),
            ctx,
        )
        .await;
        assert_eq!(got.schema(), partial.schema());
        assert_close(
            lines(std::slice::from_ref(&got)),
            lines(&want),
            &format!("{sql}, none"),
        );
    }
    assert!(groups > 0, "{sql}: no groups");
    let schema = partial.schema();
    let got = datafusion_aggregate(
        partial,
        AggregateMode::Final,
        device_partials,
        schema.clone(),
        ctx,
    )
    .await;
    let want = datafusion_aggregate(partial, AggregateMode::Final, df_partials, schema, ctx).await;
    assert_close(lines(&got), lines(&want), &format!("{sql}: final"));
    assert!(!lines(&want).is_empty());
    if whole_query {
        let query = ctx.sql(sql).await.unwrap().collect().await.unwrap();
        assert_close(
            lines(&got),
            lines(&query),
            &format!("{sql}: the query's result"),
        );
    }
}

/// Q1, Q6 and aggregates of every supported type, with nulls and null keys.
pub async fn check_aggregates(device: &ExecDevice) {
    let ctx = session(lineitem(0.01, 2, 8192));
    check_partial_aggregate_with(&ctx, Q1, device, true).await;
    check_partial_aggregate_with(&ctx, Q6, device, true).await;
    let typed = typed_session();
    check_partial_aggregate(
        &typed,
        "SELECT k, sum(a), count(a), count(*), avg(b), min(a), max(a), min(x), max(y), \
         sum(x), sum(y), min(d), max(d), count(f), sum(small), min(small) FROM t GROUP BY k",
        device,
    )
    .await;
    check_partial_aggregate(
        &typed,
        "SELECT x, d, sum(a), count(*), max(b) FROM t GROUP BY x, d",
        device,
    )
    .await;
    check_partial_aggregate(
        &typed,
        "SELECT sum(a), count(a), count(*), avg(a), min(d), max(x) FROM t WHERE x > 0",
        device,
    )
    .await;
    check_partial_aggregate(&typed, "SELECT a, count(*) FROM t GROUP BY a", device).await;
    // A group whose values are all null (`b` of `bb`): null states, a count of 0.
    check_partial_aggregate(
        &typed,
        "SELECT k, sum(b), min(b), max(b), count(b), avg(b) FROM t GROUP BY k",
        device,
    )
    .await;
    // Sums beyond 64 bits (40 values near 9e17), negative sums, min and max.
    check_partial_aggregate(
        &typed,
        "SELECT k, sum(big), sum(-big), min(big), max(-big), avg(big) FROM t GROUP BY k",
        device,
    )
    .await;
    check_partial_aggregate(
        &typed,
        "SELECT sum(big), sum(-big), sum(big * 3), min(big), max(big) FROM t",
        device,
    )
    .await;
    // FILTER: the aggregate of `CASE WHEN f THEN x END` (count(*) of the rows f keeps,
    // a sum, min, max or average of none null); count of a string (its validity).
    check_partial_aggregate(
        &typed,
        "SELECT k, count(k), count(*) FILTER (WHERE x > 0), \
         sum(a) FILTER (WHERE b IS NOT NULL AND x < 5), min(d) FILTER (WHERE k = 'bb'), \
         max(x) FILTER (WHERE x % 2 = 0), avg(a) FILTER (WHERE y > 0), \
         count(b) FILTER (WHERE k LIKE '%b%') FROM t GROUP BY k",
        device,
    )
    .await;
    check_partial_aggregate(
        &typed,
        "SELECT count(k), count(*) FILTER (WHERE x IS NULL), sum(big) FILTER (WHERE big > 0), \
         sum(small) FILTER (WHERE small < 3) FROM t",
        device,
    )
    .await;
    check_partial_aggregate(&typed, "SELECT x, count(k) FROM t GROUP BY x", device).await;
    // bool_and and bool_or: the least and the most of booleans (nulls skipped, a group of
    // none null), min and max of booleans too.
    check_partial_aggregate(
        &typed,
        "SELECT k, bool_and(x > -3), bool_or(x > 3), bool_and(b IS NULL), bool_or(y < 0), \
         min(x > 0), max(k = 'bb'), bool_and(a > 0) FILTER (WHERE x > 0) FROM t GROUP BY k",
        device,
    )
    .await;
    check_partial_aggregate(
        &typed,
        "SELECT bool_and(x IS NOT NULL), bool_or(k LIKE '%ü%') FROM t",
        device,
    )
    .await;
    // bit_and, bit_or, bit_xor of signed (negative values: sign-extended lanes) and
    // unsigned integers, with nulls and a FILTER; a group of none null is null.
    check_partial_aggregate(
        &typed,
        "SELECT k, bit_and(x), bit_or(x), bit_xor(x), bit_and(small), bit_or(small), \
         bit_xor(y), bit_and(arrow_cast(abs(y), 'UInt32')), \
         bit_or(arrow_cast(abs(y) % 65536, 'UInt16')), bit_xor(arrow_cast(abs(y) % 256, 'UInt8')), \
         bit_and(CASE WHEN b IS NULL THEN 1 ELSE 3 END), bit_or(x) FILTER (WHERE y > 100) \
         FROM t GROUP BY k",
        device,
    )
    .await;
    check_partial_aggregate(
        &typed,
        "SELECT bit_and(y), bit_or(small), bit_xor(arrow_cast(x % 100, 'Int8')) FROM t",
        device,
    )
    .await;
    // Thousands of groups: collisions and probing in the group table.
    check_partial_aggregate(
        &ctx,
        "SELECT l_orderkey, l_returnflag, count(*), sum(l_quantity), min(l_shipdate), \
         max(l_extendedprice) FROM lineitem GROUP BY l_orderkey, l_returnflag",
        device,
    )
    .await;
}

/// A frame of no rows: empty columns, no group (one row of empty states without keys).
pub async fn check_empty_frames(device: &ExecDevice) {
    let ctx = typed_session();
    let (e, schema, batches) = projection(&ctx, "a * b + a").await;
    let compiled = DeviceExpr::compile(&e, &schema).unwrap();
    let empty = batches[0].slice(0, 0);
    let got = compiled.evaluate(&upload(&empty, device), device).unwrap();
    assert_eq!(got.len(), 0);
    assert_eq!(download(&got, device).len(), 0);
    for sql in [
        "SELECT k, sum(a), count(*) FROM t GROUP BY k",
        "SELECT sum(a), count(*), min(x), avg(b) FROM t",
    ] {
        let partial = &partial_aggregate_of(&ctx, sql).await;
        let compiled = DevicePartialAggregate::compile(partial).unwrap();
        let input = partial.input().schema();
        let empty = RecordBatch::new_empty(input.clone());
        let got = compiled.run(&upload(&empty, device), device).unwrap();
        let want =
            datafusion_aggregate(partial, AggregateMode::Partial, vec![empty], input, &ctx).await;
        assert_eq!(lines(std::slice::from_ref(&got)), lines(&want), "{sql}");
    }
}

/// String group keys longer than 12 bytes group on the device (their length, prefix and
/// hash, then their bytes compared with their group's first row's): DataFusion's
/// partials over TPC-H's long strings (`l_comment`: nearly a group per row;
/// `l_shipinstruct`: four groups, two long) as `Utf8View`, `Utf8` and `LargeUtf8`. Two
/// different long keys of one hash in a batch are [`ComputeError::KeyCollision`].
pub async fn check_long_keys(device: &ExecDevice) {
    for strings in [DataType::Utf8View, DataType::Utf8, DataType::LargeUtf8] {
        let data: Vec<Vec<RecordBatch>> = lineitem(0.001, 2, 1024)
            .into_iter()
            .map(|p| p.into_iter().map(|b| strings_as(b, &strings)).collect())
            .collect();
        let ctx = session(data);
        for sql in [
            "SELECT l_shipinstruct, sum(l_quantity), count(*) FROM lineitem \
             GROUP BY l_shipinstruct",
            "SELECT l_shipmode, l_comment, count(*), max(l_orderkey) FROM lineitem \
             GROUP BY l_shipmode, l_comment",
        ] {
            check_partial_aggregate(&ctx, sql, device).await;
        }
    }
    let (a, b) = colliding_strings();
    let keys = arrow_array::StringViewArray::from(vec![
        Some(a.as_str()),
        Some("short"),
        None,
        Some(b.as_str()),
        Some(a.as_str()),
    ]);
    let batch = RecordBatch::try_from_iter([
        ("s", Arc::new(keys) as ArrayRef),
        ("v", Arc::new(Int64Array::from_iter_values(0..5))),
    ])
    .unwrap();
    let ctx = session_of("t", &batch);
    let partial = partial_aggregate_of(&ctx, "SELECT s, sum(v) FROM t GROUP BY s").await;
    let compiled = DevicePartialAggregate::compile(&partial).unwrap();
    let err = compiled.run(&upload(&batch, device), device).unwrap_err();
    assert!(
        matches!(
            err.downcast_ref::<ComputeError>(),
            Some(ComputeError::KeyCollision { .. })
        ),
        "{err}"
    );
    // Without the second of the pair: one group of two rows.
    let got = compiled
        .run(&upload(&batch.slice(0, 3), device), device)
        .unwrap();
    assert_eq!(got.num_rows(), 3);
}

/// Partial aggregates over `Float64` on the device: `sum`, `avg` (of floats, and of
/// integers, which DataFusion casts to `Float64`) and `count`, grouped and not, with
/// nulls, NaN, infinities of both signs and both zeros, against DataFusion's partials
/// and finals (sums within rounding). Float `min` and `max` stay on the host, saying
/// why (DataFusion's depend on the rows' order where NaN occurs).
pub async fn check_float_aggregates(device: &ExecDevice) {
    let n = 300;
    let v = arrow_array::Float64Array::from_iter((0..n).map(|i| match i % 23 {
        3 => None,
        5 if i % 2 == 0 => Some(f64::NAN),
        7 => Some(-0.0),
        8 => Some(0.0),
        11 if i < 100 => Some(f64::INFINITY),
        13 if i > 200 => Some(f64::NEG_INFINITY),
        _ => Some((i as f64) * 0.37 - 41.25),
    }));
    let batch = RecordBatch::try_from_iter([
        (
            "g",
            Arc::new(Int32Array::from_iter_values((0..n).map(|i| i % 7))) as ArrayRef,
        ),
        ("v", Arc::new(v)),
        (
            "i",
            Arc::new(Int64Array::from_iter_values(
                (0..n).map(|i| i64::from(i) * 13 - 900),
            )),
        ),
        (
            "w",
            Arc::new(arrow_array::Float64Array::from_iter_values(
                (0..n).map(|i| f64::from(i) / 8.0 + 0.1),
            )),
        ),
    ])
    .unwrap();
    let ctx = SessionContext::new();
    let halves = vec![vec![batch.slice(0, 150)], vec![batch.slice(150, 150)]];
    let table = MemTable::try_new(batch.schema(), halves).unwrap();
    ctx.register_table("ft", Arc::new(table)).unwrap();
    for sql in [
        "SELECT g, sum(v), avg(v), count(v) FROM ft GROUP BY g",
        "SELECT g, sum(w), avg(w), avg(i), min(i) FROM ft GROUP BY g",
        "SELECT sum(w), avg(i), sum(v), count(*) FROM ft",
        "SELECT g, avg(v) FROM ft WHERE g > 2 GROUP BY g",
    ] {
        check_partial_aggregate_with(&ctx, sql, device, true).await;
    }
    check_float_min_max(device).await;
}

/// `min` and `max` of `Float64` on the device, as DataFusion computes them:
/// - exactly, where no NaN or -0.0 occurs: infinities, nulls, a group of only nulls, and
///   groups of only -inf (whose grouped max DataFusion leaves at its start, f64::MIN)
///   and only +inf (min: f64::MAX), grouped and not;
/// - a batch with NaN or -0.0 fails the device's key with an overflow, so the operator
///   aggregates it on the host: DataFusion's grouped max of `1, NaN, 2` is 2 (a NaN
///   replaces its state and the next value the NaN), as is its min, and the query's
///   results are DataFusion's. The NaN and -0.0 lie in one partition, so that
///   DataFusion's own answer does not depend on the order partitions finish in.
pub async fn check_float_min_max(device: &ExecDevice) {
    let n = 240;
    let f = arrow_array::Float64Array::from_iter((0..n).map(|i| match (i % 6, i % 11) {
        (3, _) => None,
        (4, _) => Some(f64::NEG_INFINITY),
        (5, _) => Some(f64::INFINITY),
        (_, 7) => None,
        (_, 2) if i < 100 => Some(f64::INFINITY),
        (_, 9) if i > 150 => Some(f64::NEG_INFINITY),
        _ => Some((i as f64) * 0.73 - 80.5),
    }));
    let batch = RecordBatch::try_from_iter([
        (
            "g",
            Arc::new(Int32Array::from_iter_values((0..n).map(|i| i % 6))) as ArrayRef,
        ),
        ("f", Arc::new(f)),
    ])
    .unwrap();
    let ctx = SessionContext::new();
    let halves = vec![vec![batch.slice(0, 120)], vec![batch.slice(120, 120)]];
    let table = MemTable::try_new(batch.schema(), halves).unwrap();
    ctx.register_table("mm", Arc::new(table)).unwrap();
    for sql in [
        "SELECT g, min(f), max(f) FROM mm GROUP BY g",
        "SELECT min(f), max(f), count(f) FROM mm",
        "SELECT min(f) FROM mm WHERE g = 4",
        "SELECT max(f) FROM mm WHERE g = 4",
        "SELECT g, max(f) FROM mm WHERE g > 3 GROUP BY g",
    ] {
        check_partial_aggregate_with(&ctx, sql, device, true).await;
    }

    // NaN and -0.0, in the first partition only.
    let g = Int32Array::from_iter_values((0..n).map(|i| i % 4));
    let x = arrow_array::Float64Array::from_iter((0..n).map(|i| match i {
        0 => Some(1.0),
        4 => Some(f64::NAN),
        8 => Some(2.0),
        1 => Some(0.0),
        5 => Some(-0.0),
        2 => Some(-0.0),
        6 => Some(0.0),
        i if i % 5 == 0 => None,
        i => Some((i as f64) * 1.5 + 10.0),
    }));
    let batch =
        RecordBatch::try_from_iter([("g", Arc::new(g) as ArrayRef), ("x", Arc::new(x))]).unwrap();
    let sql = "SELECT g, min(x), max(x) FROM nz GROUP BY g";
    let partial = partial_aggregate_of(&ctx, "SELECT g, min(f), max(f) FROM mm GROUP BY g").await;
    let compiled = DevicePartialAggregate::compile(&partial).unwrap();
    let nan_frame = upload(
        &RecordBatch::try_from_iter([
            ("g", Arc::new(Int32Array::from(vec![0, 1])) as ArrayRef),
            (
                "f",
                Arc::new(arrow_array::Float64Array::from(vec![1.0, f64::NAN])),
            ),
        ])
        .unwrap(),
        device,
    );
    let zero_frame = upload(
        &RecordBatch::try_from_iter([
            ("g", Arc::new(Int32Array::from(vec![0, 1])) as ArrayRef),
            (
                "f",
                Arc::new(arrow_array::Float64Array::from(vec![-0.0, 3.0])),
            ),
        ])
        .unwrap(),
        device,
    );
    for frame in [nan_frame, zero_frame] {
        let failed = compiled.run(&frame, device).unwrap_err();
        assert!(
            matches!(
                ComputeError::find(failed.as_ref()),
                Some(ComputeError::HostOnly(_))
            ),
            "{failed}"
        );
    }
    let parts = vec![vec![batch.slice(0, 120)], vec![batch.slice(120, 120)]];
    let want =
        falls_back_as_datafusion(device, ("nz", parts), sql, "DevicePartialAggregateExec").await;
    // Row by row, DataFusion's min of group 0 (1, NaN, 2, ...) is 2, not 1 (a NaN
    // replaces its state, the next value the NaN); of group 2 (-0.0, 0.0, ...) -0.0 and
    // of group 1 (0.0, -0.0, ...) 0.0, the first of the equal zeros.
    for line in ["|0|2.0|", "|1|0.0|", "|2|-0.0|"] {
        assert!(want.iter().any(|l| l.starts_with(line)), "{line}: {want:?}");
    }
}

/// `sql` over table `name` (of `parts`) in a device session (every join placed, as
/// [`every_join_session`]) and in DataFusion alone: its plan has `node`, its rows are
/// DataFusion's, and some batch of `node` was computed on the host
/// (`host_fallback_batches`). DataFusion's rows, as [`lines`].
async fn falls_back_as_datafusion(
    device: &ExecDevice,
    (name, parts): (&str, Vec<Vec<RecordBatch>>),
    sql: &str,
    node: &str,
) -> Vec<String> {
    let on_device = every_join_session(device).await;
    let plain = SessionContext::new_with_config(SessionConfig::new().with_target_partitions(2));
    for ctx in [&on_device, &plain] {
        let table = MemTable::try_new(parts[0][0].schema(), parts.clone()).unwrap();
        ctx.register_table(name, Arc::new(table)).unwrap();
    }
    let (plan, shown) = planned(&on_device, sql).await;
    assert!(shown.contains(node), "{shown}");
    let got = collect(plan.clone(), on_device.task_ctx()).await.unwrap();
    let want = plain.sql(sql).await.unwrap().collect().await.unwrap();
    assert_eq!(lines(&got), lines(&want), "{sql}\n{shown}");
    assert!(
        host_fallbacks(&plan, node) > 0,
        "{sql}: no batch fell back to the host\n{shown}"
    );
    lines(&want)
}

/// What the aggregate compiler refuses.
pub async fn check_aggregate_refusals() {
    let ctx = typed_session();
    for (sql, why) in [
        (
            "SELECT k, count(DISTINCT x), count(DISTINCT y) FROM t GROUP BY k",
            "DISTINCT",
        ),
        ("SELECT f, count(*) FROM t GROUP BY f", "Boolean"),
        // A FILTER the device cannot compute: its reason, from the CASE it becomes.
        (
            "SELECT k, sum(a) FILTER (WHERE regexp_like(k, k)) FROM t GROUP BY k",
            "a literal pattern",
        ),
        (
            "SELECT k, stddev(x) FROM t GROUP BY k",
            "aggregate function `stddev` has no device kernel",
        ),
    ] {
        let plan = ctx
            .sql(sql)
            .await
            .unwrap()
            .create_physical_plan()
            .await
            .unwrap();
        let mut reasons = Vec::new();
        let mut stack = vec![plan];
        while let Some(p) = stack.pop() {
            if let Some(a) = p.downcast_ref::<AggregateExec>() {
                match DevicePartialAggregate::compile(a) {
                    Ok(_) => reasons.push(format!("{:?} compiled", a.mode())),
                    Err(u) => reasons.push(u.0),
                }
            }
            stack.extend(p.children().into_iter().cloned());
        }
        assert!(
            reasons.iter().any(|r| r.contains(why)),
            "{sql}: {reasons:?}"
        );
        assert!(
            reasons.iter().all(|r| !r.contains("Partial compiled")),
            "{sql}: {reasons:?}"
        );
    }
}

/// Filter predicates of Q1 and Q6 compile and select as DataFusion's filters do.
pub async fn check_tpch_filters(device: &ExecDevice) {
    let ctx = session(lineitem(0.01, 1, 8192));
    for sql in [Q1, Q6] {
        let plan = ctx
            .sql(sql)
            .await
            .unwrap()
            .create_physical_plan()
            .await
            .unwrap();
        let node = find::<FilterExec>(&plan).unwrap();
        let filter = node.downcast_ref::<FilterExec>().unwrap();
        let input = filter.input().clone();
        let compiled = DeviceExpr::compile(filter.predicate(), &input.schema()).unwrap();
        for batch in collect(input, ctx.task_ctx()).await.unwrap() {
            let want = filter
                .predicate()
                .evaluate(&batch)
                .unwrap()
                .into_array(batch.num_rows())
                .unwrap();
            let want = want.as_any().downcast_ref::<BooleanArray>().unwrap();
            let frame = upload(&batch, device);
            let selection = select(&compiled, &frame, device).unwrap();
            let mut transfer = Transfer::new(device.device().clone(), TransferOptions::default());
            let got = frame
                .with_selection(selection)
                .unwrap()
                .download(&mut transfer)
                .unwrap();
            assert_eq!(got, filter_record_batch(&batch, want).unwrap());
        }
    }
}

#[tokio::test]
async fn expressions_are_datafusions() {
    if own_tests() {
        check_expressions(&ExecDevice::cpu()).await;
    }
}

#[tokio::test]
async fn overflow_is_a_typed_error() {
    if own_tests() {
        check_overflow(&ExecDevice::cpu()).await;
    }
}

#[tokio::test]
async fn unsupported_expressions_say_why() {
    if own_tests() {
        check_refusals().await;
        check_aggregate_refusals().await;
    }
}

#[tokio::test]
async fn selections_are_datafusions_filters() {
    if own_tests() {
        check_select(&ExecDevice::cpu()).await;
        check_tpch_filters(&ExecDevice::cpu()).await;
    }
}

/// A frame compacted by its selection on the device (the unload's step before the
/// download) equals DataFusion's filter of the batch: every fixed-width type (integers of
/// every width, signed and not, floats, dates, timestamps, decimals of 128 bits beyond
/// 64), booleans, string and binary views (inline, long, in several blocks, empty), with
/// and without nulls, slices, no row kept, every row kept, offset-based strings and
/// binaries of both widths; structs, fixed-size lists, variable-size lists, maps and unions of
/// these (nested, sliced, imported at an offset); and the cases left to the host (a
/// dictionary of lists, lists whose kept rows hold no item, no selection).
pub async fn check_compact(device: &ExecDevice) {
    use arrow_array::{
        BinaryViewArray, Float64Array, StringViewArray, TimestampMicrosecondArray, UInt64Array,
    };
    use devarrow_datafusion::compute::compact;

    let typed = typed_batch();
    let n = typed.num_rows();
    let fixed = typed
        .project(&[0, 1, 2, 3, 4, 5, 6, 8])
        .expect("small, a, b, x, y, d, f, big");
    let tiny = arrow_array::Int8Array::from(
        (0..n as i32)
            .map(|i| (i % 4 != 1).then_some((i - 20) as i8))
            .collect::<Vec<_>>(),
    );
    let huge = Decimal128Array::from(
        (0..n)
            .map(|i| (i % 6 != 4).then_some(100_000_000_000_000_000_000 + i as i128))
            .collect::<Vec<_>>(),
    )
    .with_precision_and_scale(38, 0)
    .unwrap();
    let floats = Float64Array::from((0..n).map(|i| i as f64 / 3.0).collect::<Vec<_>>());
    let unsigned = UInt64Array::from(
        (0..n as u64)
            .map(|i| (i % 7 != 0).then_some(u64::MAX - i))
            .collect::<Vec<_>>(),
    );
    let times = TimestampMicrosecondArray::from(
        (0..n as i64)
            .map(|i| 1_700_000_000_000_000 + i)
            .collect::<Vec<_>>(),
    );
    // Views: inline, long (two blocks of 64 bytes each at least), empty and null.
    let mut strings = arrow_array::builder::StringViewBuilder::new().with_fixed_block_size(64);
    for i in 0..n {
        match i % 5 {
            0 => strings.append_value(format!("short {i}")),
            1 => strings.append_value(format!("a value of more than twelve bytes, row {i}")),
            2 => strings.append_null(),
            3 => strings.append_value(""),
            _ => strings.append_value(format!("{i:>13}")),
        }
    }
    let strings: StringViewArray = strings.finish();
    assert!(strings.data_buffers().len() > 1, "several blocks");
    let blobs = BinaryViewArray::from_iter_values((0..n).map(|i| vec![i as u8; i % 20]));
    let cast = |a: &dyn Array, to: DataType| datafusion::arrow::compute::cast(a, &to).unwrap();
    // Offset-based: the same strings and blobs.
    let utf8 = cast(&strings, DataType::Utf8);
    let large = cast(&strings, DataType::LargeUtf8);
    let binary = cast(&blobs, DataType::Binary);
    let large_binary = cast(&blobs, DataType::LargeBinary);
    // Dictionaries: of offset-based strings (null keys), of views (long values), of
    // integers with a null value, each key type's width.
    let modes = ["AIR", "a mode of more than twelve bytes", "", "REG AIR"];
    let dict_utf8: arrow_array::DictionaryArray<arrow_array::types::Int32Type> = (0..n)
        .map(|i| (i % 6 != 3).then_some(modes[i % 4]))
        .collect();
    let dict_view = cast(
        &dict_utf8,
        DataType::Dictionary(Box::new(DataType::UInt16), Box::new(DataType::Utf8View)),
    );
    let dict_ints = arrow_array::DictionaryArray::new(
        arrow_array::UInt8Array::from(
            (0..n)
                .map(|i| (i % 5 != 1).then_some((i % 3) as u8))
                .collect::<Vec<_>>(),
        ),
        Arc::new(arrow_array::Int64Array::from(vec![Some(5), None, Some(-7)])),
    );
    let mut columns = fixed.columns().to_vec();
    let mut fields: Vec<_> = fixed.schema().fields().iter().cloned().collect();
    for (name, column) in [
        ("dict_utf8", Arc::new(dict_utf8) as ArrayRef),
        ("dict_view", dict_view),
        ("dict_ints", Arc::new(dict_ints)),
        ("tiny", Arc::new(tiny) as ArrayRef),
        ("huge", Arc::new(huge)),
        ("floats", Arc::new(floats)),
        ("unsigned", Arc::new(unsigned)),
        ("times", Arc::new(times)),
        ("strings", Arc::new(strings)),
        ("blobs", Arc::new(blobs)),
        ("utf8", utf8),
        ("large", large),
        ("binary", binary),
        ("large_binary", large_binary),
    ] {
        fields.push(Arc::new(Field::new(
            name,
            column.data_type().clone(),
            column.null_count() > 0,
        )));
        columns.push(column);
    }
    let all = RecordBatch::try_new(Arc::new(Schema::new(fields)), columns).unwrap();
    type Mask = Box<dyn Fn(usize) -> Option<u8>>;
    let masks: [(&str, Mask); 5] = [
        ("every third row", Box::new(|i| Some((i % 3 == 0) as u8))),
        ("all but nulls", Box::new(|i| (i % 5 != 2).then_some(9))),
        ("the last rows", Box::new(|i| Some((i > 30) as u8))),
        ("none", Box::new(|_| Some(0))),
        ("all", Box::new(|_| Some(1))),
    ];
    for batch in [all.clone(), all.slice(3, 29)] {
        for (what, mask) in &masks {
            let mask = UInt8Array::from((0..batch.num_rows()).map(mask).collect::<Vec<_>>());
            let keep = BooleanArray::from(
                mask.iter()
                    .map(|m| Some(m.unwrap_or(0) != 0))
                    .collect::<Vec<_>>(),
            );
            let want = filter_record_batch(&batch, &keep).unwrap();
            // Uploaded as it is, and imported with an offset into its buffers.
            for frame in [
                upload(&batch, device),
                upload_with_offset(&batch, 7, device),
            ] {
                let frame = frame
                    .with_selection(selection_column(mask.clone(), device))
                    .unwrap();
                match compact(&frame, device).unwrap() {
                    Some(Some(kept)) => {
                        assert!(kept.selection().is_none());
                        assert_eq!(kept.num_rows(), want.num_rows(), "{what}");
                        let mut transfer =
                            Transfer::new(device.device().clone(), TransferOptions::default());
                        assert_eq!(kept.download(&mut transfer).unwrap(), want, "{what}");
                    }
                    Some(None) => assert_eq!(want.num_rows(), 0, "{what}"),
                    None => panic!("{what}: these columns compact on the device"),
                }
            }
        }
    }
    // Structs, nulls at each level: of fixed-width values, a struct of views and
    // offset-based strings, and a dictionary; fixed-size lists. A struct or list of an
    // offset (an import's) may be left to the host.
    let struct_of = |fields: Vec<(&str, ArrayRef)>, nulls: Option<Vec<bool>>| {
        let fields: Vec<_> = fields
            .into_iter()
            .map(|(name, a)| (Arc::new(Field::new(name, a.data_type().clone(), true)), a))
            .collect();
        let (fields, arrays): (Vec<_>, Vec<_>) = fields.into_iter().unzip();
        Arc::new(
            arrow_array::StructArray::try_new(
                fields.into(),
                arrays,
                nulls.map(arrow_buffer::NullBuffer::from),
            )
            .unwrap(),
        ) as ArrayRef
    };
    let inner = struct_of(
        vec![
            ("views", all.column_by_name("strings").unwrap().clone()),
            ("utf8", all.column_by_name("utf8").unwrap().clone()),
        ],
        Some((0..n).map(|i| i % 9 != 4).collect()),
    );
    let outer = struct_of(
        vec![
            ("tiny", all.column_by_name("tiny").unwrap().clone()),
            ("inner", inner),
            ("dict", all.column_by_name("dict_utf8").unwrap().clone()),
        ],
        Some((0..n).map(|i| i % 7 != 2).collect()),
    );
    // Fixed-size lists (embeddings, say): of floats with nulls at both levels, of
    // strings.
    let embeddings = arrow_array::FixedSizeListArray::try_new(
        Arc::new(Field::new("item", DataType::Float32, true)),
        4,
        Arc::new(arrow_array::Float32Array::from(
            (0..4 * n)
                .map(|i| (i % 11 != 3).then_some(i as f32 / 8.0))
                .collect::<Vec<_>>(),
        )),
        Some(arrow_buffer::NullBuffer::from(
            (0..n).map(|i| i % 6 != 1).collect::<Vec<_>>(),
        )),
    )
    .unwrap();
    let pairs = arrow_array::FixedSizeListArray::try_new(
        Arc::new(Field::new("item", DataType::Utf8, true)),
        2,
        datafusion::arrow::compute::concat(&[all.column_by_name("utf8").unwrap().as_ref(); 2])
            .unwrap(),
        None,
    )
    .unwrap();
    let structs = RecordBatch::try_from_iter([
        ("outer", outer),
        ("huge", all.column_by_name("huge").unwrap().clone()),
        ("embeddings", Arc::new(embeddings) as ArrayRef),
        ("pairs", Arc::new(pairs) as ArrayRef),
    ])
    .unwrap();
    // `batch` compacted on the device under every mask equals arrow's filter, uploaded
    // and imported at an offset (the device may leave an import of an offset to the
    // host where `offset_leaves`).
    let compacts_as_filter = |batch: &RecordBatch, label: &str, offset_leaves: bool| {
        for (what, mask) in &masks {
            let mask = UInt8Array::from((0..batch.num_rows()).map(mask).collect::<Vec<_>>());
            let keep = BooleanArray::from(
                mask.iter()
                    .map(|m| Some(m.unwrap_or(0) != 0))
                    .collect::<Vec<_>>(),
            );
            let want = filter_record_batch(batch, &keep).unwrap();
            for (frame, offset) in [
                (upload(batch, device), false),
                (upload_with_offset(batch, 7, device), true),
            ] {
                let frame = frame
                    .with_selection(selection_column(mask.clone(), device))
                    .unwrap();
                match compact(&frame, device).unwrap() {
                    Some(Some(kept)) => {
                        let mut transfer =
                            Transfer::new(device.device().clone(), TransferOptions::default());
                        let got = kept.download(&mut transfer).unwrap();
                        assert_eq!(got, want, "{label}: {what}");
                    }
                    Some(None) => assert_eq!(want.num_rows(), 0, "{label}: {what}"),
                    None => assert!(
                        offset && offset_leaves,
                        "{label}, {what}: these compact on the device"
                    ),
                }
            }
        }
    };
    compacts_as_filter(&structs, "structs", true);
    // Variable-size lists and maps, nulls at each level and empty lists: of integers,
    // of string views (long values), of offset-based strings (i64 offsets), of lists, of
    // structs; a map of strings to integers.
    let ints = arrow_array::ListArray::from_iter_primitive::<arrow_array::types::Int32Type, _, _>(
        (0..n as i32).map(|i| match i % 7 {
            2 => None,
            3 => Some(vec![]),
            k => Some((0..k).map(|j| (j != 1).then_some(i * 10 + j)).collect()),
        }),
    );
    let list_of = |wide: bool, values: ArrayRef, lens: &dyn Fn(usize) -> usize, nulls: bool| {
        let field = Arc::new(Field::new("item", values.data_type().clone(), true));
        let lengths: Vec<usize> = (0..n).map(lens).collect();
        assert_eq!(lengths.iter().sum::<usize>(), values.len());
        let nulls = nulls.then(|| {
            arrow_buffer::NullBuffer::from(
                (0..n)
                    .map(|i| i % 8 != 5 || lengths[i] > 0)
                    .collect::<Vec<_>>(),
            )
        });
        if wide {
            Arc::new(
                arrow_array::LargeListArray::try_new(
                    field,
                    arrow_buffer::OffsetBuffer::from_lengths(lengths),
                    values,
                    nulls,
                )
                .unwrap(),
            ) as ArrayRef
        } else {
            Arc::new(
                arrow_array::ListArray::try_new(
                    field,
                    arrow_buffer::OffsetBuffer::from_lengths(lengths),
                    values,
                    nulls,
                )
                .unwrap(),
            ) as ArrayRef
        }
    };
    let views = all.column_by_name("strings").unwrap().clone();
    let utf8 = all.column_by_name("large").unwrap().clone();
    // Row i holds (i + 1) % 3 views of `views` (in order, then from the start again).
    let cycled = |a: &ArrayRef, total: usize| {
        let idx = arrow_array::UInt32Array::from(
            (0..total as u32).map(|k| k % n as u32).collect::<Vec<_>>(),
        );
        datafusion::arrow::compute::take(a.as_ref(), &idx, None).unwrap()
    };
    let three = (0..n).map(|i| (i + 1) % 3).sum::<usize>();
    let list_views = list_of(false, cycled(&views, three), &|i| (i + 1) % 3, true);
    let large_utf8 = list_of(true, cycled(&utf8, three), &|i| (i + 1) % 3, false);
    let some = (0..n).filter(|i| i % 3 != 2).count();
    let list_lists = list_of(
        false,
        Arc::new(ints.slice(0, some)),
        &|i| usize::from(i % 3 != 2),
        true,
    );
    let pairs = struct_of(
        vec![
            ("tiny", cycled(all.column_by_name("tiny").unwrap(), three)),
            (
                "dict",
                cycled(all.column_by_name("dict_utf8").unwrap(), three),
            ),
        ],
        Some((0..three).map(|i| i % 4 != 1).collect()),
    );
    let list_structs = list_of(false, pairs, &|i| (i + 1) % 3, true);
    let mut map = arrow_array::builder::MapBuilder::new(
        None,
        arrow_array::builder::StringBuilder::new(),
        arrow_array::builder::Int64Builder::new(),
    );
    for i in 0..n {
        if i % 9 == 4 {
            map.append(false).unwrap();
            continue;
        }
        for k in 0..i % 4 {
            map.keys()
                .append_value(format!("key {k} of a long row {i}"));
            map.values()
                .append_option((k != 2).then_some(i as i64 * k as i64));
        }
        map.append(true).unwrap();
    }
    let lists = RecordBatch::try_from_iter([
        ("ints", Arc::new(ints) as ArrayRef),
        ("list_views", list_views),
        ("large_utf8", large_utf8),
        ("list_lists", list_lists),
        ("list_structs", list_structs),
        ("map", Arc::new(map.finish()) as ArrayRef),
    ])
    .unwrap();
    // No item among the kept rows (rows of i % 3 == 2 hold none in every column but
    // `ints`, left out): left to the host on CUDA (nothing to allocate the items in),
    // else equal to the filter.
    let on_cuda = device.device().device_type() == devarrow::abi::ArrowDeviceType::CUDA;
    let filtered_or_left = |batch: &RecordBatch, mask: &Mask, what: &str| {
        let mask = UInt8Array::from((0..batch.num_rows()).map(mask).collect::<Vec<_>>());
        let keep = BooleanArray::from(mask.iter().map(|m| Some(m == Some(1))).collect::<Vec<_>>());
        let want = filter_record_batch(batch, &keep).unwrap();
        let frame = upload(batch, device)
            .with_selection(selection_column(mask, device))
            .unwrap();
        match compact(&frame, device).unwrap() {
            Some(Some(kept)) => {
                assert!(!on_cuda, "{what}: CUDA leaves it to the host");
                let mut transfer =
                    Transfer::new(device.device().clone(), TransferOptions::default());
                assert_eq!(kept.download(&mut transfer).unwrap(), want, "{what}");
            }
            Some(None) => panic!("{what}: rows are kept"),
            None => assert!(on_cuda, "{what}: the CPU device filters every type"),
        }
    };
    let no_items: Mask = Box::new(|i| Some((i % 21 == 2) as u8));
    filtered_or_left(
        &lists.project(&[1, 2, 3]).unwrap(),
        &no_items,
        "lists whose kept rows keep no item",
    );
    for batch in [lists.clone(), lists.slice(4, 30)] {
        compacts_as_filter(&batch, "lists", false);
    }
    // Unions, sparse and dense, of integers, string views and lists; a union of an offset
    // (an import's) may be left to the host, and so may a dense union one of whose
    // children keeps no item.
    let union_fields: arrow_schema::UnionFields = [
        (3i8, Arc::new(Field::new("int", DataType::Int64, true))),
        (
            7,
            Arc::new(Field::new(
                "text",
                all.column_by_name("strings").unwrap().data_type().clone(),
                true,
            )),
        ),
        (
            12,
            Arc::new(Field::new(
                "list",
                lists.column(0).data_type().clone(),
                true,
            )),
        ),
    ]
    .into_iter()
    .collect();
    let type_of = |i: usize| [3i8, 7, 12, 7][i % 4];
    let type_ids: arrow_buffer::ScalarBuffer<i8> = (0..n).map(type_of).collect();
    let ints = || {
        Arc::new(Int64Array::from(
            (0..n as i64)
                .map(|i| (i % 5 != 3).then_some(i * 1000))
                .collect::<Vec<_>>(),
        )) as ArrayRef
    };
    let sparse = arrow_array::UnionArray::try_new(
        union_fields.clone(),
        type_ids.clone(),
        None,
        vec![
            ints(),
            all.column_by_name("strings").unwrap().clone(),
            lists.column(0).clone(),
        ],
    )
    .unwrap();
    // Dense: each child's items in order, a row of each type taking the next (the text
    // child's items every other view of `strings`, so some are used by no row).
    let mut next_of = std::collections::HashMap::new();
    let offsets: arrow_buffer::ScalarBuffer<i32> = (0..n)
        .map(|i| {
            let k = next_of.entry(type_of(i)).or_insert(0);
            *k += 1;
            (*k - 1) * if type_of(i) == 7 { 2 } else { 1 }
        })
        .collect();
    let count = |t: i8| (0..n).filter(|&i| type_of(i) == t).count();
    let dense = arrow_array::UnionArray::try_new(
        union_fields.clone(),
        type_ids,
        Some(offsets),
        vec![
            ints().slice(0, count(3)),
            all.column_by_name("strings")
                .unwrap()
                .slice(0, 2 * count(7)),
            lists.column(0).slice(0, count(12)),
        ],
    )
    .unwrap();
    let unions = RecordBatch::try_from_iter([
        ("sparse", Arc::new(sparse) as ArrayRef),
        ("dense", Arc::new(dense) as ArrayRef),
    ])
    .unwrap();
    compacts_as_filter(&unions, "unions", true);
    // Only rows of one type kept: a dense union's other children keep no item.
    let one_type: Mask = Box::new(|i| Some((i % 4 == 0) as u8));
    filtered_or_left(
        &unions.project(&[1]).unwrap(),
        &one_type,
        "a dense union child of no kept item",
    );
    // Offsets that go back at a row the selection drops: the rows kept are ranges of
    // the items, but not the items between them. CUDA checks every row's offsets and
    // leaves the batch to the host (whose download refuses it or filters it).
    if on_cuda {
        let items = Int32Array::from(vec![10, 11, 12, 13]);
        // SAFETY: invalid on purpose (row 1 ends before it starts); only the device's
        // compaction reads it, which checks the offsets.
        let crossed = unsafe {
            datafusion::arrow::array::ArrayData::builder(DataType::List(Arc::new(Field::new(
                "item",
                DataType::Int32,
                true,
            ))))
            .len(4)
            .add_buffer(arrow_buffer::Buffer::from_slice_ref([0i32, 2, 1, 3, 4]))
            .child_data(vec![items.into_data()])
            .build_unchecked()
        };
        let crossed =
            RecordBatch::try_from_iter([("l", arrow_array::make_array(crossed))]).unwrap();
        let frame = upload(&crossed, device)
            .with_selection(selection_column(UInt8Array::from(vec![1, 0, 1, 0]), device))
            .unwrap();
        assert!(
            compact(&frame, device).unwrap().is_none(),
            "offsets that go back"
        );
        // A dense union row whose offset is past its child (made on the device: an
        // upload refuses it): left to the host too.
        #[cfg(feature = "cuda")]
        if let Some(cuda) = device.cuda() {
            use devarrow::cuda::CudaArray;
            let stream = cuda.stream();
            let fields: arrow_schema::UnionFields =
                [(0i8, Arc::new(Field::new("i", DataType::Int32, true)))]
                    .into_iter()
                    .collect();
            let child =
                CudaArray::from_values(DataType::Int32, stream.clone_htod(&[10i32, 11]).unwrap())
                    .unwrap();
            // SAFETY: invalid on purpose (row 1's offset is past the child's 2 items);
            // only the device's compaction reads it, which checks the kept rows' offsets.
            let past = unsafe {
                CudaArray::from_union(
                    fields,
                    arrow_schema::UnionMode::Dense,
                    stream.clone_htod(&[0i8, 0, 0]).unwrap(),
                    Some(stream.clone_htod(&[0i32, 2, 1]).unwrap()),
                    vec![child],
                )
            }
            .unwrap();
            let schema = Arc::new(Schema::new(vec![Field::new(
                "u",
                past.data_type().clone(),
                false,
            )]));
            let batch =
                DeviceBatch::from_cuda_arrays(device.device().clone(), schema, vec![past]).unwrap();
            let frame = DeviceFrame::from_batch(batch)
                .with_selection(selection_column(UInt8Array::from(vec![1, 1, 0]), device))
                .unwrap();
            assert!(
                compact(&frame, device).unwrap().is_none(),
                "a union offset past its child"
            );
        }
    }
    // Left to the host's filter after the download: a dictionary of lists, a list of no
    // item.
    let every_other =
        |n: usize| UInt8Array::from((0..n).map(|i| Some((i % 2) as u8)).collect::<Vec<_>>());
    let list_dictionary = arrow_array::DictionaryArray::new(
        Int32Array::from((0..n as i32).map(|i| i % 2).collect::<Vec<_>>()),
        lists.column(0).slice(0, 2),
    );
    let frame = upload(
        &RecordBatch::try_from_iter([("d", Arc::new(list_dictionary) as ArrayRef)]).unwrap(),
        device,
    )
    .with_selection(selection_column(every_other(n), device))
    .unwrap();
    assert!(
        compact(&frame, device).unwrap().is_none(),
        "a dictionary of lists"
    );
    let nothing =
        arrow_array::ListArray::new_null(Arc::new(Field::new("item", DataType::Int32, true)), n);
    let none_of = RecordBatch::try_from_iter([
        ("x", typed.column(3).clone()),
        ("l", Arc::new(nothing) as ArrayRef),
    ])
    .unwrap();
    let every_other: Mask = Box::new(|i| Some((i % 2) as u8));
    filtered_or_left(&none_of, &every_other, "a list of no item");
    assert!(compact(&upload(&all, device), device).unwrap().is_none());
}

/// String predicates over a `Utf8View` column (`=`, `<>`, `IN`, `NOT IN` against
/// literals of at most 12 bytes), with nulls, values longer than 12 bytes and a slice,
/// select DataFusion's rows; a longer literal says why it stays on the host. The same
/// over `Utf8` and `LargeUtf8` columns (read through views made of their offsets),
/// whose `substr` (a string of their type, not a view) stays on the host.
pub async fn check_string_predicates(device: &ExecDevice) {
    for strings in [DataType::Utf8View, DataType::Utf8, DataType::LargeUtf8] {
        string_predicates_of(device, &strings).await;
    }
}

/// [`check_string_predicates`] over string columns of `strings`.
async fn string_predicates_of(device: &ExecDevice, strings: &DataType) {
    let n = 60;
    let modes = [
        "AIR", "REG AIR", "MAIL", "SHIP", "TRUCK", "FOB", "RAIL", "ünï",
    ];
    let s = arrow_array::StringViewArray::from(
        (0..n)
            .map(|i| match i % 9 {
                4 => None,
                7 => Some("a mode much longer than twelve bytes".to_string()),
                8 => Some(String::new()),
                _ => Some(modes[i % modes.len()].to_string()),
            })
            .collect::<Vec<_>>(),
    );
    let x = Int32Array::from((0..n as i32).map(|i| i - 30).collect::<Vec<_>>());
    // Long values in several blocks, and short ones, for LIKE.
    let comments = [
        "Customer requests sleep; Complaints follow",
        "carefully special packages nag: requests",
        "special requests",
        "abab",
        "aba",
        "regular deposits haggle furiously above the Customer",
        "Complaints",
        "final special asymptotes wake. slyly ironic requests",
        // Spaces at the ends, for trim: long, short, only spaces.
        "   padded at both ends, long enough to lie in a buffer  ",
        " x ",
        "    ",
        // Delimiters that overlap: split from the left and from the right differ.
        "xaaax",
    ];
    let mut c = arrow_array::builder::StringViewBuilder::new().with_fixed_block_size(96);
    for i in 0..n {
        match i % 11 {
            10 => c.append_null(),
            _ => c.append_value(comments[i % comments.len()]),
        }
    }
    let c = c.finish();
    assert!(c.data_buffers().len() > 1, "several blocks");
    let cast = |a: ArrayRef| datafusion::arrow::compute::cast(&a, strings).unwrap();
    let batch = RecordBatch::try_from_iter([
        ("s", cast(Arc::new(s))),
        ("x", Arc::new(x)),
        ("c", cast(Arc::new(c))),
    ])
    .unwrap();
    let ctx = session_of("v", &batch);
    for text in [
        "s = 'AIR'",
        "'MAIL' = s",
        "s <> 'SHIP'",
        "s = ''",
        "s IN ('AIR', 'REG AIR', 'FOB')",
        "s NOT IN ('AIR', 'TRUCK')",
        "s = 'AIR' AND x > 0",
        "s IN ('RAIL') OR x < -20",
        "x IN (-3, 7, 12)",
        "x NOT IN (0, 1, 29)",
        // Literals of more than 12 bytes: compared byte by byte.
        "s = 'a mode much longer than twelve bytes'",
        "s <> 'a mode much longer than twelve bytes'",
        "s = 'a mode much longer than twelve bytez'",
        "s IN ('AIR', 'a mode much longer than twelve bytes')",
        "s NOT IN ('FOB', 'a mode much longer than twelve bytes')",
        "c = 'carefully special packages nag: requests'",
        // LIKE patterns of literal pieces and %.
        "s LIKE 'REG%'",
        "s LIKE '%AIR'",
        "s LIKE '%A%'",
        "s NOT LIKE '%AI%'",
        "s LIKE 'AIR'",
        "s LIKE ''",
        "s LIKE 'a%longer%bytes'",
        "s LIKE 'a mode much longer than twelve bytes%'",
        "c LIKE '%special%requests%'",
        "c NOT LIKE '%special%requests%'",
        "c LIKE 'Customer%'",
        "c LIKE '%Complaints'",
        "c LIKE '%Customer%Complaints%'",
        "c LIKE 'ab%ab'",
        "c LIKE '%ab%ab%'",
        "c LIKE 'aba%'",
        "c LIKE '%ba'",
        "c LIKE 'special%requests'",
        "c LIKE '%requests' AND x > 0",
        // `_`: one character; `\` escapes.
        "s LIKE 'A_R'",
        "s LIKE '_A%'",
        "s NOT LIKE '%_'",
        "c LIKE '%special_requests%'",
        "c LIKE 'ab_'",
        "c LIKE '___%'",
        "c LIKE '%a_a%'",
        "s LIKE '%\\_%'",
        // The first k characters (substr from 1): a prefix, the value, or nothing.
        "substr(s, 1, 2) = 'RE'",
        "substr(s, 1, 3) IN ('AIR', 'REG', 'MA')",
        "substr(s, 1, 3) NOT IN ('SHI', 'FOBX')",
        "substring(s from 1 for 4) = 'a mo'",
        "substr(s, 1, 20) = 'AIR'",
        "substr(s, 1, 20) = 'a mode much longer than'",
        "substr(c, 1, 8) = 'Customer'",
        "substr(s, 1, 2) = 'ün'",
        "substr(s, 1, 1) = 'ü'",
        "substr(s, 1, 2) IN ('MAIL', 'SHIP')",
        // starts_with, ends_with, contains: LIKE patterns of one literal piece.
        "starts_with(s, 'RE')",
        "ends_with(c, 'requests')",
        "contains(c, 'special')",
        "NOT contains(c, 'ab')",
        "starts_with(s, '')",
        "contains(s, 'ün')",
        "ends_with(s, 'a mode much longer than twelve bytes')",
        // Regular expressions (the `regex` crate's syntax, as DataFusion's): `~`, `~*`,
        // `!~`, `!~*` and `regexp_like` with flags, Unicode classes and case folding.
        "s ~ 'A.R'",
        "s ~* 'a.r$'",
        "s !~ '^[A-Z ]+$'",
        "c !~* 'REQUESTS'",
        "c ~ 'sp(e|a)cial\\s+req'",
        "s ~ 'ü|ï'",
        "s ILIKE 'ÜNÏ'",
        "s NOT ILIKE '%N_'",
        "s ~* 'ÜN'",
        "c ~ '(ab)+a?$'",
        "s ~ ''",
        "c ~ '\\d'",
        "c ~ '\\p{Lu}\\w+ [a-z]'",
        "regexp_like(c, 'customer.*complaints', 'i')",
        "regexp_like(c, '^carefully.*requests$', 's')",
        "regexp_like(c, 'a b a', 'x')",
        "regexp_like(s, 'AIR') AND x > 0",
        // Lengths: in characters, bytes and bits.
        "character_length(s) = 3",
        "length(c) > 20",
        "octet_length(s) < 4",
        "bit_length(c) >= 320",
        // Validity of a string column, and IS [NOT] DISTINCT FROM.
        "s IS NULL",
        "c IS NOT NULL",
        "s IS NULL OR x > 0",
        "(s = 'AIR') IS DISTINCT FROM true",
        "(x > 0) IS NOT DISTINCT FROM (s = 'AIR')",
    ] {
        // The projection's input batches: the columns the predicate reads.
        let (e, schema, batches) = projection_of(&ctx, "v", &format!("({text})")).await;
        let compiled = DeviceExpr::compile(&e, &schema)
            .unwrap_or_else(|u| panic!("{text} compiles for the device: {u:?}"));
        let input = concat_batches(&schema, &batches).unwrap();
        for batch in [input.clone(), input.slice(5, 41)] {
            let want = e
                .evaluate(&batch)
                .unwrap()
                .into_array(batch.num_rows())
                .unwrap();
            let want = want.as_any().downcast_ref::<BooleanArray>().unwrap();
            for frame in [
                upload(&batch, device),
                upload_with_offset(&batch, 3, device),
            ] {
                let mask = download(&select(&compiled, &frame, device).unwrap(), device);
                let mask = mask.as_any().downcast_ref::<UInt8Array>().unwrap();
                for i in 0..batch.num_rows() {
                    assert_eq!(
                        mask.value(i) == 1,
                        want.is_valid(i) && want.value(i),
                        "{text} over {strings}: row {i}"
                    );
                }
            }
        }
    }
    // substr as a projection's string value, of the column's own type: prefixes (every
    // value inline up to 3 characters), other starts, no count, starts of 0 and less
    // (the count taken from them), counts of 0 and past the end; values with nulls,
    // two-byte characters, long ones in several blocks, shorter than the range; slices.
    for text in [
        "substr(s, 1, 2)",
        "substr(s, 1, 3)",
        "substring(c from 1 for 1)",
        "substr(s, 1, 1)",
        "substr(s, 1, 4)",
        "substr(s, 2, 2)",
        "substr(s, 3)",
        "substr(s, 0, 3)",
        "substr(s, -2, 4)",
        "substr(s, -5, 2)",
        "substr(s, 4, 0)",
        "substr(s, 40)",
        "substr(c, 1, 20)",
        "substr(c, 5)",
        "substr(c, 10, 13)",
        "substr(c, 2, 12)",
        "substr(c, 30, 100)",
        // Parts split at a delimiter of 1 to 8 bytes (two-byte characters too), from the
        // start and from the end, past the last part, and at an empty delimiter (the
        // value is its one part); overlapping delimiters, leftmost or rightmost first.
        "split_part(s, ' ', 1)",
        "split_part(s, ' ', 2)",
        "split_part(s, ' ', -1)",
        "split_part(s, ' ', -2)",
        "split_part(s, ' ', 9)",
        "split_part(s, ' ', -9)",
        "split_part(s, 'ï', 1)",
        "split_part(s, 'n', -1)",
        "split_part(c, ' ', 3)",
        "split_part(c, ' ', -1)",
        "split_part(c, ' ', -4)",
        "split_part(c, 'ab', 2)",
        "split_part(c, 'ab', -1)",
        "split_part(c, 'aa', 2)",
        "split_part(c, 'aa', -2)",
        "split_part(c, 'requests', 1)",
        "split_part(c, 'requests', -1)",
        "split_part(s, '', 1)",
        "split_part(s, '', -1)",
        "split_part(c, '', 2)",
        // Spaces trimmed (DataFusion's default), at both ends, the start, the end.
        "btrim(c)",
        "trim(s)",
        "ltrim(c)",
        "rtrim(c)",
        // ASCII characters of a literal trimmed (`TRIM(BOTH 'x' FROM ...)`, `ltrim(s, 'ab')`):
        // several, one, none, letters of long values, a space among them.
        "btrim(c, 'Cus')",
        "ltrim(s, 'AREG')",
        "rtrim(c, 'stq ')",
        "trim(BOTH 'a' FROM s)",
        "trim(LEADING 'C' FROM c)",
        "btrim(s, '')",
        "btrim(c, ' .srequt')",
        // Case of ASCII values (long ones in several blocks, nulls), of each type; each
        // word's first letter (`initcap`: rows written anew).
        "upper(c)",
        "lower(c)",
        "initcap(c)",
        "upper(s)",
        "lower(s)",
        "initcap(s)",
        // Matches counted one after the other (`regexp_count`), from a character on,
        // with flags; anchors at the value's start only, a start past the end.
        "regexp_count(c, 'ab')",
        "regexp_count(c, '[aeiou]', 3)",
        "regexp_count(s, 'A|ü', 1, 'i')",
        "regexp_count(c, '^.')",
        "regexp_count(c, 're(q|g)')",
        "regexp_count(c, '\\s+')",
        "regexp_count(c, 'a', 200)",
        "regexp_count(s, '(?m)^.', 2)",
        // The position of the nth match (`regexp_instr`), from a character on.
        "regexp_instr(c, 'a')",
        "regexp_instr(c, '[aeiou]', 3, 2)",
        "regexp_instr(s, 'ü|N', 1, 1, 'i')",
        "regexp_instr(c, 're(q|g)', 1, 2, '', 0)",
        "regexp_instr(c, 'x', 200)",
        // Matches replaced by a literal (the first, or every one with `g`), with flags.
        "regexp_replace(c, 'a', 'X')",
        "regexp_replace(c, '[aeiou]+', '', 'g')",
        "regexp_replace(s, 'Ü|ï', '_', 'gi')",
        "regexp_replace(c, '^\\s+', '')",
        "regexp_replace(c, 're(q|g)', 'a longer replacement', 'g')",
        "regexp_replace(c, 's$', 'S')",
        // Lengths as values (Int32, or Int64 over LargeUtf8).
        "character_length(s)",
        "char_length(c) * 2",
        "octet_length(s)",
        "bit_length(c)",
        "length(s) + octet_length(c)",
    ] {
        if !text.starts_with("substr") && !text.starts_with("split_part") {
            assert_evaluates_as_datafusion(&ctx, "v", text, &[(5, 41)], device).await;
            continue;
        }
        let compiled = assert_evaluates_as_datafusion(&ctx, "v", text, &[(5, 41)], device).await;
        assert_eq!(compiled.data_type(), strings, "{text}");
    }
    // The value up to the nth delimiter, or after the nth from the end (`substr_index`,
    // whose signature casts a `Utf8` or `LargeUtf8` column to `Utf8View`: those stay the
    // host's): single- and multi-byte delimiters, overlapping ones (found leftmost or
    // rightmost first, as DataFusion's `match_indices` and `rmatch_indices`), counts past
    // the delimiters (the whole value), 0 and an empty delimiter (empty), the largest and
    // least counts.
    if strings == &DataType::Utf8View {
        for text in [
            "substr_index(s, ' ', 1)",
            "substr_index(s, ' ', 2)",
            "substr_index(s, ' ', -1)",
            "substr_index(s, ' ', -2)",
            "substr_index(s, ' ', 9)",
            "substr_index(s, ' ', -9)",
            "substr_index(s, 'ï', 1)",
            "substr_index(s, 'n', -1)",
            "substr_index(c, ' ', 3)",
            "substr_index(c, 'ab', 2)",
            "substr_index(c, 'aa', 2)",
            "substr_index(c, 'aa', -2)",
            "substr_index(c, 'requests', 1)",
            "substr_index(c, 'requests', -1)",
            "substring_index(c, 'e', -3)",
            "substr_index(c, ' ', 0)",
            "substr_index(s, '', 2)",
            "substr_index(c, 'e', 9223372036854775807)",
            "substr_index(c, 'e', -9223372036854775808)",
        ] {
            let compiled =
                assert_evaluates_as_datafusion(&ctx, "v", text, &[(5, 41)], device).await;
            assert_eq!(compiled.data_type(), strings, "{text}");
        }
    }
    for (text, why) in [
        // A delimiter of more than 8 bytes.
        (
            "substr_index(c, 'Customer ', 1)",
            "`substr_index` has no device kernel",
        ),
        ("substr(s, 2, -1)", "`substr` has no device kernel"),
        ("substr(s, x)", "`substr` has no device kernel"),
        // A delimiter of more than 8 bytes; part 0 (DataFusion's error, the host's).
        (
            "split_part(c, 'Customer ', 1)",
            "`split_part` has no device kernel",
        ),
        ("split_part(s, ' ', 0)", "`split_part` has no device kernel"),
        ("regexp_like(c, s)", "a literal pattern"),
        ("regexp_like(c, 'a', 'gi')", "the global flag"),
        ("regexp_count(c, 'a', 0)", "at least 1"),
        ("regexp_instr(c, '(a)b', 1, 1, '', 1)", "capture group"),
        ("regexp_instr(c, 'a', 1, 0)", "at least 1"),
        ("regexp_replace(c, '(a)', '\\1\\1')", "has no device kernel"),
        ("regexp_replace(c, 'a', '$0')", "has no device kernel"),
        ("(s LIKE CONCAT(s, '%'))", "a literal pattern"),
    ] {
        let (e, schema, _) = projection_of(&ctx, "v", text).await;
        let refused = DeviceExpr::compile(&e, &schema);
        assert!(
            matches!(&refused, Err(Unsupported(w)) if w.contains(why)),
            "{text}: {refused:?}"
        );
    }
}

/// Each of `texts` over `table` has no device kernel: its compilation is refused (the
/// expression stays on the host).
async fn assert_no_device_kernel(ctx: &SessionContext, table: &str, texts: &[&str]) {
    for text in texts {
        let (e, schema, _) = projection_of(ctx, table, text).await;
        assert!(
            DeviceExpr::compile(&e, &schema).is_err(),
            "`{text}`: no device kernel"
        );
    }
}

/// `text` over `table`: DataFusion's evaluation of the whole batch fails, and the
/// device's flags the batch as one for the host (`Overflow`), which then raises
/// DataFusion's error. `batch` (when given) is the input instead of the table's.
async fn assert_fails_as_datafusion(
    ctx: &SessionContext,
    table: &str,
    text: &str,
    batch: Option<&RecordBatch>,
    device: &ExecDevice,
) {
    let (e, schema, batches) = projection_of(ctx, table, text).await;
    let input = match batch {
        Some(batch) => batch.clone(),
        None => concat_batches(&schema, &batches).unwrap(),
    };
    assert!(e.evaluate(&input).is_err(), "`{text}`: DataFusion fails");
    let overflow = |e: &ComputeError| matches!(e, ComputeError::Overflow(_));
    assert_device_fails(ctx, table, text, &input, device, overflow).await;
}

/// `text` over `table` compiles for the device, and its evaluation over `batch` (the
/// table's first batch by default) is left to the host (`ComputeError::HostOnly`): a
/// value whose answer is the host's, which the host then computes (or fails with
/// DataFusion's error).
async fn assert_left_to_the_host(
    ctx: &SessionContext,
    table: &str,
    text: &str,
    batch: Option<&RecordBatch>,
    device: &ExecDevice,
) {
    let (_, _, batches) = projection_of(ctx, table, text).await;
    let host_only = |e: &ComputeError| matches!(e, ComputeError::HostOnly(_));
    let input = batch.unwrap_or(&batches[0]);
    assert_device_fails(ctx, table, text, input, device, host_only).await;
}

/// `text` over `table` compiles for the device, and its evaluation over `input` fails
/// with a `ComputeError` that `is` accepts.
async fn assert_device_fails(
    ctx: &SessionContext,
    table: &str,
    text: &str,
    input: &RecordBatch,
    device: &ExecDevice,
    is: impl Fn(&ComputeError) -> bool,
) {
    let (e, schema, _) = projection_of(ctx, table, text).await;
    let failed = DeviceExpr::compile(&e, &schema)
        .unwrap_or_else(|u| panic!("`{text}` refused: {u}"))
        .evaluate(&upload(input, device), device)
        .unwrap_err();
    assert!(
        ComputeError::find(failed.as_ref()).is_some_and(is),
        "`{text}`: {failed}"
    );
}

/// `CASE`, the year and month of dates and comparisons of floats, on a table of its
/// own: dates across four centuries either side of 1970 (leap days, the ends of years,
/// 1600, 1900, 2000), floats with NaN, infinities and both zeros, with nulls.
pub async fn check_case_and_dates(device: &ExecDevice) {
    let mut days: Vec<Option<i32>> = (-160_000..160_000).step_by(997).map(Some).collect();
    for (y, m, d) in [
        (1600, 2, 29),
        (1900, 2, 28),
        (1900, 3, 1),
        (1969, 12, 31),
        (1970, 1, 1),
        (2000, 2, 29),
        (2000, 3, 1),
        (1998, 12, 31),
        (1999, 1, 1),
        (2100, 3, 1),
        // Months' ends, for months added (a day clamped to a shorter month's last).
        (2000, 1, 31),
        (2001, 1, 31),
        (1999, 3, 31),
        (2000, 5, 31),
        (1900, 1, 29),
    ] {
        days.push(Some(days_from_civil(y, m, d)));
    }
    // ISO weeks' edges: the last and first days of years whose week 1 starts in
    // December, or whose last week is 53.
    for year in 1995..2013 {
        for (m, d) in [
            (12, 28),
            (12, 29),
            (12, 30),
            (12, 31),
            (1, 1),
            (1, 2),
            (1, 3),
            (1, 4),
        ] {
            let y = if m == 1 { year + 1 } else { year };
            days.push(Some(days_from_civil(y, m, d)));
        }
    }
    // chrono's calendar ends (-262143-01-01, 262142-12-31), a day either side of them and
    // the ends of Date32: arrow's date parts are null outside it.
    let (first, last) = (
        days_from_civil(-262_143, 1, 1),
        days_from_civil(262_142, 12, 31),
    );
    days.extend([first - 1, first, last, last + 1, i32::MIN, i32::MAX].map(Some));
    days.push(None);
    let n = days.len();
    // Timestamps of those days at times of day either side of midnight (a negative count
    // floors to the day before): nanoseconds within their range, seconds as they come
    // (past chrono's calendar at its ends: null date parts), and milliseconds in UTC.
    let at = |i: usize| (i as i64 * 7_919) % 86_400 - 43_200;
    let ts = arrow_array::TimestampNanosecondArray::from(
        days.iter()
            .enumerate()
            .map(|(i, d)| {
                d.map(|d| {
                    (d as i64).clamp(-106_000, 106_000) * 86_400_000_000_000
                        + at(i) * 1_000_000_000
                        + i as i64 % 1_000
                })
            })
            .collect::<Vec<_>>(),
    );
    let tsec = arrow_array::TimestampSecondArray::from(
        days.iter()
            .enumerate()
            .map(|(i, d)| d.map(|d| d as i64 * 86_400 + at(i)))
            .collect::<Vec<_>>(),
    );
    let tz = arrow_array::TimestampMillisecondArray::from(
        days.iter()
            .enumerate()
            .map(|(i, d)| d.map(|d| (d as i64).clamp(-106_000, 106_000) * 86_400_000 + at(i)))
            .collect::<Vec<_>>(),
    )
    .with_timezone("UTC");
    // The same instants in a fixed zone (local time 5:30 ahead) and in a zone whose
    // offset changes (daylight saving: the host's).
    let tk = tz.clone().with_timezone("+05:30");
    let tn = tz.clone().with_timezone("America/New_York");
    let d = Date32Array::from(days);
    let x = Int32Array::from(
        (0..n as i32)
            .map(|i| (i % 7 != 3).then_some(i % 5 - 2))
            .collect::<Vec<_>>(),
    );
    let m = Decimal128Array::from(
        (0..n as i128)
            .map(|i| Some(i * 125 - 900))
            .collect::<Vec<_>>(),
    )
    .with_precision_and_scale(12, 2)
    .unwrap();
    // Floats with the values a total order places: NaN, infinities, both zeros.
    let specials = [
        f64::NAN,
        -f64::NAN,
        f64::INFINITY,
        f64::NEG_INFINITY,
        0.0,
        -0.0,
        1.5,
        -2.25,
        1e300,
        -1e-300,
    ];
    let f = arrow_array::Float64Array::from(
        (0..n)
            .map(|i| (i % 11 != 5).then(|| specials[i % specials.len()] * (i / 9 + 1) as f64))
            .collect::<Vec<_>>(),
    );
    let g = arrow_array::Float64Array::from(
        (0..n)
            .map(|i| specials[(i * 7) % specials.len()])
            .collect::<Vec<_>>(),
    );
    let batch = RecordBatch::try_from_iter([
        ("d", Arc::new(d) as ArrayRef),
        ("x", Arc::new(x)),
        ("m", Arc::new(m)),
        ("f", Arc::new(f)),
        ("g", Arc::new(g)),
        ("ts", Arc::new(ts)),
        ("tsec", Arc::new(tsec)),
        ("tz", Arc::new(tz)),
        ("tk", Arc::new(tk)),
        ("tn", Arc::new(tn)),
    ])
    .unwrap();
    let ctx = SessionContext::new();
    // The rows within chrono's calendar (all but the ends), for what fails past it.
    let within = batch.slice(3, n - 10);
    let table = MemTable::try_new(batch.schema(), vec![vec![batch]]).unwrap();
    ctx.register_table("w", Arc::new(table)).unwrap();
    let table = MemTable::try_new(within.schema(), vec![vec![within]]).unwrap();
    ctx.register_table("within", Arc::new(table)).unwrap();
    for text in [
        "date_part('year', d)",
        "date_part('month', d)",
        "date_part('day', d)",
        "date_part('quarter', d)",
        "date_part('dow', d)",
        "date_part('doy', d)",
        "date_part('week', d)",
        "date_part('isodow', d)",
        "date_part('isoyear', d)",
        // DataFusion's names of parts: interval units' plurals and abbreviations.
        "date_part('weeks', d)",
        "date_part('YRS', d)",
        "date_part('qtr', d)",
        "date_part('mons', d)",
        "EXTRACT(WEEK FROM d) * 10 + EXTRACT(DOW FROM d)",
        "EXTRACT(DOY FROM d)",
        // Timestamps' date parts (no time zone) and times of day, comparisons of any.
        "date_part('year', ts)",
        "date_part('day', ts)",
        "date_part('hour', ts)",
        "date_part('minute', ts)",
        "EXTRACT(DOW FROM ts) * 100 + EXTRACT(HOUR FROM ts)",
        "date_part('week', tsec)",
        "date_part('isoyear', tsec)",
        "date_part('hours', tsec)",
        "date_part('mins', tsec)",
        "ts > TIMESTAMP '1999-06-01 12:00:00'",
        "tsec <= TIMESTAMP '1969-12-31 23:00:00'",
        "tz < tz",
        "CASE WHEN x > 0 THEN ts END",
        // Casts between dates and timestamps with no time zone: a timestamp's day
        // floored; a date's days in the unit (checked: null past i64 for TRY_CAST).
        "CAST(ts AS DATE)",
        "CAST(ts AS DATE) = d",
        "TRY_CAST(d AS TIMESTAMP)",
        "arrow_cast(d, 'Timestamp(Second, None)')",
        // date_trunc: to a unit of time (any range, a zone's minutes too), to a week,
        // month, quarter or year of no zone (in DataFusion's nanoseconds).
        "date_trunc('day', ts)",
        "date_trunc('hour', tsec)",
        "date_trunc('DAY', tsec)",
        "date_trunc('minute', tz)",
        "date_trunc('second', ts)",
        "date_trunc('millisecond', tsec)",
        "date_trunc('week', ts)",
        "date_trunc('month', ts)",
        "date_trunc('quarter', ts)",
        "date_trunc('year', ts)",
        // A fixed zone's (and UTC's) date parts, casts and date_trunc: its local time's.
        "date_part('hour', tz)",
        "date_part('hour', tk)",
        "date_part('minute', tk)",
        "date_part('day', tk)",
        "EXTRACT(DOW FROM tk)",
        "date_part('year', tk) * 100 + date_part('month', tk)",
        "CAST(tk AS DATE)",
        "CAST(tz AS DATE)",
        "date_trunc('hour', tk)",
        "date_trunc('day', tz)",
        "date_trunc('day', tk)",
        "date_trunc('week', tk)",
        "date_trunc('month', tz)",
        "date_trunc('month', tk)",
        "date_trunc('year', tk)",
        "EXTRACT(DAY FROM d) + EXTRACT(MONTH FROM d)",
        "EXTRACT(YEAR FROM d)",
        "EXTRACT(MONTH FROM d) * 100 + x",
        "date_part('YEAR', d) = 1998",
        "CASE WHEN x > 0 THEN m ELSE 0 END",
        "CASE WHEN x > 0 THEN m WHEN x < 0 THEN -m END",
        "CASE x WHEN 1 THEN 10 WHEN -1 THEN 20 ELSE 30 END",
        "CASE WHEN x IS NULL THEN d END",
        "CASE WHEN x >= 0 THEN x > 1 ELSE NULL END",
        // Float64 comparisons, in DataFusion's order: total, NaN above everything, but
        // -0.0 equal to 0.0.
        "f > 1.5",
        "f = 0.0",
        "f < -0.0",
        "f <= g",
        "f = g",
        "f <> g",
        "f >= CAST('NaN' AS DOUBLE)",
        "f = CAST('-inf' AS DOUBLE)",
        "f IN (1.5, -2.25, 0.0)",
        "f IS NULL OR f > g",
        "CASE WHEN x > 0 THEN f ELSE g END > 1.0",
        "f IS NOT DISTINCT FROM g",
        // abs of floats: the sign bit cleared (-0.0 and NaN's too).
        "abs(f)",
        "abs(f - g) > 1.0",
        // floor, ceil, trunc, sqrt and round of floats, as f64's (round half away from
        // zero, DataFusion's `(x * 10^d).round() / 10^d`).
        "floor(f)",
        "ceil(f)",
        "trunc(f)",
        "floor(f / g)",
        "round(f)",
        "round(f, 2)",
        "round(f * 0.37, 3)",
        "round(g, -1)",
        "round(CAST(m AS DOUBLE) / 7.0, 1)",
        "sqrt(abs(f))",
        // Float64 arithmetic (IEEE 754, NaN, infinities, zero divisors among it) and
        // casts of integers and decimals to Float64, as arrow computes them.
        "f + 1.0",
        "f - g",
        "f * g > 1.0",
        "f / g",
        "(f + g) * 0.5 - f / 3.0",
        "CAST(x AS DOUBLE) > f",
        "CAST(x AS DOUBLE) / 3.0",
        "CAST(m AS DOUBLE) * 1.1",
        "CAST(m AS DOUBLE) > 0.5 * CAST(x AS DOUBLE)",
        "CASE WHEN x > 0 THEN f * 2.0 ELSE CAST(m AS DOUBLE) END",
        // Casts from Float64 as arrow's: to integers truncated toward zero, to decimals
        // scaled and rounded half away from zero; NaN, infinities and values out of
        // range null (TRY_CAST) or an error (CAST, over values that all fit).
        "TRY_CAST(f AS BIGINT)",
        "TRY_CAST(f AS INT)",
        "TRY_CAST(f AS SMALLINT)",
        "TRY_CAST(f AS DECIMAL(10,0))",
        "TRY_CAST(f * 0.37 AS DECIMAL(12,3))",
        "TRY_CAST(g AS DECIMAL(4,1))",
        "CAST(CAST(m AS DOUBLE) * 1.1 AS DECIMAL(15,3))",
        "CAST(CAST(x AS DOUBLE) / 3.0 AS BIGINT)",
        "CAST(CAST(m AS DOUBLE) / -7.0 AS DECIMAL(18,6))",
    ] {
        // The last slice: chrono's ends and Date32's, with no null (a date part's null
        // there is its own).
        let slices = [(3, n - 10), (n - 7, 6)];
        assert_evaluates_as_datafusion(&ctx, "w", text, &slices, device).await;
    }
    assert_no_device_kernel(&ctx, "w", &["TRY_CAST(f AS DECIMAL(30,2))", "f % g"]).await;
    // Timestamps plus or minus intervals of days and time, as arrow adds them:
    // nanoseconds (within their range), milliseconds in UTC (time only: a zone's days are
    // its local calendar's), seconds within chrono's calendar (the rows `within` it).
    for text in [
        "ts + INTERVAL '1 day'",
        "ts - INTERVAL '36 hours 30 minutes'",
        "INTERVAL '1 hour' + ts",
        "ts + INTERVAL '2 days 3 seconds' > ts",
        "tz + INTERVAL '90 minutes'",
        "tz - INTERVAL '1.5 seconds'",
        "tsec + INTERVAL '2 days 3 seconds'",
        "tsec - INTERVAL '400 days'",
        "date_trunc('day', ts + INTERVAL '12 hours')",
        "EXTRACT(DAY FROM tsec + INTERVAL '1 day')",
        // Months (no zone), as chrono adds them: the day clamped to the month's last,
        // then the days, then the time; and dates plus or minus intervals, the time's
        // whole days truncated toward zero.
        "ts + INTERVAL '1 month'",
        "ts - INTERVAL '13 months 2 days'",
        "tsec + INTERVAL '1 month 1 day 1 second'",
        "tsec - INTERVAL '1 year'",
        "INTERVAL '3 months' + tsec",
        "d + INTERVAL '1 month'",
        "d - INTERVAL '1 month'",
        "d + INTERVAL '1 year 2 months 3 days'",
        "d + INTERVAL '36 hours'",
        "d - INTERVAL '36 hours'",
        "INTERVAL '11 months' + d",
        "date_part('day', d + INTERVAL '1 month')",
        // Differences, as arrow's checked arithmetic of the unit's counts: a timestamp less a
        // timestamp of its unit is their duration, a timestamp plus or less a duration a
        // timestamp, durations add and compare (with literals too); a date less a date is
        // the days between them, an Int64.
        "tsec - arrow_cast(d, 'Timestamp(Second, None)')",
        "(tsec - arrow_cast(d, 'Timestamp(Second, None)')) \
         + (tsec - arrow_cast('1990-01-01T00:00:00', 'Timestamp(Second, None)'))",
        "tsec - (tsec - arrow_cast(d, 'Timestamp(Second, None)'))",
        "arrow_cast(d, 'Timestamp(Second, None)') + (tsec - arrow_cast(d, 'Timestamp(Second, None)'))",
        "(tsec - arrow_cast(d, 'Timestamp(Second, None)')) \
         < (arrow_cast(d, 'Timestamp(Second, None)') - tsec)",
        "(tsec - arrow_cast(d, 'Timestamp(Second, None)')) > arrow_cast(3600, 'Duration(Second)')",
        "ts - TIMESTAMP '1970-01-02T00:00:00'",
        "ts - (ts - TIMESTAMP '1970-01-02T00:00:00')",
        "d - CAST(tsec AS DATE)",
        "CAST(tsec AS DATE) - d > 0",
        // A fixed zone's days and months: its local calendar's (whole days of its time).
        "tz + INTERVAL '1 month'",
        "tz + INTERVAL '1 day'",
        "tk + INTERVAL '1 month 2 days 3 hours'",
        "tk - INTERVAL '1 day'",
    ] {
        assert_evaluates_as_datafusion(&ctx, "within", text, &[(5, 40)], device).await;
    }
    // A difference past 64 bits fails in arrow ("Overflow happened"): on the device too,
    // and the host raises arrow's error.
    let nanos = arrow_array::TimestampNanosecondArray::from(vec![
        0,
        -8_000_000_000_000_000_000,
        i64::MIN + 1,
    ]);
    assert_edge_as_datafusion(
        Arc::new(nanos),
        "c - TIMESTAMP '2000-01-01T00:00:00'",
        device,
    )
    .await;
    // Seconds past chrono's calendar (at Date32's ends) fail in arrow: on the device too,
    // and the host raises arrow's error.
    assert_fails_as_datafusion(&ctx, "w", "tsec + INTERVAL '1 day'", None, device).await;
    assert_fails_as_datafusion(&ctx, "w", "tsec - INTERVAL '1 second'", None, device).await;
    // Past chrono's calendar a date's months fail in arrow: on the device too.
    assert_fails_as_datafusion(&ctx, "w", "d + INTERVAL '1 month'", None, device).await;
    assert_fails_as_datafusion(&ctx, "w", "tsec - INTERVAL '1 month'", None, device).await;
    assert_no_device_kernel(&ctx, "w", &["tsec + INTERVAL '1 millisecond'"]).await;
    // date_trunc to a month of seconds past DataFusion's nanoseconds fails there: the
    // device flags the batch for the host, which raises DataFusion's error.
    assert_fails_as_datafusion(&ctx, "w", "date_trunc('month', tsec)", None, device).await;
    // At the edge of the nanoseconds: i64::MAX / 10^9 seconds truncates, one second more
    // fails (its month's start fits, its nanoseconds do not).
    let edge = i64::MAX / 1_000_000_000;
    let secs = arrow_array::TimestampSecondArray::from(vec![edge - 40_000_000, edge, edge + 1]);
    assert_edge_as_datafusion(Arc::new(secs), "date_trunc('month', c)", device).await;
    // Nanoseconds at the end of 64 bits: a second added to i64::MAX less 2 s fits, to
    // i64::MAX less half a second does not (arrow fails, the device flags the batch).
    let nanos = arrow_array::TimestampNanosecondArray::from(vec![
        0,
        i64::MAX - 2_000_000_000,
        i64::MAX - 500_000_000,
    ]);
    assert_edge_as_datafusion(Arc::new(nanos), "c + INTERVAL '1 second'", device).await;
    check_partial_aggregate(
        &ctx,
        "SELECT date_trunc('month', ts) AS mo, count(*), min(x) FROM w GROUP BY mo",
        device,
    )
    .await;
    // `sqrt` of a negative fails in DataFusion: the device flags the batch, and the host
    // raises DataFusion's error.
    assert_fails_as_datafusion(&ctx, "w", "sqrt(f)", None, device).await;
    // A second-unit timestamp past chrono's calendar has no date: arrow's cast fails, so
    // the device flags the batch for the host, which raises DataFusion's error.
    assert_fails_as_datafusion(&ctx, "w", "CAST(tsec AS DATE)", None, device).await;
    assert_no_device_kernel(&ctx, "w", &["date_part('second', ts)"]).await;
    // A changing zone's date parts, dates, date_trunc, months and days compile; instants past its
    // table (1900 to 2100: `tn` spans 1680 to 2260) leave the batch to the host.
    for text in [
        "date_part('hour', tn)",
        "CAST(tn AS DATE)",
        "tn + INTERVAL '1 month'",
        "tn + INTERVAL '1 day'",
        "date_trunc('month', tn)",
        "date_trunc('day', tn)",
    ] {
        assert_left_to_the_host(&ctx, "w", text, None, device).await;
    }
    check_partial_aggregate(
        &ctx,
        "SELECT date_part('hour', ts) AS h, min(ts), max(tsec), count(*) FROM w GROUP BY h",
        device,
    )
    .await;
    check_partial_aggregate(
        &ctx,
        "SELECT ts, count(*) FROM w WHERE x > 0 GROUP BY ts",
        device,
    )
    .await;
    let (e, schema, _) = projection_of(&ctx, "w", "date_part('hour', d)").await;
    let refused = DeviceExpr::compile(&e, &schema);
    assert!(
        matches!(&refused, Err(Unsupported(w)) if w.contains("`hour`")),
        "{refused:?}"
    );
}

#[tokio::test]
async fn case_and_dates_are_datafusions() {
    if own_tests() {
        check_case_and_dates(&ExecDevice::cpu()).await;
    }
}

/// Date parts, dates and `date_trunc` of timestamps in zones whose offset changes, as DataFusion
/// computes them (arrow's chrono-tz local time): New York and Paris (daylight saving by
/// an hour, rules changed over the century), Lord Howe (by half an hour), Kathmandu
/// (+05:30, then +05:45 since 1986), Sao Paulo (whose clocks changed at midnight), in
/// seconds, milliseconds, microseconds and nanoseconds, with instants every 15 minutes
/// around transitions (spring forward, fall back), instants spread over 1900 to 2100,
/// and nulls; their `date_trunc` too.
pub async fn check_changing_zones(device: &ExecDevice) {
    use arrow_array::{
        TimestampMicrosecondArray, TimestampMillisecondArray, TimestampNanosecondArray,
        TimestampSecondArray,
    };
    // Seconds since the epoch: 6 hours either side of transitions, every 15 minutes
    // (2024-03-10T07:00Z New York, 2024-11-03T06:00Z New York, 2024-03-31T01:00Z Paris,
    // 2024-04-06T15:00Z Lord Howe, 1986-01-01T00:00Z Kathmandu's 15 minutes, 1918-03-31
    // and 1945-09-30 New York), and spread over the two centuries.
    let mut seconds: Vec<Option<i64>> = Vec::new();
    for center in [
        1_710_054_000i64,
        1_730_613_600,
        1_711_846_800,
        1_712_415_600,
        504_921_600,
        -1_633_280_400,
        -765_396_000,
    ] {
        for k in -24..=24 {
            seconds.push(Some(center + k * 900 + (k % 7)));
        }
    }
    let mut next = xorshift(0x9E37_79B9_7F4A_7C15);
    for i in 0..200 {
        // 1901 to 2099: a year from the ends of the zones' tables.
        let span = 4_070_908_800u64 + 2_177_452_800;
        seconds.push((i % 13 != 6).then(|| next(span - 1) as i64 - 2_177_452_800));
    }
    // Sao Paulo's clocks changed at midnight: 2018-11-04T03:00Z skipped 00:00 to 01:00
    // (a day truncated into the gap), 2019-02-17T02:00Z went back over 23:00 to 00:00.
    for center in [1_541_300_400i64, 1_550_368_800] {
        for k in -24..=24 {
            seconds.push(Some(center + k * 900 + (k % 5)));
        }
    }
    let zones = [
        "America/New_York",
        "Europe/Paris",
        "Australia/Lord_Howe",
        "Asia/Kathmandu",
        "America/Sao_Paulo",
    ];
    let mut columns: Vec<(String, ArrayRef)> = Vec::new();
    for (z, zone) in zones.iter().enumerate() {
        let scaled = |per: i64| {
            seconds
                .iter()
                .map(move |s| s.map(|s| s * per + (s % 1_000).abs() % per))
        };
        let column: ArrayRef = match z {
            0 => Arc::new(
                TimestampSecondArray::from(scaled(1).collect::<Vec<_>>()).with_timezone(*zone),
            ),
            1 => Arc::new(
                TimestampMillisecondArray::from(scaled(1_000).collect::<Vec<_>>())
                    .with_timezone(*zone),
            ),
            2 => Arc::new(
                TimestampMicrosecondArray::from(scaled(1_000_000).collect::<Vec<_>>())
                    .with_timezone(*zone),
            ),
            3 => Arc::new(
                TimestampNanosecondArray::from(scaled(1_000_000_000).collect::<Vec<_>>())
                    .with_timezone(*zone),
            ),
            _ => Arc::new(
                TimestampMillisecondArray::from(scaled(1_000).collect::<Vec<_>>())
                    .with_timezone(*zone),
            ),
        };
        columns.push((format!("t{z}"), column));
    }
    let batch = RecordBatch::try_from_iter(columns).unwrap();
    let n = batch.num_rows();
    let ctx = session_of("zones", &batch);
    for t in ["t0", "t1", "t2", "t3", "t4"] {
        for text in [
            format!("date_part('hour', {t})"),
            format!("date_part('minute', {t})"),
            format!("date_part('day', {t})"),
            format!("EXTRACT(DOW FROM {t}) * 100 + EXTRACT(MONTH FROM {t})"),
            format!("date_part('year', {t})"),
            format!("CAST({t} AS DATE)"),
            // The local time truncated, mapped back as DataFusion maps it (a time the
            // clocks went back over by the value's own offset; one they skipped from
            // three hours earlier).
            format!("date_trunc('hour', {t})"),
            format!("date_trunc('day', {t})"),
            format!("date_trunc('week', {t})"),
            format!("date_trunc('month', {t})"),
            format!("date_trunc('quarter', {t})"),
            format!("date_trunc('year', {t})"),
        ] {
            assert_evaluates_as_datafusion(&ctx, "zones", &text, &[(3, n - 10), (40, 60)], device)
                .await;
        }
    }
    // Months and days in the local calendar, each step mapped back to its one instant
    // (chrono's `single()`), then the time on the instant: the instants spread over the
    // two centuries (none lands on a change).
    let spread = ctx
        .table("zones")
        .await
        .unwrap()
        .limit(7 * 49, Some(200))
        .unwrap();
    ctx.register_table("spread", spread.into_view()).unwrap();
    for t in ["t0", "t1", "t2", "t3", "t4"] {
        for text in [
            format!("{t} + INTERVAL '1 day'"),
            format!("{t} - INTERVAL '1 month'"),
            format!("{t} + INTERVAL '1 month 2 days 3 hours'"),
            format!("{t} - INTERVAL '40 days 5 minutes'"),
            format!("INTERVAL '13 months' + {t}"),
        ] {
            assert_evaluates_as_datafusion(&ctx, "spread", &text, &[(3, 150)], device).await;
        }
    }
    // A day on that lands in the hour New York skipped (2024-03-10 02:30) or went back
    // over (2024-11-03 01:30): arrow fails; the device leaves the batch to the host.
    for at in [1_709_969_400i64, 1_730_525_400] {
        let batch = RecordBatch::try_from_iter([(
            "t",
            Arc::new(
                TimestampSecondArray::from(vec![Some(at), None, Some(at - 86_400)])
                    .with_timezone("America/New_York"),
            ) as ArrayRef,
        )])
        .unwrap();
        let ctx = session_of("edge", &batch);
        let text = "t + INTERVAL '1 day'";
        let (e, _, batches) = projection_of(&ctx, "edge", text).await;
        assert!(e.evaluate(&batches[0]).is_err(), "{at}: arrow fails");
        assert_left_to_the_host(&ctx, "edge", text, None, device).await;
    }
}

#[tokio::test]
async fn changing_zones_are_datafusions() {
    if own_tests() {
        check_changing_zones(&ExecDevice::cpu()).await;
    }
}

/// The day count since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's
/// `days_from_civil`).
fn days_from_civil(y: i32, m: u32, d: u32) -> i32 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m as i32 + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d as i32 - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// A draw in `0..below` ([`xorshift`]'s).
type Draw<'a> = &'a mut dyn FnMut(u64) -> u64;

/// A small xorshift generator, seeded: `next(below)` is in `0..below` (0 for `below` 0).
/// The tests that draw their cases with it name a failing case that fails again.
fn xorshift(mut state: u64) -> impl FnMut(u64) -> u64 {
    move |below| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state % below.max(1)
    }
}

/// A session with table `name` of one `Utf8View` column `s`: 300 values, one in
/// `nulls` null (drawn first), the others of fewer than `longest` characters drawn by
/// `character`, in view blocks of 64 bytes (several of them).
fn random_strings_table(
    name: &str,
    next: Draw<'_>,
    (nulls, longest): (u64, u64),
    character: &dyn Fn(Draw<'_>) -> char,
) -> SessionContext {
    let mut values = arrow_array::builder::StringViewBuilder::new().with_fixed_block_size(64);
    for _ in 0..300 {
        if next(nulls) == 0 {
            values.append_null();
            continue;
        }
        let len = next(longest) as usize;
        let value: String = (0..len).map(|_| character(&mut *next)).collect();
        values.append_value(value);
    }
    let values = values.finish();
    assert!(values.data_buffers().len() > 1, "several blocks");
    let batch = RecordBatch::try_from_iter([("s", Arc::new(values) as ArrayRef)]).unwrap();
    let ctx = SessionContext::new();
    let table = MemTable::try_new(batch.schema(), vec![vec![batch]]).unwrap();
    ctx.register_table(name, Arc::new(table)).unwrap();
    ctx
}

/// LIKE against DataFusion on random values and patterns: values of 0 to 30 characters
/// of 1 to 4 bytes (`a`, `b`, `é`, `🦀`) and of LIKE's own (`_`, `%`, `\\`), inline and
/// long, in several blocks, some null; patterns of up to 8 of those, `%`, `_` and escapes
/// (`\\` and a character, or a trailing `\\`), each as `LIKE` and `NOT LIKE`; then
/// `substr` of the same values. A small xorshift makes them, seeded, so a failure names
/// a pattern that fails again.
pub async fn check_random_like(device: &ExecDevice) {
    let mut next = xorshift(0x9E37_79B9_7F4A_7C15);
    // Mostly the first four, so that patterns of literals match some values.
    let alphabet = ['a', 'b', 'é', '🦀', '_', '%', '\\'];
    let character = |next: &mut dyn FnMut(u64) -> u64| alphabet[(next(20) as usize).min(18) / 3];
    let ctx = random_strings_table("r", &mut next, (13, 31), &character);
    for round in 0..160 {
        let len = next(9) as usize;
        let mut pattern = String::new();
        for _ in 0..len {
            match next(12) {
                0..=2 => pattern.push('%'),
                3..=4 => pattern.push('_'),
                5 => {
                    pattern.push('\\');
                    if next(4) != 0 {
                        pattern.push(character(&mut next));
                    }
                }
                _ => pattern.push(character(&mut next)),
            }
        }
        let not = if round % 2 == 0 { "" } else { "NOT " };
        let text = format!("(s {not}LIKE '{pattern}')");
        assert_evaluates_as_datafusion(&ctx, "r", &text, &[], device).await;
    }
    // Lengths of the same values, and one-piece patterns drawn from them.
    for text in ["character_length(s)", "octet_length(s)", "bit_length(s)"] {
        assert_evaluates_as_datafusion(&ctx, "r", text, &[(7, 200)], device).await;
    }
    for round in 0..30 {
        let len = next(4) as usize;
        let piece: String = (0..len).map(|_| character(&mut next)).collect();
        let function = ["starts_with", "ends_with", "contains"][round % 3];
        let text = format!("{function}(s, '{piece}')");
        assert_evaluates_as_datafusion(&ctx, "r", &text, &[(7, 200)], device).await;
    }
    // And substr of the same values: starts from -3 to 34, counts from 0 to 15 or none.
    for round in 0..40 {
        let start = next(38) as i64 - 3;
        let text = match round % 4 {
            0 => format!("substr(s, {start})"),
            _ => format!("substr(s, {start}, {})", next(16)),
        };
        assert_evaluates_as_datafusion(&ctx, "r", &text, &[(7, 200)], device).await;
    }
}

/// Regular expressions against DataFusion (`~`, `~*`, `!~`, `!~*`, DataFusion's `regex`
/// crate) on random values and patterns: values of 0 to 20 characters of 1 to 4 bytes in
/// both cases (`a`, `b`, `A`, `é`, `É`, `🦀`), inline and long, some null; patterns of
/// those characters, `.`, classes (negated, ranges, Unicode ones), groups, alternations,
/// repetitions (`*`, `+`, `?`, counted), anchors, case folding. Seeded, as
/// [`check_random_like`].
pub async fn check_random_regex(device: &ExecDevice) {
    let mut next = xorshift(0x2545_F491_4F6C_DD1D);
    let alphabet = ['a', 'b', 'A', 'é', 'É', '🦀'];
    let character = |next: &mut dyn FnMut(u64) -> u64| alphabet[next(6) as usize];
    let ctx = random_strings_table("r", &mut next, (11, 21), &character);
    fn term(next: &mut dyn FnMut(u64) -> u64, depth: u32) -> String {
        let atom = match next(if depth > 0 { 6 } else { 9 }) {
            0..=2 => ['a', 'b', 'A', 'é', 'É', '🦀'][next(6) as usize].to_string(),
            3 => ".".into(),
            4 => [
                "[ab]",
                "[^a]",
                "[a-z]",
                "[é🦀]",
                "\\w",
                "\\p{Lu}",
                "[[:alpha:]]",
            ][next(7) as usize]
                .into(),
            5 => "\\s".into(),
            6 => format!("({})", sequence(next, depth + 1)),
            _ => format!(
                "(?:{}|{})",
                sequence(next, depth + 1),
                sequence(next, depth + 1)
            ),
        };
        let quantifier = ["", "", "", "", "*", "+", "?", "{1,2}"][next(8) as usize];
        atom + quantifier
    }
    fn sequence(next: &mut dyn FnMut(u64) -> u64, depth: u32) -> String {
        (0..1 + next(3)).map(|_| term(next, depth)).collect()
    }
    let (mut too_large, mut counted, mut replaced) = (0, 0, 0);
    for round in 0..120 {
        let mut pattern = sequence(&mut next, 0);
        if next(4) == 0 {
            pattern.insert(0, '^');
        }
        if next(4) == 0 {
            pattern.push('$');
        }
        let op = ["~", "~*", "!~", "!~*"][round % 4];
        let text = format!("(s {op} '{pattern}')");
        // An automaton past the device's bound stays on the host (Unicode classes
        // repeated can make thousands of states).
        let (e, schema, _) = projection_of(&ctx, "r", &text).await;
        if let Err(Unsupported(why)) = DeviceExpr::compile(&e, &schema) {
            assert!(
                why.contains("limit") || why.contains("more than"),
                "{text}: {why}"
            );
            too_large += 1;
            continue;
        }
        assert_evaluates_as_datafusion(&ctx, "r", &text, &[(7, 200)], device).await;
        // And the matches counted (empty ones too).
        let count = format!("regexp_count(s, '{pattern}')");
        let (e, schema, _) = projection_of(&ctx, "r", &count).await;
        match DeviceExpr::compile(&e, &schema) {
            Err(Unsupported(why)) => {
                assert!(
                    why.contains("limit") || why.contains("more than"),
                    "{count}: {why}"
                )
            }
            Ok(_) => {
                counted += 1;
                assert_evaluates_as_datafusion(&ctx, "r", &count, &[(7, 200)], device).await;
            }
        }
        // And the position of its second match, from the second character on.
        let instr = format!("regexp_instr(s, '{pattern}', 2, 2)");
        let (e, schema, _) = projection_of(&ctx, "r", &instr).await;
        if DeviceExpr::compile(&e, &schema).is_ok() {
            assert_evaluates_as_datafusion(&ctx, "r", &instr, &[(7, 200)], device).await;
        }
        // And replaced, every match or the first.
        let flags = ["'g'", "'gi'", "''", "'i'"][round % 4];
        let replace = format!("regexp_replace(s, '{pattern}', '<>', {flags})");
        let (e, schema, _) = projection_of(&ctx, "r", &replace).await;
        if DeviceExpr::compile(&e, &schema).is_ok() {
            replaced += 1;
            assert_evaluates_as_datafusion(&ctx, "r", &replace, &[(7, 200)], device).await;
        }
    }
    assert!(counted > 30, "{counted} patterns counted");
    assert!(replaced > 30, "{replaced} patterns replaced");
    assert!(
        too_large < 6,
        "{too_large} of 120 patterns too large for the device"
    );
}

/// Patterns that match the empty string against DataFusion: `regexp_count`,
/// `regexp_instr` (from each start up to past the values' ends, several occurrences) and
/// `regexp_replace` (first and every match) count, find and replace their empty matches
/// as `find_iter` yields them (at each character's start, not inside one, not at the
/// previous match's end, and at the value's end), over random values of 1 to 4 bytes a
/// character, inline and long, some null.
pub async fn check_empty_matches(device: &ExecDevice) {
    let mut next = xorshift(0xBB67_AE85_84CA_A73B);
    let alphabet = ['a', 'b', 'A', 'é', '🦀', ' '];
    let character = |next: &mut dyn FnMut(u64) -> u64| alphabet[next(6) as usize];
    let ctx = random_strings_table("e", &mut next, (11, 21), &character);
    for pattern in [
        "",
        "a*",
        "a*?",
        "b?",
        "x*|a",
        "^",
        "$",
        "é*",
        "\\b",
        "\\B",
        "(a|🦀)*",
    ] {
        // Each expression, and whether its search starts at each value's start.
        let mut texts = vec![
            (format!("regexp_count(s, '{pattern}')"), true),
            (format!("regexp_replace(s, '{pattern}', '<>', 'g')"), true),
            (format!("regexp_replace(s, '{pattern}', '<>')"), true),
            (format!("regexp_replace(s, '{pattern}', '', 'g')"), true),
        ];
        for (start, nth) in [(1, 1), (1, 3), (2, 2), (20, 1), (21, 1), (22, 1)] {
            texts.push((format!("regexp_count(s, '{pattern}', {start})"), start == 1));
            let instr = format!("regexp_instr(s, '{pattern}', {start}, {nth})");
            texts.push((instr, start == 1));
        }
        let boundary = pattern.contains("\\b") || pattern.contains("\\B");
        for (text, from_the_start) in texts {
            if !boundary {
                assert_evaluates_as_datafusion(&ctx, "e", &text, &[(7, 200)], device).await;
            } else if from_the_start {
                // A Unicode boundary's automaton gives up on the values past ASCII (a
                // search from each value's start reaches them): the host's.
                assert_left_to_the_host(&ctx, "e", &text, None, device).await;
            }
        }
    }
}

/// Word boundaries against DataFusion: Unicode ones (`\b`, `\B`) and ASCII ones
/// (`(?-u:\b)`) in `~`, `~*`, `!~`, `regexp_count`, `regexp_instr` and
/// `regexp_replace`, over random ASCII values of words, spaces, `_`, `-` and digits
/// (inline and long, some null). A Unicode boundary's automaton gives up at a byte past
/// ASCII: a batch with such a value is left to the host (`HostOnly`), and a query's
/// filter computes it there, with DataFusion's rows; an ASCII boundary needs no such
/// state, and stays on the device.
pub async fn check_word_boundaries(device: &ExecDevice) {
    let mut next = xorshift(0x6A09_E667_F3BC_C908);
    let alphabet = ['a', 'b', 'A', ' ', '_', '-', '1'];
    let character = |next: &mut dyn FnMut(u64) -> u64| alphabet[next(7) as usize];
    let ctx = random_strings_table("w", &mut next, (11, 21), &character);
    for pattern in [
        "\\bab",
        "b\\b",
        "\\Ba",
        "\\b\\w+\\b",
        "\\b[ab]{2}\\b",
        "\\b1|a\\B",
        "^\\bA",
        "(?-u:\\b)a",
        "(?-u:\\B)b(?-u:\\b)",
    ] {
        for text in [
            format!("(s ~ '{pattern}')"),
            format!("(s ~* '{pattern}')"),
            format!("(s !~ '{pattern}')"),
            format!("regexp_count(s, '{pattern}')"),
            format!("regexp_instr(s, '{pattern}', 1, 2)"),
            format!("regexp_replace(s, '{pattern}', '<>', 'g')"),
            format!("regexp_replace(s, '{pattern}', '<>')"),
        ] {
            assert_evaluates_as_datafusion(&ctx, "w", &text, &[(7, 200)], device).await;
        }
    }
    // Past ASCII.
    let values = ["x ab", "éab", "ab é", "a_b", "🦀 ab"];
    let batch = RecordBatch::try_from_iter([(
        "s",
        Arc::new(arrow_array::StringViewArray::from_iter_values(values)) as ArrayRef,
    )])
    .unwrap();
    let wb = session_of("wb", &batch);
    for text in [
        "(s ~ '\\bab')",
        "regexp_count(s, '\\bab')",
        "regexp_instr(s, 'a\\b')",
        "regexp_replace(s, '\\Bb', '<>', 'g')",
    ] {
        assert_left_to_the_host(&wb, "wb", text, Some(&batch), device).await;
    }
    for text in [
        "(s ~ '(?-u:\\b)ab')",
        "regexp_count(s, '(?-u:\\b)ab')",
        "regexp_replace(s, '(?-u:\\B)b', '<>', 'g')",
    ] {
        assert_evaluates_as_datafusion(&wb, "wb", text, &[(1, 3)], device).await;
    }
    // A value past ASCII that the walk never reaches (it matched first): the device's.
    let matched_first = RecordBatch::try_from_iter([(
        "s",
        Arc::new(arrow_array::StringViewArray::from_iter_values([
            "ab é",
            "x ab 🦀",
        ])) as ArrayRef,
    )])
    .unwrap();
    let mf = session_of("mf", &matched_first);
    assert_evaluates_as_datafusion(&mf, "mf", "(s ~ '\\bab')", &[], device).await;
    // One partition of ASCII (the device's), one past it (the host's).
    let parts = vec![vec![batch.slice(0, 1)], vec![batch.slice(1, 4)]];
    let sql = "SELECT s, regexp_count(s, '\\b\\w') AS n FROM wb WHERE s ~ '\\bab'";
    falls_back_as_datafusion(device, ("wb", parts), sql, "DeviceFilterExec").await;
}

/// Casts between strings and values against DataFusion (arrow's cast): integers of
/// every width, decimals (scales 0 to 18, values of fewer digits than the scale,
/// negative ones), dates (years 0 to 9999, before 1970), Booleans and timestamps (each
/// unit, fractions of each length, no zone or a fixed one) written as `Utf8`,
/// `LargeUtf8` and `Utf8View` (`CAST`, `TRY_CAST`, of columns and expressions, and
/// inside `concat`, `||` and `concat_ws`, which cast their other arguments); strings
/// parsed as integers of every width (whitespace, signs, leading zeros, each width's
/// ends and one past them, inline and long values) and as dates (each of arrow's forms,
/// days past their month, leap years, bytes arrow ignores): `TRY_CAST` gives null where
/// a value is none, `CAST` fails as DataFusion's. A decimal of more digits than its
/// precision (arrow cuts them), a date past 9999, and a string of more than 10 bytes or
/// a sign parsed as a date are left to the host.
pub async fn check_string_casts(device: &ExecDevice) {
    use arrow_array::{Int16Array, Int8Array, StringViewArray};

    let ints: Vec<Option<i64>> = vec![
        Some(0),
        Some(1),
        Some(-1),
        Some(i64::MIN),
        Some(i64::MAX),
        None,
        Some(42),
        Some(-100),
        Some(1_000_000_007),
        Some(-9_999_999_999),
        Some(10),
        Some(-10),
    ];
    let n = ints.len();
    let narrow = |lo: i64, hi: i64| -> Vec<Option<i64>> {
        ints.iter().map(|v| v.map(|v| v.clamp(lo, hi))).collect()
    };
    let decimals = |values: &[i64], p: u8, s: i8| -> ArrayRef {
        let values = (0..n).map(|i| (i % 5 != 3).then(|| values[i % values.len()] as i128));
        Arc::new(
            values
                .collect::<Decimal128Array>()
                .with_precision_and_scale(p, s)
                .unwrap(),
        )
    };
    let days = [
        0, -1, 1, -719_528, 2_932_896, 11_016, -25_567, 59, -36_524, 10_957, 19_000,
    ];
    let batch = RecordBatch::try_from_iter([
        (
            "i8",
            Arc::new(Int8Array::from_iter(
                narrow(-128, 127).iter().map(|v| v.map(|v| v as i8)),
            )) as ArrayRef,
        ),
        (
            "i16",
            Arc::new(Int16Array::from_iter(
                narrow(-32768, 32767).iter().map(|v| v.map(|v| v as i16)),
            )),
        ),
        (
            "i32",
            Arc::new(Int32Array::from_iter(
                narrow(i32::MIN as i64, i32::MAX as i64)
                    .iter()
                    .map(|v| v.map(|v| v as i32)),
            )),
        ),
        ("i64", Arc::new(Int64Array::from(ints.clone()))),
        (
            "d2",
            decimals(
                &[0, 5, -5, 12345, -12345, 99, 100, -1, 999_999_999_999_999],
                15,
                2,
            ),
        ),
        (
            "d0",
            decimals(&[0, 7, -7, 1_234_567_890, -9_999_999_999], 10, 0),
        ),
        (
            "d18",
            decimals(&[1, -1, 999_999_999_999_999_999, 10, 0], 18, 18),
        ),
        (
            "d38",
            decimals(&[i64::MAX, i64::MIN + 1, 123_456, -5], 38, 10),
        ),
        (
            "dt",
            Arc::new(Date32Array::from_iter(
                (0..n).map(|i| (i % 4 != 1).then_some(days[i % days.len()])),
            )),
        ),
        (
            "b",
            Arc::new(BooleanArray::from_iter(
                (0..n).map(|i| (i % 3 != 2).then_some(i % 2 == 0)),
            )),
        ),
    ])
    .unwrap();
    let ctx = session_of("c", &batch);
    for column in [
        "i8", "i16", "i32", "i64", "d2", "d0", "d18", "d38", "dt", "b",
    ] {
        for to in ["'Utf8'", "'LargeUtf8'", "'Utf8View'"] {
            let text = format!("arrow_cast({column}, {to})");
            assert_evaluates_as_datafusion(&ctx, "c", &text, &[(3, 7)], device).await;
        }
        for cast in ["CAST", "TRY_CAST"] {
            let text = format!("{cast}({column} AS VARCHAR)");
            assert_evaluates_as_datafusion(&ctx, "c", &text, &[(3, 7)], device).await;
        }
    }
    for text in [
        "CAST(i32 * 2 AS VARCHAR)",
        "CAST(d2 + d2 AS VARCHAR)",
        "CAST(CASE WHEN dt < DATE '9000-01-01' THEN dt + INTERVAL '3' DAY END AS VARCHAR)",
        "CAST(i64 > 0 AS VARCHAR)",
        "CAST(CASE WHEN b THEN i16 END AS VARCHAR)",
        // Booleans cast to numbers (1 and 0, nulls kept).
        "CAST(b AS INT)",
        "CAST(b AS TINYINT)",
        "arrow_cast(b, 'UInt16')",
        "CAST(i32 > 0 AS BIGINT) + CAST(b AS BIGINT)",
        "CAST(b AS DOUBLE)",
        // Integers to booleans (`x <> 0`).
        "CAST(i8 AS BOOLEAN)",
        "CAST(i64 AS BOOLEAN)",
        "arrow_cast(arrow_cast(abs(CAST(i16 AS INT)), 'UInt16'), 'Boolean')",
        "CAST(i32 % 3 AS BOOLEAN) AND b",
        // `to_char` of dates with chrono's numeric fields (years 0 and 9999, days below
        // 10, leap years' days of the year), literal bytes, the composite `%F %D %T %R`,
        // `%%`, a time of the date's midnight, and `date_format` (its alias).
        "to_char(dt, '%Y-%m-%d')",
        "to_char(dt, '%d/%m/%Y')",
        "to_char(dt, '%Y%m')",
        "to_char(dt, 'Q %y.%j')",
        "to_char(dt, '[%e]')",
        "to_char(dt, '%F %T')",
        "to_char(dt, '%D %R')",
        "to_char(dt, '100%% %H:%M:%S')",
        "date_format(CASE WHEN dt < DATE '9000-01-01' THEN dt + INTERVAL '40' DAY END, '%Y %j')",
    ] {
        assert_evaluates_as_datafusion(&ctx, "c", text, &[(1, 9)], device).await;
    }
    // Formats the device does not write (names, padding modifiers, more than 16 steps)
    // and a non-date stay the host's.
    for text in [
        "to_char(dt, '%b %Y')",
        "to_char(dt, '%-d')",
        "to_char(dt, '%F %F %F')",
        "to_char(CAST(dt AS TIMESTAMP), '%Y')",
    ] {
        let (e, schema, _) = projection_of(&ctx, "c", text).await;
        assert!(DeviceExpr::compile(&e, &schema).is_err(), "{text}");
    }
    // Timestamps of each unit, with fractions of each length, before 1970, in fixed
    // zones (a changing zone's are the host's: refused).
    {
        use arrow_array::{
            TimestampMicrosecondArray, TimestampMillisecondArray, TimestampNanosecondArray,
            TimestampSecondArray,
        };
        let nanos: Vec<Option<i64>> = vec![
            Some(0),
            Some(1_500_000_000),
            Some(-1),
            Some(1_700_000_000_123_000_000),
            Some(1_700_000_000_123_456_000),
            Some(1_700_000_000_123_456_789),
            None,
            Some(-1_000_000_000_000_000_000),
            Some(951_782_400_100_000_000),
            Some(-6_213_559_680_123_000_000),
            Some(86_399_999_999_999),
            Some(i64::MAX),
        ];
        let of = |div: i64| -> Vec<Option<i64>> {
            nanos.iter().map(|v| v.map(|v| v.div_euclid(div))).collect()
        };
        let times = RecordBatch::try_from_iter([
            (
                "s",
                Arc::new(TimestampSecondArray::from(of(1_000_000_000))) as ArrayRef,
            ),
            (
                "ms",
                Arc::new(TimestampMillisecondArray::from(of(1_000_000))),
            ),
            ("us", Arc::new(TimestampMicrosecondArray::from(of(1_000)))),
            ("ns", Arc::new(TimestampNanosecondArray::from(of(1)))),
            (
                "utc",
                Arc::new(TimestampMicrosecondArray::from(of(1_000)).with_timezone("UTC")),
            ),
            (
                "zero",
                Arc::new(TimestampMillisecondArray::from(of(1_000_000)).with_timezone("+00:00")),
            ),
            (
                "east",
                Arc::new(TimestampNanosecondArray::from(of(1)).with_timezone("+05:30")),
            ),
            (
                "west",
                Arc::new(TimestampSecondArray::from(of(1_000_000_000)).with_timezone("-03:00")),
            ),
            (
                "ny",
                Arc::new(
                    TimestampSecondArray::from(of(1_000_000_000)).with_timezone("America/New_York"),
                ),
            ),
        ])
        .unwrap();
        // (i64::MAX nanoseconds, the last row, plus a zone's offset passes the lanes: the
        // host's batch, as every local time past them.)
        let t = session_of("t", &times.slice(0, 11));
        let whole = session_of("whole", &times);
        for column in ["s", "ms", "us", "ns"] {
            let text = format!("CAST({column} AS VARCHAR)");
            assert_evaluates_as_datafusion(&whole, "whole", &text, &[], device).await;
        }
        for column in ["s", "ms", "us", "ns", "utc", "zero", "east", "west"] {
            for text in [
                format!("CAST({column} AS VARCHAR)"),
                format!("arrow_cast({column}, 'LargeUtf8')"),
                format!("'at ' || {column}"),
            ] {
                assert_evaluates_as_datafusion(&t, "t", &text, &[(2, 7)], device).await;
            }
        }
        let (e, schema, _) = projection_of(&t, "t", "CAST(ny AS VARCHAR)").await;
        assert!(
            DeviceExpr::compile(&e, &schema).is_err(),
            "a changing zone's"
        );
        // Past 9999 (in seconds and milliseconds).
        let far = RecordBatch::try_from_iter([
            (
                "s",
                Arc::new(TimestampSecondArray::from(vec![0, 300_000_000_000])) as ArrayRef,
            ),
            (
                "ms",
                Arc::new(TimestampMillisecondArray::from(vec![
                    0,
                    300_000_000_000_000,
                ])),
            ),
        ])
        .unwrap();
        let far = session_of("far", &far);
        for text in ["CAST(s AS VARCHAR)", "CAST(ms AS VARCHAR)"] {
            assert_left_to_the_host(&far, "far", text, None, device).await;
        }
    }

    // Inside `concat`, `||` and `concat_ws` (DataFusion casts their other arguments).
    let words = ["", "a", "long enough to be out of line", "é", "x"];
    let with_words = |batch: &RecordBatch| {
        let s: StringViewArray = (0..batch.num_rows())
            .map(|i| (i % 6 != 4).then_some(words[i % words.len()]))
            .collect();
        let mut columns = batch.columns().to_vec();
        columns.push(Arc::new(s));
        let mut fields: Vec<Field> = batch
            .schema()
            .fields()
            .iter()
            .map(|f| f.as_ref().clone())
            .collect();
        fields.push(Field::new("s", DataType::Utf8View, true));
        RecordBatch::try_new(Arc::new(Schema::new(fields)), columns).unwrap()
    };
    let joined = session_of("j", &with_words(&batch));
    for text in [
        "concat(s, i32)",
        "s || i64",
        "'#' || i8",
        "concat_ws('-', s, i16, dt, d2)",
        "concat(i32, 'x', b)",
        "concat_ws(', ', d18, d38, b)",
        "s || CAST(i32 * 2 AS VARCHAR) || dt",
        "concat(s, TRY_CAST(d0 AS VARCHAR), i8)",
    ] {
        assert_evaluates_as_datafusion(&joined, "j", text, &[(2, 8)], device).await;
    }
    // More digits than the precision; a year past 9999: arrow's, on the host.
    let odd = RecordBatch::try_from_iter([
        ("d", decimals(&[1, 1_234_567], 5, 2)),
        (
            "dt",
            Arc::new(Date32Array::from_iter(
                (0..n).map(|i| Some([0, 2_932_897][i % 2])),
            )),
        ),
    ])
    .unwrap();
    let o = session_of("o", &with_words(&odd));
    for text in [
        "CAST(d AS VARCHAR)",
        "CAST(dt AS VARCHAR)",
        "concat(s, d)",
        "s || dt",
    ] {
        assert_left_to_the_host(&o, "o", text, None, device).await;
    }

    // Parsed.
    let mut words: Vec<Option<String>> = [
        "0",
        "42",
        "-42",
        "+7",
        " 12 ",
        "\t-3\n",
        "\r\x0c5\x0c",
        "abc",
        "",
        " ",
        "1 2",
        "9223372036854775807",
        "-9223372036854775808",
        "9223372036854775808",
        "-9223372036854775809",
        "99999999999999999999999",
        "00000000000000000000012",
        "\x0b5",
        "5\x0b",
        "+",
        "-",
        "+-1",
        "1e3",
        "12.0",
        "\u{661}",
        "127",
        "-128",
        "128",
        "-129",
        "32767",
        "-32769",
        "2147483647",
        "-2147483649",
        "      123456789012   ",
        "-000000000000000000000000000000001",
    ]
    .iter()
    .map(|w| Some(w.to_string()))
    .collect();
    words.insert(5, None);
    let strings = RecordBatch::try_from_iter([
        (
            "s",
            Arc::new(StringViewArray::from(words.clone())) as ArrayRef,
        ),
        ("u", Arc::new(StringArray::from(words.clone()))),
    ])
    .unwrap();
    let p = session_of("p", &strings);
    for column in ["s", "u"] {
        for to in ["TINYINT", "SMALLINT", "INT", "BIGINT"] {
            let text = format!("TRY_CAST({column} AS {to})");
            assert_evaluates_as_datafusion(&p, "p", &text, &[(3, 20)], device).await;
            let text = format!("CAST({column} AS {to})");
            assert_fails_as_datafusion(&p, "p", &text, None, device).await;
        }
        // Every value an integer: the device's.
        let text = format!("CAST({column} AS BIGINT) + 1");
        let ints = strings.slice(0, 3);
        let ok = session_of("q", &ints);
        assert_evaluates_as_datafusion(&ok, "q", &text, &[(1, 2)], device).await;
    }

    // Floats and decimals: the values whose parse is certain on the device (the rest,
    // whitespace, a float's `+`, `.5` or `5.`, more than 2^53 or a power of ten past
    // 22, anything not a number: the host's, batch by batch).
    let numbers = |values: &[&str]| {
        let values: Vec<Option<&str>> = values
            .iter()
            .enumerate()
            .flat_map(|(i, v)| [Some(*v)].into_iter().chain((i % 5 == 2).then_some(None)))
            .collect();
        session_of(
            "n",
            &RecordBatch::try_from_iter([
                (
                    "s",
                    Arc::new(StringViewArray::from(values.clone())) as ArrayRef,
                ),
                ("u", Arc::new(arrow_array::LargeStringArray::from(values))),
            ])
            .unwrap(),
        )
    };
    let floats = numbers(&[
        "0",
        "-0",
        "1.5",
        "-2.25",
        "007.50",
        "123456789012345",
        "9007199254740992",
        "1e22",
        "1e-22",
        "12.5e-3",
        "3E+4",
        "-4.5e1",
        "0.1",
        "0.000001",
        "123.456e-19",
        "0e500",
        "0.30000000000004",
        "-9007199254740.991",
    ]);
    let decimals = numbers(&[
        "0",
        "-0",
        "1.5",
        "+7",
        ".5",
        "5.",
        "-.25",
        "12.345",
        "-12.345",
        "0.004",
        "0.005",
        "-0.005",
        "99999999.99",
        "000123",
        "1.99999999999999999999999999",
        "-0.0049",
    ]);
    let wide = numbers(&["1.5", "123456789.5", "-99999999.995"]);
    for column in ["s", "u"] {
        for text in [
            format!("CAST({column} AS DOUBLE)"),
            format!("TRY_CAST({column} AS DOUBLE) * 2"),
        ] {
            assert_evaluates_as_datafusion(&floats, "n", &text, &[(3, 9)], device).await;
        }
        for to in [
            "DECIMAL(10,2)",
            "DECIMAL(18,0)",
            "DECIMAL(38,4)",
            "DECIMAL(6,5)",
        ] {
            let text = format!("TRY_CAST({column} AS {to})");
            assert_evaluates_as_datafusion(&decimals, "n", &text, &[(3, 9)], device).await;
        }
        let text = format!("CAST({column} AS DECIMAL(10,2))");
        assert_evaluates_as_datafusion(&decimals, "n", &text, &[(3, 9)], device).await;
        assert_fails_as_datafusion(&wide, "n", &text, None, device).await;
        for odd in [
            " 1.5",
            "1e400",
            "abc",
            "+5",
            ".5",
            "5.",
            "1.5.5",
            "99999999999999999999",
        ] {
            let text = format!("CAST({column} AS DOUBLE)");
            let batch = numbers(&["1", odd]);
            assert_left_to_the_host(&batch, "n", &text, None, device).await;
        }
        for odd in [" 1.5", "1e4", "abc", "1.2.3", "", "-"] {
            let text = format!("TRY_CAST({column} AS DECIMAL(10,2))");
            let batch = numbers(&["1", odd]);
            assert_left_to_the_host(&batch, "n", &text, None, device).await;
        }
    }

    // Timestamps of each unit and no zone: a date alone, `T`, `t` or a space, fractions
    // of 1 to 12 digits (the first 9 kept), `Z`, fixed offsets in arrow's three forms
    // (after white space too; across midnight and the year); no timestamp where the
    // date, the separator, the clock or the point is wrong, or past the unit
    // (nanoseconds past 2262); a zone's name, an offset of a day or more, HHMMSS or a
    // leap second: the host's.
    let stamps = numbers(&[
        "2020-01-01",
        "1969-12-31T23:59:59",
        "2020-02-29 12:34:56.5",
        "2020-02-29t00:00:00.123456789",
        "1999-12-31 23:59:59.1234567891Z",
        "1970-01-01T00:00:00.000001z",
        "1677-09-21T00:12:43.145224192",
        "2262-04-11T23:47:16.854775807",
        "2020-01-01T12:00:00+05:00",
        "2020-01-01T02:00:00.25-0330",
        "1999-12-31 23:30:00 +01",
        "2000-01-01T00:10:00\t-23:59",
        "2020-06-15T08:00:00+00:00",
    ]);
    // Past nanoseconds' range.
    let far = numbers(&[
        "0000-01-01 00:00:00",
        "9999-12-31T23:59:59.999",
        "1600-03-01 01:02:03.04",
    ]);
    let wrong = numbers(&[
        "2020-01-01",
        "2019-02-29",
        "2020-13-01",
        "2020-01-01x12:00:00",
        "2020-1-1 12:00:00",
        "2020-01-01 24:00:00",
        "2020-01-01 12:60:00",
        "2020-01-01 12:00:00.",
        "2020-01",
        "",
        "2263-01-01",
    ]);
    for column in ["s", "u"] {
        for unit in ["Second", "Millisecond", "Microsecond", "Nanosecond"] {
            let text = format!("arrow_cast({column}, 'Timestamp({unit}, None)')");
            assert_evaluates_as_datafusion(&stamps, "n", &text, &[(3, 6)], device).await;
            if unit != "Nanosecond" {
                assert_evaluates_as_datafusion(&far, "n", &text, &[], device).await;
            }
            let text = format!("TRY_CAST({column} AS TIMESTAMP)");
            assert_evaluates_as_datafusion(&wrong, "n", &text, &[(3, 6)], device).await;
        }
        let text = format!("CAST({column} AS TIMESTAMP)");
        assert_evaluates_as_datafusion(&stamps, "n", &text, &[(3, 6)], device).await;
        assert_fails_as_datafusion(&wrong, "n", &text, None, device).await;
        // `to_timestamp(s)` (no session time zone): the same parse, the same error.
        let text = format!("to_timestamp({column})");
        assert_evaluates_as_datafusion(&stamps, "n", &text, &[(3, 6)], device).await;
        assert_fails_as_datafusion(&wrong, "n", &text, None, device).await;
        for odd in [
            "2020-01-01T12:00:00+24:00",
            "2020-01-01T12:00:00+05:0",
            "2020-01-01T12:00:00 +",
            "2020-01-01 120000",
            "2020-01-01 23:59:60",
            "2020-01-01 12:00:00 UTC",
        ] {
            let batch = numbers(&["2020-01-01", odd]);
            assert_left_to_the_host(&batch, "n", &text, None, device).await;
        }
    }

    // Dates: each of arrow's forms, real dates and not, bytes past the day, leap years.
    let mut dates: Vec<Option<&str>> = [
        "2020-01-01",
        "2020-1-1",
        "2020-01-1",
        "2020-1-01",
        "20200101",
        "2020-02-29",
        "2019-02-29",
        "1900-02-29",
        "2000-02-29",
        "0000-02-29",
        "2020-13-01",
        "2020-00-10",
        "2020-04-31",
        "2020-04-30",
        "2020-1-0",
        "0000-01-01",
        "9999-12-31",
        "1969-12-31",
        "1583-10-15",
        "2020-1-1x",
        "2020-01-1x",
        "2020-1-11x",
        "2020-1-1xy",
        "2020-1-123",
        "2020/01/01",
        " 2020-1-1",
        "2020-0101",
        "2020011",
        "202001011",
        "",
        "abc",
        "1-1-1",
        "2020-١-1",
    ]
    .into_iter()
    .map(Some)
    .collect();
    dates.insert(3, None);
    let valid: Vec<Option<&str>> = dates.iter().take(6).copied().collect();
    let date_strings = |values: &[Option<&str>]| {
        RecordBatch::try_from_iter([
            (
                "s",
                Arc::new(StringViewArray::from(values.to_vec())) as ArrayRef,
            ),
            ("u", Arc::new(StringArray::from(values.to_vec()))),
        ])
        .unwrap()
    };
    let d = session_of("d", &date_strings(&dates));
    let v = session_of("v", &date_strings(&valid));
    // More than 10 bytes (a timestamp to arrow), a sign first (an extended year): the
    // host's.
    let host = date_strings(&[Some("2020-01-01"), Some("2020-01-01T10:00:00")]);
    let signed = date_strings(&[Some("+2020-01-01"), Some("2020-01-01")]);
    let (h, g) = (session_of("h", &host), session_of("g", &signed));
    for column in ["s", "u"] {
        let text = format!("TRY_CAST({column} AS DATE)");
        assert_evaluates_as_datafusion(&d, "d", &text, &[(3, 20)], device).await;
        let text = format!("CAST({column} AS DATE)");
        assert_fails_as_datafusion(&d, "d", &text, None, device).await;
        assert_evaluates_as_datafusion(&v, "v", &text, &[(1, 4)], device).await;
        let text = format!("CAST({column} AS DATE) + INTERVAL '1' MONTH");
        assert_evaluates_as_datafusion(&v, "v", &text, &[(1, 4)], device).await;
        // `to_date(s)`: arrow's `Date32Type::parse`, the cast's; its error where none.
        let text = format!("to_date({column})");
        assert_evaluates_as_datafusion(&v, "v", &text, &[(1, 4)], device).await;
        assert_fails_as_datafusion(&d, "d", &text, None, device).await;
        let text = format!("TRY_CAST({column} AS DATE)");
        assert_left_to_the_host(&h, "h", &text, None, device).await;
        assert_left_to_the_host(&g, "g", &text, None, device).await;
    }
}

/// `CASE` whose values are strings against DataFusion: columns of each string type
/// (inline and long values, nulls), literals (inline and long), null values, values cast
/// to strings, a base expression, no `ELSE`; and `coalesce` and `nullif` of strings,
/// which DataFusion writes as such a `CASE`.
pub async fn check_string_choices(device: &ExecDevice) {
    use arrow_array::StringViewArray;

    let n = 40;
    let words = [
        "a",
        "",
        "bb",
        "a value longer than twelve bytes",
        "é🦀",
        "twelve bytes",
    ];
    let word = |i: usize, skip: usize| (i % 7 != skip).then_some(words[i % words.len()]);
    let batch = RecordBatch::try_from_iter([
        (
            "s",
            Arc::new((0..n).map(|i| word(i, 3)).collect::<StringViewArray>()) as ArrayRef,
        ),
        (
            "u",
            Arc::new((0..n).map(|i| word(i * 5 + 1, 5)).collect::<StringArray>()),
        ),
        (
            "i",
            Arc::new(Int32Array::from_iter(
                (0..n).map(|i| (i % 9 != 4).then_some(i as i32 % 11 - 5)),
            )),
        ),
        (
            "f",
            Arc::new(BooleanArray::from_iter(
                (0..n).map(|i| (i % 6 != 1).then_some(i % 4 < 2)),
            )),
        ),
    ])
    .unwrap();
    let ctx = session_of("c", &batch);
    for text in [
        "CASE WHEN f THEN s ELSE 'no' END",
        "CASE WHEN i > 0 THEN s WHEN i < -3 THEN u ELSE NULL END",
        "CASE i WHEN 1 THEN 'one' WHEN 2 THEN 'two' ELSE s END",
        "CASE WHEN f THEN 'a literal too long to be inline' END",
        "CASE WHEN i IS NULL THEN NULL ELSE 'x' END",
        "CASE WHEN f THEN CAST(i AS VARCHAR) WHEN i = 0 THEN 'zero' ELSE s END",
        "CASE WHEN f THEN u ELSE 'no' END",
        "coalesce(s, 'z')",
        "coalesce(s, u, 'none')",
        "coalesce(u, 'none')",
        "nullif(s, 'a')",
        "nullif(u, 'twelve bytes')",
    ] {
        assert_evaluates_as_datafusion(&ctx, "c", text, &[(3, 17)], device).await;
    }
}

/// Unsigned integers of up to 32 bits (their lanes zero-extended) against DataFusion:
/// comparisons, `IN`, `BETWEEN`, arithmetic (DataFusion's coercions), casts to and from
/// them (`TRY_CAST` of a negative value is null), written as strings; their unsigned
/// arithmetic overflows as DataFusion's does (the host raises its error).
pub async fn check_unsigned(device: &ExecDevice) {
    use arrow_array::{UInt16Array, UInt32Array};

    let n = 30u32;
    let batch = RecordBatch::try_from_iter([
        (
            "u8",
            Arc::new(UInt8Array::from_iter(
                (0..n).map(|i| (i % 7 != 3).then_some((i * 37 % 256) as u8)),
            )) as ArrayRef,
        ),
        (
            "u16",
            Arc::new(UInt16Array::from_iter((0..n).map(|i| {
                (i % 5 != 2).then_some(if i == 4 { u16::MAX } else { (i * 2_221) as u16 })
            }))),
        ),
        (
            "u32",
            Arc::new(UInt32Array::from_iter((0..n).map(|i| {
                (i % 6 != 1).then_some(if i == 9 {
                    u32::MAX
                } else {
                    i.wrapping_mul(150_000_001)
                })
            }))),
        ),
        (
            "i",
            Arc::new(Int32Array::from_iter(
                (0..n).map(|i| Some(i as i32 * 9 - 100)),
            )),
        ),
    ])
    .unwrap();
    let ctx = session_of("u", &batch);
    for text in [
        "u8 > 200",
        "u16 = 65535",
        "u32 < 3000000000",
        "u8 * 2",
        "CAST(u16 AS INT) + i",
        "CAST(u32 AS BIGINT) * 1000",
        "u32 / 7",
        "u32 % 1000",
        "CAST(u32 AS DOUBLE)",
        "CAST(u16 AS DECIMAL(10,2))",
        "u16 IN (0, 2221, 65535)",
        "u32 BETWEEN 10 AND 4000000000",
        "TRY_CAST(i AS INT UNSIGNED) IS NULL",
        "TRY_CAST(i AS TINYINT UNSIGNED) > 5",
        "CAST(u32 AS VARCHAR)",
        "u8 > u16",
        // Results of an unsigned type (zero-extended lanes, stored unsigned).
        "u8",
        "u32",
        "u32 / arrow_cast(7, 'UInt32')",
        "u16 % arrow_cast(1000, 'UInt16')",
        "CASE WHEN u8 > 100 THEN u8 END",
        "TRY_CAST(i AS INT UNSIGNED)",
        "TRY_CAST(i AS TINYINT UNSIGNED)",
        "arrow_cast(u8, 'UInt32') * arrow_cast(16843009, 'UInt32')",
    ] {
        assert_evaluates_as_datafusion(&ctx, "u", text, &[(2, 11)], device).await;
    }
    // Group keys, sums (UInt64 states, past u32), min and max.
    let parts = vec![vec![batch.slice(0, 13)], vec![batch.slice(13, 17)]];
    let two = SessionContext::new_with_config(SessionConfig::new().with_target_partitions(2));
    let table = MemTable::try_new(batch.schema(), parts).unwrap();
    two.register_table("u", Arc::new(table)).unwrap();
    for sql in [
        "SELECT u8 % 3 AS g, sum(u16), sum(u32), min(u32), max(u8), count(*) FROM u GROUP BY g",
        "SELECT u16, u32, sum(u8), min(u16) FROM u GROUP BY u16, u32",
        "SELECT sum(u32), min(u16), max(u16), max(u32) FROM u",
    ] {
        check_partial_aggregate(&two, sql, device).await;
    }

    // UInt32 + UInt32 past u32 (DataFusion fails), and below 0.
    let (fits, past) = (batch.slice(0, 9), batch.slice(0, 10));
    let small = session_of("s", &fits);
    assert_evaluates_as_datafusion(&small, "s", "(u32 + u32) > 5", &[], device).await;
    assert_fails_as_datafusion(&ctx, "u", "(u32 + u32) > 5", Some(&past), device).await;
    assert_fails_as_datafusion(&ctx, "u", "(u16 - u16 - u16) > 5", Some(&past), device).await;
}

/// Integer and float functions against DataFusion: `& | ^ << >>` of every signed width
/// (shift amounts negative and past the width: arrow's wrapping shifts; a left shift
/// past the width's sign bit); `gcd`, `lcm`, `factorial` (and their overflow errors);
/// `isnan`, `iszero`, `signum`, `nanvl`, and `greatest`/`least` of floats (NaNs of both
/// signs, both zeros, infinities: arrow's total order).
pub async fn check_integer_functions(device: &ExecDevice) {
    use arrow_array::{Float64Array, Int8Array};

    let n = 36i64;
    let batch = RecordBatch::try_from_iter([
        (
            "i8",
            Arc::new(Int8Array::from_iter(
                (0..n).map(|i| (i % 7 != 3).then_some((i * 37 % 256 - 128) as i8)),
            )) as ArrayRef,
        ),
        (
            "i16",
            Arc::new(arrow_array::Int16Array::from_iter((0..n).map(|i| {
                (i % 5 != 2).then_some((i * 2_221 % 65_536 - 32_768) as i16)
            }))),
        ),
        (
            "i32",
            Arc::new(Int32Array::from_iter((0..n).map(|i| {
                (i % 6 != 1).then_some(i.wrapping_mul(150_000_001) as i32)
            }))),
        ),
        (
            "i64",
            Arc::new(Int64Array::from_iter((0..n).map(|i| {
                Some(i.wrapping_mul(0x1234_5678_9abc_def1) ^ (i << 60))
            }))),
        ),
        (
            "s",
            Arc::new(Int32Array::from_iter((0..n).map(|i| {
                (i % 11 != 5).then_some(
                    [0, 1, 3, 7, 8, 15, 16, 31, 32, 33, 63, 64, 65, -1, -3, 100][i as usize % 16],
                )
            }))),
        ),
        (
            "u8",
            Arc::new(arrow_array::UInt8Array::from_iter(
                (0..n).map(|i| (i % 7 != 4).then_some((i * 59 % 256) as u8)),
            )),
        ),
        (
            "u16",
            Arc::new(arrow_array::UInt16Array::from_iter(
                (0..n).map(|i| (i % 5 != 3).then_some((i * 40_503 % 65_536) as u16)),
            )),
        ),
        (
            "u32",
            Arc::new(arrow_array::UInt32Array::from_iter((0..n).map(|i| {
                (i % 6 != 2).then_some(i.wrapping_mul(2_654_435_761) as u32)
            }))),
        ),
    ])
    .unwrap();
    let ctx = session_of("b", &batch);
    for text in [
        "i32 & 255",
        "i64 | i32",
        "i64 ^ CAST(s AS BIGINT)",
        "i8 & CAST(-16 AS TINYINT)",
        "i16 | CAST(s AS SMALLINT)",
        "i32 << s",
        "i32 >> s",
        "i64 << CAST(s AS BIGINT)",
        "i64 >> CAST(s AS BIGINT)",
        "i8 << CAST(s AS TINYINT)",
        "i8 >> CAST(s AS TINYINT)",
        "i16 << CAST(s AS SMALLINT)",
        "i16 >> CAST(s AS SMALLINT)",
        // unsigned: zero-extended lanes, a left shift cut to the width, a right shift
        // logical (the top bit set in many values)
        "u32 & u32",
        "u32 | CAST(abs(s) AS INT UNSIGNED)",
        "u32 ^ CAST(4294967295 AS INT UNSIGNED)",
        "u32 << CAST(abs(s) AS INT UNSIGNED)",
        "u32 >> CAST(abs(s) AS INT UNSIGNED)",
        "u16 << CAST(abs(s) AS SMALLINT UNSIGNED)",
        "u16 >> CAST(abs(s) AS SMALLINT UNSIGNED)",
        "u16 ^ u16",
        "u8 << CAST(abs(s) AS TINYINT UNSIGNED)",
        "u8 >> CAST(abs(s) AS TINYINT UNSIGNED)",
        "u8 | CAST(abs(s) AS TINYINT UNSIGNED)",
        "(u32 >> CAST(28 AS INT UNSIGNED)) = CAST(15 AS INT UNSIGNED)",
        "(i32 & 7) = 3",
        "gcd(i64 % 1000000, CAST(i32 AS BIGINT) % 3000)",
        "gcd(CAST(s AS BIGINT) * 6, 0)",
        "gcd(CAST(i16 AS BIGINT), CAST(-9223372036854775807 AS BIGINT) - 1)",
        "lcm(CAST(i16 AS BIGINT), CAST(s AS BIGINT))",
        "lcm(CAST(i8 AS BIGINT), 0)",
        "factorial(abs(CAST(s AS BIGINT)) % 21)",
        "iszero(i8)",
        "iszero(s)",
        "iszero(CAST(s AS DECIMAL(10, 2)) - 1)",
        "to_hex(i8)",
        "to_hex(i16)",
        "to_hex(i32)",
        "to_hex(i64)",
        "to_hex(CAST(s AS BIGINT))",
        "chr(CAST(s AS BIGINT) + 60)",
        "chr(CAST(i16 AS BIGINT) % 2048 + 2048)",
        "chr(abs(CAST(i16 AS BIGINT)) % 40000 + 2048)",
        "chr(CAST(i32 AS BIGINT) % 1000 + 128512)",
        "concat('[', chr(CAST(s AS BIGINT) + 100), ']')",
    ] {
        assert_evaluates_as_datafusion(&ctx, "b", text, &[(2, 11)], device).await;
    }
    // A surrogate or a negative value: DataFusion's error, raised by the host.
    for text in [
        "chr(CAST(s AS BIGINT) * 0 + 55296)",
        "chr(CAST(s AS BIGINT) - 200)",
    ] {
        assert_left_to_the_host(&ctx, "b", text, None, device).await;
    }
    for text in [
        "gcd(CAST(-9223372036854775807 AS BIGINT) - 1, CAST(s AS BIGINT) * 0)",
        "lcm(i64, 4611686018427387903)",
        "factorial(CAST(s AS BIGINT))",
    ] {
        assert_fails_as_datafusion(&ctx, "b", text, None, device).await;
    }

    let specials = [
        0.0,
        -0.0,
        1.5,
        -2.25,
        f64::NAN,
        -f64::NAN,
        f64::INFINITY,
        f64::NEG_INFINITY,
        1e300,
        -7.0,
        f64::from_bits(0x7FF0_0000_0000_0001),
    ];
    let floats = RecordBatch::try_from_iter([
        (
            "p",
            Arc::new(Float64Array::from_iter(
                (0..n).map(|i| (i % 7 != 3).then_some(specials[i as usize % 11])),
            )) as ArrayRef,
        ),
        (
            "q",
            Arc::new(Float64Array::from_iter((0..n).map(|i| {
                (i % 5 != 2).then_some(specials[(i * 4 + 1) as usize % 11])
            }))),
        ),
        (
            "r",
            Arc::new(Float64Array::from_iter(
                (0..n).map(|i| Some(specials[(i * 3 + 5) as usize % 11])),
            )),
        ),
    ])
    .unwrap();
    let ctx = session_of("f", &floats);
    for text in [
        "isnan(p)",
        "iszero(q)",
        "signum(p)",
        "nanvl(p, q)",
        "nanvl(r, 0.5)",
        "greatest(p, q)",
        "least(p, q)",
        "greatest(p, q, r)",
        "least(r, p, q, 0.0)",
        "greatest(p, -0.0)",
    ] {
        assert_evaluates_as_datafusion(&ctx, "f", text, &[(2, 11)], device).await;
    }
}

/// arrow's reinterpreting casts against DataFusion: integers and dates, integers and
/// timestamps, timestamps between units (divided truncated, multiplied checked; a zone
/// kept or dropped), and `to_timestamp*` of integers; a value past the target's range
/// is null for `TRY_CAST` and DataFusion's error for `CAST`; a local time given a zone
/// (arrow moves it to UTC) is refused.
pub async fn check_temporal_casts(device: &ExecDevice) {
    use arrow_array::{TimestampMicrosecondArray, TimestampMillisecondArray, UInt32Array};

    let n = 24i64;
    let big = |i: i64| {
        [
            0,
            1,
            -1,
            86_399,
            1_700_000_000,
            -2_000_000_000,
            3_000_000_000,
        ][i as usize % 7]
    };
    let batch = RecordBatch::try_from_iter([
        (
            "x",
            Arc::new(Int32Array::from_iter((0..n).map(|i| {
                (i % 5 != 2).then_some(big(i).clamp(-2_000_000, 2_000_000) as i32)
            }))) as ArrayRef,
        ),
        (
            "y",
            Arc::new(Int64Array::from_iter(
                (0..n).map(|i| (i % 6 != 3).then_some(big(i) % 1_000_000 * 7)),
            )),
        ),
        (
            "far",
            Arc::new(Int64Array::from_iter_values((0..n).map(big))),
        ),
        (
            "d",
            Arc::new(Date32Array::from_iter(
                (0..n).map(|i| (i % 4 != 1).then_some(i as i32 * 4_001 - 40_000)),
            )),
        ),
        (
            "ts",
            Arc::new(TimestampMillisecondArray::from_iter(
                (0..n).map(|i| (i % 7 != 5).then_some(big(i) * 1_003 - 7)),
            )),
        ),
        (
            "tsz",
            Arc::new(
                TimestampMicrosecondArray::from_iter(
                    (0..n).map(|i| (i % 7 != 5).then_some(big(i) * 999_999 + 3)),
                )
                .with_timezone("+05:00"),
            ),
        ),
        (
            "u",
            Arc::new(UInt32Array::from_iter(
                (0..n).map(|i| Some(big(i).unsigned_abs() as u32)),
            )),
        ),
    ])
    .unwrap();
    let ctx = session_of("t", &batch);
    for text in [
        "CAST(x AS DATE)",
        "CAST(y AS DATE)",
        "TRY_CAST(far AS DATE)",
        "CAST(d AS INT)",
        "CAST(d AS BIGINT)",
        "CAST(ts AS BIGINT)",
        "TRY_CAST(ts AS INT)",
        "CAST(tsz AS BIGINT)",
        "CAST(x AS TIMESTAMP)",
        "CAST(u AS TIMESTAMP)",
        "arrow_cast(ts, 'Timestamp(Second, None)')",
        "arrow_cast(ts, 'Timestamp(Nanosecond, None)')",
        "arrow_cast(tsz, 'Timestamp(Millisecond, Some(\"+05:00\"))')",
        "arrow_cast(tsz, 'Timestamp(Second, None)')",
        "to_timestamp_seconds(far)",
        "to_timestamp_millis(x)",
        "to_timestamp_micros(y)",
        "to_timestamp_nanos(u)",
        "to_timestamp(x)",
        "extract(epoch from d)",
        "date_part('epoch', ts)",
        "date_part('EPOCH', tsz)",
        "extract(epoch from to_timestamp_seconds(far))",
        "extract(epoch from arrow_cast(ts, 'Timestamp(Nanosecond, None)'))",
        "date_trunc('day', to_timestamp_seconds(far))",
        "extract(hour from to_timestamp_seconds(far))",
        "CAST(x AS DATE) + INTERVAL '1' MONTH",
    ] {
        assert_evaluates_as_datafusion(&ctx, "t", text, &[(3, 13)], device).await;
    }
    for text in [
        "CAST(far AS DATE)",
        "CAST(ts AS INT)",
        "to_timestamp(far * 10000000)",
    ] {
        assert_fails_as_datafusion(&ctx, "t", text, None, device).await;
    }
    let (e, schema, _) = projection_of(
        &ctx,
        "t",
        "arrow_cast(ts, 'Timestamp(Second, Some(\"+01:00\"))')",
    )
    .await;
    let refused = DeviceExpr::compile(&e, &schema).map(|_| ());
    assert!(
        matches!(&refused, Err(Unsupported(why)) if why.contains("a local time given a zone")),
        "{refused:?}"
    );
}

/// Strings computed inside an expression (each made a column first, then read as one)
/// against DataFusion: comparisons (of two strings too, and by order with a literal),
/// `LIKE`, `IN`, lengths, positions, regular
/// expressions and casts of computed strings, string functions of computed strings
/// (nested), and a filter's predicate of one (`select`, the frame's selection and
/// download against DataFusion's filter). A join key of a value of a computed string
/// is refused with its reason.
pub async fn check_computed_strings(device: &ExecDevice) {
    use arrow_array::StringViewArray;

    let words = [
        " ab ",
        "AB",
        "b",
        "",
        "  12 ",
        "a value longer than twelve bytes ",
        "é B",
    ];
    let n = 35;
    let batch = RecordBatch::try_from_iter([
        (
            "s",
            Arc::new(
                (0..n)
                    .map(|i| (i % 6 != 4).then_some(words[i % words.len()]))
                    .collect::<StringViewArray>(),
            ) as ArrayRef,
        ),
        (
            "u",
            Arc::new(
                (0..n)
                    .map(|i| (i % 5 != 3).then_some(words[(i * 3 + 1) % words.len()]))
                    .collect::<StringArray>(),
            ),
        ),
    ])
    .unwrap();
    let ctx = session_of("c", &batch);
    for text in [
        "upper(s) = 'AB'",
        "lower(s) LIKE '%b%'",
        "length(trim(s))",
        "character_length(upper(u))",
        "strpos(lower(s), 'b')",
        "upper(trim(s))",
        "concat(upper(s), '-', lower(u))",
        "substr(upper(s), 1, 2) = ' A'",
        "TRY_CAST(trim(s) AS INT)",
        "replace(upper(s), 'B', 'x')",
        "upper(s) IN ('AB', 'B')",
        "coalesce(upper(s), 'none')",
        "lpad(trim(s), 5, '*')",
        "regexp_like(lower(s), '^ ?a')",
        "upper(trim(lower(s))) = 'AB'",
        "concat(trim(u), upper(trim(s))) LIKE 'B%'",
    ] {
        assert_evaluates_as_datafusion(&ctx, "c", text, &[(2, 20)], device).await;
    }
    // Two strings compared (columns of each type, a computed one), and a column against
    // a literal by order: byte by byte, as arrow orders strings.
    for text in [
        "s = u",
        "s <> u",
        "s < u",
        "s <= u",
        "u > s",
        "s >= u",
        "s < 'b'",
        "'AB' <= s",
        "u > ' a'",
        "s >= 'a value longer than twelve bytes'",
        "upper(s) = upper(u)",
        "trim(s) < u",
        "s = s",
    ] {
        assert_evaluates_as_datafusion(&ctx, "c", text, &[(2, 20)], device).await;
    }
    // As a filter's predicate, alone and under a pending selection.
    for text in ["upper(s) = 'AB'", "length(trim(u)) > 1", "s < u"] {
        let (e, schema, batches) = projection_of(&ctx, "c", &format!("({text})")).await;
        let compiled = DeviceExpr::compile(&e, &schema).unwrap();
        let input = concat_batches(&schema, &batches).unwrap();
        let want = e
            .evaluate(&input)
            .unwrap()
            .into_array(input.num_rows())
            .unwrap();
        let want = want.as_any().downcast_ref::<BooleanArray>().unwrap();
        let frame = upload(&input, device);
        let selection = select(&compiled, &frame, device).unwrap();
        let filtered = frame.clone().with_selection(selection).unwrap();
        let mut transfer = Transfer::new(device.device().clone(), TransferOptions::default());
        let got = filtered.download(&mut transfer).unwrap();
        assert_eq!(got, filter_record_batch(&input, want).unwrap(), "{text}");
    }
    // A join's keys are evaluated alone: a value of a computed string is refused there.
    {
        use datafusion::physical_plan::joins::HashJoinExec;
        use devarrow_datafusion::compute::join::DeviceHashJoin;
        let ctx = SessionContext::new();
        join_tables_of(&ctx, &DataType::Utf8View);
        use datafusion::common::DFSchema;
        use datafusion::functions::expr_fn::upper;
        use datafusion::functions::unicode::expr_fn::character_length;
        use datafusion::logical_expr::{cast, col};
        let node = hash_join_of(
            &ctx,
            "select f.qty, f.code, d.k from fact f join dim d on f.fk = d.k2",
        )
        .await;
        let join = node.downcast_ref::<HashJoinExec>().unwrap();
        // `d.k2 = CAST(character_length(upper(f.code)) AS BIGINT)`, the probe key left
        // in the join (a rewrite, or another planner, may leave it there).
        let right = DFSchema::try_from(join.right().schema().as_ref().clone()).unwrap();
        let key = cast(character_length(upper(col("code"))), DataType::Int64);
        let key = ctx.create_physical_expr(key, &right).unwrap();
        let on = vec![(join.on()[0].0.clone(), key)];
        let rewritten = join.builder().with_on(on).build().unwrap();
        let refused = DeviceHashJoin::compile(&rewritten).map(|_| ());
        assert!(
            matches!(&refused, Err(Unsupported(why)) if why.contains("a computed string")),
            "{refused:?}"
        );
    }
}

/// Casts between strings and values, reinterpreting casts, unsigned integers, `CASE`
/// of strings and strings computed inside expressions, on the CPU device.
#[tokio::test]
async fn conversions_and_computed_strings_are_datafusions() {
    if own_tests() {
        let device = ExecDevice::cpu();
        check_string_casts(&device).await;
        check_temporal_casts(&device).await;
        check_unsigned(&device).await;
        check_integer_functions(&device).await;
        check_string_choices(&device).await;
        check_computed_strings(&device).await;
    }
}

#[tokio::test]
async fn random_like_patterns_are_datafusions() {
    if own_tests() {
        check_random_like(&ExecDevice::cpu()).await;
        check_ilike(&ExecDevice::cpu()).await;
        check_unicode_case(&ExecDevice::cpu()).await;
        check_random_regex(&ExecDevice::cpu()).await;
        check_word_boundaries(&ExecDevice::cpu()).await;
        check_empty_matches(&ExecDevice::cpu()).await;
    }
}

/// `concat`, `||`, `concat_ws`, `replace` and `strpos` against DataFusion: columns of each string
/// type (a `Utf8View` one with long values in several blocks), of 0 to 20 characters of
/// 1 to 4 bytes, some null; literals short, long and empty; casts between the types that
/// DataFusion's coercion puts in. Each over slices too.
pub async fn check_string_functions(device: &ExecDevice) {
    let mut next = xorshift(0xD1B5_4A32_D192_ED03);
    let alphabet = ['a', 'b', 'é', '🦀', ' '];
    let value = |next: &mut dyn FnMut(u64) -> u64| -> Option<String> {
        (next(7) != 0).then(|| {
            (0..next(21))
                .map(|_| alphabet[next(alphabet.len() as u64) as usize])
                .collect()
        })
    };
    let n = 300;
    let a: Vec<Option<String>> = (0..n).map(|_| value(&mut next)).collect();
    let b: Vec<Option<String>> = (0..n).map(|_| value(&mut next)).collect();
    let c: Vec<Option<String>> = (0..n).map(|_| value(&mut next)).collect();
    let mut views = arrow_array::builder::StringViewBuilder::new().with_fixed_block_size(64);
    for v in &b {
        views.append_option(v.as_deref());
    }
    let views = views.finish();
    assert!(views.data_buffers().len() > 1, "several blocks");
    let batch = RecordBatch::try_from_iter([
        ("a", Arc::new(StringArray::from(a)) as ArrayRef),
        ("b", Arc::new(views)),
        ("c", Arc::new(arrow_array::LargeStringArray::from(c))),
    ])
    .unwrap();
    let ctx = session_of("cc", &batch);
    for text in [
        "concat(a, '-', b)",
        "concat(b, c)",
        "concat(a, c)",
        "concat(a, a, a, a)",
        "concat(b, ' and a literal longer than twelve bytes')",
        "concat('', a)",
        // DataFusion coerces the integer to a string literal.
        "concat(a, 1)",
        "a || b",
        "a || '-'",
        "a || '-' || c",
        "b || c || a",
        "concat_ws('-', a, b, c)",
        "concat_ws('', a, b)",
        "concat_ws(' :: 🦀 :: ', b, 'x', c)",
        "concat_ws(',', c)",
        // Leftmost, not overlapping (`aaa` becomes `Xa`), none for an empty `from`;
        // results longer and shorter than the values, of each type (`Utf8View` gives
        // `Utf8`, as DataFusion types it).
        "replace(b, 'aa', 'X')",
        "replace(a, 'a', 'XY')",
        "replace(c, 'é', 'e')",
        "replace(b, '🦀', 'crab')",
        "replace(b, ' ', ' and a replacement longer than twelve bytes ')",
        "replace(a, 'ab', '')",
        "replace(c, '', 'x')",
        "replace(b, 'b', 'b')",
        // The first occurrence's position in characters, 0 for none, 1 for an empty
        // needle; `Int64` over `LargeUtf8`.
        "strpos(b, 'a')",
        "strpos(a, '🦀 ')",
        "instr(c, 'é')",
        "position('ab' IN b)",
        "strpos(b, '')",
        "strpos(a, 'a needle longer than any value')",
        "strpos(b, 'b') + strpos(c, 'a') * 100",
        // `left` of n >= 0 and `right` of n < 0 are `substr`s; the others count from
        // the end (multi-byte characters, values shorter than n, i64's least).
        "left(b, 3)",
        "left(a, 0)",
        "left(c, 14)",
        "right(b, -2)",
        "right(c, -15)",
        "left(b, -2)",
        "left(c, -1)",
        "left(a, -20)",
        "right(b, 2)",
        "right(c, 14)",
        "right(a, 0)",
        "right(b, 1)",
        "left(b, -9223372036854775807 - 1)",
        "right(c, -9223372036854775807 - 1)",
        // Characters reversed (multi-byte ones kept whole); the value n times (nothing
        // for 0 or less).
        "reverse(a)",
        "reverse(b)",
        "reverse(c)",
        "repeat(a, 3)",
        "repeat(b, 0)",
        "repeat(c, -2)",
        "repeat(b, 1)",
        "concat(reverse(a), repeat(b, 2))",
        // ASCII literals: a byte's first place in `from` maps it, past `to`'s end
        // deletes it; other bytes (multi-byte characters too) as they are.
        "translate(a, 'ab', 'xy')",
        "translate(b, 'abc ', 'x')",
        "translate(c, 'aa', 'xy')",
        "translate(b, '', 'x')",
        "translate(c, 'a', '')",
        // overlay: by characters, a start past the value, a count of 0, a negative one
        // (part of the value again), the literal's characters by default.
        "overlay(a placing 'XY' from 2)",
        "overlay(b placing '🦀' from 1 for 3)",
        "overlay(c placing '' from 3 for 1)",
        "overlay(a placing 'é' from 40)",
        "overlay(b placing '-' from 2 for 0)",
        "overlay(c placing 'Z' from 4 for -2)",
        "overlay(b placing 'Z' from 2 for -5)",
        // The first equal entry's place (0 for none, an empty entry too).
        "find_in_set(a, 'x,ab,,a,ab')",
        "find_in_set(b, 'é,abc')",
        "find_in_set(c, '')",
        // The first character's code point (0 for an empty value).
        "ascii(a)",
        "ascii(b)",
        "ascii(c) + 1",
        // lpad and rpad: the first `target` characters, or padded with the fill repeated
        // (a space by default; multi-byte fills; an empty fill pads nothing).
        "lpad(b, 10)",
        "rpad(a, 6, '-')",
        "lpad(c, 14, 'é🦀')",
        "rpad(b, 3, 'xyz')",
        "lpad(a, 0, 'x')",
        "rpad(c, 25, '')",
        "lpad(b, -3)",
        "rpad(b, 40, ' and on')",
        // Computed strings as arguments: each made a column first.
        "concat(a, upper(b))",
        "a || upper(b)",
        "replace(upper(a), 'A', 'x')",
    ] {
        assert_evaluates_as_datafusion(&ctx, "cc", text, &[(9, 150), (290, 10)], device).await;
    }
    assert_no_device_kernel(
        &ctx,
        "cc",
        &[
            "replace(a, b, 'x')",
            "btrim(a, 'é')",
            "lpad(b, length(a))",
            "repeat(a, 65)",
            "translate(a, 'é', 'e')",
            "overlay(a placing 'x' from 0)",
            "repeat(a, length(b))",
        ],
    )
    .await;
    // Views that share their bytes (a deduplicating builder: one 40-byte value in every
    // other row) pass the bound CUDA sizes a result's bytes by: there the batch is the
    // host's (`HostOnly`), and a query computes it on the host, with DataFusion's rows.
    if device.cuda().is_none() {
        return;
    }
    let mut shared = arrow_array::builder::StringViewBuilder::new().with_deduplicate_strings();
    for i in 0..400 {
        shared.append_value(match i % 2 {
            0 => "a value of forty bytes, shared by rows..",
            _ => "x",
        });
    }
    let batch = RecordBatch::try_from_iter([("s", Arc::new(shared.finish()) as ArrayRef)]).unwrap();
    let sh = session_of("sh", &batch);
    let (e, schema, _) = projection_of(&sh, "sh", "concat(s, s)").await;
    let failed = DeviceExpr::compile(&e, &schema)
        .unwrap()
        .evaluate(&upload(&batch, device), device)
        .unwrap_err();
    assert!(
        matches!(
            ComputeError::find(failed.as_ref()),
            Some(ComputeError::HostOnly(_))
        ),
        "{failed}"
    );
    let parts = vec![vec![batch.slice(0, 200)], vec![batch.slice(200, 200)]];
    let sql = "SELECT concat(s, '-', s) AS v FROM sh WHERE s <> 'y'";
    falls_back_as_datafusion(device, ("sh", parts), sql, "DeviceProjectionExec").await;
}

#[tokio::test]
async fn string_functions_are_datafusions() {
    if own_tests() {
        check_string_functions(&ExecDevice::cpu()).await;
    }
}

/// `ILIKE` against DataFusion: ASCII values of both cases (and `_`, `%`, digits), inline
/// and long, some null, random patterns of both cases with `%`, `_` and escapes, each as
/// `ILIKE` and `NOT ILIKE`; `upper`, `lower` and `initcap` of the values. The Kelvin sign,
/// which Unicode folds with `K`, matches and maps as in DataFusion.
pub async fn check_ilike(device: &ExecDevice) {
    let mut next = xorshift(0x2545_F491_4F6C_DD1D);
    let alphabet = ['a', 'B', 'k', 'K', 's', 'Z', '_', '%', '7'];
    let character =
        |next: &mut dyn FnMut(u64) -> u64| alphabet[next(alphabet.len() as u64) as usize];
    let ctx = random_strings_table("ci", &mut next, (11, 25), &character);
    for round in 0..100 {
        let len = next(7) as usize;
        let mut pattern = String::new();
        for _ in 0..len {
            match next(10) {
                0..=2 => pattern.push('%'),
                3 => pattern.push('_'),
                4 => pattern.push_str("\\_"),
                k => pattern.push(['A', 'b', 'K', 's', 'z'][(k - 5) as usize]),
            }
        }
        let not = if round % 2 == 0 { "" } else { "NOT " };
        let text = format!("(s {not}ILIKE '{pattern}')");
        assert_evaluates_as_datafusion(&ctx, "ci", &text, &[(9, 150)], device).await;
    }

    // `initcap`: a letter after a letter or digit (`7`) in lower case, after `_` or `%`
    // in upper case.
    for text in ["upper(s)", "lower(s)", "initcap(s)"] {
        assert_evaluates_as_datafusion(&ctx, "ci", text, &[(9, 150)], device).await;
    }

    // Not ASCII: the Kelvin sign, which `k` matches under ILIKE (Unicode case folding, in
    // the automaton of arrow's regular expression for the pattern), and which `lower`
    // makes `k`.
    let kelvin = RecordBatch::try_from_iter([(
        "s",
        Arc::new(arrow_array::StringViewArray::from(vec![
            "ok",
            "\u{212A}elvin",
            "KELVIN",
            "\u{212A}",
        ])) as ArrayRef,
    )])
    .unwrap();
    let kv = session_of("kv", &kelvin);
    for text in [
        "(s ILIKE 'kelvin')",
        "(s NOT ILIKE 'KELVIN')",
        "(s ILIKE '_elv%')",
        "(s ILIKE 'k')",
    ] {
        assert_evaluates_as_datafusion(&kv, "kv", text, &[(1, 2)], device).await;
    }
    for text in ["lower(s)", "upper(s)", "initcap(s)"] {
        assert_evaluates_as_datafusion(&kv, "kv", text, &[(1, 2)], device).await;
    }
}

/// `upper`, `lower` and `initcap` against DataFusion (Rust's Unicode case mappings) on
/// random values of characters whose case changes their length or their count (`ß` to
/// `SS`, `ﬁ` to `FI`, `ΐ` to three characters, `İ` to two, `ȿ` from 2 bytes to 3), title
/// cases (`ǅ`), letters and digits of other scripts (initcap's words), ASCII, spaces and
/// a 4-byte character, inline and long, some null; `Σ`, whose lower case depends on its
/// neighbours (cased, and case-ignorable: combining marks, apostrophes, modifier
/// letters).
pub async fn check_unicode_case(device: &ExecDevice) {
    let mut next = xorshift(0x5851_F42D_4C95_7F2D);
    let alphabet = [
        'a',
        'B',
        '7',
        ' ',
        'ß',
        'ﬁ',
        'ΐ',
        'İ',
        'ı',
        'ȿ',
        'ǅ',
        'ǆ',
        '\u{212A}',
        'é',
        'É',
        '🦀',
        'Ж',
        'ж',
        '٣',
        'ᾳ',
        '-',
        '\u{10400}',
        '\u{10428}',
        'Σ',
        'Σ',
        '\u{301}',
        '\'',
        'ʰ',
    ];
    let character =
        |next: &mut dyn FnMut(u64) -> u64| alphabet[next(alphabet.len() as u64) as usize];
    let ctx = random_strings_table("u", &mut next, (11, 25), &character);
    for text in ["upper(s)", "lower(s)", "initcap(s)"] {
        assert_evaluates_as_datafusion(&ctx, "u", text, &[(9, 150)], device).await;
    }
    let sigma = RecordBatch::try_from_iter([(
        "s",
        Arc::new(arrow_array::StringViewArray::from(vec![
            "ΟΔΟΣ",
            "ΣΑΣ ΣΑΣ",
            "ΑΣ' Σ\u{301}Α",
            "plain",
        ])) as ArrayRef,
    )])
    .unwrap();
    let sv = session_of("sv", &sigma);
    for text in ["upper(s)", "lower(s)", "initcap(s)"] {
        assert_evaluates_as_datafusion(&sv, "sv", text, &[(2, 1)], device).await;
    }
}

#[tokio::test]
async fn string_predicates_are_datafusions() {
    if own_tests() {
        check_string_predicates(&ExecDevice::cpu()).await;
    }
}

#[tokio::test]
async fn selections_compact_on_the_device() {
    if own_tests() {
        check_compact(&ExecDevice::cpu()).await;
    }
}

#[tokio::test]
async fn partial_aggregates_are_datafusions() {
    if own_tests() {
        check_aggregates(&ExecDevice::cpu()).await;
    }
}

#[tokio::test]
async fn empty_frames() {
    if own_tests() {
        check_empty_frames(&ExecDevice::cpu()).await;
    }
}

#[tokio::test]
async fn float_aggregates_are_datafusions() {
    if own_tests() {
        check_float_aggregates(&ExecDevice::cpu()).await;
    }
}

#[tokio::test]
async fn long_string_keys_group_on_the_device() {
    if own_tests() {
        check_long_keys(&ExecDevice::cpu()).await;
    }
}

/// A session whose device operators run on `device` (a pool of two slots), DataFusion's
/// rules followed by devarrow's placement rule, `partitions` target partitions.
fn session_on(device: &ExecDevice, partitions: usize) -> SessionContext {
    session_limited(device, partitions, None)
}

/// [`session_on`] with a memory pool of `memory_limit` bytes, if given.
fn session_limited(
    device: &ExecDevice,
    partitions: usize,
    memory_limit: Option<usize>,
) -> SessionContext {
    let pool = devarrow_datafusion::config::DevicePool::new(device.clone(), 2).unwrap();
    session_with_pool(Arc::new(pool), partitions, memory_limit)
}

/// A session whose device operators run on `pool`, DataFusion's rules followed by
/// devarrow's placement rule, `partitions` target partitions, a memory pool of
/// `memory_limit` bytes if given.
pub fn session_with_pool(
    pool: Arc<devarrow_datafusion::config::DevicePool>,
    partitions: usize,
    memory_limit: Option<usize>,
) -> SessionContext {
    session_with_pools(vec![pool], partitions, memory_limit)
}

/// [`session_with_pool`] over several devices' pools (partitions spread over them).
pub fn session_with_pools(
    pools: Vec<Arc<devarrow_datafusion::config::DevicePool>>,
    partitions: usize,
    memory_limit: Option<usize>,
) -> SessionContext {
    use devarrow_datafusion::config::{DevarrowConfig, DevicePlacement};
    use devarrow_datafusion::rule::DeviceOperatorRegistry;
    use devarrow_datafusion::DevicePlacementRule;

    let rule = DevicePlacementRule::new(DeviceOperatorRegistry::default())
        .with_placement(DevicePlacement::Pools(pools));
    let config = SessionConfig::new()
        .with_target_partitions(partitions)
        .with_option_extension(DevarrowConfig::default());
    let mut builder = datafusion::execution::session_state::SessionStateBuilder::new()
        .with_config(config)
        .with_default_features()
        .with_physical_optimizer_rule(Arc::new(rule));
    if let Some(limit) = memory_limit {
        let runtime = datafusion::execution::runtime_env::RuntimeEnvBuilder::new()
            .with_memory_limit(limit, 1.0)
            .build_arc()
            .unwrap();
        builder = builder.with_runtime_env(runtime);
    }
    SessionContext::new_with_state(builder.build())
}

/// [`session_on`] (2 partitions) with every join the device can run on the device,
/// whatever the bytes it moves: the joins of the checks' scans would otherwise go back to
/// the host (`tests/plans.rs`, `a_join_that_would_add_link_bytes_stays_on_the_host_saying_why`).
async fn every_join_session(device: &ExecDevice) -> SessionContext {
    let ctx = session_on(device, 2);
    ctx.sql("set devarrow.always_place_joins = true")
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    ctx
}

/// Filters and projections that compare with an uncorrelated scalar subquery (`x >
/// (SELECT avg(x) ...)`: DataFusion's `ScalarSubqueryExpr`, whose value is known only
/// when the plan runs) run on the device, the value read when each batch is evaluated:
/// integers, decimals (an `avg` of more precision), floats, a null value (a subquery of
/// no row), with DataFusion's results.
pub async fn check_scalar_subqueries(device: &ExecDevice) {
    let ctx = every_join_session(device).await;
    let plain = SessionContext::new_with_config(SessionConfig::new().with_target_partitions(2));
    join_tables(&ctx);
    join_tables(&plain);
    for sql in [
        "select f.fk, f.qty from fact f where f.fk2 = (select max(k2) from dim)",
        "select d.k, d.price from dim d where d.price > (select avg(price) from dim)",
        "select f.fk, f.qty from fact f where f.qty > (select avg(qty) from fact) \
         and f.fk2 <> 1",
        "select f.fk from fact f where f.qty > (select max(qty) from fact where qty > 1000)",
        "select f.fk, f.qty - (select min(qty) from fact where fk2 = 3) as above from fact f \
         where f.qty > 3",
    ] {
        let (plan, shown) = planned(&ctx, sql).await;
        // The subquery's value in a device operator's expression.
        assert!(
            shown
                .lines()
                .any(|l| l.contains("Device") && l.contains("scalar_subquery")),
            "{sql}\n{shown}"
        );
        let got = collect(plan, ctx.task_ctx())
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}\n{shown}"));
        let want = plain.sql(sql).await.unwrap().collect().await.unwrap();
        assert_eq!(lines(&got), lines(&want), "{sql}\n{shown}");
    }
}

/// A filter or projection whose expression overflows the device's 64-bit lanes where
/// DataFusion's 128-bit decimals do not (a cast to 18 decimal places; TPC-H Q11's
/// `CAST(sum(...) AS Decimal128(38, 15)) > scalar_subquery`) computes those batches on
/// the host, counted in `host_fallback_batches`, with DataFusion's results: the query
/// does not fail.
pub async fn check_overflow_fallback(device: &ExecDevice) {
    let ctx = every_join_session(device).await;
    let plain = SessionContext::new_with_config(SessionConfig::new().with_target_partitions(2));
    join_tables(&ctx);
    join_tables(&plain);
    // A division by zero: the host computes the batch, and DataFusion raises its own
    // error, as DataFusion alone does.
    let sql = "select f.fk from fact f where 100 / (f.qty - 5) > 3";
    let (plan, shown) = planned(&ctx, sql).await;
    assert!(shown.contains("DeviceFilterExec"), "{sql}\n{shown}");
    let got = collect(plan, ctx.task_ctx()).await.unwrap_err().to_string();
    let want = plain
        .sql(sql)
        .await
        .unwrap()
        .collect()
        .await
        .unwrap_err()
        .to_string();
    assert!(
        got.contains("Divide by zero") && want.contains("Divide by zero"),
        "{got}\n{want}"
    );
    for (sql, node) in [
        (
            "select f.fk, f.qty from fact f where cast(f.qty as decimal(38, 18)) > 3.5 \
             and f.fk2 <> 1",
            "DeviceFilterExec",
        ),
        (
            "select f.fk, sum(f.qty / (f.fk2 - 2)) as s from fact f where f.fk2 <> 2 \
             group by f.fk",
            "DevicePartialAggregateExec",
        ),
        (
            "select f.fk, cast(f.qty as decimal(38, 18)) + 1 as wide from fact f \
             where f.qty > 3",
            "DeviceProjectionExec",
        ),
    ] {
        let (plan, shown) = planned(&ctx, sql).await;
        assert!(shown.contains(node), "{sql}\n{shown}");
        let got = collect(plan.clone(), ctx.task_ctx())
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}\n{shown}"));
        let want = plain.sql(sql).await.unwrap().collect().await.unwrap();
        assert_eq!(lines(&got), lines(&want), "{sql}\n{shown}");
        let fallbacks = host_fallbacks(&plan, node);
        assert!(fallbacks > 0, "{sql}: no batch fell back to the host");
    }
}

/// The batches the `node`s of `plan` computed on the host (`host_fallback_batches`).
fn host_fallbacks(plan: &Arc<dyn ExecutionPlan>, node: &str) -> usize {
    let mut fallbacks = 0;
    let mut stack = vec![plan.clone()];
    while let Some(n) = stack.pop() {
        if n.name() == node {
            fallbacks += n
                .metrics()
                .and_then(|m| m.sum_by_name("host_fallback_batches"))
                .map_or(0, |v| v.as_usize());
        }
        stack.extend(n.children().into_iter().cloned());
    }
    fallbacks
}

#[tokio::test]
async fn overflowing_batches_are_computed_on_the_host() {
    if own_tests() {
        check_overflow_fallback(&ExecDevice::cpu()).await;
    }
}

#[tokio::test]
async fn scalar_subqueries_are_datafusions() {
    if own_tests() {
        check_scalar_subqueries(&ExecDevice::cpu()).await;
    }
}

/// `sql`'s physical plan in `ctx`, and its indented text.
pub async fn planned(ctx: &SessionContext, sql: &str) -> (Arc<dyn ExecutionPlan>, String) {
    let plan = ctx
        .sql(sql)
        .await
        .unwrap()
        .create_physical_plan()
        .await
        .unwrap();
    let shown = datafusion::physical_plan::displayable(plan.as_ref())
        .indent(true)
        .to_string();
    (plan, shown)
}

/// `batch` with its `Utf8View` columns cast to `strings`.
fn strings_as(batch: RecordBatch, strings: &DataType) -> RecordBatch {
    let fields: Vec<Field> = batch
        .schema()
        .fields()
        .iter()
        .map(|f| match f.data_type() {
            DataType::Utf8View => f.as_ref().clone().with_data_type(strings.clone()),
            _ => f.as_ref().clone(),
        })
        .collect();
    let columns = batch
        .columns()
        .iter()
        .zip(&fields)
        .map(|(c, f)| datafusion::arrow::compute::cast(c, f.data_type()).unwrap())
        .collect();
    RecordBatch::try_new(Arc::new(Schema::new(fields)), columns).unwrap()
}

/// The tables of the join checks: `dim` (the small side: unique keys `k` and `k2`, one
/// null `k`; short and long strings, booleans, decimals and dates, with nulls), `dup`
/// (keys that repeat) and `fact` (the large side, two partitions of two batches: keys
/// that match, that do not, and nulls).
fn join_tables(ctx: &SessionContext) {
    join_tables_of(ctx, &DataType::Utf8View);
}

/// [`join_tables`] with their string columns of type `strings` (`Utf8View`, `Utf8` or
/// `LargeUtf8`).
fn join_tables_of(ctx: &SessionContext, strings: &DataType) {
    use arrow_array::StringViewArray;
    let dim_schema = Arc::new(Schema::new(vec![
        Field::new("k", DataType::Int32, true),
        Field::new("k2", DataType::Int64, false),
        Field::new("name", DataType::Utf8View, true),
        Field::new("flag", DataType::Boolean, true),
        Field::new("price", DataType::Decimal128(15, 2), false),
        Field::new("day", DataType::Date32, true),
    ]));
    let n = 40;
    let dim = RecordBatch::try_new(
        dim_schema.clone(),
        vec![
            Arc::new(Int32Array::from_iter(
                (0..n).map(|i| (i != 7).then_some(i * 3)),
            )) as ArrayRef,
            Arc::new(Int64Array::from_iter_values(
                (0..n).map(|i| i64::from(i % 4)),
            )),
            Arc::new(StringViewArray::from_iter((0..n).map(|i| {
                (i % 9 != 4).then(|| {
                    if i % 2 == 0 {
                        format!("d{i}")
                    } else {
                        format!("a dimension value longer than twelve bytes, {i}")
                    }
                })
            }))),
            Arc::new(BooleanArray::from_iter(
                (0..n).map(|i| (i % 5 != 1).then_some(i % 3 == 0)),
            )),
            Arc::new(
                Decimal128Array::from_iter_values((0..n).map(|i| i128::from(i) * 125 - 900))
                    .with_precision_and_scale(15, 2)
                    .unwrap(),
            ),
            Arc::new(Date32Array::from_iter(
                (0..n).map(|i| (i % 6 != 2).then_some(9000 + i)),
            )),
        ],
    )
    .unwrap();
    let dup = RecordBatch::try_new(
        Arc::new(Schema::new(vec![
            Field::new("dk", DataType::Int32, false),
            Field::new("tag", DataType::Int64, false),
        ])),
        vec![
            Arc::new(Int32Array::from_iter_values((0..12).map(|i| (i % 4) * 3))) as ArrayRef,
            Arc::new(Int64Array::from_iter_values(0..12)),
        ],
    )
    .unwrap();
    let fact_schema = Arc::new(Schema::new(vec![
        Field::new("fk", DataType::Int32, true),
        Field::new("fk2", DataType::Int64, false),
        Field::new("qty", DataType::Int64, false),
        Field::new("note", DataType::Utf8View, false),
        // Join keys of dim's `price` and `name`: decimals and strings (short, long, some
        // matching nothing, some null).
        Field::new("cost", DataType::Decimal128(15, 2), true),
        Field::new("code", DataType::Utf8View, true),
    ]));
    let fact = |part: i32, batch: i32| {
        let rows = 700;
        let base = (part * 2 + batch) * rows;
        RecordBatch::try_new(
            fact_schema.clone(),
            vec![
                Arc::new(Int32Array::from_iter(
                    (base..base + rows).map(|r| (r % 11 != 3).then_some((r * 7) % 150)),
                )) as ArrayRef,
                Arc::new(Int64Array::from_iter_values(
                    (base..base + rows).map(|r| i64::from(r % 5)),
                )),
                Arc::new(Int64Array::from_iter_values(
                    (base..base + rows).map(|r| i64::from(r % 13)),
                )),
                Arc::new(StringViewArray::from_iter_values((base..base + rows).map(
                    |r| {
                        if r % 3 == 0 {
                            format!("a fact note longer than twelve bytes {r}")
                        } else {
                            format!("f{r}")
                        }
                    },
                ))),
                Arc::new(
                    Decimal128Array::from_iter(
                        (base..base + rows)
                            .map(|r| (r % 17 != 5).then(|| i128::from((r * 11) % 60) * 125 - 900)),
                    )
                    .with_precision_and_scale(15, 2)
                    .unwrap(),
                ),
                Arc::new(StringViewArray::from_iter((base..base + rows).map(|r| {
                    let i = (r * 13) % 50;
                    match r % 7 {
                        6 => None,
                        // A long value of another length or prefix, or of dim's length
                        // and prefix but other bytes.
                        5 => Some(format!(
                            "a dimension value longer than twelve bytes, {}",
                            i + 100
                        )),
                        4 => Some(format!("a dimension value longer than twelve bytes; {i}")),
                        _ if i % 2 == 0 => Some(format!("d{i}")),
                        _ => Some(format!("a dimension value longer than twelve bytes, {i}")),
                    }
                }))),
            ],
        )
        .unwrap()
    };
    let typed = |batch: RecordBatch| strings_as(batch, strings);
    let register = |name: &str, parts: Vec<Vec<RecordBatch>>| {
        let parts: Vec<Vec<RecordBatch>> = parts
            .into_iter()
            .map(|p| p.into_iter().map(typed).collect())
            .collect();
        let table = MemTable::try_new(parts[0][0].schema(), parts).unwrap();
        ctx.register_table(name, Arc::new(table)).unwrap();
    };
    register("dim", vec![vec![dim]]);
    register("dup", vec![vec![dup]]);
    register(
        "fact",
        vec![vec![fact(0, 0), fact(0, 1)], vec![fact(1, 0), fact(1, 1)]],
    );
}

/// Device hash joins against DataFusion's own: inner joins on one and two keys (build
/// columns of every gathered kind: integers, decimals, dates, booleans, short and long
/// strings, with nulls), after a filter (a pending selection), under a partial
/// aggregate, with join filters over both sides, semi and anti joins (null keys), build
/// keys that repeat (one row per matching pair), an empty build side; each plan has its
/// `DeviceHashJoinExec`.
pub async fn check_joins(device: &ExecDevice) {
    check_join_cases(device, &DataType::Utf8View, &["CollectLeft", "Partitioned"]).await;
}

/// [`check_joins`]' cases over string columns of `Utf8` (build side collected) and
/// `LargeUtf8` (partitioned): keys read through views made of their offsets on the
/// device, build and probe columns gathered by their offsets (`gather_lengths`, a scan,
/// `gather_strings`), `LIKE` and `=` over them.
pub async fn check_offset_string_joins(device: &ExecDevice) {
    check_join_cases(device, &DataType::Utf8, &["CollectLeft"]).await;
    check_join_cases(device, &DataType::LargeUtf8, &["Partitioned"]).await;
}

/// [`check_joins`]' cases over [`join_tables_of`] `strings`, in each of `modes`.
async fn check_join_cases(device: &ExecDevice, strings: &DataType, modes: &[&str]) {
    let ctx = every_join_session(device).await;
    let plain = SessionContext::new_with_config(SessionConfig::new().with_target_partitions(2));
    join_tables_of(&ctx, strings);
    join_tables_of(&plain, strings);
    // The joins with `dup` and with the union repeat build keys: one output row per
    // matching pair.
    let cases: [&str; 68] = [
        // Unsigned keys (zero-extended lanes).
        "select f.qty, d.name from fact f join dim d \
         on arrow_cast(abs(f.fk) % 60000, 'UInt16') = arrow_cast(abs(d.k) % 60000, 'UInt16')",
        "select d.k, d.name from dim d where exists (select 1 from fact f \
         where arrow_cast(abs(f.fk2), 'UInt32') = arrow_cast(abs(d.k2), 'UInt32'))",
        // Timestamp keys (i64 lanes; made by a host projection below the join).
        "select f.qty, d.name from fact f join dim d \
         on to_timestamp_seconds(f.fk) = to_timestamp_seconds(d.k)",
        "select d.k, d.name from dim d where not exists \
         (select 1 from fact f where to_timestamp_millis(f.fk2) = to_timestamp_millis(d.k2))",
        // Both frames of an outer join with a filter on through a partial aggregate.
        "select count(*) as n, count(d.k) as matched, sum(f.qty) as q from dim d \
         full join fact f on f.fk = d.k and f.qty > d.k2",
        "select d.name, count(*) as n, sum(f.qty) as q from fact f left join dim d \
         on f.fk = d.k and d.k2 < f.fk2 group by d.name",
        // Right and full joins with a filter: the pairs that pass it, then (a frame of
        // their own) the probe rows with none, build columns null; unique and repeated
        // build keys. And a mark join's filter.
        "select f.qty, f.fk2, d.name, d.k2 from fact f left join dim d \
         on f.fk = d.k and d.k2 < f.fk2",
        "select f.qty, u.tag from fact f left join dup u on f.fk = u.dk and u.tag > f.qty",
        "select d.k, d.name, f.qty from dim d full join fact f on f.fk = d.k \
         and f.qty > d.k2 * 3",
        "select u.tag, f.qty, f.note from dup u full join fact f on f.fk = u.dk \
         and u.tag < f.qty",
        "select f.fk, f.qty from fact f where f.qty > 8 or exists \
         (select 1 from dim d where d.k = f.fk and d.k2 < f.fk2)",
        // String keys: short values (their lanes are their views), long ones (a hash,
        // then their bytes compared), nulls, long values of dim's length and prefix.
        "select f.qty, f.code, d.k, d.name from fact f join dim d on f.code = d.name",
        "select f.fk, f.code from fact f where not exists \
         (select 1 from dim d where d.name = f.code)",
        "select d.k, d.name from dim d where exists \
         (select 1 from fact f where f.code = d.name and f.qty > 4)",
        "select f.qty, d.k from fact f left join dim d on f.code = d.name and f.cost = d.price",
        "select d.name, count(f.qty) as n from dim d full join fact f on f.code = d.name \
         group by d.name",
        "select f.qty, d.k from fact f join \
         (select * from dim union all select * from dim where k2 = 1) d on f.code = d.name",
        // String keys computed on the probe side: DataFusion computes them in a
        // projection below the join, which runs on the device (`substr`), in the join's
        // region where the build side is collected.
        "select f.qty, f.code, d.k from fact f join dim d on substr(f.code, 1, 46) = d.name",
        "select f.qty, d.k, d.name from fact f join dim d \
         on substr(f.code, 1, 2) = substr(d.name, 1, 2) and f.fk = d.k",
        "select f.fk, f.code from fact f where not exists \
         (select 1 from dim d where d.name = substr(f.code, 1, 46))",
        // Decimal keys (their unscaled values: TPC-H Q2's `ps_supplycost`).
        "select f.qty, f.cost, d.name, d.k from fact f join dim d on f.cost = d.price",
        "select f.fk, f.qty from fact f where not exists \
         (select 1 from dim d where d.price = f.cost and d.k2 = f.fk2)",
        "select d.k, d.price from dim d where exists \
         (select 1 from fact f where f.cost = d.price and f.qty > 10)",
        "select f.qty, d.name from fact f left join dim d on f.cost = d.price and f.fk = d.k",
        // `EXISTS` under `OR`: mark joins.
        "select d.k, d.name from dim d where d.k2 = 1 or exists \
         (select 1 from fact f where f.fk = d.k)",
        "select f.fk, f.qty from fact f where f.qty > 8 or exists \
         (select 1 from dim d where d.k = f.fk and d.k2 = 2)",
        // Semi and anti joins of the larger side, with a filter over both sides: right
        // semi and anti joins, unique and repeated build keys.
        "select f.fk, f.qty from fact f where exists \
         (select 1 from dim d where d.k = f.fk and d.k2 < f.qty)",
        "select f.fk, f.note from fact f where not exists \
         (select 1 from dim d where d.k = f.fk and d.k2 * 3 > f.qty)",
        "select f.fk, f.qty from fact f where exists \
         (select 1 from dup u where u.dk = f.fk and u.tag > f.qty)",
        "select f.fk, f.qty from fact f where f.fk2 <> 3 and not exists \
         (select 1 from dup u where u.dk = f.fk and u.tag % 3 = f.fk2)",
        // Full joins: a right join's rows, then the build rows nothing matched.
        "select d.k, d.name, f.qty, f.note from dim d full join fact f on f.fk = d.k",
        "select u.tag, f.qty from dup u full join fact f on f.fk = u.dk",
        "select count(*) as n, count(d.k) as matched, sum(f.qty) as q from dim d \
         full join fact f on f.fk = d.k and f.fk2 = d.k2",
        // The same with a filter over both sides: only the pairs that pass it match.
        "select d.k, d.name from dim d where exists \
         (select 1 from fact f where f.fk = d.k and f.qty > d.k2 * 2)",
        "select d.k, d.flag from dim d where not exists \
         (select 1 from fact f where f.fk = d.k and f.fk2 <> d.k2)",
        "select u.dk, u.tag from dup u where exists \
         (select 1 from fact f where f.fk = u.dk and f.qty > u.tag)",
        "select u.tag from dup u where not exists \
         (select 1 from fact f where f.fk = u.dk and f.qty + u.tag > 9)",
        "select u.tag, f.qty from dup u left join fact f on f.fk = u.dk and f.qty > u.tag",
        "select d.name, f.qty, f.note from dim d left join fact f \
         on f.fk = d.k and f.qty < d.k2 + 4",
        // The smaller side's rows that some (or no) fact row matches, and a left join
        // of the smaller side: left semi, anti and outer joins, whose output is build
        // rows emitted when the probe side has ended.
        "select d.k, d.name, d.price, d.flag from dim d where exists \
         (select 1 from fact f where f.fk = d.k)",
        "select d.k, d.day from dim d where not exists \
         (select 1 from fact f where f.fk = d.k and f.qty > 3)",
        "select u.dk, u.tag from dup u where exists \
         (select 1 from fact f where f.fk = u.dk and f.qty < 3)",
        "select count(*) as n from dup u where not exists \
         (select 1 from fact f where f.fk = u.dk and f.fk2 = 1)",
        "select d.name, d.day, f.qty, f.note from dim d left join fact f on f.fk = d.k",
        "select u.tag, f.qty, f.note from dup u left join fact f on f.fk = u.dk \
         and f.fk2 = u.tag % 3",
        "select d.name, count(f.qty) as n, sum(f.qty) as q from dim d \
         left join fact f on f.fk = d.k and f.fk2 = d.k2 group by d.name",
        "select d.k, d.price from dim d where d.k2 < 3 and exists \
         (select 1 from fact f where f.fk = d.k and f.qty > 6)",
        // Left joins of fact to the smaller side: DataFusion makes them right joins
        // whose build side is that side.
        "select f.qty, f.note, d.name, d.flag, d.price, d.day from fact f \
         left join dim d on f.fk = d.k",
        "select f.qty, d.name from fact f left join dim d on f.fk = d.k where f.qty > 6",
        "select f.qty, u.tag from fact f left join dup u on f.fk = u.dk where f.qty < 4",
        "select f.qty, d.name from fact f left join (select * from dim where k > 1000) d \
         on f.fk = d.k",
        "select count(d.name) as named, count(*) as n, sum(f.qty) as q from fact f \
         left join dim d on f.fk = d.k and f.fk2 = d.k2",
        "select f.qty, f.note, d.k, d.name, d.flag, d.price, d.day from fact f \
          join dim d on f.fk = d.k",
        "select f.qty, d.name, d.price from fact f join dim d on f.fk = d.k \
          where f.qty > 6 and d.k2 <> 1",
        "select f.qty, d.name from fact f join dim d on f.fk = d.k and f.fk2 = d.k2",
        "select d.name, sum(f.qty) as total, count(*) as n from fact f \
             join dim d on f.fk = d.k group by d.name",
        "select f.fk, f.note from fact f where exists \
             (select 1 from dim d where d.k = f.fk and d.k2 < 3)",
        "select f.fk, f.qty from fact f where not exists \
             (select 1 from dim d where d.k = f.fk)",
        "select f.fk, f.qty from fact f where f.qty < 5 and not exists \
             (select 1 from dim d where d.k = f.fk)",
        "select f.qty, u.tag from fact f join dup u on f.fk = u.dk",
        "select f.qty, d.name, d.k2 from fact f join dim d \
         on f.fk = d.k and f.qty > d.k2 * 3",
        "select f.qty, f.note, d.name from fact f join dim d on f.fk = d.k \
         and (d.name = 'd4' or f.note like 'a fact%' or d.flag) where f.fk2 <> 2",
        "select f.qty, u.tag from fact f join dup u on f.fk = u.dk and u.tag < f.qty",
        "select f.qty, f.note, f.fk, u.tag from fact f join dup u on f.fk = u.dk \
          where f.qty > 4",
        "select u.tag, count(*) as n, sum(f.qty) as total from fact f \
             join dup u on f.fk = u.dk group by u.tag",
        "select d.name, d.flag, d.price, f.note from fact f \
             join (select * from dim union all select * from dim where k2 = 1) d \
             on f.fk = d.k",
        "select f.qty, d.name from fact f join (select * from dim where k > 1000) d \
             on f.fk = d.k",
        "select f.fk, f.qty from fact f where not exists \
             (select 1 from dim d where d.k = f.fk and d.k > 1000)",
    ];
    // Each case with the build side collected (shared by the probe partitions), then
    // partitioned by the keys (each partition its own).
    for &mode in modes {
        if mode == "Partitioned" {
            for set in [
                "set datafusion.optimizer.hash_join_single_partition_threshold = 0",
                "set datafusion.optimizer.hash_join_single_partition_threshold_rows = 0",
            ] {
                ctx.sql(set).await.unwrap().collect().await.unwrap();
            }
        }
        for sql in cases {
            let (plan, shown) = planned(&ctx, sql).await;
            assert!(
                shown.contains("DeviceHashJoinExec") && shown.contains(&format!("mode={mode}")),
                "{sql}\n{shown}"
            );
            if sql.contains("substr(f.code") {
                assert!(
                    shown
                        .lines()
                        .any(|l| l.contains("DeviceProjectionExec") && l.contains("substr(code")),
                    "{sql}\n{shown}"
                );
            }
            let got = collect(plan.clone(), ctx.task_ctx())
                .await
                .unwrap_or_else(|e| panic!("{sql}: {e}\n{shown}"));
            let want = plain.sql(sql).await.unwrap().collect().await.unwrap();
            assert_eq!(
                lines(&got),
                lines(&want),
                "{mode}, {strings}: {sql}\n{shown}"
            );
        }
    }
}

#[tokio::test]
async fn joins_are_datafusions() {
    if own_tests() {
        check_joins(&ExecDevice::cpu()).await;
    }
}

#[tokio::test]
async fn joins_over_offset_strings_are_datafusions() {
    if own_tests() {
        check_offset_string_joins(&ExecDevice::cpu()).await;
        check_computed_string_keys(&ExecDevice::cpu()).await;
    }
}

/// The partitions of a query whose device join collects its build side, run one after
/// another (each to its end before the next starts, as a scheduler with one slot runs
/// them): they share one build side (read and hashed once), and a left semi, anti or
/// outer join emits its build rows once, when the last of them ends.
pub async fn check_partitions_one_after_another(device: &ExecDevice) {
    let ctx = every_join_session(device).await;
    // The joins as written: `dim` the build side, `fact` (two partitions) the probe side.
    ctx.sql("set datafusion.optimizer.join_reordering = false")
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    let plain = SessionContext::new_with_config(SessionConfig::new().with_target_partitions(2));
    join_tables(&ctx);
    join_tables(&plain);
    for sql in [
        "select d.k, d.name from dim d where exists (select 1 from fact f where f.fk = d.k)",
        "select d.k from dim d where not exists (select 1 from fact f where f.fk = d.k)",
        "select d.name, f.qty from dim d left join fact f on f.fk = d.k",
        "select f.qty, d.name from dim d join fact f on f.fk = d.k",
        // `EXISTS` under `OR` over the larger side: left mark joins (every build row,
        // with whether a probe row of any partition matched it), keys unique or not.
        "select d.k, d.name from dim d where d.k2 = 1 or exists \
         (select 1 from fact f where f.fk = d.k)",
        "select d.k, d.price from dim d where d.k2 = 2 or exists \
         (select 1 from fact f where f.cost = d.price)",
        "select d.k, d.name from dim d where d.k2 = 3 or exists \
         (select 1 from fact f where f.code = d.name)",
        "select d.k, d.name from dim d where d.k2 = 1 or exists \
         (select 1 from fact f where f.fk = d.k and f.qty > d.k2 * 4)",
        "select u.dk, u.tag from dup u where u.tag > 9 or exists \
         (select 1 from fact f where f.fk = u.dk and f.qty > 11)",
    ] {
        let (plan, shown) = planned(&ctx, sql).await;
        assert!(shown.contains("mode=CollectLeft"), "{sql}\n{shown}");
        assert!(
            !sql.contains(" or exists") || shown.contains("join_type=LeftMark"),
            "{sql}\n{shown}"
        );
        let partitions = plan.properties().partitioning.partition_count();
        assert!(partitions > 1, "{sql}\n{shown}");
        let task = ctx.task_ctx();
        let mut got = Vec::new();
        for partition in 0..partitions {
            let stream = plan.execute(partition, task.clone()).unwrap();
            got.extend(
                datafusion::physical_plan::common::collect(stream)
                    .await
                    .unwrap_or_else(|e| panic!("{sql}: {e}\n{shown}")),
            );
        }
        let want = plain.sql(sql).await.unwrap().collect().await.unwrap();
        assert_eq!(lines(&got), lines(&want), "{sql}\n{shown}");
        // One host table built, and one upload of it (the partitions ran on one device):
        // counted by partitions of the join, the metrics that are not 0.
        let counted = |name: &str| join_metrics(&plan, name).filter(|&v| v > 0).count();
        assert_eq!(counted("host_tables_built"), 1, "{sql}\n{shown}");
        assert_eq!(counted("bytes_to_device"), 1, "{sql}\n{shown}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitions_one_after_another_share_a_collected_build_side() {
    if own_tests() {
        check_partitions_one_after_another(&ExecDevice::cpu()).await;
    }
}

/// A join that collects its build side uploads its table once per device and query,
/// however many of the query's partitions probe it there: the join's `bytes_to_device`
/// is counted by one partition per device that ran partitions (the same bytes each), and
/// its host table is built once.
pub async fn check_one_table_per_device(pools: Vec<Arc<devarrow_datafusion::config::DevicePool>>) {
    use datafusion::physical_plan::metrics::MetricValue;

    let ctx = session_with_pools(pools.clone(), 4, None);
    for set in [
        "set devarrow.always_place_joins = true",
        "set datafusion.optimizer.join_reordering = false",
    ] {
        ctx.sql(set).await.unwrap().collect().await.unwrap();
    }
    let plain = SessionContext::new_with_config(SessionConfig::new().with_target_partitions(4));
    join_tables(&ctx);
    join_tables(&plain);
    // Four probe partitions (fact's two, twice).
    let sql = "select f.qty, d.name, d.price from dim d join \
               (select * from fact union all select * from fact) f on f.fk = d.k";
    let (plan, shown) = planned(&ctx, sql).await;
    assert!(shown.contains("mode=CollectLeft"), "{shown}");
    assert_eq!(
        plan.properties().partitioning.partition_count(),
        4,
        "{shown}"
    );
    let placed_before: Vec<u64> = pools.iter().map(|p| p.placed()).collect();
    let got = collect(plan.clone(), ctx.task_ctx()).await.unwrap();
    let want = plain.sql(sql).await.unwrap().collect().await.unwrap();
    assert_eq!(lines(&got), lines(&want), "{shown}");
    let devices_used = pools
        .iter()
        .zip(&placed_before)
        .filter(|(p, &before)| p.placed() > before)
        .count();
    let mut join = None;
    let mut stack = vec![plan.clone()];
    while let Some(node) = stack.pop() {
        if node.name() == "DeviceHashJoinExec" {
            join = Some(node.clone());
        }
        stack.extend(node.children().into_iter().cloned());
    }
    let metrics = join.expect("a device join").metrics().unwrap();
    let uploads: Vec<usize> = metrics
        .iter()
        .filter_map(|m| match m.value() {
            MetricValue::Count { name, count }
                if name == "bytes_to_device" && count.value() > 0 =>
            {
                Some(count.value())
            }
            _ => None,
        })
        .collect();
    assert_eq!(uploads.len(), devices_used, "{uploads:?}\n{shown}");
    assert!(uploads.windows(2).all(|w| w[0] == w[1]), "{uploads:?}");
    assert!(
        metrics
            .iter()
            .filter(|m| m.value().name() == "bytes_to_device")
            .count()
            > uploads.len(),
        "as many partitions as uploads: nothing shared\n{shown}"
    );
    assert_eq!(
        metrics
            .sum_by_name("host_tables_built")
            .map_or(0, |v| v.as_usize()),
        1,
        "{shown}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_collected_build_side_is_one_table_per_device() {
    if own_tests() {
        let pool = devarrow_datafusion::config::DevicePool::new(ExecDevice::cpu(), 2).unwrap();
        check_one_table_per_device(vec![Arc::new(pool)]).await;
    }
}

/// A join's table is reserved in the partition's `MemoryPool`: refused, the query fails
/// with `DeviceExecError::Memory` and the device gets back every byte.
pub async fn check_join_reservation(device: &ExecDevice, in_use: impl Fn() -> usize) {
    use devarrow_datafusion::DeviceExecError;

    let before = in_use();
    let ctx = session_limited(device, 1, Some(600 << 10));
    let rows = 40_000;
    let big = int64_batch([
        ("k", (0..rows).map(Some).collect()),
        ("v", (0..rows).map(|i| Some(i * 2)).collect()),
    ]);
    let small = RecordBatch::try_new(
        Arc::new(Schema::new(vec![Field::new("fk", DataType::Int64, false)])),
        vec![Arc::new(Int64Array::from_iter_values(0..10)) as ArrayRef],
    )
    .unwrap();
    for (name, batch) in [("big", big), ("small", small)] {
        let table = MemTable::try_new(batch.schema(), vec![vec![batch]]).unwrap();
        ctx.register_table(name, Arc::new(table)).unwrap();
    }
    // The build side must be the big table for its table to be refused (the small one
    // the probe side, in the region): DataFusion keeps the join's sides as written.
    for set in [
        "set datafusion.optimizer.join_reordering = false",
        "set devarrow.always_place_joins = true",
    ] {
        ctx.sql(set).await.unwrap().collect().await.unwrap();
    }
    let sql = "select s.fk, b.v from big b join small s on s.fk = b.k";
    let (plan, shown) = planned(&ctx, sql).await;
    assert!(shown.contains("DeviceHashJoinExec"), "{shown}");
    let error = collect(plan, ctx.task_ctx()).await.unwrap_err();
    assert!(
        matches!(
            DeviceExecError::find(&error),
            Some(DeviceExecError::Memory { .. })
        ),
        "{error}\n{shown}"
    );
    memory_returns(in_use, before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_join_table_is_a_typed_error_and_leaks_nothing() {
    if own_tests() {
        let (device, in_use) = counted_cpu();
        check_join_reservation(&device, in_use).await;
    }
}

/// A CPU device, and its bytes in use.
fn counted_cpu() -> (ExecDevice, impl Fn() -> usize) {
    let cpu = Arc::new(devarrow::abi::device::CpuDevice::new());
    let device = ExecDevice::from_cpu(cpu.clone());
    (device, move || cpu.memory_pool_stats().in_use_bytes)
}

/// Waits up to 10 s for `in_use()` (the device's bytes in use) to come back to `before`,
/// then checks that it did.
fn memory_returns(in_use: impl Fn() -> usize, before: usize) {
    let start = std::time::Instant::now();
    while in_use() != before && start.elapsed() < std::time::Duration::from_secs(10) {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert_eq!(in_use(), before, "device memory left behind");
}

/// Random joins against DataFusion's: tables of random sizes (empty ones among them),
/// keys drawn from small ranges (so they repeat on both sides, or not at all) with
/// nulls, one or two keys, several batches, payloads of every gathered kind (long and
/// short strings in several view blocks, booleans, decimals, with nulls), inner, semi and
/// anti joins, with and without a filter before the join and a join filter; every join
/// on the device.
pub async fn check_random_joins(device: &ExecDevice) {
    use arrow_array::builder::StringViewBuilder;

    let mut next = xorshift(0x2545_F491_4F6C_DD1D);
    for round in 0..24 {
        let ctx = every_join_session(device).await;
        let plain = SessionContext::new_with_config(SessionConfig::new().with_target_partitions(2));
        let key_range = 1 + next(40) as i32;
        let unique = round % 3 == 0;
        // The build side's rows (a key per row when `unique`), in one or two batches.
        let build_rows = if round % 7 == 3 { 0 } else { next(120) as i32 };
        let batch = |rows: i32, first: i32, nullable: bool, next: &mut dyn FnMut(u64) -> u64| {
            let mut names = StringViewBuilder::new().with_fixed_block_size(64);
            for r in 0..rows {
                match next(9) {
                    0 if nullable => names.append_null(),
                    1..=3 => names.append_value(format!("a value longer than twelve {r}")),
                    _ => names.append_value(format!("v{}", r % 7)),
                }
            }
            let keys: Vec<Option<i32>> = (0..rows)
                .map(|r| {
                    if nullable && next(11) == 0 {
                        None
                    } else if unique {
                        Some(first + r)
                    } else {
                        Some(next(key_range as u64) as i32)
                    }
                })
                .collect();
            RecordBatch::try_new(
                Arc::new(Schema::new(vec![
                    Field::new("k", DataType::Int32, true),
                    Field::new("k2", DataType::Int64, false),
                    Field::new("name", DataType::Utf8View, true),
                    Field::new("flag", DataType::Boolean, true),
                    Field::new("price", DataType::Decimal128(12, 2), true),
                ])),
                vec![
                    Arc::new(Int32Array::from(keys)) as ArrayRef,
                    Arc::new(Int64Array::from_iter_values(
                        (0..rows).map(|_| next(3) as i64),
                    )),
                    Arc::new(names.finish()),
                    Arc::new(BooleanArray::from_iter(
                        (0..rows).map(|_| (next(5) != 0).then(|| next(2) == 0)),
                    )),
                    Arc::new(
                        Decimal128Array::from_iter(
                            (0..rows).map(|_| (next(6) != 0).then(|| next(100_000) as i128 - 500)),
                        )
                        .with_precision_and_scale(12, 2)
                        .unwrap(),
                    ),
                ],
            )
            .unwrap()
        };
        let half = build_rows / 2;
        let build = vec![
            batch(half, 0, true, &mut next),
            batch(build_rows - half, half, true, &mut next),
        ];
        let probe_batches: Vec<Vec<RecordBatch>> = (0..2)
            .map(|_| {
                (0..2)
                    .map(|_| {
                        let rows = next(400) as i32;
                        let b = batch(rows, 0, round % 2 == 0, &mut next);
                        // Probe keys over the whole range (some match nothing).
                        let keys: Vec<Option<i32>> = (0..rows)
                            .map(|_| {
                                (next(13) != 0)
                                    .then(|| next((key_range + build_rows) as u64 + 5) as i32)
                            })
                            .collect();
                        let mut columns = b.columns().to_vec();
                        columns[0] = Arc::new(Int32Array::from(keys));
                        RecordBatch::try_new(b.schema(), columns).unwrap()
                    })
                    .collect()
            })
            .collect();
        for c in [&ctx, &plain] {
            let schema = build[0].schema();
            let table = MemTable::try_new(schema.clone(), vec![build.clone()]).unwrap();
            c.register_table("b", Arc::new(table)).unwrap();
            let table = MemTable::try_new(schema, probe_batches.clone()).unwrap();
            c.register_table("p", Arc::new(table)).unwrap();
        }
        // Integer keys, string keys (short ones repeat, long ones hardly), a decimal key.
        let on = [
            "p.k = b.k",
            "p.k = b.k and p.k2 = b.k2",
            "p.name = b.name",
            "p.name = b.name and p.k2 = b.k2",
            "p.k = b.k and p.price = b.price",
        ][next(5) as usize];
        let before = ["", " and p.price > 0", " and p.name like 'v%'"][next(3) as usize];
        // A filter over both sides, or none (semi, anti and left joins of `b`).
        let both = [
            "",
            " and p.price > b.price",
            " and (p.k2 <> b.k2 or b.flag)",
        ][next(3) as usize];
        let sql = match next(10) {
            9 => format!("select b.k, b.name, p.k, p.price from b full join p on {on}"),
            6 => format!("select b.k, b.name, b.flag from b where exists (select 1 from p where {on}{before}{both})"),
            7 => format!("select b.k, b.price from b where not exists (select 1 from p where {on}{before}{both})"),
            8 => format!("select b.k, b.name, p.name, p.price from b left join p on {on}{before}{both}"),
            5 => format!("select p.k, p.name, b.name, b.flag, b.price from p left join b on {on} where true{before}"),
            0 => format!("select p.k, p.name, b.name, b.flag, b.price from p join b on {on} where true{before}"),
            1 => format!(
                "select p.k2, b.name, b.price, p.flag from p join b on {on} and (b.price > p.price or b.flag) where true{before}"
            ),
            2 => format!("select b.name, count(*) as n, sum(p.price) as s from p join b on {on} where true{before} group by b.name"),
            3 => format!("select p.k, p.name from p where exists (select 1 from b where {on}{both}){before}"),
            _ => format!("select p.k, p.price from p where not exists (select 1 from b where {on}{both}){before}"),
        };
        let (plan, shown) = planned(&ctx, &sql).await;
        assert!(
            shown.contains("DeviceHashJoinExec"),
            "round {round}: {sql}\n{shown}"
        );
        let got = collect(plan, ctx.task_ctx())
            .await
            .unwrap_or_else(|e| panic!("round {round}: {sql}: {e}\n{shown}"));
        let want = plain.sql(&sql).await.unwrap().collect().await.unwrap();
        assert_eq!(lines(&got), lines(&want), "round {round}: {sql}\n{shown}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_joins_are_datafusions() {
    if own_tests() {
        check_random_joins(&ExecDevice::cpu()).await;
    }
}

/// `fact` (columns `fk`, then `s`) joined to a `dim` of repeated keys 1, 1, 2 (`select
/// f.s, d.v from f join d on f.fk = d.k`, `f` the probe side), its build side built on
/// `device`: each probe row of key 1 makes two pairs, so a probe gathers `s` to them.
async fn repeated_key_join(
    fact: &RecordBatch,
    device: &ExecDevice,
) -> devarrow_datafusion::compute::join::BuiltJoin {
    use datafusion::physical_plan::joins::HashJoinExec;
    use devarrow_datafusion::compute::join::DeviceHashJoin;

    let ctx = SessionContext::new();
    let dim = RecordBatch::try_from_iter([
        ("k", Arc::new(Int32Array::from(vec![1, 1, 2])) as ArrayRef),
        (
            "v",
            Arc::new(Int32Array::from(vec![10, 11, 20])) as ArrayRef,
        ),
    ])
    .unwrap();
    for (name, batch) in [("d", dim), ("f", fact.clone())] {
        let table = MemTable::try_new(batch.schema(), vec![vec![batch]]).unwrap();
        ctx.register_table(name, Arc::new(table)).unwrap();
    }
    let node = hash_join_of(&ctx, "select f.s, d.v from f join d on f.fk = d.k").await;
    let join = node.downcast_ref::<HashJoinExec>().unwrap();
    assert_eq!(
        join.right().schema().field(1).name(),
        "s",
        "f is the probe side"
    );
    let compiled = DeviceHashJoin::compile(join).unwrap();
    let mut transfer = Transfer::new(device.device().clone(), TransferOptions::default());
    let build = collect(join.left().clone(), ctx.task_ctx()).await.unwrap();
    let built = compiled.build(&build, device, &mut transfer).unwrap();
    assert!(!built.is_unique(), "the build keys repeat");
    built
}

/// A hash join whose probe-side string key is an expression (`f.code || '!'`, a join
/// DataFusion's SQL planner would give a projection below the join, but another planner
/// or a rewrite may not): the device computes the key into a column of the probe frame
/// (hashed, and compared byte by byte where hashes agree) and the output is DataFusion's
/// join on `f.code = d.name`, row for row, for an inner and a semi join over each
/// string type; the computed column never leaves the join. Keys that are integers cast
/// to strings join as DataFusion's. A key expression the device cannot compute says
/// why.
pub async fn check_computed_string_keys(device: &ExecDevice) {
    use datafusion::logical_expr::Operator;
    use datafusion::physical_expr::expressions::{BinaryExpr, Literal};
    use datafusion::physical_plan::joins::HashJoinExec;
    use devarrow_datafusion::compute::join::DeviceHashJoin;

    for strings in [DataType::Utf8View, DataType::Utf8, DataType::LargeUtf8] {
        let ctx = SessionContext::new_with_config(SessionConfig::new().with_target_partitions(1));
        join_tables_of(&ctx, &strings);
        for sql in [
            "select f.qty, f.code, d.k, d.name from fact f join dim d on f.code = d.name",
            "select f.fk, f.code from fact f where exists \
             (select 1 from dim d where d.name = f.code)",
        ] {
            let want = ctx.sql(sql).await.unwrap().collect().await.unwrap();
            let node = hash_join_of(&ctx, sql).await;
            let join = node.downcast_ref::<HashJoinExec>().unwrap();
            let (build_key, probe_key) = join.on()[0].clone();
            // `key || '!'`, the literal of the key's own type (as DataFusion's coercion
            // would make it).
            let bang = |e: Arc<dyn datafusion::physical_expr::PhysicalExpr>, side: &Schema| {
                use datafusion::common::ScalarValue;
                let mark = Some("!".to_string());
                let literal = match e.data_type(side).unwrap() {
                    DataType::Utf8View => ScalarValue::Utf8View(mark),
                    DataType::LargeUtf8 => ScalarValue::LargeUtf8(mark),
                    _ => ScalarValue::Utf8(mark),
                };
                Arc::new(BinaryExpr::new(
                    e,
                    Operator::StringConcat,
                    Arc::new(Literal::new(literal)),
                )) as Arc<dyn datafusion::physical_expr::PhysicalExpr>
            };
            let on = vec![(
                bang(build_key, &join.left().schema()),
                bang(probe_key, &join.right().schema()),
            )];
            let rewritten = join.builder().with_on(on).build().unwrap();
            let compiled = DeviceHashJoin::compile(&rewritten)
                .unwrap_or_else(|u| panic!("{sql} over {strings}: {u:?}"));
            let mut transfer = Transfer::new(device.device().clone(), TransferOptions::default());
            let build = collect(rewritten.left().clone(), ctx.task_ctx())
                .await
                .unwrap();
            let built = compiled.build(&build, device, &mut transfer).unwrap();
            let probe = collect(rewritten.right().clone(), ctx.task_ctx())
                .await
                .unwrap();
            let probe = concat_batches(&rewritten.right().schema(), &probe).unwrap();
            let mut got = Vec::new();
            for frame in built.probe(&upload(&probe, device), device).unwrap() {
                assert_eq!(
                    frame.schema(),
                    &rewritten.schema(),
                    "{sql}: the join's columns"
                );
                got.push(frame.download(&mut transfer).unwrap());
            }
            // Above the join, DataFusion's plan may project or reorder: compare the rows
            // of the join's own columns with DataFusion's join of the same plan.
            let host = collect(node.clone(), ctx.task_ctx()).await.unwrap();
            assert_eq!(lines(&got), lines(&host), "{sql} over {strings}");
            assert!(
                !want.is_empty() && !lines(&host).is_empty(),
                "{sql}: rows match"
            );
        }
    }
    // Keys that are integers cast to strings (the device writes them as arrow's cast):
    // DataFusion's join of the same plan, row for row.
    let ctx = SessionContext::new();
    join_tables_of(&ctx, &DataType::Utf8View);
    let node = hash_join_of(
        &ctx,
        "select f.qty, d.k from fact f join dim d on f.code = d.name",
    )
    .await;
    let join = node.downcast_ref::<HashJoinExec>().unwrap();
    let cast = |name: &str, schema: &Schema, to: DataType| {
        let column =
            datafusion::physical_expr::expressions::Column::new_with_schema(name, schema).unwrap();
        Arc::new(datafusion::physical_expr::expressions::CastExpr::new(
            Arc::new(column),
            to,
            None,
        )) as Arc<dyn datafusion::physical_expr::PhysicalExpr>
    };
    let (left, right) = (join.left().schema(), join.right().schema());
    let on = vec![(
        cast("k", &left, DataType::Utf8View),
        cast("qty", &right, DataType::Utf8View),
    )];
    let rewritten = Arc::new(join.builder().with_on(on).build().unwrap());
    let compiled = DeviceHashJoin::compile(&rewritten).unwrap();
    let mut transfer = Transfer::new(device.device().clone(), TransferOptions::default());
    let build = collect(rewritten.left().clone(), ctx.task_ctx())
        .await
        .unwrap();
    let built = compiled.build(&build, device, &mut transfer).unwrap();
    let probe = collect(rewritten.right().clone(), ctx.task_ctx())
        .await
        .unwrap();
    let probe = concat_batches(&rewritten.right().schema(), &probe).unwrap();
    let mut got = Vec::new();
    for frame in built.probe(&upload(&probe, device), device).unwrap() {
        got.push(frame.download(&mut transfer).unwrap());
    }
    let host = collect(rewritten, ctx.task_ctx()).await.unwrap();
    assert_eq!(lines(&got), lines(&host), "keys cast from integers");
    assert!(
        !lines(&host).is_empty(),
        "keys cast from integers: rows match"
    );

    // A probe key the device cannot compute (a float cast to a string): refused, with
    // the key named.
    let float = |name: &str, schema: &Schema| {
        let column = cast(name, schema, DataType::Float64);
        Arc::new(datafusion::physical_expr::expressions::CastExpr::new(
            column,
            DataType::Utf8View,
            None,
        )) as Arc<dyn datafusion::physical_expr::PhysicalExpr>
    };
    let on = vec![(float("k", &left), float("qty", &right))];
    let rewritten = join.builder().with_on(on).build().unwrap();
    let refused = DeviceHashJoin::compile(&rewritten);
    assert!(
        matches!(&refused, Err(Unsupported(why)) if why.starts_with("join key `CAST(CAST(qty")),
        "{refused:?}"
    );
}

/// The first hash join of `sql`'s physical plan in `ctx` (depth first).
async fn hash_join_of(ctx: &SessionContext, sql: &str) -> Arc<dyn ExecutionPlan> {
    use datafusion::physical_plan::joins::HashJoinExec;
    let (plan, shown) = planned(ctx, sql).await;
    find::<HashJoinExec>(&plan).unwrap_or_else(|| panic!("no hash join in {shown}"))
}

/// Keys 0 to 7 (`fk`) and a string of more than 12 bytes each (`s`, of `strings`).
fn long_strings_fact(strings: &DataType) -> RecordBatch {
    let s = arrow_array::StringViewArray::from_iter_values(
        (0..8).map(|i| format!("a value longer than twelve bytes {i}")),
    );
    RecordBatch::try_from_iter([
        (
            "fk",
            Arc::new(Int32Array::from_iter_values(0..8)) as ArrayRef,
        ),
        ("s", datafusion::arrow::compute::cast(&s, strings).unwrap()),
    ])
    .unwrap()
}

/// `batch` uploaded to `device`, exported, `bytes` written on the device at byte `at` of
/// buffer 1 of its column 1 (as a bad foreign producer's would be), and imported again:
/// a foreign frame.
fn rewritten_import(
    batch: &RecordBatch,
    device: &ExecDevice,
    at: u64,
    bytes: &[u8],
) -> DeviceFrame {
    let mut transfer = Transfer::new(device.device().clone(), TransferOptions::default());
    let (array, _schema) = transfer.to_device(batch).unwrap().export().unwrap();
    let raw = array.into_raw();
    // SAFETY: the export's own struct: a child per column, each buffer an address in
    // device memory.
    let buffer = unsafe {
        let column = &**raw.array.children.add(1);
        *column.buffers.add(1) as u64
    };
    let d = device.device();
    // SAFETY: `bytes` outlives the copy, waited for at once; the callers' destinations lie
    // in the buffer, which the export keeps alive.
    unsafe {
        d.copy_to_device(
            bytes.as_ptr(),
            (buffer + at) as *mut std::ffi::c_void,
            bytes.len(),
        )
    }
    .unwrap();
    d.record_event().unwrap().wait_host().unwrap();
    // SAFETY: the export's own struct, unchanged, released by the import.
    let array = unsafe { devarrow::abi::DeviceArray::try_new(raw) }.expect("a live array");
    DeviceFrame::from_batch(
        DeviceBatch::import(device.device().clone(), array, batch.schema()).unwrap(),
    )
}

/// A probe frame whose string views point outside their buffers (a foreign import: a
/// view rewritten past its buffer's end) is a typed error where a join gathers its views (build
/// keys that repeat), never an array that reads out of bounds. CUDA only: the CPU
/// device's join reads the frame through arrow's own import.
pub async fn check_foreign_probe_views(device: &ExecDevice) {
    if device.cuda().is_none() {
        return;
    }
    let fact = long_strings_fact(&DataType::Utf8View);
    let built = repeated_key_join(&fact, device).await;
    // Row 1's view (a row that matches): its 40 bytes at offset 1 MiB of buffer 0, far
    // past the buffer's end.
    let mut view = [0u8; 16];
    view[..4].copy_from_slice(&40u32.to_le_bytes());
    view[4..8].copy_from_slice(b"a va");
    view[12..].copy_from_slice(&(1u32 << 20).to_le_bytes());
    let foreign = rewritten_import(&fact, device, 16, &view);
    let error = built.probe(&foreign, device).unwrap_err();
    assert!(
        matches!(
            error.downcast_ref::<ComputeError>(),
            Some(ComputeError::Input(why)) if why.contains("outside its buffers")
        ),
        "{error}"
    );
}

/// A foreign `Utf8` column whose offsets point past its data (row 1's end rewritten on
/// the device, as a bad producer's would be) is a typed error wherever the device reads
/// it: a string predicate (`view_in`, `view_like`, both through views made of its
/// offsets), a group key, a join's gather of it to pairs; the compaction gives way to
/// the host. CUDA only: the CPU device's arrow import checks offsets on its own.
pub async fn check_foreign_offsets(device: &ExecDevice) {
    use devarrow_datafusion::compute::compact;

    if device.cuda().is_none() {
        return;
    }
    let fact = long_strings_fact(&DataType::Utf8);
    // Row 1's end offset (offset 2) rewritten to 1 MiB.
    let foreign = || rewritten_import(&fact, device, 8, &(1i32 << 20).to_le_bytes());
    let outside = |error: &devarrow_datafusion::error::BoxError, what: &str| {
        assert!(
            matches!(
                error.downcast_ref::<ComputeError>(),
                Some(ComputeError::Input(why)) if why.contains("outside its")
            ),
            "{what}: {error}"
        );
    };
    let ctx = session_of("f", &fact);
    for text in ["s = 'x'", "s IN ('x', 'y')", "s LIKE '%longer%'"] {
        let (e, schema, _) = projection_of(&ctx, "f", &format!("({text})")).await;
        let compiled = DeviceExpr::compile(&e, &schema).unwrap();
        let error = select(&compiled, &foreign(), device).unwrap_err();
        outside(&error, text);
    }
    // A group key.
    let partial = partial_aggregate_of(&ctx, "SELECT s, count(*) FROM f GROUP BY s").await;
    let error = DevicePartialAggregate::compile(&partial)
        .unwrap()
        .run(&foreign(), device)
        .unwrap_err();
    outside(&error, "a group key");
    // The compaction: the host filters it.
    let every_other = UInt8Array::from((0..8).map(|i| Some(i % 2)).collect::<Vec<_>>());
    let selected = foreign()
        .with_selection(selection_column(every_other, device))
        .unwrap();
    assert!(compact(&selected, device).unwrap().is_none());
    // A join's gather of it to the pairs of repeated build keys.
    let built = repeated_key_join(&fact, device).await;
    let error = built.probe(&foreign(), device).unwrap_err();
    outside(&error, "a join's gather");
}

/// A stream of a region with a device join dropped after its first batch: the
/// partitions' threads end on their own (while binding, or between frames) and give the
/// device back every byte (the join's table included).
pub async fn check_dropped_join_stream(device: &ExecDevice, in_use: impl Fn() -> usize) {
    use datafusion::physical_plan::execute_stream;
    use futures::StreamExt;

    let before = in_use();
    let ctx = every_join_session(device).await;
    join_tables(&ctx);
    let sql = "select f.qty, f.note, d.name, d.price from fact f join dim d on f.fk = d.k";
    let plan = ctx
        .sql(sql)
        .await
        .unwrap()
        .create_physical_plan()
        .await
        .unwrap();
    let mut stream = execute_stream(plan, ctx.task_ctx()).unwrap();
    let first = stream.next().await.expect("a first batch").unwrap();
    assert!(first.num_rows() > 0);
    drop(stream);
    memory_returns(in_use, before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_join_stream_frees_its_device_memory() {
    if own_tests() {
        let (device, in_use) = counted_cpu();
        check_dropped_join_stream(&device, in_use).await;
    }
}

/// String join keys whose lanes collide: a probe value that hashes as a build value but
/// differs from it matches nothing (its bytes compared after the probe), in inner, semi
/// and anti joins; two such values on the build side fail the query with a typed error.
pub async fn check_string_key_collisions(device: &ExecDevice) {
    use arrow_array::StringViewArray;
    let (a, b) = colliding_strings();
    let ctx = every_join_session(device).await;
    let plain = SessionContext::new_with_config(SessionConfig::new().with_target_partitions(2));
    let schema = Arc::new(Schema::new(vec![
        Field::new("s", DataType::Utf8View, true),
        Field::new("v", DataType::Int64, false),
    ]));
    let table = |values: Vec<Option<&str>>| {
        let n = values.len() as i64;
        let batch = RecordBatch::try_new(
            schema.clone(),
            vec![
                Arc::new(StringViewArray::from(values)) as ArrayRef,
                Arc::new(Int64Array::from_iter_values(0..n)),
            ],
        )
        .unwrap();
        Arc::new(MemTable::try_new(schema.clone(), vec![vec![batch]]).unwrap())
    };
    let probe: Vec<Option<&str>> = (0..60)
        .map(|i| match i % 4 {
            0 => Some(a.as_str()),
            1 => Some(b.as_str()),
            2 => None,
            _ => Some("short"),
        })
        .collect();
    for c in [&ctx, &plain] {
        c.register_table("small", table(vec![Some(&a), Some("short")]))
            .unwrap();
        c.register_table("big", table(probe.clone())).unwrap();
        c.register_table("both", table(vec![Some(&a), Some(&b)]))
            .unwrap();
    }
    for sql in [
        "select big.v, small.v from big join small on big.s = small.s",
        "select big.v from big where exists (select 1 from small where small.s = big.s)",
        "select big.v from big where not exists (select 1 from small where small.s = big.s)",
    ] {
        let (plan, shown) = planned(&ctx, sql).await;
        assert!(shown.contains("DeviceHashJoinExec"), "{sql}\n{shown}");
        let got = collect(plan, ctx.task_ctx())
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}\n{shown}"));
        let want = plain.sql(sql).await.unwrap().collect().await.unwrap();
        assert_eq!(lines(&got), lines(&want), "{sql}\n{shown}");
    }
    let sql = "select big.v, both.v from big join both on big.s = both.s";
    let (plan, shown) = planned(&ctx, sql).await;
    assert!(shown.contains("DeviceHashJoinExec"), "{sql}\n{shown}");
    let error = collect(plan, ctx.task_ctx())
        .await
        .expect_err("two build values of one hash")
        .to_string();
    assert!(error.contains("the same 64-bit hash"), "{error}");
}

#[tokio::test]
async fn string_keys_whose_hashes_collide_match_by_their_bytes() {
    if own_tests() {
        check_string_key_collisions(&ExecDevice::cpu()).await;
    }
}

/// `sql` run in `ctx` with a device join of `join_type` that collects its build side, its
/// rows `want`'s: the join's `partitions_on_host`, `bytes_to_device` and
/// `bytes_from_device`, and the plan's text.
async fn placed_join(
    ctx: &SessionContext,
    sql: &str,
    join_type: &str,
    want: &[RecordBatch],
) -> ([usize; 3], String) {
    let (plan, shown) = planned(ctx, sql).await;
    let placed = format!("DeviceHashJoinExec: mode=CollectLeft, join_type={join_type},");
    assert!(shown.contains(&placed), "{sql}\n{shown}");
    let got = collect(plan.clone(), ctx.task_ctx())
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}\n{shown}"));
    assert_eq!(lines(&got), lines(want), "{sql}\n{shown}");
    let metrics = ["partitions_on_host", "bytes_to_device", "bytes_from_device"]
        .map(|name| join_metric(&plan, name));
    (metrics, shown)
}

/// A batch of `Int64` columns (nullable where a value is null).
fn int64_batch<const N: usize>(columns: [(&str, Vec<Option<i64>>); N]) -> RecordBatch {
    let (fields, arrays): (Vec<Field>, Vec<ArrayRef>) = columns
        .into_iter()
        .map(|(name, values)| {
            let nullable = values.iter().any(Option::is_none);
            let array: ArrayRef = Arc::new(Int64Array::from(values));
            (Field::new(name, DataType::Int64, nullable), array)
        })
        .unzip();
    RecordBatch::try_new(Arc::new(Schema::new(fields)), arrays).unwrap()
}

/// The values of metric `name` of the plan's `DeviceHashJoinExec` nodes (one per
/// partition that set it, or per counter).
fn join_metrics(plan: &Arc<dyn ExecutionPlan>, name: &str) -> impl Iterator<Item = usize> {
    let mut values = Vec::new();
    let mut stack = vec![plan.clone()];
    while let Some(node) = stack.pop() {
        if node.name() == "DeviceHashJoinExec" {
            if let Some(metrics) = node.metrics() {
                values.extend(
                    metrics
                        .iter()
                        .filter(|m| m.value().name() == name)
                        .map(|m| m.value().as_usize()),
                );
            }
        }
        stack.extend(node.children().into_iter().cloned());
    }
    values.into_iter()
}

/// The sum of [`join_metrics`].
fn join_metric(plan: &Arc<dyn ExecutionPlan>, name: &str) -> usize {
    join_metrics(plan, name).sum()
}

/// Run-time placement: a join whose build side DataFusion's statistics underestimate (a
/// filter they cannot judge: 20% of 200,000 rows, all of which pass) is placed on the
/// device by the rule; when its partitions have read the build side (a table of about
/// 6 MiB, against a probe side and output estimated at under 3 MiB) they join on
/// the host, uploading no table: the same rows as DataFusion's, `partitions_on_host`
/// counted. With `devarrow.always_place_joins` it joins on the device. Inner, right and
/// left semi joins (the last emitting build rows at the end).
pub async fn check_run_time_placement(device: &ExecDevice) {
    let ctx = session_on(device, 2);
    let plain = SessionContext::new_with_config(SessionConfig::new().with_target_partitions(2));
    let build_rows = 200_000i64;
    let wide = int64_batch([
        ("k", (0..build_rows).map(Some).collect()),
        ("w", (0..build_rows).map(|i| Some(i * 3)).collect()),
    ]);
    let few = |part: i64| {
        int64_batch([
            (
                "fk",
                (0..40_000i64)
                    .map(|i| (i % 13 != 0).then_some((i * 7919 + part) % (build_rows + 5_000)))
                    .collect(),
            ),
            ("q", (0..40_000).map(|i| Some(i % 100)).collect()),
        ])
    };
    for c in [&ctx, &plain] {
        let table = MemTable::try_new(wide.schema(), vec![vec![wide.clone()]]).unwrap();
        c.register_table("wide", Arc::new(table)).unwrap();
        let (a, b) = (few(0), few(1));
        let table = MemTable::try_new(a.schema(), vec![vec![a], vec![b]]).unwrap();
        c.register_table("few", Arc::new(table)).unwrap();
    }
    let build = "(select * from wide where w % 7 >= 0)";
    for (sql, join_type) in [
        (format!("select sum(few.q) as q, sum(b.w) as w, count(*) as n from few join {build} b on few.fk = b.k"), "Inner"),
        (format!("select count(b.w) as matched, count(*) as n from few left join {build} b on few.fk = b.k"), "Right"),
        (format!("select count(*) as n, sum(b.w) as w from {build} b where exists (select 1 from few where few.fk = b.k)"), "LeftSemi"),
    ] {
        let want = plain.sql(&sql).await.unwrap().collect().await.unwrap();
        for always in [false, true] {
            let set = format!("set devarrow.always_place_joins = {always}");
            ctx.sql(&set).await.unwrap().collect().await.unwrap();
            // Up: the table, or (on the host) the join's output; down: its probe side.
            let ([on_host, up, down], shown) = placed_join(&ctx, &sql, join_type, &want).await;
            if always {
                assert_eq!((on_host, down), (0, 0), "{sql}\n{shown}");
                assert!(up > 5 << 20, "{up} bytes up: {sql}\n{shown}");
            } else {
                assert!(on_host > 0 && down > 0, "{sql}\n{shown}");
                assert!(up < 2 << 20, "{up} bytes up: {sql}\n{shown}");
            }
        }
    }

    // A probe side DataFusion underestimates too (a filter it cannot judge over 2 x
    // 500,000 rows): each partition starts on the host, and once the query's frames have
    // moved as many bytes as the table holds, the table goes up and each partition joins
    // on the device.
    let many = |part: i64| {
        int64_batch([
            (
                "fk",
                (0..500_000i64)
                    .map(|i| Some((i * 31 + part) % build_rows))
                    .collect(),
            ),
            ("q", (0..500_000).map(|i| Some(i % 100)).collect()),
        ])
    };
    // In batches of 10,000 rows, uploaded 256 KiB at a time: frames of about 16,000
    // rows.
    let batches = |batch: RecordBatch| -> Vec<RecordBatch> {
        (0..50).map(|i| batch.slice(i * 10_000, 10_000)).collect()
    };
    for c in [&ctx, &plain] {
        let (a, b) = (many(0), many(1));
        let table = MemTable::try_new(a.schema(), vec![batches(a), batches(b)]).unwrap();
        c.register_table("many", Arc::new(table)).unwrap();
    }
    for set in [
        "set devarrow.always_place_joins = false",
        "set devarrow.batch_bytes = 262144",
    ] {
        ctx.sql(set).await.unwrap().collect().await.unwrap();
    }
    // An inner join, and a left semi join (its marks so far go up with the table).
    let probe = "(select * from many where q % 3 >= 0)";
    for (sql, join_type) in [
        (
            format!(
                "select sum(p.q) as q, sum(b.w) as w, count(*) as n from {probe} p \
                 join {build} b on p.fk = b.k"
            ),
            ("Inner", 16),
        ),
        (
            format!(
                "select count(*) as n, sum(b.w) as w from {build} b where exists \
                 (select 1 from {probe} p where p.fk = b.k)"
            ),
            // Only the keys come down, and nothing goes up until the end.
            ("LeftSemi", 8),
        ),
    ] {
        let (join_type, row_bytes) = join_type;
        let want = plain.sql(&sql).await.unwrap().collect().await.unwrap();
        let ([on_host, up, down], shown) = placed_join(&ctx, &sql, join_type, &want).await;
        // Both partitions started on the host; the table went up (about 6 MiB, once per
        // device) after at least its bytes had moved; not every probe row came down.
        assert_eq!(on_host, 2, "{sql}\n{shown}");
        assert!(up > 5 << 20, "{up} bytes up: {sql}\n{shown}");
        let all = 1_000_000 * row_bytes;
        assert!(
            down > 0 && down < all,
            "{down} of {all} bytes down: {sql}\n{shown}"
        );
    }
}

#[tokio::test]
async fn a_join_whose_build_side_is_heavier_than_estimated_joins_on_the_host() {
    if own_tests() {
        check_run_time_placement(&ExecDevice::cpu()).await;
    }
}
