//! `devarrow --link`: the CPU device with a modelled host-device link, named in the table
//! and in the JSON (`device.link`), and the stage times of devarrow's transfers
//! (`stages_s`).

use std::process::{Command, Output};

fn devarrow(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_devarrow"))
        .args(args)
        .env_remove("RUST_BACKTRACE")
        .output()
        .expect("the devarrow binary runs")
}

fn json(args: &[&str]) -> serde_json::Value {
    let out = devarrow(args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("JSON on stdout")
}

const SMALL: [&str; 7] = [
    "--device", "cpu", "--scale", "0.001", "--reps", "1", "--json",
];

#[test]
fn the_json_records_the_link_and_the_stage_times() {
    let mut args = SMALL.to_vec();
    args.extend(["--link", "50GB/s,2us"]);
    let v = json(&args);
    assert_eq!(v["device"]["link"]["gbps"], 50.0);
    assert_eq!(v["device"]["link"]["latency_s"], 2e-6);
    assert_eq!(v["options"]["link"], "50GB/s,2us");
    for p in v["points"].as_array().unwrap() {
        assert_eq!(p["verified"], true);
        for m in p["measurements"].as_array().unwrap() {
            let stages = &m["stages_s"];
            if m["method"] == "devarrow" {
                for stage in ["plan", "allocate", "pack", "copy", "unpack", "validate"] {
                    assert!(stages[stage].as_f64().unwrap() >= 0.0, "{stage}: {m}");
                }
                assert!(stages["copy"].as_f64().unwrap() > 0.0, "{m}");
            } else {
                assert!(stages.is_null(), "{m}");
            }
        }
    }
    // Without a link: the plain CPU device, recorded as such.
    let v = json(&SMALL);
    assert!(v["device"]["link"].is_null());
}

#[test]
fn the_table_names_the_model() {
    let out = devarrow(&[
        "--device",
        "cpu",
        "--scale",
        "0.001",
        "--reps",
        "1",
        "--link",
        "40GB/s,5us",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(
        stdout.contains("model:   modelled link 40 GB/s + 5 us per copy"),
        "{stdout}"
    );
    let out = devarrow(&["--device", "cpu", "--scale", "0.001", "--reps", "1"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("model:   no link"), "{stdout}");
}

#[test]
fn a_bad_link_is_a_command_line_error() {
    for bad in ["4GB/s", "fast,1us", "4GB/s,forever"] {
        let out = devarrow(&["--device", "cpu", "--link", bad]);
        assert_eq!(out.status.code(), Some(2), "{bad}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.starts_with("devarrow: error: "), "{stderr}");
    }
}
