//! The simulated device's memory: address space reserved and physical pages mapped under it,
//! as with CUDA's virtual memory calls, in host memory.
//!
//! - **Address space** is reserved with `mmap(PROT_NONE)`: it costs nothing until mapped.
//! - **Physical memory** is one anonymous memory file (`memfd_create`), as big as the device,
//!   sparse: a physical page is a page-sized offset of the file, taken on map and given back
//!   (its memory freed with `fallocate(PUNCH_HOLE)`) when its last mapping goes. `map` puts
//!   fresh pages under an address range (`mmap(MAP_SHARED | MAP_FIXED)` of the file), `alias`
//!   puts the pages already mapped at one range under another as well (the same memory at two
//!   addresses, as `cuMemMap` of a retained allocation handle does), and `unmap` puts the
//!   reservation back (`mmap(PROT_NONE | MAP_FIXED)`), so touching an unmapped page faults,
//!   as it does on a GPU.
//! - As on CUDA, an unmap names exactly the range of one earlier map or alias call; a map
//!   lands only where nothing is mapped, inside a reservation; physical capacity is enforced
//!   on map (an alias takes none).
//! - Where no memory file can be made (a kernel without `memfd_create`), mapping changes the
//!   reservation's protection instead and aliasing is refused with [`Error::Unsupported`].
//!
//! The device plays the part of the hardware and the driver, so one `std` mutex guards the
//! books (never the `sync` facade: loom models must not see it).

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use super::{lock, sim_err};
use crate::error::{Error, Result};

/// The memory of one simulated device. See the module docs.
pub(super) struct Memory {
    capacity: u64,
    granularity: u64,
    /// The memory file, or -1 when there is none (see the module docs).
    fd: i32,
    state: Mutex<State>,
    /// Physical bytes in use.
    committed: AtomicU64,
}

#[derive(Default)]
struct State {
    /// Reserved ranges: base → length.
    reservations: HashMap<u64, u64>,
    /// Mapped pages: address → physical page (its offset in the file; its own address
    /// without a file).
    pages: BTreeMap<u64, u64>,
    /// Each map or alias call's range (base → length): an unmap must name exactly one.
    mappings: HashMap<u64, u64>,
    /// How many mapped pages show each physical page.
    refs: HashMap<u64, u32>,
    /// Physical pages given back, for reuse.
    spare: Vec<u64>,
    /// Physical pages from here on were never used.
    next: u64,
    /// Sticky fault: once a stream touched memory it must not, every call fails (a CUDA
    /// context is dead after an illegal address).
    fault: Option<String>,
}

impl Drop for Memory {
    fn drop(&mut self) {
        if self.fd >= 0 {
            // SAFETY: the file descriptor is ours alone, closed once.
            unsafe { libc::close(self.fd) };
        }
    }
}

impl Memory {
    pub(super) fn new(capacity: u64, granularity: u64) -> Memory {
        // SAFETY: memfd_create takes a NUL-terminated name and flags; it touches no memory of
        // ours. The file is then sized (sparse: no memory is used until written).
        let fd = unsafe {
            let fd = libc::memfd_create(c"vrampool-sim".as_ptr(), libc::MFD_CLOEXEC);
            if fd >= 0 && libc::ftruncate(fd, capacity.min(i64::MAX as u64) as libc::off_t) != 0 {
                libc::close(fd);
                -1
            } else {
                fd
            }
        };
        Memory { capacity, granularity, fd, state: Mutex::new(State::default()), committed: AtomicU64::new(0) }
    }

    /// Physical bytes in use.
    pub(super) fn committed(&self) -> u64 {
        self.committed.load(Ordering::Acquire)
    }

    /// Whether the device can alias (it has a memory file).
    pub(super) fn can_alias(&self) -> bool {
        self.fd >= 0
    }

    pub(super) fn fault(&self) -> Option<String> {
        lock(&self.state).fault.clone()
    }

    pub(super) fn set_fault(&self, why: String) {
        lock(&self.state).fault.get_or_insert(why);
    }

    /// Whether every byte of `[addr, addr + len)` lies on mapped pages.
    pub(super) fn is_mapped(&self, addr: u64, len: usize) -> bool {
        if len == 0 {
            return true;
        }
        let g = self.granularity;
        let Some(end) = addr.checked_add(len as u64) else { return false };
        let st = lock(&self.state);
        let mut page = addr / g * g;
        while page < end {
            if !st.pages.contains_key(&page) {
                return false;
            }
            page += g;
        }
        true
    }

    fn aligned(&self, what: &str, addr: u64, len: u64) -> Result<()> {
        let g = self.granularity;
        if len == 0 || addr % g != 0 || len % g != 0 {
            return Err(Error::InvalidArgument(format!("{what} [{addr:#x}, +{len}) is not granularity-aligned")));
        }
        Ok(())
    }

    pub(super) fn reserve(&self, bytes: u64) -> Result<u64> {
        let g = self.granularity;
        if bytes == 0 || bytes % g != 0 {
            return Err(Error::InvalidArgument(format!("reserve size {bytes} is not a positive multiple of {g}")));
        }
        // Over-reserve by one granule so the base can be aligned, then give the slack back.
        let total = usize::try_from(bytes + g).map_err(|_| Error::InvalidArgument("reserve size too large".into()))?;
        // SAFETY: an anonymous PROT_NONE mapping at an address of the kernel's choosing
        // touches no existing memory.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                total,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(sim_err("cuMemAddressReserve", std::io::Error::last_os_error().to_string()));
        }
        let start = p as u64;
        let base = start.div_ceil(g) * g;
        let head = (base - start) as usize;
        let tail = total - head - bytes as usize;
        // SAFETY: both pieces lie inside the mapping just made and outside [base, base+bytes).
        unsafe {
            if head > 0 {
                libc::munmap(p, head);
            }
            if tail > 0 {
                libc::munmap((base + bytes) as *mut libc::c_void, tail);
            }
        }
        lock(&self.state).reservations.insert(base, bytes);
        Ok(base)
    }

    /// # Safety
    /// No work still uses addresses in the range.
    pub(super) unsafe fn release(&self, base: u64, bytes: u64) -> Result<()> {
        let mut st = lock(&self.state);
        if st.reservations.get(&base) != Some(&bytes) {
            return Err(Error::InvalidArgument(format!("[{base:#x}, +{bytes}) is not a reservation")));
        }
        if st.pages.range(base..base + bytes).next().is_some() {
            return Err(sim_err("cuMemAddressFree", "pages are still mapped in the range"));
        }
        st.reservations.remove(&base);
        // SAFETY: the range is exactly one reservation made by `reserve`, with nothing mapped;
        // the caller guarantees nothing still uses it.
        unsafe { libc::munmap(base as *mut libc::c_void, bytes as usize) };
        Ok(())
    }

    /// Checks shared by map and alias: `[to, +len)` inside a reservation, nothing mapped.
    fn free_target(&self, st: &State, to: u64, len: u64, call: &'static str) -> Result<()> {
        let inside = st.reservations.iter().any(|(&b, &l)| to >= b && to.saturating_add(len) <= b + l);
        if !inside {
            return Err(Error::InvalidArgument(format!("{call} [{to:#x}, +{len}) is outside every reservation")));
        }
        if st.pages.range(to..to + len).next().is_some() {
            return Err(sim_err(call, "part of the range is already mapped"));
        }
        Ok(())
    }

    /// Show physical page `phys` at page `at` (no book-keeping).
    fn show(&self, at: u64, phys: u64) -> Result<()> {
        let g = self.granularity as usize;
        // SAFETY: `at` is a page of one of our reservations with nothing mapped there (checked
        // by the callers), so replacing its mapping touches no other memory; with a file, the
        // page is a page-aligned offset inside it.
        let rc = unsafe {
            if self.fd >= 0 {
                let p = libc::mmap(
                    at as *mut libc::c_void,
                    g,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED | libc::MAP_FIXED,
                    self.fd,
                    phys as libc::off_t,
                );
                if p == libc::MAP_FAILED {
                    -1
                } else {
                    0
                }
            } else {
                libc::mprotect(at as *mut libc::c_void, g, libc::PROT_READ | libc::PROT_WRITE)
            }
        };
        if rc != 0 {
            return Err(sim_err("cuMemMap", std::io::Error::last_os_error().to_string()));
        }
        Ok(())
    }

    /// Put the reservation back at page `at` (its contents there are gone).
    fn hide(&self, at: u64) {
        let g = self.granularity as usize;
        // SAFETY: `at` is a mapped page of one of our reservations that nothing uses any more
        // (the callers' contract); replacing it with a fresh PROT_NONE mapping keeps the
        // address space reserved and makes later use fault.
        unsafe {
            if self.fd >= 0 {
                libc::mmap(
                    at as *mut libc::c_void,
                    g,
                    libc::PROT_NONE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED | libc::MAP_NORESERVE,
                    -1,
                    0,
                );
            } else {
                libc::madvise(at as *mut libc::c_void, g, libc::MADV_DONTNEED);
                libc::mprotect(at as *mut libc::c_void, g, libc::PROT_NONE);
            }
        }
    }

    /// Map fresh physical memory under `[addr, addr + len)`, as one allocation.
    pub(super) fn map(&self, addr: u64, len: u64) -> Result<()> {
        self.aligned("map", addr, len)?;
        let g = self.granularity;
        let mut st = lock(&self.state);
        self.free_target(&st, addr, len, "cuMemMap")?;
        let used = self.committed();
        if used + len > self.capacity {
            return Err(Error::Device {
                call: "cuMemCreate",
                code: 2,
                message: format!("out of memory: {used} of {} bytes mapped, {len} more asked", self.capacity).into(),
            });
        }
        let mut shown = Vec::new();
        for at in (addr..addr + len).step_by(g as usize) {
            let phys = if self.fd < 0 {
                at
            } else {
                st.spare.pop().unwrap_or_else(|| {
                    st.next += g;
                    st.next - g
                })
            };
            if let Err(e) = self.show(at, phys) {
                // Undo the pages shown so far: nothing is left half mapped, and their
                // physical pages (never counted) are spare again.
                for &(a, p) in shown.iter().chain([(at, phys)].iter()) {
                    if a != at {
                        self.hide(a);
                    }
                    if self.fd >= 0 {
                        st.spare.push(p);
                    }
                }
                return Err(e);
            }
            shown.push((at, phys));
        }
        for (at, phys) in shown {
            st.pages.insert(at, phys);
            st.refs.insert(phys, 1);
        }
        st.mappings.insert(addr, len);
        self.committed.fetch_add(len, Ordering::AcqRel);
        Ok(())
    }

    /// Map at `[to, to + len)` the physical memory mapped now at `[from, from + len)` (exactly
    /// one earlier map or alias call's range), which stays mapped there too.
    pub(super) fn alias(&self, from: u64, to: u64, len: u64) -> Result<()> {
        if self.fd < 0 {
            return Err(Error::Unsupported("aliasing needs memfd_create, which this kernel lacks"));
        }
        self.aligned("alias", to, len)?;
        let g = self.granularity;
        let mut st = lock(&self.state);
        if st.mappings.get(&from) != Some(&len) {
            return Err(sim_err("cuMemMap", format!("[{from:#x}, +{len}) is not exactly one mapping")));
        }
        self.free_target(&st, to, len, "cuMemMap")?;
        let physical: Vec<u64> = (from..from + len).step_by(g as usize).map(|a| st.pages[&a]).collect();
        for (i, &phys) in physical.iter().enumerate() {
            let at = to + i as u64 * g;
            if let Err(e) = self.show(at, phys) {
                for j in 0..i {
                    self.hide(to + j as u64 * g);
                }
                return Err(e);
            }
        }
        for (i, phys) in physical.into_iter().enumerate() {
            st.pages.insert(to + i as u64 * g, phys);
            *st.refs.entry(phys).or_insert(0) += 1;
        }
        st.mappings.insert(to, len);
        Ok(())
    }

    /// A physical page shows nowhere any more: its memory goes back.
    fn give_back(&self, st: &mut State, phys: u64) {
        st.refs.remove(&phys);
        if self.fd >= 0 {
            // SAFETY: punching a hole in our own memory file at a page-aligned offset frees
            // that page's memory; no mapping shows it any more.
            unsafe {
                libc::fallocate(
                    self.fd,
                    libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                    phys as libc::off_t,
                    self.granularity as libc::off_t,
                )
            };
            st.spare.push(phys);
        }
        self.committed.fetch_sub(self.granularity, Ordering::AcqRel);
    }

    /// Unmap exactly one map or alias call's range; physical pages it showed alone go back.
    ///
    /// # Safety
    /// No work, queued or running, may still use the range; its contents there are lost.
    pub(super) unsafe fn unmap(&self, addr: u64, len: u64) -> Result<()> {
        self.aligned("unmap", addr, len)?;
        let g = self.granularity;
        let mut st = lock(&self.state);
        if st.mappings.get(&addr) != Some(&len) {
            // cuMemUnmap: "the range must be the entire contiguous address range that was
            // mapped to"; part of a mapping, or two of them, is refused.
            return Err(Error::Device {
                call: "cuMemUnmap",
                code: 1,
                message: format!("[{addr:#x}, +{len}) is not exactly one mapping").into(),
            });
        }
        st.mappings.remove(&addr);
        for at in (addr..addr + len).step_by(g as usize) {
            self.hide(at);
            if let Some(phys) = st.pages.remove(&at) {
                let left = st.refs.get_mut(&phys).map(|r| {
                    *r -= 1;
                    *r
                });
                if left == Some(0) {
                    self.give_back(&mut st, phys);
                }
            }
        }
        Ok(())
    }
}
