//! The CUDA compiled engine as an [`InferEngine`] (the CUDA batched
//! engine is one through [`ramus_exec::BatchedInfer`]).

use ramus_exec::{ExecError, InferEngine, Result, Scores};
use ramus_graph::InputGraph;

use crate::compiled::CompiledEngine;
use crate::error::CudaError;

impl InferEngine<f32> for CompiledEngine {
    fn name(&self) -> &'static str {
        "cuda-compiled"
    }

    fn infer(&mut self, graphs: &[&InputGraph]) -> Result<Scores<f32>> {
        let out = CompiledEngine::infer(self, graphs).map_err(|e| match e {
            // a model or batch the engine cannot run: the message names the
            // input (graph place, vertex) already
            CudaError::Model(message) => ExecError::Config(message),
            e => e.into(),
        })?;
        Ok(Scores {
            values: out.scores,
            classes: out.classes,
        })
    }
}
