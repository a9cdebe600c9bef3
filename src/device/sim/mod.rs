//! `SimDevice`: a simulated GPU in host memory, exactly as strict as CUDA.
//!
//! It plays the part of the hardware and the driver, so it uses `std` locks and threads on
//! purpose (never the `sync` facade: loom models must not see it).
//!
//! - **Memory** (module `memory`) is one host address range reserved with `mmap(PROT_NONE)`, with the pages of a sparse memory file mapped under it; a page can be shown at two addresses (aliasing); it used to be committed page
//!   by page (`mprotect` to read-write on map; `madvise(DONTNEED)` and back to `PROT_NONE` on
//!   unmap), so untouched memory costs nothing and a pool can manage tens of GiB on a laptop.
//!   Device addresses are host addresses: a host function may read and write them as a kernel
//!   would, and touching an unmapped page faults, as it does on a GPU. Physical capacity is
//!   enforced on map.
//! - **Streams** are FIFO queues, each run by its own worker thread. Each operation gets a
//!   sequence number; the stream's `completed` counter says how far the worker has got.
//! - **Events** follow CUDA's rules: never recorded ⇒ complete; recording again replaces the
//!   earlier record (the event then names the new position); complete only once the stream's
//!   worker has passed the recorded position. `stream_wait_event` enqueues a wait on the
//!   event's record as of the call.
//! - **Host functions** run on the worker in stream order; every device call made from inside
//!   one fails with [`Error::NotPermitted`], as CUDA's do.
//! - **Raw handles are reused** after a stream is destroyed (the lowest free value first), as
//!   the driver reuses `CUstream` values, so tests can show that stream ids do not follow them.
//! - **Capture**: [`SimDevice::begin_capture`] puts a stream in capture mode; while it is,
//!   anything that would need the stream's work to have run (event record, query and
//!   synchronize, host functions, copies) fails with [`Error::StreamCapturing`] — stricter
//!   than CUDA, never more forgiving.
//! - **Driver costs** are off unless asked for ([`SimDevice::builder`] with
//!   [`SimCosts`]): then maps, unmaps and event calls take the time a GPU driver's do, on the
//!   calling thread, maps and unmaps serialised under one driver lock (the model is in
//!   [`super::costs`]). Whatever the costs, the device counts the bytes it mapped and unmapped
//!   over its life ([`SimDevice::mapped_bytes_total`], [`SimDevice::unmapped_bytes_total`]).

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};

use super::costs::{self, DriverLock, SimCosts};
use super::{implement, in_host_fn_error, Device, DeviceKind, Event, HostFn, MemInfo, Stream};
use crate::error::{Error, Result};

mod memory;
use memory::Memory;

fn check_not_in_host_fn() -> Result<()> {
    if super::in_host_fn() {
        Err(in_host_fn_error())
    } else {
        Ok(())
    }
}

fn sim_err(call: &'static str, message: impl Into<String>) -> Error {
    Error::Device { call, code: -1, message: Box::new(message.into()) }
}

/// Locks in the simulator are never held across user code, so a poisoned one only means a
/// panic elsewhere in a test: keep going with the data.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A simulated GPU. Cheap to clone: clones are the same device.
#[derive(Clone)]
pub struct SimDevice {
    inner: Arc<SimInner>,
}

struct SimInner {
    capacity: u64,
    granularity: usize,
    mem: Memory,
    raws: Mutex<RawTable>,
    /// Host functions that panicked (the worker carries on, but tests want to know).
    host_fn_panics: AtomicU64,
    costs: SimCosts,
    driver: DriverLock,
    /// Bytes mapped and unmapped over the device's life.
    mapped_total: AtomicU64,
    unmapped_total: AtomicU64,
}

#[derive(Default)]
struct RawTable {
    next: u64,
    free: BTreeSet<u64>,
    live: HashMap<u64, Weak<StreamShared>>,
}

enum Op {
    Host(HostFn),
    Marker,
    /// Wait until `stream` has completed `seq`.
    Wait(Arc<StreamShared>, u64),
}

struct StreamShared {
    state: Mutex<QueueState>,
    /// Signalled when the worker completes an operation or when work is enqueued.
    cv: Condvar,
    /// Whether the stream is being captured, and `completed` as of its last store (Release,
    /// after the operation's effects): apart from `state`, because asking either costs a CUDA
    /// driver next to nothing, and behind the queue's lock, which the stream's worker takes
    /// for each host function, the pool's capture checks took 219 ms of the demo's 573 ms
    /// below its caches on two cores (four workers), its event queries as much once the
    /// checks went: costs no GPU has.
    capturing: AtomicBool,
    done: AtomicU64,
}

#[derive(Default)]
struct QueueState {
    ops: VecDeque<(u64, Op)>,
    last_seq: u64,
    completed: u64,
    closing: bool,
}

/// What a [`Stream`] of this device holds: the queue, and whether dropping the last handle
/// destroys it.
struct SimStreamHandle {
    shared: Arc<StreamShared>,
    raw: u64,
    owned: bool,
    device: Weak<SimInner>,
}

impl Drop for SimStreamHandle {
    fn drop(&mut self) {
        if self.owned {
            close_stream(&self.shared);
            if let Some(dev) = self.device.upgrade() {
                dev.free_raw(self.raw, &self.shared);
            }
        }
    }
}

fn close_stream(shared: &StreamShared) {
    let mut st = lock(&shared.state);
    st.closing = true;
    shared.cv.notify_all();
}

/// What an [`Event`] of this device holds: the stream and position of its latest record.
#[derive(Default)]
struct SimEvent {
    record: Mutex<Option<(Arc<StreamShared>, u64)>>,
}

impl StreamShared {
    /// Put `op` in stream order; its number. A marker (an event's record) on an idle stream
    /// (nothing queued, nothing running) is complete at once, as a GPU's would be, and the
    /// stream's thread is not woken: a pool records events on streams that run no work at
    /// all (a host-only bench), where a wake per event cost more than the allocations it
    /// fenced.
    fn enqueue(&self, op: Op) -> Result<u64> {
        let mut st = lock(&self.state);
        if st.closing {
            return Err(Error::StreamDestroyed);
        }
        // `completed` lags `last_seq` while an op runs (popped, not done): not idle then.
        let idle = st.ops.is_empty() && st.completed == st.last_seq;
        st.last_seq += 1;
        let seq = st.last_seq;
        if idle && matches!(op, Op::Marker) {
            st.completed = seq;
            self.done.store(seq, Ordering::Release);
        } else {
            st.ops.push_back((seq, op));
            self.cv.notify_all();
        }
        Ok(seq)
    }

    fn completed(&self) -> u64 {
        self.done.load(Ordering::Acquire)
    }

    fn wait_for(&self, seq: u64) {
        let mut st = lock(&self.state);
        while st.completed < seq {
            st = self.cv.wait(st).unwrap_or_else(|p| p.into_inner());
        }
    }

    fn run(self: Arc<Self>, device: Weak<SimInner>) {
        loop {
            let (seq, op) = {
                let mut st = lock(&self.state);
                loop {
                    if let Some(next) = st.ops.pop_front() {
                        break next;
                    }
                    if st.closing {
                        return;
                    }
                    st = self.cv.wait(st).unwrap_or_else(|p| p.into_inner());
                }
            };
            match op {
                Op::Host(f) => {
                    super::set_in_host_fn(true);
                    let outcome = catch_unwind(AssertUnwindSafe(f));
                    super::set_in_host_fn(false);
                    if outcome.is_err() {
                        if let Some(dev) = device.upgrade() {
                            dev.host_fn_panics.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
                Op::Marker => {}
                Op::Wait(other, target) => other.wait_for(target),
            }
            let mut st = lock(&self.state);
            st.completed = seq;
            self.done.store(seq, Ordering::Release);
            self.cv.notify_all();
        }
    }
}

impl SimInner {
    fn stream<'a>(&self, s: &'a Stream) -> Result<&'a SimStreamHandle> {
        let h = implement::stream_backend::<SimStreamHandle>(s)
            .ok_or_else(|| Error::InvalidArgument("stream does not belong to a simulated device".into()))?;
        if !std::ptr::eq(h.device.as_ptr(), self) {
            return Err(Error::InvalidArgument("stream belongs to another simulated device".into()));
        }
        if s.is_destroyed() {
            return Err(Error::StreamDestroyed);
        }
        Ok(h)
    }

    fn check_fault(&self) -> Result<()> {
        match self.mem.fault() {
            Some(why) => Err(sim_err("simulated device", format!("the context is dead: {why}"))),
            None => Ok(()),
        }
    }

    fn free_raw(&self, raw: u64, shared: &Arc<StreamShared>) {
        let mut t = lock(&self.raws);
        let same = t.live.get(&raw).is_some_and(|w| std::ptr::eq(w.as_ptr(), Arc::as_ptr(shared)));
        if same {
            t.live.remove(&raw);
            t.free.insert(raw);
        }
    }

    /// Whether every byte of `[addr, addr + len)` lies on mapped pages.
    fn is_mapped(&self, addr: u64, len: usize) -> bool {
        self.mem.is_mapped(addr, len)
    }

    /// Run `f` on the stream's worker once earlier work is done, checking at run time that
    /// `[addr, addr + len)` is still mapped (else the context faults, as a GPU's would).
    fn enqueue_mem_op(
        self: &Arc<Self>,
        h: &SimStreamHandle,
        addr: u64,
        len: usize,
        f: impl FnOnce() + Send + 'static,
    ) -> Result<u64> {
        if !self.is_mapped(addr, len) {
            return Err(sim_err("memory operation", format!("[{addr:#x}, +{len}) is not mapped device memory")));
        }
        let dev = Arc::downgrade(self);
        h.shared.enqueue(Op::Host(Box::new(move || {
            let Some(dev) = dev.upgrade() else { return };
            if dev.is_mapped(addr, len) {
                f();
            } else {
                dev.mem
                    .set_fault(format!("illegal address: [{addr:#x}, +{len}) was unmapped before the stream used it"));
            }
        })))
    }
}

impl SimDevice {
    /// A simulated device with `capacity` bytes of physical memory and CUDA's 2 MiB mapping
    /// granularity.
    pub fn new(capacity: u64) -> SimDevice {
        SimDevice::with_granularity(capacity, 2 << 20)
    }

    /// A simulated device with another mapping granularity (a power of two, at least the
    /// host's page size; other values are rounded up to one).
    pub fn with_granularity(capacity: u64, granularity: usize) -> SimDevice {
        SimDevice::builder(capacity).granularity(granularity).build()
    }

    /// A device of `capacity` bytes to configure: granularity (2 MiB unless set) and driver
    /// costs (none unless set).
    pub fn builder(capacity: u64) -> SimDeviceBuilder {
        SimDeviceBuilder { capacity, granularity: 2 << 20, costs: SimCosts::NONE }
    }

    /// The driver costs this device spends.
    pub fn costs(&self) -> SimCosts {
        self.inner.costs
    }

    /// Bytes mapped over the device's life (every successful [`Device::map`]).
    pub fn mapped_bytes_total(&self) -> u64 {
        self.inner.mapped_total.load(Ordering::Acquire)
    }

    /// Bytes unmapped over the device's life (every successful [`Device::unmap`]).
    pub fn unmapped_bytes_total(&self) -> u64 {
        self.inner.unmapped_total.load(Ordering::Acquire)
    }

    /// Create a stream (the same as [`Device::create_stream`]).
    pub fn new_stream(&self) -> Result<Stream> {
        check_not_in_host_fn()?;
        let shared = Arc::new(StreamShared {
            state: Mutex::new(QueueState::default()),
            cv: Condvar::new(),
            capturing: AtomicBool::new(false),
            done: AtomicU64::new(0),
        });
        let raw = {
            let mut t = lock(&self.inner.raws);
            let raw = match t.free.pop_first() {
                Some(r) => r,
                None => {
                    t.next += 1;
                    t.next
                }
            };
            t.live.insert(raw, Arc::downgrade(&shared));
            raw
        };
        let worker = Arc::clone(&shared);
        let dev = Arc::downgrade(&self.inner);
        let spawned = std::thread::Builder::new().name(format!("simstream-{raw}")).spawn(move || worker.run(dev));
        if let Err(e) = spawned {
            self.inner.free_raw(raw, &shared);
            return Err(sim_err("cuStreamCreate", format!("cannot start the stream's worker: {e}")));
        }
        let handle = SimStreamHandle { shared, raw, owned: true, device: Arc::downgrade(&self.inner) };
        Ok(implement::new_stream(raw, Box::new(handle)))
    }

    /// Run `f` on the stream once all earlier work on it is done (the simulator's
    /// `cuLaunchHostFunc`). `f` must not call the device: such calls fail.
    pub fn enqueue<F: FnOnce() + Send + 'static>(&self, stream: &Stream, f: F) -> Result<()> {
        self.launch_host_fn(stream, Box::new(f))
    }

    /// Block until all work on `stream` is done.
    pub fn synchronize(&self, stream: &Stream) -> Result<()> {
        Device::synchronize(self, stream)
    }

    /// Start capturing `stream` into a graph: until [`SimDevice::end_capture`], work that
    /// would need the stream to run fails with [`Error::StreamCapturing`].
    pub fn begin_capture(&self, stream: &Stream) -> Result<()> {
        check_not_in_host_fn()?;
        let h = self.inner.stream(stream)?;
        h.shared.capturing.store(true, Ordering::SeqCst);
        Ok(())
    }

    /// End a capture started by [`SimDevice::begin_capture`].
    pub fn end_capture(&self, stream: &Stream) -> Result<()> {
        check_not_in_host_fn()?;
        let h = self.inner.stream(stream)?;
        h.shared.capturing.store(false, Ordering::SeqCst);
        Ok(())
    }

    /// Physical bytes mapped now.
    pub fn committed_bytes(&self) -> u64 {
        self.inner.mem.committed()
    }

    /// Whether every byte of `[addr, addr + len)` lies on mapped pages now: what a host
    /// function that reads or writes device memory itself checks first, as the simulator's
    /// own copies do (a GPU would fault the context; a host thread would take a SIGSEGV).
    pub fn is_mapped(&self, addr: u64, len: usize) -> bool {
        self.inner.is_mapped(addr, len)
    }

    /// How many host functions panicked (the stream carried on after each).
    pub fn host_fn_panics(&self) -> u64 {
        self.inner.host_fn_panics.load(Ordering::Acquire)
    }

    fn capturing(h: &SimStreamHandle) -> bool {
        h.shared.capturing.load(Ordering::SeqCst)
    }

    /// Checks shared by every stream operation that needs the stream to run.
    fn running_stream<'a>(&self, stream: &'a Stream) -> Result<&'a SimStreamHandle> {
        check_not_in_host_fn()?;
        self.inner.check_fault()?;
        let h = self.inner.stream(stream)?;
        if Self::capturing(h) {
            return Err(Error::StreamCapturing);
        }
        Ok(h)
    }
}

/// Configures a [`SimDevice`]: see [`SimDevice::builder`].
#[derive(Debug, Clone)]
pub struct SimDeviceBuilder {
    capacity: u64,
    granularity: usize,
    costs: SimCosts,
}

impl SimDeviceBuilder {
    /// The mapping granularity: a power of two, at least the host's page size (other values
    /// are rounded up to one).
    pub fn granularity(mut self, granularity: usize) -> SimDeviceBuilder {
        self.granularity = granularity;
        self
    }

    /// The driver costs to spend (e.g. [`SimCosts::h200`]).
    pub fn costs(mut self, costs: SimCosts) -> SimDeviceBuilder {
        self.costs = costs;
        self
    }

    /// The device.
    pub fn build(self) -> SimDevice {
        let g = self.granularity.max(host_page_size()).next_power_of_two();
        SimDevice {
            inner: Arc::new(SimInner {
                capacity: self.capacity,
                granularity: g,
                mem: Memory::new(self.capacity, g as u64),
                raws: Mutex::new(RawTable::default()),
                host_fn_panics: AtomicU64::new(0),
                costs: self.costs,
                driver: DriverLock::default(),
                mapped_total: AtomicU64::new(0),
                unmapped_total: AtomicU64::new(0),
            }),
        }
    }
}

impl std::fmt::Debug for SimDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimDevice")
            .field("capacity", &self.inner.capacity)
            .field("granularity", &self.inner.granularity)
            .field("committed", &self.committed_bytes())
            .field("costs", &self.inner.costs)
            .finish()
    }
}

fn host_page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as usize
    } else {
        4096
    }
}

impl Device for SimDevice {
    fn kind(&self) -> DeviceKind {
        DeviceKind::Simulated
    }

    fn name(&self) -> String {
        format!("simulated device, {:.1} GiB", self.inner.capacity as f64 / (1u64 << 30) as f64)
    }

    fn total_memory(&self) -> u64 {
        self.inner.capacity
    }

    fn mem_info(&self) -> Result<MemInfo> {
        check_not_in_host_fn()?;
        let used = self.committed_bytes();
        Ok(MemInfo { free: self.inner.capacity.saturating_sub(used), total: self.inner.capacity })
    }

    fn create_stream(&self) -> Result<Stream> {
        self.new_stream()
    }

    unsafe fn wrap_stream(&self, raw: u64) -> Result<Stream> {
        check_not_in_host_fn()?;
        let shared = lock(&self.inner.raws).live.get(&raw).and_then(Weak::upgrade);
        let shared = shared.ok_or_else(|| Error::InvalidArgument(format!("no live simulated stream {raw}")))?;
        let handle = SimStreamHandle { shared, raw, owned: false, device: Arc::downgrade(&self.inner) };
        Ok(implement::new_stream(raw, Box::new(handle)))
    }

    fn destroy_stream(&self, stream: &Stream) -> Result<()> {
        check_not_in_host_fn()?;
        let h = self.inner.stream(stream)?;
        implement::run_destroy_hooks(stream);
        if implement::mark_destroyed(stream) && h.owned {
            // As cuStreamDestroy: returns at once; work already queued still runs.
            close_stream(&h.shared);
            self.inner.free_raw(h.raw, &h.shared);
        }
        Ok(())
    }

    fn synchronize(&self, stream: &Stream) -> Result<()> {
        let h = self.running_stream(stream)?;
        let seq = lock(&h.shared.state).last_seq;
        h.shared.wait_for(seq);
        self.inner.check_fault()
    }

    fn is_capturing(&self, stream: &Stream) -> Result<bool> {
        check_not_in_host_fn()?;
        Ok(Self::capturing(self.inner.stream(stream)?))
    }

    fn synchronize_device(&self) -> Result<()> {
        check_not_in_host_fn()?;
        let live: Vec<Arc<StreamShared>> = lock(&self.inner.raws).live.values().filter_map(Weak::upgrade).collect();
        for shared in live {
            if shared.capturing.load(Ordering::SeqCst) {
                return Err(Error::StreamCapturing);
            }
            let seq = lock(&shared.state).last_seq;
            shared.wait_for(seq);
        }
        self.inner.check_fault()
    }

    fn create_event(&self) -> Result<Event> {
        check_not_in_host_fn()?;
        costs::spend(self.inner.costs.event_create);
        Ok(implement::new_event(Box::new(SimEvent::default())))
    }

    fn record_event(&self, event: &Event, stream: &Stream) -> Result<()> {
        let h = self.running_stream(stream)?;
        let ev = sim_event(event)?;
        costs::spend(self.inner.costs.event_record);
        let seq = h.shared.enqueue(Op::Marker)?;
        *lock(&ev.record) = Some((Arc::clone(&h.shared), seq));
        Ok(())
    }

    fn query_event(&self, event: &Event) -> Result<bool> {
        check_not_in_host_fn()?;
        self.inner.check_fault()?;
        costs::spend(self.inner.costs.event_query);
        let rec = lock(&sim_event(event)?.record).clone();
        Ok(match rec {
            None => true,
            Some((stream, seq)) => stream.completed() >= seq,
        })
    }

    fn synchronize_event(&self, event: &Event) -> Result<()> {
        check_not_in_host_fn()?;
        self.inner.check_fault()?;
        let rec = lock(&sim_event(event)?.record).clone();
        if let Some((stream, seq)) = rec {
            stream.wait_for(seq);
        }
        self.inner.check_fault()
    }

    fn stream_wait_event(&self, stream: &Stream, event: &Event) -> Result<()> {
        let h = self.running_stream(stream)?;
        let rec = lock(&sim_event(event)?.record).clone();
        if let Some((other, seq)) = rec {
            h.shared.enqueue(Op::Wait(other, seq))?;
        }
        Ok(())
    }

    fn launch_host_fn(&self, stream: &Stream, f: HostFn) -> Result<()> {
        let h = self.running_stream(stream)?;
        h.shared.enqueue(Op::Host(f)).map(|_| ())
    }

    fn copy_to_device(&self, dst: u64, src: &[u8], stream: &Stream) -> Result<()> {
        let h = self.running_stream(stream)?;
        let data = src.to_vec();
        let seq = self.inner.enqueue_mem_op(h, dst, data.len(), move || {
            // SAFETY: the worker checked just now that the destination lies on mapped pages
            // of this device's reservation, which are readable and writable host memory.
            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), dst as *mut u8, data.len()) }
        })?;
        h.shared.wait_for(seq);
        self.inner.check_fault()
    }

    fn copy_from_device(&self, dst: &mut [u8], src: u64, stream: &Stream) -> Result<()> {
        let h = self.running_stream(stream)?;
        let len = dst.len();
        let out = Arc::new(Mutex::new(vec![0u8; len]));
        let sink = Arc::clone(&out);
        let seq = self.inner.enqueue_mem_op(h, src, len, move || {
            let mut buf = lock(&sink);
            // SAFETY: the worker checked just now that the source lies on mapped pages of this
            // device's reservation, which are readable host memory.
            unsafe { std::ptr::copy_nonoverlapping(src as *const u8, buf.as_mut_ptr(), len) }
        })?;
        h.shared.wait_for(seq);
        self.inner.check_fault()?;
        dst.copy_from_slice(&lock(&out));
        Ok(())
    }

    fn memset(&self, dst: u64, value: u8, len: usize, stream: &Stream) -> Result<()> {
        let h = self.running_stream(stream)?;
        self.inner.enqueue_mem_op(h, dst, len, move || {
            // SAFETY: the worker checked just now that the range lies on mapped pages of this
            // device's reservation, which are writable host memory.
            unsafe { std::ptr::write_bytes(dst as *mut u8, value, len) }
        })?;
        Ok(())
    }

    fn granularity(&self) -> usize {
        self.inner.granularity
    }

    fn reserve(&self, bytes: u64) -> Result<u64> {
        check_not_in_host_fn()?;
        self.inner.mem.reserve(bytes)
    }

    unsafe fn release(&self, base: u64, bytes: u64) -> Result<()> {
        check_not_in_host_fn()?;
        // SAFETY: the caller upholds release's contract, forwarded unchanged.
        unsafe { self.inner.mem.release(base, bytes) }
    }

    fn map(&self, addr: u64, bytes: usize) -> Result<()> {
        check_not_in_host_fn()?;
        let (g, len) = (self.inner.granularity as u64, bytes as u64);
        let _driver = self.inner.driver.spend(self.inner.costs.map(len / g));
        self.inner.mem.map(addr, len)?;
        self.inner.mapped_total.fetch_add(len, Ordering::AcqRel);
        Ok(())
    }

    fn alias(&self, from: u64, to: u64, bytes: usize) -> Result<()> {
        check_not_in_host_fn()?;
        let (g, len) = (self.inner.granularity as u64, bytes as u64);
        // A map without the allocation: what `cuMemMap` and `cuMemSetAccess` cost.
        let _driver = self.inner.driver.spend(self.inner.costs.map(len / g));
        self.inner.mem.alias(from, to, len)?;
        self.inner.mapped_total.fetch_add(len, Ordering::AcqRel);
        Ok(())
    }

    fn can_alias(&self) -> bool {
        self.inner.mem.can_alias()
    }

    unsafe fn unmap(&self, addr: u64, bytes: usize) -> Result<()> {
        check_not_in_host_fn()?;
        let (g, len) = (self.inner.granularity as u64, bytes as u64);
        let _driver = self.inner.driver.spend(self.inner.costs.unmap(len / g));
        // SAFETY: the caller upholds unmap's contract, forwarded unchanged.
        unsafe { self.inner.mem.unmap(addr, len)? };
        self.inner.unmapped_total.fetch_add(len, Ordering::AcqRel);
        Ok(())
    }
}

fn sim_event(event: &Event) -> Result<&SimEvent> {
    implement::event_backend::<SimEvent>(event)
        .ok_or_else(|| Error::InvalidArgument("event does not belong to a simulated device".into()))
}

#[cfg(test)]
mod tests;
