//! Test support for the device optimizer: a fake device pool, the CUDA
//! engine's parameter layout, and a harness that runs the generated kernels
//! as C++ on the host (blocks one after another, 256 threads each).

use std::fmt::Write as _;
use std::process::Command;
use std::sync::Arc;

use super::plan::Chunk;
use super::*;
use crate::pool::{ChunkMemory, PoolConfig};

const BASE: u64 = 1 << 32;
const CHUNK: u64 = 1 << 20;

/// One fake chunk of device memory at `BASE`.
#[derive(Debug)]
pub(super) struct OneChunk(bool);

impl ChunkMemory for OneChunk {
    fn allocate(&mut self, bytes: u64) -> Result<Option<u64>> {
        if self.0 || bytes > CHUNK {
            return Ok(None);
        }
        self.0 = true;
        Ok(Some(BASE))
    }
    fn release(&mut self, _base: u64) -> Result<()> {
        Ok(())
    }
}

pub(super) fn fake_pool() -> Arc<DevicePool> {
    DevicePool::with_memory(
        Box::new(OneChunk(false)),
        PoolConfig {
            initial_bytes: CHUNK,
            max_bytes: Some(CHUNK),
        },
    )
}

/// Parameters laid out like the CUDA engine does: values in declaration
/// order in one buffer, gradients dense-first in another.
pub(super) struct EngineLayout {
    pub values: PoolBuffer<f32>,
    pub grads: PoolBuffer<f32>,
    pub slots: Vec<ParamSlot>,
    /// Gradient offset of each parameter.
    pub grad_at: Vec<usize>,
}

/// `params[p]`: (length, row width if a table).
pub(super) fn engine_layout(
    pool: &Arc<DevicePool>,
    params: &[(usize, Option<usize>)],
) -> EngineLayout {
    let total: usize = params.iter().map(|p| p.0).sum();
    let values = pool.alloc::<f32>(total).unwrap();
    let grads = pool.alloc::<f32>(total).unwrap();
    let mut grad_at = vec![0; params.len()];
    let mut at = 0;
    for tables in [false, true] {
        for (p, &(len, width)) in params.iter().enumerate() {
            if width.is_some() == tables {
                grad_at[p] = at;
                at += len;
            }
        }
    }
    let mut value_at = 0;
    let slots = params
        .iter()
        .enumerate()
        .map(|(p, &(len, width))| {
            let slot = ParamSlot {
                value: values.view().slice(value_at..value_at + len).unwrap(),
                grad: grads.view().slice(grad_at[p]..grad_at[p] + len).unwrap(),
                layout: width.map_or(GradLayout::Dense, |width| GradLayout::Rows { width }),
            };
            value_at += len;
            slot
        })
        .collect();
    EngineLayout {
        values,
        grads,
        slots,
        grad_at,
    }
}

/// Enough CUDA to run the generated source as C++ on the host: blocks
/// one after another, each on 256 threads with a barrier for
/// `__syncthreads`; device addresses are offsets into `mem`.
pub(super) const HOST_SHIM: &str = r#"
#include <atomic>
#include <barrier>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

struct dim3 { unsigned x = 0, y = 0, z = 0; };
static thread_local dim3 threadIdx, blockIdx;
static dim3 blockDim, gridDim;

struct Threads {
static constexpr unsigned N = 256;
std::barrier<> start{N + 1}, finish{N + 1}, sync{N};
std::function<void()> job;
bool quit = false;
std::vector<std::thread> threads;
Threads() {
    for (unsigned t = 0; t < N; ++t)
        threads.emplace_back([this, t] {
            threadIdx.x = t;
            for (;;) {
                start.arrive_and_wait();
                if (quit) return;
                job();
                finish.arrive_and_wait();
            }
        });
}
~Threads() {
    quit = true;
    start.arrive_and_wait();
    for (auto& t : threads) t.join();
}
template <class F> void launch(unsigned gx, unsigned gy, F kernel) {
    gridDim.x = gx; gridDim.y = gy; blockDim.x = N; blockDim.y = 1;
    for (unsigned y = 0; y < gy; ++y)
        for (unsigned x = 0; x < gx; ++x) {
            job = [&] { blockIdx.x = x; blockIdx.y = y; kernel(); };
            start.arrive_and_wait();
            finish.arrive_and_wait();
        }
}
};
static Threads* pool;

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
static inline void __syncthreads() { pool->sync.arrive_and_wait(); }
static inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
static inline unsigned atomicAdd(unsigned* p, unsigned v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
static inline unsigned long long atomicMax(unsigned long long* p, unsigned long long v) {
    unsigned long long old = __atomic_load_n(p, __ATOMIC_SEQ_CST);
    while (old < v && !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {}
    return old;
}
using std::isfinite;
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __fsqrt_rn(float a) { return std::sqrt(a); }
static inline unsigned __float_as_uint(float a) { return std::bit_cast<unsigned>(a); }

static unsigned char* mem;
static const unsigned long long BASE = 0x100000000ull;
static void* at(unsigned long long a) { return a ? mem + (a - BASE) : nullptr; }
static void put(unsigned long long a, const unsigned* bits, unsigned long n) { std::memcpy(at(a), bits, 4 * n); }
static void dump(unsigned long long a, unsigned long n) {
const unsigned* w = (const unsigned*)at(a);
for (unsigned long i = 0; i < n; ++i) std::printf("%u ", w[i]);
std::printf("\n");
}
[[maybe_unused]] static float F(unsigned bits) { return std::bit_cast<float>(bits); }
[[maybe_unused]] static double D(unsigned long long bits) { return std::bit_cast<double>(bits); }
"#;

pub(super) fn host_compiler() -> Option<&'static str> {
    ["c++", "g++", "clang++"].into_iter().find(|cc| {
        Command::new(cc)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    })
}

/// Compiles `src` (the shim, then the modules and a `main`) with the
/// host C++ compiler, runs it, and returns its output lines as words;
/// `None` (with a notice) without a compiler.
pub(super) fn run_on_host(tag: &str, src: &str) -> Option<Vec<Vec<u32>>> {
    let Some(cc) = host_compiler() else {
        eprintln!("NOTICE: no C++ compiler found; skipping the host run of generated kernels");
        return None;
    };
    let dir =
        std::env::temp_dir().join(format!("ramus-optimizer-host-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (file, exe) = (dir.join("optimizer.cpp"), dir.join("optimizer"));
    std::fs::write(&file, src).unwrap();
    let out = Command::new(cc)
        .args([
            "-std=c++20",
            "-O1",
            "-ffp-contract=off",
            "-Wall",
            "-Werror",
            "-pthread",
            "-o",
        ])
        .arg(&exe)
        .arg(&file)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{cc} rejected the generated code ({}):\n{}",
        file.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let run = Command::new(&exe).output().unwrap();
    assert!(run.status.success(), "host program failed");
    let _ = std::fs::remove_dir_all(&dir);
    let text = String::from_utf8_lossy(&run.stdout).to_string();
    Some(
        text.lines()
            .map(|l| l.split_whitespace().map(|w| w.parse().unwrap()).collect())
            .collect(),
    )
}

/// A C++ array expression of `data`.
pub(super) fn words(data: &[u32]) -> String {
    let w: Vec<String> = data.iter().map(|x| format!("{x}u")).collect();
    format!("(const unsigned[]){{{}}}", w.join(", "))
}

/// C++ that copies `data` to device address `addr`.
pub(super) fn put_cpp(addr: u64, data: &[u32]) -> String {
    if data.is_empty() {
        return String::new();
    }
    format!("    put({addr}ull, {}, {});\n", words(data), data.len())
}

pub(super) fn bits(data: &[f32]) -> Vec<u32> {
    data.iter().map(|x| x.to_bits()).collect()
}

/// C++ that fills `segs` with a launch's segments.
pub(super) fn segments_cpp(ns: &str, chunk: &Chunk) -> String {
    let mut s = format!("{ns}::Segments segs{{}};\n");
    for (k, g) in chunk.segments.s[..chunk.count as usize].iter().enumerate() {
        let _ = writeln!(
            s,
            "        segs.s[{k}] = {ns}::Segment{{(float*)at({}ull), (const float*)at({}ull), \
             (float*)at({}ull), (float*)at({}ull), (const unsigned*)at({}ull), {}ull, {}u, {}u, \
             {}u, F({}u)}};",
            g.value,
            g.grad,
            g.first,
            g.second,
            g.rows,
            g.len,
            g.width,
            g.table_rows,
            g.slot,
            g.lr_scale
        );
    }
    s
}

/// C++ for the norm launches of one step, as [`DeviceOptimizer::step`]
/// makes them, checking the loss at device address `loss` (0: none).
pub(super) fn norm_cpp(
    ns: &str,
    state: &State,
    segments: &[RawSegment],
    max_norm: f64,
    loss: u64,
) -> String {
    let (chunks, total_blocks) = launch_chunks(segments, MAX_NORM_BLOCKS).unwrap();
    assert!(2 * total_blocks as usize <= state.partials.len());
    let mut s = String::new();
    for chunk in &chunks {
        let _ = writeln!(
            s,
            "    {{\n        {}        threads.launch({}, {}, [&] {{ {ns}::ramus_grad_norm(segs, \
             (double*)at({}ull), {}u, {total_blocks}u, (unsigned*)at({}ull), D({}ull), \
             (float*)at({}ull), (double*)at({}ull), (const float*)at({loss}ull), \
             (unsigned*)at({}ull)); }});\n    }}",
            segments_cpp(ns, chunk),
            chunk.grid_x,
            chunk.count,
            state.partials.view().device_ptr(),
            chunk.slot_base,
            state.counter().unwrap().device_ptr(),
            max_norm.to_bits(),
            state.scale.view().device_ptr(),
            state.words.view().device_ptr(),
            state.status().unwrap().device_ptr(),
        );
    }
    s
}

/// C++ for the update launches of one step.
pub(super) fn update_cpp(
    ns: &str,
    spec: UpdateKernelSpec,
    state: &State,
    segments: &[RawSegment],
    args: &UpdateArgs,
) -> String {
    let (chunks, _) = launch_chunks(segments, MAX_UPDATE_BLOCKS).unwrap();
    let a = [
        args.lr,
        args.weight_decay,
        args.beta1,
        args.beta2,
        args.one_minus_beta1,
        args.one_minus_beta2,
        args.eps,
        args.inv_bias_correction1,
        args.inv_bias_correction2,
    ]
    .map(|x| format!("F({}u)", x.to_bits()))
    .join(", ");
    let scale = if spec.clip {
        state.scale.view().device_ptr()
    } else {
        0
    };
    let status = state.status().unwrap().device_ptr();
    let mut s = String::new();
    for chunk in &chunks {
        let _ = writeln!(
            s,
            "    {{\n        {}        {ns}::Args args{{{a}}};\n        threads.launch({}, {}, [&] {{ \
             {ns}::{}(segs, args, (const float*)at({scale}ull), \
             (const unsigned*)at({status}ull)); }});\n    }}",
            segments_cpp(ns, chunk),
            chunk.grid_x,
            chunk.count,
            spec.update_kernel_name(),
        );
    }
    s
}

/// C++ for the buffers' keep (`restore` false) or restore launches.
pub(super) fn keep_cpp(ns: &str, state: &State, restore: bool) -> String {
    let (chunks, _) = launch_chunks(&state.buffers, MAX_UPDATE_BLOCKS).unwrap();
    let status = state.status().unwrap().device_ptr();
    let mut s = String::new();
    for chunk in &chunks {
        let _ = writeln!(
            s,
            "    {{\n        {}        threads.launch({}, {}, [&] {{ {ns}::ramus_keep_buffers(segs, \
             (const unsigned*)at({status}ull), {}u); }});\n    }}",
            segments_cpp(ns, chunk),
            chunk.grid_x,
            chunk.count,
            u32::from(restore),
        );
    }
    s
}

/// The start of a host program: the shim, then `spec`'s module in
/// namespace `ns` for each `(ns, spec)`.
pub(super) fn host_program(modules: &[(String, UpdateKernelSpec)]) -> String {
    let mut src = String::from(HOST_SHIM);
    for (ns, spec) in modules {
        let _ = writeln!(
            src,
            "namespace {ns} {{\n{}\n}}",
            spec.source().replace("extern \"C\" ", "")
        );
    }
    src += "int main() {\n    mem = (unsigned char*)std::aligned_alloc(256, 1 << 20);\n    \
            Threads threads;\n    pool = &threads;\n";
    src
}
