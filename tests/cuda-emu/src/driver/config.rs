//! The emulator's configuration, read once from the environment:
//! `DEVARROW_EMU_DEVICES`, `DEVARROW_EMU_NO_PEER`, `DEVARROW_EMU_MEM_BYTES`,
//! `DEVARROW_EMU_DELAY_US`, `DEVARROW_EMU_JITTER_US`, `DEVARROW_EMU_RESTRICTED`.
//!
//! A leaf module: it depends on no other module of the crate.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

/// The most devices `DEVARROW_EMU_DEVICES` may ask for (each has its own share of the
/// fake address range).
const MAX_DEVICES: usize = 8;

struct Config {
    devices: usize,
    no_peer: bool,
    total_memory: u64,
    delay: Duration,
    jitter_us: u64,
    restricted: bool,
}

fn parse_bytes(text: &str) -> Option<u64> {
    let text = text.trim();
    let (digits, scale) = match text.chars().last()? {
        'k' | 'K' => (&text[..text.len() - 1], 1u64 << 10),
        'm' | 'M' => (&text[..text.len() - 1], 1 << 20),
        'g' | 'G' => (&text[..text.len() - 1], 1 << 30),
        _ => (text, 1),
    };
    digits.trim().parse::<u64>().ok()?.checked_mul(scale)
}

fn config() -> &'static Config {
    static CONFIG: OnceLock<Config> = OnceLock::new();
    CONFIG.get_or_init(|| {
        let total_memory = match std::env::var("DEVARROW_EMU_MEM_BYTES") {
            Ok(v) => parse_bytes(&v).filter(|&b| b > 0).unwrap_or_else(|| {
                eprintln!("devarrow-emu: ignoring DEVARROW_EMU_MEM_BYTES={v:?} (not a byte count)");
                8 << 30
            }),
            Err(_) => 8 << 30,
        };
        let micros = |name: &str| match std::env::var(name) {
            Ok(v) => v.trim().parse::<u64>().unwrap_or_else(|_| {
                eprintln!("devarrow-emu: ignoring {name}={v:?} (not a number)");
                0
            }),
            Err(_) => 0,
        };
        let devices = match std::env::var("DEVARROW_EMU_DEVICES") {
            Ok(v) => match v.trim().parse::<usize>() {
                Ok(n) if (1..=MAX_DEVICES).contains(&n) => n,
                _ => {
                    eprintln!(
                        "devarrow-emu: ignoring DEVARROW_EMU_DEVICES={v:?} (not 1 to {MAX_DEVICES})"
                    );
                    1
                }
            },
            Err(_) => 1,
        };
        Config {
            devices,
            no_peer: std::env::var("DEVARROW_EMU_NO_PEER").as_deref() == Ok("1"),
            total_memory,
            delay: Duration::from_micros(micros("DEVARROW_EMU_DELAY_US")),
            jitter_us: micros("DEVARROW_EMU_JITTER_US"),
            restricted: std::env::var("DEVARROW_EMU_RESTRICTED").as_deref() == Ok("1"),
        }
    })
}

/// The number of emulated devices (`DEVARROW_EMU_DEVICES`, 1 to 8, default 1).
pub fn config_devices() -> usize {
    config().devices
}

/// Whether no device may access another's memory (`DEVARROW_EMU_NO_PEER=1`):
/// `cuDeviceCanAccessPeer` then says 0 for every pair, as on GPUs without a peer link.
pub fn config_no_peer() -> bool {
    config().no_peer
}

/// Each emulated device's total memory (`DEVARROW_EMU_MEM_BYTES`, default 8 GiB).
pub fn config_total_memory() -> u64 {
    config().total_memory
}

/// Whether the emulator plays a restricted runtime (`DEVARROW_EMU_RESTRICTED=1`): a
/// sandbox such as gVisor's nvproxy (GKE Sandbox, hosted notebooks), which passes the
/// driver's ioctls through a filter and answers what it does not support with
/// `CUDA_ERROR_OPERATING_SYSTEM` or `CUDA_ERROR_NOT_PERMITTED` rather than
/// `CUDA_ERROR_NOT_SUPPORTED` (see `super::memory` for the calls that fail).
pub fn config_restricted() -> bool {
    config().restricted
}

/// The delay before a stream operation: `DEVARROW_EMU_DELAY_US` (default 0) plus a
/// pseudo-random part of up to `DEVARROW_EMU_JITTER_US` (default 0), which varies how
/// the streams interleave from one operation to the next.
pub fn config_delay() -> Duration {
    let c = config();
    if c.jitter_us == 0 {
        return c.delay;
    }
    static STATE: AtomicU64 = AtomicU64::new(0x9E37_79B9_7F4A_7C15);
    // SplitMix64 over a shared counter: cheap, and good enough to shuffle timings.
    let mut z = STATE.fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    c.delay + Duration::from_micros(z % (c.jitter_us + 1))
}

#[cfg(test)]
mod tests {
    use super::parse_bytes;

    #[test]
    fn byte_counts_parse() {
        assert_eq!(parse_bytes("123"), Some(123));
        assert_eq!(parse_bytes("4K"), Some(4096));
        assert_eq!(parse_bytes(" 2g "), Some(2 << 30));
        assert_eq!(parse_bytes("x"), None);
        assert_eq!(parse_bytes(""), None);
    }
}
