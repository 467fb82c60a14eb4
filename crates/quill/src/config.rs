//! Configuration files (`-F FILE`, `include FILE`): commands of the command language, one
//! per line, with `#` comment lines and blank lines.
//!
//! A file is applied to a *copy* of the settings; the caller publishes the copy only when
//! every line of every included file applied, so a bad file never leaves a half-applied
//! configuration. `include` nests at most [`MAX_DEPTH`] deep and a file that includes
//! itself (directly or not) is refused. Relative include paths are taken relative to the
//! including file's directory. Start-up and reloads stop at the first error; `quill --check`
//! reads on past each bad line and reports every one ([`check`]).

use std::fmt;
use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};

use crate::command::Command;
use crate::settings::{Action, Settings};

/// How deeply `include` may nest.
pub const MAX_DEPTH: usize = 16;

/// Largest configuration file read (a guard against pointing `-F` at a device or a log).
pub const MAX_FILE_SIZE: u64 = 16 * 1024 * 1024;

/// A configuration error: which file, which line (0 = the file as a whole), and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub file: PathBuf,
    pub line: usize,
    pub reason: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.line == 0 {
            write!(f, "{}: {}", self.file.display(), self.reason)
        } else {
            write!(f, "{}:{}: {}", self.file.display(), self.line, self.reason)
        }
    }
}

impl std::error::Error for ConfigError {}

/// Where a configuration command came from: the file and line that set it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Origin {
    pub file: PathBuf,
    pub line: usize,
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.file.display(), self.line)
    }
}

/// Applies the commands of `path` (and of the files it includes) to `settings`, collecting
/// the runtime actions they ask for. Stops at the first error.
pub fn load(
    path: &Path,
    settings: &mut Settings,
    actions: &mut Vec<Action>,
) -> Result<(), ConfigError> {
    let mut reader = Reader {
        settings,
        actions,
        stack: Vec::new(),
        errors: None,
        applied: None,
    };
    reader.file(path)
}

/// What [`check`] found: every error, in the order of the lines, and every command that
/// applied with the line it came from (so that an error found later, such as a certificate
/// that cannot be read, can name the line that gave the file).
#[derive(Debug, Default)]
pub struct Checked {
    pub errors: Vec<ConfigError>,
    pub applied: Vec<(Origin, Command)>,
}

/// Like [`load`], but a bad line does not stop the reading: it is reported and the next
/// line is applied, so that one run names every error (`quill --check`).
pub fn check(path: &Path, settings: &mut Settings, actions: &mut Vec<Action>) -> Checked {
    let mut checked = Checked::default();
    let mut reader = Reader {
        settings,
        actions,
        stack: Vec::new(),
        errors: Some(&mut checked.errors),
        applied: Some(&mut checked.applied),
    };
    // With `errors` set, every error is collected and none is returned.
    let _ = reader.file(path);
    checked
}

/// Applies configuration text read from `path` (named in errors); `include` lines are
/// followed relative to `path`. Exposed for the fuzz target.
pub fn apply_text(
    path: &Path,
    bytes: &[u8],
    settings: &mut Settings,
) -> Result<Vec<Action>, ConfigError> {
    let mut actions = Vec::new();
    let mut reader = Reader {
        settings,
        actions: &mut actions,
        stack: Vec::new(),
        errors: None,
        applied: None,
    };
    reader.text(path, bytes)?;
    Ok(actions)
}

fn read_limited(path: &Path) -> std::io::Result<Vec<u8>> {
    let file = fs::File::open(path)?;
    let mut bytes = Vec::new();
    file.take(MAX_FILE_SIZE + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > MAX_FILE_SIZE {
        return Err(std::io::Error::other(format!(
            "larger than {MAX_FILE_SIZE} bytes"
        )));
    }
    Ok(bytes)
}

/// One reading of a file and its includes.
struct Reader<'a> {
    settings: &'a mut Settings,
    actions: &'a mut Vec<Action>,
    /// The files being read, outermost first (canonical paths, for loop detection).
    stack: Vec<PathBuf>,
    /// `None`: the first error ends the reading. `Some`: errors are collected here and the
    /// reading goes on with the next line.
    errors: Option<&'a mut Vec<ConfigError>>,
    /// Where applied commands are recorded with their lines, when asked.
    applied: Option<&'a mut Vec<(Origin, Command)>>,
}

impl Reader<'_> {
    /// Returns `e` to end the reading, or records it and lets the reading go on.
    fn fail(&mut self, e: ConfigError) -> Result<(), ConfigError> {
        match &mut self.errors {
            None => Err(e),
            Some(list) => {
                list.push(e);
                Ok(())
            }
        }
    }

    fn file(&mut self, path: &Path) -> Result<(), ConfigError> {
        let whole = |reason: String| ConfigError {
            file: path.to_path_buf(),
            line: 0,
            reason,
        };
        let canonical = match fs::canonicalize(path) {
            Ok(c) => c,
            Err(e) => return self.fail(whole(format!("cannot read: {e}"))),
        };
        if self.stack.contains(&canonical) {
            return self.fail(whole(
                "include loop: this file is already being read".to_string(),
            ));
        }
        if self.stack.len() >= MAX_DEPTH {
            return self.fail(whole(format!("includes nested more than {MAX_DEPTH} deep")));
        }
        let bytes = match read_limited(path) {
            Ok(b) => b,
            Err(e) => return self.fail(whole(format!("cannot read: {e}"))),
        };
        self.stack.push(canonical);
        let read = self.text(path, &bytes);
        self.stack.pop();
        read
    }

    fn text(&mut self, path: &Path, bytes: &[u8]) -> Result<(), ConfigError> {
        for (index, raw) in bytes.split(|&b| b == b'\n').enumerate() {
            let at = |reason: String| ConfigError {
                file: path.to_path_buf(),
                line: index + 1,
                reason,
            };
            let Ok(line) = std::str::from_utf8(raw) else {
                self.fail(at("not valid UTF-8".to_string()))?;
                continue;
            };
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let cmd: Command = match line.parse() {
                Ok(cmd) => cmd,
                Err(e) => {
                    self.fail(at(format!("{e}")))?;
                    continue;
                }
            };
            match cmd {
                Command::Include(file) => {
                    let target = Path::new(file.as_str());
                    let target = match path.parent() {
                        Some(dir) if target.is_relative() => dir.join(target),
                        _ => target.to_path_buf(),
                    };
                    self.file(&target)?;
                }
                cmd if cmd.is_setting() => match self.settings.apply(&cmd) {
                    Ok(applied) => {
                        self.actions.extend(applied.actions);
                        if let Some(list) = &mut self.applied {
                            let origin = Origin {
                                file: path.to_path_buf(),
                                line: index + 1,
                            };
                            list.push((origin, cmd));
                        }
                    }
                    Err(e) => self.fail(at(e.to_string()))?,
                },
                other => self.fail(at(format!(
                    "'{other}' is an operation, not a configuration command"
                )))?,
            }
        }
        Ok(())
    }
}
/// The text of a configuration file that rebuilds `settings` (what `write` saves).
pub fn render(settings: &Settings) -> String {
    let mut out =
        String::from("# Written by quill: commands that rebuild the running configuration.\n");
    for cmd in settings.to_commands() {
        out.push_str(&cmd.to_string());
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Dir(PathBuf);

    impl Dir {
        fn new(name: &str) -> Dir {
            let d =
                std::env::temp_dir().join(format!("quill-config-{name}-{}", std::process::id()));
            let _ = fs::remove_dir_all(&d);
            fs::create_dir_all(&d).unwrap();
            Dir(d)
        }

        fn file(&self, name: &str, text: &str) -> PathBuf {
            let p = self.0.join(name);
            fs::write(&p, text).unwrap();
            p
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    fn load_new(path: &Path) -> Result<Settings, ConfigError> {
        let mut s = Settings::default();
        load(path, &mut s, &mut Vec::new())?;
        Ok(s)
    }

    #[test]
    fn comments_blank_lines_and_includes() {
        let d = Dir::new("ok");
        d.file("servers.cfg", "server 0 address 127.0.0.1 port 80\n");
        let main = d.file(
            "main.cfg",
            "# main\n\nroundrobin\n  include servers.cfg  \ntimeout 7\n",
        );
        let s = load_new(&main).unwrap();
        assert!(s.policy.roundrobin);
        assert_eq!(s.timeout, 7);
        assert_eq!(s.servers.len(), 1);
    }

    #[test]
    fn errors_name_file_and_line() {
        let d = Dir::new("bad");
        let inner = d.file("inner.cfg", "hash\nserver 0 max lots\n");
        let main = d.file("main.cfg", "roundrobin\ninclude inner.cfg\n");
        let e = load_new(&main).unwrap_err();
        assert_eq!((e.file.as_path(), e.line), (inner.as_path(), 2));
        assert!(e.to_string().contains("inner.cfg:2:"), "{e}");
        let op = d.file("op.cfg", "servers\n");
        assert_eq!(load_new(&op).unwrap_err().line, 1);
        let bin = d.file("bin.cfg", "roundrobin\n\u{0}\u{1}\u{ff}garbage\n");
        assert_eq!(load_new(&bin).unwrap_err().line, 2);
    }

    #[test]
    fn check_reports_every_bad_line_and_where_each_command_came_from() {
        let d = Dir::new("check");
        let inner = d.file("inner.cfg", "hash\nserver 0 max lots\n");
        let main = d.file(
            "main.cfg",
            "roundrobin\nbogus\ninclude inner.cfg\ninclude gone.cfg\ntimeout 7\n",
        );
        let mut s = Settings::default();
        let checked = check(&main, &mut s, &mut Vec::new());
        let at: Vec<(PathBuf, usize)> = checked
            .errors
            .iter()
            .map(|e| (e.file.clone(), e.line))
            .collect();
        assert_eq!(
            at,
            [
                (main.clone(), 2),
                (inner.clone(), 2),
                (d.0.join("gone.cfg"), 0)
            ]
        );
        // The lines after each error were applied all the same.
        assert_eq!(s.timeout, 7);
        let origins: Vec<String> = checked.applied.iter().map(|(o, _)| o.to_string()).collect();
        assert_eq!(
            origins,
            [
                format!("{}:1", main.display()),
                format!("{}:1", inner.display()),
                format!("{}:5", main.display())
            ]
        );
        // `load` stops at the first.
        assert_eq!(load_new(&main).unwrap_err().line, 2);
    }

    #[test]
    fn include_loops_and_depth_are_refused() {
        let d = Dir::new("loop");
        d.file("a.cfg", "include b.cfg\n");
        let b = d.file("b.cfg", "include a.cfg\n");
        assert!(load_new(&b).unwrap_err().reason.contains("loop"));
        let me = d.file("me.cfg", "include me.cfg\n");
        assert!(load_new(&me).unwrap_err().reason.contains("loop"));
        for i in 0..20 {
            d.file(&format!("n{i}.cfg"), &format!("include n{}.cfg\n", i + 1));
        }
        d.file("n20.cfg", "hash\n");
        assert!(load_new(&d.0.join("n0.cfg"))
            .unwrap_err()
            .reason
            .contains("deep"));
    }

    #[test]
    fn render_round_trips() {
        let d = Dir::new("render");
        let main = d.file("main.cfg", "weight\nannounce_table 100\nannounce_grace 7\nacl 2 deny 10.0.0.0 255.0.0.0\nserver 1 address 127.0.0.1 port 81 weight 3\nlog /tmp/x.log\n");
        let s = load_new(&main).unwrap();
        let again = d.file("again.cfg", &render(&s));
        assert_eq!(load_new(&again).unwrap(), s);
    }
}
