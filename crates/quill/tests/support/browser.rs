//! Debian's headless Chromium driven by Playwright (`tests/browser/`, `npm ci` there), for
//! `tests/metrics.rs` (the dashboard): what the scripts need, or why they cannot run
//! here (the test then prints `SKIPPED` and passes; `.ci/run` installs node, npm,
//! chromium and the scripts' npm packages).
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

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

