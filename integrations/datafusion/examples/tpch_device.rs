//! TPC-H queries with devarrow's placement rule (device regions where it can make them,
//! the host elsewhere) against DataFusion alone: the same rows, checked row by row, and
//! the time of each.
//!
//! ```text
//! cargo run --release --example tpch_device -- [DEVICES] [SCALE] [PARTITIONS] [QUERIES]
//! ```
//! DEVICES is `devarrow.devices` (`auto`, the default: CUDA device 0 when there is one,
//! else the CPU device; `cpu`; `cuda:N`; `cuda:0,1`), SCALE the TPC-H scale factor
//! (default 1), PARTITIONS the tables' partitions and DataFusion's target partitions
//! (default: the CPUs), QUERIES `q1,q6` (the default), any list of `qN`, or `all`.
//!
//! `DEVARROW_TPCH_STRINGS=utf8` (or `large_utf8`) casts the tables' string columns from
//! tpchgen's `Utf8View` first.
//!
//! Each query runs twice per session, each run's physical plan made before the run (a
//! DataFusion physical plan runs once), outside the timing; the second run's `collect`
//! time is reported. Rows are compared sorted, every
//! value as text (decimals exactly) but floats, within a relative 1e-9. Exits with 1 when
//! any query's results differ or a query fails, 2 on bad arguments.

#[path = "../tests/common/tpch.rs"]
mod tpch;

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use arrow_array::RecordBatch;
use datafusion::error::Result;
use datafusion::physical_plan::{collect, displayable, ExecutionPlan};
use datafusion::prelude::SessionContext;
use devarrow_datafusion::ExecDevice;

use tpch::{
    compare_results, device_session_on, host_session, metric_sum, plan_query, Placement, Tables,
};

/// Query `q` planned and collected twice in `ctx`: the first plan, and the second run's
/// batches and time (of `collect` alone: each plan is made before its run starts; a
/// DataFusion 55 physical plan runs once, its `RepartitionExec`s' channels are taken by
/// the first run).
async fn run_twice(
    ctx: &SessionContext,
    q: usize,
) -> Result<(Arc<dyn ExecutionPlan>, Vec<RecordBatch>, Duration)> {
    let first = plan_query(ctx, q).await?;
    collect(first.clone(), ctx.task_ctx()).await?;
    let second = plan_query(ctx, q).await?;
    let start = Instant::now();
    let batches = collect(second, ctx.task_ctx()).await?;
    Ok((first, batches, start.elapsed()))
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Runs query `q` both ways; `Ok(false)` when the results differ.
async fn check(
    q: usize,
    host: &SessionContext,
    device: &SessionContext,
) -> Result<bool, Box<dyn std::error::Error>> {
    let (_, want, host_time) = run_twice(host, q).await?;
    let (device_plan, got, device_time) = run_twice(device, q).await?;
    let placement = Placement::of(&device_plan);
    match compare_results(&got, &want) {
        Ok(rows) => {
            println!(
                "q{q}: {rows} rows, equal; DataFusion alone {:.1} ms, device plan {:.1} ms; \
                 {} regions, {} host-only",
                ms(host_time),
                ms(device_time),
                placement.regions.len(),
                placement.host_only.len()
            );
            // The first run's plan holds its metrics: the bytes that crossed the link.
            let mib = |b: usize| b as f64 / (1 << 20) as f64;
            // Every device node's: the loads' and unloads', the joins' (their tables,
            // each uploaded once per device and query, and what a join on the host moved;
            // on the CPU device, the bytes a GPU's would move) and what an operator's
            // host fallback moved (a batch down, its result up).
            let link = |metric: &str| -> usize {
                [
                    "DeviceLoadExec",
                    "DeviceUnloadExec",
                    "DeviceHashJoinExec",
                    "DeviceFilterExec",
                    "DeviceProjectionExec",
                    "DevicePartialAggregateExec",
                ]
                .iter()
                .map(|node| metric_sum(&device_plan, node, metric))
                .sum()
            };
            let tables = metric_sum(&device_plan, "DeviceHashJoinExec", "bytes_to_device");
            println!(
                "    link: {:.1} MiB up (of which {:.1} MiB by joins), {:.1} MiB down ({} of \
                 the batches down compacted on the device)",
                mib(link("bytes_to_device")),
                mib(tables),
                mib(link("bytes_from_device")),
                metric_sum(&device_plan, "DeviceUnloadExec", "compacted_batches"),
            );
            // Run-time placement: partitions whose join table stayed on the host.
            let on_host = metric_sum(&device_plan, "DeviceHashJoinExec", "partitions_on_host");
            if on_host > 0 {
                println!("    joins: {on_host} partition(s) joined on the host (build side heavier than estimated)");
            }
            // Batches whose partial aggregate ran on the host (a string group key
            // longer than a device key holds).
            let fallback = metric_sum(
                &device_plan,
                "DevicePartialAggregateExec",
                "host_fallback_batches",
            );
            if fallback > 0 {
                println!("    aggregates: {fallback} batch(es) aggregated on the host (a long string key)");
            }
            println!("    placement: {placement}");
            println!(
                "    times (first run): {}",
                tpch::region_times(&device_plan)
            );
            Ok(true)
        }
        Err(diff) => {
            println!(
                "q{q}: MISMATCH; DataFusion alone {:.1} ms, device plan {:.1} ms; {} regions, \
                 {} host-only\n    placement: {placement}\n{diff}\ndevice plan:\n{}",
                ms(host_time),
                ms(device_time),
                placement.regions.len(),
                placement.host_only.len(),
                displayable(device_plan.as_ref()).indent(true)
            );
            Ok(false)
        }
    }
}

fn usage(why: &str) -> ExitCode {
    eprintln!(
        "{why}\nusage: tpch_device [auto|cpu|cuda:N|cuda:0,1] [SCALE] [PARTITIONS] \
         [q1,q6,...|all] [SET devarrow.<option> = <value>; ...]"
    );
    ExitCode::from(2)
}

#[tokio::main]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let devices = args.first().map(String::as_str).unwrap_or("auto");
    let scale: f64 = match args.get(1).map(|s| s.parse()).transpose() {
        Ok(scale) => scale.unwrap_or(1.0),
        Err(e) => return usage(&format!("SCALE: {e}")),
    };
    let default_partitions = std::thread::available_parallelism().map_or(4, |n| n.get());
    let partitions: usize = match args.get(2).map(|s| s.parse()).transpose() {
        Ok(p) => p.unwrap_or(default_partitions).max(1),
        Err(e) => return usage(&format!("PARTITIONS: {e}")),
    };
    let queries = match tpch::parse_queries(args.get(3).map(String::as_str).unwrap_or("q1,q6")) {
        Ok(queries) => queries,
        Err(e) => return usage(&e),
    };

    // One device: open it now, so that a missing one fails here and not in a query.
    if !devices.contains(',') {
        match ExecDevice::open(devices) {
            Ok(device) => println!("devices: {} (asked for `{devices}`)", device.id()),
            Err(e) => return usage(&format!("device `{devices}`: {e}")),
        }
    } else {
        println!("devices: {devices}");
    }

    let start = Instant::now();
    let tables = Tables::generate(scale, partitions);
    let sizes: Vec<String> = tables
        .tables
        .iter()
        .map(|t| format!("{} {}", t.name, t.rows()))
        .collect();
    println!(
        "TPC-H SF {scale}, {partitions} partitions, generated in {:.1} s: {}",
        start.elapsed().as_secs_f64(),
        sizes.join(", ")
    );

    let host = match host_session(&tables, partitions) {
        Ok(ctx) => ctx,
        Err(e) => return usage(&format!("DataFusion's session: {e}")),
    };
    let device = match device_session_on(&tables, partitions, devices).await {
        Ok(ctx) => ctx,
        Err(e) => return usage(&format!("the device session: {e}")),
    };
    // Session options, as SQL: `"SET devarrow.always_place_joins = true"`.
    for set in args.get(4).into_iter().flat_map(|s| s.split(';')) {
        if set.trim().is_empty() {
            continue;
        }
        let applied = match device.sql(set).await {
            Ok(df) => df.collect().await.map(|_| ()),
            Err(e) => Err(e),
        };
        if let Err(e) = applied {
            return usage(&format!("`{set}`: {e}"));
        }
        println!("{}", set.trim());
    }

    let mut failed = Vec::new();
    for q in queries {
        match check(q, &host, &device).await {
            Ok(true) => {}
            Ok(false) => failed.push(format!("q{q} (results differ)")),
            Err(e) => {
                println!("q{q}: FAILED: {e}");
                failed.push(format!("q{q} ({e})"));
            }
        }
    }
    if failed.is_empty() {
        println!("all equal");
        ExitCode::SUCCESS
    } else {
        println!("FAILED: {}", failed.join("; "));
        ExitCode::FAILURE
    }
}
