//! One scratch directory per test process, removed when the process exits.
//!
//! Fixtures that live for the whole test binary (the tiny checkpoint, servers, scripts) sit in
//! statics, and statics are never dropped: a `TempDir` held there would stay on disk after every
//! run (about 50 MB per tiny checkpoint, per test binary, per run: enough to fill a CI disk).

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

static SCRATCH: OnceLock<PathBuf> = OnceLock::new();

extern "C" fn remove_scratch() {
    if let Some(dir) = SCRATCH.get() {
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// The process's scratch directory; the libtest harness exits through `exit`, which runs the
/// cleanup whether the tests passed or failed.
pub fn scratch_dir() -> &'static Path {
    SCRATCH.get_or_init(|| {
        let dir = tempfile::Builder::new().prefix("lily-test-").tempdir().expect("tempdir").keep();
        // SAFETY: registers a function without captured state; atexit only fails when its table
        // is full, and then the directory merely stays behind.
        unsafe { libc::atexit(remove_scratch) };
        dir
    })
}

/// A fresh directory under the scratch directory (removed with it).
pub fn scratch_subdir(prefix: &str) -> PathBuf {
    tempfile::Builder::new().prefix(prefix).tempdir_in(scratch_dir()).expect("tempdir").keep()
}
