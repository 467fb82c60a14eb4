//! A client's first bytes through quill's TLS accept: ClientHello parsing (rustls) and the
//! choice of certificate by SNI (quill), then as much of the handshake as the bytes allow.
//! Must end with an error or a connection, never a panic or a hang.
#![no_main]

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use quill::command::Command;
use quill::tls::{self, ServerTls, TlsConf};
use tokio::io::AsyncWriteExt;

/// quill's TLS server with a default certificate and one SNI name (`example.test`).
fn server() -> &'static Arc<ServerTls> {
    static SERVER: OnceLock<Arc<ServerTls>> = OnceLock::new();
    SERVER.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("quill-fuzz-tls-{}", std::process::id()));
        let sni = dir.join("sni");
        std::fs::create_dir_all(&sni).unwrap();
        let files: [(&str, &str); 4] = [
            ("default.crt", include_str!("../tls/default.crt")),
            ("default.key", include_str!("../tls/default.key")),
            (
                "sni/example.test.crt",
                include_str!("../tls/example.test.crt"),
            ),
            (
                "sni/example.test.key",
                include_str!("../tls/example.test.key"),
            ),
        ];
        for (name, text) in files {
            std::fs::write(dir.join(name), text).unwrap();
        }
        let mut conf = TlsConf::default();
        for line in [
            format!("ssl_cert {}", dir.join("default.crt").display()),
            format!("ssl_key {}", dir.join("default.key").display()),
            format!("ssl_sni_path {}", sni.display()),
        ] {
            let cmd: Command = line.parse().unwrap();
            assert!(conf.apply(&cmd).unwrap(), "{line}");
        }
        tls::build(&conf, None).unwrap().server.unwrap()
    })
}

fuzz_target!(|data: &[u8]| {
    let server = Arc::clone(server());
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    runtime.block_on(async move {
        let (mut client, io) = tokio::io::duplex(256 * 1024);
        client.write_all(data).await.unwrap();
        client.shutdown().await.unwrap();
        // The client's side is complete and closed: the accept ends on its own.
        let _ = server.accept(io, Duration::from_secs(5)).await;
    });
});
