//! Sockets: listening addresses and listeners, upstream connects, service names.

pub mod connect;
pub mod listen;
pub mod services;
pub mod sockopt;
pub mod udp;

pub use listen::{ListenAddr, Listener};
