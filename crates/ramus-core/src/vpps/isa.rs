//! The instruction set the persistent kernel interprets: every opcode, the
//! flags of their `arg`s and the layouts of their operands, shared by the
//! code that writes instructions (the scheduler, `ramus-cuda`'s unroller),
//! the kernel generator that defines them for the device, and the launch
//! split. How an instruction is encoded into words is [`super::script`]'s.

// Control opcodes and the engine's opcode range.

/// Control opcode: add one to barrier `arg` once this VPP's earlier work is
/// visible to the others.
pub const OP_SIGNAL: u8 = 1;

/// Control opcode: block until barrier `arg` has received its expected number
/// of signals ([`PackedScripts::barrier_expect`](super::PackedScripts::barrier_expect)).
pub const OP_WAIT: u8 = 2;

/// First opcode available to the engine's own operations; `0` and
/// `3..OP_FIRST_ENGINE` are reserved.
pub const OP_FIRST_ENGINE: u8 = 16;

// Engine opcodes.

/// `y = W x (+ bias)` on the holders of `W` (arg: cached matrix index).
pub const OP_MATVEC: u8 = OP_FIRST_ENGINE;

/// `dx += Wᵀ dy` on the holders of `W` (arg: cached matrix index).
pub const OP_MATVEC_T: u8 = OP_FIRST_ENGINE + 1;

/// `G += dy xᵀ` into the gradient registers (arg: cached matrix index).
pub const OP_OUTER: u8 = OP_FIRST_ENGINE + 2;

/// The optimizer step on every register partition of the VPP.
pub const OP_UPDATE: u8 = OP_FIRST_ENGINE + 3;

/// Fused elementwise group (arg: its case number).
pub const OP_FUSED: u8 = OP_FIRST_ENGINE + 4;

/// Row copy. Operands `[rows, width, dst, dst_stride, src, src_stride,
/// dst_index, src_index]`: for `i < rows`, `c < width`,
/// `dst[D(i) + c] (+)= src[S(i) + c]` where `D(i) = dst + i·dst_stride`
/// without an index (`dst_index = NO_INDEX`), else `dst + idx[i]·dst_stride`
/// or, with [`ROWS_DST_ABSOLUTE`], `dst + idx[i]` (the entries are pool
/// offsets, `dst` a column within the rows; likewise `S`); a source index
/// entry [`NO_INDEX`] reads zeros, a destination one skips the row. Arg:
/// [`ROWS_ACCUMULATE`] (atomic add) | [`ROWS_DST_ABSOLUTE`] |
/// [`ROWS_SRC_ABSOLUTE`].
pub const OP_ROWS: u8 = OP_FIRST_ENGINE + 5;

/// `dst[i, c] = Σ_{e = csr[i]..csr[i+1]} src[e·src_stride + c]`; operands
/// `[rows, width, dst, src, src_stride, csr]` (csr: pool offset of rows + 1
/// `u32` entries, edge rows of `src`).
pub const OP_SUM_CHILDREN: u8 = OP_FIRST_ENGINE + 6;

/// `dst[c] (+)= scale · Σ_i src[i·src_stride + c]`; operands `[rows, width,
/// dst, src, src_stride, scale as f32 bits]`; arg [`ROWS_ACCUMULATE`].
pub const OP_SUM_ROWS: u8 = OP_FIRST_ENGINE + 7;

/// `dst[i, c] = scale · src[c]`; operands `[rows, width, dst, src, scale bits]`.
pub const OP_BROADCAST_ROWS: u8 = OP_FIRST_ENGINE + 8;

/// Softmax cross-entropy, a warp per row. Arg 0: `dst[i] = logsumexp(x_i)
/// − x_i[label_i]`, operands `[rows, classes, dst, x, labels]`; arg 1 (its
/// gradient): `dst[i, j] = up[i] · (softmax(x_i)_j − [j = label_i])`,
/// operands `[rows, classes, dst, x, labels, up]` (labels: pool offset of `u32` labels).
pub const OP_XENT: u8 = OP_FIRST_ENGINE + 9;

/// The optimizer step on rows of a parameter in the pool; operands `[rows,
/// width, value, grad, first, second, row_index]` (row `i` is `idx[i]` or,
/// with `NO_INDEX`, `i`); the gradient is zeroed after use.
pub const OP_UPDATE_DENSE: u8 = OP_FIRST_ENGINE + 10;

/// Does nothing: a sink other tasks' dependencies meet in.
pub const OP_NOP: u8 = OP_FIRST_ENGINE + 11;

/// Opcode of a host task: never encoded into a script (the scheduler
/// refuses it); its first operand is the caller's index of the work.
pub const OP_HOST: u8 = 0xff;

// Flags and operand layouts.

/// [`OP_ROWS`] / [`OP_SUM_ROWS`] flag: add atomically instead of storing.
pub const ROWS_ACCUMULATE: u16 = 1;

/// [`OP_ROWS`] flag: destination index entries are pool offsets of rows
/// (the instruction's `dst` adds a column to them).
pub const ROWS_DST_ABSOLUTE: u16 = 2;

/// [`OP_ROWS`] flag: source index entries are pool offsets of rows (the
/// instruction's `src` adds a column to them).
pub const ROWS_SRC_ABSOLUTE: u16 = 4;

/// "No index array" / "no row" in operands and index arrays.
pub const NO_INDEX: u32 = u32::MAX;

/// Words per item of a product instruction's operand list: two vector
/// offsets and a bias offset ([`NO_INDEX`]: none; only [`OP_MATVEC`] adds
/// one).
pub const PRODUCT_ITEM_WORDS: usize = 3;

/// Words per cached matrix in the `mats` table: rows, columns, value
/// offset, first-moment offset, second-moment offset, gradient offset (the
/// wide outer products' accumulator, see
/// [`WIDE_PRODUCT_ITEMS`](super::wide::WIDE_PRODUCT_ITEMS)); see
/// `ramus_codegen::persistent::matrix_table`.
pub const MATRIX_WORDS: usize = 6;

/// Flag on a merged holder instruction's count: its items follow the count
/// inside the instruction instead of sitting at an offset of the operand
/// pool.
pub const INLINE_ITEMS: u32 = 1 << 31;

/// Flag on a merged product instruction's count: the instruction runs as a
/// GEMM whose tiles are dealt over a range of VPPs (see
/// [`Scheduler::wide_items`](super::Scheduler::wide_items)), named by the word after the count: `first |
/// n << 16`, VPPs `first, first + 1, … (mod vpps)`, `n` of them, each
/// taking tiles `rank, rank + n, …`.
pub const WIDE_ITEMS: u32 = 1 << 30;

/// Item words a merged holder instruction carries inline at most (longer
/// lists go to the operand pool); every holder's script repeats them.
pub const MAX_INLINE_ITEM_WORDS: usize = 24;

/// Most barriers one batch may use (the barrier index is 16 bits).
pub const MAX_BARRIERS: usize = 65535;
