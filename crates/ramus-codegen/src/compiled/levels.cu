extern "C" __global__ void __launch_bounds__(@BLOCK@) @NAME@_levels(const float* __restrict__ params, float* state, float* push, const float* __restrict__ table_state, const float* __restrict__ table_push, const float* __restrict__ token_table, float* scratch, const u32* child_offsets_in, const u32* child_rows_in, const u32* tokens_in, const u32* batch_begin_in, const u32* batch_length_in, u32 num_batches, u32 num_internal, u32 num_nodes, const u32* roots_in, u32 num_roots, float* scores, u32* barrier, u32* done, const __grid_constant__ InlineIndices inl, u32* done_next, u32 done_clear) {
@PARAM_POINTERS@const bool use_table = @USE_TABLE@; (void)token_table; (void)scratch; (void)done;
__shared__ u32 inline_words[INLINE_INDEX_WORDS];
const bool inline_indices = inl.count > 0u;
if (inline_indices) for (u32 i = threadIdx.x; i < inl.count; i += blockDim.x) inline_words[i] = inl.words[i];
const u32* child_offsets = inline_indices ? inline_words + inl.at[0] : child_offsets_in;
const u32* child_rows = inline_indices ? inline_words + inl.at[1] : child_rows_in;
const u32* tokens = inline_indices ? inline_words + inl.at[2] : tokens_in;
const u32* batch_begin = inline_indices ? inline_words + inl.at[3] : batch_begin_in;
const u32* batch_length = inline_indices ? inline_words + inl.at[4] : batch_length_in;
const u32* roots = inline_indices ? inline_words + inl.at[5] : roots_in;
for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < done_clear; i += gridDim.x * blockDim.x) done_next[i] = 0u;
__syncthreads();
// the barrier generation (thread 0's copy; no block can arrive before every block has read it)
u32 bar_gen = 0;
if (threadIdx.x == 0) bar_gen = barrier_generation(barrier);
const u32 lane = threadIdx.x & 31u;
const u32 gw = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
const u32 gwarps = (gridDim.x * blockDim.x) >> 5;
@LEAF_PHASE@{
@WARP_COORDINATES@@WEIGHTS@
u32 begin = num_batches > 0 ? batch_begin[0] : 0, len = num_batches > 0 ? batch_length[0] : 0;
// this warp's first node of a level, its child range and first two child rows, loaded ahead (before the barrier)
u32 pcb = 0, pce = 0, pc0 = 0, pc1 = 0;
prefetch_node(begin, len, rep, child_offsets, child_rows, &pcb, &pce, &pc0, &pc1);
@PREFETCH_FIRST@for (u32 b = 0; b < num_batches; ++b) {
const u32 next_begin = b + 1 < num_batches ? batch_begin[b + 1] : 0, next_len = b + 1 < num_batches ? batch_length[b + 1] : 0;
if (rep < R) {
@BEFORE_LEVEL@for (u32 i = rep; i < len; i += R) {
const u32 n = begin + i;
const u32 tok = tokens[n]; (void)tok;
u32 cb = pcb, ce = pce, c0 = pc0, c1 = pc1;
if (i != rep) { cb = child_offsets[n]; ce = child_offsets[n + 1]; c0 = cb < ce ? child_rows[cb] : 0; c1 = cb + 1 < ce ? child_rows[cb + 1] : 0; }
@INTERNAL_CELL@}
@PUBLISH@@LATER_STAGES@}
prefetch_node(next_begin, next_len, rep, child_offsets, child_rows, &pcb, &pce, &pc0, &pc1);
@AFTER_LEVEL@begin = next_begin; len = next_len;
}
}
@HEAD_PHASE@}
