//! The console under test: the real binary (`outboxd console`) on a free loopback port,
//! a plain HTTP client that signs in as a browser would, and headless Chromium driven by
//! Debian's chromedriver through fantoccini.

#![allow(dead_code, clippy::unwrap_used)]

use std::io::BufRead as _;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::TestDb;
use super::binary::outboxd;

/// A token long enough for the console's rule.
pub const TOKEN: &str = "test-console-token-0123456789";

/// A running `outboxd console`; killed when dropped.
pub struct Console {
    child: Child,
    stderr: std::sync::Arc<std::sync::Mutex<String>>,
    /// `http://127.0.0.1:PORT` (no trailing slash).
    pub base: String,
}

impl Console {
    /// Starts the console on `db` with the sign-in token [`TOKEN`].
    pub fn start(db: &TestDb) -> Console {
        Console::start_with(db, Some(TOKEN))
    }

    /// Starts the console on `db`, with this token or none, on `127.0.0.1:0`; waits (10 s at
    /// most) for the line that gives its address.
    pub fn start_with(db: &TestDb, token: Option<&str>) -> Console {
        Console::start_with_env(db, token, &[])
    }

    /// [`Console::start_with`], with these variables in the console's environment too.
    pub fn start_with_env(db: &TestDb, token: Option<&str>, env: &[(&str, &str)]) -> Console {
        let mut cmd = outboxd(Some(&db.url()));
        cmd.args(["console", "--addr", "127.0.0.1:0"]);
        cmd.envs(env.iter().copied());
        if let Some(t) = token {
            cmd.env("OUTBOXD_CONSOLE_TOKEN", t);
        }
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn outboxd console");
        let stderr = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let pipe = child.stderr.take().unwrap();
        let sink = stderr.clone();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(pipe).lines().map_while(Result::ok) {
                let mut s = sink.lock().unwrap();
                s.push_str(&line);
                s.push('\n');
            }
        });
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut lines = std::io::BufReader::new(stdout).lines();
            if let Some(Ok(line)) = lines.next() {
                let _ = tx.send(line);
            }
            // Keep reading so the child never blocks on a full pipe.
            for _ in lines {}
        });
        let line = rx
            .recv_timeout(Duration::from_secs(10))
            .expect("the console prints its address within 10 s");
        let base = line
            .strip_prefix("outboxd console: ")
            .unwrap_or_else(|| panic!("unexpected first line: {line}"))
            .trim_end_matches('/')
            .to_owned();
        Console {
            child,
            stderr,
            base,
        }
    }

    /// What the console logged so far.
    pub fn log(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    /// The full URL of `path`.
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }
}

impl Drop for Console {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A plain HTTP client that follows no redirects (so tests see them).
pub fn http() -> reqwest::Client {
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap()
}

/// Form-encodes pairs.
pub fn form(pairs: &[(&str, &str)]) -> String {
    let mut s = url::form_urlencoded::Serializer::new(String::new());
    for (k, v) in pairs {
        s.append_pair(k, v);
    }
    s.finish()
}

/// POSTs a form body, with a cookie header when given.
pub async fn post_form(url: &str, cookie: Option<&str>, body: String) -> reqwest::Response {
    post_with(url, cookie, body, &[]).await
}

/// [`post_form`] with these extra headers (a browser's `Origin`, `Sec-Fetch-Site`, a
/// `Host`).
pub async fn post_with(
    url: &str,
    cookie: Option<&str>,
    body: String,
    headers: &[(&str, &str)],
) -> reqwest::Response {
    let mut req = http()
        .post(url)
        .header("content-type", "application/x-www-form-urlencoded")
        .body(body);
    if let Some(c) = cookie {
        req = req.header("cookie", c);
    }
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    req.send().await.unwrap()
}

/// GETs a page with the session cookie.
pub async fn get(url: &str, cookie: &str) -> reqwest::Response {
    http()
        .get(url)
        .header("cookie", cookie)
        .send()
        .await
        .unwrap()
}

/// A signed-in HTTP session: the `Cookie` header value and the CSRF token of its forms.
pub struct HttpSession {
    pub cookie: String,
    pub csrf: String,
}

/// Signs in as `name` with `token` over plain HTTP and reads the CSRF token from a page.
pub async fn sign_in(console: &Console, name: &str) -> HttpSession {
    let res = post_form(
        &console.url("/signin"),
        None,
        form(&[("name", name), ("token", TOKEN)]),
    )
    .await;
    assert_eq!(res.status(), 303, "sign-in redirects");
    let set = res
        .headers()
        .get("set-cookie")
        .expect("a session cookie")
        .to_str()
        .unwrap()
        .to_owned();
    let cookie = set.split(';').next().unwrap().to_owned();
    let page = get(&console.url("/"), &cookie).await.text().await.unwrap();
    HttpSession {
        csrf: csrf_of(&page),
        cookie,
    }
}

/// The CSRF token in a page's forms.
pub fn csrf_of(page: &str) -> String {
    let start = page
        .find("name=\"csrf\" value=\"")
        .expect("a form with a CSRF token")
        + "name=\"csrf\" value=\"".len();
    page[start..start + 64].to_owned()
}

/// A free loopback port (bound and released; the small race is acceptable in tests).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Headless Chromium under chromedriver on a port of its own. [`Browser::close`] ends the
/// session (chromedriver quits the browser); if a test fails before that, dropping it
/// ends the session from a thread of its own, then kills chromedriver (by its pid).
pub struct Browser {
    driver: Child,
    pub client: fantoccini::Client,
    closed: bool,
}

/// How long any one wait in the browser may take.
pub const WAIT: Duration = Duration::from_secs(15);

impl Browser {
    /// Starts chromedriver and a headless Chromium window of `width` × `height`.
    pub async fn start(width: u32, height: u32) -> Browser {
        let port = free_port();
        let driver = Command::new("/usr/bin/chromedriver")
            .arg(format!("--port={port}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("chromedriver (apt-get install chromium chromium-driver; scripts/test does)");
        let status = format!("http://127.0.0.1:{port}/status");
        let deadline = Instant::now() + WAIT;
        loop {
            if let Ok(r) = http().get(&status).send().await {
                if r.status().is_success() {
                    break;
                }
            }
            assert!(
                Instant::now() < deadline,
                "chromedriver did not start within {WAIT:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let mut caps = serde_json::Map::new();
        caps.insert(
            "goog:chromeOptions".into(),
            serde_json::json!({
                "binary": "/usr/bin/chromium",
                "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                         "--disable-dev-shm-usage", "--hide-scrollbars",
                         format!("--window-size={width},{height}")],
            }),
        );
        let connector = hyper_util::client::legacy::connect::HttpConnector::new();
        let client = fantoccini::ClientBuilder::new(connector)
            .capabilities(caps)
            .connect(&format!("http://127.0.0.1:{port}"))
            .await
            .expect("a WebDriver session");
        Browser {
            driver,
            client,
            closed: false,
        }
    }

    /// Opens `url` and waits for `css` to be on the page.
    pub async fn open(&self, url: &str, css: &str) -> fantoccini::elements::Element {
        self.client.goto(url).await.unwrap();
        self.wait_for(css).await
    }

    /// Waits (at most [`WAIT`]) for an element.
    pub async fn wait_for(&self, css: &str) -> fantoccini::elements::Element {
        self.client
            .wait()
            .at_most(WAIT)
            .for_element(fantoccini::Locator::Css(css))
            .await
            .unwrap_or_else(|e| panic!("waiting for {css}: {e}"))
    }

    /// The text of the element `css` (waited for).
    pub async fn text(&self, css: &str) -> String {
        self.wait_for(css).await.text().await.unwrap()
    }

    /// Clicks `css` and waits for `then` on the page that follows.
    pub async fn click(&self, css: &str, then: &str) -> fantoccini::elements::Element {
        self.wait_for(css).await.click().await.unwrap();
        self.wait_for(then).await
    }

    /// Signs in through the form.
    pub async fn sign_in(&self, console: &Console, name: &str, token: &str) {
        self.open(&console.url("/signin"), "#name").await;
        self.wait_for("#name").await.send_keys(name).await.unwrap();
        self.wait_for("#token")
            .await
            .send_keys(token)
            .await
            .unwrap();
        self.wait_for("#signin").await.click().await.unwrap();
    }

    /// Saves a PNG of the window when `OUTBOXD_CONSOLE_SCREENSHOTS` names a folder (the
    /// README's pictures are made so: `docs/console/`).
    pub async fn screenshot(&self, name: &str) {
        let Ok(dir) = std::env::var("OUTBOXD_CONSOLE_SCREENSHOTS") else {
            return;
        };
        let png = self.client.screenshot().await.unwrap();
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(format!("{dir}/{name}.png"), png).unwrap();
    }

    /// Ends the WebDriver session (the browser exits), then the driver.
    pub async fn close(mut self) {
        let _ = tokio::time::timeout(WAIT, self.client.clone().close()).await;
        self.closed = true;
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        if !self.closed {
            // A failed test: end the session so that chromedriver quits the browser. The
            // session's task runs on the test's (multi-threaded) runtime; a thread of its
            // own waits for it, within a deadline.
            let client = self.client.clone();
            let _ = std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                rt.block_on(async {
                    let _ = tokio::time::timeout(Duration::from_secs(5), client.close()).await;
                });
            })
            .join();
        }
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}
