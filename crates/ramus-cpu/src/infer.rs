//! The CPU compiled engine as an [`InferEngine`] (the CPU batched engine
//! is one through [`ramus_exec::BatchedInfer`]).

use ramus_exec::{InferEngine, Result, Scores};
use ramus_graph::InputGraph;

use crate::compiled::CpuCompiledEngine;

impl InferEngine<f32> for CpuCompiledEngine {
    fn name(&self) -> &'static str {
        "cpu-compiled"
    }

    fn infer(&mut self, graphs: &[&InputGraph]) -> Result<Scores<f32>> {
        let out = CpuCompiledEngine::infer(self, graphs)?;
        Ok(Scores {
            values: out.scores,
            classes: out.classes,
        })
    }
}
