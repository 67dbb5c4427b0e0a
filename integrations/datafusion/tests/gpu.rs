//! DeviceExec on CUDA: the revenue kernel (PTX) against DataFusion, cancellation and a
//! failing step leaving no device memory (devarrow's exact counts and the device's free
//! memory), and two devices standing in for two executors, each decoding the shipped plan
//! onto its own.
//!
//! Skips without a GPU (printing why); fails instead with DEVARROW_REQUIRE_GPU=1. Without
//! a GPU it runs on the emulated driver (`.ci/datafusion`: DEVARROW_EMU_DEVICES=2).
#![cfg(feature = "cuda")]

mod common;

#[path = "common/host_eval.rs"]
mod host_eval;

#[path = "common/tpch.rs"]
mod tpch;

use std::sync::Arc;

use datafusion::physical_plan::{collect, ExecutionPlan};
use datafusion_proto::bytes::{
    physical_plan_from_bytes_with_extension_codec, physical_plan_to_bytes_with_extension_codec,
};
use devarrow::cuda::{device_count, CudaDevice};
use devarrow_datafusion::revenue::revenue_step;
use devarrow_datafusion::{DeviceExec, DeviceExecCodec, ExecDevice, StepRegistry};
use devarrow_testing::gpu::open_or_skip;
use devarrow_testing::leaks::DeviceMemoryCheck;
use futures::StreamExt;

use common::*;

const SCALE: f64 = 0.01;

/// No device memory left once the partitions' threads have ended: a dropped or failed
/// partition's threads free their memory as they end, not before its stream's drop
/// returns (no drop joins a thread on a runtime thread), so the check waits for them (at
/// most 10 s), then asserts.
fn no_leak_once_released(check: &DeviceMemoryCheck, what: impl std::fmt::Display) {
    let start = std::time::Instant::now();
    while check.leak().is_some() && start.elapsed() < std::time::Duration::from_secs(10) {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    check.assert_no_leak(what);
}

/// A tokio runtime for one test: GPU tests are plain tests that hold devarrow's GPU test
/// lock (a std mutex) around a `block_on`, never across an await of their own runtime.
fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn revenue_kernel_on_cuda_is_datafusions_and_frees_everything() {
    let Some((_lock, cuda)) = open_or_skip(|| CudaDevice::open(0)) else {
        return;
    };
    let cuda = Arc::new(cuda);
    let check = DeviceMemoryCheck::start(cuda.primary_context());
    runtime().block_on(async {
        let ctx = session(lineitem(SCALE, 2, 8192));
        let plan = device_plan(&ctx, ExecDevice::from_cuda(cuda.clone()))
            .await
            .unwrap();
        assert_eq!(plan.device().id(), "cuda:0");
        let out = collect(plan.clone(), ctx.task_ctx()).await.unwrap();
        let n = check_against_datafusion(&out, &datafusion_revenue(&ctx).await.unwrap());
        assert!(n > 50_000);
        let metrics = plan.metrics().unwrap();
        assert_eq!(metrics.output_rows(), Some(n));
        assert!(metrics.sum_by_name("bytes_to_device").unwrap().as_usize() >= n * 32);
    });
    no_leak_once_released(&check, "the revenue plan on CUDA");
}

#[test]
fn a_dropped_partition_on_cuda_leaves_no_device_memory() {
    let Some((_lock, cuda)) = open_or_skip(|| CudaDevice::open(0)) else {
        return;
    };
    let cuda = Arc::new(cuda);
    let check = DeviceMemoryCheck::start(cuda.primary_context());
    runtime().block_on(async {
        let ctx = session(lineitem(SCALE, 2, 1024));
        let plan = device_plan(&ctx, ExecDevice::from_cuda(cuda.clone()))
            .await
            .unwrap();
        let plan = DeviceExec::try_new(
            plan.input().clone(),
            plan.step().clone(),
            plan.device().clone(),
        )
        .unwrap()
        .with_read_ahead(8);
        let mut stream = plan.execute(0, ctx.task_ctx()).unwrap();
        let first = stream.next().await.unwrap().unwrap();
        assert!(first.num_rows() > 0);
        let mut device_batches = plan.execute_device(1, ctx.task_ctx()).unwrap();
        let on_device = device_batches.next().await.unwrap().unwrap();
        assert_eq!(on_device.num_rows(), first.num_rows());
        // Cancel both mid-stream, with uploads in flight.
        drop(stream);
        drop(device_batches);
        drop(on_device);
    });
    no_leak_once_released(&check, "partitions dropped mid-stream on CUDA");
}

/// Two devices stand in for two executors: the plan goes through the codec, and each
/// "executor" decodes it onto its own device and runs one partition.
#[test]
fn two_devices_each_run_the_shipped_plan() {
    let Some((_lock, first)) = open_or_skip(|| CudaDevice::open(0)) else {
        return;
    };
    let devices = device_count().unwrap_or(0);
    if devices < 2 {
        println!("skipping: {devices} CUDA device(s), the test needs 2");
        return;
    }
    let first = Arc::new(first);
    let check0 = DeviceMemoryCheck::start(first.primary_context());
    let second = Arc::new(CudaDevice::open(1).unwrap());
    let check1 = DeviceMemoryCheck::start(second.primary_context());
    runtime().block_on(async {
        let ctx = session(lineitem(SCALE, 2, 8192));
        let registry = Arc::new(StepRegistry::new());
        registry.register(revenue_step());
        let plan = device_plan(&ctx, ExecDevice::cpu()).await.unwrap();
        let client = DeviceExecCodec::new(registry.clone(), ExecDevice::cpu());
        let bytes = physical_plan_to_bytes_with_extension_codec(plan, &client).unwrap();
        let mut out = Vec::new();
        for (partition, device) in [(0, first.clone()), (1, second.clone())] {
            let executor = DeviceExecCodec::new(registry.clone(), ExecDevice::from_cuda(device));
            let decoded =
                physical_plan_from_bytes_with_extension_codec(&bytes, &ctx.task_ctx(), &executor)
                    .unwrap();
            let node = decoded.downcast_ref::<DeviceExec>().unwrap();
            assert_eq!(node.device().id(), format!("cuda:{partition}"));
            let mut stream = decoded.execute(partition, ctx.task_ctx()).unwrap();
            while let Some(batch) = stream.next().await {
                out.push(batch.unwrap());
            }
        }
        check_against_datafusion(&out, &datafusion_revenue(&ctx).await.unwrap());
    });
    no_leak_once_released(&check0, "executor on cuda:0");
    no_leak_once_released(&check1, "executor on cuda:1");
}

/// A step failing on CUDA mid-partition fails the query with its typed error, and the
/// partitions' uploads (in flight, read ahead) leave no device memory behind.
#[test]
fn a_failing_step_on_cuda_fails_the_query_and_frees_everything() {
    let Some((_lock, cuda)) = open_or_skip(|| CudaDevice::open(0)) else {
        return;
    };
    let cuda = Arc::new(cuda);
    let check = DeviceMemoryCheck::start(cuda.primary_context());
    runtime().block_on(async {
        let ctx = session(lineitem(SCALE, 2, 2048));
        let revenue = revenue_step();
        let failing = devarrow_datafusion::DeviceStep::new("fails.on.cuda", move |batch, cx| {
            if cx.partition == 1 && cx.batch == 2 {
                return Err("the kernel failed".into());
            }
            revenue.run(batch, cx)
        })
        .with_inputs(["l_extendedprice", "l_discount"])
        .appending(vec![devarrow_datafusion::revenue::revenue_field()]);
        let scan = scan_plan(&ctx).await.unwrap();
        let plan =
            DeviceExec::try_new(scan, Arc::new(failing), ExecDevice::from_cuda(cuda.clone()))
                .unwrap()
                .with_read_ahead(4);
        let error = collect(Arc::new(plan), ctx.task_ctx()).await.unwrap_err();
        match devarrow_datafusion::DeviceExecError::find(&error) {
            Some(devarrow_datafusion::DeviceExecError::Step {
                partition: 1,
                batch: 2,
                ..
            }) => {}
            other => panic!("{other:?}: {error}"),
        }
    });
    no_leak_once_released(&check, "a query failed by its step on CUDA");
}

/// Runs `checks` with a pool of two slots on each of `cuda:0` and `cuda:1` (skipped
/// with fewer devices), then checks that neither device has memory left.
fn on_two_devices<F: std::future::Future<Output = ()>>(
    what: &str,
    checks: impl FnOnce(Vec<Arc<devarrow_datafusion::config::DevicePool>>) -> F,
) {
    use devarrow_datafusion::config::DevicePool;

    let Some((_lock, first)) = open_or_skip(|| CudaDevice::open(0)) else {
        return;
    };
    let devices = device_count().unwrap_or(0);
    if devices < 2 {
        println!("skipping: {devices} CUDA device(s), the test needs 2");
        return;
    }
    let first = Arc::new(first);
    let second = Arc::new(CudaDevice::open(1).unwrap());
    let check0 = DeviceMemoryCheck::start(first.primary_context());
    let check1 = DeviceMemoryCheck::start(second.primary_context());
    let pools = vec![
        Arc::new(DevicePool::new(ExecDevice::from_cuda(first.clone()), 2).unwrap()),
        Arc::new(DevicePool::new(ExecDevice::from_cuda(second.clone()), 2).unwrap()),
    ];
    runtime().block_on(checks(pools));
    no_leak_once_released(&check0, format!("{what} on cuda:0"));
    no_leak_once_released(&check1, format!("{what} on cuda:1"));
}

/// A device region over two devices: partition `p` runs on `cuda:{p % 2}`, each slot of a
/// device on a stream of its own, the results DataFusion's, and no device memory left on
/// either device once the plan and its pools are dropped.
#[test]
fn a_region_spreads_partitions_over_two_devices_on_streams_of_their_own() {
    on_two_devices("a region's partitions", |pools| async move {
        for pool in &pools {
            let streams: std::collections::BTreeSet<usize> = pool
                .devices()
                .map(|d| Arc::as_ptr(d.cuda().unwrap().stream()) as usize)
                .collect();
            assert_eq!(
                streams.len(),
                2,
                "each slot of {} has its own stream",
                pool.id()
            );
        }
        let factory = host_eval::HostEvalFactory::default();
        let running = factory.running.clone();
        let data = lineitem(SCALE, 4, 4096);
        let ctx = host_eval::session_with(factory, Some(pools), None, data.clone());
        let sql = "SELECT l_orderkey, l_linenumber, l_extendedprice * (1 - l_discount) AS revenue \
                   FROM lineitem WHERE l_quantity > 10";
        let got = ctx.sql(sql).await.unwrap().collect().await.unwrap();
        let want = datafusion_alone(data, sql).await;
        tpch::compare_results(&got, &want).unwrap();
        let seen = running.devices.lock().unwrap().clone();
        assert_eq!(
            seen.into_iter().collect::<Vec<_>>(),
            vec!["cuda:0".to_string(), "cuda:1".to_string()]
        );
    });
}

/// TPC-H Q3, Q5 and Q10 with every join on the device, over two devices: a collected
/// build side read and hashed once, its table uploaded once per device (shared by the
/// partitions there), the results DataFusion's, both devices used, no device memory left
/// on either.
#[test]
fn device_joins_over_two_devices_are_datafusions() {
    on_two_devices("device joins", |pools| async move {
        let tables = tpch::Tables::generate(SCALE, 4);
        let ctx = compute_checks::session_with_pools(pools.clone(), 4, None);
        tables.register(&ctx).unwrap();
        ctx.sql("SET devarrow.always_place_joins = true")
            .await
            .unwrap()
            .collect()
            .await
            .unwrap();
        let plain = tpch::host_session(&tables, 4).unwrap();
        for q in [3, 5, 10] {
            let sql = tpch::query(q);
            let (plan, shown) = compute_checks::planned(&ctx, sql).await;
            assert!(shown.contains("DeviceHashJoinExec"), "Q{q}:\n{shown}");
            let got = collect(plan, ctx.task_ctx()).await.unwrap();
            let want = plain.sql(sql).await.unwrap().collect().await.unwrap();
            tpch::compare_results(&got, &want).unwrap_or_else(|e| panic!("Q{q}: {e}"));
        }
        for pool in &pools {
            assert!(pool.placed() > 0, "{} ran no partition", pool.id());
        }
        // A collected build side: one table per device, not per partition.
        compute_checks::check_one_table_per_device(pools.clone()).await;
    });
}

/// `devarrow.devices = auto` (the default) read where the partitions run: every CUDA
/// device of this machine, each partition on the device running fewest, as a Ballista
/// executor with several GPUs reads it (`examples/ballista_regions.rs` runs the same on
/// Ballista).
#[test]
fn auto_spreads_partitions_over_every_device_of_the_machine() {
    use devarrow::DeviceRequest;
    use devarrow_datafusion::config::{pool_for, DevarrowConfig};

    let Some((_lock, _first)) = open_or_skip(|| CudaDevice::open(0)) else {
        return;
    };
    let devices = device_count().unwrap_or(0);
    if devices < 2 {
        println!("skipping: {devices} CUDA device(s), the test needs 2");
        return;
    }
    let options = DevarrowConfig::default();
    assert_eq!(options.devices, "auto");
    let requests = options.device_requests().unwrap();
    assert_eq!(
        requests,
        (0..devices).map(DeviceRequest::Cuda).collect::<Vec<_>>()
    );
    let placed = |id: usize| {
        pool_for(DeviceRequest::Cuda(id), options.partitions_per_device)
            .unwrap()
            .placed()
    };
    let before: Vec<u64> = (0..devices).map(placed).collect();
    runtime().block_on(async {
        let data = lineitem(SCALE, 4, 4096);
        let ctx = host_eval::session_with(
            host_eval::HostEvalFactory::default(),
            None,
            None,
            data.clone(),
        );
        let sql = "SELECT l_orderkey, l_linenumber, l_extendedprice * (1 - l_discount) AS revenue \
                   FROM lineitem WHERE l_quantity > 10";
        let got = ctx.sql(sql).await.unwrap().collect().await.unwrap();
        let want = datafusion_alone(data, sql).await;
        tpch::compare_results(&got, &want).unwrap();
    });
    for (id, before) in before.iter().enumerate() {
        assert!(placed(id) > *before, "cuda:{id} ran no partition");
    }
}

/// The device compute checks of `tests/compute.rs` (its CPU tests skip themselves here).
// (It declares `mod common;` itself: a second copy of the shared helpers.)
#[path = "compute.rs"]
#[allow(clippy::duplicate_mod)]
mod compute_checks;

/// Runs `checks` on `cuda:0` (the PTX kernels of `kernels/compute.ptx`), then checks
/// that they left no device memory behind.
fn on_cuda_without_leaks<F: std::future::Future<Output = ()>>(
    what: &str,
    checks: impl FnOnce(ExecDevice) -> F,
) {
    let Some((_lock, cuda)) = open_or_skip(|| CudaDevice::open(0)) else {
        return;
    };
    let cuda = Arc::new(cuda);
    let check = DeviceMemoryCheck::start(cuda.primary_context());
    runtime().block_on(checks(ExecDevice::from_cuda(cuda.clone())));
    no_leak_once_released(&check, what);
}

#[test]
fn device_expressions_on_cuda_are_datafusions() {
    on_cuda_without_leaks("expressions on CUDA", |device| async move {
        compute_checks::check_expressions(&device).await;
        compute_checks::check_overflow(&device).await;
        compute_checks::check_case_and_dates(&device).await;
        compute_checks::check_changing_zones(&device).await;
        compute_checks::check_scalar_subqueries(&device).await;
        compute_checks::check_overflow_fallback(&device).await;
        compute_checks::check_string_casts(&device).await;
        compute_checks::check_string_choices(&device).await;
        compute_checks::check_unsigned(&device).await;
        compute_checks::check_integer_functions(&device).await;
        compute_checks::check_temporal_casts(&device).await;
        compute_checks::check_computed_strings(&device).await;
    });
}

#[test]
fn device_selections_on_cuda_are_datafusions_filters() {
    on_cuda_without_leaks("selections on CUDA", |device| async move {
        compute_checks::check_select(&device).await;
        compute_checks::check_tpch_filters(&device).await;
        compute_checks::check_compact(&device).await;
        compute_checks::check_string_predicates(&device).await;
        compute_checks::check_random_like(&device).await;
        compute_checks::check_ilike(&device).await;
        compute_checks::check_unicode_case(&device).await;
        compute_checks::check_random_regex(&device).await;
        compute_checks::check_word_boundaries(&device).await;
        compute_checks::check_empty_matches(&device).await;
        compute_checks::check_string_functions(&device).await;
    });
}

/// A pattern's automaton is uploaded once per context: the first evaluation of a regular
/// expression copies its five tables to the device (and waits for them, once), later
/// ones on any stream of the context copy none and wait for nothing more. Counted on the
/// emulated driver (every driver call, by name); on a real driver the answers are checked
/// and nothing is counted.
#[test]
fn a_patterns_automaton_is_uploaded_once_per_context() {
    use arrow_array::{ArrayRef, BooleanArray, RecordBatch, StringViewArray};
    use devarrow_datafusion::compute::DeviceExpr;
    use devarrow_testing::gpu::ImplicitSyncs;

    let Some((_lock, cuda)) = open_or_skip(|| CudaDevice::open(0)) else {
        return;
    };
    let cuda = Arc::new(cuda);
    let check = DeviceMemoryCheck::start(cuda.primary_context());
    let rt = runtime();
    let values = ["once 12 per", "x", "once per", "once 3 per"];
    let batch = RecordBatch::try_from_iter([(
        "s",
        Arc::new(StringViewArray::from_iter_values(values)) as ArrayRef,
    )])
    .unwrap();
    let ctx = compute_checks::session_of("u", &batch);
    // A pattern no other test uses: its first use in the context is here.
    let (e, schema, _) = rt.block_on(compute_checks::projection_of(
        &ctx,
        "u",
        "(s ~ 'once [0-9]+ per$')",
    ));
    let compiled = DeviceExpr::compile(&e, &schema).unwrap();
    let want: ArrayRef = Arc::new(BooleanArray::from(vec![true, false, false, true]));
    let first = ExecDevice::from_cuda(cuda.clone());
    let second = first.another_stream().unwrap();
    let mut counted = Vec::new();
    for device in [&first, &first, &second] {
        let frame = compute_checks::upload(&batch, device);
        let before = ImplicitSyncs::every_call_settled();
        let got = compiled.evaluate(&frame, device).unwrap();
        let after = ImplicitSyncs::every_call_settled();
        assert_eq!(&compute_checks::download(&got, device), &want);
        drop((got, frame));
        counted.push(before.and_then(|b| after.map(|a| a.since(&b))));
    }
    if let [Some(first), Some(again), Some(other)] = &counted[..] {
        let count = |calls: &ImplicitSyncs, call: &str| calls.calls.get(call).copied().unwrap_or(0);
        let copies = |calls: &ImplicitSyncs| count(calls, "cuMemcpyHtoDAsync_v2");
        println!("first: {first}\nagain: {again}\nother stream: {other}");
        assert_eq!(
            copies(first),
            copies(again) + 5,
            "the tables, once: {first} / {again}"
        );
        assert_eq!(copies(again), copies(other), "{again} / {other}");
        // The evaluation's own wait (its error word read back), and the tables' once.
        let syncs = |calls: &ImplicitSyncs| count(calls, "cuStreamSynchronize");
        assert_eq!(syncs(first), syncs(again) + 1, "{first} / {again}");
        assert_eq!(syncs(again), syncs(other), "{again} / {other}");
        for calls in [again, other] {
            for call in ["cuStreamWaitEvent", "cuEventSynchronize"] {
                assert_eq!(count(calls, call), 0, "{call}: {calls}");
            }
        }
    }
    drop((compiled, first, second, ctx));
    no_leak_once_released(&check, "a pattern's automaton, kept by its context");
}

#[test]
fn device_partial_aggregates_on_cuda_are_datafusions() {
    on_cuda_without_leaks("partial aggregates on CUDA", |device| async move {
        compute_checks::check_aggregates(&device).await;
        compute_checks::check_long_keys(&device).await;
        compute_checks::check_float_aggregates(&device).await;
        compute_checks::check_empty_frames(&device).await;
    });
}

#[test]
fn device_hash_joins_on_cuda_are_datafusions() {
    on_cuda_without_leaks("hash joins on CUDA", |device| async move {
        compute_checks::check_joins(&device).await;
        compute_checks::check_offset_string_joins(&device).await;
        compute_checks::check_computed_string_keys(&device).await;
        compute_checks::check_random_joins(&device).await;
        compute_checks::check_partitions_one_after_another(&device).await;
        compute_checks::check_string_key_collisions(&device).await;
        compute_checks::check_run_time_placement(&device).await;
        let pool = devarrow_datafusion::config::DevicePool::new(device.clone(), 2).unwrap();
        compute_checks::check_one_table_per_device(vec![Arc::new(pool)]).await;
        compute_checks::check_foreign_probe_views(&device).await;
        compute_checks::check_foreign_offsets(&device).await;
        compute_checks::check_dropped_join_stream(&device, || 0).await;
        // Device memory is checked by `on_cuda_without_leaks`, once the pool is dropped.
        compute_checks::check_join_reservation(&device, || 0).await;
    });
}

/// TPC-H Q1 and Q6 with devarrow's own operators on CUDA (the PTX kernels of
/// `kernels/compute.ptx`): one region each, the results DataFusion's to the last digit,
/// no device memory left behind.
#[test]
fn q1_and_q6_regions_on_cuda_are_datafusions() {
    use datafusion::arrow::util::pretty::pretty_format_batches;
    use devarrow_datafusion::config::DevicePool;

    let Some((_lock, cuda)) = open_or_skip(|| CudaDevice::open(0)) else {
        return;
    };
    let cuda = Arc::new(cuda);
    let check = DeviceMemoryCheck::start(cuda.primary_context());
    runtime().block_on(async {
        let pool = Arc::new(DevicePool::new(ExecDevice::from_cuda(cuda.clone()), 2).unwrap());
        let data = lineitem(SCALE, 2, 4096);
        let ctx = compute_checks::session_with_pool(pool, 2, None);
        register_lineitem(&ctx, data.clone());
        let plain = session(data);
        for q in [1, 6] {
            let sql = tpch::query(q);
            let plan = ctx
                .sql(sql)
                .await
                .unwrap()
                .create_physical_plan()
                .await
                .unwrap();
            let shown = datafusion::physical_plan::displayable(plan.as_ref())
                .indent(false)
                .to_string();
            assert_eq!(shown.matches("DeviceUnloadExec").count(), 1, "{shown}");
            assert!(!shown.contains("HostOnlyExec"), "{shown}");
            let got = collect(plan, ctx.task_ctx()).await.unwrap();
            let want = plain.sql(sql).await.unwrap().collect().await.unwrap();
            assert_eq!(
                pretty_format_batches(&got).unwrap().to_string(),
                pretty_format_batches(&want).unwrap().to_string(),
                "Q{q}"
            );
        }
    });
    no_leak_once_released(&check, "Q1 and Q6 regions on CUDA");
}

/// A region's downloads land in pinned memory its batches own, and its loads gather
/// batches into pinned memory, however much the region moves: the device pool reserves
/// pinned room for both when it is made. Before it
/// did, their blocks came only from the 128 MiB the device reserves at open, shared with
/// the staging, and on the H200 (2026-11-29) the transitions ran at 0.33x of the pinned
/// copies, their downloads unpacked from staging into pageable memory.
#[test]
fn a_regions_downloads_land_in_pinned_memory() {
    use arrow_array::{ArrayRef, Int64Array, RecordBatch};
    use datafusion::datasource::MemTable;
    use datafusion::prelude::SessionContext;
    use devarrow_datafusion::config::{DevicePlacement, DevicePool};
    use devarrow_datafusion::region::{DeviceLoadExec, DeviceUnloadExec};

    let Some((_lock, cuda)) = open_or_skip(|| CudaDevice::open(0)) else {
        return;
    };
    let cuda = Arc::new(cuda);
    // Start from an empty reserve, whatever the tests before left in it.
    cuda.trim_pinned();
    let check = DeviceMemoryCheck::start(cuda.primary_context());
    let rt = runtime();
    let pool = Arc::new(DevicePool::new(ExecDevice::from_cuda(cuda.clone()), 2).unwrap());
    // 2 partitions of 12 batches of 1M rows: 192 MB, beyond the reserve made at open.
    let batch = |p: i64, b: i64| {
        let x: ArrayRef = Arc::new(Int64Array::from_iter_values(
            (0..1 << 20).map(|i| (p * 12 + b) << 20 | i),
        ));
        RecordBatch::try_from_iter([("x", x)]).unwrap()
    };
    let partitions: Vec<Vec<RecordBatch>> = (0..2)
        .map(|p| (0..12).map(|b| batch(p, b)).collect())
        .collect();
    let schema = partitions[0][0].schema();
    let ctx = SessionContext::new();
    ctx.register_table(
        "t",
        Arc::new(MemTable::try_new(schema, partitions).unwrap()),
    )
    .unwrap();
    let scan = rt
        .block_on(async {
            ctx.sql("select x from t")
                .await?
                .create_physical_plan()
                .await
        })
        .unwrap();
    let region: Arc<dyn ExecutionPlan> = Arc::new(
        DeviceUnloadExec::try_new(Arc::new(DeviceLoadExec::with_placement(
            scan,
            DevicePlacement::Pools(vec![pool.clone()]),
        )))
        .unwrap(),
    );
    let pageable_before = cuda.pageable_staging();
    let back = rt
        .block_on(collect(region.clone(), ctx.task_ctx()))
        .unwrap();
    assert_eq!(
        cuda.pageable_staging() - pageable_before,
        0,
        "the loads' gathers (4 batches each) were pinned memory"
    );
    let mut values: Vec<i64> = back
        .iter()
        .flat_map(|b| {
            let x = b.column(0).as_any().downcast_ref::<Int64Array>().unwrap();
            x.values().to_vec()
        })
        .collect();
    values.sort_unstable();
    assert!(
        values.iter().copied().eq(0..24 << 20),
        "every value came back once"
    );
    assert_eq!(
        tpch::metric_sum(&region, "DeviceUnloadExec", "bytes_from_device"),
        24 << 23
    );
    assert_eq!(
        tpch::metric_sum(&region, "DeviceUnloadExec", "pageable_downloads"),
        0,
        "every batch landed in pinned memory"
    );
    drop((back, region, ctx, pool));
    no_leak_once_released(&check, "a region's downloads into pinned memory");
}

/// A region's expressions compute into lanes the kernels write whole: no memset per
/// node and batch. Counted on the emulated driver (every driver call, by name): TPC-H Q1
/// (a filter, a projection and a partial aggregate, 38 kernels a batch) zeroed every
/// node's lanes before (52 `cuMemsetD8Async` a batch); what is left zeroes counters and
/// error words. Nor do they order each other with events: each computed column is a
/// batch in order on the partition's stream, exported without a sync event (17 events
/// created, 27 stream waits and 2 host waits a batch before). On a real driver the query
/// runs and nothing is counted.
#[test]
fn a_regions_operators_neither_zero_their_lanes_nor_wait_on_events() {
    use devarrow_datafusion::config::DevicePool;
    use devarrow_testing::gpu::ImplicitSyncs;

    let Some((_lock, cuda)) = open_or_skip(|| CudaDevice::open(0)) else {
        return;
    };
    let cuda = Arc::new(cuda);
    let check = DeviceMemoryCheck::start(cuda.primary_context());
    let rt = runtime();
    let pool = Arc::new(DevicePool::new(ExecDevice::from_cuda(cuda.clone()), 2).unwrap());
    let tables = tpch::Tables::generate(0.01, 2);
    let ctx = compute_checks::session_with_pool(pool.clone(), 2, None);
    tables.register(&ctx).unwrap();
    let plan_q1 = || {
        rt.block_on(async { ctx.sql(tpch::query(1)).await?.create_physical_plan().await })
            .unwrap()
    };
    // A first run loads the module and fills the pools.
    rt.block_on(collect(plan_q1(), ctx.task_ctx())).unwrap();
    let plan = plan_q1();
    // Counted once the process is quiet (the calls of threads that outlive their query,
    // ours or an earlier test's, would count too), and until it is again.
    let before = ImplicitSyncs::every_call_settled();
    rt.block_on(collect(plan.clone(), ctx.task_ctx())).unwrap();
    let after = ImplicitSyncs::every_call_settled();
    if let Some(calls) = before.and_then(|b| after.map(|a| a.since(&b))) {
        let batches = tpch::metric_sum(&plan, "DeviceLoadExec", "uploaded_batches").max(1);
        let memsets = calls.calls.get("cuMemsetD8Async").copied().unwrap_or(0) as usize;
        println!("Q1: {batches} uploaded batches, driver calls: {calls}");
        assert!(
            memsets <= 16 * batches,
            "{memsets} memsets for {batches} batches: {calls}"
        );
        // Every column an operator computes is a batch in order on the partition's
        // stream: no event is created (the device's are pooled), nor waited for, between
        // the operators (the transitions' own, at most one a batch).
        let count = |call: &str| calls.calls.get(call).copied().unwrap_or(0) as usize;
        assert!(
            count("cuEventCreate") <= batches,
            "{} events created for {batches} batches: {calls}",
            count("cuEventCreate")
        );
        for call in ["cuStreamWaitEvent", "cuEventSynchronize"] {
            assert_eq!(
                count(call),
                0,
                "{call} between a region's operators: {calls}"
            );
        }
    }
    drop((plan, ctx, tables, pool));
    no_leak_once_released(&check, "Q1's regions");
}

/// The best of `runs` wall times of `f`, in seconds.
fn best_of(runs: usize, mut f: impl FnMut()) -> f64 {
    (0..runs)
        .map(|_| {
            let start = std::time::Instant::now();
            f();
            start.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

/// Figures of device regions on CUDA, printed (run it with `--nocapture`); it asserts
/// results only. Not a benchmark (criterion's `benches/tpch.rs` is, where Rust is
/// built): the numbers the GPU proof (`ci/gpu/proof`) brings back for issue 39, each
/// beside its peer of the same run.
///
/// - TPC-H Q1 and Q6 at `DEVARROW_TPCH_SCALE` (default SF 1; 0.01 on the emulated
///   driver), DataFusion alone and with one region each, planned outside the timing,
///   best of 3 each;
/// - a region that ends in a filter of strings (`IN`, `NOT LIKE` over the comments), its
///   kept rows compacted on the device, strings included: DataFusion alone and the
///   region, best of 3 each, and the bytes it moved;
/// - the transitions alone (a region of no operator over Q1's scan: coalesce, upload,
///   download into pinned memory), best of 3, beside one pinned copy of the same bytes
///   each way (`cuMemcpyHtoDAsync` / `cuMemcpyDtoHAsync` from the device's reserved
///   pinned memory): the goal is the round trip at 0.85x or more of the pinned
///   copies' round trip;
/// - TPC-H Q3, Q5, Q9 and Q10 with their device joins at each scale of
///   `DEVARROW_TPCH_JOIN_SCALE`, a comma-separated list (default SF 0.1; 0.01 on the
///   emulated driver), checked against DataFusion, then
///   DataFusion alone and with the rule, best of 2 each, and the bytes they moved.
#[test]
fn tpch_regions_on_cuda_figures() {
    use datafusion::physical_plan::execute_stream;
    use datafusion::prelude::SessionContext;
    use devarrow::abi::device::Device;
    use devarrow_datafusion::config::{DevicePlacement, DevicePool};
    use devarrow_datafusion::region::{DeviceLoadExec, DeviceUnloadExec};
    use devarrow_testing::gpu::EmulatedDriver;

    let Some((_lock, cuda)) = open_or_skip(|| CudaDevice::open(0)) else {
        return;
    };
    let emulated = EmulatedDriver::find().is_some();
    let scale: f64 = std::env::var("DEVARROW_TPCH_SCALE")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(if emulated { 0.01 } else { 1.0 });
    let partitions = std::thread::available_parallelism().map_or(2, |n| n.get().min(16));
    let cuda = Arc::new(cuda);
    let check = DeviceMemoryCheck::start(cuda.primary_context());
    let rt = runtime();
    let pool = Arc::new(DevicePool::new(ExecDevice::from_cuda(cuda.clone()), 4).unwrap());
    let data = lineitem(scale, partitions, 8192);
    let plain = session(data.clone());
    let ctx = compute_checks::session_with_pool(pool.clone(), partitions, None);
    register_lineitem(&ctx, data);
    let plan_of = |ctx: &SessionContext, sql: &str| -> Arc<dyn ExecutionPlan> {
        rt.block_on(async { ctx.sql(sql).await?.create_physical_plan().await })
            .unwrap()
    };
    let drain =
        |plan: Arc<dyn ExecutionPlan>, ctx: &SessionContext| -> Vec<arrow_array::RecordBatch> {
            rt.block_on(collect(plan, ctx.task_ctx())).unwrap()
        };
    // DataFusion alone and with its regions, best of 3 each, each plan made before its
    // run (a DataFusion physical plan runs once).
    let both_ways = |sql: &str| -> (f64, f64) {
        let host = best_of(3, || {
            drain(plan_of(&plain, sql), &plain);
        });
        let mut plans: Vec<_> = (0..3).map(|_| plan_of(&ctx, sql)).collect();
        let device = best_of(3, || {
            drain(plans.pop().unwrap(), &ctx);
        });
        (host, device)
    };
    println!(
        "figures: TPC-H SF {scale}, {partitions} partitions, cuda:0 ({}), 4 slots",
        if emulated {
            "EMULATED driver: results only, never quote"
        } else {
            "real driver"
        }
    );
    for q in [1, 6] {
        let sql = tpch::query(q);
        let want = drain(plan_of(&plain, sql), &plain);
        let first = plan_of(&ctx, sql);
        let got = drain(first.clone(), &ctx);
        // Row by row (sorted, floats within a relative 1e-9, decimals exactly).
        tpch::compare_results(&got, &want).unwrap_or_else(|e| panic!("Q{q}: {e}"));
        let (host, device) = both_ways(sql);
        println!(
            "figures: Q{q}: DataFusion alone {:.1} ms, one region on cuda:0 {:.1} ms ({:.2}x); \
             first run: {}",
            host * 1e3,
            device * 1e3,
            host / device,
            tpch::region_times(&first)
        );
    }

    // A region that ends in a filter of strings (IN and LIKE on views, over lineitem's
    // long comments) and brings back its kept rows compacted, strings included.
    let sql = "select l_orderkey, l_shipmode, l_comment from lineitem \
               where l_shipmode in ('MAIL', 'SHIP') and l_commitdate < l_receiptdate \
               and l_comment not like '%special%requests%' \
               and l_receiptdate >= date '1994-01-01' and l_receiptdate < date '1995-01-01'";
    let sorted = |batches: &[arrow_array::RecordBatch]| {
        let mut rows: Vec<String> = datafusion::arrow::util::pretty::pretty_format_batches(batches)
            .unwrap()
            .to_string()
            .lines()
            .map(str::to_string)
            .collect();
        rows.sort();
        rows
    };
    let want = drain(plan_of(&plain, sql), &plain);
    let first = plan_of(&ctx, sql);
    let got = drain(first.clone(), &ctx);
    assert_eq!(sorted(&got), sorted(&want), "the strings filter");
    let metric = |name: &str, node: &str| tpch::metric_sum(&first, node, name);
    let (host, device) = both_ways(sql);
    println!(
        "figures: strings filter (IN, NOT LIKE, compaction of views): DataFusion alone {:.1} \
         ms, one region on cuda:0 {:.1} ms ({:.2}x); {:.1} MiB up, {:.1} MiB down, {} \
         batches compacted",
        host * 1e3,
        device * 1e3,
        host / device,
        metric("bytes_to_device", "DeviceLoadExec") as f64 / (1 << 20) as f64,
        metric("bytes_from_device", "DeviceUnloadExec") as f64 / (1 << 20) as f64,
        metric("compacted_batches", "DeviceUnloadExec"),
    );

    // The transitions alone, beside the pinned copies of the same bytes.
    let scan = plan_of(
        &plain,
        "select l_quantity, l_extendedprice, l_discount, l_tax, l_returnflag, \
         l_linestatus, l_shipdate from lineitem",
    );
    let bytes: usize = drain(scan.clone(), &plain)
        .iter()
        .flat_map(|b| b.columns().iter())
        .map(|c| c.to_data().get_slice_memory_size().unwrap_or(0))
        .sum();
    let region = || -> Arc<dyn ExecutionPlan> {
        Arc::new(
            DeviceUnloadExec::try_new(Arc::new(DeviceLoadExec::with_placement(
                scan.clone(),
                DevicePlacement::Pools(vec![pool.clone()]),
            )))
            .unwrap(),
        )
    };
    let pageable = std::sync::atomic::AtomicUsize::new(0);
    let last_times = std::sync::Mutex::new(String::new());
    let round_trip = best_of(3, || {
        rt.block_on(async {
            let plan = region();
            let mut stream = execute_stream(plan.clone(), ctx.task_ctx()).unwrap();
            while let Some(batch) = stream.next().await {
                drop(batch.unwrap());
            }
            pageable.fetch_add(
                tpch::metric_sum(&plan, "DeviceUnloadExec", "pageable_downloads"),
                std::sync::atomic::Ordering::Relaxed,
            );
            *last_times.lock().unwrap() = tpch::region_times(&plan);
        })
    });
    let device: &dyn Device = cuda.as_ref();
    device.reserve_staging(bytes).unwrap();
    let mut host = device.allocate_staging(bytes).unwrap();
    let on_device = device.allocate(bytes).unwrap();
    let src = host.as_mut_slice().as_mut_ptr();
    let h2d = best_of(3, || {
        // SAFETY: `host` (pinned, `bytes` long) and `on_device` (`bytes` long) outlive
        // the copy, waited for before the closure returns.
        unsafe { device.copy_to_device(src, on_device.address(), bytes) }.unwrap();
        device.record_event().unwrap().wait_host().unwrap();
    });
    let d2h = best_of(3, || {
        // SAFETY: as above, the other way.
        unsafe { device.copy_to_host(on_device.address(), src, bytes) }.unwrap();
        device.record_event().unwrap().wait_host().unwrap();
    });
    drop((host, on_device));
    let gbs = |t: f64| bytes as f64 / t / 1e9;
    println!(
        "figures: transitions: Q1's scan, {:.1} MiB up and down: {:.1} ms ({:.1} GB/s); \
         pinned copies of the same bytes: host to device {:.1} GB/s, device to host {:.1} \
         GB/s, their round trip {:.1} ms; the transitions at {:.2}x of the pinned round trip; \
         {} of their downloads landed in pageable memory; last run: {}",
        bytes as f64 / (1 << 20) as f64,
        round_trip * 1e3,
        gbs(round_trip),
        gbs(h2d),
        gbs(d2h),
        (h2d + d2h) * 1e3,
        (h2d + d2h) / round_trip,
        pageable.into_inner(),
        last_times.into_inner().unwrap()
    );

    // Device joins: TPC-H queries whose joins run in regions (the fact table filtered,
    // joined and partially aggregated on the device), at a smaller scale (the whole
    // TPC-H schema is generated), DataFusion alone and with the rule, best of 2 each.
    // A comma-separated list of scales: where the device starts to win.
    let join_scales: Vec<f64> = std::env::var("DEVARROW_TPCH_JOIN_SCALE")
        .ok()
        .map(|s| s.split(',').filter_map(|x| x.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![if emulated { 0.01 } else { 0.1 }]);
    // The device slots of each run (`DEVARROW_TPCH_JOIN_SLOTS`, default 4, as
    // `devarrow.partitions_per_device`): at SF 0.1 on the H200 (2026-11-30) the regions
    // spent more time waiting for one of 4 slots than in their operators.
    let join_slots: Vec<usize> = std::env::var("DEVARROW_TPCH_JOIN_SLOTS")
        .ok()
        .map(|s| s.split(',').filter_map(|x| x.trim().parse().ok()).collect())
        .filter(|v: &Vec<usize>| !v.is_empty())
        .unwrap_or_else(|| vec![4]);
    for (join_scale, slots) in join_scales
        .iter()
        .flat_map(|&scale| join_slots.iter().map(move |&slots| (scale, slots)))
    {
        let tables = tpch::Tables::generate(join_scale, partitions);
        let joins_plain = tpch::host_session(&tables, partitions).unwrap();
        let slot_pool = if slots == pool.slots() {
            pool.clone()
        } else {
            Arc::new(DevicePool::new(ExecDevice::from_cuda(cuda.clone()), slots).unwrap())
        };
        let joins_ctx = compute_checks::session_with_pool(slot_pool.clone(), partitions, None);
        tables.register(&joins_ctx).unwrap();
        for q in [3, 5, 9, 10] {
            let sql = tpch::query(q);
            let want = drain(plan_of(&joins_plain, sql), &joins_plain);
            let first = plan_of(&joins_ctx, sql);
            let got = drain(first.clone(), &joins_ctx);
            tpch::compare_results(&got, &want).unwrap_or_else(|e| panic!("Q{q} with joins: {e}"));
            let joins = datafusion::physical_plan::displayable(first.as_ref())
                .indent(false)
                .to_string()
                .matches("DeviceHashJoinExec")
                .count();
            let metric = |name: &str, node: &str| tpch::metric_sum(&first, node, name);
            let host = best_of(2, || {
                drain(plan_of(&joins_plain, sql), &joins_plain);
            });
            let mut plans: Vec<_> = (0..2).map(|_| plan_of(&joins_ctx, sql)).collect();
            let device = best_of(2, || {
                drain(plans.pop().unwrap(), &joins_ctx);
            });
            println!(
                "figures: Q{q} (SF {join_scale}, {joins} device joins, {slots} slots): DataFusion \
                 alone {:.1} ms, with device regions on cuda:0 {:.1} ms ({:.2}x); {:.1} MiB up \
                 (join tables {:.1}), {:.1} MiB down; first run: {}",
                host * 1e3,
                device * 1e3,
                host / device,
                (metric("bytes_to_device", "DeviceLoadExec")
                    + metric("bytes_to_device", "DeviceHashJoinExec")) as f64
                    / (1 << 20) as f64,
                metric("bytes_to_device", "DeviceHashJoinExec") as f64 / (1 << 20) as f64,
                metric("bytes_from_device", "DeviceUnloadExec") as f64 / (1 << 20) as f64,
                tpch::region_times(&first),
            );
        }
        drop((joins_ctx, joins_plain, tables, slot_pool));
    }

    drop((ctx, plain, pool));
    no_leak_once_released(&check, "the figures' regions on CUDA");
}
