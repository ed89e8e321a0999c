//! Launching a prepared batch: its scripts and words uploaded, its
//! accumulation region zeroed, the kernel launched (several times around
//! host GEMMs where it has host work), its loss and fault word copied back.

use std::sync::Arc;

use ramus_codegen::persistent::{TRACE_AT, TRACE_RECORD_WORDS, TRACE_WORDS_PER_CTA};

use super::batch::{LaunchScripts, PreparedBatch};
use super::options::{model_err, PersistentStep};
use super::sizes;
use super::{Pending, PersistentEngine};
use crate::blas::{Blas, Gemm};
use crate::error::{InCall, Result};
use crate::persistent::program::PersistentProgram;
use crate::persistent::unroll::{BatchProgram, GradientGemm, HostWork};
use crate::persistent::UpdateScalars;
use crate::pool::{DeviceView, PoolBuffer};

impl PersistentEngine {
    /// Uploads a prepared batch (its scripts to its slot's buffer on the
    /// copy stream, while the batches before it still run; its staged
    /// words to the pool behind them), zeroes its accumulation region and
    /// launches it on the stream, behind the batches still running; the
    /// batch joins `pending`.
    pub(super) fn enqueue(&mut self, prepared: PreparedBatch) -> Result<()> {
        let PreparedBatch {
            variant,
            slot,
            tasks,
            batch,
            launches,
            updates,
            host_seconds,
        } = prepared;

        // the pool: parameters, then the batch's regions; the slot's
        // buffer: each launch's scripts, then the update scripts
        self.ensure_capacity(batch.end)?;
        let launched = || launches.iter().filter_map(|l| l.scripts.as_ref());
        let update_at: usize = launched().map(|s| s.packed.words.len()).sum();
        let levels = launched().map(|s| s.levels).sum();
        let script_words = sizes::script_words(&launches, updates.as_ref());
        let script_buffer = self.script_buffer(slot, script_words)?;
        let script_view = script_buffer.view().slice(0..script_words)?;
        self.slots[slot].scripts = Some(script_buffer);
        let traced = self.build.trace.is_some();
        let ctas = self.variants[variant].kernel.plan().ctas;
        let barriers = sizes::barrier_words(&launches, updates.as_ref(), traced.then_some(ctas));
        if self.barriers.len() < barriers {
            self.barriers = self.pool.alloc::<u32>(barriers.next_power_of_two())?;
        }
        let stream = self.device.stream().clone();
        let view = self.buffer.view();
        // the words were staged in order when the batch was prepared: the
        // pool's, then the scripts; the pool's copy follows the scripts'
        // (so the staging buffer's next use waits for both)
        let pool_words = batch.end - batch.upload_at;
        let copy_stream = Arc::clone(&self.copy_stream);
        self.staging(slot)?
            .upload_from(pool_words, script_view, &copy_stream)?;
        let copied = &self.slots[slot].scripts_copied;
        copied.record(&copy_stream).in_call("cuEventRecord")?;
        stream.wait(copied).in_call("cuStreamWaitEvent")?;
        let words: DeviceView<u32> = view.slice(batch.upload_at..batch.end)?.reinterpret();
        self.staging(slot)?.upload(words, &stream)?;
        view.slice(batch.zeroed.clone())?.fill_zero(&stream)?;
        let scalars = self.step_scalars(batch.fault_at)?;
        self.slots[slot]
            .events
            .0
            .record(&stream)
            .in_call("cuEventRecord")?;
        let in_registers = self.variants[variant].kernel.plan().grads_in_registers;
        let last_kernel = self.updating_launch(&launches);
        for (i, launch) in launches.iter().enumerate() {
            if let Some(scripts) = &launch.scripts {
                let words = scripts.packed.words.len();
                self.variants[variant].kernel.launch(
                    view,
                    script_view.slice(launch.at..launch.at + words)?,
                    &scripts.packed,
                    self.barriers.view(),
                    &scalars,
                    in_registers && Some(i) != last_kernel,
                )?;
                self.trace_launch(variant, slot)?;
            }
            self.host_work(&batch.host_work, &launch.host_after, view)?;
        }
        if !in_registers {
            self.gradient_products(&batch.gemms, view)?;
        }
        if let Some(updates) = &updates {
            let script = script_view.slice(update_at..script_words)?;
            self.variants[variant].kernel.launch(
                view,
                script,
                &updates.packed,
                self.barriers.view(),
                &scalars,
                false,
            )?;
        }
        self.read_back(slot, &batch, view)?;
        let step = PersistentStep {
            loss: f64::NAN,
            host_seconds,
            kernel_seconds: f64::NAN,
            tasks,
            levels,
            nonfinite: false,
        };
        self.pending.push_back(Pending {
            slot,
            step,
            variant,
            loss_at: batch.loss_at,
        });
        Ok(())
    }

    /// The launch whose kernel updates from the register gradients: the
    /// last one with kernel work (`None` when the update is deferred).
    /// Register gradients outlive no launch: every other hands them to the
    /// pool's accumulator.
    fn updating_launch(&self, launches: &[LaunchScripts]) -> Option<usize> {
        launches
            .iter()
            .rposition(|l| l.scripts.is_some())
            .filter(|_| !self.defer_updates)
    }

    /// Slot `slot`'s script buffer, at least `script_words` long: its own
    /// (the slot's batch before this one is done: its loss was read), else a
    /// new one.
    fn script_buffer(&mut self, slot: usize, script_words: usize) -> Result<PoolBuffer<u32>> {
        // a new buffer may be memory the pool took back from work still
        // queued on the stream (it reuses freed blocks at once), so the
        // copy stream first waits for that work
        Ok(match self.slots[slot].scripts.take() {
            Some(b) if b.len() >= script_words => b,
            _ => {
                let b = self
                    .pool
                    .alloc::<u32>(sizes::script_buffer_words(script_words))?;
                let queued = self.device.new_event()?;
                queued
                    .record(self.device.stream())
                    .in_call("cuEventRecord")?;
                self.copy_stream
                    .wait(&queued)
                    .in_call("cuStreamWaitEvent")?;
                b
            }
        })
    }

    /// Sets the learning rate of every batch submitted from now on (a
    /// kernel argument: nothing recompiles).
    pub fn set_lr(&mut self, lr: f64) -> Result<()> {
        self.optimizer
            .set_lr(lr)
            .map_err(|e| model_err(e.to_string()))?;
        self.step_lrs.clear();
        Ok(())
    }

    /// The learning rates of the next `lrs.len()` batches submitted, one
    /// each in order (a window prepared in parallel is still launched in
    /// order, each launch taking the next); the batches after them keep
    /// the last.
    pub fn set_step_lrs(&mut self, lrs: &[f64]) -> Result<()> {
        let mut check = self.optimizer;
        for &lr in lrs {
            check.set_lr(lr).map_err(|e| model_err(e.to_string()))?;
        }
        self.step_lrs = lrs.iter().copied().collect();
        Ok(())
    }

    /// The optimizer's scalars for the next step (counted here), with the
    /// batch's fault word at `fault_at`.
    fn step_scalars(&mut self, fault_at: usize) -> Result<UpdateScalars> {
        self.steps += 1;
        // a schedule's rate for this step, kept for the steps after it
        if let Some(lr) = self.step_lrs.pop_front() {
            self.optimizer.lr = lr;
        }
        let c = &self.optimizer;
        let t = self.steps as f64;
        Ok(UpdateScalars {
            lr: c.lr as f32,
            weight_decay: c.weight_decay as f32,
            beta1: c.beta1 as f32,
            beta2: c.beta2 as f32,
            eps: c.eps as f32,
            inv_bias_correction1: (1.0 / (1.0 - c.beta1.powf(t))) as f32,
            inv_bias_correction2: (1.0 / (1.0 - c.beta2.powf(t))) as f32,
            clip: 1.0,
            fault_at: u32::try_from(fault_at)
                .map_err(|_| model_err("the batch's fault word is past 2^32 floats"))?,
        })
    }

    /// After a batch's last launch on the stream: its end event, and its
    /// loss and fault word copied back to slot `slot`.
    fn read_back(
        &mut self,
        slot: usize,
        batch: &BatchProgram,
        view: DeviceView<f32>,
    ) -> Result<()> {
        let stream = self.device.stream().clone();
        self.slots[slot]
            .events
            .1
            .record(&stream)
            .in_call("cuEventRecord")?;
        self.slots[slot]
            .loss
            .download(view.slice(batch.loss_at..batch.loss_at + 1)?, &stream)?;
        let fault: DeviceView<u32> = view
            .slice(batch.fault_at..batch.fault_at + 1)?
            .reinterpret();
        self.slots[slot].fault.download(fault, &stream)?;
        Ok(())
    }

    /// Traced kernels: appends the launch just enqueued's records, read
    /// before the next launch writes its own over them.
    pub(super) fn trace_launch(&mut self, variant: usize, slot: usize) -> Result<()> {
        let Some(path) = self.build.trace.clone() else {
            return Ok(());
        };
        let ctas = self.variants[variant].kernel.plan().ctas;
        let records = self
            .barriers
            .view()
            .slice(TRACE_AT..TRACE_AT + TRACE_WORDS_PER_CTA * ctas)?;
        let stream = self.device.stream().clone();
        let words = self.staging(slot)?.download_to_vec(records, &stream)?;
        self.traced_launches += 1;
        append_trace(&path, self.traced_launches, &words)
    }

    /// cuBLAS, made at first use.
    pub(super) fn ensure_blas(&mut self) -> Result<()> {
        if self.blas.is_none() {
            self.blas = Some(Blas::new(&self.device, self.device.stream().clone())?);
        }
        Ok(())
    }

    /// The host work `which` (indices into `work`) on the stream: each
    /// product as one cuBLAS GEMM with the weights' master copy in the pool.
    pub(super) fn host_work(
        &mut self,
        work: &[HostWork],
        which: &[u32],
        view: DeviceView<f32>,
    ) -> Result<()> {
        if which.is_empty() {
            return Ok(());
        }
        self.ensure_blas()?;
        let Some(blas) = self.blas.as_ref() else {
            return Ok(());
        };
        for &i in which {
            let item = work
                .get(i as usize)
                .ok_or_else(|| model_err(format!("host task names work {i} of {}", work.len())))?;
            match *item {
                HostWork::Gradient(g) => gradient_gemm(blas, &self.prog, &g, view)?,
                HostWork::Product {
                    matrix,
                    transposed,
                    rows,
                    input,
                    input_stride,
                    output,
                    output_stride,
                } => {
                    let spec = &self.prog.matrices[usize::from(matrix)];
                    // y = x Wᵀ (W: n × k) or y = x W (W: k × n)
                    let (n, k) = match transposed {
                        false => (spec.rows, spec.cols),
                        true => (spec.cols, spec.rows),
                    };
                    if rows == 0 {
                        continue;
                    }
                    let span = |at: usize, stride: usize, width: usize| {
                        view.slice(at..at + (rows - 1) * stride + width)
                    };
                    let value = self.prog.params.value[spec.param];
                    let gemm = Gemm {
                        trans_b: !transposed,
                        beta: 1.0,
                        lda: Some(input_stride),
                        ldc: Some(output_stride),
                        ..Gemm::new(rows, n, k)
                    };
                    blas.sgemm(
                        &gemm,
                        span(input, input_stride, k)?,
                        view.slice(value..value + spec.rows * spec.cols)?,
                        span(output, output_stride, n)?,
                    )?;
                }
            }
        }
        Ok(())
    }

    /// The cached matrices' weight gradients with cuBLAS (a plan without
    /// register gradients): `grad += Aᵀ B` per product, on the stream.
    pub(super) fn gradient_products(
        &mut self,
        gemms: &[GradientGemm],
        view: DeviceView<f32>,
    ) -> Result<()> {
        self.ensure_blas()?;
        let Some(blas) = self.blas.as_ref() else {
            return Ok(());
        };
        for g in gemms {
            gradient_gemm(blas, &self.prog, g, view)?;
        }
        Ok(())
    }

    /// Grows the pool buffer to `floats`, keeping the parameter region.
    pub(super) fn ensure_capacity(&mut self, floats: usize) -> Result<()> {
        if floats <= self.buffer.len() {
            return Ok(());
        }
        let stream = self.device.stream().clone();
        let total = self.prog.params.total;
        let kept = self
            .transfer
            .download_to_vec(self.buffer.view().slice(0..total)?, &stream)?;
        let bigger = self.pool.alloc::<f32>(sizes::grown_buffer_floats(floats))?;
        self.transfer
            .upload_slice(&kept, bigger.view().slice(0..total)?, &stream)?;
        self.transfer.wait()?;
        self.buffer = bigger;
        Ok(())
    }
}

/// `grad[m] += Aᵀ B` for one weight-gradient product `g` (see
/// [`GradientGemm`]), into the matrix's gradient slot in the pool.
pub(super) fn gradient_gemm(
    blas: &Blas,
    prog: &PersistentProgram,
    g: &GradientGemm,
    view: DeviceView<f32>,
) -> Result<()> {
    let spec = &prog.matrices[usize::from(g.matrix)];
    let (rows, cols) = (spec.rows, spec.cols);
    let grad = prog.params.grad[spec.param]
        .ok_or_else(|| model_err("a cached matrix without a gradient slot"))?;
    if g.rows == 0 {
        return Ok(());
    }
    let span =
        |at: usize, stride: usize, width: usize| view.slice(at..at + (g.rows - 1) * stride + width);
    let gemm = Gemm {
        trans_a: true,
        beta: 1.0,
        lda: Some(g.a_stride),
        ldb: Some(g.b_stride),
        ..Gemm::new(rows, cols, g.rows)
    };
    blas.sgemm(
        &gemm,
        span(g.a, g.a_stride, rows)?,
        span(g.b, g.b_stride, cols)?,
        view.slice(grad..grad + rows * cols)?,
    )
}

/// Appends one launch's trace (`words`: the barrier buffer's records,
/// [`TRACE_WORDS_PER_CTA`] per CTA) to `path` as lines `launch cta opcode
/// arg start_ns end_ns items` (times: the GPU's global timer, low 32 bits;
/// items: a product's item count, 255 for that many or more, else 0).
/// `scripts/vpps_trace.py` summarises a file.
pub(super) fn append_trace(path: &std::path::Path, launch: u64, words: &[u32]) -> Result<()> {
    use std::fmt::Write as _;
    use std::io::Write as _;
    let mut out = String::new();
    for (cta, rec) in words.chunks(TRACE_WORDS_PER_CTA).enumerate() {
        let count = (rec[0] as usize).min((rec.len() - 1) / TRACE_RECORD_WORDS);
        for r in rec[1..1 + count * TRACE_RECORD_WORDS].chunks(TRACE_RECORD_WORDS) {
            let _ = writeln!(
                out,
                "{launch} {cta} {} {} {} {} {}",
                r[0] & 0xff,
                r[0] >> 16,
                r[1],
                r[2],
                (r[0] >> 8) & 0xff
            );
        }
    }
    let trace_err = |e: std::io::Error| model_err(format!("trace file {}: {e}", path.display()));
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .and_then(|mut f| f.write_all(out.as_bytes()))
        .map_err(trace_err)
}
