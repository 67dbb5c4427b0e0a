//! The revenue plan on real Ballista (55, in-process "standalone" mode): one scheduler and
//! **two executors, each on its own device**, the result checked against DataFusion's.
//!
//! ```text
//! cargo run --release --features ballista --example ballista_two_executors -- [SCALE] [PARTITIONS]
//! ```
//!
//! - lineitem (tpchgen-arrow, default scale 0.05, 4 parts) is written to Parquet files
//!   (Ballista's executors read tables from files, not from the client's memory);
//! - the client builds `SELECT ... FROM lineitem WHERE ...` under a `DeviceStepNode`
//!   (the revenue step, by name) and sends the logical plan to the scheduler
//!   (`DeviceLogicalCodec` around Ballista's codec);
//! - the scheduler plans it with `DevicePlanner` (the node becomes a `DeviceExec`), cuts
//!   it into stages and ships them to the executors (`DeviceExecCodec` around Ballista's
//!   codec: the step's name travels, not code or a device);
//! - each executor decodes the stages with its own codec, holding its own device: here two
//!   CPU devices (`cpu`; on a GPU node it would be `cuda:0`, `cuda:1`, ...), whose memory
//!   pools show that both ran device steps, and that the client's and scheduler's device
//!   (it only plans) ran none.

use std::error::Error;
use std::sync::Arc;

#[path = "../tests/common/mod.rs"]
mod common;

use ballista::prelude::{SessionConfigExt, SessionContextExt};
use ballista_core::serde::protobuf::scheduler_grpc_client::SchedulerGrpcClient;
use ballista_core::serde::{BallistaLogicalExtensionCodec, BallistaPhysicalExtensionCodec};
use datafusion::dataframe::{DataFrame, DataFrameWriteOptions};
use datafusion::execution::SessionStateBuilder;
use datafusion::prelude::{ParquetReadOptions, SessionConfig, SessionContext};
use devarrow::abi::device::CpuDevice;
use devarrow_datafusion::logical::{DeviceLogicalCodec, DevicePlanner, DeviceStepNode};
use devarrow_datafusion::revenue::revenue_step;
use devarrow_datafusion::{DeviceExecCodec, ExecDevice, StepRegistry};

use common::*;

/// A session state whose Ballista codecs carry device steps (other nodes go to
/// Ballista's own codecs) and run them on `device`.
fn state_on(
    registry: &Arc<StepRegistry>,
    device: ExecDevice,
) -> datafusion::execution::SessionState {
    let logical = Arc::new(DeviceLogicalCodec::new(
        registry.clone(),
        Arc::new(BallistaLogicalExtensionCodec::default()),
    ));
    let physical = Arc::new(
        DeviceExecCodec::new(registry.clone(), device.clone())
            .with_fallback(Arc::new(BallistaPhysicalExtensionCodec::default())),
    );
    let config = SessionConfig::new_with_ballista()
        .with_target_partitions(2)
        .with_ballista_standalone_parallelism(1)
        .with_ballista_logical_extension_codec(logical)
        .with_ballista_physical_extension_codec(physical);
    SessionStateBuilder::new()
        .with_config(config)
        .with_default_features()
        .with_query_planner(Arc::new(DevicePlanner::new(registry.clone(), device)))
        .build()
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let scale: f64 = args.first().map(|s| s.parse()).transpose()?.unwrap_or(0.05);
    let parts: usize = args.get(1).map(|s| s.parse()).transpose()?.unwrap_or(4);

    // lineitem as Parquet files, one per generated part.
    let dir =
        std::env::temp_dir().join(format!("devarrow-ballista-lineitem-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let local = session(lineitem(scale, parts, 8192));
    local
        .table("lineitem")
        .await?
        .write_parquet(
            dir.to_str().ok_or("path")?,
            DataFrameWriteOptions::new(),
            None,
        )
        .await?;
    println!(
        "lineitem at scale {scale} in Parquet under {}",
        dir.display()
    );

    let registry = Arc::new(StepRegistry::new());
    registry.register(revenue_step());
    // Three devices: the client's and scheduler's (it plans, and must run nothing), and
    // one per executor.
    let planner_device = Arc::new(CpuDevice::new());
    let (device_a, device_b) = (Arc::new(CpuDevice::new()), Arc::new(CpuDevice::new()));
    let client_state = state_on(&registry, ExecDevice::from_cpu(planner_device.clone()));
    let state_a = state_on(&registry, ExecDevice::from_cpu(device_a.clone()));

    // Ballista's scheduler, and two executors, each with its own device (all in this
    // process, talking gRPC and Arrow Flight over localhost as separate processes would).
    let addr =
        ballista_scheduler::standalone::new_standalone_scheduler_from_state(&client_state).await?;
    let scheduler_url = format!("http://localhost:{}", addr.port());
    let scheduler = loop {
        match SchedulerGrpcClient::connect(scheduler_url.clone()).await {
            Ok(client) => break client,
            Err(_) => tokio::time::sleep(std::time::Duration::from_millis(100)).await,
        }
    };
    let state_b = state_on(&registry, ExecDevice::from_cpu(device_b.clone()));
    ballista_executor::new_standalone_executor_from_state(scheduler.clone(), 1, &state_a).await?;
    ballista_executor::new_standalone_executor_from_state(scheduler, 1, &state_b).await?;
    println!("Ballista: scheduler at {scheduler_url}, executors on cpu device A and cpu device B");
    let ctx = SessionContext::remote_with_state(&scheduler_url, client_state).await?;

    ctx.register_parquet(
        "lineitem",
        dir.to_str().ok_or("path")?,
        ParquetReadOptions::default(),
    )
    .await?;
    let scan = ctx.sql(SCAN).await?;
    let node = DeviceStepNode::try_new(scan.logical_plan().clone(), &revenue_step())?;
    let df = DataFrame::new(ctx.state(), node.into_plan());
    let out = df.collect().await?;

    // DataFusion alone, locally, on the same files.
    let check = SessionContext::new();
    check
        .register_parquet(
            "lineitem",
            dir.to_str().ok_or("path")?,
            ParquetReadOptions::default(),
        )
        .await?;
    let expected = datafusion_revenue(&check).await?;
    let n = check_against_datafusion(&out, &expected);
    let used = |d: &CpuDevice| {
        let s = d.memory_pool_stats();
        s.hits + s.misses
    };
    println!(
        "{n} rows of revenue through Ballista equal DataFusion's; device allocations: \
         executor A {}, executor B {}, client and scheduler {}",
        used(&device_a),
        used(&device_b),
        used(&planner_device)
    );
    std::fs::remove_dir_all(&dir)?;
    if used(&device_a) == 0 || used(&device_b) == 0 {
        return Err("one executor's device ran no step".into());
    }
    if used(&planner_device) != 0 {
        return Err("the client or the scheduler ran a device step".into());
    }
    Ok(())
}
