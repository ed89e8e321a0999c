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

// dst[i] = a * dst[i] + b * src[i] (parameter-gradient accumulation, and
// the gradients of batches accumulated into a step, each scaled); with a == 0 dst is not read, with b == 0 src
// is not (it may then be dst itself: a scaling in place).
extern "C" __global__ void ramus_scale_add(float* dst, const float* src, u64 n, float a,
                                           float b) {
    FOR_EACH(i, n) {
        dst[i] = (a == 0.0f ? 0.0f : a * dst[i]) + (b == 0.0f ? 0.0f : b * src[i]);
    }
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

// ---------------------------------------------------------------- CNN ops
//
// Images are rows of C*H*W floats in CHW order (`ramus-core/src/ops/cnn.rs`
// gives the exact semantics these kernels match). Every kernel is a gather:
// each output element is written by one thread, so no atomics are needed and
// the summation order is fixed (the CPU's order where it sums in f32).

// Geometry of a convolution (or of the 1x1 "permute" that rearranges
// channel-major rows, see ramus_im2col), passed by value.
struct ConvGeom {
    u32 channels;   // C
    u32 height;     // H
    u32 width;      // W
    u32 kernel_h;
    u32 kernel_w;
    u32 stride;
    u32 padding;
    u32 out_h;      // (H + 2p - kh) / s + 1
    u32 out_w;      // (W + 2p - kw) / s + 1
    u32 pad_;
};

// Lowers `images` images (rows of C*H*W at x) to columns. Element
// (image i, patch row k = (c*kh + ki)*kw + kj, position p = oy*Wo + ox)
// goes to cols[i * image_stride + k * ld + p]: input pixel
// (c, oy*s + ki - pad, ox*s + kj - pad), 0 outside the image.
// image_stride = K*P, ld = P gives one [K, P] matrix per image (the
// forward product); image_stride = P, ld = images*P gives one [K, images*P]
// matrix whose columns are all images' positions (the weight gradient).
extern "C" __global__ void ramus_im2col(float* cols, const float* __restrict__ x, ConvGeom g,
                                        u32 images, u64 image_stride, u64 ld) {
    const u64 np = (u64)g.out_h * g.out_w;
    const u32 taps = g.kernel_h * g.kernel_w;
    const u64 per_image = (u64)g.channels * taps * np;
    const u64 in_len = (u64)g.channels * g.height * g.width;
    FOR_EACH(e, (u64)images * per_image) {
        const u64 i = e / per_image;
        const u64 rest = e % per_image;
        const u32 k = (u32)(rest / np);
        const u32 p = (u32)(rest % np);
        const u32 c = k / taps;
        const u32 ki = (k % taps) / g.kernel_w;
        const u32 kj = k % g.kernel_w;
        const long long iy = (long long)(p / g.out_w) * g.stride + ki - (long long)g.padding;
        const long long ix = (long long)(p % g.out_w) * g.stride + kj - (long long)g.padding;
        float v = 0.0f;
        if (iy >= 0 && iy < (long long)g.height && ix >= 0 && ix < (long long)g.width) {
            v = x[i * in_len + ((u64)c * g.height + (u64)iy) * g.width + (u64)ix];
        }
        cols[i * image_stride + (u64)k * ld + p] = v;
    }
}

// The adjoint of ramus_im2col, one thread per input pixel: pixel (c, iy, ix)
// of image i sums the column entries that im2col read from it, kernel taps
// (ki, kj) in row-major order (the CPU's col2im order): output position
// oy = (iy + pad - ki) / s when that division is exact and oy < Ho, and
// likewise ox. Writes every pixel (0 where nothing reads it).
extern "C" __global__ void ramus_col2im(float* x, const float* __restrict__ cols, ConvGeom g,
                                        u32 images, u64 image_stride, u64 ld) {
    const u64 plane = (u64)g.height * g.width;
    const u64 in_len = (u64)g.channels * plane;
    FOR_EACH(e, (u64)images * in_len) {
        const u64 i = e / in_len;
        const u32 c = (u32)((e % in_len) / plane);
        const u32 iy = (u32)((e % plane) / g.width);
        const u32 ix = (u32)(e % g.width);
        const float* img = cols + i * image_stride;
        float acc = 0.0f;
        for (u32 ki = 0; ki < g.kernel_h; ++ki) {
            const long long ty = (long long)iy + g.padding - ki;
            if (ty < 0 || ty % g.stride != 0 || ty / g.stride >= g.out_h) continue;
            const u32 oy = (u32)(ty / g.stride);
            for (u32 kj = 0; kj < g.kernel_w; ++kj) {
                const long long tx = (long long)ix + g.padding - kj;
                if (tx < 0 || tx % g.stride != 0 || tx / g.stride >= g.out_w) continue;
                const u32 ox = (u32)(tx / g.stride);
                const u64 k = ((u64)c * g.kernel_h + ki) * g.kernel_w + kj;
                acc += img[k * ld + (u64)oy * g.out_w + ox];
            }
        }
        x[e] = acc;
    }
}

// Geometry of a max pooling (square window), passed by value.
struct PoolGeom {
    u32 channels;
    u32 height;
    u32 width;
    u32 kernel;
    u32 stride;
    u32 padding;    // at most kernel / 2, so every window holds an image pixel
    u32 out_h;
    u32 out_w;
};

// Index (into one channel's H*W plane) of the first maximum of output
// position (oy, ox)'s window, scanned in row-major order; padded positions
// never win (the window is clipped to the image, as on the CPU).
__device__ u32 pool_argmax(const float* plane, const PoolGeom& g, u32 oy, u32 ox) {
    const u32 y0 = oy * g.stride >= g.padding ? oy * g.stride - g.padding : 0;
    const u32 y_end = oy * g.stride + g.kernel - g.padding;
    const u32 y1 = y_end < g.height ? y_end : g.height;
    const u32 x0 = ox * g.stride >= g.padding ? ox * g.stride - g.padding : 0;
    const u32 x_end = ox * g.stride + g.kernel - g.padding;
    const u32 x1 = x_end < g.width ? x_end : g.width;
    u32 best = y0 * g.width + x0;
    float best_v = plane[best];
    for (u32 iy = y0; iy < y1; ++iy) {
        for (u32 ix = x0; ix < x1; ++ix) {
            const u32 at = iy * g.width + ix;
            if (plane[at] > best_v) {
                best = at;
                best_v = plane[at];
            }
        }
    }
    return best;
}

// y[r, c, oy, ox] = the maximum of its window of x[r, c].
extern "C" __global__ void ramus_max_pool2d(float* y, const float* __restrict__ x, PoolGeom g,
                                            u32 rows) {
    const u64 out_plane = (u64)g.out_h * g.out_w;
    const u64 in_plane = (u64)g.height * g.width;
    FOR_EACH(e, (u64)rows * g.channels * out_plane) {
        const u64 rc = e / out_plane;  // row * channels + channel
        const u32 oy = (u32)((e % out_plane) / g.out_w);
        const u32 ox = (u32)(e % g.out_w);
        const float* plane = x + rc * in_plane;
        y[e] = plane[pool_argmax(plane, g, oy, ox)];
    }
}

// Its gradient, one thread per input pixel: the sum of dy over the windows
// that contain the pixel and whose (recomputed) first maximum it is, in
// increasing (oy, ox) order, as the CPU adds them.
extern "C" __global__ void ramus_max_pool2d_backward(float* dx, const float* __restrict__ x,
                                                     const float* __restrict__ dy, PoolGeom g,
                                                     u32 rows) {
    const u64 out_plane = (u64)g.out_h * g.out_w;
    const u64 in_plane = (u64)g.height * g.width;
    FOR_EACH(e, (u64)rows * g.channels * in_plane) {
        const u64 rc = e / in_plane;
        const u32 at = (u32)(e % in_plane);
        const long long iy = at / g.width;
        const long long ix = at % g.width;
        const float* plane = x + rc * in_plane;
        const float* grad = dy + rc * out_plane;
        // windows oy*s - pad <= iy < oy*s - pad + kernel
        const long long s = g.stride;
        const long long lo_y = iy + g.padding - g.kernel + 1;
        const long long lo_x = ix + g.padding - g.kernel + 1;
        const long long oy0 = lo_y > 0 ? (lo_y + s - 1) / s : 0;
        const long long ox0 = lo_x > 0 ? (lo_x + s - 1) / s : 0;
        const long long oy1 = (iy + g.padding) / s;  // inclusive
        const long long ox1 = (ix + g.padding) / s;
        float acc = 0.0f;
        for (long long oy = oy0; oy <= oy1 && oy < (long long)g.out_h; ++oy) {
            for (long long ox = ox0; ox <= ox1 && ox < (long long)g.out_w; ++ox) {
                if (pool_argmax(plane, g, (u32)oy, (u32)ox) == at) {
                    acc += grad[oy * g.out_w + ox];
                }
            }
        }
        dx[e] = acc;
    }
}

// y[r, c] = (sum over the S positions of x[r, c], in order) * (1 / S).
extern "C" __global__ void ramus_global_avg_pool(float* y, const float* __restrict__ x, u32 rows,
                                                 u32 channels, u32 spatial) {
    const float inv = 1.0f / (float)spatial;
    FOR_EACH(e, (u64)rows * channels) {
        const float* xs = x + e * spatial;
        float acc = 0.0f;
        for (u32 j = 0; j < spatial; ++j) acc += xs[j];
        y[e] = acc * inv;
    }
}

// dx[r, c, j] = dy[r, c] * (1 / S).
extern "C" __global__ void ramus_global_avg_pool_backward(float* dx, const float* __restrict__ dy,
                                                          u32 rows, u32 channels, u32 spatial) {
    const float inv = 1.0f / (float)spatial;
    FOR_EACH(e, (u64)rows * channels * spatial) { dx[e] = dy[e / spatial] * inv; }
}

// y[r, c, j] = b[c].
extern "C" __global__ void ramus_channel_broadcast(float* y, const float* __restrict__ b,
                                                   u32 rows, u32 channels, u32 spatial) {
    FOR_EACH(e, (u64)rows * channels * spatial) { y[e] = b[(e / spatial) % channels]; }
}

// y[r, c, j] = x[r, c, j] * coef[2c] + coef[2c + 1], rounded as the CPU
// rounds it (no fused multiply-add): batch norm and its inference forms.
extern "C" __global__ void ramus_channel_affine(float* y, const float* __restrict__ x,
                                                const float* __restrict__ coef, u32 rows,
                                                u32 channels, u32 spatial) {
    FOR_EACH(e, (u64)rows * channels * spatial) {
        const u32 c = (u32)((e / spatial) % channels);
        y[e] = __fadd_rn(__fmul_rn(x[e], coef[2 * c]), coef[2 * c + 1]);
    }
}

// ---- per-channel reductions: one block of NORM_THREADS threads per
// channel (blockIdx.x), a power of two. Each thread sums a fixed, strided subset of the
// channel's rows x positions in double, then the block adds the partial sums
// in a fixed tree: deterministic, and as exact as the CPU's f64 sums.

#define NORM_THREADS 512

__device__ double block_sum_f64(double v, double* sh) {
    sh[threadIdx.x] = v;
    __syncthreads();
    for (u32 half = NORM_THREADS / 2; half > 0; half >>= 1) {
        if (threadIdx.x < half) sh[threadIdx.x] += sh[threadIdx.x + half];
        __syncthreads();
    }
    const double total = sh[0];
    __syncthreads();
    return total;
}

// Offset of element j (< rows * S, which the host keeps below 2^32 - NORM_THREADS)
// of channel c: row j / S, position j % S.
__device__ __forceinline__ u64 channel_at(u32 j, u32 c, u32 channels, u32 spatial) {
    return ((u64)(j / spatial) * channels + c) * spatial + j % spatial;
}

// Mean and biased variance of channel blockIdx.x (two passes, as the CPU's
// channel_moments). rows * S must be positive.
__device__ void channel_moments(const float* x, u32 rows, u32 channels, u32 spatial, double* sh,
                                double* mean, double* var) {
    const u32 c = blockIdx.x;
    const u32 count = rows * spatial;  // checked on the host: no overflow
    double s = 0.0;
    for (u32 j = threadIdx.x; j < count; j += NORM_THREADS) {
        s += (double)x[channel_at(j, c, channels, spatial)];
    }
    const double m = block_sum_f64(s, sh) / (double)count;
    double q = 0.0;
    for (u32 j = threadIdx.x; j < count; j += NORM_THREADS) {
        const double d = (double)x[channel_at(j, c, channels, spatial)] - m;
        q += d * d;
    }
    *var = block_sum_f64(q, sh) / (double)count;
    *mean = m;
}

// Mean and 1 / sqrt(var + eps) of channel blockIdx.x (biased variance, as
// the CPU's channel_stats).
__device__ void channel_stats(const float* x, u32 rows, u32 channels, u32 spatial, double eps,
                              double* sh, double* mean, double* inv) {
    double var;
    channel_moments(x, rows, channels, spatial, sh, mean, &var);
    *inv = 1.0 / sqrt(var + eps);
}

// (sum dy, sum dy * (x - mean) * inv) of channel blockIdx.x.
__device__ void channel_grad_sums(const float* x, const float* dy, u32 rows, u32 channels,
                                  u32 spatial, double mean, double inv, double* sh, double* sd,
                                  double* sdx) {
    const u32 c = blockIdx.x;
    const u32 count = rows * spatial;  // checked on the host: no overflow
    double a = 0.0, b = 0.0;
    for (u32 j = threadIdx.x; j < count; j += NORM_THREADS) {
        const u64 at = channel_at(j, c, channels, spatial);
        const double d = (double)dy[at];
        a += d;
        b += d * ((double)x[at] - mean) * inv;
    }
    *sd = block_sum_f64(a, sh);
    *sdx = block_sum_f64(b, sh);
}

// out[c] = sum over rows and positions of x[r, c, j] (double, rounded once).
extern "C" __global__ void ramus_channel_sum(float* out, const float* __restrict__ x, u32 rows,
                                             u32 channels, u32 spatial) {
    __shared__ double sh[NORM_THREADS];
    const u32 c = blockIdx.x;
    const u32 count = rows * spatial;  // checked on the host: no overflow
    double s = 0.0;
    for (u32 j = threadIdx.x; j < count; j += NORM_THREADS) {
        s += (double)x[channel_at(j, c, channels, spatial)];
    }
    s = block_sum_f64(s, sh);
    if (threadIdx.x == 0) out[c] = (float)s;
}

// Channel c's batch mean and (biased) variance over count values blended
// into the running statistics (when given), as the CPU's
// update_running_stats: unbiased batch variance, each product and sum
// rounded on its own.
__device__ void blend_running(float* running_mean, float* running_var, u32 c, double mean,
                              double var, double count, double momentum) {
    if (!running_mean || !running_var) return;
    const double unbias = count > 1.0 ? count / (count - 1.0) : 1.0;
    const double keep = 1.0 - momentum;
    running_mean[c] =
        (float)__dadd_rn(__dmul_rn(keep, (double)running_mean[c]), __dmul_rn(momentum, mean));
    running_var[c] = (float)__dadd_rn(__dmul_rn(keep, (double)running_var[c]),
                                      __dmul_rn(__dmul_rn(momentum, var), unbias));
}

// Training batch norm: coef[2c], coef[2c + 1] = a, b with y = x * a + b,
// a = gamma * inv, b = beta - mean * a (computed in double, then rounded).
extern "C" __global__ void ramus_batch_norm_coef(float* coef, const float* __restrict__ x,
                                                 const float* __restrict__ gamma,
                                                 const float* __restrict__ beta, u32 rows,
                                                 u32 channels, u32 spatial, double eps,
                                                 float* running_mean, float* running_var,
                                                 double momentum) {
    __shared__ double sh[NORM_THREADS];
    const u32 c = blockIdx.x;
    double mean, var;
    channel_moments(x, rows, channels, spatial, sh, &mean, &var);
    const double inv = 1.0 / sqrt(var + eps);
    if (threadIdx.x == 0) {
        const double a = (double)gamma[c] * inv;
        coef[2 * c] = (float)a;
        coef[2 * c + 1] = (float)((double)beta[c] - mean * a);
        const double count = (double)rows * (double)spatial;
        blend_running(running_mean, running_var, c, mean, var, count, momentum);
    }
}

// Its input gradient's coefficients: dx = k * dy + x * q + p with
// k = gamma * inv, q = -k * inv * sdx / M, p = -k * sd / M - mean * q
// (M = rows * S), in coef[3c .. 3c + 3].
extern "C" __global__ void ramus_batch_norm_backward_coef(float* coef, const float* __restrict__ x,
                                                          const float* __restrict__ dy,
                                                          const float* __restrict__ gamma,
                                                          u32 rows, u32 channels, u32 spatial,
                                                          double eps) {
    __shared__ double sh[NORM_THREADS];
    const u32 c = blockIdx.x;
    double mean, inv, sd, sdx;
    channel_stats(x, rows, channels, spatial, eps, sh, &mean, &inv);
    channel_grad_sums(x, dy, rows, channels, spatial, mean, inv, sh, &sd, &sdx);
    if (threadIdx.x == 0) {
        const double m = (double)rows * (double)spatial;
        const double k = (double)gamma[c] * inv;
        const double q = -k * inv * sdx / m;
        const double p = -k * sd / m - mean * q;
        coef[3 * c] = (float)k;
        coef[3 * c + 1] = (float)q;
        coef[3 * c + 2] = (float)p;
    }
}

// dx = k * dy + x * q + p per channel, rounded as the CPU rounds it.
extern "C" __global__ void ramus_batch_norm_backward_apply(float* dx, const float* __restrict__ x,
                                                          const float* __restrict__ dy,
                                                          const float* __restrict__ coef,
                                                          u32 rows, u32 channels, u32 spatial) {
    FOR_EACH(e, (u64)rows * channels * spatial) {
        const u32 c = (u32)((e / spatial) % channels);
        const float kd = __fmul_rn(coef[3 * c], dy[e]);
        const float xq = __fmul_rn(x[e], coef[3 * c + 1]);
        dx[e] = __fadd_rn(__fadd_rn(kd, xq), coef[3 * c + 2]);
    }
}

// d gamma[c] = sum dy * x_hat over rows and positions.
extern "C" __global__ void ramus_batch_norm_backward_gamma(float* out, const float* __restrict__ x,
                                                           const float* __restrict__ dy, u32 rows,
                                                           u32 channels, u32 spatial, double eps) {
    __shared__ double sh[NORM_THREADS];
    const u32 c = blockIdx.x;
    double mean, inv, sd, sdx;
    channel_stats(x, rows, channels, spatial, eps, sh, &mean, &inv);
    channel_grad_sums(x, dy, rows, channels, spatial, mean, inv, sh, &sd, &sdx);
    if (threadIdx.x == 0) out[c] = (float)sdx;
}

// ---- synchronized batch norm: the statistics of every rank's rows, summed
// over the ranks between these kernels. sums[0..C] = sum of x, sums[C] =
// rows, sums[C + 1 .. 2C + 1] = sum of (x - mean)^2; stats[0..C] = mean,
// stats[C..2C] = 1 / sqrt(var + eps), stats[2C] = rows (of every rank).

// sum of (x - mean)^2 of channel blockIdx.x, the mean from every rank's
// sums[0..C + 1], into sums[C + 1 + c].
extern "C" __global__ void ramus_norm_sq_dev(float* sums, const float* __restrict__ x, u32 rows,
                                             u32 channels, u32 spatial) {
    __shared__ double sh[NORM_THREADS];
    const u32 c = blockIdx.x;
    const double count = (double)sums[channels] * (double)spatial;
    const double m = count > 0.0 ? (double)sums[c] / count : 0.0;
    const u32 local = rows * spatial;  // checked on the host: no overflow
    double q = 0.0;
    for (u32 j = threadIdx.x; j < local; j += NORM_THREADS) {
        const double d = (double)x[channel_at(j, c, channels, spatial)] - m;
        q += d * d;
    }
    q = block_sum_f64(q, sh);
    if (threadIdx.x == 0) sums[channels + 1 + c] = (float)q;
}

// From every rank's sums: the coefficients as ramus_batch_norm_coef's
// (none when coef is null: a rank without rows), the statistics for the
// backward pass, and the running statistics (when given).
extern "C" __global__ void ramus_batch_norm_coef_synced(float* coef, float* stats,
                                                        const float* __restrict__ sums,
                                                        const float* __restrict__ gamma,
                                                        const float* __restrict__ beta,
                                                        u32 channels, u32 spatial, double eps,
                                                        float* running_mean, float* running_var,
                                                        double momentum) {
    FOR_EACH(c, channels) {
        const double count = (double)sums[channels] * (double)spatial;
        const double mean = (double)sums[c] / count;
        const double var = (double)sums[channels + 1 + c] / count;
        const double inv = 1.0 / sqrt(var + eps);
        if (coef) {
            const double a = (double)gamma[c] * inv;
            coef[2 * c] = (float)a;
            coef[2 * c + 1] = (float)((double)beta[c] - mean * a);
        }
        stats[c] = (float)mean;
        stats[channels + c] = (float)inv;
        if (c == 0) stats[2 * channels] = sums[channels];
        blend_running(running_mean, running_var, c, mean, var, count, momentum);
    }
}

// (sum dy, sum dy * x_hat) of channel blockIdx.x, x_hat from stats, into
// sd[c] (when sd is given) and sdx[c].
extern "C" __global__ void ramus_norm_grad_sums(float* sd, float* sdx, const float* __restrict__ x,
                                                const float* __restrict__ dy,
                                                const float* __restrict__ stats, u32 rows,
                                                u32 channels, u32 spatial) {
    __shared__ double sh[NORM_THREADS];
    const u32 c = blockIdx.x;
    double a, b;
    channel_grad_sums(x, dy, rows, channels, spatial, (double)stats[c],
                      (double)stats[channels + c], sh, &a, &b);
    if (threadIdx.x == 0) {
        if (sd) sd[c] = (float)a;
        sdx[c] = (float)b;
    }
}

// The input gradient's coefficients, as ramus_batch_norm_backward_coef's,
// from every rank's (sum dy, sum dy * x_hat) in sums[0..C], sums[C..2C].
extern "C" __global__ void ramus_batch_norm_backward_coef_synced(float* coef,
                                                                 const float* __restrict__ sums,
                                                                 const float* __restrict__ stats,
                                                                 const float* __restrict__ gamma,
                                                                 u32 channels, u32 spatial) {
    FOR_EACH(c, channels) {
        const double m = (double)stats[2 * channels] * (double)spatial;
        const double mean = (double)stats[c];
        const double inv = (double)stats[channels + c];
        const double k = (double)gamma[c] * inv;
        const double q = -k * inv * (double)sums[channels + c] / m;
        const double p = -k * (double)sums[c] / m - mean * q;
        coef[3 * c] = (float)k;
        coef[3 * c + 1] = (float)q;
        coef[3 * c + 2] = (float)p;
    }
}

// Inference batch norm with given statistics, one thread per channel:
// a = gamma / sqrt(var + eps), b = beta - mean * a (beta, mean: 0 when null),
// into coef[2c], coef[2c + 1]. A variance below -eps gives NaN (the CPU
// refuses it with an error; the device cannot stop the pass).
extern "C" __global__ void ramus_batch_norm_inference_coef(float* coef,
                                                           const float* __restrict__ gamma,
                                                           const float* __restrict__ beta,
                                                           const float* __restrict__ mean,
                                                           const float* __restrict__ var,
                                                           u32 channels, double eps) {
    FOR_EACH(c, channels) {
        const double a = (double)gamma[c] / sqrt((double)var[c] + eps);
        const double b = (beta ? (double)beta[c] : 0.0) - (mean ? (double)mean[c] : 0.0) * a;
        coef[2 * c] = (float)a;
        coef[2 * c + 1] = (float)b;
    }
}

// Gradient of inference batch norm for gamma (which 0), mean (1) or var (2):
// with u = sum dy * (x - mean) and v = sum dy over rows and positions,
// d gamma = u / sqrt(var + eps), d mean = -gamma * v / sqrt(var + eps),
// d var = -gamma * u / (2 (var + eps)^1.5).
extern "C" __global__ void ramus_batch_norm_inference_param(
    float* out, const float* __restrict__ x, const float* __restrict__ gamma,
    const float* __restrict__ mean, const float* __restrict__ var, const float* __restrict__ dy,
    u32 rows, u32 channels, u32 spatial, double eps, u32 which) {
    __shared__ double sh[NORM_THREADS];
    const u32 c = blockIdx.x;
    const u32 count = rows * spatial;  // checked on the host: no overflow
    const double m = (double)mean[c];
    double a = 0.0, b = 0.0;
    for (u32 j = threadIdx.x; j < count; j += NORM_THREADS) {
        const u64 at = channel_at(j, c, channels, spatial);
        const double d = (double)dy[at];
        a += d * ((double)x[at] - m);
        b += d;
    }
    const double u = block_sum_f64(a, sh);
    const double v = block_sum_f64(b, sh);
    if (threadIdx.x == 0) {
        const double ve = (double)var[c] + eps;
        const double gm = (double)gamma[c];
        double r;
        if (which == 0) {
            r = u / sqrt(ve);
        } else if (which == 1) {
            r = -gm * v / sqrt(ve);
        } else {
            r = -0.5 * gm * u / (ve * sqrt(ve));
        }
        out[c] = (float)r;
    }
}

// C[r, c] = sum_t A[r, t] * B[c, t] (+ bias[c]) for r < m, c < n: a product
// with few rows of A and a row-major weight B (n x k), as in a vertex
// function's input projections over a small task. One warp per output
// column, four rows at a time: lanes stride over k, so B's row is read
// coalesced and reused from registers for the four rows; a warp shuffle
// reduces in a fixed order (deterministic). Cheaper to launch than cuBLAS
// for the few rows a task has at small batch sizes.
extern "C" __global__ void ramus_gemm_abt_small(float* C, u32 ldc, const float* __restrict__ A,
                                                u32 lda, const float* __restrict__ B,
                                                const float* __restrict__ bias, u32 m, u32 n,
                                                u32 k) {
    const u32 lane = threadIdx.x % 32;
    const u64 warps = (u64)gridDim.x * blockDim.x / 32;
    for (u64 c = ((u64)blockIdx.x * blockDim.x + threadIdx.x) / 32; c < n; c += warps) {
        const float* b = B + c * k;
        const float add = bias ? bias[c] : 0.0f;
        for (u32 r0 = 0; r0 < m; r0 += 4) {
            float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            for (u32 t = lane; t < k; t += 32) {
                const float bt = b[t];
#pragma unroll
                for (u32 q = 0; q < 4; ++q) {
                    if (r0 + q < m) acc[q] += A[(u64)(r0 + q) * lda + t] * bt;
                }
            }
#pragma unroll
            for (u32 q = 0; q < 4; ++q) {
#pragma unroll
                for (u32 o = 16; o > 0; o >>= 1) acc[q] += __shfl_down_sync(0xffffffffu, acc[q], o);
            }
            if (lane == 0) {
                for (u32 q = 0; q < 4 && r0 + q < m; ++q) C[(u64)(r0 + q) * ldc + c] = acc[q] + add;
            }
        }
    }
}

// ---- per-row matrices (row_matmul) and the shared-row embedding (embedding_unk)

// out[r] = op(A_r) · op(B_r) for r < rows, op(A): [m, k], op(B): [k, n], all
// row-major; A_r = a + r * a_step (a_step 0: one static A for every row),
// stored [m, k] or, with trans_a, [k, m]; B_r likewise ([k, n] / [n, k]).
// One thread per output element.
extern "C" __global__ void ramus_row_matmul(float* out, const float* __restrict__ a, u64 a_step,
                                            const float* __restrict__ b, u64 b_step, u32 rows,
                                            u32 m, u32 k, u32 n, u32 trans_a, u32 trans_b) {
    const u64 per = (u64)m * n;
    FOR_EACH(i, (u64)rows * per) {
        const u64 r = i / per;
        const u32 e = (u32)(i % per);
        const u32 row = e / n, col = e % n;
        const float* ar = a + r * a_step;
        const float* br = b + r * b_step;
        float acc = 0.0f;
        for (u32 t = 0; t < k; ++t) {
            const float x = trans_a ? ar[(u64)t * m + row] : ar[(u64)row * k + t];
            const float y = trans_b ? br[(u64)col * k + t] : br[(u64)t * n + col];
            acc += x * y;
        }
        out[i] = acc;
    }
}

// out[r, j] = table[tokens[r] < table_rows ? tokens[r] : 0, j].
extern "C" __global__ void ramus_embedding_unk(float* out, const float* __restrict__ table,
                                               const u32* __restrict__ tokens, u32 rows,
                                               u32 table_rows, u32 width) {
    FOR_EACH(i, (u64)rows * width) {
        const u32 t = tokens[i / width];
        const u64 row = t < table_rows ? t : 0u;
        out[i] = table[row * width + (u32)(i % width)];
    }
}

// dtable[row of tokens[r], j] += grad[r, j] (dtable zeroed before).
extern "C" __global__ void ramus_embedding_unk_backward(float* dtable, const float* __restrict__ grad,
                                                        const u32* __restrict__ tokens, u32 rows,
                                                        u32 table_rows, u32 width) {
    FOR_EACH(i, (u64)rows * width) {
        const u32 t = tokens[i / width];
        const u64 row = t < table_rows ? t : 0u;
        atomicAdd(&dtable[row * width + (u32)(i % width)], grad[i]);
    }
}
