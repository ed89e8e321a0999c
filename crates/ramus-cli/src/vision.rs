//! The CLI side of the CNN models (`alexnet`, `vgg`, `vgg11` ... `vgg19`,
//! `resnet`): their options (image shape, synthetic data size, depth,
//! blocks per stage), building a model from them or from a checkpoint's
//! settings, and how accuracy is reported for images.

use ramus_nn::vision::{parse_blocks, VGG_DEPTHS};
use ramus_nn::{DataKind, EvalResult, ImageShape, VisionConfig};

/// Width knob (`--hidden`) of the CNN models when none is given: a
/// quarter of the papers' 64, which trains in seconds per epoch on a CPU.
pub const DEFAULT_CNN_WIDTH: usize = 16;
/// `--hidden` of the other models when none is given.
pub const DEFAULT_HIDDEN: usize = 64;

/// Options of the CNN models (ignored by, and refused for, the others).
#[derive(clap::Args, Clone, Debug, Default)]
pub struct VisionArgs {
    /// Image shape CxHxW the CNN is built for (synthetic images are drawn
    /// at this size) [default: 3x32x32].
    #[arg(long)]
    pub image: Option<ImageShape>,
    /// Number of synthetic training images; dev and test get a quarter
    /// each [default: 2000].
    #[arg(long)]
    pub images: Option<usize>,
    /// Depth: 11, 13, 16 or 19 for `vgg`; 9n+2 (11, 20, 29, 56, ...) for
    /// `resnet`, i.e. three stages of n bottleneck blocks.
    #[arg(long)]
    pub depth: Option<usize>,
    /// ResNet bottleneck blocks per stage, e.g. 3,4,6,3 [default: 1,1,1].
    #[arg(long)]
    pub blocks: Option<String>,
}

/// Synthetic training images when `--images` is not given.
pub const DEFAULT_TRAIN_IMAGES: usize = 2000;

impl VisionArgs {
    /// The architecture for `model`, or `None` for a model that reads no
    /// images (then none of these options may be given).
    pub fn config(&self, model: &str, kind: DataKind) -> Result<Option<VisionConfig>, String> {
        if kind != DataKind::Images {
            let given = [
                ("--image", self.image.is_some()),
                ("--images", self.images.is_some()),
                ("--depth", self.depth.is_some()),
                ("--blocks", self.blocks.is_some()),
            ];
            if let Some((flag, _)) = given.iter().find(|(_, g)| *g) {
                return Err(format!(
                    "{flag} applies to the CNN models (alexnet, vgg, resnet), not `{model}`"
                ));
            }
            return Ok(None);
        }
        let mut c = VisionConfig::default();
        if let Some(image) = self.image {
            c.image = image;
        }
        match (model, self.depth, &self.blocks) {
            (_, Some(_), Some(_)) => return Err("give --depth or --blocks, not both".into()),
            ("resnet", Some(d), None) => c.resnet_blocks = VisionConfig::resnet_depth(d)?,
            ("resnet", None, Some(b)) => c.resnet_blocks = parse_blocks(b)?,
            ("vgg", Some(d), None) => c.vgg_depth = d,
            (_, Some(_), None) => {
                return Err(format!(
                    "--depth applies to `vgg` ({}) and `resnet`, not `{model}`",
                    VGG_DEPTHS.map(|d| d.to_string()).join(", ")
                ))
            }
            (_, None, Some(_)) if model != "resnet" => {
                return Err(format!("--blocks applies to `resnet`, not `{model}`"))
            }
            _ => {}
        }
        Ok(Some(c))
    }
}

/// The optimizer and learning rate: the given ones, else Adam at 0.001 for
/// the CNNs and Adagrad at 0.05 for the other models.
pub fn optimizer_defaults(
    kind: DataKind,
    optimizer: Option<&str>,
    lr: Option<f64>,
) -> (String, f64) {
    let (o, l) = match kind {
        DataKind::Images => ("adam", 0.001),
        _ => ("adagrad", 0.05),
    };
    (optimizer.unwrap_or(o).to_string(), lr.unwrap_or(l))
}

/// Accuracy as the training log prints it: root and all-node accuracy for
/// graphs, one accuracy for images (each image is one vertex), per-token
/// tag accuracy for the taggers.
pub fn accuracy(kind: DataKind, r: &EvalResult) -> String {
    match kind {
        DataKind::Images => format!("acc {:.2}%", 100.0 * r.root_accuracy),
        DataKind::Tagged { .. } => format!("tag acc {:.2}%", 100.0 * r.node_accuracy),
        _ => format!(
            "root acc {:.2}% all-node acc {:.2}%",
            100.0 * r.root_accuracy,
            100.0 * r.node_accuracy
        ),
    }
}

/// What one sample is called in throughput and counts.
pub fn unit(kind: DataKind) -> (&'static str, &'static str) {
    match kind {
        DataKind::Images => ("img", "images"),
        _ => ("sent", "graphs"),
    }
}
