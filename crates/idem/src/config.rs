//! The configuration of operation classes a command runs with: the TOML file
//! of `--config` / `IDEM_CONFIG` (else the bundled one) and the
//! `IDEM_OPERATIONS__…` overrides of the environment.

use std::path::PathBuf;

use anyhow::{Context, Result};
use idem_core::config::Config;

pub(crate) fn load_config(path: Option<&PathBuf>) -> Result<Config> {
    if path.is_none() {
        tracing::info!(
            "no --config / IDEM_CONFIG given: using the bundled configuration (examples/idem.toml)"
        );
    }
    let overrides = operation_overrides();
    if !overrides.is_empty() {
        let names: Vec<&str> = overrides.iter().map(|(k, _)| k.as_str()).collect();
        tracing::info!(
            overrides = %names.join(", "),
            "configuration overridden from the environment"
        );
    }
    config_from(path, overrides)
}

/// The configuration at `path` (else the bundled one) with the
/// `IDEM_OPERATIONS__…` overrides of the environment applied.
pub(crate) fn read_config(path: Option<&PathBuf>) -> Result<Config> {
    config_from(path, operation_overrides())
}

/// The `IDEM_OPERATIONS__…` variables of the environment, sorted by name.
fn operation_overrides() -> Vec<(String, String)> {
    let mut vars: Vec<(String, String)> = std::env::vars()
        .filter(|(k, _)| k.starts_with("IDEM_OPERATIONS__"))
        .collect();
    vars.sort();
    vars
}

/// The configuration at `path` (else the bundled one) with `overrides` applied.
fn config_from(path: Option<&PathBuf>, overrides: Vec<(String, String)>) -> Result<Config> {
    let config = match path {
        Some(p) => {
            let text =
                std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
            Config::from_toml_with_env(&text, overrides)?
        }
        None => Config::from_toml_with_env(idem_core::config::DEFAULT_TOML, overrides)?,
    };
    Ok(config)
}
