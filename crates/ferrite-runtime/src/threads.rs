//! The process-wide worker pool: one rayon pool sized by `--threads`, shared by every op.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

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

/// Give the calling thread the lowest priority (nice 19): it takes a small share of a core
/// that other threads want, so background work (the SSD tier's writer) hardly slows a model
/// step, whose workers poll between parallel loops and would yield to it — yet it still
/// progresses on a machine kept busy by other work (the idle class, `SCHED_IDLE`, would
/// starve it there). Where Linux's per-thread priority is unavailable the thread keeps its
/// priority.
pub fn run_at_lowest_priority() {
    #[cfg(target_os = "linux")]
    // SAFETY: `setpriority` on the calling thread's own id changes only its nice value.
    unsafe {
        libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, 19);
    }
}

pub fn current() -> usize {
    rayon::current_num_threads()
}

/// Pause instructions between two polls of an idle worker during `run`.
const IDLE_PAUSES: usize = 16;

/// How long a worker polls without finding work before it leaves `run`'s polling (and may
/// sleep).
const MAX_IDLE_POLL: Duration = Duration::from_micros(200);

/// Run `f` on a worker of the pool and wait for it, the other workers kept awake meanwhile.
///
/// Wrap a whole model step in this: inside a worker, each op's parallel loop forks and joins
/// within the pool (well under a microsecond), whereas from an outside thread every op is
/// queued to the pool while the caller sleeps on a latch — a cross-thread wake-up of ~10 µs or
/// more per op, hundreds of times per decoded token.
///
/// The other workers spend the step polling for work (`rayon::yield_now`) instead of going to
/// sleep whenever `f` runs serial code between two parallel loops: a sleeping worker takes
/// 10–20 µs to wake, and a step has ~200 such gaps. Measured on SmolLM2's 30 layers of
/// matmuls at 8 rows with a 5 µs serial gap after each call: 10.5 ms with sleeping workers,
/// against 6.7 ms without the gaps.
pub fn run<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    let done = AtomicBool::new(false);
    let done_ref = &done;
    rayon::scope(|s| {
        let caller = rayon::current_thread_index();
        s.spawn_broadcast(move |_, ctx| {
            // The caller runs `f`; its own copy of this job must not spin (it may run it while
            // waiting inside `f`).
            if Some(ctx.index()) == caller {
                return;
            }
            let mut last_work = Instant::now();
            while !done_ref.load(Ordering::Acquire) {
                if rayon::yield_now() == Some(rayon::Yield::Executed) {
                    last_work = Instant::now();
                } else if last_work.elapsed() > MAX_IDLE_POLL {
                    // A worker may run this job from inside another job's wait (it was
                    // stealing when the broadcast came); polling there until `done` would
                    // hold up that job and, through it, `f` — a deadlock. Bounded idle
                    // polling ends it, and serial gaps in a step are far shorter.
                    break;
                } else {
                    // Back off (~1 µs) between polls: a tight loop of steal attempts keeps
                    // the caller's deque line bouncing between the cores.
                    (0..IDLE_PAUSES).for_each(|_| std::hint::spin_loop());
                }
            }
        });
        // Set `done` even if `f` panics: the scope waits for the pollers before it unwinds.
        let _stop = SetOnDrop(done_ref);
        f()
    })
}

/// Call `body(&mut state, i)` once for every `i` in `0..n`, spread over the pool's threads,
/// each thread with its own `state` from `init`; return when every call has returned.
///
/// `0..n` is cut into one contiguous share per thread. A thread takes the indices of its own
/// share in order from the front, then takes the other shares' indices from their backs; the
/// caller, once nothing is left to take, spins until the indices others took are done. So a
/// thread walks adjacent items (adjacent weight panels stream well: handing out panels one
/// at a time in turn made SmolLM2's 8-row MLP matmuls ~15 % slower) and the load still
/// balances to within one item.
///
/// A rayon parallel iterator instead splits its range into nested joins: a thread that
/// finishes its half before the thief finishes the other waits inside rayon, which yields to
/// the kernel and soon sleeps on a futex, to be woken (tens of µs) when the other half ends.
/// Here a wait lasts at most the one item another thread is still on, and nothing sleeps.
pub fn for_each_claimed<S>(n: usize, init: impl Fn() -> S + Sync, body: impl Fn(&mut S, usize) + Sync) {
    let threads = rayon::current_num_threads().min(n);
    if threads <= 1 {
        let mut state = init();
        (0..n).for_each(|i| body(&mut state, i));
        return;
    }
    let shares: Vec<Share> = (0..threads).map(|t| Share::new(t * n / threads, (t + 1) * n / threads)).collect();
    let done = AtomicUsize::new(0);
    let shares = &shares[..];
    let work = |t: usize| {
        let mut state = init();
        let own = std::iter::from_fn(|| shares[t].take(true));
        let others = (1..threads).flat_map(|o| std::iter::from_fn(move || shares[(t + o) % threads].take(false)));
        for i in own.chain(others) {
            // Counted even if `body` panics, so the caller's spin below ends; the scope then
            // re-raises the panic.
            let _count = CountOnDrop(&done);
            body(&mut state, i);
        }
    };
    rayon::scope(|s| {
        for t in 1..threads {
            let work = &work;
            s.spawn(move |_| work(t));
        }
        work(0);
        // Every index is taken by now; wait for those still running elsewhere: spin while
        // that is short, then yield the core, in case the thread we wait for is queued behind
        // us on it (more runnable threads than cores: a spinning caller would hold it up for a
        // whole time slice, every loop of every step).
        let mut spins = 0u32;
        while done.load(Ordering::Acquire) < n {
            if spins < MAX_WAIT_SPINS {
                spins += 1;
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    });
}

/// Spins (`pause`: 10–40 µs in all) a caller of `for_each_claimed` waits before it yields its
/// core between polls.
const MAX_WAIT_SPINS: u32 = 1 << 8;

/// A contiguous range of indices that its owner takes from the front and other threads from
/// the back: `(front, back)` packed into one atomic word.
struct Share(AtomicU64);

impl Share {
    fn new(front: usize, back: usize) -> Share {
        Share(AtomicU64::new(front as u64 | (back as u64) << 32))
    }

    /// Take one index from the front (`front_side`) or the back, if any is left.
    fn take(&self, front_side: bool) -> Option<usize> {
        let mut cur = self.0.load(Ordering::Relaxed);
        loop {
            let (front, back) = (cur & 0xFFFF_FFFF, cur >> 32);
            if front >= back {
                return None;
            }
            let (next, taken) = if front_side { (cur + 1, front) } else { (cur - (1 << 32), back - 1) };
            match self.0.compare_exchange_weak(cur, next, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => return Some(taken as usize),
                Err(now) => cur = now,
            }
        }
    }
}

/// `f(&mut state, i)` for every `i` in `0..n` through `for_each_claimed`, the results in
/// order of `i`.
pub fn map_claimed<S, R: Send + Sync>(
    n: usize,
    init: impl Fn() -> S + Sync,
    f: impl Fn(&mut S, usize) -> R + Sync,
) -> Vec<R> {
    let slots: Vec<OnceLock<R>> = (0..n).map(|_| OnceLock::new()).collect();
    for_each_claimed(n, init, |state, i| {
        let _ = slots[i].set(f(state, i));
    });
    slots.into_iter().map(|s| s.into_inner().expect("for_each_claimed calls every index once")).collect()
}

/// Adds one to its counter when dropped.
struct CountOnDrop<'a>(&'a AtomicUsize);

impl Drop for CountOnDrop<'_> {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::Release);
    }
}

/// Sets its flag when dropped.
struct SetOnDrop<'a>(&'a AtomicBool);

impl Drop for SetOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `run` returns `f`'s value with the pool's parallel loops working inside it, and a panic
    /// in `f` reaches the caller instead of leaving the polling workers waiting.
    #[test]
    fn run_returns_and_propagates_panics() {
        use rayon::prelude::*;
        let sum: u64 = run(|| (0..10_000u64).into_par_iter().sum());
        assert_eq!(sum, 10_000 * 9_999 / 2);
        let caught = std::panic::catch_unwind(|| run(|| panic!("inside the step")));
        assert!(caught.is_err());
        assert_eq!(run(|| 7), 7);
    }

    /// Every index once, from every thread's state, inside `run` and outside it; a panic in
    /// one call reaches the caller instead of leaving it spinning.
    #[test]
    fn claimed_loops_call_every_index_once() {
        for n in [0, 1, 2, 7, 100] {
            let got = map_claimed(
                n,
                || 0u64,
                |calls, i| {
                    *calls += 1;
                    i * i
                },
            );
            assert_eq!(got, (0..n).map(|i| i * i).collect::<Vec<_>>());
            let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            run(|| {
                for_each_claimed(
                    n,
                    || (),
                    |_, i| {
                        hits[i].fetch_add(1, Ordering::Relaxed);
                    },
                )
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
        }
        let caught = std::panic::catch_unwind(|| {
            for_each_claimed(
                64,
                || (),
                |_, i| {
                    if i == 33 {
                        panic!("item 33");
                    }
                },
            )
        });
        assert!(caught.is_err());
    }

    /// Many steps of nested parallel loops through `run`, each with the right sum. (A smoke
    /// test: the stall that `MAX_IDLE_POLL` ends needs timing this loop rarely hits.)
    #[test]
    fn run_finishes_with_nested_parallel_loops() {
        use rayon::prelude::*;
        for step in 0..3000u64 {
            let got: u64 = run(|| {
                (0..64u64).into_par_iter().map(|i| (0..50u64).into_par_iter().map(|j| i * j + step).sum::<u64>()).sum()
            });
            assert_eq!(got, (64 * 63 / 2) * (50 * 49 / 2) + 64 * 50 * step);
        }
    }
}
