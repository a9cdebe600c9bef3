//! The final report: the tiers' figures as a table, and the files of `--report DIR`:
//! `snapshot.json` (a [`Snapshot`] of the pool mid-run), `memory.svg` (that snapshot, a row
//! per mapped range, blocks coloured by state) and `timeline.svg` (live and reserved bytes
//! over the run).

use std::fmt::Write as _;
use std::path::Path;

use vrampool::{BlockState, Snapshot, Stats};

use super::work::Error;

const MIB: f64 = (1u64 << 20) as f64;

pub fn mib(b: u64) -> String {
    format!("{:.1} MiB", b as f64 / MIB)
}

/// Nanoseconds as milliseconds.
pub fn ms(ns: u64) -> String {
    format!("{:.1} ms", ns as f64 / 1e6)
}

fn pct(a: u64, b: u64) -> String {
    if b == 0 {
        "-".into()
    } else {
        format!("{:.1}%", 100.0 * a as f64 / b as f64)
    }
}

/// The tiers' figures, one row per tier.
pub fn tier_table(s: &Stats) -> String {
    let misses = s.allocs.saturating_sub(s.t0_hits + s.t1_hits);
    let rows = [
        (
            "T0 thread caches",
            format!(
                "{} hits ({}), {} cached now in {} caches",
                s.t0_hits,
                pct(s.t0_hits, s.allocs),
                mib(s.thread_cached_bytes),
                s.thread_caches
            ),
        ),
        (
            "T1 stream depots",
            format!("{} hits ({}), {} cached now", s.t1_hits, pct(s.t1_hits, s.allocs), mib(s.depot_bytes)),
        ),
        (
            "T2 retiring",
            format!(
                "{} now (record_stream blocks), {} batches retired, {} events recorded ({} asked of \
                 other threads' streams, {} hurries skipped while records were slow), {} queried",
                mib(s.retiring_bytes),
                s.batches_retired,
                s.events_recorded,
                s.records_asked,
                s.hurries_skipped,
                s.events_queried
            ),
        ),
        (
            "T3 arena",
            format!(
                "{misses} misses ({}), {} same-stream reuses, {} device waits ({} reuses covered by \
                 earlier ones), {} free in streams' chunks",
                pct(misses, s.allocs),
                s.same_stream_reuses,
                s.device_waits,
                s.covered_reuses,
                mib(s.stream_free_bytes)
            ),
        ),
        (
            "ladder",
            format!(
                "{} flushes, {} maps, {} host waits, {} steals, {} out-of-memory; {} below the caches \
                 (allocating {}, freeing {}), of which {} mapping and {} unmapping; {} in event calls \
                 (recording {}, of which {} in {} records for placements waiting on frees; querying {}, device \
                 waits {}, capture checks {})",
                s.ladder_flushes,
                s.ladder_maps,
                s.ladder_waits,
                s.ladder_steals,
                s.ooms,
                ms(s.ladder_ns + s.release_ns),
                ms(s.ladder_ns),
                ms(s.release_ns),
                ms(s.map_ns),
                ms(s.unmap_ns),
                ms(s.event_ns),
                ms(s.record_ns),
                ms(s.reuse_record_ns),
                s.reuse_records,
                ms(s.query_ns),
                ms(s.wait_ns),
                ms(s.capture_ns)
            ),
        ),
        (
            "pages",
            format!(
                "{} reserved now, {} at peak; {} mapped and {} unmapped over the run, {} pages lent",
                mib(s.reserved_bytes),
                mib(s.peak_reserved_bytes),
                mib(s.mapped_bytes),
                mib(s.unmapped_bytes),
                s.pages_lent
            ),
        ),
    ];
    let w = rows.iter().map(|r| r.0.len()).max().unwrap_or(0);
    let mut out = format!("{:w$}  {}\n{:-<w$}  {:-<60}\n", "tier", "figures", "", "");
    for (k, v) in rows {
        let _ = writeln!(out, "{k:w$}  {v}");
    }
    out
}

/// One sample of the timeline.
#[derive(Clone, Copy)]
pub struct Sample {
    pub t: f64,
    /// The most bytes the workers had asked for and not freed since the last sample.
    pub live: u64,
    pub reserved: u64,
}

fn colour(s: BlockState) -> &'static str {
    match s {
        BlockState::Live => "#e4572e",
        BlockState::Cached => "#2e86ab",
        BlockState::Retiring => "#a23b72",
        BlockState::Free => "#d9d9d9",
    }
}

const STATES: [BlockState; 4] = [BlockState::Live, BlockState::Cached, BlockState::Retiring, BlockState::Free];

fn name(s: BlockState) -> &'static str {
    match s {
        BlockState::Live => "live",
        BlockState::Cached => "cached",
        BlockState::Retiring => "retiring",
        BlockState::Free => "free",
    }
}

/// The snapshot as a picture: each mapped range starts a row (a long one wraps onto more),
/// each pixel coloured by the state holding most of its bytes.
pub fn memory_svg(snap: &Snapshot, title: &str) -> String {
    const W: u64 = 1100;
    const LEFT: u64 = 130;
    const ROW_H: u64 = 18;
    let mapped: u64 = snap.segments.iter().map(|s| s.bytes).sum();
    // About 24 rows for everything mapped, in whole pages per row.
    let page = snap.page_size.max(1);
    let per_row = (mapped / 24).max(page).div_ceil(page) * page;
    let bpp = per_row.div_ceil(W).max(1);
    let mut rows = String::new();
    let mut y = 70;
    for seg in &snap.segments {
        let mut start = seg.addr;
        let end = seg.addr + seg.bytes;
        while start < end {
            let stop = (start + per_row).min(end);
            let px = (stop - start).div_ceil(bpp);
            let _ = write!(rows, r#"<text x="{}" y="{}" class="addr">{:#x}</text>"#, LEFT - 8, y + ROW_H - 5, start);
            // Bytes of each state in each pixel of the row.
            let mut acc = vec![[0u64; 4]; px as usize];
            for e in seg.extents.iter().filter(|e| e.addr < stop && e.addr + e.bytes > start) {
                let (lo, hi) = (e.addr.max(start), (e.addr + e.bytes).min(stop));
                let si = STATES.iter().position(|&s| s == e.state).unwrap_or(3);
                let (mut a, first, last) = (lo, (lo - start) / bpp, (hi - 1 - start) / bpp);
                for p in first..=last {
                    let pend = (start + (p + 1) * bpp).min(hi);
                    acc[p as usize][si] += pend - a;
                    a = pend;
                }
            }
            let mut p = 0usize;
            while p < acc.len() {
                let best = |c: &[u64; 4]| (0..4).max_by_key(|&i| (c[i], 3 - i)).unwrap_or(3);
                let s = best(&acc[p]);
                let q = (p..acc.len()).find(|&q| best(&acc[q]) != s).unwrap_or(acc.len());
                let _ = write!(
                    rows,
                    r#"<rect x="{}" y="{y}" width="{}" height="{ROW_H}" fill="{}"/>"#,
                    LEFT + p as u64,
                    q - p,
                    colour(STATES[s])
                );
                p = q;
            }
            y += ROW_H + 4;
            start = stop;
        }
    }
    let mut legend = String::new();
    let sums = [snap.live_bytes, snap.cached_bytes, snap.retiring_bytes, snap.free_bytes];
    for (i, s) in STATES.iter().enumerate() {
        let x = LEFT + i as u64 * 230;
        let _ = write!(
            legend,
            r#"<rect x="{x}" y="38" width="14" height="14" fill="{}"/><text x="{}" y="50">{} {}</text>"#,
            colour(*s),
            x + 20,
            name(*s),
            mib(sums[i])
        );
    }
    let h = y + 30;
    format!(
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{tw}" height="{h}" viewBox="0 0 {tw} {h}" font-family="sans-serif" font-size="13">
<style>.addr {{ font-family: monospace; font-size: 11px; text-anchor: end; fill: #444 }}</style>
<rect width="100%" height="100%" fill="white"/>
<text x="{LEFT}" y="22" font-size="16" font-weight="bold">{title}</text>
{legend}
{rows}
<text x="{LEFT}" y="{foot}" fill="#555">each row: one mapped range (wrapped every {row}); one pixel: {px_b}, coloured by the state holding most of it</text>
</svg>
"##,
        tw = LEFT + W + 20,
        foot = y + 16,
        row = mib(per_row),
        px_b = if bpp >= 1 << 20 { mib(bpp) } else { format!("{:.0} KiB", bpp as f64 / 1024.0) },
    )
}

/// Live and reserved bytes over the run (sampled), with their exact peaks (`peaks`: live,
/// reserved) and the moment of the snapshot marked.
pub fn timeline_svg(samples: &[Sample], peaks: (u64, u64), snapshot_at: Option<f64>, title: &str) -> String {
    const W: f64 = 1000.0;
    const H: f64 = 380.0;
    const L: f64 = 80.0;
    const T: f64 = 60.0;
    let t_max = samples.last().map_or(1.0, |s| s.t).max(1e-3);
    let y_max = samples.iter().map(|s| s.reserved.max(s.live)).max().unwrap_or(1).max(1) as f64 / MIB * 1.15;
    let x = |t: f64| L + t / t_max * W;
    let y = |b: u64| T + H - (b as f64 / MIB) / y_max * H;
    let line = |f: &dyn Fn(&Sample) -> u64| {
        samples.iter().map(|s| format!("{:.1},{:.1}", x(s.t), y(f(s)))).collect::<Vec<_>>().join(" ")
    };
    let mut axes = String::new();
    let step = nice_step(y_max / 5.0);
    let mut v = 0.0;
    while v <= y_max {
        let yy = T + H - v / y_max * H;
        let _ = write!(
            axes,
            r##"<line x1="{L}" x2="{}" y1="{yy:.1}" y2="{yy:.1}" stroke="#eee"/><text x="{}" y="{:.1}" text-anchor="end">{v:.0}</text>"##,
            L + W,
            L - 6.0,
            yy + 4.0
        );
        v += step;
    }
    let tstep = nice_step(t_max / 8.0);
    let mut t = 0.0;
    while t <= t_max + 1e-9 {
        let _ = write!(axes, r#"<text x="{:.1}" y="{}" text-anchor="middle">{t:.0}</text>"#, x(t), T + H + 18.0);
        t += tstep;
    }
    let mark = snapshot_at.map_or(String::new(), |t| {
        format!(
            r##"<line x1="{0:.1}" x2="{0:.1}" y1="{T}" y2="{1}" stroke="#888" stroke-dasharray="4 3"/><text x="{2:.1}" y="{3}" fill="#555">snapshot</text>"##,
            x(t),
            T + H,
            x(t) + 4.0,
            T + 14.0
        )
    });
    let (peak_live, peak_res) = peaks;
    format!(
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{sw}" height="{sh}" viewBox="0 0 {sw} {sh}" font-family="sans-serif" font-size="13">
<rect width="100%" height="100%" fill="white"/>
<text x="{L}" y="24" font-size="16" font-weight="bold">{title}</text>
<rect x="{L}" y="34" width="14" height="4" fill="#2e86ab" transform="translate(0,5)"/><text x="{l1}" y="46">reserved (mapped), peak {pr}</text>
<rect x="{l2}" y="34" width="14" height="4" fill="#e4572e" transform="translate(0,5)"/><text x="{l3}" y="46">live (bytes asked for, not yet freed; the peak of each 0.1 s), peak {pl}</text>
{axes}
<line x1="{L}" x2="{L}" y1="{T}" y2="{bottom}" stroke="#444"/><line x1="{L}" x2="{right}" y1="{bottom}" y2="{bottom}" stroke="#444"/>
<text x="{L}" y="{xl}" fill="#555">seconds</text><text x="16" y="{T}" fill="#555">MiB</text>
{mark}
<polyline fill="none" stroke="#2e86ab" stroke-width="2" points="{res}"/>
<polyline fill="none" stroke="#e4572e" stroke-width="1.5" points="{live}"/>
</svg>
"##,
        sw = L + W + 30.0,
        sh = T + H + 50.0,
        l1 = L + 20.0,
        l2 = L + 330.0,
        l3 = L + 350.0,
        pr = mib(peak_res),
        pl = mib(peak_live),
        bottom = T + H,
        right = L + W,
        xl = T + H + 40.0,
        res = line(&|s| s.reserved),
        live = line(&|s| s.live),
    )
}

fn nice_step(raw: f64) -> f64 {
    let p = 10f64.powf(raw.max(1e-9).log10().floor());
    [1.0, 2.0, 5.0, 10.0].iter().map(|m| m * p).find(|&s| s >= raw).unwrap_or(10.0 * p)
}

/// Write the three files into `dir` (made if missing).
pub fn write_files(dir: &Path, snap: &Snapshot, memory: &str, timeline: &str) -> Result<(), Error> {
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let write = |name: &str, body: &str| {
        std::fs::write(dir.join(name), body).map_err(|e| format!("cannot write {}: {e}", dir.join(name).display()))
    };
    write("snapshot.json", &serde_json::to_string_pretty(snap)?)?;
    write("memory.svg", memory)?;
    write("timeline.svg", timeline)?;
    Ok(())
}
