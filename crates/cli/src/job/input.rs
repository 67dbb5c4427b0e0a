//! The data the job moves: TPC-H `lineitem` generated in memory, or a Parquet or Arrow
//! IPC file, cut into batches of the sizes measured.

use std::fs::File;
use std::io::{BufReader, Read};
use std::path::Path;
use std::sync::Arc;

use arrow_array::{
    make_array, Array, ArrayRef, BinaryViewArray, RecordBatch, RecordBatchOptions, StringViewArray,
};
use arrow_data::transform::MutableArrayData;
use arrow_schema::{ArrowError, DataType};

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
pub fn load(path: &Path) -> Result<(Format, Vec<RecordBatch>), JobError> {
    let format = detect_format(path)?;
    let shown = path.display();
    let fail = |e: &dyn std::fmt::Display| {
        JobError::new(format!("cannot read {shown} as {}: {e}", format.name()))
    };
    let file = File::open(path).map_err(|e| JobError::new(format!("cannot open {shown}: {e}")))?;
    let batches: Result<Vec<RecordBatch>, ArrowError> = match format {
        Format::Parquet => {
            use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
            ParquetRecordBatchReaderBuilder::try_new(file)
                .and_then(|b| b.with_batch_size(64 << 10).build())
                .map_err(|e| fail(&e))?
                .collect()
        }
        Format::IpcFile => arrow_ipc::reader::FileReader::try_new(BufReader::new(file), None)
            .map_err(|e| fail(&e))?
            .collect(),
        Format::IpcStream => arrow_ipc::reader::StreamReader::try_new(BufReader::new(file), None)
            .map_err(|e| fail(&e))?
            .collect(),
    };
    Ok((format, batches.map_err(|e| fail(&e))?))
}

/// Whether `batches` already are batches of `rows` rows (the last one may be shorter).
fn already_cut(batches: &[RecordBatch], rows: usize) -> bool {
    let last = batches.len().saturating_sub(1);
    batches.iter().enumerate().all(|(i, b)| {
        b.num_rows() == rows || (i == last && b.num_rows() > 0 && b.num_rows() < rows)
    })
}

/// Cuts `batches` into batches of `rows` rows each (the last may be shorter), every
/// batch with buffers of its own (copied, not slices of the input, so that a batch holds
/// only its own bytes; top-level string and binary views are compacted). Batches that
/// already have that shape are returned as they are.
pub fn rebatch(batches: &[RecordBatch], rows: usize) -> Result<Vec<RecordBatch>, ArrowError> {
    assert!(rows > 0, "rows per batch must be positive");
    let Some(first) = batches.first() else {
        return Ok(Vec::new());
    };
    if already_cut(batches, rows) {
        return Ok(batches.to_vec());
    }
    let schema = first.schema();
    let total: usize = batches.iter().map(|b| b.num_rows()).sum();
    let mut out = Vec::with_capacity(total.div_ceil(rows));
    // The cursor: batch index and row within it.
    let (mut at, mut offset) = (0, 0);
    let mut done = 0;
    while done < total {
        let want = rows.min(total - done);
        // The pieces of input batches that make up this output batch.
        let mut pieces = Vec::new();
        let mut need = want;
        while need > 0 {
            let available = batches[at].num_rows() - offset;
            let take = available.min(need);
            if take > 0 {
                pieces.push((at, offset, take));
            }
            need -= take;
            offset += take;
            if offset == batches[at].num_rows() {
                at += 1;
                offset = 0;
            }
        }
        let columns = (0..schema.fields().len())
            .map(|c| {
                let data: Vec<_> = pieces
                    .iter()
                    .map(|&(b, _, _)| batches[b].column(c).to_data())
                    .collect();
                let mut mutable = MutableArrayData::new(data.iter().collect(), false, want);
                for (i, &(_, start, len)) in pieces.iter().enumerate() {
                    mutable.try_extend(i, start, start + len)?;
                }
                Ok(compact(make_array(mutable.freeze())))
            })
            .collect::<Result<Vec<_>, ArrowError>>()?;
        let options = RecordBatchOptions::new().with_row_count(Some(want));
        out.push(RecordBatch::try_new_with_options(
            schema.clone(),
            columns,
            &options,
        )?);
        done += want;
    }
    Ok(out)
}

/// Copies the strings a view array uses into buffers of its own (the views of a copied
/// piece still point into the whole input's data buffers).
fn compact(array: ArrayRef) -> ArrayRef {
    match array.data_type() {
        DataType::Utf8View => Arc::new(StringViewArray::from(array.to_data()).gc()),
        DataType::BinaryView => Arc::new(BinaryViewArray::from(array.to_data()).gc()),
        _ => array,
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use arrow_array::{Int64Array, StringArray};
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
        let whole = batch.get_array_memory_size();
        let out = rebatch(std::slice::from_ref(&batch), 64).unwrap();
        assert_eq!(out.len(), 64);
        assert_eq!(out[3], batch.slice(192, 64));
        assert!(
            out[3].get_array_memory_size() * 16 < whole,
            "{} of {whole}",
            out[3].get_array_memory_size()
        );
    }
}
