//! A server's answer to a `check grpc` health check (the body of its DATA frames): reading
//! the gRPC message and the protobuf `HealthCheckResponse` in it never panics, and what
//! reads as SERVING was a whole uncompressed message.
#![no_main]

use libfuzzer_sys::fuzz_target;
use quill::health::grpc::{serving_status, ServingStatus};

fuzz_target!(|data: &[u8]| {
    if let Ok(ServingStatus::Serving) = serving_status(data) {
        assert_eq!(data[0], 0);
        let len = u32::from_be_bytes([data[1], data[2], data[3], data[4]]) as usize;
        assert_eq!(data.len(), 5 + len);
    }
});
