//! The registry's configuration: the device kind, the simulator's size and the pools'
//! limits, from environment variables read once or set by the program before first use.

use crate::error::{Error, Result};
use crate::PoolConfig;

/// Which kind of device the registry opens for every ordinal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceChoice {
    /// Simulated devices ([`crate::SimDevice`]): no GPU needed.
    Sim,
    /// CUDA GPUs (feature `cuda`); a pool fails with [`Error::NoDevice`] without one.
    Cuda,
    /// CUDA when a driver and GPU 0 are present, else the simulator; decided once.
    Auto,
}

/// How the registry makes its pools. `Default` is what an unset environment gives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// `VRAMPOOL_DEVICE`: `sim`, `cuda` or `auto` (default `auto`).
    pub device: DeviceChoice,
    /// `VRAMPOOL_SIM_BYTES`: memory of each simulated device (default 16 GiB).
    pub sim_bytes: u64,
    /// `VRAMPOOL_SIM_DEVICES`: how many simulated devices there are (ordinals 0..n;
    /// default 1, as on a machine with one GPU).
    pub sim_devices: usize,
    /// `VRAMPOOL_MAX_STREAMS`: most distinct streams the registry keeps per device (default
    /// 1024). A stream is kept for the life of the process once seen (its blocks may be
    /// cached against it), and a simulated stream runs a thread.
    pub max_streams: usize,
    /// Each pool's configuration: `VRAMPOOL_MAX_RESERVED` ([`PoolConfig::max_reserved`]),
    /// `VRAMPOOL_MAX_CACHED` ([`PoolConfig::max_cached_bytes`]),
    /// `VRAMPOOL_THREAD_CACHE_BYTES` ([`PoolConfig::thread_cache_bytes`]),
    /// `VRAMPOOL_LARGEST_CACHED_CLASS` ([`PoolConfig::largest_cached_class`]),
    /// `VRAMPOOL_RELEASE_THRESHOLD` ([`PoolConfig::release_threshold`]),
    /// `VRAMPOOL_MAP_RUN_PAGES` ([`PoolConfig::map_run_pages`], default
    /// [`REGISTRY_MAP_RUN_PAGES`]), `VRAMPOOL_TRADE_PAGES`
    /// ([`PoolConfig::trade_pages_on_map`]), `VRAMPOOL_CROSS_STREAM_WAITS`
    /// ([`PoolConfig::cross_stream_waits`]), `VRAMPOOL_RECORD_TRACE`
    /// ([`PoolConfig::record_trace`]; device N > 0 writes the path with `.N` appended); the
    /// rest as [`PoolConfig::default`].
    pub pool: PoolConfig,
}

/// Pages a registry pool maps as one allocation when a block needs several: 16, not
/// [`PoolConfig::default`]'s 1. The registry's pools serve C and PyTorch, whose users weigh
/// vrampool against PyTorch's caching allocator: under PyTorch on an H200, growth page by
/// page was where the time went and cost the throughput, while runs of 16 still held less
/// than PyTorch's allocator (`docs/BENCHMARKS.md`, the fourth session).
/// `VRAMPOOL_MAP_RUN_PAGES=1` takes the memory figure instead.
pub const REGISTRY_MAP_RUN_PAGES: usize = 16;

/// The most devices the registry serves (ordinals `0..MAX_DEVICES`).
pub const MAX_DEVICES: usize = 64;
/// The most streams per device [`Config::max_streams`] may allow.
pub const MAX_STREAMS: usize = 1 << 20;
const MIN_SIM_BYTES: u64 = 2 << 20;

/// Every environment variable the registry reads, with what it takes.
pub const VARIABLES: &[(&str, &str)] = &[
    ("VRAMPOOL_DEVICE", "sim | cuda | auto (default auto)"),
    ("VRAMPOOL_SIM_BYTES", "bytes of each simulated device (default 16GiB)"),
    ("VRAMPOOL_SIM_DEVICES", "number of simulated devices (default 1)"),
    ("VRAMPOOL_MAX_STREAMS", "streams kept per device (default 1024)"),
    ("VRAMPOOL_MAX_RESERVED", "most bytes a pool maps (default 80% of the device)"),
    ("VRAMPOOL_MAX_CACHED", "most bytes a pool's caches hold (default half of max reserved)"),
    ("VRAMPOOL_THREAD_CACHE_BYTES", "most bytes one thread's cache for one stream holds (default 256MiB)"),
    ("VRAMPOOL_LARGEST_CACHED_CLASS", "largest block size kept in the caches (default 4MiB)"),
    ("VRAMPOOL_RELEASE_THRESHOLD", "free mapped bytes kept between trims (default: all)"),
    ("VRAMPOOL_MAP_RUN_PAGES", "pages mapped as one allocation when a block needs several, 1 to 64 (default 16)"),
    ("VRAMPOOL_TRADE_PAGES", "1 | 0: past its peak, lend free pages rather than map new ones (default 1)"),
    ("VRAMPOOL_CROSS_STREAM_WAITS", "1 | 0: let a stream wait on the device for memory another freed (default 1)"),
    (
        "VRAMPOOL_RECORD_TRACE",
        "file to write every allocation and free to, as a trace for replay; slows the pool (default: none)",
    ),
];

impl Default for Config {
    fn default() -> Config {
        Config {
            device: DeviceChoice::Auto,
            sim_bytes: 16 << 30,
            sim_devices: 1,
            max_streams: 1024,
            pool: PoolConfig { map_run_pages: REGISTRY_MAP_RUN_PAGES, ..PoolConfig::default() },
        }
    }
}

impl Config {
    /// The configuration the environment gives (unset or empty variables keep their
    /// defaults). A bad value is an [`Error::InvalidArgument`] naming the variable, the
    /// value and what it takes.
    pub fn from_env() -> Result<Config> {
        Config::from_lookup(|name| std::env::var_os(name).map(|v| v.to_string_lossy().into_owned()))
    }

    /// As [`Config::from_env`], with the variables looked up through `get`.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Config> {
        let mut c = Config::default();
        let var = |name: &str| get(name).map(|v| v.trim().to_string()).filter(|v| !v.is_empty());
        if let Some(v) = var("VRAMPOOL_DEVICE") {
            c.device = match v.to_ascii_lowercase().as_str() {
                "sim" => DeviceChoice::Sim,
                "cuda" => DeviceChoice::Cuda,
                "auto" => DeviceChoice::Auto,
                _ => return Err(bad("VRAMPOOL_DEVICE", &v, "sim, cuda or auto")),
            };
        }
        let bytes = |name: &str| var(name).map(|v| parse_bytes(&v).ok_or_else(|| bad(name, &v, BYTES))).transpose();
        let count =
            |name: &str| var(name).map(|v| v.parse::<usize>().map_err(|_| bad(name, &v, "a whole number"))).transpose();
        if let Some(b) = bytes("VRAMPOOL_SIM_BYTES")? {
            c.sim_bytes = b;
        }
        if let Some(n) = count("VRAMPOOL_SIM_DEVICES")? {
            c.sim_devices = n;
        }
        if let Some(n) = count("VRAMPOOL_MAX_STREAMS")? {
            c.max_streams = n;
        }
        if let Some(b) = bytes("VRAMPOOL_MAX_RESERVED")? {
            c.pool.max_reserved = Some(b);
        }
        if let Some(b) = bytes("VRAMPOOL_MAX_CACHED")? {
            c.pool.max_cached_bytes = Some(b);
        }
        if let Some(b) = bytes("VRAMPOOL_THREAD_CACHE_BYTES")? {
            c.pool.thread_cache_bytes = b;
        }
        if let Some(b) = bytes("VRAMPOOL_LARGEST_CACHED_CLASS")? {
            c.pool.largest_cached_class = b;
        }
        if let Some(b) = bytes("VRAMPOOL_RELEASE_THRESHOLD")? {
            c.pool.release_threshold = b;
        }
        if let Some(n) = count("VRAMPOOL_MAP_RUN_PAGES")? {
            c.pool.map_run_pages = n;
        }
        let switch = |name: &str| var(name).map(|v| parse_switch(&v).ok_or_else(|| bad(name, &v, SWITCH))).transpose();
        if let Some(on) = switch("VRAMPOOL_TRADE_PAGES")? {
            c.pool.trade_pages_on_map = on;
        }
        if let Some(on) = switch("VRAMPOOL_CROSS_STREAM_WAITS")? {
            c.pool.cross_stream_waits = on;
        }
        if let Some(path) = get("VRAMPOOL_RECORD_TRACE").filter(|v| !v.trim().is_empty()) {
            c.pool.record_trace = Some(path.into());
        }
        c.validate()?;
        Ok(c)
    }

    /// Check the values' ranges (also done by [`super::configure`]).
    pub fn validate(&self) -> Result<()> {
        let shown = |v: &dyn std::fmt::Display| v.to_string();
        if self.sim_bytes < MIN_SIM_BYTES {
            return Err(bad("VRAMPOOL_SIM_BYTES", &shown(&self.sim_bytes), "at least 2MiB"));
        }
        if self.sim_devices == 0 || self.sim_devices > MAX_DEVICES {
            return Err(bad("VRAMPOOL_SIM_DEVICES", &shown(&self.sim_devices), "1 to 64"));
        }
        if self.max_streams == 0 || self.max_streams > MAX_STREAMS {
            return Err(bad("VRAMPOOL_MAX_STREAMS", &shown(&self.max_streams), "1 to 1048576"));
        }
        if self.pool.max_reserved == Some(0) {
            return Err(bad("VRAMPOOL_MAX_RESERVED", "0", "more than 0 bytes"));
        }
        // The pool would clamp it; a user who asked for more should hear so.
        let most = PoolConfig::MAX_MAP_RUN_PAGES;
        if !(1..=most).contains(&self.pool.map_run_pages) {
            return Err(bad("VRAMPOOL_MAP_RUN_PAGES", &shown(&self.pool.map_run_pages), &format!("1 to {most}")));
        }
        Ok(())
    }
}

const BYTES: &str = "a byte count: digits with an optional K, M, G or T suffix (KiB, MiB, ...: powers of 1024)";
const SWITCH: &str = "1, 0, true, false, on, off, yes or no";

/// `"1"`, `"true"`, `"on"`, `"yes"` (any case) and their opposites; `None` for anything else.
fn parse_switch(s: &str) -> Option<bool> {
    match s.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "on" | "yes" => Some(true),
        "0" | "false" | "off" | "no" => Some(false),
        _ => None,
    }
}

fn bad(name: &str, value: &str, wants: &str) -> Error {
    Error::InvalidArgument(format!("configuration: {name}={value:?} is not valid: {wants}"))
}

/// `"17179869184"`, `"16GiB"`, `"16 G"`, `"512MB"`, `"64k"`: binary multiples, any case.
/// `None` for anything else, and on overflow.
pub(crate) fn parse_bytes(s: &str) -> Option<u64> {
    let s = s.trim();
    let digits = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (n, unit) = s.split_at(digits);
    let n: u64 = n.parse().ok()?;
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => return None,
    };
    n.checked_mul(1u64 << shift)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn from(vars: &[(&str, &str)]) -> Result<Config> {
        Config::from_lookup(|name| vars.iter().find(|(k, _)| *k == name).map(|(_, v)| v.to_string()))
    }

    #[test]
    fn an_empty_environment_gives_the_defaults() {
        assert_eq!(from(&[]).unwrap(), Config::default());
        assert_eq!(from(&[("VRAMPOOL_DEVICE", " "), ("VRAMPOOL_SIM_BYTES", "")]).unwrap(), Config::default());
    }

    #[test]
    fn byte_counts_take_binary_suffixes() {
        assert_eq!(parse_bytes("17179869184"), Some(16 << 30));
        assert_eq!(parse_bytes("16GiB"), Some(16 << 30));
        assert_eq!(parse_bytes("16 g"), Some(16 << 30));
        assert_eq!(parse_bytes("512MB"), Some(512 << 20));
        assert_eq!(parse_bytes("64k"), Some(64 << 10));
        assert_eq!(parse_bytes("1T"), Some(1 << 40));
        for bad in ["", "GiB", "-1", "1.5G", "12 parsecs", "99999999999999999999", "20000000T"] {
            assert_eq!(parse_bytes(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn each_variable_sets_its_field() {
        let c = from(&[
            ("VRAMPOOL_DEVICE", "SIM"),
            ("VRAMPOOL_SIM_BYTES", "2GiB"),
            ("VRAMPOOL_SIM_DEVICES", "3"),
            ("VRAMPOOL_MAX_STREAMS", "17"),
            ("VRAMPOOL_MAX_RESERVED", "1G"),
            ("VRAMPOOL_MAX_CACHED", "256M"),
            ("VRAMPOOL_THREAD_CACHE_BYTES", "8M"),
            ("VRAMPOOL_LARGEST_CACHED_CLASS", "4M"),
            ("VRAMPOOL_RELEASE_THRESHOLD", "0"),
            ("VRAMPOOL_MAP_RUN_PAGES", "1"),
            ("VRAMPOOL_TRADE_PAGES", "off"),
            ("VRAMPOOL_CROSS_STREAM_WAITS", "0"),
            ("VRAMPOOL_RECORD_TRACE", "/tmp/a trace.csv"),
        ])
        .unwrap();
        assert_eq!(c.device, DeviceChoice::Sim);
        assert_eq!((c.sim_bytes, c.sim_devices, c.max_streams), (2 << 30, 3, 17));
        assert_eq!(c.pool.max_reserved, Some(1 << 30));
        assert_eq!(c.pool.max_cached_bytes, Some(256 << 20));
        assert_eq!(c.pool.thread_cache_bytes, 8 << 20);
        assert_eq!(c.pool.largest_cached_class, 4 << 20);
        assert_eq!(c.pool.release_threshold, 0);
        assert_eq!(c.pool.map_run_pages, 1);
        assert!(!c.pool.trade_pages_on_map);
        assert!(!c.pool.cross_stream_waits);
        assert_eq!(c.pool.record_trace, Some("/tmp/a trace.csv".into()), "a path is taken as written");
    }

    #[test]
    fn switches_take_the_usual_spellings() {
        for (v, on) in [("1", true), ("TRUE", true), ("on", true), ("Yes", true), ("0", false), ("false", false)] {
            assert_eq!(from(&[("VRAMPOOL_TRADE_PAGES", v)]).unwrap().pool.trade_pages_on_map, on, "{v:?}");
        }
        let e = from(&[("VRAMPOOL_CROSS_STREAM_WAITS", "maybe")]).unwrap_err().to_string();
        assert!(e.contains("VRAMPOOL_CROSS_STREAM_WAITS") && e.contains("maybe") && e.contains("on, off"), "{e}");
    }

    #[test]
    fn the_listed_defaults_are_the_defaults() {
        let d = Config::default().pool;
        let listed = |name: &str| VARIABLES.iter().find(|(n, _)| *n == name).map(|(_, what)| *what).unwrap();
        let cases = [
            ("VRAMPOOL_THREAD_CACHE_BYTES", format!("(default {}MiB)", d.thread_cache_bytes >> 20)),
            ("VRAMPOOL_LARGEST_CACHED_CLASS", format!("(default {}MiB)", d.largest_cached_class >> 20)),
            ("VRAMPOOL_MAP_RUN_PAGES", format!("(default {})", d.map_run_pages)),
            ("VRAMPOOL_TRADE_PAGES", format!("(default {})", u8::from(d.trade_pages_on_map))),
            ("VRAMPOOL_CROSS_STREAM_WAITS", format!("(default {})", u8::from(d.cross_stream_waits))),
        ];
        for (name, default) in cases {
            assert!(listed(name).ends_with(&default), "{name}: {:?} should end with {default:?}", listed(name));
        }
    }

    #[test]
    fn a_bad_value_is_refused_with_its_name_and_what_it_takes() {
        for (name, value, wants) in [
            ("VRAMPOOL_DEVICE", "gpu", "sim, cuda or auto"),
            ("VRAMPOOL_SIM_BYTES", "lots", "byte count"),
            ("VRAMPOOL_SIM_BYTES", "1M", "at least 2MiB"),
            ("VRAMPOOL_SIM_DEVICES", "0", "1 to 64"),
            ("VRAMPOOL_SIM_DEVICES", "two", "whole number"),
            ("VRAMPOOL_MAX_STREAMS", "0", "1 to 1048576"),
            ("VRAMPOOL_MAX_RESERVED", "0", "more than 0"),
            ("VRAMPOOL_MAX_CACHED", "-5", "byte count"),
            ("VRAMPOOL_MAP_RUN_PAGES", "0", "1 to 64"),
            ("VRAMPOOL_MAP_RUN_PAGES", "65", "1 to 64"),
            ("VRAMPOOL_MAP_RUN_PAGES", "4k", "whole number"),
        ] {
            let msg = from(&[(name, value)]).unwrap_err().to_string();
            assert!(msg.contains(name) && msg.contains(wants), "{msg}");
            if wants != "at least 2MiB" {
                assert!(msg.contains(value), "{msg}");
            }
        }
    }
}
