//! The C ABI as C and Python see it: `tests/c/abi_test.c` compiled with the system's `cc`
//! against `include/vrampool.h` and `libvrampool.so`, and `tests/python/smoke.py` through
//! `ctypes`, each run on the simulator in a process of its own.
//!
//! The library is the one cargo built beside this test (`target/<profile>/libvrampool.so`,
//! a `cdylib` of the crate's lib target, built before the integration tests).

use std::path::{Path, PathBuf};
use std::process::Command;

/// `target/<profile>/`: the test binary runs from its `deps/` folder.
fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    exe.parent().and_then(Path::parent).expect("target/<profile>/deps/<test>").to_path_buf()
}

/// The newer of `target/<profile>/libvrampool.so` (what `cargo build` leaves) and
/// `deps/libvrampool.so` (what `cargo test` builds): after a change, the first is stale
/// until the next `cargo build`.
fn library() -> PathBuf {
    let dir = target_dir();
    let modified = |p: &PathBuf| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    let lib = [dir.join("libvrampool.so"), dir.join("deps/libvrampool.so")]
        .into_iter()
        .filter_map(|p| modified(&p).map(|t| (t, p)))
        .max_by_key(|(t, _)| *t)
        .map(|(_, p)| p)
        .unwrap_or_else(|| panic!("no libvrampool.so in {}: cargo builds it with the lib target", dir.display()));
    lib.canonicalize().expect("the library's path")
}

fn sim_env(cmd: &mut Command) -> &mut Command {
    cmd.env("VRAMPOOL_DEVICE", "sim")
        .env("VRAMPOOL_SIM_BYTES", "2GiB")
        .env_remove("VRAMPOOL_SIM_DEVICES")
        .env_remove("VRAMPOOL_MAX_RESERVED")
}

fn run(cmd: &mut Command, what: &str) {
    let out = cmd.output().unwrap_or_else(|e| panic!("cannot run {what}: {e}"));
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    print!("{text}");
    assert!(out.status.success(), "{what} failed ({}):\n{text}", out.status);
}

#[test]
fn a_c_program_uses_every_entry_point_and_every_bad_input_is_refused() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let lib = library();
    let lib_dir = lib.parent().expect("the library's folder");
    let out_dir = std::env::temp_dir().join(format!("vrampool-c-abi-{}", std::process::id()));
    std::fs::create_dir_all(&out_dir).expect("a scratch folder");
    let exe = out_dir.join("abi_test");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    run(
        Command::new(&cc)
            .args(["-std=c11", "-O1", "-g", "-Wall", "-Wextra", "-Werror", "-pthread"])
            .arg("-I")
            .arg(root.join("include"))
            .arg(root.join("tests/c/abi_test.c"))
            .arg("-o")
            .arg(&exe)
            .arg(&lib)
            .arg(format!("-Wl,-rpath,{}", lib_dir.display())),
        &format!("{cc} (compiling tests/c/abi_test.c)"),
    );
    run(sim_env(&mut Command::new(&exe)), "tests/c/abi_test.c");
    run(Command::new(&exe).arg("bad-config").env("VRAMPOOL_DEVICE", "gpu"), "tests/c/abi_test.c bad-config");
    // The trace a process records: the lines after its last flush reach the file at exit.
    let trace = out_dir.join("trace.csv");
    run(sim_env(Command::new(&exe).arg("trace").env("VRAMPOOL_RECORD_TRACE", &trace)), "tests/c/abi_test.c trace");
    let text = std::fs::read_to_string(&trace).expect("the trace was written");
    assert_eq!(
        text, "op,id,size,stream\na,0,1000,0\na,1,3145728,1\nf,0,1000,0\nf,1,3145728,1\na,2,77,0\n",
        "every event, in order, the last three written at exit"
    );
    let _ = std::fs::remove_dir_all(&out_dir);
}

#[test]
fn python_ctypes_drives_the_entry_points() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    run(sim_env(Command::new(&python).arg(root.join("tests/python/smoke.py")).arg(library())), "tests/python/smoke.py");
}
