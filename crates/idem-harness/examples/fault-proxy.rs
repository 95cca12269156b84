//! `fault-proxy`: the fault-injecting proxy of `idem_harness::fault_proxy` as
//! a process, for the SDK worker suites (Python, TypeScript) that put it
//! between their worker and `idem serve`.
//!
//! ```text
//! fault-proxy --upstream 127.0.0.1:PORT [--listen 127.0.0.1:0]
//! ```
//!
//! Once bound it prints exactly one line, `listening on 127.0.0.1:NNNN`, on
//! stdout, then serves until it is killed. Rules are set with `PUT /__faults`
//! and counts read with `GET /__faults/counts` on the same port (the module's
//! documentation gives the route classes, modes and rule forms).
//!
//! Exit status 2 on a usage error, 1 if the address cannot be bound.

use std::io::Write;
use std::net::SocketAddr;
use std::process::ExitCode;

use idem_harness::fault_proxy::FaultProxy;

const USAGE: &str = "usage: fault-proxy --upstream HOST:PORT [--listen HOST:PORT]";

fn parse_args() -> Result<(SocketAddr, SocketAddr), String> {
    let mut upstream = None;
    let mut listen: SocketAddr = ([127, 0, 0, 1], 0).into();
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let addr: SocketAddr = value.parse().map_err(|e| format!("{flag} {value}: {e}"))?;
        match flag.as_str() {
            "--upstream" => upstream = Some(addr),
            "--listen" => listen = addr,
            _ => return Err(format!("unknown argument {flag}")),
        }
    }
    let upstream = upstream.ok_or("--upstream is required")?;
    Ok((upstream, listen))
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let (upstream, listen) = match parse_args() {
        Ok(args) => args,
        Err(e) => {
            eprintln!("fault-proxy: {e}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let proxy = match FaultProxy::start(listen, upstream).await {
        Ok(proxy) => proxy,
        Err(e) => {
            eprintln!("fault-proxy: bind {listen}: {e}");
            return ExitCode::from(1);
        }
    };
    let mut stdout = std::io::stdout().lock();
    if writeln!(stdout, "listening on {}", proxy.addr())
        .and_then(|()| stdout.flush())
        .is_err()
    {
        return ExitCode::from(1);
    }
    drop(stdout);
    std::future::pending::<()>().await;
    ExitCode::SUCCESS
}
