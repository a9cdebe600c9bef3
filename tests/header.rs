//! `include/vrampool.h` is what cbindgen makes of the crate's C ABI (`src/ffi/mod.rs` and
//! `src/ffi/status.rs`) with
//! `cbindgen.toml`: the test regenerates it and fails on any difference, so the committed
//! header cannot drift from the code. `VRAMPOOL_BLESS=1` writes the new header instead.

use std::path::Path;

#[test]
fn the_committed_header_is_what_the_code_generates() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(root.join("cbindgen.toml")).expect("cbindgen.toml parses");
    // The ABI's two files only: the crate's other public constants are not the C API.
    let bindings = cbindgen::Builder::new()
        .with_src(root.join("src/ffi/mod.rs"))
        .with_src(root.join("src/ffi/status.rs"))
        .with_config(config)
        .generate()
        .expect("cbindgen reads the crate");
    let mut generated = Vec::new();
    bindings.write(&mut generated);
    let generated = String::from_utf8(generated).expect("the header is UTF-8");
    let path = root.join("include/vrampool.h");
    if std::env::var_os("VRAMPOOL_BLESS").is_some() {
        std::fs::write(&path, &generated).expect("write include/vrampool.h");
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    if committed != generated {
        let line = committed.lines().zip(generated.lines()).position(|(a, b)| a != b);
        panic!(
            "include/vrampool.h differs from what src/ffi generates (first differing line: {:?});\n\
             regenerate it with `VRAMPOOL_BLESS=1 cargo test --test header` and commit it",
            line.map(|l| l + 1)
        );
    }
    for needed in [
        "void *vrampool_malloc(ssize_t size, int device, void *stream);",
        "void vrampool_free(void *ptr, ssize_t size, int device, void *stream);",
        "int vrampool_free_any(void *ptr, size_t *size, int *device, void **stream);",
        "int vrampool_record_stream(void *ptr, void *stream);",
        "int vrampool_empty_cache(void);",
        "int vrampool_stream_destroyed(int device, void *stream);",
        "size_t vrampool_stats_json(int device, char *buf, size_t len);",
        "const char *vrampool_last_error(void);",
        "#include <stddef.h>",
        "#include <sys/types.h>",
    ] {
        assert!(generated.contains(needed), "the header lacks `{needed}`");
    }
}
