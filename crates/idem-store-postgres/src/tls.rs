//! The TLS connector of a [`Target`]: rustls with the `ring` provider, checking
//! as much of the server's certificate as its `sslmode` asks (libpq's rules,
//! [`Target::verify`]).

use std::sync::Arc;

use idem_store::StoreError;
use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::WebPkiSupportedAlgorithms;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme,
};
use tokio_postgres_rustls::MakeRustlsConnect;

use crate::target::{RootCerts, Target, Verify};

/// The connector for `target`. Built for every mode (with `sslmode=disable`
/// the driver never uses it).
///
/// # Errors
/// [`StoreError::Config`] when the root certificates cannot be read: the
/// `sslrootcert` file is missing or holds no PEM certificate, or the platform
/// has none.
pub(crate) fn connector(target: &Target) -> Result<MakeRustlsConnect, StoreError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let verifier: Arc<dyn ServerCertVerifier> = match target.verify() {
        Verify::Nothing => Arc::new(EncryptOnly {
            algorithms: provider.signature_verification_algorithms,
        }),
        mode => {
            let roots = root_store(target)?;
            let webpki =
                WebPkiServerVerifier::builder_with_provider(Arc::new(roots), Arc::clone(&provider))
                    .build()
                    .map_err(|e| {
                        StoreError::Config(format!(
                            "TLS to PostgreSQL ({}): {e}",
                            target.tls_description()
                        ))
                    })?;
            if mode == Verify::Full {
                webpki
            } else {
                Arc::new(ChainOnly { inner: webpki })
            }
        }
    };
    let config = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| StoreError::Config(format!("TLS to PostgreSQL: {e}")))?
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_no_client_auth();
    Ok(MakeRustlsConnect::new(config))
}

/// The root certificates of `target`: its `sslrootcert` file, else the
/// platform's.
fn root_store(target: &Target) -> Result<RootCertStore, StoreError> {
    let mut roots = RootCertStore::empty();
    match &target.root_certs {
        Some(RootCerts::File(path)) => {
            let certs = CertificateDer::pem_file_iter(path)
                .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
                .map_err(|e| {
                    StoreError::Config(format!(
                        "sslrootcert={}: cannot read the root certificates: {e}",
                        path.display()
                    ))
                })?;
            let (added, _) = roots.add_parsable_certificates(certs);
            if added == 0 {
                return Err(StoreError::Config(format!(
                    "sslrootcert={}: no usable certificate in the file",
                    path.display()
                )));
            }
        }
        Some(RootCerts::System) | None => {
            let found = rustls_native_certs::load_native_certs();
            let (added, _) = roots.add_parsable_certificates(found.certs);
            if added == 0 {
                let why = found
                    .errors
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join("; ");
                return Err(StoreError::Config(format!(
                    "{} needs root certificates and the platform has none ({why}); \
                     give sslrootcert=/path/to/ca.pem",
                    target.tls_description()
                )));
            }
        }
    }
    Ok(roots)
}

/// `verify-ca` (and `require` with a root certificate): the chain must lead
/// to a root certificate; a certificate for another host name is accepted.
#[derive(Debug)]
struct ChainOnly {
    inner: Arc<WebPkiServerVerifier>,
}

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        // The name is checked after the chain: a name mismatch means the chain
        // verified.
        match self.inner.verify_server_cert(
            end_entity,
            intermediates,
            server_name,
            ocsp_response,
            now,
        ) {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// `prefer` and `require` without a root certificate: encrypted, the server
/// not authenticated (libpq's rule). The handshake's signatures are still
/// checked, so the peer holds the key of the certificate it shows.
#[derive(Debug)]
struct EncryptOnly {
    algorithms: WebPkiSupportedAlgorithms,
}

impl ServerCertVerifier for EncryptOnly {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}
