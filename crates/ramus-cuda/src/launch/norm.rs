//! Launchers of the batch normalisation kernels of `builtin.cu`: the
//! per-channel coefficients (training, inference) and the gradients, as
//! `ramus_core::ops::cnn`'s CPU kernels compute them.

use cudarc::driver::{CudaStream, PushKernelArg};

use ramus_core::ops::{NormGeom, NormParam, RUNNING_STATS_MOMENTUM};

use super::cnn::{
    holds, holds_input_and_gradient, mul, norm_dims, per_channel_cfg, reduction_rows,
};
use super::{elementwise_cfg, Builtin, Launcher};
use crate::error::Result;
use crate::pool::DeviceView;

/// The inputs of [`Launcher::batch_norm_coef`]: the batch `x`, the learned
/// scale and shift, and the running statistics `(mean, var)` to blend the
/// batch's into, if tracked.
#[derive(Clone, Copy, Debug)]
pub struct BatchNormOperands {
    pub x: DeviceView<f32>,
    pub gamma: DeviceView<f32>,
    pub beta: DeviceView<f32>,
    pub running: Option<(DeviceView<f32>, DeviceView<f32>)>,
}

/// The inputs of [`Launcher::batch_norm_backward_input`]: the forward
/// input `x`, the scale `gamma` and the output gradient `dy`.
#[derive(Clone, Copy, Debug)]
pub struct NormGradOperands {
    pub x: DeviceView<f32>,
    pub gamma: DeviceView<f32>,
    pub dy: DeviceView<f32>,
}

/// The per-channel statistics and parameters of
/// [`Launcher::batch_norm_inference_coef`] (`beta` and `mean` count as 0
/// when absent).
#[derive(Clone, Copy, Debug)]
pub struct NormStats {
    pub gamma: DeviceView<f32>,
    pub beta: Option<DeviceView<f32>>,
    pub mean: Option<DeviceView<f32>>,
    pub var: DeviceView<f32>,
}

impl Launcher {
    /// Training batch normalisation's per-channel `(a, b)` (`y = x·a + b`)
    /// into `coef` (`2C` floats), from the statistics of all `rows` rows;
    /// with `operands.running = Some((mean, var))`, also blends the batch's
    /// statistics into those running statistics in place (momentum
    /// [`RUNNING_STATS_MOMENTUM`], unbiased variance, as
    /// `ramus_cpu::kernels::update_running_stats`).
    pub fn batch_norm_coef(
        &self,
        stream: &CudaStream,
        coef: DeviceView<f32>,
        operands: BatchNormOperands,
        rows: usize,
        norm: &NormGeom,
    ) -> Result<()> {
        let BatchNormOperands {
            x,
            gamma,
            beta,
            running,
        } = operands;
        const OP: &str = "batch_norm";
        let (c, s) = norm_dims(norm, OP)?;
        if rows == 0 {
            return Ok(());
        }
        holds(&coef, 2 * norm.channels, "the coefficients", OP)?;
        holds(
            &x,
            mul(rows, norm.channels * norm.spatial, OP)?,
            "the input",
            OP,
        )?;
        holds(&gamma, norm.channels, "gamma", OP)?;
        holds(&beta, norm.channels, "beta", OP)?;
        if let Some((mean, var)) = &running {
            holds(mean, norm.channels, "the running mean", OP)?;
            holds(var, norm.channels, "the running variance", OP)?;
        }
        let r = reduction_rows(rows, norm.spatial, OP)?;
        let null = 0u64;
        let momentum = RUNNING_STATS_MOMENTUM;
        let mut launch = stream.launch_builder(self.function(Builtin::BatchNormCoef));
        launch
            .arg(coef.kernel_arg())
            .arg(x.kernel_arg())
            .arg(gamma.kernel_arg())
            .arg(beta.kernel_arg())
            .arg(&r)
            .arg(&c)
            .arg(&s)
            .arg(&norm.eps);
        match &running {
            Some((mean, var)) => launch.arg(mean.kernel_arg()).arg(var.kernel_arg()),
            None => launch.arg(&null).arg(&null),
        };
        launch.arg(&momentum);
        // SAFETY: arguments match the kernel (one block per channel; null
        // running statistics, which it checks, when there are none); sizes
        // checked above.
        unsafe {
            self.launch_counted(
                &mut launch,
                per_channel_cfg(c),
                "cuLaunchKernel(ramus_batch_norm_coef)",
            )
        }
    }

    /// Training batch normalisation's input gradient: per-channel
    /// coefficients `(k, q, p)` into `coef` (`3C` floats), then
    /// `dx = k·dy + x·q + p`.
    pub fn batch_norm_backward_input(
        &self,
        stream: &CudaStream,
        dx: DeviceView<f32>,
        operands: NormGradOperands,
        coef: DeviceView<f32>,
        rows: usize,
        norm: &NormGeom,
    ) -> Result<()> {
        let NormGradOperands { x, gamma, dy } = operands;
        const OP: &str = "batch_norm_backward_input";
        let (c, s) = norm_dims(norm, OP)?;
        let total = mul(rows, norm.channels * norm.spatial, OP)?;
        if total == 0 {
            return Ok(());
        }
        holds(&coef, 3 * norm.channels, "the coefficients", OP)?;
        holds_input_and_gradient(&x, &dy, total, OP)?;
        holds(&dx, total, "the output", OP)?;
        holds(&gamma, norm.channels, "gamma", OP)?;
        let r = reduction_rows(rows, norm.spatial, OP)?;
        let mut launch = stream.launch_builder(self.function(Builtin::BatchNormBackwardCoef));
        launch
            .arg(coef.kernel_arg())
            .arg(x.kernel_arg())
            .arg(dy.kernel_arg())
            .arg(gamma.kernel_arg())
            .arg(&r)
            .arg(&c)
            .arg(&s)
            .arg(&norm.eps);
        // SAFETY: arguments match the kernel (one block per channel);
        // sizes checked above.
        unsafe {
            self.launch_counted(
                &mut launch,
                per_channel_cfg(c),
                "cuLaunchKernel(ramus_batch_norm_backward_coef)",
            )
        }?;
        self.batch_norm_backward_apply(stream, dx, operands, coef, rows, norm)
    }

    /// `dx = k·dy + x·q + p` per channel with `(k, q, p)` in `coef`.
    pub(super) fn batch_norm_backward_apply(
        &self,
        stream: &CudaStream,
        dx: DeviceView<f32>,
        operands: NormGradOperands,
        coef: DeviceView<f32>,
        rows: usize,
        norm: &NormGeom,
    ) -> Result<()> {
        let NormGradOperands { x, dy, .. } = operands;
        const OP: &str = "batch_norm_backward_input";
        let (c, s) = norm_dims(norm, OP)?;
        let total = mul(rows, norm.channels * norm.spatial, OP)?;
        if total == 0 {
            return Ok(());
        }
        holds(&coef, 3 * norm.channels, "the coefficients", OP)?;
        holds_input_and_gradient(&x, &dy, total, OP)?;
        holds(&dx, total, "the output", OP)?;
        let r = reduction_rows(rows, norm.spatial, OP)?;
        let mut launch = stream.launch_builder(self.function(Builtin::BatchNormBackwardApply));
        launch
            .arg(dx.kernel_arg())
            .arg(x.kernel_arg())
            .arg(dy.kernel_arg())
            .arg(coef.kernel_arg())
            .arg(&r)
            .arg(&c)
            .arg(&s);
        // SAFETY: arguments match the kernel; sizes checked above.
        unsafe {
            self.launch_counted(
                &mut launch,
                elementwise_cfg(total),
                "cuLaunchKernel(ramus_batch_norm_backward_apply)",
            )
        }
    }

    /// Training batch normalisation's gamma gradient `Σ dy·x̂` per channel
    /// (zeros when there are no rows).
    pub fn batch_norm_backward_gamma(
        &self,
        stream: &CudaStream,
        out: DeviceView<f32>,
        x: DeviceView<f32>,
        dy: DeviceView<f32>,
        rows: usize,
        norm: &NormGeom,
    ) -> Result<()> {
        const OP: &str = "batch_norm_backward_gamma";
        let (c, s) = norm_dims(norm, OP)?;
        if self.zeros_without_rows(stream, out, norm.channels, rows, OP)? {
            return Ok(());
        }
        let total = mul(rows, norm.channels * norm.spatial, OP)?;
        holds_input_and_gradient(&x, &dy, total, OP)?;
        let r = reduction_rows(rows, norm.spatial, OP)?;
        let mut launch = stream.launch_builder(self.function(Builtin::BatchNormBackwardGamma));
        launch
            .arg(out.kernel_arg())
            .arg(x.kernel_arg())
            .arg(dy.kernel_arg())
            .arg(&r)
            .arg(&c)
            .arg(&s)
            .arg(&norm.eps);
        // SAFETY: arguments match the kernel (one block per channel);
        // sizes checked above.
        unsafe {
            self.launch_counted(
                &mut launch,
                per_channel_cfg(c),
                "cuLaunchKernel(ramus_batch_norm_backward_gamma)",
            )
        }
    }

    /// Inference batch normalisation's per-channel `(a, b)` into `coef`
    /// (`2C` floats): `a = gamma / sqrt(var + eps)`, `b = beta - mean·a`
    /// (`beta` and `mean` count as 0 when absent: the input gradient's
    /// coefficients). A variance below `-eps` gives NaN here, where the CPU
    /// engine stops with an error: the device cannot stop a queued pass.
    pub fn batch_norm_inference_coef(
        &self,
        stream: &CudaStream,
        coef: DeviceView<f32>,
        stats: NormStats,
        norm: &NormGeom,
    ) -> Result<()> {
        let NormStats {
            gamma,
            beta,
            mean,
            var,
        } = stats;
        const OP: &str = "batch_norm_inference";
        let (c, _) = norm_dims(norm, OP)?;
        holds(&coef, 2 * norm.channels, "the coefficients", OP)?;
        holds(&gamma, norm.channels, "gamma", OP)?;
        holds(&var, norm.channels, "var", OP)?;
        for v in beta.iter().chain(&mean) {
            holds(v, norm.channels, "beta or mean", OP)?;
        }
        let null = 0u64;
        let mut launch = stream.launch_builder(self.function(Builtin::BatchNormInferenceCoef));
        launch.arg(coef.kernel_arg()).arg(gamma.kernel_arg());
        match &beta {
            Some(v) => launch.arg(v.kernel_arg()),
            None => launch.arg(&null),
        };
        match &mean {
            Some(v) => launch.arg(v.kernel_arg()),
            None => launch.arg(&null),
        };
        launch.arg(var.kernel_arg()).arg(&c).arg(&norm.eps);
        // SAFETY: arguments match the kernel (null pointers for absent
        // beta / mean, which it checks); sizes checked above.
        unsafe {
            self.launch_counted(
                &mut launch,
                elementwise_cfg(norm.channels),
                "cuLaunchKernel(ramus_batch_norm_inference_coef)",
            )
        }
    }

    /// The gradient of inference batch normalisation for gamma, mean or var
    /// (a static `[C]`; zeros when there are no rows).
    pub fn batch_norm_inference_param(
        &self,
        stream: &CudaStream,
        out: DeviceView<f32>,
        [x, gamma, mean, var, dy]: [DeviceView<f32>; 5],
        rows: usize,
        norm: &NormGeom,
        param: NormParam,
    ) -> Result<()> {
        const OP: &str = "batch_norm_inference_backward";
        let (c, s) = norm_dims(norm, OP)?;
        if self.zeros_without_rows(stream, out, norm.channels, rows, OP)? {
            return Ok(());
        }
        let total = mul(rows, norm.channels * norm.spatial, OP)?;
        holds_input_and_gradient(&x, &dy, total, OP)?;
        for v in [&gamma, &mean, &var] {
            holds(v, norm.channels, "gamma, mean or var", OP)?;
        }
        let which: u32 = match param {
            NormParam::Gamma => 0,
            NormParam::Mean => 1,
            NormParam::Var => 2,
        };
        let r = reduction_rows(rows, norm.spatial, OP)?;
        let mut launch = stream.launch_builder(self.function(Builtin::BatchNormInferenceParam));
        launch
            .arg(out.kernel_arg())
            .arg(x.kernel_arg())
            .arg(gamma.kernel_arg())
            .arg(mean.kernel_arg())
            .arg(var.kernel_arg())
            .arg(dy.kernel_arg())
            .arg(&r)
            .arg(&c)
            .arg(&s)
            .arg(&norm.eps)
            .arg(&which);
        // SAFETY: arguments match the kernel (one block per channel);
        // sizes checked above.
        unsafe {
            self.launch_counted(
                &mut launch,
                per_channel_cfg(c),
                "cuLaunchKernel(ramus_batch_norm_inference_param)",
            )
        }
    }
}
