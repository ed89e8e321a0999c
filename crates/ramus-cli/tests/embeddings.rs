//! `ramus train --embeddings FILE`: the embedding table starts from the
//! file's vectors for the words it holds (read back from the saved
//! checkpoint of a run at learning rate 0), and the file's errors.

mod common;

use std::collections::HashMap;
use std::path::Path;

use common::{error_line, fresh_dir, ramus_ok, stdout, write_files};
use serde_json::Value;

const TREES: &str = "(3 (2 the) (3 cat))\n(1 (2 a) (1 dog))\n(2 (2 the) (2 dog))\n";

/// The data and a vector file of 4 values for `the` and `cat` (and a word
/// the data lacks).
fn setup(name: &str) -> std::path::PathBuf {
    let dir = fresh_dir(name);
    write_files(
        &dir,
        &[
            ("train.txt", TREES),
            ("dev.txt", TREES),
            ("test.txt", TREES),
        ],
    );
    let vectors = "the 0.5 -0.25 1 2\nzebra 9 9 9 9\ncat 0.125 0 -1 3\n";
    write_files(&dir, &[("vectors.txt", vectors)]);
    dir
}

/// The safetensors tensor `name` (f32) and the checkpoint's vocabulary.
fn tensor_and_vocab(path: &Path, name: &str) -> (Vec<f32>, Vec<String>) {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let offsets = &header[name]["data_offsets"];
    let (a, b) = (
        offsets[0].as_u64().unwrap() as usize,
        offsets[1].as_u64().unwrap() as usize,
    );
    let data = bytes[8 + n + a..8 + n + b]
        .chunks(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let vocab: Vec<String> =
        serde_json::from_str(header["__metadata__"]["ramus.vocab"].as_str().unwrap()).unwrap();
    (data, vocab)
}

#[test]
fn the_table_starts_from_the_file_s_vectors() {
    let dir = setup("embeddings-load");
    let (data, save) = (dir.to_str().unwrap(), dir.join("m.safetensors"));
    let vectors = dir.join("vectors.txt");
    let o = ramus_ok(&[
        "train",
        "--data",
        data,
        "--model",
        "treelstm",
        "--hidden",
        "4",
        "--epochs",
        "1",
        "--optimizer",
        "sgd",
        "--lr",
        "0",
        "--quiet",
        "--embeddings",
        vectors.to_str().unwrap(),
        "--save",
        save.to_str().unwrap(),
    ]);
    let out = stdout(&o);
    assert!(out.contains("embeddings: 2 of 5 words from"), "{out}");
    assert!(out.contains("4 dimensions"), "{out}");
    let (emb, vocab) = tensor_and_vocab(&save, "emb");
    let row = |w: &str| {
        let i = vocab.iter().position(|v| v == w).unwrap();
        emb[4 * i..4 * i + 4].to_vec()
    };
    assert_eq!(row("the"), vec![0.5, -0.25, 1.0, 2.0]);
    assert_eq!(row("cat"), vec![0.125, 0.0, -1.0, 3.0]);
    // a word the file lacks keeps its random start
    let dog = row("dog");
    let known: HashMap<&str, Vec<f32>> = [("the", row("the")), ("cat", row("cat"))]
        .into_iter()
        .collect();
    assert!(known.values().all(|v| *v != dog) && dog.iter().any(|x| *x != 0.0));
}

#[test]
fn a_file_that_does_not_fit_is_refused_naming_it() {
    let dir = setup("embeddings-errors");
    let data = dir.to_str().unwrap();
    let vectors = dir.join("vectors.txt");
    let bad = dir.join("bad.txt");
    std::fs::write(&bad, "the 1 2 3 4\ncat 1 2\n").unwrap();
    let base = [
        "train", "--data", data, "--model", "treelstm", "--epochs", "1",
    ];
    let run = |extra: &[&str]| {
        let mut args = base.to_vec();
        args.extend_from_slice(extra);
        common::ramus(&args)
    };
    let v = vectors.to_str().unwrap();
    error_line(
        &run(&["--hidden", "8", "--embeddings", v]),
        &["--embeddings", "4 values", "--hidden 4"],
    );
    error_line(
        &run(&["--hidden", "4", "--embeddings", bad.to_str().unwrap()]),
        &["bad.txt:2:5", "2 values"],
    );
    let missing = dir.join("none.txt");
    error_line(
        &run(&["--hidden", "4", "--embeddings", missing.to_str().unwrap()]),
        &["--embeddings", "none.txt"],
    );
}

/// `words` and their 4-value `rows` as a `.safetensors` vector file.
fn safetensors_vectors(path: &Path, words: &[&str], rows: &[[f32; 4]]) {
    let data: Vec<u8> = rows
        .iter()
        .flatten()
        .flat_map(|x| x.to_le_bytes())
        .collect();
    let header = serde_json::json!({
        "__metadata__": { "words": words.join("\n") },
        "embeddings": { "dtype": "F32", "shape": [rows.len(), 4], "data_offsets": [0, data.len()] },
    })
    .to_string();
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend(header.as_bytes());
    bytes.extend(data);
    std::fs::write(path, bytes).unwrap();
}

/// Dev and test words the training split lacks are known when the file
/// has their vectors (and unknown otherwise), from text and safetensors
/// files alike.
#[test]
fn dev_and_test_words_with_vectors_join_the_vocabulary() {
    let dir = fresh_dir("embeddings-widen");
    let dev = "(3 (2 the) (3 zebra))\n(1 (2 a) (1 unicorn))\n";
    write_files(
        &dir,
        &[("train.txt", TREES), ("dev.txt", dev), ("test.txt", TREES)],
    );
    let rows = [[0.5, -0.25, 1.0, 2.0], [7.0, 8.0, 9.0, 10.0]];
    write_files(
        &dir,
        &[(
            "v.txt",
            "the 0.5 -0.25 1 2\nzebra 7 8 9 10\nokapi 1 1 1 1\n",
        )],
    );
    safetensors_vectors(&dir.join("v.safetensors"), &["the", "zebra"], &rows);
    let mut tables = Vec::new();
    for file in ["v.txt", "v.safetensors"] {
        let save = dir.join(format!("{file}.ckpt.safetensors"));
        let o = ramus_ok(&[
            "train",
            "--data",
            dir.to_str().unwrap(),
            "--model",
            "treelstm",
            "--hidden",
            "4",
            "--epochs",
            "1",
            "--optimizer",
            "sgd",
            "--lr",
            "0",
            "--quiet",
            "--embeddings",
            dir.join(file).to_str().unwrap(),
            "--save",
            save.to_str().unwrap(),
        ]);
        let out = stdout(&o);
        assert!(
            out.contains("embeddings: 2 of 6 words from")
                && out.contains("1 dev/test words without a vector are unknown"),
            "{file}: {out}"
        );
        let (emb, vocab) = tensor_and_vocab(&save, "emb");
        assert_eq!(
            vocab,
            ["<unk>", "the", "cat", "a", "dog", "zebra"],
            "{file}"
        );
        assert_eq!(emb[20..24], rows[1], "{file}: zebra's row");
        tables.push(emb);
    }
    assert_eq!(
        tables[0], tables[1],
        "text and safetensors files start alike"
    );
}
