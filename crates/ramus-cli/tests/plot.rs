//! `ramus plot`: the curves of `train --log-dir` runs drawn to a PNG, one
//! colour per run; its errors; and `ramus bench --plot`'s speed-up chart.

mod common;

use std::path::{Path, PathBuf};

use common::{error_line, fresh_dir, ramus, ramus_ok};

/// The first two colours of the charts' palette (`src/plot/canvas.rs`):
/// the first run's and the second's.
const FIRST: [u8; 3] = [31, 119, 180];
const SECOND: [u8; 3] = [230, 85, 13];

/// A two-epoch run on the built-in treebank logged to `dir` (`extra`:
/// more flags).
fn train(dir: &Path, extra: &[&str]) {
    let mut args = vec![
        "train",
        "--epochs",
        "2",
        "--hidden",
        "16",
        "--quiet",
        "--log-dir",
        dir.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    ramus_ok(&args);
}

/// The image at `path`, decoded.
fn decode(path: &Path) -> image::RgbImage {
    image::open(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .to_rgb8()
}

fn count(img: &image::RgbImage, rgb: [u8; 3]) -> usize {
    img.pixels().filter(|p| p.0 == rgb).count()
}

/// The files in `dir` (no temporary file may be left by a write).
fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// Two logged runs in a fresh directory: `a` (steps logged too) and `b`.
fn two_runs(name: &str) -> (PathBuf, PathBuf, PathBuf) {
    let dir = fresh_dir(name);
    let (a, b) = (dir.join("run-a"), dir.join("run-b"));
    train(&a, &["--log-every", "30"]);
    train(&b, &["--lr", "0.2"]);
    (dir, a, b)
}

#[test]
fn runs_are_drawn_to_a_png_of_the_asked_size_in_a_colour_each() {
    let (dir, a, b) = two_runs("plot-runs");
    let out = dir.join("out");
    std::fs::create_dir_all(&out).unwrap();
    let one = out.join("one.png");
    ramus_ok(&[
        "plot",
        a.to_str().unwrap(),
        "--output",
        one.to_str().unwrap(),
        "--width",
        "800",
        "--height",
        "400",
    ]);
    let img = decode(&one);
    assert_eq!(img.dimensions(), (800, 400));
    // lines and markers of the run's colour (its four legend samples
    // alone are some 650 pixels), none of a second run's
    assert!(count(&img, FIRST) > 1_500, "{}", count(&img, FIRST));
    assert_eq!(count(&img, SECOND), 0);
    let both = out.join("both.png");
    ramus_ok(&[
        "plot",
        a.to_str().unwrap(),
        b.to_str().unwrap(),
        "--output",
        both.to_str().unwrap(),
        "--width",
        "700",
        "--height",
        "900",
    ]);
    let img = decode(&both);
    assert_eq!(img.dimensions(), (700, 900));
    let (first, second) = (count(&img, FIRST), count(&img, SECOND));
    assert!(first > 3_000 && second > 3_000, "{first} {second}");
    // stacked panels: each run's colour in the loss panel (top half) and
    // in the accuracy panel (bottom half)
    for half in [0..450, 450..900] {
        for rgb in [FIRST, SECOND] {
            let n = img
                .enumerate_pixels()
                .filter(|(_, y, p)| half.contains(y) && p.0 == rgb)
                .count();
            assert!(n > 1_000, "{rgb:?} in rows {half:?}: {n}");
        }
    }
    // most of the canvas is background, but far from all of it
    let background = count(&img, [255, 255, 255]);
    let total = (700 * 900) as usize;
    assert!(
        background > total / 2 && background < total - 20_000,
        "{background}"
    );
    assert_eq!(names(&out), ["both.png", "one.png"]);
}

#[test]
fn bad_runs_and_outputs_are_refused_naming_them() {
    let dir = fresh_dir("plot-errors");
    let run = dir.join("run");
    train(&run, &[]);
    let out = dir.join("p.png");
    let plot = |dirs: &[&Path], extra: &[&str]| {
        let mut args = vec!["plot"];
        args.extend(dirs.iter().map(|d| d.to_str().unwrap()));
        args.extend_from_slice(&["--output", out.to_str().unwrap()]);
        args.extend_from_slice(extra);
        ramus(&args)
    };
    // a malformed line: refused with the file and its line number
    let bad = dir.join("bad");
    std::fs::create_dir_all(&bad).unwrap();
    let metrics = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    let lines = metrics.lines().count();
    std::fs::write(
        bad.join("metrics.jsonl"),
        format!("{metrics}{{\"kind\": \"epoch\", \"epoch\": \n"),
    )
    .unwrap();
    let at = format!("bad/metrics.jsonl:{}:", lines + 1);
    error_line(&plot(&[&run, &bad], &[]), &[&at]);
    // a record of the wrong shape, also located
    std::fs::write(
        bad.join("metrics.jsonl"),
        "{\"kind\": \"epoch\", \"epoch\": 1, \"train_loss\": \"low\"}\n",
    )
    .unwrap();
    error_line(
        &plot(&[&bad], &[]),
        &["bad/metrics.jsonl:1:", "`train_loss`"],
    );
    // a directory that is not there, one without metrics
    error_line(&plot(&[&run, &dir.join("nope")], &[]), &["nope"]);
    let empty = dir.join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    error_line(&plot(&[&empty], &[]), &["empty/metrics.jsonl"]);
    // an output whose directory does not exist, a canvas too small
    let nowhere = dir.join("no-such-dir").join("p.png");
    error_line(
        &ramus(&[
            "plot",
            run.to_str().unwrap(),
            "--output",
            nowhere.to_str().unwrap(),
        ]),
        &["--output", "no-such-dir", "does not exist"],
    );
    error_line(&plot(&[&run], &["--width", "20"]), &["--width 20"]);
    assert!(!out.exists());
    // no directory at all: clap's usage error
    let o = ramus(&["plot", "--output", out.to_str().unwrap()]);
    assert!(!o.status.success());
}

#[test]
fn bench_plots_its_speed_ups_per_batch_size() {
    let dir = fresh_dir("bench-plot");
    let trees = dir.join("trees.txt");
    std::fs::write(
        &trees,
        "(3 (2 not) (1 (2 very) (1 bad)))\n(1 (2 the) (4 wonderful))\n(2 (2 a) (3 fine))\n",
    )
    .unwrap();
    let png = dir.join("speedup.png");
    let bench = |extra: &[&str]| {
        let mut args = vec![
            "bench",
            trees.to_str().unwrap(),
            "--engine",
            "compiled",
            "--hidden",
            "8",
            "--batch-sizes",
            "1,3",
            "--reps",
            "2",
        ];
        args.extend_from_slice(extra);
        ramus(&args)
    };
    let o = bench(&["--compare-batched", "--plot", png.to_str().unwrap()]);
    assert!(o.status.success(), "{}", common::stderr(&o));
    // the bench prints its lines as without --plot
    let ratios = common::json_lines(&o)
        .iter()
        .filter(|l| l["ratio"] == "compiled_vs_batched")
        .count();
    assert_eq!(ratios, 2);
    let img = decode(&png);
    assert_eq!(img.dimensions(), (1000, 560));
    // two bars of the comparison's colour (and its legend sample)
    assert!(count(&img, FIRST) > 2_000, "{}", count(&img, FIRST));
    assert_eq!(names(&dir), ["speedup.png", "trees.txt"]);
    // nothing to compare with, an output nowhere: refused before timing
    std::fs::remove_file(&png).unwrap();
    let o = bench(&["--plot", png.to_str().unwrap()]);
    error_line(&o, &["--plot", "--compare-batched"]);
    assert!(o.stdout.is_empty());
    let nowhere = dir.join("no-such-dir").join("s.png");
    let o = bench(&["--compare-batched", "--plot", nowhere.to_str().unwrap()]);
    error_line(&o, &["--plot", "does not exist"]);
    assert!(o.stdout.is_empty());
    assert!(!png.exists());
}
