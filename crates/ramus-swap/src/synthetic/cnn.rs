//! CNN training traces: a layer list run forward, the loss, the backward
//! in reverse and the optimizer, with activation sizes from layer shapes.

use super::recorder::{DeviceSpeed, Optimizer, Recorder};
use crate::trace::{Phase, TensorId, TensorKind, Trace, TraceError};

/// One layer of a CNN.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CnnLayer {
    /// Convolution with fused bias and ReLU.
    Conv {
        /// Output channels.
        out: usize,
        /// Kernel size.
        kernel: usize,
        /// Stride.
        stride: usize,
        /// Zero padding.
        pad: usize,
    },
    /// Max pooling.
    MaxPool {
        /// Window size.
        kernel: usize,
        /// Stride.
        stride: usize,
        /// Padding.
        pad: usize,
    },
    /// Global average pooling to 1×1.
    GlobalAvgPool,
    /// Fully connected layer (flattens its input).
    Linear {
        /// Output features.
        out: usize,
        /// Whether a ReLU follows.
        relu: bool,
    },
    /// Dropout (keeps a one-byte mask per element for the backward pass).
    Dropout,
    /// ResNet bottleneck block: 1×1, 3×3 (strided), 1×1 convolutions with
    /// batch norm, a projection shortcut when the shape changes, residual
    /// add and ReLU.
    Bottleneck {
        /// Width of the inner convolutions.
        mid: usize,
        /// Output channels.
        out: usize,
        /// Stride of the 3×3 convolution (and the projection).
        stride: usize,
    },
}

/// A CNN training iteration to generate.
#[derive(Clone, Debug, PartialEq)]
pub struct CnnSpec {
    /// Model name (prefix of nothing; for reports).
    pub name: String,
    /// Images per batch.
    pub batch: usize,
    /// Input channels.
    pub in_channels: usize,
    /// Input height and width.
    pub image: usize,
    /// Classes of the final layer's softmax.
    pub classes: usize,
    /// The layers in forward order.
    pub layers: Vec<CnnLayer>,
    /// The optimizer.
    pub optimizer: Optimizer,
    /// Bytes per element (4 for FP32).
    pub elem_bytes: u64,
    /// Largest convolution workspace, bytes.
    pub max_workspace_bytes: u64,
    /// Op durations.
    pub speed: DeviceSpeed,
}

/// The fully connected classifier AlexNet and VGG end with: two 4096-wide
/// ReLU layers with dropout, then 1000 ImageNet classes.
fn imagenet_classifier() -> [CnnLayer; 5] {
    let fc = |out, relu| CnnLayer::Linear { out, relu };
    [
        fc(4096, true),
        CnnLayer::Dropout,
        fc(4096, true),
        CnnLayer::Dropout,
        fc(1000, false),
    ]
}

/// An ImageNet CNN on RGB images in FP32, SGD with momentum.
fn imagenet_cnn(
    name: String,
    batch: usize,
    image: usize,
    layers: Vec<CnnLayer>,
    speed: DeviceSpeed,
) -> CnnSpec {
    CnnSpec {
        name,
        batch,
        in_channels: 3,
        image,
        classes: 1000,
        layers,
        optimizer: Optimizer::Momentum,
        elem_bytes: 4,
        max_workspace_bytes: 64 << 20,
        speed,
    }
}

fn vgg(
    name: &str,
    blocks: &[(usize, usize)],
    batch: usize,
    image: usize,
    speed: DeviceSpeed,
) -> CnnSpec {
    let mut layers = Vec::new();
    for &(convs, ch) in blocks {
        for _ in 0..convs {
            layers.push(CnnLayer::Conv {
                out: ch,
                kernel: 3,
                stride: 1,
                pad: 1,
            });
        }
        layers.push(CnnLayer::MaxPool {
            kernel: 2,
            stride: 2,
            pad: 0,
        });
    }
    layers.extend(imagenet_classifier());
    imagenet_cnn(name.to_string(), batch, image, layers, speed)
}

/// VGG-16 (13 convolutions, 3 fully connected layers), SGD with momentum.
pub fn vgg16(batch: usize, image: usize, speed: DeviceSpeed) -> CnnSpec {
    vgg(
        "vgg16",
        &[(2, 64), (2, 128), (3, 256), (3, 512), (3, 512)],
        batch,
        image,
        speed,
    )
}

/// VGG-19 (16 convolutions, 3 fully connected layers), SGD with momentum.
pub fn vgg19(batch: usize, image: usize, speed: DeviceSpeed) -> CnnSpec {
    vgg(
        "vgg19",
        &[(2, 64), (2, 128), (4, 256), (4, 512), (4, 512)],
        batch,
        image,
        speed,
    )
}

/// AlexNet on 227×227 images, SGD with momentum.
pub fn alexnet(batch: usize, speed: DeviceSpeed) -> CnnSpec {
    let conv = |out, kernel, stride, pad| CnnLayer::Conv {
        out,
        kernel,
        stride,
        pad,
    };
    let pool = CnnLayer::MaxPool {
        kernel: 3,
        stride: 2,
        pad: 0,
    };
    let mut layers = vec![
        conv(96, 11, 4, 0),
        pool,
        conv(256, 5, 1, 2),
        pool,
        conv(384, 3, 1, 1),
        conv(384, 3, 1, 1),
        conv(256, 3, 1, 1),
        pool,
    ];
    layers.extend(imagenet_classifier());
    imagenet_cnn("alexnet".into(), batch, 227, layers, speed)
}

/// A bottleneck ResNet with `blocks[i]` blocks in stage `i` (`[3, 4, 6, 3]`
/// is ResNet-50, `[3, 4, 23, 3]` ResNet-101, `[3, 8, 36, 3]` ResNet-152),
/// SGD with momentum.
pub fn resnet(blocks: [usize; 4], batch: usize, image: usize, speed: DeviceSpeed) -> CnnSpec {
    let mut layers = vec![
        CnnLayer::Conv {
            out: 64,
            kernel: 7,
            stride: 2,
            pad: 3,
        },
        CnnLayer::MaxPool {
            kernel: 3,
            stride: 2,
            pad: 1,
        },
    ];
    let widths = [(64, 256), (128, 512), (256, 1024), (512, 2048)];
    for (stage, (&count, &(mid, out))) in blocks.iter().zip(&widths).enumerate() {
        for i in 0..count {
            let stride = if i == 0 && stage > 0 { 2 } else { 1 };
            layers.push(CnnLayer::Bottleneck { mid, out, stride });
        }
    }
    layers.push(CnnLayer::GlobalAvgPool);
    layers.push(CnnLayer::Linear {
        out: 1000,
        relu: false,
    });
    let depth = 2 + 3 * blocks.iter().sum::<usize>();
    imagenet_cnn(format!("resnet{depth}"), batch, image, layers, speed)
}

/// An activation and its per-sample shape.
#[derive(Clone, Copy, Debug)]
struct Act {
    t: TensorId,
    c: usize,
    h: usize,
    w: usize,
}

/// What the backward pass of one layer needs.
#[derive(Clone, Debug)]
enum Rec {
    Conv {
        name: String,
        x: Act,
        y: TensorId,
        params: Vec<TensorId>,
        grads: Vec<TensorId>,
        relu: bool,
        need_dx: bool,
        flops: f64,
        ws: u64,
    },
    Pool {
        name: String,
        x: Act,
        y: TensorId,
    },
    GlobalPool {
        name: String,
        x: Act,
    },
    Dropout {
        name: String,
        x: Act,
        mask: TensorId,
    },
    Block {
        name: String,
        x: Act,
        out: TensorId,
        branch: Vec<Rec>,
        shortcut: Option<Box<Rec>>,
    },
}

/// A convolution to emit (or, with `kernel` = spatial size and no
/// padding, a fully connected layer), with fused bias/norm.
#[derive(Clone, Copy, Debug)]
struct Conv {
    out: usize,
    kernel: usize,
    stride: usize,
    pad: usize,
    /// Whether a ReLU follows (its backward then runs first).
    relu: bool,
    /// Whether the backward computes the input's gradient (not for the
    /// first layer, whose input is the data).
    need_dx: bool,
}

impl Conv {
    /// A convolution with ReLU whose input gradient is needed.
    fn relu(out: usize, kernel: usize, stride: usize, pad: usize) -> Conv {
        Conv {
            out,
            kernel,
            stride,
            pad,
            relu: true,
            need_dx: true,
        }
    }

    /// The same convolution without the ReLU.
    fn linear(self) -> Conv {
        Conv {
            relu: false,
            ..self
        }
    }
}

/// The CNN generator: the recorder and the spec it follows.
struct CnnGen<'a> {
    r: Recorder,
    spec: &'a CnnSpec,
}

impl CnnGen<'_> {
    /// Bytes of a batch of `c`×`h`×`w` elements.
    fn batch_bytes(&self, c: usize, h: usize, w: usize) -> u64 {
        (self.spec.batch * c * h * w) as u64 * self.spec.elem_bytes
    }

    /// Elements of a recorded tensor.
    fn elems(&self, t: TensorId) -> f64 {
        self.r.bytes(t) as f64 / self.spec.elem_bytes as f64
    }

    fn act(&mut self, name: String, c: usize, h: usize, w: usize) -> Act {
        let bytes = self.batch_bytes(c, h, w);
        let t = self.r.tensor(name, bytes, TensorKind::Activation);
        Act { t, c, h, w }
    }

    fn grad_like(&mut self, name: String, x: &Act) -> TensorId {
        let bytes = self.batch_bytes(x.c, x.h, x.w);
        self.r.tensor(name, bytes, TensorKind::Gradient)
    }

    /// The backward op `{name}.bwd` of a layer without parameters: reads
    /// `reads`, writes the gradient of its input `x`, which it returns.
    fn input_grad_bwd(&mut self, name: &str, x: &Act, reads: &[TensorId]) -> TensorId {
        let dx = self.grad_like(format!("{name}.dx"), x);
        let elems = self.elems(x.t);
        self.r
            .op(format!("{name}.bwd"), Phase::Backward, reads, &[dx], elems);
        dx
    }

    fn workspace(&mut self, name: String, bytes: u64) -> Vec<TensorId> {
        if bytes == 0 {
            Vec::new()
        } else {
            vec![self.r.tensor(name, bytes, TensorKind::Workspace)]
        }
    }

    /// Convolution `c` of `x` (see [`Conv`]).
    fn conv(&mut self, name: &str, x: Act, c: Conv) -> Result<(Act, Rec), TraceError> {
        let Conv {
            out,
            kernel,
            stride,
            pad,
            relu,
            need_dx,
        } = c;
        let (ho, wo) = out_size(name, x.h, x.w, kernel, stride, pad)?;
        let spec = self.spec;
        let y = self.act(format!("{name}.out"), out, ho, wo);
        let (params, grads) = self.r.params(
            name,
            &[
                ("w", (out * x.c * kernel * kernel) as u64),
                ("b", out as u64),
            ],
        );
        let flops = 2.0 * (spec.batch * out * ho * wo * x.c * kernel * kernel) as f64;
        let ws = if kernel > 1 && (ho > 1 || wo > 1) {
            ((spec.batch * x.c * kernel * kernel * ho * wo) as u64 * spec.elem_bytes)
                .min(spec.max_workspace_bytes)
        } else {
            0
        };
        let wst = self.workspace(format!("{name}.ws"), ws);
        let reads = [x.t, params[0], params[1]];
        let writes: Vec<TensorId> = std::iter::once(y.t).chain(wst).collect();
        self.r.op(name, Phase::Forward, &reads, &writes, flops);
        Ok((
            y,
            Rec::Conv {
                name: name.to_string(),
                x,
                y: y.t,
                params,
                grads,
                relu,
                need_dx,
                flops,
                ws,
            },
        ))
    }

    /// Layer `i` (from 1) of the forward pass over `x`; the first layer
    /// computes no input gradient.
    fn forward(
        &mut self,
        i: usize,
        layer: CnnLayer,
        x: Act,
        first: bool,
    ) -> Result<(Act, Rec), TraceError> {
        match layer {
            CnnLayer::Conv {
                out,
                kernel,
                stride,
                pad,
            } => {
                let c = Conv {
                    need_dx: !first,
                    ..Conv::relu(out, kernel, stride, pad)
                };
                self.conv(&format!("conv{i}"), x, c)
            }
            CnnLayer::Linear { out, relu } => {
                // A fully connected layer is a convolution covering the input.
                let flat = Act {
                    t: x.t,
                    c: x.c * x.h * x.w,
                    h: 1,
                    w: 1,
                };
                let c = Conv {
                    relu,
                    need_dx: !first,
                    ..Conv::relu(out, 1, 1, 0)
                };
                self.conv(&format!("fc{i}"), flat, c)
            }
            CnnLayer::MaxPool {
                kernel,
                stride,
                pad,
            } => self.max_pool(i, x, kernel, stride, pad),
            CnnLayer::GlobalAvgPool => Ok(self.global_avg_pool(i, x)),
            CnnLayer::Dropout => Ok(self.dropout(i, x)),
            CnnLayer::Bottleneck { mid, out, stride } => self.bottleneck(i, x, mid, out, stride),
        }
    }

    /// Max pooling with a `kernel`×`kernel` window.
    fn max_pool(
        &mut self,
        i: usize,
        x: Act,
        kernel: usize,
        stride: usize,
        pad: usize,
    ) -> Result<(Act, Rec), TraceError> {
        let name = format!("pool{i}");
        let (ho, wo) = out_size(&name, x.h, x.w, kernel, stride, pad)?;
        let y = self.act(format!("{name}.out"), x.c, ho, wo);
        let elems = (self.spec.batch * x.c * ho * wo * kernel * kernel) as f64;
        self.r.op(&name, Phase::Forward, &[x.t], &[y.t], elems);
        Ok((y, Rec::Pool { name, x, y: y.t }))
    }

    fn global_avg_pool(&mut self, i: usize, x: Act) -> (Act, Rec) {
        let name = format!("avgpool{i}");
        let y = self.act(format!("{name}.out"), x.c, 1, 1);
        let elems = (self.spec.batch * x.c * x.h * x.w) as f64;
        self.r.op(&name, Phase::Forward, &[x.t], &[y.t], elems);
        (y, Rec::GlobalPool { name, x })
    }

    fn dropout(&mut self, i: usize, x: Act) -> (Act, Rec) {
        let name = format!("dropout{i}");
        let y = self.act(format!("{name}.out"), x.c, x.h, x.w);
        let mask_bytes = (self.spec.batch * x.c * x.h * x.w) as u64;
        let mask = self
            .r
            .tensor(format!("{name}.mask"), mask_bytes, TensorKind::Activation);
        let elems = (self.spec.batch * x.c * x.h * x.w) as f64;
        self.r
            .op(&name, Phase::Forward, &[x.t], &[y.t, mask], elems);
        (y, Rec::Dropout { name, x, mask })
    }

    /// A ResNet bottleneck block (see [`CnnLayer::Bottleneck`]).
    fn bottleneck(
        &mut self,
        i: usize,
        x: Act,
        mid: usize,
        out: usize,
        stride: usize,
    ) -> Result<(Act, Rec), TraceError> {
        let name = format!("block{i}");
        let (a, r1) = self.conv(&format!("{name}.conv1"), x, Conv::relu(mid, 1, 1, 0))?;
        let (b, r2) = self.conv(&format!("{name}.conv2"), a, Conv::relu(mid, 3, stride, 1))?;
        let (c, r3) = self.conv(
            &format!("{name}.conv3"),
            b,
            Conv::relu(out, 1, 1, 0).linear(),
        )?;
        let (sc, shortcut) = if stride != 1 || x.c != out {
            let proj = Conv::relu(out, 1, stride, 0).linear();
            let (s, rs) = self.conv(&format!("{name}.proj"), x, proj)?;
            (s.t, Some(Box::new(rs)))
        } else {
            (x.t, None)
        };
        let y = self.act(format!("{name}.out"), out, c.h, c.w);
        let elems = (self.spec.batch * out * c.h * c.w) as f64;
        self.r.op(
            format!("{name}.add_relu"),
            Phase::Forward,
            &[c.t, sc],
            &[y.t],
            elems,
        );
        Ok((
            y,
            Rec::Block {
                name,
                x,
                out: y.t,
                branch: vec![r1, r2, r3],
                shortcut,
            },
        ))
    }

    /// Emits the backward ops of `rec` given the gradient of its output;
    /// returns the gradient of its input (if needed).
    fn backward(&mut self, rec: &Rec, dy: TensorId) -> Option<TensorId> {
        match rec {
            Rec::Conv {
                name,
                x,
                y,
                params,
                grads,
                relu,
                need_dx,
                flops,
                ws,
            } => {
                if *relu {
                    let elems = self.elems(*y);
                    self.r.op(
                        format!("{name}.relu_bwd"),
                        Phase::Backward,
                        &[*y, dy],
                        &[dy],
                        elems,
                    );
                }
                let wsf = self.workspace(format!("{name}.ws_filter"), *ws);
                let writes: Vec<TensorId> = grads.iter().copied().chain(wsf).collect();
                self.r.op(
                    format!("{name}.bwd_filter"),
                    Phase::Backward,
                    &[x.t, dy],
                    &writes,
                    *flops,
                );
                if *need_dx {
                    let dx = self.grad_like(format!("{name}.dx"), x);
                    let wsd = self.workspace(format!("{name}.ws_data"), *ws);
                    let writes: Vec<TensorId> = std::iter::once(dx).chain(wsd).collect();
                    self.r.op(
                        format!("{name}.bwd_data"),
                        Phase::Backward,
                        &[dy, params[0]],
                        &writes,
                        *flops,
                    );
                    Some(dx)
                } else {
                    None
                }
            }
            Rec::Pool { name, x, y } => Some(self.input_grad_bwd(name, x, &[dy, x.t, *y])),
            Rec::GlobalPool { name, x } => Some(self.input_grad_bwd(name, x, &[dy])),
            Rec::Dropout { name, x, mask } => Some(self.input_grad_bwd(name, x, &[dy, *mask])),
            Rec::Block {
                name,
                x,
                out,
                branch,
                shortcut,
            } => {
                let elems = self.elems(*out);
                self.r.op(
                    format!("{name}.add_relu_bwd"),
                    Phase::Backward,
                    &[*out, dy],
                    &[dy],
                    elems,
                );
                let mut d = dy;
                for r in branch.iter().rev() {
                    d = self.backward(r, d)?;
                }
                let ds = match shortcut {
                    Some(s) => self.backward(s, dy)?,
                    None => dy,
                };
                let dx = self.grad_like(format!("{name}.dx"), x);
                let elems = self.elems(x.t);
                self.r.op(
                    format!("{name}.add_bwd"),
                    Phase::Backward,
                    &[d, ds],
                    &[dx],
                    elems,
                );
                Some(dx)
            }
        }
    }
}

/// Output size of a convolution or pooling window, or an error naming the layer.
fn out_size(
    name: &str,
    h: usize,
    w: usize,
    kernel: usize,
    stride: usize,
    pad: usize,
) -> Result<(usize, usize), TraceError> {
    let f = |x: usize| {
        (x + 2 * pad)
            .checked_sub(kernel)
            .filter(|_| stride > 0)
            .map(|v| v / stride + 1)
    };
    match (f(h), f(w)) {
        (Some(a), Some(b)) => Ok((a, b)),
        _ => Err(TraceError::Spec(format!(
            "layer {name}: a {kernel}×{kernel} window with stride {stride} does not fit a {h}×{w} input"
        ))),
    }
}

impl CnnSpec {
    /// Generates the training iteration: forward, loss, backward in
    /// reverse, optimizer.
    pub fn trace(&self) -> Result<Trace, TraceError> {
        let mut g = CnnGen {
            r: Recorder::new(self.speed, self.optimizer, self.elem_bytes),
            spec: self,
        };
        let mut x = g.act("input".into(), self.in_channels, self.image, self.image);
        let labels =
            g.r.tensor("labels", 8 * self.batch as u64, TensorKind::Activation);
        let mut recs = Vec::with_capacity(self.layers.len());
        for (i, &layer) in self.layers.iter().enumerate() {
            let (y, rec) = g.forward(i + 1, layer, x, i == 0)?;
            recs.push(rec);
            x = y;
        }
        let loss = g.r.tensor(
            "loss",
            self.elem_bytes * self.batch as u64,
            TensorKind::Activation,
        );
        let mut d = g.grad_like("logits.grad".into(), &x);
        let elems = (self.batch * x.c) as f64 * 5.0;
        g.r.op(
            "softmax_xent",
            Phase::Forward,
            &[x.t, labels],
            &[loss, d],
            elems,
        );
        for rec in recs.iter().rev() {
            match g.backward(rec, d) {
                Some(dx) => d = dx,
                None => break,
            }
        }
        g.r.finish()
    }
}
