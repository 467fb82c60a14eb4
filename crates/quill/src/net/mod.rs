//! Sockets: listening addresses and listeners, upstream connects, service names, and
//! addresses written as text.

pub mod connect;
pub mod listen;
pub mod services;
pub mod sockopt;
pub mod text;
pub mod udp;

pub use listen::{ListenAddr, Listener};
