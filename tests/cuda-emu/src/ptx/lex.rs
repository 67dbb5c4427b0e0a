//! The PTX tokenizer: identifiers (dotted names, `%` registers, `$` labels), numbers,
//! strings and punctuation, with comments removed and 1-based line numbers kept.

use super::types::ParseError;

/// What a token is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// A name: `ld.global.u32`, `%rd1`, `.reg`, `LG_LOOP`, `$L__BB0_1`, `L1::evict_last`.
    Ident,
    /// A number literal (decimal, hex, octal, binary, `0f`/`0d` floats).
    Num,
    /// A string literal (only skipped: `.file`, `.pragma`).
    Str,
    /// One punctuation character.
    Punct(u8),
}

/// One token.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Token<'a> {
    pub kind: Kind,
    pub text: &'a str,
    pub line: usize,
    /// Byte offset in the source.
    pub start: usize,
}

impl Token<'_> {
    pub fn is_punct(&self, c: u8) -> bool {
        self.kind == Kind::Punct(c)
    }
}

fn ident_start(c: u8) -> bool {
    c.is_ascii_alphabetic() || matches!(c, b'_' | b'$' | b'%' | b'.')
}

fn ident_continue(c: u8) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, b'_' | b'$' | b'%' | b'.')
}

/// Splits `src` into tokens.
pub(crate) fn lex(src: &str) -> Result<Vec<Token<'_>>, ParseError> {
    let b = src.as_bytes();
    let mut toks = Vec::new();
    let mut i = 0;
    let mut line = 1;
    while i < b.len() {
        let c = b[i];
        if c == b'\n' {
            line += 1;
            i += 1;
        } else if c.is_ascii_whitespace() {
            i += 1;
        } else if c == b'/' && b.get(i + 1) == Some(&b'/') {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if c == b'/' && b.get(i + 1) == Some(&b'*') {
            let start_line = line;
            i += 2;
            loop {
                if i + 1 >= b.len() {
                    return Err(ParseError {
                        line: start_line,
                        message: "unterminated /* comment".into(),
                    });
                }
                if b[i] == b'*' && b[i + 1] == b'/' {
                    i += 2;
                    break;
                }
                if b[i] == b'\n' {
                    line += 1;
                }
                i += 1;
            }
        } else if c == b'"' {
            let start = i;
            i += 1;
            while i < b.len() && b[i] != b'"' {
                if b[i] == b'\n' {
                    return Err(ParseError {
                        line,
                        message: "unterminated string".into(),
                    });
                }
                i += 1;
            }
            if i >= b.len() {
                return Err(ParseError {
                    line,
                    message: "unterminated string".into(),
                });
            }
            i += 1;
            toks.push(Token {
                kind: Kind::Str,
                text: &src[start..i],
                line,
                start,
            });
        } else if ident_start(c) {
            let start = i;
            i += 1;
            loop {
                if i < b.len() && ident_continue(b[i]) {
                    i += 1;
                } else if i + 2 < b.len()
                    && b[i] == b':'
                    && b[i + 1] == b':'
                    && ident_continue(b[i + 2])
                {
                    // cache-eviction qualifiers such as `L1::evict_last`
                    i += 2;
                } else {
                    break;
                }
            }
            toks.push(Token {
                kind: Kind::Ident,
                text: &src[start..i],
                line,
                start,
            });
        } else if c.is_ascii_digit() {
            let start = i;
            while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'.' || b[i] == b'_') {
                i += 1;
            }
            toks.push(Token {
                kind: Kind::Num,
                text: &src[start..i],
                line,
                start,
            });
        } else if b"(){}[],;:+-<>@!|=*".contains(&c) {
            toks.push(Token {
                kind: Kind::Punct(c),
                text: &src[i..i + 1],
                line,
                start: i,
            });
            i += 1;
        } else {
            let ch = src[i..].chars().next().unwrap_or('?');
            return Err(ParseError {
                line,
                message: format!("unexpected character {ch:?}"),
            });
        }
    }
    Ok(toks)
}

/// Parses an integer literal the way PTX writes them (`0x` hex, `0b` binary, leading-0
/// octal, decimal, optional `U` suffix) or a `0f`/`0d` hexadecimal float (raw bits).
pub(crate) fn parse_int(text: &str) -> Option<u64> {
    let t = text.strip_suffix(['U', 'u']).unwrap_or(text);
    let (digits, radix) = if let Some(h) = t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")) {
        (h, 16)
    } else if let Some(h) = t.strip_prefix("0f").or_else(|| t.strip_prefix("0F")) {
        if h.len() != 8 {
            return None;
        }
        (h, 16)
    } else if let Some(h) = t.strip_prefix("0d").or_else(|| t.strip_prefix("0D")) {
        if h.len() != 16 {
            return None;
        }
        (h, 16)
    } else if let Some(h) = t.strip_prefix("0b").or_else(|| t.strip_prefix("0B")) {
        (h, 2)
    } else if t.len() > 1 && t.starts_with('0') {
        (&t[1..], 8)
    } else {
        (t, 10)
    };
    if digits.is_empty() {
        return None;
    }
    u64::from_str_radix(digits, radix).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn literals() {
        assert_eq!(parse_int("0"), Some(0));
        assert_eq!(parse_int("42"), Some(42));
        assert_eq!(parse_int("0x00204081"), Some(0x0020_4081));
        assert_eq!(parse_int("010"), Some(8));
        assert_eq!(parse_int("0b101"), Some(5));
        assert_eq!(parse_int("7U"), Some(7));
        assert_eq!(parse_int("0f3F800000"), Some(0x3F80_0000));
        assert_eq!(parse_int("1.5"), None);
        assert_eq!(parse_int("09"), None);
        assert_eq!(parse_int("0x"), None);
    }

    #[test]
    fn tokens_and_lines() {
        let t = lex("// c\n/* a\nb */ ld.global.u8 %r3, [%rd5+-4]; L1::evict_last\n").unwrap();
        let texts: Vec<&str> = t.iter().map(|t| t.text).collect();
        assert_eq!(
            texts,
            [
                "ld.global.u8",
                "%r3",
                ",",
                "[",
                "%rd5",
                "+",
                "-",
                "4",
                "]",
                ";",
                "L1::evict_last"
            ]
        );
        assert_eq!(t[0].line, 3);
        assert!(lex("/* open").is_err());
        assert!(lex("a # b").is_err());
    }
}
