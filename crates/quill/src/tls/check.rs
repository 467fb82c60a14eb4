//! Every problem of a TLS configuration, not only the first (`quill --check`): each part
//! that reads files is built on its own, so an unreadable key does not hide a bad CA file
//! or a broken site of the SNI directory. Start-up and reloads use `build`, which stops at
//! the first problem; this only adds the ones `build` would have met after it.

use std::path::{Path, PathBuf};

use rustls::RootCertStore;

use super::{build, build_upstream, files, provider_and_versions, TlsConf, TlsError};
use crate::command::Command;

/// The problems `build` would meet with `conf`; empty when it builds.
pub fn check(conf: &TlsConf) -> Vec<TlsError> {
    let Err(first) = build(conf, None) else {
        return Vec::new();
    };
    let mut found = Vec::new();
    match provider_and_versions(conf) {
        Err(e) => found.push(e),
        Ok((provider, _)) => {
            if let Some(cert) = &conf.cert {
                let cert = PathBuf::from(cert.as_str());
                let key = conf
                    .key
                    .as_ref()
                    .map_or_else(|| cert.clone(), |k| PathBuf::from(k.as_str()));
                found.extend(files::certified_key(&cert, &key, &provider).err());
                if let Some(dir) = &conf.sni_path {
                    match files::sni_sites(Path::new(dir.as_str())) {
                        Err(e) => found.push(e),
                        Ok(sites) => {
                            for site in sites {
                                let key = files::certified_key(&site.cert, &site.key, &provider);
                                found.extend(key.err());
                                if let Some(ca) = &site.ca {
                                    let mut roots = RootCertStore::empty();
                                    found.extend(files::add_roots(&mut roots, ca).err());
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    if let Some(ocsp) = &conf.ocsp {
        found.extend(files::read(Path::new(ocsp.as_str())).err());
    }
    let mut roots = RootCertStore::empty();
    if let Some(ca) = &conf.ca {
        found.extend(files::add_roots(&mut roots, Path::new(ca.as_str())).err());
    }
    if let Some(dir) = &conf.ca_dir {
        found.extend(files::add_roots_dir(&mut roots, Path::new(dir.as_str())).err());
    }
    if conf.upstream {
        found.extend(build_upstream(conf).err());
    }
    // What `build` checks beyond the files (a key too weak for the suites, -R without a CA).
    if found.is_empty() {
        found.push(first);
    }
    found
}

impl TlsError {
    /// The file the problem is in, when it is about one.
    pub fn file(&self) -> Option<&Path> {
        match self {
            TlsError::Read { file, .. }
            | TlsError::NoCertificate { file, .. }
            | TlsError::NoKey { file, .. }
            | TlsError::EncryptedKey { file }
            | TlsError::BadCert { file, .. }
            | TlsError::BadKey { file, .. }
            | TlsError::BadCa { file, .. }
            | TlsError::Sni { file, .. }
            | TlsError::EmptyOcsp { file } => Some(file),
            TlsError::KeyMismatch { key, .. } => Some(key),
            _ => None,
        }
    }

    /// Whether `cmd` is the setting a problem that names no file is about.
    pub fn is_about(&self, cmd: &Command) -> bool {
        match self {
            TlsError::NoClientCa => matches!(cmd, Command::SslVerifyClient(true)),
            TlsError::NeedsCert(_) => matches!(
                cmd,
                Command::SslKey(Some(_))
                    | Command::SslVerifyClient(true)
                    | Command::SslSniPath(Some(_))
                    | Command::SslOcspResponse(Some(_))
            ),
            TlsError::Cipher { .. } | TlsError::NoSuites { .. } => {
                matches!(cmd, Command::SslCiphers(_))
            }
            TlsError::NoVersion => {
                matches!(cmd, Command::SslProtocol(_) | Command::SslOption(..))
            }
            _ => false,
        }
    }
}
