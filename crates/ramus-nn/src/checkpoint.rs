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

use std::collections::BTreeMap;
use std::path::Path;

use ramus_core::{Model, ParamKind, Params, Tensor};
use ramus_graph::Vocab;
use safetensors::tensor::Dtype;

use crate::error::{NnError, Result};

/// Metadata keys.
const KEY_MODEL: &str = "ramus.model";
const KEY_SETTINGS: &str = "ramus.settings";
const KEY_VOCAB: &str = "ramus.vocab";

/// What a checkpoint holds besides the tensors.
#[derive(Clone, Debug)]
pub struct CheckpointInfo {
    pub model: String,
    pub settings: BTreeMap<String, String>,
    pub vocab: Vocab,
}

/// What a checkpoint may carry besides the model, its parameters and the
/// vocabulary: more tensors (under names the model does not use) and more
/// metadata (a resumable checkpoint's training state).
#[derive(Default)]
pub struct Extra<'a> {
    pub tensors: Vec<(String, &'a Tensor<f32>)>,
    pub metadata: BTreeMap<String, String>,
}

/// Writes `params` of `model` with `vocab` to `path`, atomically (see
/// [`crate::atomic`]): a crash leaves the old file or the new one.
pub fn save(path: &Path, model: &Model, params: &Params<f32>, vocab: &Vocab) -> Result<()> {
    save_with(path, model, params, vocab, &Extra::default())
}

/// [`save`] with `extra` tensors and metadata.
pub fn save_with(
    path: &Path,
    model: &Model,
    params: &Params<f32>,
    vocab: &Vocab,
    extra: &Extra<'_>,
) -> Result<()> {
    let data = to_bytes(model, params, vocab, extra)?;
    crate::atomic::write_atomic(path, &data).map_err(|e| NnError::Io {
        path: path.to_path_buf(),
        source: e,
    })
}

/// The bytes [`save_with`] writes: the same inputs always give the same
/// bytes (tensors by name, metadata keys sorted).
pub fn to_bytes(
    model: &Model,
    params: &Params<f32>,
    vocab: &Vocab,
    extra: &Extra<'_>,
) -> Result<Vec<u8>> {
    let mut tensors: Vec<(&str, &Tensor<f32>)> = model
        .params
        .iter()
        .zip(&params.values)
        .map(|(spec, t)| (spec.name.as_str(), t))
        .collect();
    tensors.extend(extra.tensors.iter().map(|(n, t)| (n.as_str(), *t)));
    let mut meta = extra.metadata.clone();
    meta.insert(KEY_MODEL.to_string(), model.name.clone());
    meta.insert(
        KEY_SETTINGS.to_string(),
        serde_json::to_string(&model.settings).map_err(|e| NnError::Checkpoint(e.to_string()))?,
    );
    meta.insert(KEY_VOCAB.to_string(), vocab.to_json());
    serialize(tensors, &meta)
}

/// A safetensors file of f32 `tensors` and `meta`, in one order whatever
/// the process: tensors sorted by name (the order `safetensors` itself
/// lays one dtype out in), metadata keys sorted. (`safetensors::serialize`
/// takes the metadata as a `HashMap`, whose order changes from run to run.)
fn serialize(
    mut tensors: Vec<(&str, &Tensor<f32>)>,
    meta: &BTreeMap<String, String>,
) -> Result<Vec<u8>> {
    tensors.sort_by(|a, b| a.0.cmp(b.0));
    if let Some(w) = tensors.windows(2).find(|w| w[0].0 == w[1].0) {
        return Err(NnError::Checkpoint(format!(
            "two tensors named `{}`",
            w[0].0
        )));
    }
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), serde_json::json!(meta));
    let mut offset = 0usize;
    for (name, t) in &tensors {
        let end = offset + 4 * t.len();
        header.insert(
            (*name).to_string(),
            serde_json::json!({"dtype": "F32", "shape": t.shape(), "data_offsets": [offset, end]}),
        );
        offset = end;
    }
    let mut header = serde_json::to_vec(&header).map_err(|e| NnError::Checkpoint(e.to_string()))?;
    // safetensors pads the header with spaces to a multiple of 8 bytes
    header.resize(header.len().next_multiple_of(8), b' ');
    let mut out = Vec::with_capacity(8 + header.len() + offset);
    out.extend((header.len() as u64).to_le_bytes());
    out.extend(header);
    for (_, t) in &tensors {
        out.extend(t.data().iter().flat_map(|x| x.to_le_bytes()));
    }
    Ok(out)
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

/// Loads parameters for `model` from checkpoint bytes, checking names and
/// shapes; missing buffers take their initial values (see the module docs).
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
    let bad = |m: String| NnError::Checkpoint(format!("{}: {m}", path.display()));
    let st = safetensors::SafeTensors::deserialize(data).map_err(|e| bad(e.to_string()))?;
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
        values.push(Tensor::from_vec(&spec.shape, v)?);
    }
    Ok((Params::from_tensors(model, values)?, defaulted))
}
