//! What quill asks of client connections served request by request (`h1_pump`): to stop,
//! or to move on to a new connection after a reload or a drain. They read it from
//! [`State::asked`] with one load per turn instead of registering with the process-wide
//! watch channels per request (≈ 2.4 k instructions a request, and a lock that both
//! event loops' cores fought over).
//!
//! Only a connection waiting for its client must be woken, and only when quill stops: each
//! event loop keeps one [`bell`] for that, rung by one task per loop ([`ring_at_stop`]).
//! Invariant: the bell rings only after [`State::stop`] is visible, so a waiter woken by
//! it, or one that starts waiting after it, sees `stopping`.

use std::sync::Arc;

use tokio::sync::Notify;

use super::pump::{Ask, Asks};
use crate::state::{Asked, State};

thread_local! {
    /// The event loop's bell: one per thread, alive as long as the process.
    static BELL: &'static Notify = Box::leak(Box::new(Notify::new()));
}

/// This event loop's bell, rung when quill stops.
pub fn bell() -> &'static Notify {
    BELL.with(|b| *b)
}

/// Rings this event loop's bell once quill stops. One task per event loop runs it.
pub async fn ring_at_stop(state: Arc<State>) {
    let mut stopping = state.stopping.subscribe();
    // `State::stop` sets the word before it sends on the channel.
    if stopping.wait_for(|s| *s).await.is_ok() {
        bell().notify_waiters();
    }
}

/// What quill asks of one connection: stop, or move on if a reload or a drain came
/// since it started.
#[derive(Debug, Clone, Copy)]
pub struct Since<'a> {
    state: &'a State,
    start: Asked,
}

impl<'a> Since<'a> {
    /// Reads from now on.
    pub fn now(state: &'a State) -> Since<'a> {
        Since {
            state,
            start: state.asked(),
        }
    }
}

impl Asks for Since<'_> {
    fn ask(&self) -> Ask {
        let now = self.state.asked();
        if now.stopping() {
            Ask::Stop
        } else if now.recycled_since(self.start) {
            Ask::MoveOn
        } else {
            Ask::Nothing
        }
    }
}
