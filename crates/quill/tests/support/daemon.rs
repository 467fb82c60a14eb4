//! Third-party daemons started by the tests (Debian's NGINX and HAProxy): a daemon is a
//! child process killed when dropped, started only when its program is installed (else the
//! test prints `SKIPPED` and passes; `.ci/run` installs them).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::*;

/// A daemon of the test (nginx, haproxy), killed when dropped.
pub struct Daemon {
    child: Child,
    log: PathBuf,
    dir: TempDir,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Daemon {
    /// Starts `program args` in `dir` and waits until `port` accepts connections. `None`
    /// (with a message) when the program is not installed.
    pub fn start(program: &str, args: &[String], port: u16, dir: TempDir) -> Option<Daemon> {
        if Command::new(program).arg("-v").output().is_err() {
            eprintln!("SKIPPED: {program} is not installed (.ci/run installs it)");
            return None;
        }
        let log = dir.path().join("daemon.log");
        let child = Command::new(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&log).unwrap())
            .stderr(std::fs::File::create(dir.path().join("daemon.err")).unwrap())
            .spawn()
            .unwrap_or_else(|e| panic!("{program}: {e}"));
        let mut d = Daemon { child, log, dir };
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let up = poll_until(START_DEADLINE, || {
            if let Ok(Some(status)) = d.child.try_wait() {
                panic!("{program} exited ({status}): {}", d.stderr());
            }
            TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok()
        });
        assert!(up, "{program} did not listen on {port}: {}", d.stderr());
        Some(d)
    }

    /// What the daemon wrote to stderr and to its error log.
    pub fn stderr(&self) -> String {
        let dir = self.log.parent().unwrap_or(Path::new("."));
        let mut s = std::fs::read_to_string(dir.join("daemon.err")).unwrap_or_default();
        s.push_str(&std::fs::read_to_string(dir.join("error.log")).unwrap_or_default());
        s
    }

    /// Sends a signal with kill(1).
    pub fn signal(&self, sig: &str) {
        let st = Command::new("kill")
            .arg(format!("-{sig}"))
            .arg(self.child.id().to_string())
            .status()
            .expect("kill");
        assert!(st.success());
    }

    /// The daemon's exit status once it has exited, waiting at most `within`; `None` if it
    /// still runs then.
    pub fn wait_exit(&mut self, within: Duration) -> Option<std::process::ExitStatus> {
        let mut status = None;
        poll_until(within, || {
            status = self.child.try_wait().unwrap();
            status.is_some()
        });
        status
    }

    /// The daemon's private directory (its configuration, logs and files).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

/// Debian's NGINX with one worker on 127.0.0.1:PORT, serving `files` (name, content) from
/// its directory's `www/`; `http` lines go into the `http { }` block, `server` lines into
/// its one `server { }` block after the `listen` line (with `listen_options`).
pub fn nginx(
    listen_options: &str,
    http: &str,
    server: &str,
    files: &[(&str, &[u8])],
) -> Option<(Daemon, u16)> {
    let port = free_port();
    nginx_at(port, listen_options, http, server, files).map(|n| (n, port))
}

/// [`nginx`] on a port of the caller's (an NGINX started again where one was).
pub fn nginx_at(
    port: u16,
    listen_options: &str,
    http: &str,
    server: &str,
    files: &[(&str, &[u8])],
) -> Option<Daemon> {
    let dir = TempDir::new("nginx");
    let d = dir.path().display().to_string();
    std::fs::create_dir(dir.path().join("www")).unwrap();
    for (name, content) in files {
        std::fs::write(dir.path().join("www").join(name), content).unwrap();
    }
    let conf = format!(
        "daemon off;\nmaster_process off;\nworker_processes 1;\npid {d}/nginx.pid;\n\
         error_log {d}/error.log info;\nevents {{ worker_connections 1024; }}\n\
         http {{\n access_log off;\n client_body_temp_path {d}/body;\n proxy_temp_path {d}/proxy;\n\
         fastcgi_temp_path {d}/fcgi;\n uwsgi_temp_path {d}/uwsgi;\n scgi_temp_path {d}/scgi;\n{http}\n\
         server {{\n  listen 127.0.0.1:{port}{listen_options};\n  root {d}/www;\n{server}\n }}\n}}\n"
    );
    let path = dir.path().join("nginx.conf");
    std::fs::write(&path, conf).unwrap();
    let args = vec![
        "-p".to_string(),
        d.clone(),
        "-e".to_string(),
        format!("{d}/error.log"),
        "-c".to_string(),
        path.display().to_string(),
    ];
    Daemon::start("/usr/sbin/nginx", &args, port, dir)
}

/// NGINX serving `files` the way a stock installation does: `sendfile on` without
/// `tcp_nopush`, so every response leaves in two writes (the head, then the body), and
/// keep-alive without a practical request limit.
pub fn nginx_files(files: &[(&str, &[u8])]) -> Option<(Daemon, u16)> {
    nginx("", " sendfile on;\n keepalive_requests 1000000;", "", files)
}
