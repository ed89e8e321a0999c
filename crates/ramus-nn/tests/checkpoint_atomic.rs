//! Checkpoint writes: byte-identical for identical inputs, and atomic — a
//! process killed (SIGKILL) at any moment while saving leaves either the
//! old file or the new one, whole and loadable, never a torn one.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use ramus_core::Params;
use ramus_graph::Vocab;
use ramus_nn::{build_model, checkpoint, ModelConfig};
use rand::{Rng, SeedableRng};

/// Set in the child process that saves checkpoints in a loop.
const CHILD_ENV: &str = "RAMUS_ATOMIC_SAVE_CHILD";
/// The seeds of the parameters the child saves, in turn.
const SEEDS: [u64; 3] = [11, 12, 13];

fn fresh_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ramus-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn vocab(words: usize) -> Vocab {
    let mut v = Vocab::new();
    for i in 0..words {
        v.add(&format!("w{i}"));
    }
    v
}

/// A model big enough that writing it takes a while (about 24 MB).
fn big_model() -> (ramus_core::Model, Vocab) {
    let cfg = ModelConfig {
        vocab: 20_000,
        hidden: 300,
        classes: 5,
    };
    (build_model("treelstm", &cfg).unwrap(), vocab(cfg.vocab))
}

#[test]
fn saving_twice_writes_identical_bytes() {
    let cfg = ModelConfig {
        vocab: 30,
        hidden: 4,
        classes: 5,
    };
    let mut model = build_model("treelstm", &cfg).unwrap();
    model.settings.insert("loss_at".into(), "all".into());
    let params = Params::<f32>::init(&model, 3);
    let vocab = vocab(cfg.vocab);
    let dir = fresh_dir("identical");
    let first = dir.join("a.safetensors");
    checkpoint::save(&first, &model, &params, &vocab).unwrap();
    let expected = std::fs::read(&first).unwrap();
    // every map in the file is written in one order, whatever the process
    // (a hash map's order changes from one map to the next)
    for i in 0..8 {
        let path = dir.join(format!("b{i}.safetensors"));
        checkpoint::save(&path, &model, &params, &vocab).unwrap();
        assert!(
            std::fs::read(&path).unwrap() == expected,
            "save {i} differs from the first"
        );
    }
    // and the file is a valid safetensors file that loads back
    let (info, bytes) = checkpoint::read_info(&first).unwrap();
    assert_eq!(info.model, "treelstm");
    assert_eq!(
        checkpoint::load_params(&first, &bytes, &model).unwrap(),
        params
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// The child: saves the big model's parameters under each seed in turn,
/// over and over, until killed. A no-op in a normal test run.
#[test]
fn atomic_save_child() {
    let Ok(path) = std::env::var(CHILD_ENV) else {
        return;
    };
    let (model, vocab) = big_model();
    let all: Vec<Params<f32>> = SEEDS.iter().map(|&s| Params::init(&model, s)).collect();
    for params in all.iter().cycle() {
        checkpoint::save(Path::new(&path), &model, params, &vocab).unwrap();
    }
}

#[test]
fn a_save_killed_at_any_moment_leaves_a_whole_checkpoint() {
    let (model, _) = big_model();
    let expected: Vec<Params<f32>> = SEEDS.iter().map(|&s| Params::init(&model, s)).collect();
    let dir = fresh_dir("atomic");
    let path = dir.join("m.safetensors");
    let kills: usize = std::env::var("RAMUS_ATOMIC_KILLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    let mut loaded = 0;
    for kill in 0..kills {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "atomic_save_child",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_ENV, &path)
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(rng.random_range(50..600)));
        child.kill().unwrap(); // SIGKILL on Unix
        child.wait().unwrap();
        // no kill may leave the file torn: absent (before the first save)
        // or one of the saved parameter sets, whole
        if !path.exists() {
            continue;
        }
        let (info, bytes) = checkpoint::read_info(&path)
            .unwrap_or_else(|e| panic!("kill {kill}: torn checkpoint: {e}"));
        assert_eq!(info.model, "treelstm");
        let params = checkpoint::load_params(&path, &bytes, &model)
            .unwrap_or_else(|e| panic!("kill {kill}: torn checkpoint: {e}"));
        assert!(
            expected.contains(&params),
            "kill {kill}: the parameters are none of those saved"
        );
        loaded += 1;
    }
    assert!(loaded > 0, "no kill came after a save: lengthen the waits");
    // no temporary file is left behind by a completed save... only by a
    // killed one, which the next save does not trip over
    std::fs::remove_dir_all(&dir).ok();
}
