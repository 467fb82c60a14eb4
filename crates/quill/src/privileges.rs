//! Giving up root the Pen way (`-j DIR`, `-u USER`): find the user *inside the jail*, then
//! chroot + chdir("/"), then supplementary groups, gid, uid — in that order — and finally
//! prove the drop cannot be undone. Call it after the listeners are bound, before any thread.
//!
//! With a jail the user is read from `<jail>/etc/passwd` and `<jail>/etc/group` (parsed here:
//! after a chroot NSS may not work); without one the system's user database (NSS) is asked.
//! `-u root` is allowed and changes no id. Paths given by the user name files inside the
//! jail; [`in_jail`] maps one to where it is before the chroot.

use std::fmt;
use std::io;
use std::path::{Component, Path, PathBuf};

use nix::unistd::{Gid, Uid};

/// Why privileges could not be dropped. Each variant names the file, the user or the jail.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PrivilegeError {
    /// A passwd or group file of the jail could not be read.
    #[error("cannot read {}: {source}", path.display())]
    Read { path: PathBuf, source: io::Error },
    /// The user's own entry in a passwd or group file is malformed.
    #[error("{}:{line}: malformed entry for '{user}' ({reason})", path.display())]
    Malformed {
        path: PathBuf,
        line: usize,
        user: String,
        reason: &'static str,
    },
    /// No such user (`database` is the file, or "the system's user database").
    #[error("user '{user}' not found in {database}")]
    NoSuchUser { user: String, database: String },
    /// The system's user database (NSS) failed.
    #[error("cannot look up user '{user}': {source}")]
    Lookup { user: String, source: nix::Error },
    #[error("cannot chroot to {}: {source}", jail.display())]
    Chroot { jail: PathBuf, source: nix::Error },
    #[error("cannot change directory to / inside the jail {}: {source}", jail.display())]
    Chdir { jail: PathBuf, source: nix::Error },
    #[error("cannot set the supplementary groups of '{user}' to {groups:?}: {source}")]
    SetGroups {
        user: String,
        groups: Vec<u32>,
        source: nix::Error,
    },
    #[error("cannot set group id {gid} of '{user}': {source}")]
    SetGid {
        user: String,
        gid: u32,
        source: nix::Error,
    },
    #[error("cannot set user id {uid} of '{user}': {source}")]
    SetUid {
        user: String,
        uid: u32,
        source: nix::Error,
    },
    /// The ids were set but the drop did not hold (e.g. root could be regained).
    #[error("dropping privileges to '{user}' did not hold: {what}")]
    NotDropped { user: String, what: String },
}

/// A user to run as, as found in the jail's (or the system's) user database.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Account {
    pub name: String,
    pub uid: u32,
    /// The primary group.
    pub gid: u32,
    /// Every group of the user, the primary group first, without duplicates.
    pub groups: Vec<u32>,
}

impl Account {
    /// Whether the account may remove a file it does not own (root's pid file) from `dir`:
    /// write and search access to the directory, and with its sticky bit, the directory
    /// its own. An unreadable directory counts as no.
    pub fn may_remove_from(&self, dir: &Path) -> bool {
        use std::os::unix::fs::MetadataExt;
        if self.uid == 0 {
            return true;
        }
        let Ok(meta) = std::fs::metadata(dir) else {
            return false;
        };
        let mode = meta.mode();
        let owns = meta.uid() == self.uid;
        let shift = if owns {
            6
        } else if self.groups.contains(&meta.gid()) {
            3
        } else {
            0
        };
        let write_and_search = (mode >> shift) & 0o3 == 0o3;
        write_and_search && (mode & 0o1000 == 0 || owns)
    }
}

/// The pid file `path` will be left at exit: `account` may not remove it from its
/// directory (said at start, and by `--check`, as well as at exit).
pub fn warn_if_pid_file_stays(account: &Account, path: &Path) {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    // A directory that is not there fails the start (and the check) anyway.
    if dir.is_dir() && !account.may_remove_from(dir) {
        tracing::warn!(
            "pid file {}: user {} may not remove it from {} at exit, so it will be left naming a dead process",
            path.display(),
            account.name,
            dir.display()
        );
    }
}

/// What [`drop_privileges`] did, for the log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dropped {
    /// The directory the process is now chrooted to.
    pub jail: Option<PathBuf>,
    /// The `-u` user, if one was given.
    pub user: Option<String>,
    /// Real = effective = saved ids after the drop.
    pub uid: u32,
    pub gid: u32,
    /// Supplementary groups set (empty when no id was changed).
    pub groups: Vec<u32>,
    /// False when the process already ran as the user (e.g. `-u root` as root).
    pub changed_ids: bool,
}

impl fmt::Display for Dropped {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(jail) = &self.jail {
            write!(f, "chrooted to {}; ", jail.display())?;
        }
        let who = self.user.as_deref().unwrap_or("(unchanged)");
        write!(f, "running as {who} (uid {}, gid {}", self.uid, self.gid)?;
        if !self.groups.is_empty() {
            let groups: Vec<String> = self.groups.iter().map(u32::to_string).collect();
            write!(f, ", groups {}", groups.join(","))?;
        }
        f.write_str(")")?;
        if !self.changed_ids {
            f.write_str(", ids unchanged")?;
        }
        Ok(())
    }
}

/// True when the process runs with effective uid 0.
pub fn is_root() -> bool {
    Uid::effective().is_root()
}

/// Where `path`, as the user gave it (a path inside the jail), is before the chroot.
///
/// Without a jail the path is returned as given. With one, the path is taken from the jail's
/// root: relative paths too (the process does `chdir("/")` after the chroot), and `..` never
/// climbs above the jail, just as inside a real chroot. The mapping is lexical: a symbolic
/// link inside the jail that points to an absolute path is not followed the way the chrooted
/// process would follow it.
pub fn in_jail(jail: Option<&Path>, path: &Path) -> PathBuf {
    let Some(jail) = jail else {
        return path.to_path_buf();
    };
    let mut inside: Vec<&std::ffi::OsStr> = Vec::new();
    for component in path.components() {
        match component {
            Component::Prefix(_) | Component::RootDir | Component::CurDir => {}
            Component::ParentDir => {
                inside.pop();
            }
            Component::Normal(name) => inside.push(name),
        }
    }
    let mut out = jail.to_path_buf();
    out.extend(inside);
    out
}

/// Finds `user` in the jail's `etc/passwd` and `etc/group`, or without a jail in the
/// system's user database. Does not change anything: call it early to fail fast on a bad
/// `-u`, or to learn the uid/gid to give files (a Unix control socket) before the drop.
pub fn lookup_account(jail: Option<&Path>, user: &str) -> Result<Account, PrivilegeError> {
    match jail {
        Some(jail) => lookup_in_files(
            &in_jail(Some(jail), Path::new("/etc/passwd")),
            &in_jail(Some(jail), Path::new("/etc/group")),
            user,
        ),
        None => lookup_system(user),
    }
}

/// Looks `user` up in the given passwd and group files.
pub fn lookup_in_files(passwd: &Path, group: &Path, user: &str) -> Result<Account, PrivilegeError> {
    let read = |path: &Path| {
        std::fs::read_to_string(path).map_err(|source| PrivilegeError::Read {
            path: path.to_path_buf(),
            source,
        })
    };
    let (uid, gid) = parse_passwd(&read(passwd)?, passwd, user)?;
    let groups = parse_groups(&read(group)?, group, user, gid)?;
    Ok(Account {
        name: user.to_owned(),
        uid,
        gid,
        groups,
    })
}

/// Finds `user` in the text of a passwd(5) file: `(uid, gid)`. The first entry wins (as
/// with NSS "files"); comments, blank lines, NIS `+`/`-` lines and other users' malformed
/// lines are skipped; the user's own malformed line is an error naming the line.
pub fn parse_passwd(text: &str, path: &Path, user: &str) -> Result<(u32, u32), PrivilegeError> {
    for (n, line) in text.lines().enumerate() {
        let Some(fields) = entry(line, user) else {
            continue;
        };
        let malformed = |reason| PrivilegeError::Malformed {
            path: path.to_path_buf(),
            line: n + 1,
            user: user.to_owned(),
            reason,
        };
        // name:password:uid:gid[:gecos:home:shell]
        if fields.len() < 4 {
            return Err(malformed("fewer than 4 fields"));
        }
        let uid = fields[2]
            .parse::<u32>()
            .map_err(|_| malformed("the uid is not a number"))?;
        let gid = fields[3]
            .parse::<u32>()
            .map_err(|_| malformed("the gid is not a number"))?;
        return Ok((uid, gid));
    }
    Err(PrivilegeError::NoSuchUser {
        user: user.to_owned(),
        database: path.display().to_string(),
    })
}

/// The groups of `user` from the text of a group(5) file: `primary` first, then every group
/// whose member list names the user. Malformed lines that do not concern the user are
/// skipped; one that lists the user but has no numeric gid is an error.
pub fn parse_groups(
    text: &str,
    path: &Path,
    user: &str,
    primary: u32,
) -> Result<Vec<u32>, PrivilegeError> {
    let mut groups = vec![primary];
    for (n, line) in text.lines().enumerate() {
        let line = line.trim_end_matches('\r');
        if line.trim().is_empty() || line.starts_with('#') || line.starts_with(['+', '-']) {
            continue;
        }
        // name:password:gid:member,member,...
        let fields: Vec<&str> = line.split(':').collect();
        let Some(members) = fields.get(3) else {
            continue;
        };
        if !members.split(',').any(|m| m.trim() == user) {
            continue;
        }
        let gid = fields[2]
            .parse::<u32>()
            .map_err(|_| PrivilegeError::Malformed {
                path: path.to_path_buf(),
                line: n + 1,
                user: user.to_owned(),
                reason: "the gid of a group listing the user is not a number",
            })?;
        if !groups.contains(&gid) {
            groups.push(gid);
        }
    }
    Ok(groups)
}

/// The colon-separated fields of `line` when it is `user`'s entry.
fn entry<'a>(line: &'a str, user: &str) -> Option<Vec<&'a str>> {
    let line = line.trim_end_matches('\r');
    if line.starts_with('#') || line.starts_with(['+', '-']) {
        return None;
    }
    let fields: Vec<&str> = line.split(':').collect();
    (fields.first() == Some(&user)).then_some(fields)
}

fn lookup_system(user: &str) -> Result<Account, PrivilegeError> {
    let found = nix::unistd::User::from_name(user).map_err(|source| PrivilegeError::Lookup {
        user: user.to_owned(),
        source,
    })?;
    let Some(found) = found else {
        return Err(PrivilegeError::NoSuchUser {
            user: user.to_owned(),
            database: "the system's user database".to_owned(),
        });
    };
    let gid = found.gid.as_raw();
    let mut groups = vec![gid];
    for g in system_groups(user, found.gid)? {
        if !groups.contains(&g) {
            groups.push(g);
        }
    }
    Ok(Account {
        name: user.to_owned(),
        uid: found.uid.as_raw(),
        gid,
        groups,
    })
}

#[cfg(not(any(target_vendor = "apple", target_os = "redox", target_os = "haiku")))]
fn system_groups(user: &str, gid: Gid) -> Result<Vec<u32>, PrivilegeError> {
    let lookup = |source| PrivilegeError::Lookup {
        user: user.to_owned(),
        source,
    };
    let name = std::ffi::CString::new(user).map_err(|_| lookup(nix::Error::EINVAL))?;
    let groups = nix::unistd::getgrouplist(&name, gid).map_err(lookup)?;
    Ok(groups.into_iter().map(Gid::as_raw).collect())
}

#[cfg(any(target_vendor = "apple", target_os = "redox", target_os = "haiku"))]
fn system_groups(_user: &str, gid: Gid) -> Result<Vec<u32>, PrivilegeError> {
    Ok(vec![gid.as_raw()])
}

/// Looks the user up (inside the jail), chroots to the jail, then becomes the user:
/// `drop_privileges(Some("/var/lib/quill"), Some("quill"))` is `-j /var/lib/quill -u quill`.
/// Either argument may be absent. On error the process may be half way (e.g. chrooted but
/// still root): the caller must exit.
pub fn drop_privileges(jail: Option<&Path>, user: Option<&str>) -> Result<Dropped, PrivilegeError> {
    let account = user.map(|u| lookup_account(jail, u)).transpose()?;
    become_account(jail, account.as_ref())
}

/// The second half of [`drop_privileges`], for a caller that looked the account up earlier
/// with [`lookup_account`]: chroot + chdir("/"), then setgroups, setgid, setuid, then checks
/// that root cannot be regained.
pub fn become_account(
    jail: Option<&Path>,
    account: Option<&Account>,
) -> Result<Dropped, PrivilegeError> {
    if let Some(jail) = jail {
        nix::unistd::chroot(jail).map_err(|source| PrivilegeError::Chroot {
            jail: jail.to_path_buf(),
            source,
        })?;
        nix::unistd::chdir("/").map_err(|source| PrivilegeError::Chdir {
            jail: jail.to_path_buf(),
            source,
        })?;
    }
    let mut done = Dropped {
        jail: jail.map(Path::to_path_buf),
        user: account.map(|a| a.name.clone()),
        uid: Uid::effective().as_raw(),
        gid: Gid::effective().as_raw(),
        groups: Vec::new(),
        changed_ids: false,
    };
    let Some(account) = account else {
        return Ok(done);
    };
    // Already that user (`-u root` as root, or `-u me` as me): nothing to change.
    if Uid::current().as_raw() == account.uid && Uid::effective().as_raw() == account.uid {
        return Ok(done);
    }
    let user = || account.name.clone();
    let groups: Vec<Gid> = account.groups.iter().copied().map(Gid::from_raw).collect();
    set_groups(&groups).map_err(|source| PrivilegeError::SetGroups {
        user: user(),
        groups: account.groups.clone(),
        source,
    })?;
    nix::unistd::setgid(Gid::from_raw(account.gid)).map_err(|source| PrivilegeError::SetGid {
        user: user(),
        gid: account.gid,
        source,
    })?;
    nix::unistd::setuid(Uid::from_raw(account.uid)).map_err(|source| PrivilegeError::SetUid {
        user: user(),
        uid: account.uid,
        source,
    })?;
    verify(account)?;
    done.uid = account.uid;
    done.gid = account.gid;
    done.groups = account.groups.clone();
    done.changed_ids = true;
    Ok(done)
}

/// Only the chroot half: `chroot(jail)` + `chdir("/")`, still as root. For a start-up that
/// reads its files inside the jail (as a reload will) before [`become_user`].
pub fn enter_jail(jail: &Path) -> Result<(), PrivilegeError> {
    become_account(Some(jail), None).map(|_| ())
}

/// Only the user half: setgroups, setgid, setuid and the check that root cannot be had back.
/// Changes nothing when the process already runs as the account (`-u root` as root).
pub fn become_user(account: &Account) -> Result<Dropped, PrivilegeError> {
    become_account(None, Some(account))
}

#[cfg(not(any(target_vendor = "apple", target_os = "redox", target_os = "haiku")))]
fn set_groups(groups: &[Gid]) -> nix::Result<()> {
    nix::unistd::setgroups(groups)
}

#[cfg(any(target_vendor = "apple", target_os = "redox", target_os = "haiku"))]
fn set_groups(_groups: &[Gid]) -> nix::Result<()> {
    Ok(())
}

/// Checks that every id is the account's and, unless the account is root, that root can't
/// be had back.
fn verify(account: &Account) -> Result<(), PrivilegeError> {
    let fail = |what: String| PrivilegeError::NotDropped {
        user: account.name.clone(),
        what,
    };
    let (uids, gids) = current_ids();
    if uids.iter().any(|&u| u != account.uid) {
        return Err(fail(format!("user ids are {uids:?}, not {}", account.uid)));
    }
    if gids.iter().any(|&g| g != account.gid) {
        return Err(fail(format!("group ids are {gids:?}, not {}", account.gid)));
    }
    if account.uid != 0 {
        if nix::unistd::setuid(Uid::from_raw(0)).is_ok() {
            return Err(fail("setuid(0) succeeded afterwards".to_owned()));
        }
        if nix::unistd::seteuid(Uid::from_raw(0)).is_ok() {
            return Err(fail("seteuid(0) succeeded afterwards".to_owned()));
        }
        if account.gid != 0 && nix::unistd::setgid(Gid::from_raw(0)).is_ok() {
            return Err(fail("setgid(0) succeeded afterwards".to_owned()));
        }
    }
    Ok(())
}

/// (real, effective, saved) user ids and group ids; saved ones where the system tells them.
#[cfg(any(
    target_os = "linux",
    target_os = "android",
    target_os = "freebsd",
    target_os = "openbsd"
))]
fn current_ids() -> (Vec<u32>, Vec<u32>) {
    let uids = match nix::unistd::getresuid() {
        Ok(r) => vec![r.real.as_raw(), r.effective.as_raw(), r.saved.as_raw()],
        Err(_) => vec![Uid::current().as_raw(), Uid::effective().as_raw()],
    };
    let gids = match nix::unistd::getresgid() {
        Ok(r) => vec![r.real.as_raw(), r.effective.as_raw(), r.saved.as_raw()],
        Err(_) => vec![Gid::current().as_raw(), Gid::effective().as_raw()],
    };
    (uids, gids)
}

#[cfg(not(any(
    target_os = "linux",
    target_os = "android",
    target_os = "freebsd",
    target_os = "openbsd"
)))]
fn current_ids() -> (Vec<u32>, Vec<u32>) {
    (
        vec![Uid::current().as_raw(), Uid::effective().as_raw()],
        vec![Gid::current().as_raw(), Gid::effective().as_raw()],
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const PASSWD: &str = "\
# comment line
root:x:0:0:root:/root:/bin/bash

+nisuser::::::
broken line without colons
other:x:notanumber:1::/:/bin/false
quill:x:4242:4243:quill daemon:/var/lib/quill:/usr/sbin/nologin
quill:x:9999:9999:shadowed duplicate:/:/bin/false
short:x:7
crlf:x:77:78::/:/bin/sh\r
";

    const GROUP: &str = "\
# groups
root:x:0:
quill:x:4243:
extra:x:5000:alice,quill,bob
spaced:x:5001: quill
garbage
nogid:x:abc:alice
quillish:x:5002:quillx
dup:x:5000:quill
";

    fn p() -> &'static Path {
        Path::new("/jail/etc/passwd")
    }

    #[test]
    fn finds_user_first_entry_wins() {
        assert_eq!(parse_passwd(PASSWD, p(), "quill").ok(), Some((4242, 4243)));
        assert_eq!(parse_passwd(PASSWD, p(), "root").ok(), Some((0, 0)));
        assert_eq!(parse_passwd(PASSWD, p(), "crlf").ok(), Some((77, 78)));
    }

    #[test]
    fn missing_user_names_the_file() {
        let err = parse_passwd(PASSWD, p(), "nobody-here").err();
        assert!(matches!(err, Some(PrivilegeError::NoSuchUser { .. })));
        let text = err.map(|e| e.to_string()).unwrap_or_default();
        assert_eq!(text, "user 'nobody-here' not found in /jail/etc/passwd");
    }

    #[test]
    fn comments_and_nis_lines_are_not_users() {
        assert!(parse_passwd(PASSWD, p(), "# comment line").is_err());
        assert!(parse_passwd(PASSWD, p(), "+nisuser").is_err());
        assert!(parse_passwd("", p(), "").is_err());
    }

    #[test]
    fn malformed_own_line_is_an_error_with_its_line_number() {
        let err = parse_passwd(PASSWD, p(), "other").err();
        let text = err.map(|e| e.to_string()).unwrap_or_default();
        assert_eq!(
            text,
            "/jail/etc/passwd:6: malformed entry for 'other' (the uid is not a number)"
        );
        let err = parse_passwd(PASSWD, p(), "short").err();
        assert!(matches!(
            err,
            Some(PrivilegeError::Malformed { line: 9, .. })
        ));
    }

    #[test]
    fn groups_primary_first_members_exact_no_duplicates() {
        let groups = parse_groups(GROUP, Path::new("/g"), "quill", 4243).ok();
        assert_eq!(groups, Some(vec![4243, 5000, 5001]));
        let groups = parse_groups(GROUP, Path::new("/g"), "bob", 100).ok();
        assert_eq!(groups, Some(vec![100, 5000]));
        let groups = parse_groups(GROUP, Path::new("/g"), "nobody", 65534).ok();
        assert_eq!(groups, Some(vec![65534]));
    }

    #[test]
    fn group_listing_user_with_bad_gid_is_an_error() {
        let err = parse_groups(GROUP, Path::new("/g"), "alice", 100).err();
        assert!(matches!(
            err,
            Some(PrivilegeError::Malformed { line: 7, .. })
        ));
    }

    #[test]
    fn lookup_in_files_reads_both_and_names_missing_file() {
        let dir = std::env::temp_dir().join(format!("quill-priv-unit-{}", std::process::id()));
        let etc = dir.join("etc");
        assert!(std::fs::create_dir_all(&etc).is_ok());
        assert!(std::fs::write(etc.join("passwd"), PASSWD).is_ok());
        let err = lookup_account(Some(&dir), "quill").err();
        let text = err.map(|e| e.to_string()).unwrap_or_default();
        assert!(text.starts_with(&format!("cannot read {}", etc.join("group").display())));
        assert!(std::fs::write(etc.join("group"), GROUP).is_ok());
        let account = lookup_account(Some(&dir), "quill").ok();
        assert_eq!(
            account,
            Some(Account {
                name: "quill".into(),
                uid: 4242,
                gid: 4243,
                groups: vec![4243, 5000, 5001],
            })
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn system_lookup_finds_root() {
        let root = lookup_account(None, "root").ok();
        assert_eq!(root.as_ref().map(|a| (a.uid, a.gid)), Some((0, 0)));
        assert!(matches!(
            lookup_account(None, "no-such-user-quill-test"),
            Err(PrivilegeError::NoSuchUser { .. })
        ));
    }

    #[test]
    fn paths_are_inside_the_jail() {
        let jail = Some(Path::new("/var/lib/quill"));
        let cases = [
            ("/etc/quill.cfg", "/var/lib/quill/etc/quill.cfg"),
            ("etc/quill.cfg", "/var/lib/quill/etc/quill.cfg"),
            ("/tmp/../../../etc/shadow", "/var/lib/quill/etc/shadow"),
            ("/./run//quill.pid", "/var/lib/quill/run/quill.pid"),
            ("/", "/var/lib/quill"),
        ];
        for (given, expected) in cases {
            assert_eq!(
                in_jail(jail, Path::new(given)),
                PathBuf::from(expected),
                "{given}"
            );
        }
        assert_eq!(
            in_jail(None, Path::new("rel/x.cfg")),
            PathBuf::from("rel/x.cfg")
        );
    }

    #[test]
    fn nothing_to_do_without_jail_and_user() {
        let done = drop_privileges(None, None).ok();
        assert_eq!(done.as_ref().map(|d| d.changed_ids), Some(false));
        assert_eq!(done.map(|d| d.uid), Some(Uid::effective().as_raw()));
    }

    #[test]
    fn display_for_the_log() {
        let d = Dropped {
            jail: Some("/var/lib/quill".into()),
            user: Some("quill".into()),
            uid: 4242,
            gid: 4243,
            groups: vec![4243, 5000],
            changed_ids: true,
        };
        assert_eq!(
            d.to_string(),
            "chrooted to /var/lib/quill; running as quill (uid 4242, gid 4243, groups 4243,5000)"
        );
    }

    #[test]
    fn removing_root_s_file_needs_write_and_search_on_the_directory_and_sticky_ownership() {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let dir = std::env::temp_dir().join(format!("quill-priv-remove-{}", std::process::id()));
        assert!(std::fs::create_dir_all(&dir).is_ok());
        let meta = std::fs::metadata(&dir).ok();
        let (owner, group) = meta.map(|m| (m.uid(), m.gid())).unwrap_or_default();
        let account = |uid: u32, groups: Vec<u32>| Account {
            name: "someone".into(),
            uid,
            gid: groups.first().copied().unwrap_or(uid),
            groups,
        };
        // Not the owner, nor in the group: neither uid is root's.
        let stranger = account(owner + 50_000, vec![group + 50_000]);
        let member = account(owner + 50_001, vec![group + 50_000, group]);
        let chmod = |mode: u32| {
            assert!(std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(mode)).is_ok());
        };
        chmod(0o755);
        assert!(!stranger.may_remove_from(&dir));
        assert!(!member.may_remove_from(&dir));
        chmod(0o775);
        assert!(!stranger.may_remove_from(&dir));
        assert!(member.may_remove_from(&dir));
        chmod(0o773);
        assert!(stranger.may_remove_from(&dir), "write and search suffice");
        chmod(0o772);
        assert!(!stranger.may_remove_from(&dir), "write without search");
        chmod(0o1777);
        assert!(
            !stranger.may_remove_from(&dir),
            "sticky: another's file stays"
        );
        assert!(
            account(owner, vec![group]).may_remove_from(&dir),
            "sticky: the owner may"
        );
        assert!(account(0, vec![0]).may_remove_from(&dir), "root may");
        assert!(!stranger.may_remove_from(&dir.join("missing")));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
