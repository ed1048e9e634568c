//! `backstop serve` as a process on a store it cannot make writes durable in: it exits 2 with
//! one line naming the store and the reason, and never says it listens.
//!
//! Permission bits do not stop root, so when the tests run as root the gateway is started as
//! the unprivileged user `nobody` (uid and gid 65534) on files that user owns, and the read-only
//! file system is a real one: a tmpfs mounted for the test and remounted read-only (where the
//! test may not mount, it says so and checks nothing).

#![cfg(target_os = "linux")]

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::common::listening::spawn_listening;

const EXAMPLE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/backstop.yaml");

/// The unprivileged user the gateway runs as when the tests run as root.
const NOBODY: u32 = 65534;

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// `backstop serve` of the example policy, its secrets set, on a free loopback port with its
/// store at `store`; as `nobody` when this process is root.
fn serve(store: &Path) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_backstop"));
    command
        .env_remove("RUST_LOG")
        .env("BACKSTOP_AGENT_INVOICE_TOKEN", "invoice-token")
        .env("BILLING_API_KEY", "billing-secret-value")
        .args([
            "serve",
            "--config",
            EXAMPLE,
            "--listen",
            "127.0.0.1:0",
            "--store",
        ])
        .arg(store);
    if is_root() {
        command.uid(NOBODY).gid(NOBODY);
    }
    command
}

/// Makes `path` belong to the user [`serve`] runs as.
fn hand_over(path: &Path) {
    if is_root() {
        std::os::unix::fs::chown(path, Some(NOBODY), Some(NOBODY)).expect("chown");
    }
}

fn chmod(path: &Path, mode: u32) {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
}

/// A directory `store-dir` the gateway's user owns, inside a temporary directory it may enter.
fn store_dir(root: &tempfile::TempDir) -> PathBuf {
    chmod(root.path(), 0o755);
    let dir = root.path().join("store-dir");
    std::fs::create_dir(&dir).expect("mkdir");
    hand_over(&dir);
    dir
}

/// A closed store with one task at `dir/b.db`, owned by the gateway's user.
fn closed_store(dir: &Path) -> PathBuf {
    let path = dir.join("b.db");
    let store = backstop_store::SqliteStore::open(&path).expect("open store");
    backstop_store::Store::open_task(
        &store,
        backstop_store::NewTask {
            id: "run-a".into(),
            agent: "invoice-agent".into(),
            priority: backstop_store::Priority::Normal,
            deadline: None,
        },
        crate::common::at(0),
    )
    .expect("open task");
    drop(store);
    hand_over(&path);
    path
}

/// Runs `command` to its end (killing it after 60 s: a gateway that serves instead of
/// refusing), and checks it exited 2 with exactly one line on stderr, which it returns.
#[allow(clippy::disallowed_methods)] // a bound on waiting for another process
fn refused(command: &mut Command) -> String {
    let mut child = command
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn serve");
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while child.try_wait().expect("wait").is_none() {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().expect("output");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!stderr.contains("listening on"), "it served:\n{stderr}");
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "one line:\n{stderr}");
    lines[0].to_owned()
}

#[test]
fn serve_refuses_a_read_only_store_file_in_a_writable_directory() {
    let root = tempfile::tempdir().expect("tempdir");
    let dir = store_dir(&root);
    let path = closed_store(&dir);
    chmod(&path, 0o444);
    let before = std::fs::read(&path).expect("read");
    let line = refused(&mut serve(&path));
    assert_eq!(
        line,
        format!(
            "backstop serve: cannot open the store {p}: writes cannot be made durable here: the \
             file cannot be opened for writing (permission denied); make the file and its \
             directory writable for this user (on a writable file system), or use another store",
            p = path.display()
        )
    );
    assert_eq!(
        std::fs::read(&path).expect("read"),
        before,
        "left as it was"
    );
}

#[test]
fn serve_refuses_a_store_whose_directory_takes_no_new_file() {
    let root = tempfile::tempdir().expect("tempdir");
    let dir = store_dir(&root);
    let path = closed_store(&dir);
    // The store file is writable, but SQLite could not create its -wal and -shm files.
    chmod(&dir, 0o555);
    let line = refused(&mut serve(&path));
    chmod(&dir, 0o755);
    assert!(
        line.starts_with(&format!(
            "backstop serve: cannot open the store {p}: writes cannot be made durable here: its \
             directory {d} does not take new files (permission denied), and SQLite creates the \
             store's -wal and -shm files there;",
            p = path.display(),
            d = dir.display()
        )),
        "{line}"
    );
    let left: Vec<_> = std::fs::read_dir(&dir)
        .expect("list")
        .map(|e| e.expect("entry").file_name())
        .collect();
    assert_eq!(left, [std::ffi::OsString::from("b.db")], "nothing created");
}

/// A tmpfs mounted on a directory for the test, unmounted when dropped.
struct Mounted(PathBuf);

impl Mounted {
    /// Mounts a small tmpfs on `dir`, or `None` where this process may not mount.
    fn tmpfs(dir: &Path) -> Option<Mounted> {
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=64m,mode=0755", "tmpfs"])
            .arg(dir)
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        ok.then(|| Mounted(dir.to_owned()))
    }

    fn remount_read_only(&self) {
        let status = Command::new("mount")
            .args(["-o", "remount,ro"])
            .arg(&self.0)
            .status()
            .expect("mount");
        assert!(status.success(), "remount read-only");
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

#[test]
fn serve_refuses_a_store_on_a_read_only_file_system_whose_wal_and_shm_exist() {
    let root = tempfile::tempdir().expect("tempdir");
    let dir = store_dir(&root);
    let Some(mount) = (if is_root() {
        Mounted::tmpfs(&dir)
    } else {
        None
    }) else {
        eprintln!(
            "serve_refuses_a_store_on_a_read_only_file_system_whose_wal_and_shm_exist: not \
             checked: this test mounts a tmpfs, which needs root with CAP_SYS_ADMIN"
        );
        return;
    };
    hand_over(&dir);
    // Created by the gateway, not here: this process keeps a descriptor of every store it
    // opened for writing, which would keep the file system from being remounted read-only.
    let path = dir.join("b.db");
    // A gateway killed while serving leaves its -wal and -shm files beside the store.
    let mut gateway = spawn_listening(&mut serve(&path), Duration::from_secs(60));
    gateway.kill();
    for suffix in ["-wal", "-shm"] {
        let mut name = path.clone().into_os_string();
        name.push(suffix);
        assert!(
            Path::new(&name).exists(),
            "{suffix} left by the killed gateway"
        );
    }
    mount.remount_read_only();
    let line = refused(&mut serve(&path));
    assert!(
        line.starts_with(&format!(
            "backstop serve: cannot open the store {p}: writes cannot be made durable here: the \
             file cannot be opened for writing (a read-only file system);",
            p = path.display()
        )),
        "{line}"
    );
}
