//! TPC-H lineitem in DataFusion, with one step on a device: `revenue = l_extendedprice *
//! (1 - l_discount)` per row, computed by a PTX kernel on CUDA (or by the CPU device's
//! equivalent), inside the physical plan of a SQL query; then summed by flag in SQL, and
//! everything checked against DataFusion's own result.
//!
//! ```text
//! cargo run --release --example tpch_revenue -- [DEVICE] [SCALE] [PARTITIONS]
//! ```
//! DEVICE is a devarrow device string (`auto`, the default: CUDA device 0 when there is
//! one, else the CPU device; `cpu`; `cuda:N`), SCALE the TPC-H scale factor (default
//! 0.1: 600,000 rows), PARTITIONS DataFusion's partitions (default 4).

#[path = "../tests/common/mod.rs"]
mod common;

use std::error::Error;
use std::sync::Arc;
use std::time::Instant;

use datafusion::datasource::MemTable;
use datafusion::physical_plan::{collect, displayable, ExecutionPlan};
use devarrow_datafusion::ExecDevice;

use common::*;

/// The final query, over the device plan's rows and over lineitem.
const BY_FLAG: &str = "SELECT l_returnflag, sum(revenue) AS revenue FROM {t} \
                       GROUP BY l_returnflag ORDER BY l_returnflag";

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let spec = args.first().map(String::as_str).unwrap_or("auto");
    let scale: f64 = args.get(1).map(|s| s.parse()).transpose()?.unwrap_or(0.1);
    let partitions: usize = args.get(2).map(|s| s.parse()).transpose()?.unwrap_or(4);

    let device = ExecDevice::open(spec)?;
    println!("device: {} (asked for `{spec}`)", device.id());
    let t = Instant::now();
    let ctx = session(lineitem(scale, partitions, 8192));
    println!(
        "lineitem at scale {scale}: {partitions} partitions, generated in {:.2?}",
        t.elapsed()
    );

    // The scan's plan with the device step on top of it.
    let plan = device_plan(&ctx, device).await?;
    println!(
        "\nphysical plan:\n{}",
        displayable(plan.as_ref()).indent(true)
    );

    let t = Instant::now();
    let on_device = collect(plan.clone(), ctx.task_ctx()).await?;
    let device_time = t.elapsed();
    let t = Instant::now();
    let by_datafusion = datafusion_revenue(&ctx).await?;
    let datafusion_time = t.elapsed();
    let n = check_against_datafusion(&on_device, &by_datafusion);
    println!(
        "revenue of {n} rows: the device step's equals DataFusion's, row by row \
         (device plan {device_time:.2?}, DataFusion alone {datafusion_time:.2?})"
    );

    // The rest of the query in SQL, over the device plan's output.
    let rows = MemTable::try_new(plan.schema(), vec![on_device])?;
    ctx.register_table("device_rows", Arc::new(rows))?;
    let ours = ctx
        .sql(&BY_FLAG.replace("{t}", "device_rows"))
        .await?
        .collect()
        .await?;
    ctx.register_table(
        "datafusion_rows",
        Arc::new(MemTable::try_new(
            by_datafusion[0].schema(),
            vec![by_datafusion],
        )?),
    )?;
    let theirs = ctx
        .sql(&BY_FLAG.replace("{t}", "datafusion_rows"))
        .await?
        .collect()
        .await?;
    if ours != theirs {
        return Err("sum(revenue) by flag differs from DataFusion's".into());
    }
    println!(
        "\nsum(revenue) by l_returnflag (the same as DataFusion's):\n{}",
        arrow_cast_pretty(&ours)?
    );

    // What the device step cost, from DataFusion's metrics of the node.
    let metrics = plan.metrics().ok_or("no metrics")?.aggregate_by_name();
    println!("DeviceExec metrics: {metrics}");
    let nanos = |name: &str| metrics.sum_by_name(name).map_or(0, |m| m.as_usize()) as f64;
    let bytes = |name: &str| metrics.sum_by_name(name).map_or(0, |m| m.as_usize());
    println!(
        "moved {:.1} MiB up, {:.1} MiB down; the partitions waited {:.1} ms for uploaded \
         batches (the child's work and the uploads that read-ahead did not hide), spent \
         {:.1} ms in the step and {:.1} ms downloading (the bench separates the transfers)",
        bytes("bytes_to_device") as f64 / (1 << 20) as f64,
        bytes("bytes_from_device") as f64 / (1 << 20) as f64,
        nanos("upload_wait") / 1e6,
        nanos("device_step") / 1e6,
        nanos("download") / 1e6,
    );
    Ok(())
}

fn arrow_cast_pretty(batches: &[arrow_array::RecordBatch]) -> Result<String, Box<dyn Error>> {
    Ok(datafusion::arrow::util::pretty::pretty_format_batches(batches)?.to_string())
}
