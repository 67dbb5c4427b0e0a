//! Regular expressions on the device: a pattern made a table of transitions over byte
//! classes (a deterministic automaton, regex-automata's, the engine of the `regex` crate
//! that DataFusion matches with), walked byte by byte by each row. On CUDA `view_regex`
//! (`~`, `regexp_like`, `ILIKE`), `view_regex_count` (`regexp_count`),
//! `regex_replace_views` (`regexp_replace`) and `view_regex_instr` (`regexp_instr`); on
//! the CPU device [`RegexTable::is_match`], [`RegexTable::count`], [`RegexTable::replace`]
//! and [`RegexTable::instr`], the same walks.
//!
//! The automaton answers what the `regex` crate answers, with its syntax and defaults
//! (Unicode classes and case folding, UTF-8): whether a match starts anywhere in the value
//! (an unanchored search), where the leftmost-first match ends, and, by anchored searches
//! from each byte, where it starts. A Unicode word boundary (`\b`, `\B`) is
//! regex-automata's: an ASCII boundary, right while the walk reads ASCII bytes only, and
//! a state of kind [`QUIT`] at the first byte past ASCII (whose boundary would need the
//! character's class; so is a search that starts after such a byte): that row's answer is
//! the host's (the kernels set 8 in the error word, the twins answer [`Quit`]). An ASCII
//! boundary (`(?-u:\b)`) needs no such state. A table of more than [`MAX_TABLE_BYTES`]
//! is refused.

use regex_automata::dfa::{dense, Automaton, StartError, StartKind};
use regex_automata::util::{start, syntax};
use regex_automata::Anchored;

/// The most bytes a pattern's transitions may take (uploaded once per context and kept
/// there, up to 16 MiB of patterns; past that with each batch): about 1,000 states over
/// 256 classes.
pub(crate) const MAX_TABLE_BYTES: usize = 1 << 20;

/// A state's kind ([`RegexTable::kinds`]): a match was seen.
pub(crate) const MATCHED: u8 = 1;
/// A state's kind: no match can follow.
pub(crate) const DEAD: u8 = 2;
/// A state's kind: the automaton cannot tell (a Unicode word boundary by a byte past
/// ASCII): the row's answer is the host's. Every transition of the state leads to itself.
pub(crate) const QUIT: u8 = 3;

/// The automaton gave up on a value ([`QUIT`]): its answer is the host's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Quit;

/// A pattern's automaton as the device walks it: state 0 is the start (at the start of
/// the value); from state `s`, byte `b` leads to `next[s * stride + classes[b]]`, and the
/// end of the value to `next[s * stride + stride - 1]`. The value matches at the first
/// state of kind [`MATCHED`], and does not at one of kind [`DEAD`] or where the end leads
/// to no match; at one of kind [`QUIT`] the answer is the host's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RegexTable {
    /// The pattern as the `regex` crate compiles it (flags prefixed).
    pub(crate) pattern: String,
    /// Each byte's class.
    pub(crate) classes: Vec<u8>,
    /// The classes, and the end of the value.
    pub(crate) stride: u32,
    /// The transitions, `stride` a state.
    pub(crate) next: Vec<u32>,
    /// Each state's kind: 0, [`MATCHED`], [`DEAD`] or [`QUIT`].
    pub(crate) kinds: Vec<u8>,
    /// The start state of a search that begins after byte `b` (`starts[b]`), or at the
    /// start of the value (`starts[256]`, state 0): anchors, line ends and word boundaries
    /// look behind (after a byte past ASCII, a Unicode boundary's start is of kind
    /// [`QUIT`]).
    pub(crate) starts: Vec<u32>,
    /// The start state of a search anchored where it begins (`regexp_replace`'s tries),
    /// as [`RegexTable::starts`].
    pub(crate) anchored: Vec<u32>,
    /// Whether the pattern can match the empty string: its matches are then found by
    /// anchored searches from each byte, which give their starts (`regexp_count`'s
    /// unanchored walk cannot step past an empty match), and `regexp_replace`'s output
    /// may hold a replacement per character.
    pub(crate) matches_empty: bool,
}

impl RegexTable {
    /// The table of `pattern` (flags as `regex` reads them: `(?i)` prefixed for a
    /// case-insensitive match), or why it has none on the device.
    pub(crate) fn compile(pattern: &str) -> Result<Self, String> {
        let hir = syntax::parse(pattern).map_err(|e| format!("the pattern: {e}"))?;
        let dfa = dense::Builder::new()
            .configure(
                dense::Config::new()
                    .start_kind(StartKind::Both)
                    // Bytes past ASCII quit a Unicode word boundary's automaton.
                    .unicode_word_boundary(true)
                    .dfa_size_limit(Some(4 * MAX_TABLE_BYTES))
                    .determinize_size_limit(Some(4 * MAX_TABLE_BYTES)),
            )
            .build(pattern)
            .map_err(|e| format!("no automaton for the device: {e}"))?;
        // The start of the value first (state 0), then after each byte; unanchored, then
        // anchored. `None`: the automaton quits (after a quit byte).
        let start_after = |anchored: Anchored, behind: Option<u8>| match dfa
            .start_state(&start::Config::new().anchored(anchored).look_behind(behind))
        {
            Ok(state) => Ok(Some(state)),
            Err(StartError::Quit { .. }) => Ok(None),
            Err(e) => Err(format!("no start state: {e}")),
        };
        let start = start_after(Anchored::No, None)?.ok_or("no start state")?;
        let mut behind = Vec::with_capacity(2 * 257);
        for anchored in [Anchored::No, Anchored::Yes] {
            for b in 0..=255u8 {
                behind.push(start_after(anchored, Some(b))?);
            }
            if anchored == Anchored::Yes {
                behind.push(start_after(anchored, None)?);
            }
        }
        let byte_classes = dfa.byte_classes();
        let classes: Vec<u8> = (0..=255u8).map(|b| byte_classes.get(b)).collect();
        let eoi = byte_classes.alphabet_len() - 1;
        let stride = eoi + 1;
        // One byte of each class.
        let mut representatives = vec![0u8; eoi];
        for b in (0..=255u8).rev() {
            representatives[usize::from(classes[usize::from(b)])] = b;
        }
        // The states reachable from the start, numbered in the order they are found (every
        // quit state, and a start that quits, as one: `None`).
        let quits = |state: Option<_>| state.filter(|&s| !dfa.is_quit_state(s));
        let mut ids = std::collections::HashMap::new();
        let mut order = vec![Some(start)];
        ids.insert(Some(start), 0u32);
        for &state in &behind {
            if let std::collections::hash_map::Entry::Vacant(slot) = ids.entry(quits(state)) {
                slot.insert(order.len() as u32);
                order.push(quits(state));
            }
        }
        let (mut next, mut kinds) = (Vec::new(), Vec::new());
        let mut at = 0;
        while at < order.len() {
            let Some(state) = order[at] else {
                kinds.push(QUIT);
                next.extend(std::iter::repeat_n(at as u32, stride));
                at += 1;
                continue;
            };
            at += 1;
            kinds.push(if dfa.is_match_state(state) {
                MATCHED
            } else if dfa.is_dead_state(state) {
                DEAD
            } else {
                0
            });
            let targets = representatives
                .iter()
                .map(|&b| dfa.next_state(state, b))
                .chain([dfa.next_eoi_state(state)]);
            for target in targets {
                let target = quits(Some(target));
                let id = match ids.get(&target) {
                    Some(&id) => id,
                    None => {
                        let id = u32::try_from(order.len()).map_err(|_| "too many states")?;
                        ids.insert(target, id);
                        order.push(target);
                        id
                    }
                };
                next.push(id);
            }
            if 4 * next.len() > MAX_TABLE_BYTES {
                return Err(format!(
                    "an automaton of more than {MAX_TABLE_BYTES} bytes has no device kernel"
                ));
            }
        }
        let mut starts: Vec<u32> = behind.iter().map(|&state| ids[&quits(state)]).collect();
        let anchored = starts.split_off(256);
        starts.push(0);
        Ok(Self {
            pattern: pattern.to_string(),
            classes,
            stride: stride as u32,
            next,
            kinds,
            starts,
            anchored,
            matches_empty: hir.properties().minimum_len() == Some(0),
        })
    }

    /// The end of the leftmost-first match a search from byte `from` of `value` finds, if
    /// any, from the start state `starts` gives for the byte behind it (`starts[256]` at
    /// the value's start): [`RegexTable::starts`] for an unanchored search (`regexp_count`),
    /// [`RegexTable::anchored`] for one that must start at `from` (`regexp_replace`'s and
    /// `regexp_instr`'s tries). Each byte's transition: at a state of kind [`MATCHED`] a
    /// match ends before that byte (the automaton's matches are delayed by one byte), and
    /// the walk goes on until a dead state or the end of the value (whose transition may
    /// match too), for the longest match of the preferred pattern. [`Quit`] at a state of
    /// kind [`QUIT`].
    fn match_end(&self, value: &[u8], from: usize, starts: &[u32]) -> Result<Option<usize>, Quit> {
        let stride = self.stride as usize;
        let behind = if from == 0 {
            256
        } else {
            usize::from(value[from - 1])
        };
        let mut state = starts[behind] as usize;
        let mut end = None;
        for (at, &byte) in value.iter().enumerate().skip(from) {
            let class = usize::from(self.classes[usize::from(byte)]);
            state = self.next[state * stride + class] as usize;
            match self.kinds[state] {
                MATCHED => end = Some(at),
                DEAD => return Ok(end),
                QUIT => return Err(Quit),
                _ => {}
            }
        }
        state = self.next[state * stride + stride - 1] as usize;
        match self.kinds[state] {
            MATCHED => end = Some(value.len()),
            QUIT => return Err(Quit),
            _ => {}
        }
        Ok(end)
    }

    /// `value` with its matches (the first, or every one with `global`) replaced by
    /// `replacement`, as `Regex::replacen` makes it for a replacement of no group: the
    /// matches of [`RegexTable::find_each`]. [`Quit`]: the host's.
    pub(crate) fn replace(
        &self,
        value: &[u8],
        replacement: &[u8],
        global: bool,
    ) -> Result<Vec<u8>, Quit> {
        let mut out = Vec::with_capacity(value.len());
        let mut kept = 0;
        self.find_each(value, |start, end| {
            out.extend_from_slice(&value[kept..start]);
            out.extend_from_slice(replacement);
            kept = end;
            global
        })?;
        out.extend_from_slice(&value[kept..]);
        Ok(out)
    }

    /// The matches of `value`, one after the other, as `Regex::find_iter` yields them,
    /// each given to `each` (its start and end) until it answers false: from the previous
    /// match's end, the first byte where an anchored search matches, ending where that
    /// search's leftmost-first match ends. An empty match counts only at a character's
    /// start (UTF-8), and not at the previous match's end (the search goes on from the
    /// next byte); the end of the value is a place to match too. [`Quit`]: the host's.
    pub(crate) fn find_each(
        &self,
        value: &[u8],
        mut each: impl FnMut(usize, usize) -> bool,
    ) -> Result<(), Quit> {
        let mut last_end = None;
        while let Some((start, end)) = self.next_match(value, last_end)? {
            if !each(start, end) {
                break;
            }
            last_end = Some(end);
        }
        Ok(())
    }

    /// The match [`RegexTable::find_each`] takes after one that ended at `last_end` (from
    /// the value's start when `None`).
    fn next_match(
        &self,
        value: &[u8],
        last_end: Option<usize>,
    ) -> Result<Option<(usize, usize)>, Quit> {
        for start in last_end.unwrap_or(0)..=value.len() {
            let Some(end) = self.match_end(value, start, &self.anchored)? else {
                continue;
            };
            let taken = end > start
                || (Some(start) != last_end && value.get(start).is_none_or(|b| b & 0xC0 != 0x80));
            if taken {
                return Ok(Some((start, end)));
            }
        }
        Ok(None)
    }

    /// The byte where character `skip` of `value` starts (0-based; the value's length
    /// for `skip` its character count), `None` past that: as DataFusion's
    /// `start_to_byte_offset` (for a start `skip + 1`).
    pub(crate) fn char_start(value: &[u8], skip: u64) -> Option<usize> {
        (0..value.len())
            .filter(|&i| value[i] & 0xC0 != 0x80)
            .chain([value.len()])
            .nth(usize::try_from(skip).ok()?)
    }

    /// `regexp_instr`'s answer: the 1-based character position in `value` of the start of
    /// the `nth` match (1 the first) of the value from its character `skip` on (that
    /// rest a haystack of its own), one after the other, or 0 where there is none; as
    /// `view_regex_instr` finds it. [`Quit`]: the host's.
    pub(crate) fn instr(&self, value: &[u8], skip: u64, nth: u64) -> Result<i64, Quit> {
        let Some(from) = Self::char_start(value, skip) else {
            return Ok(0);
        };
        let (mut found, mut position) = (0, 0);
        self.find_each(&value[from..], |start, _| {
            found += 1;
            if found == nth {
                position = Self::chars(&value[..from + start]) + 1;
            }
            found != nth
        })?;
        Ok(position)
    }

    /// How many matches `value` holds from its character `skip` on (that rest a haystack
    /// of its own; none past its end), as `Regex::find_iter` counts them: for a pattern
    /// that cannot match the empty string, each unanchored search from the previous
    /// match's end ([`RegexTable::match_end`], as `view_regex_count` walks it); else
    /// [`RegexTable::find_each`]'s (as `view_regex_instr` counts them). [`Quit`]: the
    /// host's.
    pub(crate) fn count(&self, value: &[u8], skip: u64) -> Result<i64, Quit> {
        let Some(from) = Self::char_start(value, skip) else {
            return Ok(0);
        };
        let value = &value[from..];
        let mut count = 0;
        if self.matches_empty {
            self.find_each(value, |_, _| {
                count += 1;
                true
            })?;
            return Ok(count);
        }
        let mut from = 0;
        while from < value.len() {
            match self.match_end(value, from, &self.starts)? {
                Some(end) if end > from => {
                    count += 1;
                    from = end;
                }
                _ => break,
            }
        }
        Ok(count)
    }

    /// The characters of `value` (its bytes that start one).
    fn chars(value: &[u8]) -> i64 {
        value.iter().filter(|&&b| b & 0xC0 != 0x80).count() as i64
    }

    /// Whether `value` holds a match, walking the table as `view_regex` does. [`Quit`]:
    /// the host's.
    pub(crate) fn is_match(&self, value: &[u8]) -> Result<bool, Quit> {
        let stride = self.stride as usize;
        let mut state = 0usize;
        for &b in value {
            match self.kinds[state] {
                0 => {}
                QUIT => return Err(Quit),
                kind => return Ok(kind == MATCHED),
            }
            state = self.next[state * stride + usize::from(self.classes[usize::from(b)])] as usize;
        }
        if self.kinds[state] == 0 {
            state = self.next[state * stride + stride - 1] as usize;
        }
        match self.kinds[state] {
            QUIT => Err(Quit),
            kind => Ok(kind == MATCHED),
        }
    }
}

/// The regular expression arrow's `ilike` matches a `LIKE` pattern with (case-insensitive,
/// `.` matching a newline too: `(?is)` prefixed): `%` as `.*` (none at the start or the
/// end), `_` as `.`, `\\` the next character literally (a trailing `\\` itself), the
/// `regex` crate's meta characters escaped.
pub(crate) fn ilike_pattern(pattern: &str) -> String {
    let meta = |c: char| "\\.+*?()|[]{}^$#&-~".contains(c);
    let mut result = String::from("(?is)");
    let mut chars = pattern.chars().peekable();
    if chars.peek() == Some(&'%') {
        chars.next();
    } else {
        result.push('^');
    }
    while let Some(c) = chars.next() {
        match c {
            '\\' => match chars.next() {
                Some(next) => {
                    if meta(next) {
                        result.push('\\');
                    }
                    result.push(next);
                }
                None => result.push_str("\\\\"),
            },
            '%' => result.push_str(".*"),
            '_' => result.push('.'),
            c => {
                if meta(c) {
                    result.push('\\');
                }
                result.push(c);
            }
        }
    }
    if result.ends_with(".*") {
        result.truncate(result.len() - 2);
    } else {
        result.push('$');
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The table's answer where it gives one: a Unicode word boundary's automaton gives
    /// up ([`Quit`]) on a value past ASCII only; any other answers.
    fn answered<T>(answer: Result<T, Quit>, pattern: &str, value: &str) -> Option<T> {
        let unicode_boundary = pattern.contains("\\b") || pattern.contains("\\B");
        match answer {
            Ok(answer) => Some(answer),
            Err(Quit) => {
                assert!(
                    unicode_boundary && !pattern.contains("(?-u") && !value.is_ascii(),
                    "{pattern:?} gave up on {value:?}"
                );
                None
            }
        }
    }

    /// The table's replacements in `value` (the first match, then every one) are
    /// `Regex::replacen`'s, where it answers.
    fn assert_replaces_as_regex(
        table: &RegexTable,
        regex: &regex::Regex,
        pattern: &str,
        value: &str,
    ) {
        for (global, limit) in [(false, 1), (true, 0)] {
            let replaced = table.replace(value.as_bytes(), b"<$>", global);
            if let Some(replaced) = answered(replaced, pattern, value) {
                assert_eq!(
                    replaced,
                    regex.replacen(value, limit, "<$$>").as_bytes(),
                    "{pattern:?} in {value:?}, global {global}"
                );
            }
        }
    }

    /// The table answers as `Regex::is_match` (DataFusion's) on values of one to four
    /// bytes a character, with anchors, classes, alternations, repetitions, case folding
    /// and word boundaries (a Unicode one's answer, on a value past ASCII, may be the
    /// host's).
    #[test]
    fn tables_match_as_the_regex_crate() {
        let values = [
            "",
            "a",
            "ab",
            "ba",
            "abc",
            "ÄBC",
            "äbc",
            "x🦀y",
            "🦀",
            "é",
            "E",
            "line\nnext",
            "aaab",
            "0123",
            "Customer Complaints",
            "ab ab",
            "a_b-ab",
            "éab",
            "ab é",
            "x ab🦀",
        ];
        for pattern in [
            "",
            "a",
            "^a",
            "a$",
            "^$",
            "b+",
            "a.c",
            "(?i)äb",
            "(?i)CUSTOMER",
            "[0-9]{2}",
            "\\d",
            "\\w+\\s",
            "🦀|é",
            "^.$",
            "(?s)e.n",
            "(?m)^next",
            "a*b",
            "[^a]",
            "\\p{Greek}",
            "(ab|ba)+c?",
            "\\bab\\b",
            "\\Bb",
            "b\\b",
            "\\b",
            "(?-u:\\b)ab(?-u:\\b)",
            "(?-u:\\B)b",
        ] {
            let table = RegexTable::compile(pattern).unwrap();
            let regex = regex::Regex::new(pattern).unwrap();
            for value in values {
                if let Some(m) = answered(table.is_match(value.as_bytes()), pattern, value) {
                    assert_eq!(m, regex.is_match(value), "{pattern:?} on {value:?}");
                }
            }
        }
        // The ASCII values all answered; "éab" by an automaton that gives up.
        let boundary = RegexTable::compile("\\bab").unwrap();
        assert_eq!(boundary.is_match(b"x ab"), Ok(true));
        assert_eq!(boundary.is_match(b"xab"), Ok(false));
        assert_eq!(boundary.is_match("éab".as_bytes()), Err(Quit));
        assert_eq!(
            boundary.is_match("ab é".as_bytes()),
            Ok(true),
            "matched first"
        );
        // Counts as `find_iter`'s, for patterns that match no empty string.
        for pattern in [
            "a",
            "ab",
            "a+",
            "[ab]",
            "b|ab",
            "(?i)ä",
            "^a",
            "a$",
            "(?m)^x",
            "\\d+",
            ".b",
            "(?s).",
            "🦀+",
            "aa|a",
            "\\ba",
            "b\\b",
            "\\Bb",
            "(?-u:\\b)a",
        ] {
            let table = RegexTable::compile(pattern).unwrap();
            assert!(!table.matches_empty, "{pattern}");
            let regex = regex::Regex::new(pattern).unwrap();
            for value in values
                .iter()
                .chain(&["aaaa", "abab", "x\nx\nx", "aab🦀🦀b", "12 34"])
            {
                if let Some(count) = answered(table.count(value.as_bytes(), 0), pattern, value) {
                    let want = regex.find_iter(value).count() as i64;
                    assert_eq!(count, want, "{pattern:?} in {value:?}");
                }
            }
        }
        assert!(RegexTable::compile("a*").unwrap().matches_empty);
        // Patterns that match the empty string: counted, found and replaced as
        // `find_iter` yields their matches (an empty one at each character's start, not
        // at the previous match's end, and at the value's end), from each start
        // character, the value's end included.
        for pattern in [
            "",
            "a*",
            "a*?",
            "b?",
            "ab|",
            "^",
            "$",
            "(?m)^",
            "(?m)$",
            "é*",
            "🦀?",
            "\\b",
            "\\B",
            "(?-u:\\b)",
            "x*|a",
        ] {
            let table = RegexTable::compile(pattern).unwrap();
            assert!(table.matches_empty, "{pattern}");
            let regex = regex::Regex::new(pattern).unwrap();
            for value in values
                .iter()
                .chain(&["aaaa", "abab", "aab🦀é🦀b", "éaéb", "x\nx"])
            {
                for skip in 0..=value.chars().count() as u64 + 1 {
                    let Some(from) = RegexTable::char_start(value.as_bytes(), skip) else {
                        assert_eq!(skip, value.chars().count() as u64 + 1);
                        assert_eq!(table.count(value.as_bytes(), skip), Ok(0));
                        continue;
                    };
                    let rest = &value[from..];
                    let found = answered(table.count(value.as_bytes(), skip), pattern, value);
                    if let Some(count) = found {
                        let want = regex.find_iter(rest).count() as i64;
                        assert_eq!(count, want, "{pattern:?} in {value:?} from {skip}");
                    }
                    for nth in [1, 2, 3] {
                        let want = regex
                            .find_iter(rest)
                            .nth(nth as usize - 1)
                            .map_or(0, |m| value[..from + m.start()].chars().count() as i64 + 1);
                        let found = table.instr(value.as_bytes(), skip, nth);
                        if let Some(found) = answered(found, pattern, value) {
                            assert_eq!(found, want, "{pattern:?} in {value:?} from {skip}, {nth}");
                        }
                    }
                }
                assert_replaces_as_regex(&table, &regex, pattern, value);
            }
        }
        // Positions as DataFusion's `regexp_instr` (the nth match's start, in characters).
        for pattern in [
            "a", "ab|a", "a+", "^a", "a$", "🦀|é", "[^a]", "b", "\\ba", "\\Bb",
        ] {
            let table = RegexTable::compile(pattern).unwrap();
            let regex = regex::Regex::new(pattern).unwrap();
            for value in values.iter().chain(&["aaaa", "abab", "aab🦀é🦀b", "éaéb"]) {
                for (skip, nth) in [(0, 1), (0, 2), (1, 1), (2, 3), (9, 1)] {
                    let chars: Vec<(usize, char)> = value.char_indices().collect();
                    let want = match chars.get(skip as usize) {
                        Some(&(from, _)) => regex
                            .find_iter(&value[from..])
                            .nth(nth as usize - 1)
                            .map_or(0, |m| value[..from + m.start()].chars().count() as i64 + 1),
                        None => 0,
                    };
                    let found = table.instr(value.as_bytes(), skip, nth);
                    if let Some(found) = answered(found, pattern, value) {
                        assert_eq!(
                            found, want,
                            "{pattern:?} in {value:?} from {skip}, match {nth}"
                        );
                    }
                }
            }
        }
        // Replacements as `Regex::replacen`'s (the first match, or all).
        for pattern in [
            "a", "ab|a", "a+", "^a", "a$", "(?m)^x", "\\d+", "🦀|é", "[^a]", "\\ba\\w*", "b\\b",
        ] {
            let table = RegexTable::compile(pattern).unwrap();
            let regex = regex::Regex::new(pattern).unwrap();
            for value in values
                .iter()
                .chain(&["aaaa", "abab", "x\nx\nx", "aab🦀é🦀b", "12 34"])
            {
                assert_replaces_as_regex(&table, &regex, pattern, value);
            }
        }
        assert!(RegexTable::compile("(").is_err());
    }
}
