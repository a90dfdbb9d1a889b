//! Long-lived buffers on transparent huge pages, for data that kernels stream through on every
//! step (the packed weight copies, the host KV pools).
//!
//! Streaming weights from 4 KiB pages costs a TLB miss every 4 KiB; a decode step of SmolLM2
//! reads ~115 MB of weights, ~28 k pages. Buffers here come from 2 MiB-aligned chunks marked
//! `MADV_HUGEPAGE`, so the kernel backs them with 2 MiB pages where it can (the LM head's
//! matmul at eight rows ran 1.32 → 1.09 ms a step when its copy was on huge pages). Small
//! buffers share a chunk, bump-allocated; a chunk is unmapped when the last buffer in it is
//! dropped. Where huge pages are off, the same memory is ordinary pages.
//!
//! The memory comes from the process's own anonymous mappings, never from `malloc`: a large
//! `calloc` made on a thread other than the main one is served from a glibc thread arena and
//! zero-filled page by page, which backs all of it at once (a 2 GiB KV pool allocated on the
//! server's loader thread made a 160 MB process a 2.2 GB one). A mapping stays unbacked until
//! written.

use std::sync::{Arc, Mutex};

/// Bytes of a huge page, and the alignment of every chunk.
const HUGE_PAGE: usize = 2 << 20;
/// Bytes of a shared chunk; a buffer over half of it gets a chunk of its own.
const CHUNK: usize = 16 * HUGE_PAGE;
/// Alignment of each buffer within a chunk (a cache line).
const ALIGN: usize = 64;

/// An anonymous mapping of `len` bytes at `ptr` (2 MiB-aligned), zero until written.
struct Chunk {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: a chunk is plain memory; the buffers carved from it are disjoint, and each gives out
// `&mut` only through `&mut HugeBuf`.
unsafe impl Send for Chunk {}
unsafe impl Sync for Chunk {}

impl Chunk {
    /// Map `len` bytes (a multiple of `HUGE_PAGE`), or `None` when the mapping fails.
    fn map(len: usize) -> Option<Chunk> {
        let span = len + HUGE_PAGE;
        // SAFETY: a fresh private anonymous mapping; the parts outside the aligned window are
        // unmapped again below and never used.
        unsafe {
            let raw = libc::mmap(
                std::ptr::null_mut(),
                span,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            );
            if raw == libc::MAP_FAILED {
                return None;
            }
            let start = raw as usize;
            let aligned = start.next_multiple_of(HUGE_PAGE);
            if aligned > start {
                libc::munmap(raw, aligned - start);
            }
            let tail = start + span - (aligned + len);
            if tail > 0 {
                libc::munmap((aligned + len) as *mut libc::c_void, tail);
            }
            // Advice only: without THP the pages stay 4 KiB.
            libc::madvise(aligned as *mut libc::c_void, len, libc::MADV_HUGEPAGE);
            Some(Chunk { ptr: aligned as *mut u8, len })
        }
    }
}

impl Drop for Chunk {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, unmapped once, after every buffer in it is gone.
        unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len) };
    }
}

/// The chunk small buffers are carved from, and its bytes in use.
static OPEN: Mutex<Option<(Arc<Chunk>, usize)>> = Mutex::new(None);

/// A zero-initialized byte buffer on huge pages (or a plain heap buffer where no mapping can
/// be made).
pub struct HugeBuf {
    memory: Memory,
}

enum Memory {
    Mapped {
        chunk: Arc<Chunk>,
        at: usize,
        len: usize,
    },
    /// Where no mapping can be made; `u64` words keep it 8-byte aligned for `HugeVec`.
    Heap(Vec<u64>, usize),
}

impl HugeBuf {
    /// `len` zero bytes.
    pub fn zeroed(len: usize) -> HugeBuf {
        let heap = |len: usize| Memory::Heap(vec![0; len.div_ceil(8)], len);
        let memory = if len == 0 {
            heap(0)
        } else if len > CHUNK / 2 {
            match Chunk::map(len.next_multiple_of(HUGE_PAGE)) {
                Some(c) => Memory::Mapped { chunk: Arc::new(c), at: 0, len },
                None => heap(len),
            }
        } else {
            let mut open = OPEN.lock().unwrap_or_else(|e| e.into_inner());
            if open.as_ref().is_none_or(|(_, used)| used + len > CHUNK) {
                *open = Chunk::map(CHUNK).map(|c| (Arc::new(c), 0));
            }
            match open.as_mut() {
                Some((chunk, used)) => {
                    let at = *used;
                    *used = (at + len).next_multiple_of(ALIGN);
                    Memory::Mapped { chunk: chunk.clone(), at, len }
                }
                None => heap(len),
            }
        };
        HugeBuf { memory }
    }

    pub fn as_slice(&self) -> &[u8] {
        match &self.memory {
            // SAFETY: `at..at + len` lies in the chunk, which lives as long as `self`, and no
            // other buffer covers it.
            Memory::Mapped { chunk, at, len } => unsafe { std::slice::from_raw_parts(chunk.ptr.add(*at), *len) },
            Memory::Heap(v, len) => &bytemuck::cast_slice(v)[..*len],
        }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        match &mut self.memory {
            // SAFETY: as in `as_slice`; `&mut self` makes this the only view of the range.
            Memory::Mapped { chunk, at, len } => unsafe { std::slice::from_raw_parts_mut(chunk.ptr.add(*at), *len) },
            Memory::Heap(v, len) => &mut bytemuck::cast_slice_mut(v)[..*len],
        }
    }
}

/// `len` values of `T` in a `HugeBuf`: zero until written, 8-byte aligned.
pub struct HugeVec<T> {
    buf: HugeBuf,
    len: usize,
    _values: std::marker::PhantomData<T>,
}

impl<T: bytemuck::Pod> HugeVec<T> {
    /// `len` values whose bits are all zero.
    pub fn zeroed(len: usize) -> HugeVec<T> {
        const { assert!(std::mem::align_of::<T>() <= 8) };
        HugeVec { buf: HugeBuf::zeroed(len * std::mem::size_of::<T>()), len, _values: std::marker::PhantomData }
    }
}

impl<T: bytemuck::Pod> From<&[T]> for HugeVec<T> {
    fn from(values: &[T]) -> HugeVec<T> {
        let mut v = HugeVec::zeroed(values.len());
        v.copy_from_slice(values);
        v
    }
}

impl<T: bytemuck::Pod> std::ops::Deref for HugeVec<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &bytemuck::cast_slice(self.buf.as_slice())[..self.len]
    }
}

impl<T: bytemuck::Pod> std::ops::DerefMut for HugeVec<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        &mut bytemuck::cast_slice_mut(self.buf.as_mut_slice())[..self.len]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_zeroed_aligned_and_disjoint() {
        let sizes = [1, 63, 64, 4097, 300_000, CHUNK / 2, CHUNK / 2 + 1, 3 * HUGE_PAGE + 5];
        let mut bufs: Vec<HugeBuf> = sizes.iter().map(|&n| HugeBuf::zeroed(n)).collect();
        for (i, b) in bufs.iter_mut().enumerate() {
            assert!(b.as_slice().iter().all(|&x| x == 0), "buffer {i} not zeroed");
            assert_eq!(b.as_slice().as_ptr() as usize % ALIGN, 0, "buffer {i} misaligned");
            b.as_mut_slice().fill(i as u8 + 1);
        }
        for (i, b) in bufs.iter().enumerate() {
            assert_eq!(b.as_slice().len(), sizes[i]);
            assert!(b.as_slice().iter().all(|&x| x == i as u8 + 1), "buffer {i} overwritten by another");
        }
        assert!(HugeBuf::zeroed(0).as_slice().is_empty());
    }

    #[test]
    fn typed_buffers_read_back_what_was_written() {
        let mut v: HugeVec<f32> = HugeVec::zeroed(1001);
        assert!(v.iter().all(|&x| x == 0.0));
        assert_eq!(v.as_ptr() as usize % std::mem::align_of::<f32>(), 0);
        v[1000] = 2.5;
        let copy = HugeVec::from(&v[..]);
        assert_eq!(copy.len(), 1001);
        assert_eq!(copy[1000], 2.5);
    }
}
