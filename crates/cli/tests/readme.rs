//! The README's sample output and option table cannot drift from the job:
//!
//! - the block between `<!-- sample-output: begin -->` and `<!-- sample-output: end -->`
//!   starts with the command (`$ cargo run --release -- ARGS`); the test runs the
//!   binary with those arguments (on the CPU device, so they say `--device cpu`) and
//!   compares its shape with the block: every line, label, column and count, with the
//!   figures that vary from run to run (times, GB/s, percentages, the commit) masked,
//!   and the build profile too (`cargo test` runs a debug build);
//! - the sample comes from a release build: its `build:` line says `release` (a debug
//!   build's figures are not representative);
//! - the option table lists exactly the options of `devarrow --help`.
//!
//! To regenerate the block (numbers from a release build, as the README says; the test
//! refuses to write a debug build's):
//!
//! ```sh
//! UPDATE_README=1 cargo test --release -p devarrow-cli --test readme
//! ```

use std::path::PathBuf;
use std::process::Command;

const BEGIN: &str = "<!-- sample-output: begin -->";
const END: &str = "<!-- sample-output: end -->";
const PROMPT: &str = "$ cargo run --release -- ";
/// The line of a release build's report that names its build profile.
const RELEASE: &str = "build:   release";

/// The package's directory as cargo runs this test, else as it built it: a test binary
/// reused from a shared target directory, built in another checkout, keeps that
/// checkout's path in `env!`.
fn manifest_dir() -> PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")))
}

fn readme_path() -> PathBuf {
    manifest_dir().join("../../README.md")
}

fn readme() -> String {
    std::fs::read_to_string(readme_path()).expect("README.md at the top of the workspace")
}

/// The sample block's lines (inside its ```text fence), and where they lie in `readme`.
fn sample_block(readme: &str) -> (Vec<&str>, std::ops::Range<usize>) {
    let begin = readme
        .find(BEGIN)
        .expect("README has a sample-output block")
        + BEGIN.len();
    let end = readme[begin..].find(END).expect("the block ends") + begin;
    let block = &readme[begin..end];
    let open = block.find("```text\n").expect("a ```text fence") + "```text\n".len();
    let close = block[open..].find("```").expect("the fence closes") + open;
    let lines = block[open..close].lines().collect();
    (lines, begin + open..begin + close)
}

/// Runs the binary with `args`: stderr's lines, then stdout's (what a terminal shows:
/// the report is printed at the end).
fn run(args: &[&str]) -> Vec<String> {
    let out = Command::new(env!("CARGO_BIN_EXE_devarrow"))
        .args(args)
        .output()
        .expect("the devarrow binary runs");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    assert!(
        out.status.success(),
        "devarrow {args:?} failed:\n{stderr}\n{stdout}"
    );
    stderr
        .lines()
        .chain(stdout.lines())
        .map(str::to_string)
        .collect()
}

/// A line with what varies between runs masked: numbers with a decimal point (and the
/// unit of a duration after one) become `#`, the commit `<commit>`, the reason on the
/// device line goes, and runs of spaces (column widths) become one.
fn shape(line: &str) -> String {
    if line.starts_with("build:") {
        return "build: <profile>".to_string();
    }
    let line = match line.find("(commit ") {
        Some(i) => {
            let rest = &line[i + "(commit ".len()..];
            let hash_end = rest.find(')').unwrap_or(rest.len());
            format!("{}(commit <commit>{}", &line[..i], &rest[hash_end..])
        }
        None => line.to_string(),
    };
    let line = match (line.strip_prefix("device:"), line.find(" (")) {
        (Some(_), Some(i)) => line[..i].to_string(),
        _ => line,
    };
    let mut out = String::with_capacity(line.len());
    let chars: Vec<char> = line.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        if !chars[i].is_ascii_digit() {
            out.push(chars[i]);
            i += 1;
            continue;
        }
        let start = i;
        while i < chars.len() && (chars[i].is_ascii_digit() || chars[i] == '.') {
            i += 1;
        }
        let mut number: String = chars[start..i].iter().collect();
        let full_stop = number.ends_with('.');
        if full_stop {
            number.pop();
        }
        if !number.contains('.') {
            out.push_str(&number);
        } else {
            out.push('#');
            // A duration's unit varies with its size.
            let rest: String = chars[i..].iter().collect();
            let unit = [" ms", " us", " s"].into_iter().find(|unit| {
                rest.starts_with(unit)
                    && !rest[unit.len()..].starts_with(|c: char| c.is_alphanumeric())
            });
            if let (Some(unit), false) = (unit, full_stop) {
                i += unit.chars().count();
            }
        }
        if full_stop {
            out.push('.');
        }
    }
    out.split_whitespace().collect::<Vec<_>>().join(" ")
}

#[test]
fn shape_masks_only_what_varies() {
    assert_eq!(
        shape("  host -> device  devarrow     58    130,803,680    98.194 ms     1.33     15.0%"),
        "host -> device devarrow 58 130,803,680 # # #%"
    );
    assert_eq!(shape("x 1.500 s."), "x #.");
    assert_eq!(shape("took 2.5 seconds"), "took # seconds");
    assert_eq!(
        shape("devarrow 0.1.0 (commit cc168a437112)"),
        "devarrow # (commit <commit>)"
    );
    assert_eq!(
        shape("device:  CPU device (as asked; CUDA: 1 device)"),
        "device: CPU device"
    );
    assert_eq!(
        shape("ok: every batch (10 batches)."),
        "ok: every batch (10 batches)."
    );
    assert_eq!(shape("build:   release"), "build: <profile>");
    assert_eq!(
        shape("build:   debug (figures are not representative: use cargo run --release)"),
        "build: <profile>"
    );
}

#[test]
fn the_readme_sample_output_comes_from_a_release_build() {
    let text = readme();
    let (lines, _) = sample_block(&text);
    let build: Vec<&&str> = lines.iter().filter(|l| l.starts_with("build:")).collect();
    assert_eq!(
        build,
        [&RELEASE],
        "README.md's sample output must come from a release build (its `build:` line says \
         which); regenerate it with `UPDATE_README=1 cargo test --release -p devarrow-cli \
         --test readme`"
    );
}

#[test]
fn the_readme_sample_output_is_what_the_job_prints() {
    let text = readme();
    let (lines, range) = sample_block(&text);
    let command = lines.first().expect("the block starts with the command");
    let args: Vec<&str> = command
        .strip_prefix(PROMPT)
        .unwrap_or_else(|| panic!("the block's first line starts with {PROMPT:?}: {command}"))
        .split_whitespace()
        .collect();
    assert!(
        args.windows(2).any(|w| w == ["--device", "cpu"]),
        "the sample runs on the CPU device, so that any machine can check it: {command}"
    );
    let actual = run(&args);

    if std::env::var_os("UPDATE_README").is_some() {
        assert!(
            actual.iter().any(|l| l == RELEASE),
            "UPDATE_README writes only a release build's figures: run it with `cargo test \
             --release`"
        );
        let mut block = format!("{command}\n");
        for line in &actual {
            block.push_str(line);
            block.push('\n');
        }
        let mut updated = text.clone();
        updated.replace_range(range, &block);
        std::fs::write(readme_path(), updated).expect("README.md is writable");
        return;
    }

    let expected: Vec<String> = lines[1..].iter().map(|l| shape(l)).collect();
    let actual: Vec<String> = actual.iter().map(|l| shape(l)).collect();
    let hint = "regenerate it with `UPDATE_README=1 cargo test --release -p devarrow-cli \
                --test readme`";
    for (i, (e, a)) in expected.iter().zip(&actual).enumerate() {
        assert_eq!(
            e,
            a,
            "line {} of README.md's sample output differs from what `devarrow {}` prints \
             ({hint})",
            i + 2,
            args.join(" ")
        );
    }
    assert_eq!(
        expected.len(),
        actual.len(),
        "README.md's sample output has {} lines, the job printed {} ({hint}):\n{}",
        expected.len(),
        actual.len(),
        actual.join("\n")
    );
}

/// The long options `devarrow --help` lists (without --help and --version).
fn help_options() -> Vec<String> {
    let out = Command::new(env!("CARGO_BIN_EXE_devarrow"))
        .arg("--help")
        .output()
        .expect("the devarrow binary runs");
    let help = String::from_utf8_lossy(&out.stdout).into_owned();
    let mut options: Vec<String> = help
        .lines()
        .map(str::trim_start)
        // Option lines: `-q, --quiet`, `--scale <SCALE>`.
        .filter(|l| l.starts_with('-'))
        .filter_map(|l| {
            l.split([' ', ','])
                .find(|w| w.starts_with("--"))
                .map(|w| w.to_string())
        })
        .filter(|o| o != "--help" && o != "--version")
        .collect();
    options.sort();
    options.dedup();
    options
}

/// The options of the README's option table: rows starting `` | `--name ``.
fn readme_options(readme: &str) -> Vec<String> {
    let mut options: Vec<String> = readme
        .lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .flat_map(|cell| {
            // `-q`, `--quiet` | ...: every option named in the first cell.
            let first = cell.split(" |").next().unwrap_or("");
            first
                .split('`')
                .filter(|w| w.starts_with("--"))
                .map(|w| w.split_whitespace().next().unwrap_or(w).to_string())
                .collect::<Vec<_>>()
        })
        .collect();
    options.sort();
    options.dedup();
    options
}

#[test]
fn the_readme_documents_every_option() {
    let help = help_options();
    assert!(help.len() >= 9, "{help:?}");
    assert_eq!(
        readme_options(&readme()),
        help,
        "README.md's option table and `devarrow --help` list different options"
    );
}
