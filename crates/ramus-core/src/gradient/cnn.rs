//! Gradients of the convolution, pooling and normalisation ops.

use super::{GradCtx, Gradient};
use crate::graph::Sym;
use crate::op::OpDef;
use crate::ops::*;

/// Gradient of a gradient op `op` that has none: records "second
/// derivatives of `of` are not supported" on the builder.
fn no_second_derivative(g: &mut GradCtx<'_>, op: &str, of: &str) {
    g.b.fail(op, format!("second derivatives of {of} are not supported"));
}

/// Sets input `i`'s gradient to the static value `s`, reshaped to the
/// input's shape when they differ (a `[1, C]` bias, a 4-D weight).
fn set_static(g: &mut GradCtx<'_>, i: usize, s: Sym) {
    let want = g.input_type(i).map(|t| t.shape).unwrap_or_default();
    let s = match g.b.ty(s) {
        Some(t) if t.shape != want => g.b.reshape(s, &want),
        _ => s,
    };
    g.set(i, s);
}

impl Gradient for Conv2d {
    fn gradient(&self, g: &mut GradCtx<'_>) {
        let geom = self.0;
        let (x, w, dy) = (g.input(0), g.input(1), g.grad());
        let dx = g.b.conv2d_backward_input(dy, w, geom);
        g.set(0, dx);
        let dw = g.b.conv2d_backward_weight(x, dy, geom);
        set_static(g, 1, dw);
        if g.inputs_len() == 3 {
            let db =
                g.b.channel_sum(dy, geom.out_channels, geom.out_h() * geom.out_w());
            set_static(g, 2, db);
        }
    }
}

impl Gradient for Conv2dBackwardInput {
    fn gradient(&self, g: &mut GradCtx<'_>) {
        // adjoint pair: <G, col2im(Wᵀ dY)> = <conv(G, W), dY> = <dY·im2col(G)ᵀ, W>
        let geom = self.0;
        let (dy, w, gr) = (g.input(0), g.input(1), g.grad());
        let d_dy = g.b.conv2d(gr, w, None, geom);
        g.set(0, d_dy);
        let d_w = g.b.conv2d_backward_weight(gr, dy, geom);
        set_static(g, 1, d_w);
    }
}

impl Gradient for Conv2dBackwardWeight {
    fn gradient(&self, g: &mut GradCtx<'_>) {
        let geom = self.0;
        let (x, dy, gr) = (g.input(0), g.input(1), g.grad());
        let d_x = g.b.conv2d_backward_input(dy, gr, geom);
        g.set(0, d_x);
        let d_dy = g.b.conv2d(x, gr, None, geom);
        g.set(1, d_dy);
    }
}

impl Gradient for MaxPool2d {
    fn gradient(&self, g: &mut GradCtx<'_>) {
        let (x, dy) = (g.input(0), g.grad());
        let dx = g.b.max_pool2d_backward(x, dy, self.0);
        g.set(0, dx);
    }
}

impl Gradient for MaxPool2dBackward {
    fn gradient(&self, g: &mut GradCtx<'_>) {
        no_second_derivative(g, "max_pool2d_backward", "max pooling");
    }
}

impl Gradient for GlobalAvgPool {
    fn gradient(&self, g: &mut GradCtx<'_>) {
        let dy = g.grad();
        let op = GlobalAvgPoolBackward { pool: *self };
        let dx = g.b.apply(op, &[dy]);
        g.set(0, dx);
    }
}

impl Gradient for GlobalAvgPoolBackward {
    fn gradient(&self, g: &mut GradCtx<'_>) {
        let gr = g.grad();
        let d = g.b.apply(self.pool, &[gr]);
        g.set(0, d);
    }
}

impl Gradient for ChannelSum {
    fn gradient(&self, g: &mut GradCtx<'_>) {
        let (x, gr) = (g.input(0), g.grad());
        let d = g.b.channel_broadcast(gr, x, self.channels, self.spatial);
        g.set(0, d);
    }
}

impl Gradient for ChannelBroadcast {
    fn gradient(&self, g: &mut GradCtx<'_>) {
        let gr = g.grad();
        let s = g.b.channel_sum(gr, self.channels, self.spatial);
        set_static(g, 0, s);
    }
}

impl Gradient for BatchNorm {
    fn gradient(&self, g: &mut GradCtx<'_>) {
        let n = self.0;
        let (x, gamma, dy) = (g.input(0), g.input(1), g.grad());
        let dx = g.b.apply(BatchNormBackwardInput(n), &[x, gamma, dy]);
        g.set(0, dx);
        let dgamma = g.b.apply(BatchNormBackwardGamma(n), &[x, dy]);
        set_static(g, 1, dgamma);
        let dbeta = g.b.channel_sum(dy, n.channels, n.spatial);
        set_static(g, 2, dbeta);
    }
}

impl Gradient for BatchNormBackwardInput {
    fn gradient(&self, g: &mut GradCtx<'_>) {
        no_second_derivative(g, "batch_norm_backward_input", "batch normalisation");
    }
}

impl Gradient for BatchNormBackwardGamma {
    fn gradient(&self, g: &mut GradCtx<'_>) {
        no_second_derivative(g, "batch_norm_backward_gamma", "batch normalisation");
    }
}

impl Gradient for BatchNormInference {
    fn gradient(&self, g: &mut GradCtx<'_>) {
        let n = self.0;
        let (x, gamma, mean, var, dy) = (g.input(0), g.input(1), g.input(3), g.input(4), g.grad());
        let dx =
            g.b.apply(BatchNormInferenceBackwardInput(n), &[gamma, var, dy]);
        g.set(0, dx);
        let dbeta = g.b.channel_sum(dy, n.channels, n.spatial);
        set_static(g, 2, dbeta);
        for (i, param) in [
            (1, NormParam::Gamma),
            (3, NormParam::Mean),
            (4, NormParam::Var),
        ] {
            let op = BatchNormInferenceBackwardParam { geom: n, param };
            let d = g.b.apply(op, &[x, gamma, mean, var, dy]);
            set_static(g, i, d);
        }
    }
}

impl Gradient for BatchNormInferenceBackwardInput {
    fn gradient(&self, g: &mut GradCtx<'_>) {
        no_second_derivative(
            g,
            "batch_norm_inference_backward_input",
            "batch normalisation",
        );
    }
}

impl Gradient for BatchNormInferenceBackwardParam {
    fn gradient(&self, g: &mut GradCtx<'_>) {
        no_second_derivative(g, self.name(), "batch normalisation");
    }
}
