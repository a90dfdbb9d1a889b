//! The process-wide worker pool: one rayon pool sized by `--threads`, shared by every op.

use crate::error::{Result, RuntimeError};

/// Size the global pool once at start-up; later calls keep the first size. Also keeps freed
/// activation buffers in the heap (`keep_freed_memory`).
pub fn init(threads: Option<usize>) -> Result<usize> {
    keep_freed_memory();
    let n = threads.unwrap_or_else(|| std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1));
    if n == 0 {
        return Err(RuntimeError::Threads("--threads must be at least 1".into()));
    }
    // An error here means the pool already exists (e.g. in tests); its size stands.
    let _ = rayon::ThreadPoolBuilder::new().num_threads(n).build_global();
    Ok(rayon::current_num_threads())
}

/// A forward allocates its activations afresh; glibc serves large blocks with fresh `mmap`s
/// and unmaps them when freed, so every step paid page faults and kernel zeroing (SmolLM2,
/// eight 128-token prompts prefilled together: 0.91 s, 0.57–0.67 s with this). Keeping freed
/// memory in the heap lets the next step reuse it; the heap stays at its high-water mark.
fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `mallopt` only changes allocator thresholds; any value is valid.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 30);
        libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
    }
}

pub fn current() -> usize {
    rayon::current_num_threads()
}

/// Run `f` on a worker of the pool and wait for it; from a worker, just call it.
///
/// Wrap a whole model step in this: inside a worker, each op's parallel loop forks and joins
/// within the pool (well under a microsecond), whereas from an outside thread every op is
/// queued to the pool while the caller sleeps on a latch — a cross-thread wake-up of ~10 µs or
/// more per op, hundreds of times per decoded token.
pub fn run<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    rayon::scope(|_| f())
}
