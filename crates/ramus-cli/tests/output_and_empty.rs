//! Output and empty input (issue 30, class 7): a closed standard output
//! ends every command quietly (and `train` still saves), an empty or blank
//! data file is an error naming it in every reader and command, and reader
//! errors name the file and the place in it (`infer`'s UTF-8 errors, a
//! broken checkpoint).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::Output;
use std::sync::OnceLock;

mod common;
use common::*;

/// Runs `ramus args` with `stdin` as its standard input, reads `lines`
/// lines of its standard output and then closes it, as `| head -n LINES`
/// does; returns the exit status and standard error.
fn with_output_closed_after(args: &[&str], lines: usize, stdin: &[u8]) -> Output {
    let mut child = spawn_with_stdin(args, stdin);
    let mut out = BufReader::new(child.stdout.take().expect("stdout"));
    for _ in 0..lines {
        let mut line = String::new();
        out.read_line(&mut line).expect("read a line");
        assert!(!line.is_empty(), "{args:?} ended before line {lines}");
    }
    drop(out);
    child.wait_with_output().expect("wait for ramus")
}

/// Fails unless the command exited successfully with nothing on stderr
/// (no panic, no "failed printing to stdout").
fn assert_quiet_success(o: &Output, what: &str) {
    assert!(
        o.status.success() && o.stderr.is_empty(),
        "{what}: {:?}, stderr: {}",
        o.status,
        stderr(o)
    );
}

/// A short training run of a small Tree-LSTM on the built-in treebank.
const TRAIN_TINY: [&str; 8] = [
    "train", "--model", "treelstm", "--epochs", "1", "--hidden", "4", "--quiet",
];

/// A Tree-LSTM checkpoint trained briefly on the built-in treebank.
fn tree_checkpoint() -> &'static Path {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let path = tmp("tree.safetensors");
        ramus_ok(&[&TRAIN_TINY[..], &["--save", path.to_str().unwrap()]].concat());
        path
    })
}

/// `name` in a fresh folder `dir` holding `files` (name, contents).
fn folder(dir: &str, files: &[(&str, &str)]) -> PathBuf {
    let d = fresh_dir(dir);
    write_files(&d, files);
    d
}

const TREE: &str = "(3 (2 a) (4 (2 good) (3 film)))\n";
const SENTENCE: &str = "a good film\n";
const BLANK: &str = "  \n\t\r\n\n";

#[test]
fn a_closed_output_pipe_ends_commands_quietly() {
    let ckpt = tree_checkpoint().to_str().unwrap();
    // far more than a pipe's buffer of predictions, so that infer writes
    // after `head` has gone
    let many = TREE.repeat(5000);
    let trees = tmp("many.txt");
    std::fs::write(&trees, &many).unwrap();
    let trees = trees.to_str().unwrap();
    let o = with_output_closed_after(&["infer", "--checkpoint", ckpt, "--input", trees], 1, b"");
    assert_quiet_success(&o, "infer --input | head -1");
    let o = with_output_closed_after(&["infer", "--checkpoint", ckpt], 3, many.as_bytes());
    assert_quiet_success(&o, "infer < trees | head -3");
    let one = tmp("one.txt");
    std::fs::write(&one, TREE).unwrap();
    let one = one.to_str().unwrap();
    for args in [
        &["eval", "--json", "--data", one, "--checkpoint", ckpt][..],
        &["eval", "--data", one, "--checkpoint", ckpt],
        &["inspect", "--model", "treelstm"],
        &["inspect", "--model", "treelstm", "--fusion"],
        &[
            "bench",
            "--reps",
            "1",
            "--batch-sizes",
            "1",
            "--hidden",
            "4",
            one,
        ],
        &[
            "plan-memory",
            "--batch-size",
            "200",
            "--budget-ratio",
            "1.5",
        ],
    ] {
        let o = with_output_closed_after(args, 0, b"");
        assert_quiet_success(&o, &args.join(" "));
    }
    // train's output is a log: it trains on and saves its checkpoint
    let saved = tmp("closed.safetensors");
    let o = with_output_closed_after(
        &[&TRAIN_TINY[..], &["--save", saved.to_str().unwrap()]].concat(),
        0,
        b"",
    );
    assert_quiet_success(&o, "train --save | head -0");
    assert!(saved.is_file(), "train did not save with its output closed");
}

#[test]
fn empty_data_files_are_errors_naming_them_in_train() {
    // every split of the tree models, the language model and the taggers
    for (model, good, missing) in [
        ("treelstm", TREE, "dev.txt"),
        ("td-rnn", TREE, "dev.txt"),
        ("lstm-lm", SENTENCE, "valid.txt"),
        ("bilstm-tagger", "a|O good|X\n", "dev.txt"),
    ] {
        for empty in ["train.txt", missing, "test.txt"] {
            let files: Vec<(&str, &str)> = ["train.txt", missing, "test.txt"]
                .into_iter()
                .map(|f| (f, if f == empty { BLANK } else { good }))
                .collect();
            let dir = folder(&format!("{model}-{}", empty.replace('.', "-")), &files);
            let o = ramus(&[
                "train",
                "--model",
                model,
                "--data",
                dir.to_str().unwrap(),
                "--epochs",
                "1",
                "--hidden",
                "4",
                "--quiet",
            ]);
            let file = dir.join(empty);
            assert_one_line_error(&o, &format!("{}: no ", file.display()));
        }
    }
    // one tagged file to split, and an image folder with an empty image
    let empty = tmp("empty-tagged.txt");
    std::fs::write(&empty, "").unwrap();
    let o = ramus(&[
        "train",
        "--model",
        "bilstm-tagger",
        "--data",
        empty.to_str().unwrap(),
    ]);
    assert_one_line_error(&o, &format!("{}: no tagged sentences", empty.display()));
    let images = tmp("empty-image");
    for split in ["train", "dev", "test"] {
        for class in ["a", "b"] {
            std::fs::create_dir_all(images.join(split).join(class)).unwrap();
        }
    }
    let file = images.join("train").join("a").join("0.png");
    std::fs::write(&file, b"").unwrap();
    let o = ramus(&[
        "train",
        "--model",
        "resnet",
        "--data",
        images.to_str().unwrap(),
    ]);
    assert_one_line_error(&o, &file.display().to_string());
}

#[test]
fn an_empty_training_file_for_the_language_model_is_blamed_on_itself() {
    let dir = folder(
        "lm-empty-train",
        &[
            ("train.txt", ""),
            ("valid.txt", SENTENCE),
            ("test.txt", SENTENCE),
        ],
    );
    let o = ramus(&[
        "train",
        "--model",
        "lstm-lm",
        "--data",
        dir.to_str().unwrap(),
    ]);
    assert_one_line_error(
        &o,
        &format!("{}: no sentences", dir.join("train.txt").display()),
    );
    assert!(!stderr(&o).contains("valid.txt"), "{}", stderr(&o));
}

#[test]
fn empty_data_files_are_errors_naming_them_in_eval_infer_bench_and_plan_memory() {
    let ckpt = tree_checkpoint().to_str().unwrap();
    let blank = tmp("blank.txt");
    std::fs::write(&blank, BLANK).unwrap();
    let name = blank.to_str().unwrap();
    let needle = format!("{name}: no trees");
    assert_one_line_error(
        &ramus(&["eval", "--data", name, "--checkpoint", ckpt]),
        &needle,
    );
    assert_one_line_error(
        &ramus(&["infer", "--input", name, "--checkpoint", ckpt]),
        &needle,
    );
    let o = with_output_closed_after(&["infer", "--checkpoint", ckpt], 0, BLANK.as_bytes());
    assert_one_line_error(&o, "<stdin>: no trees");
    assert_one_line_error(&ramus(&["bench", "--reps", "1", name]), &needle);
    let o = ramus(&["bench", "--reps", "1", "--model", "bilstm-tagger", name]);
    assert_one_line_error(&o, &format!("{name}: no tagged sentences"));
    let o = ramus(&["bench", "--reps", "1", "--model", "lstm-lm", name]);
    assert_one_line_error(&o, &format!("{name}: no sentences"));
    let dir = folder(
        "plan-empty",
        &[("train.txt", BLANK), ("dev.txt", TREE), ("test.txt", TREE)],
    );
    let o = ramus(&["plan-memory", "--data", dir.to_str().unwrap()]);
    assert_one_line_error(
        &o,
        &format!("{}: no trees", dir.join("train.txt").display()),
    );
    // a language model evaluated on an empty file
    let lm = folder(
        "lm-data",
        &[
            ("train.txt", SENTENCE),
            ("valid.txt", SENTENCE),
            ("test.txt", SENTENCE),
        ],
    );
    let lm_ckpt = tmp("lm.safetensors");
    ramus_ok(&[
        "train",
        "--model",
        "lstm-lm",
        "--data",
        lm.to_str().unwrap(),
        "--epochs",
        "1",
        "--hidden",
        "4",
        "--quiet",
        "--save",
        lm_ckpt.to_str().unwrap(),
    ]);
    let o = ramus(&[
        "eval",
        "--data",
        name,
        "--checkpoint",
        lm_ckpt.to_str().unwrap(),
    ]);
    assert_one_line_error(&o, &format!("{name}: no sentences"));
}

#[test]
fn infer_names_the_place_of_invalid_utf8() {
    let ckpt = tree_checkpoint().to_str().unwrap();
    let bad = tmp("bad-utf8.txt");
    let text = b"(3 (2 a) (2 b))\n(1 (2 caf\xc3\xa9) (2 x\xff))\n";
    std::fs::write(&bad, text).unwrap();
    let o = ramus(&[
        "infer",
        "--input",
        bad.to_str().unwrap(),
        "--checkpoint",
        ckpt,
    ]);
    assert_one_line_error(&o, &format!("{}:2:17: invalid UTF-8", bad.display()));
    let o = with_output_closed_after(&["infer", "--checkpoint", ckpt], 0, text);
    assert_one_line_error(&o, "<stdin>:2:17: invalid UTF-8");
}

#[test]
fn checkpoint_errors_name_the_file_and_the_place() {
    let bytes = std::fs::read(tree_checkpoint()).unwrap();
    let data = tmp("one-tree.txt");
    std::fs::write(&data, TREE).unwrap();
    let eval = |name: &str, bytes: &[u8]| {
        let path = tmp(name);
        std::fs::write(&path, bytes).unwrap();
        let o = ramus(&[
            "eval",
            "--data",
            data.to_str().unwrap(),
            "--checkpoint",
            path.to_str().unwrap(),
        ]);
        (o, path.display().to_string())
    };
    let (o, path) = eval("truncated.safetensors", &bytes[..bytes.len() - 3]);
    assert_one_line_error(
        &o,
        &format!("{path}: not a safetensors file: header (bytes 8.."),
    );
    assert!(stderr(&o).contains("data ends at byte"), "{}", stderr(&o));
    let (o, path) = eval("short.safetensors", &bytes[..5]);
    assert_one_line_error(&o, &format!("{path}: not a safetensors file: bytes 0..8"));
    // a vocabulary with a word twice: the metadata key, line and column
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    header["__metadata__"]["ramus.vocab"] = "[\n\"<unk>\",\n\"a\",\n \"a\"]".into();
    let header = serde_json::to_vec(&header).unwrap();
    let mut twice = (header.len() as u64).to_le_bytes().to_vec();
    twice.extend_from_slice(&header);
    twice.extend_from_slice(&bytes[8 + n..]);
    let (o, path) = eval("twice.safetensors", &twice);
    assert_one_line_error(
        &o,
        &format!("{path}: metadata `ramus.vocab`:4:2: word \"a\" appears twice"),
    );
}
