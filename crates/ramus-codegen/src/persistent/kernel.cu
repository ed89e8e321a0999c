#define VP_NONE 0xffffffffu

// The barrier poll: a relaxed load (an acquire load would invalidate the
// SM's L1 on every iteration); the waiter acquires once when it has seen
// the count.
__device__ __forceinline__ unsigned vp_load_relaxed(const unsigned* p) {
    unsigned v;
    asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// A barrier's count read with acquire semantics: it synchronizes with every
// release-add that the count it reads includes (they are read-modify-writes
// of one location, a release sequence), so the signalling CTAs' writes are
// visible after it.
__device__ __forceinline__ unsigned vp_load_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// Adds one to a barrier's count with release semantics: the block's writes
// before it (ordered by the block barrier before the call) are visible to a
// CTA that acquires the count.
__device__ __forceinline__ void vp_signal_release(unsigned* p) {
    asm volatile("red.release.gpu.global.add.u32 [%0], 1;" :: "l"(p) : "memory");
}

// One parameter element's optimizer step (the rule is VP_RULE) on values in
// registers: `m1` and `m2` are its moments, updated in place (SGD uses
// neither, Adagrad only `m2`).
__device__ __forceinline__ float vp_step(float wv, float gv, float& m1, float& m2,
                                         float lr, float weight_decay, float beta1, float beta2,
                                         float eps, float inv_bc1, float inv_bc2) {
#if VP_RULE == 0
    gv = gv + weight_decay * wv;
    return wv - lr * gv;
#elif VP_RULE == 1
    gv = gv + weight_decay * wv;
    m2 = m2 + gv * gv;
    return wv - lr * gv / (sqrtf(m2) + eps);
#else
    m1 = beta1 * m1 + (1.0f - beta1) * gv;
    m2 = beta2 * m2 + (1.0f - beta2) * gv * gv;
    wv = wv - lr * weight_decay * wv;
    return wv - lr * (m1 * inv_bc1) / (sqrtf(m2 * inv_bc2) + eps);
#endif
}

// Raises the batch's fault word (see `fault_at`) unless every value the
// thread's update wrote was finite.
__device__ __forceinline__ void vp_report_finite(bool finite, float* pool, unsigned fault_at) {
    if (!finite && fault_at != VP_NONE) atomicOr(reinterpret_cast<unsigned*>(pool) + fault_at, 1u);
}

// The step of one element in the pool, whose moments are at `first` and
// `second`.
__device__ __forceinline__ float vp_update(float wv, float gv, float* first, float* second,
                                           float lr, float weight_decay, float beta1, float beta2,
                                           float eps, float inv_bc1, float inv_bc2) {
    float m1 = VP_RULE == 2 ? *first : 0.0f, m2 = VP_RULE >= 1 ? *second : 0.0f;
    wv = vp_step(wv, gv, m1, m2, lr, weight_decay, beta1, beta2, eps, inv_bc1, inv_bc2);
    if (VP_RULE == 2) *first = m1;
    if (VP_RULE >= 1) *second = m2;
    return wv;
}

// An asynchronous 4-byte copy from pool[at] into shared memory (zeros where
// `ok` is false; nothing is read then), in the thread's current group.
__device__ __forceinline__ void vp_copy_async(float* dst, const float* pool, unsigned at, bool ok) {
    const unsigned to = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n"
                 :: "r"(to), "l"(ok ? pool + at : pool), "r"(ok ? 4 : 0) : "memory");
}

__device__ __forceinline__ void vp_copy_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// Waits until at most `pending` of the thread's groups are in flight.
template <int pending>
__device__ __forceinline__ void vp_copy_wait() {
    asm volatile("cp.async.wait_group %0;\n" :: "n"(pending) : "memory");
}

__device__ __forceinline__ float vp_warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// The warp's sums of VP_G values at once: lane l ends with the sum of
// v[l / (32 / VP_G)] over all lanes. Each halving step exchanges half of a
// lane's remaining values with the lane `o` apart (the upper lane keeps the
// upper half), then plain butterfly steps finish each group of 32 / VP_G
// lanes.
__device__ __forceinline__ float vp_transposed_sum(float (&v)[VP_G], unsigned lane) {
#pragma unroll
    for (int h = VP_G / 2, o = 16; h >= 1; h /= 2, o /= 2) {
        const bool upper = (lane & o) != 0;
#pragma unroll
        for (int i = 0; i < h; ++i) {
            const float keep = upper ? v[i + h] : v[i];
            const float give = upper ? v[i] : v[i + h];
            v[i] = keep + __shfl_xor_sync(0xffffffffu, give, o);
        }
    }
    float s = v[0];
#pragma unroll
    for (int o = 16 / VP_G; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    return s;
}

// A wide product instruction as a tiled GEMM, its output tiles dealt
// round-robin over the processors (`rank` of `ranks`); the weights
// are read from the master copy in the pool (the registers' values: only
// the batch's last step writes it). `m` is the matrix's table entry, `list`
// the instruction's `count` items. With M × N outputs reduced over K:
//   MATVEC    y_i  = W x_i (+ b_i)   M = items, N = rows, K = cols
//   MATVEC_T  dx_i += W^T dy_i      M = items, N = cols, K = rows (atomic)
//   OUTER     G   += sum_i dy_i x_i^T M = rows, N = cols, K = items, split
//             into chunks of VP_OUTER_CHUNK items that add atomically into
//             the gradient accumulator in the pool
// With fewer output tiles than `ranks`, MATVEC and MATVEC_T split K into
// ranks / tiles pieces that add atomically (y then starts at zero; the
// first piece adds the bias).
// 256 threads, a VP_BT x VP_BT tile, 4 x 4 outputs per thread, operands
// copied VP_BK deep into VP_STAGES shared buffers, the next steps' copies
// in flight while a step is computed.
__device__ __forceinline__ void vp_wide_product(
    unsigned op, const unsigned* __restrict__ m, unsigned count, const unsigned* list,
    float* pool, unsigned rank, unsigned ranks, float* stage)
{
    const unsigned rows = m[0], cols = m[1], value = m[2], grad = m[5];
    const bool outer = op == OP_OUTER;
    const unsigned M = outer ? rows : count;
    const unsigned N = op == OP_MATVEC ? rows : cols;
    const unsigned K = op == OP_MATVEC ? cols : (op == OP_MATVEC_T ? rows : count);
    const unsigned tiles_m = (M + VP_BT - 1) / VP_BT, tiles_n = (N + VP_BT - 1) / VP_BT;
    // the reduction's splits (see `wide_tiles` on the host): an outer
    // product's item chunks, or a product's share of the processors per
    // output tile, each split VP_BK-aligned
    unsigned splits, depth;
    if (outer) {
        depth = VP_OUTER_CHUNK;
        splits = (K + depth - 1) / depth;
    } else {
        splits = max(1u, ranks / (tiles_m * tiles_n));
        depth = ((K + splits - 1) / splits + VP_BK - 1) / VP_BK * VP_BK;
        splits = (K + depth - 1) / depth;
    }
    const unsigned tiles = tiles_m * tiles_n * splits;
    // VP_STAGES buffers of two operand tiles, [VP_BK][VP_BT + 4] each (the
    // padding keeps the stores' banks apart and the rows 16-byte aligned
    // for the float4 reads), then the items' offsets
    unsigned* const items = (unsigned*)(stage + VP_STAGES * VP_GEMM_BUFFER);
    const unsigned tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
    for (unsigned t = rank; t < tiles; t += ranks) {
        const unsigned split = t % splits, tile = t / splits;
        const unsigned m0 = (tile / tiles_n) * VP_BT, n0 = (tile % tiles_n) * VP_BT;
        const unsigned k_lo = split * depth;
        const unsigned k_hi = min(K, k_lo + depth);
        __syncthreads(); // the previous tile is done with the stage
        // the tile's items: its rows' (x, y, bias) or its chunk's (dy, x)
        if (outer) {
            for (unsigned e = tid; e < 2 * (k_hi - k_lo); e += VP_THREADS)
                items[e] = list[VP_ITEM * (k_lo + e / 2) + e % 2];
        } else {
            for (unsigned e = tid; e < 3 * VP_BT; e += VP_THREADS)
                items[e] = m0 + e / 3 < count ? list[VP_ITEM * (m0 + e / 3) + e % 3] : VP_NONE;
        }
        __syncthreads();
        // copies this thread's four elements of each operand tile at depth
        // k0 into buffer `b`, asynchronously (zeros outside the operands)
        auto issue = [&](unsigned k0, unsigned b) {
            float* const as = stage + b * VP_GEMM_BUFFER;
            float* const bs = as + VP_BK * (VP_BT + 4);
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const unsigned e = tid + VP_THREADS * q;
                if (outer) {
                    const unsigned kk = e / VP_BT, mm = e % VP_BT, k = k0 + kk;
                    const unsigned dy = k < k_hi ? items[2 * (k - k_lo)] : VP_NONE;
                    const unsigned x = k < k_hi ? items[2 * (k - k_lo) + 1] : VP_NONE;
                    vp_copy_async(as + kk * (VP_BT + 4) + mm, pool, dy + m0 + mm, dy != VP_NONE && m0 + mm < M);
                    vp_copy_async(bs + kk * (VP_BT + 4) + mm, pool, x + n0 + mm, x != VP_NONE && n0 + mm < N);
                } else {
                    // A: row mm of the items, k-contiguous
                    const unsigned mm = e / VP_BK, kk = e % VP_BK;
                    const unsigned src = items[3 * mm];
                    vp_copy_async(as + kk * (VP_BT + 4) + mm, pool, src + k0 + kk,
                                  src != VP_NONE && k0 + kk < K);
                    if (op == OP_MATVEC) {
                        // B(k, n) = W[n][k]: k-contiguous too
                        vp_copy_async(bs + kk * (VP_BT + 4) + mm, pool, value + (n0 + mm) * cols + k0 + kk,
                                      n0 + mm < N && k0 + kk < K);
                    } else {
                        // B(k, n) = W[k][n]: n-contiguous
                        const unsigned kb = e / VP_BT, nb = e % VP_BT;
                        vp_copy_async(bs + kb * (VP_BT + 4) + nb, pool, value + (k0 + kb) * cols + n0 + nb,
                                      k0 + kb < K && n0 + nb < N);
                    }
                }
            }
        };
        float acc[4][4];
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;
        // VP_STAGES - 1 steps in flight ahead of the one computed: hides the
        // load latency (docs/benchmarks.md#persistent-kernel-gemm-pipeline-depth)
        const unsigned steps = (k_hi - k_lo + VP_BK - 1) / VP_BK;
#pragma unroll
        for (unsigned s = 0; s + 1 < VP_STAGES; ++s) {
            if (s < steps) issue(k_lo + s * VP_BK, s);
            vp_copy_commit();
        }
        for (unsigned step = 0; step < steps; ++step) {
            // this step's copies are done (the groups after it may still
            // fly) and every thread is past the step before, whose buffer
            // is reused
            vp_copy_wait<VP_STAGES - 2>();
            __syncthreads();
            const unsigned ahead = step + VP_STAGES - 1;
            if (ahead < steps) issue(k_lo + ahead * VP_BK, ahead % VP_STAGES);
            vp_copy_commit();
            const float* const as = stage + (step % VP_STAGES) * VP_GEMM_BUFFER;
            const float* const bs = as + VP_BK * (VP_BT + 4);
#pragma unroll
            for (int k = 0; k < VP_BK; ++k) {
                const float4 a = *(const float4*)(as + k * (VP_BT + 4) + 4 * ty);
                const float4 b = *(const float4*)(bs + k * (VP_BT + 4) + 4 * tx);
                const float av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
                for (int i = 0; i < 4; ++i)
#pragma unroll
                    for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
            }
        }
// 16-byte atomics need sm_90
#if VP_VECTOR_EPILOGUE && __CUDA_ARCH__ >= 900
        // each thread's row quads, one 16-byte atomic (or store) where the
        // quad is whole and aligned: a quarter of the atomics
        // (docs/benchmarks.md#persistent-kernel-vector-epilogue)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const unsigned mi = 4 * ty + i, row = m0 + mi, n = n0 + 4 * tx;
            if (row >= M || n >= N) continue;
            // the quad's row: the gradient's, the output's or the input
            // gradient's; a product's output added to (split) or stored
            unsigned dst = outer ? grad + row * cols : items[3 * mi + 1];
            if (dst == VP_NONE) continue;
            dst += n;
            float v[4] = {acc[i][0], acc[i][1], acc[i][2], acc[i][3]};
            bool add = true;
            if (op == OP_MATVEC) {
                // split: the output starts at zero (the lowering places
                // forward products in the zeroed region)
                add = splits > 1;
                const unsigned bias = items[3 * mi + 2];
                if (bias != VP_NONE && split == 0) {
#pragma unroll
                    for (int j = 0; j < 4; ++j) v[j] += n + j < N ? pool[bias + n + j] : 0.0f;
                }
            }
            if (n + 3 < N && (dst & 3u) == 0) {
                const float4 q = make_float4(v[0], v[1], v[2], v[3]);
                if (add) atomicAdd((float4*)(pool + dst), q);
                else *(float4*)(pool + dst) = q;
            } else {
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    if (n + j >= N) continue;
                    if (add) atomicAdd(pool + dst + j, v[j]);
                    else pool[dst + j] = v[j];
                }
            }
        }
#else
        // each thread's 16 outputs, one scalar atomic (or store) each
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const unsigned mi = 4 * ty + i, row = m0 + mi;
            if (row >= M) continue;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const unsigned n = n0 + 4 * tx + j;
                if (n >= N) continue;
                if (outer) {
                    atomicAdd(pool + grad + row * cols + n, acc[i][j]);
                } else if (op == OP_MATVEC) {
                    const unsigned y = items[3 * mi + 1], bias = items[3 * mi + 2];
                    if (y == VP_NONE) continue;
                    const float v = acc[i][j] + (bias != VP_NONE && split == 0 ? pool[bias + n] : 0.0f);
                    // split: the output starts at zero (the lowering
                    // places forward products in the zeroed region)
                    if (splits > 1) atomicAdd(pool + y + n, v);
                    else pool[y + n] = v;
                } else {
                    const unsigned dx = items[3 * mi + 1];
                    if (dx != VP_NONE) atomicAdd(pool + dx + n, acc[i][j]);
                }
            }
        }
#endif
    }
}

extern "C" __global__ void __launch_bounds__(VP_THREADS, VP_CTAS_PER_SM) vpps_train(
    float* pool, const unsigned* __restrict__ script,
    unsigned* barriers, const unsigned* __restrict__ parts, const unsigned* __restrict__ mats,
    unsigned prefix_at, unsigned scripts_at, unsigned expect_at, unsigned operands_at,
    float lr, float weight_decay, float beta1, float beta2, float eps,
    float inv_bc1, float inv_bc2, float clip, unsigned flush_grads, unsigned fault_at)
{
    __shared__ unsigned code[VP_SMEM_WORDS];
    // the products' stage: a transposed product's round (rows of dx sums
    // and the held rows' dy), or a wide product's GEMM tiles
    __shared__ __align__(16) float vp_stage[VP_STAGE_FLOATS];
    // a transposed product's warps' rows of sums and its pairs' held dy
    float* const vp_sums = vp_stage;
    float* const vp_dy = vp_stage + VP_TB * VP_WARPS * VP_TK * VP_WARP;
    // a product's staged inputs and its held rows' biases
    float* const vp_xs = vp_stage;
    float* const vp_bias = vp_stage + VP_SX * VP_COLS;
    // per partition: its matrix and first row (for the held-row loads)
    __shared__ unsigned vp_mat[VP_P], vp_first[VP_P];
    const unsigned lane = threadIdx.x % VP_WARP;
    const unsigned warp = threadIdx.x / VP_WARP;
    const unsigned cta = blockIdx.x;
    if (threadIdx.x < VP_P) {
        vp_mat[threadIdx.x] = parts[(cta * VP_P + threadIdx.x) * 2];
        vp_first[threadIdx.x] = parts[(cta * VP_P + threadIdx.x) * 2 + 1];
    }
    // index arrays (labels, row lists, child offsets) live in the pool as u32
    const unsigned* upool = (const unsigned*)pool;

    // ---- register partitions: this warp's rows of each partition. Its
    // matrix and first row are read from shared memory at each use (see
    // `vp_mat`): held in registers through the interpreter, they cost the
    // registers that kept the wide products' 16-byte epilogue from spilling
#define VP_PM(p) vp_mat[p]
#define VP_PROW(p) (vp_first[p] + warp * VP_R)
    float w[VP_P][VP_R][VP_K];
#if VP_GRADS
    float g[VP_P][VP_R][VP_K];
#endif
#pragma unroll
    for (int p = 0; p < VP_P; ++p) {
        const unsigned pm = parts[(cta * VP_P + p) * 2];
        const unsigned prow = parts[(cta * VP_P + p) * 2 + 1] + warp * VP_R;
        unsigned rows = 0, cols = 0, value = 0;
        if (pm != VP_NONE) {
            rows = mats[pm * VP_MAT_WORDS];
            cols = mats[pm * VP_MAT_WORDS + 1];
            value = mats[pm * VP_MAT_WORDS + 2];
        }
#pragma unroll
        for (int r = 0; r < VP_R; ++r) {
            const unsigned row = prow + r;
#pragma unroll
            for (int k = 0; k < VP_K; ++k) {
                const unsigned col = lane + VP_WARP * k;
                w[p][r][k] = (row < rows && col < cols) ? pool[value + row * cols + col] : 0.0f;
#if VP_GRADS
                g[p][r][k] = 0.0f;
#endif
            }
        }
    }

    // every thread reads the partitions' matrices and first rows from here
    // on (`VP_PM`, `VP_PROW`), a CTA with no instructions too (it still
    // flushes its register gradients)
    __syncthreads();

    // ---- the script interpreter
    const unsigned begin = script[prefix_at + cta];
    const unsigned end = script[prefix_at + cta + 1];
    unsigned pos = begin;
#if VP_TRACE
    unsigned* trace = barriers + VP_TRACE_AT + cta * VP_TRACE_WORDS;
    unsigned traced = 0;
#endif
    while (pos < end) {
        const unsigned n = min(end - pos, (unsigned)VP_SMEM_WORDS);
        __syncthreads();
        for (unsigned i = threadIdx.x; i < n; i += blockDim.x) code[i] = script[scripts_at + pos + i];
        __syncthreads();
        unsigned at = 0;
        while (at < n) {
            const unsigned pre = code[at];
            const unsigned len = (pre >> 8) & 0xffu;
            if (len == 0 || at + len > n) break;
            const unsigned op = pre & 0xffu;
            const unsigned arg = pre >> 16;
            const unsigned* operand = code + at + 1;
#if VP_TRACE
            unsigned long long started;
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(started));
#endif
            switch (op) {
            case OP_SIGNAL:
                __syncthreads();
                if (threadIdx.x == 0) vp_signal_release(barriers + arg);
                break;
            case OP_WAIT:
                if (threadIdx.x == 0) {
                    const unsigned want = script[expect_at + arg];
                    while (vp_load_relaxed(barriers + arg) < want) { }
                    (void)vp_load_acquire(barriers + arg);
                }
                __syncthreads();
                break;
            case OP_MATVEC:
            case OP_MATVEC_T:
            case OP_OUTER: {
                if (operand[0] & VP_WIDE_ITEMS) {
                    // a GEMM dealt over a range of processors, this one
                    // of them: `first | n << 16`, VPPs first.. (mod grid)
                    const bool inline_items = (operand[0] & VP_INLINE_ITEMS) != 0;
                    const unsigned count = operand[0] & ~(VP_INLINE_ITEMS | VP_WIDE_ITEMS);
                    const unsigned first = operand[1] & 0xffffu, ranks = operand[1] >> 16;
                    const unsigned* list = inline_items ? operand + 2 : script + operands_at + operand[2];
                    vp_wide_product(op, mats + arg * VP_MAT_WORDS, count, list, pool,
                                    (cta + gridDim.x - first) % gridDim.x, ranks, vp_stage);
                    break;
                }
                bool holds = false;
#pragma unroll
                for (int p = 0; p < VP_P; ++p) holds = holds || VP_PM(p) == arg;
                if (!holds) break;
                const unsigned rows = mats[arg * VP_MAT_WORDS];
                const unsigned cols = mats[arg * VP_MAT_WORDS + 1];
                // the items: inside the instruction (shared memory) or in
                // the operand pool
                const bool inline_items = (operand[0] & VP_INLINE_ITEMS) != 0;
                const unsigned count = operand[0] & ~VP_INLINE_ITEMS;
                const unsigned* list = inline_items ? operand + 1 : script + operands_at + operand[1];
                // the held row h of this block (partition, warp, row)
                // holds matrix row vp_first[p] + w * VP_R + r
#define VP_HELD_ROW(h) (vp_first[(h) / (VP_WARPS * VP_R)] + ((h) / VP_R) % VP_WARPS * VP_R + (h) % VP_R)
#define VP_HELD_HERE(h) (vp_mat[(h) / (VP_WARPS * VP_R)] == arg && VP_HELD_ROW(h) < rows)
                if (op == OP_MATVEC_T) {
                    // dx += W^T dy over the held rows, VP_S pairs per
                    // round: the block stages the held rows' dy in shared
                    // memory; then, VP_TB pairs at a time, every warp
                    // writes its rows' sums to its own shared row (VP_TK
                    // registers' columns at a time) and the block adds
                    // the warps' rows into the pool, one atomic per
                    // column. (Adding the warps' sums with shared-memory
                    // atomics instead serialized them: a float atomic on
                    // shared memory is a compare-and-swap loop, and all
                    // warps hit the same columns.)
                    for (unsigned v0 = 0; v0 < count; v0 += VP_S) {
                        const unsigned n = min((unsigned)VP_S, count - v0);
                        __syncthreads();
                        for (unsigned e = threadIdx.x; e < n * VP_HELD; e += VP_THREADS) {
                            const unsigned j = e / VP_HELD, h = e % VP_HELD;
                            const unsigned dy = list[VP_ITEM * (v0 + j)];
                            vp_dy[e] = (VP_HELD_HERE(h) && dy != VP_NONE) ? pool[dy + VP_HELD_ROW(h)] : 0.0f;
                        }
                        __syncthreads();
                        for (unsigned j0 = 0; j0 < n; j0 += VP_TB) {
                            float acc[VP_TB][VP_K];
#pragma unroll
                            for (int t = 0; t < VP_TB; ++t) {
#pragma unroll
                                for (int k = 0; k < VP_K; ++k) acc[t][k] = 0.0f;
                                if (j0 + t >= n) continue;
                                const float* held = vp_dy + (j0 + t) * VP_HELD + warp * VP_R;
#pragma unroll
                                for (int p = 0; p < VP_P; ++p) {
                                    if (VP_PM(p) != arg) continue;
#pragma unroll
                                    for (int r = 0; r < VP_R; ++r) {
                                        const float d = held[p * VP_WARPS * VP_R + r];
#pragma unroll
                                        for (int k = 0; k < VP_K; ++k) acc[t][k] = fmaf(d, w[p][r][k], acc[t][k]);
                                    }
                                }
                            }
#pragma unroll
                            for (int k0 = 0; k0 < VP_K; k0 += VP_TK) {
                                // this warp's row of pair t: vp_sums[t][warp][kk * 32 + lane]
#pragma unroll
                                for (int t = 0; t < VP_TB; ++t)
#pragma unroll
                                    for (int kk = 0; kk < VP_TK && k0 + kk < VP_K; ++kk)
                                        vp_sums[(t * VP_WARPS + warp) * VP_TK * VP_WARP + kk * VP_WARP + lane] = acc[t][k0 + kk];
                                __syncthreads();
                                const unsigned width = min((unsigned)VP_TK, (unsigned)(VP_K - k0)) * VP_WARP;
                                for (unsigned e = threadIdx.x; e < VP_TB * width; e += VP_THREADS) {
                                    const unsigned t = e / width, c = e % width, col = k0 * VP_WARP + c;
                                    if (j0 + t >= n || col >= cols) continue;
                                    const unsigned dx = list[VP_ITEM * (v0 + j0 + t) + 1];
                                    if (dx == VP_NONE) continue;
                                    float sum = 0.0f;
#pragma unroll
                                    for (int wi = 0; wi < VP_WARPS; ++wi)
                                        sum += vp_sums[(t * VP_WARPS + wi) * VP_TK * VP_WARP + c];
                                    atomicAdd(pool + dx + col, sum);
                                }
                                __syncthreads();
                            }
                        }
                    }
                    break;
                }
                if (op == OP_MATVEC) {
                    // y = W x (+ bias) over the held rows, VP_SX items per
                    // round: the block stages the items' x and the held
                    // rows' biases in shared memory (all loads in flight at
                    // once), then every warp takes VP_G items at a time,
                    // reads x from shared memory, and reduces its rows'
                    // VP_G sums together: each halving step of the
                    // butterfly swaps half of the items, so a lane ends
                    // with one item's sum (item lane / (32 / VP_G)) after
                    // VP_G - 1 + log2(32 / VP_G) shuffles, not 5 per item
                    for (unsigned v0 = 0; v0 < count; v0 += VP_SX) {
                        const unsigned n = min((unsigned)VP_SX, count - v0);
                        __syncthreads();
                        for (unsigned e = threadIdx.x; e < n * VP_COLS; e += VP_THREADS) {
                            const unsigned j = e / VP_COLS, col = e % VP_COLS;
                            const unsigned x = list[VP_ITEM * (v0 + j)];
                            vp_xs[e] = (x != VP_NONE && col < cols) ? pool[x + col] : 0.0f;
                        }
                        for (unsigned e = threadIdx.x; e < n * VP_HELD; e += VP_THREADS) {
                            const unsigned j = e / VP_HELD, h = e % VP_HELD;
                            const unsigned bias = list[VP_ITEM * (v0 + j) + 2];
                            vp_bias[e] = (VP_HELD_HERE(h) && bias != VP_NONE) ? pool[bias + VP_HELD_ROW(h)] : 0.0f;
                        }
                        __syncthreads();
                        for (unsigned j0 = 0; j0 < n; j0 += VP_G) {
                            float acc[VP_P][VP_R][VP_G];
#pragma unroll
                            for (int p = 0; p < VP_P; ++p)
#pragma unroll
                                for (int r = 0; r < VP_R; ++r)
#pragma unroll
                                    for (int i = 0; i < VP_G; ++i) acc[p][r][i] = 0.0f;
#pragma unroll
                            for (int k = 0; k < VP_K; ++k) {
                                float xv[VP_G];
#pragma unroll
                                for (int i = 0; i < VP_G; ++i) xv[i] = vp_xs[(j0 + i) * VP_COLS + lane + VP_WARP * k];
#pragma unroll
                                for (int p = 0; p < VP_P; ++p) {
                                    if (VP_PM(p) != arg) continue;
#pragma unroll
                                    for (int r = 0; r < VP_R; ++r)
#pragma unroll
                                        for (int i = 0; i < VP_G; ++i) acc[p][r][i] = fmaf(w[p][r][k], xv[i], acc[p][r][i]);
                                }
                            }
                            const unsigned item = j0 + lane / (VP_WARP / VP_G);
#pragma unroll
                            for (int p = 0; p < VP_P; ++p) {
                                if (VP_PM(p) != arg) continue;
#pragma unroll
                                for (int r = 0; r < VP_R; ++r) {
                                    const float sum = vp_transposed_sum(acc[p][r], lane);
                                    const unsigned row = VP_PROW(p) + r;
                                    if (lane % (VP_WARP / VP_G) == 0 && item < n && row < rows) {
                                        const unsigned y = list[VP_ITEM * (v0 + item) + 1];
                                        const unsigned h = (p * VP_WARPS + warp) * VP_R + r;
                                        if (y != VP_NONE) pool[y + row] = sum + vp_bias[item * VP_HELD + h];
                                    }
                                }
                            }
                        }
                    }
                    break;
                }
#undef VP_HELD_ROW
#undef VP_HELD_HERE
                // OUTER: (dy, x) pairs, G[row, :] += dy[row] * x, VP_V at
                // a time, their loads all in flight before the arithmetic
                // (one pair's loads are a round trip each, the instruction
                // would be latency-bound)
#if VP_GRADS
                for (unsigned v0 = 0; v0 < count; v0 += VP_V) {
                    float xr[VP_V][VP_K];
                    float d[VP_P][VP_R][VP_V];
#pragma unroll
                    for (int j = 0; j < VP_V; ++j) {
                        const bool ok = v0 + j < count;
                        const unsigned dy = ok ? list[VP_ITEM * (v0 + j)] : VP_NONE;
                        const unsigned x = ok ? list[VP_ITEM * (v0 + j) + 1] : VP_NONE;
#pragma unroll
                        for (int k = 0; k < VP_K; ++k) {
                            const unsigned col = lane + VP_WARP * k;
                            xr[j][k] = (x != VP_NONE && col < cols) ? pool[x + col] : 0.0f;
                        }
#pragma unroll
                        for (int p = 0; p < VP_P; ++p)
#pragma unroll
                            for (int r = 0; r < VP_R; ++r) {
                                const unsigned row = VP_PROW(p) + r;
                                d[p][r][j] = (VP_PM(p) == arg && row < rows && dy != VP_NONE) ? pool[dy + row] : 0.0f;
                            }
                    }
#pragma unroll
                    for (int p = 0; p < VP_P; ++p) {
                        if (VP_PM(p) != arg) continue;
#pragma unroll
                        for (int r = 0; r < VP_R; ++r)
#pragma unroll
                            for (int j = 0; j < VP_V; ++j)
#pragma unroll
                                for (int k = 0; k < VP_K; ++k) g[p][r][k] = fmaf(d[p][r][j], xr[j][k], g[p][r][k]);
                    }
                }
#else
                __trap();
#endif
                break;
            }
            case OP_UPDATE: {
#if VP_GRADS
                bool finite = true;
                // A piece of a row at a time, its loads (the wide outer
                // products' sums, the moments) before its stores: the
                // compiler keeps a pool load after a pool store (they may
                // alias), so loading each element after the previous one's
                // stores would cost a round trip to memory per element, not
                // per piece (docs/benchmarks.md#persistent-kernel-update-loads)
#pragma unroll
                for (int p = 0; p < VP_P; ++p) {
                    if (VP_PM(p) == VP_NONE) continue;
                    const unsigned* m = mats + VP_PM(p) * VP_MAT_WORDS;
                    const unsigned rows = m[0], cols = m[1], value = m[2], first = m[3], second = m[4];
                    const unsigned grad = m[5];
#pragma unroll
                    for (int r = 0; r < VP_R; ++r) {
                        const unsigned row = VP_PROW(p) + r;
                        if (row >= rows) continue;
                        // `chunk` elements a piece, fewer with more moments
                        // (with CUDA 13.0's ptxas, larger pieces spilled in
                        // plans that did not spill before: whole rows at
                        // h 512, 4 elements with Adam's two moments)
                        constexpr int chunk = VP_RULE == 0 ? 8 : (VP_RULE == 1 ? 4 : 2);
#pragma unroll
                        for (int k0 = 0; k0 < VP_K; k0 += chunk) {
                            float m1[chunk], m2[chunk];
#pragma unroll
                            for (int c = 0; c < chunk && k0 + c < VP_K; ++c) {
                                const unsigned col = lane + VP_WARP * (k0 + c);
                                const unsigned i = row * cols + col;
                                const bool ok = col < cols;
                                g[p][r][k0 + c] += ok ? pool[grad + i] : 0.0f;
                                m1[c] = VP_RULE == 2 && ok ? pool[first + i] : 0.0f;
                                m2[c] = VP_RULE >= 1 && ok ? pool[second + i] : 0.0f;
                            }
#pragma unroll
                            for (int c = 0; c < chunk && k0 + c < VP_K; ++c) {
                                const int k = k0 + c;
                                const unsigned col = lane + VP_WARP * k;
                                if (col >= cols) continue;
                                const unsigned i = row * cols + col;
                                pool[grad + i] = 0.0f;
                                const float wv = vp_step(w[p][r][k], g[p][r][k] * clip, m1[c], m2[c], lr,
                                                         weight_decay, beta1, beta2, eps, inv_bc1, inv_bc2);
                                finite = finite && isfinite(wv);
                                w[p][r][k] = wv;
                                g[p][r][k] = 0.0f;
                                pool[value + i] = wv;
                                if (VP_RULE == 2) pool[first + i] = m1[c];
                                if (VP_RULE >= 1) pool[second + i] = m2[c];
                            }
                        }
                    }
                }
                vp_report_finite(finite, pool, fault_at);
#else
                __trap();
#endif
                break;
            }
            case OP_NOP:
                break;
            case OP_FUSED:
                switch (arg) {
//@FUSED_CASES@
                default: __trap();
                }
                break;
            case OP_ROWS: {
                const unsigned rows = operand[0], width = operand[1];
                const unsigned dst = operand[2], dst_stride = operand[3];
                const unsigned src = operand[4], src_stride = operand[5];
                const unsigned* di = operand[6] == VP_NONE ? 0 : upool + operand[6];
                const unsigned* si = operand[7] == VP_NONE ? 0 : upool + operand[7];
                const unsigned n = rows * width;
                // VP_AHEAD elements per thread at a time, loads first
                for (unsigned e0 = threadIdx.x; e0 < n; e0 += VP_AHEAD * blockDim.x) {
                    float v[VP_AHEAD];
                    unsigned d[VP_AHEAD];
#pragma unroll
                    for (int u = 0; u < VP_AHEAD; ++u) {
                        const unsigned e = e0 + u * blockDim.x;
                        v[u] = 0.0f;
                        d[u] = VP_NONE;
                        if (e >= n) continue;
                        const unsigned i = e / width, c = e % width;
                        if (si == 0) {
                            v[u] = pool[src + i * src_stride + c];
                        } else if (si[i] != VP_NONE) {
                            v[u] = pool[src + ((arg & ROWS_SRC_ABSOLUTE) ? si[i] : si[i] * src_stride) + c];
                        }
                        if (di != 0 && di[i] == VP_NONE) continue;
                        d[u] = dst + (di == 0 ? i * dst_stride
                                              : ((arg & ROWS_DST_ABSOLUTE) ? di[i] : di[i] * dst_stride)) + c;
                    }
#pragma unroll
                    for (int u = 0; u < VP_AHEAD; ++u) {
                        if (d[u] == VP_NONE) continue;
                        if (arg & ROWS_ACCUMULATE) atomicAdd(pool + d[u], v[u]); else pool[d[u]] = v[u];
                    }
                }
                break;
            }
            case OP_SUM_CHILDREN: {
                const unsigned rows = operand[0], width = operand[1], dst = operand[2];
                const unsigned src = operand[3], src_stride = operand[4];
                const unsigned* csr = upool + operand[5];
                const unsigned n = rows * width;
                // VP_AHEAD elements per thread at a time, loads first
                for (unsigned e0 = threadIdx.x; e0 < n; e0 += VP_AHEAD * blockDim.x) {
                    float acc[VP_AHEAD];
#pragma unroll
                    for (int u = 0; u < VP_AHEAD; ++u) {
                        const unsigned e = e0 + u * blockDim.x;
                        acc[u] = 0.0f;
                        if (e >= n) continue;
                        const unsigned i = e / width, c = e % width;
                        for (unsigned k = csr[i]; k < csr[i + 1]; ++k) acc[u] += pool[src + k * src_stride + c];
                    }
#pragma unroll
                    for (int u = 0; u < VP_AHEAD; ++u) {
                        const unsigned e = e0 + u * blockDim.x;
                        if (e < n) pool[dst + e] = acc[u];
                    }
                }
                break;
            }
            case OP_SUM_ROWS: {
                const unsigned rows = operand[0], width = operand[1], dst = operand[2];
                const unsigned src = operand[3], src_stride = operand[4];
                const float scale = __uint_as_float(operand[5]);
                for (unsigned c = threadIdx.x; c < width; c += blockDim.x) {
                    float acc = 0.0f;
                    for (unsigned i = 0; i < rows; ++i) acc += pool[src + i * src_stride + c];
                    if (arg & ROWS_ACCUMULATE) atomicAdd(pool + dst + c, scale * acc);
                    else pool[dst + c] = scale * acc;
                }
                break;
            }
            case OP_BROADCAST_ROWS: {
                const unsigned rows = operand[0], width = operand[1], dst = operand[2], src = operand[3];
                const float scale = __uint_as_float(operand[4]);
                for (unsigned e = threadIdx.x; e < rows * width; e += blockDim.x)
                    pool[dst + e] = scale * pool[src + e % width];
                break;
            }
            case OP_XENT: {
                const unsigned rows = operand[0], classes = operand[1], dst = operand[2], x = operand[3];
                const unsigned* labels = upool + operand[4];
                for (unsigned i = warp; i < rows; i += VP_THREADS / VP_WARP) {
                    const float* row = pool + x + i * classes;
                    float m = __int_as_float(0xff800000);
                    for (unsigned j = lane; j < classes; j += VP_WARP) m = fmaxf(m, row[j]);
#pragma unroll
                    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
                    float sum = 0.0f;
                    for (unsigned j = lane; j < classes; j += VP_WARP) sum += expf(row[j] - m);
                    sum = vp_warp_sum(sum);
                    if (arg == 0) {
                        if (lane == 0) pool[dst + i] = logf(sum) + m - row[labels[i]];
                    } else {
                        const float up = pool[operand[5] + i], inv = 1.0f / sum;
                        for (unsigned j = lane; j < classes; j += VP_WARP)
                            pool[dst + i * classes + j] = up * (expf(row[j] - m) * inv - (j == labels[i] ? 1.0f : 0.0f));
                    }
                }
                break;
            }
            case OP_UPDATE_DENSE: {
                const unsigned rows = operand[0], width = operand[1], value = operand[2], grad = operand[3];
                const unsigned first = operand[4], second = operand[5];
                const unsigned* ri = operand[6] == VP_NONE ? 0 : upool + operand[6];
                bool finite = true;
                for (unsigned e = threadIdx.x; e < rows * width; e += blockDim.x) {
                    const unsigned i = (ri == 0 ? e / width : ri[e / width]) * width + e % width;
                    const float wv = vp_update(pool[value + i], pool[grad + i] * clip, pool + first + i,
                                               pool + second + i, lr, weight_decay, beta1, beta2, eps,
                                               inv_bc1, inv_bc2);
                    pool[value + i] = wv;
                    finite = finite && isfinite(wv);
                    pool[grad + i] = 0.0f;
                }
                vp_report_finite(finite, pool, fault_at);
                break;
            }
            default:
                __trap();
            }
            // the next instruction may read what this one wrote (chained work)
            __syncthreads();
#if VP_TRACE
            if (threadIdx.x == 0 && traced < VP_TRACE_RECORDS) {
                unsigned long long ended;
                asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ended));
                // a product's item count (255: that many or more) in bits 8..15
                const unsigned items = (op == OP_MATVEC || op == OP_MATVEC_T || op == OP_OUTER)
                    ? min(operand[0] & 0xffffu, 255u) : 0u;
                trace[1 + 3 * traced] = op | (items << 8) | (arg << 16);
                trace[2 + 3 * traced] = (unsigned)started;
                trace[3 + 3 * traced] = (unsigned)ended;
                trace[0] = ++traced;
            }
#endif
            at += len;
        }
        if (at == 0) __trap(); // a malformed script: no whole instruction in a round
        pos += at;
    }
#if VP_GRADS
    // a launch before the batch's last (host work follows it): the register
    // gradients join the pool's accumulator, which OP_UPDATE adds in (other
    // CTAs' wide outer products may still add into it: atomically)
    if (flush_grads) {
#pragma unroll
        for (int p = 0; p < VP_P; ++p) {
            if (VP_PM(p) == VP_NONE) continue;
            const unsigned* m = mats + VP_PM(p) * VP_MAT_WORDS;
            const unsigned rows = m[0], cols = m[1], grad = m[5];
#pragma unroll
            for (int r = 0; r < VP_R; ++r) {
                const unsigned row = VP_PROW(p) + r;
                if (row >= rows) continue;
#pragma unroll
                for (int k = 0; k < VP_K; ++k) {
                    const unsigned col = lane + VP_WARP * k;
                    if (col < cols) atomicAdd(pool + grad + row * cols + col, g[p][r][k]);
                }
            }
        }
    }
#endif
}
