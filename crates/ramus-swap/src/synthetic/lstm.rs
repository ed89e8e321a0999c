//! LSTM training traces: one op per time step forward, the head and loss
//! on the last state, one op per step backward, the optimizer.

use super::recorder::{DeviceSpeed, Optimizer, Recorder};
use crate::trace::{Phase, TensorId, TensorKind, Trace, TraceError};

/// An LSTM over a batch of long sequences, loss on the last state.
#[derive(Clone, Debug, PartialEq)]
pub struct LstmSpec {
    /// Sequence length (time steps).
    pub steps: usize,
    /// Sequences per batch.
    pub batch: usize,
    /// Hidden size (also the input embedding size).
    pub hidden: usize,
    /// The optimizer.
    pub optimizer: Optimizer,
    /// Bytes per element.
    pub elem_bytes: u64,
    /// Op durations.
    pub speed: DeviceSpeed,
}

/// The forward pass's tensors per step (index 0 of `cs` and `hs`: the
/// initial state).
struct Steps {
    xs: Vec<TensorId>,
    gates: Vec<TensorId>,
    cs: Vec<TensorId>,
    hs: Vec<TensorId>,
}

impl LstmSpec {
    /// A long-sequence LSTM with Adam.
    pub fn new(steps: usize, batch: usize, hidden: usize, speed: DeviceSpeed) -> LstmSpec {
        LstmSpec {
            steps,
            batch,
            hidden,
            optimizer: Optimizer::Adam,
            elem_bytes: 4,
            speed,
        }
    }

    /// Generates the iteration: one op per step forward, the head and loss,
    /// one op per step backward (reverse), the optimizer.
    pub fn trace(&self) -> Result<Trace, TraceError> {
        let h = self.hidden as u64;
        let mut r = Recorder::new(self.speed, self.optimizer, self.elem_bytes);
        let (p, g) = r.params("lstm", &[("w", 4 * h * 2 * h), ("b", 4 * h)]);
        let steps = self.forward(&mut r, &p);
        let dh = self.head(&mut r, steps.hs[self.steps]);
        self.backward(&mut r, &steps, (&p, &g), dh);
        r.finish()
    }

    /// Bytes of one state (`h` or `c`) of the batch.
    fn state_bytes(&self) -> u64 {
        (self.batch * self.hidden) as u64 * self.elem_bytes
    }

    /// FLOPs of one step's gate GEMM.
    fn step_flops(&self) -> f64 {
        let (bsz, h) = (self.batch as u64, self.hidden as u64);
        2.0 * (bsz * 4 * h * 2 * h) as f64
    }

    /// One op per step, each reading the step's input, the previous state
    /// and the parameters `p`.
    fn forward(&self, r: &mut Recorder, p: &[TensorId]) -> Steps {
        let state = self.state_bytes();
        let h0 = r.tensor("h.0", state, TensorKind::Activation);
        let c0 = r.tensor("c.0", state, TensorKind::Activation);
        let mut s = Steps {
            xs: Vec::new(),
            gates: Vec::new(),
            cs: vec![c0],
            hs: vec![h0],
        };
        for t in 1..=self.steps {
            let x = r.tensor(format!("x.{t}"), state, TensorKind::Activation);
            let gt = r.tensor(format!("gates.{t}"), 4 * state, TensorKind::Activation);
            let ct = r.tensor(format!("c.{t}"), state, TensorKind::Activation);
            let ht = r.tensor(format!("h.{t}"), state, TensorKind::Activation);
            r.op(
                format!("lstm.{t}"),
                Phase::Forward,
                &[x, s.hs[t - 1], s.cs[t - 1], p[0], p[1]],
                &[gt, ct, ht],
                self.step_flops(),
            );
            s.xs.push(x);
            s.gates.push(gt);
            s.cs.push(ct);
            s.hs.push(ht);
        }
        s
    }

    /// The head on the last hidden state `last`, the loss and the head's
    /// backward; returns the gradient of `last`.
    fn head(&self, r: &mut Recorder, last: TensorId) -> TensorId {
        let (bsz, h) = (self.batch as u64, self.hidden as u64);
        let classes = 16u64;
        let (hp, hg) = r.params("head", &[("w", classes * h), ("b", classes)]);
        let l = r.loss_tensors(bsz, classes);
        let head_flops = 2.0 * (bsz * classes * h) as f64;
        r.op(
            "head",
            Phase::Forward,
            &[last, hp[0], hp[1]],
            &[l.logits],
            head_flops,
        );
        r.softmax_xent(&l);
        let dh = r.tensor(
            format!("h.{}.grad", self.steps),
            self.state_bytes(),
            TensorKind::Gradient,
        );
        let head_bwd_writes = [dh, hg[0], hg[1]];
        r.op(
            "head.bwd",
            Phase::Backward,
            &[l.dlogits, last, hp[0]],
            &head_bwd_writes,
            2.0 * head_flops,
        );
        dh
    }

    /// One op per step in reverse, from the last state's gradient `dh`,
    /// accumulating into the gradients of the parameters `(p, g)`.
    fn backward(
        &self,
        r: &mut Recorder,
        s: &Steps,
        (p, g): (&[TensorId], &[TensorId]),
        mut dh: TensorId,
    ) {
        let state = self.state_bytes();
        let mut dc: Option<TensorId> = None;
        for t in (1..=self.steps).rev() {
            let dh_prev = r.tensor(format!("h.{}.grad", t - 1), state, TensorKind::Gradient);
            let dc_prev = r.tensor(format!("c.{}.grad", t - 1), state, TensorKind::Gradient);
            let mut reads = vec![
                dh,
                s.gates[t - 1],
                s.cs[t - 1],
                s.cs[t],
                s.hs[t - 1],
                s.xs[t - 1],
                p[0],
                g[0],
                g[1],
            ];
            reads.extend(dc);
            r.op(
                format!("lstm.{t}.bwd"),
                Phase::Backward,
                &reads,
                &[dh_prev, dc_prev, g[0], g[1]],
                2.0 * self.step_flops(),
            );
            dh = dh_prev;
            dc = Some(dc_prev);
        }
    }
}
