//! No secret in any output: a PostgreSQL password (written unencoded with
//! `@`, `:` or `/`, or percent-encoded), an API key and a console session
//! token never reach a log line, an error message or `/metrics`, from
//! `idem serve` or from any command that takes `--store`. Every password
//! here is framed by a marker that no other output contains, so a fragment
//! of it (the driver once took the tail after an unencoded `@` for the host)
//! is found as surely as the whole.

use idem_store_postgres::testing::fresh_database;

use crate::console::Browser;
use crate::support::{Server, cli_at, ikey, payment, send};

/// Framing of every password: a scan for it finds any fragment longer than
/// the password's middle.
const MARK: &str = "QZ7";

/// Passwords as written in the URL, of the shapes that broke URL parsing:
/// an unencoded `@`, a `:`, a `/` and `?`, and an encoded `%40`.
fn passwords() -> [String; 4] {
    [
        format!("{MARK}s3cr@t{MARK}"),
        format!("{MARK}a:b{MARK}"),
        format!("{MARK}p/w?x@y{MARK}"),
        format!("{MARK}p%40ss{MARK}"),
    ]
}

/// `url` (`postgres://postgres@HOST…`) with `password` after the role.
fn with_password(url: &str, password: &str) -> String {
    url.replacen(
        "postgres://postgres@",
        &format!("postgres://postgres:{password}@"),
        1,
    )
}

/// Fails naming `what` when `text` holds the password marker or any of `secrets`.
#[track_caller]
fn assert_clean(what: &str, text: &str, secrets: &[String]) {
    assert!(
        !text.contains(MARK),
        "{what} shows part of the password:\n{text}"
    );
    for s in secrets {
        assert!(!text.contains(s.as_str()), "{what} shows a secret:\n{text}");
    }
}

/// Every command that takes `--store`, then `idem serve` with requests that
/// log (a submit, a refused key, a console sign-in, `/metrics`), for each
/// password shape; then an unreachable server's error, for each shape.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_password_key_or_session_token_reaches_any_output() {
    let db = fresh_database().await;
    let mut secrets: Vec<String> = Vec::new();
    for password in passwords() {
        let url = with_password(db.url(), &password);
        let (ok, out, err) = cli_at(&url, &["migrate"]);
        assert!(ok, "migrate: {err}");
        assert_clean("migrate", &(out + &err), &secrets);
        let (ok, key, err) = cli_at(
            &url,
            &["keys", "create", "--tenant", "acme", "--role", "admin"],
        );
        assert!(ok, "keys create: {err}");
        // The plain key is printed once, on stdout, by design; nowhere else.
        assert_clean("keys create's log", &err, &secrets);
        secrets.push(key.trim().to_owned());
        let key_id = cli_at(&url, &["keys", "list"]).1;
        assert_clean("keys list", &key_id, &secrets);
        let id = key_id
            .lines()
            .last()
            .and_then(|l| l.split_whitespace().next())
            .expect("a key line")
            .to_owned();
        for args in [
            vec!["task", "list", "--tenant", "acme"],
            vec!["task", "show", "0190b6d5-0000-7000-8000-000000000000"],
            vec!["gc"],
            vec!["keys", "revoke", &id],
        ] {
            let (_, out, err) = cli_at(&url, &args);
            assert_clean(&args.join(" "), &(out + &err), &secrets);
        }
        let (_, admin, _) = cli_at(
            &url,
            &["keys", "create", "--tenant", "acme", "--role", "admin"],
        );
        let admin = admin.trim().to_owned();
        secrets.push(admin.clone());
        let keys = Server::create_keys(&url);
        secrets.extend([keys.acme.clone(), keys.exec.clone()]);
        let srv = Server::start_pg(&url, &keys, &[("RUST_LOG", "debug")]).await;
        srv.new_task(&ikey(), "payment.release", payment(5)).await;
        let refused = srv.get("/v1/tasks", &format!("{}x", keys.acme)).await;
        assert_eq!(refused.status, 401);
        let b = Browser::new(&srv);
        let signed = b.sign_in(&admin, None).await;
        assert_eq!(signed.status, 303, "sign-in: {}", signed.text);
        for cookie in signed.headers.get_all("set-cookie") {
            let value = cookie.to_str().unwrap().split(';').next().unwrap();
            let token = value.split_once('=').map_or(value, |(_, v)| v);
            if token.len() > 8 {
                secrets.push(token.to_owned());
            }
        }
        assert_eq!(b.get("/console/overview").await.status, 200);
        let metrics = send(srv.http.get(format!("{}/metrics", srv.url))).await;
        assert_eq!(metrics.status, 200);
        assert_clean("/metrics", &metrics.text, &secrets);
        let log = srv.log();
        assert!(log.contains("127.0.0.1"), "the log names the host:\n{log}");
        assert_clean("the server's log", &log, &secrets);
        drop(srv);
    }
    // An unreachable server: the error names host and port, never the password.
    for password in passwords() {
        let url = format!("postgres://postgres:{password}@127.0.0.1:1/idem");
        for args in [
            vec!["migrate"],
            vec!["keys", "list"],
            vec!["serve", "--store-wait-ms", "0"],
        ] {
            let (ok, out, err) = cli_at(&url, &args);
            assert!(!ok, "{args:?} on an unreachable store succeeded");
            assert!(err.contains("127.0.0.1:1"), "{args:?}: {err}");
            assert_clean(
                &format!("{args:?} on an unreachable store"),
                &(out + &err),
                &secrets,
            );
        }
    }
}
