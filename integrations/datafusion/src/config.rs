//! devarrow's session options ([`DevarrowConfig`], DataFusion's `ConfigExtension` under
//! the prefix `devarrow`) and the devices a plan runs on, chosen when it runs
//! ([`DevicePool`], [`DeviceLease`]).
//!
//! A plan never names a device: the scheduler and the client plan with none. When a
//! partition of a device region starts, it reads `devarrow.devices` from its task's
//! session options, on the machine that runs it (`auto`: every CUDA device there), and
//! takes the device of that list running the fewest partitions
//! ([`DevicePlacement::place`]). Each time it works
//! on the device (an upload; a batch's operators and download) it holds one of that
//! device's slots (`devarrow.partitions_per_device`: the per-device limit of partitions
//! on the device at once), never while it waits for its input, so regions nested in
//! regions (a region above a join of regions) cannot starve each other of slots. On
//! CUDA each slot has its own stream, made when the device is first opened by the
//! process, so one partition's copies overlap another's kernels; a batch is ordered
//! across slots by its events.
//!
//! ```
//! use datafusion::prelude::{SessionConfig, SessionContext};
//! use devarrow_datafusion::config::DevarrowConfig;
//!
//! let config = SessionConfig::new().with_option_extension(DevarrowConfig::default());
//! let ctx = SessionContext::new_with_config(config);
//! // `SET devarrow.devices = 'cuda:0,1'` in SQL, or:
//! let mut state = ctx.state();
//! state.config_mut().options_mut().set("devarrow.devices", "cpu").unwrap();
//! let options = state.config().options().extensions.get::<DevarrowConfig>().unwrap();
//! assert_eq!(options.devices, "cpu");
//! assert_eq!(options.device_requests().unwrap().len(), 1);
//! ```

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use datafusion::common::config::ConfigExtension;
use datafusion::common::extensions_options;
use devarrow::abi::device::{CpuDevice, HostPool};
use devarrow::bridge::{Transfer, TransferOptions};
use devarrow::{DeviceRequest, DeviceSpec};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::error::DeviceExecError;
use crate::step::ExecDevice;

/// What a region's load gathers before one upload by default: 32 MiB, on the plateau of
/// the copy engine's curve measured on the H200 (pinned host to device: 37 GB/s at
/// 1 MiB, 54 at 16 MiB, 55 at 256 MiB; `docs/datafusion-gpu.md`, "Coalescing"), where
/// DataFusion's default batches of 8,192 rows of lineitem (about 1 MiB) are not.
pub const DEFAULT_BATCH_BYTES: usize = 32 << 20;

extensions_options! {
    /// devarrow's options of a DataFusion session (prefix `devarrow`): register with
    /// `SessionConfig::with_option_extension(DevarrowConfig::default())`, set with
    /// `SET devarrow.<name> = ...`.
    pub struct DevarrowConfig {
        /// Whether the `DevicePlacement` rule moves plan nodes onto devices.
        pub enabled: bool, default = true
        /// Whether every join the device can run goes on the device. When false (the
        /// default), a join at the top of a region goes back to the host where it would
        /// move more bytes across the link than the host join: where the region would
        /// be only its input uploaded for it, or its output rows are wider than its
        /// input's (`EXPLAIN` says so).
        pub always_place_joins: bool, default = false
        /// The devices partitions run on, in devarrow's grammar (`auto`, `cpu`,
        /// `cuda:N`, `cuda:N,M,...`, `cuda:all`; `cuda:0,cuda:1` is read as `cuda:0,1`).
        /// Read when a partition starts, where it runs (a Ballista executor reads it
        /// on its own machine), never when the plan is made: `auto` and `cuda:all` are
        /// every CUDA device of that machine (`auto`: the CPU device where it has none).
        /// Each partition goes to the device of the list running the fewest partitions.
        pub devices: String, default = "auto".to_string()
        /// The host bytes a region's load gathers (coalescing small batches) before one
        /// upload; 0: every batch as it comes.
        pub batch_bytes: usize, default = DEFAULT_BATCH_BYTES
        /// Batches a region uploads ahead of its operators (0: on demand).
        pub read_ahead: usize, default = 2
        /// Partitions running on one device at once (each with a stream of its own on
        /// CUDA); a partition beyond waits for one to end.
        pub partitions_per_device: usize, default = 4
        /// A region whose uploads (its loads' inputs and its joins' build sides, by
        /// DataFusion's statistics) come to fewer bytes than this stays on the host
        /// (`EXPLAIN` says so): a region has fixed costs (a device slot, its threads,
        /// launches, a download) that a small query does not earn back. 0 (the
        /// default): every region is placed. On an H200 (2026-11-30,
        /// `docs/datafusion-gpu.md`, "Figures on a GPU") TPC-H Q3, Q5, Q9 and Q10 ran
        /// 0.54-0.82x of DataFusion alone's speed at SF 0.1 and 1.16-1.87x at SF 1, but
        /// no threshold by statistics told them apart (SF 1's Q9, a win, estimates 17.9
        /// MiB for its largest region; SF 0.1's Q10, a loss, 43.6 MiB): the slots'
        /// queueing decided, not the bytes. Q1, Q6 and a strings filter at SF 1 ran
        /// 4.0-10.3x faster.
        pub min_region_bytes: usize, default = 0
    }
}

impl ConfigExtension for DevarrowConfig {
    const PREFIX: &'static str = "devarrow";
}

impl DevarrowConfig {
    /// The devices of [`DevarrowConfig::devices`], one request each, in order.
    ///
    /// # Errors
    /// [`DeviceExecError::Config`] for a string outside devarrow's grammar.
    pub fn device_requests(&self) -> Result<Vec<DeviceRequest>, DeviceExecError> {
        parse_devices(&self.devices)
    }
}

/// `cuda:0,cuda:1` (a list of single devices) or a string of devarrow's grammar.
fn parse_devices(spec: &str) -> Result<Vec<DeviceRequest>, DeviceExecError> {
    let items: Vec<&str> = spec.split(',').collect();
    if items.len() > 1 {
        if let Ok(requests) = items
            .iter()
            .map(|item| item.parse::<DeviceRequest>())
            .collect::<Result<Vec<_>, _>>()
        {
            if requests.iter().any(|r| matches!(r, DeviceRequest::Cuda(_)))
                && requests.iter().all(|r| matches!(r, DeviceRequest::Cuda(_)))
            {
                return Ok(requests);
            }
        }
    }
    let parsed: DeviceSpec = spec
        .parse()
        .map_err(|e| DeviceExecError::Config(format!("devarrow.devices = `{spec}`: {e}")))?;
    Ok(match parsed {
        DeviceSpec::Auto => cuda_all(),
        DeviceSpec::Cpu => vec![DeviceRequest::Cpu],
        DeviceSpec::Cuda(id) => vec![DeviceRequest::Cuda(id)],
        DeviceSpec::CudaList(ids) => ids.into_iter().map(DeviceRequest::Cuda).collect(),
        DeviceSpec::CudaAll => cuda_all(),
    })
}

/// Every CUDA device of the machine that reads the option (`cuda:all`, and `auto`: a
/// partition runs where it is read, so an executor with several GPUs uses them all), or
/// `auto` (the CPU device) when it has none.
fn cuda_all() -> Vec<DeviceRequest> {
    #[cfg(feature = "cuda")]
    if let Ok(devices) = devarrow::cuda::list_devices() {
        if !devices.is_empty() {
            return devices.iter().map(|d| DeviceRequest::Cuda(d.id)).collect();
        }
    }
    vec![DeviceRequest::Auto]
}

/// The slots of one device: `slots` handles of it (on CUDA each on a stream of its own),
/// lent to one partition at a time.
pub struct DevicePool {
    id: String,
    slots: Vec<Slot>,
    free: Mutex<Vec<usize>>,
    permits: Arc<Semaphore>,
    /// Partitions placed on the device and not yet ended ([`PartitionTicket`]s).
    partitions: AtomicUsize,
    /// Partitions ever placed on the device.
    placed: AtomicU64,
}

impl fmt::Debug for DevicePool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DevicePool")
            .field("id", &self.id)
            .field("slots", &self.slots.len())
            .finish_non_exhaustive()
    }
}

impl DevicePool {
    fn open(request: DeviceRequest, slots: usize) -> Result<Self, DeviceExecError> {
        let spec = match request {
            DeviceRequest::Auto => "auto".to_string(),
            DeviceRequest::Cpu => "cpu".to_string(),
            DeviceRequest::Cuda(id) => format!("cuda:{id}"),
        };
        Self::new(ExecDevice::open(&spec)?, slots)
    }

    /// A pool of `slots` handles of `first`'s device: `first`, and on CUDA others with
    /// streams of their own, each with warm transfers.
    ///
    /// # Errors
    /// [`DeviceExecError::Device`] when a stream or a transfer's staging is refused.
    pub fn new(first: ExecDevice, slots: usize) -> Result<Self, DeviceExecError> {
        let slots = slots.max(1);
        let mut handles = vec![Slot::new(first.clone())?];
        for _ in 1..slots {
            handles.push(Slot::new(first.another_stream()?)?);
        }
        // Every slot's downloads land in one pool of pinned memory, reserved now with
        // room for the loads' gathers (a partition's batches coalesced into pinned
        // memory, `devarrow.batch_bytes` each, one per core at once), after every
        // staging chunk is taken (on CUDA the context's pinned memory is shared, and a
        // reservation only makes sure one free range is that large: made before the
        // staging, the staging would eat into it). Without it both came from the 128
        // MiB a CUDA device reserves at open, and beyond it were pageable: uploads from
        // pageable gathers, downloads unpacked from staging (the H200 run of 2026-11-29:
        // the transitions at 0.33x of the pinned copies).
        let device = first.device();
        if !device.host_accessible() {
            let bytes = TransferOptions::default().pinned_host_bytes;
            let gathers =
                std::thread::available_parallelism().map_or(4, |n| n.get()) * DEFAULT_BATCH_BYTES;
            let landing = Arc::new(HostPool::pinned(device.clone(), bytes));
            device
                .reserve_staging(bytes + gathers)
                .map_err(|e| DeviceExecError::Device {
                    spec: first.id().to_string(),
                    reason: e.to_string(),
                })?;
            for slot in &handles {
                slot.download
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .set_pinned_host_pool(Some(landing.clone()));
            }
        }
        Ok(Self {
            id: first.id().to_string(),
            slots: handles,
            free: Mutex::new((0..slots).rev().collect()),
            permits: Arc::new(Semaphore::new(slots)),
            partitions: AtomicUsize::new(0),
            placed: AtomicU64::new(0),
        })
    }

    /// A pool of `slots` handles of an existing CPU device (tests: one device whose
    /// memory they count).
    pub fn cpu(device: Arc<CpuDevice>, slots: usize) -> Self {
        Self::new(ExecDevice::from_cpu(device), slots).expect("the CPU device's transfers prepare")
    }

    /// The slots' device handles (on CUDA, each with its own stream).
    pub fn devices(&self) -> impl Iterator<Item = &ExecDevice> {
        self.slots.iter().map(|slot| &slot.device)
    }

    /// The device handle whose staging memory a partition's load coalesces into (on
    /// CUDA, the context's pinned memory, shared by every slot).
    pub(crate) fn staging_device(&self) -> &ExecDevice {
        &self.slots[0].device
    }

    /// `cpu` or `cuda:N`.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// How many partitions may run on it at once.
    pub fn slots(&self) -> usize {
        self.slots.len()
    }

    /// Partitions of regions placed on the device that have not ended (running, or
    /// waiting for their input or a slot).
    pub fn partitions(&self) -> usize {
        self.partitions.load(Ordering::Acquire)
    }

    /// Partitions ever placed on the device (how a test or an operator sees that every
    /// device of a host was used).
    pub fn placed(&self) -> u64 {
        self.placed.load(Ordering::Acquire)
    }

    /// Slots lent now (partitions working on the device at this moment).
    pub fn in_use(&self) -> usize {
        self.slots.len() - self.permits.available_permits()
    }

    /// Waits for a free slot, blocking the calling thread (a partition's own thread,
    /// never a runtime's).
    pub fn lease_blocking(self: &Arc<Self>) -> DeviceLease {
        futures::executor::block_on(self.lease())
    }

    /// Waits for a free slot, blocking the calling thread: slot `preferred` when it is
    /// free then, any other free one when it is not (as [`DevicePool::lease_preferring`]).
    pub fn lease_blocking_preferring(self: &Arc<Self>, preferred: usize) -> DeviceLease {
        futures::executor::block_on(self.lease_preferring(preferred))
    }

    /// Waits for a free slot (without blocking a thread).
    pub async fn lease(self: &Arc<Self>) -> DeviceLease {
        self.lease_of(None).await
    }

    /// Waits for a free slot (without blocking a thread): slot `preferred` when it is
    /// free once a slot is, any other free one when it is not (it waits for no slot in
    /// particular).
    ///
    /// On CUDA each slot has its own stream. A batch used on the stream it was uploaded
    /// on (or computed on) needs nothing to order it: its memory is written and freed in
    /// stream order there. On another slot's stream every view of it records and waits
    /// for events. A partition's load and operators therefore ask for the slot of the
    /// batch they hold.
    pub async fn lease_preferring(self: &Arc<Self>, preferred: usize) -> DeviceLease {
        self.lease_of(Some(preferred)).await
    }

    async fn lease_of(self: &Arc<Self>, preferred: Option<usize>) -> DeviceLease {
        let permit = self
            .permits
            .clone()
            .acquire_owned()
            .await
            .expect("a device pool's semaphore is never closed");
        let slot = {
            let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
            match preferred.and_then(|slot| free.iter().position(|&s| s == slot)) {
                Some(at) => free.remove(at),
                None => free.pop().expect("a permit guarantees a free slot"),
            }
        };
        DeviceLease {
            pool: self.clone(),
            slot,
            _permit: permit,
        }
    }
}

/// A device handle and its two transfers, lent to one partition at a time.
struct Slot {
    device: ExecDevice,
    upload: Mutex<Transfer>,
    download: Mutex<Transfer>,
}

impl Slot {
    /// The handle and its transfers, their staging allocated now (the warm-up: on CUDA
    /// the pinned allocations that synchronize happen here, not in a running query).
    /// Their downloads' pinned pool is the device pool's ([`DevicePool::new`]).
    fn new(device: ExecDevice) -> Result<Self, DeviceExecError> {
        let transfer = || -> Result<Transfer, DeviceExecError> {
            let options = TransferOptions::default().with_pinned_host_bytes(0);
            let mut transfer = Transfer::new(device.device().clone(), options);
            transfer.prepare().map_err(|e| DeviceExecError::Device {
                spec: device.id().to_string(),
                reason: e.to_string(),
            })?;
            Ok(transfer)
        };
        Ok(Self {
            upload: Mutex::new(transfer()?),
            download: Mutex::new(transfer()?),
            device,
        })
    }
}

/// One slot of a device, held while a partition works on the device (an upload, or a
/// batch's operators and download); dropping it frees the slot.
pub struct DeviceLease {
    pool: Arc<DevicePool>,
    slot: usize,
    _permit: OwnedSemaphorePermit,
}

impl fmt::Debug for DeviceLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceLease")
            .field("device", &self.pool.id)
            .field("slot", &self.slot)
            .finish()
    }
}

impl DeviceLease {
    /// The slot's device handle (on CUDA, with the slot's own stream).
    pub fn device(&self) -> &ExecDevice {
        &self.pool.slots[self.slot].device
    }

    /// The slot's transfer for uploads (warm: its staging allocated when the device was
    /// opened).
    pub fn upload(&self) -> MutexGuard<'_, Transfer> {
        self.pool.slots[self.slot]
            .upload
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// The slot's transfer for downloads (into pinned memory the batches own).
    pub fn download(&self) -> MutexGuard<'_, Transfer> {
        self.pool.slots[self.slot]
            .download
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// The slot's number on its device.
    pub fn slot(&self) -> usize {
        self.slot
    }
}

impl Drop for DeviceLease {
    fn drop(&mut self) {
        self.pool
            .free
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(self.slot);
    }
}

type PoolKey = (String, usize);

fn pools() -> &'static Mutex<HashMap<PoolKey, Arc<DevicePool>>> {
    static POOLS: OnceLock<Mutex<HashMap<PoolKey, Arc<DevicePool>>>> = OnceLock::new();
    POOLS.get_or_init(Default::default)
}

/// The process's pool of `request` with `slots` slots, opened on first use and kept
/// (opening a CUDA device, its streams and its pinned tables is the warm-up that keeps
/// driver calls that synchronize out of running queries).
pub fn pool_for(request: DeviceRequest, slots: usize) -> Result<Arc<DevicePool>, DeviceExecError> {
    let key = (format!("{request:?}"), slots.max(1));
    let mut pools = pools().lock().unwrap_or_else(|e| e.into_inner());
    if let Some(pool) = pools.get(&key) {
        return Ok(pool.clone());
    }
    let pool = Arc::new(DevicePool::open(request, slots)?);
    pools.insert(key, pool.clone());
    Ok(pool)
}

/// A partition's place on a device, from its start to its end: while it lives the
/// partition counts in [`DevicePool::partitions`], which [`DevicePlacement::place`]
/// reads to put the next partition on the device running fewest.
#[derive(Debug)]
pub struct PartitionTicket {
    pool: Arc<DevicePool>,
}

impl PartitionTicket {
    /// The device the partition was placed on.
    pub fn pool(&self) -> &Arc<DevicePool> {
        &self.pool
    }
}

impl Drop for PartitionTicket {
    fn drop(&mut self) {
        self.pool.partitions.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Serializes placements, so that two partitions starting at once see each other.
static PLACING: Mutex<()> = Mutex::new(());

/// Where a region's partitions run: one pool per device, and each partition placed,
/// when it starts, on the device with the fewest partitions running (ties: partition
/// `p` prefers device `p % n`). A Ballista executor runs only some partitions of a
/// stage, so `p % n` alone could put them all on one of its devices.
#[derive(Debug, Clone)]
pub enum DevicePlacement {
    /// The devices of the session's `devarrow.devices`, opened (once per process) when a
    /// partition first runs.
    FromSession,
    /// These pools, whatever the session says (tests, embedders with devices of their
    /// own).
    Pools(Vec<Arc<DevicePool>>),
}

impl DevicePlacement {
    /// Places partition `partition` (under `config`): on the device of the list running
    /// the fewest partitions, first from `partition % n` on among equals. The ticket
    /// counts the partition there until it drops.
    ///
    /// # Errors
    /// [`DeviceExecError::Config`] for a bad `devarrow.devices` or no pool;
    /// [`DeviceExecError::Device`] when a device of the list does not open.
    pub fn place(
        &self,
        config: &DevarrowConfig,
        partition: usize,
    ) -> Result<PartitionTicket, DeviceExecError> {
        let pools = match self {
            Self::Pools(pools) if !pools.is_empty() => pools.clone(),
            Self::Pools(_) => return Err(DeviceExecError::Config("no device pool".into())),
            Self::FromSession => config
                .device_requests()?
                .into_iter()
                .map(|request| pool_for(request, config.partitions_per_device))
                .collect::<Result<Vec<_>, _>>()?,
        };
        let _placing = PLACING.lock().unwrap_or_else(|e| e.into_inner());
        let n = pools.len();
        let chosen = (0..n)
            .map(|k| (partition + k) % n)
            .min_by_key(|&i| pools[i].partitions())
            .expect("at least one pool");
        let pool = pools[chosen].clone();
        pool.partitions.fetch_add(1, Ordering::AcqRel);
        pool.placed.fetch_add(1, Ordering::AcqRel);
        Ok(PartitionTicket { pool })
    }

    /// The pool partition `partition` runs on under `config` when it alone is placed
    /// (device `partition % n` of the list).
    pub fn pool(
        &self,
        config: &DevarrowConfig,
        partition: usize,
    ) -> Result<Arc<DevicePool>, DeviceExecError> {
        match self {
            Self::Pools(pools) if !pools.is_empty() => Ok(pools[partition % pools.len()].clone()),
            Self::Pools(_) => Err(DeviceExecError::Config("no device pool".into())),
            Self::FromSession => {
                let requests = config.device_requests()?;
                pool_for(
                    requests[partition % requests.len()],
                    config.partitions_per_device,
                )
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_lists_of_both_forms() {
        assert_eq!(
            parse_devices("cuda:0,cuda:1").unwrap(),
            vec![DeviceRequest::Cuda(0), DeviceRequest::Cuda(1)]
        );
        assert_eq!(
            parse_devices("cuda:1,0").unwrap(),
            vec![DeviceRequest::Cuda(1), DeviceRequest::Cuda(0)]
        );
        assert_eq!(parse_devices("cpu").unwrap(), vec![DeviceRequest::Cpu]);
        assert!(matches!(
            parse_devices("tpu:0"),
            Err(DeviceExecError::Config(_))
        ));
    }

    #[test]
    fn partitions_go_to_the_device_running_fewest() {
        let pools: Vec<Arc<DevicePool>> = (0..2)
            .map(|_| Arc::new(DevicePool::cpu(Arc::new(CpuDevice::new()), 1)))
            .collect();
        let placement = DevicePlacement::Pools(pools.clone());
        let config = DevarrowConfig::default();
        // An executor given only the even partitions of a stage: `p % 2` would put them
        // all on the first device.
        let tickets: Vec<PartitionTicket> = [0, 2, 4, 6]
            .iter()
            .map(|p| placement.place(&config, *p).unwrap())
            .collect();
        assert_eq!(
            pools.iter().map(|p| p.partitions()).collect::<Vec<_>>(),
            [2, 2]
        );
        // Ended partitions free their place: the next goes where fewest run.
        let (second, _first): (Vec<_>, Vec<_>) = tickets
            .into_iter()
            .partition(|t| Arc::ptr_eq(t.pool(), &pools[1]));
        drop(second);
        let next = placement.place(&config, 0).unwrap();
        assert!(Arc::ptr_eq(next.pool(), &pools[1]));
        assert_eq!(pools.iter().map(|p| p.placed()).collect::<Vec<_>>(), [2, 3]);
    }

    #[test]
    fn auto_is_every_cuda_device_of_the_machine_else_the_cpu_device() {
        let requests = parse_devices("auto").unwrap();
        #[cfg(feature = "cuda")]
        if let Ok(devices) = devarrow::cuda::list_devices() {
            if !devices.is_empty() {
                assert_eq!(requests.len(), devices.len());
                assert!(requests.iter().all(|r| matches!(r, DeviceRequest::Cuda(_))));
                return;
            }
        }
        assert_eq!(requests, vec![DeviceRequest::Auto]);
    }

    #[tokio::test]
    async fn a_pool_lends_each_slot_to_one_partition_at_a_time() {
        let pool = Arc::new(DevicePool::cpu(Arc::new(CpuDevice::new()), 2));
        let a = pool.lease().await;
        let b = pool.lease().await;
        assert_ne!(a.slot(), b.slot());
        assert_eq!(pool.in_use(), 2);
        let third = tokio::spawn({
            let pool = pool.clone();
            async move { pool.lease().await.slot() }
        });
        tokio::task::yield_now().await;
        assert!(!third.is_finished(), "a third partition waits for a slot");
        let freed = a.slot();
        drop(a);
        assert_eq!(third.await.unwrap(), freed);
        drop(b);
        assert_eq!(pool.in_use(), 0);
    }

    #[tokio::test]
    async fn a_pool_lends_the_slot_asked_for_when_it_is_free() {
        let pool = Arc::new(DevicePool::cpu(Arc::new(CpuDevice::new()), 3));
        for slot in [2, 0, 1, 2] {
            assert_eq!(pool.lease_preferring(slot).await.slot(), slot);
        }
        let held = pool.lease_preferring(1).await;
        let other = pool.lease_preferring(1).await;
        assert_eq!(held.slot(), 1);
        assert_ne!(
            other.slot(),
            1,
            "a busy slot is not waited for while others are free"
        );
        drop(held);
        assert_eq!(pool.lease_blocking_preferring(1).slot(), 1);
        drop(other);
        assert_eq!(pool.in_use(), 0);
    }
}
