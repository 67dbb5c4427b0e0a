//! Unicode's case mappings on the device: `upper`, `lower` and `initcap` as DataFusion
//! computes them (Rust's `char::to_uppercase` and `char::to_lowercase`, and
//! `char::is_alphanumeric` for `initcap`'s words), as tables made once of Rust's own
//! mappings, walked by `unicode_case_views` on CUDA and by [`CaseTables::apply`] on the
//! CPU device.
//!
//! `str::to_lowercase` maps `Σ` (U+03A3) by the characters around it: `ς` where a cased
//! character comes before it and none after (skipping case-ignorable ones both ways),
//! `σ` elsewhere. Rust does not expose those two Unicode properties, so the tables
//! derive them from `str::to_lowercase` itself: `c` is cased (and not case-ignorable)
//! where `cΣ` ends in `ς`, and case-ignorable where `AcΣ` does but `cΣ` does not.

use std::sync::OnceLock;

use super::expr::Case;

/// The capital sigma, whose lower case depends on its neighbours.
pub(crate) const CAPITAL_SIGMA: u32 = 0x3A3;
/// Its lower case at a word's end, and elsewhere.
const FINAL_SIGMA: char = 'ς';
const SMALL_SIGMA: char = 'σ';

/// One direction's mapping: the code points that map to something else, sorted, and what
/// each maps to (3 code points, 0 past the mapping's end).
#[derive(Debug)]
pub(crate) struct Mapping {
    pub(crate) keys: Vec<u32>,
    pub(crate) maps: Vec<u32>,
}

/// The tables of [`Case`]: upper and lower mappings of every code point beyond ASCII that
/// changes, and as sorted inclusive ranges (start, end pairs): the alphanumeric code
/// points beyond ASCII, and for `Σ`'s lower case, the case-ignorable code points and the
/// cased ones that are not case-ignorable.
#[derive(Debug)]
pub(crate) struct CaseTables {
    pub(crate) upper: Mapping,
    pub(crate) lower: Mapping,
    pub(crate) alphanumeric: Vec<u32>,
    pub(crate) ignorable: Vec<u32>,
    pub(crate) cased: Vec<u32>,
}

/// The code points of `first..=0x10FFFF` for which `keep` holds, as sorted inclusive
/// ranges (start, end pairs).
fn ranges_of(first: u32, keep: impl Fn(char) -> bool) -> Vec<u32> {
    let mut ranges: Vec<u32> = Vec::new();
    for c in (first..=0x10FFFFu32).filter_map(char::from_u32) {
        if !keep(c) {
            continue;
        }
        let c = c as u32;
        match ranges.last_mut() {
            Some(end) if *end + 1 == c => *end = c,
            _ => ranges.extend([c, c]),
        }
    }
    ranges
}

/// Whether `cp` lies in `ranges` ([`ranges_of`]'s): a binary search for the ranges that
/// start at or before it (`lo` of them), the last holding it or not.
fn in_ranges(ranges: &[u32], cp: u32) -> bool {
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
            // `Σ` final after `c` alone: cased, not case-ignorable; after `A` then `c`:
            // either that or case-ignorable.
            let ends_final = |s: String| s.to_lowercase().ends_with(FINAL_SIGMA);
            let cased = |c: char| ends_final(format!("{c}Σ"));
            CaseTables {
                upper: mapping(|c| c.to_uppercase().collect()),
                lower: mapping(|c| c.to_lowercase().collect()),
                alphanumeric: ranges_of(0x80, char::is_alphanumeric),
                ignorable: ranges_of(0, |c| !cased(c) && ends_final(format!("A{c}Σ"))),
                cased: ranges_of(0, cased),
            }
        })
    }

    /// `case` of `value` as `unicode_case_views` computes it.
    pub(crate) fn apply(&self, case: Case, value: &str) -> String {
        let mut out = String::with_capacity(value.len());
        let mut after_alphanumeric = false;
        let mut rest = value;
        while let Some(c) = rest.chars().next() {
            rest = &rest[c.len_utf8()..];
            let upper = match case {
                Case::Upper => true,
                Case::Lower => false,
                Case::Initcap => !after_alphanumeric,
            };
            let cp = c as u32;
            if case == Case::Lower && cp == CAPITAL_SIGMA {
                let at = value.len() - rest.len() - c.len_utf8();
                out.push(if self.final_sigma(value, at) {
                    FINAL_SIGMA
                } else {
                    SMALL_SIGMA
                });
                continue;
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
                in_ranges(&self.alphanumeric, cp)
            };
        }
        out
    }

    /// Whether the `Σ` at byte `at` of `value` ends a word: a cased character before it
    /// and none after, skipping case-ignorable ones both ways (Rust's rule).
    fn final_sigma(&self, value: &str, at: usize) -> bool {
        let cased_first = |mut chars: std::iter::Rev<std::str::Chars<'_>>| {
            chars
                .find(|&c| !in_ranges(&self.ignorable, c as u32))
                .is_some_and(|c| in_ranges(&self.cased, c as u32))
        };
        let cased_next = |mut chars: std::str::Chars<'_>| {
            chars
                .find(|&c| !in_ranges(&self.ignorable, c as u32))
                .is_some_and(|c| in_ranges(&self.cased, c as u32))
        };
        let before = cased_first(value[..at].chars().rev());
        let after = cased_next(value[at + 2..].chars());
        before && !after
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tables give Rust's (DataFusion's) mappings: every code point's upper and
    /// lower case, and `initcap`'s words by `char::is_alphanumeric`; `Σ`'s lower case by
    /// its neighbours, on random strings of cased, case-ignorable and other characters.
    #[test]
    fn tables_map_as_rust() {
        let tables = CaseTables::get();
        for c in (0..=0x10FFFFu32).filter_map(char::from_u32) {
            let value = c.to_string();
            assert_eq!(
                tables.apply(Case::Upper, &value),
                value.to_uppercase(),
                "{c:?}"
            );
            assert_eq!(
                tables.apply(Case::Lower, &value),
                value.to_lowercase(),
                "{c:?}"
            );
            // After an alphanumeric character, lower case; else upper.
            let pair = format!("{c}A");
            let want = if c.is_alphanumeric() { "a" } else { "A" };
            assert!(tables.apply(Case::Initcap, &pair).ends_with(want), "{c:?}");
        }
        // DataFusion's initcap: upper case (not title case) after no alphanumeric.
        assert_eq!(
            tables.apply(Case::Initcap, "ǆemal ßtraße ﬁx 3ǆ"),
            "Ǆemal SStraße FIx 3ǆ"
        );
        // Σ among letters, marks and apostrophes (case-ignorable), modifier letters (both
        // cased and case-ignorable), digits, spaces and other scripts.
        let alphabet = [
            'Σ', 'Σ', 'Α', 'a', '\u{301}', '\'', '.', ':', 'ʰ', '1', ' ', '-', '字', 'Ⓐ', '\u{345}',
        ];
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        for _ in 0..20_000 {
            let mut value = String::new();
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            for k in 0..(x % 7) {
                value.push(alphabet[((x >> (8 + 4 * k)) % alphabet.len() as u64) as usize]);
            }
            assert_eq!(
                tables.apply(Case::Lower, &value),
                value.to_lowercase(),
                "{value:?}"
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
    }
}
