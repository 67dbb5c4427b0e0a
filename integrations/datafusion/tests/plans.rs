//! devarrow's own device operators in TPC-H Q1 and Q6 (`tests/common/tpch.rs`) on the
//! CPU device: the plans the
//! rule makes (snapshots of `EXPLAIN`: one region each, the filter, the projection and
//! the partial aggregate on the device) and their results, DataFusion's alone.

mod common;

#[path = "common/tpch.rs"]
mod tpch;

use std::sync::Arc;

use arrow_array::RecordBatch;
use datafusion::arrow::util::pretty::pretty_format_batches;
use datafusion::physical_plan::{collect, displayable, ExecutionPlan};
use datafusion::prelude::{SessionConfig, SessionContext};
use devarrow_datafusion::device_session;

use common::{lineitem, register_lineitem};

fn device_ctx(partitions: Vec<Vec<RecordBatch>>) -> SessionContext {
    let ctx = device_session(SessionConfig::new().with_target_partitions(partitions.len()));
    register_lineitem(&ctx, partitions);
    ctx
}

async fn plan(ctx: &SessionContext, sql: &str) -> Arc<dyn ExecutionPlan> {
    ctx.sql(sql)
        .await
        .unwrap()
        .create_physical_plan()
        .await
        .unwrap()
}

/// Runs `sql` (a `SET`) on `ctx` to the end.
async fn run(ctx: &SessionContext, sql: &str) {
    ctx.sql(sql).await.unwrap().collect().await.unwrap();
}

fn text(plan: &Arc<dyn ExecutionPlan>) -> String {
    displayable(plan.as_ref()).indent(false).to_string()
}

async fn check(name: &str, sql: &str) {
    check_regions(name, sql, 1).await;
}

/// `sql`'s plan on the CPU device matches snapshot `name`, has `regions` regions (a
/// load and an unload each) and nothing left on the host, and gives DataFusion's rows
/// alone; the plan's text.
async fn check_regions(name: &str, sql: &str, regions: usize) -> String {
    let data = lineitem(0.01, 2, 2048);
    let ctx = device_ctx(data.clone());
    run(&ctx, "SET devarrow.devices = 'cpu'").await;
    let device_plan = plan(&ctx, sql).await;
    let shown = text(&device_plan);
    insta::assert_snapshot!(name, shown);
    assert_eq!(shown.matches("DeviceLoadExec").count(), regions, "{shown}");
    assert_eq!(
        shown.matches("DeviceUnloadExec").count(),
        regions,
        "{shown}"
    );
    assert!(!shown.contains("HostOnlyExec"), "{shown}");
    let got = collect(device_plan, ctx.task_ctx()).await.unwrap();
    let want = common::datafusion_alone(data, sql).await;
    // Ordered queries: the same rows in the same order, every value equal.
    assert_eq!(
        pretty_format_batches(&got).unwrap().to_string(),
        pretty_format_batches(&want).unwrap().to_string()
    );
    shown
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn q1_runs_its_filter_projection_and_partial_aggregate_on_the_device() {
    check("q1", tpch::query(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn q6_runs_its_filter_projection_and_partial_aggregate_on_the_device() {
    check("q6", tpch::query(6)).await;
}

/// Long string group keys (TPC-H's `l_shipinstruct`, "DELIVER IN PERSON") group on the
/// device: no batch falls back to the host, and the results are DataFusion's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_string_keys_are_aggregated_on_the_device() {
    let data = lineitem(0.005, 2, 2048);
    let sql = "select l_shipinstruct, sum(l_quantity) as q, count(*) as n from lineitem \
               where l_quantity > 10 group by l_shipinstruct order by l_shipinstruct";
    let (fallbacks, _) = aggregated(data, sql).await;
    assert_eq!(fallbacks, 0, "long keys group on the device");
}

/// A batch the device cannot group (two different long keys of one 64-bit hash, crafted)
/// falls back to the host, counted, with DataFusion's results.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_colliding_string_keys_is_aggregated_on_the_host() {
    use arrow_array::{ArrayRef, StringViewArray};
    let (a, b) = common::colliding_strings();
    // lineitem's rows, with `l_shipinstruct` replaced by the two strings in turn.
    let data: Vec<Vec<RecordBatch>> = lineitem(0.002, 2, 2048)
        .into_iter()
        .map(|p| {
            p.into_iter()
                .map(|batch| {
                    let n = batch.num_rows();
                    let keys = StringViewArray::from_iter_values((0..n).map(|i| {
                        if i % 2 == 0 {
                            a.as_str()
                        } else {
                            b.as_str()
                        }
                    }));
                    let i = batch.schema().index_of("l_shipinstruct").unwrap();
                    let mut columns = batch.columns().to_vec();
                    columns[i] = Arc::new(keys) as ArrayRef;
                    RecordBatch::try_new(batch.schema(), columns).unwrap()
                })
                .collect()
        })
        .collect();
    let sql = "select l_shipinstruct, sum(l_quantity) as q, count(*) as n from lineitem \
               where l_quantity > 10 group by l_shipinstruct order by l_shipinstruct";
    let (fallbacks, down) = aggregated(data, sql).await;
    assert!(
        fallbacks > 0,
        "the colliding keys' batches fell back to the host"
    );
    // What they brought down crossed the link: counted.
    assert!(down > 0, "the fallback's download is not counted");
}

/// `sql` (a grouped aggregate) over `data` with the rule on the CPU device, its results
/// DataFusion's: the batches its partial aggregate left to the host, and the bytes it
/// brought down.
async fn aggregated(data: Vec<Vec<RecordBatch>>, sql: &str) -> (usize, usize) {
    let ctx = device_ctx(data.clone());
    run(&ctx, "SET devarrow.devices = 'cpu'").await;
    let device_plan = plan(&ctx, sql).await;
    assert!(text(&device_plan).contains("DevicePartialAggregateExec"));
    let got = collect(device_plan.clone(), ctx.task_ctx()).await.unwrap();
    let want = common::datafusion_alone(data, sql).await;
    assert_eq!(
        pretty_format_batches(&got).unwrap().to_string(),
        pretty_format_batches(&want).unwrap().to_string()
    );
    let (mut fallbacks, mut down) = (0, 0);
    let mut stack = vec![device_plan];
    while let Some(node) = stack.pop() {
        if let Some(m) = node.metrics() {
            let sum = |name| m.sum_by_name(name).map_or(0, |v| v.as_usize());
            fallbacks += sum("host_fallback_batches");
            if node.name() == "DevicePartialAggregateExec" {
                down += sum("bytes_from_device");
            }
        }
        stack.extend(node.children().into_iter().cloned());
    }
    (fallbacks, down)
}

/// A region that ends in a filter compacts its rows on the device: only the rows the
/// filter keeps cross the link (about a tenth here), and the result is DataFusion's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_region_ending_in_a_filter_brings_back_only_the_kept_rows() {
    brings_back_only_the_kept_rows(
        "SELECT l_orderkey, l_quantity, l_extendedprice FROM lineitem \
         WHERE l_quantity > 45 ORDER BY l_orderkey, l_extendedprice",
    )
    .await;
}

/// The same with strings (views, inline and long), booleans and dates among the columns:
/// they are compacted on the device too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strings_and_booleans_are_compacted_before_the_download() {
    brings_back_only_the_kept_rows(
        "SELECT l_orderkey, l_linenumber, l_shipmode, l_comment, l_returnflag, l_shipdate, \
         l_quantity > 48 AS most FROM lineitem WHERE l_quantity > 45 \
         ORDER BY l_orderkey, l_linenumber",
    )
    .await;
}

async fn brings_back_only_the_kept_rows(sql: &str) {
    let data = lineitem(0.01, 2, 2048);
    let ctx = device_ctx(data.clone());
    run(&ctx, "SET devarrow.devices = 'cpu'").await;
    let device_plan = plan(&ctx, sql).await;
    let shown = text(&device_plan);
    assert!(shown.contains("DeviceFilterExec"), "{shown}");
    let got = collect(device_plan.clone(), ctx.task_ctx()).await.unwrap();
    let want = common::datafusion_alone(data, sql).await;
    assert_eq!(
        pretty_format_batches(&got).unwrap().to_string(),
        pretty_format_batches(&want).unwrap().to_string()
    );
    let up = tpch::metric_sum(&device_plan, "DeviceLoadExec", "bytes_to_device");
    let down = tpch::metric_sum(&device_plan, "DeviceUnloadExec", "bytes_from_device");
    assert!(
        tpch::metric_sum(&device_plan, "DeviceUnloadExec", "compacted_batches") > 0,
        "{shown}"
    );
    assert!(down * 5 < up, "{down} bytes down for {up} up");
}

/// TPC-H Q22 filters customers by an uncorrelated scalar subquery (`c_acctbal > (select
/// avg(c_acctbal) ...)`) on the device, its value read when the plan runs, with
/// DataFusion's results. DataFusion's protobuf decodes a scalar subquery only inside its
/// `ScalarSubqueryExec`, never from a device node's bytes: the codec refuses to encode
/// that filter, saying why, and on Ballista (whose tasks decode their plans) the rule
/// keeps the subquery's conjunct on the host, over a device filter of the others (the
/// country codes), where the plan round-trips and gives the same rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn q22_filters_by_its_scalar_subquery_on_the_device_but_not_on_ballista() {
    use datafusion_proto::bytes::{
        physical_plan_from_bytes_with_extension_codec, physical_plan_to_bytes_with_extension_codec,
    };
    use devarrow_datafusion::rule::DeviceOperatorRegistry;
    use devarrow_datafusion::{DeviceExecCodec, ExecDevice, StepRegistry};

    let tables = tpch::Tables::generate(0.01, 2);
    let want = tpch::host_results(&tables, 2, tpch::query(22))
        .await
        .unwrap();
    let want = pretty_format_batches(&want).unwrap().to_string();
    let codec = DeviceExecCodec::new(Arc::new(StepRegistry::new()), ExecDevice::cpu())
        .with_operators(DeviceOperatorRegistry::default());
    let reads_subquery = |shown: &str, node: &str| {
        shown
            .lines()
            .any(|l| l.contains(node) && l.contains("scalar_subquery"))
    };

    let ctx = tpch::device_session_on(&tables, 2, "cpu").await.unwrap();
    let device_plan = tpch::plan_query(&ctx, 22).await.unwrap();
    let shown = text(&device_plan);
    assert!(reads_subquery(&shown, "DeviceFilterExec"), "{shown}");
    let got = collect(device_plan.clone(), ctx.task_ctx()).await.unwrap();
    assert_eq!(pretty_format_batches(&got).unwrap().to_string(), want);
    let refused = physical_plan_to_bytes_with_extension_codec(device_plan, &codec).unwrap_err();
    assert!(refused.to_string().contains("scalar subquery"), "{refused}");

    let config = SessionConfig::new()
        .with_target_partitions(2)
        .with_option_extension(BallistaLike::default());
    let ctx = device_session(config);
    run(&ctx, "SET devarrow.devices = 'cpu'").await;
    tables.register(&ctx).unwrap();
    let ballista_plan = tpch::plan_query(&ctx, 22).await.unwrap();
    let shown = text(&ballista_plan);
    assert!(!reads_subquery(&shown, "DeviceFilterExec"), "{shown}");
    assert!(
        shown.contains("HostOnlyExec: FilterExec stays on the host: it reads a scalar subquery"),
        "{shown}"
    );
    // The customer filter's other conjunct (the country codes) runs on the device,
    // below the host filter of the subquery's (the subquery's own filter reads
    // `c_acctbal > 0.00` too).
    assert!(
        shown.lines().any(|l| l.contains("DeviceFilterExec")
            && l.contains("substr(c_phone")
            && !l.contains("c_acctbal")),
        "{shown}"
    );
    let bytes = physical_plan_to_bytes_with_extension_codec(ballista_plan, &codec).unwrap();
    let back =
        physical_plan_from_bytes_with_extension_codec(&bytes, &ctx.task_ctx(), &codec).unwrap();
    let got = collect(back, ctx.task_ctx()).await.unwrap();
    assert_eq!(pretty_format_batches(&got).unwrap().to_string(), want);
}

/// TPC-H Q22 over `Utf8` tables (arrow-rs `StringArray`s, as in-memory tables hold
/// them): its country code, `substring(c_phone from 1 for 2)`, is computed on the device
/// as a `Utf8` column (offsets and bytes written there), so the projection joins the
/// customer filter's region and the partial aggregate groups by it on the device. Before,
/// `substr` of a `Utf8` column kept its projection on the host. The results are
/// DataFusion's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn q22_over_utf8_computes_its_country_codes_on_the_device() {
    let tables = tpch::Tables::generate(0.01, 2).with_strings(&arrow_schema::DataType::Utf8);
    let want = tpch::host_results(&tables, 2, tpch::query(22))
        .await
        .unwrap();
    let ctx = tpch::device_session_on(&tables, 2, "cpu").await.unwrap();
    let plan = tpch::plan_query(&ctx, 22).await.unwrap();
    let shown = text(&plan);
    assert!(
        shown
            .lines()
            .any(|l| l.contains("DeviceProjectionExec") && l.contains("substr")),
        "{shown}"
    );
    assert!(
        !shown.contains("ProjectionExec stays on the host"),
        "{shown}"
    );
    let got = collect(plan, ctx.task_ctx()).await.unwrap();
    assert_eq!(
        pretty_format_batches(&got).unwrap().to_string(),
        pretty_format_batches(&want).unwrap().to_string()
    );
}

/// TPC-H Q3: both joins on the device, each with its build side a host child (itself a
/// region's output) and its probe side in the region, which runs on from the lineitem
/// filter through the join into the partial aggregate: lineitem's rows never come back
/// to the host. The results are DataFusion's; the plan round-trips through the codec
/// (a device operator with two children).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn q3_joins_on_the_device_and_round_trips_through_the_codec() {
    use datafusion_proto::bytes::{
        physical_plan_from_bytes_with_extension_codec, physical_plan_to_bytes_with_extension_codec,
    };
    use devarrow_datafusion::rule::DeviceOperatorRegistry;
    use devarrow_datafusion::{DeviceExecCodec, ExecDevice, StepRegistry};

    let tables = tpch::Tables::generate(0.01, 2);
    let ctx = tpch::device_session_on(&tables, 2, "cpu").await.unwrap();
    let device_plan = tpch::plan_query(&ctx, 3).await.unwrap();
    let shown = text(&device_plan);
    insta::assert_snapshot!("q3", shown);
    assert_eq!(shown.matches("DeviceHashJoinExec").count(), 2, "{shown}");
    assert!(
        shown.contains("DevicePartialAggregateExec: mode=Partial, gby=[l_orderkey@2 as l_orderkey"),
        "{shown}"
    );
    // Encoded before it runs (a run fills in the TopK's dynamic filter).
    let codec = DeviceExecCodec::new(Arc::new(StepRegistry::new()), ExecDevice::cpu())
        .with_operators(DeviceOperatorRegistry::default());
    let bytes = physical_plan_to_bytes_with_extension_codec(device_plan.clone(), &codec).unwrap();
    let back =
        physical_plan_from_bytes_with_extension_codec(&bytes, &ctx.task_ctx(), &codec).unwrap();
    assert_eq!(text(&back), shown);
    let got = collect(device_plan.clone(), ctx.task_ctx()).await.unwrap();
    let want = tpch::host_results(&tables, 2, tpch::query(3))
        .await
        .unwrap();
    assert_eq!(
        pretty_format_batches(&got).unwrap().to_string(),
        pretty_format_batches(&want).unwrap().to_string()
    );

    let again = collect(back, ctx.task_ctx()).await.unwrap();
    assert_eq!(
        pretty_format_batches(&again).unwrap().to_string(),
        pretty_format_batches(&want).unwrap().to_string()
    );
}

/// A join that collects its build side reads it once per query, whatever the number of
/// partitions that probe it: its build child's `output_rows` are the build side's rows,
/// not one copy per partition; and its host table is built once
/// (`host_tables_built`), each partition uploading it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_collected_build_side_is_read_once_per_query() {
    use devarrow_datafusion::region::DeviceOperatorExec;

    let tables = tpch::Tables::generate(0.01, 4);
    let ctx = tpch::device_session_on(&tables, 4, "cpu").await.unwrap();
    // The device joins that collect their build side, and their build children.
    let builds = |plan: &Arc<dyn ExecutionPlan>| {
        let mut builds = Vec::new();
        let mut stack = vec![plan.clone()];
        while let Some(node) = stack.pop() {
            if let Some(op) = node.downcast_ref::<DeviceOperatorExec>() {
                if op.operator().name() == "DeviceHashJoinExec"
                    && text(&node).contains("mode=CollectLeft")
                {
                    builds.push(op.host_inputs().next().unwrap().1.clone());
                }
            }
            stack.extend(node.children().into_iter().cloned());
        }
        builds
    };
    // The rows of each build side, from another plan of the query (its own metrics).
    let mut rows = Vec::new();
    for build in builds(&tpch::plan_query(&ctx, 3).await.unwrap()) {
        let batches = collect(build, ctx.task_ctx()).await.unwrap();
        rows.push(batches.iter().map(|b| b.num_rows()).sum::<usize>());
    }
    let device_plan = tpch::plan_query(&ctx, 3).await.unwrap();
    let read = builds(&device_plan);
    assert_eq!(read.len(), 2, "{}", text(&device_plan));
    collect(device_plan.clone(), ctx.task_ctx()).await.unwrap();
    for (build, rows) in read.iter().zip(&rows) {
        let output_rows = build
            .metrics()
            .and_then(|m| m.output_rows())
            .unwrap_or_default();
        assert_eq!(output_rows, *rows, "{}", text(build));
    }
    // Each join's host table built once (by one partition; the others upload it).
    assert_eq!(
        tpch::metric_sum(&device_plan, "DeviceHashJoinExec", "host_tables_built"),
        read.len(),
        "{}",
        text(&device_plan)
    );
    // Each partition of each join timed its build side's read and its bind.
    let analyzed = datafusion::physical_plan::display::DisplayableExecutionPlan::with_metrics(
        device_plan.as_ref(),
    )
    .indent(false)
    .to_string();
    for name in ["host_input_time", "bind_time"] {
        assert_eq!(
            analyzed.matches(&format!("{name}=")).count(),
            read.len(),
            "{analyzed}"
        );
        assert!(
            tpch::metric_sum(&device_plan, "DeviceHashJoinExec", name) > 0,
            "{name}: {analyzed}"
        );
    }
}

/// Where a join would only add bytes on the link, the rule leaves it on the host and
/// says why: here the join's output (orders' strings added to lineitem's rows) goes
/// straight back to the host. `devarrow.always_place_joins` puts it on the device
/// anyway, with the same results.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_join_that_would_add_link_bytes_stays_on_the_host_saying_why() {
    let tables = tpch::Tables::generate(0.01, 2);
    let ctx = tpch::device_session_on(&tables, 2, "cpu").await.unwrap();
    let sql = "select l_orderkey, o_orderdate, o_clerk, o_comment from lineitem \
               join orders on l_orderkey = o_orderkey where l_quantity > 45";
    let want = tpch::host_results(&tables, 2, sql).await.unwrap();
    for always in [false, true] {
        run(&ctx, &format!("set devarrow.always_place_joins = {always}")).await;
        let device_plan = plan(&ctx, sql).await;
        let shown = text(&device_plan);
        if always {
            assert!(shown.contains("DeviceHashJoinExec"), "{shown}");
        } else {
            assert!(!shown.contains("DeviceHashJoinExec"), "{shown}");
            assert!(
                shown.contains("HostOnlyExec: HashJoinExec stays on the host: its output would go straight back to the host"),
                "{shown}"
            );
        }
        let got = collect(device_plan, ctx.task_ctx()).await.unwrap();
        tpch::compare_results(&got, &want).unwrap();
    }
}

datafusion::common::extensions_options! {
    /// Stands for Ballista's options (its config extension's `ballista.` prefix): the
    /// session the scheduler plans stages with.
    struct BallistaLike {
        /// Any option.
        pub job_name: String, default = String::new()
    }
}

impl datafusion::common::config::ConfigExtension for BallistaLike {
    const PREFIX: &'static str = "ballista";
}

/// A join whose partitions share state (a collected build side whose matched rows the
/// last partition emits: left semi, anti and outer joins) cannot run as it is where the
/// session is Ballista's (each task runs its own copy of the stage's plan, and Ballista
/// makes such a host join `Partitioned`, which it cannot through a device node): the rule
/// makes it `Partitioned` first, as Ballista does (each side hash-repartitioned on its
/// keys), then places it on the device. In one process it is collected, on the device.
/// Each gives DataFusion's rows.
#[tokio::test]
async fn a_join_whose_partitions_share_state_is_partitioned_on_ballista() {
    use arrow_array::{ArrayRef, Int32Array};
    use datafusion::datasource::MemTable;

    let batch = |name: &str, values: Vec<i32>| {
        RecordBatch::try_from_iter([(name, Arc::new(Int32Array::from(values)) as ArrayRef)])
            .unwrap()
    };
    let sql = "select d.k from dim d where exists (select 1 from fact f where f.fk = d.k)";
    for (ballista, collected) in [(false, true), (true, true), (true, false)] {
        let mut config = SessionConfig::new().with_target_partitions(2);
        if ballista {
            config = config.with_option_extension(BallistaLike::default());
        }
        let ctx = device_session(config);
        let mut sets = vec![
            "set datafusion.optimizer.join_reordering = false",
            "set devarrow.always_place_joins = true",
        ];
        if !collected {
            sets.push("set datafusion.optimizer.hash_join_single_partition_threshold = 0");
            sets.push("set datafusion.optimizer.hash_join_single_partition_threshold_rows = 0");
        }
        for set in sets {
            ctx.sql(set).await.unwrap().collect().await.unwrap();
        }
        let dim = batch("k", (0..20).collect());
        let fact = MemTable::try_new(
            batch("fk", vec![]).schema(),
            vec![
                vec![batch("fk", vec![1, 3, 5])],
                vec![batch("fk", vec![7, 30])],
            ],
        )
        .unwrap();
        let dim = MemTable::try_new(dim.schema(), vec![vec![dim]]).unwrap();
        ctx.register_table("dim", Arc::new(dim)).unwrap();
        ctx.register_table("fact", Arc::new(fact)).unwrap();
        let plan = plan(&ctx, sql).await;
        let shown = text(&plan);
        assert!(!shown.contains("HostOnlyExec"), "{shown}");
        let mode = match (ballista, collected) {
            (false, _) => "CollectLeft",
            (true, _) => "Partitioned",
        };
        assert!(
            shown.contains(&format!("DeviceHashJoinExec: mode={mode}")),
            "{shown}"
        );
        // Demoted: each side repartitioned by its key, as Ballista's planner does.
        if ballista && collected {
            assert_eq!(
                shown.matches("RepartitionExec: partitioning=Hash").count(),
                2,
                "{shown}"
            );
        }
        let got = collect(plan, ctx.task_ctx()).await.unwrap();
        let rows = pretty_format_batches(&got).unwrap().to_string();
        assert_eq!(got.iter().map(|b| b.num_rows()).sum::<usize>(), 4, "{rows}");
    }
}

/// A join whose build side DataFusion's statistics estimate larger than its probe side
/// and its output together stays on the host, saying so: uploading that build side would
/// move more than the host join (here the build side is a 1.6 MiB table, the probe side
/// 10 rows). `devarrow.always_place_joins` places it anyway, with the same rows.
#[tokio::test]
async fn a_join_with_a_build_side_heavier_than_its_probe_side_stays_on_the_host() {
    use arrow_array::{ArrayRef, Int64Array};
    use datafusion::datasource::MemTable;

    let ctx = device_session(SessionConfig::new().with_target_partitions(2));
    let plain = SessionContext::new_with_config(SessionConfig::new().with_target_partitions(2));
    let rows = 100_000;
    let big = RecordBatch::try_from_iter([
        (
            "k",
            Arc::new(Int64Array::from_iter_values(0..rows)) as ArrayRef,
        ),
        (
            "v",
            Arc::new(Int64Array::from_iter_values((0..rows).map(|i| i * 3))),
        ),
    ])
    .unwrap();
    let small = RecordBatch::try_from_iter([(
        "fk",
        Arc::new(Int64Array::from_iter_values((0..10).map(|i| i * 7))) as ArrayRef,
    )])
    .unwrap();
    for c in [&ctx, &plain] {
        for (name, batch) in [("big", big.clone()), ("small", small.clone())] {
            let table = MemTable::try_new(batch.schema(), vec![vec![batch]]).unwrap();
            c.register_table(name, Arc::new(table)).unwrap();
        }
        // The build side as written: `big`.
        run(c, "set datafusion.optimizer.join_reordering = false").await;
    }
    // A filter on the probe side puts it in a region, under the join.
    let sql = "select s.fk, b.v from big b join (select fk from small where fk > 6) s \
               on s.fk = b.k";
    let want = plain.sql(sql).await.unwrap().collect().await.unwrap();
    for every_join in [false, true] {
        run(
            &ctx,
            &format!("set devarrow.always_place_joins = {every_join}"),
        )
        .await;
        let plan = plan(&ctx, sql).await;
        let shown = text(&plan);
        assert_eq!(
            shown.contains("its build side (about 1.5 MiB by DataFusion's statistics)"),
            !every_join,
            "{shown}"
        );
        assert_eq!(
            shown.contains("DeviceHashJoinExec: "),
            every_join,
            "{shown}"
        );
        let got = collect(plan, ctx.task_ctx()).await.unwrap();
        assert_eq!(
            pretty_format_batches(&got)
                .unwrap()
                .to_string()
                .lines()
                .count(),
            pretty_format_batches(&want)
                .unwrap()
                .to_string()
                .lines()
                .count()
        );
    }
}

/// A region of projections alone goes back to the host, saying why (it would take its
/// input up and its output down for row-by-row work); a projection in a region with a
/// filter stays, and the results are DataFusion's either way.
#[tokio::test]
async fn a_region_of_projections_alone_stays_on_the_host() {
    let data = lineitem(0.01, 2, 2048);
    let ctx = device_ctx(data.clone());
    for (sql, region) in [
        (
            "SELECT l_extendedprice * (1 - l_discount) AS price, l_quantity + 1 AS q \
             FROM lineitem",
            false,
        ),
        (
            "SELECT l_extendedprice * (1 - l_discount) AS price FROM lineitem \
             WHERE l_quantity > 45",
            true,
        ),
    ] {
        let device_plan = plan(&ctx, sql).await;
        let shown = text(&device_plan);
        assert_eq!(
            shown.contains("DeviceProjectionExec"),
            region,
            "{sql}\n{shown}"
        );
        assert_eq!(
            shown.contains("a region of projections alone"),
            !region,
            "{sql}\n{shown}"
        );
        let got = collect(device_plan, ctx.task_ctx()).await.unwrap();
        let want = common::datafusion_alone(data.clone(), sql).await;
        let rows = |b: &[RecordBatch]| b.iter().map(RecordBatch::num_rows).sum::<usize>();
        assert_eq!(rows(&got), rows(&want), "{sql}");
    }
}

/// With `devarrow.min_region_bytes`, a region that would upload fewer bytes (by
/// DataFusion's statistics) goes back to the host whole, saying why; at 0 (the default)
/// or below what it uploads, it stays. The results are DataFusion's either way.
#[tokio::test]
async fn a_region_under_min_region_bytes_stays_on_the_host() {
    let data = lineitem(0.01, 2, 2048);
    let ctx = device_ctx(data.clone());
    let sql = "SELECT l_returnflag, sum(l_extendedprice * (1 - l_discount)) AS revenue \
               FROM lineitem WHERE l_quantity < 24 GROUP BY l_returnflag ORDER BY l_returnflag";
    let want = common::datafusion_alone(data, sql).await;
    for (min, region) in [
        (None, true),
        (Some(0usize), true),
        (Some(1), true),
        (Some(1 << 40), false),
    ] {
        if let Some(min) = min {
            run(&ctx, &format!("SET devarrow.min_region_bytes = {min}")).await;
        }
        let device_plan = plan(&ctx, sql).await;
        let shown = text(&device_plan);
        assert_eq!(
            shown.contains("DeviceUnloadExec"),
            region,
            "{min:?}\n{shown}"
        );
        assert_eq!(
            shown.contains("under devarrow.min_region_bytes (1048576.0 MiB)"),
            !region,
            "{min:?}\n{shown}"
        );
        let got = collect(device_plan, ctx.task_ctx()).await.unwrap();
        assert_eq!(
            pretty_format_batches(&got).unwrap().to_string(),
            pretty_format_batches(&want).unwrap().to_string(),
            "{min:?}"
        );
    }
}

/// A partial aggregate over a `UNION ALL` of two device regions joins each of them:
/// each region filters, projects and aggregates before its unload, where a region over
/// the union would have taken both children's rows down and up again (an unload, the
/// union, a load). The results are DataFusion's alone.
#[tokio::test]
async fn a_partial_aggregate_over_a_union_joins_each_childs_region() {
    let sql = "SELECT l_returnflag, sum(l_quantity) AS q, count(*) AS n FROM ( \
                 SELECT l_returnflag, l_quantity FROM lineitem WHERE l_quantity < 10 \
                 UNION ALL \
                 SELECT l_returnflag, l_quantity * 2 FROM lineitem WHERE l_discount > 0.05) \
               GROUP BY l_returnflag ORDER BY l_returnflag";
    let shown = check_regions("union_partial_aggregate", sql, 2).await;
    assert_eq!(
        shown.matches("DevicePartialAggregateExec").count(),
        2,
        "{shown}"
    );
}
