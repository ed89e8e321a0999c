//! Fork-join for kernels. Outside a pass this is rayon. During a pass an
//! engine may install a [`SpinHelper`]: a second thread that busy-waits for
//! work, so that the many small products and elementwise ops of a dynamic
//! batch (tens of microseconds each) can be split in two without paying a
//! thread wake-up per op (the idea behind persistent kernels, on a CPU).
//!
//! The helper pays off only while it has a core of its own. On a busy
//! machine it may be descheduled while it holds a half, and the caller then
//! waits a whole time slice (milliseconds) for a half that takes
//! microseconds. So the installing thread keeps account of what the joins
//! cost against what they would have cost on one thread ([`Payoff`]); when
//! the helper stops paying off, joins run both halves on the caller and the
//! helper parks, for a rest that doubles while it keeps failing. The split
//! itself never changes, so results do not depend on which thread ran what.

use std::cell::Cell;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rayon::prelude::*;

type Job = Box<dyn FnOnce() + Send>;

struct Shared {
    /// Incremented when a job is posted.
    posted: AtomicU64,
    /// Set to the number of the last job finished.
    finished: AtomicU64,
    /// The helper spins while this is set and parks otherwise.
    active: AtomicBool,
    shutdown: AtomicBool,
    /// The helper thread, to unpark it.
    helper: OnceLock<std::thread::Thread>,
    job: Mutex<Option<Job>>,
    /// How long the helper took over its last job, in nanoseconds.
    job_nanos: AtomicU64,
    panicked: Mutex<Option<Box<dyn std::any::Any + Send>>>,
    /// Kept by the installing thread only (the lock is never contended).
    payoff: Mutex<Payoff>,
    /// Test hook: the helper sleeps this long after taking a job, as if
    /// descheduled while it holds it.
    #[cfg(test)]
    stall: Mutex<Duration>,
}

/// The helper is judged over windows of this much one-thread work (or
/// this much wall time, whichever comes first).
const WINDOW: Duration = Duration::from_millis(2);
/// The helper is kept only where joins take at most this share of what the
/// same work takes on one thread.
const KEEP_BELOW: f64 = 0.95;
/// The first rest after a window that did not pay off; it doubles up to
/// [`LONGEST_REST`] while windows keep failing.
const FIRST_REST: Duration = Duration::from_millis(20);
const LONGEST_REST: Duration = Duration::from_secs(2);

/// What the helper's joins cost against one thread (see the module docs).
struct Payoff {
    /// Wall time of this window's joins.
    elapsed: Duration,
    /// What the same halves took to run (the caller's and the helper's).
    serial: Duration,
    /// Until then joins run on the caller and the helper parks.
    resting_until: Option<Instant>,
    rest: Duration,
    /// Windows that did not pay off (for tests and reports).
    failed_windows: u64,
}

impl Payoff {
    fn new() -> Self {
        Payoff {
            elapsed: Duration::ZERO,
            serial: Duration::ZERO,
            resting_until: None,
            rest: FIRST_REST,
            failed_windows: 0,
        }
    }

    /// Whether joins run on the caller now; ends a rest that is over.
    fn resting(&mut self, now: Instant) -> bool {
        match self.resting_until {
            Some(t) if now < t => true,
            Some(_) => {
                self.resting_until = None;
                false
            }
            None => false,
        }
    }

    /// Accounts for one join; true when the helper starts a rest.
    fn record(&mut self, now: Instant, elapsed: Duration, serial: Duration) -> bool {
        self.elapsed += elapsed;
        self.serial += serial;
        // a window ends after enough work, or after enough waiting (one
        // stalled join is enough to judge)
        if self.serial < WINDOW && self.elapsed < WINDOW {
            return false;
        }
        let paid = self.elapsed.as_secs_f64() <= KEEP_BELOW * self.serial.as_secs_f64();
        self.elapsed = Duration::ZERO;
        self.serial = Duration::ZERO;
        if paid {
            self.rest = FIRST_REST;
            return false;
        }
        self.failed_windows += 1;
        self.resting_until = Some(now + self.rest);
        self.rest = (self.rest * 2).min(LONGEST_REST);
        true
    }
}

/// A helper thread that runs one half of each [`join`] while installed.
pub struct SpinHelper {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

thread_local! {
    static INSTALLED: Cell<Option<*const Shared>> = const { Cell::new(None) };
    /// Set while this thread runs its half of a helper join: joins nested
    /// in it run sequentially (the helper is busy with the other half).
    static NESTED: Cell<bool> = const { Cell::new(false) };
}

impl SpinHelper {
    /// Starts the helper thread (parked until [`SpinHelper::install`]).
    pub fn new() -> std::io::Result<Self> {
        let shared = Arc::new(Shared {
            posted: AtomicU64::new(0),
            finished: AtomicU64::new(0),
            active: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            helper: OnceLock::new(),
            job: Mutex::new(None),
            job_nanos: AtomicU64::new(0),
            panicked: Mutex::new(None),
            payoff: Mutex::new(Payoff::new()),
            #[cfg(test)]
            stall: Mutex::new(Duration::ZERO),
        });
        let s = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("ramus-helper".into())
            .spawn(move || helper_loop(&s))?;
        let _ = shared.helper.set(thread.thread().clone());
        Ok(SpinHelper {
            shared,
            thread: Some(thread),
        })
    }

    /// Runs `f` on this thread with the helper spinning for [`join`] work.
    pub fn install<R>(&self, f: impl FnOnce() -> R) -> R {
        let resting = self
            .shared
            .payoff
            .lock()
            .is_ok_and(|mut p| p.resting(Instant::now()));
        if !resting {
            self.wake();
        }
        let previous = INSTALLED.with(|c| c.replace(Some(Arc::as_ptr(&self.shared))));
        let result = catch_unwind(AssertUnwindSafe(f));
        INSTALLED.with(|c| c.set(previous));
        self.shared.active.store(false, Ordering::Release);
        match result {
            Ok(r) => r,
            Err(p) => resume_unwind(p),
        }
    }

    /// Sets the helper spinning.
    fn wake(&self) {
        self.shared.active.store(true, Ordering::Release);
        self.shared.wake_helper();
    }

    /// How many times the helper was sent to rest for not paying off.
    pub fn rests(&self) -> u64 {
        self.shared.payoff.lock().map_or(0, |p| p.failed_windows)
    }
}

impl Shared {
    fn wake_helper(&self) {
        if let Some(t) = self.helper.get() {
            t.unpark();
        }
    }
}

impl Drop for SpinHelper {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}

fn helper_loop(s: &Shared) {
    let mut done = 0u64;
    loop {
        if s.shutdown.load(Ordering::Acquire) {
            return;
        }
        if !s.active.load(Ordering::Acquire) && s.posted.load(Ordering::Acquire) == done {
            std::thread::park_timeout(std::time::Duration::from_millis(50));
            continue;
        }
        let posted = s.posted.load(Ordering::Acquire);
        if posted == done {
            std::hint::spin_loop();
            continue;
        }
        let job = s.job.lock().map(|mut j| j.take()).unwrap_or(None);
        if let Some(job) = job {
            #[cfg(test)]
            std::thread::sleep(s.stall.lock().map_or(Duration::ZERO, |d| *d));
            let t0 = Instant::now();
            if let Err(p) = catch_unwind(AssertUnwindSafe(job)) {
                if let Ok(mut slot) = s.panicked.lock() {
                    *slot = Some(p);
                }
            }
            s.job_nanos
                .store(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        }
        done = posted;
        s.finished.store(done, Ordering::Release);
    }
}

/// Runs `a` and `b`, possibly in parallel, and returns both results.
pub fn join<RA: Send, RB: Send>(
    a: impl FnOnce() -> RA + Send,
    b: impl FnOnce() -> RB + Send,
) -> (RA, RB) {
    if NESTED.with(|n| n.get()) {
        return (a(), b());
    }
    match INSTALLED.with(|c| c.get()) {
        // SAFETY: the pointer was set by `SpinHelper::install` from an `Arc`
        // that the installing `SpinHelper` keeps alive for the whole
        // `install` call, and it is cleared before `install` returns; this
        // thread is inside that call.
        Some(shared) => helper_join(unsafe { &*shared }, a, b),
        None => rayon::join(a, b),
    }
}

fn helper_join<RA, RB: Send>(
    s: &Shared,
    a: impl FnOnce() -> RA,
    b: impl FnOnce() -> RB + Send,
) -> (RA, RB) {
    let start = Instant::now();
    if s.payoff.lock().is_ok_and(|mut p| p.resting(start)) {
        return (a(), b());
    }
    // a rest that just ended left the helper parked
    if !s.active.swap(true, Ordering::AcqRel) {
        // (the helper parks with a timeout, so a missed wake-up costs at
        // most one rest's worth of joins on the caller)
        s.wake_helper();
    }
    let mut rb = None;
    {
        let slot = &mut rb;
        let job: Box<dyn FnOnce() + Send + '_> = Box::new(move || *slot = Some(b()));
        // SAFETY: the job borrows `b`'s captures and `rb`, which live on this
        // stack frame. It runs at most once: whoever takes it out of the
        // slot (the helper, or this thread taking it back) runs it. This
        // function does not return (not even by unwinding: `a` and a job
        // taken back run under catch_unwind) until the job has run here or
        // the helper reports it finished, so the borrows outlive every
        // use; erasing the lifetime only lets the job cross to the helper
        // thread.
        let job: Job = unsafe { std::mem::transmute::<Box<dyn FnOnce() + Send + '_>, Job>(job) };
        if let Ok(mut j) = s.job.lock() {
            *j = Some(job);
        }
        let ticket = s.posted.fetch_add(1, Ordering::AcqRel) + 1;
        NESTED.with(|n| n.set(true));
        let ra = catch_unwind(AssertUnwindSafe(a));
        let caller_time = start.elapsed();
        // a helper that has not taken the job yet (its core busy elsewhere,
        // or descheduled) gives it back: this thread runs it instead of
        // waiting (the slot hands the job to exactly one of the two)
        let unclaimed = s.job.lock().ok().and_then(|mut j| j.take());
        let taken_back = unclaimed.is_some();
        let t_b = Instant::now();
        if let Some(job) = unclaimed {
            if let Err(p) = catch_unwind(AssertUnwindSafe(job)) {
                NESTED.with(|n| n.set(false));
                resume_unwind(p);
            }
        }
        NESTED.with(|n| n.set(false));
        while !taken_back && s.finished.load(Ordering::Acquire) < ticket {
            std::hint::spin_loop();
        }
        let other_half = if taken_back {
            t_b.elapsed()
        } else {
            Duration::from_nanos(s.job_nanos.load(Ordering::Relaxed))
        };
        let now = Instant::now();
        let rest = s
            .payoff
            .lock()
            .is_ok_and(|mut p| p.record(now, now - start, caller_time + other_half));
        if rest {
            s.active.store(false, Ordering::Release);
        }
        let helper_panic = s.panicked.lock().ok().and_then(|mut p| p.take());
        if let Some(p) = helper_panic {
            resume_unwind(p);
        }
        match ra {
            Ok(ra) => (
                ra,
                rb.take()
                    .unwrap_or_else(|| resume_unwind(Box::new("helper job lost"))),
            ),
            Err(p) => resume_unwind(p),
        }
    }
}

/// Outputs with at least this many elements are worth splitting: small with
/// a spinning helper installed (a split costs well under a microsecond), large
/// with rayon (a split may wake a sleeping thread).
pub fn min_split_elements() -> usize {
    if INSTALLED.with(|c| c.get()).is_some() && !NESTED.with(|n| n.get()) {
        1 << 12
    } else {
        1 << 17
    }
}

/// Number of threads kernels may split work over.
pub fn threads() -> usize {
    if NESTED.with(|n| n.get()) {
        1
    } else if INSTALLED.with(|c| c.get()).is_some() {
        2
    } else {
        rayon::current_num_threads()
    }
}

/// `f(index, chunk)` for every `chunk`-sized piece of `data`, split over the
/// available threads.
pub fn for_each_chunk_mut<T: Send>(
    data: &mut [T],
    chunk: usize,
    f: impl Fn(usize, &mut [T]) + Sync,
) {
    let chunk = chunk.max(1);
    if NESTED.with(|n| n.get()) {
        data.chunks_mut(chunk)
            .enumerate()
            .for_each(|(i, c)| f(i, c));
    } else if INSTALLED.with(|c| c.get()).is_some() {
        let pieces = data.len().div_ceil(chunk);
        let (lo, hi) = data.split_at_mut((pieces / 2) * chunk);
        let first = pieces / 2;
        join(
            || lo.chunks_mut(chunk).enumerate().for_each(|(i, c)| f(i, c)),
            || {
                hi.chunks_mut(chunk)
                    .enumerate()
                    .for_each(|(i, c)| f(first + i, c))
            },
        );
    } else {
        data.par_chunks_mut(chunk)
            .enumerate()
            .for_each(|(i, c)| f(i, c));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn join_runs_both_sides_with_and_without_helper() {
        assert_eq!(join(|| 1, || 2), (1, 2));
        let helper = SpinHelper::new().unwrap();
        let sums = helper.install(|| {
            assert_eq!(threads(), 2);
            (0..200)
                .map(|i| {
                    let v: Vec<u64> = (0..i).collect();
                    let (a, b) = join(
                        || v[..i as usize / 2].iter().sum::<u64>(),
                        || v[i as usize / 2..].iter().sum::<u64>(),
                    );
                    a + b
                })
                .collect::<Vec<_>>()
        });
        for (i, s) in sums.iter().enumerate() {
            assert_eq!(*s, (0..i as u64).sum::<u64>());
        }
        let mut data = vec![0usize; 1000];
        helper
            .install(|| for_each_chunk_mut(&mut data, 7, |i, c| c.iter_mut().for_each(|x| *x = i)));
        assert!(data.iter().enumerate().all(|(j, &x)| x == j / 7));
    }

    /// Half of a join: about `micros` of arithmetic.
    fn work(micros: u64) {
        let t0 = Instant::now();
        let mut x = 1u64;
        while t0.elapsed() < Duration::from_micros(micros) {
            for _ in 0..64 {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
            }
        }
        std::hint::black_box(x);
    }

    #[test]
    fn a_helper_that_loses_its_core_is_rested_and_joins_run_on_the_caller() {
        let helper = SpinHelper::new().unwrap();
        // the helper holds each half it takes for 5 ms, as a helper whose
        // core another process took would until its next time slice
        *helper.shared.stall.lock().unwrap() = Duration::from_millis(5);
        let joins = 2000;
        let t0 = Instant::now();
        let sums = helper.install(|| {
            (0..joins)
                .map(|i| {
                    let (a, b) = join(
                        || {
                            work(20);
                            0
                        },
                        || i,
                    );
                    a + b
                })
                .sum::<u64>()
        });
        let took = t0.elapsed();
        assert_eq!(sums, (0..joins).sum::<u64>());
        assert!(helper.rests() >= 1, "the stalled helper was never rested");
        // 2000 joins of 20 us halves: 80 ms on one thread; waiting out the
        // stall at every join (without rests) would take over 10 s
        assert!(
            took < Duration::from_secs(2),
            "{joins} joins took {took:?} with a stalled helper"
        );
    }

    #[test]
    fn a_panic_in_either_half_reaches_the_caller() {
        let helper = SpinHelper::new().unwrap();
        let r = catch_unwind(AssertUnwindSafe(|| {
            helper.install(|| join(|| 1, || -> i32 { panic!("right side") }))
        }));
        assert!(r.is_err());
        let r = catch_unwind(AssertUnwindSafe(|| {
            helper.install(|| join(|| -> i32 { panic!("left side") }, || 2))
        }));
        assert!(r.is_err());
        // the helper still works afterwards, also with nested joins
        assert_eq!(helper.install(|| join(|| 3, || 4)), (3, 4));
        let nested = helper.install(|| join(|| join(|| 1, || 2), || join(|| 3, || 4)));
        assert_eq!(nested, ((1, 2), (3, 4)));
    }
}
