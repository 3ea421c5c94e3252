//! Whose files the outbox accepts: its directory and state files must be the
//! effective user's (or root's) and writable by nobody else, in the spirit of
//! git's `safe.directory` and OpenSSH's `StrictModes`.
//!
//! Another local user who could prepare the directory, or write one file in it,
//! could read every message body (a world-writable journal the bot appends to)
//! or have their own message sent as the bot's (a planted `outbox.json` and
//! `audit.jsonl`). So opening checks, once, the directory and every state file
//! in it; from then on nobody else can add or replace a file, because nobody
//! else can write the directory.
//!
//! The check is made at open, not at every access: a file created later is
//! created by the outbox itself (mode 0600, directories 0700), in a directory
//! only the owner (and, with [`Trust::shared_group`], that group) can write.

use std::fs;
use std::path::Path;

use crate::error::{Error, Result};

/// Who besides the effective user and root may own or write the outbox's files.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Trust {
    /// Members of this group are trusted too: a directory or file whose group is
    /// this one may be owned by another user and may be group-writable.
    /// Writable by others is never accepted.
    pub(crate) shared_group: Option<u32>,
}

/// Names in the outbox directory that the outbox reads or writes. Anything else
/// (an operator's notes, quarantined torn tails, which are never read back) is
/// left alone.
fn is_state_name(name: &str) -> bool {
    matches!(
        name,
        crate::store::STATE_FILE
            | crate::store::JOURNAL_FILE
            | crate::lock::LOCK_FILE
            | crate::lock::OWNERS_DIR
            | crate::history::HISTORY_DIR
            | crate::audit::AUDIT_FILE
            | crate::audit::ANCHOR_FILE
    ) || name
        .strip_prefix("audit-")
        .and_then(|n| n.strip_suffix(".jsonl"))
        .is_some()
}

/// Checks the outbox directory `dir` and every state file in it (and in
/// `owners/` and `history/`). Call after creating `dir`, before opening anything.
pub(crate) fn check_outbox_dir(dir: &Path, trust: Trust) -> Result<()> {
    // The directory the caller named may be a symlink they made on purpose: the
    // directory it leads to is the one checked.
    let meta = fs::metadata(dir).map_err(|e| Error::io(dir, "stat", e))?;
    check(dir, &meta, trust)?;
    for entry in fs::read_dir(dir).map_err(|e| Error::io(dir, "read directory", e))? {
        let entry = entry.map_err(|e| Error::io(dir, "read directory", e))?;
        let name = entry.file_name();
        if !name.to_str().is_some_and(is_state_name) {
            continue;
        }
        let path = entry.path();
        let meta = fs::symlink_metadata(&path).map_err(|e| Error::io(&path, "stat", e))?;
        check(&path, &meta, trust)?;
        if meta.is_dir() {
            for inner in fs::read_dir(&path).map_err(|e| Error::io(&path, "read directory", e))? {
                let inner = inner.map_err(|e| Error::io(&path, "read directory", e))?;
                let inner_path = inner.path();
                let inner_meta = fs::symlink_metadata(&inner_path)
                    .map_err(|e| Error::io(&inner_path, "stat", e))?;
                check(&inner_path, &inner_meta, trust)?;
            }
        }
    }
    Ok(())
}

/// Checks one entry's type, owner and mode (`meta` from `lstat`).
#[cfg(unix)]
fn check(path: &Path, meta: &fs::Metadata, trust: Trust) -> Result<()> {
    use std::os::unix::fs::MetadataExt;
    let me = rustix::process::geteuid().as_raw();
    let (owner, group, mode) = (meta.uid(), meta.gid(), meta.mode() & 0o7777);
    let shown = shell_quote(path);
    let refuse = |reason: String, fix: String| {
        Err(Error::Untrusted {
            path: path.to_path_buf(),
            owner,
            mode,
            reason,
            fix,
        })
    };
    if meta.file_type().is_symlink() {
        return refuse(
            "it is a symbolic link, and the outbox never follows links inside its directory".into(),
            format!("remove it (`rm {shown}`); the outbox creates its own files"),
        );
    }
    let shared = trust.shared_group == Some(group);
    if owner != me && owner != 0 && !shared {
        return refuse(
            format!("it is owned by uid {owner}, not by this user (uid {me}) or root"),
            format!(
                "make sure nobody else prepared it, then `chown {me} {shown}`; or run as uid {owner}"
            ),
        );
    }
    if mode & 0o002 != 0 {
        return refuse("others can write it".into(), format!("`chmod o-w {shown}`"));
    }
    if mode & 0o020 != 0 && !shared {
        return refuse(
            format!("group {group} can write it"),
            format!(
                "`chmod g-w {shown}`; or, if group {group} shares this outbox on purpose, \
                 open it with `OutboxBuilder::shared_group({group})`"
            ),
        );
    }
    Ok(())
}

#[cfg(not(unix))]
fn check(path: &Path, meta: &fs::Metadata, _trust: Trust) -> Result<()> {
    // No owners or mode bits to check; a link is still never followed.
    if meta.file_type().is_symlink() {
        return Err(Error::Untrusted {
            path: path.to_path_buf(),
            owner: 0,
            mode: 0,
            reason:
                "it is a symbolic link, and the outbox never follows links inside its directory"
                    .into(),
            fix: "remove it; the outbox creates its own files".into(),
        });
    }
    Ok(())
}

/// `path` as one shell word, for the commands the errors suggest.
#[cfg(unix)]
fn shell_quote(path: &Path) -> String {
    let text = path.display().to_string();
    if text
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || "/._-+".contains(c))
    {
        text
    } else {
        format!("'{}'", text.replace('\'', r"'\''"))
    }
}
