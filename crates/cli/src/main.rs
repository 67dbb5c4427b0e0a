//! `devarrow`: the main job. Benchmarks moving real Arrow data (TPC-H `lineitem`, or a
//! Parquet / Arrow IPC file) from the host to a device and back with devarrow, beside raw
//! pinned and pageable copies of the same byte count and a buffer-by-buffer copy, checks
//! that every batch comes back equal, and prints a table (or JSON, or an SVG chart).
//!
//! It runs on CUDA device 0 when one opens and on the CPU device otherwise, saying why.
//! `devarrow --help` lists the options; the logic lives in the `job` modules.

fn main() -> std::process::ExitCode {
    // A bug is reported in one line, like every other failure (no backtrace).
    std::panic::set_hook(Box::new(|info| {
        let location = info
            .location()
            .map(|l| format!(" at {}:{}", l.file(), l.line()))
            .unwrap_or_default();
        let message = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".to_string());
        eprintln!(
            "devarrow: internal error: {}{location}",
            message.replace('\n', " ")
        );
    }));
    devarrow_cli::run()
}
