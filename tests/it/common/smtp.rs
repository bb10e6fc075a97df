//! SMTP for the e-mail tests: a fault-injecting fake, and a real server (aiosmtpd).
//!
//! [`FakeSmtp`] listens on 127.0.0.1:0 and speaks just enough SMTP (greeting, EHLO,
//! AUTH PLAIN, MAIL, RCPT, DATA, RSET, NOOP, QUIT), answering each transaction from a
//! [`Plan`]: a reply at any step, a dropped connection, or silence. It records every
//! connection, command and message, so tests can check what was (not) sent.
//!
//! [`Sink`] runs `tests/smtp_sink.py` (aiosmtpd, from PyPI) on a free port and reads the
//! messages it stored, parsed by Python's e-mail package.

#![allow(dead_code, clippy::unwrap_used)]

use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

/// What the fake does at one step.
#[derive(Debug, Clone, PartialEq)]
pub enum Answer {
    /// The normal positive reply for the step.
    Ok,
    /// This reply line (e.g. `"451 4.3.0 try later"`).
    Reply(String),
    /// Close the connection without answering.
    Drop,
    /// Never answer; keep the connection open.
    Silence,
    /// The normal positive reply, after this long (a slow relay).
    Late(Duration),
}

/// A reply line.
pub fn reply(line: &str) -> Answer {
    Answer::Reply(line.to_owned())
}

/// How the fake answers one transaction (MAIL FROM to the end of DATA).
#[derive(Debug, Clone)]
pub struct Plan {
    /// The answer to MAIL FROM.
    pub mail: Answer,
    /// Answers to RCPT TO by address (lower case); others get 250.
    pub rcpt: HashMap<String, Answer>,
    /// The answer to DATA.
    pub data: Answer,
    /// The answer after the end of DATA (the content is recorded in any case).
    pub end_of_data: Answer,
    /// Read this many bytes of content, then close the connection.
    pub drop_after_content_bytes: Option<usize>,
    /// After the 354, read nothing more and never answer (a relay that stalls mid-content).
    pub stall_content: bool,
    /// After answering the end of DATA, close the connection (as a relay that limits
    /// messages per connection, or times idle sessions out, does).
    pub close_after: bool,
}

impl Default for Plan {
    fn default() -> Self {
        Plan {
            mail: Answer::Ok,
            rcpt: HashMap::new(),
            data: Answer::Ok,
            end_of_data: Answer::Ok,
            drop_after_content_bytes: None,
            stall_content: false,
            close_after: false,
        }
    }
}

impl Plan {
    /// Accept everything.
    pub fn ok() -> Plan {
        Plan::default()
    }
    /// Answer MAIL FROM with `a`.
    pub fn at_mail(a: Answer) -> Plan {
        Plan {
            mail: a,
            ..Plan::default()
        }
    }
    /// Answer the end of DATA with `a`.
    pub fn at_end_of_data(a: Answer) -> Plan {
        Plan {
            end_of_data: a,
            ..Plan::default()
        }
    }
    /// Answer RCPT TO for `address` with `a`.
    pub fn at_rcpt(address: &str, a: Answer) -> Plan {
        let mut p = Plan::default();
        p.rcpt.insert(address.to_lowercase(), a);
        p
    }
}

/// What the fake received in one transaction that reached the end of DATA.
#[derive(Debug, Clone)]
pub struct Received {
    /// The MAIL FROM address.
    pub mail_from: String,
    /// Accepted RCPT TO addresses.
    pub rcpt_to: Vec<String>,
    /// The content, dot-unstuffed, without the end-of-data marker.
    pub content: Vec<u8>,
    /// The bytes exactly as they came after the 354, up to and including the line that
    /// ended the data (`.` and its line break): still dot-stuffed, nothing normalised.
    pub wire: Vec<u8>,
}

impl Received {
    /// A header's (unfolded) value, from the content.
    pub fn header(&self, name: &str) -> Option<String> {
        header_of(&self.content, name)
    }
}

/// A header's unfolded value in raw message bytes.
pub fn header_of(content: &[u8], name: &str) -> Option<String> {
    let text = String::from_utf8_lossy(content);
    let head = text.split("\r\n\r\n").next().unwrap_or("");
    let mut value: Option<String> = None;
    for line in head.split("\r\n") {
        if let Some(v) = value.as_mut() {
            if line.starts_with(' ') || line.starts_with('\t') {
                v.push_str(line);
                continue;
            }
            break;
        }
        if let Some((n, v)) = line.split_once(':')
            && n.eq_ignore_ascii_case(name)
        {
            value = Some(v.trim().to_owned());
        }
    }
    value
}

#[derive(Default)]
struct State {
    /// Greeting answers of the next connections; `Ok` when empty.
    greetings: VecDeque<Answer>,
    /// Plans of the next transactions; [`Plan::ok`] when empty.
    plans: VecDeque<Plan>,
    /// Advertise STARTTLS in EHLO (never actually done).
    starttls: bool,
    /// The answer to AUTH.
    auth: Option<Answer>,
    /// End the data at a `.` line whose line breaks may be a lone CR or LF, as relays
    /// open to SMTP smuggling did (2023); see [`FakeSmtp::end_data_at_any_line_break`].
    lenient_end_of_data: bool,
    /// Leave SMTPUTF8 out of EHLO (many relays do not offer it).
    no_smtputf8: bool,
    connections: usize,
    /// Sessions that have ended (the client closed, or the fake did).
    closed: usize,
    commands: Vec<String>,
    auth_plain: Vec<Vec<u8>>,
    received: Vec<Received>,
}

/// The fault-injecting SMTP fake.
#[derive(Clone)]
pub struct FakeSmtp {
    /// Where it listens.
    pub addr: std::net::SocketAddr,
    state: Arc<Mutex<State>>,
}

impl FakeSmtp {
    /// Starts the fake on 127.0.0.1:0; it stops with the test's runtime.
    pub async fn start() -> FakeSmtp {
        FakeSmtp::serve(TcpListener::bind("127.0.0.1:0").await.unwrap())
    }

    /// Starts a fake whose connections behave like a real network's rather than loopback's:
    /// an Ethernet-sized MSS (loopback's 64 KiB lets the client's send buffer grow past a
    /// megabyte) and a small receive buffer, so a client writing more than a few dozen KiB
    /// to a relay that stops reading blocks.
    pub async fn start_narrow() -> FakeSmtp {
        let sock =
            socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        sock.set_tcp_mss(1400).unwrap();
        sock.set_recv_buffer_size(8 * 1024).unwrap();
        let addr: std::net::SocketAddr = "127.0.0.1:0".parse().unwrap();
        sock.bind(&addr.into()).unwrap();
        sock.listen(64).unwrap();
        sock.set_nonblocking(true).unwrap();
        FakeSmtp::serve(TcpListener::from_std(sock.into()).unwrap())
    }

    fn serve(listener: TcpListener) -> FakeSmtp {
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(Mutex::new(State::default()));
        let st = state.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let st = st.clone();
                tokio::spawn(async move {
                    let _ = session(stream, st.clone()).await;
                    st.lock().unwrap().closed += 1;
                });
            }
        });
        FakeSmtp { addr, state }
    }

    /// `smtp://127.0.0.1:PORT?tls=none`.
    pub fn url(&self) -> String {
        format!("smtp://{}?tls=none", self.addr)
    }

    /// Queues plans for the next transactions, in order.
    pub fn plan(&self, plans: impl IntoIterator<Item = Plan>) {
        self.state.lock().unwrap().plans.extend(plans);
    }

    /// Queues greeting answers for the next connections, in order.
    pub fn greet(&self, answers: impl IntoIterator<Item = Answer>) {
        self.state.lock().unwrap().greetings.extend(answers);
    }

    /// Advertise STARTTLS in EHLO.
    pub fn offer_starttls(&self) {
        self.state.lock().unwrap().starttls = true;
    }

    /// Do not advertise SMTPUTF8.
    pub fn without_smtputf8(&self) {
        self.state.lock().unwrap().no_smtputf8 = true;
    }

    /// Advertise AUTH PLAIN and answer it with `a`.
    pub fn require_auth(&self, a: Answer) {
        self.state.lock().unwrap().auth = Some(a);
    }

    /// Take `<LF>.<LF>`, `<LF>.<CR><LF>`, `<CR>.<CR><LF>` and `<CR>.<LF>` for the end of
    /// data too, not only `<CR><LF>.<CR><LF>`: a relay open to SMTP smuggling. Whatever
    /// follows such a marker is read as commands, so a message that carries one shows up
    /// here as a second MAIL FROM and a second received message.
    pub fn end_data_at_any_line_break(&self) {
        self.state.lock().unwrap().lenient_end_of_data = true;
    }

    /// Sessions that have ended: once this equals [`FakeSmtp::connections`] after the
    /// client closed its connections, everything the client sent has been read.
    pub fn closed(&self) -> usize {
        self.state.lock().unwrap().closed
    }

    /// Connections accepted so far.
    pub fn connections(&self) -> usize {
        self.state.lock().unwrap().connections
    }

    /// Every command line received (the verb and its argument).
    pub fn commands(&self) -> Vec<String> {
        self.state.lock().unwrap().commands.clone()
    }

    /// The decoded AUTH PLAIN payloads.
    pub fn auth_plain(&self) -> Vec<Vec<u8>> {
        self.state.lock().unwrap().auth_plain.clone()
    }

    /// Every transaction that reached the end of DATA.
    pub fn received(&self) -> Vec<Received> {
        self.state.lock().unwrap().received.clone()
    }
}

/// Sends an answer; false when the session must end (dropped, or silent forever).
async fn answer(w: &mut tokio::net::tcp::OwnedWriteHalf, a: &Answer, ok: &str) -> bool {
    match a {
        Answer::Ok => w.write_all(format!("{ok}\r\n").as_bytes()).await.is_ok(),
        Answer::Reply(line) => w.write_all(format!("{line}\r\n").as_bytes()).await.is_ok(),
        Answer::Drop => false,
        Answer::Silence => {
            std::future::pending::<()>().await;
            false
        }
        Answer::Late(d) => {
            tokio::time::sleep(*d).await;
            w.write_all(format!("{ok}\r\n").as_bytes()).await.is_ok()
        }
    }
}

/// Whether an answer accepts (the transaction goes on).
fn accepts(a: &Answer) -> bool {
    match a {
        Answer::Ok | Answer::Late(_) => true,
        Answer::Reply(line) => line.starts_with('2') || line.starts_with('3'),
        _ => false,
    }
}

async fn session(stream: TcpStream, st: Arc<Mutex<State>>) -> std::io::Result<()> {
    let greeting = {
        let mut s = st.lock().unwrap();
        s.connections += 1;
        s.greetings.pop_front().unwrap_or(Answer::Ok)
    };
    let (r, mut w) = stream.into_split();
    let mut r = BufReader::new(r);
    if !answer(&mut w, &greeting, "220 fake.test ESMTP").await {
        return Ok(());
    }
    let mut plan: Option<Plan> = None;
    let mut mail_from = String::new();
    let mut rcpt_to = Vec::new();
    let mut line = String::new();
    loop {
        line.clear();
        if r.read_line(&mut line).await? == 0 {
            return Ok(());
        }
        let cmd = line.trim_end().to_owned();
        st.lock().unwrap().commands.push(cmd.clone());
        let verb = cmd
            .split_whitespace()
            .next()
            .unwrap_or("")
            .to_ascii_uppercase();
        match verb.as_str() {
            "EHLO" | "HELO" => {
                let (starttls, auth, no_smtputf8) = {
                    let s = st.lock().unwrap();
                    (s.starttls, s.auth.is_some(), s.no_smtputf8)
                };
                let mut lines = vec!["250-fake.test", "250-8BITMIME"];
                if !no_smtputf8 {
                    lines.push("250-SMTPUTF8");
                }
                if starttls {
                    lines.push("250-STARTTLS");
                }
                if auth {
                    lines.push("250-AUTH PLAIN");
                }
                lines.push("250 SIZE 52428800");
                w.write_all(format!("{}\r\n", lines.join("\r\n")).as_bytes())
                    .await?;
            }
            "AUTH" => {
                let payload = cmd.split_whitespace().nth(2).unwrap_or("");
                use base64::Engine as _;
                let decoded = base64::engine::general_purpose::STANDARD
                    .decode(payload)
                    .unwrap_or_default();
                let a = {
                    let mut s = st.lock().unwrap();
                    s.auth_plain.push(decoded);
                    s.auth.clone().unwrap_or(Answer::Ok)
                };
                if !answer(&mut w, &a, "235 2.7.0 Authentication successful").await {
                    return Ok(());
                }
            }
            "MAIL" => {
                let p = st.lock().unwrap().plans.pop_front().unwrap_or_default();
                mail_from = address_in(&cmd);
                rcpt_to.clear();
                let a = p.mail.clone();
                plan = Some(p);
                if !answer(&mut w, &a, "250 2.1.0 Ok").await {
                    return Ok(());
                }
                if !accepts(&a) {
                    plan = None;
                }
            }
            "RCPT" => {
                let addr = address_in(&cmd);
                let a = plan
                    .as_ref()
                    .and_then(|p| p.rcpt.get(&addr.to_lowercase()).cloned())
                    .unwrap_or(Answer::Ok);
                if plan.is_none() {
                    w.write_all(b"503 5.5.1 need MAIL first\r\n").await?;
                    continue;
                }
                if !answer(&mut w, &a, "250 2.1.5 Ok").await {
                    return Ok(());
                }
                if accepts(&a) {
                    rcpt_to.push(addr);
                }
            }
            "DATA" => {
                let Some(p) = plan.take() else {
                    w.write_all(b"503 5.5.1 need MAIL first\r\n").await?;
                    continue;
                };
                if rcpt_to.is_empty() {
                    w.write_all(b"554 5.5.1 no valid recipients\r\n").await?;
                    continue;
                }
                if !answer(&mut w, &p.data, "354 End data with <CR><LF>.<CR><LF>").await {
                    return Ok(());
                }
                if !accepts(&p.data) {
                    continue;
                }
                if p.stall_content {
                    std::future::pending::<()>().await;
                }
                if let Some(n) = p.drop_after_content_bytes {
                    let mut buf = vec![0u8; n];
                    let _ = r.read_exact(&mut buf).await;
                    return Ok(());
                }
                let lenient = st.lock().unwrap().lenient_end_of_data;
                let mut wire = Vec::new();
                let marker = loop {
                    let Ok(b) = r.read_u8().await else {
                        return Ok(());
                    };
                    wire.push(b);
                    if let Some(n) = end_of_data(&wire, lenient) {
                        break n;
                    }
                };
                let content = unstuff(&wire[..wire.len() - marker]);
                st.lock().unwrap().received.push(Received {
                    mail_from: mail_from.clone(),
                    rcpt_to: rcpt_to.clone(),
                    content,
                    wire,
                });
                if !answer(&mut w, &p.end_of_data, "250 2.0.0 Ok: queued as FAKE1234").await {
                    return Ok(());
                }
                if p.close_after {
                    return Ok(());
                }
            }
            "RSET" => {
                plan = None;
                rcpt_to.clear();
                w.write_all(b"250 2.0.0 Ok\r\n").await?;
            }
            "NOOP" => w.write_all(b"250 2.0.0 Ok\r\n").await?,
            "QUIT" => {
                w.write_all(b"221 2.0.0 Bye\r\n").await?;
                return Ok(());
            }
            "STARTTLS" => w.write_all(b"454 4.7.0 TLS not available\r\n").await?,
            _ => w.write_all(b"502 5.5.2 unknown command\r\n").await?,
        }
    }
}

/// Whether `wire` (the data so far) ends with an end-of-data marker; if so, the marker's
/// length, the line break before the `.` included. Strict: `.<CR><LF>` as the first line
/// or after a CRLF. Lenient: a `.` line whose line breaks may each be CR, LF or CRLF.
fn end_of_data(wire: &[u8], lenient: bool) -> Option<usize> {
    if !lenient {
        if wire == b".\r\n" {
            return Some(3);
        }
        return wire.ends_with(b"\r\n.\r\n").then_some(5);
    }
    let after = if wire.ends_with(b".\r\n") {
        3
    } else if wire.ends_with(b".\n") {
        2
    } else {
        return None;
    };
    let before = &wire[..wire.len() - after];
    if before.is_empty() {
        Some(after)
    } else if before.ends_with(b"\r\n") {
        Some(after + 2)
    } else if before.ends_with(b"\r") || before.ends_with(b"\n") {
        Some(after + 1)
    } else {
        None
    }
}

/// The content without its transparency dots: a line that starts with `..` loses one.
fn unstuff(data: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(data.len());
    for line in data.split_inclusive(|&b| b == b'\n') {
        out.extend_from_slice(
            line.strip_prefix(b".")
                .filter(|l| l.starts_with(b"."))
                .unwrap_or(line),
        );
    }
    out
}

/// The address between angle brackets of `MAIL FROM:<a>` or `RCPT TO:<a>`.
fn address_in(cmd: &str) -> String {
    let start = cmd.find('<').map(|i| i + 1).unwrap_or(cmd.len());
    let end = cmd[start..]
        .find('>')
        .map(|i| start + i)
        .unwrap_or(cmd.len());
    cmd[start..end].to_owned()
}

/// The real SMTP server: aiosmtpd running `tests/smtp_sink.py`, killed when dropped.
pub struct Sink {
    /// Its port on 127.0.0.1.
    pub port: u16,
    dir: PathBuf,
    _child: tokio::process::Child,
}

/// A message the sink stored.
#[derive(Debug, Clone, serde::Deserialize)]
pub struct Stored {
    /// The envelope sender.
    pub mail_from: String,
    /// The envelope recipients.
    pub rcpt_tos: Vec<String>,
    /// The raw content, base64.
    pub raw: String,
    /// What Python's e-mail package makes of it.
    pub parsed: Parsed,
}

/// A message as Python's e-mail package parses it.
#[derive(Debug, Clone, serde::Deserialize)]
pub struct Parsed {
    /// The top-level content type.
    pub content_type: String,
    /// Headers in order, values decoded (RFC 2047).
    pub headers: Vec<(String, String)>,
    /// The leaf parts, decoded.
    pub parts: Vec<Part>,
    /// Headers in order as the policy's header classes read them: unfolded and decoded.
    pub decoded: Vec<(String, String)>,
    /// `from`, `to`, `cc`, `reply-to`: the mailboxes, (display name, address) each.
    pub addresses: HashMap<String, Vec<(String, String)>>,
}

/// One leaf MIME part.
#[derive(Debug, Clone, serde::Deserialize)]
pub struct Part {
    /// e.g. `text/plain`.
    pub content_type: String,
    /// e.g. `utf-8`.
    pub charset: Option<String>,
    /// The decoded content.
    pub content: String,
}

impl Stored {
    /// The raw bytes as received.
    pub fn raw_bytes(&self) -> Vec<u8> {
        use base64::Engine as _;
        base64::engine::general_purpose::STANDARD
            .decode(&self.raw)
            .unwrap()
    }

    /// Every decoded value of a header (case-insensitive name).
    pub fn headers(&self, name: &str) -> Vec<String> {
        self.parsed
            .headers
            .iter()
            .filter(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.clone())
            .collect()
    }

    /// The one decoded value of a header.
    pub fn header(&self, name: &str) -> Option<String> {
        let all = self.headers(name);
        assert!(all.len() <= 1, "{name} appears {} times", all.len());
        all.into_iter().next()
    }
}

impl Sink {
    /// Starts aiosmtpd with the sink handler and `args` (see `tests/smtp_sink.py`); waits
    /// until it accepts connections. Panics with how to install aiosmtpd if it is missing:
    /// CI must have it, so a missing server fails rather than skips.
    pub async fn start(args: &[&str]) -> Sink {
        let dir = std::env::temp_dir().join(format!(
            "outboxd-sink-{}-{}",
            std::process::id(),
            rand::random::<u64>()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/smtp_sink.py");
        let python = std::env::var("OUTBOXD_TEST_PYTHON").unwrap_or_else(|_| "python3".into());
        let mut child = tokio::process::Command::new(&python)
            .arg(script)
            .arg(&dir)
            .args(args)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run {python}: {e}"));
        let stdout = child.stdout.take().unwrap();
        let mut lines = BufReader::new(stdout).lines();
        let ready = tokio::time::timeout(Duration::from_secs(20), lines.next_line()).await;
        let port = match ready {
            Ok(Ok(Some(line))) if line.starts_with("READY ") => line[6..].trim().parse().unwrap(),
            other => {
                let _ = child.start_kill();
                let mut err = String::new();
                if let Some(mut e) = child.stderr.take() {
                    let _ =
                        tokio::time::timeout(Duration::from_secs(5), e.read_to_string(&mut err))
                            .await;
                }
                panic!(
                    "the aiosmtpd sink did not start ({other:?}); install it with \
                     `python3 -m pip install aiosmtpd==1.4.6` (.ci/run does). stderr: {err}"
                );
            }
        };
        Sink {
            port,
            dir,
            _child: child,
        }
    }

    /// `smtp://127.0.0.1:PORT?tls=none`.
    pub fn url(&self) -> String {
        format!("smtp://127.0.0.1:{}?tls=none", self.port)
    }

    /// The messages stored so far, in order. A message the sink has answered but not yet
    /// parsed (`<n>.pending`, see `tests/smtp_sink.py`) is waited for, at most a minute.
    pub fn messages(&self) -> Vec<Stored> {
        let listed = |ext: &str| -> Vec<PathBuf> {
            std::fs::read_dir(&self.dir)
                .unwrap()
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == ext))
                .collect()
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while !listed("pending").is_empty() {
            assert!(
                std::time::Instant::now() < deadline,
                "the sink did not finish parsing a message within a minute"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        let mut names = listed("json");
        names.sort();
        names
            .iter()
            .map(|p| {
                let v: serde_json::Value = serde_json::from_slice(&std::fs::read(p).unwrap())
                    .unwrap_or_else(|e| panic!("{}: {e}", p.display()));
                if let Some(error) = v.get("error") {
                    panic!("{}: {error}", p.display());
                }
                serde_json::from_value(v).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
            })
            .collect()
    }

    /// Waits until at least `n` messages were stored.
    pub async fn wait_for(&self, n: usize, timeout: Duration) -> Vec<Stored> {
        super::wait_until(timeout, &format!("{n} messages at the sink"), || async {
            self.messages().len() >= n
        })
        .await;
        self.messages()
    }
}

impl Drop for Sink {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
