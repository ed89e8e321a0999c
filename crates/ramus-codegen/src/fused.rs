//! CodeGen of fused elementwise groups (Cavs §3.5): the CUDA C++ of a
//! [`FusedGroup`] of the fusion pass ([`ramus_core::fusion`]), as a kernel
//! of its own for the batched engine ([`FusedSource::kernel`], named by a
//! hash of its normalized source so identical groups share one compiled
//! kernel) and as one instruction case of the persistent kernel
//! ([`FusedSource::persistent_case`]). The members' C expressions come from
//! the ops' elementwise templates ([`FusedGroup::members_code`]); the CPU
//! evaluator of a group, the oracle these kernels are tested against, is
//! `ramus_cpu::fused::eval_group`.

use std::fmt::Write as _;

use ramus_core::error::Result;
use ramus_core::fusion::{FusedGroup, InputKind};
use ramus_core::graph::{Graph, NodeId};

/// A generated CUDA kernel: its name (derived from the source) and source.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FusedKernel {
    /// `fused_<16 hex digits>`: a hash of the normalized source, so groups
    /// with the same computation share one compiled kernel.
    pub name: String,
    /// One `extern "C" __global__` function called `name`.
    pub source: String,
}

/// FNV-1a, 64 bit: a hash that is stable across builds and platforms (the
/// kernel name is a cache key on disk).
fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// The CUDA C++ of a fused group (implemented for [`FusedGroup`]; see
/// each method there).
pub trait FusedSource {
    /// The group as one CUDA C++ kernel called `kernel_name`.
    fn cuda_source(&self, graph: &Graph, kernel_name: &str) -> Result<String>;
    /// The group as case `case` of the persistent kernel's instruction switch.
    fn persistent_case(
        &self,
        graph: &Graph,
        case: usize,
        scatter_added: &dyn Fn(NodeId) -> bool,
    ) -> Result<String>;
    /// Operands of [`persistent_case`](Self::persistent_case) after `n`.
    fn persistent_operands(&self) -> usize;
    /// The kernel with its content-derived name (see [`FusedKernel`]).
    fn kernel(&self, graph: &Graph) -> Result<FusedKernel>;
}

impl FusedSource for FusedGroup {
    /// The group as one CUDA C++ kernel called `kernel_name`. Parameters, in
    /// this order (the engine's launch relies on it):
    ///
    /// ```text
    /// extern "C" __global__ void NAME(
    ///     const float* __restrict__ in0, ...,   // one per input, `inputs` order
    ///     float* __restrict__ out0, ...,        // one per output, `outputs` order
    ///     float* cat0, ...,                     // one per `concat_writes` entry
    ///     const unsigned int* __restrict__ in<k>_rows, ...  // per CSR input, input order
    ///     unsigned long long n, unsigned int width,
    ///     unsigned int in<k>_stride, unsigned int in<k>_offset, ...   // per Window input, input order
    ///     unsigned int cat<q>_stride, unsigned int cat<q>_offset, ... // per concat write, in order
    ///     unsigned int in<k>_base, ...)          // per CSR input, input order
    /// ```
    ///
    /// (a *CSR input* is one of kind [`InputKind::ChildSum`] or
    /// [`InputKind::ParentRow`], see [`InputKind::is_csr`]).
    ///
    /// * `inK` is input `K`: rows × width floats (per element), `width`
    ///   floats (broadcast), or for an [`InputKind::Window`] the *source*
    ///   buffer (rows × stride floats), read at
    ///   `in[(i / width) * stride + offset + i % width]`;
    /// * for an [`InputKind::ChildSum`], `inK` is the edge-row *source*
    ///   (edges × width floats, from the first edge of the launched range)
    ///   and `inK_rows` the group's rows + 1 CSR edge offsets (absolute edge
    ///   numbers): element `i` sums `inK[e * width + i % width]` for `e`
    ///   from `inK_rows[i / width] - inK_base` to
    ///   `inK_rows[i / width + 1] - inK_base` (exclusive), in edge order
    ///   from `0.0f`;
    /// * for an [`InputKind::ParentRow`], `inK` is the vertex-row *source*
    ///   (from the first vertex of the launched range) and `inK_rows` holds
    ///   one parent vertex number (absolute) per edge row of the group:
    ///   element `i` is `inK[(inK_rows[i / width] - inK_base) * width + i % width]`;
    /// * `outK` is output `K` (rows × width floats, not aliasing any input);
    /// * `catQ` is the buffer of concat write `Q`'s concat (rows × its
    ///   width floats); the kernel stores the member at
    ///   `cat[(i / width) * stride + offset + i % width]`. Entries writing
    ///   one concat get the same pointer (they write disjoint columns, and
    ///   the parameters are not `__restrict__` so that this is allowed);
    /// * `n` = rows × width (`width` for a static group).
    ///
    /// Strides, offsets and bases are run-time arguments, so one compiled
    /// kernel serves every hidden size and range of rows. Row and edge
    /// indices are scaled in 64 bits. A grid-stride loop covers `0..n`, so
    /// any launch shape is correct.
    fn cuda_source(&self, graph: &Graph, kernel_name: &str) -> Result<String> {
        let outputs = self.output_members()?;
        let writes = self.concat_write_members()?;
        let csr: Vec<usize> = (0..self.inputs.len())
            .filter(|&k| self.inputs[k].kind.is_csr())
            .collect();
        let mut params: Vec<String> = (0..self.inputs.len())
            .map(|k| format!("const float* __restrict__ in{k}"))
            .collect();
        params.extend((0..outputs.len()).map(|k| format!("float* __restrict__ out{k}")));
        // not restrict: writes into one concat share its pointer
        params.extend((0..writes.len()).map(|q| format!("float* cat{q}")));
        params.extend(
            csr.iter()
                .map(|k| format!("const unsigned int* __restrict__ in{k}_rows")),
        );
        params.push("unsigned long long n".into());
        params.push("unsigned int width".into());
        for (k, input) in self.inputs.iter().enumerate() {
            if matches!(input.kind, InputKind::Window { .. }) {
                params.push(format!("unsigned int in{k}_stride"));
                params.push(format!("unsigned int in{k}_offset"));
            }
        }
        for q in 0..writes.len() {
            params.push(format!("unsigned int cat{q}_stride"));
            params.push(format!("unsigned int cat{q}_offset"));
        }
        params.extend(csr.iter().map(|k| format!("unsigned int in{k}_base")));
        let mut s = format!(
            "extern \"C\" __global__ void {kernel_name}(\n    {})\n{{\n",
            params.join(",\n    ")
        );
        s += "    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;\n";
        s += "         i < n;\n";
        s += "         i += (unsigned long long)gridDim.x * blockDim.x) {\n";
        s += &self.element_body(graph)?;
        s += "    }\n}\n";
        Ok(s)
    }

    /// The group as one `case` of the persistent kernel's instruction
    /// switch (`case` is the instruction's arg): the processor's threads
    /// stride over the `n` elements, each taking `VP_FUSED_AHEAD` (a macro
    /// the kernel defines) at a time, their inputs loaded before any is
    /// computed. Operands, in order: `n`, the pool
    /// offset of every input (for a window or CSR input, of the source
    /// rows the instruction's first row reads), of every output, of every
    /// concat write (its first row and column 0), then for each CSR input
    /// (input order) the pool offset of its `u32` index array for the
    /// instruction's rows (entries relative to the source offset given). Widths, strides and column
    /// offsets are compiled in. A concat write into a node `scatter_added`
    /// names takes, instead of its first row, the pool offset of an index
    /// array with one pool offset of a row per row of the instruction
    /// (`0xffffffff`: none), and adds its columns into those rows
    /// atomically: the concat's rows go straight to where a scatter-add
    /// would have sent them.
    fn persistent_case(
        &self,
        graph: &Graph,
        case: usize,
        scatter_added: &dyn Fn(NodeId) -> bool,
    ) -> Result<String> {
        let outputs = self.output_members()?;
        let mut s = format!("case {case}: {{\n");
        let mut at = 1;
        let mut next = || {
            at += 1;
            at - 1
        };
        s += "    const unsigned n = operand[0];\n";
        let _ = writeln!(s, "    const unsigned width = {};", self.width);
        for (k, input) in self.inputs.iter().enumerate() {
            let _ = writeln!(s, "    const float* in{k} = pool + operand[{}];", next());
            if let InputKind::Window { offset, stride, .. } = input.kind {
                let _ = writeln!(
                    s,
                    "    const unsigned in{k}_stride = {stride}, in{k}_offset = {offset};"
                );
            }
        }
        for k in 0..outputs.len() {
            let _ = writeln!(s, "    float* out{k} = pool + operand[{}];", next());
        }
        let scattered: Vec<bool> = self
            .concat_writes
            .iter()
            .map(|w| scatter_added(w.concat))
            .collect();
        for (q, w) in self.concat_writes.iter().enumerate() {
            if scattered[q] {
                let _ = writeln!(
                    s,
                    "    const unsigned* cat{q}_rows = upool + operand[{}];",
                    next()
                );
                let _ = writeln!(s, "    const unsigned cat{q}_offset = {};", w.offset);
            } else {
                let _ = writeln!(s, "    float* cat{q} = pool + operand[{}];", next());
                let _ = writeln!(
                    s,
                    "    const unsigned cat{q}_stride = {}, cat{q}_offset = {};",
                    w.stride, w.offset
                );
            }
        }
        for (k, input) in self.inputs.iter().enumerate() {
            if input.kind.is_csr() {
                let _ = writeln!(
                    s,
                    "    const unsigned* in{k}_rows = upool + operand[{}];",
                    next()
                );
                let _ = writeln!(s, "    const unsigned in{k}_base = 0;");
            }
        }
        // VP_FUSED_AHEAD (the kernel's macro) elements per thread at a
        // time, all their inputs loaded before any is computed: the outputs
        // may alias the inputs as far as the compiler knows, so a plain loop
        // waits for each element's loads in turn
        s += "    constexpr unsigned ahead = VP_FUSED_AHEAD;\n";
        s += "    for (unsigned i0 = threadIdx.x; i0 < n; i0 += ahead * blockDim.x) {\n";
        for k in 0..self.inputs.len() {
            let _ = writeln!(s, "        float ahead{k}[ahead];");
        }
        s += "#pragma unroll\n";
        s += "        for (unsigned u = 0; u < ahead; ++u) {\n";
        s += "        const unsigned i = i0 + u * blockDim.x;\n";
        s += "        if (i >= n) break;\n";
        for k in 0..self.inputs.len() {
            s += &self.input_load(k, &format!("ahead{k}[u]"), false);
        }
        s += "        }\n";
        s += "#pragma unroll\n";
        s += "        for (unsigned u = 0; u < ahead; ++u) {\n";
        s += "        const unsigned i = i0 + u * blockDim.x;\n";
        s += "        if (i >= n) break;\n";
        for k in 0..self.inputs.len() {
            let _ = writeln!(s, "        const float a{k} = ahead{k}[u];");
        }
        s += &self.element_compute(graph, &scattered)?;
        s += "        }\n";
        s += "    }\n    break;\n}\n";
        Ok(s)
    }

    /// Operands of [`persistent_case`](Self::persistent_case) after `n`.
    fn persistent_operands(&self) -> usize {
        let csr = self.inputs.iter().filter(|i| i.kind.is_csr()).count();
        self.inputs.len() + self.outputs.len() + self.concat_writes.len() + csr
    }

    /// The kernel with its content-derived name (see [`FusedKernel`]).
    fn kernel(&self, graph: &Graph) -> Result<FusedKernel> {
        let normalized = self.cuda_source(graph, "KERNEL")?;
        let name = format!("fused_{:016x}", fnv1a64(normalized.as_bytes()));
        let source = self.cuda_source(graph, &name)?;
        Ok(FusedKernel { name, source })
    }
}

/// The pieces [`FusedSource`]'s kernels share: the loads of a group's
/// inputs and the code of its members at one element.
trait ElementCode {
    fn element_body(&self, graph: &Graph) -> Result<String>;
    fn input_load(&self, k: usize, target: &str, declare: bool) -> String;
    fn element_compute(&self, graph: &Graph, scattered: &[bool]) -> Result<String>;
}

impl ElementCode for FusedGroup {
    /// The loop body of the group's code for element `i` (of `n = rows ×
    /// width`): loads of every input (names `in{k}`, windows through
    /// `in{k}_stride` / `in{k}_offset`, CSR inputs through `in{k}_rows` and
    /// `in{k}_base`), the members' expressions, and the stores to `out{k}`
    /// and the concat writes `cat{q}` (`cat{q}_stride`, `cat{q}_offset`);
    /// `width` is the group's width. Shared by the batched engine's kernels
    /// and the persistent kernel's instruction cases.
    fn element_body(&self, graph: &Graph) -> Result<String> {
        let mut s = String::new();
        for k in 0..self.inputs.len() {
            s += &self.input_load(k, &format!("a{k}"), true);
        }
        s += &self.element_compute(graph, &[])?;
        Ok(s)
    }

    /// Code that reads input `k` at element `i` into `target`, an lvalue,
    /// or with `declare` a new `float` of that name.
    fn input_load(&self, k: usize, target: &str, declare: bool) -> String {
        let index = match self.inputs[k].kind {
            InputKind::PerElement => "i".to_string(),
            InputKind::Broadcast => "i % width".to_string(),
            InputKind::Window { .. } => {
                format!("(i / width) * in{k}_stride + in{k}_offset + i % width")
            }
            InputKind::ParentRow { .. } => format!(
                "(unsigned long long)(in{k}_rows[i / width] - in{k}_base) * width + i % width"
            ),
            InputKind::ChildSum { .. } => {
                // the edge rows of the vertex row, in order (like the CPU kernel)
                let declared = if declare { "float " } else { "" };
                return format!(
                    "        {declared}{target} = 0.0f;\n\
                     \x20       for (unsigned int e = in{k}_rows[i / width] - in{k}_base, \
                     end = in{k}_rows[i / width + 1] - in{k}_base; e < end; ++e) {{\n\
                     \x20           {target} += in{k}[(unsigned long long)e * width + i % width];\n\
                     \x20       }}\n"
                );
            }
        };
        let declared = if declare { "const float " } else { "" };
        format!("        {declared}{target} = in{k}[{index}];\n")
    }

    /// The members' code at element `i` (inputs read into `a{k}`) and the
    /// stores of the outputs and concat writes (`scattered[q]`: concat
    /// write `q` adds into the row whose pool offset its index array gives,
    /// see [`persistent_case`](Self::persistent_case)).
    fn element_compute(&self, graph: &Graph, scattered: &[bool]) -> Result<String> {
        let code = self.members_code(graph)?;
        let outputs = self.output_members()?;
        let writes = self.concat_write_members()?;
        let mut s = String::new();
        for (j, c) in code.iter().enumerate() {
            s += &format!("        const float t{j} = {};\n", c.expr);
        }
        for (k, j) in outputs.iter().enumerate() {
            s += &format!("        out{k}[i] = t{j};\n");
        }
        for (q, j) in writes.iter().enumerate() {
            if scattered.get(q).copied().unwrap_or(false) {
                s += &format!(
                    "        if (cat{q}_rows[i / width] != 0xffffffffu) \
                     atomicAdd(pool + cat{q}_rows[i / width] + cat{q}_offset + i % width, t{j});\n"
                );
            } else {
                s += &format!(
                    "        cat{q}[(i / width) * cat{q}_stride + cat{q}_offset + i % width] = t{j};\n"
                );
            }
        }
        Ok(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv_is_stable() {
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
    }
}
