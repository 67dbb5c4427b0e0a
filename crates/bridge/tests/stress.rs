//! Load: 8 threads, each with a device of its own (on CUDA, its own stream), move batches
//! to the device and back, export and import them, while a ninth thread releases their
//! exports, for a while (`DEVARROW_STRESS_SECONDS`; 10 s on the CPU device, 60 s on CUDA
//! by default). No batch comes back different, and device and host memory return to
//! their starting level (host memory counted by this binary's global allocator, so the
//! test has a binary of its own).
//!
//! Not under Miri: a load test runs for a time, not a number of steps, and interpreted it
//! would move a handful of batches in minutes; the Miri step checks the same code paths
//! with the bridge's other tests.
#![cfg(not(miri))]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use arrow_array::{ArrayRef, Int64Array, RecordBatch, StringArray};
use devarrow_abi::device::{CpuDevice, Device};
use devarrow_abi::DeviceArray;
use devarrow_bridge::{DeviceBatch, Transfer, TransferOptions};
use devarrow_cuda::{CudaDevice, PrimaryContext};
use devarrow_testing::leaks::{free_memory, DeviceMemoryCheck};

/// The system allocator, counting the bytes live.
struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

// SAFETY: every call is forwarded to `System` unchanged; only a counter is kept beside.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: the caller's layout, forwarded.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: `ptr` came from `alloc` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: the caller's layout, forwarded.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(
            new_size as isize - layout.size() as isize,
            Ordering::Relaxed,
        );
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

const THREADS: usize = 8;

/// One test at a time: the host byte count is the whole process's.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn seconds(default: u64) -> Duration {
    Duration::from_secs(
        std::env::var("DEVARROW_STRESS_SECONDS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(default),
    )
}

/// Thread `t`'s `i`th batch: sizes and slices differ from one to the next.
fn batch(t: usize, i: usize) -> RecordBatch {
    let rows = 1 + (t * 977 + i * 131) % 5000;
    let whole = RecordBatch::try_from_iter([
        (
            "n",
            Arc::new(Int64Array::from_iter(
                (0..rows as i64).map(|r| (r % 5 != 0).then_some(r * t as i64 + i as i64)),
            )) as ArrayRef,
        ),
        (
            "s",
            Arc::new(StringArray::from_iter(
                (0..rows).map(|r| (r % 7 != 0).then(|| format!("{t}:{i}:{r}"))),
            )) as ArrayRef,
        ),
    ])
    .unwrap();
    let offset = i % rows.min(3);
    whole.slice(offset, rows - offset)
}

/// One worker: round trips until `deadline`, every export handed to `releaser`.
fn work(
    device: Arc<dyn Device>,
    t: usize,
    deadline: Instant,
    releaser: mpsc::Sender<DeviceArray>,
) -> usize {
    let mut transfer = Transfer::new(device.clone(), TransferOptions::default());
    let mut i = 0;
    while Instant::now() < deadline {
        let expected = batch(t, i);
        let on_device = transfer.to_device(&expected).unwrap();
        // One export goes to another thread, which releases it whenever it gets to it...
        let (released_elsewhere, _) = on_device.export().unwrap();
        releaser.send(released_elsewhere).unwrap();
        // ... while another comes back in as a foreign array and is downloaded.
        let (array, schema) = on_device.export().unwrap();
        drop(on_device);
        let imported = DeviceBatch::import_with_ffi_schema(device.clone(), array, &schema).unwrap();
        let back = transfer.to_host(&imported).unwrap();
        assert_eq!(back, expected, "thread {t}, batch {i}");
        i += 1;
    }
    i
}

/// Runs the workers on the devices `open` makes, with one releasing thread.
fn stress(open: impl Fn() -> Arc<dyn Device>, duration: Duration) -> usize {
    let deadline = Instant::now() + duration;
    let (tx, rx) = mpsc::channel::<DeviceArray>();
    let released = Arc::new(AtomicUsize::new(0));
    let releasing = {
        let released = released.clone();
        std::thread::spawn(move || {
            for array in rx {
                drop(array);
                released.fetch_add(1, Ordering::Relaxed);
            }
        })
    };
    let workers: Vec<_> = (0..THREADS)
        .map(|t| {
            let device = open();
            let tx = tx.clone();
            std::thread::spawn(move || work(device, t, deadline, tx))
        })
        .collect();
    drop(tx);
    let batches: usize = workers.into_iter().map(|w| w.join().unwrap()).sum();
    releasing.join().unwrap();
    assert_eq!(released.load(Ordering::Relaxed), batches);
    batches
}

/// Host bytes live now, after a moment for other threads' last frees.
fn live_host_bytes() -> isize {
    std::thread::sleep(Duration::from_millis(50));
    LIVE.load(Ordering::Relaxed)
}

#[test]
fn eight_threads_on_the_cpu_device() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let open = || Arc::new(CpuDevice::new()) as Arc<dyn Device>;
    stress(open, Duration::from_millis(200)); // warm-up: lazily made statics
    let before = live_host_bytes();
    let batches = stress(open, seconds(10));
    let after = live_host_bytes();
    println!("{batches} batches; host bytes live {before} -> {after}");
    assert!(batches >= THREADS);
    assert!(
        after - before < 1 << 20,
        "host memory grew: {before} -> {after}"
    );
}

#[test]
fn eight_threads_each_on_its_own_cuda_stream() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let Some((_lock, dev)) = devarrow_testing::gpu::open_or_skip(|| PrimaryContext::open(0)) else {
        return;
    };
    let open = || {
        Arc::new(CudaDevice::new(dev.clone()).expect("a CUDA device with its own stream"))
            as Arc<dyn Device>
    };
    stress(open, Duration::from_millis(500));
    let (device_check, host_before) = (DeviceMemoryCheck::start(&dev), live_host_bytes());
    let batches = stress(open, seconds(60));
    let host_after = live_host_bytes();
    println!(
        "{batches} batches; device bytes free {} -> {}; host bytes live {host_before} -> \
         {host_after}",
        device_check.free_at_start(),
        free_memory(&dev)
    );
    assert!(batches >= THREADS);
    device_check.assert_no_leak("the stress run");
    assert!(
        host_after - host_before < 1 << 20,
        "host memory grew: {host_before} -> {host_after}"
    );
}
