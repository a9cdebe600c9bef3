//! Reading a trace file, shared by the examples that replay traces (`#[path]`-included:
//! examples have no crate of their own to share code through).

use std::io::BufReader;

use vrampool::replay::Trace;

/// The trace at `path`: gzip'd when its name ends in `.gz`, plain CSV otherwise.
pub fn load(path: &str) -> Result<Trace, String> {
    let file = std::fs::File::open(path).map_err(|e| e.to_string())?;
    let parsed = if path.ends_with(".gz") {
        Trace::parse(BufReader::new(flate2::read::GzDecoder::new(file)))
    } else {
        Trace::parse(BufReader::new(file))
    };
    parsed.map_err(|e| e.to_string())
}
