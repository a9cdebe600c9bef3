//! The C ABI against a model of what is live (see `fuzz/README.md`).
#![no_main]

use std::collections::BTreeMap;
use std::ffi::{c_void, CStr};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Mutex, Once};

use libfuzzer_sys::fuzz_target;
use vrampool::ffi::*;
use vrampool::registry::{self, Config, DeviceChoice};

/// Stream handles the target allocates on (each a simulated stream made on first sight),
/// and one it never allocates on.
const STREAMS: [u64; 4] = [0, 1, 2, 0xdead];
const UNUSED_STREAM: u64 = 0xbad;
const MAX_LIVE: usize = 48;

const SIZES: [isize; 16] = [
    0,
    -1,
    -4096,
    isize::MIN,
    1,
    255,
    256,
    257,
    4096,
    65536,
    1 << 20,
    3 << 20,
    (64 << 20) + 1,
    1 << 40,
    isize::MAX,
    100_000,
];

fn setup() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        registry::configure(Config { device: DeviceChoice::Sim, sim_bytes: 1 << 30, ..Config::default() })
            .expect("the fuzz target configures the registry first");
    });
}

/// This thread's last error, taken (as the ABI's callers see it).
fn last_error() -> Option<String> {
    let p = vrampool_last_error();
    // SAFETY: a NUL-terminated string the library keeps until this thread's next call.
    (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

/// A thread that frees what it is sent and answers with its last error.
struct Remote {
    to: Sender<(u64, isize, i32, u64)>,
    from: Receiver<Option<String>>,
}

fn remote() -> &'static Mutex<Remote> {
    static REMOTE: std::sync::OnceLock<Mutex<Remote>> = std::sync::OnceLock::new();
    REMOTE.get_or_init(|| {
        let (to, rx) = channel::<(u64, isize, i32, u64)>();
        let (tx, from) = channel();
        std::thread::spawn(move || {
            for (p, size, dev, stream) in rx {
                // SAFETY: the simulator takes any stream value; bad pointers are refused.
                unsafe { vrampool_free(p as *mut c_void, size, dev, stream as *mut c_void) };
                if tx.send(last_error()).is_err() {
                    break;
                }
            }
        });
        Mutex::new(Remote { to, from })
    })
}

struct Input<'a>(&'a [u8]);

impl Input<'_> {
    fn byte(&mut self) -> Option<u8> {
        let (&b, rest) = self.0.split_first()?;
        self.0 = rest;
        Some(b)
    }
    fn word(&mut self) -> Option<u16> {
        Some(u16::from(self.byte()?) << 8 | u16::from(self.byte()?))
    }
}

/// What is live: address → (size, stream).
type Model = BTreeMap<u64, (isize, u64)>;

fn free_expect(model: &mut Model, p: u64, size: isize, dev: i32, stream: u64) -> bool {
    let ok = p != 0 && dev == 0 && model.get(&p) == Some(&(size, stream));
    if ok {
        model.remove(&p);
    }
    ok
}

fn check_free(model: &mut Model, p: u64, size: isize, dev: i32, stream: u64, remote_thread: bool) {
    let expect_ok = free_expect(model, p, size, dev, stream);
    let err = if remote_thread {
        let r = remote().lock().unwrap();
        r.to.send((p, size, dev, stream)).unwrap();
        r.from.recv().unwrap()
    } else {
        // SAFETY: as in `remote`.
        unsafe { vrampool_free(p as *mut c_void, size, dev, stream as *mut c_void) };
        last_error()
    };
    // free(NULL) is a no-op without an error.
    let expect_err = !expect_ok && p != 0;
    assert_eq!(err.is_some(), expect_err, "free({p:#x}, {size}, {dev}, {stream:#x}): {err:?}, model {model:?}");
}

fn check_model(model: &Model) {
    // Statistics settle pending frees first.
    let n = unsafe { vrampool_stats_json(0, std::ptr::null_mut(), 0) };
    assert!(n > 0);
    // SAFETY: no other thread is inside the ABI (the remote thread waits for requests).
    let live = unsafe { live_blocks(0) };
    let want: Vec<(u64, u64)> = model.iter().map(|(&p, &(s, _))| (p, s as u64)).collect();
    assert_eq!(live, want, "the table's live blocks are the model's");
}

fn stats() -> serde_like::Stats {
    let n = unsafe { vrampool_stats_json(0, std::ptr::null_mut(), 0) };
    let mut buf = vec![0u8; n + 1];
    assert_eq!(unsafe { vrampool_stats_json(0, buf.as_mut_ptr().cast(), buf.len()) }, n);
    serde_like::Stats::parse(std::str::from_utf8(&buf[..n]).unwrap())
}

mod serde_like {
    /// The few figures the target checks, read from the JSON by key.
    pub struct Stats {
        pub allocated_bytes: u64,
        pub abi_internal_errors: u64,
        pub abi_late_double_frees: u64,
        pub abi_pending_frees: u64,
    }

    fn field(json: &str, key: &str) -> u64 {
        let pat = format!("\"{key}\":");
        let at = json.find(&pat).unwrap_or_else(|| panic!("no {key} in {json}")) + pat.len();
        json[at..].split(|c: char| !c.is_ascii_digit()).next().unwrap().parse().unwrap()
    }

    impl Stats {
        pub fn parse(json: &str) -> Stats {
            Stats {
                allocated_bytes: field(json, "allocated_bytes"),
                abi_internal_errors: field(json, "abi_internal_errors"),
                abi_late_double_frees: field(json, "abi_late_double_frees"),
                abi_pending_frees: field(json, "abi_pending_frees"),
            }
        }
    }
}

fuzz_target!(|data: &[u8]| {
    setup();
    let mut input = Input(data);
    let mut model = Model::new();
    // Freed blocks, for double frees (their addresses may be live again since).
    let mut freed: Vec<(u64, isize, u64)> = Vec::new();
    while let Some(op) = input.byte() {
        let Some(arg) = input.word() else { break };
        let stream = STREAMS[(arg >> 14) as usize % STREAMS.len()];
        match op % 10 {
            // malloc
            0..=2 => {
                if model.len() >= MAX_LIVE {
                    continue;
                }
                let sel = (arg & 0x3fff) as usize;
                let size = if sel < 0x2000 { SIZES[sel % SIZES.len()] } else { (sel as isize) * 97 };
                // SAFETY: the simulator takes any stream value.
                let p = unsafe { vrampool_malloc(size, 0, stream as *mut c_void) } as u64;
                let err = last_error();
                if size <= 0 || size >= 1 << 40 {
                    assert_eq!(p, 0, "malloc({size})");
                    assert_eq!(err.is_some(), size != 0, "malloc({size}): {err:?}");
                } else if p == 0 {
                    // Out of memory is allowed, with an error.
                    assert!(err.is_some(), "malloc({size}) returned NULL without an error");
                } else {
                    assert!(err.is_none(), "malloc({size}) succeeded with an error: {err:?}");
                    assert_eq!(p % 256, 0);
                    assert!(model.insert(p, (size, stream)).is_none(), "{p:#x} handed out twice");
                }
            }
            // a good free, here or on the other thread
            3 | 4 => {
                let Some((&p, &(size, stream))) = model.iter().nth(arg as usize % model.len().max(1)) else {
                    continue;
                };
                check_free(&mut model, p, size, 0, stream, op % 10 == 4 && arg & 1 == 1);
                freed.push((p, size, stream));
            }
            // a bad free: wrong size, stream, device, interior, foreign, double
            5 | 6 => {
                let remote_thread = arg & 0x8000 != 0;
                let pick = model.iter().nth(arg as usize % model.len().max(1)).map(|(&p, &v)| (p, v));
                let (p, size, dev, s) = match (arg >> 4) % 8 {
                    0 => match pick {
                        Some((p, (size, s))) => (p, size + 256 * ((arg & 3) as isize + 1), 0, s),
                        None => continue,
                    },
                    1 => match pick {
                        Some((p, (size, _))) => (p, size, 0, UNUSED_STREAM),
                        None => continue,
                    },
                    2 => match pick {
                        Some((p, (size, s))) => (p, size, 1 + (arg & 1) as i32 * -2, s),
                        None => continue,
                    },
                    3 => match pick {
                        Some((p, (size, s))) if size > 512 => (p + 256, size - 256, 0, s),
                        Some((p, (size, s))) => (p + 1, size, 0, s),
                        None => continue,
                    },
                    4 => (0x1000 + u64::from(arg) * 4096, 4096, 0, 0),
                    5 | 6 => match freed.get(arg as usize % freed.len().max(1)) {
                        Some(&(p, size, s)) => (p, size, 0, s),
                        None => continue,
                    },
                    _ => match pick {
                        Some((p, (_, s))) => (p, -1, 0, s),
                        None => continue,
                    },
                };
                check_free(&mut model, p, size, dev, s, remote_thread);
            }
            // record_stream
            7 => {
                let Some((&p, _)) = model.iter().nth(arg as usize % model.len().max(1)) else { continue };
                let other = STREAMS[(arg as usize >> 2) % STREAMS.len()];
                let (target, want_ok) = if arg & 1 == 0 { (p, true) } else { (p + 256, false) };
                // SAFETY: the simulator takes any stream value.
                let rc = unsafe { vrampool_record_stream(target as *mut c_void, other as *mut c_void) };
                let err = last_error();
                if want_ok {
                    assert_eq!((rc, &err), (0, &None), "record_stream({target:#x})");
                } else if model.contains_key(&target) {
                    // The interior address is another live block's start: recorded there.
                    assert_eq!(rc, 0, "record_stream({target:#x}): {err:?}");
                } else {
                    assert!(rc != 0 && err.is_some(), "record_stream({target:#x}) of no block");
                }
            }
            8 => check_model(&model),
            _ => {
                if arg % 16 == 0 {
                    assert_eq!(vrampool_empty_cache(), 0, "{:?}", last_error());
                }
            }
        }
    }
    // Free what is left, then nothing may be allocated and no bug counted.
    let left: Vec<(u64, (isize, u64))> = model.iter().map(|(&p, &v)| (p, v)).collect();
    for (p, (size, stream)) in left {
        check_free(&mut model, p, size, 0, stream, false);
    }
    check_model(&model);
    let s = stats();
    assert_eq!(s.allocated_bytes, 0, "allocated bytes left after every free");
    assert_eq!(s.abi_pending_frees, 0);
    assert_eq!(s.abi_internal_errors, 0);
    assert_eq!(s.abi_late_double_frees, 0, "no free raced another here");
});
