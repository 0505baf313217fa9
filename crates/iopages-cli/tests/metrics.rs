//! `iopages serve --metrics`: the Prometheus endpoint against real
//! traffic (nbdcopy writes through the export, the counters and latency
//! histograms move) and against hostile clients (unknown paths, other
//! methods, an oversized request head, idle connections holding slots).
//!
//! Every server is a real `iopages serve` process on a Unix socket with
//! its metrics on 127.0.0.1, an ephemeral port read from its banner.

mod common;

use common::{exchange, get, pattern, serve_cmd, succeeded, tools, Dir, Served};
use std::collections::BTreeMap;
use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// `iopages serve --metrics 127.0.0.1:0` on the Unix socket `sock`, and
/// the address its banner gives for the metrics.
fn serve(sock: &Path, stderr: PathBuf) -> (Served, SocketAddr) {
    let mut cmd = serve_cmd();
    cmd.args(["--size", "16M", "--arena", "128M"])
        .arg("--unix")
        .arg(sock);
    let (srv, metrics) = Served::spawn_with_metrics(cmd, stderr);
    assert!(srv.uri.starts_with("nbd+unix:///"), "{:?}", srv.banner);
    (srv, metrics)
}

/// SIGTERM: `srv` must exit 0.
fn stop(srv: Served) {
    let stderr = srv.stderr.clone();
    let (st, _) = srv.terminate();
    assert!(
        st.success(),
        "iopages serve exited with {st}: {}",
        std::fs::read_to_string(&stderr).unwrap_or_default()
    );
}

/// A sample's name and labels, the labels sorted.
type Series = (String, Vec<(String, String)>);

/// The samples of a text exposition: `name{k="v",…} value` lines.
fn parse(text: &str) -> BTreeMap<Series, f64> {
    let mut m = BTreeMap::new();
    for line in text.lines() {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (series, value) = line.rsplit_once(' ').expect("name and value");
        let value: f64 = match value {
            "+Inf" => f64::INFINITY,
            v => v.parse().unwrap_or_else(|_| panic!("value of {line}")),
        };
        let (name, mut labels) = match series.split_once('{') {
            None => (series.to_string(), Vec::new()),
            Some((name, rest)) => {
                let body = rest.strip_suffix('}').expect("closing brace");
                (name.to_string(), parse_labels(body))
            }
        };
        labels.sort();
        assert!(
            m.insert((name, labels), value).is_none(),
            "a repeated series: {line}"
        );
    }
    m
}

fn parse_labels(mut s: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    while !s.is_empty() {
        let (k, rest) = s.split_once("=\"").expect("k=\"v\"");
        let mut v = String::new();
        let mut chars = rest.char_indices();
        let end = loop {
            match chars.next().expect("a closing quote") {
                (_, '\\') => match chars.next().expect("an escape").1 {
                    'n' => v.push('\n'),
                    c => v.push(c),
                },
                (i, '"') => break i,
                (_, c) => v.push(c),
            }
        };
        out.push((k.to_string(), v));
        s = rest[end + 1..]
            .strip_prefix(',')
            .unwrap_or(&rest[end + 1..]);
    }
    out
}

fn value(m: &BTreeMap<Series, f64>, name: &str, labels: &[(&str, &str)]) -> f64 {
    let mut l: Vec<(String, String)> = labels
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    l.sort();
    *m.get(&(name.to_string(), l))
        .unwrap_or_else(|| panic!("no {name}{labels:?}"))
}

fn scrape(addr: SocketAddr) -> BTreeMap<Series, f64> {
    let (code, head, body) = get(addr, "/metrics");
    assert_eq!(code, 200, "{head}\n{body}");
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: text/plain; version=0.0.4"),
        "{head}"
    );
    parse(&body)
}

/// The buckets of one histogram series, by bound, checked: cumulative
/// (non-decreasing), the last +Inf and equal to `_count`.
fn histogram(m: &BTreeMap<Series, f64>, name: &str, labels: &[(&str, &str)]) -> (f64, f64) {
    let mut want: Vec<(String, String)> = labels
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    want.sort();
    let bucket = format!("{name}_bucket");
    let mut buckets: Vec<(f64, f64)> = m
        .iter()
        .filter(|((n, _), _)| *n == bucket)
        .filter_map(|((_, l), v)| {
            let le = l.iter().find(|(k, _)| k == "le")?;
            let rest: Vec<_> = l.iter().filter(|(k, _)| k != "le").cloned().collect();
            (rest == want).then(|| {
                let bound = if le.1 == "+Inf" {
                    f64::INFINITY
                } else {
                    le.1.parse().unwrap()
                };
                (bound, *v)
            })
        })
        .collect();
    buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    assert!(buckets.len() > 10, "{name}{labels:?}: {buckets:?}");
    for w in buckets.windows(2) {
        assert!(w[0].1 <= w[1].1, "not cumulative: {buckets:?}");
    }
    let count = value(m, &format!("{name}_count"), labels);
    let sum = value(m, &format!("{name}_sum"), labels);
    let last = buckets.last().unwrap();
    assert_eq!(last.0, f64::INFINITY);
    assert_eq!(last.1, count, "+Inf is the count: {buckets:?}");
    (count, sum)
}

#[test]
fn writes_move_the_counters_and_the_latency_histogram() {
    if !tools(&["nbdcopy"]) {
        return;
    }
    let dir = Dir::new("traffic");
    let (srv, metrics) = serve(&dir.join("sock"), dir.join("serve.err"));
    let before = scrape(metrics);
    let e = [("export", "iopages")];
    let w = [("export", "iopages"), ("command_class", "write")];
    let (count0, _) = histogram(&before, "iopages_request_duration_seconds", &w);
    assert_eq!(value(&before, "iopages_export_open", &e), 1.0);

    let src = dir.join("src.img");
    std::fs::write(&src, pattern(3, 8 << 20)).unwrap();
    let mut cmd = Command::new("nbdcopy");
    cmd.arg(&src).arg(&srv.uri);
    let out = cmd.output().unwrap();
    succeeded(&cmd, &out);

    let after = scrape(metrics);
    let moved = |name: &str, labels: &[(&str, &str)]| {
        value(&after, name, labels) - value(&before, name, labels)
    };
    assert!(moved("iopages_write_bytes_total", &e) >= (8 << 20) as f64);
    let writes = moved(
        "iopages_requests_total",
        &[("export", "iopages"), ("command", "write")],
    );
    assert!(writes > 0.0);
    let (count1, sum1) = histogram(&after, "iopages_request_duration_seconds", &w);
    // Every write served counts in the histogram.
    assert_eq!(count1 - count0, writes);
    assert!(sum1 > 0.0);
    histogram(
        &after,
        "iopages_request_duration_seconds",
        &[("export", "iopages"), ("command_class", "read")],
    );
    // Idle again: nothing in flight, nothing held in the budget.
    assert_eq!(value(&after, "iopages_requests_in_flight", &e), 0.0);
    assert_eq!(value(&after, "iopages_budget_used_bytes", &[]), 0.0);
    assert!(value(&after, "iopages_connections_total", &[]) >= 1.0);
    assert!(value(&after, "iopages_sessions_total", &[]) >= 1.0);
    assert!(value(&after, "iopages_arena_pages", &e) > 0.0);
    let out: f64 = ["strategy", "mempool", "reserve"]
        .iter()
        .map(|s| {
            moved(
                "iopages_out_pages_total",
                &[("export", "iopages"), ("source", s)],
            )
        })
        .sum();
    assert!(out > 0.0, "writes take out pages");
    stop(srv);
}

#[test]
fn the_endpoint_answers_only_what_it_serves_and_stays_up_under_abuse() {
    let dir = Dir::new("http");
    let (srv, metrics) = serve(&dir.join("sock"), dir.join("serve.err"));
    let a = metrics;

    let (code, _, body) = get(a, "/healthz");
    assert_eq!((code, body.as_str()), (200, "ok\n"));
    assert_eq!(get(a, "/nope").0, 404);
    assert_eq!(get(a, "/metricsx").0, 404);
    let post = exchange(a, b"POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n").unwrap();
    assert_eq!(post.0, 405);
    assert!(post.1.contains("Allow: GET"), "{}", post.1);
    assert_eq!(exchange(a, b"\x16\x03\x01garbage\r\n\r\n").unwrap().0, 400);
    // A query string is not part of the path.
    assert_eq!(get(a, "/metrics?x=1").0, 200);
    // OpenMetrics on request.
    let om = exchange(
        a,
        b"GET /metrics HTTP/1.1\r\nAccept: application/openmetrics-text; version=1.0.0\r\n\r\n",
    )
    .unwrap();
    assert!(om.1.contains("application/openmetrics-text"), "{}", om.1);
    assert!(om.2.ends_with("# EOF\n"));

    // A head over the bound: refused (431) or closed, never served.
    let mut big = b"GET /metrics HTTP/1.1\r\nX-Filler: ".to_vec();
    big.resize(64 << 10, b'a');
    if let Some((code, head, _)) = exchange(a, &big) {
        assert_eq!(code, 431, "{head}");
    }
    scrape(a);

    // Clients that connect and send nothing hold slots; a scrape still
    // gets through at once (the oldest are closed), not after their
    // timeout.
    let idle: Vec<TcpStream> = (0..20).map(|_| TcpStream::connect(a).unwrap()).collect();
    let t = Instant::now();
    scrape(a);
    assert_eq!(get(a, "/healthz").0, 200);
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    // Half a head, then nothing: the same.
    let mut slow = TcpStream::connect(a).unwrap();
    slow.write_all(b"GET /metr").unwrap();
    scrape(a);
    drop(idle);
    drop(slow);
    scrape(a);
    stop(srv);
}
