//! TPC-H Q1 and Q6 with device regions, and Q3, Q4, Q13, Q21 and Q22 with device hash
//! joins, on real Ballista (55, in-process "standalone" mode): the scheduler plans with
//! `DevicePlacementRule` and opens no device; **one executor uses every device of its
//! machine**; the results are checked against DataFusion's, row by row.
//!
//! ```text
//! cargo run --release --features ballista --example ballista_regions -- [SCALE] [PARTITIONS]
//! ```
//!
//! - the 8 tables (tpchgen-arrow, default scale 0.01) are written to Parquet files
//!   (Ballista's executors read tables from files);
//! - hash joins rather than Ballista's default sort-merge joins
//!   (`datafusion.optimizer.prefer_hash_join`), each join the device can run placed there
//!   (`devarrow.always_place_joins`, so that the run covers them): a join's build side
//!   travels to its task through a shuffle, its probe side is the region. Every join is
//!   `Partitioned` (DataFusion's thresholds for collecting a build side set to 0). The
//!   scheduler's plan (`EXPLAIN`, which runs there) must have the device joins too. Then
//!   Q13 with the thresholds at their defaults: its left outer join collects its build
//!   side (DataFusion's plan alone), which Ballista's tasks (each its own copy of the
//!   plan) cannot share, so the rule makes it `Partitioned` first, as Ballista's planner
//!   makes a host one, and places it;
//! - the client's session has the rule, the codec of region nodes
//!   (`DeviceExecCodec`, around Ballista's for the rest) and `devarrow.devices = auto`;
//! - the scheduler cuts the plan into stages: the regions travel as bytes (each
//!   operator as its host twin's protobuf), with no device in them;
//! - the executor decodes each stage with its own codec and runs it. `auto` is read
//!   there, when a partition starts: every CUDA device of that machine (the CPU device
//!   where it has none), each partition on the device running fewest. The example ends
//!   with an error unless every such device ran partitions.
//!
//! Then the same queries under Ballista's adaptive planner (its default), which plans
//! stages with a rule list of its own, so its plans have no region: an executor started
//! as a deployment starts one (`start_executor_process`) with a `DevicePlacementEngine`
//! places the regions in each stage it runs; each query must run partitions on the
//! devices and give DataFusion's rows.
//!
//! On the emulated driver with two devices (`DEVARROW_EMU_DEVICES=2`, as `.ci/datafusion`
//! runs it with `DEVARROW_CI_BALLISTA=1`), the one executor uses both.

use std::error::Error;
use std::sync::Arc;

#[path = "../tests/common/mod.rs"]
mod common;

#[path = "../tests/common/tpch.rs"]
mod tpch;

use ballista::prelude::{SessionConfigExt, SessionContextExt};
use ballista_core::serde::protobuf::scheduler_grpc_client::SchedulerGrpcClient;
use ballista_core::serde::{BallistaLogicalExtensionCodec, BallistaPhysicalExtensionCodec};
use datafusion::arrow::util::pretty::pretty_format_batches;
use datafusion::dataframe::DataFrameWriteOptions;
use datafusion::execution::SessionStateBuilder;
use datafusion::physical_plan::displayable;
use datafusion::prelude::{ParquetReadOptions, SessionConfig, SessionContext};
use devarrow_datafusion::config::{pool_for, DevarrowConfig};

/// The queries run, and whether each must have a device hash join in its plan.
const QUERIES: [(usize, bool); 7] = [
    (1, false),
    (6, false),
    (3, true),
    (4, true),
    (13, true),
    (21, true),
    (22, true),
];
use devarrow_datafusion::{with_device_placement, DeviceExecCodec, ExecDevice, StepRegistry};

use common::*;

/// Ballista's session state, with device regions: the placement rule, the codec of
/// region nodes (other nodes go to Ballista's own codecs) and devarrow's options.
fn state(partitions: usize, adaptive: bool) -> datafusion::execution::SessionState {
    // The codec's own device is for `DeviceExec` steps only (none here); regions choose
    // theirs when they run.
    let physical = Arc::new(
        DeviceExecCodec::new(Arc::new(StepRegistry::new()), ExecDevice::cpu())
            .with_fallback(Arc::new(BallistaPhysicalExtensionCodec::default())),
    );
    // Ballista's adaptive planner (on by default) plans stages with a rule list of its
    // own, without the session's physical optimizer rules: with it, the executor places
    // the regions (`DevicePlacementEngine`); with the static planner, the scheduler does.
    let mut config = SessionConfig::new_with_ballista()
        .with_ballista_adaptive_query_planner(adaptive)
        .with_target_partitions(partitions)
        .with_ballista_standalone_parallelism(partitions)
        .with_ballista_logical_extension_codec(Arc::new(BallistaLogicalExtensionCodec::default()))
        .with_ballista_physical_extension_codec(physical)
        .with_option_extension(DevarrowConfig::default());
    let optimizer = &mut config.options_mut().optimizer;
    optimizer.prefer_hash_join = true;
    optimizer.hash_join_single_partition_threshold = 0;
    optimizer.hash_join_single_partition_threshold_rows = 0;
    if let Some(devarrow) = config.options_mut().extensions.get_mut::<DevarrowConfig>() {
        devarrow.always_place_joins = true;
    }
    with_device_placement(
        SessionStateBuilder::new()
            .with_config(config)
            .with_default_features(),
    )
    .build()
}

/// Rows as sorted text.
fn sorted(batches: &[arrow_array::RecordBatch]) -> Vec<String> {
    let text = pretty_format_batches(batches).unwrap().to_string();
    let mut rows: Vec<String> = text.lines().map(str::to_string).collect();
    rows.sort();
    rows
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let scale: f64 = args.first().map(|s| s.parse()).transpose()?.unwrap_or(0.01);
    let partitions: usize = args.get(1).map(|s| s.parse()).transpose()?.unwrap_or(4);

    let dir =
        std::env::temp_dir().join(format!("devarrow-ballista-regions-{}", std::process::id()));
    let tables = tpch::Tables::generate(scale, partitions);
    let source = SessionContext::new();
    tables.register(&source)?;
    let mut paths = Vec::new();
    for table in &tables.tables {
        let path = dir.join(table.name);
        std::fs::create_dir_all(&path)?;
        let path = path.to_str().ok_or("path")?.to_string();
        source
            .table(table.name)
            .await?
            .write_parquet(&path, DataFrameWriteOptions::new(), None)
            .await?;
        paths.push((table.name, path));
    }

    let state = state(partitions, false);
    let addr = ballista_scheduler::standalone::new_standalone_scheduler_from_state(&state).await?;
    let scheduler_url = format!("http://localhost:{}", addr.port());
    let scheduler = loop {
        match SchedulerGrpcClient::connect(scheduler_url.clone()).await {
            Ok(client) => break client,
            Err(_) => tokio::time::sleep(std::time::Duration::from_millis(100)).await,
        }
    };
    ballista_executor::new_standalone_executor_from_state(scheduler, partitions, &state).await?;
    let ctx = SessionContext::remote_with_state(&scheduler_url, state.clone()).await?;

    // The same plan locally, to show the regions the scheduler plans (planning opens no
    // device); the state's catalog, with the tables, is the client's.
    let local = SessionContext::new_with_state(state.clone());
    let alone = SessionContext::new();
    for (name, path) in &paths {
        for c in [&ctx, &alone] {
            c.register_parquet(*name, path, ParquetReadOptions::default())
                .await?;
        }
    }
    for (q, joins) in QUERIES {
        let sql = tpch::query(q);
        let plan = local.sql(sql).await?.create_physical_plan().await?;
        let text = displayable(plan.as_ref()).indent(false).to_string();
        if !text.contains("DeviceLoadExec") {
            return Err(format!("Q{q} has no device region:\n{text}").into());
        }
        if joins && !text.contains("DeviceHashJoinExec: ") {
            return Err(format!("Q{q} has no device join:\n{text}").into());
        }
        // An executor's `DevicePlacementEngine` (below) runs a plan that has regions as
        // it came.
        let engine = devarrow_datafusion::ballista::DevicePlacementEngine::default();
        if !Arc::ptr_eq(&engine.place(plan.clone(), state.config())?, &plan) {
            return Err(format!("Q{q}: the engine placed regions in a placed plan").into());
        }
        // The plan as the scheduler makes it (EXPLAIN runs there, with the session's
        // settings the client sends).
        let explained = ctx.sql(&format!("EXPLAIN {sql}")).await?.collect().await?;
        let explained = pretty_format_batches(&explained)?.to_string();
        if joins && !explained.contains("DeviceHashJoinExec: ") {
            return Err(format!("Q{q}: the scheduler planned no device join:\n{explained}").into());
        }
        println!("Q{q}, as the scheduler plans it:\n{text}");
        let got = ctx.sql(sql).await?.collect().await?;
        let want = alone.sql(sql).await?.collect().await?;
        if sorted(&got) != sorted(&want) {
            return Err(format!(
                "Q{q} through Ballista differs from DataFusion's:\n{}\n{}",
                pretty_format_batches(&got)?,
                pretty_format_batches(&want)?
            )
            .into());
        }
        println!(
            "Q{q}: {} rows through Ballista equal DataFusion's",
            rows(&got)
        );
    }

    // A collected left outer join (Q13's, DataFusion's thresholds at their defaults,
    // where DataFusion alone collects its build side): each task would emit the build
    // rows it never matched, so the rule makes it `Partitioned` first, as Ballista's
    // planner makes a host one, and places it on the device.
    let sql = tpch::query(13);
    let collected = alone.sql(sql).await?.create_physical_plan().await?;
    let collected = displayable(collected.as_ref()).indent(false).to_string();
    if !collected.contains("mode=CollectLeft, join_type=Left") {
        return Err(format!("Q13 collects no build side alone:\n{collected}").into());
    }
    for c in [&ctx, &local] {
        for set in [
            "set datafusion.optimizer.hash_join_single_partition_threshold = 1048576",
            "set datafusion.optimizer.hash_join_single_partition_threshold_rows = 131072",
        ] {
            c.sql(set).await?.collect().await?;
        }
    }
    let plan = local.sql(sql).await?.create_physical_plan().await?;
    let text = displayable(plan.as_ref()).indent(false).to_string();
    if !text.contains("DeviceHashJoinExec: mode=Partitioned, join_type=Left") {
        return Err(format!("Q13's collected join was not partitioned:\n{text}").into());
    }
    let got = ctx.sql(sql).await?.collect().await?;
    let want = alone.sql(sql).await?.collect().await?;
    if sorted(&got) != sorted(&want) {
        return Err("Q13 with its join partitioned by the rule differs from DataFusion's".into());
    }
    println!("Q13, its collected join partitioned by the rule: rows equal DataFusion's");

    // Every device `auto` names on this machine ran partitions.
    let mut idle = Vec::new();
    for (id, placed) in placed_per_device()? {
        println!("{id}: {placed} partitions placed");
        if placed == 0 {
            idle.push(id);
        }
    }
    if !idle.is_empty() {
        return Err(format!("devices that ran no partition: {}", idle.join(", ")).into());
    }

    adaptive(&paths, partitions, &dir, &alone).await?;
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

/// The partitions each device `auto` names on this machine has run, by its id.
fn placed_per_device() -> Result<Vec<(String, u64)>, Box<dyn Error>> {
    let options = DevarrowConfig::default();
    let mut placed = Vec::new();
    for request in options.device_requests()? {
        let pool = pool_for(request, options.partitions_per_device)?;
        placed.push((pool.id().to_string(), pool.placed()));
    }
    Ok(placed)
}

/// The partitions every device has run.
fn placed() -> Result<u64, Box<dyn Error>> {
    Ok(placed_per_device()?.iter().map(|(_, n)| n).sum())
}

/// A port free now on this machine (the executor's Flight and gRPC services need
/// theirs before they start).
fn free_port() -> Result<u16, Box<dyn Error>> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// The queries again under Ballista's adaptive planner (its default): a scheduler of
/// its own plans every stage with its own rule list, so no region is in its plans; the
/// executor, started as a Ballista deployment starts one (`start_executor_process`) with
/// a `DevicePlacementEngine`, places them in each stage it runs. Each query must run
/// partitions on the devices and give DataFusion's rows.
async fn adaptive(
    paths: &[(&str, String)],
    partitions: usize,
    dir: &std::path::Path,
    alone: &SessionContext,
) -> Result<(), Box<dyn Error>> {
    use ballista_executor::executor_process::{start_executor_process, ExecutorProcessConfig};
    use devarrow_datafusion::ballista::DevicePlacementEngine;

    let state = state(partitions, true);
    let addr = ballista_scheduler::standalone::new_standalone_scheduler_from_state(&state).await?;
    let config = state.config().clone();
    let work_dir = dir.join("adaptive-work");
    std::fs::create_dir_all(&work_dir)?;
    let executor = ExecutorProcessConfig {
        bind_host: "127.0.0.1".into(),
        external_host: Some("localhost".into()),
        port: free_port()?,
        grpc_port: free_port()?,
        scheduler_host: "localhost".into(),
        scheduler_port: addr.port(),
        vcores: partitions,
        // The standalone scheduler's policy: executors poll it for tasks.
        task_scheduling_policy: ballista_core::config::TaskSchedulingPolicy::PullStaged,
        work_dir: Some(work_dir.to_str().ok_or("path")?.to_string()),
        print_thread_info: false,
        override_execution_engine: Some(Arc::new(DevicePlacementEngine::default())),
        override_config_producer: Some(Arc::new(move || config.clone())),
        override_physical_codec: Some(state.config().ballista_physical_extension_codec()),
        ..Default::default()
    };
    tokio::spawn(async move {
        if let Err(e) = start_executor_process(Arc::new(executor)).await {
            eprintln!("the executor stopped: {e}");
        }
    });
    let scheduler_url = format!("http://localhost:{}", addr.port());
    let ctx = SessionContext::remote_with_state(&scheduler_url, state.clone()).await?;
    for (name, path) in paths {
        ctx.register_parquet(*name, path, ParquetReadOptions::default())
            .await?;
    }
    for (q, _) in QUERIES {
        let sql = tpch::query(q);
        // (The scheduler's `EXPLAIN` shows regions even here: it plans the explained
        // stages with the session's rules. The stages it runs are its adaptive
        // planner's, with none: without the engine, no partition runs on a device.)
        let before = placed()?;
        let got = ctx.sql(sql).await?.collect().await?;
        let want = alone.sql(sql).await?.collect().await?;
        if sorted(&got) != sorted(&want) {
            return Err(format!(
                "Q{q} under the adaptive planner differs from DataFusion's:\n{}\n{}",
                pretty_format_batches(&got)?,
                pretty_format_batches(&want)?
            )
            .into());
        }
        let ran = placed()? - before;
        if ran == 0 {
            return Err(
                format!("Q{q} under the adaptive planner ran no partition on a device").into(),
            );
        }
        println!(
            "Q{q}: {} rows under Ballista's adaptive planner equal DataFusion's; the executor \
             placed its regions ({ran} partitions on devices)",
            rows(&got)
        );
    }
    Ok(())
}
