//! Device regions on the CPU device: the rule's placement (snapshots of `EXPLAIN`),
//! results against DataFusion alone, devices chosen when the plan runs, memory
//! reservations, the per-device limit, coalescing, cancellation and a runtime that is
//! never blocked.
//!
//! The operators here are the tests' own (`tests/common/host_eval.rs`: a registered
//! factory, as an engine would add one), so that the region's plumbing is tested apart from
//! devarrow's device kernels (`tests/compute.rs`, `tests/tpch.rs`).

mod common;

#[path = "common/host_eval.rs"]
mod host_eval;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arrow_array::RecordBatch;
use datafusion::arrow::util::pretty::pretty_format_batches;
use datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;
use datafusion::physical_plan::execution_plan::replace_children_if_necessary;
use datafusion::physical_plan::{collect, displayable, execute_stream, ExecutionPlan};
use datafusion::prelude::SessionContext;
use devarrow::abi::device::CpuDevice;
use devarrow_datafusion::config::DevicePool;
use devarrow_datafusion::DeviceExecError;
use futures::StreamExt;

use common::lineitem;
use host_eval::{session_with, HostEvalFactory};

const QUERY: &str =
    "SELECT l_orderkey, l_linenumber, l_extendedprice * (1 - l_discount) AS revenue \
                     FROM lineitem WHERE l_quantity > 10";

async fn plan_of(ctx: &SessionContext, sql: &str) -> Arc<dyn ExecutionPlan> {
    ctx.sql(sql)
        .await
        .unwrap()
        .create_physical_plan()
        .await
        .unwrap()
}

fn text(plan: &Arc<dyn ExecutionPlan>) -> String {
    displayable(plan.as_ref()).indent(false).to_string()
}

async fn set(ctx: &SessionContext, option: &str, value: &str) {
    ctx.sql(&format!("SET devarrow.{option} = '{value}'"))
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
}

/// Rows as sorted text: equal results, whatever the order.
fn sorted_rows(batches: &[RecordBatch]) -> Vec<String> {
    let text = pretty_format_batches(batches).unwrap().to_string();
    let mut rows: Vec<String> = text
        .lines()
        .filter(|l| l.starts_with('|'))
        .skip(1)
        .map(str::to_string)
        .collect();
    rows.sort();
    rows
}

#[tokio::test]
async fn adjacent_device_nodes_make_one_region() {
    let ctx = session_with(
        HostEvalFactory::default(),
        None,
        None,
        lineitem(0.001, 1, 1024),
    );
    let plan = plan_of(&ctx, QUERY).await;
    insta::assert_snapshot!("filter_projection_region", text(&plan));
    let text = text(&plan);
    assert_eq!(text.matches("DeviceLoadExec").count(), 1, "{text}");
    assert_eq!(text.matches("DeviceUnloadExec").count(), 1, "{text}");
}

#[tokio::test]
async fn a_node_without_a_device_operator_stays_on_the_host_saying_why() {
    let ctx = session_with(
        HostEvalFactory::default(),
        None,
        None,
        lineitem(0.001, 1, 1024),
    );
    let plan = plan_of(
        &ctx,
        "SELECT l_orderkey, l_quantity * 2 AS no_device FROM lineitem WHERE l_quantity > 10",
    )
    .await;
    insta::assert_snapshot!("host_only_reason", text(&plan));
    let text = text(&plan);
    assert!(
        text.contains("HostOnlyExec: ProjectionExec stays on the host: column `no_device` has no device operator"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_region_gives_datafusions_results() {
    let data = lineitem(0.01, 3, 1000);
    let ctx = session_with(HostEvalFactory::default(), None, None, data.clone());
    set(&ctx, "devices", "cpu").await;
    let plain = common::session(data);
    let want = plain.sql(QUERY).await.unwrap().collect().await.unwrap();
    let got = ctx.sql(QUERY).await.unwrap().collect().await.unwrap();
    assert_eq!(sorted_rows(&got), sorted_rows(&want));
    assert!(common::rows(&got) > 1000);
}

#[tokio::test]
async fn devices_are_chosen_when_the_plan_runs_not_when_it_is_planned() {
    let ctx = session_with(
        HostEvalFactory::default(),
        None,
        None,
        lineitem(0.001, 1, 1024),
    );
    // Planned for a device this machine cannot have: planning opens no device.
    set(&ctx, "devices", "cuda:97").await;
    let plan = plan_of(&ctx, QUERY).await;
    let error = collect(plan.clone(), ctx.task_ctx()).await.unwrap_err();
    assert!(
        matches!(
            DeviceExecError::find(&error),
            Some(DeviceExecError::Device { .. })
        ),
        "{error}"
    );
    // The same plan, run where the session says `cpu`.
    set(&ctx, "devices", "cpu").await;
    let batches = collect(plan, ctx.task_ctx()).await.unwrap();
    assert!(common::rows(&batches) > 0);
    // A string outside the grammar is a typed error when the plan runs.
    set(&ctx, "devices", "tpu:0").await;
    let plan = plan_of(&ctx, QUERY).await;
    let error = collect(plan, ctx.task_ctx()).await.unwrap_err();
    assert!(
        matches!(
            DeviceExecError::find(&error),
            Some(DeviceExecError::Config(_))
        ),
        "{error}"
    );
}

/// Waits (a hang guard, 10 s) until the CPU device's pool has `bytes` in use.
fn wait_for_device_memory(device: &CpuDevice, bytes: usize) -> usize {
    let start = Instant::now();
    loop {
        let in_use = device.memory_pool_stats().in_use_bytes;
        if in_use == bytes || start.elapsed() > Duration::from_secs(10) {
            return in_use;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_reservation_is_a_typed_error_and_leaks_nothing() {
    let cpu = Arc::new(CpuDevice::new());
    let pool = Arc::new(DevicePool::cpu(cpu.clone(), 2));
    let before = cpu.memory_pool_stats().in_use_bytes;
    let ctx = session_with(
        HostEvalFactory::default(),
        Some(vec![pool]),
        Some(256 << 10),
        lineitem(0.01, 2, 8192),
    );
    set(&ctx, "batch_bytes", &(4 << 20).to_string()).await;
    let error = ctx.sql(QUERY).await.unwrap().collect().await.unwrap_err();
    assert!(
        matches!(
            DeviceExecError::find(&error),
            Some(DeviceExecError::Memory { .. })
        ),
        "{error}"
    );
    assert_eq!(wait_for_device_memory(&cpu, before), before);
}

/// The load's `bytes_to_device` of `plan`'s region.
fn bytes_to_device(plan: &Arc<dyn ExecutionPlan>) -> usize {
    let mut stack = vec![plan.clone()];
    while let Some(node) = stack.pop() {
        if node.name() == "DeviceLoadExec" {
            return node
                .metrics()
                .unwrap()
                .sum_by_name("bytes_to_device")
                .map_or(0, |v| v.as_usize());
        }
        stack.extend(node.children().into_iter().cloned());
    }
    panic!("no load in the plan")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn columns_computed_inside_a_region_are_reserved() {
    // One batch of one partition: one upload. Its projection holds 4 MiB of device memory
    // beyond what was uploaded; a pool with room for the upload and 2 MiB more refuses
    // it, and one with room for 8 MiB more admits it and ends with nothing reserved.
    let scratch = 4 << 20;
    let data = lineitem(0.002, 1, 1 << 20);
    assert_eq!(data[0].len(), 1);
    let factory = || HostEvalFactory {
        scratch_bytes: scratch,
        ..Default::default()
    };
    let cpu = Arc::new(CpuDevice::new());
    let pool = Arc::new(DevicePool::cpu(cpu.clone(), 1));
    let before = cpu.memory_pool_stats().in_use_bytes;
    let unlimited = session_with(factory(), Some(vec![pool.clone()]), None, data.clone());
    let plan = plan_of(&unlimited, QUERY).await;
    let want = collect(plan.clone(), unlimited.task_ctx()).await.unwrap();
    let uploaded = bytes_to_device(&plan);
    assert!(uploaded > 0);

    let tight = session_with(
        factory(),
        Some(vec![pool.clone()]),
        Some(uploaded + (2 << 20)),
        data.clone(),
    );
    let error = tight.sql(QUERY).await.unwrap().collect().await.unwrap_err();
    match DeviceExecError::find(&error) {
        Some(DeviceExecError::Memory { bytes, .. }) => assert!(*bytes > 2 << 20, "{error}"),
        _ => panic!("a memory error, not {error}"),
    }
    assert_eq!(wait_for_device_memory(&cpu, before), before);

    let roomy = session_with(
        factory(),
        Some(vec![pool]),
        Some(uploaded + (8 << 20)),
        data,
    );
    let got = roomy.sql(QUERY).await.unwrap().collect().await.unwrap();
    assert_eq!(sorted_rows(&got), sorted_rows(&want));
    assert_eq!(roomy.runtime_env().memory_pool.reserved(), 0);
    assert_eq!(wait_for_device_memory(&cpu, before), before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn partitions_beyond_the_per_device_limit_wait_for_a_slot() {
    let cpu = Arc::new(CpuDevice::new());
    let pool = Arc::new(DevicePool::cpu(cpu.clone(), 1));
    let factory = HostEvalFactory {
        delay: Duration::from_millis(2),
        ..Default::default()
    };
    let running = factory.running.clone();
    let data = lineitem(0.005, 4, 1000);
    let ctx = session_with(factory, Some(vec![pool.clone()]), None, data.clone());
    set(&ctx, "batch_bytes", "0").await;
    let got = ctx.sql(QUERY).await.unwrap().collect().await.unwrap();
    assert_eq!(
        running.most.load(Ordering::SeqCst),
        1,
        "one partition at a time"
    );
    let want = common::datafusion_alone(data, QUERY).await;
    assert_eq!(sorted_rows(&got), sorted_rows(&want));
    assert_eq!(pool.in_use(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_batches_are_coalesced_before_the_upload() {
    let data = lineitem(0.01, 1, 512);
    let input_batches = data[0].len();
    let ctx = session_with(HostEvalFactory::default(), None, None, data);
    set(&ctx, "devices", "cpu").await;
    let uploaded = |plan: &Arc<dyn ExecutionPlan>| -> (usize, usize) {
        let mut found = None;
        let mut stack = vec![plan.clone()];
        while let Some(node) = stack.pop() {
            if node.name() == "DeviceLoadExec" {
                let m = node.metrics().unwrap();
                let get = |name: &str| {
                    m.sum_by_name(name)
                        .map(|v| v.as_usize())
                        .unwrap_or_default()
                };
                found = Some((get("input_batches"), get("uploaded_batches")));
            }
            stack.extend(node.children().into_iter().cloned());
        }
        found.expect("a load")
    };
    let plan = plan_of(&ctx, QUERY).await;
    collect(plan.clone(), ctx.task_ctx()).await.unwrap();
    let (inputs, uploads) = uploaded(&plan);
    assert!(inputs >= input_batches / 2, "{inputs} of {input_batches}");
    assert!(
        uploads * 4 <= inputs,
        "{uploads} uploads of {inputs} batches"
    );
    set(&ctx, "batch_bytes", "0").await;
    let plan = plan_of(&ctx, QUERY).await;
    collect(plan.clone(), ctx.task_ctx()).await.unwrap();
    let (inputs, uploads) = uploaded(&plan);
    assert_eq!(inputs, uploads, "batch_bytes = 0: every batch as it comes");
}

#[test]
fn the_runtime_is_never_blocked_by_a_region() {
    // One thread runs the query and a ticker: if a poll of the region waited for the
    // device (here, operators that sleep), the ticker would stall.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    runtime.block_on(async {
        let factory = HostEvalFactory {
            delay: Duration::from_millis(40),
            ..Default::default()
        };
        let ctx = session_with(factory, None, None, lineitem(0.005, 1, 2048));
        set(&ctx, "devices", "cpu").await;
        set(&ctx, "batch_bytes", "0").await;
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
        let batches = ctx.sql(QUERY).await.unwrap().collect().await.unwrap();
        let elapsed = start.elapsed();
        ticker.abort();
        assert!(common::rows(&batches) > 0);
        // The operators slept at least 40 ms a batch; a ticker of 2 ms that ran all the
        // while ticked many times (a blocked one: about once per batch).
        let ticks = ticks.load(Ordering::SeqCst);
        assert!(
            ticks as u128 >= elapsed.as_millis() / 8,
            "{ticks} ticks in {elapsed:?}"
        );
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_a_region_stream_frees_its_device_memory() {
    let cpu = Arc::new(CpuDevice::new());
    let pool = Arc::new(DevicePool::cpu(cpu.clone(), 2));
    let before = cpu.memory_pool_stats().in_use_bytes;
    let factory = HostEvalFactory {
        delay: Duration::from_millis(5),
        ..Default::default()
    };
    let ctx = session_with(
        factory,
        Some(vec![pool.clone()]),
        None,
        lineitem(0.01, 1, 1024),
    );
    set(&ctx, "batch_bytes", "0").await;
    set(&ctx, "read_ahead", "4").await;
    let plan = plan_of(&ctx, QUERY).await;
    let mut stream = execute_stream(plan, ctx.task_ctx()).unwrap();
    let first = stream.next().await.unwrap().unwrap();
    assert!(first.num_rows() > 0);
    let start = Instant::now();
    drop(stream);
    assert!(
        start.elapsed() < Duration::from_millis(200),
        "the drop joins nothing"
    );
    assert_eq!(wait_for_device_memory(&cpu, before), before);
    let start = Instant::now();
    while pool.in_use() > 0 && start.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(pool.in_use(), 0, "the slot came back");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_child_put_under_a_device_node_makes_it_its_host_twin() {
    // DataFusion's EnforceDistribution (as Ballista's scheduler runs it on each stage)
    // probes a node by rebuilding it over a `CoalescePartitionsExec` of its child.
    let ctx = session_with(
        HostEvalFactory::default(),
        None,
        None,
        lineitem(0.001, 2, 1024),
    );
    set(&ctx, "devices", "cpu").await;
    let plan = plan_of(&ctx, QUERY).await;
    let mut found = 0;
    let mut stack = vec![plan.clone()];
    while let Some(node) = stack.pop() {
        let child = node.children().first().map(|c| (*c).clone());
        if let (true, Some(child)) = (
            matches!(
                node.name(),
                "DeviceFilterExec" | "DeviceProjectionExec" | "DeviceUnloadExec"
            ),
            child,
        ) {
            let coalesced: Arc<dyn ExecutionPlan> = Arc::new(CoalescePartitionsExec::new(child));
            let rebuilt = replace_children_if_necessary(node.clone(), vec![coalesced]).unwrap();
            if node.name() == "DeviceUnloadExec" {
                assert_eq!(rebuilt.name(), "CoalescePartitionsExec");
            } else {
                assert_eq!(
                    rebuilt.name(),
                    if node.name() == "DeviceFilterExec" {
                        "FilterExec"
                    } else {
                        "ProjectionExec"
                    }
                );
                assert_eq!(rebuilt.schema(), node.schema());
                // It runs, on the host, over the region below.
                let rows: usize = collect(rebuilt, ctx.task_ctx())
                    .await
                    .unwrap()
                    .iter()
                    .map(RecordBatch::num_rows)
                    .sum();
                assert!(rows > 0);
            }
            found += 1;
        }
        stack.extend(node.children().into_iter().cloned());
    }
    assert!(found >= 3, "{}", text(&plan));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_analyze_shows_the_regions_metrics() {
    let ctx = session_with(
        HostEvalFactory::default(),
        None,
        None,
        lineitem(0.001, 1, 1024),
    );
    set(&ctx, "devices", "cpu").await;
    let batches = ctx
        .sql(&format!("EXPLAIN ANALYZE {QUERY}"))
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    let text = pretty_format_batches(&batches).unwrap().to_string();
    for metric in [
        "output_rows",
        "elapsed_compute",
        "bytes_from_device",
        "unload_time",
        "load_wait",
        "bytes_to_device",
        "uploaded_batches",
        "device_time",
    ] {
        assert!(text.contains(metric), "{metric} in {text}");
    }
}
