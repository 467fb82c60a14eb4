//! Server selection: the runtime server table, the client tracking table and the policies
//! that choose a server for a new connection (Pen's semantics).

pub mod clock;
pub mod select;
pub mod servers;
pub mod tracking;

pub use select::{Choice, Selector};
pub use servers::{Place, ServerState, ServerTable};
pub use tracking::ClientTable;
