//! The CUDA device options of a run ([`CudaDeviceOptions`]): from `--cuda-options`, else
//! from the environment variable [`ENV`], else the defaults. Both take the same
//! comma-separated list, e.g. `batch_copies,register_pageable=1MiB,host_wait=block`.

use std::ffi::OsStr;

use devarrow::cuda::{CudaDeviceOptions, HostWait};

/// The environment variable the options are read from when `--cuda-options` is not
/// given.
pub const ENV: &str = "DEVARROW_CUDA_OPTIONS";

/// The options a list may name, with the values each takes.
pub const VALID: &str = "batch_copies[=BOOL], register_pageable=SIZE|off, \
                         host_wait=spin|block, reuse_events[=BOOL] (BOOL: true/false, \
                         on/off, yes/no, 1/0; SIZE: bytes with an optional K/KiB, M/MiB or \
                         G/GiB suffix, powers of 1024)";

/// Why a list of CUDA options was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CudaOptionsError {
    /// An item names no option.
    #[error("unknown CUDA option `{item}`; the options are {VALID}")]
    Unknown {
        /// The item as given.
        item: String,
    },
    /// An option that needs a value has none.
    #[error("the CUDA option `{item}` needs a value ({expected}); the options are {VALID}")]
    MissingValue {
        /// The item as given.
        item: String,
        /// What the option takes.
        expected: &'static str,
    },
    /// An option's value is not one it takes.
    #[error("bad value in the CUDA option `{item}`: expected {expected}; the options are {VALID}")]
    BadValue {
        /// The item as given.
        item: String,
        /// What the option takes.
        expected: &'static str,
    },
    /// An option is named twice.
    #[error("the CUDA option `{name}` is given twice; the options are {VALID}")]
    Repeated {
        /// The option's name.
        name: String,
    },
    /// The environment variable is not UTF-8.
    #[error("the list is not valid UTF-8; the options are {VALID}")]
    NotUnicode,
}

/// Where a run's CUDA options came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// Neither the flag nor the environment variable: the defaults.
    Default,
    /// The environment variable [`ENV`].
    Env,
    /// `--cuda-options` (which wins over the environment variable).
    Flag,
}

impl Source {
    /// How the report names it: `default`, `DEVARROW_CUDA_OPTIONS`, `--cuda-options`.
    pub fn label(self) -> &'static str {
        match self {
            Self::Default => "default",
            Self::Env => ENV,
            Self::Flag => "--cuda-options",
        }
    }
}

/// A list of CUDA options as given on the command line, parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Given {
    /// The list as given.
    pub text: String,
    /// The options it sets (the others at their defaults).
    pub options: CudaDeviceOptions,
}

/// The CUDA options a run asked for, and where they came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaOptions {
    /// The options (the defaults where none were given).
    pub options: CudaDeviceOptions,
    /// Where they came from.
    pub source: Source,
    /// The list as given (`None` with [`Source::Default`]).
    pub text: Option<String>,
    /// Whether [`ENV`] was set but `--cuda-options` won over it.
    pub env_overridden: bool,
}

impl Default for CudaOptions {
    fn default() -> Self {
        Self {
            options: CudaDeviceOptions::default(),
            source: Source::Default,
            text: None,
            env_overridden: false,
        }
    }
}

impl CudaOptions {
    /// The options of a run: `flag` when given (then `env` is not read), else `env` (the
    /// value of [`ENV`]; unset or blank is the defaults).
    pub fn resolve(flag: Option<Given>, env: Option<&OsStr>) -> Result<Self, CudaOptionsError> {
        let env_set = env.is_some_and(|v| !v.to_string_lossy().trim().is_empty());
        if let Some(given) = flag {
            return Ok(Self {
                options: given.options,
                source: Source::Flag,
                text: Some(given.text),
                env_overridden: env_set,
            });
        }
        if !env_set {
            return Ok(Self::default());
        }
        let text = env
            .and_then(OsStr::to_str)
            .ok_or(CudaOptionsError::NotUnicode)?;
        Ok(Self {
            options: parse(text)?,
            source: Source::Env,
            text: Some(text.trim().to_string()),
            env_overridden: false,
        })
    }

    /// Whether any option was given (by the flag or the environment).
    pub fn given(&self) -> bool {
        self.source != Source::Default
    }
}

/// The value parser of `--cuda-options`.
pub fn parse_flag(s: &str) -> Result<Given, String> {
    let options = parse(s).map_err(|e| e.to_string())?;
    Ok(Given {
        text: s.trim().to_string(),
        options,
    })
}

/// Parses a comma-separated list of CUDA options; the options it does not name keep
/// their defaults ([`CudaDeviceOptions::default`]). Names are case-insensitive, blank
/// items are skipped.
pub fn parse(s: &str) -> Result<CudaDeviceOptions, CudaOptionsError> {
    let mut options = CudaDeviceOptions::default();
    let mut seen: Vec<String> = Vec::new();
    for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let (name, value) = match item.split_once('=') {
            Some((name, value)) => (name.trim(), Some(value.trim())),
            None => (item, None),
        };
        let name = name.to_ascii_lowercase();
        let value = value.map(str::to_ascii_lowercase);
        let missing = |expected| CudaOptionsError::MissingValue {
            item: item.to_string(),
            expected,
        };
        let bad = |expected| CudaOptionsError::BadValue {
            item: item.to_string(),
            expected,
        };
        const BOOL: &str = "true/false, on/off, yes/no or 1/0";
        const SIZE: &str = "a size in bytes (e.g. 1048576, 64K, 1MiB, 1G) or off";
        const WAIT: &str = "spin or block";
        match name.as_str() {
            "batch_copies" => {
                options = options.batch_copies(parse_bool(value.as_deref()).ok_or(bad(BOOL))?)
            }
            "reuse_events" => {
                options = options.reuse_events(parse_bool(value.as_deref()).ok_or(bad(BOOL))?)
            }
            "host_wait" => {
                let wait = match value.as_deref() {
                    None | Some("") => return Err(missing(WAIT)),
                    Some("spin") => HostWait::Spin,
                    Some("block") => HostWait::Block,
                    Some(_) => return Err(bad(WAIT)),
                };
                options = options.host_wait(wait);
            }
            "register_pageable" => {
                let min_bytes = match value.as_deref() {
                    None | Some("") => return Err(missing(SIZE)),
                    Some("off" | "none" | "no" | "false") => None,
                    Some(size) => Some(parse_size(size).ok_or(bad(SIZE))?),
                };
                options = options.register_pageable(min_bytes);
            }
            _ => {
                return Err(CudaOptionsError::Unknown {
                    item: item.to_string(),
                })
            }
        }
        if seen.contains(&name) {
            return Err(CudaOptionsError::Repeated { name });
        }
        seen.push(name);
    }
    Ok(options)
}

/// A flag's value: none (the bare name) is true.
fn parse_bool(value: Option<&str>) -> Option<bool> {
    match value {
        None | Some("true" | "on" | "yes" | "1") => Some(true),
        Some("false" | "off" | "no" | "0") => Some(false),
        Some(_) => None,
    }
}

/// Binary units by suffix (lowercase).
const UNITS: [(&str, usize); 7] = [
    ("kib", 1 << 10),
    ("mib", 1 << 20),
    ("gib", 1 << 30),
    ("k", 1 << 10),
    ("m", 1 << 20),
    ("g", 1 << 30),
    ("b", 1),
];

/// A byte count, lowercase: digits (`_` allowed) and an optional suffix from [`UNITS`].
pub(crate) fn parse_size(s: &str) -> Option<usize> {
    let (digits, unit) = UNITS
        .iter()
        .find_map(|&(suffix, unit)| s.strip_suffix(suffix).map(|d| (d, unit)))
        .unwrap_or((s, 1));
    let digits = digits.trim().replace('_', "");
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse::<usize>().ok()?.checked_mul(unit)
}

/// A byte count in the largest binary unit that divides it (`1MiB`), else in bytes.
pub fn size_text(bytes: usize) -> String {
    for (suffix, unit) in [("GiB", 1usize << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)] {
        if bytes >= unit && bytes.is_multiple_of(unit) {
            return format!("{}{suffix}", bytes / unit);
        }
    }
    bytes.to_string()
}

/// All four options with their values, in the syntax [`parse`] takes:
/// `batch_copies=true,register_pageable=off,host_wait=spin,reuse_events=true`.
pub fn describe(o: &CudaDeviceOptions) -> String {
    format!(
        "batch_copies={},register_pageable={},host_wait={},reuse_events={}",
        o.batch_copies,
        o.register_pageable.map_or_else(|| "off".into(), size_text),
        host_wait_name(o.host_wait),
        o.reuse_events
    )
}

/// `spin` or `block`.
pub fn host_wait_name(wait: HostWait) -> &'static str {
    match wait {
        HostWait::Spin => "spin",
        HostWait::Block => "block",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn good_lists() {
        let d = CudaDeviceOptions::default();
        assert_eq!(parse("").unwrap(), d);
        assert_eq!(parse(" , ").unwrap(), d);
        assert_eq!(parse("batch_copies").unwrap(), d.batch_copies(true));
        assert_eq!(
            parse("batch_copies,register_pageable=1MiB,host_wait=block,reuse_events=false")
                .unwrap(),
            d.batch_copies(true)
                .register_pageable(Some(1 << 20))
                .host_wait(HostWait::Block)
                .reuse_events(false)
        );
        assert_eq!(
            parse(" Batch_Copies = off , HOST_WAIT=Spin ").unwrap(),
            d.batch_copies(false)
        );
        for (size, bytes) in [
            ("4096", 4096),
            ("64K", 64 << 10),
            ("64kib", 64 << 10),
            ("1M", 1 << 20),
            ("2MiB", 2 << 20),
            ("1G", 1 << 30),
            ("1GiB", 1 << 30),
            ("1_000", 1000),
            ("512B", 512),
            ("0", 0),
        ] {
            assert_eq!(
                parse(&format!("register_pageable={size}"))
                    .unwrap()
                    .register_pageable,
                Some(bytes),
                "{size}"
            );
        }
        assert_eq!(
            parse("register_pageable=off").unwrap().register_pageable,
            None
        );
        for (value, on) in [("true", true), ("on", true), ("1", true), ("no", false)] {
            assert_eq!(
                parse(&format!("reuse_events={value}"))
                    .unwrap()
                    .reuse_events,
                on
            );
        }
    }

    #[test]
    fn bad_lists_name_the_item_and_list_the_options() {
        for (list, item) in [
            ("batch_copy", "`batch_copy`"),
            ("batch_copies,nope=1", "`nope=1`"),
            ("host_wait=fast", "`host_wait=fast`"),
            ("host_wait", "`host_wait`"),
            ("register_pageable", "`register_pageable`"),
            ("register_pageable=1MB", "`register_pageable=1MB`"),
            ("register_pageable=-1", "`register_pageable=-1`"),
            ("register_pageable=1.5M", "`register_pageable=1.5M`"),
            (
                "register_pageable=99999999999999999999G",
                "`register_pageable=99999999999999999999G`",
            ),
            ("reuse_events=maybe", "`reuse_events=maybe`"),
            ("batch_copies,batch_copies=false", "`batch_copies`"),
        ] {
            let e = parse(list).unwrap_err().to_string();
            assert!(e.contains(item), "{list}: {e}");
            for name in [
                "batch_copies",
                "register_pageable",
                "host_wait",
                "reuse_events",
            ] {
                assert!(e.contains(name), "{list}: {e}");
            }
        }
    }

    #[test]
    fn describe_names_all_four_and_parses_back() {
        let d = CudaDeviceOptions::default();
        assert_eq!(
            describe(&d),
            "batch_copies=true,register_pageable=off,host_wait=spin,reuse_events=true"
        );
        for o in [
            d,
            d.batch_copies(true).register_pageable(Some(1 << 20)),
            d.host_wait(HostWait::Block)
                .reuse_events(false)
                .register_pageable(Some(1000)),
        ] {
            assert_eq!(parse(&describe(&o)).unwrap(), o, "{}", describe(&o));
        }
        assert_eq!(size_text(1 << 20), "1MiB");
        assert_eq!(size_text(3 << 10), "3KiB");
        assert_eq!(size_text(1000), "1000");
    }

    #[test]
    fn the_flag_wins_over_the_environment() {
        let flag = || Some(parse_flag("host_wait=block").unwrap());
        let env = Some(OsStr::new("batch_copies"));
        let both = CudaOptions::resolve(flag(), env).unwrap();
        assert_eq!(both.source, Source::Flag);
        assert!(both.env_overridden);
        assert_eq!(
            both.options,
            CudaDeviceOptions::default().host_wait(HostWait::Block)
        );
        // The environment is not even read when the flag is given.
        let bad_env = Some(OsStr::new("nope"));
        assert_eq!(
            CudaOptions::resolve(flag(), bad_env).unwrap().source,
            Source::Flag
        );
        let from_env = CudaOptions::resolve(None, env).unwrap();
        assert_eq!(from_env.source, Source::Env);
        assert_eq!(from_env.text.as_deref(), Some("batch_copies"));
        assert!(from_env.options.batch_copies && !from_env.env_overridden);
        assert!(CudaOptions::resolve(None, bad_env).is_err());
        for unset in [None, Some(OsStr::new("")), Some(OsStr::new("  "))] {
            assert_eq!(
                CudaOptions::resolve(None, unset).unwrap(),
                CudaOptions::default()
            );
        }
        assert!(parse_flag("host_wait=fast").is_err());
    }
}
