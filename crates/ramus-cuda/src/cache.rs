//! The kernel cache: compiled kernels kept in memory and on disk, so each
//! kernel source is compiled once per machine rather than once per run.
//!
//! Keys hash the *normalized* source ([`normalize_source`]: comments
//! stripped, whitespace collapsed), so sources that differ only in comments or
//! spacing share an entry. The hash is 64-bit FNV-1a ([`fnv1a64`]): its
//! definition is fixed (unlike `std`'s hasher, whose algorithm may change
//! between Rust releases, which would silently invalidate every disk entry),
//! it needs no dependency, and collisions are negligible at the scale of a
//! kernel cache (about n²/2⁶⁵: 10⁻¹¹ for ten thousand kernels). It is not a
//! defence against a forged cache directory, which is the user's own.
//!
//! Disk entries live in [`default_cache_dir`] and are named by source hash,
//! compile target and Ramus version. Each holds a header with the source hash,
//! the image length and an image checksum, so a truncated or corrupt entry is
//! detected, logged and rebuilt. Entries are written atomically (temporary
//! file, then rename); a failed write is logged and otherwise ignored.
//!
//! [`KernelCache::prefetch`] starts a compile on a thread of its own, so that
//! several sources compile at once on the host's cores (the persistent
//! engine's `rpw` candidates) while the caller goes on; the lookup of that
//! source then waits for it instead of compiling again.
//!
//! The compiler and the loader are passed in ([`KernelCache::new`]), so the
//! cache logic is tested on the CPU with a fake compiler;
//! [`KernelCache::for_device`] plugs in NVRTC and the CUDA driver.

use std::collections::HashMap;
use std::ffi::OsString;
use std::fmt;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::device::CudaDevice;
use crate::error::{CudaError, Result};
use crate::rtc::{check_kernel_names, LoadedModule, NvrtcCompiler};

/// Compiles a source that defines the named kernels into an image.
pub type CompileFn = dyn Fn(&str, &[&str]) -> Result<Vec<u8>> + Send + Sync;
/// Turns an image into a usable module that provides the named kernels.
pub type LoadFn<M> = dyn Fn(&[u8], &[&str]) -> Result<M> + Send + Sync;

/// Counters of a [`KernelCache`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KernelCacheStats {
    /// Sources compiled (misses in memory and on disk).
    pub compiled: u64,
    /// Lookups answered from memory.
    pub memory_hits: u64,
    /// Lookups answered from disk.
    pub disk_hits: u64,
    /// Time spent compiling.
    pub compile_time: Duration,
    /// Disk entries found corrupt or unloadable (and rebuilt).
    pub corrupt_entries: u64,
    /// Disk entries that could not be written.
    pub failed_writes: u64,
}

impl fmt::Display for KernelCacheStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "kernels: {} compiled in {:.3} s, {} memory hits, {} disk hits",
            self.compiled,
            self.compile_time.as_secs_f64(),
            self.memory_hits,
            self.disk_hits
        )?;
        if self.corrupt_entries > 0 {
            write!(f, ", {} corrupt entries rebuilt", self.corrupt_entries)?;
        }
        if self.failed_writes > 0 {
            write!(f, ", {} cache writes failed", self.failed_writes)?;
        }
        Ok(())
    }
}

/// A compile started on a thread of its own ([`KernelCache::prefetch`],
/// [`compile_in_background`]): the image and the time the compile took.
pub type Prefetched = JoinHandle<Result<(Vec<u8>, Duration)>>;

/// Starts `compile` of `source` (which defines `kernel_names`) on a thread
/// of its own, for [`KernelCache::adopt`] once the cache exists.
pub fn compile_in_background(
    source: &str,
    kernel_names: &[&str],
    compile: impl FnOnce(&str, &[&str]) -> Result<Vec<u8>> + Send + 'static,
) -> io::Result<Prefetched> {
    let source = source.to_string();
    let names: Vec<String> = kernel_names.iter().map(|n| n.to_string()).collect();
    std::thread::Builder::new()
        .name("ramus-kernel-compile".into())
        .spawn(move || {
            let names: Vec<&str> = names.iter().map(String::as_str).collect();
            let started = Instant::now();
            let image = compile(&source, &names)?;
            Ok((image, started.elapsed()))
        })
}

struct CacheState<M> {
    loaded: HashMap<u64, Arc<M>>,
    /// Compiles under way on threads of their own, by memory key.
    prefetching: HashMap<u64, Prefetched>,
    stats: KernelCacheStats,
}

/// Compiled kernels by source, in memory and on disk. `M` is what a loaded
/// image becomes: a [`LoadedModule`] on a device, anything in tests.
pub struct KernelCache<M = LoadedModule> {
    directory: Option<PathBuf>,
    target_tag: String,
    compile: Arc<CompileFn>,
    load: Box<LoadFn<M>>,
    state: Mutex<CacheState<M>>,
}

/// Waits for the compiles still under way: a process that ends while a
/// thread is inside the compiler (a run stopped by an error during its
/// set-up) would otherwise tear the compiler's library down under it.
impl<M> Drop for KernelCache<M> {
    fn drop(&mut self) {
        let prefetching = std::mem::take(&mut self.lock().prefetching);
        for (_, compiling) in prefetching {
            // its image or error is of no use any more
            let _ = compiling.join();
        }
    }
}

impl<M> fmt::Debug for KernelCache<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KernelCache")
            .field("directory", &self.directory)
            .field("target_tag", &self.target_tag)
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

impl KernelCache<LoadedModule> {
    /// NVRTC for `device` with the default options; images are loaded into
    /// the device's context. `directory` is usually [`default_cache_dir`];
    /// `None` keeps the cache in memory only.
    pub fn for_device(device: &CudaDevice, directory: Option<PathBuf>) -> Result<Self> {
        Ok(Self::with_compiler(
            device,
            NvrtcCompiler::for_device(device)?,
            directory,
        ))
    }

    /// Like [`KernelCache::for_device`], with a configured compiler.
    pub fn with_compiler(
        device: &CudaDevice,
        compiler: NvrtcCompiler,
        directory: Option<PathBuf>,
    ) -> Self {
        let context = Arc::clone(device.context());
        let target_tag = compiler.cache_tag();
        Self::new(
            target_tag,
            directory,
            move |source, names| compiler.compile(source, names),
            move |image, names| LoadedModule::load(&context, image, names),
        )
    }
}

impl<M> KernelCache<M> {
    /// A cache whose entries are made by `compile` and `load`. `target_tag`
    /// names everything that makes images differ besides the source (the
    /// architecture and code-changing options); it is part of file names.
    pub fn new(
        target_tag: impl Into<String>,
        directory: Option<PathBuf>,
        compile: impl Fn(&str, &[&str]) -> Result<Vec<u8>> + Send + Sync + 'static,
        load: impl Fn(&[u8], &[&str]) -> Result<M> + Send + Sync + 'static,
    ) -> Self {
        let target_tag = file_safe(&target_tag.into());
        Self {
            directory,
            target_tag,
            compile: Arc::new(compile),
            load: Box::new(load),
            state: Mutex::new(CacheState {
                loaded: HashMap::new(),
                prefetching: HashMap::new(),
                stats: KernelCacheStats::default(),
            }),
        }
    }

    /// The module for `source`, which defines the kernels `kernel_names`:
    /// from memory, else from disk, else compiled (and written to disk).
    /// Sources differing only in comments and whitespace share an entry.
    pub fn get_or_compile(&self, source: &str, kernel_names: &[&str]) -> Result<Arc<M>> {
        let (source_hash, memory_key) = entry_keys(source, kernel_names)?;
        // Held throughout, so each source is compiled once even when several
        // threads ask for it at the same time.
        let mut state = self.lock();
        if let Some(module) = state.loaded.get(&memory_key) {
            let module = Arc::clone(module);
            state.stats.memory_hits += 1;
            return Ok(module);
        }
        let path = self.entry_path(source_hash);
        if let Some(path) = &path {
            if let Some(module) =
                self.load_from_disk(&mut state, path, source_hash, kernel_names)?
            {
                let module = Arc::new(module);
                state.stats.disk_hits += 1;
                state.loaded.insert(memory_key, Arc::clone(&module));
                return Ok(module);
            }
        }
        let (image, took) = match state.prefetching.remove(&memory_key) {
            Some(compiling) => compiling.join().unwrap_or_else(|_| {
                Err(CudaError::Compile {
                    kernels: kernel_names.join(", "),
                    target: self.target_tag.clone(),
                    log: "the thread compiling them panicked".into(),
                })
            })?,
            None => {
                let started = Instant::now();
                let image = (self.compile)(source, kernel_names)?;
                (image, started.elapsed())
            }
        };
        state.stats.compile_time += took;
        state.stats.compiled += 1;
        if let Some(path) = &path {
            if let Err(e) = write_atomically(path, &encode_entry(source_hash, &image)) {
                if state.stats.failed_writes == 0 {
                    eprintln!(
                        "ramus-cuda: could not write kernel cache entry {} ({e}); \
                         kernels will be recompiled in later runs",
                        path.display()
                    );
                }
                state.stats.failed_writes += 1;
            }
        }
        let module = Arc::new((self.load)(&image, kernel_names)?);
        state.loaded.insert(memory_key, Arc::clone(&module));
        Ok(module)
    }

    /// Starts compiling `source` (which defines `kernel_names`) on a thread
    /// of its own, unless it is loaded, on disk or already compiling; a
    /// later [`get_or_compile`](Self::get_or_compile) of it waits for that
    /// compile (and reports its error, if any) instead of compiling again.
    /// Where no thread can be started, the lookup compiles as usual.
    pub fn prefetch(&self, source: &str, kernel_names: &[&str]) -> Result<()> {
        let (source_hash, memory_key) = entry_keys(source, kernel_names)?;
        let mut state = self.lock();
        let on_disk = self
            .entry_path(source_hash)
            .is_some_and(|path| path.is_file());
        if on_disk
            || state.loaded.contains_key(&memory_key)
            || state.prefetching.contains_key(&memory_key)
        {
            return Ok(());
        }
        let compile = Arc::clone(&self.compile);
        if let Ok(compiling) =
            compile_in_background(source, kernel_names, move |s, n| compile(s, n))
        {
            state.prefetching.insert(memory_key, compiling);
        }
        Ok(())
    }

    /// Takes over `compiling`, a compile of `source` (which defines
    /// `kernel_names`) started with [`compile_in_background`] before this
    /// cache existed, with the compiler this cache uses: a later lookup
    /// waits for it as for a [`prefetch`](Self::prefetch). A source the
    /// cache already has or compiles keeps that, and `compiling` is left to
    /// finish on its own.
    pub fn adopt(&self, source: &str, kernel_names: &[&str], compiling: Prefetched) -> Result<()> {
        let (_, memory_key) = entry_keys(source, kernel_names)?;
        let mut state = self.lock();
        if !state.loaded.contains_key(&memory_key) {
            state.prefetching.entry(memory_key).or_insert(compiling);
        }
        Ok(())
    }

    /// Whether the module for `source` can be had without waiting for a
    /// compile: loaded, on disk, or its prefetched compile done. Where it is
    /// none of these and no compile is under way, starts one (see
    /// [`prefetch`](Self::prefetch)); where no thread can compile it, the
    /// lookup has to, and it counts as ready.
    pub fn is_ready(&self, source: &str, kernel_names: &[&str]) -> Result<bool> {
        let (source_hash, memory_key) = entry_keys(source, kernel_names)?;
        {
            let state = self.lock();
            if state.loaded.contains_key(&memory_key) {
                return Ok(true);
            }
            if let Some(compiling) = state.prefetching.get(&memory_key) {
                return Ok(compiling.is_finished());
            }
        }
        if self
            .entry_path(source_hash)
            .is_some_and(|path| path.is_file())
        {
            return Ok(true);
        }
        self.prefetch(source, kernel_names)?;
        Ok(!self.lock().prefetching.contains_key(&memory_key))
    }

    /// The cache's counters.
    pub fn stats(&self) -> KernelCacheStats {
        self.lock().stats
    }

    /// Where entries are stored, if on disk.
    pub fn directory(&self) -> Option<&Path> {
        self.directory.as_deref()
    }

    /// The file that holds (or would hold) the entry for `source`.
    pub fn entry_path_for(&self, source: &str) -> Option<PathBuf> {
        self.entry_path(source_hash(source))
    }

    fn entry_path(&self, source_hash: u64) -> Option<PathBuf> {
        self.directory
            .as_ref()
            .map(|dir| entry_file(dir, &self.target_tag, source_hash))
    }

    fn lock(&self) -> MutexGuard<'_, CacheState<M>> {
        // A panicking compiler cannot leave the map half-updated.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// `Ok(None)` when there is no usable entry (missing, corrupt or not
    /// loadable: the caller recompiles); errors only for a kernel that the
    /// entry lacks, which recompiling would not fix.
    fn load_from_disk(
        &self,
        state: &mut CacheState<M>,
        path: &Path,
        source_hash: u64,
        kernel_names: &[&str],
    ) -> Result<Option<M>> {
        let bytes = match std::fs::read(path) {
            Ok(bytes) => bytes,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::NotFound | io::ErrorKind::NotADirectory
                ) =>
            {
                return Ok(None)
            }
            Err(e) => {
                eprintln!(
                    "ramus-cuda: cannot read kernel cache entry {} ({e}); recompiling",
                    path.display()
                );
                return Ok(None);
            }
        };
        let image = match decode_entry(&bytes, source_hash) {
            Ok(image) => image,
            Err(reason) => {
                eprintln!(
                    "ramus-cuda: kernel cache entry {} is corrupt ({reason}); recompiling",
                    path.display()
                );
                state.stats.corrupt_entries += 1;
                return Ok(None);
            }
        };
        match (self.load)(image, kernel_names) {
            Ok(module) => Ok(Some(module)),
            Err(e @ CudaError::KernelNotFound { .. }) => Err(e),
            Err(e) => {
                eprintln!(
                    "ramus-cuda: cannot load kernel cache entry {} ({e}); recompiling",
                    path.display()
                );
                state.stats.corrupt_entries += 1;
                Ok(None)
            }
        }
    }
}

/// Whether a cache over `directory` whose compiler is tagged
/// `target_tag` (see [`NvrtcCompiler::cache_tag`](crate::NvrtcCompiler::cache_tag)) holds `source` on
/// disk: known before the device is opened.
pub fn entry_on_disk(directory: &Path, target_tag: &str, source: &str) -> bool {
    entry_file(directory, &file_safe(target_tag), source_hash(source)).is_file()
}

/// The hash that names `source`'s entry: of its text without comments and
/// runs of whitespace.
fn source_hash(source: &str) -> u64 {
    fnv1a64(normalize_source(source).as_bytes())
}

/// `source`'s hash and its memory key with `kernel_names` (checked).
fn entry_keys(source: &str, kernel_names: &[&str]) -> Result<(u64, u64)> {
    check_kernel_names(kernel_names)?;
    let hash = source_hash(source);
    Ok((hash, with_kernel_names(hash, kernel_names)))
}

/// `tag` with every character a file name might not take replaced by `_`.
fn file_safe(tag: &str) -> String {
    tag.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "_-.".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// The entry file of a source in `directory`, for a compiler tagged `tag`
/// (already [`file_safe`]) and this version of Ramus.
fn entry_file(directory: &Path, tag: &str, source_hash: u64) -> PathBuf {
    let version = env!("CARGO_PKG_VERSION");
    directory.join(format!("{source_hash:016x}-{tag}-ramus-{version}.kbin"))
}

/// The directory for disk entries: `$RAMUS_CACHE_DIR` if set, else
/// `$XDG_CACHE_HOME/ramus/kernels`, else `$HOME/.cache/ramus/kernels`;
/// `None` if none of these is set.
pub fn default_cache_dir() -> Option<PathBuf> {
    cache_dir_from(
        std::env::var_os("RAMUS_CACHE_DIR"),
        std::env::var_os("XDG_CACHE_HOME"),
        std::env::var_os("HOME"),
    )
}

fn cache_dir_from(
    ramus_cache_dir: Option<OsString>,
    xdg_cache_home: Option<OsString>,
    home: Option<OsString>,
) -> Option<PathBuf> {
    let set = |value: Option<OsString>| value.filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(dir) = set(ramus_cache_dir) {
        return Some(dir);
    }
    // The XDG spec ignores relative paths.
    if let Some(dir) = set(xdg_cache_home).filter(|dir| dir.is_absolute()) {
        return Some(dir.join("ramus").join("kernels"));
    }
    set(home).map(|home| home.join(".cache").join("ramus").join("kernels"))
}

/// The source with comments removed and whitespace collapsed: a run of
/// whitespace (and comments) becomes one newline if it contains a newline
/// (so preprocessor lines stay separate), else one space; leading and
/// trailing whitespace is dropped. String and character literals are kept
/// verbatim. (C++ raw string literals are not recognised.)
pub fn normalize_source(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    // The whitespace seen since the last token: None, Some(' ') or Some('\n').
    let mut gap: Option<char> = None;
    let mut chars = source.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '/' if chars.peek() == Some(&'/') => {
                // A line comment ends before the newline (unless continued).
                while let Some(&next) = chars.peek() {
                    if next == '\n' {
                        break;
                    }
                    chars.next();
                    if next == '\\' && chars.peek() == Some(&'\n') {
                        chars.next();
                    }
                }
                gap = gap.or(Some(' '));
            }
            '/' if chars.peek() == Some(&'*') => {
                chars.next();
                let mut previous = '\0';
                for next in chars.by_ref() {
                    if previous == '*' && next == '/' {
                        break;
                    }
                    previous = next;
                }
                // A block comment is one space, even across lines.
                gap = gap.or(Some(' '));
            }
            c if c.is_whitespace() => {
                gap = Some(if c == '\n' || gap == Some('\n') {
                    '\n'
                } else {
                    ' '
                });
            }
            _ => {
                if let Some(separator) = gap.take() {
                    if !out.is_empty() {
                        out.push(separator);
                    }
                }
                out.push(c);
                if c == '"' || c == '\'' {
                    copy_literal(c, &mut chars, &mut out);
                }
            }
        }
    }
    out
}

/// Copies a string or character literal up to its closing `quote`.
fn copy_literal(quote: char, chars: &mut impl Iterator<Item = char>, out: &mut String) {
    while let Some(c) = chars.next() {
        out.push(c);
        match c {
            '\\' => {
                if let Some(escaped) = chars.next() {
                    out.push(escaped);
                }
            }
            '\n' => return, // unterminated: let the compiler complain
            c if c == quote => return,
            _ => {}
        }
    }
}

const FNV_OFFSET_BASIS: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

/// 64-bit FNV-1a of `bytes`.
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    fnv1a64_continue(FNV_OFFSET_BASIS, bytes)
}

fn fnv1a64_continue(mut hash: u64, bytes: &[u8]) -> u64 {
    for &byte in bytes {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(FNV_PRIME);
    }
    hash
}

/// Memory entries are per source *and* kernel list (a module holds the
/// kernels it was loaded with); disk entries per source only.
fn with_kernel_names(source_hash: u64, kernel_names: &[&str]) -> u64 {
    kernel_names.iter().fold(source_hash, |hash, name| {
        fnv1a64_continue(fnv1a64_continue(hash, name.as_bytes()), &[0])
    })
}

/// Disk entry layout (little-endian): magic, source hash, image length,
/// image checksum (FNV-1a 64), image.
const ENTRY_MAGIC: &[u8; 8] = b"RAMUSKC\x01";
const ENTRY_HEADER_LEN: usize = 32;

fn encode_entry(source_hash: u64, image: &[u8]) -> Vec<u8> {
    let mut entry = Vec::with_capacity(ENTRY_HEADER_LEN + image.len());
    entry.extend_from_slice(ENTRY_MAGIC);
    entry.extend_from_slice(&source_hash.to_le_bytes());
    entry.extend_from_slice(&(image.len() as u64).to_le_bytes());
    entry.extend_from_slice(&fnv1a64(image).to_le_bytes());
    entry.extend_from_slice(image);
    entry
}

/// The image of a well-formed entry for `source_hash`, or why it is not one.
fn decode_entry(entry: &[u8], source_hash: u64) -> std::result::Result<&[u8], String> {
    if entry.len() < ENTRY_HEADER_LEN {
        return Err(format!("{} bytes, shorter than the header", entry.len()));
    }
    let (header, image) = entry.split_at(ENTRY_HEADER_LEN);
    let word = |i: usize| {
        let mut bytes = [0u8; 8];
        bytes.copy_from_slice(&header[8 * i..8 * i + 8]);
        u64::from_le_bytes(bytes)
    };
    if &header[..8] != ENTRY_MAGIC {
        return Err("not a Ramus kernel cache entry".into());
    }
    if word(1) != source_hash {
        return Err("written for another source".into());
    }
    if word(2) != image.len() as u64 {
        return Err(format!(
            "image of {} bytes where the header says {}",
            image.len(),
            word(2)
        ));
    }
    if word(3) != fnv1a64(image) {
        return Err("image checksum mismatch".into());
    }
    Ok(image)
}

/// Writes `bytes` to a temporary file beside `path`, then renames it over
/// `path`, so readers see either the old entry or the complete new one.
fn write_atomically(path: &Path, bytes: &[u8]) -> io::Result<()> {
    static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);
    let dir = path
        .parent()
        .ok_or_else(|| io::Error::other("cache entry path has no parent directory"))?;
    std::fs::create_dir_all(dir)?;
    let file_name = path.file_name().unwrap_or_default().to_string_lossy();
    let temp = dir.join(format!(
        ".{file_name}.{}.{}.tmp",
        std::process::id(),
        TEMP_COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let written = std::fs::File::create(&temp)
        .and_then(|mut file| file.write_all(bytes))
        .and_then(|()| std::fs::rename(&temp, path));
    if written.is_err() {
        // Best effort: the temporary file may not exist.
        let _ = std::fs::remove_file(&temp);
    }
    written
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    /// A fresh directory under the system temp dir, removed on drop.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new(name: &str) -> Self {
            static COUNTER: AtomicUsize = AtomicUsize::new(0);
            let dir = std::env::temp_dir().join(format!(
                "ramus-cuda-{name}-{}-{}",
                std::process::id(),
                COUNTER.fetch_add(1, Ordering::Relaxed)
            ));
            std::fs::create_dir_all(&dir).unwrap();
            Self(dir)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// A cache whose "compiler" prefixes the source and counts calls, and
    /// whose "loader" turns the image back into a string.
    fn fake_cache(directory: Option<PathBuf>) -> (KernelCache<String>, Arc<AtomicUsize>) {
        let compiles = Arc::new(AtomicUsize::new(0));
        let counter = Arc::clone(&compiles);
        let cache = KernelCache::new(
            "sm_test",
            directory,
            move |source: &str, _names: &[&str]| {
                counter.fetch_add(1, Ordering::Relaxed);
                if source.contains("syntax error") {
                    return Err(CudaError::Compile {
                        kernels: "k".into(),
                        target: "sm_test".into(),
                        log: "syntax error".into(),
                    });
                }
                Ok(format!("IMAGE:{source}").into_bytes())
            },
            |image: &[u8], _names: &[&str]| {
                String::from_utf8(image.to_vec())
                    .map_err(|_| CudaError::BadArgument("image is not UTF-8".into()))
            },
        );
        (cache, compiles)
    }

    const SAXPY: &str = r#"
        // y = a x + y
        extern "C" __global__ void saxpy(float a, const float* x, float* y, unsigned n) {
            unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
            if (i < n) { y[i] = a * x[i] + y[i]; }
        }
    "#;

    #[test]
    fn the_second_lookup_is_a_memory_hit() {
        let (cache, compiles) = fake_cache(None);
        let first = cache.get_or_compile(SAXPY, &["saxpy"]).unwrap();
        let second = cache.get_or_compile(SAXPY, &["saxpy"]).unwrap();
        assert!(Arc::ptr_eq(&first, &second));
        assert!(first.starts_with("IMAGE:"));
        assert_eq!(compiles.load(Ordering::Relaxed), 1);
        let stats = cache.stats();
        assert_eq!(
            (stats.compiled, stats.memory_hits, stats.disk_hits),
            (1, 1, 0)
        );
        assert!(stats.to_string().contains("1 compiled"));
    }

    #[test]
    fn a_prefetched_source_compiles_once_on_its_own_thread() {
        let dir = TempDir::new("prefetch");
        let (cache, compiles) = fake_cache(Some(dir.0.clone()));
        cache.prefetch(SAXPY, &["saxpy"]).unwrap();
        // asked again while (or after) it compiles: nothing more starts
        cache.prefetch(SAXPY, &["saxpy"]).unwrap();
        let module = cache.get_or_compile(SAXPY, &["saxpy"]).unwrap();
        assert!(module.starts_with("IMAGE:"));
        assert_eq!(compiles.load(Ordering::Relaxed), 1);
        let stats = cache.stats();
        assert_eq!((stats.compiled, stats.memory_hits), (1, 0));
        // written to disk like any compile: a new cache prefetches nothing
        assert!(cache.entry_path_for(SAXPY).unwrap().is_file());
        let (cache, compiles) = fake_cache(Some(dir.0.clone()));
        cache.prefetch(SAXPY, &["saxpy"]).unwrap();
        cache.get_or_compile(SAXPY, &["saxpy"]).unwrap();
        assert_eq!(compiles.load(Ordering::Relaxed), 0);
        assert_eq!(cache.stats().disk_hits, 1);
        // a loaded source is not compiled again either
        cache.prefetch(SAXPY, &["saxpy"]).unwrap();
        assert_eq!(compiles.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn readiness_starts_a_compile_and_follows_it_and_the_disk() {
        let dir = TempDir::new("ready");
        let (cache, compiles) = fake_cache(Some(dir.0.clone()));
        assert!(!entry_on_disk(&dir.0, "sm_test", SAXPY));
        // nothing compiles it yet: asking starts a compile of its own
        let mut ready = cache.is_ready(SAXPY, &["saxpy"]).unwrap();
        let started = Instant::now();
        while !ready && started.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(1));
            ready = cache.is_ready(SAXPY, &["saxpy"]).unwrap();
        }
        assert!(ready, "the compile finishes");
        assert_eq!(compiles.load(Ordering::Relaxed), 1);
        // the lookup takes the compiled image and writes it to disk
        cache.get_or_compile(SAXPY, &["saxpy"]).unwrap();
        assert_eq!(compiles.load(Ordering::Relaxed), 1);
        assert!(cache.is_ready(SAXPY, &["saxpy"]).unwrap());
        assert!(entry_on_disk(&dir.0, "sm_test", SAXPY));
        assert!(!entry_on_disk(&dir.0, "sm_other", SAXPY));
        // a new cache over the directory: ready from disk, nothing compiles
        let (cache, compiles) = fake_cache(Some(dir.0.clone()));
        assert!(cache.is_ready(SAXPY, &["saxpy"]).unwrap());
        assert_eq!(compiles.load(Ordering::Relaxed), 0);
        assert!(cache.is_ready(SAXPY, &[]).is_err(), "no kernel names");
    }

    #[test]
    fn an_adopted_compile_is_what_the_lookup_takes() {
        let (cache, compiles) = fake_cache(None);
        let early = compile_in_background(SAXPY, &["saxpy"], |source, _| {
            Ok(format!("EARLY:{source}").into_bytes())
        })
        .unwrap();
        cache.adopt(SAXPY, &["saxpy"], early).unwrap();
        // nothing else starts: it counts as compiling
        cache.prefetch(SAXPY, &["saxpy"]).unwrap();
        let module = cache.get_or_compile(SAXPY, &["saxpy"]).unwrap();
        assert!(module.starts_with("EARLY:"), "{module}");
        assert_eq!(compiles.load(Ordering::Relaxed), 0);
        assert_eq!(cache.stats().compiled, 1);
        // a loaded source keeps its module
        let late = compile_in_background(SAXPY, &["saxpy"], |_, _| Ok(b"LATE".to_vec())).unwrap();
        cache.adopt(SAXPY, &["saxpy"], late).unwrap();
        assert!(cache
            .get_or_compile(SAXPY, &["saxpy"])
            .unwrap()
            .starts_with("EARLY:"));
    }

    #[test]
    fn a_prefetched_compile_error_reaches_the_lookup() {
        let (cache, compiles) = fake_cache(None);
        let broken = "syntax error";
        cache.prefetch(broken, &["k"]).unwrap();
        match cache.get_or_compile(broken, &["k"]) {
            Err(CudaError::Compile { log, .. }) => assert!(log.contains("syntax error")),
            other => panic!("expected the compile error, got {other:?}"),
        }
        assert_eq!(compiles.load(Ordering::Relaxed), 1);
        assert!(cache.prefetch(broken, &[]).is_err(), "no kernel names");
    }

    #[test]
    fn comment_and_whitespace_variants_share_an_entry() {
        let dir = TempDir::new("variants");
        let (cache, compiles) = fake_cache(Some(dir.0.clone()));
        let variant = r#"/* the same kernel */
extern "C"   __global__ void saxpy(float a,   const float* x, float* y,  unsigned n) {

    unsigned i = blockIdx.x * blockDim.x + threadIdx.x; // index
    if (i < n) { y[i] = a * x[i] + y[i]; }
}"#;
        cache.get_or_compile(SAXPY, &["saxpy"]).unwrap();
        cache.get_or_compile(variant, &["saxpy"]).unwrap();
        assert_eq!(compiles.load(Ordering::Relaxed), 1);
        assert_eq!(cache.entry_path_for(SAXPY), cache.entry_path_for(variant));
        // A different kernel is a different entry.
        cache
            .get_or_compile(&SAXPY.replace("a * x[i]", "a * x[i] * a"), &["saxpy"])
            .unwrap();
        assert_eq!(compiles.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn a_new_cache_over_the_same_directory_reads_from_disk() {
        let dir = TempDir::new("disk");
        let (cache, _) = fake_cache(Some(dir.0.clone()));
        let compiled = cache.get_or_compile(SAXPY, &["saxpy"]).unwrap();
        drop(cache);

        let (cache, compiles) = fake_cache(Some(dir.0.clone()));
        let loaded = cache.get_or_compile(SAXPY, &["saxpy"]).unwrap();
        assert_eq!(loaded, compiled);
        assert_eq!(compiles.load(Ordering::Relaxed), 0);
        let stats = cache.stats();
        assert_eq!((stats.compiled, stats.disk_hits), (0, 1));
        // Another kernel list over the same source: a new module, no compile.
        cache.get_or_compile(SAXPY, &["saxpy", "other"]).unwrap();
        assert_eq!(cache.stats().disk_hits, 2);
        assert_eq!(compiles.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn corrupt_and_truncated_entries_are_rebuilt() {
        let dir = TempDir::new("corrupt");
        let (cache, _) = fake_cache(Some(dir.0.clone()));
        cache.get_or_compile(SAXPY, &["saxpy"]).unwrap();
        let path = cache.entry_path_for(SAXPY).unwrap();
        let good = std::fs::read(&path).unwrap();

        let mut flipped = good.clone();
        *flipped.last_mut().unwrap() ^= 0x40;
        let truncated = good[..good.len() - 7].to_vec();
        let garbage = b"not an entry".to_vec();
        for bad in [flipped, truncated, garbage, Vec::new()] {
            std::fs::write(&path, &bad).unwrap();
            let (cache, compiles) = fake_cache(Some(dir.0.clone()));
            let module = cache.get_or_compile(SAXPY, &["saxpy"]).unwrap();
            assert!(module.starts_with("IMAGE:"));
            assert_eq!(compiles.load(Ordering::Relaxed), 1);
            assert_eq!(cache.stats().corrupt_entries, 1);
            assert_eq!(
                std::fs::read(&path).unwrap(),
                good,
                "the entry is rewritten"
            );
        }
    }

    #[test]
    fn an_unwritable_directory_still_compiles() {
        let dir = TempDir::new("unwritable");
        // A directory under a regular file cannot be created (even by root).
        let blocker = dir.0.join("file");
        std::fs::write(&blocker, b"").unwrap();
        let (cache, compiles) = fake_cache(Some(blocker.join("kernels")));
        cache.get_or_compile(SAXPY, &["saxpy"]).unwrap();
        cache.get_or_compile(SAXPY, &["saxpy"]).unwrap();
        let stats = cache.stats();
        assert_eq!(compiles.load(Ordering::Relaxed), 1);
        assert_eq!((stats.failed_writes, stats.memory_hits), (1, 1));
    }

    #[test]
    fn compile_errors_are_returned_and_not_cached() {
        let dir = TempDir::new("errors");
        let (cache, compiles) = fake_cache(Some(dir.0.clone()));
        let source = "syntax error";
        assert!(matches!(
            cache.get_or_compile(source, &["k"]),
            Err(CudaError::Compile { .. })
        ));
        assert!(cache.get_or_compile(source, &["k"]).is_err());
        assert_eq!(compiles.load(Ordering::Relaxed), 2);
        assert!(!cache.entry_path_for(source).unwrap().exists());
        assert!(cache.get_or_compile(SAXPY, &[]).is_err(), "no kernel names");
    }

    #[test]
    fn entry_files_name_hash_target_and_version() {
        let (cache, _) = fake_cache(Some(PathBuf::from("/cache")));
        let path = cache.entry_path_for(SAXPY).unwrap();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let hash = fnv1a64(normalize_source(SAXPY).as_bytes());
        assert_eq!(
            name,
            format!(
                "{hash:016x}-sm_test-ramus-{}.kbin",
                env!("CARGO_PKG_VERSION")
            )
        );
        assert!(fake_cache(None).0.entry_path_for(SAXPY).is_none());
    }

    #[test]
    fn normalization_strips_comments_and_collapses_whitespace() {
        assert_eq!(
            normalize_source("  a  +\tb // c\n\n  d /* e\n f */ g  "),
            "a + b\nd g"
        );
        assert_eq!(normalize_source("x/**/y"), "x y");
        // Newlines survive so that preprocessor lines stay lines.
        assert_eq!(
            normalize_source("#define A 1\n int x;"),
            "#define A 1\nint x;"
        );
        // Literals are kept verbatim, including comment markers and escapes.
        assert_eq!(
            normalize_source(r#"printf("a  // b \" /* c");  // d"#),
            r#"printf("a  // b \" /* c");"#
        );
        assert_eq!(normalize_source("c = '\"';  // q"), "c = '\"';");
        // A continued line comment swallows the next line.
        assert_eq!(normalize_source("a // b \\\n c\nd"), "a\nd");
    }

    #[test]
    fn fnv1a64_matches_the_reference_values() {
        assert_eq!(fnv1a64(b""), 0xcbf29ce484222325);
        assert_eq!(fnv1a64(b"a"), 0xaf63dc4c8601ec8c);
        assert_eq!(fnv1a64(b"foobar"), 0x85944171f73967e8);
    }

    #[test]
    fn entries_round_trip_and_reject_damage() {
        let entry = encode_entry(42, b"cubin bytes");
        assert_eq!(decode_entry(&entry, 42).unwrap(), b"cubin bytes");
        assert!(decode_entry(&entry, 43).is_err());
        assert!(decode_entry(&entry[..entry.len() - 1], 42).is_err());
        assert!(decode_entry(&entry[..10], 42).is_err());
        let mut longer = entry.clone();
        longer.push(0);
        assert!(decode_entry(&longer, 42).is_err());
    }

    #[test]
    fn the_cache_directory_follows_the_environment_precedence() {
        let os = |s: &str| Some(OsString::from(s));
        assert_eq!(
            cache_dir_from(os("/r"), os("/x"), os("/h")),
            Some(PathBuf::from("/r"))
        );
        assert_eq!(
            cache_dir_from(None, os("/x"), os("/h")),
            Some(PathBuf::from("/x/ramus/kernels"))
        );
        assert_eq!(
            cache_dir_from(os(""), os("relative"), os("/h")),
            Some(PathBuf::from("/h/.cache/ramus/kernels"))
        );
        assert_eq!(cache_dir_from(None, None, None), None);
    }
}
