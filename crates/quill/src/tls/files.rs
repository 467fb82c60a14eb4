//! Reading TLS material from files: PEM certificate chains, private keys, CA bundles and
//! directories, the `ssl_sni_path` directory.
//!
//! Every error names the file it is about; a file is read once per build, whole, so a
//! certificate renewed between two reads cannot mix an old key with a new certificate.

use std::path::{Path, PathBuf};

use rustls::crypto::CryptoProvider;
use rustls::sign::CertifiedKey;
use rustls::RootCertStore;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

use super::TlsError;

/// Reads a whole file.
pub fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        file: path.to_path_buf(),
        source,
    })
}

fn certificates(path: &Path, bytes: &[u8]) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let mut out = Vec::new();
    for item in CertificateDer::pem_slice_iter(bytes) {
        match item {
            Ok(c) => out.push(c),
            Err(e) => {
                return Err(TlsError::NoCertificate {
                    file: path.to_path_buf(),
                    detail: format!(" ({e})"),
                })
            }
        }
    }
    if out.is_empty() {
        return Err(TlsError::NoCertificate {
            file: path.to_path_buf(),
            detail: String::new(),
        });
    }
    Ok(out)
}

/// The certificate chain of `cert` (leaf first) with the private key of `key` (which may
/// be the same file), checked to belong together, and the leaf's notAfter (Unix seconds).
pub fn certified_key(
    cert: &Path,
    key: &Path,
    provider: &CryptoProvider,
) -> Result<(CertifiedKey, i64), TlsError> {
    let cert_bytes = read(cert)?;
    let chain = certificates(cert, &cert_bytes)?;
    let key_bytes = if key == cert { cert_bytes } else { read(key)? };
    let der = PrivateKeyDer::from_pem_slice(&key_bytes).map_err(|e| {
        if is_encrypted_key(&key_bytes) {
            return TlsError::EncryptedKey {
                file: key.to_path_buf(),
            };
        }
        TlsError::NoKey {
            file: key.to_path_buf(),
            detail: match e {
                rustls_pki_types::pem::Error::NoItemsFound => String::new(),
                other => format!(" ({other})"),
            },
        }
    })?;
    let signing_key =
        provider
            .key_provider
            .load_private_key(der)
            .map_err(|e| TlsError::BadKey {
                file: key.to_path_buf(),
                reason: e.to_string(),
            })?;
    // Not `CertifiedKey::from_der`: its check parses the leaf as a client would verify it
    // (webpki), which refuses X.509 v1 certificates ("UnsupportedCertVersion", blamed on
    // the key). A server only needs its key and its certificate's public key to agree;
    // whether the certificate is acceptable is for its clients to judge, as with NGINX,
    // HAProxy and Pen.
    let leaf = chain.first().ok_or_else(|| TlsError::NoCertificate {
        file: cert.to_path_buf(),
        detail: String::new(),
    })?;
    let (leaf_spki, not_after) = leaf_public_key(cert, leaf)?;
    if signing_key
        .public_key()
        .is_some_and(|spki| spki.as_ref() != leaf_spki.as_slice())
    {
        return Err(TlsError::KeyMismatch {
            cert: cert.to_path_buf(),
            key: key.to_path_buf(),
        });
    }
    Ok((CertifiedKey::new(chain, signing_key), not_after))
}

/// The DER SubjectPublicKeyInfo of a certificate (any X.509 version) and its notAfter
/// (Unix seconds). Warns once, at build time, when the certificate is outside its validity
/// period: it is still served (clients decide), but an operator should hear of it before
/// the clients do.
fn leaf_public_key(file: &Path, der: &CertificateDer<'_>) -> Result<(Vec<u8>, i64), TlsError> {
    use x509_parser::prelude::{FromDer, X509Certificate};
    let (_, parsed) = X509Certificate::from_der(der.as_ref()).map_err(|e| TlsError::BadCert {
        file: file.to_path_buf(),
        reason: e.to_string(),
    })?;
    let validity = parsed.validity();
    if !validity.is_valid() {
        tracing::warn!(
            "{}: the certificate is valid from {} to {} only: clients will refuse it",
            file.display(),
            validity.not_before,
            validity.not_after
        );
    }
    let not_after = validity.not_after.timestamp();
    Ok((parsed.public_key().raw.to_vec(), not_after))
}

/// Whether a key file holds a passphrase-protected key: PKCS#8 `ENCRYPTED PRIVATE KEY`,
/// or OpenSSL's traditional `Proc-Type: 4,ENCRYPTED` header.
fn is_encrypted_key(bytes: &[u8]) -> bool {
    let has = |needle: &[u8]| bytes.windows(needle.len()).any(|w| w == needle);
    has(b"-----BEGIN ENCRYPTED PRIVATE KEY-----") || has(b"Proc-Type: 4,ENCRYPTED")
}

/// Adds the certificates of a PEM bundle as trust anchors.
pub fn add_roots(roots: &mut RootCertStore, path: &Path) -> Result<(), TlsError> {
    let bytes = read(path)?;
    for cert in certificates(path, &bytes)? {
        roots.add(cert).map_err(|e| TlsError::BadCa {
            file: path.to_path_buf(),
            reason: e.to_string(),
        })?;
    }
    Ok(())
}

/// Adds every certificate found in the files of a directory (OpenSSL's hashed
/// `c_rehash` layout, or plain `.pem`/`.crt` files). Files holding no certificate are
/// skipped; a directory that yields none is an error.
pub fn add_roots_dir(roots: &mut RootCertStore, dir: &Path) -> Result<(), TlsError> {
    let entries = std::fs::read_dir(dir).map_err(|source| TlsError::Read {
        file: dir.to_path_buf(),
        source,
    })?;
    let before = roots.len();
    let mut paths: Vec<PathBuf> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
    paths.sort();
    for path in paths {
        if !path.is_file() {
            continue;
        }
        let bytes = read(&path)?;
        let Ok(certs) = certificates(&path, &bytes) else {
            tracing::debug!("{}: no certificate, skipped", path.display());
            continue;
        };
        for cert in certs {
            roots.add(cert).map_err(|e| TlsError::BadCa {
                file: path.clone(),
                reason: e.to_string(),
            })?;
        }
    }
    if roots.len() == before {
        return Err(TlsError::NoCertificate {
            file: dir.to_path_buf(),
            detail: " (no file in the directory holds one)".to_string(),
        });
    }
    Ok(())
}

/// One name served from the `ssl_sni_path` directory.
pub struct Site {
    /// The server name, lower case.
    pub name: String,
    pub cert: PathBuf,
    pub key: PathBuf,
    /// CA certificates for this name's clients (used with `ssl_verify_client`).
    pub ca: Option<PathBuf>,
}

/// The names of an `ssl_sni_path` directory: every `NAME.crt` with its `NAME.key` (which
/// must exist) and optional `NAME.ca`.
pub fn sni_sites(dir: &Path) -> Result<Vec<Site>, TlsError> {
    let entries = std::fs::read_dir(dir).map_err(|source| TlsError::Read {
        file: dir.to_path_buf(),
        source,
    })?;
    let mut sites = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|source| TlsError::Read {
            file: dir.to_path_buf(),
            source,
        })?;
        let path = entry.path();
        if path.extension().and_then(|e| e.to_str()) != Some("crt") {
            continue;
        }
        let Some(name) = path.file_stem().and_then(|s| s.to_str()) else {
            continue;
        };
        let key = path.with_extension("key");
        if !key.exists() {
            return Err(TlsError::Sni {
                file: key,
                reason: format!("missing: the key for {}", path.display()),
            });
        }
        let ca = Some(path.with_extension("ca")).filter(|p| p.exists());
        sites.push(Site {
            name: name.trim_end_matches('.').to_ascii_lowercase(),
            cert: path,
            key,
            ca,
        });
    }
    sites.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(sites)
}
