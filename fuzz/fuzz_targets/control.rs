//! The control socket protocol: the bytes a control client sends, through the line framing
//! and the command dispatch of a State built in-process, over an in-memory stream. Never
//! panics; the reply is valid UTF-8 ending in a newline (or empty), an error reply is `error: ...`, and it agrees
//! with a model of the framing (first line, at most MAX_LINE bytes, UTF-8).
//!
//! The first byte picks how the input arrives: bit 0 set = repeated to well beyond
//! MAX_LINE (huge lines, which libFuzzer's input size would not reach); the other bits = the
//! size of the writes (1..=127 bytes, so lines are split anywhere).
//! Commands whose effects leave the process (files, sockets, name resolution, exit) are
//! not executed (`metrics_listen ADDR` included): the model refuses those inputs before
//! they reach dispatch.
#![no_main]

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, OnceLock};

use libfuzzer_sys::fuzz_target;
use quill::command::{Command, ServerField};
use quill::control::{answer, Context, MAX_LINE};
use quill::settings::Settings;
use quill::state::State;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn context() -> &'static Arc<Context> {
    static CTX: OnceLock<Arc<Context>> = OnceLock::new();
    CTX.get_or_init(|| {
        Arc::new(Context {
            state: State::new(Settings::default(), true),
            control_addr: Some("127.0.0.1:10111".to_string()),
            exit_enabled: false,
            config_file: None,
            base_commands: Vec::new(),
            relisten: Vec::new(),
            exit: Arc::new(tokio::sync::Notify::new()),
            listener_fds: Mutex::new(Vec::new()),
            control_fd: Mutex::new(None),
            upgraded: AtomicBool::new(false),
            // No metrics listener runs here: what is handed to it is dropped.
            metrics: tokio::sync::mpsc::unbounded_channel().0,
        })
    })
}

/// One runtime for every input: a command runs on its blocking pool (`control::off_thread`),
/// whose threads a runtime per input would start and join each time.
fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("runtime")
    })
}

/// True for commands that touch files, sockets or the resolver when executed.
fn leaves_the_process(cmd: &Command) -> bool {
    match cmd {
        Command::Server { fields, .. } => fields
            .iter()
            .any(|f| matches!(f, ServerField::Address(h) if h.ip().is_none())),
        Command::Emergency(Some(_))
        | Command::Abuse(Some(_))
        | Command::Listen(Some(_))
        | Command::GeoipDb(_)
        | Command::Include(_)
        | Command::Write(_)
        | Command::Log(Some(_))
        | Command::AccessLog(Some(_))
        | Command::WebStats(Some(_))
        | Command::MetricsListen(Some(_)) => true,
        _ => false,
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, body)) = data.split_first() else {
        return;
    };
    let input: Vec<u8> = if mode & 1 == 1 && !body.is_empty() {
        body.iter()
            .copied()
            .cycle()
            .take(MAX_LINE + 4096 + body.len())
            .collect()
    } else {
        body.to_vec()
    };
    let write_size = usize::from(mode >> 1).max(1);

    // The model of the framing: the first line, without CR, if short enough and UTF-8.
    let line_end = input
        .iter()
        .position(|&b| b == b'\n')
        .unwrap_or(input.len());
    let line = &input[..line_end];
    let framed = if line.len() > MAX_LINE {
        None
    } else {
        std::str::from_utf8(line)
            .ok()
            .map(|l| l.trim_end_matches('\r'))
    };
    if let Some(cmd) = framed.and_then(|l| l.parse::<Command>().ok()) {
        if leaves_the_process(&cmd) {
            return;
        }
    }

    let reply = runtime().block_on(async {
        let (mut client, server) = tokio::io::duplex(64 * 1024);
        let sending = async {
            for chunk in input.chunks(write_size) {
                if client.write_all(chunk).await.is_err() {
                    break;
                }
            }
            let _ = client.shutdown().await;
            let mut reply = Vec::new();
            let _ = client.read_to_end(&mut reply).await;
            reply
        };
        let (reply, ()) = tokio::join!(sending, answer(context(), server));
        reply
    });
    let reply = String::from_utf8(reply).expect("the reply is UTF-8");
    assert!(
        reply.is_empty() || reply.ends_with('\n'),
        "reply without a newline: {reply:?}"
    );
    if framed.is_none() {
        assert!(
            reply.starts_with("error: "),
            "a malformed line was not refused: {reply:?}"
        );
    }
    if let Some(l) = framed {
        if l.parse::<Command>().is_err() {
            assert!(
                reply.starts_with("error: "),
                "{l:?} does not parse but got {reply:?}"
            );
        }
    }
});
