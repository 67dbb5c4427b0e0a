//! The TPC-H revenue query with the device step beside DataFusion alone:
//!
//! - `datafusion`: `SELECT ..., l_extendedprice * (1 - l_discount) AS revenue FROM
//!   lineitem WHERE ...`, DataFusion computing the product;
//! - `device_step/<device>`: the scan's plan under a `DeviceExec` whose step computes it
//!   on the device (uploading the two columns, downloading the product);
//!
//!   both physical plans built once, before measuring: each iteration executes its plan
//!   (`collect`), neither plans (SQL parsing and optimizing are not measured);
//! - `transfers_only/<device>`: the device step's transfers alone, without DataFusion or
//!   the step: the same rows' two input columns up and one `Decimal128` column down, batch
//!   by batch, one partition after the other (`Transfer::to_device`, `to_host`; only
//!   those are timed).
//!
//! Before measuring, a second run of each (the first warms up) prints the bytes moved and
//! the transfer share (`transfers_only` over `device_step`, single runs; criterion's
//! figures below give the same ratio with confidence intervals). The plan's partitions run in parallel and the
//! transfers-only run in one thread, so the share is an upper bound when partitions
//! overlap their transfers.
//!
//! ```text
//! cargo bench --bench revenue                          # auto: CUDA 0, else the CPU device
//! DEVARROW_DEVICE=cpu DEVARROW_TPCH_SCALE=0.5 cargo bench --bench revenue
//! ```

#[path = "../tests/common/mod.rs"]
mod common;

use std::time::{Duration, Instant};

use arrow_array::RecordBatch;
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use datafusion::physical_plan::{collect, ExecutionPlan};
use devarrow::bridge::{Transfer, TransferOptions};
use devarrow_datafusion::ExecDevice;

use common::*;

fn revenue(c: &mut Criterion) {
    let runtime = tokio::runtime::Runtime::new().expect("tokio runtime");
    let spec = std::env::var("DEVARROW_DEVICE").unwrap_or_else(|_| "auto".into());
    let scale: f64 = std::env::var("DEVARROW_TPCH_SCALE")
        .ok()
        .map(|s| s.parse().expect("DEVARROW_TPCH_SCALE is a number"))
        .unwrap_or(0.1);
    let partitions = std::thread::available_parallelism().map_or(2, |n| n.get());
    let device = ExecDevice::open(&spec).expect("the device");
    let ctx = session(lineitem(scale, partitions, 8192));
    let plan = runtime
        .block_on(device_plan(&ctx, device.clone()))
        .expect("the device plan");
    // DataFusion alone, planned once as the device plan is.
    let datafusion_plan = runtime
        .block_on(async { ctx.sql(REVENUE_SQL).await?.create_physical_plan().await })
        .expect("DataFusion's plan");

    // The step's transfers alone: its input columns up, a column of its output's size down.
    let inputs: Vec<RecordBatch> = runtime
        .block_on(collect(plan.input().clone(), ctx.task_ctx()))
        .expect("the scan")
        .into_iter()
        .filter(|b| b.num_rows() > 0)
        .map(|b| {
            let schema = b.schema();
            let indices = ["l_extendedprice", "l_discount"].map(|c| schema.index_of(c).unwrap());
            b.project(&indices).unwrap()
        })
        .collect();
    let mut transfer = Transfer::new(device.device().clone(), TransferOptions::default());
    // Times the uploads of the inputs and the downloads of a column of the output's size
    // (a one-column upload stands in for the output the device would make; not timed).
    let transfers_only = |transfer: &mut Transfer| -> Duration {
        let mut timed = Duration::ZERO;
        for batch in &inputs {
            let output = transfer
                .to_device(&batch.project(&[0]).unwrap())
                .expect("upload");
            let t = Instant::now();
            let up = transfer.to_device(batch).expect("upload");
            up.event().wait_host().expect("upload done");
            transfer.to_host(&output).expect("download");
            timed += t.elapsed();
            drop(up);
        }
        timed
    };
    let time = |f: &mut dyn FnMut()| {
        let t = Instant::now();
        f();
        t.elapsed()
    };

    // One run of each for the check, then one more of each, timed, for the transfer share
    // (the first run of the plan pays for warming up).
    let on_device = runtime
        .block_on(collect(plan.clone(), ctx.task_ctx()))
        .expect("device plan");
    // The bytes of one run (the node's metrics add up over its runs).
    let metrics = plan.metrics().expect("metrics").aggregate_by_name();
    transfers_only(&mut transfer);
    let device_time = time(&mut || {
        runtime
            .block_on(collect(plan.clone(), ctx.task_ctx()))
            .expect("device plan");
    });
    let by_datafusion = runtime
        .block_on(collect(datafusion_plan.clone(), ctx.task_ctx()))
        .expect("DataFusion");
    let n = check_against_datafusion(&on_device, &by_datafusion);
    transfer.take_stats();
    let transfer_time = transfers_only(&mut transfer);
    let stats = transfer.take_stats();

    let value = |name: &str| metrics.sum_by_name(name).map_or(0, |m| m.as_usize()) as f64;
    let gbps = |bytes: u64, d: Duration| bytes as f64 / d.as_secs_f64().max(1e-9) / 1e9;
    eprintln!(
        "device {} at scale {scale} ({n} rows, {partitions} partitions): {:.1} MiB up, \
         {:.1} MiB down; device plan {device_time:.2?}, its transfers alone \
         {transfer_time:.2?} (up {:.2} GB/s, down {:.2} GB/s): transfer share {:.0}%",
        device.id(),
        value("bytes_to_device") / (1 << 20) as f64,
        value("bytes_from_device") / (1 << 20) as f64,
        gbps(stats.to_device.bytes, stats.to_device.total()),
        gbps(stats.to_host.bytes, stats.to_host.total()),
        100.0 * transfer_time.as_secs_f64() / device_time.as_secs_f64().max(1e-9),
    );

    let mut group = c.benchmark_group(format!("tpch_revenue_sf{scale}"));
    group.sample_size(10);
    group.throughput(Throughput::Elements(n as u64));
    group.bench_function("datafusion", |b| {
        b.to_async(&runtime).iter(|| async {
            collect(datafusion_plan.clone(), ctx.task_ctx())
                .await
                .unwrap()
        })
    });
    group.bench_function(format!("device_step/{}", device.id()), |b| {
        b.to_async(&runtime).iter(|| async {
            let plan: std::sync::Arc<dyn ExecutionPlan> = plan.clone();
            collect(plan, ctx.task_ctx()).await.unwrap()
        })
    });
    group.bench_function(format!("transfers_only/{}", device.id()), |b| {
        b.iter_custom(|iters| (0..iters).map(|_| transfers_only(&mut transfer)).sum())
    });
    group.finish();
}

criterion_group!(benches, revenue);
criterion_main!(benches);
