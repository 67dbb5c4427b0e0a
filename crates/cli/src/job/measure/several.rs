//! devarrow on several devices at once ([`measure_several`]): the batches dealt
//! round-robin, one thread and one `Transfer` per device, started together.

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use arrow_array::RecordBatch;
use devarrow::bridge::{DeviceBatch, Transfer, TransferOptions};

use super::{best, gbps, pool_retention, Direction, JobDevice, JobError, Stage};

/// devarrow's figures on one device of a run on several.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceShare {
    /// `cuda:N`.
    pub id: String,
    /// The batches this device got (round-robin).
    pub batches: usize,
    /// Device bytes of those batches, per repetition and direction.
    pub bytes: usize,
    /// Host to device: this device's time of every timed repetition, from the common
    /// start until its last batch had arrived.
    pub to_device: Vec<Duration>,
    /// Device to host: likewise, until its batches were rebuilt on the host.
    pub to_host: Vec<Duration>,
}

impl DeviceShare {
    /// Bandwidth of the best repetition in `direction`, in GB/s.
    pub fn gbps(&self, direction: Direction) -> f64 {
        gbps(self.bytes, self.best(direction))
    }

    /// The best repetition in `direction`.
    pub fn best(&self, direction: Direction) -> Duration {
        match direction {
            Direction::HostToDevice => best(&self.to_device),
            Direction::DeviceToHost => best(&self.to_host),
        }
    }
}

/// devarrow on several devices at once: each device's figures, and the wall time of the
/// whole (all devices, started together, until the last has finished).
#[derive(Debug, Clone, PartialEq)]
pub struct MultiPoint {
    /// One per device, in the order asked for.
    pub shares: Vec<DeviceShare>,
    /// Host to device: the wall time of every timed repetition.
    pub wall_to_device: Vec<Duration>,
    /// Device to host: the wall time of every timed repetition.
    pub wall_to_host: Vec<Duration>,
}

impl MultiPoint {
    /// Bytes moved per repetition and direction, all devices together.
    pub fn bytes(&self) -> usize {
        self.shares.iter().map(|s| s.bytes).sum()
    }

    /// The best wall time in `direction`.
    pub fn best_wall(&self, direction: Direction) -> Duration {
        match direction {
            Direction::HostToDevice => best(&self.wall_to_device),
            Direction::DeviceToHost => best(&self.wall_to_host),
        }
    }

    /// The wall times of every timed repetition in `direction`.
    pub fn walls(&self, direction: Direction) -> &[Duration] {
        match direction {
            Direction::HostToDevice => &self.wall_to_device,
            Direction::DeviceToHost => &self.wall_to_host,
        }
    }

    /// The aggregate bandwidth in `direction`: all bytes over the best wall time, GB/s.
    pub fn gbps(&self, direction: Direction) -> f64 {
        gbps(self.bytes(), self.best_wall(direction))
    }
}

/// The steps (repetitions, warm-ups included) [`measure_several`] counts on its stage.
pub fn several_steps(reps: usize) -> u64 {
    (Direction::ALL.len() * (reps + 1)) as u64
}

/// One device's part of a run on several: its device, its own `Transfer`, the batches
/// dealt to it, and where they are.
struct Worker<'a> {
    id: &'a str,
    transfer: Transfer,
    batches: Vec<&'a RecordBatch>,
    on_device: Vec<DeviceBatch>,
    back: Vec<RecordBatch>,
}

impl Worker<'_> {
    fn move_to_device(&mut self) -> Result<(), JobError> {
        let id = self.id;
        let fail = |e: devarrow::abi::Error| JobError::new(format!("{id}: {e}"));
        let batches: Vec<RecordBatch> = self.batches.iter().map(|&b| b.clone()).collect();
        self.on_device
            .extend(self.transfer.to_device_batches(&batches).map_err(fail)?);
        for batch in &self.on_device {
            batch.event().wait_host().map_err(fail)?;
        }
        Ok(())
    }

    fn move_to_host(&mut self) -> Result<(), JobError> {
        let id = self.id;
        let back = self
            .transfer
            .to_host_batches(&self.on_device)
            .map_err(|e| JobError::new(format!("{id}: moving the batches back: {e}")))?;
        self.back.extend(back);
        Ok(())
    }
}

/// Runs `f` on every worker at once, one thread each, started together (a barrier), and
/// returns the wall time of the whole (until the last has finished) and each worker's
/// own time.
fn all_at_once<'a>(
    workers: &mut [Worker<'a>],
    f: fn(&mut Worker<'a>) -> Result<(), JobError>,
) -> Result<(Duration, Vec<Duration>), JobError> {
    let barrier = Barrier::new(workers.len() + 1);
    std::thread::scope(|scope| {
        let threads: Vec<_> = workers
            .iter_mut()
            .map(|worker| {
                let barrier = &barrier;
                scope.spawn(move || {
                    barrier.wait();
                    let start = Instant::now();
                    let result = f(worker);
                    (result, start.elapsed())
                })
            })
            .collect();
        barrier.wait();
        let start = Instant::now();
        let mut results = Vec::with_capacity(threads.len());
        for thread in threads {
            results.push(
                thread
                    .join()
                    .map_err(|_| JobError::new("a device's transfer thread panicked"))?,
            );
        }
        // The threads may start a moment before this one wakes: the wall is never
        // shorter than the longest device.
        let mut wall = start.elapsed();
        let mut times = Vec::with_capacity(results.len());
        for (result, time) in results {
            result?;
            wall = wall.max(time);
            times.push(time);
        }
        Ok((wall, times))
    })
}

/// Measures devarrow on several devices at once: the batches dealt round-robin (batch
/// `i` to device `i % n`), one thread per device, each with its own `Transfer`, started
/// together; host to device, then device to host. Checks that every batch comes back
/// equal. Every repetition (all devices) is a step of `stage` (see [`several_steps`]).
pub fn measure_several(
    devices: &[(String, Arc<dyn JobDevice>)],
    batches: &[RecordBatch],
    reps: usize,
    stage: &Stage,
) -> Result<MultiPoint, JobError> {
    let n = devices.len().max(1);
    stage.part(format!("devarrow on {n} devices"));
    let mut workers: Vec<Worker<'_>> = devices
        .iter()
        .enumerate()
        .map(|(d, (id, device))| Worker {
            id,
            transfer: Transfer::new(device.clone(), TransferOptions::default()),
            batches: batches.iter().skip(d).step_by(n).collect(),
            on_device: Vec::new(),
            back: Vec::new(),
        })
        .collect();
    let sync = || -> Result<(), JobError> {
        for (id, device) in devices {
            device
                .synchronize()
                .map_err(|e| JobError::new(format!("synchronizing {id}: {e}")))?;
        }
        Ok(())
    };
    // Each device's pool keeps its share of a repetition (see `measure_point`).
    for (worker, (id, device)) in workers.iter().zip(devices) {
        device
            .retain_freed_memory(Some(pool_retention(worker.batches.iter().copied())))
            .map_err(|e| JobError::new(format!("sizing the memory pool of {id}: {e}")))?;
    }
    let mut wall_to_device = Vec::with_capacity(reps);
    let mut times_to_device = vec![Vec::with_capacity(reps); workers.len()];
    for rep in 0..=reps {
        // The last repetition's device memory is freed outside the timed region.
        workers.iter_mut().for_each(|w| w.on_device.clear());
        sync()?;
        let (wall, times) = all_at_once(&mut workers, Worker::move_to_device)?;
        if rep > 0 {
            wall_to_device.push(wall);
            times_to_device
                .iter_mut()
                .zip(times)
                .for_each(|(all, t)| all.push(t));
        }
        stage.inc(1);
    }
    let mut wall_to_host = Vec::with_capacity(reps);
    let mut times_to_host = vec![Vec::with_capacity(reps); workers.len()];
    for rep in 0..=reps {
        workers.iter_mut().for_each(|w| w.back.clear());
        let (wall, times) = all_at_once(&mut workers, Worker::move_to_host)?;
        if rep > 0 {
            wall_to_host.push(wall);
            times_to_host
                .iter_mut()
                .zip(times)
                .for_each(|(all, t)| all.push(t));
        }
        stage.inc(1);
    }
    for (i, batch) in batches.iter().enumerate() {
        let worker = &workers[i % n];
        if worker.back.get(i / n) != Some(batch) {
            return Err(JobError::new(format!(
                "batch {i} of {} rows came back from {} different from the input",
                batch.num_rows(),
                worker.id
            )));
        }
    }
    let shares = workers
        .iter()
        .zip(times_to_device.into_iter().zip(times_to_host))
        .map(|(w, (to_device, to_host))| DeviceShare {
            id: w.id.to_string(),
            batches: w.batches.len(),
            bytes: w.on_device.iter().map(DeviceBatch::device_bytes).sum(),
            to_device,
            to_host,
        })
        .collect();
    for (id, device) in devices {
        device
            .retain_freed_memory(None)
            .map_err(|e| JobError::new(format!("sizing the memory pool of {id}: {e}")))?;
    }
    drop(workers);
    sync()?;
    Ok(MultiPoint {
        shares,
        wall_to_device,
        wall_to_host,
    })
}

#[cfg(test)]
mod tests {
    use super::super::{measure_point, Method};
    use super::*;
    use devarrow::abi::device::CpuDevice;

    #[test]
    fn several_devices_at_once_on_cpu_devices() {
        let devices: Vec<(String, Arc<dyn JobDevice>)> = (0..3)
            .map(|i| {
                let device: Arc<dyn JobDevice> = Arc::new(CpuDevice::new());
                (format!("cpu:{i}"), device)
            })
            .collect();
        let batches = crate::tpch::lineitem(0.001, 1000);
        assert!(batches.len() >= 4, "{}", batches.len());
        let stage = Stage::off();
        let multi = measure_several(&devices, &batches, 2, &stage).unwrap();
        assert_eq!(stage.bar().position(), several_steps(2));
        assert_eq!(multi.shares.len(), 3);
        assert_eq!(multi.wall_to_device.len(), 2);
        assert_eq!(multi.wall_to_host.len(), 2);
        let dealt: usize = multi.shares.iter().map(|s| s.batches).sum();
        assert_eq!(dealt, batches.len());
        for (i, share) in multi.shares.iter().enumerate() {
            assert_eq!(share.id, format!("cpu:{i}"));
            assert_eq!(share.batches, batches.iter().skip(i).step_by(3).count());
            assert!(share.bytes > 0);
            assert_eq!((share.to_device.len(), share.to_host.len()), (2, 2));
            for direction in Direction::ALL {
                // No device takes longer than the whole.
                assert!(share.best(direction) <= multi.best_wall(direction));
                assert!(share.gbps(direction) > 0.0);
            }
        }
        // The same bytes as one device moves.
        let one = measure_point(
            &devices[0].1,
            &batches,
            1000,
            1,
            &TransferOptions::default(),
            &Stage::off(),
        )
        .unwrap();
        let single = one
            .timing(Method::Devarrow, Direction::HostToDevice)
            .unwrap();
        assert_eq!(multi.bytes(), single.bytes);
        assert!(multi.gbps(Direction::DeviceToHost) > 0.0);
    }
}
