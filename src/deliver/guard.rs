//! The destination check: webhooks must not reach the worker's own network.
//!
//! A webhook URL is written by an application, sometimes on behalf of its users; without a
//! check, `http://169.254.169.254/` or `http://localhost:5432/` would let anyone who can
//! enqueue a message probe the worker's network (SSRF). The check runs on the address the
//! connection is actually made to: literal IPs in the URL are checked before the request,
//! and host names are checked inside the DNS resolver the HTTP client uses, so a name that
//! resolves to a public address once and a private one later (DNS rebinding) cannot pass.
//! The URL parser (WHATWG rules) normalises `127.1`, `2130706433` and `0x7f.1` to
//! `127.0.0.1` before we see them.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;

use crate::config::DestinationPolicy;

/// Raised by the resolver when every address of a host is forbidden; the webhook channel
/// finds it in the error chain and classes the attempt `invalid`.
#[derive(Debug, thiserror::Error)]
#[error("destination not allowed: {host} resolves only to private or reserved addresses")]
pub struct BlockedDestination {
    /// The host name (never a path).
    pub host: String,
}

/// Is this address one a webhook may never reach by default?
///
/// Loopback, private (RFC 1918), link-local, CGNAT (100.64/10), unique-local (fc00::/7),
/// multicast, unspecified, broadcast and other reserved ranges; IPv6 forms that embed an
/// IPv4 address (mapped, compatible, NAT64) are judged by the embedded address.
pub fn is_forbidden(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => forbidden_v4(v4),
        IpAddr::V6(v6) => forbidden_v6(v6),
    }
}

fn forbidden_v4(ip: Ipv4Addr) -> bool {
    let [a, b, ..] = ip.octets();
    ip.is_unspecified()
        || ip.is_loopback()
        || ip.is_private()
        || ip.is_link_local()
        || ip.is_multicast()
        || ip.is_broadcast()
        || a == 0 // "this network"
        || (a == 100 && (64..128).contains(&b)) // CGNAT, RFC 6598
        || (a == 192 && b == 0 && ip.octets()[2] == 0) // IETF protocol assignments
        || (a == 198 && (b == 18 || b == 19)) // benchmarking, RFC 2544
        || a >= 240 // reserved, RFC 1112
}

fn v4_of(hi: u16, lo: u16) -> Ipv4Addr {
    let [a, b] = hi.to_be_bytes();
    let [c, d] = lo.to_be_bytes();
    Ipv4Addr::new(a, b, c, d)
}

fn forbidden_v6(ip: Ipv6Addr) -> bool {
    if let Some(v4) = ip.to_ipv4_mapped() {
        return forbidden_v4(v4);
    }
    let seg = ip.segments();
    // IPv4-compatible (::a.b.c.d, deprecated) and NAT64 (64:ff9b::/96) embed an IPv4 address.
    if seg[..6] == [0, 0, 0, 0, 0, 0] && !(seg[6] == 0 && seg[7] <= 1) {
        return forbidden_v4(Ipv4Addr::new(
            (seg[6] >> 8) as u8,
            seg[6] as u8,
            (seg[7] >> 8) as u8,
            seg[7] as u8,
        ));
    }
    if seg[..6] == [0x64, 0xff9b, 0, 0, 0, 0] {
        return forbidden_v4(Ipv4Addr::new(
            (seg[6] >> 8) as u8,
            seg[6] as u8,
            (seg[7] >> 8) as u8,
            seg[7] as u8,
        ));
    }
    // SIIT (::ffff:0:a.b.c.d) embeds an IPv4 address; so does 6to4 (2002:AABB:CCDD::/48).
    if seg[..6] == [0, 0, 0, 0, 0xffff, 0] {
        return forbidden_v4(v4_of(seg[6], seg[7]));
    }
    if seg[0] == 0x2002 {
        return forbidden_v4(v4_of(seg[1], seg[2]));
    }
    // Local-use NAT64 (64:ff9b:1::/48, RFC 8215) translates to whatever the site chose:
    // refuse the whole prefix.
    if seg[..3] == [0x64, 0xff9b, 1] {
        return true;
    }
    ip.is_unspecified()
        || ip.is_loopback()
        || ip.is_multicast()
        || (seg[0] & 0xfe00) == 0xfc00 // unique local fc00::/7
        || (seg[0] & 0xffc0) == 0xfe80 // link-local fe80::/10
        || (seg[0] & 0xffc0) == 0xfec0 // site-local fec0::/10 (deprecated)
}

/// The policy applied to one request.
#[derive(Debug, Clone, Default)]
pub struct Guard {
    policy: Arc<DestinationPolicy>,
}

impl Guard {
    /// A guard for the given policy.
    pub fn new(policy: DestinationPolicy) -> Self {
        Guard {
            policy: Arc::new(policy),
        }
    }

    /// May a request to this URL host (as the URL has it, IPv6 without brackets) go out
    /// whatever it resolves to?
    pub fn host_exempt(&self, host: &str) -> bool {
        self.policy.allow_private_networks
            || self.policy.allow_hosts.contains(
                &host
                    .trim_start_matches('[')
                    .trim_end_matches(']')
                    .to_ascii_lowercase(),
            )
    }

    /// May a request go to this address?
    pub fn ip_allowed(&self, ip: IpAddr) -> bool {
        self.policy.allow_private_networks || !is_forbidden(ip)
    }

    /// Keeps the resolved addresses a connection may use; `Err` when none is left.
    pub fn filter(
        &self,
        host: &str,
        addrs: impl Iterator<Item = SocketAddr>,
    ) -> Result<Vec<SocketAddr>, BlockedDestination> {
        let exempt = self.host_exempt(host);
        let kept: Vec<SocketAddr> = addrs
            .filter(|a| exempt || self.ip_allowed(a.ip()))
            .collect();
        if kept.is_empty() {
            Err(BlockedDestination {
                host: host.to_owned(),
            })
        } else {
            Ok(kept)
        }
    }
}

/// A name lookup: the system resolver, or a stand-in (tests use one that changes its answer
/// between calls, as a rebinding DNS server would).
type Lookup = Arc<dyn Fn(&str) -> std::io::Result<Vec<SocketAddr>> + Send + Sync>;

/// The HTTP client's DNS resolver: a lookup, then [`Guard::filter`]. The HTTP client
/// connects only to the addresses this returns, so the check is on the address actually
/// connected to, at the moment of connecting: a second, different answer to a later lookup
/// (DNS rebinding) is checked again.
#[derive(Clone)]
pub struct GuardedResolver {
    guard: Guard,
    lookup: Option<Lookup>,
}

impl std::fmt::Debug for GuardedResolver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GuardedResolver")
            .field("guard", &self.guard)
            .finish_non_exhaustive()
    }
}

impl GuardedResolver {
    /// A resolver that applies `guard` to every answer of the system resolver.
    pub fn new(guard: Guard) -> Self {
        GuardedResolver {
            guard,
            lookup: None,
        }
    }

    /// A resolver that applies `guard` to the answers of `lookup` instead.
    pub fn with_lookup(
        guard: Guard,
        lookup: impl Fn(&str) -> std::io::Result<Vec<SocketAddr>> + Send + Sync + 'static,
    ) -> Self {
        GuardedResolver {
            guard,
            lookup: Some(Arc::new(lookup)),
        }
    }
}

impl reqwest::dns::Resolve for GuardedResolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let guard = self.guard.clone();
        let lookup = self.lookup.clone();
        Box::pin(async move {
            let host = name.as_str().to_owned();
            let addrs: Vec<SocketAddr> = match lookup {
                Some(f) => f(&host)?,
                None => tokio::net::lookup_host((host.as_str(), 0)).await?.collect(),
            };
            let kept = guard.filter(&host, addrs.into_iter())?;
            Ok(Box::new(kept.into_iter()) as reqwest::dns::Addrs)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("test address")
    }

    #[test]
    fn forbidden_ranges() {
        for s in [
            "127.0.0.1",
            "127.1.2.3",
            "10.0.0.1",
            "172.16.0.1",
            "172.31.255.255",
            "192.168.1.1",
            "169.254.169.254",
            "100.64.0.1",
            "100.127.255.255",
            "0.0.0.0",
            "0.1.2.3",
            "224.0.0.1",
            "255.255.255.255",
            "240.0.0.1",
            "198.18.0.1",
            "192.0.0.8",
            "::1",
            "::",
            "fc00::1",
            "fd12:3456::1",
            "fe80::1",
            "ff02::1",
            "::ffff:127.0.0.1",
            "::ffff:10.1.2.3",
            "::127.0.0.1",
            "64:ff9b::a9fe:a9fe",
            "fec0::1",
        ] {
            assert!(is_forbidden(ip(s)), "{s} should be forbidden");
        }
        for s in [
            "93.184.216.34",
            "8.8.8.8",
            "1.1.1.1",
            "172.32.0.1",
            "100.128.0.1",
            "192.0.2.1",
            "2606:4700::1111",
            "::ffff:8.8.8.8",
            "64:ff9b::808:808",
        ] {
            assert!(!is_forbidden(ip(s)), "{s} should be allowed");
        }
    }

    #[test]
    fn url_parser_normalises_ipv4_spellings() {
        for spelled in [
            "http://127.1/",
            "http://2130706433/",
            "http://0x7f.0.0.1/",
            "http://0177.0.0.1/",
        ] {
            let url = url::Url::parse(spelled).expect("parses");
            assert_eq!(
                url.host(),
                Some(url::Host::Ipv4(Ipv4Addr::LOCALHOST)),
                "{spelled}"
            );
        }
        let url = url::Url::parse("http://[::ffff:127.0.0.1]/").expect("parses");
        match url.host() {
            Some(url::Host::Ipv6(v6)) => assert!(is_forbidden(IpAddr::V6(v6))),
            other => panic!("unexpected host {other:?}"),
        }
    }

    /// A DNS server that answers a public address first and a private one after (rebinding):
    /// the second answer is refused when it is looked up, which is when the client would
    /// connect to it.
    #[tokio::test]
    async fn a_rebinding_answer_is_refused_when_it_comes() {
        use reqwest::dns::Resolve as _;
        use std::sync::atomic::{AtomicUsize, Ordering};
        let calls = Arc::new(AtomicUsize::new(0));
        let c = calls.clone();
        let resolver =
            GuardedResolver::with_lookup(Guard::new(DestinationPolicy::default()), move |_| {
                let ip = if c.fetch_add(1, Ordering::SeqCst) == 0 {
                    [93, 184, 216, 34]
                } else {
                    [127, 0, 0, 1]
                };
                Ok(vec![SocketAddr::from((ip, 0))])
            });
        let name = |s: &str| s.parse::<reqwest::dns::Name>().expect("name");
        let first: Vec<SocketAddr> = resolver
            .resolve(name("rebind.example"))
            .await
            .expect("public answer")
            .collect();
        assert_eq!(first, vec![SocketAddr::from(([93, 184, 216, 34], 0))]);
        let second = resolver
            .resolve(name("rebind.example"))
            .await
            .err()
            .expect("private answer refused");
        assert!(second.to_string().contains("not allowed"), "{second}");
        // A mixed answer keeps only the allowed addresses: the client cannot pick the private one.
        let mixed = GuardedResolver::with_lookup(Guard::new(DestinationPolicy::default()), |_| {
            Ok(vec![
                SocketAddr::from(([127, 0, 0, 1], 0)),
                SocketAddr::from(([93, 184, 216, 34], 0)),
            ])
        });
        let kept: Vec<SocketAddr> = mixed
            .resolve(name("mixed.example"))
            .await
            .expect("one allowed")
            .collect();
        assert_eq!(kept, vec![SocketAddr::from(([93, 184, 216, 34], 0))]);
    }

    #[test]
    fn policy_exemptions() {
        let guard = Guard::new(
            DestinationPolicy::from_values(None, Some("hooks.internal,::1")).expect("valid"),
        );
        assert!(guard.host_exempt("HOOKS.internal"));
        assert!(guard.host_exempt("[::1]"));
        assert!(!guard.host_exempt("other.internal"));
        let addrs = [
            SocketAddr::from(([10, 0, 0, 1], 0)),
            SocketAddr::from(([8, 8, 8, 8], 0)),
        ];
        assert_eq!(
            guard.filter("x", addrs.into_iter()).expect("one left"),
            vec![addrs[1]]
        );
        assert!(guard.filter("x", addrs[..1].iter().copied()).is_err());
        assert_eq!(
            guard
                .filter("hooks.internal", addrs.into_iter())
                .expect("exempt")
                .len(),
            2
        );
        let open = Guard::new(DestinationPolicy {
            allow_private_networks: true,
            ..Default::default()
        });
        assert!(open.ip_allowed(ip("127.0.0.1")));
    }
}
