//! Checkpoints: safetensors files whose tensors are the model's parameters
//! under their own names (f32), with the model name, its settings and the
//! vocabulary recorded in the metadata so that `eval` and other tools map
//! words to the same ids.
//!
//! Non-trained buffers ([`ramus_core::ParamKind::Buffer`]: batch
//! normalisation's running statistics) are saved like parameters. A
//! checkpoint written before a model had its buffers (CNN checkpoints from
//! before running statistics) still loads: each missing buffer takes its
//! initial value (running mean 0, running variance 1) and
//! [`load_params_reporting`] names it, so callers can say so (`ramus eval`
//! and `ramus infer` print a note). A missing *trained* parameter is an
//! error.
//!
//! Loading also refuses, naming the file and the tensor, what would give
//! wrong answers without a word: a tensor holding a non-finite value (NaN
//! or infinite, e.g. a model saved after training diverged) and tensors the
//! model does not have (a checkpoint of another model or version, whose
//! values would be silently ignored). [`LoadOptions`] accepts either.

use std::collections::HashMap;
use std::path::Path;

use ramus_core::{Model, ParamKind, Params, Tensor};
use ramus_graph::Vocab;
use safetensors::tensor::{Dtype, TensorView};

use crate::error::{NnError, Result};

/// Metadata keys.
const KEY_MODEL: &str = "ramus.model";
const KEY_SETTINGS: &str = "ramus.settings";
const KEY_VOCAB: &str = "ramus.vocab";

/// What a checkpoint holds besides the tensors.
#[derive(Clone, Debug)]
pub struct CheckpointInfo {
    pub model: String,
    pub settings: std::collections::BTreeMap<String, String>,
    pub vocab: Vocab,
}

/// Writes `params` of `model` with `vocab` to `path`.
pub fn save(path: &Path, model: &Model, params: &Params<f32>, vocab: &Vocab) -> Result<()> {
    let bytes: Vec<Vec<u8>> = params
        .values
        .iter()
        .map(|t| t.data().iter().flat_map(|x| x.to_le_bytes()).collect())
        .collect();
    let mut views = Vec::new();
    for ((spec, t), b) in model.params.iter().zip(&params.values).zip(&bytes) {
        let view = TensorView::new(Dtype::F32, t.shape().to_vec(), b)
            .map_err(|e| NnError::Checkpoint(format!("tensor `{}`: {e}", spec.name)))?;
        views.push((spec.name.clone(), view));
    }
    let mut meta = HashMap::new();
    meta.insert(KEY_MODEL.to_string(), model.name.clone());
    meta.insert(
        KEY_SETTINGS.to_string(),
        serde_json::to_string(&model.settings).map_err(|e| NnError::Checkpoint(e.to_string()))?,
    );
    meta.insert(KEY_VOCAB.to_string(), vocab.to_json());
    let data = safetensors::serialize(views, Some(meta))
        .map_err(|e| NnError::Checkpoint(e.to_string()))?;
    std::fs::write(path, data).map_err(|e| NnError::Io {
        path: path.to_path_buf(),
        source: e,
    })
}

/// Reads the metadata of the checkpoint at `path`.
pub fn read_info(path: &Path) -> Result<(CheckpointInfo, Vec<u8>)> {
    let data = std::fs::read(path).map_err(|e| NnError::Io {
        path: path.to_path_buf(),
        source: e,
    })?;
    let bad = |m: String| NnError::Checkpoint(format!("{}: {m}", path.display()));
    let (_, header) = safetensors::SafeTensors::read_metadata(&data)
        .map_err(|e| bad(format!("not a safetensors file ({e})")))?;
    let meta = header
        .metadata()
        .clone()
        .ok_or_else(|| bad("no Ramus metadata".into()))?;
    let get = |k: &str| {
        meta.get(k)
            .cloned()
            .ok_or_else(|| bad(format!("metadata lacks `{k}`")))
    };
    let settings =
        serde_json::from_str(&get(KEY_SETTINGS)?).map_err(|e| bad(format!("bad settings: {e}")))?;
    let vocab =
        Vocab::from_json(&get(KEY_VOCAB)?).map_err(|e| bad(format!("bad vocabulary: {e}")))?;
    Ok((
        CheckpointInfo {
            model: get(KEY_MODEL)?,
            settings,
            vocab,
        },
        data,
    ))
}

/// What loading accepts beyond a clean checkpoint (see the module docs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LoadOptions {
    /// Accept tensors holding NaN or infinite values.
    pub allow_nonfinite: bool,
    /// Accept (and ignore) tensors the model does not have.
    pub allow_unused: bool,
}

/// Loads parameters for `model` from checkpoint bytes, checking names,
/// shapes and values; missing buffers take their initial values (see the
/// module docs).
pub fn load_params(path: &Path, data: &[u8], model: &Model) -> Result<Params<f32>> {
    load_params_reporting(path, data, model).map(|(params, _)| params)
}

/// [`load_params`], also returning the names of the buffers the checkpoint
/// lacked (which took their initial values).
pub fn load_params_reporting(
    path: &Path,
    data: &[u8],
    model: &Model,
) -> Result<(Params<f32>, Vec<String>)> {
    load_params_with(path, data, model, LoadOptions::default())
}

/// [`load_params_reporting`], accepting what `options` allows.
pub fn load_params_with(
    path: &Path,
    data: &[u8],
    model: &Model,
    options: LoadOptions,
) -> Result<(Params<f32>, Vec<String>)> {
    let bad = |m: String| NnError::Checkpoint(format!("{}: {m}", path.display()));
    let st = safetensors::SafeTensors::deserialize(data).map_err(|e| bad(e.to_string()))?;
    if !options.allow_unused {
        let mut unused: Vec<&str> = st
            .names()
            .into_iter()
            .filter(|name| model.params.iter().all(|spec| spec.name != *name))
            .collect();
        if !unused.is_empty() {
            unused.sort_unstable();
            return Err(bad(format!(
                "{} tensor(s) that model `{}` does not have: `{}` (a checkpoint of \
                 another model or version?); pass --allow-unused-tensors to ignore them",
                unused.len(),
                model.name,
                unused.join("`, `")
            )));
        }
    }
    let mut values = Vec::new();
    let mut defaulted = Vec::new();
    let mut initial: Option<Params<f32>> = None;
    for (p, spec) in model.params.iter().enumerate() {
        let t = match st.tensor(&spec.name) {
            Ok(t) => t,
            Err(_) if spec.kind == ParamKind::Buffer => {
                // buffers are deterministic (zeros, constants): any seed
                let init = initial.get_or_insert_with(|| Params::init(model, 0));
                values.push(init.values[p].clone());
                defaulted.push(spec.name.clone());
                continue;
            }
            Err(_) => {
                return Err(bad(format!(
                    "missing tensor `{}` of model `{}`",
                    spec.name, model.name
                )))
            }
        };
        if t.dtype() != Dtype::F32 {
            return Err(bad(format!(
                "tensor `{}` has dtype {:?}, expected F32",
                spec.name,
                t.dtype()
            )));
        }
        if t.shape() != spec.shape.as_slice() {
            return Err(bad(format!(
                "tensor `{}` has shape {:?}, model expects {:?}",
                spec.name,
                t.shape(),
                spec.shape
            )));
        }
        let v: Vec<f32> = t
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        if !options.allow_nonfinite {
            if let Some((at, x)) = v.iter().enumerate().find(|(_, x)| !x.is_finite()) {
                let count = v.iter().filter(|x| !x.is_finite()).count();
                return Err(bad(format!(
                    "tensor `{}` holds {count} non-finite value(s) (the first, {x}, at \
                     element {at}); pass --allow-nonfinite-checkpoint to load it anyway",
                    spec.name
                )));
            }
        }
        values.push(Tensor::from_vec(&spec.shape, v)?);
    }
    Ok((Params::from_tensors(model, values)?, defaulted))
}
