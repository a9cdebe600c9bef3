//! The table's slots: one anonymous mapping, reserved without swap and zero until written,
//! so the slots of the untouched range cost no memory (a loom build uses a boxed slice: its
//! atomics cannot live in raw memory).

use super::Slot;
use crate::error::Result;

#[cfg(not(loom))]
pub(super) struct Storage {
    ptr: std::ptr::NonNull<Slot>,
    len: usize,
}

// SAFETY: the mapping is owned by the storage and only reached through `&Slot`s, whose
// fields are atomics.
#[cfg(not(loom))]
unsafe impl Send for Storage {}
// SAFETY: as above.
#[cfg(not(loom))]
unsafe impl Sync for Storage {}

#[cfg(not(loom))]
impl Storage {
    pub(super) fn new(len: usize) -> Result<Storage> {
        let bytes = len.checked_mul(std::mem::size_of::<Slot>()).filter(|&b| b > 0 && b <= isize::MAX as usize);
        let bytes = bytes.ok_or_else(|| {
            crate::Error::InvalidArgument(format!("a live-block table of {len} slots cannot be mapped"))
        })?;
        // SAFETY: an anonymous private mapping at an address of the kernel's choosing: no
        // memory of ours is touched or replaced.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            let err = std::io::Error::last_os_error();
            return Err(crate::Error::Device {
                call: "mmap",
                code: err.raw_os_error().unwrap_or(-1) as i64,
                message: Box::new(format!("cannot reserve {bytes} B for the C ABI's live-block table: {err}")),
            });
        }
        // Small pages only: a huge page would commit 2 MiB of slots (21 MiB of device
        // range) where one block starts. Advice only: the table works without it.
        // SAFETY: advice on our own fresh mapping.
        let _ = unsafe { libc::madvise(p, bytes, libc::MADV_NOHUGEPAGE) };
        // All-zero bytes are a valid `Slot` (three atomic zeros: free, never used); a
        // successful mmap without MAP_FIXED never returns null.
        let ptr = std::ptr::NonNull::new(p.cast::<Slot>())
            .ok_or_else(|| crate::Error::InvalidArgument("mmap returned a null table".into()))?;
        Ok(Storage { ptr, len })
    }

    #[inline(always)]
    pub(super) fn len(&self) -> usize {
        self.len
    }

    pub(super) fn as_ptr(&self) -> *const Slot {
        self.ptr.as_ptr()
    }

    #[inline(always)]
    pub(super) fn get(&self, idx: usize) -> &Slot {
        assert!(idx < self.len, "slot {idx} outside a table of {}", self.len);
        // SAFETY: in bounds of the mapping, which lives as long as `self`; zeroed memory is a
        // valid `Slot`.
        unsafe { &*self.ptr.as_ptr().add(idx) }
    }

    /// `f` over the slots of the pages that were ever written (mincore tells them apart
    /// from the untouched zero pages, which are never read).
    pub(super) fn touched<T>(&self, mut f: impl FnMut(usize, &Slot) -> Option<T>) -> Vec<T> {
        let page = page_size();
        let bytes = self.len * std::mem::size_of::<Slot>();
        let pages = bytes.div_ceil(page);
        let mut resident = vec![0u8; pages];
        // SAFETY: the range is our mapping and `resident` has one byte per page of it.
        let rc = unsafe { libc::mincore(self.ptr.as_ptr().cast(), bytes, resident.as_mut_ptr()) };
        let mut out = Vec::new();
        for (p, &r) in resident.iter().enumerate() {
            if rc == 0 && r & 1 == 0 {
                continue;
            }
            let first = (p * page).div_ceil(std::mem::size_of::<Slot>());
            let last = (((p + 1) * page).div_ceil(std::mem::size_of::<Slot>())).min(self.len);
            out.extend((first..last).filter_map(|i| f(i, self.get(i))));
        }
        out
    }
}

#[cfg(not(loom))]
impl Drop for Storage {
    fn drop(&mut self) {
        let bytes = self.len * std::mem::size_of::<Slot>();
        // SAFETY: the mapping made in `new`, unmapped once; no `&Slot` outlives `self`.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), bytes) };
    }
}

#[cfg(not(loom))]
fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as usize
    } else {
        4096
    }
}

#[cfg(loom)]
pub(super) struct Storage(Box<[Slot]>);

#[cfg(loom)]
impl Storage {
    pub(super) fn new(len: usize) -> Result<Storage> {
        Ok(Storage((0..len).map(|_| Slot::default()).collect()))
    }

    pub(super) fn len(&self) -> usize {
        self.0.len()
    }

    pub(super) fn get(&self, idx: usize) -> &Slot {
        &self.0[idx]
    }

    pub(super) fn as_ptr(&self) -> *const Slot {
        self.0.as_ptr()
    }

    pub(super) fn touched<T>(&self, f: impl FnMut(usize, &Slot) -> Option<T>) -> Vec<T> {
        let mut f = f;
        self.0.iter().enumerate().filter_map(|(i, s)| f(i, s)).collect()
    }
}
