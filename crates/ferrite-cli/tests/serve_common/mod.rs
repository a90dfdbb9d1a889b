//! Shared by the `ferrite serve --isolate` tests: the server process (started with given
//! arguments, its address read from its log, killed when dropped) and an HTTP client.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// The server process; killed when dropped.
pub struct Server {
    pub child: Child,
    pub url: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `ferrite serve` with `args` (and `--port 0`), once it listens; its log goes to the test's
/// stderr, each line prefixed `server: `.
pub fn serve(args: &[String]) -> Server {
    let mut child = Command::new(env!("CARGO_BIN_EXE_ferrite"))
        .arg("serve")
        .args(args)
        .args(["--port", "0"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start ferrite serve");
    let stderr = child.stderr.take().expect("stderr");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            eprintln!("server: {line}");
            if let Some(addr) = line.strip_prefix("listening on ") {
                let _ = tx.send(addr.to_string());
            }
        }
    });
    let url = rx.recv_timeout(Duration::from_secs(300)).expect("the server listens");
    Server { child, url }
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder().timeout(Duration::from_secs(300)).build().expect("client")
}
