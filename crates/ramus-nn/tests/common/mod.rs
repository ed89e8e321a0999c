//! Helpers shared by the integration tests.

use std::path::{Path, PathBuf};

/// `$RAMUS_DATA/<sub>`, else `<workspace>/../shared/data/<sub>`, if it
/// exists; otherwise prints that the test skips it.
pub fn data_file(sub: &str) -> Option<PathBuf> {
    let root = match std::env::var_os("RAMUS_DATA") {
        Some(d) => PathBuf::from(d),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data"),
    };
    let path = root.join(sub);
    if path.exists() {
        Some(path)
    } else {
        // written to stderr directly: the test harness does not capture it, so CI logs show the skip
        let _ = std::io::Write::write_fmt(
            &mut std::io::stderr(),
            format_args!("skipping: {sub} not found at {}\n", path.display()),
        );
        None
    }
}
