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

use hyper_util::client::legacy::connect::dns::Name;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;

use super::webhook::settings::DestinationPolicy;

/// What every refusal of the guard ends with: the settings that lift it, so that an
/// operator whose first message to a local receiver is refused learns the remedy from the
/// error itself. It names no host (the error already does once, and a long host twice
/// would push the line past its 500-character cut).
pub const HOW_TO_ALLOW: &str = "to allow it, set OUTBOXD_ALLOW_PRIVATE_NETWORKS=true \
     or list the host in OUTBOXD_WEBHOOK_ALLOW_HOSTS";

/// Raised by the resolver when every address of a host is forbidden; the webhook channel
/// finds it in the error chain and classes the attempt `invalid`.
#[derive(Debug, thiserror::Error)]
#[error(
    "destination not allowed: {host} resolves only to private or reserved addresses ({})",
    HOW_TO_ALLOW
)]
pub struct BlockedDestination {
    /// The host name (never a path).
    pub host: String,
}

/// Is this address one a webhook may never reach by default?
///
/// Every address that is not globally reachable is refused: the semantics of the standard
/// library's unstable `IpAddr::is_global` (which follows the IANA IPv4 and IPv6
/// Special-Purpose Address Registries: loopback, private, shared/CGNAT, link-local,
/// documentation, benchmarking, reserved, broadcast, "this network", the IETF protocol
/// assignments 192.0.0.0/24 and 2001::/23 but for their globally reachable exceptions,
/// discard-only 100::/64, 6to4 2002::/16, unique-local, link-local), written out here,
/// plus what the guard is stricter about:
///
/// * multicast (224.0.0.0/4, ff00::/8), deprecated site-local fec0::/10, the deprecated
///   6to4 relay anycast 192.88.99.0/24, and the registry's newer not-reachable blocks
///   (documentation 3fff::/20, SRv6 SIDs 5f00::/16, the dummy prefix 100:0:0:1::/64);
/// * IPv6 forms that embed an IPv4 address the host or a translator would connect to
///   (IPv4-mapped `::ffff:a.b.c.d`, IPv4-compatible `::a.b.c.d`, SIIT `::ffff:0:a.b.c.d`,
///   NAT64 `64:ff9b::/96`) are judged by the embedded address, and the local-use NAT64
///   prefix 64:ff9b:1::/48 is refused whole. (For the mapped block this is the one place
///   the guard is less strict than `is_global`, which refuses all of it: a mapped public
///   address is as reachable as its IPv4 spelling.)
pub fn is_forbidden(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => forbidden_v4(v4),
        IpAddr::V6(v6) => forbidden_v6(v6),
    }
}

/// `Ipv4Addr::is_global` of the standard library (unstable), written out.
fn is_global_v4(ip: Ipv4Addr) -> bool {
    let o = ip.octets();
    !(o[0] == 0 // "this network", 0.0.0.0/8
        || ip.is_private() // 10/8, 172.16/12, 192.168/16
        || (o[0] == 100 && (o[1] & 0b1100_0000) == 0b0100_0000) // shared, 100.64.0.0/10
        || ip.is_loopback() // 127/8
        || ip.is_link_local() // 169.254/16
        // IETF protocol assignments 192.0.0.0/24, but for the two globally reachable
        // anycast addresses 192.0.0.9 (PCP) and 192.0.0.10 (TURN)
        || (o[0] == 192 && o[1] == 0 && o[2] == 0 && o[3] != 9 && o[3] != 10)
        || ip.is_documentation() // 192.0.2/24, 198.51.100/24, 203.0.113/24
        || (o[0] == 198 && (o[1] & 0xfe) == 18) // benchmarking, 198.18.0.0/15
        || (o[0] & 0xf0 == 0xf0 && !ip.is_broadcast()) // reserved, 240.0.0.0/4
        || ip.is_broadcast())
}

fn forbidden_v4(ip: Ipv4Addr) -> bool {
    let o = ip.octets();
    !is_global_v4(ip) || ip.is_multicast() || (o[0] == 192 && o[1] == 88 && o[2] == 99) // 6to4 relay anycast, deprecated (RFC 7526)
}

/// `Ipv6Addr::is_global` of the standard library (unstable), written out.
fn is_global_v6(ip: Ipv6Addr) -> bool {
    let seg = ip.segments();
    let bits = u128::from_be_bytes(ip.octets());
    !(ip.is_unspecified()
        || ip.is_loopback()
        || matches!(seg, [0, 0, 0, 0, 0, 0xffff, _, _]) // IPv4-mapped, ::ffff:0:0/96
        || matches!(seg, [0x64, 0xff9b, 1, _, _, _, _, _]) // local-use translation, 64:ff9b:1::/48
        || matches!(seg, [0x100, 0, 0, 0, _, _, _, _]) // discard-only, 100::/64
        // IETF protocol assignments 2001::/23, but for its globally reachable entries
        || (matches!(seg, [0x2001, b, _, _, _, _, _, _] if b < 0x200)
            && !(bits == 0x2001_0001_0000_0000_0000_0000_0000_0001 // PCP anycast 2001:1::1
                || bits == 0x2001_0001_0000_0000_0000_0000_0000_0002 // TURN anycast 2001:1::2
                || matches!(seg, [0x2001, 3, _, _, _, _, _, _]) // AMT 2001:3::/32
                || matches!(seg, [0x2001, 4, 0x112, _, _, _, _, _]) // AS112-v6 2001:4:112::/48
                // ORCHIDv2 2001:20::/28 and DETs 2001:30::/28
                || matches!(seg, [0x2001, b, _, _, _, _, _, _] if (0x20..=0x3f).contains(&b))))
        || seg[0] == 0x2002 // 6to4, 2002::/16 (not said to be globally reachable)
        || (seg[0] == 0x2001 && seg[1] == 0xdb8) // documentation, 2001:db8::/32
        || (seg[0] & 0xfe00) == 0xfc00 // unique local, fc00::/7
        || (seg[0] & 0xffc0) == 0xfe80) // link-local unicast, fe80::/10
}

fn v4_of(hi: u16, lo: u16) -> Ipv4Addr {
    let [a, b] = hi.to_be_bytes();
    let [c, d] = lo.to_be_bytes();
    Ipv4Addr::new(a, b, c, d)
}

fn forbidden_v6(ip: Ipv6Addr) -> bool {
    let seg = ip.segments();
    // IPv4-mapped (::ffff:0:0/96): a connection to it is a connection to the IPv4 address,
    // so that address decides (the standard library calls the whole block not global; a
    // mapped public address is allowed here, as its IPv4 spelling is).
    if let Some(v4) = ip.to_ipv4_mapped() {
        return forbidden_v4(v4);
    }
    if !is_global_v6(ip) {
        return true;
    }
    // Forms a host or a translator turns into an IPv4 destination are judged by that
    // destination: IPv4-compatible (::a.b.c.d, deprecated; :: and ::1 were refused above),
    // SIIT (::ffff:0:a.b.c.d) and NAT64 (64:ff9b::/96, globally reachable as a prefix).
    if seg[..6] == [0, 0, 0, 0, 0, 0]
        || seg[..6] == [0, 0, 0, 0, 0xffff, 0]
        || seg[..6] == [0x64, 0xff9b, 0, 0, 0, 0]
    {
        return forbidden_v4(v4_of(seg[6], seg[7]));
    }
    ip.is_multicast() // ff00::/8
        || (seg[0] & 0xffc0) == 0xfec0 // site-local fec0::/10 (deprecated)
        || (seg[0] == 0x3fff && seg[1] < 0x1000) // documentation, 3fff::/20 (RFC 9637)
        || seg[0] == 0x5f00 // SRv6 SIDs, 5f00::/16 (RFC 9602)
        || matches!(seg, [0x100, 0, 0, 1, _, _, _, _]) // dummy prefix, 100:0:0:1::/64
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
            || self
                .policy
                .allow_hosts
                .contains(&super::webhook::settings::without_brackets(host))
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

/// Looks `host` up (the stand-in, else the system resolver).
async fn look_up(lookup: Option<Lookup>, host: &str) -> std::io::Result<Vec<SocketAddr>> {
    match lookup {
        Some(f) => f(host),
        None => Ok(tokio::net::lookup_host((host, 0)).await?.collect()),
    }
}

impl GuardedResolver {
    /// Refuses early a host that a connection would refuse: resolves it now and applies the
    /// guard. `Some` when every address it has is refused; `None` when some may be used, or
    /// when it does not resolve now (then nothing is known, and the connection that uses it
    /// later is checked again, at that moment: this early look is a courtesy, not the
    /// boundary).
    pub async fn refuses(&self, host: &str) -> Option<BlockedDestination> {
        if self.guard.host_exempt(host) {
            return None;
        }
        let addrs = look_up(self.lookup.clone(), host).await.ok()?;
        self.guard.filter(host, addrs.into_iter()).err()
    }
}

/// The resolver of the webhook client's connector (hyper-util's `HttpConnector`): every
/// address it hands over has passed the guard, so a connection can only go where the guard
/// allows, whatever the name resolved to before.
impl tower_service::Service<Name> for GuardedResolver {
    type Response = std::vec::IntoIter<SocketAddr>;
    type Error = Box<dyn std::error::Error + Send + Sync>;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Self::Response, Self::Error>> + Send>,
    >;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, name: Name) -> Self::Future {
        let guard = self.guard.clone();
        let lookup = self.lookup.clone();
        Box::pin(async move {
            let host = name.as_str().to_owned();
            let addrs = look_up(lookup, &host).await?;
            let kept = guard.filter(&host, addrs.into_iter())?;
            Ok(kept.into_iter())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("test address")
    }

    /// Addresses of every IANA special-purpose block whose "Globally Reachable" is False (or
    /// N/A), first, last and notable addresses, with the block; and what the guard refuses
    /// beyond the registry.
    const REFUSED: &[(&str, &str)] = &[
        // IANA IPv4 Special-Purpose Address Registry, Globally Reachable False
        ("0.0.0.0", "0.0.0.0/8 this network (0.0.0.0/32 this host)"),
        ("0.1.2.3", "0.0.0.0/8 this network"),
        ("0.255.255.255", "0.0.0.0/8 this network"),
        ("10.0.0.0", "10.0.0.0/8 private"),
        ("10.255.255.255", "10.0.0.0/8 private"),
        ("100.64.0.0", "100.64.0.0/10 shared address space"),
        ("100.127.255.255", "100.64.0.0/10 shared address space"),
        ("127.0.0.1", "127.0.0.0/8 loopback"),
        ("127.255.255.255", "127.0.0.0/8 loopback"),
        ("169.254.0.0", "169.254.0.0/16 link local"),
        ("169.254.169.254", "169.254.0.0/16 link local"),
        ("169.254.255.255", "169.254.0.0/16 link local"),
        ("172.16.0.0", "172.16.0.0/12 private"),
        ("172.31.255.255", "172.16.0.0/12 private"),
        ("192.0.0.0", "192.0.0.0/24 IETF protocol assignments"),
        ("192.0.0.7", "192.0.0.0/29 IPv4 service continuity prefix"),
        ("192.0.0.8", "192.0.0.8/32 IPv4 dummy address"),
        ("192.0.0.11", "192.0.0.0/24 IETF protocol assignments"),
        ("192.0.0.170", "192.0.0.170/32 NAT64/DNS64 discovery"),
        ("192.0.0.171", "192.0.0.171/32 NAT64/DNS64 discovery"),
        ("192.0.0.255", "192.0.0.0/24 IETF protocol assignments"),
        ("192.0.2.0", "192.0.2.0/24 documentation (TEST-NET-1)"),
        ("192.0.2.1", "192.0.2.0/24 documentation (TEST-NET-1)"),
        ("192.0.2.255", "192.0.2.0/24 documentation (TEST-NET-1)"),
        ("192.168.0.0", "192.168.0.0/16 private"),
        ("192.168.255.255", "192.168.0.0/16 private"),
        ("198.18.0.0", "198.18.0.0/15 benchmarking"),
        ("198.19.255.255", "198.18.0.0/15 benchmarking"),
        ("198.51.100.0", "198.51.100.0/24 documentation (TEST-NET-2)"),
        (
            "198.51.100.255",
            "198.51.100.0/24 documentation (TEST-NET-2)",
        ),
        ("203.0.113.0", "203.0.113.0/24 documentation (TEST-NET-3)"),
        ("203.0.113.255", "203.0.113.0/24 documentation (TEST-NET-3)"),
        ("240.0.0.0", "240.0.0.0/4 reserved"),
        ("255.255.255.254", "240.0.0.0/4 reserved"),
        ("255.255.255.255", "255.255.255.255/32 limited broadcast"),
        // Deprecated 6to4 relay anycast (RFC 7526; the registry says N/A): refused whole.
        (
            "192.88.99.0",
            "192.88.99.0/24 deprecated 6to4 relay anycast",
        ),
        (
            "192.88.99.1",
            "192.88.99.0/24 deprecated 6to4 relay anycast",
        ),
        (
            "192.88.99.255",
            "192.88.99.0/24 deprecated 6to4 relay anycast",
        ),
        // The guard also refuses multicast.
        ("224.0.0.1", "224.0.0.0/4 multicast"),
        ("239.255.255.255", "224.0.0.0/4 multicast"),
        // IANA IPv6 Special-Purpose Address Registry, Globally Reachable False (or N/A)
        ("::", "::/128 unspecified"),
        ("::1", "::1/128 loopback"),
        ("::ffff:0.0.0.0", "::ffff:0:0/96 IPv4-mapped"),
        ("::ffff:127.0.0.1", "::ffff:0:0/96 IPv4-mapped"),
        ("::ffff:10.1.2.3", "::ffff:0:0/96 IPv4-mapped"),
        ("::ffff:255.255.255.255", "::ffff:0:0/96 IPv4-mapped"),
        (
            "64:ff9b:1::",
            "64:ff9b:1::/48 local-use IPv4/IPv6 translation",
        ),
        (
            "64:ff9b:1:ffff:ffff:ffff:ffff:ffff",
            "64:ff9b:1::/48 local-use translation",
        ),
        ("100::", "100::/64 discard-only"),
        ("100::ffff:ffff:ffff:ffff", "100::/64 discard-only"),
        ("100:0:0:1::1", "100:0:0:1::/64 dummy prefix"),
        (
            "2001::",
            "2001::/23 IETF protocol assignments (2001::/32 TEREDO: N/A)",
        ),
        ("2001::1", "2001::/32 TEREDO"),
        ("2001:0:ffff:ffff:ffff:ffff:ffff:ffff", "2001::/32 TEREDO"),
        ("2001:1::", "2001::/23 IETF protocol assignments"),
        ("2001:1::3", "2001::/23 IETF protocol assignments"),
        ("2001:2::", "2001:2::/48 benchmarking"),
        (
            "2001:2:0:ffff:ffff:ffff:ffff:ffff",
            "2001:2::/48 benchmarking",
        ),
        ("2001:2:1::1", "2001::/23 IETF protocol assignments"),
        ("2001:4::1", "2001::/23 IETF protocol assignments"),
        ("2001:4:113::1", "2001::/23 IETF protocol assignments"),
        ("2001:10::1", "2001:10::/28 deprecated ORCHID (N/A)"),
        ("2001:1f:ffff::1", "2001:10::/28 deprecated ORCHID (N/A)"),
        ("2001:40::1", "2001::/23 IETF protocol assignments"),
        (
            "2001:1ff:ffff:ffff:ffff:ffff:ffff:ffff",
            "2001::/23 IETF protocol assignments",
        ),
        ("2001:db8::", "2001:db8::/32 documentation"),
        ("2001:db8::1", "2001:db8::/32 documentation"),
        (
            "2001:db8:ffff:ffff:ffff:ffff:ffff:ffff",
            "2001:db8::/32 documentation",
        ),
        ("2002::", "2002::/16 6to4 (N/A)"),
        (
            "2002:808:808::1",
            "2002::/16 6to4 (N/A), even of a public IPv4",
        ),
        ("2002:7f00:1::1", "2002::/16 6to4 of 127.0.0.1"),
        (
            "2002:ffff:ffff:ffff:ffff:ffff:ffff:ffff",
            "2002::/16 6to4 (N/A)",
        ),
        ("3fff::", "3fff::/20 documentation"),
        (
            "3fff:fff:ffff:ffff:ffff:ffff:ffff:ffff",
            "3fff::/20 documentation",
        ),
        ("5f00::1", "5f00::/16 segment routing (SRv6) SIDs"),
        (
            "5f00:ffff:ffff:ffff:ffff:ffff:ffff:ffff",
            "5f00::/16 SRv6 SIDs",
        ),
        ("fc00::", "fc00::/7 unique local"),
        ("fd12:3456::1", "fc00::/7 unique local"),
        (
            "fdff:ffff:ffff:ffff:ffff:ffff:ffff:ffff",
            "fc00::/7 unique local",
        ),
        ("fe80::", "fe80::/10 link-local unicast"),
        ("fe80::1", "fe80::/10 link-local unicast"),
        (
            "febf:ffff:ffff:ffff:ffff:ffff:ffff:ffff",
            "fe80::/10 link-local unicast",
        ),
        // The guard also refuses multicast, site-local, and an embedded IPv4 the host or a
        // translator would turn it into, when that IPv4 is refused.
        ("ff02::1", "ff00::/8 multicast"),
        ("ff0e::1", "ff00::/8 multicast (global scope too)"),
        ("fec0::1", "fec0::/10 site-local (deprecated)"),
        ("::127.0.0.1", "IPv4-compatible of 127.0.0.1"),
        ("::10.1.2.3", "IPv4-compatible of 10.1.2.3"),
        ("::192.0.2.1", "IPv4-compatible of a documentation address"),
        ("::ffff:0:127.0.0.1", "SIIT of 127.0.0.1"),
        ("64:ff9b::a9fe:a9fe", "NAT64 of 169.254.169.254"),
        ("64:ff9b::7f00:1", "NAT64 of 127.0.0.1"),
        ("64:ff9b::c000:201", "NAT64 of 192.0.2.1 (documentation)"),
        ("64:ff9b::c058:6301", "NAT64 of 192.88.99.1"),
    ];

    /// Globally reachable: the registry's exceptions (Globally Reachable True), the first
    /// addresses past the edges of refused blocks, and ordinary public addresses.
    const ALLOWED: &[(&str, &str)] = &[
        ("192.0.0.9", "192.0.0.9/32 port control protocol anycast"),
        (
            "192.0.0.10",
            "192.0.0.10/32 traversal using relays around NAT anycast",
        ),
        ("192.31.196.1", "192.31.196.0/24 AS112-v4"),
        ("192.52.193.1", "192.52.193.0/24 AMT"),
        (
            "192.175.48.1",
            "192.175.48.0/24 direct delegation AS112 service",
        ),
        ("1.0.0.0", "past 0.0.0.0/8"),
        ("9.255.255.255", "before 10.0.0.0/8"),
        ("11.0.0.0", "past 10.0.0.0/8"),
        ("100.63.255.255", "before 100.64.0.0/10"),
        ("100.128.0.0", "past 100.64.0.0/10"),
        ("126.255.255.255", "before 127.0.0.0/8"),
        ("128.0.0.0", "past 127.0.0.0/8"),
        ("169.253.255.255", "before 169.254.0.0/16"),
        ("169.255.0.0", "past 169.254.0.0/16"),
        ("172.15.255.255", "before 172.16.0.0/12"),
        ("172.32.0.0", "past 172.16.0.0/12"),
        ("191.255.255.255", "before 192.0.0.0/24"),
        ("192.0.1.0", "past 192.0.0.0/24"),
        ("192.0.1.255", "before 192.0.2.0/24"),
        ("192.0.3.0", "past 192.0.2.0/24"),
        ("192.88.98.255", "before 192.88.99.0/24"),
        ("192.88.100.0", "past 192.88.99.0/24"),
        ("192.167.255.255", "before 192.168.0.0/16"),
        ("192.169.0.0", "past 192.168.0.0/16"),
        ("198.17.255.255", "before 198.18.0.0/15"),
        ("198.20.0.0", "past 198.18.0.0/15"),
        ("198.51.99.255", "before 198.51.100.0/24"),
        ("198.51.101.0", "past 198.51.100.0/24"),
        ("203.0.112.255", "before 203.0.113.0/24"),
        ("203.0.114.0", "past 203.0.113.0/24"),
        ("223.255.255.255", "before 224.0.0.0/4"),
        ("1.1.1.1", "public"),
        ("8.8.8.8", "public"),
        ("93.184.216.34", "public"),
        ("2001:1::1", "2001:1::1/128 port control protocol anycast"),
        (
            "2001:1::2",
            "2001:1::2/128 traversal using relays around NAT anycast",
        ),
        ("2001:3::", "2001:3::/32 AMT"),
        ("2001:3:ffff:ffff:ffff:ffff:ffff:ffff", "2001:3::/32 AMT"),
        ("2001:4:112::", "2001:4:112::/48 AS112-v6"),
        (
            "2001:4:112:ffff:ffff:ffff:ffff:ffff",
            "2001:4:112::/48 AS112-v6",
        ),
        ("2001:20::", "2001:20::/28 ORCHIDv2"),
        (
            "2001:2f:ffff:ffff:ffff:ffff:ffff:ffff",
            "2001:20::/28 ORCHIDv2",
        ),
        (
            "2001:30::",
            "2001:30::/28 drone remote ID protocol entity tags",
        ),
        ("2001:3f:ffff:ffff:ffff:ffff:ffff:ffff", "2001:30::/28 DETs"),
        (
            "2620:4f:8000::1",
            "2620:4f:8000::/48 direct delegation AS112 service",
        ),
        ("64:ff9b::808:808", "64:ff9b::/96 NAT64 of a public IPv4"),
        (
            "::ffff:8.8.8.8",
            "::ffff:0:0/96 IPv4-mapped: judged by the IPv4 it connects to",
        ),
        ("::8.8.8.8", "IPv4-compatible of a public IPv4"),
        ("2001:200::1", "past 2001::/23"),
        (
            "2001:db7:ffff:ffff:ffff:ffff:ffff:ffff",
            "before 2001:db8::/32",
        ),
        ("2001:db9::", "past 2001:db8::/32"),
        ("2003::", "past 2002::/16"),
        (
            "3ffe:ffff:ffff:ffff:ffff:ffff:ffff:ffff",
            "before 3fff::/20",
        ),
        ("3fff:1000::", "past 3fff::/20"),
        ("2001:4860:4860::8888", "public"),
        ("2606:4700::1111", "public"),
    ];

    #[test]
    fn every_address_that_is_not_globally_reachable_is_refused() {
        let wrong: Vec<String> = REFUSED
            .iter()
            .filter(|(s, _)| !is_forbidden(ip(s)))
            .map(|(s, why)| format!("{s} ({why}) is allowed"))
            .chain(
                ALLOWED
                    .iter()
                    .filter(|(s, _)| is_forbidden(ip(s)))
                    .map(|(s, why)| format!("{s} ({why}) is refused")),
            )
            .collect();
        assert!(wrong.is_empty(), "{}", wrong.join("\n"));
        // The policy switch that tests and local set-ups use still lets every one through.
        let open = Guard::new(DestinationPolicy {
            allow_private_networks: true,
            ..Default::default()
        });
        assert!(REFUSED.iter().all(|(s, _)| open.ip_allowed(ip(s))));
        let closed = Guard::new(DestinationPolicy::default());
        assert!(REFUSED.iter().all(|(s, _)| !closed.ip_allowed(ip(s))));
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
        use std::sync::atomic::{AtomicUsize, Ordering};
        use tower_service::Service as _;
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
        let name = |s: &str| s.parse::<Name>().expect("name");
        let first: Vec<SocketAddr> = resolver
            .clone()
            .call(name("rebind.example"))
            .await
            .expect("public answer")
            .collect();
        assert_eq!(first, vec![SocketAddr::from(([93, 184, 216, 34], 0))]);
        let second = resolver
            .clone()
            .call(name("rebind.example"))
            .await
            .expect_err("private answer refused");
        assert!(second.to_string().contains("not allowed"), "{second}");
        // A mixed answer keeps only the allowed addresses: the client cannot pick the private one.
        let mixed = GuardedResolver::with_lookup(Guard::new(DestinationPolicy::default()), |_| {
            Ok(vec![
                SocketAddr::from(([127, 0, 0, 1], 0)),
                SocketAddr::from(([93, 184, 216, 34], 0)),
            ])
        });
        let kept: Vec<SocketAddr> = mixed
            .clone()
            .call(name("mixed.example"))
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
