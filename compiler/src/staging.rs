//! An output folder written beside its destination and swapped into place when complete, so that
//! an interrupted or failed compile leaves nothing at the destination that kiln would open, and an
//! existing artifact there is replaced only by a complete one.
//!
//! The folder is staged as `.NAME.tmp-PID` in the destination's parent. On Linux the finished
//! folder and an existing destination are exchanged in one `renameat2(RENAME_EXCHANGE)`, so the
//! destination is always either the old artifact or the new one; elsewhere (or on a file system
//! without it) the old one is first renamed aside. A staged folder left by a killed compile is
//! removed by the next compile of the same destination once its process is gone.

use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Result};

/// A folder being written for `out`.
pub struct Staging {
    out: PathBuf,
    tmp: PathBuf,
    done: bool,
}

impl Staging {
    /// Prepares to write the folder `out`: refuses an existing `out` that `replaceable` rejects,
    /// removes what interrupted compiles of `out` left, and creates the staging folder.
    pub fn new(out: &Path, replaceable: impl Fn(&Path) -> bool) -> Result<Staging> {
        // A path without a final name (`.`, `..`, `dir/..`) is resolved first, so that the
        // staging folder is a sibling of the output, never inside it.
        let out = if out.file_name().is_none() {
            let resolved = std::fs::canonicalize(out)
                .map_err(|e| anyhow!("cannot write {}: {e}", out.display()))?;
            if resolved.file_name().is_none() {
                bail!("cannot write {}: it is the root folder", out.display());
            }
            resolved
        } else {
            out.to_path_buf()
        };
        if out.exists() && !replaceable(&out) {
            bail!(
                "{} exists and is not a kiln output folder; refusing to replace it",
                out.display()
            );
        }
        let parent = kiln_ir::io::parent_folder(&out)?.to_path_buf();
        let name = out
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        remove_leftovers(&parent, &name)?;
        let tmp = parent.join(format!(".{name}.tmp-{}", std::process::id()));
        std::fs::create_dir(&tmp).map_err(|e| anyhow!("cannot create {}: {e}", tmp.display()))?;
        Ok(Staging {
            out,
            tmp,
            done: false,
        })
    }

    /// The folder to write into.
    pub fn path(&self) -> &Path {
        &self.tmp
    }

    /// The destination.
    pub fn out(&self) -> &Path {
        &self.out
    }

    /// Puts the finished folder in place of the destination, then removes the old one.
    pub fn commit(mut self) -> Result<()> {
        let fail = |e: std::io::Error| anyhow!("cannot write {}: {e}", self.out.display());
        if !self.out.exists() {
            std::fs::rename(&self.tmp, &self.out).map_err(fail)?;
        } else if !exchange(&self.tmp, &self.out).map_err(fail)? {
            let mut aside = self.tmp.clone().into_os_string();
            aside.push(".old");
            let aside = PathBuf::from(aside);
            std::fs::rename(&self.out, &aside).map_err(fail)?;
            if let Err(e) = std::fs::rename(&self.tmp, &self.out) {
                let _ = std::fs::rename(&aside, &self.out);
                return Err(fail(e));
            }
            std::fs::rename(&aside, &self.tmp).map_err(fail)?;
        }
        // The staging path now holds the old output, if there was one.
        self.done = true;
        if self.tmp.exists() {
            std::fs::remove_dir_all(&self.tmp)
                .map_err(|e| anyhow!("cannot remove the old output {}: {e}", self.tmp.display()))?;
        }
        Ok(())
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if !self.done {
            let _ = std::fs::remove_dir_all(&self.tmp);
        }
    }
}

/// Exchanges `a` and `b` in one step where the system can; `false` where it cannot.
#[cfg(target_os = "linux")]
fn exchange(a: &Path, b: &Path) -> std::io::Result<bool> {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    let c = |p: &Path| {
        CString::new(p.as_os_str().as_bytes())
            .map_err(|_| std::io::Error::other("a path holds a NUL byte"))
    };
    let (a, b) = (c(a)?, c(b)?);
    // SAFETY: both paths are NUL-terminated strings that outlive the call; relative paths are
    // taken from the working directory (AT_FDCWD), as `rename` takes them.
    let r = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            a.as_ptr(),
            libc::AT_FDCWD,
            b.as_ptr(),
            libc::RENAME_EXCHANGE,
        )
    };
    if r == 0 {
        return Ok(true);
    }
    let e = std::io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EINVAL | libc::ENOSYS | libc::EOPNOTSUPP) => Ok(false),
        _ => Err(e),
    }
}

#[cfg(not(target_os = "linux"))]
fn exchange(_: &Path, _: &Path) -> std::io::Result<bool> {
    Ok(false)
}

/// Removes `.NAME.tmp-PID` folders (and `.old` ones set aside) in `parent` whose process is gone.
fn remove_leftovers(parent: &Path, name: &str) -> Result<()> {
    let prefix = format!(".{name}.tmp-");
    let Ok(entries) = std::fs::read_dir(parent) else {
        return Ok(());
    };
    for entry in entries.flatten() {
        let file = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = file
            .strip_prefix(&prefix)
            .map(|rest| rest.trim_end_matches(".old"))
            .and_then(|pid| pid.parse::<u32>().ok())
        else {
            continue;
        };
        if pid == std::process::id() || !alive(pid) {
            std::fs::remove_dir_all(entry.path()).map_err(|e| {
                anyhow!(
                    "cannot remove {} (left by an interrupted compile): {e}",
                    entry.path().display()
                )
            })?;
        }
    }
    Ok(())
}

/// Whether process `pid` exists (where that cannot be known, it is taken to exist).
fn alive(pid: u32) -> bool {
    if cfg!(target_os = "linux") {
        Path::new("/proc").join(pid.to_string()).exists()
    } else {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, text: &str) {
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(dir.join("f"), text).unwrap();
    }

    fn read(dir: &Path) -> String {
        std::fs::read_to_string(dir.join("f")).unwrap()
    }

    #[test]
    fn a_committed_folder_replaces_the_old_one_and_leaves_nothing_else() {
        let root = tempfile::tempdir().unwrap();
        let out = root.path().join("art");
        write(&out, "old");
        let s = Staging::new(&out, |_| true).unwrap();
        write(s.path(), "new");
        assert_eq!(
            read(&out),
            "old",
            "the old output stays whole until the swap"
        );
        s.commit().unwrap();
        assert_eq!(read(&out), "new");
        let names: Vec<_> = std::fs::read_dir(root.path()).unwrap().collect();
        assert_eq!(names.len(), 1, "no staging or old folder is left");
    }

    #[test]
    fn a_dropped_staging_leaves_the_old_output_and_nothing_else() {
        let root = tempfile::tempdir().unwrap();
        let out = root.path().join("art");
        write(&out, "old");
        let s = Staging::new(&out, |_| true).unwrap();
        write(s.path(), "half");
        drop(s);
        assert_eq!(read(&out), "old");
        assert_eq!(std::fs::read_dir(root.path()).unwrap().count(), 1);
    }

    #[test]
    fn leftovers_of_dead_processes_are_removed_and_live_ones_kept() {
        let root = tempfile::tempdir().unwrap();
        let out = root.path().join("art");
        // No process has id 4294967295; the parent of this test is alive.
        let dead = root.path().join(".art.tmp-4294967295");
        let dead_old = root.path().join(".art.tmp-4294967295.old");
        let live = root
            .path()
            .join(format!(".art.tmp-{}", std::os::unix::process::parent_id()));
        let other = root.path().join(".other.tmp-4294967295");
        for d in [&dead, &dead_old, &live, &other] {
            write(d, "x");
        }
        Staging::new(&out, |_| true).unwrap();
        assert!(!dead.exists() && !dead_old.exists());
        assert!(live.exists() && other.exists());
    }

    #[test]
    fn a_folder_that_is_not_an_output_is_refused() {
        let root = tempfile::tempdir().unwrap();
        let err = Staging::new(root.path(), |_| false).err().unwrap();
        assert!(err.to_string().contains("refusing to replace it"), "{err}");
    }
}
