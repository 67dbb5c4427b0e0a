//! DeviceExec on devarrow's CPU device (runs everywhere): results against DataFusion's
//! own, batch boundaries, partitioning and ordering, metrics, typed errors naming the
//! partition, cancellation leaving no device memory, and the codec.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arrow_array::{Array, Int64Array, RecordBatch};
use arrow_schema::{DataType, Field, Schema, SchemaRef, SortOptions};
use datafusion::common::stats::Precision;
use datafusion::common::ColumnStatistics;
use datafusion::config::ConfigOptions;
use datafusion::dataframe::DataFrame;
use datafusion::datasource::memory::{DataSourceExec, MemorySourceConfig};
use datafusion::datasource::MemTable;
use datafusion::execution::SessionStateBuilder;
use datafusion::functions_aggregate::expr_fn::{count, sum};
use datafusion::physical_expr::expressions::col;
use datafusion::physical_expr::PhysicalSortExpr;
use datafusion::physical_optimizer::ensure_requirements::EnsureRequirements;
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_plan::repartition::RepartitionExec;
use datafusion::physical_plan::sorts::sort::SortExec;
use datafusion::physical_plan::statistics::StatisticsArgs;
use datafusion::physical_plan::{
    collect, collect_partitioned, displayable, ExecutionPlan, ExecutionPlanProperties, Partitioning,
};
use datafusion::prelude::{col as dfcol, lit, SessionConfig, SessionContext};
use datafusion_proto::bytes::{
    physical_plan_from_bytes_with_extension_codec, physical_plan_to_bytes_with_extension_codec,
};
use devarrow::abi::device::CpuDevice;
use devarrow::bridge::{DeviceBatch, Transfer, TransferOptions};
use devarrow_datafusion::revenue::revenue_step;
use devarrow_datafusion::{
    DeviceExec, DeviceExecCodec, DeviceExecError, DevicePlanner, DeviceStep, DeviceStepNode,
    ExecDevice, StepRegistry,
};
use futures::StreamExt;

use common::*;

const SCALE: f64 = 0.01;

#[tokio::test]
async fn revenue_on_the_cpu_device_is_datafusions() {
    let ctx = session(lineitem(SCALE, 3, 8192));
    let plan = device_plan(&ctx, ExecDevice::cpu()).await.unwrap();
    assert_eq!(
        partitions_of(plan.as_ref()),
        partitions_of(plan.input().as_ref())
    );
    let out = collect(plan.clone(), ctx.task_ctx()).await.unwrap();
    let expected = datafusion_revenue(&ctx).await.unwrap();
    let n = check_against_datafusion(&out, &expected);
    assert!(n > 50_000, "{n} rows");
    // The input's columns come first, as they were; revenue is appended.
    let input_schema = plan.input().schema();
    assert_eq!(
        &out[0].schema().fields()[..input_schema.fields().len()],
        &input_schema.fields()[..]
    );
    assert_eq!(
        out[0].schema().field(input_schema.fields().len()).name(),
        "revenue"
    );

    // Metrics: rows out, bytes both ways, the step's and the download's times.
    let metrics = plan.metrics().unwrap();
    assert_eq!(metrics.output_rows(), Some(n));
    let sum = |name: &str| {
        metrics
            .sum_by_name(name)
            .unwrap_or_else(|| panic!("metric {name}"))
            .as_usize()
    };
    // Two Decimal128 columns up (16 bytes a row each), one down.
    assert!(
        sum("bytes_to_device") >= n * 32,
        "{}",
        sum("bytes_to_device")
    );
    assert!(
        sum("bytes_from_device") >= n * 16,
        "{}",
        sum("bytes_from_device")
    );
    assert!(sum("device_step") > 0 && sum("download") > 0);
}

#[tokio::test]
async fn batches_partitions_and_order_are_the_inputs() {
    let ctx = session(lineitem(SCALE, 2, 1000));
    let scan = scan_plan(&ctx).await.unwrap();
    // Sorted partitions: the DeviceExec must claim the same ordering.
    let ordering = [PhysicalSortExpr::new(
        col("l_extendedprice", &scan.schema()).unwrap(),
        SortOptions::default(),
    )];
    let sorted: Arc<dyn ExecutionPlan> =
        Arc::new(SortExec::new(ordering.into(), scan).with_preserve_partitioning(true));
    let step = Arc::new(revenue_step());
    let plan: Arc<dyn ExecutionPlan> = Arc::new(
        DeviceExec::try_new(sorted.clone(), step, ExecDevice::cpu())
            .unwrap()
            .with_read_ahead(1),
    );
    // (DataFusion's `UnknownPartitioning` is equal to nothing, itself included.)
    assert!(matches!(
        sorted.output_partitioning(),
        Partitioning::UnknownPartitioning(2)
    ));
    assert!(matches!(
        plan.output_partitioning(),
        Partitioning::UnknownPartitioning(2)
    ));
    let l_extendedprice_asc = sorted.output_ordering().expect("sorted").clone();
    assert_eq!(plan.output_ordering(), Some(&l_extendedprice_asc));
    // A hash partitioning on an input column is kept, structurally.
    let hash = Partitioning::Hash(vec![col("l_orderkey", &sorted.schema()).unwrap()], 3);
    let hashed = Arc::new(RepartitionExec::try_new(sorted.clone(), hash.clone()).unwrap());
    let over_hashed =
        DeviceExec::try_new(hashed, Arc::new(revenue_step()), ExecDevice::cpu()).unwrap();
    assert_eq!(over_hashed.properties().partitioning, hash);
    let inputs = collect_partitioned(sorted, ctx.task_ctx()).await.unwrap();
    let outputs = collect_partitioned(plan, ctx.task_ctx()).await.unwrap();
    assert_eq!(outputs.len(), inputs.len());
    for (input, output) in inputs.iter().zip(&outputs) {
        let input: Vec<_> = input.iter().filter(|b| b.num_rows() > 0).collect();
        assert_eq!(output.len(), input.len(), "one batch out per batch in");
        for (i, o) in input.iter().zip(output) {
            assert_eq!(i.num_rows(), o.num_rows());
            for c in 0..i.num_columns() {
                assert_eq!(i.column(c), o.column(c), "column {c} as it came in");
            }
        }
    }
}

/// The revenue step, failing on one partition's second batch.
fn failing_step(partition: usize) -> DeviceStep {
    let revenue = revenue_step();
    DeviceStep::new("fails.on.one.partition", move |batch, cx| {
        if cx.partition == partition && cx.batch == 1 {
            return Err(format!("kernel failed on partition {}", cx.partition).into());
        }
        revenue.run(batch, cx)
    })
    .with_inputs(["l_extendedprice", "l_discount"])
    .appending(vec![devarrow_datafusion::revenue::revenue_field()])
}

#[tokio::test]
async fn a_failing_step_fails_the_query_naming_the_partition() {
    let ctx = session(lineitem(SCALE, 3, 4096));
    let scan = scan_plan(&ctx).await.unwrap();
    let plan =
        Arc::new(DeviceExec::try_new(scan, Arc::new(failing_step(2)), ExecDevice::cpu()).unwrap());
    let error = collect(plan, ctx.task_ctx()).await.unwrap_err();
    let found = DeviceExecError::find(&error).unwrap_or_else(|| panic!("not typed: {error}"));
    match found {
        DeviceExecError::Step {
            step,
            partition,
            batch,
            source,
        } => {
            assert_eq!(
                (step.as_str(), *partition, *batch),
                ("fails.on.one.partition", 2, 1)
            );
            assert!(source.to_string().contains("kernel failed"), "{source}");
        }
        other => panic!("{other}"),
    }
    assert_eq!(found.partition(), Some(2));
    assert!(error.to_string().contains("partition 2"), "{error}");
}

#[tokio::test]
async fn a_step_returning_the_wrong_columns_is_a_typed_error() {
    let ctx = session(lineitem(SCALE, 1, 4096));
    let scan = scan_plan(&ctx).await.unwrap();
    // Declares an Int64 column, returns the uploaded batch unchanged.
    let step = DeviceStep::new("identity", |batch, _| Ok(batch))
        .with_inputs(["l_discount"])
        .appending(vec![arrow_schema::Field::new(
            "x",
            arrow_schema::DataType::Int64,
            false,
        )]);
    let plan = Arc::new(DeviceExec::try_new(scan, Arc::new(step), ExecDevice::cpu()).unwrap());
    let error = collect(plan, ctx.task_ctx()).await.unwrap_err();
    assert!(
        matches!(
            DeviceExecError::find(&error),
            Some(DeviceExecError::OutputSchema { partition: 0, .. })
        ),
        "{error}"
    );
}

#[tokio::test]
async fn a_step_needing_a_missing_column_is_refused_at_planning() {
    let ctx = session(lineitem(SCALE, 1, 4096));
    let scan = ctx
        .sql("SELECT l_orderkey FROM lineitem")
        .await
        .unwrap()
        .create_physical_plan()
        .await
        .unwrap();
    let error = DeviceExec::try_new(scan, Arc::new(revenue_step()), ExecDevice::cpu()).unwrap_err();
    assert!(
        matches!(
            DeviceExecError::find(&error),
            Some(DeviceExecError::Input { .. })
        ),
        "{error}"
    );
}

/// Waits (a hang guard, 10 s) until the CPU device's pool has no block in use.
fn wait_for_no_device_memory(device: &CpuDevice) -> usize {
    let start = Instant::now();
    loop {
        let in_use = device.memory_pool_stats().in_use_bytes;
        if in_use == 0 || start.elapsed() > Duration::from_secs(10) {
            return in_use;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_a_partition_stream_leaves_no_device_memory() {
    let ctx = session(lineitem(SCALE, 2, 1024));
    let cpu = Arc::new(CpuDevice::new());
    let plan = device_plan(&ctx, ExecDevice::from_cpu(cpu.clone()))
        .await
        .unwrap();
    let plan = Arc::new(
        DeviceExec::try_new(
            plan.input().clone(),
            plan.step().clone(),
            plan.device().clone(),
        )
        .unwrap()
        .with_read_ahead(8),
    );
    assert_eq!(cpu.memory_pool_stats().in_use_bytes, 0);
    for partition in 0..2 {
        let mut stream = plan.execute(partition, ctx.task_ctx()).unwrap();
        let first = stream.next().await.unwrap().unwrap();
        assert!(first.num_rows() > 0);
        // Let the read-ahead fill: uploads hold device memory now.
        let start = Instant::now();
        while cpu.memory_pool_stats().in_use_bytes == 0 && start.elapsed() < Duration::from_secs(5)
        {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        assert!(
            cpu.memory_pool_stats().in_use_bytes > 0,
            "uploads ahead hold memory"
        );
        let start = Instant::now();
        drop(stream);
        // The drop joins nothing on this (runtime) thread; the partition's threads end on
        // their own and free everything.
        assert!(
            start.elapsed() < Duration::from_millis(200),
            "the drop waited"
        );
        assert_eq!(wait_for_no_device_memory(&cpu), 0, "partition {partition}");
        drop(first);
    }
    // Device batches handed on, dropped mid-stream.
    let mut device_batches = plan.execute_device(1, ctx.task_ctx()).unwrap();
    let one = device_batches.next().await.unwrap().unwrap();
    assert_eq!(one.schema().field(0).name(), "revenue");
    drop(one);
    drop(device_batches);
    assert_eq!(wait_for_no_device_memory(&cpu), 0);
}

#[tokio::test]
async fn a_cancelled_query_leaves_no_device_memory() {
    let ctx = session(lineitem(SCALE, 3, 1024));
    let cpu = Arc::new(CpuDevice::new());
    let plan = device_plan(&ctx, ExecDevice::from_cpu(cpu.clone()))
        .await
        .unwrap();
    let seen = Arc::new(AtomicUsize::new(0));
    let task = {
        let (plan, ctx, seen) = (plan.clone(), ctx.task_ctx(), seen.clone());
        tokio::spawn(async move {
            let mut stream = datafusion::physical_plan::execute_stream(plan, ctx).unwrap();
            while let Some(batch) = stream.next().await {
                batch.unwrap();
                seen.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
    };
    while seen.load(Ordering::SeqCst) < 3 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    task.abort();
    assert!(task.await.unwrap_err().is_cancelled());
    assert_eq!(wait_for_no_device_memory(&cpu), 0);
}

#[tokio::test]
async fn the_codec_ships_the_step_by_name_to_each_device() {
    let ctx = session(lineitem(SCALE, 2, 4096));
    let plan = device_plan(&ctx, ExecDevice::cpu()).await.unwrap();
    let registry = Arc::new(StepRegistry::new());
    registry.register(revenue_step());
    // The "client" encodes; an "executor" decodes onto its own device.
    let client = DeviceExecCodec::new(registry.clone(), ExecDevice::cpu());
    let bytes = physical_plan_to_bytes_with_extension_codec(plan.clone(), &client).unwrap();
    let executor_device = Arc::new(CpuDevice::new());
    let executor = DeviceExecCodec::new(registry, ExecDevice::from_cpu(executor_device.clone()));
    let decoded =
        physical_plan_from_bytes_with_extension_codec(&bytes, &ctx.task_ctx(), &executor).unwrap();
    let node = decoded.downcast_ref::<DeviceExec>().expect("a DeviceExec");
    assert_eq!(node.step().name(), "tpch.revenue");
    assert_eq!(node.read_ahead(), plan.read_ahead());
    assert_eq!(node.schema(), plan.schema());
    let out = collect(decoded, ctx.task_ctx()).await.unwrap();
    check_against_datafusion(&out, &datafusion_revenue(&ctx).await.unwrap());
    assert!(
        executor_device.memory_pool_stats().hits + executor_device.memory_pool_stats().misses > 0,
        "ran on the executor's device"
    );

    // An executor without the step: a typed error naming it.
    let bare = DeviceExecCodec::new(Arc::new(StepRegistry::new()), ExecDevice::cpu());
    let error =
        physical_plan_from_bytes_with_extension_codec(&bytes, &ctx.task_ctx(), &bare).unwrap_err();
    assert!(
        error.to_string().contains("no device step `tpch.revenue`"),
        "{error}"
    );
}

#[test]
fn devices_open_by_name() {
    assert_eq!(ExecDevice::open("cpu").unwrap().id(), "cpu");
    assert!(matches!(
        ExecDevice::open("gpu"),
        Err(DeviceExecError::Device { .. })
    ));
    // `auto` is a GPU when there is one, else the CPU device.
    let auto = ExecDevice::open("auto").unwrap();
    assert!(auto.id() == "cpu" || auto.id().starts_with("cuda:"));
}

#[tokio::test]
async fn a_logical_device_step_plans_into_a_device_exec_and_ships_by_name() {
    use datafusion::logical_expr::{Extension, UserDefinedLogicalNode};
    use datafusion_proto::logical_plan::{DefaultLogicalExtensionCodec, LogicalExtensionCodec};
    use devarrow_datafusion::DeviceLogicalCodec;

    let registry = Arc::new(StepRegistry::new());
    let step = registry.register(revenue_step());
    let cpu = Arc::new(CpuDevice::new());
    let planner = DevicePlanner::new(registry.clone(), ExecDevice::from_cpu(cpu.clone()));
    let state = SessionStateBuilder::new()
        .with_default_features()
        .with_config(SessionConfig::new().with_target_partitions(2))
        .with_query_planner(Arc::new(planner))
        .build();
    let ctx = SessionContext::new_with_state(state);
    register_lineitem(&ctx, lineitem(SCALE, 2, 4096));

    let scan = ctx.sql(SCAN).await.unwrap();
    let node = DeviceStepNode::try_new(scan.logical_plan().clone(), &step).unwrap();
    let df = DataFrame::new(ctx.state(), node.clone().into_plan());
    let physical = df.clone().create_physical_plan().await.unwrap();
    let shown = displayable(physical.as_ref()).indent(false).to_string();
    assert!(
        shown.contains("DeviceExec: step=tpch.revenue, device=cpu"),
        "{shown}"
    );
    let out = df.collect().await.unwrap();
    check_against_datafusion(&out, &datafusion_revenue(&ctx).await.unwrap());
    assert!(
        cpu.memory_pool_stats().misses > 0,
        "ran on the planner's device"
    );

    // The logical codec: the node goes by the step's name, other nodes to the inner codec.
    let codec = DeviceLogicalCodec::new(registry, Arc::new(DefaultLogicalExtensionCodec {}));
    let mut buf = Vec::new();
    let extension = Extension {
        node: Arc::new(node.clone()),
    };
    codec.try_encode(&extension, &mut buf).unwrap();
    let decoded = codec
        .try_decode(&buf, &[scan.logical_plan().clone()], &ctx.task_ctx())
        .unwrap();
    let decoded = decoded
        .node
        .as_any()
        .downcast_ref::<DeviceStepNode>()
        .unwrap();
    assert_eq!(decoded, &node);
    assert!(UserDefinedLogicalNode::schema(decoded)
        .field_with_unqualified_name("revenue")
        .is_ok());
}

/// A step computing on the host what a kernel would compute on the device: the batch
/// downloaded, `f` applied, the result imported back onto the CPU device.
fn host_step(
    name: &str,
    f: impl Fn(&RecordBatch) -> RecordBatch + Send + Sync + 'static,
) -> DeviceStep {
    DeviceStep::new(name, move |batch, cx| {
        let mut transfer = Transfer::new(cx.device.device().clone(), TransferOptions::default());
        let out = f(&transfer.to_host(&batch)?);
        let (array, _schema) = devarrow::abi::cpu::export_record_batch(&out)?;
        Ok(DeviceBatch::import(
            cx.device.device().clone(),
            array,
            out.schema(),
        )?)
    })
}

/// `batch` with its Int64 column `name` mapped by `f`.
fn map_column(batch: &RecordBatch, name: &str, f: impl Fn(i64) -> i64) -> RecordBatch {
    let index = batch.schema().index_of(name).unwrap();
    let mut columns = batch.columns().to_vec();
    let values = columns[index]
        .as_any()
        .downcast_ref::<Int64Array>()
        .unwrap();
    columns[index] = Arc::new(values.unary::<_, arrow_array::types::Int64Type>(&f));
    RecordBatch::try_new(batch.schema(), columns).unwrap()
}

/// t(k Int64, v Int64): `partitions` partitions of batches of 10 rows; k ascending in
/// each partition (declared to DataFusion when `sorted`), v = k * 10 + 7.
fn int_table(partitions: usize, batches: usize) -> (SchemaRef, Vec<Vec<RecordBatch>>) {
    let schema = Arc::new(Schema::new(vec![
        Field::new("k", DataType::Int64, false),
        Field::new("v", DataType::Int64, false),
    ]));
    let data = (0..partitions)
        .map(|p| {
            (0..batches)
                .map(|b| {
                    let start = ((p * batches + b) * 10) as i64;
                    let k = Int64Array::from_iter_values(start..start + 10);
                    let v = Int64Array::from_iter_values((start..start + 10).map(|k| k * 10 + 7));
                    RecordBatch::try_new(schema.clone(), vec![Arc::new(k), Arc::new(v)]).unwrap()
                })
                .collect()
        })
        .collect();
    (schema, data)
}

fn int_source(partitions: usize, sorted: bool) -> Arc<dyn ExecutionPlan> {
    let (schema, data) = int_table(partitions, 3);
    let mut source = MemorySourceConfig::try_new(&data, schema.clone(), None).unwrap();
    if sorted {
        let k_asc = PhysicalSortExpr::new(col("k", &schema).unwrap(), SortOptions::default());
        source = source
            .try_with_sort_information(vec![[k_asc].into()])
            .unwrap();
    }
    DataSourceExec::from_data_source(source)
}

/// The Int64 column `name` of each partition.
fn int_column(partitions: &[Vec<RecordBatch>], name: &str) -> Vec<Vec<i64>> {
    partitions
        .iter()
        .map(|batches| {
            batches
                .iter()
                .flat_map(|b| {
                    let column = b.column_by_name(name).unwrap();
                    let values = column.as_any().downcast_ref::<Int64Array>().unwrap();
                    values.values().to_vec()
                })
                .collect()
        })
        .collect()
}

fn is_sorted(values: &[i64]) -> bool {
    values.windows(2).all(|w| w[0] <= w[1])
}

/// `SortExec(k)` over a DeviceExec over `source`, through DataFusion's
/// `EnsureRequirements` (EnforceDistribution and EnforceSorting), run.
async fn sorted_by_k_above(step: DeviceStep, source: Arc<dyn ExecutionPlan>) -> Vec<Vec<i64>> {
    let device: Arc<dyn ExecutionPlan> =
        Arc::new(DeviceExec::try_new(source, Arc::new(step), ExecDevice::cpu()).unwrap());
    let k_asc = PhysicalSortExpr::new(col("k", &device.schema()).unwrap(), SortOptions::default());
    let sort = Arc::new(SortExec::new([k_asc].into(), device).with_preserve_partitioning(true));
    let plan = EnsureRequirements::new()
        .optimize(sort, &ConfigOptions::new())
        .unwrap();
    let ctx = SessionContext::new();
    int_column(
        &collect_partitioned(plan, ctx.task_ctx()).await.unwrap(),
        "k",
    )
}

#[tokio::test]
async fn a_step_rewriting_a_sort_key_claims_no_order() {
    let negate = || host_step("negate.k", |b| map_column(b, "k", |k| -k));
    // The input sorted by k: the node must not claim k's order (the sort would go).
    for (i, k) in sorted_by_k_above(negate(), int_source(2, true))
        .await
        .iter()
        .enumerate()
    {
        assert!(is_sorted(k), "partition {i} is not sorted by k: {k:?}");
    }
    // The input unsorted: the sort must stay above the node (not pushed below it).
    for (i, k) in sorted_by_k_above(negate(), int_source(2, false))
        .await
        .iter()
        .enumerate()
    {
        assert!(is_sorted(k), "partition {i} is not sorted by k: {k:?}");
    }

    // Neither claimed: no ordering, and no pushing a sort on k below the node.
    let node =
        DeviceExec::try_new(int_source(2, true), Arc::new(negate()), ExecDevice::cpu()).unwrap();
    assert!(node.properties().output_ordering().is_none());
    assert_eq!(node.maintains_input_order(), vec![false]);
    // Declared: a monotone rewrite of k keeps its order (the sort goes), and a column
    // left untouched keeps its order too.
    let double = host_step("double.k", |b| map_column(b, "k", |k| 2 * k)).preserves_order();
    let node =
        DeviceExec::try_new(int_source(2, true), Arc::new(double), ExecDevice::cpu()).unwrap();
    assert_eq!(
        node.properties().output_ordering().map(|o| o.to_string()),
        Some("k@0 ASC".to_string())
    );
    assert_eq!(node.maintains_input_order(), vec![true]);
    let keeps_v = negate().with_inputs(["k", "v"]).leaves_untouched(["v"]);
    let (schema, data) = int_table(2, 3);
    let v_asc = PhysicalSortExpr::new(col("v", &schema).unwrap(), SortOptions::default());
    let source = MemorySourceConfig::try_new(&data, schema, None)
        .unwrap()
        .try_with_sort_information(vec![[v_asc].into()])
        .unwrap();
    let node = DeviceExec::try_new(
        DataSourceExec::from_data_source(source),
        Arc::new(keeps_v),
        ExecDevice::cpu(),
    )
    .unwrap();
    assert_eq!(
        node.properties().output_ordering().map(|o| o.to_string()),
        Some("v@1 ASC".to_string())
    );
    // Only v is kept: a sort on k above must not be pushed below.
    assert_eq!(node.maintains_input_order(), vec![false]);
}

/// A session planning `DeviceStepNode`s with `registry`'s steps on the CPU device.
fn device_session(registry: Arc<StepRegistry>, partitions: usize) -> SessionContext {
    let planner = DevicePlanner::new(registry, ExecDevice::cpu());
    let state = SessionStateBuilder::new()
        .with_default_features()
        .with_config(SessionConfig::new().with_target_partitions(partitions))
        .with_query_planner(Arc::new(planner))
        .build();
    SessionContext::new_with_state(state)
}

#[tokio::test]
async fn a_step_rewriting_a_hash_key_claims_no_partitioning() {
    // `SELECT k, sum(n) FROM (step over SELECT k, count(*) AS n FROM t GROUP BY k) GROUP
    // BY k`, the step bucketing k (k % 2): the inner aggregate's output is hash
    // partitioned on k, which the bucketed k is not; the outer aggregate needs a
    // repartition on the new k, or each partition sums its own buckets.
    let registry = Arc::new(StepRegistry::new());
    let bucket = registry.register(host_step("bucket.k", |b| map_column(b, "k", |k| k % 2)));
    let ctx = device_session(registry, 4);
    let (schema, data) = int_table(4, 3);
    ctx.register_table("t", Arc::new(MemTable::try_new(schema, data).unwrap()))
        .unwrap();
    let inner = ctx
        .table("t")
        .await
        .unwrap()
        .aggregate(vec![dfcol("k")], vec![count(lit(1)).alias("n")])
        .unwrap();
    let node = DeviceStepNode::try_new(inner.logical_plan().clone(), &bucket).unwrap();
    let outer = DataFrame::new(ctx.state(), node.into_plan())
        .aggregate(vec![dfcol("k")], vec![sum(dfcol("n")).alias("n")])
        .unwrap();
    let physical = outer.clone().create_physical_plan().await.unwrap();
    let shown = displayable(physical.as_ref()).indent(false).to_string();
    let out = outer.collect().await.unwrap();
    let mut groups: Vec<(i64, i64)> = out
        .iter()
        .flat_map(|b| {
            let k = b.column(0).as_any().downcast_ref::<Int64Array>().unwrap();
            let n = b.column(1).as_any().downcast_ref::<Int64Array>().unwrap();
            (0..b.num_rows()).map(move |i| (k.value(i), n.value(i)))
        })
        .collect();
    groups.sort();
    assert_eq!(groups, vec![(0, 60), (1, 60)], "{shown}");

    // The node's partitioning: unknown, of the child's count; a step declaring it
    // keeps the key column keeps the child's hash partitioning.
    let (schema, data) = int_table(2, 3);
    let source = MemorySourceConfig::try_new_exec(&data, schema.clone(), None).unwrap();
    let hash = Partitioning::Hash(vec![col("k", &schema).unwrap()], 3);
    let repartitioned: Arc<dyn ExecutionPlan> =
        Arc::new(RepartitionExec::try_new(source, hash.clone()).unwrap());
    let rewrites_k = host_step("bucket.k", |b| map_column(b, "k", |k| k % 2));
    let node = DeviceExec::try_new(
        repartitioned.clone(),
        Arc::new(rewrites_k),
        ExecDevice::cpu(),
    )
    .unwrap();
    assert!(matches!(
        &node.properties().partitioning,
        Partitioning::UnknownPartitioning(3)
    ));
    let keeps_k = host_step("bucket.v", |b| map_column(b, "v", |v| v % 2)).leaves_untouched(["k"]);
    let node =
        DeviceExec::try_new(repartitioned.clone(), Arc::new(keeps_k), ExecDevice::cpu()).unwrap();
    assert_eq!(node.properties().partitioning, hash);
    let keeps_keys =
        host_step("bucket.v", |b| map_column(b, "v", |v| v % 2)).preserves_partitioning();
    let node = DeviceExec::try_new(
        repartitioned.clone(),
        Arc::new(keeps_keys),
        ExecDevice::cpu(),
    )
    .unwrap();
    assert_eq!(node.properties().partitioning, hash);
    // A column declared untouched must be there.
    let wrong = host_step("bucket.v", |b| b.clone()).leaves_untouched(["nope"]);
    let error = DeviceExec::try_new(repartitioned, Arc::new(wrong), ExecDevice::cpu()).unwrap_err();
    assert!(
        matches!(
            DeviceExecError::find(&error),
            Some(DeviceExecError::Input { .. })
        ),
        "{error}"
    );
}

#[tokio::test]
async fn statistics_are_the_childs_for_untouched_columns_only() {
    // 2 partitions of 3 batches of 10 rows: 60 rows, exact.
    let stats_of = |plan: &dyn ExecutionPlan| {
        datafusion::physical_plan::statistics::StatisticsContext::new()
            .compute(plan, &StatisticsArgs::new())
            .unwrap()
    };
    let source = int_source(2, false);
    let source_stats = stats_of(source.as_ref());
    assert_eq!(source_stats.num_rows, Precision::Exact(60));
    assert_eq!(
        source_stats.column_statistics[0].null_count,
        Precision::Exact(0)
    );

    // Appending: the input's columns as they were, the appended one unknown.
    let appended = Field::new("w", DataType::Int64, false);
    let append = host_step("append.w", |b| {
        let w = b.column_by_name("k").unwrap().clone();
        let schema = Arc::new(Schema::new(vec![Field::new("w", DataType::Int64, false)]));
        RecordBatch::try_new(schema, vec![w]).unwrap()
    })
    .with_inputs(["k"])
    .appending(vec![appended]);
    let node = DeviceExec::try_new(source.clone(), Arc::new(append), ExecDevice::cpu()).unwrap();
    let stats = stats_of(&node);
    assert_eq!(stats.num_rows, Precision::Exact(60));
    assert_eq!(stats.column_statistics.len(), 3);
    for c in 0..2 {
        assert_eq!(stats.column_statistics[c].null_count, Precision::Exact(0));
    }
    assert_eq!(stats.column_statistics[2], ColumnStatistics::new_unknown());

    // Rewriting k, keeping the schema and declaring v untouched: k's statistics unknown.
    let rewrite = host_step("negate.k", |b| map_column(b, "k", |k| -k)).leaves_untouched(["v"]);
    let node = DeviceExec::try_new(source, Arc::new(rewrite), ExecDevice::cpu()).unwrap();
    let stats = stats_of(&node);
    assert_eq!(stats.num_rows, Precision::Exact(60));
    assert_eq!(stats.column_statistics[0], ColumnStatistics::new_unknown());
    assert_eq!(stats.column_statistics[1].null_count, Precision::Exact(0));
}

#[tokio::test]
async fn execute_device_holds_no_host_batches() {
    // One partition of many batches (no filter: no coalescing), an appending step.
    let ctx = session(lineitem(SCALE, 1, 512));
    let scan = ctx
        .sql("SELECT l_orderkey, l_linenumber, l_extendedprice, l_discount FROM lineitem")
        .await
        .unwrap()
        .create_physical_plan()
        .await
        .unwrap();
    let plan = DeviceExec::try_new(scan, Arc::new(revenue_step()), ExecDevice::cpu()).unwrap();
    let pool = ctx.runtime_env().memory_pool.clone();
    let mut device_batches = plan.execute_device(0, ctx.task_ctx()).unwrap();
    let mut n = 0;
    while let Some(batch) = device_batches.next().await {
        drop(batch.unwrap());
        n += 1;
        // The input's columns are never handed on here: none is kept.
        assert_eq!(pool.reserved(), 0, "host memory held after {n} batches");
    }
    assert!(n > 50, "{n} batches");
    drop(device_batches);

    // `execute` joins each input batch with its output and lets it go: the queue's
    // memory (accounted in the pool while the batches wait) is back to none at the end.
    let mut host_batches = plan.execute(0, ctx.task_ctx()).unwrap();
    let mut rows = 0;
    while let Some(batch) = host_batches.next().await {
        rows += batch.unwrap().num_rows();
    }
    assert!(rows > 0);
    assert_eq!(pool.reserved(), 0, "host memory held after the last batch");
}

#[tokio::test]
async fn elapsed_compute_covers_the_step_and_the_download() {
    let ctx = session(lineitem(SCALE, 2, 8192));
    let scan = scan_plan(&ctx).await.unwrap();
    let revenue = revenue_step();
    // The revenue step, 5 ms slower per batch.
    let slow = DeviceStep::new("slow.revenue", move |batch, cx| {
        std::thread::sleep(Duration::from_millis(5));
        revenue.run(batch, cx)
    })
    .with_inputs(["l_extendedprice", "l_discount"])
    .appending(vec![devarrow_datafusion::revenue::revenue_field()]);
    let plan = Arc::new(DeviceExec::try_new(scan, Arc::new(slow), ExecDevice::cpu()).unwrap());
    let batches = collect(plan.clone(), ctx.task_ctx()).await.unwrap().len();
    let metrics = plan.metrics().unwrap();
    let nanos = |name: &str| metrics.sum_by_name(name).unwrap().as_usize();
    let (compute, step, download) = (
        metrics.elapsed_compute().unwrap(),
        nanos("device_step"),
        nanos("download"),
    );
    assert!(
        step >= batches * 5_000_000,
        "device_step {step} ns, {batches} batches"
    );
    assert!(download > 0);
    assert!(
        compute >= step + download,
        "elapsed_compute {compute} ns < device_step {step} ns + download {download} ns"
    );
}

/// The step and the download never run on a tokio worker: on a one-thread runtime, a
/// ticker keeps ticking while a slow step (40 ms a batch) runs. Before the download and
/// the step moved off the runtime, the ticker stalled for each batch.
#[test]
fn a_slow_step_never_blocks_the_runtime() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    runtime.block_on(async {
        let ctx = session(lineitem(0.002, 1, 512));
        let scan = scan_plan(&ctx).await.unwrap();
        let step = DeviceStep::new("slow", |batch, _| {
            std::thread::sleep(Duration::from_millis(40));
            Ok(batch)
        });
        let plan = Arc::new(DeviceExec::try_new(scan, Arc::new(step), ExecDevice::cpu()).unwrap());
        let ticks = Arc::new(AtomicUsize::new(0));
        let ticker = {
            let ticks = ticks.clone();
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    ticks.fetch_add(1, Ordering::SeqCst);
                }
            })
        };
        let start = Instant::now();
        let batches = collect(plan, ctx.task_ctx()).await.unwrap();
        let elapsed = start.elapsed();
        ticker.abort();
        assert!(batches.len() >= 2, "{} batches", batches.len());
        let ticks = ticks.load(Ordering::SeqCst);
        assert!(
            ticks as u128 >= elapsed.as_millis() / 8,
            "{ticks} ticks in {elapsed:?}"
        );
    });
}
