//! Data planes that own connections. They read the settings snapshot and the shared tables,
//! never parse configuration text, and never block.

pub mod candidates;
pub mod coalesce;
pub mod dummy;
pub mod gateway;
pub mod grpc;
pub mod h1;
pub mod h1_client;
pub mod h1_pump;
pub mod h2;
pub mod h2_client;
pub mod http;
pub mod park;
pub mod poll_before_sleep;
pub mod polling;
pub mod pool;
pub mod pool_h2;
pub mod proxy_protocol;
pub mod pump;
pub mod quickack;
pub mod registry;
pub mod relay;
pub mod replay;
pub mod signals;
pub mod splice;
pub mod stream;
pub mod tcp;
pub mod udp;
