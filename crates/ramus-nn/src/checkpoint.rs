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

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use ramus_core::{Model, ParamKind, Params, Tensor};
use ramus_graph::Vocab;
use safetensors::tensor::{Dtype, TensorInfo};
use safetensors::SafeTensorError;

use ramus_exec::{ExecError, Result};

/// The prefix of the tensors a resumable checkpoint adds
/// (its run state: names no model uses, so checks for unused tensors
/// skip them).
pub const TENSOR_PREFIX: &str = "ramus.resume/";

/// Whether `name` is one of the tensors a resumable checkpoint adds.
pub fn is_resume_tensor(name: &str) -> bool {
    name.starts_with(TENSOR_PREFIX)
}

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
/// [`ramus_exec::atomic`]): a crash leaves the old file or the new one.
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
    ramus_exec::atomic::write_atomic(path, &data).map_err(|e| ExecError::Io {
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
        serde_json::to_string(&model.settings).map_err(|e| ExecError::Checkpoint(e.to_string()))?,
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
        return Err(ExecError::Checkpoint(format!(
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
    let mut header =
        serde_json::to_vec(&header).map_err(|e| ExecError::Checkpoint(e.to_string()))?;
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
    let data = std::fs::read(path).map_err(|e| ExecError::Io {
        path: path.to_path_buf(),
        source: e,
    })?;
    let bad = |m: String| ExecError::Checkpoint(format!("{}: {m}", path.display()));
    let (_, header) = safetensors::SafeTensors::read_metadata(&data)
        .map_err(|e| bad(format!("not a safetensors file: {}", locate(&e, &data))))?;
    let meta = header
        .metadata()
        .clone()
        .ok_or_else(|| bad("no Ramus metadata".into()))?;
    let get = |k: &str| {
        meta.get(k)
            .cloned()
            .ok_or_else(|| bad(format!("metadata lacks `{k}`")))
    };
    let settings = serde_json::from_str(&get(KEY_SETTINGS)?)
        .map_err(|e| bad(format!("metadata `{KEY_SETTINGS}`: {e}")))?;
    let vocab = Vocab::from_json(&get(KEY_VOCAB)?, &format!("metadata `{KEY_VOCAB}`"))
        .map_err(|e| bad(e.to_string()))?;
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
    let bad = |m: String| ExecError::Checkpoint(format!("{}: {m}", path.display()));
    let st = safetensors::SafeTensors::deserialize(data).map_err(|e| bad(locate(&e, data)))?;
    if !options.allow_unused {
        let mut unused: Vec<&str> = st
            .names()
            .into_iter()
            .filter(|name| !is_resume_tensor(name))
            .filter(|name| model.params.iter().all(|spec| spec.name != *name))
            .collect();
        if !unused.is_empty() {
            unused.sort_unstable();
            return Err(bad(format!(
                "model `{}` has no tensor `{}` ({} unused in all: a checkpoint of another \
                 model or version?); pass --allow-unused-tensors to ignore them",
                model.name,
                unused.join("`, `"),
                unused.len()
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

/// What is wrong with safetensors bytes `data` (`e`, from reading their
/// header) and where: the bytes of the header length or of the header, or
/// the tensor whose entry does not match its data.
fn locate(e: &SafeTensorError, data: &[u8]) -> String {
    let header_end = data
        .get(..8)
        .and_then(|b| Some(8 + usize::try_from(u64::from_le_bytes(b.try_into().ok()?)).ok()?));
    match (e, header_end) {
        (SafeTensorError::HeaderTooSmall, _) => format!(
            "bytes 0..8 hold the header length, but the file has {} bytes",
            data.len()
        ),
        (SafeTensorError::HeaderTooLarge | SafeTensorError::InvalidHeaderLength, end) => format!(
            "bytes 0..8: the header length ({} bytes) does not fit the file's {} bytes or the 100 MB limit",
            end.map_or("over 2^64".to_string(), |e| (e - 8).to_string()),
            data.len()
        ),
        (SafeTensorError::InvalidHeader(u), _) => {
            format!("header byte {}: invalid UTF-8", 8 + u.valid_up_to())
        }
        (SafeTensorError::InvalidHeaderDeserialization(j), Some(end)) => {
            format!("header (bytes 8..{end}), JSON {j}")
        }
        (_, Some(end)) => match data.get(8..end).and_then(|h| bad_tensor(h, data.len() - end)) {
            Some(why) => format!("header (bytes 8..{end}): {why}"),
            None => format!("header (bytes 8..{end}): {e}"),
        },
        (_, None) => e.to_string(),
    }
}

/// The first tensor entry of `header` (JSON) whose offsets do not follow
/// the previous one's or do not hold its shape and dtype, or a note that
/// the data does not end where the `data_bytes` after the header end.
fn bad_tensor(header: &[u8], data_bytes: usize) -> Option<String> {
    let entries: HashMap<String, serde_json::Value> = serde_json::from_slice(header).ok()?;
    let mut tensors: Vec<(String, TensorInfo)> = entries
        .into_iter()
        .filter(|(name, _)| name != "__metadata__")
        .map(|(name, v)| Some((name, serde_json::from_value(v).ok()?)))
        .collect::<Option<_>>()?;
    tensors.sort_by_key(|(_, t)| t.data_offsets);
    let mut end = 0;
    for (name, t) in &tensors {
        let (s, e) = t.data_offsets;
        let bits = t
            .shape
            .iter()
            .try_fold(t.dtype.bitsize(), |n, &d| n.checked_mul(d));
        let place = format!(
            "tensor `{name}` ({:?} {:?}, data_offsets [{s}, {e}])",
            t.dtype, t.shape
        );
        if s != end || e < s {
            return Some(format!(
                "{place} does not start where the previous tensor ends ({end})"
            ));
        }
        match bits {
            Some(b) if b % 8 == 0 && b / 8 == e - s => {}
            Some(b) if b % 8 == 0 => {
                return Some(format!(
                    "{place} has {} bytes, its shape and dtype need {}",
                    e - s,
                    b / 8
                ))
            }
            _ => {
                return Some(format!(
                "{place}: its shape and dtype need no whole number of bytes that fits in memory"
            ))
            }
        }
        end = e;
    }
    (end != data_bytes).then(|| {
        format!("the tensors' data ends at byte {end} after the header, but {data_bytes} bytes follow it")
    })
}
