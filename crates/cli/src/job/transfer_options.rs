//! The transfer options of a run (`--transfer-options`): the staging geometry and the
//! packing threads of devarrow's [`Transfer`](devarrow::bridge::Transfer), so that one
//! run on a GPU can compare them beside the same ceilings (the defaults are decided by
//! such runs). A comma-separated list, e.g. `staging=128MiB,chunk=8MiB,pack_threads=8`.

use devarrow::bridge::TransferOptions;

use super::cuda_options::{parse_size, size_text};

/// The options a list may name, with the values each takes.
pub const VALID: &str = "staging=SIZE, chunk=SIZE, first_chunk=SIZE, pack_threads=N \
                         (SIZE: bytes with an optional K/KiB, M/MiB or G/GiB suffix, powers \
                         of 1024; pack_threads=0: the default count)";

/// The transfer options of a run: the list as given (`None`: the defaults) and the
/// options it sets.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TransferGiven {
    /// The list as given, trimmed.
    pub text: Option<String>,
    /// `staging_bytes`, `chunk_bytes`, `first_chunk_bytes`, `pack_threads` as given.
    pub values: [Option<usize>; 4],
}

impl TransferGiven {
    /// [`TransferOptions::default`] with the values given.
    pub fn options(&self) -> TransferOptions {
        let [staging, chunk, first, threads] = self.values;
        let mut o = TransferOptions::default();
        if let Some(v) = staging {
            o = o.with_staging_bytes(v);
        }
        if let Some(v) = chunk {
            o = o.with_chunk_bytes(v);
        }
        if let Some(v) = first {
            o.first_chunk_bytes = v;
        }
        if let Some(v) = threads {
            o.pack_threads = v;
        }
        o
    }

    /// The four values that run, in the syntax [`parse_flag`] takes.
    pub fn describe(&self) -> String {
        let o = self.options();
        format!(
            "staging={},chunk={},first_chunk={},pack_threads={}",
            size_text(o.staging_bytes),
            size_text(o.chunk_bytes),
            size_text(o.first_chunk_bytes),
            o.pack_threads
        )
    }
}

/// The value parser of `--transfer-options`: names are case-insensitive, blank items
/// are skipped, a name given twice is refused.
pub fn parse_flag(s: &str) -> Result<TransferGiven, String> {
    const NAMES: [&str; 4] = ["staging", "chunk", "first_chunk", "pack_threads"];
    let mut values = [None; 4];
    for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let (name, value) = item
            .split_once('=')
            .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_ascii_lowercase()))
            .ok_or_else(|| {
                format!("the transfer option `{item}` needs a value; the options are {VALID}")
            })?;
        let i = NAMES
            .iter()
            .position(|n| *n == name)
            .ok_or_else(|| format!("unknown transfer option `{item}`; the options are {VALID}"))?;
        let parsed = if name == "pack_threads" {
            value.parse::<usize>().ok().filter(|&n| n <= 1024)
        } else {
            parse_size(&value).filter(|&n| n > 0)
        };
        let v = parsed.ok_or_else(|| {
            format!("bad value in the transfer option `{item}`; the options are {VALID}")
        })?;
        if values[i].replace(v).is_some() {
            return Err(format!(
                "the transfer option `{name}` is given twice; the options are {VALID}"
            ));
        }
    }
    Ok(TransferGiven {
        text: Some(s.trim().to_string()),
        values,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_list_sets_the_options_it_names_and_keeps_the_defaults_of_the_others() {
        let given = parse_flag(" staging=128MiB, Chunk=8M ,pack_threads=8 ").unwrap();
        let o = given.options();
        let d = TransferOptions::default();
        assert_eq!(
            (
                o.staging_bytes,
                o.chunk_bytes,
                o.first_chunk_bytes,
                o.pack_threads
            ),
            (128 << 20, 8 << 20, d.first_chunk_bytes, 8)
        );
        assert_eq!(
            given.text.as_deref(),
            Some("staging=128MiB, Chunk=8M ,pack_threads=8")
        );
        assert_eq!(
            given.describe(),
            format!(
                "staging=128MiB,chunk=8MiB,first_chunk={},pack_threads=8",
                size_text(d.first_chunk_bytes)
            )
        );
        assert_eq!(
            TransferGiven::default().options().chunk_bytes,
            d.chunk_bytes
        );
    }

    #[test]
    fn bad_lists_say_what_is_wrong() {
        for (list, says) in [
            ("stage=1M", "unknown transfer option `stage=1M`"),
            ("chunk", "needs a value"),
            ("chunk=0", "bad value"),
            ("chunk=lots", "bad value"),
            ("pack_threads=-1", "bad value"),
            ("chunk=1M,chunk=2M", "given twice"),
        ] {
            let e = parse_flag(list).unwrap_err();
            assert!(
                e.contains(says) && e.contains("pack_threads=N"),
                "{list}: {e}"
            );
        }
    }
}
