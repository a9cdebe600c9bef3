//! The demo as a user runs it: `examples/inference_server` on the simulator, briefly. A clean
//! run exits 0, says `corrupted blocks: 0` last and writes its three files; with the pool's
//! event guard broken (`--break-event-guard`), memory goes from one stream to another while
//! the first still uses it, the demo's checks see other blocks' patterns, and it says so and
//! exits non-zero. With runs of pages (`--map-run-pages 16`, the C ABI's default) it runs
//! clean too, and a run length out of range is refused.
//!
//! The binary is the one cargo built beside this test (`target/<profile>/examples/`:
//! `cargo test` builds the examples before it runs the tests); if it is missing (a run of
//! `--test demo` alone), the test builds it first.

use std::path::{Path, PathBuf};
use std::process::Command;

/// `target/<profile>/`: the test binary runs from its `deps/` folder.
fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    exe.parent().and_then(Path::parent).expect("target/<profile>/deps/<test>").to_path_buf()
}

fn demo() -> PathBuf {
    let dir = target_dir();
    let bin = dir.join("examples/inference_server");
    if !bin.exists() {
        let release = dir.file_name().is_some_and(|n| n == "release");
        let mut cargo = Command::new(env!("CARGO"));
        cargo.args(["build", "--example", "inference_server", "--manifest-path"]);
        cargo.arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml"));
        if release {
            cargo.arg("--release");
        }
        if !cfg!(feature = "cuda") {
            cargo.arg("--no-default-features");
        }
        let status = cargo.status().expect("cargo builds the demo");
        assert!(status.success(), "cargo could not build the demo");
    }
    bin
}

struct Outcome {
    ok: bool,
    stdout: String,
    corrupted: Option<u64>,
}

fn run(name: &str, extra: &[&str]) -> (Outcome, PathBuf) {
    let report = std::env::temp_dir().join(format!("vrampool-demo-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&report);
    let out = Command::new(demo())
        .args(["--device", "sim", "--threads", "2", "--duration", "3", "--report"])
        .arg(&report)
        .args(extra)
        .env_remove("RUST_LOG")
        .output()
        .expect("the demo runs");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    print!("{stdout}{}", String::from_utf8_lossy(&out.stderr));
    let corrupted = stdout
        .lines()
        .filter_map(|l| l.strip_prefix("corrupted blocks: "))
        .next_back()
        .map(|n| n.trim().parse().expect("a count after `corrupted blocks:`"));
    (Outcome { ok: out.status.success(), stdout, corrupted }, report)
}

#[test]
fn the_demo_runs_clean_and_writes_its_report() {
    let (out, dir) = run("clean", &[]);
    assert!(out.ok, "the demo failed");
    assert_eq!(out.corrupted, Some(0), "its last `corrupted blocks:` line");
    assert!(out.stdout.contains("T0 thread caches"), "the tiers' table");
    let json = std::fs::read_to_string(dir.join("snapshot.json")).expect("snapshot.json");
    let snap: serde_json::Value = serde_json::from_str(&json).expect("snapshot.json is JSON");
    let segments = snap["segments"].as_array().expect("segments");
    assert!(!segments.is_empty(), "the pool had memory mapped mid-run");
    let mapped: u64 = segments.iter().map(|s| s["bytes"].as_u64().unwrap()).sum();
    let states: u64 =
        ["live_bytes", "cached_bytes", "retiring_bytes", "free_bytes"].iter().map(|k| snap[k].as_u64().unwrap()).sum();
    assert_eq!(states, mapped, "every mapped byte is in one state");
    for svg in ["memory.svg", "timeline.svg"] {
        let text = std::fs::read_to_string(dir.join(svg)).unwrap_or_else(|e| panic!("{svg}: {e}"));
        assert!(text.starts_with("<svg") && text.trim_end().ends_with("</svg>"), "{svg} is an SVG");
        assert!(text.contains("<rect") && text.contains("<text"), "{svg} draws something");
    }
    assert!(std::fs::read_to_string(dir.join("timeline.svg")).unwrap().contains("<polyline"));
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_broken_event_guard_shows_as_corrupted_blocks() {
    let (out, dir) = run("broken", &["--break-event-guard"]);
    assert!(!out.ok, "the demo exits non-zero when blocks are corrupted");
    let n = out.corrupted.expect("a `corrupted blocks:` line");
    assert!(n > 0, "the checks did not see memory reused across streams before its free");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn with_runs_of_pages_the_demo_runs_clean_and_a_bad_run_length_is_refused() {
    let (out, dir) = run("runs", &["--map-run-pages", "16"]);
    assert!(out.ok, "the demo failed with runs of 16 pages");
    assert_eq!(out.corrupted, Some(0), "its last `corrupted blocks:` line");
    let _ = std::fs::remove_dir_all(dir);
    for bad in ["0", "65", "many"] {
        let out =
            Command::new(demo()).args(["--device", "sim", "--map-run-pages", bad]).output().expect("the demo runs");
        assert!(!out.status.success(), "--map-run-pages {bad} was taken");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("1 to 64"), "--map-run-pages {bad}: {err}");
    }
}
