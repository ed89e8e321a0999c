extern "C" __global__ void __launch_bounds__(@BLOCK@) @NAME@_unrolled(const float* __restrict__ params, float* state, float* push, const float* __restrict__ table_state, const float* __restrict__ table_push, const float* __restrict__ token_table, float* scratch, const u32* __restrict__ child_offsets, const u32* __restrict__ child_rows, const u32* __restrict__ tokens, const u32* __restrict__ step_begin, u32 num_steps, const u32* __restrict__ group_parent, const u32* __restrict__ group_child_begin, const u32* __restrict__ group_children, u32 num_internal, u32 num_nodes, const u32* __restrict__ roots, u32 num_roots, float* scores, u32* barrier) {
@PARAM_POINTERS@const bool use_table = @USE_TABLE@; (void)token_table; (void)scratch;
u32 bar_gen = 0;
if (threadIdx.x == 0) bar_gen = barrier_generation(barrier);
const u32 lane = threadIdx.x & 31u;
const u32 gw = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
const u32 gwarps = (gridDim.x * blockDim.x) >> 5;
@LEAF_PHASE@{
const u32 bw = threadIdx.x >> 5, BW = blockDim.x >> 5;
for (u32 st = 0; st < num_steps; ++st) {
const u32 g_end = step_begin[st + 1];
for (u32 g = step_begin[st] + blockIdx.x; g < g_end; g += gridDim.x) {
const u32 kb = group_child_begin[g], ke = group_child_begin[g + 1];
const u32 par = group_parent[g];
// the children of the group (their own children are ready)
@CHILDREN@// then the parent, reading them back from L1
if (par != 0xffffffffu) {
@PARENT@}
}
grid_sync(barrier, &bar_gen);
}
}
@HEAD_PHASE@}
