//! Whether generated data will fit: an estimate of the host memory a run at `--scale`
//! needs, made before generating anything, against the memory the machine has available
//! (`MemAvailable` in `/proc/meminfo`). `--no-memory-check` skips it.

use crate::tpch::estimated_lineitem_rows;

/// Bytes of Arrow buffers per generated `lineitem` row, as the data line reports them
/// (every allocation once, at its capacity): 138.4 MB for the 600,572 rows of scale 0.1.
pub const LINEITEM_BYTES_PER_ROW: u64 = 231;

/// Host memory a run needs whatever the scale: tpchgen's text pool (300 MiB, a static
/// of the generator), devarrow's staging buffers (64 MiB) and the program.
pub const FIXED_BYTES: u64 = 400_000_000;

/// The copies of the data that host memory holds at the job's peak on the CPU device,
/// where "device" memory is host memory too: the batches, their device copy and the
/// batches brought back. Measured: peak RSS 778 MB at scale 0.1 (138.4 MB of data) and
/// 1,548 MB at scale 0.3, so about 2.7 copies above the fixed part; 3 leaves a margin.
pub const CPU_DEVICE_COPIES: f64 = 3.0;

/// The same on a CUDA device, whose copies live in device memory: the batches and the
/// batches brought back (or the raw copies' one host buffer). Not measured on a GPU yet.
pub const CUDA_DEVICE_COPIES: f64 = 2.0;

/// The estimated host memory of a run on generated data.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Estimate {
    /// The TPC-H scale.
    pub scale: f64,
    /// About how many `lineitem` rows it has.
    pub rows: u64,
    /// About how many bytes of Arrow buffers they take.
    pub data_bytes: u64,
    /// The copies of them the job holds at its peak.
    pub copies: f64,
    /// The host memory the run needs: [`FIXED_BYTES`] + `data_bytes × copies`.
    pub needed_bytes: u64,
}

/// The estimate for `lineitem` at `scale`, on a CUDA device or the CPU device.
pub fn estimate(scale: f64, on_cuda: bool) -> Estimate {
    let rows = estimated_lineitem_rows(scale);
    let data_bytes = rows.saturating_mul(LINEITEM_BYTES_PER_ROW);
    let copies = if on_cuda {
        CUDA_DEVICE_COPIES
    } else {
        CPU_DEVICE_COPIES
    };
    Estimate {
        scale,
        rows,
        data_bytes,
        copies,
        needed_bytes: FIXED_BYTES.saturating_add((data_bytes as f64 * copies) as u64),
    }
}

impl Estimate {
    /// The largest scale whose estimate fits in `available` bytes (0 when not even the
    /// fixed part does).
    pub fn largest_scale_for(&self, available: u64) -> f64 {
        let per_scale = (self.needed_bytes - FIXED_BYTES) as f64 / self.scale;
        if per_scale > 0.0 {
            available.saturating_sub(FIXED_BYTES) as f64 / per_scale
        } else {
            f64::INFINITY
        }
    }
}

/// Generated data would not fit in the memory available.
#[derive(Debug, Clone, PartialEq)]
pub struct NotEnoughMemory {
    /// What the run would need.
    pub estimate: Estimate,
    /// What the machine has available.
    pub available_bytes: u64,
}

impl std::fmt::Display for NotEnoughMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let e = &self.estimate;
        let largest = e.largest_scale_for(self.available_bytes);
        let smaller = if largest >= 0.001 {
            format!("use --scale {} or less, ", round_down(largest))
        } else {
            String::new()
        };
        write!(
            f,
            "--scale {} needs about {} of memory ({} rows of about {} B: {} of Arrow \
             buffers, held {} times at the peak, plus {} for the generator and staging) but \
             only {} is available: {smaller}free some memory, or pass --no-memory-check to \
             run anyway",
            e.scale,
            gb(e.needed_bytes),
            super::text::thousands(e.rows),
            LINEITEM_BYTES_PER_ROW,
            gb(e.data_bytes),
            e.copies,
            gb(FIXED_BYTES),
            gb(self.available_bytes),
        )
    }
}

impl std::error::Error for NotEnoughMemory {}

fn gb(bytes: u64) -> String {
    format!("{:.1} GB", bytes as f64 / 1e9)
}

/// `x` rounded down to two significant digits (at least the smallest scale, 0.001).
fn round_down(x: f64) -> f64 {
    if x.is_nan() || x <= 0.001 {
        return 0.001;
    }
    if x.is_infinite() {
        return x;
    }
    let magnitude = 10f64.powf(x.log10().floor() - 1.0);
    let rounded = (x / magnitude).floor() * magnitude;
    // Printed with as few digits as it has.
    format!("{rounded:.6}").parse().unwrap_or(rounded)
}

/// Hands memory freed by the last stage back to the operating system. glibc keeps the
/// free parts of its heaps (one per thread that allocated), and reuses them only for
/// allocations that fit: without this, the buffers of the raw copies come on top of the
/// memory the devarrow transfers freed, and the peak grows by a copy of the data.
pub fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim has no preconditions; it only returns free pages of the
    // allocator's heaps to the kernel.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Checks `estimate` against `available` bytes (`None`: unknown, nothing to check).
pub fn check(estimate: &Estimate, available: Option<u64>) -> Result<(), NotEnoughMemory> {
    match available {
        Some(available) if estimate.needed_bytes > available => Err(NotEnoughMemory {
            estimate: *estimate,
            available_bytes: available,
        }),
        _ => Ok(()),
    }
}

/// The memory available to a new process: `MemAvailable` of `/proc/meminfo` (`None`
/// where there is no such file, as outside Linux).
pub fn available() -> Option<u64> {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|text| mem_available(&text))
}

/// The `MemAvailable:` line of a `/proc/meminfo` text, in bytes.
pub fn mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))?;
    let mut words = line.split_whitespace();
    let value: u64 = words.next()?.parse().ok()?;
    let unit = match words.next() {
        Some("kB") => 1024,
        None => 1,
        Some(_) => return None,
    };
    value.checked_mul(unit)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_estimate_grows_with_the_scale() {
        let e = estimate(1.0, false);
        assert_eq!(e.rows, 6_001_215);
        assert_eq!(e.data_bytes, 6_001_215 * LINEITEM_BYTES_PER_ROW);
        assert_eq!(e.copies, CPU_DEVICE_COPIES);
        assert_eq!(
            e.needed_bytes,
            FIXED_BYTES + (e.data_bytes as f64 * CPU_DEVICE_COPIES) as u64
        );
        // About 1.4 GB of data at scale 1, a few times that to run.
        assert!(e.data_bytes > 1_300_000_000 && e.data_bytes < 1_500_000_000);
        let ten = estimate(10.0, false);
        assert!(ten.needed_bytes - FIXED_BYTES > 9 * (e.needed_bytes - FIXED_BYTES));
        // What was measured (peak RSS 778 MB at scale 0.1, 1,548 MB at 0.3) is covered,
        // without much to spare.
        for (scale, peak) in [(0.1, 778e6), (0.3, 1548e6)] {
            let needed = estimate(scale, false).needed_bytes as f64;
            assert!(needed > peak && needed < 1.2 * peak, "{scale}: {needed}");
        }
        assert_eq!(e.largest_scale_for(FIXED_BYTES / 2), 0.0);
        // On a GPU the device copies are not in host memory.
        assert!(estimate(1.0, true).needed_bytes < e.needed_bytes);
        assert!((e.largest_scale_for(e.needed_bytes) - 1.0).abs() < 1e-6);
    }

    #[test]
    fn the_estimate_matches_generated_data() {
        let batches = crate::tpch::lineitem(0.01, 64 << 10);
        let bytes = crate::tpch::batch_bytes(&batches) as f64;
        let estimated = estimate(0.01, false).data_bytes as f64;
        assert!(
            (bytes - estimated).abs() < 0.1 * bytes,
            "{bytes} bytes generated, {estimated} estimated"
        );
    }

    #[test]
    fn too_little_memory_is_a_clear_error() {
        let e = estimate(100.0, false);
        assert_eq!(check(&e, None), Ok(()));
        assert_eq!(check(&e, Some(e.needed_bytes)), Ok(()));
        let available = 16_000_000_000;
        let err = check(&e, Some(available)).unwrap_err();
        assert_eq!(err.available_bytes, available);
        assert_eq!(err.estimate, e);
        let text = err.to_string();
        for part in [
            "--scale 100 needs about",
            "600,121,500 rows",
            "16.0 GB is available",
            "--no-memory-check",
        ] {
            assert!(text.contains(part), "{part}: {text}");
        }
        // The scale it suggests fits.
        let suggested = e.largest_scale_for(available);
        assert!(text.contains(&format!("use --scale {} or less", round_down(suggested))));
        assert!(check(&estimate(round_down(suggested), false), Some(available)).is_ok());
        // Not even the smallest scale fits: no scale suggested.
        let none = check(&e, Some(FIXED_BYTES)).unwrap_err().to_string();
        assert!(!none.contains("use --scale"), "{none}");
        // The job's error says the same, in one line.
        let job = crate::job::JobError::from(err);
        assert_eq!(job.to_string(), text);
        assert!(!text.contains('\n'));
    }

    #[test]
    fn meminfo() {
        let text =
            "MemTotal:       24600000 kB\nMemFree:         1000 kB\nMemAvailable:   12000000 kB\n";
        assert_eq!(mem_available(text), Some(12_000_000 * 1024));
        assert_eq!(mem_available("MemTotal: 5 kB\n"), None);
        assert_eq!(mem_available("MemAvailable: lots\n"), None);
        assert_eq!(mem_available("MemAvailable: 5 MB\n"), None);
        if std::path::Path::new("/proc/meminfo").exists() {
            assert!(available().unwrap() > 0);
        }
    }

    #[test]
    fn rounding_down() {
        assert_eq!(round_down(5.46), 5.4);
        assert_eq!(round_down(0.0123), 0.012);
        assert_eq!(round_down(123.0), 120.0);
        assert_eq!(round_down(0.0), 0.001);
    }
}
