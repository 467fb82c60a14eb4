//! A load generator for zero-downtime tests: client threads that run complete request /
//! answer exchanges through quill, back to back, and count every one that fails.
//!
//! One exchange: connect, read the backend's name line, send a random block, read the
//! same block back, half-close, see the connection end. Anything else (refused, reset,
//! closed early, wrong bytes, timeout) is a failure, recorded with its reason.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::Duration;

use super::{backend_name, client_from, wait_until, Rng};

/// Exchanges done and failed so far, and why the first failures failed.
#[derive(Default)]
pub struct Tally {
    pub ok: AtomicU64,
    pub failed: AtomicU64,
    pub reasons: Mutex<Vec<String>>,
}

/// Client threads running exchanges until [`Load::stop`].
pub struct Load {
    stop: Arc<AtomicBool>,
    pub tally: Arc<Tally>,
    threads: Vec<JoinHandle<()>>,
}

fn exchange(addr: SocketAddr, src: &str, rng: &mut Rng) -> Result<(), String> {
    let mut s = client_from(src, addr).map_err(|e| format!("connect: {e}"))?;
    backend_name(&mut s).ok_or("closed before the backend's name")?;
    let mut block = vec![0u8; 512];
    rng.fill(&mut block);
    s.write_all(&block).map_err(|e| format!("write: {e}"))?;
    let mut back = vec![0u8; block.len()];
    s.read_exact(&mut back).map_err(|e| format!("read: {e}"))?;
    if back != block {
        return Err("echo differs".into());
    }
    s.shutdown(Shutdown::Write)
        .map_err(|e| format!("shutdown: {e}"))?;
    let mut rest = [0u8; 64];
    match s.read(&mut rest) {
        Ok(0) => Ok(()),
        Ok(n) => Err(format!("{n} unexpected bytes at the end")),
        Err(e) => Err(format!("waiting for the end: {e}")),
    }
}

impl Load {
    /// Starts `clients` threads against `addr`, each from its own loopback address.
    pub fn start(addr: SocketAddr, clients: usize) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let tally = Arc::new(Tally::default());
        let threads = (0..clients)
            .map(|i| {
                let (stop, tally) = (Arc::clone(&stop), Arc::clone(&tally));
                let src = format!("127.0.1.{}", 10 + i);
                thread::spawn(move || {
                    let mut rng = Rng::new(i as u64 + 1);
                    while !stop.load(Ordering::SeqCst) {
                        match exchange(addr, &src, &mut rng) {
                            Ok(()) => {
                                tally.ok.fetch_add(1, Ordering::SeqCst);
                            }
                            Err(reason) => {
                                tally.failed.fetch_add(1, Ordering::SeqCst);
                                let mut r = tally.reasons.lock().unwrap();
                                if r.len() < 20 {
                                    r.push(reason);
                                }
                            }
                        }
                    }
                })
            })
            .collect();
        Load {
            stop,
            tally,
            threads,
        }
    }

    pub fn ok(&self) -> u64 {
        self.tally.ok.load(Ordering::SeqCst)
    }

    /// Waits until `n` more exchanges than now have succeeded.
    pub fn wait_more(&self, n: u64, timeout: Duration) {
        let want = self.ok() + n;
        wait_until(
            timeout,
            format_args!(
                "{want} exchanges succeeded (failed so far: {})",
                self.failed()
            ),
            || self.ok() >= want,
        );
    }

    pub fn failed(&self) -> u64 {
        self.tally.failed.load(Ordering::SeqCst)
    }

    /// Stops the clients and returns (succeeded, failed, reasons).
    pub fn stop(self) -> (u64, u64, Vec<String>) {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.threads {
            let _ = t.join();
        }
        let reasons = self.tally.reasons.lock().unwrap().clone();
        (
            self.tally.ok.load(Ordering::SeqCst),
            self.tally.failed.load(Ordering::SeqCst),
            reasons,
        )
    }
}
