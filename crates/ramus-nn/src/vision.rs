//! The CNN model zoo: AlexNet-, VGG- and ResNet-style networks for small
//! images, declared through the same Cavs API as the dynamic models.
//!
//! A batch of images is a batch of single-vertex graphs (see
//! `ramus_graph::images`): the model's one vertex function pulls an image
//! row of `C*H*W` floats (CHW order), runs the whole network as eager ops
//! over every image of the batch at once (so batch normalisation sees the
//! whole batch), and pushes a feature vector; the head is a linear
//! classifier with softmax cross-entropy on every (labelled) vertex.
//!
//! # Networks
//!
//! `hidden` ([`ModelConfig::hidden`]) is the width knob: the channel count
//! of the first stage, which is 64 in the papers (so `hidden = 64` gives the
//! published widths; the CLI's default for images is 16, a quarter-width
//! network that trains in seconds on a CPU).
//!
//! * `alexnet` — five convolutions with bias and ReLU of `h, 3h, 6h, 4h, 4h`
//!   channels (AlexNet's 64-192-384-256-256 at `h = 64`), 5×5 then 3×3
//!   kernels at stride 1 (small images have no room for the 11×11 stride-4
//!   stem), overlapping 3×3 stride-2 max pools after conv 1, 2 and 5, then
//!   flatten → dropout → linear `16h` → ReLU → dropout → linear `16h` → ReLU.
//! * `vgg11`, `vgg13`, `vgg16`, `vgg19` (and `vgg`, whose depth is
//!   [`VisionConfig::vgg_depth`]) — torchvision's block configurations
//!   (A, B, D, E) with every width scaled by `h / 64` (64-128-256-512 become
//!   `h, 2h, 4h, 8h`): 3×3 convolutions with batch normalisation and ReLU,
//!   a 2×2 max pool after each block (skipped once the map is a single row
//!   or column, so small images work), then flatten → dropout → linear
//!   `8h` → ReLU → dropout → linear `8h` → ReLU.
//! * `resnet` — a ResNet with **bottleneck** blocks
//!   ([`VisionConfig::resnet_blocks`] blocks per stage, default `[1, 1, 1]`;
//!   `[n, n, n]` is the CIFAR ResNet of depth `9n + 2`, `[3, 4, 6, 3]` the
//!   layout of ResNet-50). A 3×3 stem convolution of `h` channels with batch
//!   norm and ReLU (images of 96 pixels or more get ImageNet's 7×7 stride-2
//!   stem and a 3×3 stride-2 max pool instead); stage `s` has bottleneck
//!   width `h * 2^s` and output `4 * h * 2^s` channels. A block is
//!   1×1 → BN → ReLU → 3×3 (stride 2 in the first block of every stage but
//!   the first, as in ResNet v1.5) → BN → ReLU → 1×1 → BN, plus the shortcut
//!   (identity, or a strided 1×1 projection with BN where the shape
//!   changes), then ReLU. Global average pooling gives the features.
//!
//! Convolutions and hidden linear layers (all followed by ReLU) start from
//! He/Kaiming normal weights ([`Init::Kaiming`]), biases at zero, batch-norm
//! scales at one and shifts at zero; the classifier uses PyTorch's
//! `nn.Linear` default. Dropout (rate [`ModelOptions::dropout`]) sits before
//! the hidden linear layers of AlexNet and VGG, as in the papers.
//!
//! # Batch statistics
//!
//! Every batch normalisation keeps running statistics, as PyTorch does:
//! buffers `name.running_mean` (zeros) and `name.running_var` (ones),
//! `[C]` each, declared after every trained parameter
//! ([`ramus_core::ParamKind::Buffer`]: no gradient, no optimizer step, no
//! weight decay). Training passes normalise with the batch's statistics
//! (biased variance) and blend them into the buffers with momentum 0.1
//! (unbiased variance); evaluation and inference normalise with the
//! buffers, so a model's predictions do not depend on the rest of the
//! batch. Checkpoints carry the buffers (see [`crate::checkpoint`]).

use std::collections::BTreeMap;

use ramus_core::model::{HeadRows, Init, ModelBuilder, VertexFnBuilder};
use ramus_core::ops::{Conv2dGeom, NormGeom, Pool2dGeom};
use ramus_core::{CoreError, Model, Result, Sym};

use crate::blocks::{classifier_head, linear_bias, record_settings, ModelConfig, ModelOptions};

/// Names of the CNN models.
pub const VISION_MODELS: [&str; 7] = [
    "alexnet", "vgg", "vgg11", "vgg13", "vgg16", "vgg19", "resnet",
];

/// VGG depths with a block configuration.
pub const VGG_DEPTHS: [usize; 4] = [11, 13, 16, 19];

/// Batch-normalisation epsilon of every model.
pub const BN_EPS: f64 = 1e-5;

/// Shape of the input images.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ImageShape {
    pub channels: usize,
    pub height: usize,
    pub width: usize,
}

impl Default for ImageShape {
    /// 3×32×32.
    fn default() -> Self {
        ImageShape {
            channels: 3,
            height: 32,
            width: 32,
        }
    }
}

impl ImageShape {
    /// Floats per image, `C*H*W`.
    pub fn len(&self) -> usize {
        self.channels * self.height * self.width
    }
    /// True when some dimension is 0.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl std::fmt::Display for ImageShape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}x{}x{}", self.channels, self.height, self.width)
    }
}

impl std::str::FromStr for ImageShape {
    type Err = String;
    /// `CxHxW`, e.g. `3x32x32`.
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let parts: Vec<&str> = s.split('x').collect();
        let dims: Option<Vec<usize>> = parts.iter().map(|p| p.trim().parse().ok()).collect();
        match dims.as_deref() {
            Some(&[channels, height, width]) if channels * height * width > 0 => Ok(ImageShape {
                channels,
                height,
                width,
            }),
            _ => Err(format!(
                "image shape `{s}` is not CxHxW with positive sizes (e.g. 3x32x32)"
            )),
        }
    }
}

/// Architecture settings of the CNN models beyond [`ModelConfig`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VisionConfig {
    pub image: ImageShape,
    /// Depth of `vgg`: 11, 13, 16 or 19 (`vgg11` ... `vgg19` fix their own).
    pub vgg_depth: usize,
    /// Bottleneck blocks in each stage of `resnet` (one entry per stage).
    pub resnet_blocks: Vec<usize>,
}

impl Default for VisionConfig {
    /// 3×32×32 images, VGG-11, ResNet with one block in each of three stages.
    fn default() -> Self {
        VisionConfig {
            image: ImageShape::default(),
            vgg_depth: 11,
            resnet_blocks: vec![1, 1, 1],
        }
    }
}

impl VisionConfig {
    /// Blocks per stage of the three-stage CIFAR ResNet of `depth = 9n + 2`
    /// layers (11, 20, 29, 56, 164, ...).
    pub fn resnet_depth(depth: usize) -> std::result::Result<Vec<usize>, String> {
        if depth < 11 || (depth - 2) / 9 * 9 + 2 != depth {
            return Err(format!(
                "a bottleneck ResNet's depth is 9n + 2 (11, 20, 29, 56, ...), got {depth}"
            ));
        }
        Ok(vec![(depth - 2) / 9; 3])
    }

    /// Reads the settings [`build_vision_model`] records (`image`, `depth`,
    /// `blocks`); missing ones keep their defaults.
    pub fn from_settings(settings: &BTreeMap<String, String>) -> std::result::Result<Self, String> {
        let mut c = VisionConfig::default();
        if let Some(s) = settings.get("image") {
            c.image = s.parse()?;
        }
        if let Some(s) = settings.get("depth") {
            c.vgg_depth = s
                .parse()
                .map_err(|_| format!("setting `depth` = `{s}` is not a number"))?;
        }
        if let Some(s) = settings.get("blocks") {
            c.resnet_blocks = parse_blocks(s)?;
        }
        Ok(c)
    }
}

/// Parses a comma-separated list of blocks per stage, e.g. `3,4,6,3`.
pub fn parse_blocks(s: &str) -> std::result::Result<Vec<usize>, String> {
    let blocks: Option<Vec<usize>> = s
        .split(',')
        .map(|p| p.trim().parse().ok().filter(|&n| n > 0))
        .collect();
    match blocks {
        Some(b) if !b.is_empty() => Ok(b),
        _ => Err(format!(
            "blocks per stage `{s}` is not a comma-separated list of positive numbers (e.g. 3,4,6,3)"
        )),
    }
}

/// True for the names of [`VISION_MODELS`].
pub fn is_vision_model(name: &str) -> bool {
    VISION_MODELS.contains(&name)
}

fn model_error(model: &str, message: impl Into<String>) -> CoreError {
    CoreError::Model {
        model: model.to_string(),
        message: message.into(),
    }
}

/// Builds CNN model `name` (one of [`VISION_MODELS`]) for `vision.image`
/// images and `cfg.classes` classes; `cfg.hidden` is the width knob (see the
/// module docs) and `cfg.vocab` is ignored. The architecture is recorded in
/// the model's settings (`image`, `depth` or `blocks`) for checkpoints.
pub fn build_vision_model(
    name: &str,
    cfg: &ModelConfig,
    vision: &VisionConfig,
    opts: &ModelOptions,
) -> Result<Model> {
    let err = |m: String| model_error(name, m);
    if cfg.hidden == 0 {
        return Err(err("hidden (the width knob) must be at least 1".into()));
    }
    if cfg.classes < 2 {
        return Err(err(format!(
            "needs at least 2 classes, got {}",
            cfg.classes
        )));
    }
    if vision.image.is_empty() {
        return Err(err(format!("image shape {} is empty", vision.image)));
    }
    if !(0.0..1.0).contains(&opts.dropout) {
        return Err(err(format!(
            "dropout rate {} is not in [0, 1)",
            opts.dropout
        )));
    }
    let mut m = ModelBuilder::new(name, 1);
    let mut settings = vec![("image", vision.image.to_string())];
    let features = match name {
        "alexnet" => alexnet(&mut m, cfg.hidden, vision.image, opts.dropout),
        "vgg" | "vgg11" | "vgg13" | "vgg16" | "vgg19" => {
            let depth = name
                .strip_prefix("vgg")
                .and_then(|d| d.parse().ok())
                .unwrap_or(vision.vgg_depth);
            settings.push(("depth", depth.to_string()));
            vgg(&mut m, depth, cfg.hidden, vision.image, opts.dropout)
        }
        "resnet" => {
            let b = &vision.resnet_blocks;
            settings.push((
                "blocks",
                b.iter()
                    .map(|n| n.to_string())
                    .collect::<Vec<_>>()
                    .join(","),
            ));
            resnet(&mut m, b, cfg.hidden, vision.image)
        }
        _ => {
            return Err(CoreError::Unknown {
                kind: "CNN model",
                name: name.to_string(),
                hint: format!(" (known: {})", VISION_MODELS.join(", ")),
            })
        }
    }
    .map_err(err)?;
    let (layers, out, norms) = features;
    let classes = cfg.classes;
    let w_out = m.param("W_out", &[classes, out], Init::LinearDefault);
    let b_out = m.param("b_out", &[classes], linear_bias(out));
    // running statistics last: the trained parameters stay contiguous
    let running: Vec<(usize, usize)> = norms
        .iter()
        .map(|(name, channels)| {
            (
                m.buffer(&format!("{name}.running_mean"), &[*channels], Init::Zeros),
                m.buffer(
                    &format!("{name}.running_var"),
                    &[*channels],
                    Init::Constant { value: 1.0 },
                ),
            )
        })
        .collect();
    let input = vision.image.len();
    m.vertex_fn("image", |f| {
        let x = f.pull(input);
        let y = apply(f, &layers, &running, x);
        f.push(y);
    })?;
    m.head(HeadRows::Labelled, out, |h| {
        classifier_head(h, w_out, b_out, 0.0)
    })?;
    for (k, v) in settings {
        m.setting(k, v);
    }
    let mut model = m.build()?;
    record_settings(&mut model, name, cfg);
    Ok(model)
}

// ---------------------------------------------------------------- layers

/// The value flowing through a network: an image or a flat vector.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Shape {
    Image { c: usize, h: usize, w: usize },
    Flat(usize),
}

impl Shape {
    fn len(&self) -> usize {
        match *self {
            Shape::Image { c, h, w } => c * h * w,
            Shape::Flat(n) => n,
        }
    }
}

/// One layer of a declared network, with its parameter ids.
#[derive(Clone, Debug)]
enum Layer {
    Conv {
        geom: Conv2dGeom,
        w: usize,
        bias: Option<usize>,
    },
    /// Batch normalisation; `stats` indexes the network's running
    /// statistics (declared after the trained parameters).
    Norm {
        geom: NormGeom,
        gamma: usize,
        beta: usize,
        stats: usize,
    },
    Relu,
    MaxPool(Pool2dGeom),
    GlobalAvgPool {
        c: usize,
        h: usize,
        w: usize,
    },
    Dropout(f64),
    Linear {
        w: usize,
        b: usize,
    },
    /// `body(x) + shortcut(x)`; an empty shortcut is the identity.
    Residual {
        body: Vec<Layer>,
        shortcut: Vec<Layer>,
    },
}

/// Emits `layers` on `x` in the vertex function; `running[i]` is the
/// (mean, var) buffer pair of the norm layer with `stats = i`.
fn apply(f: &mut VertexFnBuilder, layers: &[Layer], running: &[(usize, usize)], mut x: Sym) -> Sym {
    for layer in layers {
        x = match layer {
            Layer::Conv { geom, w, bias } => {
                let w = f.param(*w);
                let b = bias.map(|b| f.param(b));
                f.conv2d(x, w, b, *geom)
            }
            Layer::Norm {
                geom,
                gamma,
                beta,
                stats,
            } => {
                let (g, b) = (f.param(*gamma), f.param(*beta));
                match running.get(*stats) {
                    Some(&(mean, var)) => {
                        let stats = (f.param(mean), f.param(var));
                        f.batch_norm_tracked(x, g, b, stats, *geom)
                    }
                    None => f.fail(
                        "batch_norm",
                        format!("norm layer {stats} has no running statistics"),
                    ),
                }
            }
            Layer::Relu => f.relu(x),
            Layer::MaxPool(geom) => f.max_pool2d(x, *geom),
            Layer::GlobalAvgPool { c, h, w } => f.global_avg_pool(x, *c, *h, *w),
            Layer::Dropout(p) => f.dropout(x, *p),
            Layer::Linear { w, b } => {
                let (w, b) = (f.param(*w), f.param(*b));
                f.linear(x, w, Some(b))
            }
            Layer::Residual { body, shortcut } => {
                let y = apply(f, body, running, x);
                let s = apply(f, shortcut, running, x);
                f.add(y, s)
            }
        };
    }
    x
}

/// Declares a network layer by layer: tracks the value's shape, declares
/// each layer's parameters on the model and checks every geometry.
struct Net<'m> {
    m: &'m mut ModelBuilder,
    shape: Shape,
    layers: Vec<Layer>,
    /// Name and channels of every norm layer so far (shared by the
    /// branches of residual blocks): their running statistics, in order.
    norms: Vec<(String, usize)>,
}

type NetResult<T = ()> = std::result::Result<T, String>;

/// A declared network: layers, feature width, norm layers (name, channels).
type Network = (Vec<Layer>, usize, Vec<(String, usize)>);

impl<'m> Net<'m> {
    fn new(m: &'m mut ModelBuilder, image: ImageShape) -> Self {
        Net {
            m,
            shape: Shape::Image {
                c: image.channels,
                h: image.height,
                w: image.width,
            },
            layers: Vec::new(),
            norms: Vec::new(),
        }
    }

    fn image(&self, what: &str) -> NetResult<(usize, usize, usize)> {
        match self.shape {
            Shape::Image { c, h, w } => Ok((c, h, w)),
            Shape::Flat(n) => Err(format!("{what} needs an image, got a vector of {n}")),
        }
    }

    /// `k`×`k` convolution to `out` channels (Kaiming weights `[O, C, k, k]`,
    /// optional zero bias), named `name.W` / `name.b`.
    fn conv(
        &mut self,
        name: &str,
        out: usize,
        k: usize,
        stride: usize,
        padding: usize,
        bias: bool,
    ) -> NetResult {
        let (c, h, w) = self.image(name)?;
        let geom = Conv2dGeom {
            in_channels: c,
            height: h,
            width: w,
            out_channels: out,
            kernel_h: k,
            kernel_w: k,
            stride,
            padding,
        };
        geom.validate()
            .map_err(|e| format!("{name} on a {c}x{h}x{w} map: {e}"))?;
        let wid = self
            .m
            .param(&format!("{name}.W"), &[out, c, k, k], Init::Kaiming);
        let bias = bias.then(|| self.m.param(&format!("{name}.b"), &[out], Init::Zeros));
        self.layers.push(Layer::Conv { geom, w: wid, bias });
        self.shape = Shape::Image {
            c: out,
            h: geom.out_h(),
            w: geom.out_w(),
        };
        Ok(())
    }

    /// Batch normalisation, parameters `name.gamma` (ones) and `name.beta`
    /// (zeros); its running statistics are declared by the caller of
    /// [`Net::finish`], after every trained parameter.
    fn norm(&mut self, name: &str) -> NetResult {
        let (c, h, w) = self.image(name)?;
        let gamma = self.m.param(
            &format!("{name}.gamma"),
            &[c],
            Init::Constant { value: 1.0 },
        );
        let beta = self.m.param(&format!("{name}.beta"), &[c], Init::Zeros);
        self.layers.push(Layer::Norm {
            geom: NormGeom {
                channels: c,
                spatial: h * w,
                eps: BN_EPS,
            },
            gamma,
            beta,
            stats: self.norms.len(),
        });
        self.norms.push((name.to_string(), c));
        Ok(())
    }

    fn relu(&mut self) {
        self.layers.push(Layer::Relu);
    }

    fn max_pool(&mut self, kernel: usize, stride: usize, padding: usize) -> NetResult {
        let (c, h, w) = self.image("max pool")?;
        let geom = Pool2dGeom {
            channels: c,
            height: h,
            width: w,
            kernel,
            stride,
            padding,
        };
        geom.validate()
            .map_err(|e| format!("max pool on a {c}x{h}x{w} map: {e}"))?;
        self.layers.push(Layer::MaxPool(geom));
        self.shape = Shape::Image {
            c,
            h: geom.out_h(),
            w: geom.out_w(),
        };
        Ok(())
    }

    fn global_avg_pool(&mut self) -> NetResult {
        let (c, h, w) = self.image("global average pool")?;
        self.layers.push(Layer::GlobalAvgPool { c, h, w });
        self.shape = Shape::Flat(c);
        Ok(())
    }

    /// Images are rows in CHW order already: flattening changes nothing.
    fn flatten(&mut self) {
        self.shape = Shape::Flat(self.shape.len());
    }

    fn dropout(&mut self, p: f64) {
        if p > 0.0 {
            self.layers.push(Layer::Dropout(p));
        }
    }

    /// Linear layer to `out` (Kaiming weights: a ReLU follows), zero bias.
    fn linear(&mut self, name: &str, out: usize) {
        let n = self.shape.len();
        let w = self.m.param(&format!("{name}.W"), &[out, n], Init::Kaiming);
        let b = self.m.param(&format!("{name}.b"), &[out], Init::Zeros);
        self.layers.push(Layer::Linear { w, b });
        self.shape = Shape::Flat(out);
    }

    /// `body(x) + shortcut(x)`: both branches start from the current shape
    /// and must end on the same one.
    fn residual(
        &mut self,
        body: impl FnOnce(&mut Net) -> NetResult,
        shortcut: impl FnOnce(&mut Net) -> NetResult,
    ) -> NetResult {
        let start = self.shape;
        let mut b = Net {
            m: &mut *self.m,
            shape: start,
            layers: Vec::new(),
            norms: std::mem::take(&mut self.norms),
        };
        body(&mut b)?;
        let (body_layers, body_shape, norms) = (b.layers, b.shape, b.norms);
        let mut s = Net {
            m: &mut *self.m,
            shape: start,
            layers: Vec::new(),
            norms,
        };
        shortcut(&mut s)?;
        self.norms = s.norms;
        if s.shape != body_shape {
            return Err(format!(
                "residual branches end on different shapes: {body_shape:?} vs {:?}",
                s.shape
            ));
        }
        let shortcut_layers = s.layers;
        self.layers.push(Layer::Residual {
            body: body_layers,
            shortcut: shortcut_layers,
        });
        self.shape = body_shape;
        Ok(())
    }

    /// The layers, the width of the pushed features and the norm layers
    /// whose running statistics the caller declares.
    fn finish(self) -> Network {
        let n = self.shape.len();
        (self.layers, n, self.norms)
    }
}

// ---------------------------------------------------------------- networks

/// AlexNet for small images (see the module docs).
fn alexnet(m: &mut ModelBuilder, h: usize, image: ImageShape, dropout: f64) -> NetResult<Network> {
    let mut n = Net::new(m, image);
    let convs = [
        (h, 5, true),
        (3 * h, 5, true),
        (6 * h, 3, false),
        (4 * h, 3, false),
        (4 * h, 3, true),
    ];
    for (i, &(out, k, pool)) in convs.iter().enumerate() {
        n.conv(&format!("conv{}", i + 1), out, k, 1, k / 2, true)?;
        n.relu();
        if pool {
            n.max_pool(3, 2, 1)?;
        }
    }
    n.flatten();
    for i in 1..=2 {
        n.dropout(dropout);
        n.linear(&format!("fc{i}"), 16 * h);
        n.relu();
    }
    Ok(n.finish())
}

/// torchvision's VGG block configurations: channels as multiples of the
/// first stage's width (1, 2, 4, 8 = 64, 128, 256, 512), 0 = max pool.
fn vgg_config(depth: usize) -> Option<&'static [usize]> {
    Some(match depth {
        11 => &[1, 0, 2, 0, 4, 4, 0, 8, 8, 0, 8, 8, 0],
        13 => &[1, 1, 0, 2, 2, 0, 4, 4, 0, 8, 8, 0, 8, 8, 0],
        16 => &[1, 1, 0, 2, 2, 0, 4, 4, 4, 0, 8, 8, 8, 0, 8, 8, 8, 0],
        19 => &[
            1, 1, 0, 2, 2, 0, 4, 4, 4, 4, 0, 8, 8, 8, 8, 0, 8, 8, 8, 8, 0,
        ],
        _ => return None,
    })
}

/// VGG with batch normalisation (see the module docs).
fn vgg(
    m: &mut ModelBuilder,
    depth: usize,
    h: usize,
    image: ImageShape,
    dropout: f64,
) -> NetResult<Network> {
    let config = vgg_config(depth).ok_or_else(|| {
        format!(
            "VGG depth must be one of {}, got {depth}",
            VGG_DEPTHS.map(|d| d.to_string()).join(", ")
        )
    })?;
    let mut n = Net::new(m, image);
    let mut conv = 0;
    for &mult in config {
        if mult == 0 {
            let (_, ht, wd) = n.image("max pool")?;
            if ht >= 2 && wd >= 2 {
                n.max_pool(2, 2, 0)?;
            }
            continue;
        }
        conv += 1;
        n.conv(&format!("conv{conv}"), mult * h, 3, 1, 1, false)?;
        n.norm(&format!("bn{conv}"))?;
        n.relu();
    }
    n.flatten();
    for i in 1..=2 {
        n.dropout(dropout);
        n.linear(&format!("fc{i}"), 8 * h);
        n.relu();
    }
    Ok(n.finish())
}

/// Bottleneck ResNet (see the module docs).
fn resnet(
    m: &mut ModelBuilder,
    blocks: &[usize],
    h: usize,
    image: ImageShape,
) -> NetResult<Network> {
    if blocks.is_empty() || blocks.contains(&0) {
        return Err(format!(
            "ResNet blocks per stage must be positive, got {blocks:?}"
        ));
    }
    let mut n = Net::new(m, image);
    if image.height.min(image.width) >= 96 {
        n.conv("stem", h, 7, 2, 3, false)?;
        n.norm("stem.bn")?;
        n.relu();
        n.max_pool(3, 2, 1)?;
    } else {
        n.conv("stem", h, 3, 1, 1, false)?;
        n.norm("stem.bn")?;
        n.relu();
    }
    for (s, &count) in blocks.iter().enumerate() {
        let mid = h << s;
        let out = 4 * mid;
        for b in 0..count {
            let (c, ht, wd) = n.image("bottleneck block")?;
            let stride = if b == 0 && s > 0 && ht >= 2 && wd >= 2 {
                2
            } else {
                1
            };
            let p = format!("s{}.b{}", s + 1, b + 1);
            n.residual(
                |x| {
                    x.conv(&format!("{p}.conv1"), mid, 1, 1, 0, false)?;
                    x.norm(&format!("{p}.bn1"))?;
                    x.relu();
                    x.conv(&format!("{p}.conv2"), mid, 3, stride, 1, false)?;
                    x.norm(&format!("{p}.bn2"))?;
                    x.relu();
                    x.conv(&format!("{p}.conv3"), out, 1, 1, 0, false)?;
                    x.norm(&format!("{p}.bn3"))
                },
                |x| {
                    if stride == 1 && c == out {
                        return Ok(());
                    }
                    x.conv(&format!("{p}.proj"), out, 1, stride, 0, false)?;
                    x.norm(&format!("{p}.proj.bn"))
                },
            )?;
            n.relu();
        }
    }
    n.global_avg_pool()?;
    Ok(n.finish())
}
