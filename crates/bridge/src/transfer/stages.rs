//! Where the host time of a [`Transfer`](crate::Transfer) goes, stage by stage
//! ([`StageTimes`], per direction in [`TransferStats`]): accumulated with `Instant`s around
//! each stage (a few per chunk, tens of nanoseconds each), so a regression shows in the
//! stage it is in.

use std::ops::AddAssign;
use std::time::Duration;

/// The host time of one direction of a transfer, by stage, summed over calls.
///
/// | stage | to the device | to the host |
/// | --- | --- | --- |
/// | `plan` | planning the batch (buffers cut, offsets rebased) | preparing the downloads (an imported batch packed on the device), ordering them after the batches' events |
/// | `allocate` | device memory; registering pageable buffers for direct DMA (see [`Device::register_host`](devarrow_abi::device::Device::register_host)) | the host memory the batches come back into, and registering it |
/// | `pack` | packing into staging memory, or into device memory directly | — |
/// | `copy` | enqueueing copies and waiting for them (for a staging buffer to be free again) | enqueueing copies and waiting for them (for a chunk to arrive) |
/// | `unpack` | — | staging (or device) memory to host memory |
/// | `validate` | — | rebuilding (and, for foreign data, validating) arrow-rs arrays |
///
/// To the device, the copies still in flight when `to_device` returns are not counted:
/// the caller waits for them (on the batch's event).
///
/// ```
/// use std::sync::Arc;
///
/// use arrow_array::{ArrayRef, Int64Array, RecordBatch};
/// use devarrow_abi::device::CpuDevice;
/// use devarrow_bridge::{Transfer, TransferOptions};
///
/// # fn main() -> devarrow_abi::Result<()> {
/// let v: ArrayRef = Arc::new(Int64Array::from_iter_values(0..10_000));
/// let batch = RecordBatch::try_from_iter([("v", v)])?;
/// let mut transfer = Transfer::new(Arc::new(CpuDevice::new()), TransferOptions::default());
/// let on_device = transfer.to_device(&batch)?;
/// transfer.to_host(&on_device)?;
///
/// let stats = transfer.take_stats();
/// assert_eq!((stats.to_device.batches, stats.to_host.batches), (1, 1));
/// assert!(stats.to_device.bytes >= 80_000); // the device image: 10,000 i64 values
/// for (stage, time) in stats.to_device.stages() {
///     println!("{stage}: {time:?}");
/// }
/// assert_eq!(transfer.stats().to_device.batches, 0); // counting afresh
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StageTimes {
    /// Planning (to the device) or preparing downloads (to the host).
    pub plan: Duration,
    /// Allocating the destination: device memory, or host memory.
    pub allocate: Duration,
    /// Packing buffers into staging (or device) memory.
    pub pack: Duration,
    /// Enqueueing copies and waiting for copies to complete.
    pub copy: Duration,
    /// Unpacking staging (or device) memory into host memory.
    pub unpack: Duration,
    /// Rebuilding arrow-rs arrays on the host (validating foreign data).
    pub validate: Duration,
    /// Batches moved.
    pub batches: u64,
    /// Bytes moved (device images).
    pub bytes: u64,
}

impl StageTimes {
    /// The sum of every stage.
    pub fn total(&self) -> Duration {
        self.plan + self.allocate + self.pack + self.copy + self.unpack + self.validate
    }

    /// Every stage with its name, in pipeline order.
    pub fn stages(&self) -> [(&'static str, Duration); 6] {
        [
            ("plan", self.plan),
            ("allocate", self.allocate),
            ("pack", self.pack),
            ("copy", self.copy),
            ("unpack", self.unpack),
            ("validate", self.validate),
        ]
    }
}

impl AddAssign for StageTimes {
    fn add_assign(&mut self, other: Self) {
        self.plan += other.plan;
        self.allocate += other.allocate;
        self.pack += other.pack;
        self.copy += other.copy;
        self.unpack += other.unpack;
        self.validate += other.validate;
        self.batches += other.batches;
        self.bytes += other.bytes;
    }
}

/// The stage times of a [`Transfer`](crate::Transfer), per direction, since it was made
/// or since [`Transfer::take_stats`](crate::Transfer::take_stats).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TransferStats {
    /// [`Transfer::to_device`](crate::Transfer::to_device).
    pub to_device: StageTimes,
    /// [`Transfer::to_host`](crate::Transfer::to_host) and
    /// [`Transfer::to_host_batches`](crate::Transfer::to_host_batches).
    pub to_host: StageTimes,
    /// Downloaded images that landed in pinned host memory (one per batch), copied there
    /// directly ([`TransferOptions::pinned_host_bytes`](crate::TransferOptions::pinned_host_bytes)).
    pub pinned_downloads: u64,
    /// Downloaded images that fell back to pageable memory through staging, the pinned
    /// pool being full or refused ([`Transfer::host_memory_note`](crate::Transfer::host_memory_note)).
    pub pageable_downloads: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stage_times_add_up() {
        let ms = Duration::from_millis;
        let mut a = StageTimes {
            plan: ms(1),
            pack: ms(2),
            batches: 1,
            bytes: 10,
            ..Default::default()
        };
        a += StageTimes {
            copy: ms(3),
            validate: ms(4),
            batches: 2,
            bytes: 5,
            ..Default::default()
        };
        assert_eq!(a.total(), ms(10));
        assert_eq!((a.batches, a.bytes), (3, 15));
        assert_eq!(a.stages()[3], ("copy", ms(3)));
    }
}
