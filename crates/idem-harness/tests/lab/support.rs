//! The two binaries the lab's tests run: `idem-lab` (this package's) and the
//! `idem` whose `idem serve` processes it starts.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// The `idem-lab` binary cargo built for these tests.
pub const LAB: &str = env!("CARGO_BIN_EXE_idem-lab");

/// `idem-lab`, without `IDEM_STORE`.
pub fn lab() -> Command {
    let mut cmd = Command::new(LAB);
    cmd.env_remove("IDEM_STORE");
    cmd
}

/// [`lab`] for a command that starts `idem serve`: [`idem_bin`] is built
/// first. Without `IDEM_BIN` the command finds it by its own default, beside
/// `idem-lab`.
pub fn lab_serving() -> Command {
    idem_bin();
    lab()
}

/// The `idem` binary: `IDEM_BIN` when set, else the one `cargo build
/// --workspace --bins --examples` puts beside `idem-lab` (same target
/// directory and profile), built once per test process so it is never older
/// than the sources (cargo has released the target directory by the time
/// tests run). Another package's binary has no `CARGO_BIN_EXE_` variable
/// here. The whole workspace's bins and examples, not `-p idem`: a build of
/// examples resolves features with every member's dev-dependencies, as
/// `cargo test --workspace` does, so after that command this build has
/// nothing to compile (`-p idem` would build `idem` and its dependencies
/// again with other features).
pub fn idem_bin() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        if let Some(bin) = std::env::var_os("IDEM_BIN") {
            return PathBuf::from(bin);
        }
        let lab = Path::new(LAB);
        let profile_dir = lab.parent().expect("idem-lab's directory");
        let target_dir = profile_dir.parent().expect("the target directory");
        let profile = match profile_dir.file_name().and_then(|n| n.to_str()) {
            Some("debug") | None => "dev",
            Some(other) => other,
        };
        let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let status = Command::new(env!("CARGO"))
            .current_dir(&workspace)
            .args(["build", "--quiet", "--workspace", "--bins", "--examples"])
            .args(["--profile", profile])
            .arg("--target-dir")
            .arg(target_dir)
            .status()
            .expect("run cargo build --workspace --bins --examples");
        assert!(status.success(), "cargo build of the bins failed: {status}");
        let bin = lab.with_file_name(format!("idem{}", std::env::consts::EXE_SUFFIX));
        assert!(bin.is_file(), "no idem binary at {}", bin.display());
        bin
    })
}
