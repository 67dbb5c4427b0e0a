//! The tables of a run's text ([`Run::text`](super::Run::text)): the host's ceilings, one
//! batch size's measurements, devarrow on several devices, the sweep over batch sizes.

use std::fmt::Write as _;

use super::super::measure::{
    Ceiling, CopyStores, Direction, HostCeilings, Method, MultiPoint, Point,
};
use super::{count, human_duration, thousands};

/// The host's ceilings beside devarrow (its share of a parallel copy of the same bytes
/// into pinned memory host to device, into pre-faulted memory device to host, each the
/// better of a memcpy and streaming stores, and both ways of each), and where devarrow's
/// downloads landed.
pub(super) fn host_lines(out: &mut String, points: &[Point]) {
    let with: Vec<(&Point, &HostCeilings)> = points
        .iter()
        .filter_map(|p| p.ceilings.as_ref().map(|c| (p, c)))
        .collect();
    if let Some((_, first)) = with.first() {
        let _ = writeln!(
            out,
            "\nhost ceilings: the better of a parallel memcpy and parallel streaming stores of \
             the same bytes ({} threads, {} MB) beside each batch size:\n  one range into \
             pinned memory, into faulted memory, and the batches' own buffers into pinned \
             memory; devarrow above 1.00x of one points to a wrong ceiling",
            first.threads,
            thousands((first.bytes / 1_000_000) as u64)
        );
        let _ = writeln!(
            out,
            "  {:>10}  {:>14} {:>14} {:>16}  {:>22} {:>22} {:>22}",
            "rows/batch",
            "into pinned",
            "into faulted",
            "its buffers",
            "devarrow H2D / pinned",
            "H2D / its buffers",
            "devarrow D2H / faulted"
        );
        for (p, c) in &with {
            let ratio = |direction: Direction, ceiling: f64| {
                p.timing(Method::Devarrow, direction)
                    .filter(|_| ceiling > 0.0)
                    .map_or_else(
                        || "-".to_string(),
                        |t| format!("{:.2}x", t.gbps() / ceiling),
                    )
            };
            let gather = c.gather_gbps();
            let _ = writeln!(
                out,
                "  {:>10}  {:>9.2} GB/s {:>9.2} GB/s {:>16}  {:>22} {:>22} {:>22}",
                thousands(p.batch_rows as u64),
                c.pinned_gbps(),
                c.faulted_gbps(),
                gather.map_or_else(|| "-".to_string(), |g| format!("{g:.2} GB/s")),
                ratio(Direction::HostToDevice, c.pinned_gbps()),
                gather.map_or_else(|| "-".to_string(), |g| ratio(Direction::HostToDevice, g)),
                ratio(Direction::DeviceToHost, c.faulted_gbps()),
            );
        }
        let _ = writeln!(
            out,
            "  each ceiling both ways, GB/s: {} / {}",
            CopyStores::Memcpy.key(),
            CopyStores::Streaming.key()
        );
        for (p, c) in &with {
            let both = |c: &Ceiling| match (c.memcpy_gbps(), c.streaming_gbps()) {
                (None, None) => "-".to_string(),
                (m, s) => {
                    let g =
                        |v: Option<f64>| v.map_or_else(|| "-".to_string(), |v| format!("{v:.2}"));
                    format!("{} / {}", g(m), g(s))
                }
            };
            let _ = writeln!(
                out,
                "  {:>10}  {:>14} {:>14} {:>16}",
                thousands(p.batch_rows as u64),
                both(&c.pinned),
                both(&c.faulted),
                both(&c.gather),
            );
        }
    }
    for p in points {
        if let Some(m) = &p.host_memory {
            let rows = thousands(p.batch_rows as u64);
            match &m.note {
                None => {
                    let _ = writeln!(
                        out,
                        "downloads ({rows} rows/batch): {} landed in pinned host memory, copied \
                         there directly",
                        count(m.pinned as usize, "batch", "batches")
                    );
                }
                Some(note) => {
                    let _ = writeln!(
                        out,
                        "downloads ({rows} rows/batch): {} in pinned host memory, {} in pageable \
                         memory: {note}",
                        count(m.pinned as usize, "batch", "batches"),
                        count(m.pageable as usize, "batch", "batches")
                    );
                }
            }
        }
    }
}

/// The table of one batch size: bytes, time, GB/s and share of pinned per method and
/// direction.
pub(super) fn point_table(out: &mut String, p: &Point) {
    let _ = writeln!(
        out,
        "{} rows per batch: {} in {}",
        thousands(p.batch_rows as u64),
        count(p.rows, "row", "rows"),
        count(p.batches, "batch", "batches")
    );
    let _ = writeln!(
        out,
        "  {:<15} {:<18} {:>7} {:>14} {:>12} {:>8} {:>9}",
        "direction", "method", "copies", "bytes", "time", "GB/s", "of pinned"
    );
    for direction in Direction::ALL {
        for (i, method) in Method::ALL.into_iter().enumerate() {
            let Some(t) = p.timing(method, direction) else {
                continue;
            };
            let share = p
                .percent_of_pinned(method, direction)
                .map_or_else(|| "-".to_string(), |s| format!("{s:.1}%"));
            let _ = writeln!(
                out,
                "  {:<15} {:<18} {:>7} {:>14} {:>12} {:>8.2} {:>9}",
                if i == 0 { direction.label() } else { "" },
                method.label(),
                thousands(t.copies),
                thousands(t.bytes as u64),
                human_duration(t.best()),
                t.gbps(),
                share
            );
        }
    }
}

/// devarrow on several devices at once at one batch size: bytes, time and GB/s per
/// device and direction, and the total (all bytes over the wall time of the whole).
pub(super) fn several_table(out: &mut String, p: &Point, m: &MultiPoint, peers_on: &str) {
    let _ = writeln!(
        out,
        "{} rows per batch, devarrow on {} devices at once (batches round-robin, one thread \
         and Transfer per device, started together)",
        thousands(p.batch_rows as u64),
        m.shares.len()
    );
    let _ = writeln!(
        out,
        "  {:<15} {:<10} {:>8} {:>14} {:>12} {:>8}",
        "direction", "device", "batches", "bytes", "time", "GB/s"
    );
    for direction in Direction::ALL {
        for (i, s) in m.shares.iter().enumerate() {
            let _ = writeln!(
                out,
                "  {:<15} {:<10} {:>8} {:>14} {:>12} {:>8.2}",
                if i == 0 { direction.label() } else { "" },
                s.id,
                thousands(s.batches as u64),
                thousands(s.bytes as u64),
                human_duration(s.best(direction)),
                s.gbps(direction)
            );
        }
        let _ = writeln!(
            out,
            "  {:<15} {:<10} {:>8} {:>14} {:>12} {:>8.2}",
            "",
            "total",
            thousands(m.shares.iter().map(|s| s.batches as u64).sum()),
            thousands(m.bytes() as u64),
            human_duration(m.best_wall(direction)),
            m.gbps(direction)
        );
    }
    let _ = writeln!(
        out,
        "  total: all bytes over the wall time of the whole; the table above (devarrow \
         alone, raw copies, buffer by buffer) ran on {peers_on} only"
    );
}

/// The table of a sweep: GB/s per method, direction and batch size.
pub(super) fn sweep_table(out: &mut String, points: &[Point]) {
    let _ = writeln!(
        out,
        "GB/s by batch size (best repetition); % = devarrow's share of the pinned copy"
    );
    let _ = write!(out, "  {:>10} {:>8}", "", "");
    for method in Method::ALL {
        let _ = write!(out, "  {:^15}", method.short_label());
    }
    let _ = writeln!(out, "  {:^13}", "% of pinned");
    let _ = write!(out, "  {:>10} {:>8}", "rows/batch", "batches");
    for _ in Method::ALL {
        let _ = write!(out, "  {:>7} {:>7}", "H2D", "D2H");
    }
    let _ = writeln!(out, "  {:>6} {:>6}", "H2D", "D2H");
    for p in points {
        let _ = write!(
            out,
            "  {:>10} {:>8}",
            thousands(p.batch_rows as u64),
            thousands(p.batches as u64)
        );
        for method in Method::ALL {
            for direction in Direction::ALL {
                match p.timing(method, direction) {
                    Some(t) => {
                        let _ = write!(out, " {:>7.2}", t.gbps());
                    }
                    None => {
                        let _ = write!(out, " {:>7}", "-");
                    }
                }
            }
            out.push(' ');
        }
        out.push(' ');
        for direction in Direction::ALL {
            match p.percent_of_pinned(Method::Devarrow, direction) {
                Some(s) => {
                    let _ = write!(out, " {:>5.0}%", s);
                }
                None => {
                    let _ = write!(out, " {:>6}", "-");
                }
            }
        }
        out.push('\n');
    }
}
