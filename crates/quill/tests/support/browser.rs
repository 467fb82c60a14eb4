//! Debian's headless Chromium driven by Playwright (`tests/browser/`, `npm ci` there), for
//! `tests/metrics.rs` (the dashboard) and `tests/requests.rs` (a page over HTTP/2): what
//! the scripts need, or why they cannot run here (the test then prints `SKIPPED` and
//! passes; `.ci/run` installs node, npm, chromium and the scripts' npm packages), and
//! running a script to its end within a deadline.
#![allow(dead_code)]

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use super::poll_until;

/// Debian's chromium, the browser the scripts launch.
pub const CHROMIUM: &str = "/usr/bin/chromium";

/// `tests/browser/`: the scripts, their package.json and node_modules.
pub fn browser_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/browser")
}

/// The scripts' directory when node ≥ 20, chromium and playwright-core are there, else
/// why they cannot run.
pub fn browser_tools() -> Result<PathBuf, String> {
    let node = Command::new("node").arg("--version").output();
    let Ok(node) = node else {
        return Err("node is not installed".into());
    };
    // Playwright needs Node 20 or later.
    let version = String::from_utf8_lossy(&node.stdout).trim().to_string();
    let major: u32 = version
        .trim_start_matches('v')
        .split('.')
        .next()
        .and_then(|m| m.parse().ok())
        .unwrap_or(0);
    if major < 20 {
        return Err(format!("node {version} is older than 20"));
    }
    if !Path::new(CHROMIUM).exists() {
        return Err(format!(
            "{CHROMIUM} is not installed (apt-get install chromium)"
        ));
    }
    let dir = browser_dir();
    if !dir.join("node_modules/playwright-core").exists() {
        return Err(format!(
            "playwright-core is not installed: run `npm ci` in {}",
            dir.display()
        ));
    }
    Ok(dir)
}

/// Runs `node SCRIPT` (a file of [`browser_dir`]) with `env` to its end and returns its
/// stdout (its stderr goes to the test's); killed, with a panic, after `deadline`.
pub fn run_script(script: &str, env: &[(&str, &str)], deadline: Duration) -> String {
    let path = browser_dir().join(script);
    let mut child = Command::new("node")
        .arg(&path)
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run node {}: {e}", path.display()));
    let mut out = child.stdout.take().expect("stdout pipe");
    let reader = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = out.read_to_end(&mut v);
        v
    });
    let exited = poll_until(deadline, || matches!(child.try_wait(), Ok(Some(_))));
    if !exited {
        let _ = child.kill();
        let _ = child.wait();
    }
    let stdout = String::from_utf8_lossy(&reader.join().unwrap_or_default()).into_owned();
    assert!(
        exited,
        "node {script} still running after {deadline:?}; its stdout:\n{stdout}"
    );
    stdout
}
