//! quill's own diagnostic log (not the access or connection logs): warnings and errors,
//! more with `-d` or `debug N`, to stderr in the foreground and to syslog for a daemon.
//! The level is one atomic that any thread may change at run time; tracing's per-call-site
//! cache is rebuilt when it does.

use std::io;
use std::sync::atomic::{AtomicU8, Ordering::Relaxed};

use tracing_subscriber::Layer as _;

/// The current log level: `-d` and `debug N` change it at any time.
static LOG_LEVEL: AtomicU8 = AtomicU8::new(0);

/// Sets the log level from Pen's debug number (0 = warnings and errors only).
pub fn set_level(debug: u32) {
    let level = u8::try_from(debug).unwrap_or(u8::MAX);
    if LOG_LEVEL.swap(level, Relaxed) != level {
        // tracing caches per call site whether it is enabled; make it ask again.
        tracing::callsite::rebuild_interest_cache();
    }
}

fn level_enabled(level: &tracing::Level) -> bool {
    let wanted = match LOG_LEVEL.load(Relaxed) {
        0 => tracing::Level::WARN,
        1 => tracing::Level::INFO,
        2 => tracing::Level::DEBUG,
        _ => tracing::Level::TRACE,
    };
    *level <= wanted
}

/// Logs go to stderr in the foreground and to syslog (facility user, as Pen) for a daemon.
/// The syslog socket is connected here, before any chroot can hide /dev/log.
pub fn init(foreground: bool) {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    let filter = tracing_subscriber::filter::filter_fn(|meta| level_enabled(meta.level()));
    if foreground {
        // Colours only for a terminal: journald, a file or a log shipper would keep the
        // escape sequences as part of every line.
        let layer = tracing_subscriber::fmt::layer()
            .with_ansi(io::IsTerminal::is_terminal(&io::stderr()))
            .with_writer(crate::logfile::StderrLines)
            .with_target(false);
        let _ = tracing_subscriber::registry()
            .with(layer.with_filter(filter))
            .try_init();
    } else {
        let syslog = crate::syslog::Syslog::new(crate::syslog::Facility::User);
        let _ = tracing_subscriber::registry()
            .with(crate::syslog::layer(syslog).with_filter(filter))
            .try_init();
    }
}
