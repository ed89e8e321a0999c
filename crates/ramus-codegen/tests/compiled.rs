//! The compiled engine's generated kernels of real models: what they
//! contain, and that they parse as C++ (with stubs for the CUDA keywords)
//! where a C++ compiler is at hand.

use ramus_nn::{build_model_with, ModelConfig, ModelOptions};

const CFG: ModelConfig = ModelConfig {
    vocab: 11,
    hidden: 6,
    classes: 3,
};

/// Declarations that let a generated CUDA kernel parse as host C++ (a
/// syntax check: nothing runs).
const CUDA_STUBS: &str = "#define __global__\n#define __device__\n#define __shared__\n#define __forceinline__ inline\n#define __launch_bounds__(x)\n#define __restrict__ __restrict\n#define __align__(x)\n#define __grid_constant__\nstruct float4 { float x, y, z, w; };\nstruct dim3_ { unsigned x, y, z; };\nstatic dim3_ threadIdx, blockIdx, blockDim, gridDim;\ninline float __shfl_xor_sync(unsigned, float v, int) { return v; }\ninline float __shfl_sync(unsigned, float v, unsigned) { return v; }\ninline void __syncthreads() {}\ninline void __syncwarp() {}\n#include <math.h>\n";

#[test]
fn the_mvrnn_kernel_source_is_generated_and_parses() {
    // 6 units: a warp's own lanes compute its column of `P`; 32 units in
    // blocks of 8 warps: the block computes its 8 columns together
    for hidden in [CFG.hidden, 32] {
        mvrnn_kernel_parses(&ModelConfig { hidden, ..CFG });
    }
}

fn mvrnn_kernel_parses(cfg: &ModelConfig) {
    use ramus_codegen::compiled::{LoweredCell, TreeKernelSpec};
    let model = build_model_with("mvrnn", cfg, &ModelOptions { dropout: 0.0 }).expect("model");
    let cells = ramus_core::lower::lower_model(&model).expect("lowers");
    let offsets: Vec<usize> = model
        .params
        .iter()
        .scan(0, |at, p| {
            let here = *at;
            *at += p.shape.iter().product::<usize>();
            Some(here)
        })
        .collect();
    let compiler = ["c++", "g++"].into_iter().find(|cc| {
        std::process::Command::new(cc)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    });
    for (leaf_table, persistent_weights, node_counters) in [
        (true, true, false),
        (false, false, false),
        (true, true, true),
    ] {
        let spec = TreeKernelSpec {
            name: "cortex",
            leaf: LoweredCell {
                graph: &model.functions[cells.leaf.0].forward,
                program: &cells.leaf.1,
            },
            internal: LoweredCell {
                graph: &model.functions[cells.internal.0].forward,
                program: &cells.internal.1,
            },
            head: LoweredCell {
                graph: &model.head.forward,
                program: &cells.head,
            },
            param_offsets: &offsets,
            persistent_weights,
            leaf_table,
            block_threads: 256,
            node_counters,
            token_table: None,
        };
        let source = spec.source().expect("generates");
        // W_M [A; B] straight into the state, lane by lane; B a and A b
        // stored for the second stage
        let product = if cfg.hidden.is_multiple_of(32) {
            format!(
                "{} column products of the block's 8 units, block-cooperative",
                cfg.hidden
            )
        } else {
            format!("{} column products, lane-parallel", cfg.hidden)
        };
        assert!(source.contains(&product), "the phrase matrix: {product}");
        // with persistence, a block of 8 warps keeps its slice of W_M in
        // registers (32 rows, split 8 ways)
        assert_eq!(
            source.contains("block-cooperative, the matrix in registers"),
            persistent_weights && cfg.hidden == 32,
            "leaf table {leaf_table}, persistent {persistent_weights}"
        );
        // small batches' index arrays come with the launch
        assert!(source.contains("const __grid_constant__ InlineIndices inl"));
        if node_counters {
            // the second stage waits for its own nodes' first
            assert!(source.contains("wait_count(done + 0u * num_internal + begin + i"));
        } else {
            assert!(source.contains("grid_sync(barrier, &bar_gen);\nif (rep < R)"));
        }
        let Some(cc) = compiler else {
            eprintln!("no C++ compiler: the generated kernel's syntax is not checked");
            continue;
        };
        let dir = std::env::temp_dir().join(format!("ramus-mvrnn-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let file = dir.join(format!(
            "cortex_{}_{leaf_table}_{node_counters}.cpp",
            cfg.hidden
        ));
        std::fs::write(&file, format!("{CUDA_STUBS}{source}")).expect("write");
        let out = std::process::Command::new(cc)
            .arg("-fsyntax-only")
            .arg("-w")
            .arg(&file)
            .output()
            .expect("run the compiler");
        assert!(
            out.status.success(),
            "the generated kernel does not parse:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
