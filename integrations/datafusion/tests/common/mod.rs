//! TPC-H lineitem in DataFusion, and the revenue query with and without the device step:
//! shared by the tests, the example (`examples/tpch_revenue.rs`) and the bench, which
//! include this file.
#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::Arc;

use arrow_array::{Array, Decimal128Array, Int32Array, Int64Array, RecordBatch};
use arrow_schema::DataType;
use datafusion::datasource::MemTable;
use datafusion::error::Result;
use datafusion::physical_plan::ExecutionPlan;
use datafusion::prelude::{SessionConfig, SessionContext};
use devarrow_datafusion::revenue::revenue_step;
use devarrow_datafusion::{DeviceExec, ExecDevice};
use tpchgen::generators::LineItemGenerator;
use tpchgen_arrow::LineItemArrow;

/// The columns the query reads.
pub const SCAN: &str =
    "SELECT l_orderkey, l_linenumber, l_returnflag, l_extendedprice, l_discount \
                        FROM lineitem WHERE l_shipdate < DATE '1998-09-02'";

/// DataFusion alone: the same rows, with DataFusion's own revenue.
pub const REVENUE_SQL: &str = "SELECT l_orderkey, l_linenumber, l_returnflag, \
                               l_extendedprice * (1 - l_discount) AS revenue \
                               FROM lineitem WHERE l_shipdate < DATE '1998-09-02'";

/// TPC-H lineitem at `scale`, generated in `partitions` parts (one DataFusion partition
/// each) of batches of `batch_rows`.
pub fn lineitem(scale: f64, partitions: usize, batch_rows: usize) -> Vec<Vec<RecordBatch>> {
    (1..=partitions as i32)
        .map(|part| {
            LineItemArrow::new(LineItemGenerator::new(scale, part, partitions as i32))
                .with_batch_size(batch_rows)
                .collect::<Result<Vec<_>, _>>()
                .expect("tpchgen lineitem")
        })
        .collect()
}

/// A session with `lineitem` registered (its partitions as they are).
pub fn session(partitions: Vec<Vec<RecordBatch>>) -> SessionContext {
    let target = partitions.len().max(1);
    let ctx = SessionContext::new_with_config(SessionConfig::new().with_target_partitions(target));
    register_lineitem(&ctx, partitions);
    ctx
}

/// `sql`'s result by DataFusion alone over `lineitem` of `partitions` ([`session`]).
pub async fn datafusion_alone(partitions: Vec<Vec<RecordBatch>>, sql: &str) -> Vec<RecordBatch> {
    session(partitions)
        .sql(sql)
        .await
        .unwrap()
        .collect()
        .await
        .unwrap()
}

/// Registers `lineitem` in `ctx` (its partitions as they are, of their schema).
pub fn register_lineitem(ctx: &SessionContext, partitions: Vec<Vec<RecordBatch>>) {
    // The batches' own schema (the generator's, or one with other string types).
    let schema = partitions
        .iter()
        .flatten()
        .next()
        .map_or_else(LineItemArrow::schema_ref, |b| b.schema());
    let table = MemTable::try_new(schema, partitions).expect("MemTable");
    ctx.register_table("lineitem", Arc::new(table))
        .expect("register lineitem");
}

/// The physical plan of [`SCAN`] over the session's lineitem.
pub async fn scan_plan(ctx: &SessionContext) -> Result<Arc<dyn ExecutionPlan>> {
    ctx.sql(SCAN).await?.create_physical_plan().await
}

/// The scan's physical plan under a `DeviceExec` running the revenue step on `device`.
pub async fn device_plan(ctx: &SessionContext, device: ExecDevice) -> Result<Arc<DeviceExec>> {
    let scan = scan_plan(ctx).await?;
    let step = Arc::new(revenue_step());
    Ok(Arc::new(DeviceExec::try_new(scan, step, device)?))
}

/// (l_orderkey, l_linenumber) -> revenue (its unscaled value) and its scale, of batches
/// holding those columns.
pub fn revenue_by_row(batches: &[RecordBatch]) -> (HashMap<(i64, i32), i128>, i8) {
    let mut rows = HashMap::new();
    let mut scale = None;
    for batch in batches {
        let key = batch.column_by_name("l_orderkey").expect("l_orderkey");
        let key = key.as_any().downcast_ref::<Int64Array>().expect("i64 key");
        let line = batch.column_by_name("l_linenumber").expect("l_linenumber");
        let line = line
            .as_any()
            .downcast_ref::<Int32Array>()
            .expect("i32 line");
        let revenue = batch.column_by_name("revenue").expect("revenue");
        match revenue.data_type() {
            DataType::Decimal128(_, s) => scale = Some(*s),
            other => panic!("revenue is {other}"),
        }
        let revenue = revenue.as_any().downcast_ref::<Decimal128Array>().unwrap();
        assert_eq!(revenue.null_count(), 0);
        for i in 0..batch.num_rows() {
            let old = rows.insert((key.value(i), line.value(i)), revenue.value(i));
            assert!(
                old.is_none(),
                "row {:?} twice",
                (key.value(i), line.value(i))
            );
        }
    }
    (rows, scale.unwrap_or(4))
}

/// DataFusion's own revenue, row by row.
pub async fn datafusion_revenue(ctx: &SessionContext) -> Result<Vec<RecordBatch>> {
    ctx.sql(REVENUE_SQL).await?.collect().await
}

/// Checks the device plan's rows against DataFusion's: same rows, same values at the same
/// scale. Returns the number of rows.
pub fn check_against_datafusion(device: &[RecordBatch], datafusion: &[RecordBatch]) -> usize {
    let (got, got_scale) = revenue_by_row(device);
    let (want, want_scale) = revenue_by_row(datafusion);
    assert_eq!(got_scale, want_scale, "revenue's scale");
    assert_eq!(got.len(), want.len(), "rows");
    for (row, value) in &want {
        assert_eq!(got.get(row), Some(value), "revenue of row {row:?}");
    }
    got.len()
}

/// The plan's output rows.
pub fn rows(batches: &[RecordBatch]) -> usize {
    batches.iter().map(|b| b.num_rows()).sum()
}

/// Keeps `ExecutionPlan` in scope for the includers.
pub fn partitions_of(plan: &dyn ExecutionPlan) -> usize {
    plan.properties().partitioning.partition_count()
}

/// Two strings of 24 bytes, of one length and prefix, whose join key lanes agree (their
/// hashes collide) though their bytes differ: printable ASCII, found by search.
pub fn colliding_strings() -> (String, String) {
    use devarrow_datafusion::compute::join::string_key_lanes;
    const C: u64 = 0xFF51_AFD7_ED55_8CCD;
    let mix = |h: u64, w: u64| {
        let h = (h ^ w).wrapping_mul(C);
        h ^ (h >> 33)
    };
    let word = |s: &[u8]| u64::from_le_bytes(s.try_into().unwrap());
    let a = b"join key, ab: 0123456789";
    let start = 0x9E37_79B9_7F4A_7C15u64;
    let after_two = |w1: u64, w2: u64| mix(mix(start, w1), w2);
    let state_a = after_two(word(&a[..8]), word(&a[8..16]));
    // b's second word differs; its third makes the state before the last mix equal.
    for c in 0u64.. {
        let second = format!("{c:08}");
        let state_b = after_two(word(&a[..8]), word(second.as_bytes()));
        let third = (state_a ^ word(&a[16..]) ^ state_b).to_le_bytes();
        if third.iter().all(|b| (0x20..0x7f).contains(b)) {
            let b = format!(
                "{}{second}{}",
                std::str::from_utf8(&a[..8]).unwrap(),
                std::str::from_utf8(&third).unwrap()
            );
            let a = std::str::from_utf8(a).unwrap().to_string();
            assert_ne!(a, b);
            assert_eq!(
                string_key_lanes(a.as_bytes()),
                string_key_lanes(b.as_bytes()),
                "no collision: the test's hash is not the join's"
            );
            return (a, b);
        }
    }
    unreachable!()
}
