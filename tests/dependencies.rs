//! What depending on devarrow pulls in, checked with `cargo tree` over the lock file:
//! the library has no command-line dependencies, and without the default `cuda` feature
//! neither the facade nor the bridge builds cudarc.

use std::path::PathBuf;
use std::process::Command;

/// The package's directory as cargo runs this test, else as it built it: a test binary
/// reused from a shared target directory, built in another checkout, keeps that
/// checkout's path in `env!`.
fn manifest_dir() -> PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")))
}

/// The normal (non-dev, non-build) dependencies of `package` with `args`, one crate name
/// per line.
fn dependencies(package: &str, args: &[&str]) -> Vec<String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args([
            "tree",
            "--offline",
            "-e",
            "normal",
            "--prefix",
            "none",
            "-p",
            package,
        ])
        .args(["--format", "{p}"])
        .args(args)
        .current_dir(manifest_dir())
        .output()
        .expect("cargo tree runs");
    assert!(
        out.status.success(),
        "cargo tree -p {package} {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut names: Vec<String> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .filter_map(|l| l.split_whitespace().next().map(str::to_string))
        .collect();
    names.sort();
    names.dedup();
    names
}

fn assert_none_of(package: &str, args: &[&str], forbidden: &[&str]) {
    let deps = dependencies(package, args);
    assert!(deps.iter().any(|d| d == package), "{deps:?}");
    for f in forbidden {
        assert!(
            !deps.iter().any(|d| d == f),
            "{package} {args:?} depends on {f}: {deps:?}"
        );
    }
}

const CLI_ONLY: &[&str] = &[
    "clap",
    "parquet",
    "arrow-ipc",
    "tpchgen",
    "tpchgen-arrow",
    "serde_json",
    "serde",
    "arrow-select",
    "indicatif",
    "plotters",
    "dejavu",
    "criterion",
    "devarrow-cli",
    "devarrow-testing",
    "devarrow-emu",
    "devarrow-interop",
];

#[test]
fn the_library_has_no_command_line_or_test_dependencies() {
    assert_none_of("devarrow", &[], CLI_ONLY);
    assert!(dependencies("devarrow", &[]).iter().any(|d| d == "cudarc"));
}

#[test]
fn without_cuda_nothing_builds_cudarc() {
    let no_cuda = ["cudarc", "devarrow-cuda"];
    assert_none_of("devarrow", &["--no-default-features"], &no_cuda);
    assert_none_of("devarrow-bridge", &["--no-default-features"], &no_cuda);
    assert_none_of("devarrow-abi", &[], &no_cuda);
}
