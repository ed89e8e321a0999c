//! NVRTC: compiles CUDA C++ source for the device's own architecture into a
//! cubin (or, when NVRTC cannot target the device directly, PTX for the
//! newest architecture it can, which the driver compiles on load), and loads
//! compiled images as modules.

use std::ffi::{c_char, c_int, CString};
use std::sync::Arc;

use cudarc::driver::sys::CUresult;
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, DriverError};
use cudarc::nvrtc::{result, sys, Ptx};

use crate::device::CudaDevice;
use crate::error::{CudaError, InCall, Result};

/// What a compiled image contains.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ImageKind {
    /// Machine code for exactly this architecture.
    Cubin,
    /// PTX, compiled for the device by the driver when loaded.
    Ptx,
}

/// The architecture NVRTC compiles for, e.g. `sm_90` (cubin) or
/// `compute_90` (PTX).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CompileTarget {
    /// Compute capability as a number: `major * 10 + minor` (90 for 9.0).
    pub arch: u32,
    pub kind: ImageKind,
}

impl CompileTarget {
    /// A cubin for `device_arch` if NVRTC supports it, else PTX for the
    /// newest older architecture NVRTC supports (the driver JIT-compiles PTX
    /// forward); an error if NVRTC supports nothing at or below the device.
    pub fn choose(device_arch: u32, supported: &[u32]) -> Result<Self> {
        if supported.contains(&device_arch) {
            return Ok(Self {
                arch: device_arch,
                kind: ImageKind::Cubin,
            });
        }
        match supported.iter().copied().filter(|&a| a < device_arch).max() {
            Some(arch) => Ok(Self {
                arch,
                kind: ImageKind::Ptx,
            }),
            None => Err(CudaError::BadArgument(format!(
                "this NVRTC cannot compile for sm_{device_arch}: it supports {supported:?}"
            ))),
        }
    }

    /// The value of `--gpu-architecture`.
    pub fn gpu_architecture(&self) -> String {
        match self.kind {
            ImageKind::Cubin => format!("sm_{}", self.arch),
            ImageKind::Ptx => format!("compute_{}", self.arch),
        }
    }
}

/// The architectures this NVRTC can compile for (as `major * 10 + minor`).
pub fn supported_archs() -> Result<Vec<u32>> {
    let mut count: c_int = 0;
    // SAFETY: writes one int through a valid pointer.
    unsafe { sys::nvrtcGetNumSupportedArchs(&mut count) }
        .result()
        .in_call("nvrtcGetNumSupportedArchs")?;
    let mut archs: Vec<c_int> = vec![0; usize::try_from(count).unwrap_or(0)];
    if archs.is_empty() {
        return Ok(Vec::new());
    }
    // SAFETY: `archs` has room for the `count` ints NVRTC writes.
    unsafe { sys::nvrtcGetSupportedArchs(archs.as_mut_ptr()) }
        .result()
        .in_call("nvrtcGetSupportedArchs")?;
    Ok(archs
        .into_iter()
        .filter_map(|a| u32::try_from(a).ok())
        .collect())
}

/// Compiles CUDA C++ with fixed options for one target.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NvrtcCompiler {
    target: CompileTarget,
    fast_math: bool,
    fast_compile: bool,
}

impl NvrtcCompiler {
    /// For `device`'s own architecture (see [`CompileTarget::choose`]).
    pub fn for_device(device: &CudaDevice) -> Result<Self> {
        let (major, minor) = device.compute_capability();
        let target = CompileTarget::choose(major * 10 + minor, &supported_archs()?)?;
        Ok(Self::for_target(target))
    }

    /// For an explicit target.
    pub fn for_target(target: CompileTarget) -> Self {
        Self {
            target,
            fast_math: false,
            fast_compile: false,
        }
    }

    /// Enables `--use_fast_math` (off by default: results must match the
    /// CPU reference).
    pub fn with_fast_math(self, fast_math: bool) -> Self {
        Self { fast_math, ..self }
    }

    /// Enables `--Ofast-compile=max` (NVRTC 12.8 and later): compiles in a
    /// fraction of the time, into slower code that may keep arrays in local
    /// memory (for a kernel that only bridges the time until the optimized
    /// one is compiled).
    pub fn with_fast_compile(self, fast_compile: bool) -> Self {
        Self {
            fast_compile,
            ..self
        }
    }

    pub fn target(&self) -> CompileTarget {
        self.target
    }

    /// The NVRTC command line.
    pub fn options(&self) -> Vec<String> {
        let mut options = vec![
            format!("--gpu-architecture={}", self.target.gpu_architecture()),
            "-default-device".to_string(),
            "-std=c++17".to_string(),
        ];
        if self.fast_math {
            options.push("--use_fast_math".to_string());
        }
        if self.fast_compile {
            options.push("--Ofast-compile=max".to_string());
        }
        options
    }

    /// Names what this compiler produces, for cache keys: the architecture
    /// plus any option that changes the code.
    pub fn cache_tag(&self) -> String {
        let mut tag = self.target.gpu_architecture();
        if self.fast_math {
            tag.push_str("-fastmath");
        }
        if self.fast_compile {
            tag.push_str("-fastcompile");
        }
        tag
    }

    /// Compiles `source`, which defines the `extern "C"` kernels
    /// `kernel_names`, into an image for [`LoadedModule::load`].
    pub fn compile(&self, source: &str, kernel_names: &[&str]) -> Result<Vec<u8>> {
        check_kernel_names(kernel_names)?;
        let source = CString::new(source)
            .map_err(|_| CudaError::BadArgument("kernel source contains a NUL byte".into()))?;
        let name = CString::new(format!("{}.cu", kernel_names[0]))
            .map_err(|_| CudaError::BadArgument("kernel name contains a NUL byte".into()))?;
        let program = Program::create(source, name)?;
        // SAFETY: `program` is a live program (destroyed only by its Drop).
        if let Err(e) = unsafe { result::compile_program(program.raw, &self.options()) } {
            let log = program.log().unwrap_or_default();
            return Err(CudaError::Compile {
                kernels: kernel_names.join(", "),
                target: self.target.gpu_architecture(),
                log: if log.trim().is_empty() {
                    e.to_string()
                } else {
                    log
                },
            });
        }
        match self.target.kind {
            ImageKind::Cubin => program.cubin(),
            ImageKind::Ptx => program.ptx(),
        }
    }
}

/// Checks names before they reach C APIs (which need NUL-free strings).
pub(crate) fn check_kernel_names(kernel_names: &[&str]) -> Result<()> {
    if kernel_names.is_empty() {
        return Err(CudaError::BadArgument("no kernel names given".into()));
    }
    match kernel_names
        .iter()
        .find(|name| name.is_empty() || name.contains('\0'))
    {
        Some(bad) => Err(CudaError::BadArgument(format!(
            "invalid kernel name {bad:?}"
        ))),
        None => Ok(()),
    }
}

/// An NVRTC program, destroyed on drop. Owns the C strings NVRTC may refer to.
struct Program {
    raw: sys::nvrtcProgram,
    _source: CString,
    _name: CString,
}

impl Program {
    fn create(source: CString, name: CString) -> Result<Self> {
        let raw = result::create_program(&source, Some(&name)).in_call("nvrtcCreateProgram")?;
        Ok(Self {
            raw,
            _source: source,
            _name: name,
        })
    }

    fn log(&self) -> Result<String> {
        // SAFETY: `self.raw` is a live program.
        let log = unsafe { result::get_program_log(self.raw) }.in_call("nvrtcGetProgramLog")?;
        Ok(c_chars_to_string(&log))
    }

    fn cubin(&self) -> Result<Vec<u8>> {
        let mut size = 0usize;
        // SAFETY: `self.raw` is a live, compiled program; writes one usize.
        unsafe { sys::nvrtcGetCUBINSize(self.raw, &mut size) }
            .result()
            .in_call("nvrtcGetCUBINSize")?;
        let mut cubin = vec![0u8; size];
        // SAFETY: `cubin` has the `size` bytes NVRTC writes.
        unsafe { sys::nvrtcGetCUBIN(self.raw, cubin.as_mut_ptr().cast::<c_char>()) }
            .result()
            .in_call("nvrtcGetCUBIN")?;
        Ok(cubin)
    }

    fn ptx(&self) -> Result<Vec<u8>> {
        // SAFETY: `self.raw` is a live, compiled program.
        let ptx = unsafe { result::get_ptx(self.raw) }.in_call("nvrtcGetPTX")?;
        // Keeps NVRTC's terminating NUL, which `cuModuleLoadData` needs.
        Ok(ptx.into_iter().map(|c| c as u8).collect())
    }
}

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: `self.raw` was created by `nvrtcCreateProgram` and is
        // destroyed only here.
        if let Err(e) = unsafe { result::destroy_program(self.raw) } {
            eprintln!("ramus-cuda: nvrtcDestroyProgram failed: {e}");
        }
    }
}

fn c_chars_to_string(chars: &[c_char]) -> String {
    let bytes: Vec<u8> = chars
        .iter()
        .map(|&c| c as u8)
        .take_while(|&b| b != 0)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// A compiled image loaded into a context, with its kernels looked up.
#[derive(Debug)]
pub struct LoadedModule {
    module: Arc<CudaModule>,
    functions: Vec<(String, CudaFunction)>,
}

impl LoadedModule {
    /// Loads a cubin or PTX image (as [`NvrtcCompiler::compile`] makes) and
    /// looks up `kernel_names` in it.
    pub fn load(context: &Arc<CudaContext>, image: &[u8], kernel_names: &[&str]) -> Result<Self> {
        check_kernel_names(kernel_names)?;
        let mut image = image.to_vec();
        let is_elf = image.starts_with(b"\x7fELF");
        if !is_elf && image.last() != Some(&0) {
            image.push(0); // PTX text must be NUL-terminated
        }
        let module = context
            .load_module(Ptx::from_binary(image))
            .in_call("cuModuleLoadData")?;
        let functions = kernel_names
            .iter()
            .map(|&name| match module.load_function(name) {
                Ok(function) => Ok((name.to_string(), function)),
                Err(DriverError(CUresult::CUDA_ERROR_NOT_FOUND)) => {
                    Err(CudaError::KernelNotFound { name: name.into() })
                }
                Err(source) => Err(CudaError::Driver {
                    call: "cuModuleGetFunction",
                    source,
                }),
            })
            .collect::<Result<_>>()?;
        Ok(Self { module, functions })
    }

    /// The kernel `name`, which must be one of the names the module was
    /// loaded with.
    pub fn function(&self, name: &str) -> Result<&CudaFunction> {
        self.functions
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, function)| function)
            .ok_or_else(|| CudaError::KernelNotFound { name: name.into() })
    }

    /// The underlying module.
    pub fn module(&self) -> &Arc<CudaModule> {
        &self.module
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_target_is_the_device_itself_when_nvrtc_supports_it() {
        let supported = [75, 80, 86, 89, 90, 100, 120];
        let target = CompileTarget::choose(90, &supported).unwrap();
        assert_eq!(target.kind, ImageKind::Cubin);
        assert_eq!(target.gpu_architecture(), "sm_90");

        // An architecture newer than NVRTC knows: PTX for the newest below it.
        let target = CompileTarget::choose(130, &supported).unwrap();
        assert_eq!(target.gpu_architecture(), "compute_120");
        let target = CompileTarget::choose(87, &supported).unwrap();
        assert_eq!(target.gpu_architecture(), "compute_86");

        assert!(CompileTarget::choose(70, &supported).is_err());
    }

    #[test]
    fn options_follow_the_target_and_keep_exact_math_by_default() {
        let compiler = NvrtcCompiler::for_target(CompileTarget {
            arch: 90,
            kind: ImageKind::Cubin,
        });
        assert_eq!(
            compiler.options(),
            ["--gpu-architecture=sm_90", "-default-device", "-std=c++17"]
        );
        assert_eq!(compiler.cache_tag(), "sm_90");
        let fast = compiler.clone().with_fast_math(true);
        assert!(fast.options().contains(&"--use_fast_math".to_string()));
        let quick = compiler.clone().with_fast_compile(true);
        assert!(quick.options().contains(&"--Ofast-compile=max".to_string()));
        assert_eq!(quick.cache_tag(), "sm_90-fastcompile");
        assert_eq!(fast.cache_tag(), "sm_90-fastmath");
    }

    #[test]
    fn kernel_names_are_checked() {
        assert!(check_kernel_names(&["saxpy", "scale"]).is_ok());
        assert!(check_kernel_names(&[]).is_err());
        assert!(check_kernel_names(&[""]).is_err());
        assert!(check_kernel_names(&["a\0b"]).is_err());
    }
}
