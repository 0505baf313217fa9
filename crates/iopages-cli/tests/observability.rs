//! What operators load beside `iopages serve --metrics`, checked against
//! a real server: the scrape is clean under Prometheus' own linter
//! (`promtool check metrics`), the OpenMetrics body is well formed and
//! carries the same series, the alert rules pass `promtool check rules`
//! and their unit tests (`promtool test rules`), and every metric that
//! the Grafana dashboard (`contrib/grafana/iopages.json`) and the rules
//! (`contrib/prometheus/`) name is one the server really exports.
//!
//! The server: `iopages serve --config` with a local LUKS2 image and one
//! on a remote store (nbdkit's `file` plugin), both opened and driven by
//! the tests' NBD client (writes, reads, FLUSH, TRIM, WRITE_ZEROES, and
//! a read past the end that fails), so every family has samples. It is
//! started once, scraped in both formats, and stopped; the tests share
//! the scrape. The names the dashboard and rules may use come from that
//! scrape's `# TYPE` lines — never from a list typed in here.
//!
//! promtool (Debian's `prometheus`), nbdkit and nbdinfo are outside
//! tools: where one is missing the test says so and returns, except
//! under `CI=true` (scripts/setup-debian.sh installs them).

mod common;

use common::{exchange, export_table, luks2_image, serve_cmd, tools, Dir, NbdKit, Served};
use iopages_testkit::nbd_client::{self as nbd, Client};
use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;

/// What Prometheus 2 sends (OpenMetrics first, 0.0.4 after it).
const PROMETHEUS_ACCEPT: &str = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";

/// The repository's root.
fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// One scrape of the server in each format: (content type, body).
struct Scrape {
    text: (String, String),
    openmetrics: (String, String),
}

/// GET /metrics with `accept` (none: no Accept header): the content type
/// and the body of a 200.
fn get_metrics(addr: SocketAddr, accept: Option<&str>) -> (String, String) {
    let accept = accept.map_or(String::new(), |a| format!("Accept: {a}\r\n"));
    let req = format!("GET /metrics HTTP/1.1\r\nHost: {addr}\r\n{accept}\r\n");
    let (code, head, body) = exchange(addr, req.as_bytes()).expect("a reply to GET /metrics");
    assert_eq!(code, 200, "{head}\n{body}");
    let ty = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-type")
                .then(|| v.trim().to_string())
        })
        .unwrap_or_else(|| panic!("no Content-Type: {head}"));
    (ty, body)
}

/// Writes, reads, FLUSH, TRIM and WRITE_ZEROES on `export` through the
/// socket `sock`, and a read past its end, which must fail.
fn drive(sock: &Path, export: &str) {
    let mut c = Client::unix(sock);
    let e = c
        .go(export, &[])
        .unwrap_or_else(|err| panic!("NBD_OPT_GO {export}: {err}"));
    let data: Vec<u8> = (0..64 << 10).map(|i| (i * 7 + 3) as u8).collect();
    assert_eq!(c.write(0, &data, 0), 0, "{export}: write");
    assert_eq!(c.read(0, data.len() as u32).as_deref(), Ok(&data[..]));
    assert_eq!(c.command(nbd::CMD_FLUSH, 0, 0, 0), 0, "{export}: flush");
    // TRIM and WRITE_ZEROES may be refused (the export's flags say); a
    // refusal is an error the metrics count, which is what is wanted.
    c.command(nbd::CMD_TRIM, 0, 1 << 20, 64 << 10);
    c.command(nbd::CMD_WRITE_ZEROES, 0, 2 << 20, 64 << 10);
    assert_eq!(
        c.read(e.size, 4096),
        Err(nbd::EINVAL),
        "{export}: past the end"
    );
    c.disconnect();
}

/// Start the server (a local and a remote export, metrics on
/// 127.0.0.1:0), drive both exports, scrape it in both formats and stop
/// it; `None` where a tool is missing (outside CI).
fn live() -> Option<&'static Scrape> {
    static LIVE: OnceLock<Option<Scrape>> = OnceLock::new();
    LIVE.get_or_init(|| {
        if !tools(&["promtool", "nbdkit", "nbdinfo"]) {
            return None;
        }
        let dir = Dir::new("live");
        let (local, pass) = luks2_image(&dir, "local", "16M", b"observability");
        // The remote volume is authenticated, so its integrity families
        // are exported too.
        let (remote, fresh, _) = common::luks2_auth_image(&dir, "remote", "24M", &pass, "aead");
        let (_store, store_uri) = NbdKit::file(&dir.join("store.sock"), &remote);
        let sock = dir.join("s.sock");
        let conf = dir.join("serve.toml");
        let text = format!(
            "[server]\nunix = [\"{}\"]\n{}{}",
            sock.display(),
            export_table("local", &local.display().to_string(), &pass, ""),
            export_table(
                "remote",
                &store_uri,
                &pass,
                &format!("freshness = \"{}\"", fresh.display())
            ),
        );
        std::fs::write(&conf, text).unwrap();
        let mut cmd = serve_cmd();
        cmd.arg("--config").arg(&conf);
        let (srv, addr) = Served::spawn_with_metrics(cmd, dir.join("serve.err"));
        drive(&sock, "local");
        drive(&sock, "remote");
        let scrape = Scrape {
            text: get_metrics(addr, None),
            openmetrics: get_metrics(addr, Some(PROMETHEUS_ACCEPT)),
        };
        srv.stop();
        Some(scrape)
    })
    .as_ref()
}

/// The families a 0.0.4 body declares: `# TYPE` name → kind (a counter
/// under its samples' name, `…_total`).
fn declared(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .map(|l| {
            let (name, kind) = l.split_once(' ').expect("# TYPE NAME KIND");
            (name.to_string(), kind.to_string())
        })
        .collect()
}

/// The series of a body's samples (`name{labels}`, the value dropped).
fn series(body: &str) -> BTreeSet<String> {
    body.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| {
            l.rsplit_once(' ')
                .expect("a series and a value")
                .0
                .to_string()
        })
        .collect()
}

/// A sample's metric name (up to its labels or its value).
fn sample_name(sample: &str) -> &str {
    sample.split(['{', ' ']).next().unwrap()
}

/// `cmd`, given `stdin`: its output. The input is written on its own
/// thread while the output is read, so a tool that answers before it has
/// read everything cannot fill its output pipe and stall both sides.
fn run_with_stdin(cmd: &mut Command, stdin: &str) -> Output {
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    let mut input = child.stdin.take().unwrap();
    std::thread::scope(|s| {
        // A tool that exits without reading it all closes the pipe: what
        // it said is the result either way.
        s.spawn(move || input.write_all(stdin.as_bytes()));
        child.wait_with_output().unwrap()
    })
}

/// `promtool check metrics` of `body`: its exit status and what it said.
fn promtool_check_metrics(body: &str) -> (bool, String) {
    let out = run_with_stdin(
        Command::new(iopages_testkit::find_tool("promtool").unwrap()).args(["check", "metrics"]),
        body,
    );
    let said =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), said)
}

#[test]
fn the_scrape_is_clean_under_promtool_check_metrics_and_every_family_has_samples() {
    let Some(s) = live() else { return };
    let (ty, body) = &s.text;
    assert_eq!(ty, "text/plain; version=0.0.4; charset=utf-8");
    assert!(!body.contains("# EOF"), "0.0.4 has no # EOF");
    let families = declared(body);
    assert!(families.len() > 30, "{families:?}");
    let all = series(body);
    let names: BTreeSet<&str> = all.iter().map(|s| sample_name(s)).collect();
    for (name, kind) in &families {
        let has = match kind.as_str() {
            "histogram" => names.contains(format!("{name}_count").as_str()),
            _ => names.contains(name.as_str()),
        };
        assert!(
            has,
            "{name} ({kind}) has no sample: the I/O did not reach it"
        );
    }
    let (ok, said) = promtool_check_metrics(body);
    assert!(ok && said.is_empty(), "promtool check metrics:\n{said}");
}

#[test]
fn the_openmetrics_scrape_is_well_formed_and_has_the_same_series() {
    let Some(s) = live() else { return };
    let (ty, body) = &s.openmetrics;
    assert_eq!(
        ty,
        "application/openmetrics-text; version=1.0.0; charset=utf-8"
    );
    assert!(body.ends_with("\n# EOF\n"), "no final # EOF");
    assert_eq!(body.matches("# EOF").count(), 1);
    let mut seen = BTreeSet::new();
    let mut family: Option<(String, String)> = None;
    for line in body.lines().filter(|l| *l != "# EOF") {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap();
            assert!(seen.insert(name.to_string()), "{name} described twice");
            assert!(!(kind == "counter" && name.ends_with("_total")), "{line}");
            family = Some((name.to_string(), kind.to_string()));
        } else if let Some(rest) = line.strip_prefix("# HELP ") {
            // HELP comes first: its family's TYPE follows.
            let name = rest.split(' ').next().unwrap();
            assert!(!seen.contains(name), "HELP after TYPE: {line}");
        } else {
            let (name, kind) = family.as_ref().expect("a sample before any TYPE");
            let sample = sample_name(line);
            let suffix = sample.strip_prefix(name.as_str()).unwrap_or("?");
            let allowed: &[&str] = match kind.as_str() {
                "counter" => &["_total"],
                "gauge" => &[""],
                "histogram" => &["_bucket", "_sum", "_count"],
                k => panic!("unexpected kind {k}"),
            };
            assert!(allowed.contains(&suffix), "{line} under the {kind} {name}");
        }
    }
    assert_eq!(seen.len(), declared(&s.text.1).len());
    // The same series in both formats: a scraper's choice changes no name.
    assert_eq!(series(body), series(&s.text.1));
    // promtool reads 0.0.4: the OpenMetrics body, whose counters are
    // described by their family's name, is what it must flag.
    let (ok, said) = promtool_check_metrics(body);
    assert!(!ok && said.contains("no help text"), "{said}");
}

/// PromQL keywords that are not metric names (aggregation modifiers,
/// binary operators, matching).
const KEYWORDS: [&str; 12] = [
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "and",
    "or",
    "unless",
    "offset",
    "atan2",
];

/// PromQL's aggregation operators: `sum by (l) (…)` puts a keyword, not
/// a parenthesis, after the operator's name.
const AGGREGATIONS: [&str; 12] = [
    "sum",
    "min",
    "max",
    "avg",
    "group",
    "stddev",
    "stdvar",
    "count",
    "count_values",
    "bottomk",
    "topk",
    "quantile",
];

/// Where the string literal starting at `i` (its quote) ends: the index
/// after its closing quote.
fn skip_string(b: &[u8], i: usize) -> usize {
    let q = b[i];
    let mut j = i + 1;
    while j < b.len() && b[j] != q {
        j += if b[j] == b'\\' { 2 } else { 1 };
    }
    j + 1
}

/// Where the bracketed part starting at `i` (`open`) ends, strings
/// inside it skipped: the index after its `close`.
fn skip_bracket(b: &[u8], i: usize, open: u8, close: u8) -> usize {
    let (mut depth, mut j) = (0, i);
    while j < b.len() {
        match b[j] {
            b'"' | b'\'' | b'`' => {
                j = skip_string(b, j);
                continue;
            }
            c if c == open => depth += 1,
            c if c == close => {
                depth -= 1;
                if depth == 0 {
                    return j + 1;
                }
            }
            _ => {}
        }
        j += 1;
    }
    j
}

/// The metric names a PromQL expression selects: identifiers that are
/// not functions, keywords, numbers or durations, outside label matchers
/// (`{…}`), ranges (`[…]`), strings, grouping lists (`by (…)`, …) and
/// Grafana's `$variables`.
fn metric_names(expr: &str) -> Vec<String> {
    let b = expr.as_bytes();
    let ident = |c: u8| c.is_ascii_alphanumeric() || c == b'_' || c == b':';
    let (mut out, mut i) = (Vec::new(), 0);
    while i < b.len() {
        match b[i] {
            b'"' | b'\'' | b'`' => i = skip_string(b, i),
            b'{' => i = skip_bracket(b, i, b'{', b'}'),
            b'[' => i = skip_bracket(b, i, b'[', b']'),
            b'$' if b.get(i + 1) == Some(&b'{') => i = skip_bracket(b, i + 1, b'{', b'}'),
            b'$' => {
                i += 1;
                while i < b.len() && ident(b[i]) {
                    i += 1;
                }
            }
            c if c.is_ascii_digit() || c == b'.' => {
                // A number or a duration (5m, 1e3, 0.99).
                while i < b.len() && (ident(b[i]) || b[i] == b'.') {
                    i += 1;
                }
            }
            c if ident(c) => {
                let start = i;
                while i < b.len() && ident(b[i]) {
                    i += 1;
                }
                let word = &expr[start..i];
                let mut next = i;
                while next < b.len() && b[next].is_ascii_whitespace() {
                    next += 1;
                }
                let call = b.get(next) == Some(&b'(');
                let lower = word.to_ascii_lowercase();
                if KEYWORDS.contains(&lower.as_str()) {
                    if call && lower != "and" && lower != "or" && lower != "unless" {
                        // by (…), on (…), group_left (…): label names.
                        i = skip_bracket(b, next, b'(', b')');
                    }
                } else if !call
                    && !AGGREGATIONS.contains(&lower.as_str())
                    && !matches!(lower.as_str(), "inf" | "nan")
                {
                    out.push(word.to_string());
                }
            }
            _ => i += 1,
        }
    }
    out
}

/// Names a selector may use beside the server's families: the series
/// Prometheus records for every target.
const PROMETHEUS_SERIES: [&str; 1] = ["up"];

/// The names in `used` (where, name) that the server does not export:
/// not a declared family, not a histogram's `_bucket`/`_sum`/`_count`,
/// not recorded by `records`, not Prometheus' own.
fn unknown(
    used: &[(String, String)],
    families: &BTreeMap<String, String>,
    records: &BTreeSet<String>,
) -> Vec<String> {
    let histogram = |n: &str| families.get(n).is_some_and(|k| k == "histogram");
    used.iter()
        .filter(|(_, name)| {
            let n = name.as_str();
            let part = ["_bucket", "_sum", "_count"]
                .iter()
                .any(|s| n.strip_suffix(s).is_some_and(histogram));
            !(families.contains_key(n)
                || part
                || records.contains(n)
                || PROMETHEUS_SERIES.contains(&n))
        })
        .map(|(at, name)| format!("{name} (in {at})"))
        .collect()
}

/// Every PromQL text in the dashboard: (where, expression) for each
/// panel target's `expr` and each template variable's query (for
/// `label_values(SELECTOR, LABEL)`, the selector).
fn dashboard_queries(d: &serde_json::Value) -> Vec<(String, String)> {
    fn walk(v: &serde_json::Value, at: &str, out: &mut Vec<(String, String)>) {
        match v {
            serde_json::Value::Object(m) => {
                let here = m
                    .get("title")
                    .or(m.get("name"))
                    .and_then(|t| t.as_str())
                    .map_or(at.to_string(), |t| format!("{at}/{t}"));
                for (k, v) in m {
                    match (k.as_str(), v.as_str()) {
                        ("expr" | "definition", Some(e)) => out.push((here.clone(), e.to_string())),
                        _ => walk(v, &here, out),
                    }
                }
            }
            serde_json::Value::Array(a) => a.iter().for_each(|v| walk(v, at, out)),
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk(d, "", &mut out);
    for (_, e) in &mut out {
        if let Some(inner) = e.strip_prefix("label_values(") {
            let selector = inner.rsplit_once(',').map_or(inner, |(s, _)| s);
            *e = selector.to_string();
        }
    }
    out
}

/// A YAML file's values of `key` (`key: value`, quoted or not, or a
/// block scalar `key: >-` / `|` on the more indented lines below).
fn yaml_values(text: &str, key: &str) -> Vec<String> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    for (i, l) in lines.iter().enumerate() {
        let t = l.trim_start().trim_start_matches("- ");
        let Some(v) = t.strip_prefix(key).and_then(|r| r.strip_prefix(':')) else {
            continue;
        };
        let v = v.trim();
        if v.starts_with('>') || v.starts_with('|') {
            let indent = l.len() - l.trim_start().len();
            let block: Vec<&str> = lines[i + 1..]
                .iter()
                .take_while(|n| n.trim().is_empty() || n.len() - n.trim_start().len() > indent)
                .map(|n| n.trim())
                .collect();
            out.push(block.join(" "));
        } else {
            let unquoted = v
                .strip_prefix('\'')
                .and_then(|v| v.strip_suffix('\''))
                .or_else(|| v.strip_prefix('"').and_then(|v| v.strip_suffix('"')))
                .unwrap_or(v);
            out.push(unquoted.to_string());
        }
    }
    out
}

fn rules_file() -> String {
    std::fs::read_to_string(repo().join("contrib/prometheus/iopages.rules.yml")).unwrap()
}

fn dashboard() -> serde_json::Value {
    let text = std::fs::read_to_string(repo().join("contrib/grafana/iopages.json")).unwrap();
    serde_json::from_str(&text).expect("the dashboard is JSON")
}

#[test]
fn promql_names_are_found_outside_matchers_functions_and_grouping() {
    let e = r#"histogram_quantile(0.99, sum by (le, export) (rate(a_bucket{job=~"$job", x="}{[by(z)"}[$__rate_interval]))) / on (instance) group_left (export) b:rec offset 5m + ignoring(q) c * 1e3 > bool inf or d and ${var} unless count(e) by (f)"#;
    assert_eq!(metric_names(e), ["a_bucket", "b:rec", "c", "d", "e"]);
    assert_eq!(metric_names("up{job=\"iopages\"} == 0"), ["up"]);
    assert_eq!(metric_names("absent(up)"), ["up"]);
    // The checker flags what the server does not export.
    let families: BTreeMap<String, String> = [("x_total", "counter"), ("h_seconds", "histogram")]
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .into();
    let used = [
        "x_total",
        "h_seconds_bucket",
        "h_seconds_count",
        "x",
        "x_total_count",
        "up",
        "y:z",
    ]
    .map(|n| ("t".to_string(), n.to_string()));
    let records = BTreeSet::from(["y:z".to_string()]);
    assert_eq!(
        unknown(&used, &families, &records),
        ["x (in t)", "x_total_count (in t)"]
    );
}

#[test]
fn every_metric_the_dashboard_names_is_one_the_server_exports() {
    let d = dashboard();
    // Imports anywhere: one Prometheus input, every data source that input.
    assert_eq!(d["__inputs"][0]["name"], "DS_PROMETHEUS");
    assert_eq!(d["__inputs"][0]["pluginId"], "prometheus");
    let text = d.to_string();
    assert!(
        !text.contains("\"uid\":\"prometheus\""),
        "a fixed data source uid"
    );
    let vars = d["templating"]["list"].as_array().unwrap();
    let export = vars
        .iter()
        .find(|v| v["name"] == "export")
        .expect("an export variable");
    assert!(export["definition"]
        .as_str()
        .unwrap()
        .starts_with("label_values("));
    let queries = dashboard_queries(&d);
    // Every panel (rows aside) queries something.
    for p in d["panels"].as_array().unwrap() {
        if p["type"] != "row" {
            let t = p["targets"].as_array().map_or(0, |t| t.len());
            assert!(t > 0, "panel {} has no query", p["title"]);
            assert_eq!(p["datasource"]["uid"], "${DS_PROMETHEUS}", "{}", p["title"]);
        }
    }
    let Some(s) = live() else { return };
    let used: Vec<(String, String)> = queries
        .iter()
        .flat_map(|(at, e)| metric_names(e).into_iter().map(move |n| (at.clone(), n)))
        .collect();
    assert!(used.len() > 40, "{used:?}");
    let bad = unknown(&used, &declared(&s.text.1), &BTreeSet::new());
    assert!(
        bad.is_empty(),
        "the dashboard names metrics the server does not export:\n{}",
        bad.join("\n")
    );
}

#[test]
fn every_metric_the_rules_and_their_tests_name_is_one_the_server_exports() {
    let rules = rules_file();
    let records: BTreeSet<String> = yaml_values(&rules, "record").into_iter().collect();
    assert!(
        records.iter().all(|r| r.starts_with("iopages:")),
        "{records:?}"
    );
    let exprs = yaml_values(&rules, "expr");
    assert!(exprs.len() > 15, "{exprs:?}");
    let mut used: Vec<(String, String)> = exprs
        .iter()
        .flat_map(|e| metric_names(e).into_iter().map(move |n| (e.clone(), n)))
        .collect();
    // The unit tests' input series are what a scrape gives too.
    let tests =
        std::fs::read_to_string(repo().join("contrib/prometheus/iopages.rules.test.yml")).unwrap();
    for s in yaml_values(&tests, "series") {
        used.push(("iopages.rules.test.yml".into(), sample_name(&s).to_string()));
    }
    let Some(s) = live() else { return };
    let bad = unknown(&used, &declared(&s.text.1), &records);
    assert!(
        bad.is_empty(),
        "the rules name metrics the server does not export:\n{}",
        bad.join("\n")
    );
}

#[test]
fn the_rules_pass_promtool_check_and_their_unit_tests() {
    let Some(promtool) = iopages_testkit::need_tool("promtool", env!("CARGO_CRATE_NAME")) else {
        return;
    };
    let dir = repo().join("contrib/prometheus");
    for args in [
        ["check", "rules", "iopages.rules.yml"],
        ["test", "rules", "iopages.rules.test.yml"],
    ] {
        let out = Command::new(&promtool)
            .args(args)
            .current_dir(&dir)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success() && said.contains("SUCCESS"),
            "promtool {args:?}:\n{said}"
        );
    }
    // Every alert says how bad it is and what it means, and waits.
    let rules = rules_file();
    let alerts = yaml_values(&rules, "alert").len();
    assert!(alerts >= 12, "{alerts} alerts");
    for key in ["for", "severity", "summary", "description"] {
        assert_eq!(
            yaml_values(&rules, key).len(),
            alerts,
            "every alert has {key}"
        );
    }
}

#[test]
fn the_dashboards_queries_parse_as_promql() {
    let Some(promtool) = iopages_testkit::need_tool("promtool", env!("CARGO_CRATE_NAME")) else {
        return;
    };
    // Each panel's query as a recording rule, Grafana's variables given
    // values, for promtool's parser.
    let mut rules = String::from("groups:\n  - name: dashboard\n    rules:\n");
    let d = dashboard();
    let exprs: Vec<String> = dashboard_queries(&d).into_iter().map(|(_, e)| e).collect();
    for (i, e) in exprs.iter().enumerate() {
        let e = e
            .replace("$__rate_interval", "5m")
            .replace("$job", ".*")
            .replace("$instance", ".*")
            .replace("$export", ".*");
        rules.push_str(&format!(
            "      - record: dashboard:query_{i}\n        expr: '{}'\n",
            e.replace('\'', "''")
        ));
    }
    let dir = Dir::new("dashboard");
    let file = dir.join("dashboard.rules.yml");
    std::fs::write(&file, rules).unwrap();
    let out = Command::new(&promtool)
        .args(["check", "rules"])
        .arg(&file)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let said =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{said}");
    assert!(
        said.contains(&format!("{} rules found", exprs.len())),
        "{said}"
    );
}
