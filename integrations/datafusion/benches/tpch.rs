//! TPC-H Q1 and Q6 with their filter, projection and partial aggregate on a device
//! (`DevicePlacementRule`: one region each) beside DataFusion alone, planning outside the
//! timing in both arms (each iteration executes a physical plan made beforehand: a
//! DataFusion plan with a `RepartitionExec` runs only once):
//!
//! - `q1/datafusion`, `q1/device`, `q6/datafusion`, `q6/device`;
//! - `transitions/load_unload`: the region's transitions alone: Q1's scan onto the device
//!   and back (a region of no operator), in bytes per second;
//! - `transitions/host_ceiling`: the same bytes copied host to host by every core at once,
//!   the better of `memcpy` and streaming stores (devarrow's packing writes with
//!   streaming stores): what the host can do, measured in the same run. On the CPU device
//!   a "transition" is a host copy, so its GB/s is read against this ceiling.
//!
//! - `transitions_modelled_link/load_unload` and `.../pinned_round_trip`: the same
//!   transitions on a CPU device whose copies take the time of a modelled link
//!   (`DEVARROW_BENCH_LINK`, default `2GB/s,10us`: devarrow's `LinkModel`), 4 device slots
//!   as on a GPU, beside one copy of the same bytes each way from pinned staging on the
//!   same link: whether the transitions' pipeline keeps a link busy (the issue's goal on
//!   a GPU, 0.85x of the pinned round trip), on a machine with no GPU. Meaningful for a
//!   link well below the host's copy rate (the model sleeps out each copy's time).
//!
//! Before measuring, one run of each device plan prints where the region's time went (its
//! nodes' metrics: `load_time`, each operator's `device_time`, `unload_time`), so the
//! transitions' share is read off the same plan.
//!
//! ```text
//! cargo bench --bench tpch                              # auto: CUDA 0, else the CPU device
//! DEVARROW_DEVICE=cpu DEVARROW_TPCH_SCALE=1 cargo bench --bench tpch
//! ```

#[path = "../tests/common/mod.rs"]
mod common;

#[path = "../tests/common/tpch.rs"]
mod tpch;

use std::sync::Arc;
use std::time::Instant;

use arrow_array::RecordBatch;
use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use datafusion::physical_plan::{collect, execute_stream, ExecutionPlan};
use datafusion::prelude::{SessionConfig, SessionContext};
use devarrow::abi::device::{CpuDevice, Device, LinkModel};
use devarrow::bridge::copy::{copy_bytes, Stores};
use devarrow_datafusion::config::{DevicePlacement, DevicePool};
use devarrow_datafusion::region::{DeviceLoadExec, DeviceUnloadExec};
use devarrow_datafusion::{device_session, ExecDevice};
use futures::StreamExt;

use common::*;

/// Q1's scan: the columns its region loads.
const Q1_SCAN: &str = "select l_quantity, l_extendedprice, l_discount, l_tax, l_returnflag, \
    l_linestatus, l_shipdate from lineitem";

/// Sums a metric over every node of `plan` named `node` (`None`: every node).
fn metric(plan: &Arc<dyn ExecutionPlan>, node: Option<&str>, name: &str) -> f64 {
    let mut total = 0.0;
    let mut stack = vec![plan.clone()];
    while let Some(n) = stack.pop() {
        if node.is_none_or(|want| n.name() == want) {
            if let Some(m) = n.metrics() {
                total += m.sum_by_name(name).map_or(0, |v| v.as_usize()) as f64;
            }
        }
        stack.extend(n.children().into_iter().cloned());
    }
    total
}

/// The host's copy ceiling for `bytes` bytes: every core copying its share into
/// pre-faulted memory, the better of ordinary and streaming stores, in GB/s.
fn host_ceiling(source: &[u8], target: &mut [u8]) -> (f64, f64) {
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let run = |stores: Stores, target: &mut [u8]| -> f64 {
        let chunk = source.len().div_ceil(threads);
        let start = Instant::now();
        std::thread::scope(|s| {
            for (from, to) in source.chunks(chunk).zip(target.chunks_mut(chunk)) {
                s.spawn(move || {
                    // SAFETY: `to` and `from` are disjoint slices of the same length
                    // (chunks of equal-length buffers), each borrowed for the call.
                    unsafe { copy_bytes(to.as_mut_ptr(), from.as_ptr(), from.len(), stores) };
                });
            }
        });
        source.len() as f64 / start.elapsed().as_secs_f64() / 1e9
    };
    run(Stores::Cached, target);
    let mut best = (0.0f64, 0.0f64);
    for _ in 0..3 {
        best.0 = best.0.max(run(Stores::Cached, target));
        best.1 = best.1.max(run(Stores::Streaming, target));
    }
    best
}

fn tpch(c: &mut Criterion) {
    let runtime = tokio::runtime::Runtime::new().expect("tokio runtime");
    let spec = std::env::var("DEVARROW_DEVICE").unwrap_or_else(|_| "auto".into());
    let scale: f64 = std::env::var("DEVARROW_TPCH_SCALE")
        .ok()
        .map(|s| s.parse().expect("DEVARROW_TPCH_SCALE is a number"))
        .unwrap_or(1.0);
    let partitions = std::thread::available_parallelism().map_or(2, |n| n.get());
    let data = lineitem(scale, partitions, 8192);
    let plain = session(data.clone());
    let device = device_session(SessionConfig::new().with_target_partitions(partitions));
    register_lineitem(&device, data);
    let set = |ctx: &SessionContext, sql: &str| {
        runtime
            .block_on(async { ctx.sql(sql).await?.collect().await })
            .expect(sql);
    };
    set(&device, &format!("SET devarrow.devices = '{spec}'"));
    let plan_of = |ctx: &SessionContext, sql: &str| -> Arc<dyn ExecutionPlan> {
        runtime
            .block_on(async { ctx.sql(sql).await?.create_physical_plan().await })
            .expect(sql)
    };

    let mut group = c.benchmark_group("tpch");
    group.sample_size(10);
    for (name, sql) in [("q1", tpch::query(1)), ("q6", tpch::query(6))] {
        let on_host = plan_of(&plain, sql);
        let on_device = plan_of(&device, sql);
        let want = runtime
            .block_on(collect(on_host.clone(), plain.task_ctx()))
            .unwrap();
        let got = runtime
            .block_on(collect(on_device.clone(), device.task_ctx()))
            .unwrap();
        let text = |b: &[RecordBatch]| {
            datafusion::arrow::util::pretty::pretty_format_batches(b)
                .unwrap()
                .to_string()
        };
        assert_eq!(text(&got), text(&want), "{name}: the device plan's result");
        let ms = |ns: f64| ns / 1e6;
        eprintln!(
            "{name} at scale {scale} on {spec} ({partitions} partitions), the region's time \
             summed over partitions: load {:.1} ms ({:.1} MiB up), operators {:.1} ms, \
             unload {:.1} ms ({:.2} MiB down): transitions {:.0}% of the region",
            ms(metric(&on_device, Some("DeviceLoadExec"), "load_time")),
            metric(&on_device, Some("DeviceLoadExec"), "bytes_to_device") / (1 << 20) as f64,
            ms(metric(&on_device, None, "device_time")),
            ms(metric(&on_device, Some("DeviceUnloadExec"), "unload_time")),
            metric(&on_device, Some("DeviceUnloadExec"), "bytes_from_device") / (1 << 20) as f64,
            100.0
                * (metric(&on_device, Some("DeviceLoadExec"), "load_time")
                    + metric(&on_device, Some("DeviceUnloadExec"), "unload_time"))
                / (metric(&on_device, Some("DeviceLoadExec"), "load_time")
                    + metric(&on_device, None, "device_time")
                    + metric(&on_device, Some("DeviceUnloadExec"), "unload_time"))
                .max(1.0),
        );
        // A DataFusion physical plan with a RepartitionExec runs once: each iteration gets
        // a plan made beforehand, outside the timing (both arms alike).
        group.bench_function(format!("{name}/datafusion"), |b| {
            b.iter_batched(
                || plan_of(&plain, sql),
                |plan| runtime.block_on(collect(plan, plain.task_ctx())).unwrap(),
                BatchSize::PerIteration,
            )
        });
        group.bench_function(format!("{name}/device"), |b| {
            b.iter_batched(
                || plan_of(&device, sql),
                |plan| runtime.block_on(collect(plan, device.task_ctx())).unwrap(),
                BatchSize::PerIteration,
            )
        });
    }
    group.finish();

    // The transitions alone, and the host's ceiling for the same bytes.
    let scan = plan_of(&plain, Q1_SCAN);
    let batches = runtime
        .block_on(collect(scan.clone(), plain.task_ctx()))
        .unwrap();
    let bytes: usize = batches
        .iter()
        .flat_map(|b| b.columns().iter())
        .map(|c| c.to_data().get_slice_memory_size().unwrap_or(0))
        .sum();
    let round_trip: Arc<dyn ExecutionPlan> = Arc::new(
        DeviceUnloadExec::try_new(Arc::new(DeviceLoadExec::new(scan.clone()))).expect("a region"),
    );
    let source = vec![1u8; bytes];
    let mut target = vec![0u8; bytes];
    let (memcpy, streaming) = host_ceiling(&source, &mut target);
    eprintln!(
        "transitions: Q1's scan, {:.1} MiB; host ceiling (every core, pre-faulted): memcpy \
         {memcpy:.1} GB/s, streaming stores {streaming:.1} GB/s",
        bytes as f64 / (1 << 20) as f64
    );
    let mut group = c.benchmark_group("transitions");
    group.sample_size(10);
    group.throughput(Throughput::Bytes(bytes as u64));
    // Each batch is dropped as it arrives, as an operator above the region would: a
    // `collect` would hold every landed batch, so that each run lands in memory fresh
    // from the system.
    let drain = |plan: Arc<dyn ExecutionPlan>| -> usize {
        runtime.block_on(async {
            let mut stream = execute_stream(plan, device.task_ctx()).unwrap();
            let mut rows = 0;
            while let Some(batch) = stream.next().await {
                rows += batch.unwrap().num_rows();
            }
            rows
        })
    };
    let probe: Arc<dyn ExecutionPlan> = Arc::new(
        DeviceUnloadExec::try_new(Arc::new(DeviceLoadExec::new(scan.clone()))).expect("a region"),
    );
    drain(probe.clone());
    let seconds = |node: &str, name: &str| metric(&probe, Some(node), name) / 1e9;
    eprintln!(
        "transitions, one run: load {:.1} GB/s per partition thread ({:.1} ms summed), unload \
         {:.1} GB/s per partition thread ({:.1} ms summed)",
        bytes as f64 / seconds("DeviceLoadExec", "load_time") / 1e9,
        seconds("DeviceLoadExec", "load_time") * 1e3,
        metric(&probe, Some("DeviceUnloadExec"), "bytes_from_device")
            / seconds("DeviceUnloadExec", "unload_time")
            / 1e9,
        seconds("DeviceUnloadExec", "unload_time") * 1e3,
    );
    group.bench_function("load_unload", |b| b.iter(|| drain(round_trip.clone())));
    group.bench_function("host_ceiling", |b| {
        let stores = if streaming >= memcpy {
            Stores::Streaming
        } else {
            Stores::Cached
        };
        let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
        let chunk = source.len().div_ceil(threads);
        b.iter(|| {
            std::thread::scope(|s| {
                for (from, to) in source.chunks(chunk).zip(target.chunks_mut(chunk)) {
                    s.spawn(move || {
                        // SAFETY: `to` and `from` are disjoint slices of the same
                        // length, each borrowed for the call.
                        unsafe { copy_bytes(to.as_mut_ptr(), from.as_ptr(), from.len(), stores) };
                    });
                }
            })
        })
    });
    group.finish();

    // The same transitions on a modelled link, beside the link's pinned round trip.
    let link: LinkModel = std::env::var("DEVARROW_BENCH_LINK")
        .unwrap_or_else(|_| "2GB/s,10us".into())
        .parse()
        .expect("DEVARROW_BENCH_LINK is BANDWIDTH,LATENCY");
    let modelled = Arc::new(CpuDevice::with_link(link));
    let pool = Arc::new(
        DevicePool::new(ExecDevice::from_cpu(modelled.clone()), 4).expect("a device pool"),
    );
    let on_link = || -> Arc<dyn ExecutionPlan> {
        Arc::new(
            DeviceUnloadExec::try_new(Arc::new(DeviceLoadExec::with_placement(
                scan.clone(),
                DevicePlacement::Pools(vec![pool.clone()]),
            )))
            .expect("a region"),
        )
    };
    modelled.reserve_staging(bytes).expect("staging");
    let mut staging = modelled.allocate_staging(bytes).expect("staging");
    let on_device = modelled.allocate(bytes).expect("device memory");
    let host = staging.as_mut_slice().as_mut_ptr();
    let link_device: &dyn Device = modelled.as_ref();
    let ideal = 2.0 * link.copy_time(bytes).as_secs_f64();
    let run = drain(on_link());
    eprintln!(
        "transitions on a modelled link ({link}): {run} rows, {:.1} MiB each way; the \
         link's round trip {:.1} ms",
        bytes as f64 / (1 << 20) as f64,
        ideal * 1e3
    );
    let mut group = c.benchmark_group("transitions_modelled_link");
    group.sample_size(10);
    group.throughput(Throughput::Bytes(bytes as u64));
    group.bench_function("load_unload", |b| b.iter(|| drain(on_link())));
    group.bench_function("pinned_round_trip", |b| {
        b.iter(|| {
            // SAFETY: `host` (pinned staging, `bytes` long) and `on_device` (`bytes` long)
            // outlive both copies, each waited for before the next and before the end.
            unsafe { link_device.copy_to_device(host, on_device.address(), bytes) }.unwrap();
            link_device.record_event().unwrap().wait_host().unwrap();
            // SAFETY: as above, the other way.
            unsafe { link_device.copy_to_host(on_device.address(), host, bytes) }.unwrap();
            link_device.record_event().unwrap().wait_host().unwrap();
        })
    });
    group.finish();
}

criterion_group!(benches, tpch);
criterion_main!(benches);
