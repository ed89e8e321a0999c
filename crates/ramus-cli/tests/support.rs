//! `ramus inspect --support` against the engines themselves: what the
//! table says an engine refuses, the engine refuses when built (CPU
//! compiled), or refuses before it needs a device (CUDA compiled: its
//! cells lower first); what it says an engine runs, the engine accepts.

mod common;

use common::*;
use ramus_core::Params;
use ramus_nn::{build_model, ModelConfig};

/// The table's cell for `model` under the column `engine`.
fn cell(table: &str, model: &str, engine: &str) -> String {
    let mut lines = table.lines();
    let header = lines.next().expect("a header line");
    let columns: Vec<&str> = header
        .split("  ")
        .map(str::trim)
        .filter(|c| !c.is_empty())
        .collect();
    let col = columns
        .iter()
        .position(|&c| c == engine)
        .unwrap_or_else(|| panic!("no column `{engine}` in {header}"));
    let row = lines
        .find(|l| l.split_whitespace().next() == Some(model))
        .unwrap_or_else(|| panic!("no row for `{model}`:\n{table}"));
    let cells: Vec<&str> = row
        .split("  ")
        .map(str::trim)
        .filter(|c| !c.is_empty())
        .collect();
    cells[col].to_string()
}

fn tree_model(name: &str) -> ramus_core::Model {
    let cfg = ModelConfig {
        vocab: 100,
        hidden: 8,
        classes: 5,
    };
    build_model(name, &cfg).unwrap()
}

#[test]
fn support_table_matches_the_engines() {
    let o = ramus_ok(&["inspect", "--support"]);
    let table = stdout(&o);
    // a child-sum Tree-LSTM runs everywhere
    for engine in [
        "cpu batched",
        "cpu compiled",
        "cuda batched",
        "cuda compiled",
        "cuda persistent",
        "swap",
    ] {
        assert_eq!(cell(&table, "treelstm", engine), "yes", "{table}");
    }
    // a reason is printed for every refusal
    let no = cell(&table, "bilstm-tagger", "cpu compiled");
    assert!(no.starts_with("no ("), "{table}");
    assert!(table.contains("bilstm-tagger on cpu compiled:"), "{table}");
    assert!(cell(&table, "alexnet", "cuda persistent").starts_with("no ("));
    assert!(table.contains("(an image op)"), "{table}");

    // the CPU compiled engine: refuses the tagger, builds the Tree-LSTM
    let tagger = tree_model("bilstm-tagger");
    let params = Params::init(&tagger, 0);
    let err = ramus_cpu::compiled::CpuCompiledEngine::new(&tagger, &params, false)
        .err()
        .expect("the CPU compiled engine refuses bilstm-tagger")
        .to_string();
    assert!(table.contains(&err), "engine said `{err}`, table:\n{table}");
    let tree = tree_model("treelstm");
    assert!(
        ramus_cpu::compiled::CpuCompiledEngine::new(&tree, &Params::init(&tree, 0), false).is_ok()
    );

    // the CUDA compiled engine lowers before it opens a device: its refusal
    // of the tagger is the table's reason with or without a GPU
    let options = ramus_cuda::compiled::CompiledOptions::default();
    let err = ramus_cuda::compiled::CompiledEngine::new(&tagger, &params, &options)
        .err()
        .expect("the CUDA compiled engine refuses bilstm-tagger")
        .to_string();
    assert!(table.contains(&err), "engine said `{err}`, table:\n{table}");
}

/// The time-delay models' head multiplies a product (two stages), which the
/// compiled kernel's code generation refuses: the table says `no` for the
/// CUDA compiled engine with that reason, and the engine, which checks the
/// code generation's preconditions before it opens a device, refuses with
/// the same message with or without a GPU.
#[test]
fn cuda_compiled_refuses_a_two_stage_head_as_the_table_says() {
    let o = ramus_ok(&["inspect", "--support"]);
    let table = stdout(&o);
    let options = ramus_cuda::compiled::CompiledOptions::default();
    for name in ["td-rnn", "td-lstm"] {
        assert_eq!(cell(&table, name, "cuda compiled").get(..4), Some("no ("));
        // the CPU compiled engine runs them (only CUDA code generation refuses)
        assert_eq!(cell(&table, name, "cpu compiled"), "yes", "{table}");
        let model = tree_model(name);
        let params = Params::init(&model, 0);
        let err = ramus_cuda::compiled::CompiledEngine::new(&model, &params, &options)
            .err()
            .unwrap_or_else(|| panic!("the CUDA compiled engine refuses {name}"))
            .to_string();
        assert!(err.contains("(a product of a product)"), "{name}: {err}");
        assert!(err.contains(&format!("model `{name}`")), "{name}: {err}");
        let why = format!("{name} on cuda compiled: {err}");
        assert!(table.contains(&why), "engine said `{err}`, table:\n{table}");
    }
}
