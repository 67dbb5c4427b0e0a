//! The main job: builds or reads Arrow data, moves it to a device and back with devarrow
//! at one or more batch sizes, beside raw pinned and pageable copies of the same byte
//! count and a buffer-by-buffer copy, checks it comes back equal, and reports a table,
//! JSON and a chart.
//!
//! - [`options`]: the command line;
//! - [`device`]: choosing the device (CUDA when there is one, else the CPU device), or
//!   several CUDA devices (`cuda:0,1`, `cuda:all`);
//! - [`cuda_options`]: the CUDA device's options (`--cuda-options`,
//!   `DEVARROW_CUDA_OPTIONS`);
//! - [`memory`]: whether generated data will fit in memory;
//! - [`input`]: generated TPC-H `lineitem`, or a Parquet / Arrow IPC file;
//! - [`measure`]: the timed transfers (devarrow on several devices at once too);
//! - [`progress`]: progress on stderr;
//! - [`report`]: the table and the JSON;
//! - [`chart`]: the SVG or PNG chart.

pub mod chart;
pub mod cuda_options;
pub mod device;
pub mod input;
pub mod measure;
pub mod memory;
pub mod options;
pub mod progress;
pub mod report;
pub mod text;
pub mod transfer_options;

use std::io::Write as _;
use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use arrow_array::RecordBatch;
use clap::Parser as _;
use devarrow::abi::cpu;
use devarrow::bridge::{Transfer, TransferOptions};
use devarrow::cuda::ImportedArray;

use self::device::Selected;
use self::measure::JobDevice;
use self::memory::NotEnoughMemory;
use self::options::{Cli, JsonTarget, Options};
use self::progress::{Progress, Unit};
use self::report::{DataInfo, DeviceInfo, Run};

/// A failure of the job: one line for the user.
#[derive(Debug, Clone, PartialEq)]
pub enum JobError {
    /// A failure, said in a line.
    Failed(String),
    /// The data asked for would not fit in the memory available.
    NotEnoughMemory(NotEnoughMemory),
    /// The CUDA devices of a multi-device run did not open.
    Devices(device::DevicesError),
}

impl JobError {
    /// An error saying `message`.
    pub fn new(message: impl Into<String>) -> Self {
        Self::Failed(message.into())
    }
}

impl From<NotEnoughMemory> for JobError {
    fn from(e: NotEnoughMemory) -> Self {
        Self::NotEnoughMemory(e)
    }
}

impl From<device::DevicesError> for JobError {
    fn from(e: device::DevicesError) -> Self {
        Self::Devices(e)
    }
}

impl std::fmt::Display for JobError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            // One line, whatever the source error looked like.
            Self::Failed(message) => f.write_str(&message.replace('\n', " ")),
            Self::NotEnoughMemory(e) => e.fmt(f),
            Self::Devices(e) => f.write_str(&e.to_string().replace('\n', " ")),
        }
    }
}

impl std::error::Error for JobError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Failed(_) => None,
            Self::NotEnoughMemory(e) => Some(e),
            Self::Devices(e) => Some(e),
        }
    }
}

/// Runs the job from the process's command line: the exit code is 0 on success, 1 on a
/// failure (one line on stderr), 2 on a bad command line.
pub fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            use clap::error::ErrorKind;
            if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
                let _ = e.print();
                return ExitCode::SUCCESS;
            }
            // clap's first line is the error; the rest is usage we shorten to a hint.
            let rendered = e.render().to_string();
            let first = rendered.lines().next().unwrap_or("bad command line");
            let first = first.strip_prefix("error: ").unwrap_or(first);
            eprintln!("devarrow: error: {first} (see devarrow --help)");
            return ExitCode::from(2);
        }
    };
    let options = match cli.resolve(std::env::var_os(cuda_options::ENV).as_deref()) {
        Ok(options) => options,
        // A bad value of the variable is a bad command line, as the flag's would be.
        Err(e) => {
            eprintln!("devarrow: error: {}: {e}", cuda_options::ENV);
            return ExitCode::from(2);
        }
    };
    let progress = Progress::new(options.progress);
    match run(options, &progress) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("devarrow: error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Checks that `path` can be written to, before the run spends time measuring.
fn check_writable(path: &Path, what: &str) -> Result<(), JobError> {
    let parent = path.parent().filter(|p| !p.as_os_str().is_empty());
    if let Some(parent) = parent {
        if !parent.is_dir() {
            return Err(JobError::new(format!(
                "cannot write the {what} to {}: {} is not a directory",
                path.display(),
                parent.display()
            )));
        }
    }
    if path.is_dir() {
        return Err(JobError::new(format!(
            "cannot write the {what} to {}: it is a directory",
            path.display()
        )));
    }
    Ok(())
}

/// Writes to stdout; a reader that went away (`devarrow | head`) is not an error.
fn print_stdout(text: &str) -> Result<(), JobError> {
    let mut stdout = std::io::stdout().lock();
    match stdout
        .write_all(text.as_bytes())
        .and_then(|()| stdout.flush())
    {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
            Err(JobError::new(format!("cannot write to stdout: {e}")))
        }
        _ => Ok(()),
    }
}

fn write_file(path: &Path, what: &str, contents: &str) -> Result<(), JobError> {
    std::fs::write(path, contents).map_err(|e| {
        JobError::new(format!(
            "cannot write the {what} to {}: {e}",
            path.display()
        ))
    })
}

/// The data, in batches of one size.
enum Source {
    /// TPC-H `lineitem`, generated at every batch size (batches as the generator emits
    /// them, one set per thread, so the last batch of each set may be shorter).
    Tpch(f64),
    /// A file's batches, cut to every batch size.
    File(Vec<RecordBatch>),
}

/// Generates `lineitem` at `scale` in batches of `rows`, the stage's bar counting rows.
fn generate(scale: f64, rows: usize, stage: &progress::Stage) -> Vec<RecordBatch> {
    crate::tpch::lineitem_with_progress(scale, rows, &|n| stage.inc(n as u64))
}

impl Source {
    /// The data in batches of `rows` rows; the stage's bar counts the rows generated.
    fn batches(&self, rows: usize, stage: &progress::Stage) -> Result<Vec<RecordBatch>, JobError> {
        match self {
            Self::Tpch(scale) => {
                stage.part("generating");
                stage.restart(
                    Some(crate::tpch::estimated_lineitem_rows(*scale)),
                    Unit::Rows,
                );
                let batches = generate(*scale, rows, stage);
                memory::release_free_memory();
                Ok(batches)
            }
            Self::File(batches) => {
                stage.part("cutting");
                input::rebatch(batches, rows)
                    .map_err(|e| JobError::new(format!("cutting the input into batches: {e}")))
            }
        }
    }
}

/// Runs the job with resolved options, showing `progress`.
pub fn run(options: Options, progress: &Progress) -> Result<(), JobError> {
    if let Some(JsonTarget::File(path)) = &options.json {
        check_writable(path, "JSON")?;
    }
    if let Some(path) = &options.chart {
        options::ChartFormat::of_path(path).map_err(JobError::new)?;
        check_writable(path, "chart")?;
    }
    // A file is read before the device opens, so that a bad file is its only message.
    let loaded = match &options.input {
        Some(path) => {
            // An error (also: no rows) before a line saying it was read.
            let (format, batches) = input::load_with_progress(path, progress)?;
            Some((path, format, batches))
        }
        None => None,
    };

    // Several devices (`cuda:0,1`, `cuda:all`): the first runs everything a single device
    // runs; devarrow then runs on all of them at once. `cuda:all` on a machine with one
    // device is a run on that device.
    let (selected, several) = if options.device.is_multi() {
        let mut all = device::select_several(&options.device, options.link, &options.cuda_options)?;
        let several: Vec<(String, String, Arc<dyn JobDevice>)> = if all.len() > 1 {
            all.iter()
                .map(|s| (s.id.clone(), s.name.clone(), s.device.clone()))
                .collect()
        } else {
            Vec::new()
        };
        (all.remove(0), several)
    } else {
        (
            device::select(&options.device, options.link, &options.cuda_options)?,
            Vec::new(),
        )
    };
    // Before anything is generated, and before the first line about it.
    if options.input.is_none() && options.memory_check {
        let estimate = memory::estimate(options.scale, selected.cuda.is_some());
        memory::check(&estimate, memory::available())?;
    }
    match &selected.fallback {
        Some(why) => progress.note(&format!("{why}; running on the CPU device")),
        None if several.is_empty() => {
            progress.note(&format!("running on {} ({})", selected.name, selected.id));
        }
        None => {
            let all: Vec<String> = several
                .iter()
                .map(|(id, name, _)| format!("{name} ({id})"))
                .collect();
            progress.note(&format!(
                "running on {} devices: {}",
                several.len(),
                all.join(", ")
            ));
        }
    }
    let cuda = &options.cuda_options;
    if cuda.env_overridden {
        progress.note(&format!(
            "--cuda-options given: {} ignored",
            cuda_options::ENV
        ));
    }
    if let Some(note) = report::cuda_options_unused(cuda, selected.cuda.is_some()) {
        progress.note(&note);
    }

    let (source, data, first) = match loaded {
        Some((path, format, batches)) => {
            let rows: usize = batches.iter().map(|b| b.num_rows()).sum();
            let data = DataInfo {
                kind: format.name().into(),
                path: Some(path.display().to_string()),
                scale: None,
                rows,
                columns: batches[0].num_columns(),
                arrow_bytes: crate::tpch::batch_bytes(&batches),
            };
            (Source::File(batches), data, None)
        }
        None => {
            let rows = options.batch_sizes[0];
            let stage = progress.stage(
                format!("generating TPC-H lineitem at scale {}", options.scale),
                Some(crate::tpch::estimated_lineitem_rows(options.scale)),
                Unit::Rows,
            );
            let batches = generate(options.scale, rows, &stage);
            // The generator's threads leave free memory in their heaps.
            memory::release_free_memory();
            stage.finish();
            if batches.iter().all(|b| b.num_rows() == 0) {
                return Err(JobError::new(format!(
                    "TPC-H lineitem at scale {} has no rows: use a larger --scale",
                    options.scale
                )));
            }
            let data = DataInfo {
                kind: "tpch-lineitem".into(),
                path: None,
                scale: Some(options.scale),
                rows: batches.iter().map(|b| b.num_rows()).sum(),
                columns: crate::tpch::lineitem_schema().fields().len(),
                arrow_bytes: crate::tpch::batch_bytes(&batches),
            };
            (Source::Tpch(options.scale), data, Some(batches))
        }
    };

    let mut points = Vec::with_capacity(options.batch_sizes.len());
    let mut export_check = None;
    let mut first = first;
    let count = options.batch_sizes.len();
    let steps = measure::steps(options.reps)
        + if several.is_empty() {
            0
        } else {
            measure::several_steps(options.reps)
        };
    let devices: Vec<(String, Arc<dyn JobDevice>)> = several
        .iter()
        .map(|(id, _, device)| (id.clone(), device.clone()))
        .collect();
    for (i, &rows) in options.batch_sizes.iter().enumerate() {
        let stage = progress.stage(
            format!(
                "[{}/{count}] {} rows per batch",
                i + 1,
                report::thousands(rows as u64)
            ),
            Some(steps),
            Unit::Steps,
        );
        let batches = match first.take() {
            Some(batches) => batches,
            None => {
                let batches = source.batches(rows, &stage)?;
                stage.restart(Some(steps), Unit::Steps);
                batches
            }
        };
        stage.part(report::count(batches.len(), "batch", "batches"));
        let mut point = measure::measure_point(
            &selected.device,
            &batches,
            rows,
            options.reps,
            &options.transfer_options.options(),
            &stage,
        )?;
        if !devices.is_empty() {
            point.multi = Some(measure::measure_several(
                &devices,
                &batches,
                options.reps,
                &stage,
            )?);
        }
        if export_check.is_none() {
            stage.part("export/import");
            export_check = Some(check_export(&selected, &batches[0])?);
        }
        // The batches go before the next size's are made.
        drop(batches);
        memory::release_free_memory();
        stage.finish();
        points.push(point);
    }
    // Nothing of the data is needed any more, nor the other devices.
    drop(source);
    drop(devices);
    let several: Vec<(String, String)> = several
        .into_iter()
        .map(|(id, name, _)| (id, name))
        .collect();

    let run = Run {
        device: DeviceInfo {
            id: selected.id.clone(),
            name: selected.name.clone(),
            cuda_summary: selected.cuda_summary.clone(),
            fallback: selected.fallback.clone(),
            link: (selected.id == "cpu").then_some(options.link).flatten(),
            cuda_options: selected.cuda.as_ref().map(|cuda| cuda.options()),
            batched_copies: selected
                .cuda
                .as_ref()
                .map(|cuda| (cuda.batch_copies_available(), cuda.batched_copy_calls())),
            several,
        },
        data,
        points,
        export_check,
        options,
    };
    if let Some(path) = &run.options.chart {
        let title = format!(
            "Host-device transfer bandwidth on the {} ({})",
            run.device.name, run.device.id
        );
        let subtitle = format!(
            "{}{}; devarrow {} (commit {}), best of {}",
            run.data.short(),
            run.device.model_note(),
            env!("CARGO_PKG_VERSION"),
            devarrow::GIT_COMMIT,
            run.options.reps,
        );
        chart::write(path, &run.points, &title, &subtitle)?;
    }
    let json = || {
        run.json_text()
            .map_err(|e| JobError::new(format!("cannot write the JSON: {e}")))
    };
    let stdout = match &run.options.json {
        Some(JsonTarget::Stdout) => json()?,
        Some(JsonTarget::File(path)) => {
            write_file(path, "JSON", &json()?)?;
            run.text()
        }
        None => run.text(),
    };
    print_stdout(&stdout)?;
    Ok(())
}

/// Exports `batch`, moved to the device, through the C Device Data Interface and imports
/// it again: on the CPU device back into a record batch compared with the input, on CUDA
/// onto a consumer stream that waits on the batch's event.
fn check_export(selected: &Selected, batch: &RecordBatch) -> Result<String, JobError> {
    let fail = |e: &dyn std::fmt::Display| JobError::new(format!("export/import check: {e}"));
    let mut transfer = Transfer::new(selected.device.clone(), TransferOptions::default());
    let on_device = transfer.to_device(batch).map_err(|e| fail(&e))?;
    let start = Instant::now();
    let (array, schema) = on_device.export().map_err(|e| fail(&e))?;
    match &selected.cuda {
        None => {
            let back = cpu::import_record_batch(array, &schema).map_err(|e| fail(&e))?;
            if &back != batch {
                return Err(fail(&"the imported batch differs from the input"));
            }
        }
        Some(cuda) => {
            let consumer = cuda.primary_context().new_stream().map_err(|e| fail(&e))?;
            let imported = ImportedArray::import(array, &consumer).map_err(|e| fail(&e))?;
            imported.synchronize_host().map_err(|e| fail(&e))?;
            if imported.device_type() != on_device.device().device_type()
                || imported.array().length != batch.num_rows() as i64
            {
                return Err(fail(
                    &"the imported array does not match the exported batch",
                ));
            }
        }
    }
    let elapsed = start.elapsed();
    Ok(format!(
        "ok: a device batch exported as an ArrowDeviceArray ({}, device {}) and imported \
         again in {}",
        on_device.device().device_type(),
        on_device.device().device_id(),
        report::human_duration(elapsed)
    ))
}
