//! The data the job moves: TPC-H `lineitem` generated in memory, or a Parquet or Arrow
//! IPC file, cut into batches of the sizes measured.

use std::fs::File;
use std::io::{BufReader, Read};
use std::path::Path;

use std::sync::Arc;

use arrow_array::cast::AsArray;
use arrow_array::types::ByteViewType;
use arrow_array::{Array, ArrayRef, GenericByteViewArray, RecordBatch, RecordBatchOptions};
use arrow_schema::{ArrowError, DataType};
use arrow_select::coalesce::BatchCoalescer;

use super::progress::{Progress, Unit};
use super::JobError;

/// The file formats `--input` reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// Apache Parquet (magic `PAR1`).
    Parquet,
    /// The Arrow IPC file format (magic `ARROW1`; `.arrow`, `.feather`).
    IpcFile,
    /// The Arrow IPC stream format (`.arrows`, `.ipc`).
    IpcStream,
}

impl Format {
    /// The name printed and written to JSON.
    pub fn name(self) -> &'static str {
        match self {
            Self::Parquet => "parquet",
            Self::IpcFile => "arrow-ipc-file",
            Self::IpcStream => "arrow-ipc-stream",
        }
    }
}

/// Decides the format of `path` from its magic bytes, else from its extension.
pub fn detect_format(path: &Path) -> Result<Format, JobError> {
    let shown = path.display();
    let meta = std::fs::metadata(path)
        .map_err(|e| JobError::new(format!("cannot read the input {shown}: {e}")))?;
    if meta.is_dir() {
        return Err(JobError::new(format!("{shown} is a directory, not a file")));
    }
    if meta.len() == 0 {
        return Err(JobError::new(format!("{shown} is empty")));
    }
    let mut head = Vec::with_capacity(8);
    File::open(path)
        .and_then(|f| f.take(8).read_to_end(&mut head))
        .map_err(|e| JobError::new(format!("cannot read {shown}: {e}")))?;
    if head.starts_with(b"PAR1") {
        return Ok(Format::Parquet);
    }
    if head.starts_with(b"ARROW1") {
        return Ok(Format::IpcFile);
    }
    if head.starts_with(&[0xff; 4]) {
        return Ok(Format::IpcStream);
    }
    let extension = path
        .extension()
        .and_then(|e| e.to_str())
        .map(str::to_ascii_lowercase);
    match extension.as_deref() {
        Some("parquet" | "pq") => Ok(Format::Parquet),
        Some("arrow" | "feather") => Ok(Format::IpcFile),
        // Streams written before Arrow 0.15 start with the message length, no marker.
        Some("arrows" | "ipc" | "stream") => Ok(Format::IpcStream),
        _ => Err(JobError::new(format!(
            "{shown} is neither Parquet nor Arrow IPC (unknown magic bytes and extension; \
             expected .parquet, .arrow, .arrows or .ipc)"
        ))),
    }
}

/// Reads every record batch of a Parquet or Arrow IPC file.
#[cfg(test)]
pub fn load(path: &Path) -> Result<(Format, Vec<RecordBatch>), JobError> {
    load_with_progress(path, &Progress::off())
}

/// [`load`], showing a stage that moves with the rows (Parquet) or the bytes (Arrow
/// IPC) read.
pub fn load_with_progress(
    path: &Path,
    progress: &Progress,
) -> Result<(Format, Vec<RecordBatch>), JobError> {
    let format = detect_format(path)?;
    let shown = path.display();
    let fail = |e: &dyn std::fmt::Display| {
        JobError::new(format!("cannot read {shown} as {}: {e}", format.name()))
    };
    let file = File::open(path).map_err(|e| JobError::new(format!("cannot open {shown}: {e}")))?;
    let what = format!("reading {shown} ({})", format.name());
    let (stage, batches): (_, Result<Vec<RecordBatch>, ArrowError>) = match format {
        Format::Parquet => {
            use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
            let builder = ParquetRecordBatchReaderBuilder::try_new(file).map_err(|e| fail(&e))?;
            let rows = u64::try_from(builder.metadata().file_metadata().num_rows()).ok();
            let stage = progress.stage(what, rows, Unit::Rows);
            let reader = builder
                .with_batch_size(64 << 10)
                .build()
                .map_err(|e| fail(&e))?;
            let batches = reader
                .inspect(|b| {
                    if let Ok(b) = b {
                        stage.inc(b.num_rows() as u64);
                    }
                })
                .collect();
            (stage, batches)
        }
        Format::IpcFile | Format::IpcStream => {
            let size = file.metadata().ok().map(|m| m.len());
            let stage = progress.stage(what, size, Unit::Bytes);
            let read = BufReader::new(stage.bar().wrap_read(file));
            let batches = if format == Format::IpcFile {
                arrow_ipc::reader::FileReader::try_new(read, None)
                    .map_err(|e| fail(&e))?
                    .collect()
            } else {
                arrow_ipc::reader::StreamReader::try_new(read, None)
                    .map_err(|e| fail(&e))?
                    .collect()
            };
            (stage, batches)
        }
    };
    let batches = batches.map_err(|e| fail(&e))?;
    if batches.iter().all(|b| b.num_rows() == 0) {
        return Err(JobError::new(format!(
            "{shown} holds no rows: nothing to transfer"
        )));
    }
    stage.finish();
    Ok((format, batches))
}

/// Whether `batches` already are batches of `rows` rows (the last one may be shorter).
fn already_cut(batches: &[RecordBatch], rows: usize) -> bool {
    let last = batches.len().saturating_sub(1);
    batches.iter().enumerate().all(|(i, b)| {
        b.num_rows() == rows || (i == last && b.num_rows() > 0 && b.num_rows() < rows)
    })
}

/// Cuts `batches` into batches of `rows` rows each (the last may be shorter), every
/// batch with buffers of its own: arrow-select's `BatchCoalescer` copies the rows (not
/// slices of the input, so that a batch holds only its own bytes), and top-level string
/// and binary views that still reference more string data than they use are compacted.
/// Batches that already have that shape are returned as they are.
pub fn rebatch(batches: &[RecordBatch], rows: usize) -> Result<Vec<RecordBatch>, ArrowError> {
    if rows == 0 {
        return Err(ArrowError::InvalidArgumentError(
            "rows per batch must be positive".into(),
        ));
    }
    let Some(first) = batches.first() else {
        return Ok(Vec::new());
    };
    if already_cut(batches, rows) {
        return Ok(batches.to_vec());
    }
    let total: usize = batches.iter().map(|b| b.num_rows()).sum();
    let mut out = Vec::with_capacity(total.div_ceil(rows));
    let mut coalescer = BatchCoalescer::new(first.schema(), rows);
    let mut take = |coalescer: &mut BatchCoalescer| -> Result<(), ArrowError> {
        while let Some(cut) = coalescer.next_completed_batch() {
            out.push(compact(cut)?);
        }
        Ok(())
    };
    for batch in batches {
        // Pieces that each fall within one output batch: the coalescer then copies the
        // strings of a view column when the piece uses little of its buffers.
        let mut offset = 0;
        while offset < batch.num_rows() {
            let room = rows - coalescer.get_buffered_rows();
            let len = room.min(batch.num_rows() - offset);
            coalescer.push_batch(batch.slice(offset, len))?;
            take(&mut coalescer)?;
            offset += len;
        }
    }
    coalescer.finish_buffered_batch()?;
    take(&mut coalescer)?;
    Ok(out)
}

/// Compacts the top-level string and binary views of `batch` whose data buffers hold
/// more than an eighth more than the strings they use.
fn compact(batch: RecordBatch) -> Result<RecordBatch, ArrowError> {
    fn sparse<T: ByteViewType + ?Sized>(a: &GenericByteViewArray<T>) -> bool {
        let used = a.total_buffer_bytes_used();
        let held: usize = a.data_buffers().iter().map(|b| b.capacity()).sum();
        held > used + used / 8
    }
    if !batch
        .columns()
        .iter()
        .any(|c| matches!(c.data_type(), DataType::Utf8View | DataType::BinaryView))
    {
        return Ok(batch);
    }
    let columns: Vec<ArrayRef> = batch
        .columns()
        .iter()
        .map(|c| match c.data_type() {
            DataType::Utf8View if sparse(c.as_string_view()) => {
                Arc::new(c.as_string_view().gc()) as ArrayRef
            }
            DataType::BinaryView if sparse(c.as_binary_view()) => {
                Arc::new(c.as_binary_view().gc()) as ArrayRef
            }
            _ => c.clone(),
        })
        .collect();
    RecordBatch::try_new_with_options(
        batch.schema(),
        columns,
        &RecordBatchOptions::new().with_row_count(Some(batch.num_rows())),
    )
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use arrow_array::{Int64Array, StringArray, StringViewArray};
    use std::path::PathBuf;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A directory of its own under the system temp dir, removed on drop.
    pub(crate) struct TempDir(pub PathBuf);

    impl TempDir {
        pub(crate) fn new() -> Self {
            static NEXT: AtomicUsize = AtomicUsize::new(0);
            let dir = std::env::temp_dir().join(format!(
                "devarrow-job-{}-{}",
                std::process::id(),
                NEXT.fetch_add(1, Ordering::Relaxed)
            ));
            std::fs::create_dir_all(&dir).unwrap();
            Self(dir)
        }
        pub(crate) fn path(&self, name: &str) -> PathBuf {
            self.0.join(name)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn sample(rows: i64, start: i64) -> RecordBatch {
        RecordBatch::try_from_iter([
            (
                "id",
                Arc::new(Int64Array::from_iter_values(start..start + rows)) as ArrayRef,
            ),
            (
                "name",
                Arc::new(StringArray::from_iter(
                    (start..start + rows).map(|i| (i % 5 != 0).then(|| format!("name {i}"))),
                )) as ArrayRef,
            ),
        ])
        .unwrap()
    }

    /// Writes every batch with `w`, then closes it (writing the footer, if any).
    fn write_all(mut w: impl arrow_array::RecordBatchWriter, batches: &[RecordBatch]) {
        for b in batches {
            w.write(b).unwrap();
        }
        w.close().unwrap();
    }

    fn write_parquet(path: &Path, batches: &[RecordBatch]) {
        let w = parquet::arrow::ArrowWriter::try_new(
            File::create(path).unwrap(),
            batches[0].schema(),
            None,
        )
        .unwrap();
        write_all(w, batches);
    }

    fn write_ipc_file(path: &Path, batches: &[RecordBatch]) {
        let w = arrow_ipc::writer::FileWriter::try_new(
            File::create(path).unwrap(),
            &batches[0].schema(),
        )
        .unwrap();
        write_all(w, batches);
    }

    fn write_ipc_stream(path: &Path, batches: &[RecordBatch]) {
        let w = arrow_ipc::writer::StreamWriter::try_new(
            File::create(path).unwrap(),
            &batches[0].schema(),
        )
        .unwrap();
        write_all(w, batches);
    }

    fn write_compressed_ipc_file(
        path: &Path,
        batches: &[RecordBatch],
        codec: arrow_ipc::CompressionType,
    ) {
        let options = arrow_ipc::writer::IpcWriteOptions::default()
            .try_with_compression(Some(codec))
            .unwrap();
        let w = arrow_ipc::writer::FileWriter::try_new_with_options(
            File::create(path).unwrap(),
            &batches[0].schema(),
            options,
        )
        .unwrap();
        write_all(w, batches);
    }

    fn rows_of(batches: &[RecordBatch]) -> usize {
        batches.iter().map(|b| b.num_rows()).sum()
    }

    #[test]
    fn loads_parquet_and_ipc_files_and_streams() {
        let dir = TempDir::new();
        let input = [sample(1000, 0), sample(500, 1000)];
        let whole = rebatch(&input, 1500).unwrap();
        type Writer = fn(&Path, &[RecordBatch]);
        let cases: [(&str, Writer, Format); 3] = [
            ("t.parquet", write_parquet, Format::Parquet),
            ("t.arrow", write_ipc_file, Format::IpcFile),
            ("t.arrows", write_ipc_stream, Format::IpcStream),
        ];
        for (name, write, format) in cases {
            let path = dir.path(name);
            write(&path, &input);
            let (found, batches) = load(&path).unwrap();
            assert_eq!(found, format, "{name}");
            assert_eq!(rows_of(&batches), 1500, "{name}");
            assert_eq!(rebatch(&batches, 1500).unwrap(), whole, "{name}");
            // The magic bytes win over a misleading extension.
            let renamed = dir.path(&format!("{name}.data"));
            std::fs::rename(&path, &renamed).unwrap();
            assert_eq!(detect_format(&renamed).unwrap(), format, "{name}");
        }
        // `.ipc` names a stream.
        let path = dir.path("t.ipc");
        write_ipc_stream(&path, &input);
        assert_eq!(load(&path).unwrap().0, Format::IpcStream);
    }

    /// pyarrow writes Feather (IPC) files compressed with lz4 by default, zstd on request.
    #[test]
    fn loads_lz4_and_zstd_compressed_ipc_files() {
        let dir = TempDir::new();
        let input = [sample(3000, 0), sample(1000, 3000)];
        let whole = rebatch(&input, 4000).unwrap();
        for (name, codec) in [
            ("lz4.feather", arrow_ipc::CompressionType::LZ4_FRAME),
            ("zstd.arrow", arrow_ipc::CompressionType::ZSTD),
        ] {
            let path = dir.path(name);
            write_compressed_ipc_file(&path, &input, codec);
            // Compressed: smaller than the same file written plain.
            let plain = dir.path("plain.arrow");
            write_ipc_file(&plain, &input);
            let (size, plain_size) = (
                std::fs::metadata(&path).unwrap().len(),
                std::fs::metadata(&plain).unwrap().len(),
            );
            assert!(size < plain_size, "{name}: {size} vs {plain_size}");
            let (format, batches) = load(&path).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(format, Format::IpcFile, "{name}");
            assert_eq!(rebatch(&batches, 4000).unwrap(), whole, "{name}");
        }
    }

    /// The IPC reader slices every buffer of a batch out of one message body: its bytes
    /// are counted once, close to the file's size (not once per column).
    #[test]
    fn an_ipc_file_counts_about_its_size() {
        let dir = TempDir::new();
        let path = dir.path("lineitem.arrow");
        write_ipc_file(&path, &crate::tpch::lineitem(0.001, 2000));
        let size = std::fs::metadata(&path).unwrap().len() as f64;
        let (_, batches) = load(&path).unwrap();
        let counted = crate::tpch::batch_bytes(&batches) as f64;
        assert!(
            counted > 0.9 * size && counted < 1.1 * size,
            "{counted} bytes counted for a file of {size}"
        );
        // What `get_array_memory_size` says: many times the file.
        let naive: usize = batches.iter().map(|b| b.get_array_memory_size()).sum();
        assert!(naive as f64 > 5.0 * size, "{naive} vs {size}");
    }

    #[test]
    fn bad_files_are_clear_errors() {
        let dir = TempDir::new();
        let missing = dir.path("missing.parquet");
        let err = load(&missing).unwrap_err().to_string();
        assert!(err.contains("missing.parquet"), "{err}");

        let empty = dir.path("empty.arrow");
        std::fs::write(&empty, b"").unwrap();
        assert!(load(&empty).unwrap_err().to_string().contains("is empty"));

        let text = dir.path("notes.txt");
        std::fs::write(&text, b"hello, world").unwrap();
        let err = load(&text).unwrap_err().to_string();
        assert!(err.contains("neither Parquet nor Arrow IPC"), "{err}");

        let fake = dir.path("fake.parquet");
        std::fs::write(&fake, b"not really parquet").unwrap();
        let err = load(&fake).unwrap_err().to_string();
        assert!(
            err.contains("cannot read") && err.contains("parquet"),
            "{err}"
        );

        let truncated = dir.path("truncated.arrow");
        write_ipc_file(&truncated, &[sample(100, 0)]);
        let bytes = std::fs::read(&truncated).unwrap();
        std::fs::write(&truncated, &bytes[..bytes.len() / 2]).unwrap();
        assert!(load(&truncated).is_err());

        assert!(load(&dir.0).unwrap_err().to_string().contains("directory"));
    }

    #[test]
    fn rebatch_cuts_exact_batches_with_their_own_buffers() {
        let input = [
            sample(700, 0),
            sample(0, 700),
            sample(300, 700),
            sample(1, 1000),
        ];
        let out = rebatch(&input, 256).unwrap();
        let sizes: Vec<_> = out.iter().map(|b| b.num_rows()).collect();
        assert_eq!(sizes, [256, 256, 256, 233]);
        let expected = sample(1001, 0);
        for (i, b) in out.iter().enumerate() {
            assert_eq!(b, &expected.slice(i * 256, b.num_rows()));
        }
        // Already cut: returned as is.
        let again = rebatch(&out, 256).unwrap();
        assert!(again[0]
            .column(0)
            .to_data()
            .ptr_eq(&out[0].column(0).to_data()));
        assert!(rebatch(&[], 10).unwrap().is_empty());
    }

    #[test]
    fn rebatch_compacts_string_views() {
        let long: Vec<String> = (0..4096)
            .map(|i| format!("a string longer than twelve {i}"))
            .collect();
        let views = StringViewArray::from_iter_values(long.iter());
        let batch = RecordBatch::try_from_iter([("s", Arc::new(views) as ArrayRef)]).unwrap();
        let bytes = |b: &RecordBatch| crate::footprint::arrow_bytes(std::slice::from_ref(b));
        let whole = bytes(&batch);
        let out = rebatch(std::slice::from_ref(&batch), 64).unwrap();
        assert_eq!(out.len(), 64);
        assert_eq!(out[3], batch.slice(192, 64));
        assert!(bytes(&out[3]) * 16 < whole, "{} of {whole}", bytes(&out[3]));
    }
}
