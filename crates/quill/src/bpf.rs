//! What quill's two BPF programs (`dsr::xdp`, `proxy::offload`) share around aya: whether
//! the running kernel attaches them through links that go with the process, and the
//! verifier's complaint in a line a log can hold.

/// Whether the running kernel is at least `major.minor` (from `/proc/sys/kernel/osrelease`;
/// unreadable: no).
pub fn kernel_at_least(major: u32, minor: u32) -> bool {
    let Ok(release) = std::fs::read_to_string("/proc/sys/kernel/osrelease") else {
        return false;
    };
    let mut parts = release.trim().split(['.', '-']);
    let running: u32 = parts.next().and_then(|p| p.parse().ok()).unwrap_or(0);
    let running_minor: u32 = parts.next().and_then(|p| p.parse().ok()).unwrap_or(0);
    (running, running_minor) >= (major, minor)
}

/// The verifier's complaint, shortened to its last lines (the whole log is long).
pub fn verifier_error(e: &aya::programs::ProgramError) -> String {
    match e {
        aya::programs::ProgramError::LoadError {
            io_error,
            verifier_log,
        } => {
            let log = verifier_log.to_string();
            let tail: Vec<&str> = log.lines().rev().take(5).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            format!("{io_error}: {}", tail.join(" / "))
        }
        other => other.to_string(),
    }
}
