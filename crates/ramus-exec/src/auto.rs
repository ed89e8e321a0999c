//! The measuring chooser among inference engines ([`AutoInfer`]): for each
//! batch shape (number of graphs, total vertices to the next power of two)
//! it runs every candidate engine on the first batch of that shape a few
//! times, keeps the fastest (its best time), and sends every later batch of
//! the shape to it. A candidate that refuses the model (when built) or the
//! batch (when measured) is skipped with a notice; the choice and the
//! timings behind it are noticed too.
//!
//! ```
//! use ramus_exec::{AutoInfer, InferEngine, Scores};
//! use ramus_graph::InputGraph;
//!
//! struct Fixed(&'static str, f32);
//! impl InferEngine<f32> for Fixed {
//!     fn name(&self) -> &'static str {
//!         self.0
//!     }
//!     fn infer(&mut self, graphs: &[&InputGraph]) -> ramus_exec::Result<Scores<f32>> {
//!         Ok(Scores { values: vec![self.1; graphs.len()], classes: 1 })
//!     }
//! }
//!
//! let mut notices = Vec::new();
//! let mut auto = AutoInfer::new(
//!     vec![
//!         ("refuser", Err("cannot run this model".to_string())),
//!         ("fixed", Ok(Box::new(Fixed("fixed", 0.5)) as Box<dyn InferEngine<f32>>)),
//!     ],
//!     |line: &str| notices.push(line.to_string()),
//! )
//! .unwrap();
//! let mut leaf = InputGraph::new();
//! leaf.push_vertex(&[], 0, 0).unwrap();
//! assert_eq!(auto.infer(&[&leaf]).unwrap().values, vec![0.5]);
//! drop(auto);
//! assert!(notices[0].contains("refuser") && notices[0].contains("cannot run this model"));
//! ```

use std::collections::HashMap;
use std::fmt;
use std::time::Instant;

use ramus_core::Real;
use ramus_graph::InputGraph;

use crate::error::{ExecError, Result};
use crate::infer::{InferEngine, Scores};

/// Where [`AutoInfer`] reads the time: the wall clock ([`WallClock`]), or
/// a test's own.
pub trait Clock {
    /// Seconds since some fixed instant.
    fn seconds(&mut self) -> f64;
}

/// The wall clock (the engines synchronize their devices before returning
/// scores, so it times the whole batch).
pub struct WallClock(Instant);

impl Default for WallClock {
    fn default() -> Self {
        WallClock(Instant::now())
    }
}

impl Clock for WallClock {
    fn seconds(&mut self) -> f64 {
        self.0.elapsed().as_secs_f64()
    }
}

/// What [`AutoInfer`] chooses an engine for: the number of graphs of a
/// batch and their vertices in all, rounded up to a power of two.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BatchShape {
    pub graphs: usize,
    /// At most this many vertices in all, and more than half as many.
    pub vertices: usize,
}

impl BatchShape {
    /// The shape of the batch `graphs`.
    pub fn of(graphs: &[&InputGraph]) -> Self {
        let total: usize = graphs.iter().map(|g| g.len()).sum();
        BatchShape {
            graphs: graphs.len(),
            vertices: total.max(1).next_power_of_two(),
        }
    }
}

impl fmt::Display for BatchShape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = if self.graphs == 1 { "" } else { "s" };
        let (lo, hi) = (self.vertices / 2 + 1, self.vertices);
        match (lo, hi) {
            (_, 1) => write!(f, "{} graph{s} of 1 vertex", self.graphs),
            (lo, hi) if lo == hi => write!(f, "{} graph{s} of {hi} vertices", self.graphs),
            (lo, hi) => write!(f, "{} graph{s} of {lo}-{hi} vertices", self.graphs),
        }
    }
}

/// A candidate engine as offered to [`AutoInfer::new`]: its name, and the
/// engine or why it could not be built for the model.
pub type Offer<'a, T> = (
    &'static str,
    std::result::Result<Box<dyn InferEngine<T> + 'a>, String>,
);

/// Runs each batch on the fastest of its candidate engines for the batch's
/// shape, measured on the first batch of that shape; see the module docs.
pub struct AutoInfer<'a, T: Real> {
    candidates: Vec<Box<dyn InferEngine<T> + 'a>>,
    clock: Box<dyn Clock + 'a>,
    /// Runs of each candidate on a shape's first batch (its best counts).
    rounds: usize,
    chosen: HashMap<BatchShape, usize>,
    notice: Box<dyn FnMut(&str) + 'a>,
}

/// Each candidate's best time on one batch, `None` where it failed.
struct Trial<T> {
    seconds: Vec<Option<f64>>,
    scores: Vec<Option<Scores<T>>>,
    errors: Vec<Option<ExecError>>,
}

impl<'a, T: Real> AutoInfer<'a, T> {
    /// The chooser among the engines of `offers` that could be built (in
    /// order of preference: the first of equally fast ones wins); each
    /// refusal is a `notice` line, and so is each choice. An error, naming
    /// every refusal, when none could be built.
    pub fn new(offers: Vec<Offer<'a, T>>, notice: impl FnMut(&str) + 'a) -> Result<Self> {
        let mut notice: Box<dyn FnMut(&str) + 'a> = Box::new(notice);
        let (mut candidates, mut refusals) = (Vec::new(), Vec::new());
        for (name, offer) in offers {
            match offer {
                Ok(engine) => candidates.push(engine),
                Err(why) => {
                    notice(&format!("auto: {name} left out: {why}"));
                    refusals.push(format!("{name}: {why}"));
                }
            }
        }
        if candidates.is_empty() {
            return Err(ExecError::Config(format!(
                "no inference engine can run this model ({})",
                refusals.join("; ")
            )));
        }
        Ok(AutoInfer {
            candidates,
            clock: Box::new(WallClock::default()),
            rounds: 3,
            chosen: HashMap::new(),
            notice,
        })
    }

    /// Reads the time from `clock` instead of the wall clock.
    pub fn with_clock(mut self, clock: impl Clock + 'a) -> Self {
        self.clock = Box::new(clock);
        self
    }

    /// Runs each candidate `rounds` times (at least once) on a shape's
    /// first batch; 3 by default (the first run of a shape may grow buffers).
    pub fn with_rounds(mut self, rounds: usize) -> Self {
        self.rounds = rounds.max(1);
        self
    }

    /// The engine chosen for batches of `shape`, once one of them ran.
    pub fn chosen(&self, shape: BatchShape) -> Option<&'static str> {
        self.chosen.get(&shape).map(|&i| self.candidates[i].name())
    }

    /// Runs every candidate on `graphs` and keeps each one's best time.
    fn trial(&mut self, graphs: &[&InputGraph]) -> Trial<T> {
        let n = self.candidates.len();
        let mut trial = Trial {
            seconds: vec![None; n],
            scores: vec![None; n],
            errors: (0..n).map(|_| None).collect(),
        };
        for _ in 0..self.rounds {
            for (i, engine) in self.candidates.iter_mut().enumerate() {
                if trial.errors[i].is_some() {
                    continue;
                }
                let started = self.clock.seconds();
                match engine.infer(graphs) {
                    Ok(scores) => {
                        let took = self.clock.seconds() - started;
                        let best = trial.seconds[i].map_or(took, |b: f64| b.min(took));
                        trial.seconds[i] = Some(best);
                        trial.scores[i] = Some(scores);
                    }
                    Err(e) => {
                        trial.seconds[i] = None;
                        trial.errors[i] = Some(e);
                    }
                }
            }
        }
        trial
    }

    /// Measures the candidates on the first batch of `shape`, remembers
    /// the fastest and returns its scores; the first candidate's error if
    /// every one failed.
    fn choose(&mut self, shape: BatchShape, graphs: &[&InputGraph]) -> Result<Scores<T>> {
        let mut trial = self.trial(graphs);
        let best = (0..self.candidates.len())
            .filter_map(|i| trial.seconds[i].map(|s| (i, s)))
            .fold(None, |best: Option<(usize, f64)>, (i, s)| match best {
                Some((_, b)) if b <= s => best,
                _ => Some((i, s)),
            });
        let Some((chosen, _)) = best else {
            let first = trial.errors.iter_mut().find_map(Option::take);
            return Err(first.unwrap_or_else(|| ExecError::Config("no engine ran".into())));
        };
        let mut timings = Vec::new();
        for (i, engine) in self.candidates.iter().enumerate() {
            match (&trial.seconds[i], &trial.errors[i]) {
                (Some(s), _) => timings.push(format!("{} {:.3} ms", engine.name(), s * 1e3)),
                (None, Some(e)) => {
                    (self.notice)(&format!(
                        "auto: {} skipped for batches of {shape}: {e}",
                        engine.name()
                    ));
                }
                (None, None) => {}
            }
        }
        (self.notice)(&format!(
            "auto: batches of {shape}: {} (best of {} runs): {}",
            timings.join(", "),
            self.rounds,
            self.candidates[chosen].name()
        ));
        self.chosen.insert(shape, chosen);
        trial.scores[chosen]
            .take()
            .ok_or_else(|| ExecError::Config("the chosen engine gave no scores".into()))
    }
}

impl<T: Real> InferEngine<T> for AutoInfer<'_, T> {
    fn name(&self) -> &'static str {
        "auto"
    }

    fn infer(&mut self, graphs: &[&InputGraph]) -> Result<Scores<T>> {
        if self.candidates.len() == 1 {
            return self.candidates[0].infer(graphs);
        }
        let shape = BatchShape::of(graphs);
        match self.chosen.get(&shape) {
            Some(&i) => self.candidates[i].infer(graphs),
            None => self.choose(shape, graphs),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::{Cell, RefCell};
    use std::rc::Rc;

    /// A clock the fake engines move on.
    #[derive(Clone, Default)]
    struct FakeClock(Rc<Cell<f64>>);

    impl Clock for FakeClock {
        fn seconds(&mut self) -> f64 {
            self.0.get()
        }
    }

    /// Takes `fixed + per_graph × graphs` seconds of the fake clock a batch, scores
    /// every graph `score`, and counts its runs; refuses batches of more
    /// than `max_graphs` graphs.
    struct Fake {
        name: &'static str,
        clock: FakeClock,
        per_graph: f64,
        fixed: f64,
        /// Seconds more on the first run only.
        first_extra: f64,
        score: f32,
        max_graphs: usize,
        runs: Rc<RefCell<Vec<&'static str>>>,
    }

    impl InferEngine<f32> for Fake {
        fn name(&self) -> &'static str {
            self.name
        }
        fn infer(&mut self, graphs: &[&InputGraph]) -> Result<Scores<f32>> {
            self.runs.borrow_mut().push(self.name);
            if graphs.len() > self.max_graphs {
                return Err(ExecError::Input(format!(
                    "{} takes at most {} graphs",
                    self.name, self.max_graphs
                )));
            }
            let c = &self.clock.0;
            let extra = std::mem::take(&mut self.first_extra);
            c.set(c.get() + extra + self.fixed + self.per_graph * graphs.len() as f64);
            Ok(Scores {
                values: vec![self.score; graphs.len()],
                classes: 1,
            })
        }
    }

    fn leaves(n: usize) -> Vec<InputGraph> {
        (0..n)
            .map(|_| {
                let mut g = InputGraph::new();
                g.push_vertex(&[], 0, 0).expect("leaf");
                g
            })
            .collect()
    }

    struct Setup {
        clock: FakeClock,
        runs: Rc<RefCell<Vec<&'static str>>>,
        notices: Rc<RefCell<Vec<String>>>,
    }

    impl Setup {
        fn new() -> Self {
            Setup {
                clock: FakeClock::default(),
                runs: Rc::default(),
                notices: Rc::default(),
            }
        }
        /// `name` costing `fixed + per_graph × graphs` seconds a batch.
        fn fake(&self, name: &'static str, fixed: f64, per_graph: f64, score: f32) -> Fake {
            Fake {
                name,
                clock: self.clock.clone(),
                per_graph,
                fixed,
                first_extra: 0.0,
                score,
                max_graphs: usize::MAX,
                runs: self.runs.clone(),
            }
        }
        fn auto(&self, offers: Vec<Offer<'static, f32>>) -> Result<AutoInfer<'static, f32>> {
            let notices = self.notices.clone();
            let auto = AutoInfer::new(offers, move |l: &str| notices.borrow_mut().push(l.into()))?;
            Ok(auto.with_clock(self.clock.clone()))
        }
    }

    fn offer(engine: Fake) -> Offer<'static, f32> {
        (engine.name, Ok(Box::new(engine)))
    }

    #[test]
    fn picks_the_measured_fastest_per_shape_and_keeps_it() {
        let s = Setup::new();
        // "latency" wins small batches, "throughput" large ones
        let latency = s.fake("latency", 0.001, 0.001, 1.0);
        let throughput = s.fake("throughput", 0.010, 0.0001, 2.0);
        let mut auto = s.auto(vec![offer(latency), offer(throughput)]).unwrap();
        let (small, large) = (leaves(2), leaves(200));
        let small: Vec<&InputGraph> = small.iter().collect();
        let large: Vec<&InputGraph> = large.iter().collect();

        // the first small batch: both measured 3 times, the fastest's scores
        assert_eq!(auto.infer(&small).unwrap().values, vec![1.0; 2]);
        assert_eq!(s.runs.borrow().len(), 6);
        assert_eq!(auto.chosen(BatchShape::of(&small)), Some("latency"));
        // later batches of the shape run on the choice alone
        s.runs.borrow_mut().clear();
        for _ in 0..4 {
            assert_eq!(auto.infer(&small).unwrap().values, vec![1.0; 2]);
        }
        assert_eq!(*s.runs.borrow(), vec!["latency"; 4]);
        // another shape is measured anew
        assert_eq!(auto.infer(&large).unwrap().values, vec![2.0; 200]);
        assert_eq!(auto.chosen(BatchShape::of(&large)), Some("throughput"));
        let notices = s.notices.borrow();
        assert_eq!(notices.len(), 2, "{notices:?}");
        assert!(
            notices[0].contains("2 graphs of 2 vertices")
                && notices[0].contains("latency 3.000 ms")
                && notices[0].contains("throughput 10.200 ms")
                && notices[0].ends_with(": latency"),
            "{notices:?}"
        );
        assert!(notices[1].ends_with(": throughput"), "{notices:?}");
    }

    #[test]
    fn keeps_the_best_run_and_prefers_the_first_of_equals() {
        let s = Setup::new();
        let first = s.fake("first", 0.002, 0.0, 1.0);
        let second = s.fake("second", 0.002, 0.0, 2.0);
        let mut auto = s.auto(vec![offer(first), offer(second)]).unwrap();
        let g = leaves(1);
        assert_eq!(auto.infer(&[&g[0]]).unwrap().values, vec![1.0]);
        assert_eq!(auto.chosen(BatchShape::of(&[&g[0]])), Some("first"));

        // a slow first run (a buffer growing) does not count against it
        let s = Setup::new();
        let mut warming = s.fake("warming", 0.001, 0.0, 1.0);
        warming.first_extra = 0.050;
        let steady = s.fake("steady", 0.0015, 0.0, 2.0);
        let mut auto = s.auto(vec![offer(warming), offer(steady)]).unwrap();
        assert_eq!(auto.infer(&[&g[0]]).unwrap().values, vec![1.0]);
        assert_eq!(auto.chosen(BatchShape::of(&[&g[0]])), Some("warming"));
        // measured once, the first run is all there is
        let s = Setup::new();
        let mut warming = s.fake("warming", 0.001, 0.0, 1.0);
        warming.first_extra = 0.050;
        let steady = s.fake("steady", 0.0015, 0.0, 2.0);
        let mut auto = s
            .auto(vec![offer(warming), offer(steady)])
            .unwrap()
            .with_rounds(1);
        assert_eq!(auto.infer(&[&g[0]]).unwrap().values, vec![2.0]);
        assert_eq!(s.runs.borrow().len(), 2);
    }

    #[test]
    fn skips_refusals_with_a_notice_and_fails_only_when_all_fail() {
        let s = Setup::new();
        let mut small_only = s.fake("small-only", 0.0, 0.0001, 1.0);
        small_only.max_graphs = 4;
        let slow = s.fake("slow", 0.5, 0.0, 2.0);
        let offers = vec![
            ("unbuildable", Err("has no cell for op `Foo`".to_string())),
            offer(small_only),
            offer(slow),
        ];
        let mut auto = s.auto(offers).unwrap();
        let large = leaves(8);
        let large: Vec<&InputGraph> = large.iter().collect();
        // the fast engine refuses this batch: the slow one runs it
        assert_eq!(auto.infer(&large).unwrap().values, vec![2.0; 8]);
        assert_eq!(auto.chosen(BatchShape::of(&large)), Some("slow"));
        let notices = s.notices.borrow().clone();
        assert!(notices[0].contains("unbuildable left out: has no cell for op `Foo`"));
        assert!(notices[1].contains("small-only skipped") && notices[1].contains("at most 4"));
        assert!(notices[2].ends_with(": slow"), "{notices:?}");

        // every candidate refusing the batch: the first one's error, unchanged
        let s = Setup::new();
        let (mut a, mut b) = (s.fake("a", 0.0, 0.0, 1.0), s.fake("b", 0.0, 0.0, 1.0));
        (a.max_graphs, b.max_graphs) = (0, 0);
        let mut auto = s.auto(vec![offer(a), offer(b)]).unwrap();
        let e = auto.infer(&large).unwrap_err().to_string();
        assert_eq!(e, "bad input: a takes at most 0 graphs");

        // nothing buildable: an error naming every refusal
        let s = Setup::new();
        let offers: Vec<Offer<'static, f32>> =
            vec![("x", Err("no CUDA".into())), ("y", Err("no cell".into()))];
        let e = s.auto(offers).err().expect("refused").to_string();
        assert!(e.contains("x: no CUDA; y: no cell"), "{e}");
    }
}
