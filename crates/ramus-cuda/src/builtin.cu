// Built-in kernels of the CUDA batched engine: the data movement and
// reductions that are not elementwise (elementwise work is generated per
// fused group by the fusion pass). Compiled once per device through the
// kernel cache. Indices are 32-bit; NONE marks "no row" (a missing child:
// the gathered row is zero; a skipped destination).

typedef unsigned int u32;
typedef unsigned long long u64;

#define NONE 0xffffffffu

#define FOR_EACH(i, n)                                                       \
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (u64)(n);   \
         i += (u64)gridDim.x * blockDim.x)

// One row movement: for r < rows, row dst_rows[r] (or r) of dst receives
// row src_rows[r] (or r) of src, overwriting or adding.
struct RowMove {
    float* dst;
    const float* src;
    const u32* dst_rows;  // null: identity
    const u32* src_rows;  // null: identity
    u32 rows;
    u32 width;
    u32 accumulate;       // 1: atomicAdd into dst
    u32 pad_;
};

#define MAX_MOVES 8

struct RowMoves {
    RowMove m[MAX_MOVES];
};

// Up to MAX_MOVES independent row movements in one launch (blockIdx.y
// picks one): the per-task gather of every gathered symbol, head inputs,
// child-gradient and embedding-row-gradient accumulation.
extern "C" __global__ void ramus_move_rows(RowMoves moves) {
    const RowMove mv = moves.m[blockIdx.y];
    const u64 n = (u64)mv.rows * mv.width;
    FOR_EACH(i, n) {
        const u32 r = (u32)(i / mv.width);
        const u32 j = (u32)(i % mv.width);
        const u32 s = mv.src_rows ? mv.src_rows[r] : r;
        const u32 d = mv.dst_rows ? mv.dst_rows[r] : r;
        if (d == NONE) continue;
        const float v = s == NONE ? 0.0f : mv.src[(u64)s * mv.width + j];
        float* out = mv.dst + (u64)d * mv.width + j;
        if (mv.accumulate) {
            atomicAdd(out, v);
        } else {
            *out = v;
        }
    }
}

// dst[r, dst_col + j] = src[r, src_col + j] for j < cols (concat, slice, pad).
extern "C" __global__ void ramus_copy_columns(float* dst, u32 dst_width, u32 dst_col,
                                              const float* __restrict__ src, u32 src_width,
                                              u32 src_col, u32 cols, u32 rows) {
    FOR_EACH(i, (u64)rows * cols) {
        const u64 r = i / cols;
        const u32 j = (u32)(i % cols);
        dst[r * dst_width + dst_col + j] = src[r * src_width + src_col + j];
    }
}

extern "C" __global__ void ramus_fill(float* dst, u64 n, float value) {
    FOR_EACH(i, n) { dst[i] = value; }
}

// dst[i] += src[i] (parameter-gradient accumulation).
extern "C" __global__ void ramus_add_into(float* dst, const float* __restrict__ src, u64 n) {
    FOR_EACH(i, n) { dst[i] += src[i]; }
}

// Child sum: vertex row r of the run sums its edge rows
// offsets[r] - edge_base .. offsets[r + 1] - edge_base (CSR, absolute
// offsets of the function's rows; deterministic order). Edge row e is read
// at src[e * src_stride + src_offset ..] (a column window of a wider value).
extern "C" __global__ void ramus_sum_children(float* dst, const float* __restrict__ src,
                                              const u32* __restrict__ offsets, u32 edge_base,
                                              u32 rows, u32 width, u32 src_stride,
                                              u32 src_offset) {
    FOR_EACH(i, (u64)rows * width) {
        const u32 r = (u32)(i / width);
        const u32 j = (u32)(i % width);
        float acc = 0.0f;
        for (u32 e = offsets[r] - edge_base; e < offsets[r + 1] - edge_base; ++e) {
            acc += src[(u64)e * src_stride + src_offset + j];
        }
        dst[i] = acc;
    }
}

// Each edge row of the run copies its parent's vertex row
// (parent[e] - row_base).
extern "C" __global__ void ramus_expand_children(float* dst, const float* __restrict__ src,
                                                 const u32* __restrict__ parent, u32 row_base,
                                                 u32 edges, u32 width) {
    FOR_EACH(i, (u64)edges * width) {
        const u64 e = i / width;
        const u32 j = (u32)(i % width);
        dst[i] = src[(u64)(parent[e] - row_base) * width + j];
    }
}

// dst[j] = scale * sum_r src[r, j]. Blocks of 32 columns x 8 row lanes;
// lanes reduce through shared memory in a fixed order (deterministic).
extern "C" __global__ void ramus_sum_rows(float* dst, const float* __restrict__ src, u32 rows,
                                          u32 width, float scale) {
    __shared__ float part[8][33];
    const u32 col = blockIdx.x * 32 + threadIdx.x;
    float acc = 0.0f;
    if (col < width) {
        for (u32 r = threadIdx.y; r < rows; r += 8) {
            acc += src[(u64)r * width + col];
        }
    }
    part[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0 && col < width) {
        float total = 0.0f;
        for (int y = 0; y < 8; ++y) total += part[y][threadIdx.x];
        dst[col] = total * scale;
    }
}

// dst[r, j] = scale * src[j].
extern "C" __global__ void ramus_broadcast_rows(float* dst, const float* __restrict__ src,
                                                u32 rows, u32 width, float scale) {
    FOR_EACH(i, (u64)rows * width) { dst[i] = src[i % width] * scale; }
}

// Block-wide reductions over 128 threads (4 warps).
__device__ float block_max(float v, float* scratch) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
    __syncthreads();
    v = fmaxf(fmaxf(scratch[0], scratch[1]), fmaxf(scratch[2], scratch[3]));
    __syncthreads();
    return v;
}

__device__ float block_sum(float v, float* scratch) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
    __syncthreads();
    v = (scratch[0] + scratch[1]) + (scratch[2] + scratch[3]);
    __syncthreads();
    return v;
}

// Max and sum of exp(x - max) of one row, reduced over the block.
__device__ void row_softmax_stats(const float* row, u32 classes, float* scratch, float* max_out,
                                  float* sum_out) {
    float m = __int_as_float(0xff800000);  // -inf
    for (u32 j = threadIdx.x; j < classes; j += blockDim.x) m = fmaxf(m, row[j]);
    m = block_max(m, scratch);
    float s = 0.0f;
    for (u32 j = threadIdx.x; j < classes; j += blockDim.x) s += expf(row[j] - m);
    *sum_out = block_sum(s, scratch);
    *max_out = m;
}

// Softmax cross-entropy, one 128-thread block per row: loss[r] =
// logsumexp(x[r]) - x[r, label[r]] (labels checked on the host).
extern "C" __global__ void ramus_softmax_xent(float* loss, const float* __restrict__ x,
                                              const u32* __restrict__ labels, u32 rows,
                                              u32 classes) {
    __shared__ float scratch[4];
    for (u32 r = blockIdx.x; r < rows; r += gridDim.x) {
        const float* row = x + (u64)r * classes;
        float m, s;
        row_softmax_stats(row, classes, scratch, &m, &s);
        if (threadIdx.x == 0) loss[r] = logf(s) + m - row[labels[r]];
    }
}

// Its gradient: dx[r, j] = up[r] * (softmax(x[r])_j - [j == label[r]]).
extern "C" __global__ void ramus_softmax_xent_backward(float* dx, const float* __restrict__ x,
                                                       const u32* __restrict__ labels,
                                                       const float* __restrict__ up, u32 rows,
                                                       u32 classes) {
    __shared__ float scratch[4];
    for (u32 r = blockIdx.x; r < rows; r += gridDim.x) {
        const float* row = x + (u64)r * classes;
        float m, s;
        row_softmax_stats(row, classes, scratch, &m, &s);
        const float inv = 1.0f / s;
        const float g = up[r];
        for (u32 j = threadIdx.x; j < classes; j += blockDim.x) {
            const float p = expf(row[j] - m) * inv;
            dx[(u64)r * classes + j] = g * (p - (j == labels[r] ? 1.0f : 0.0f));
        }
    }
}
