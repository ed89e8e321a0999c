//! Word vectors in a `.safetensors` file: one 2-D `F32` tensor (named
//! `embeddings`, or the file's only tensor) of one row a word, and the
//! words in the metadata under `words`, one a line in row order. Only the
//! header and the rows of the vocabulary's words are read (in file
//! order), so memory stays `vocabulary × dimension` whatever the file's
//! size.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

use safetensors::tensor::Metadata;
use safetensors::Dtype;

use crate::vectors::WordVectors;
use crate::vocab::Vocab;
use crate::GraphError;

/// The tensor read when the file holds several.
pub const TENSOR: &str = "embeddings";
/// The metadata key of the words.
pub const WORDS: &str = "words";
/// Headers past this size are refused (the format's own limit).
const MAX_HEADER: u64 = 100_000_000;

/// Reads the vectors of `vocab`'s words from the safetensors file `path`;
/// `progress(bytes)` is called as rows are read.
pub fn read(
    path: &Path,
    vocab: &Vocab,
    mut progress: impl FnMut(u64),
) -> Result<WordVectors, GraphError> {
    let io = |source| GraphError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut file = File::open(path).map_err(io)?;
    let table = Table::read(&mut file, path)?;
    // the vocabulary's words, by row (the first row of a word given twice)
    let mut seen = vec![false; vocab.len()];
    let mut wanted: Vec<(usize, u32)> = Vec::new();
    for (row, word) in table.words.iter().enumerate() {
        if let Some(id) = vocab.get(word).filter(|&id| !seen[id as usize]) {
            seen[id as usize] = true;
            wanted.push((row, id));
        }
    }
    let dim = table.dim;
    let mut found = Vec::with_capacity(wanted.len());
    let mut bytes = vec![0u8; 4 * dim];
    for (k, (row, id)) in wanted.into_iter().enumerate() {
        let at = table.start + (row * 4 * dim) as u64;
        file.seek(SeekFrom::Start(at)).map_err(io)?;
        file.read_exact(&mut bytes).map_err(io)?;
        let vector: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        if let Some(i) = vector.iter().position(|x| !x.is_finite()) {
            return Err(GraphError::Format {
                file: path.display().to_string(),
                message: format!(
                    "the vector of `{}` (row {row}) has a non-finite value at {i}",
                    table.words[row]
                ),
            });
        }
        found.push((id, vector));
        if k % 4096 == 0 {
            progress(at);
        }
    }
    progress(table.start + (table.words.len() * 4 * dim) as u64);
    Ok(WordVectors {
        dim,
        found,
        file_words: table.words.len(),
    })
}

/// What a vector file's header says: its words in row order, the
/// vectors' width and where the first row starts in the file.
struct Table {
    words: Vec<String>,
    dim: usize,
    start: u64,
}

impl Table {
    /// The header of `file` (at its start), checked; errors name `path`.
    fn read(file: &mut File, path: &Path) -> Result<Table, GraphError> {
        let bad = |message: String| GraphError::Format {
            file: path.display().to_string(),
            message,
        };
        let io = |source| GraphError::Io {
            path: path.to_path_buf(),
            source,
        };
        let mut size = [0u8; 8];
        file.read_exact(&mut size).map_err(io)?;
        let n = u64::from_le_bytes(size);
        if n > MAX_HEADER {
            return Err(bad(format!(
                "a header of {n} bytes: not a safetensors file?"
            )));
        }
        let mut header = vec![0u8; n as usize];
        file.read_exact(&mut header).map_err(io)?;
        let text = std::str::from_utf8(&header).map_err(|e| bad(format!("header: {e}")))?;
        let meta: Metadata = serde_json::from_str(text).map_err(|e| bad(format!("header: {e}")))?;
        let (tensor, info) = match meta.info(TENSOR) {
            Some(info) => (TENSOR.to_string(), info),
            None => {
                let mut all = meta.tensors().into_iter();
                match (all.next(), all.next()) {
                    (Some((t, info)), None) => (t, info),
                    (None, _) => return Err(bad("it holds no tensor".into())),
                    _ => {
                        return Err(bad(format!(
                            "it holds several tensors and none named `{TENSOR}`"
                        )))
                    }
                }
            }
        };
        let (&[rows, dim], Dtype::F32) = (info.shape.as_slice(), info.dtype) else {
            return Err(bad(format!(
                "tensor `{tensor}` holds {:?} of shape {:?}; word vectors are F32 of \
                 [words, dimension]",
                info.dtype, info.shape
            )));
        };
        let (from, to) = info.data_offsets;
        if dim == 0 || to.checked_sub(from) != rows.checked_mul(4 * dim) {
            return Err(bad(format!(
                "tensor `{tensor}` spans bytes {from}..{to}, not {rows} vectors of {dim} floats"
            )));
        }
        let words = meta
            .metadata()
            .as_ref()
            .and_then(|m| m.get(WORDS))
            .ok_or_else(|| bad(format!("its metadata has no `{WORDS}` (one word a line)")))?;
        let words: Vec<String> = words.split('\n').map(String::from).collect();
        if words.len() != rows {
            return Err(bad(format!(
                "`{WORDS}` lists {} words, tensor `{tensor}` has {rows} rows",
                words.len()
            )));
        }
        Ok(Table {
            words,
            dim,
            start: 8 + n + from as u64,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use safetensors::tensor::TensorView;

    use super::*;

    /// A file of `words` with vectors `rows` (in `dtype`'s bytes) under
    /// `tensor`, and the metadata's words (`None`: no metadata).
    fn write(tensor: &str, rows: &[Vec<f32>], words: Option<&str>, dtype: Dtype) -> tempdir::Dir {
        let dim = rows.first().map_or(0, Vec::len);
        let bytes: Vec<u8> = rows
            .iter()
            .flatten()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        let shape = match dtype {
            Dtype::F32 => vec![rows.len(), dim],
            _ => vec![rows.len(), 2 * dim], // the same bytes as twice as many halves
        };
        let view = TensorView::new(dtype, shape, &bytes).unwrap();
        let meta = words.map(|w| HashMap::from([(WORDS.to_string(), w.to_string())]));
        let dir = tempdir::Dir::new();
        let data = safetensors::serialize([(tensor, view)], meta).unwrap();
        std::fs::write(dir.file(), data).unwrap();
        dir
    }

    /// A scratch directory removed on drop, holding `v.safetensors`.
    mod tempdir {
        pub struct Dir(std::path::PathBuf);
        impl Dir {
            pub fn new() -> Self {
                use std::sync::atomic::{AtomicUsize, Ordering};
                static N: AtomicUsize = AtomicUsize::new(0);
                let n = N.fetch_add(1, Ordering::Relaxed);
                let p =
                    std::env::temp_dir().join(format!("ramus-vectors-{}-{n}", std::process::id()));
                std::fs::create_dir_all(&p).unwrap();
                Dir(p)
            }
            pub fn file(&self) -> std::path::PathBuf {
                self.0.join("v.safetensors")
            }
        }
        impl Drop for Dir {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.0);
            }
        }
    }

    fn vocab(words: &[&str]) -> Vocab {
        let mut v = Vocab::new();
        words.iter().for_each(|w| {
            v.add(w);
        });
        v
    }

    #[test]
    fn keeps_the_rows_of_the_vocabulary_s_words() {
        let rows = vec![vec![0.5, 1.0], vec![2.0, -3.0], vec![4.0, 0.25]];
        let dir = write("vectors", &rows, Some("cat\ndog\nthe"), Dtype::F32);
        let v = vocab(&["the", "cat", "bird"]);
        let got = read(&dir.file(), &v, |_| {}).unwrap();
        assert_eq!(got.dim, 2);
        assert_eq!(got.file_words, 3);
        // `the` is id 1, `cat` id 2, found in row order
        assert_eq!(got.found, vec![(2, vec![0.5, 1.0]), (1, vec![4.0, 0.25])]);
    }

    #[test]
    fn files_it_cannot_use_are_refused_saying_why() {
        let rows = vec![vec![0.5, 1.0], vec![2.0, f32::NAN]];
        let v = vocab(&["a", "b"]);
        let cases = [
            (
                write(TENSOR, &rows, None, Dtype::F32),
                "metadata has no `words`",
            ),
            (
                write(TENSOR, &rows, Some("a"), Dtype::F32),
                "lists 1 words, tensor `embeddings` has 2 rows",
            ),
            (write(TENSOR, &rows, Some("a\nb"), Dtype::F16), "holds F16"),
            (
                write(TENSOR, &rows, Some("a\nb"), Dtype::F32),
                "`b` (row 1) has a non-finite value at 1",
            ),
        ];
        for (dir, want) in cases {
            let e = read(&dir.file(), &v, |_| {}).unwrap_err().to_string();
            assert!(e.contains(want), "{e}");
            assert!(e.starts_with(&dir.file().display().to_string()), "{e}");
        }
    }
}
