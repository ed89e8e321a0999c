//! `ramus train`'s learning-rate flags: the schedule (`--lr-schedule`,
//! `--warmup` and each schedule's settings, see [`ramus_nn::schedule`])
//! and the embedding tables' own rates (`--freeze-embeddings`,
//! `--embedding-lr`), which the engines take as per-parameter multipliers
//! of the scheduled rate.

use ramus_core::Model;
use ramus_nn::schedule::{LrSchedule, ScheduleKind};

/// The word embedding table (the one `--embeddings` fills).
const WORD_TABLE: &str = "emb";

/// The learning-rate flags.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct LrArgs {
    /// How the learning rate changes over the run: constant, step (times
    /// --lr-gamma every --lr-step-epochs epochs), cosine (down to --lr-min
    /// over the run's steps) or plateau (times --lr-gamma when the dev
    /// accuracy has not improved for --lr-plateau-patience epochs).
    #[arg(long, default_value = "constant")]
    pub lr_schedule: String,
    /// Linear warm-up over the first N optimizer steps: step s (from 0)
    /// takes (s + 1) / N of the scheduled rate.
    #[arg(long, default_value_t = 0)]
    pub warmup: usize,
    /// The step schedule: epochs between decays.
    #[arg(long)]
    pub lr_step_epochs: Option<usize>,
    /// The step and plateau schedules: the factor of each decay [default: 0.1].
    #[arg(long)]
    pub lr_gamma: Option<f64>,
    /// The cosine schedule: the rate it ends at [default: 0].
    #[arg(long)]
    pub lr_min: Option<f64>,
    /// The plateau schedule: epochs without a better dev accuracy before
    /// a decay [default: 2].
    #[arg(long)]
    pub lr_plateau_patience: Option<usize>,
    /// Leave the word embedding table as it starts (e.g. from
    /// --embeddings): it takes no update.
    #[arg(long)]
    pub freeze_embeddings: bool,
    /// The learning rate of the embedding tables (the word table, and the
    /// character table of bilstm-char-tagger), following the schedule as
    /// --lr does [default: --lr].
    #[arg(long)]
    pub embedding_lr: Option<f64>,
}

impl LrArgs {
    /// The schedule at base rate `base` for a run of `total_steps` steps;
    /// refuses an unknown schedule, a setting of another schedule, or one
    /// no one can mean, naming the flag.
    pub fn schedule(&self, base: f64, total_steps: usize) -> Result<LrSchedule, String> {
        let name = self.lr_schedule.as_str();
        let gamma = self.lr_gamma.unwrap_or(0.1);
        let kind = match name {
            "constant" => ScheduleKind::Constant,
            "step" => ScheduleKind::Step {
                every: self
                    .lr_step_epochs
                    .ok_or("--lr-schedule step needs --lr-step-epochs K (epochs between decays)")?,
                gamma,
            },
            "cosine" => ScheduleKind::Cosine {
                min: self.lr_min.unwrap_or(0.0),
            },
            "plateau" => ScheduleKind::Plateau {
                patience: self.lr_plateau_patience.unwrap_or(2),
                gamma,
            },
            _ => {
                return Err(format!(
                    "--lr-schedule {name}: expected constant, step, cosine or plateau"
                ))
            }
        };
        let given: [(&str, bool, &[&str]); 4] = [
            ("--lr-step-epochs", self.lr_step_epochs.is_some(), &["step"]),
            ("--lr-gamma", self.lr_gamma.is_some(), &["step", "plateau"]),
            ("--lr-min", self.lr_min.is_some(), &["cosine"]),
            (
                "--lr-plateau-patience",
                self.lr_plateau_patience.is_some(),
                &["plateau"],
            ),
        ];
        for (flag, is_given, applies) in given {
            if is_given && !applies.contains(&name) {
                return Err(format!(
                    "{flag} applies to --lr-schedule {}, not {name}",
                    applies.join(" or ")
                ));
            }
        }
        let schedule = LrSchedule {
            base,
            kind,
            warmup: self.warmup,
            total_steps,
        };
        schedule.validate()?;
        Ok(schedule)
    }

    /// Each parameter's multiplier of the scheduled rate for `model` at
    /// base rate `base`: 0 for the word table with `--freeze-embeddings`,
    /// `--embedding-lr / base` for every embedding table; `None` when
    /// neither flag is given.
    pub fn lr_scales(&self, model: &Model, base: f64) -> Result<Option<Vec<f64>>, String> {
        if !self.freeze_embeddings && self.embedding_lr.is_none() {
            return Ok(None);
        }
        let mut scales = vec![1.0; model.params.len()];
        if let Some(lr) = self.embedding_lr {
            if !(lr.is_finite() && lr >= 0.0) {
                return Err(format!(
                    "--embedding-lr {lr}: expected a finite number >= 0"
                ));
            }
            if base <= 0.0 {
                return Err(format!(
                    "--embedding-lr {lr} is taken relative to --lr, which is {base}: give --lr > 0"
                ));
            }
            let tables = ramus_exec::optim::embedding_tables(model);
            if tables.is_empty() {
                return Err(format!(
                    "--embedding-lr: model `{}` has no embedding table",
                    model.name
                ));
            }
            for p in tables {
                scales[p] = lr / base;
            }
        }
        if self.freeze_embeddings {
            let table = model.param_id(WORD_TABLE).map_err(|_| {
                format!(
                    "--freeze-embeddings: model `{}` has no word embedding table `{WORD_TABLE}`",
                    model.name
                )
            })?;
            scales[table] = 0.0;
        }
        Ok(Some(scales))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(schedule: &str) -> LrArgs {
        LrArgs {
            lr_schedule: schedule.into(),
            ..LrArgs::default()
        }
    }

    #[test]
    fn flags_of_another_schedule_are_refused() {
        let mut a = args("cosine");
        a.lr_gamma = Some(0.5);
        let e = a.schedule(0.1, 10).unwrap_err();
        assert!(
            e.contains("--lr-gamma applies to --lr-schedule step or plateau"),
            "{e}"
        );
        let mut a = args("plateau");
        a.lr_step_epochs = Some(2);
        let e = a.schedule(0.1, 10).unwrap_err();
        assert!(
            e.contains("--lr-step-epochs applies to --lr-schedule step,"),
            "{e}"
        );
        let e = args("step").schedule(0.1, 10).unwrap_err();
        assert!(e.contains("needs --lr-step-epochs"), "{e}");
        let e = args("linear").schedule(0.1, 10).unwrap_err();
        assert!(e.contains("--lr-schedule linear"), "{e}");
    }

    #[test]
    fn defaults_fill_each_schedule() {
        let s = args("plateau").schedule(0.1, 10).unwrap();
        assert_eq!(
            s.kind,
            ScheduleKind::Plateau {
                patience: 2,
                gamma: 0.1
            }
        );
        let s = args("cosine").schedule(0.1, 10).unwrap();
        assert_eq!(s.kind, ScheduleKind::Cosine { min: 0.0 });
        assert_eq!(s.total_steps, 10);
    }
}
