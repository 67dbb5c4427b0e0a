//! Unicode's case mappings on the device: `upper`, `lower` and `initcap` as DataFusion
//! computes them (Rust's `char::to_uppercase` and `char::to_lowercase`, and
//! `char::is_alphanumeric` for `initcap`'s words), as tables made once of Rust's own
//! mappings, walked by `unicode_case_views` on CUDA and by [`CaseTables::apply`] on the
//! CPU device.
//!
//! `str::to_lowercase` maps `Σ` (U+03A3) by the letters around it (`ς` at a word's end,
//! `σ` elsewhere), from Unicode properties Rust does not expose: `lower` of a value with
//! one is the host's.

use std::sync::OnceLock;

use super::expr::Case;

/// The capital sigma, whose lower case depends on its neighbours.
pub(crate) const CAPITAL_SIGMA: u32 = 0x3A3;

/// One direction's mapping: the code points that map to something else, sorted, and what
/// each maps to (3 code points, 0 past the mapping's end).
#[derive(Debug)]
pub(crate) struct Mapping {
    pub(crate) keys: Vec<u32>,
    pub(crate) maps: Vec<u32>,
}

/// The tables of [`Case`]: upper and lower mappings of every code point beyond ASCII that
/// changes, and the alphanumeric code points beyond ASCII as sorted inclusive ranges
/// (start, end pairs).
#[derive(Debug)]
pub(crate) struct CaseTables {
    pub(crate) upper: Mapping,
    pub(crate) lower: Mapping,
    pub(crate) alphanumeric: Vec<u32>,
}

impl CaseTables {
    /// The tables, made once per process of Rust's mappings (every code point beyond
    /// ASCII; ASCII is the kernel's own arithmetic).
    pub(crate) fn get() -> &'static CaseTables {
        static TABLES: OnceLock<CaseTables> = OnceLock::new();
        TABLES.get_or_init(|| {
            let mapping = |map: fn(char) -> Vec<char>| {
                let (mut keys, mut maps) = (Vec::new(), Vec::new());
                for c in (0x80..=0x10FFFFu32).filter_map(char::from_u32) {
                    let to = map(c);
                    if to != [c] {
                        assert!(to.len() <= 3, "{c:?} maps to {to:?}");
                        keys.push(c as u32);
                        maps.extend((0..3).map(|i| to.get(i).map_or(0, |&t| t as u32)));
                    }
                }
                Mapping { keys, maps }
            };
            let mut alphanumeric: Vec<u32> = Vec::new();
            for c in (0x80..=0x10FFFFu32).filter_map(char::from_u32) {
                if !c.is_alphanumeric() {
                    continue;
                }
                let c = c as u32;
                match alphanumeric.last_mut() {
                    Some(end) if *end + 1 == c => *end = c,
                    _ => alphanumeric.extend([c, c]),
                }
            }
            CaseTables {
                upper: mapping(|c| c.to_uppercase().collect()),
                lower: mapping(|c| c.to_lowercase().collect()),
                alphanumeric,
            }
        })
    }

    /// `case` of `value` as `unicode_case_views` computes it; `None` for `lower` of a
    /// value with [`CAPITAL_SIGMA`] (the host's).
    pub(crate) fn apply(&self, case: Case, value: &str) -> Option<String> {
        let mut out = String::with_capacity(value.len());
        let mut after_alphanumeric = false;
        for c in value.chars() {
            let upper = match case {
                Case::Upper => true,
                Case::Lower => false,
                Case::Initcap => !after_alphanumeric,
            };
            let cp = c as u32;
            if case == Case::Lower && cp == CAPITAL_SIGMA {
                return None;
            }
            if c.is_ascii() {
                out.push(match upper {
                    true => c.to_ascii_uppercase(),
                    false => c.to_ascii_lowercase(),
                });
            } else {
                let mapping = if upper { &self.upper } else { &self.lower };
                match mapping.keys.binary_search(&cp) {
                    Ok(i) => out.extend(
                        mapping.maps[3 * i..3 * i + 3]
                            .iter()
                            .take_while(|&&m| m != 0)
                            .filter_map(|&m| char::from_u32(m)),
                    ),
                    Err(_) => out.push(c),
                }
            }
            after_alphanumeric = if c.is_ascii() {
                c.is_ascii_alphanumeric()
            } else {
                // The ranges that start at or before `cp` (`lo` of them), the last
                // holding it or not.
                let ranges = &self.alphanumeric;
                let (mut lo, mut hi) = (0, ranges.len() / 2);
                while lo < hi {
                    let mid = (lo + hi) / 2;
                    if ranges[2 * mid] <= cp {
                        lo = mid + 1;
                    } else {
                        hi = mid;
                    }
                }
                lo > 0 && cp <= ranges[2 * (lo - 1) + 1]
            };
        }
        Some(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tables give Rust's (DataFusion's) mappings: every code point's upper and
    /// lower case (`Σ` under lower left out), and `initcap`'s words by
    /// `char::is_alphanumeric`.
    #[test]
    fn tables_map_as_rust() {
        let tables = CaseTables::get();
        for c in (0..=0x10FFFFu32).filter_map(char::from_u32) {
            let value = c.to_string();
            assert_eq!(
                tables.apply(Case::Upper, &value),
                Some(value.to_uppercase()),
                "{c:?}"
            );
            if c as u32 != CAPITAL_SIGMA {
                assert_eq!(
                    tables.apply(Case::Lower, &value),
                    Some(value.to_lowercase()),
                    "{c:?}"
                );
            }
            // After an alphanumeric character, lower case; else upper.
            let pair = format!("{c}A");
            let want = if c.is_alphanumeric() { "a" } else { "A" };
            assert!(
                tables.apply(Case::Initcap, &pair).unwrap().ends_with(want),
                "{c:?}"
            );
        }
        // No mapping has more than three times its character's bytes (the device's
        // bound of the data).
        for mapping in [&tables.upper, &tables.lower] {
            for (i, &key) in mapping.keys.iter().enumerate() {
                let bytes: usize = mapping.maps[3 * i..3 * i + 3]
                    .iter()
                    .filter_map(|&m| char::from_u32(m).filter(|_| m != 0))
                    .map(char::len_utf8)
                    .sum();
                assert!(
                    bytes <= 3 * char::from_u32(key).unwrap().len_utf8(),
                    "{key:#x}"
                );
            }
        }
        assert_eq!(tables.apply(Case::Lower, "ΣΑΣ"), None);
        // DataFusion's initcap: upper case (not title case) after no alphanumeric.
        assert_eq!(
            tables.apply(Case::Initcap, "ǆemal ßtraße ﬁx 3ǆ").as_deref(),
            Some("Ǆemal SStraße FIx 3ǆ")
        );
    }
}
