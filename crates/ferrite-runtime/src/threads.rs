//! The process-wide worker pool: one rayon pool sized by `--threads`, shared by every op.

use crate::error::{Result, RuntimeError};

/// Size the global pool once at start-up; later calls keep the first size.
pub fn init(threads: Option<usize>) -> Result<usize> {
    let n = threads.unwrap_or_else(|| std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1));
    if n == 0 {
        return Err(RuntimeError::Threads("--threads must be at least 1".into()));
    }
    // An error here means the pool already exists (e.g. in tests); its size stands.
    let _ = rayon::ThreadPoolBuilder::new().num_threads(n).build_global();
    Ok(rayon::current_num_threads())
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
