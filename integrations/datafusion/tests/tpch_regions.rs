//! TPC-H's 22 queries through device regions on the CPU device, whatever devarrow's
//! compute can do yet: the rule asks a factory of the test's own (as an engine would
//! register one) that makes a device operator of every filter and projection, evaluated
//! by DataFusion on the host inside the region (the frame comes down, the expression
//! runs, the result goes up again, a filter's as a pending selection). Slow, and exactly
//! DataFusion's results, so what this checks is the rule's and the regions' plumbing
//! (loads, unloads, pending selections, merged regions, declared properties) on real
//! plans: every query must give DataFusion's rows.
//!
//! `DEVARROW_TPCH_SCALE` (default 0.01) and `DEVARROW_TPCH_PARTITIONS` (default 4), as
//! in `tests/tpch.rs`; `DEVARROW_TPCH_SLOTS`: `devarrow.partitions_per_device`.
//!
//! Nested regions (a region whose input holds regions: Q3's region over a sort of joins
//! of regions) once deadlocked: a partition held its device slot while it waited for its
//! input, so an outer region's partitions could take every slot and leave the inner ones
//! none. A partition now holds a slot only while it works on the device;
//! `nested_regions_do_not_deadlock_even_on_one_slot` runs Q3 with 4 partitions on one slot.

mod common;

#[path = "common/host_eval.rs"]
mod host_eval;

#[path = "common/tpch.rs"]
mod tpch;

use std::sync::{Arc, OnceLock};

use datafusion::execution::session_state::SessionStateBuilder;
use datafusion::physical_plan::{collect, displayable};
use datafusion::prelude::{SessionConfig, SessionContext};
use devarrow_datafusion::rule::DeviceOperatorRegistry;
use devarrow_datafusion::{DevarrowConfig, DevicePlacementRule};

use host_eval::HostEvalFactory;

use tpch::{compare_results, host_session, Placement, Tables};

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    match std::env::var(name) {
        Ok(value) => value
            .parse()
            .unwrap_or_else(|_| panic!("{name}={value} does not parse")),
        Err(_) => default,
    }
}

fn partitions() -> usize {
    env_or("DEVARROW_TPCH_PARTITIONS", 4)
}

fn tables() -> &'static Tables {
    static TABLES: OnceLock<Tables> = OnceLock::new();
    TABLES.get_or_init(|| Tables::generate(env_or("DEVARROW_TPCH_SCALE", 0.01), partitions()))
}

/// Every filter and projection, evaluated on the host inside a region.
/// A session whose rule asks [`HostEvalFactory`], its regions on the CPU device, with
/// `slots` partitions per device (`None`: the default).
async fn host_eval_session(
    tables: &Tables,
    partitions: usize,
    slots: Option<usize>,
) -> SessionContext {
    let mut registry = DeviceOperatorRegistry::empty();
    registry.register(Arc::new(HostEvalFactory::default()));
    let config = SessionConfig::new()
        .with_target_partitions(partitions)
        .with_option_extension(DevarrowConfig::default());
    let state = SessionStateBuilder::new()
        .with_config(config)
        .with_default_features()
        .with_physical_optimizer_rule(Arc::new(DevicePlacementRule::new(registry)))
        .build();
    let ctx = SessionContext::new_with_state(state);
    ctx.sql("SET devarrow.devices = 'cpu'")
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    if let Some(slots) = slots {
        ctx.sql(&format!("SET devarrow.partitions_per_device = {slots}"))
            .await
            .unwrap()
            .collect()
            .await
            .unwrap();
    }
    tables.register(&ctx).unwrap();
    ctx
}

/// The sessions' `devarrow.partitions_per_device` (`None`: the default).
fn slots() -> Option<usize> {
    std::env::var("DEVARROW_TPCH_SLOTS")
        .ok()
        .map(|s| s.parse().expect("DEVARROW_TPCH_SLOTS is a count"))
}

async fn check_query(q: usize) {
    let tables = tables();
    let partitions = partitions();
    let host = host_session(tables, partitions).unwrap();
    let device = host_eval_session(tables, partitions, slots()).await;
    let want = match host.sql(tpch::query(q)).await {
        Ok(df) => df.collect().await,
        Err(e) => Err(e),
    }
    .unwrap_or_else(|e| panic!("Q{q} on DataFusion alone: {e}"));
    let plan = tpch::plan_query(&device, q)
        .await
        .unwrap_or_else(|e| panic!("Q{q}'s plan with host-evaluated regions: {e}"));
    let placement = Placement::of(&plan);
    let shown = || displayable(plan.as_ref()).indent(true).to_string();
    if std::env::var_os("DEVARROW_TPCH_SHOW_PLANS").is_some() {
        println!("Q{q} with host-evaluated regions:\n{}", shown());
    }
    let got = collect(plan.clone(), device.task_ctx())
        .await
        .unwrap_or_else(|e| panic!("Q{q} with host-evaluated regions: {e}\n{}", shown()));
    let rows = compare_results(&got, &want).unwrap_or_else(|diff| {
        panic!(
            "Q{q}: with host-evaluated regions, not DataFusion's results: {diff}\nplan:\n{}",
            shown()
        )
    });
    println!("Q{q:02} (host-evaluated regions): {rows} rows, equal; placement: {placement}");
    assert!(
        !placement.regions.is_empty(),
        "Q{q}: no region:\n{}",
        shown()
    );
}

macro_rules! tpch_queries {
    ($($name:ident: $q:literal),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                check_query($q).await;
            }
        )*
    };
}

tpch_queries! {
    q01: 1, q02: 2, q03: 3, q04: 4, q05: 5, q06: 6, q07: 7, q08: 8, q09: 9, q10: 10,
    q11: 11, q12: 12, q13: 13, q14: 14, q15: 15, q16: 16, q17: 17, q18: 18, q19: 19,
    q20: 20, q21: 21, q22: 22,
}

/// Q3 (a region over a sort of joins of regions) with 4 partitions on one device slot:
/// before slots were held only for device work, it waited forever (this fails after 60 s
/// instead).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nested_regions_do_not_deadlock_even_on_one_slot() {
    let device = host_eval_session(tables(), 4, Some(1)).await;
    let plan = tpch::plan_query(&device, 3).await.unwrap();
    let (done, wait) = std::sync::mpsc::channel();
    let task_ctx = device.task_ctx();
    tokio::spawn(async move {
        let _ = done.send(collect(plan, task_ctx).await.map(|b| b.len()));
    });
    let result =
        tokio::task::spawn_blocking(move || wait.recv_timeout(std::time::Duration::from_secs(60)))
            .await
            .unwrap();
    match result {
        Ok(batches) => {
            batches.unwrap();
        }
        Err(_) => panic!("Q3 with 4 partitions on one device slot: no result after 60 s"),
    }
}
