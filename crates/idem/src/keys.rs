//! The checks of `idem keys create`'s arguments, made before any store is
//! opened.

use std::path::PathBuf;

use anyhow::{Result, bail};
use idem_core::model::{Role, Serves};

use crate::config::read_config;
use idem_server::output::tell;

/// Checks the arguments of `keys create` before anything is opened: the role,
/// the tenant (1–128 visible ASCII characters: it is part of every scope's
/// primary key) and the operation classes (trimmed; none empty; a warning for
/// each the configuration at `config`, else the bundled one, does not
/// define). Returns them ready to store.
///
/// # Errors
/// A message naming the refused argument.
pub(crate) fn key_to_create(
    tenant: &str,
    role: &str,
    operations: Option<&[String]>,
    config: Option<&PathBuf>,
) -> Result<(String, Role, Option<Vec<String>>)> {
    let role: Role = role
        .parse()
        .map_err(|e| anyhow::anyhow!("{e}: use client, executor or admin"))?;
    if tenant.is_empty()
        || tenant.len() > 128
        || !tenant.bytes().all(|b| (0x21..=0x7e).contains(&b))
    {
        bail!("--tenant must be 1–128 visible ASCII characters");
    }
    let operations =
        operations.map(|ops| ops.iter().map(|o| o.trim().to_owned()).collect::<Vec<_>>());
    if let Some(ops) = &operations {
        if ops.iter().any(String::is_empty) {
            bail!("--operations lists an empty class name");
        }
        warn_unknown_classes(ops, config);
    }
    Ok((tenant.to_owned(), role, operations))
}

/// Warns (on stderr) about each of `ops` that the configuration at `path`
/// (`--config` / `IDEM_CONFIG`, as `idem serve` takes it; else the bundled
/// one) does not define: a key limited to it can submit nothing until the
/// server's configuration has it. Only a warning, since the server may run
/// with another configuration.
fn warn_unknown_classes(ops: &[String], path: Option<&PathBuf>) {
    let config = match read_config(path) {
        Ok(config) => config,
        Err(e) => {
            tell(format_args!(
                "warning: the configuration does not load ({e:#}); the operation classes were not checked"
            ));
            return;
        }
    };
    let source = path.map_or_else(
        || "the bundled configuration".to_owned(),
        |p| format!("the configuration {}", p.display()),
    );
    for op in ops.iter().filter(|o| !config.operations.contains_key(*o)) {
        tell(format_args!(
            "warning: `{op}` is not an operation class of {source}; this key cannot submit it until the server's configuration defines it"
        ));
    }
}

/// The `--serves` of `keys create`: `None` without one; an executor key's
/// tenant set (SPEC §2.13).
///
/// # Errors
/// A `--serves` on a key whose role is not `executor`, or one with an empty
/// tenant name.
pub(crate) fn pool_of(role: &str, serves: Option<&str>) -> anyhow::Result<Option<Serves>> {
    let Some(text) = serves else {
        return Ok(None);
    };
    if role != "executor" {
        anyhow::bail!(
            "--serves is for executor keys (a shared executor pool); this key's role is {role}"
        );
    }
    match Serves::parse(text) {
        Some(s) => Ok(Some(s)),
        None => {
            anyhow::bail!("--serves takes `all` or a comma-separated list of tenants, none empty")
        }
    }
}
