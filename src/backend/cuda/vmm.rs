//! The driver's virtual memory management, wrapped: physical pages (`cuMemCreate`) mapped into
//! reserved address ranges (`cuMemAddressReserve` + `cuMemMap`). A sequence's KV cache is one
//! reserved range whose pages are mapped as the sequence grows, so kernels and captured graphs
//! see fixed, contiguous addresses while memory is committed a page at a time.

use anyhow::{anyhow, Result};
use cudarc::driver::{sys, CudaContext};
use std::sync::Arc;

fn check(r: sys::CUresult, what: &str) -> Result<()> {
    r.result().map_err(|e| anyhow!("{what}: {e:?}"))
}

fn device_prop(device: i32) -> sys::CUmemAllocationProp {
    // SAFETY: plain C data; all-zero is the documented default for the fields not set here.
    let mut p: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    p.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    p.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    p.location.id = device;
    p
}

/// The device's page size for mapped memory (2 MiB on Hopper).
pub fn granularity(ctx: &CudaContext) -> Result<usize> {
    ctx.bind_to_thread().map_err(|e| anyhow!("{e:?}"))?;
    let prop = device_prop(ctx.ordinal() as i32);
    let mut g = 0usize;
    // SAFETY: `prop` and `g` are live for the call.
    check(
        unsafe {
            sys::cuMemGetAllocationGranularity(&mut g, &prop, sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM)
        },
        "cuMemGetAllocationGranularity",
    )?;
    Ok(g.max(1))
}

/// One physical page of device memory, not mapped anywhere by itself. Released when dropped
/// (the driver frees it once no range maps it any more).
pub struct PhysPage {
    handle: sys::CUmemGenericAllocationHandle,
    ctx: Arc<CudaContext>,
}

impl PhysPage {
    pub fn create(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Self> {
        ctx.bind_to_thread().map_err(|e| anyhow!("{e:?}"))?;
        let prop = device_prop(ctx.ordinal() as i32);
        let mut handle = 0;
        // SAFETY: `bytes` is a multiple of the granularity (callers use `granularity`).
        check(unsafe { sys::cuMemCreate(&mut handle, bytes, &prop, 0) }, "cuMemCreate")?;
        Ok(PhysPage { handle, ctx: ctx.clone() })
    }
}

impl Drop for PhysPage {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: the handle came from cuMemCreate and is released once.
        unsafe { sys::cuMemRelease(self.handle) };
    }
}

/// A reserved range of device addresses; pages are mapped into it at page-aligned offsets.
/// The owner unmaps what it mapped (after the stream stopped using it) before dropping it.
pub struct AddressRange {
    base: u64,
    bytes: usize,
    ctx: Arc<CudaContext>,
}

impl AddressRange {
    pub fn reserve(ctx: &Arc<CudaContext>, bytes: usize, align: usize) -> Result<Self> {
        ctx.bind_to_thread().map_err(|e| anyhow!("{e:?}"))?;
        let mut base = 0;
        // SAFETY: reserves address space only; released in Drop.
        check(unsafe { sys::cuMemAddressReserve(&mut base, bytes, align, 0, 0) }, "cuMemAddressReserve")?;
        Ok(AddressRange { base, bytes, ctx: ctx.clone() })
    }

    pub fn base(&self) -> u64 {
        self.base
    }

    /// Maps `page` (`bytes` long) at `offset` and makes it readable and writable by the device.
    pub fn map(&self, offset: usize, page: &PhysPage, bytes: usize) -> Result<()> {
        self.map_run(offset, &[page], bytes)
    }

    /// Maps `pages` (each `page_bytes` long) back to back from `offset`, then makes the whole
    /// run readable and writable with one access call: the access call is the costly one, and a
    /// copy of a long sequence maps hundreds of pages.
    pub fn map_run(&self, offset: usize, pages: &[&PhysPage], page_bytes: usize) -> Result<()> {
        let bytes = pages.len() * page_bytes;
        assert!(offset + bytes <= self.bytes, "mapping past the reserved range");
        if pages.is_empty() {
            return Ok(());
        }
        self.ctx.bind_to_thread().map_err(|e| anyhow!("{e:?}"))?;
        let at = self.base + offset as u64;
        // Unmaps the first `n` pages of the run (mapped here and never used).
        let undo = |n: usize| {
            for i in 0..n {
                // SAFETY: mapped by this call and never used.
                unsafe { sys::cuMemUnmap(at + (i * page_bytes) as u64, page_bytes) };
            }
        };
        for (i, page) in pages.iter().enumerate() {
            // SAFETY: the range is reserved by us and this offset is not mapped (the caller's
            // page list says so); the page outlives the mapping (unmapped before it is dropped).
            if let Err(e) = check(unsafe { sys::cuMemMap(at + (i * page_bytes) as u64, page_bytes, 0, page.handle, 0) }, "cuMemMap") {
                undo(i);
                return Err(e);
            }
        }
        let desc = sys::CUmemAccessDesc {
            location: device_prop(self.ctx.ordinal() as i32).location,
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: `at..at + bytes` was just mapped.
        let r = check(unsafe { sys::cuMemSetAccess(at, bytes, &desc, 1) }, "cuMemSetAccess");
        if r.is_err() {
            undo(pages.len());
        }
        r
    }

    /// Unmaps the page mapped at `offset`. No stream work may still use it.
    pub fn unmap(&self, offset: usize, bytes: usize) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: the caller mapped this page and synchronised the stream.
        unsafe { sys::cuMemUnmap(self.base + offset as u64, bytes) };
    }
}

impl Drop for AddressRange {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: reserved in `reserve`; every mapping was removed by the owner.
        unsafe { sys::cuMemAddressFree(self.base, self.bytes) };
    }
}
