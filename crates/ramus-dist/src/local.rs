//! A group of ranks inside one process (one thread each), for engines
//! whose gradients live on the host: the CPU engine trained data-parallel
//! across threads, and the tests that check data parallelism without a
//! GPU. Every collective gathers each rank's contribution and every rank
//! sums them in rank order, so the sums are identical on every rank and
//! from run to run. A rank that is dropped, or that does not arrive within
//! the group's timeout, makes the others fail naming it instead of waiting
//! for ever.

use std::marker::PhantomData;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use ramus_core::Real;
use ramus_exec::data_parallel::{Collective, GradBuffer};
use ramus_exec::{ExecError, Result};

/// One rank's contribution to a collective.
#[derive(Clone, Debug)]
enum Payload {
    Values(Vec<f64>),
}

struct State {
    /// Collectives completed so far.
    generation: u64,
    /// This generation's contributions, by rank.
    arrived: Vec<Option<Payload>>,
    /// The last completed generation's contributions, in rank order.
    gathered: Arc<Vec<Payload>>,
    /// Ranks dropped.
    left: Vec<bool>,
    /// Why a rank gave up waiting, for the others to report.
    gave_up: Option<String>,
}

struct Shared {
    state: Mutex<State>,
    wake: Condvar,
    timeout: Duration,
    world: usize,
}

/// One rank of a [`local_group`]: a [`Collective`] over host buffers.
pub struct LocalRank<T> {
    rank: usize,
    shared: Arc<Shared>,
    /// The rank's own handle (dropping it leaves the group), not one made
    /// by [`Collective::handle`].
    primary: bool,
    _values: PhantomData<fn(T) -> T>,
}

/// `world` ranks that sum with each other, one per thread; a collective
/// that some rank does not reach within `timeout` fails on the others.
pub fn local_group<T: Real>(world: usize, timeout: Duration) -> Vec<LocalRank<T>> {
    let shared = Arc::new(Shared {
        state: Mutex::new(State {
            generation: 0,
            arrived: vec![None; world],
            gathered: Arc::new(Vec::new()),
            left: vec![false; world],
            gave_up: None,
        }),
        wake: Condvar::new(),
        timeout,
        world,
    });
    (0..world)
        .map(|rank| LocalRank {
            rank,
            shared: shared.clone(),
            primary: true,
            _values: PhantomData,
        })
        .collect()
}

impl<T> LocalRank<T> {
    fn lock(&self) -> Result<MutexGuard<'_, State>> {
        self.shared
            .state
            .lock()
            .map_err(|_| self.failure("another rank panicked inside a collective".into()))
    }

    fn failure(&self, message: String) -> ExecError {
        ExecError::Config(format!(
            "data-parallel rank {} of the local group: {message}",
            self.rank
        ))
    }

    /// Every rank's `mine`, in rank order, once all have given theirs.
    fn gather(&self, mine: Payload) -> Result<Arc<Vec<Payload>>> {
        let mut st = self.lock()?;
        let world = self.shared.world;
        let generation = st.generation;
        st.arrived[self.rank] = Some(mine);
        if st.arrived.iter().all(Option::is_some) {
            let all = st.arrived.iter_mut().filter_map(Option::take).collect();
            st.gathered = Arc::new(all);
            st.generation += 1;
            self.shared.wake.notify_all();
            return Ok(st.gathered.clone());
        }
        let deadline = Instant::now() + self.shared.timeout;
        while st.generation == generation {
            if let Some(why) = &st.gave_up {
                return Err(self.failure(why.clone()));
            }
            if let Some(gone) = st.left.iter().position(|&l| l) {
                return Err(self.failure(format!(
                    "rank {gone} left the group in the middle of a collective"
                )));
            }
            let now = Instant::now();
            if now >= deadline {
                let missing: Vec<String> = (0..world)
                    .filter(|&r| st.arrived[r].is_none())
                    .map(|r| r.to_string())
                    .collect();
                let why = format!(
                    "rank(s) {} of {world} did not reach the collective within {:.1} s",
                    missing.join(", "),
                    self.shared.timeout.as_secs_f64()
                );
                st.gave_up = Some(why.clone());
                self.shared.wake.notify_all();
                return Err(self.failure(why));
            }
            st = self
                .shared
                .wake
                .wait_timeout(st, deadline - now)
                .map_err(|_| self.failure("another rank panicked inside a collective".into()))?
                .0;
        }
        Ok(st.gathered.clone())
    }

    /// The element-wise sums, in rank order, of every rank's `values`.
    fn sum(&self, values: Vec<f64>) -> Result<Vec<f64>> {
        let len = values.len();
        let all = self.gather(Payload::Values(values))?;
        let mut sum = vec![0.0; len];
        for (rank, part) in all.iter().enumerate() {
            match part {
                Payload::Values(v) if v.len() == len => {
                    sum.iter_mut().zip(v).for_each(|(s, x)| *s += x);
                }
                _ => {
                    return Err(self.failure(format!(
                        "rank {rank} called another collective or gave another size \
                         (ranks must call the same collectives in the same order)"
                    )))
                }
            }
        }
        Ok(sum)
    }
}

impl<T> Drop for LocalRank<T> {
    fn drop(&mut self) {
        if !self.primary {
            return;
        }
        if let Ok(mut st) = self.shared.state.lock() {
            st.left[self.rank] = true;
            self.shared.wake.notify_all();
        }
    }
}

impl<T: Real> Collective<T> for LocalRank<T> {
    fn rank(&self) -> usize {
        self.rank
    }

    fn handle(&self) -> Option<Box<dyn Collective<T>>> {
        Some(Box::new(LocalRank::<T> {
            rank: self.rank,
            shared: self.shared.clone(),
            primary: false,
            _values: PhantomData,
        }))
    }

    fn world(&self) -> usize {
        self.shared.world
    }

    fn sum_scalars(&mut self, values: &mut [f64]) -> Result<()> {
        let sum = self.sum(values.to_vec())?;
        values.copy_from_slice(&sum);
        Ok(())
    }

    fn sum_buffers(&mut self, mut buffers: Vec<GradBuffer<'_, T>>, scale: f64) -> Result<()> {
        let mut flat = Vec::new();
        for b in &buffers {
            match b {
                GradBuffer::Host(v) => flat.extend(v.iter().map(|x| x.to_f64() * scale)),
                GradBuffer::Device(_) => {
                    return Err(self.failure(
                        "the local group sums host buffers only, not device memory".into(),
                    ))
                }
            }
        }
        let sum = self.sum(flat)?;
        let mut at = 0;
        for b in &mut buffers {
            if let GradBuffer::Host(v) = b {
                v.iter_mut()
                    .zip(&sum[at..])
                    .for_each(|(x, s)| *x = T::from_f64(*s));
                at += v.len();
            }
        }
        Ok(())
    }
}
