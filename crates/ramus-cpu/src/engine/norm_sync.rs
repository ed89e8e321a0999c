//! Synchronized batch normalisation on the CPU engine: the handle on the
//! data-parallel group that the batch-norm kernels sum their statistics
//! through ([`NormSum`]), shared by the pass's arenas, and what a rank
//! without rows in a step does so that the others are not left waiting.

use std::sync::{Arc, Mutex, MutexGuard};

use ramus_core::graph::ParamId;
use ramus_core::ops::NormGeom;
use ramus_core::{CoreError, Params, Real};
use ramus_exec::data_parallel::Collective;
use ramus_exec::{ExecError, Result};

use crate::kernels::{update_running_stats, NormSum};

/// The group handle and the sums of the last step with rows.
pub(crate) struct NormSync<T> {
    collective: Box<dyn Collective<T>>,
    /// The sums of this step so far (of the last step with rows, once it
    /// is done): a rank without rows sums as many zeros.
    calls: Vec<Call>,
    /// Sums still to come of a running-statistics update (recorded as
    /// its [`Call::Running`], not one by one).
    in_running: usize,
}

/// One of a step's sums over the ranks.
#[derive(Clone, Copy, Debug)]
enum Call {
    /// Statistics of `len` values.
    Sum(usize),
    /// The two sums of a layer's batch moments for its running statistics
    /// (parameters `mean` and `var`), which a rank without rows updates
    /// too, from the other ranks' rows.
    Running {
        norm: NormGeom,
        mean: ParamId,
        var: ParamId,
    },
}

/// Shared by the arenas of a training pass.
pub(crate) type NormShare<T> = Arc<Mutex<NormSync<T>>>;

impl<T: Real> NormSync<T> {
    pub(crate) fn share(collective: Box<dyn Collective<T>>) -> NormShare<T> {
        Arc::new(Mutex::new(NormSync {
            collective,
            calls: Vec::new(),
            in_running: 0,
        }))
    }

    /// Before the passes of a step with rows on this rank.
    pub(crate) fn start_step(&mut self) {
        self.calls.clear();
        self.in_running = 0;
    }

    /// Before the sums of a running-statistics update of `mean` and `var`.
    pub(crate) fn running(&mut self, norm: NormGeom, mean: ParamId, var: ParamId) {
        self.calls.push(Call::Running { norm, mean, var });
        self.in_running = 2;
    }

    /// A step without rows on this rank: the sums of the last step with
    /// rows, each of zeros (the statistics of no rows), so that the ranks'
    /// collectives pair up; returns the running statistics the other
    /// ranks' rows give (as a step with rows leaves them for
    /// `apply_running_stats`). Fails if no step with rows came before (the
    /// sums' number and sizes are not known yet).
    pub(crate) fn stand_in(&mut self, params: &Params<T>) -> Result<Vec<(ParamId, Vec<T>)>> {
        if self.calls.is_empty() && self.collective.world() > 1 {
            return Err(ExecError::Config(format!(
                "synchronized batch norm: rank {} has no graph in a step before any step with \
                 graphs (the dataset has fewer graphs than ranks?)",
                self.collective.rank()
            )));
        }
        let mut updates = Vec::new();
        for &call in &self.calls {
            match call {
                Call::Sum(len) => self.collective.sum_scalars(&mut vec![0.0; len])?,
                Call::Running { norm, mean, var } => {
                    let value = |p: ParamId| {
                        params
                            .values
                            .get(p)
                            .map(|t| t.data().to_vec())
                            .ok_or_else(|| {
                                ExecError::Input(format!("no running-statistics parameter {p}"))
                            })
                    };
                    let (mut m, mut v) = (value(mean)?, value(var)?);
                    let mut direct = Direct(self.collective.as_mut());
                    update_running_stats(&norm, (&[], 0), &mut m, &mut v, Some(&mut direct))?;
                    updates.extend([(mean, m), (var, v)]);
                }
            }
        }
        Ok(updates)
    }
}

impl<T: Real> NormSum for NormSync<T> {
    fn sum(&mut self, values: &mut [f64]) -> ramus_core::Result<()> {
        match self.in_running {
            0 => self.calls.push(Call::Sum(values.len())),
            n => self.in_running = n - 1,
        }
        Direct(self.collective.as_mut()).sum(values)
    }
}

/// Sums through the collective without recording.
struct Direct<'a, T>(&'a mut dyn Collective<T>);

impl<T: Real> NormSum for Direct<'_, T> {
    fn sum(&mut self, values: &mut [f64]) -> ramus_core::Result<()> {
        self.0
            .sum_scalars(values)
            .map_err(|e| CoreError::kernel("synchronized batch_norm", e.to_string()))
    }
}

/// Locks the shared handle (a rank's passes run one at a time).
pub(crate) fn lock<T>(share: &NormShare<T>) -> Result<MutexGuard<'_, NormSync<T>>> {
    share.lock().map_err(|_| {
        ExecError::Config("synchronized batch norm: a pass panicked while summing".into())
    })
}
