//! Page-locked host memory for the prefix cache's host tier: sequences' state and KV copied out
//! of the device in fixed-size chunks of pinned memory (so the copies run at PCIe DMA speed in
//! both directions) that are kept for reuse. Pinning memory costs time in proportion to its size
//! (about as long as copying it several times over), so the pool is filled when the server loads
//! ([`PinnedPool::warm`]) and a chunk freed by one copy serves the next.

use anyhow::{anyhow, Result};
use cudarc::driver::{sys, CudaContext, CudaStream, PinnedHostSlice};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

/// Bytes per chunk: small enough that rounding a copy up to whole chunks wastes little, large
/// enough that a long sequence takes tens of chunks, not thousands.
pub const CHUNK_BYTES: usize = 32 << 20;

/// The most the prefix cache's host tier takes by default (pinned at load: about 0.7 s
/// per GiB).
pub const DEFAULT_TIER_BYTES: usize = 8192 << 20;

/// The host tier's default budget: a quarter of the host memory available now, at most
/// [`DEFAULT_TIER_BYTES`] (0 when it cannot be read).
pub fn default_tier_bytes() -> usize {
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let available_kib = meminfo.lines().find_map(|l| l.strip_prefix("MemAvailable:")).and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<usize>().ok()).unwrap_or(0);
    (available_kib.saturating_mul(1024) / 4).min(DEFAULT_TIER_BYTES)
}

/// Chunks of pinned host memory, allocated on demand and kept once freed.
pub struct PinnedPool {
    ctx: Arc<CudaContext>,
    free: Mutex<Vec<PinnedHostSlice<u8>>>,
    /// Chunks pinned so far (in copies or free).
    pinned: AtomicUsize,
}

impl PinnedPool {
    pub fn new(ctx: Arc<CudaContext>) -> Arc<Self> {
        Arc::new(PinnedPool { ctx, free: Mutex::new(Vec::new()), pinned: AtomicUsize::new(0) })
    }

    /// Pins chunks until the pool holds `bytes` (it keeps them until the process ends), so copies
    /// draw on chunks already pinned; returns the bytes pinned. Runs before serving: pinning
    /// beside running work held up its driver calls for seconds. A failure stops it with what it
    /// has: copies then pin what they need themselves.
    pub fn warm(&self, bytes: usize) -> Result<usize> {
        while (self.pinned.load(Relaxed) + 1) * CHUNK_BYTES <= bytes {
            let c = self.alloc()?;
            self.free.lock().unwrap_or_else(|p| p.into_inner()).push(c);
        }
        Ok(self.pinned.load(Relaxed) * CHUNK_BYTES)
    }

    fn take(&self) -> Result<PinnedHostSlice<u8>> {
        if let Some(c) = self.free.lock().unwrap_or_else(|p| p.into_inner()).pop() {
            return Ok(c);
        }
        self.alloc()
    }

    fn alloc(&self) -> Result<PinnedHostSlice<u8>> {
        // SAFETY: the chunk's bytes are only read after a copy wrote them. Flags 0: cached,
        // not write-combined (the host never reads them, but DMA in both directions is full speed).
        let c = unsafe { self.ctx.alloc_pinned_with_flags::<u8>(CHUNK_BYTES, 0) }.map_err(|e| anyhow!("pinned host allocation of {} MiB: {e:?}", CHUNK_BYTES >> 20))?;
        self.pinned.fetch_add(1, Relaxed);
        Ok(c)
    }

    /// Bytes a copy of `bytes` takes: whole chunks.
    pub fn rounded(bytes: usize) -> usize {
        bytes.div_ceil(CHUNK_BYTES) * CHUNK_BYTES
    }
}

/// A run of device memory copied into pinned chunks, back to back. Its chunks go back to the pool
/// when it is dropped.
pub struct HostCopy {
    chunks: Vec<PinnedHostSlice<u8>>,
    /// Bytes written so far.
    len: usize,
    pool: Arc<PinnedPool>,
}

impl HostCopy {
    /// An empty copy with room for `bytes` (all chunks taken now, so a copy that cannot get its
    /// memory fails before any transfer).
    pub fn with_capacity(pool: &Arc<PinnedPool>, bytes: usize) -> Result<Self> {
        let mut c = HostCopy { chunks: Vec::new(), len: 0, pool: pool.clone() };
        for _ in 0..bytes.div_ceil(CHUNK_BYTES) {
            c.chunks.push(pool.take()?);
        }
        Ok(c)
    }

    /// The host address of byte `at` and how many bytes follow it in its chunk.
    fn at(&self, at: usize) -> Result<(*mut u8, usize)> {
        let chunk = self.chunks.get(at / CHUNK_BYTES).ok_or_else(|| anyhow!("host copy overrun at byte {at}"))?;
        // The chunk is driver-allocated memory, not behind a Rust reference: DMA writes it.
        let base = chunk.as_ptr().map_err(|e| anyhow!("{e:?}"))? as *mut u8;
        // SAFETY: `at % CHUNK_BYTES` is inside the chunk.
        Ok((unsafe { base.add(at % CHUNK_BYTES) }, CHUNK_BYTES - at % CHUNK_BYTES))
    }

    /// Calls `f(host address, offset into the run, length)` for the pieces of bytes
    /// `from..from + bytes` of this copy, split where they cross a chunk.
    fn pieces(&self, from: usize, bytes: usize, mut f: impl FnMut(*mut u8, usize, usize) -> Result<()>) -> Result<()> {
        let mut done = 0;
        while done < bytes {
            let (host, room) = self.at(from + done)?;
            let n = room.min(bytes - done);
            f(host, done, n)?;
            done += n;
        }
        Ok(())
    }

    /// Queues a copy of `bytes` device bytes from `src` after what is written so far.
    pub fn append_from_device(&mut self, src: u64, bytes: usize, stream: &CudaStream) -> Result<()> {
        self.pieces(self.len, bytes, |dst, done, n| {
            // SAFETY: `dst..dst + n` is inside a pinned chunk this copy owns; `src + done` is
            // mapped device memory the caller keeps alive until the stream is synchronised.
            let r = unsafe { sys::cuMemcpyDtoHAsync_v2(dst as *mut _, src + done as u64, n, stream.cu_stream()) };
            r.result().map_err(|e| anyhow!("device-to-host copy: {e:?}"))
        })?;
        self.len += bytes;
        Ok(())
    }

    /// Queues a copy of `bytes` bytes from `from` of this copy to device address `dst`.
    pub fn read_to_device(&self, from: usize, dst: u64, bytes: usize, stream: &CudaStream) -> Result<()> {
        if from + bytes > self.len {
            anyhow::bail!("host copy read past its {} bytes", self.len);
        }
        self.pieces(from, bytes, |src, done, n| {
            // SAFETY: `src..src + n` is inside a pinned chunk this copy owns and wrote; `dst` is
            // mapped device memory of at least `bytes`.
            let r = unsafe { sys::cuMemcpyHtoDAsync_v2(dst + done as u64, src as *const _, n, stream.cu_stream()) };
            r.result().map_err(|e| anyhow!("host-to-device copy: {e:?}"))
        })
    }
}

impl Drop for HostCopy {
    fn drop(&mut self) {
        let mut free = self.pool.free.lock().unwrap_or_else(|p| p.into_inner());
        free.append(&mut self.chunks);
    }
}
