//! TPC-H's 22 queries with devarrow's placement rule on (`device_session`, regions on
//! the CPU device) give DataFusion's results: the same rows (sorted; floats within a
//! relative 1e-9, everything else as text, decimals exactly). Regions where the rule
//! can make them, the host elsewhere; each test prints its query's placement (regions,
//! and the nodes left on the host with the reasons): run with `--nocapture` to see it.
//!
//! - `DEVARROW_TPCH_SCALE` (default 0.01) and `DEVARROW_TPCH_PARTITIONS` (default 4):
//!   the tables' scale and partitions (and the sessions' target partitions).
//! - `DEVARROW_TPCH_STRINGS` (`utf8`, `large_utf8`; default `view`): the string
//!   columns' type (tpchgen makes `Utf8View`; in-memory tables often hold `Utf8`).
//! - `DEVARROW_EXPECT_DEVICE_Q1_Q6=1`: Q1 and Q6 must each run in exactly one region
//!   holding the filter, the projection (Q1) and the partial aggregate, none of them
//!   left on the host (once devarrow's compute runs them: `src/compute/`).
//!
//! SF 1, row by row, with timings: `examples/tpch_device.rs`.

#[path = "common/tpch.rs"]
mod tpch;

use std::sync::{Arc, OnceLock};

use datafusion::physical_plan::aggregates::{AggregateExec, AggregateMode};
use datafusion::physical_plan::filter::FilterExec;
use datafusion::physical_plan::projection::ProjectionExec;
use datafusion::physical_plan::{collect, displayable, ExecutionPlan};
use devarrow_datafusion::region::ops::ProjectionOperator;
use devarrow_datafusion::HostOnlyExec;

use tpch::{compare_results, device_session_on, host_session, plan_query, Placement, Tables};

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    match std::env::var(name) {
        Ok(value) => value
            .parse()
            .unwrap_or_else(|_| panic!("{name}={value} does not parse")),
        Err(_) => default,
    }
}

fn scale() -> f64 {
    env_or("DEVARROW_TPCH_SCALE", 0.01)
}

fn partitions() -> usize {
    env_or("DEVARROW_TPCH_PARTITIONS", 4)
}

/// The tables, generated once for every test of this binary.
fn tables() -> &'static Tables {
    static TABLES: OnceLock<Tables> = OnceLock::new();
    TABLES.get_or_init(|| Tables::generate(scale(), partitions()))
}

/// Nodes the rule asks about (filters, projections, partial aggregates) that are
/// neither device operators nor under a `HostOnlyExec` saying why: the rule missed
/// them.
fn unplaced(plan: &Arc<dyn ExecutionPlan>, under_host_only: bool, found: &mut Vec<String>) {
    // A projection that only picks columns is no device candidate (it joins a region
    // below it when there is one).
    let asked = plan.downcast_ref::<FilterExec>().is_some()
        || plan
            .downcast_ref::<ProjectionExec>()
            .is_some_and(|p| !ProjectionOperator::picks_only(p))
        || plan
            .downcast_ref::<AggregateExec>()
            .is_some_and(|a| *a.mode() == AggregateMode::Partial);
    if asked && !under_host_only {
        found.push(
            displayable(plan.as_ref())
                .one_line()
                .to_string()
                .trim()
                .to_string(),
        );
    }
    let host_only = plan.downcast_ref::<HostOnlyExec>().is_some();
    for child in plan.children() {
        unplaced(child, host_only, found);
    }
}

/// Runs query `q` on DataFusion alone and with the rule on (regions on the CPU
/// device), checks the results equal, prints the placement; returns it.
async fn check_query(q: usize) -> Placement {
    let tables = tables();
    let partitions = partitions();
    let host = host_session(tables, partitions).expect("host session");
    let device = device_session_on(tables, partitions, "cpu")
        .await
        .expect("device session");

    let want = match host.sql(tpch::query(q)).await {
        Ok(df) => df.collect().await,
        Err(e) => Err(e),
    }
    .unwrap_or_else(|e| panic!("Q{q} on DataFusion alone: {e}"));
    let plan = plan_query(&device, q)
        .await
        .unwrap_or_else(|e| panic!("Q{q}'s plan with the rule: {e}"));
    let placement = Placement::of(&plan);
    if std::env::var_os("DEVARROW_TPCH_SHOW_PLANS").is_some() {
        println!(
            "Q{q} with the rule:\n{}",
            displayable(plan.as_ref()).indent(true)
        );
    }
    let got = collect(plan.clone(), device.task_ctx())
        .await
        .unwrap_or_else(|e| {
            panic!(
                "Q{q} with the rule: {e}\n{}",
                displayable(plan.as_ref()).indent(true)
            )
        });

    let rows = compare_results(&got, &want).unwrap_or_else(|diff| {
        panic!(
            "Q{q}: the device session's results are not DataFusion's: {diff}\nplan:\n{}",
            displayable(plan.as_ref()).indent(true)
        )
    });
    println!(
        "Q{q:02} (SF {}, {partitions} partitions): {rows} rows, equal; placement: {placement}",
        tables.scale
    );

    // Every join the device can run on the device (not only those that save link
    // bytes): the same rows.
    let set = |on: bool| {
        let device = device.clone();
        async move {
            let sql = format!("SET devarrow.always_place_joins = {on}");
            device.sql(&sql).await.unwrap().collect().await.unwrap();
        }
    };
    set(true).await;
    let every_join = plan_query(&device, q).await.unwrap();
    let got = collect(every_join.clone(), device.task_ctx())
        .await
        .unwrap_or_else(|e| panic!("Q{q} with every join on the device: {e}"));
    compare_results(&got, &want).unwrap_or_else(|diff| {
        panic!(
            "Q{q} with every join on the device: not DataFusion's results: {diff}\nplan:\n{}",
            displayable(every_join.as_ref()).indent(true)
        )
    });
    set(false).await;

    let mut missed = Vec::new();
    unplaced(&plan, false, &mut missed);
    assert!(
        missed.is_empty(),
        "Q{q}: nodes the rule neither moved nor annotated: {missed:?}\n{}",
        displayable(plan.as_ref()).indent(true)
    );
    for h in &placement.host_only {
        assert!(
            !h.reason.trim().is_empty(),
            "Q{q}: {} stays on the host without a reason",
            h.node
        );
    }
    placement
}

/// Q1 and Q6: the filter and the partial aggregate are each in a region or on the host
/// with a reason; with `DEVARROW_EXPECT_DEVICE_Q1_Q6=1`, all in one region.
fn check_aggregating_query(q: usize, placement: &Placement, projection: bool) {
    let in_region = |name: &str| {
        placement
            .regions
            .iter()
            .any(|r| r.operators.iter().any(|o| o == name))
    };
    let filter = in_region("DeviceFilterExec")
        || placement
            .host_only
            .iter()
            .any(|h| h.node == FilterExec::static_name());
    let aggregate = in_region("DevicePartialAggregateExec")
        || placement.host_only.iter().any(|h| h.partial_aggregate);
    assert!(
        filter && aggregate,
        "Q{q}: its filter and partial aggregate are neither in a region nor on the host \
         with a reason: {placement}"
    );
    if std::env::var("DEVARROW_EXPECT_DEVICE_Q1_Q6").as_deref() == Ok("1") {
        placement
            .expect_one_aggregating_region(projection)
            .unwrap_or_else(|why| panic!("Q{q}: {why}"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn q01() {
    let placement = check_query(1).await;
    check_aggregating_query(1, &placement, true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn q06() {
    let placement = check_query(6).await;
    check_aggregating_query(6, &placement, false);
}

macro_rules! tpch_queries {
    ($($name:ident: $q:literal),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                check_query($q).await;
            }
        )*
    };
}

tpch_queries! {
    q02: 2, q03: 3, q04: 4, q05: 5, q07: 7, q08: 8, q09: 9, q10: 10, q11: 11, q12: 12,
    q13: 13, q14: 14, q15: 15, q16: 16, q17: 17, q18: 18, q19: 19, q20: 20, q21: 21,
    q22: 22,
}

#[test]
fn query_lists_parse() {
    assert_eq!(tpch::parse_queries("q1,q6").unwrap(), vec![1, 6]);
    assert_eq!(tpch::parse_queries("Q22, 3").unwrap(), vec![22, 3]);
    assert_eq!(tpch::parse_queries("all").unwrap().len(), 22);
    assert!(tpch::parse_queries("q23").is_err());
}

#[test]
fn rows_compare_floats_with_a_tolerance_and_the_rest_exactly() {
    use arrow_array::{Decimal128Array, Float64Array, RecordBatch, StringArray};
    use arrow_schema::{DataType, Field, Schema};
    let schema = Arc::new(Schema::new(vec![
        Field::new("k", DataType::Utf8, false),
        Field::new("d", DataType::Decimal128(15, 2), false),
        Field::new("f", DataType::Float64, true),
    ]));
    let batch = |k: [&str; 2], d: [i128; 2], f: [Option<f64>; 2]| {
        RecordBatch::try_new(
            schema.clone(),
            vec![
                Arc::new(StringArray::from(k.to_vec())),
                Arc::new(
                    Decimal128Array::from(d.to_vec())
                        .with_precision_and_scale(15, 2)
                        .unwrap(),
                ),
                Arc::new(Float64Array::from(f.to_vec())),
            ],
        )
        .unwrap()
    };
    let want = batch(["a", "b"], [100, 250], [Some(1.0), None]);
    // Another order, a float off by 1e-12 relative: equal.
    let got = batch(["b", "a"], [250, 100], [None, Some(1.0 + 1e-12)]);
    assert_eq!(compare_results(&[got], std::slice::from_ref(&want)), Ok(2));
    // A decimal off by one unit in the last place: not equal.
    let got = batch(["a", "b"], [101, 250], [Some(1.0), None]);
    let diff = compare_results(&[got], std::slice::from_ref(&want)).unwrap_err();
    assert!(diff.contains("1.01") && diff.contains("1.00"), "{diff}");
    // A float off by 1e-6 relative: not equal.
    let got = batch(["a", "b"], [100, 250], [Some(1.000001), None]);
    assert!(compare_results(&[got], std::slice::from_ref(&want)).is_err());
    // A row missing.
    assert!(compare_results(&[want.slice(0, 1)], &[want]).is_err());
}
