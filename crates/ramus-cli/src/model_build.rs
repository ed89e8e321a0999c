//! Models by name ([`build`], with the head rows of `--loss-at`) and from
//! checkpoints ([`load_checkpoint`], as `eval` and `infer` read them).

use crate::result::AnyResult;
use ramus_core::{HeadRows, Model, Params};
use ramus_nn::checkpoint;
use ramus_nn::{
    build_model_with, build_sequence_model, build_vision_model, data_kind, DataKind, ModelConfig,
    ModelOptions, SequenceConfig, VisionConfig,
};

use crate::output::noteln;
use crate::sequence;

/// What `eval` and `infer` accept in a checkpoint beyond a clean one.
#[derive(clap::Args, Clone, Copy, Debug, Default)]
pub(crate) struct CheckpointFlags {
    /// Load a checkpoint even if a tensor holds NaN or infinite values.
    #[arg(long)]
    allow_nonfinite_checkpoint: bool,
    /// Load a checkpoint even if it has tensors the model does not use
    /// (they are ignored).
    #[arg(long)]
    allow_unused_tensors: bool,
}

impl CheckpointFlags {
    pub(crate) fn options(self) -> checkpoint::LoadOptions {
        checkpoint::LoadOptions {
            allow_nonfinite: self.allow_nonfinite_checkpoint,
            allow_unused: self.allow_unused_tensors,
        }
    }
}

/// Builds `name`: a CNN for `vision`, a sequence model for `seq`, else a
/// zoo model.
pub(crate) fn build(
    name: &str,
    cfg: &ModelConfig,
    vision: Option<&VisionConfig>,
    seq: Option<&SequenceConfig>,
    opts: &ModelOptions,
) -> ramus_core::Result<Model> {
    match (vision, seq) {
        (Some(v), _) => build_vision_model(name, cfg, v, opts),
        (None, Some(s)) => build_sequence_model(name, cfg, s, opts),
        (None, None) => build_model_with(name, cfg, opts),
    }
}

/// The head rows `--loss-at` names: `root` or `all` (labelled) vertices.
pub(crate) fn loss_rows(at: &str) -> Result<HeadRows, String> {
    match at {
        "root" => Ok(HeadRows::Roots),
        "all" => Ok(HeadRows::Labelled),
        other => Err(format!("must be root or all, got `{other}`")),
    }
}

/// A model and its trained parameters, read from a checkpoint.
pub(crate) struct Loaded {
    pub info: checkpoint::CheckpointInfo,
    pub model: ramus_core::Model,
    pub params: Params<f32>,
    pub kind: DataKind,
    pub vision: Option<ramus_nn::VisionConfig>,
}

/// Reads a checkpoint: its settings rebuild the model, then the parameters
/// load (non-finite values and unused tensors refused unless `flags` allow
/// them). Every error names the file.
pub(crate) fn load_checkpoint(path: &std::path::Path, flags: CheckpointFlags) -> AnyResult<Loaded> {
    let (info, bytes) = checkpoint::read_info(path)?;
    let (model, kind, vision_cfg) =
        model_of(&info).map_err(|e| format!("{}: {e}", path.display()))?;
    let (params, defaulted) = checkpoint::load_params_with(path, &bytes, &model, flags.options())?;
    if let Some(first) = defaulted.first() {
        noteln!(
            "note: {} predates running statistics: {} buffers (`{first}`, ...) start from \
             their initial values (mean 0, variance 1), which evaluation normalises with",
            path.display(),
            defaulted.len()
        );
    }
    Ok(Loaded {
        info,
        model,
        params,
        kind,
        vision: vision_cfg,
    })
}

/// The model a checkpoint's metadata describes (its name and settings).
fn model_of(
    info: &checkpoint::CheckpointInfo,
) -> AnyResult<(Model, DataKind, Option<ramus_nn::VisionConfig>)> {
    let setting = |k: &str| -> AnyResult<usize> {
        let v = info
            .settings
            .get(k)
            .ok_or_else(|| format!("checkpoint settings lack `{k}`"))?;
        Ok(v.parse()
            .map_err(|_| format!("checkpoint setting `{k}` = `{v}` is not a number"))?)
    };
    let cfg = ModelConfig {
        vocab: setting("vocab")?,
        hidden: setting("hidden")?,
        classes: setting("classes")?,
    };
    if cfg.vocab != info.vocab.len() {
        return Err(format!(
            "checkpoint vocabulary has {} words but the model was built for {}",
            info.vocab.len(),
            cfg.vocab
        )
        .into());
    }
    let kind = data_kind(&info.model)
        .ok_or_else(|| format!("checkpoint names an unknown model `{}`", info.model))?;
    let vision_cfg = match kind {
        DataKind::Images => Some(
            ramus_nn::VisionConfig::from_settings(&info.settings)
                .map_err(|e| format!("checkpoint settings: {e}"))?,
        ),
        _ => None,
    };
    let seq_cfg = sequence::from_settings(&info.model, &info.settings)?;
    let mut model = build(
        &info.model,
        &cfg,
        vision_cfg.as_ref(),
        seq_cfg.as_ref(),
        &ModelOptions::default(),
    )?;
    if let Some(at) = info.settings.get("loss_at") {
        model.head.rows =
            loss_rows(at).map_err(|e| format!("checkpoint setting `loss_at`: {e}"))?;
    }
    Ok((model, kind, vision_cfg))
}
