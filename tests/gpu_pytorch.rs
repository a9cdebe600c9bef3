//! PyTorch on vrampool, on a real GPU: `examples/pytorch/run.py --quick` against the
//! `libvrampool.so` cargo built beside this test. The script runs ResNet-50 inference,
//! GPT-2 generation and a GPT-2 training loop, each from 4 threads on 4 CUDA streams, once under
//! PyTorch's caching allocator and once under vrampool (installed through
//! `CUDAPluggableAllocator`, with the C++ hooks for `record_stream`, `empty_cache` and
//! out-of-memory), compares the outputs, and runs the side-stream `record_stream` test; it
//! exits 0 only when the outputs match and every check passed. Ignored by default; run with
//! `cargo test --release --test gpu_pytorch -- --ignored --nocapture`.
//!
//! Skipped (with a message) where `python3`, `torch`, `torchvision`, `transformers` or a
//! CUDA device is missing. `VRAMPOOL_PYTHON` names another interpreter, `VRAMPOOL_LIB`
//! another library, `VRAMPOOL_PYTORCH_TIMEOUT` the limit in seconds (default 900).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// `target/<profile>/`: the test binary runs from its `deps/` folder.
fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    exe.parent().and_then(Path::parent).expect("target/<profile>/deps/<test>").to_path_buf()
}

fn library() -> PathBuf {
    if let Some(p) = std::env::var_os("VRAMPOOL_LIB") {
        return PathBuf::from(p);
    }
    let dir = target_dir();
    [dir.join("libvrampool.so"), dir.join("deps/libvrampool.so")]
        .into_iter()
        .find(|p| p.exists())
        .unwrap_or_else(|| panic!("no libvrampool.so in {}: `cargo build --release` builds it", dir.display()))
}

/// The script: beside the working directory (the repository root, as cargo and the GPU
/// machine run it), else beside the target folder, else where this crate was built.
fn script() -> PathBuf {
    let rel = Path::new("examples/pytorch/run.py");
    let mut roots = vec![std::env::current_dir().expect("the working directory")];
    roots.extend(target_dir().parent().and_then(Path::parent).map(Path::to_path_buf));
    roots.push(PathBuf::from(env!("CARGO_MANIFEST_DIR")));
    roots
        .iter()
        .map(|r| r.join(rel))
        .find(|p| p.exists())
        .unwrap_or_else(|| panic!("no {} under {roots:?}", rel.display()))
}

fn python() -> String {
    std::env::var("VRAMPOOL_PYTHON").unwrap_or_else(|_| "python3".into())
}

/// Why this machine cannot run the test, if it cannot.
fn missing() -> Option<String> {
    let probe = "import sys\n\
                 try:\n    import torch, torchvision, transformers\n\
                 except Exception as e:\n    print(f'{type(e).__name__}: {e}'); sys.exit(2)\n\
                 sys.exit(0 if torch.cuda.is_available() else 3)";
    match Command::new(python()).args(["-c", probe]).output() {
        Err(e) => Some(format!("no {} ({e})", python())),
        Ok(out) => match out.status.code() {
            Some(0) => None,
            Some(2) => Some(format!("a Python module is missing: {}", String::from_utf8_lossy(&out.stdout).trim())),
            Some(3) => Some("torch sees no CUDA device".into()),
            _ => Some(format!("the probe failed: {}", String::from_utf8_lossy(&out.stderr).trim())),
        },
    }
}

fn timeout() -> Duration {
    let secs = std::env::var("VRAMPOOL_PYTORCH_TIMEOUT").ok().and_then(|s| s.parse().ok()).unwrap_or(900);
    Duration::from_secs(secs)
}

#[test]
#[ignore = "needs a CUDA GPU, python3 and PyTorch"]
fn pytorch_models_match_the_reference_allocator_under_vrampool() {
    if let Some(why) = missing() {
        println!("skipped: {why}");
        return;
    }
    let lib = library();
    let out = std::env::temp_dir().join(format!("vrampool_gpu_pytorch_{}", std::process::id()));
    std::fs::create_dir_all(&out).expect("the output folder");
    let mut child = Command::new(python())
        .arg(script())
        .args(["--quick", "--lib"])
        .arg(&lib)
        .arg("--out")
        .arg(&out)
        .env("VRAMPOOL_DEVICE", "cuda")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the script");
    // Read the pipes on threads so a chatty child cannot fill them and stall.
    let read = |pipe: Option<Box<dyn std::io::Read + Send>>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            if let Some(mut p) = pipe {
                let _ = p.read_to_string(&mut s);
            }
            s
        })
    };
    let stdout = read(child.stdout.take().map(|p| Box::new(p) as Box<dyn std::io::Read + Send>));
    let stderr = read(child.stderr.take().map(|p| Box::new(p) as Box<dyn std::io::Read + Send>));
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait for the script") {
            break Some(s);
        }
        if start.elapsed() > timeout() {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let (stdout, stderr) = (stdout.join().unwrap_or_default(), stderr.join().unwrap_or_default());
    println!("{stdout}");
    eprintln!("{}", tail(&stderr, 8000));
    let status = status.unwrap_or_else(|| panic!("run.py ran past {:?}", timeout()));
    assert!(status.success(), "run.py failed ({status}); its files are in {}", out.display());
    assert!(stdout.contains("RESULT: PASS"), "run.py did not report a pass");
    let summary = std::fs::read_to_string(out.join("summary.md")).expect("run.py writes summary.md");
    for case in ["default stream", "4 threads, own streams"] {
        assert!(
            summary.contains(&format!("| record_stream: hook on, {case} | vrampool | clean")),
            "the side-stream record_stream test under vrampool with the hook ({case}) must be clean:\n{summary}"
        );
    }
    assert!(
        summary.contains("| out of memory: 64 TiB | vrampool | raised torch.OutOfMemoryError"),
        "out of memory under vrampool must be a Python exception:\n{summary}"
    );
    for workload in ["resnet50", "gpt2_generate", "gpt2_train"] {
        assert!(summary.contains(&format!("| {workload} | vrampool |")), "no {workload} row under vrampool");
    }
    println!("took {:.0} s; files in {}", start.elapsed().as_secs_f64(), out.display());
}

fn tail(s: &str, n: usize) -> &str {
    let mut i = s.len().saturating_sub(n);
    while !s.is_char_boundary(i) {
        i += 1;
    }
    &s[i..]
}
