//! `-j DIR -u USER` for real: a child process (this test binary, re-run with a filter and an
//! environment variable) chroots into a temporary jail, drops to a user found in the jail's
//! own etc/passwd and etc/group, and reports what it became on stdout. Needs root; skips
//! with a message otherwise. The end-to-end test with the quill binary lives elsewhere.

use std::collections::HashMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use quill::privileges::{
    become_user, drop_privileges, enter_jail, is_root, lookup_account, Dropped, PrivilegeError,
};

const HELPER_ENV: &str = "QUILL_PRIVILEGES_HELPER";

/// The child's side: runs only when the parent set `HELPER_ENV` (`jail\nuser[\nsplit]`,
/// either may be empty; `split` looks up, enters the jail, then becomes the user in three
/// calls); otherwise it is a no-op that passes.
#[test]
fn privileges_helper() {
    let Ok(spec) = std::env::var(HELPER_ENV) else {
        return;
    };
    let mut parts = spec.split('\n');
    let jail = parts.next().filter(|j| !j.is_empty()).map(PathBuf::from);
    let user = parts.next().filter(|u| !u.is_empty());
    let split = parts.next() == Some("split");
    let result = if split {
        split_drop(jail.as_deref(), user)
    } else {
        drop_privileges(jail.as_deref(), user)
    };
    match result {
        Ok(done) => {
            let groups: Vec<String> = nix::unistd::getgroups()
                .unwrap_or_default()
                .iter()
                .map(|g| g.as_raw().to_string())
                .collect();
            let root = std::fs::metadata("/").map(|m| (m.dev(), m.ino()));
            let cwd = std::env::current_dir().map(|p| p.display().to_string());
            let regain = nix::unistd::setuid(nix::unistd::Uid::from_raw(0)).is_ok();
            let marker = Path::new("/quill-jail-marker").exists();
            let can_write_etc = std::fs::write("/etc/passwd", "x").is_ok();
            println!("RESULT ok=1");
            println!("RESULT uid={}", nix::unistd::getuid());
            println!("RESULT euid={}", nix::unistd::geteuid());
            println!("RESULT gid={}", nix::unistd::getgid());
            println!("RESULT egid={}", nix::unistd::getegid());
            println!("RESULT groups={}", groups.join(","));
            println!("RESULT root={root:?}");
            println!("RESULT cwd={cwd:?}");
            println!("RESULT regain_root={regain}");
            println!("RESULT marker={marker}");
            println!("RESULT can_write_etc={can_write_etc}");
            println!("RESULT changed_ids={}", done.changed_ids);
            println!("RESULT display={done}");
        }
        Err(e) => {
            println!("RESULT ok=0");
            println!("RESULT error={e}");
        }
    }
}

/// The same drop as `drop_privileges`, in the three steps a daemon that reads its files
/// inside the jail takes.
fn split_drop(jail: Option<&Path>, user: Option<&str>) -> Result<Dropped, PrivilegeError> {
    let account = user.map(|u| lookup_account(jail, u)).transpose()?;
    if let Some(jail) = jail {
        enter_jail(jail)?;
    }
    match account {
        Some(account) => become_user(&account),
        None => drop_privileges(None, None),
    }
}

/// Runs the helper in a child process and returns its `RESULT key=value` lines.
fn run_helper(jail: Option<&Path>, user: Option<&str>) -> HashMap<String, String> {
    run_helper_mode(jail, user, "")
}

fn run_helper_mode(jail: Option<&Path>, user: Option<&str>, mode: &str) -> HashMap<String, String> {
    let exe = std::env::current_exe().unwrap_or_else(|e| panic!("current_exe: {e}"));
    let spec = format!(
        "{}\n{}\n{mode}",
        jail.map(|j| j.display().to_string()).unwrap_or_default(),
        user.unwrap_or("")
    );
    let out = Command::new(exe)
        .args([
            "--exact",
            "privileges_helper",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(HELPER_ENV, spec)
        .output()
        .unwrap_or_else(|e| panic!("cannot run the helper: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "helper failed: {}\nstdout:\n{stdout}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
        .lines()
        // libtest's "test privileges_helper ... " may precede the first line.
        .filter_map(|l| l.find("RESULT ").map(|at| &l[at + "RESULT ".len()..]))
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

/// A temporary jail with its own etc/passwd and etc/group (test user uid 4242, gid 4242,
/// also member of group 4343) and a marker file at its root. Removed on drop.
struct Jail(PathBuf);

impl Jail {
    fn new(name: &str) -> Jail {
        let dir = std::env::temp_dir().join(format!("quill-jail-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let write = |rel: &str, text: &str| {
            let path = dir.join(rel);
            if let Some(parent) = path.parent() {
                std::fs::create_dir_all(parent).unwrap_or_else(|e| panic!("{e}"));
            }
            std::fs::write(&path, text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        };
        write(
            "etc/passwd",
            "root:x:0:0:root:/root:/bin/sh\n\
             # the test user exists only inside the jail\n\
             quilltest:x:4242:4242:quill test:/:/usr/sbin/nologin\n",
        );
        write(
            "etc/group",
            "root:x:0:\nquilltest:x:4242:\nquillextra:x:4343:someone,quilltest\nother:x:4444:someone\n",
        );
        write("quill-jail-marker", "");
        Jail(dir)
    }

    fn root_id(&self) -> String {
        let m = std::fs::metadata(&self.0).unwrap_or_else(|e| panic!("{e}"));
        format!("{:?}", Ok::<_, ()>((m.dev(), m.ino())))
    }
}

impl Drop for Jail {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn skip_unless_root(test: &str) -> bool {
    if is_root() {
        return false;
    }
    eprintln!("SKIPPED {test}: needs root (chroot and setuid); CI runs as root");
    true
}

#[test]
fn chroots_and_drops_to_a_user_of_the_jail() {
    if skip_unless_root("chroots_and_drops_to_a_user_of_the_jail") {
        return;
    }
    let jail = Jail::new("drop");
    let r = run_helper(Some(&jail.0), Some("quilltest"));
    assert_eq!(r.get("ok").map(String::as_str), Some("1"), "{r:?}");
    for key in ["uid", "euid", "gid", "egid"] {
        assert_eq!(r.get(key).map(String::as_str), Some("4242"), "{key}: {r:?}");
    }
    assert_eq!(
        r.get("groups").map(String::as_str),
        Some("4242,4343"),
        "{r:?}"
    );
    assert_eq!(
        r.get("root"),
        Some(&jail.root_id()),
        "process root is the jail"
    );
    assert_eq!(r.get("cwd").map(String::as_str), Some("Ok(\"/\")"));
    assert_eq!(r.get("marker").map(String::as_str), Some("true"));
    assert_eq!(r.get("regain_root").map(String::as_str), Some("false"));
    assert_eq!(r.get("can_write_etc").map(String::as_str), Some("false"));
    assert_eq!(r.get("changed_ids").map(String::as_str), Some("true"));
}

#[test]
fn jail_then_user_in_separate_steps() {
    if skip_unless_root("jail_then_user_in_separate_steps") {
        return;
    }
    let jail = Jail::new("split");
    let r = run_helper_mode(Some(&jail.0), Some("quilltest"), "split");
    assert_eq!(r.get("ok").map(String::as_str), Some("1"), "{r:?}");
    assert_eq!(r.get("uid").map(String::as_str), Some("4242"), "{r:?}");
    assert_eq!(r.get("groups").map(String::as_str), Some("4242,4343"));
    assert_eq!(r.get("root"), Some(&jail.root_id()));
    assert_eq!(r.get("regain_root").map(String::as_str), Some("false"));
}

#[test]
fn user_root_is_allowed_and_changes_no_id() {
    if skip_unless_root("user_root_is_allowed_and_changes_no_id") {
        return;
    }
    let jail = Jail::new("root");
    let r = run_helper(Some(&jail.0), Some("root"));
    assert_eq!(r.get("ok").map(String::as_str), Some("1"), "{r:?}");
    assert_eq!(r.get("uid").map(String::as_str), Some("0"));
    assert_eq!(r.get("root"), Some(&jail.root_id()));
    assert_eq!(r.get("changed_ids").map(String::as_str), Some("false"));
}

#[test]
fn jail_without_user_only_chroots() {
    if skip_unless_root("jail_without_user_only_chroots") {
        return;
    }
    let jail = Jail::new("nouser");
    let r = run_helper(Some(&jail.0), None);
    assert_eq!(r.get("ok").map(String::as_str), Some("1"), "{r:?}");
    assert_eq!(r.get("uid").map(String::as_str), Some("0"));
    assert_eq!(r.get("root"), Some(&jail.root_id()));
    assert_eq!(r.get("marker").map(String::as_str), Some("true"));
}

#[test]
fn user_missing_from_the_jail_is_an_error_naming_its_passwd() {
    if skip_unless_root("user_missing_from_the_jail_is_an_error_naming_its_passwd") {
        return;
    }
    let jail = Jail::new("missing");
    // "daemon" exists on the host, but not in the jail: the jail's file decides.
    let r = run_helper(Some(&jail.0), Some("daemon"));
    assert_eq!(r.get("ok").map(String::as_str), Some("0"), "{r:?}");
    let expected = format!(
        "user 'daemon' not found in {}",
        jail.0.join("etc/passwd").display()
    );
    assert_eq!(r.get("error"), Some(&expected));
}

#[test]
fn dropping_without_root_fails_with_a_clear_error() {
    // Runs as anybody: as root, first become "nobody" without a jail, then try again.
    if !is_root() {
        let r = run_helper(None, Some("root"));
        assert_eq!(r.get("ok").map(String::as_str), Some("0"), "{r:?}");
        let err = r.get("error").cloned().unwrap_or_default();
        assert!(err.contains("'root'"), "{err}");
        return;
    }
    let r = run_helper(None, Some("nobody"));
    if r.get("error").is_some_and(|e| e.contains("not found")) {
        eprintln!("SKIPPED: no user 'nobody' on this system");
        return;
    }
    assert_eq!(r.get("ok").map(String::as_str), Some("1"), "{r:?}");
    assert_ne!(r.get("uid").map(String::as_str), Some("0"));
    assert_eq!(r.get("regain_root").map(String::as_str), Some("false"));
}
