typedef unsigned int u32;
typedef unsigned long long u64;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// The code of child edge e (its first two come from registers).
#define CHILD(e) ((e) == cb ? c0 : (e) == cb + 1u ? c1 : child_rows[e])

// Loads the child range and first two child codes of node begin + rep (if
// the level has it): the next level's, issued before its barrier, or a
// waiting thread's further nodes of the level.
__device__ __forceinline__ void prefetch_node(u32 begin, u32 len, u32 rep, const u32* child_offsets,
                                              const u32* child_rows, u32* cb, u32* ce, u32* c0,
                                              u32* c1) {
    if (rep < len) {
        const u32 n = begin + rep;
        *cb = child_offsets[n];
        *ce = child_offsets[n + 1];
        *c0 = *cb < *ce ? child_rows[*cb] : 0u;
        *c1 = *cb + 1u < *ce ? child_rows[*cb + 1u] : 0u;
    }
}

// Grid-wide barrier for a cooperative launch. Thread 0 of each block
// arrives on bar[0] with release semantics (cumulative over the block's
// stores, which __syncthreads ordered before it); the last to arrive
// resets the count and publishes generation *gen + 1 in bar[1] (release);
// the others wait for it with acquire loads. *gen is the block's own copy
// of the generation (read once at kernel start, before any block can
// arrive), so a barrier costs no load before arriving.
__device__ __forceinline__ u32 barrier_generation(const u32* bar) {
    u32 g;
    asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(g) : "l"(bar + 1) : "memory");
    return g;
}

// Per-node completion counters (dataflow order): the warps (or blocks)
// of a node's units each add one with release semantics after its stores
// (lane 0 stored, or a block barrier ordered the stores before thread 0);
// a reader polls with relaxed loads until all have arrived, then an
// acquire fence orders its own later loads of the node's rows after every
// unit's stores.
__device__ __forceinline__ void signal_done(u32* counter) {
    asm volatile("red.release.gpu.global.add.u32 [%0], 1;" :: "l"(counter) : "memory");
}

__device__ __forceinline__ u32 load_relaxed(const u32* counter) {
    u32 now;
    asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(now) : "l"(counter) : "memory");
    return now;
}

__device__ __forceinline__ void acquire_fence() {
    asm volatile("fence.acq_rel.gpu;" ::: "memory");
}

__device__ __forceinline__ void wait_count(const u32* counter, u32 arrivals) {
    while (load_relaxed(counter) < arrivals) {
    }
}

// Waits for every internal child (code below num_internal) of a node:
// the first two children's counters are loaded together, so ready
// children cost one round trip. The caller fences once after its waits.
__device__ __forceinline__ void wait_children(const u32* counters, u32 cb, u32 ce, u32 c0, u32 c1,
                                              const u32* child_rows, u32 num_internal,
                                              u32 arrivals) {
    const bool w0 = cb < ce && c0 < num_internal, w1 = cb + 1u < ce && c1 < num_internal;
    u32 v0 = w0 ? load_relaxed(counters + c0) : arrivals;
    u32 v1 = w1 ? load_relaxed(counters + c1) : arrivals;
    while (v0 < arrivals) v0 = load_relaxed(counters + c0);
    while (v1 < arrivals) v1 = load_relaxed(counters + c1);
    for (u32 e = cb + 2u; e < ce; ++e) {
        const u32 c = child_rows[e];
        if (c < num_internal) wait_count(counters + c, arrivals);
    }
}

__device__ __forceinline__ void grid_sync(u32* bar, u32* gen) {
    __syncthreads();
    if (threadIdx.x == 0) {
        const u32 next = *gen + 1u;
        u32 old, now;
        asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(old) : "l"(bar) : "memory");
        if (old == gridDim.x - 1) {
            asm volatile("st.relaxed.gpu.global.u32 [%0], 0;" :: "l"(bar) : "memory");
            asm volatile("st.release.gpu.global.u32 [%0], %1;" :: "l"(bar + 1), "r"(next) : "memory");
        } else {
            do {
                asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(now) : "l"(bar + 1) : "memory");
            } while (now != next);
        }
        *gen = next;
    }
    __syncthreads();
}
