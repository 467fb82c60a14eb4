//! quill: a fast, memory-safe TCP load balancer, command-line compatible with Pen.
//!
//! The spine is the command language ([`command`]): flags, `-O` options and (later) config
//! files and the control socket all become [`command::Command`]s applied by
//! [`settings::Settings::apply`]. The result is published as an immutable snapshot in
//! [`state::State`], beside the runtime tables the data plane ([`proxy`]) updates.

pub mod accesslog;
pub mod acl;
pub mod announce;
pub mod balance;
pub mod bpf;
pub mod check;
pub mod cli;
pub mod command;
pub mod config;
pub mod connlog;
pub mod control;
pub mod daemon;
pub mod demo;
pub mod dsr;
pub mod geoip;
pub mod health;
pub mod logfile;
pub mod logging;
pub mod memory;
pub mod net;
pub mod privileges;
pub mod proxy;
pub mod settings;
pub mod state;
pub mod syslog;
pub mod systemd;
pub mod tls;
