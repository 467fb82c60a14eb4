//! `quill`: argv -> settings -> daemon. Errors are turned into words here, once.

use std::process::ExitCode;

use quill::cli::{self, Parsed};

fn main() -> ExitCode {
    quill::demo::die_with_parent();
    match cli::parse(std::env::args_os().skip(1)) {
        Ok(Parsed::Help) => {
            print!("{}", cli::USAGE);
            ExitCode::SUCCESS
        }
        Ok(Parsed::Version) => {
            println!("quill {}", env!("CARGO_PKG_VERSION"));
            ExitCode::SUCCESS
        }
        Ok(Parsed::Demo) => match quill::demo::run() {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("quill demo: {e}");
                ExitCode::FAILURE
            }
        },
        Ok(Parsed::Run(inv)) => match quill::daemon::run(inv) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("quill: {e}");
                ExitCode::from(e.exit_code())
            }
        },
        Err(e) => {
            eprintln!("quill: {e}");
            ExitCode::from(2)
        }
    }
}

/// mimalloc instead of glibc's malloc: a connection is a handful of small, long-lived
/// allocations (its task, two socket registrations), and mimalloc packs them tighter:
/// 1,632 instead of 1,982 bytes of RSS per idle proxied connection before it is parked
/// (`bench/run --scenarios idle9k`), with the same CPU per request (keep-alive and TLS
/// handshakes, A/B). `quill::memory` asks it to return what parking frees.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;
