//! Fork-join for kernels. Outside a pass this is rayon. During a pass an
//! engine may install a [`SpinHelper`]: a second thread that busy-waits for
//! work, so that the many small products and elementwise ops of a dynamic
//! batch (tens of microseconds each) can be split in two without paying a
//! thread wake-up per op (the idea behind persistent kernels, on a CPU).

use std::cell::Cell;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

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
    job: Mutex<Option<Job>>,
    panicked: Mutex<Option<Box<dyn std::any::Any + Send>>>,
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
            job: Mutex::new(None),
            panicked: Mutex::new(None),
        });
        let s = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("ramus-helper".into())
            .spawn(move || helper_loop(&s))?;
        Ok(SpinHelper {
            shared,
            thread: Some(thread),
        })
    }

    /// Runs `f` on this thread with the helper spinning for [`join`] work.
    pub fn install<R>(&self, f: impl FnOnce() -> R) -> R {
        self.shared.active.store(true, Ordering::Release);
        if let Some(t) = &self.thread {
            t.thread().unpark();
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
            if let Err(p) = catch_unwind(AssertUnwindSafe(job)) {
                if let Ok(mut slot) = s.panicked.lock() {
                    *slot = Some(p);
                }
            }
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
        // a helper that has not taken the job yet (its core busy elsewhere,
        // or descheduled) gives it back: this thread runs it instead of
        // waiting (the slot hands the job to exactly one of the two)
        let unclaimed = s.job.lock().ok().and_then(|mut j| j.take());
        let taken_back = unclaimed.is_some();
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
