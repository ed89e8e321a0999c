//! Learning-rate schedules: the rate of every optimizer step of a run as a
//! pure function of where the step is (its number in the run, its epoch)
//! and of the plateau state (what the dev metric did so far), so that a
//! resumed run, which saves the plateau state with the rest of its
//! [`RunState`](crate::resume::RunState), continues the same schedule.
//!
//! * `constant`: the base rate throughout;
//! * `step`: the base rate times `gamma` after every `every` epochs
//!   (`lr · gamma^⌊(epoch − 1) / every⌋`, epochs counted from 1);
//! * `cosine`: from the base rate down to `min` over the run's steps after
//!   the warm-up, half a cosine wave;
//! * `plateau`: the base rate times `gamma` each time the dev metric has
//!   not improved for `patience` epochs in a row ([`Plateau`]).
//!
//! A linear warm-up over the first `warmup` steps multiplies any of them:
//! step `s` (from 0) of the warm-up takes `(s + 1) / warmup` of the rate.

/// Which schedule, with its settings.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ScheduleKind {
    Constant,
    /// Times `gamma` after every `every` epochs.
    Step {
        every: usize,
        gamma: f64,
    },
    /// Down to `min` over the run's steps after the warm-up.
    Cosine {
        min: f64,
    },
    /// Times `gamma` after `patience` epochs without a better dev metric.
    Plateau {
        patience: usize,
        gamma: f64,
    },
}

impl ScheduleKind {
    /// The schedule's name on the command line.
    pub fn name(&self) -> &'static str {
        match self {
            ScheduleKind::Constant => "constant",
            ScheduleKind::Step { .. } => "step",
            ScheduleKind::Cosine { .. } => "cosine",
            ScheduleKind::Plateau { .. } => "plateau",
        }
    }
}

/// A run's learning-rate schedule.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LrSchedule {
    /// The base rate (`--lr`).
    pub base: f64,
    pub kind: ScheduleKind,
    /// Steps of linear warm-up (0: none).
    pub warmup: usize,
    /// The run's steps: epochs times batches per epoch.
    pub total_steps: usize,
}

/// Where a step is in its run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepAt {
    /// The step's number in the run, from 0.
    pub step: usize,
    /// Its epoch, from 1.
    pub epoch: usize,
}

impl LrSchedule {
    /// A constant rate `base`.
    pub fn constant(base: f64) -> Self {
        LrSchedule {
            base,
            kind: ScheduleKind::Constant,
            warmup: 0,
            total_steps: 0,
        }
    }

    /// Refuses settings no one can mean, naming the flag: a base or
    /// minimum rate that is negative or not finite, a minimum above the
    /// base, a `gamma` outside (0, 1], 0 epochs between steps or of
    /// patience.
    pub fn validate(&self) -> Result<(), String> {
        let rate = |v: f64| v.is_finite() && v >= 0.0;
        let gamma_ok = |g: f64| g.is_finite() && g > 0.0 && g <= 1.0;
        if !rate(self.base) {
            return Err(format!("--lr {}: expected a finite number >= 0", self.base));
        }
        match self.kind {
            ScheduleKind::Constant => Ok(()),
            ScheduleKind::Step { gamma, .. } | ScheduleKind::Plateau { gamma, .. }
                if !gamma_ok(gamma) =>
            {
                Err(format!("--lr-gamma {gamma}: expected a number in (0, 1]"))
            }
            ScheduleKind::Step { every: 0, .. } => {
                Err("--lr-step-epochs must be at least 1".into())
            }
            ScheduleKind::Plateau { patience: 0, .. } => {
                Err("--lr-plateau-patience must be at least 1 epoch".into())
            }
            ScheduleKind::Cosine { min } if !rate(min) || min > self.base => Err(format!(
                "--lr-min {min}: expected a finite number from 0 to the learning rate {}",
                self.base
            )),
            _ => Ok(()),
        }
    }

    /// The rate of the step at `at`, with the dev metric's history
    /// `plateau`.
    pub fn rate(&self, at: StepAt, plateau: &Plateau) -> f64 {
        let scheduled = match self.kind {
            ScheduleKind::Constant => self.base,
            ScheduleKind::Step { every, gamma } => {
                let steps = at.epoch.saturating_sub(1) / every.max(1);
                self.base * gamma.powi(steps.min(i32::MAX as usize) as i32)
            }
            ScheduleKind::Cosine { min } => {
                let span = self.total_steps.saturating_sub(self.warmup).max(1);
                let done = at.step.saturating_sub(self.warmup).min(span);
                let progress = done as f64 / span as f64;
                min + (self.base - min) * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
            }
            ScheduleKind::Plateau { gamma, .. } => {
                self.base * gamma.powi(plateau.decays.min(i32::MAX as u32) as i32)
            }
        };
        match at.step < self.warmup {
            true => scheduled * (at.step + 1) as f64 / self.warmup as f64,
            false => scheduled,
        }
    }
}

/// What the plateau schedule keeps of the dev metric's history (saved in
/// resumable checkpoints): the best value so far, the epochs since it (or
/// since the last decay), and the decays so far.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Plateau {
    pub best: Option<f64>,
    pub stale_epochs: usize,
    pub decays: u32,
}

impl Plateau {
    /// Takes an epoch's dev metric (higher is better; one that is not
    /// finite never improves): after `patience` epochs in a row without
    /// improving on the best, one more decay and the count starts again.
    /// Returns whether the rate decays.
    pub fn observe(&mut self, metric: f64, patience: usize) -> bool {
        let improved = metric.is_finite() && self.best.is_none_or(|b| metric > b);
        if improved {
            self.best = Some(metric);
            self.stale_epochs = 0;
            return false;
        }
        self.stale_epochs += 1;
        if self.stale_epochs >= patience.max(1) {
            self.stale_epochs = 0;
            self.decays = self.decays.saturating_add(1);
            return true;
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn at(step: usize, epoch: usize) -> StepAt {
        StepAt { step, epoch }
    }

    fn schedule(kind: ScheduleKind, warmup: usize, total_steps: usize) -> LrSchedule {
        LrSchedule {
            base: 0.1,
            kind,
            warmup,
            total_steps,
        }
    }

    #[test]
    fn step_decays_after_every_k_epochs() {
        let s = schedule(
            ScheduleKind::Step {
                every: 2,
                gamma: 0.5,
            },
            0,
            100,
        );
        let p = Plateau::default();
        let rates: Vec<f64> = (1..=5).map(|e| s.rate(at(0, e), &p)).collect();
        assert_eq!(rates, [0.1, 0.1, 0.05, 0.05, 0.025]);
    }

    #[test]
    fn cosine_runs_from_the_rate_to_the_minimum() {
        let s = schedule(ScheduleKind::Cosine { min: 0.01 }, 0, 10);
        let p = Plateau::default();
        assert_eq!(s.rate(at(0, 1), &p), 0.1);
        assert!((s.rate(at(5, 1), &p) - 0.055).abs() < 1e-12);
        assert!((s.rate(at(10, 1), &p) - 0.01).abs() < 1e-12);
        // past the end it stays at the minimum
        assert!((s.rate(at(50, 9), &p) - 0.01).abs() < 1e-12);
    }

    #[test]
    fn warmup_climbs_linearly_then_hands_over() {
        let s = schedule(ScheduleKind::Cosine { min: 0.0 }, 4, 14);
        let p = Plateau::default();
        for (i, want) in [0.025, 0.05, 0.075, 0.1].into_iter().enumerate() {
            assert!((s.rate(at(i, 1), &p) - want).abs() < 1e-15, "step {i}");
        }
        // the cosine starts after the warm-up, at the full rate
        assert_eq!(s.rate(at(4, 1), &p), 0.1);
        assert!((s.rate(at(9, 1), &p) - 0.05).abs() < 1e-12);
        let c = schedule(ScheduleKind::Constant, 2, 0);
        assert_eq!(c.rate(at(0, 1), &p), 0.05);
        assert_eq!(c.rate(at(7, 3), &p), 0.1);
    }

    #[test]
    fn plateau_decays_after_patience_stale_epochs() {
        let s = schedule(
            ScheduleKind::Plateau {
                patience: 2,
                gamma: 0.5,
            },
            0,
            0,
        );
        let mut p = Plateau::default();
        let mut rates = Vec::new();
        for metric in [0.5, 0.6, 0.6, 0.55, 0.7, 0.7, f64::NAN, 0.65] {
            rates.push(s.rate(at(0, 1), &p));
            p.observe(metric, 2);
        }
        rates.push(s.rate(at(0, 1), &p));
        // improve, improve, stale, stale (decay), improve, stale, stale
        // (decay), stale
        assert_eq!(rates, [0.1, 0.1, 0.1, 0.1, 0.05, 0.05, 0.05, 0.025, 0.025]);
        assert_eq!(p.best, Some(0.7));
        assert_eq!(p.stale_epochs, 1);
    }

    #[test]
    fn validation_names_the_flag() {
        let bad = [
            (
                ScheduleKind::Step {
                    every: 0,
                    gamma: 0.5,
                },
                "--lr-step-epochs",
            ),
            (
                ScheduleKind::Step {
                    every: 1,
                    gamma: 0.0,
                },
                "--lr-gamma",
            ),
            (
                ScheduleKind::Plateau {
                    patience: 1,
                    gamma: 1.5,
                },
                "--lr-gamma",
            ),
            (
                ScheduleKind::Plateau {
                    patience: 0,
                    gamma: 0.5,
                },
                "--lr-plateau-patience",
            ),
            (ScheduleKind::Cosine { min: 0.2 }, "--lr-min"),
            (ScheduleKind::Cosine { min: f64::NAN }, "--lr-min"),
        ];
        for (kind, flag) in bad {
            let e = schedule(kind, 0, 1).validate().unwrap_err();
            assert!(e.contains(flag), "{kind:?}: {e}");
        }
        assert!(schedule(ScheduleKind::Cosine { min: 0.1 }, 3, 1)
            .validate()
            .is_ok());
    }

    proptest! {
        /// Every schedule stays within [min, base] after the warm-up and
        /// never rises from one step to the next past it (no plateau
        /// improvement); the warm-up is the schedule's rate (the cosine's:
        /// the full rate) times (s + 1) / warmup.
        #[test]
        fn rates_are_bounded_and_do_not_rise(
            base in 0.0f64..10.0,
            min_frac in 0.0f64..1.0,
            warmup in 0usize..20,
            total in 1usize..500,
            every in 1usize..5,
            gamma in 0.01f64..1.0,
            kind in 0u8..4,
        ) {
            let min = base * min_frac;
            let kind = match kind {
                0 => ScheduleKind::Constant,
                1 => ScheduleKind::Step { every, gamma },
                2 => ScheduleKind::Cosine { min },
                _ => ScheduleKind::Plateau { patience: every, gamma },
            };
            let s = LrSchedule { base, kind, warmup, total_steps: total };
            prop_assert!(s.validate().is_ok());
            let plain = LrSchedule { warmup: 0, ..s };
            let p = Plateau::default();
            let per_epoch = total.div_ceil(7).max(1);
            let mut last = f64::INFINITY;
            for step in 0..total + 3 {
                let a = at(step, step / per_epoch + 1);
                let r = s.rate(a, &p);
                prop_assert!(r >= 0.0 && r <= base * (1.0 + 1e-12), "{r}");
                if step < warmup {
                    // the cosine starts after the warm-up: at the full rate
                    let scheduled = match kind {
                        ScheduleKind::Cosine { .. } => base,
                        _ => plain.rate(a, &p),
                    };
                    let want = scheduled * (step + 1) as f64 / warmup as f64;
                    prop_assert!((r - want).abs() <= 1e-12 * base.max(1.0));
                } else {
                    if let ScheduleKind::Cosine { min } = kind {
                        prop_assert!(r >= min * (1.0 - 1e-12));
                    }
                    prop_assert!(r <= last * (1.0 + 1e-12), "step {step}: {r} after {last}");
                    last = r;
                }
            }
        }

        /// The plateau schedule decays exactly once per `patience` stale
        /// epochs: with a metric that never improves after the first
        /// epoch, `n` epochs give `(n - 1) / patience` decays.
        #[test]
        fn plateau_counts_stale_epochs(patience in 1usize..6, epochs in 1usize..40) {
            let mut p = Plateau::default();
            for _ in 0..epochs {
                p.observe(0.5, patience);
            }
            prop_assert_eq!(p.decays as usize, (epochs - 1) / patience);
        }
    }
}
