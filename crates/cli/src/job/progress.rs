//! Progress on stderr: a line per stage once it is done (`devarrow: what: parts (1.2 s)`),
//! and, while a stage runs and stderr is a terminal, an `indicatif` bar that moves with
//! it (rows generated, bytes read, repetitions measured). When stderr is not a terminal
//! (a pipe, a file, a test) no bar is drawn: only the lines. `--quiet` and `--json -`
//! silence both.

use std::io::IsTerminal as _;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// What a stage's bar counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    /// Table rows.
    Rows,
    /// Bytes (of a file).
    Bytes,
    /// Steps of work (timed repetitions).
    Steps,
}

impl Unit {
    fn style(self, known_total: bool) -> ProgressStyle {
        let template = match (self, known_total) {
            (_, false) => "{prefix} {spinner} {human_pos} {msg} [{elapsed}]",
            (Self::Rows, true) => {
                "{prefix} [{bar:30}] {human_pos}/~{human_len} rows {msg} [{elapsed}, ETA {eta}]"
            }
            (Self::Bytes, true) => {
                "{prefix} [{bar:30}] {bytes}/{total_bytes} {msg} [{elapsed}, ETA {eta}]"
            }
            (Self::Steps, true) => "{prefix} [{bar:30}] {pos}/{len} {msg} [{elapsed}]",
        };
        ProgressStyle::with_template(template)
            .map(|s| s.progress_chars("=> "))
            .unwrap_or_else(|_| ProgressStyle::default_bar())
    }
}

/// Where progress goes: nowhere, lines on stderr, or lines and live bars on a terminal.
#[derive(Debug, Clone, Copy)]
pub struct Progress {
    lines: bool,
    bars: bool,
}

impl Progress {
    /// Progress on stderr when `enabled`; bars only when stderr is a terminal.
    pub fn new(enabled: bool) -> Self {
        Self {
            lines: enabled,
            bars: enabled && std::io::stderr().is_terminal(),
        }
    }

    /// No progress.
    #[cfg(test)]
    pub fn off() -> Self {
        Self {
            lines: false,
            bars: false,
        }
    }

    /// A line of its own.
    pub fn note(&self, what: &str) {
        if self.lines {
            eprintln!("devarrow: {what}");
        }
    }

    /// Starts a stage: a bar of `total` `unit`s (a spinner when the total is unknown).
    pub fn stage(&self, what: impl Into<String>, total: Option<u64>, unit: Unit) -> Stage {
        let what = what.into();
        let bar = if self.bars {
            let bar = ProgressBar::with_draw_target(total, ProgressDrawTarget::stderr());
            bar.set_prefix(format!("devarrow: {what}"));
            bar.set_style(unit.style(total.is_some()));
            // The elapsed time moves even while one long step runs.
            bar.enable_steady_tick(Duration::from_millis(200));
            bar
        } else {
            ProgressBar::hidden()
        };
        Stage {
            bar,
            what,
            parts: Mutex::new(Vec::new()),
            start: Instant::now(),
            line: self.lines,
        }
    }
}

/// A stage in progress: its bar, and the parts its line will list.
#[derive(Debug)]
pub struct Stage {
    bar: ProgressBar,
    what: String,
    parts: Mutex<Vec<String>>,
    start: Instant,
    line: bool,
}

impl Stage {
    /// A stage that shows nothing.
    #[cfg(test)]
    pub fn off() -> Self {
        Progress::off().stage("", None, Unit::Steps)
    }

    /// Notes a part of the stage: shown beside the bar, and listed on the stage's line.
    pub fn part(&self, what: impl Into<String>) {
        let what = what.into();
        self.bar.set_message(what.clone());
        if let Ok(mut parts) = self.parts.lock() {
            parts.push(what);
        }
    }

    /// Counts `n` more units done.
    pub fn inc(&self, n: u64) {
        self.bar.inc(n);
    }

    /// Counts from 0 again, to `total` of `unit` (a sub-stage).
    pub fn restart(&self, total: Option<u64>, unit: Unit) {
        self.bar.set_position(0);
        match total {
            Some(total) => self.bar.set_length(total),
            None => self.bar.unset_length(),
        }
        if !self.bar.is_hidden() {
            self.bar.set_style(unit.style(total.is_some()));
        }
        self.bar.reset_eta();
    }

    /// The bar, to wrap a reader with (it then counts the bytes read).
    pub fn bar(&self) -> &ProgressBar {
        &self.bar
    }

    /// The stage's line: what, the parts, and how long it took.
    pub fn line(&self) -> String {
        let parts = self.parts.lock().map(|p| p.join(", ")).unwrap_or_default();
        let sep = if parts.is_empty() { "" } else { ": " };
        format!(
            "devarrow: {}{sep}{parts} ({:.1} s)",
            self.what,
            self.start.elapsed().as_secs_f64()
        )
    }

    /// Ends the stage: clears its bar and prints its line.
    pub fn finish(self) {
        self.bar.finish_and_clear();
        if self.line {
            eprintln!("{}", self.line());
        }
    }
}

impl Drop for Stage {
    /// A stage that did not finish (an error) clears its bar, so that the error prints
    /// on a line of its own.
    fn drop(&mut self) {
        if !self.bar.is_finished() {
            self.bar.finish_and_clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stage_lists_its_parts_and_its_time() {
        let stage = Progress::off().stage("[1/2] 1,024 rows per batch", Some(10), Unit::Steps);
        stage.part("3 batches");
        stage.inc(4);
        stage.part("devarrow");
        stage.restart(Some(100), Unit::Rows);
        stage.inc(50);
        let line = stage.line();
        assert!(
            line.starts_with("devarrow: [1/2] 1,024 rows per batch: 3 batches, devarrow ("),
            "{line}"
        );
        assert!(line.ends_with(" s)"), "{line}");
        stage.finish();
        let bare = Stage::off();
        assert_eq!(bare.line(), "devarrow:  (0.0 s)");
    }

    #[test]
    fn off_draws_no_bars() {
        let progress = Progress::off();
        assert!(!progress.lines && !progress.bars);
        assert!(progress.stage("x", Some(1), Unit::Bytes).bar().is_hidden());
        // Not a terminal under `cargo test`'s capture: lines, no bars.
        if !std::io::stderr().is_terminal() {
            let progress = Progress::new(true);
            assert!(progress.lines && !progress.bars);
        }
    }
}
