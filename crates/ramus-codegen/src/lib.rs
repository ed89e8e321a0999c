//! Ramus code generation: the CUDA C++ the engines compile, generated from
//! the IR and its passes in `ramus-core`.
