//! Synthetic training traces with realistic sizes and op times.
//!
//! These stand in for engine-recorded traces in tests, examples and
//! benchmarks of the planner:
//!
//! * [`CnnSpec`]: CNN training — forward through a layer list, loss,
//!   backward in reverse, then the optimizer — with activation sizes derived
//!   from layer shapes. Presets: [`vgg16`], [`vgg19`], [`alexnet`],
//!   [`resnet`] (bottleneck blocks, configurable depth). Convolutions fuse
//!   bias (or batch norm) and ReLU; their backward is three ops (ReLU mask
//!   in place, filter gradient, data gradient) as cuDNN runs it.
//! * [`LstmSpec`]: an LSTM over one long sequence (a batch of them), with
//!   the head on the last state.
//! * [`TreeSpec`]: a child-sum Tree-LSTM over a batch of large random
//!   binary trees, one batching task per tree level as Cavs schedules it.
//!
//! Op durations come from a roofline model ([`DeviceSpeed`]): the larger of
//! FLOPs over compute throughput and bytes touched over memory bandwidth,
//! plus a launch cost.

use crate::trace::{Phase, TensorId, TensorKind, Trace, TraceBuilder, TraceError};

/// A roofline model of a device, for synthetic op durations.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DeviceSpeed {
    /// Sustained arithmetic throughput, FLOP/s.
    pub flops_per_s: f64,
    /// Sustained device memory bandwidth, bytes/s.
    pub memory_bytes_per_s: f64,
    /// Fixed cost per op (launch), seconds.
    pub launch_s: f64,
}

impl DeviceSpeed {
    /// The AutoVM thesis' RTX 2080 Ti: ≈ 11 TFLOP/s FP32 sustained, 500 GB/s.
    pub fn rtx_2080_ti() -> DeviceSpeed {
        DeviceSpeed {
            flops_per_s: 11e12,
            memory_bytes_per_s: 500e9,
            launch_s: 5e-6,
        }
    }

    /// An H100: ≈ 50 TFLOP/s sustained (TF32), 2.5 TB/s.
    pub fn h100() -> DeviceSpeed {
        DeviceSpeed {
            flops_per_s: 50e12,
            memory_bytes_per_s: 2.5e12,
            launch_s: 4e-6,
        }
    }

    /// Seconds for an op doing `flops` and touching `bytes`.
    pub fn op_time(&self, flops: f64, bytes: u64) -> f64 {
        self.launch_s + (flops / self.flops_per_s).max(bytes as f64 / self.memory_bytes_per_s)
    }
}

/// The optimizer, which decides how much state each parameter carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Optimizer {
    /// Plain SGD: no state.
    Sgd,
    /// SGD with momentum: one buffer per parameter.
    Momentum,
    /// Adam: two moments per parameter.
    Adam,
}

impl Optimizer {
    fn states(self) -> usize {
        match self {
            Optimizer::Sgd => 0,
            Optimizer::Momentum => 1,
            Optimizer::Adam => 2,
        }
    }
}

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

/// A trace builder that remembers sizes, to derive op durations.
struct Recorder {
    b: TraceBuilder,
    bytes: Vec<u64>,
    speed: DeviceSpeed,
}

impl Recorder {
    fn new(speed: DeviceSpeed) -> Recorder {
        Recorder {
            b: TraceBuilder::new(),
            bytes: Vec::new(),
            speed,
        }
    }

    fn tensor(&mut self, name: impl Into<String>, bytes: u64, kind: TensorKind) -> TensorId {
        self.bytes.push(bytes);
        self.b.tensor(name, bytes, kind)
    }

    fn op(
        &mut self,
        name: impl Into<String>,
        phase: Phase,
        reads: &[TensorId],
        writes: &[TensorId],
        flops: f64,
    ) {
        let mut all: Vec<TensorId> = reads.iter().chain(writes).copied().collect();
        all.sort();
        all.dedup();
        let bytes: u64 = all
            .iter()
            .map(|t| self.bytes.get(t.index()).copied().unwrap_or(0))
            .sum();
        let d = self.speed.op_time(flops, bytes);
        self.b.timed_op(name, phase, reads, writes, d);
    }

    fn build(self) -> Result<Trace, TraceError> {
        self.b.build()
    }
}

/// A parameter group updated by one optimizer op.
struct Group {
    name: String,
    params: Vec<TensorId>,
    grads: Vec<TensorId>,
    states: Vec<TensorId>,
    elems: u64,
}

/// Adds a parameter group (tensors of `elems` elements each) with its
/// gradients and optimizer state.
fn add_group(
    r: &mut Recorder,
    groups: &mut Vec<Group>,
    opt: Optimizer,
    eb: u64,
    name: &str,
    parts: &[(&str, u64)],
) -> (Vec<TensorId>, Vec<TensorId>) {
    let mut g = Group {
        name: name.to_string(),
        params: Vec::new(),
        grads: Vec::new(),
        states: Vec::new(),
        elems: 0,
    };
    for &(part, elems) in parts {
        g.params
            .push(r.tensor(format!("{name}.{part}"), elems * eb, TensorKind::Parameter));
        g.grads
            .push(r.tensor(format!("{name}.d{part}"), elems * eb, TensorKind::Gradient));
        for s in 0..opt.states() {
            g.states.push(r.tensor(
                format!("{name}.{part}.state{s}"),
                elems * eb,
                TensorKind::OptimizerState,
            ));
        }
        g.elems += elems;
    }
    let out = (g.params.clone(), g.grads.clone());
    groups.push(g);
    out
}

/// Emits one optimizer op per group, in forward order.
fn optimizer_ops(r: &mut Recorder, groups: &[Group]) {
    for g in groups {
        let reads: Vec<TensorId> = g
            .params
            .iter()
            .chain(&g.grads)
            .chain(&g.states)
            .copied()
            .collect();
        let writes: Vec<TensorId> = g.params.iter().chain(&g.states).copied().collect();
        r.op(
            format!("{}.update", g.name),
            Phase::Optimizer,
            &reads,
            &writes,
            10.0 * g.elems as f64,
        );
    }
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

struct CnnGen<'a> {
    r: Recorder,
    spec: &'a CnnSpec,
    groups: Vec<Group>,
}

impl CnnGen<'_> {
    /// Bytes of a batch of `c`×`h`×`w` elements.
    fn batch_bytes(&self, c: usize, h: usize, w: usize) -> u64 {
        (self.spec.batch * c * h * w) as u64 * self.spec.elem_bytes
    }

    /// Elements of a recorded tensor.
    fn elems(&self, t: TensorId) -> f64 {
        self.r.bytes[t.index()] as f64 / self.spec.elem_bytes as f64
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

    /// Convolution (or, with `kernel` = spatial size and no padding, a
    /// fully connected layer) with fused bias/norm and optional ReLU.
    #[allow(clippy::too_many_arguments)]
    fn conv(
        &mut self,
        name: &str,
        x: Act,
        out: usize,
        kernel: usize,
        stride: usize,
        pad: usize,
        relu: bool,
        need_dx: bool,
    ) -> Result<(Act, Rec), TraceError> {
        let (ho, wo) = out_size(name, x.h, x.w, kernel, stride, pad)?;
        let spec = self.spec;
        let y = self.act(format!("{name}.out"), out, ho, wo);
        let (params, grads) = add_group(
            &mut self.r,
            &mut self.groups,
            spec.optimizer,
            spec.elem_bytes,
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

    fn forward(
        &mut self,
        i: usize,
        layer: CnnLayer,
        x: Act,
        first: bool,
    ) -> Result<(Act, Rec), TraceError> {
        let spec = self.spec;
        match layer {
            CnnLayer::Conv {
                out,
                kernel,
                stride,
                pad,
            } => self.conv(
                &format!("conv{i}"),
                x,
                out,
                kernel,
                stride,
                pad,
                true,
                !first,
            ),
            CnnLayer::Linear { out, relu } => {
                // A fully connected layer is a convolution covering the input.
                let flat = Act {
                    t: x.t,
                    c: x.c * x.h * x.w,
                    h: 1,
                    w: 1,
                };
                self.conv(&format!("fc{i}"), flat, out, 1, 1, 0, relu, !first)
            }
            CnnLayer::MaxPool {
                kernel,
                stride,
                pad,
            } => {
                let name = format!("pool{i}");
                let (ho, wo) = out_size(&name, x.h, x.w, kernel, stride, pad)?;
                let y = self.act(format!("{name}.out"), x.c, ho, wo);
                let elems = (spec.batch * x.c * ho * wo * kernel * kernel) as f64;
                self.r.op(&name, Phase::Forward, &[x.t], &[y.t], elems);
                Ok((y, Rec::Pool { name, x, y: y.t }))
            }
            CnnLayer::GlobalAvgPool => {
                let name = format!("avgpool{i}");
                let y = self.act(format!("{name}.out"), x.c, 1, 1);
                let elems = (spec.batch * x.c * x.h * x.w) as f64;
                self.r.op(&name, Phase::Forward, &[x.t], &[y.t], elems);
                Ok((y, Rec::GlobalPool { name, x }))
            }
            CnnLayer::Dropout => {
                let name = format!("dropout{i}");
                let y = self.act(format!("{name}.out"), x.c, x.h, x.w);
                let mask_bytes = (spec.batch * x.c * x.h * x.w) as u64;
                let mask =
                    self.r
                        .tensor(format!("{name}.mask"), mask_bytes, TensorKind::Activation);
                let elems = (spec.batch * x.c * x.h * x.w) as f64;
                self.r
                    .op(&name, Phase::Forward, &[x.t], &[y.t, mask], elems);
                Ok((y, Rec::Dropout { name, x, mask }))
            }
            CnnLayer::Bottleneck { mid, out, stride } => {
                let name = format!("block{i}");
                let (a, r1) = self.conv(&format!("{name}.conv1"), x, mid, 1, 1, 0, true, true)?;
                let (b, r2) =
                    self.conv(&format!("{name}.conv2"), a, mid, 3, stride, 1, true, true)?;
                let (c, r3) = self.conv(&format!("{name}.conv3"), b, out, 1, 1, 0, false, true)?;
                let (sc, shortcut) = if stride != 1 || x.c != out {
                    let (s, rs) =
                        self.conv(&format!("{name}.proj"), x, out, 1, stride, 0, false, true)?;
                    (s.t, Some(Box::new(rs)))
                } else {
                    (x.t, None)
                };
                let y = self.act(format!("{name}.out"), out, c.h, c.w);
                let elems = (spec.batch * out * c.h * c.w) as f64;
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
        }
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
            r: Recorder::new(self.speed),
            spec: self,
            groups: Vec::new(),
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
        optimizer_ops(&mut g.r, &g.groups);
        g.r.build()
    }
}

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
        let (bsz, h, eb) = (self.batch as u64, self.hidden as u64, self.elem_bytes);
        let mut r = Recorder::new(self.speed);
        let mut groups = Vec::new();
        let (p, g) = add_group(
            &mut r,
            &mut groups,
            self.optimizer,
            eb,
            "lstm",
            &[("w", 4 * h * 2 * h), ("b", 4 * h)],
        );
        let state = bsz * h * eb;
        let mut hs = vec![r.tensor("h.0", state, TensorKind::Activation)];
        let mut cs = vec![r.tensor("c.0", state, TensorKind::Activation)];
        let mut xs = Vec::new();
        let mut gates = Vec::new();
        let step_flops = 2.0 * (bsz * 4 * h * 2 * h) as f64;
        for t in 1..=self.steps {
            let x = r.tensor(format!("x.{t}"), state, TensorKind::Activation);
            let gt = r.tensor(format!("gates.{t}"), 4 * state, TensorKind::Activation);
            let ct = r.tensor(format!("c.{t}"), state, TensorKind::Activation);
            let ht = r.tensor(format!("h.{t}"), state, TensorKind::Activation);
            r.op(
                format!("lstm.{t}"),
                Phase::Forward,
                &[x, hs[t - 1], cs[t - 1], p[0], p[1]],
                &[gt, ct, ht],
                step_flops,
            );
            xs.push(x);
            gates.push(gt);
            cs.push(ct);
            hs.push(ht);
        }
        let classes = 16u64;
        let (hp, hg) = add_group(
            &mut r,
            &mut groups,
            self.optimizer,
            eb,
            "head",
            &[("w", classes * h), ("b", classes)],
        );
        let logits = r.tensor("logits", bsz * classes * eb, TensorKind::Activation);
        let labels = r.tensor("labels", bsz * 8, TensorKind::Activation);
        let loss = r.tensor("loss", bsz * eb, TensorKind::Activation);
        let dlogits = r.tensor("logits.grad", bsz * classes * eb, TensorKind::Gradient);
        let last = self.steps;
        let head_flops = 2.0 * (bsz * classes * h) as f64;
        r.op(
            "head",
            Phase::Forward,
            &[hs[last], hp[0], hp[1]],
            &[logits],
            head_flops,
        );
        r.op(
            "softmax_xent",
            Phase::Forward,
            &[logits, labels],
            &[loss, dlogits],
            0.0,
        );
        let mut dh = r.tensor(format!("h.{last}.grad"), state, TensorKind::Gradient);
        let head_bwd_writes = [dh, hg[0], hg[1]];
        r.op(
            "head.bwd",
            Phase::Backward,
            &[dlogits, hs[last], hp[0]],
            &head_bwd_writes,
            2.0 * head_flops,
        );
        let mut dc: Option<TensorId> = None;
        for t in (1..=self.steps).rev() {
            let dh_prev = r.tensor(format!("h.{}.grad", t - 1), state, TensorKind::Gradient);
            let dc_prev = r.tensor(format!("c.{}.grad", t - 1), state, TensorKind::Gradient);
            let mut reads = vec![
                dh,
                gates[t - 1],
                cs[t - 1],
                cs[t],
                hs[t - 1],
                xs[t - 1],
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
                2.0 * step_flops,
            );
            dh = dh_prev;
            dc = Some(dc_prev);
        }
        optimizer_ops(&mut r, &groups);
        r.build()
    }
}

/// A child-sum Tree-LSTM over a batch of random binary trees, scheduled as
/// Cavs does: one batching task per level (vertices of equal height).
#[derive(Clone, Debug, PartialEq)]
pub struct TreeSpec {
    /// Trees per batch.
    pub trees: usize,
    /// Leaves per tree.
    pub leaves: usize,
    /// Hidden size.
    pub hidden: usize,
    /// Seed of the tree shapes.
    pub seed: u64,
    /// The optimizer.
    pub optimizer: Optimizer,
    /// Bytes per element.
    pub elem_bytes: u64,
    /// Op durations.
    pub speed: DeviceSpeed,
}

/// SplitMix64: a small deterministic generator for tree shapes.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `1..n` (n >= 2).
    fn split(&mut self, n: usize) -> usize {
        1 + (self.next() % (n as u64 - 1)) as usize
    }
}

/// Builds a random binary tree over `leaves` leaves (uniform random
/// splits); records vertices per height and which child heights each
/// height gathers from. Returns the root's height.
fn grow(
    leaves: usize,
    rng: &mut SplitMix,
    count: &mut Vec<u64>,
    children: &mut Vec<Vec<bool>>,
) -> usize {
    // Iterative post-order to stay safe on deep trees.
    enum Frame {
        Enter(usize),
        Exit,
    }
    let mut stack = vec![Frame::Enter(leaves)];
    let mut heights: Vec<usize> = Vec::new();
    while let Some(f) = stack.pop() {
        match f {
            Frame::Enter(1) => {
                if count.is_empty() {
                    count.push(0);
                    children.push(Vec::new());
                }
                count[0] += 1;
                heights.push(0);
            }
            Frame::Enter(n) => {
                let k = rng.split(n);
                stack.push(Frame::Exit);
                stack.push(Frame::Enter(n - k));
                stack.push(Frame::Enter(k));
            }
            Frame::Exit => {
                let r = heights.pop().unwrap_or(0);
                let l = heights.pop().unwrap_or(0);
                let hgt = 1 + l.max(r);
                while count.len() <= hgt {
                    count.push(0);
                    children.push(Vec::new());
                }
                count[hgt] += 1;
                for c in [l, r] {
                    if children[hgt].len() <= c {
                        children[hgt].resize(c + 1, false);
                    }
                    children[hgt][c] = true;
                }
                heights.push(hgt);
            }
        }
    }
    heights.pop().unwrap_or(0)
}

impl TreeSpec {
    /// A batch of large trees with Adam.
    pub fn new(
        trees: usize,
        leaves: usize,
        hidden: usize,
        seed: u64,
        speed: DeviceSpeed,
    ) -> TreeSpec {
        TreeSpec {
            trees,
            leaves,
            hidden,
            seed,
            optimizer: Optimizer::Adam,
            elem_bytes: 4,
            speed,
        }
    }

    /// Generates the iteration: leaf task, one task per level upwards, the
    /// head over the roots, the backward tasks top-down, the optimizer.
    pub fn trace(&self) -> Result<Trace, TraceError> {
        if self.trees == 0 || self.leaves == 0 {
            return Err(TraceError::Spec(format!(
                "a tree batch needs at least one tree and one leaf ({} trees of {} leaves)",
                self.trees, self.leaves
            )));
        }
        let mut rng = SplitMix(self.seed);
        let mut count = Vec::new();
        let mut children: Vec<Vec<bool>> = Vec::new();
        let mut roots = Vec::new();
        for _ in 0..self.trees {
            roots.push(grow(
                self.leaves.max(1),
                &mut rng,
                &mut count,
                &mut children,
            ));
        }
        roots.sort_unstable();
        roots.dedup();
        let levels = count.len();
        let (h, eb) = (self.hidden as u64, self.elem_bytes);
        let mut r = Recorder::new(self.speed);
        let mut groups = Vec::new();
        let (lp, lg) = add_group(
            &mut r,
            &mut groups,
            self.optimizer,
            eb,
            "leaf",
            &[("w", 3 * h * h), ("b", 3 * h)],
        );
        let (ip, ig) = add_group(
            &mut r,
            &mut groups,
            self.optimizer,
            eb,
            "internal",
            &[("u", 5 * h * 2 * h), ("b", 5 * h)],
        );
        let tokens = r.tensor(
            "tokens",
            count.first().copied().unwrap_or(0) * 8,
            TensorKind::Activation,
        );
        let mut hs = Vec::with_capacity(levels);
        let mut cs = Vec::with_capacity(levels);
        let mut gs = Vec::with_capacity(levels);
        for (l, &v) in count.iter().enumerate() {
            let gates = if l == 0 { 3 } else { 5 };
            gs.push(r.tensor(
                format!("level{l}.gates"),
                v * gates * h * eb,
                TensorKind::Activation,
            ));
            cs.push(r.tensor(format!("level{l}.c"), v * h * eb, TensorKind::Activation));
            hs.push(r.tensor(format!("level{l}.h"), v * h * eb, TensorKind::Activation));
        }
        let kids = |l: usize| -> Vec<usize> {
            children
                .get(l)
                .map(|c| {
                    c.iter()
                        .enumerate()
                        .filter(|(_, &on)| on)
                        .map(|(i, _)| i)
                        .collect()
                })
                .unwrap_or_default()
        };
        let task_flops = |l: usize| {
            let v = count[l] as f64;
            if l == 0 {
                2.0 * v * (3 * h * h) as f64
            } else {
                2.0 * v * (5 * h * 2 * h) as f64
            }
        };
        r.op(
            "leaves",
            Phase::Forward,
            &[tokens, lp[0], lp[1]],
            &[gs[0], cs[0], hs[0]],
            task_flops(0),
        );
        for l in 1..levels {
            let mut reads: Vec<TensorId> = Vec::new();
            for k in kids(l) {
                reads.push(hs[k]);
                reads.push(cs[k]);
            }
            reads.extend([ip[0], ip[1]]);
            r.op(
                format!("level{l}"),
                Phase::Forward,
                &reads,
                &[gs[l], cs[l], hs[l]],
                task_flops(l),
            );
        }
        let classes = 5u64;
        let (hp, hg) = add_group(
            &mut r,
            &mut groups,
            self.optimizer,
            eb,
            "head",
            &[("w", classes * h)],
        );
        let nroots = self.trees as u64;
        let logits = r.tensor("logits", nroots * classes * eb, TensorKind::Activation);
        let labels = r.tensor("labels", nroots * 8, TensorKind::Activation);
        let loss = r.tensor("loss", nroots * eb, TensorKind::Activation);
        let dlogits = r.tensor("logits.grad", nroots * classes * eb, TensorKind::Gradient);
        let mut reads: Vec<TensorId> = roots.iter().map(|&l| hs[l]).collect();
        reads.push(hp[0]);
        let head_flops = 2.0 * (nroots * classes * h) as f64;
        r.op("head", Phase::Forward, &reads, &[logits], head_flops);
        r.op(
            "softmax_xent",
            Phase::Forward,
            &[logits, labels],
            &[loss, dlogits],
            0.0,
        );
        let mut level_grads = |what: &str| -> Vec<TensorId> {
            (0..levels)
                .map(|l| {
                    r.tensor(
                        format!("level{l}.{what}.grad"),
                        count[l] * h * eb,
                        TensorKind::Gradient,
                    )
                })
                .collect()
        };
        let dh = level_grads("h");
        let dc = level_grads("c");
        let mut reads = vec![dlogits, hp[0]];
        reads.extend(roots.iter().map(|&l| hs[l]));
        let mut writes: Vec<TensorId> = roots.iter().map(|&l| dh[l]).collect();
        writes.push(hg[0]);
        r.op(
            "head.bwd",
            Phase::Backward,
            &reads,
            &writes,
            2.0 * head_flops,
        );
        for l in (1..levels).rev() {
            let mut reads = vec![dh[l], gs[l], cs[l], ip[0], ig[0], ig[1]];
            if l + 1 < levels {
                reads.push(dc[l]);
            }
            let mut writes = vec![ig[0], ig[1]];
            for k in kids(l) {
                reads.extend([hs[k], cs[k], dh[k], dc[k]]);
                writes.extend([dh[k], dc[k]]);
            }
            r.op(
                format!("level{l}.bwd"),
                Phase::Backward,
                &reads,
                &writes,
                2.0 * task_flops(l),
            );
        }
        r.op(
            "leaves.bwd",
            Phase::Backward,
            &[dh[0], dc[0], gs[0], cs[0], tokens, lg[0], lg[1]],
            &[lg[0], lg[1]],
            2.0 * task_flops(0),
        );
        optimizer_ops(&mut r, &groups);
        r.build()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::analyze;
    use crate::cost::CostModel;

    #[test]
    fn vgg19_shapes_and_sizes() {
        let t = vgg19(64, 224, DeviceSpeed::rtx_2080_ti()).trace().unwrap();
        let find = |name: &str| t.tensors().iter().find(|x| x.name == name).unwrap();
        // conv1_1 output: 64 × 64 × 224 × 224 × 4 bytes.
        assert_eq!(find("conv1.out").bytes, 64 * 64 * 224 * 224 * 4);
        // fc6 weight: 4096 × 25088.
        let fc = t
            .tensors()
            .iter()
            .find(|x| x.name.ends_with(".w") && x.bytes == 4096 * 25088 * 4);
        assert!(fc.is_some());
        // VGG-19 has ≈ 143.7 M parameters.
        let params: u64 = t
            .tensors()
            .iter()
            .filter(|x| x.kind == TensorKind::Parameter)
            .map(|x| x.bytes / 4)
            .sum();
        assert!((143_000_000..144_500_000).contains(&params), "{params}");
        let an = analyze(&t, &CostModel::default());
        // Forward + two backward GEMMs ≈ 3 × 39 GFLOP × 64 images ≈ 7.5
        // TFLOP: ≈ 0.7 s at 11 TFLOP/s.
        let compute = an.op_start_s[t.num_ops()];
        assert!(compute > 0.5 && compute < 1.0, "{compute}");
    }

    #[test]
    fn resnet50_and_sequence_and_tree_build() {
        let r = resnet([3, 4, 6, 3], 32, 224, DeviceSpeed::h100())
            .trace()
            .unwrap();
        let params: u64 = r
            .tensors()
            .iter()
            .filter(|x| x.kind == TensorKind::Parameter)
            .map(|x| x.bytes / 4)
            .sum();
        // ResNet-50 ≈ 25.5 M parameters (batch-norm folded into biases).
        assert!((23_000_000..26_500_000).contains(&params), "{params}");
        let s = LstmSpec::new(64, 32, 256, DeviceSpeed::h100())
            .trace()
            .unwrap();
        assert_eq!(
            s.ops().iter().filter(|o| o.name.ends_with(".bwd")).count(),
            65
        );
        let t = TreeSpec::new(8, 200, 64, 7, DeviceSpeed::h100())
            .trace()
            .unwrap();
        assert!(t.num_ops() > 10);
        assert!(alexnet(128, DeviceSpeed::h100()).trace().is_ok());
    }

    #[test]
    fn impossible_models_are_errors() {
        let t = TreeSpec::new(0, 10, 8, 1, DeviceSpeed::h100()).trace();
        assert!(matches!(t, Err(TraceError::Spec(_))));
        // VGG's five 2×2 poolings do not fit a 16×16 image.
        let e = vgg19(1, 16, DeviceSpeed::h100()).trace().unwrap_err();
        assert!(e.to_string().contains("pool"), "{e}");
    }
}
