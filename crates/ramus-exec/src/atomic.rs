//! Files written whole or not at all: the bytes go to a temporary file in
//! the destination's directory, are flushed to disk, and the temporary file
//! is renamed over the destination (then, on Unix, the directory is synced
//! so that the rename itself survives a crash). A process killed at any
//! moment leaves either the old file or the new one, never a torn one.

use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// The directory `path` is in (`.` for a bare file name).
fn parent_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// A temporary name beside `path`, unique within this process and among
/// processes (hidden, ending in `.tmp`).
fn temp_path(path: &Path) -> PathBuf {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    parent_dir(path).join(format!(
        ".{name}.{}.{}.tmp",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ))
}

/// Writes `bytes` to `path` atomically (see the module docs).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let temp = temp_path(path);
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&temp)
        .and_then(|mut file| {
            file.write_all(bytes)?;
            file.flush()?;
            file.sync_all()
        })
        .and_then(|()| std::fs::rename(&temp, path));
    if let Err(e) = written {
        // best effort: the temporary file may not exist
        let _ = std::fs::remove_file(&temp);
        return Err(e);
    }
    sync_dir(parent_dir(path))
}

/// Flushes a directory's entries (the rename) to disk.
#[cfg(unix)]
fn sync_dir(dir: &Path) -> io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}

/// Elsewhere the rename alone is what there is.
#[cfg(not(unix))]
fn sync_dir(_dir: &Path) -> io::Result<()> {
    Ok(())
}

/// Checks, before any work, that [`write_atomic`] can write `path`: it is
/// not a directory, and its directory exists and takes a new file (a probe
/// file is created there and removed). The message names `flag`.
pub fn check_writable(path: &Path, flag: &str) -> Result<(), String> {
    let bad = |why: String| format!("{flag} {}: {why}", path.display());
    if path.is_dir() {
        return Err(bad("is a directory, not a file".into()));
    }
    let dir = parent_dir(path);
    if !dir.is_dir() {
        return Err(bad(format!("directory {} does not exist", dir.display())));
    }
    let probe = temp_path(path);
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&probe)
        .map_err(|e| bad(format!("cannot write in {}: {e}", dir.display())))?;
    std::fs::remove_file(&probe).map_err(|e| {
        bad(format!(
            "cannot remove the probe file {}: {e}",
            probe.display()
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("ramus-atomic-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn replaces_the_file_and_leaves_no_temporary() {
        let d = dir("replace");
        let path = d.join("f.bin");
        write_atomic(&path, b"old").unwrap();
        write_atomic(&path, b"new contents").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"new contents");
        let names: Vec<_> = std::fs::read_dir(&d).unwrap().collect();
        assert_eq!(names.len(), 1, "temporary files left: {names:?}");
        std::fs::remove_dir_all(&d).ok();
    }

    #[test]
    fn unwritable_destinations_are_named_with_the_flag() {
        let d = dir("check");
        assert!(check_writable(&d.join("ok.safetensors"), "--save").is_ok());
        let err = check_writable(&d, "--save").unwrap_err();
        assert!(
            err.starts_with("--save ") && err.contains("directory"),
            "{err}"
        );
        let err = check_writable(&d.join("missing/x.safetensors"), "--save").unwrap_err();
        assert!(err.contains("does not exist"), "{err}");
        // the probe leaves nothing behind
        assert_eq!(std::fs::read_dir(&d).unwrap().count(), 0);
        // a bare file name is in the current directory
        assert_eq!(parent_dir(Path::new("x.safetensors")), Path::new("."));
        std::fs::remove_dir_all(&d).ok();
    }
}
