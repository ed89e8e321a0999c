//! Cortex lowering: a vertex function's (or the head's) inference graph as
//! a **cell program** of per-unit scalar code, the form the compiled
//! inference engines run (Cortex §4.3–§5: fused cells, model persistence).
//!
//! # Vectors and units
//!
//! Every value the outputs need is one of two kinds:
//!
//! * a **vector** ([`VecNode`]): computed from the vertex's inputs (its
//!   children's states, its token's embedding) through data movement and
//!   elementwise ops only, no product. Any column of it can be evaluated on
//!   its own ([`VecExpr`]), so an engine evaluates exactly the columns it
//!   needs where it needs them (the lanes of a matrix-vector product read
//!   their own slice of the input, nothing is stored);
//! * a **unit value**: anything downstream of a matrix-vector product. Its
//!   columns are split into `units` interleaved **units**: unit `j` owns
//!   columns `j, U + j, 2U + j, …` of every unit value (`U` = `units`, the
//!   greatest common divisor of every unit value's width and every slice and
//!   concat boundary on them), and no column of one unit depends on another
//!   unit's. Each unit value of width `L·U` becomes `L` **scalars**
//!   ([`ScalarNode`], one per lane `m`: column `m·U + j`), all units running
//!   the same scalar code with their own `j`.
//!
//! A Tree-LSTM cell becomes, for unit `j`: three dot products of the child
//! sum `h̃` with rows `j`, `U + j`, `2U + j` of `U_iou`, one dot product per
//! child with row `j` of `U_f`, and the gate arithmetic of column `j`. An
//! engine pins a unit's weight rows on chip (in registers) across all levels
//! and runs the units in parallel; nothing is stored but the new state.
//!
//! Slices and concats of unit values are pure renumbering (no code);
//! `sum_children` of an edge scalar is a loop over the child edges
//! ([`ScalarExpr::ChildSum`]); dropout masks are 1 at inference and
//! multiplications by them are folded away.
//!
//! # Per-row matrices
//!
//! A vertex may carry matrices in its state (an MV-RNN's `[p; vec(P)]`),
//! multiplied by [`RowMatMul`] products, which lower
//! to two more scalar forms:
//!
//! * a per-row matrix times a per-row vector (`B a`): unit `j`'s lane is
//!   row `row + j` of the matrix dotted with the whole vector
//!   ([`ScalarExpr::RowDot`]);
//! * a static matrix times a per-row matrix (`W_M [A; B]`): output column
//!   `i·n + c` is row `i` of the static matrix dotted with column `c` of the
//!   per-row matrix. The units split the columns `c` (so `U` divides `n`);
//!   a lane's row `i` is the same for every unit, so every unit reads the
//!   same parameter elements, and its own column of the per-row matrix
//!   ([`ScalarExpr::ColumnDot`]).
//!
//! Either operand may be a unit value, stored and read back as a vector
//! by a later stage like a product's input.
//!
//! # Stages
//!
//! A product whose input is itself a unit value (a TreeGRU's
//! `U_h Σ_k (r_k ⊙ h_k)`) needs every unit's columns of that input: the
//! cell gets a second **stage**. In stage 0 each unit stores its columns
//! into a per-vertex scratch row ([`CellProgram::stores`]); stage 1 reads the
//! row back as a vector ([`VecExpr::Staged`]). A value one stage computes
//! and a later one reads is carried through the scratch row the same way
//! (parameters and vector reads are simply read again), so no stage ever
//! needs another stage's registers: an engine may run the stages as separate
//! passes with a barrier between them.
//!
//! # Hoisting
//!
//! [`CellProgram::hoist_token_values`] moves the values that depend on the
//! vertex's token alone (an input projection `W x + b`) into a per-token
//! table an engine computes once at load.
//!
//! A graph that does not fit — an op without an elementwise form, a
//! non-parameter weight, a product of per-edge unit values — is an error
//! naming the node.

mod compact;
mod lowering;
mod pass;
mod types;

pub use compact::Hoisted;
pub use pass::{embedding_rows, lower, lower_model, ModelCells};
pub use types::{
    scalar_deps, scalar_vectors, unsupported, vec_deps, CellProgram, ChildRef, ScalarExpr,
    ScalarId, ScalarNode, Scope, VecExpr, VecId, VecNode,
};
