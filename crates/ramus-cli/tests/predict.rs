//! `ramus infer` for every model family (issue 33, item 4) and `ramus data
//! export`: each prediction's probabilities sum to one and carry the class
//! names, `--top-k` lists the K best in order, the language model's
//! perplexity is exp(−log-likelihood / tokens), labelled inputs give the
//! accuracy `eval` gives, the exported built-in data trains to the same
//! model as the built-in data itself, and malformed input or flags are
//! errors naming the place or the flag. Every model is tiny (a second or
//! less to train on two cores).

use std::path::{Path, PathBuf};

use serde_json::Value;

mod common;
use common::*;

/// `path` as a `&str`.
fn s(path: &Path) -> &str {
    path.to_str().unwrap()
}

/// The probabilities of one prediction: (class, probability), as listed.
fn listed(v: &Value) -> Vec<(String, f64)> {
    v["probabilities"]
        .as_array()
        .unwrap_or_else(|| panic!("no probabilities in {v}"))
        .iter()
        .map(|p| {
            let name = p["class"].as_str().unwrap().to_string();
            (name, p["probability"].as_f64().unwrap())
        })
        .collect()
}

/// Checks a prediction listing every class: the probabilities sum to one,
/// best first, the first being the predicted class.
fn assert_full(v: &Value, classes: usize) {
    let p = listed(v);
    assert_eq!(p.len(), classes, "{v}");
    let sum: f64 = p.iter().map(|x| x.1).sum();
    assert!((sum - 1.0).abs() < 1e-5, "sum {sum}: {v}");
    assert!(p.windows(2).all(|w| w[0].1 >= w[1].1), "{v}");
    assert_eq!(p[0].0, v["class"].as_str().unwrap(), "{v}");
}

/// The `infer: ... accuracy X%` figure on standard error.
fn noted_accuracy(o: &std::process::Output) -> f64 {
    let err = stderr(o);
    let line = err
        .lines()
        .find(|l| l.starts_with("infer: ") && l.contains("accuracy"))
        .unwrap_or_else(|| panic!("no accuracy on stderr: {err}"));
    line.trim_end_matches('%')
        .rsplit(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

/// The percentage after `key` in `text` (`root acc 31.20%`).
fn percent_after(text: &str, key: &str) -> f64 {
    let at = text
        .find(key)
        .unwrap_or_else(|| panic!("no `{key}` in {text}"))
        + key.len();
    text[at..]
        .trim_start()
        .split('%')
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

/// Trains `args` (a tiny run) and saves it to `ckpt`; returns stdout.
fn train(args: &[&str], ckpt: &Path) -> String {
    let o = ramus_ok(&[&["train", "--quiet", "--save", s(ckpt)], args].concat());
    stdout(&o)
}

/// The flags of a one-epoch run of `model` at hidden size 4 on `data`.
fn one_epoch<'a>(model: &'a str, data: &'a Path) -> [&'a str; 8] {
    let data = s(data);
    [
        "--model", model, "--hidden", "4", "--epochs", "1", "--data", data,
    ]
}

/// A fresh folder `name` and a one-epoch `model` of hidden size 4 trained
/// on the built-in treebank, saved there.
fn tiny_tree_model(name: &str, model: &str) -> (PathBuf, PathBuf) {
    let dir = fresh_dir(name);
    let ckpt = dir.join("t.safetensors");
    train(&["--model", model, "--hidden", "4", "--epochs", "1"], &ckpt);
    (dir, ckpt)
}

/// `ramus infer --checkpoint CKPT ARGS...`.
fn infer(ckpt: &Path, args: &[&str]) -> std::process::Output {
    ramus(&[&["infer", "--checkpoint", s(ckpt)], args].concat())
}

/// [`infer`], failing unless it succeeds.
fn infer_ok(ckpt: &Path, args: &[&str]) -> std::process::Output {
    ramus_ok(&[&["infer", "--checkpoint", s(ckpt)], args].concat())
}

/// The `test:` line of a training log, without its timing.
fn test_line(log: &str) -> String {
    let line = log.lines().find(|l| l.starts_with("test:")).unwrap();
    line.split(" | trained").next().unwrap().to_string()
}

#[test]
fn exported_treebank_trains_the_built_in_model_and_infer_reports_its_accuracy() {
    let dir = fresh_dir("predict-trees");
    let data = dir.join("data");
    let o = ramus_ok(&["data", "export", "--output", s(&data)]);
    assert!(stdout(&o).contains("train 3000 / dev 500 / test 500 trees"));
    let tiny = ["--model", "treelstm", "--hidden", "4", "--epochs", "1"];
    let (built_in, exported) = (dir.join("a.safetensors"), dir.join("b.safetensors"));
    let a = train(&tiny, &built_in);
    let b = train(&[&tiny[..], &["--data", s(&data)]].concat(), &exported);
    assert_eq!(test_line(&a), test_line(&b));
    assert_eq!(saved_tensors(&built_in), saved_tensors(&exported));
    // eval and infer on the exported test split: the training run's accuracy
    let test = data.join("test.txt");
    let trained = percent_after(&test_line(&a), "root acc");
    let e = ramus_ok(&["eval", "--data", s(&test), "--checkpoint", s(&built_in)]);
    assert_eq!(percent_after(&stdout(&e), "root acc"), trained);
    let o = infer_ok(&built_in, &["--input", s(&test)]);
    assert!(
        (noted_accuracy(&o) - trained).abs() < 0.005,
        "{}",
        stderr(&o)
    );
    let lines = json_lines(&o);
    assert_eq!(lines.len(), 500);
    for v in &lines {
        assert_full(v, 5);
        assert_eq!(v["prediction"].to_string(), v["class"].as_str().unwrap());
        assert_eq!(v["scores"].as_array().unwrap().len(), 5);
    }
    // --top-k: the K best of the full listing, in its order
    let o = infer_ok(&built_in, &["--input", s(&test)]);
    let k = infer_ok(&built_in, &["--input", s(&test), "--top-k", "2"]);
    for (full, top) in json_lines(&o).iter().zip(json_lines(&k)) {
        assert_eq!(listed(&top), listed(full)[..2].to_vec());
    }
}

#[test]
fn plain_sentences_become_right_branching_trees() {
    let (dir, ckpt) = tiny_tree_model("predict-text", "treelstm-nary");
    let text = dir.join("s.txt");
    // the second sentence's tree: (charming (, (clever film)))
    std::fs::write(&text, "not lovely\n\ncharming, clever film\nzzz-unknown\n").unwrap();
    let args = ["infer", "--checkpoint", s(&ckpt), "--input", s(&text)];
    let o = ramus_ok(&[&args[..], &["--text", "--top-k", "3"]].concat());
    let lines = json_lines(&o);
    assert_eq!(lines.len(), 3);
    for v in &lines {
        assert_eq!(listed(v).len(), 3);
    }
    assert!(!stderr(&o).contains("accuracy"), "{}", stderr(&o));
    // the same as the bracketed right-branching trees, labels aside
    let trees = dir.join("t.txt");
    let bracketed = "(2 (2 not) (2 lovely))\n(2 (2 charming) (2 (2 ,) (2 (2 clever) (2 film))))\n\
                     (2 (2 zzz) (2 (2 -) (2 unknown)))\n";
    std::fs::write(&trees, bracketed).unwrap();
    let o = infer_ok(&ckpt, &["--input", s(&trees)]);
    let same: Vec<_> = json_lines(&o).iter().map(|v| v["scores"].clone()).collect();
    let o = ramus_ok(&[&args[..], &["--text"]].concat());
    let from_text: Vec<_> = json_lines(&o).iter().map(|v| v["scores"].clone()).collect();
    assert_eq!(from_text, same);
}

/// A small tagged corpus: `train.txt`, `dev.txt`, `test.txt` in `dir`.
fn tagged_corpus(dir: &Path) {
    let names = [("Paris", "B-LOC"), ("Anna", "B-PER"), ("Bob", "B-PER")];
    let words = ["the", "went", "to", "saw", "city", "in"];
    let sentence = |i: usize| -> String {
        (0..4 + i % 3)
            .map(|j| match (i * 7 + j * 3) % 5 {
                0 => format!("{}|{}", names[(i + j) % 3].0, names[(i + j) % 3].1),
                _ => format!("{}|O", words[(i + 2 * j) % 6]),
            })
            .collect::<Vec<_>>()
            .join(" ")
    };
    for (name, range) in [("train", 0..60), ("dev", 60..70), ("test", 70..80)] {
        let text: String = range.map(|i| sentence(i) + "\n").collect();
        std::fs::write(dir.join(format!("{name}.txt")), text).unwrap();
    }
}

#[test]
fn taggers_predict_a_tag_per_word_with_or_without_tags_in_the_input() {
    let dir = fresh_dir("predict-tagger");
    tagged_corpus(&dir);
    let ckpt = dir.join("tagger.safetensors");
    let args = [
        "--model",
        "bilstm-tagger",
        "--hidden",
        "8",
        "--mlp",
        "8",
        "--epochs",
        "2",
    ];
    train(&[&args[..], &["--data", s(&dir)]].concat(), &ckpt);
    let test = dir.join("test.txt");
    let e = ramus_ok(&["eval", "--data", s(&test), "--checkpoint", s(&ckpt)]);
    let o = infer_ok(&ckpt, &["--input", s(&test)]);
    let noted = noted_accuracy(&o);
    assert!((noted - percent_after(&stdout(&e), "tag acc")).abs() < 0.005);
    let first_words = std::fs::read_to_string(&test).unwrap();
    let first_words: Vec<&str> = first_words.lines().next().unwrap().split(' ').collect();
    let v = &json_lines(&o)[0];
    let tokens = v["tokens"].as_array().unwrap();
    assert_eq!(tokens.len(), first_words.len());
    for (t, w) in tokens.iter().zip(&first_words) {
        assert_eq!(t["word"].as_str().unwrap(), w.split('|').next().unwrap());
        assert_full(t, 3);
    }
    // plain words from standard input, the two best tags each
    let child = spawn_with_stdin(
        &["infer", "--checkpoint", s(&ckpt), "--top-k", "2"],
        b"Anna went to Paris\n",
    );
    let o = child.wait_with_output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let v = &json_lines(&o)[0];
    assert_eq!(v["classes"].as_array().unwrap().len(), 4);
    for t in v["tokens"].as_array().unwrap() {
        let p = listed(t);
        assert_eq!(p.len(), 2);
        assert!(p[0].1 >= p[1].1 && ["O", "B-LOC", "B-PER"].contains(&p[0].0.as_str()));
    }
    assert!(!stderr(&o).contains("accuracy"));
    // a line mixing tagged and plain words is located
    let bad = dir.join("bad.txt");
    std::fs::write(&bad, "Anna|B-PER went|O\nAnna went|O\n").unwrap();
    let o = infer(&ckpt, &["--input", s(&bad)]);
    error_line(&o, &["bad.txt:2:6:", "went|O"]);
    let o = infer(&ckpt, &["--input", s(&bad), "--text"]);
    error_line(&o, &["--text", "bilstm-tagger"]);
}

#[test]
fn the_language_model_scores_each_sentence() {
    let dir = fresh_dir("predict-lm");
    let data = dir.join("data");
    ramus_ok(&["data", "export", "--model", "lstm-lm", "--output", s(&data)]);
    let ckpt = dir.join("lm.safetensors");
    let log = train(&one_epoch("lstm-lm", &data), &ckpt);
    let test = data.join("test.txt");
    let o = infer_ok(&ckpt, &["--input", s(&test)]);
    let lines = json_lines(&o);
    assert_eq!(lines.len(), 500);
    let (mut ll, mut tokens) = (0.0, 0);
    for v in &lines {
        let (l, n) = (
            v["log_likelihood"].as_f64().unwrap(),
            v["tokens"].as_u64().unwrap(),
        );
        assert!(l < 0.0 && n > 1, "{v}");
        let ppl = v["perplexity"].as_f64().unwrap();
        assert!((ppl - (-l / n as f64).exp()).abs() <= 1e-9 * ppl, "{v}");
        (ll, tokens) = (ll + l, tokens + n);
    }
    // the mean loss per token is about the training run's test loss (a mean of batch means)
    let loss: f64 = test_line(&log)
        .split("loss ")
        .nth(1)
        .unwrap()
        .split(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        (-ll / tokens as f64 - loss).abs() < 0.01,
        "{ll} / {tokens} vs {loss}"
    );
    assert!(
        stderr(&o).contains(&format!("{tokens} tokens")),
        "{}",
        stderr(&o)
    );
    let o = infer(&ckpt, &["--input", s(&test), "--top-k", "2"]);
    error_line(&o, &["--top-k", "lstm-lm"]);
    let o = infer(&ckpt, &["--input", s(&test), "--engine", "compiled"]);
    error_line(&o, &["--engine compiled", "batched"]);
}

#[test]
fn cnns_predict_image_files_and_folders() {
    let dir = fresh_dir("predict-images");
    let data = dir.join("data");
    let shape = ["--image", "3x8x8"];
    let export = [
        "data",
        "export",
        "--model",
        "alexnet",
        "--images",
        "40",
        "--output",
        s(&data),
    ];
    let o = ramus_ok(&[&export[..], &shape[..]].concat());
    assert!(stdout(&o).contains("train 40 / dev 10 / test 10 images"));
    let o = ramus(&[&export[..], &shape[..]].concat());
    error_line(&o, &["--output", "not empty"]);
    let ckpt = dir.join("cnn.safetensors");
    train(
        &[&one_epoch("alexnet", &data)[..], &shape[..]].concat(),
        &ckpt,
    );
    // a folder of class folders: labelled, the accuracy eval gives
    let test = data.join("test");
    let e = ramus_ok(&["eval", "--data", s(&test), "--checkpoint", s(&ckpt)]);
    let o = infer_ok(&ckpt, &["--input", s(&test)]);
    assert!((noted_accuracy(&o) - percent_after(&stdout(&e), "acc")).abs() < 0.005);
    let lines = json_lines(&o);
    assert_eq!(lines.len(), 10);
    for v in &lines {
        assert_full(v, 10);
        assert!(v["file"].as_str().unwrap().ends_with(".png"), "{v}");
    }
    // a folder of images and an image file: unlabelled, the same scores
    let disk = test.join("disk");
    let file: PathBuf = std::fs::read_dir(test.join("ring"))
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let o = infer_ok(&ckpt, &["--top-k", "1", "--input", s(&disk), s(&file)]);
    assert!(!stderr(&o).contains("accuracy"));
    for v in json_lines(&o) {
        assert_eq!(listed(&v).len(), 1);
        let same = lines.iter().find(|l| l["file"] == v["file"]).unwrap();
        assert_eq!(same["scores"], v["scores"]);
    }
    let o = infer(&ckpt, &["--input", s(&dir.join("none.png"))]);
    error_line(&o, &["none.png: no such file"]);
}

#[test]
fn malformed_input_and_wrong_flags_are_named() {
    let (dir, ckpt) = tiny_tree_model("predict-errors", "treelstm");
    let trees = dir.join("trees.txt");
    std::fs::write(&trees, "(3 (2 a) (2 b))\n\n(3 (2 a) (2 b)\n").unwrap();
    let infer = ["infer", "--checkpoint", s(&ckpt), "--input"];
    error_line(
        &ramus(&[&infer[..], &[s(&trees)]].concat()),
        &["trees.txt:3:"],
    );
    let o = ramus(&[&infer[..], &[s(&trees), s(&trees)]].concat());
    error_line(&o, &["--input", "one file"]);
    let o = ramus(&[&infer[..], &[s(&trees), "--top-k", "0"]].concat());
    error_line(&o, &["--top-k must be at least 1"]);
    // tagged text given to a tree model: the place the trees' reader stops
    let tagged = dir.join("tagged.txt");
    std::fs::write(&tagged, "Anna|B-PER went|O\n").unwrap();
    error_line(
        &ramus(&[&infer[..], &[s(&tagged)]].concat()),
        &[
            "tagged.txt:1:1:",
            "holds `treelstm`, which reads bracketed trees",
        ],
    );
    let export = |args: &[&str], out: &str| {
        ramus(&[&["data", "export", "--output", s(&dir.join(out))], args].concat())
    };
    let o = export(&["--model", "bilstm-tagger"], "x");
    error_line(&o, &["`bilstm-tagger` has no built-in data"]);
    let o = export(&["--images", "8"], "y");
    error_line(&o, &["--images applies to the CNN models"]);
}
