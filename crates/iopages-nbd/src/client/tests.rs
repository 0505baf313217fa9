use super::*;

fn tcp(host: &str, port: u16, export: &str) -> RemoteSpec {
    RemoteSpec {
        address: RemoteAddress::Tcp {
            host: host.into(),
            port,
        },
        export: export.into(),
        tls: None,
        reconnect_delay: None,
    }
}

/// Each URI parses to its spec, and the spec's own URI parses back to it.
fn assert_parses_and_round_trips(cases: Vec<(&str, RemoteSpec)>) {
    for (uri, want) in cases {
        let got = RemoteSpec::parse(uri).unwrap_or_else(|e| panic!("{uri}: {e}"));
        assert_eq!(got, want, "{uri}");
        assert_eq!(
            RemoteSpec::parse(&got.uri()).unwrap(),
            want,
            "{}",
            got.uri()
        );
    }
}

#[test]
fn good_tcp_uris_parse_and_round_trip() {
    assert_parses_and_round_trips(vec![
        ("nbd://example.com", tcp("example.com", 10809, "")),
        ("nbd://example.com/", tcp("example.com", 10809, "")),
        (
            "nbd://example.com:10900/disk",
            tcp("example.com", 10900, "disk"),
        ),
        ("NBD://h:1/a%20b/c", tcp("h", 1, "a b/c")),
        ("nbd://[::1]:2000/x", tcp("::1", 2000, "x")),
        ("nbd://[fe80::1]", tcp("fe80::1", 10809, "")),
        ("nbd://10.0.0.1:/e", tcp("10.0.0.1", 10809, "e")),
    ]);
}

#[test]
fn good_unix_uris_parse_and_round_trip() {
    assert_parses_and_round_trips(vec![
        (
            "nbd+unix:///vol?socket=/run/nbd.sock",
            RemoteSpec {
                address: RemoteAddress::Unix("/run/nbd.sock".into()),
                export: "vol".into(),
                tls: None,
                reconnect_delay: None,
            },
        ),
        (
            "nbd+unix://?socket=/tmp/a%26b",
            RemoteSpec {
                address: RemoteAddress::Unix("/tmp/a&b".into()),
                export: "".into(),
                tls: None,
                reconnect_delay: None,
            },
        ),
    ]);
}

#[test]
fn good_tls_uris_parse_and_round_trip() {
    assert_parses_and_round_trips(vec![
        (
            "nbds://h/e?tls-certificates=/etc/pki/nbd",
            RemoteSpec {
                tls: Some(RemoteTls {
                    certificates: Some("/etc/pki/nbd".into()),
                    ..RemoteTls::new()
                }),
                ..tcp("h", 10809, "e")
            },
        ),
        (
            "NBDS://alice@[::1]:99/e?tls-psk-file=/k%26s.psk&tls-type=psk",
            RemoteSpec {
                tls: Some(RemoteTls {
                    psk_file: Some("/k&s.psk".into()),
                    username: Some("alice".into()),
                    ..RemoteTls::new()
                }),
                ..tcp("::1", 99, "e")
            },
        ),
        (
            "nbds+unix:///luks?socket=/s&tls-certificates=/c&tls-hostname=nbd.example\
             &tls-verify-peer=0&reconnect-delay=5",
            RemoteSpec {
                address: RemoteAddress::Unix("/s".into()),
                export: "luks".into(),
                tls: Some(RemoteTls {
                    certificates: Some("/c".into()),
                    hostname: Some("nbd.example".into()),
                    verify_peer: false,
                    ..RemoteTls::new()
                }),
                reconnect_delay: Some(Duration::from_secs(5)),
            },
        ),
        (
            "nbds://h?tls-username=bob&tls-verify-peer=true",
            RemoteSpec {
                tls: Some(RemoteTls {
                    username: Some("bob".into()),
                    ..RemoteTls::new()
                }),
                ..tcp("h", 10809, "")
            },
        ),
    ]);
}

#[test]
fn bad_uris_are_refused_with_a_reason() {
    let cases = [
        ("", "not an NBD URI"),
        ("example.com:10809", "not an NBD URI"),
        ("http://h/e", "not supported"),
        ("nbd+vsock://1:2/e", "not supported"),
        ("nbd:///e", "no host"),
        ("nbd://:10809/e", "no host"),
        ("nbd://h:0/e", "bad port"),
        ("nbd://h:65536/e", "bad port"),
        ("nbd://h:+1/e", "bad port"),
        ("nbd://h:x/e", "bad port"),
        ("nbd://::1/e", "in brackets"),
        ("nbd://[::1/e", "closing ]"),
        ("nbd://[::1]x/e", "junk"),
        ("nbd://u@h/e", "only for TLS"),
        ("nbd://h/e#f", "fragment"),
        ("nbd://h/e?reconnect-delay=x", "not whole seconds"),
        ("nbd://h/e?reconnect-delay=-1", "not whole seconds"),
        ("nbd://h/e?reconnect-delay=3601", "from 0 to 3600"),
        ("nbd://h/e?reconnect-delay=1&reconnect-delay=2", "twice"),
        ("nbd://h/e?tls-certificates=/x", "needs TLS: use nbds://"),
        ("nbd+unix:///e?socket=/s&tls-psk-file=/k", "needs TLS"),
        ("nbds+unix:///e", "nbds+unix:// needs ?socket=PATH"),
        ("nbds://h/e?tls-certificates=", "is empty"),
        ("nbds://h/e?tls-hostname=", "is empty"),
        ("nbds://h/e?tls-verify-peer=maybe", "not a boolean"),
        ("nbds://h/e?tls-type=anon", "not supported (x509 or psk)"),
        ("nbds://h/e?tls-type=psk", "needs tls-psk-file"),
        ("nbds://h/e?tls-certificates=/c&tls-psk-file=/k", "not both"),
        (
            "nbds://h/e?tls-certificates=/c&tls-certificates=/d",
            "twice",
        ),
        ("nbds://a@h/e?tls-username=b", "both as user@"),
        ("nbds://a:pw@h/e", "a user name alone"),
        ("nbds://h/e?tls-foo=1", "unknown query parameter"),
        ("nbds://h/e?socket=/s", "unknown query parameter"),
        ("nbd://h/e?socket=/x", "unknown query parameter"),
        ("nbd+unix:///e", "needs ?socket=PATH"),
        ("nbd+unix:///e?socket=", "needs ?socket=PATH"),
        ("nbd+unix://host/e?socket=/s", "takes no host"),
        ("nbd+unix:///e?socket=/s&socket=/t", "twice"),
        ("nbd+unix:///e?socket=/s&tls=on", "unknown query parameter"),
        ("nbd://h/%zz", "%-escape"),
        ("nbd://h/%ff", "UTF-8"),
    ];
    for (uri, why) in cases {
        let e = RemoteSpec::parse(uri).expect_err(uri);
        assert_eq!(e.kind(), ErrorKind::InvalidInput, "{uri}");
        assert!(e.to_string().contains(why), "{uri}: {e}");
    }
    let long = format!("nbd://h/{}", "x".repeat(4097));
    assert!(RemoteSpec::parse(&long).is_err());
}

#[test]
fn segments_are_cut_at_any_byte() {
    let (a, b, c) = ([1u8; 3], [2u8; 4], [3u8; 5]);
    let segs: [&[u8]; 3] = [&a, &b, &c];
    let cut = sub_slices(&segs, 2, 7);
    assert_eq!(cut.concat(), vec![1, 2, 2, 2, 2, 3, 3]);
    assert_eq!(sub_slices(&segs, 7, 5).concat(), vec![3; 5]);
    assert!(sub_slices(&segs, 12, 0).is_empty());
}

#[test]
fn error_codes_map_to_kinds() {
    assert_eq!(errno_kind(EIO).0, ErrorKind::Other);
    assert_eq!(errno_kind(ENOSPC).0, ErrorKind::StorageFull);
    assert_eq!(errno_kind(EPERM).0, ErrorKind::PermissionDenied);
    assert_eq!(errno_kind(EINVAL).0, ErrorKind::InvalidInput);
    assert_eq!(errno_kind(ENOTSUP).0, ErrorKind::Unsupported);
    assert_eq!(errno_kind(12345).0, ErrorKind::Other);
}

/// This thread's voluntary context switches so far (each a sleep and a
/// wake-up).
fn own_sleeps() -> u64 {
    let status = std::fs::read_to_string("/proc/thread-self/status").unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
        .map(|v| v.trim().parse().unwrap())
        .unwrap()
}

/// The reader waits for a reply on `ours` while a writer's 1 MiB goes out
/// on the same socket and `store` takes it 16 KiB at a time: how many
/// times the reader slept before the reply came.
fn reader_sleeps_beside_a_write<S: Read + Write + Send + 'static>(
    ours: Stream,
    writer: Stream,
    mut store: S,
) -> u64 {
    let reader = std::thread::spawn(move || {
        let mut rx = Recv::new(ours, 4096, Duration::from_secs(5));
        let before = own_sleeps();
        let mut reply = [0u8; 16];
        rx.fill(&mut reply, Duration::from_secs(20), &mut |_| Ok(true))
            .unwrap();
        (reply, own_sleeps() - before)
    });
    let sender = std::thread::spawn(move || (&writer).write_all(&vec![7u8; 1 << 20]).unwrap());
    let (mut taken, mut piece) = (0, vec![0u8; 16 << 10]);
    while taken < 1 << 20 {
        let n = store.read(&mut piece).unwrap();
        assert!(n > 0 && piece[..n].iter().all(|&b| b == 7));
        taken += n;
        std::thread::sleep(Duration::from_micros(300));
    }
    sender.join().unwrap();
    store.write_all(&[9u8; 16]).unwrap();
    let (reply, sleeps) = reader.join().unwrap();
    assert_eq!(reply, [9u8; 16]);
    sleeps
}

/// The reader sleeps until the reply, not once for every piece of a
/// write the store takes on the same connection (asleep in `recv`, it
/// was woken 8 times here over a Unix socket; over loopback TCP the
/// write fits the send buffer the kernel grows, so TCP here checks that
/// the `poll` path reads a TCP stream as well).
#[test]
fn a_reader_is_not_woken_by_what_the_store_takes_of_a_write() {
    let (ours, store) = std::os::unix::net::UnixStream::pair().unwrap();
    let writer = Stream::Unix(ours.try_clone().unwrap());
    let sleeps = reader_sleeps_beside_a_write(Stream::Unix(ours), writer, store);
    assert!(
        sleeps <= 4,
        "Unix socket: the reader slept {sleeps} times waiting for one reply"
    );

    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let ours = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
    let (store, _) = listener.accept().unwrap();
    let writer = Stream::Tcp(ours.try_clone().unwrap());
    let sleeps = reader_sleeps_beside_a_write(Stream::Tcp(ours), writer, store);
    assert!(
        sleeps <= 4,
        "TCP: the reader slept {sleeps} times waiting for one reply"
    );
}
