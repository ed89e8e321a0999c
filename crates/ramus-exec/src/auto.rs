//! The measuring chooser among inference engines ([`AutoInfer`]): for each
//! batch shape (number of graphs, total vertices to the next power of two)
//! it runs every candidate engine on the first batch of that shape a few
//! times, keeps the fastest (its best time), and sends every later batch of
//! the shape to it. A candidate that refuses the model (when built) or the
//! batch (when measured) is skipped with a notice; the choice and the
//! timings behind it are noticed too.
//!
//! Set-up counts too ([`AutoInfer::lazy`]): candidates are built when a
//! shape first needs them, their set-up timed, and one whose estimated
//! set-up exceeds what it can save over the run's batches of the shape
//! ([`AutoInfer::with_run`]: the fastest measured engine's time for them,
//! the share of it a candidate at most [`LazyOffer::speedup_bound`] times
//! faster saves) is not built for it: its set-up cannot pay for itself.
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
        Self::counted(graphs.len(), graphs.iter().map(|g| g.len()).sum())
    }

    /// The shapes of the batches of `batch_size` graphs (the last one
    /// shorter) that `graphs` is run in: what [`AutoInfer::with_run`] takes.
    pub fn of_chunks(graphs: &[InputGraph], batch_size: usize) -> Vec<Self> {
        graphs
            .chunks(batch_size.max(1))
            .map(|c| Self::counted(c.len(), c.iter().map(InputGraph::len).sum()))
            .collect()
    }

    fn counted(graphs: usize, vertices: usize) -> Self {
        BatchShape {
            graphs,
            vertices: vertices.max(1).next_power_of_two(),
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

/// Builds a candidate engine for the model (its set-up, which
/// [`AutoInfer`] times), or says why it cannot run the model.
pub type Build<'a, T> =
    Box<dyn FnOnce() -> std::result::Result<Box<dyn InferEngine<T> + 'a>, String> + 'a>;

/// A candidate engine offered to [`AutoInfer::lazy`], built only when a
/// batch shape needs it measured.
pub struct LazyOffer<'a, T> {
    pub name: &'static str,
    /// Seconds building it is expected to take, where the offerer can
    /// tell cheaply beforehand (`None`: negligible or unknown, so it is
    /// built when first needed).
    pub setup_estimate: Option<f64>,
    /// At most how many times faster than another engine it runs a batch,
    /// as far as known (`f64::INFINITY` where unknown): its set-up must be
    /// repaid by what it can save, not by the other engine's whole time.
    pub speedup_bound: f64,
    pub build: Build<'a, T>,
}

/// A candidate's engine: not built yet, built, or refused when built.
enum Slot<'a, T> {
    Unbuilt(Build<'a, T>),
    Built(Box<dyn InferEngine<T> + 'a>),
    Refused(String),
}

struct Candidate<'a, T> {
    name: &'static str,
    slot: Slot<'a, T>,
    setup_estimate: Option<f64>,
    speedup_bound: f64,
    /// Seconds its build took, once built here (`None` when given built).
    setup: Option<f64>,
}

/// Runs each batch on the candidate engine expected to finish the run's
/// batches of its shape soonest (set-up included), measured on the first
/// batch of that shape; see the module docs.
pub struct AutoInfer<'a, T: Real> {
    candidates: Vec<Candidate<'a, T>>,
    clock: Box<dyn Clock + 'a>,
    /// Runs of each candidate on a shape's first batch (its best counts).
    rounds: usize,
    chosen: HashMap<BatchShape, usize>,
    /// Batches of each shape the run presents, when told ([`AutoInfer::with_run`]).
    planned: Option<HashMap<BatchShape, usize>>,
    notice: Box<dyn FnMut(&str) + 'a>,
}

/// Each candidate's best time on one batch, `None` where it failed or
/// was not measured.
struct Trial<T> {
    seconds: Vec<Option<f64>>,
    scores: Vec<Option<Scores<T>>>,
    errors: Vec<Option<ExecError>>,
    /// Why a candidate was not built for this shape.
    not_built: Vec<Option<String>>,
    /// Seconds a candidate's build took during this trial.
    setup: Vec<Option<f64>>,
}

impl<T> Trial<T> {
    fn new(n: usize) -> Self {
        Trial {
            seconds: vec![None; n],
            scores: (0..n).map(|_| None).collect(),
            errors: (0..n).map(|_| None).collect(),
            not_built: vec![None; n],
            setup: vec![None; n],
        }
    }

    /// The fastest candidate measured and its time (the first of equals).
    fn best(&self) -> Option<(usize, f64)> {
        self.seconds
            .iter()
            .enumerate()
            .filter_map(|(i, s)| s.map(|s| (i, s)))
            .fold(None, |best, (i, s)| match best {
                Some((_, b)) if b <= s => best,
                _ => Some((i, s)),
            })
    }
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
                Ok(engine) => candidates.push(Candidate {
                    name,
                    slot: Slot::Built(engine),
                    setup_estimate: None,
                    speedup_bound: f64::INFINITY,
                    setup: None,
                }),
                Err(why) => {
                    notice(&format!("auto: {name} left out: {why}"));
                    refusals.push(format!("{name}: {why}"));
                }
            }
        }
        if candidates.is_empty() {
            return Err(no_engine(&refusals));
        }
        Ok(Self::over(candidates, notice))
    }

    /// The chooser among `offers` (in order of preference), each built
    /// when a batch shape first needs it measured, its set-up timed. With
    /// the run's batches known ([`AutoInfer::with_run`]), a candidate
    /// whose estimated set-up exceeds what it can save over the shape's
    /// batches against the fastest engine measured is not built for it.
    /// A refusal to build is a `notice` line; an error when `offers` is
    /// empty.
    pub fn lazy(offers: Vec<LazyOffer<'a, T>>, notice: impl FnMut(&str) + 'a) -> Result<Self> {
        if offers.is_empty() {
            return Err(no_engine(&[]));
        }
        let candidates = offers
            .into_iter()
            .map(|o| Candidate {
                name: o.name,
                slot: Slot::Unbuilt(o.build),
                setup_estimate: o.setup_estimate,
                speedup_bound: o.speedup_bound,
                setup: None,
            })
            .collect();
        Ok(Self::over(candidates, Box::new(notice)))
    }

    fn over(candidates: Vec<Candidate<'a, T>>, notice: Box<dyn FnMut(&str) + 'a>) -> Self {
        AutoInfer {
            candidates,
            clock: Box::new(WallClock::default()),
            rounds: 3,
            chosen: HashMap::new(),
            planned: None,
            notice,
        }
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

    /// The shapes of the batches the run will present, in any order
    /// ([`BatchShape::of_chunks`]): a candidate's set-up is then weighed
    /// against the time of the batches of each shape. Without them the
    /// run is taken as endless (set-up never counts).
    pub fn with_run(mut self, shapes: impl IntoIterator<Item = BatchShape>) -> Self {
        let mut planned = HashMap::new();
        for shape in shapes {
            *planned.entry(shape).or_insert(0usize) += 1;
        }
        self.planned = Some(planned);
        self
    }

    /// The engine chosen for batches of `shape`, once one of them ran.
    pub fn chosen(&self, shape: BatchShape) -> Option<&'static str> {
        self.chosen.get(&shape).map(|&i| self.candidates[i].name)
    }

    /// Builds candidate `i` if it is not built yet, timing it and noticing
    /// a refusal; whether it is built now.
    fn build(&mut self, i: usize, trial: &mut Trial<T>) -> bool {
        let c = &mut self.candidates[i];
        if let Slot::Unbuilt(_) = c.slot {
            let Slot::Unbuilt(build) = std::mem::replace(&mut c.slot, Slot::Refused(String::new()))
            else {
                return false;
            };
            let started = self.clock.seconds();
            let built = build();
            let took = self.clock.seconds() - started;
            c.slot = match built {
                Ok(engine) => {
                    c.setup = Some(took);
                    trial.setup[i] = Some(took);
                    Slot::Built(engine)
                }
                Err(why) => {
                    (self.notice)(&format!("auto: {} left out: {why}", c.name));
                    Slot::Refused(why)
                }
            };
        }
        matches!(self.candidates[i].slot, Slot::Built(_))
    }

    /// Runs the built candidates `which` on `graphs`, alternating, and
    /// keeps each one's best time.
    fn measure(&mut self, which: &[usize], graphs: &[&InputGraph], trial: &mut Trial<T>) {
        for _ in 0..self.rounds {
            for &i in which {
                let Slot::Built(engine) = &mut self.candidates[i].slot else {
                    continue;
                };
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
    }

    /// Measures the candidates on the first batch of `shape` (the built
    /// ones first, then each unbuilt one, cheapest estimated set-up first,
    /// unless its set-up exceeds what it can save over the shape's batches),
    /// remembers the fastest and returns its scores; the first candidate's
    /// error if every one failed.
    fn choose(&mut self, shape: BatchShape, graphs: &[&InputGraph]) -> Result<Scores<T>> {
        let n = self.candidates.len();
        let mut trial = Trial::new(n);
        let built: Vec<usize> = (0..n)
            .filter(|&i| matches!(self.candidates[i].slot, Slot::Built(_)))
            .collect();
        self.measure(&built, graphs, &mut trial);
        let mut unbuilt: Vec<usize> = (0..n)
            .filter(|&i| matches!(self.candidates[i].slot, Slot::Unbuilt(_)))
            .collect();
        unbuilt.sort_by(|&a, &b| {
            let est = |i: usize| self.candidates[i].setup_estimate.unwrap_or(0.0);
            est(a).total_cmp(&est(b))
        });
        let batches = self
            .planned
            .as_ref()
            .map(|p| p.get(&shape).copied().unwrap_or(1));
        for i in unbuilt {
            let (estimate, bound) = {
                let c = &self.candidates[i];
                (c.setup_estimate, c.speedup_bound)
            };
            if let (Some(batches), Some(setup), Some((_, best))) = (batches, estimate, trial.best())
            {
                // the most it can save over the shape's batches
                let saving = batches as f64 * best * (1.0 - 1.0 / bound.max(1.0));
                if setup >= saving {
                    let s = if batches == 1 { "" } else { "es" };
                    trial.not_built[i] = Some(format!(
                        "not built (set-up est. {:.1} ms >= {:.1} ms it can save over \
                         {batches} batch{s} of {:.3} ms)",
                        setup * 1e3,
                        saving * 1e3,
                        best * 1e3
                    ));
                    continue;
                }
            }
            if self.build(i, &mut trial) {
                self.measure(&[i], graphs, &mut trial);
            }
        }
        let Some((chosen, _)) = trial.best() else {
            return Err(self.no_result(&mut trial));
        };
        self.report(shape, batches, chosen, &trial);
        self.chosen.insert(shape, chosen);
        trial.scores[chosen]
            .take()
            .ok_or_else(|| ExecError::Config("the chosen engine gave no scores".into()))
    }

    /// The error when no candidate ran a shape's first batch: the first
    /// candidate's error, or every refusal to build.
    fn no_result(&self, trial: &mut Trial<T>) -> ExecError {
        if let Some(first) = trial.errors.iter_mut().find_map(Option::take) {
            return first;
        }
        let refusals: Vec<String> = self
            .candidates
            .iter()
            .filter_map(|c| match &c.slot {
                Slot::Refused(why) => Some(format!("{}: {why}", c.name)),
                _ => None,
            })
            .collect();
        no_engine(&refusals)
    }

    /// Notices the choice for `shape` and the measurements behind it, and
    /// each candidate that failed the batch.
    fn report(
        &mut self,
        shape: BatchShape,
        batches: Option<usize>,
        chosen: usize,
        trial: &Trial<T>,
    ) {
        let mut timings = Vec::new();
        for (i, c) in self.candidates.iter().enumerate() {
            match (&trial.seconds[i], &trial.errors[i], &trial.not_built[i]) {
                (Some(s), _, _) => {
                    let setup = trial.setup[i]
                        .map(|s| format!(" (set-up {:.1} ms)", s * 1e3))
                        .unwrap_or_default();
                    timings.push(format!("{} {:.3} ms{setup}", c.name, s * 1e3));
                }
                (None, _, Some(why)) => timings.push(format!("{} {why}", c.name)),
                (None, Some(e), _) => {
                    (self.notice)(&format!(
                        "auto: {} skipped for batches of {shape}: {e}",
                        c.name
                    ));
                }
                (None, None, None) => {}
            }
        }
        let count = batches
            .map(|b| format!(" ({b} in the run)"))
            .unwrap_or_default();
        (self.notice)(&format!(
            "auto: batches of {shape}{count}: {} (best of {} runs): {}",
            timings.join(", "),
            self.rounds,
            self.candidates[chosen].name
        ));
    }
}

/// The error when no candidate can run the model, naming each refusal.
fn no_engine(refusals: &[String]) -> ExecError {
    ExecError::Config(format!(
        "no inference engine can run this model ({})",
        refusals.join("; ")
    ))
}

impl<T: Real> InferEngine<T> for AutoInfer<'_, T> {
    fn name(&self) -> &'static str {
        "auto"
    }

    fn infer(&mut self, graphs: &[&InputGraph]) -> Result<Scores<T>> {
        let shape = BatchShape::of(graphs);
        let i = match self.chosen.get(&shape) {
            Some(&i) => i,
            // a lone candidate needs no measuring
            None if self.candidates.len() == 1 => {
                let mut trial = Trial::new(1);
                if !self.build(0, &mut trial) {
                    return Err(self.no_result(&mut trial));
                }
                0
            }
            None => return self.choose(shape, graphs),
        };
        match &mut self.candidates[i].slot {
            Slot::Built(engine) => engine.infer(graphs),
            _ => Err(ExecError::Config("the chosen engine is not built".into())),
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

    /// `engine` offered lazily: building it takes `setup` seconds of the
    /// fake clock (estimated as `estimate`) and sets `built`.
    fn lazy_offer(
        engine: Fake,
        setup: f64,
        estimate: Option<f64>,
        built: &Rc<Cell<bool>>,
    ) -> LazyOffer<'static, f32> {
        let built = built.clone();
        LazyOffer {
            name: engine.name,
            setup_estimate: estimate,
            speedup_bound: f64::INFINITY,
            build: Box::new(move || {
                let c = &engine.clock.0;
                c.set(c.get() + setup);
                built.set(true);
                Ok(Box::new(engine) as Box<dyn InferEngine<f32>>)
            }),
        }
    }

    impl Setup {
        fn lazy(&self, offers: Vec<LazyOffer<'static, f32>>) -> AutoInfer<'static, f32> {
            let notices = self.notices.clone();
            let auto = AutoInfer::lazy(offers, move |l: &str| notices.borrow_mut().push(l.into()));
            auto.expect("offers").with_clock(self.clock.clone())
        }
    }

    #[test]
    fn set_up_that_cannot_pay_for_itself_is_not_paid() {
        // "tables" is twice as fast a batch but takes 100 ms to build: a
        // run of 10 batches (20 ms on "plain") cannot repay it
        let s = Setup::new();
        let (tables_built, plain_built) = (Rc::new(Cell::new(false)), Rc::new(Cell::new(false)));
        let tables = lazy_offer(
            s.fake("tables", 0.001, 0.0, 1.0),
            0.1,
            Some(0.1),
            &tables_built,
        );
        let plain = lazy_offer(s.fake("plain", 0.002, 0.0, 2.0), 0.0, None, &plain_built);
        let g = leaves(3);
        let batch: Vec<&InputGraph> = g.iter().collect();
        let mut auto = s
            .lazy(vec![tables, plain])
            .with_run(vec![BatchShape::of(&batch); 10]);
        for _ in 0..10 {
            assert_eq!(auto.infer(&batch).unwrap().values, vec![2.0; 3]);
        }
        assert!(!tables_built.get() && plain_built.get());
        assert_eq!(auto.chosen(BatchShape::of(&batch)), Some("plain"));
        // plain measured 3 times, then 9 more batches: no set-up paid
        assert!(
            (s.clock.0.get() - 0.024).abs() < 1e-9,
            "{}",
            s.clock.0.get()
        );
        let notices = s.notices.borrow();
        assert_eq!(notices.len(), 1, "{notices:?}");
        assert_eq!(
            notices[0],
            "auto: batches of 3 graphs of 3-4 vertices (10 in the run): tables not built \
             (set-up est. 100.0 ms >= 20.0 ms it can save over 10 batches of 2.000 ms), \
             plain 2.000 ms (set-up 0.0 ms) (best of 3 runs): plain"
        );
    }

    #[test]
    fn a_speedup_bound_keeps_a_set_up_that_cannot_be_repaid() {
        // 60 batches of 2 ms: 120 ms, more than the 100 ms set-up, but a
        // table engine at most twice as fast saves at most 60 ms of them
        for (bound, built_then) in [(f64::INFINITY, true), (2.0, false)] {
            let s = Setup::new();
            let built = Rc::new(Cell::new(false));
            let mut tables = lazy_offer(s.fake("tables", 0.001, 0.0, 1.0), 0.1, Some(0.1), &built);
            tables.speedup_bound = bound;
            let plain = lazy_offer(s.fake("plain", 0.002, 0.0, 2.0), 0.0, None, &Rc::default());
            let g = leaves(1);
            let batch = [&g[0]];
            let mut auto = s
                .lazy(vec![tables, plain])
                .with_run(vec![BatchShape::of(&batch); 60]);
            auto.infer(&batch).unwrap();
            assert_eq!(built.get(), built_then, "bound {bound}");
            let want = if built_then { "tables" } else { "plain" };
            assert_eq!(auto.chosen(BatchShape::of(&batch)), Some(want));
        }
    }

    #[test]
    fn set_up_that_pays_for_itself_is_paid_and_reported() {
        // the same engines over 1,000 batches (2 s on "plain"): the table
        // engine is built, measured, and wins
        let s = Setup::new();
        let (tables_built, plain_built) = (Rc::new(Cell::new(false)), Rc::new(Cell::new(false)));
        let tables = lazy_offer(
            s.fake("tables", 0.001, 0.0, 1.0),
            0.1,
            Some(0.1),
            &tables_built,
        );
        let plain = lazy_offer(s.fake("plain", 0.002, 0.0, 2.0), 0.0, None, &plain_built);
        let g = leaves(3);
        let batch: Vec<&InputGraph> = g.iter().collect();
        let mut auto = s
            .lazy(vec![tables, plain])
            .with_run(vec![BatchShape::of(&batch); 1000]);
        assert_eq!(auto.infer(&batch).unwrap().values, vec![1.0; 3]);
        assert!(tables_built.get() && plain_built.get());
        s.runs.borrow_mut().clear();
        assert_eq!(auto.infer(&batch).unwrap().values, vec![1.0; 3]);
        assert_eq!(*s.runs.borrow(), vec!["tables"]);
        let notices = s.notices.borrow();
        assert_eq!(
            notices[0],
            "auto: batches of 3 graphs of 3-4 vertices (1000 in the run): tables 1.000 ms \
             (set-up 100.0 ms), plain 2.000 ms (set-up 0.0 ms) (best of 3 runs): tables"
        );

        // a run of unknown length: set-up is not weighed, as before
        let s = Setup::new();
        let built = Rc::new(Cell::new(false));
        let tables = lazy_offer(s.fake("tables", 0.001, 0.0, 1.0), 0.1, Some(0.1), &built);
        let plain = lazy_offer(s.fake("plain", 0.002, 0.0, 2.0), 0.0, None, &built);
        let mut auto = s.lazy(vec![tables, plain]);
        assert_eq!(auto.infer(&batch).unwrap().values, vec![1.0; 3]);
        assert_eq!(auto.chosen(BatchShape::of(&batch)), Some("tables"));
    }

    #[test]
    fn a_set_up_paid_for_one_shape_is_not_weighed_again() {
        // 1,000 small batches repay the table engine's set-up; the 5 large
        // ones alone would not, but it is built by then
        let s = Setup::new();
        let built = Rc::new(Cell::new(false));
        let tables = lazy_offer(s.fake("tables", 0.0, 0.001, 1.0), 0.1, Some(0.1), &built);
        let plain = lazy_offer(s.fake("plain", 0.0, 0.002, 2.0), 0.0, None, &Rc::default());
        let (small, large) = (leaves(1), leaves(2));
        let small: Vec<&InputGraph> = small.iter().collect();
        let large: Vec<&InputGraph> = large.iter().collect();
        let mut shapes = vec![BatchShape::of(&small); 1000];
        shapes.extend(vec![BatchShape::of(&large); 5]);
        let mut auto = s.lazy(vec![tables, plain]).with_run(shapes.clone());
        auto.infer(&small).unwrap();
        auto.infer(&large).unwrap();
        assert_eq!(auto.chosen(BatchShape::of(&large)), Some("tables"));

        // the large batches first: the table engine waits for the small ones
        let s = Setup::new();
        let built = Rc::new(Cell::new(false));
        let tables = lazy_offer(s.fake("tables", 0.0, 0.001, 1.0), 0.1, Some(0.1), &built);
        let plain = lazy_offer(s.fake("plain", 0.0, 0.002, 2.0), 0.0, None, &Rc::default());
        let mut auto = s.lazy(vec![tables, plain]).with_run(shapes);
        auto.infer(&large).unwrap();
        assert!(!built.get());
        assert_eq!(auto.chosen(BatchShape::of(&large)), Some("plain"));
        auto.infer(&small).unwrap();
        assert!(built.get());
        assert_eq!(auto.chosen(BatchShape::of(&small)), Some("tables"));
    }

    #[test]
    fn lazy_refusals_are_noticed_when_built() {
        let s = Setup::new();
        let refuser = |name: &'static str, why: &'static str| LazyOffer::<'static, f32> {
            name,
            setup_estimate: None,
            speedup_bound: f64::INFINITY,
            build: Box::new(move || Err(why.to_string())),
        };
        let plain = lazy_offer(s.fake("plain", 0.002, 0.0, 2.0), 0.0, None, &Rc::default());
        let mut auto = s.lazy(vec![refuser("x", "no CUDA"), plain]);
        let g = leaves(1);
        assert_eq!(auto.infer(&[&g[0]]).unwrap().values, vec![2.0]);
        assert_eq!(s.notices.borrow()[0], "auto: x left out: no CUDA");

        let s = Setup::new();
        let mut auto = s.lazy(vec![refuser("x", "no CUDA"), refuser("y", "no cell")]);
        let e = auto.infer(&[&g[0]]).unwrap_err().to_string();
        assert!(e.contains("x: no CUDA; y: no cell"), "{e}");
    }
}
