//! The control API through its real unix socket: every endpoint, bad input of every kind,
//! slow and concurrent clients, `vgpuctl`, and the daemon started from a TOML config.
//! (Pause, drain and weights with guest work running are in
//! `bench/tests/api_loopback.rs`.)

use std::io::{ErrorKind, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use vgpu_backend::api::client::{parse_response, ApiClient, ClientError, RawResponse};
use vgpu_backend::api::{ApiOptions, ApiServer};
use vgpu_backend::{SchedConfig, VmLimits};
use vgpu_test_support::Host;

struct Rig {
    host: Host,
    api: ApiServer,
}

impl Rig {
    fn new(tag: &str, opts: ApiOptions) -> Rig {
        let host = Host::new(
            &format!("api-{tag}"),
            64 << 20,
            VmLimits::default(),
            &["vm1", "vm2"],
        );
        let api = ApiServer::start(&host.backend, &host.dir.join("api.sock"), opts).expect("api");
        Rig { host, api }
    }

    fn client(&self) -> ApiClient {
        ApiClient::new(self.api.path()).with_timeout(Duration::from_secs(20))
    }

    fn raw(&self, method: &str, path: &str, body: Option<&str>) -> (u16, Value) {
        let r = self
            .client()
            .raw(method, path, body.map(str::as_bytes))
            .expect("request");
        (r.status, body_json(&r))
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        self.api.shutdown();
    }
}

fn body_json(r: &RawResponse) -> Value {
    serde_json::from_slice(&r.body).unwrap_or(Value::Null)
}

/// Sends raw bytes on a fresh connection, reads the answer to EOF.
fn send_raw(path: &Path, data: &[u8]) -> RawResponse {
    let mut s = UnixStream::connect(path).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(20)))
        .expect("timeout");
    s.write_all(data).expect("write");
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    parse_response(&out).expect("response")
}

fn assert_error(status: u16, v: &Value, want_status: u16, want_code: &str) {
    assert_eq!(status, want_status, "{v}");
    assert_eq!(v["code"], want_code, "{v}");
    assert!(v["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
}

#[test]
fn every_endpoint_answers_through_the_socket() {
    let rig = Rig::new("all", ApiOptions::default());
    let c = rig.client();
    let info = c.info().expect("info");
    assert_eq!(info.api_version, "v1");
    assert_eq!(info.gpu.vram_bytes, 64 << 20);
    assert_eq!(info.vms, 2);
    assert_eq!(info.policy, "none");

    let list = c.vms().expect("list");
    let names: Vec<&str> = list.vms.iter().map(|v| v.name.as_str()).collect();
    assert_eq!(names, ["vm1", "vm2"]);
    assert!(list
        .vms
        .iter()
        .all(|v| !v.connected && !v.paused && v.weight == 100));

    let d = c.vm("vm1").expect("detail");
    assert!(d.socket.ends_with("vm1.sock"));
    assert_eq!(d.limits.vram_bytes, VmLimits::default().vram_bytes);

    assert_eq!(c.set_weight("vm1", 700).expect("weight").weight, 700);
    assert_eq!(rig.host.backend.vm_weight("vm1"), Some(700));
    assert_eq!(c.vm("vm1").expect("detail").weight, 700);

    assert_eq!(
        c.set_vram_quota("vm2", 8 << 20).expect("quota").bytes,
        8 << 20
    );
    assert_eq!(
        rig.host.backend.vm_limits("vm2").map(|l| l.vram_bytes),
        Some(8 << 20)
    );

    let p = c.pause("vm2").expect("pause");
    assert!(p.paused);
    assert_eq!(rig.host.backend.vm_paused("vm2"), Some(true));
    let p = c.drain("vm2", Some(1000)).expect("drain");
    assert!(p.paused && p.waited_ms.is_some());
    let p = c.resume("vm2").expect("resume");
    assert!(!p.paused);

    // Let the sampler take a few samples.
    std::thread::sleep(Duration::from_millis(700));
    let st = c.vm_stats("vm1").expect("stats");
    assert_eq!(st.weight, 700);
    assert_eq!((st.vram_resident_bytes, st.vram_swapped_bytes), (0, 0));
    // No guest: the VRAM figures are there, all zero (moves are in
    // `bench/tests/api_loopback.rs`).
    assert_eq!(st.vram.quota_bytes, VmLimits::default().vram_bytes);
    assert_eq!(
        (st.vram.evictions, st.vram.swap_ins, st.vram.pauses),
        (0, 0, 0)
    );
    assert!(st.vram.processes.is_empty(), "{st:?}");
    assert!(!st.windows.is_empty(), "{st:?}");
    assert!(st.windows.iter().all(|w| w.share == 0.0));

    let s = c.scheduler().expect("scheduler");
    assert_eq!(s.config.policy, "none");
    assert!(!s.running);
    let s = c
        .set_scheduler(&json!({"policy": "fair", "interval_ms": 5}))
        .expect("set scheduler");
    assert!(s.running);
    assert_eq!(s.config.interval_ms, 5);
    assert_eq!(
        rig.host.backend.scheduler_config().map(|c| c.interval_ms),
        Some(5)
    );
    // A partial change keeps the rest.
    let s = c
        .set_scheduler(&json!({"threshold_us": 1234, "unshadow_cap": 4}))
        .expect("partial");
    assert_eq!(
        (
            s.config.policy.as_str(),
            s.config.interval_ms,
            s.config.threshold_us
        ),
        ("fair", 5, 1234)
    );
    assert_eq!(s.config.unshadow_cap, Some(4));
    let s = c
        .set_scheduler(&json!({"unshadow_cap": null, "policy": "none"}))
        .expect("cap off");
    assert_eq!(s.config.unshadow_cap, None);
    assert!(!s.running);

    let m = c.metrics().expect("metrics");
    for needle in [
        "vgpu_vm_gpu_busy_seconds_total{vm=\"vm1\"} 0",
        "vgpu_vm_weight{vm=\"vm1\"} 700",
        "vgpu_vm_vram_quota_bytes{vm=\"vm2\"} 8388608",
        "vgpu_vm_paused{vm=\"vm2\"} 0",
        "vgpu_sched_policy{policy=\"none\"} 1",
        "# TYPE vgpu_vm_gpu_busy_seconds_total counter",
        "vgpu_api_requests_total{status=\"200\"}",
        "# TYPE vgpu_vm_vram_evictions_total counter",
        "vgpu_vm_vram_evictions_total{vm=\"vm1\"} 0",
        "vgpu_vm_vram_swapped_bytes{vm=\"vm2\"} 0",
        "vgpu_vm_vram_pause_seconds{vm=\"vm1\",which=\"p99\"} 0",
        "vgpu_gpu_vram_free_bytes 67108864",
    ] {
        assert!(m.contains(needle), "metrics lack {needle:?}:\n{m}");
    }
    check_exposition(&m);
}

/// Every sample line is `name{labels} value` with a declared family and a float value.
fn check_exposition(m: &str) {
    let mut declared = std::collections::BTreeSet::new();
    for line in m.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut it = rest.split(' ');
            let name = it.next().expect("name");
            assert!(matches!(it.next(), Some("counter" | "gauge")), "{line}");
            declared.insert(name.to_string());
            continue;
        }
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        let (series, value) = line.rsplit_once(' ').expect("sample line");
        value.parse::<f64>().expect("value");
        let name = series.split('{').next().expect("name");
        assert!(declared.contains(name), "{name} not declared");
        assert!(
            name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_'),
            "{name}"
        );
    }
}

#[test]
fn bad_requests_get_json_errors() {
    let rig = Rig::new("bad", ApiOptions::default());
    let w = "/api/v1/vms/vm1/weight";
    let cases: &[(&str, &str, Option<&str>, u16, &str)] = &[
        ("GET", "/api/v1/nope", None, 404, "not_found"),
        ("GET", "/api/v1/vms/", None, 404, "not_found"),
        ("GET", "/api/v2/info", None, 404, "not_found"),
        ("DELETE", "/api/v1/vms/vm1", None, 405, "method_not_allowed"),
        ("POST", "/api/v1/info", None, 405, "method_not_allowed"),
        ("GET", "/api/v1/vms/ghost", None, 404, "vm_not_found"),
        ("GET", "/api/v1/vms/ghost/stats", None, 404, "vm_not_found"),
        (
            "PUT",
            "/api/v1/vms/ghost/weight",
            Some(r#"{"weight":5}"#),
            404,
            "vm_not_found",
        ),
        ("PUT", "/api/v1/vms/ghost/pause", None, 404, "vm_not_found"),
        ("PUT", w, Some("{"), 400, "invalid_json"),
        ("PUT", w, Some("{\"weight\": 5"), 400, "invalid_json"),
        ("PUT", w, Some("weight=5"), 400, "invalid_json"),
        ("PUT", w, None, 400, "invalid_json"),
        ("PUT", w, Some("[5]"), 400, "invalid_body"),
        ("PUT", w, Some("{}"), 400, "invalid_body"),
        ("PUT", w, Some(r#"{"weight":"5"}"#), 400, "invalid_body"),
        ("PUT", w, Some(r#"{"weight":5,"x":1}"#), 400, "invalid_body"),
        ("PUT", w, Some(r#"{"weight":0}"#), 400, "invalid_weight"),
        ("PUT", w, Some(r#"{"weight":-3}"#), 400, "invalid_weight"),
        ("PUT", w, Some(r#"{"weight":10001}"#), 400, "invalid_weight"),
        ("PUT", w, Some(r#"{"weight":1.5}"#), 400, "invalid_weight"),
        ("PUT", w, Some(r#"{"weight":1e300}"#), 400, "invalid_weight"),
        (
            "PUT",
            w,
            Some(r#"{"weight":99999999999999999999999999}"#),
            400,
            "invalid_weight",
        ),
        (
            "PUT",
            "/api/v1/vms/vm1/vram-quota",
            Some(r#"{"bytes":0}"#),
            400,
            "invalid_quota",
        ),
        (
            "PUT",
            "/api/v1/vms/vm1/vram-quota",
            Some(r#"{"bytes":4097}"#),
            400,
            "invalid_quota",
        ),
        (
            "PUT",
            "/api/v1/vms/vm1/vram-quota",
            Some(r#"{"bytes":18446744073709551615}"#),
            400,
            "invalid_quota",
        ),
        (
            "PUT",
            "/api/v1/vms/vm1/pause",
            Some(r#"{"now":true}"#),
            400,
            "invalid_body",
        ),
        (
            "PUT",
            "/api/v1/vms/vm1/drain",
            Some(r#"{"timeout_ms":0}"#),
            400,
            "out_of_range",
        ),
        (
            "PUT",
            "/api/v1/vms/vm1/drain",
            Some(r#"{"timeout_ms":600000}"#),
            400,
            "out_of_range",
        ),
        (
            "PUT",
            "/api/v1/scheduler",
            Some(r#"{"policy":"fast"}"#),
            400,
            "invalid_config",
        ),
        (
            "PUT",
            "/api/v1/scheduler",
            Some(r#"{"policy":7}"#),
            400,
            "invalid_config",
        ),
        (
            "PUT",
            "/api/v1/scheduler",
            Some(r#"{"watchdog_ms":0}"#),
            400,
            "out_of_range",
        ),
        (
            "PUT",
            "/api/v1/scheduler",
            Some(r#"{"interval_ms":0}"#),
            400,
            "out_of_range",
        ),
        (
            "PUT",
            "/api/v1/scheduler",
            Some(r#"{"interval_ms":1001}"#),
            400,
            "out_of_range",
        ),
        (
            "PUT",
            "/api/v1/scheduler",
            Some(r#"{"unshadow_cap":0}"#),
            400,
            "out_of_range",
        ),
        (
            "PUT",
            "/api/v1/scheduler",
            Some(r#"{"interval":5}"#),
            400,
            "invalid_body",
        ),
    ];
    for (method, path, body, status, code) in cases {
        let (s, v) = rig.raw(method, path, *body);
        assert_error(s, &v, *status, code);
    }
    // Nothing changed.
    assert_eq!(rig.host.backend.vm_weight("vm1"), Some(100));
    assert_eq!(rig.host.backend.scheduler_config(), None);
    // 405 names the allowed methods.
    let r = rig
        .client()
        .raw("GET", "/api/v1/vms/vm1/weight", None)
        .expect("405");
    assert_eq!(r.header("allow"), Some("PUT"));

    let sock = rig.api.path().to_path_buf();
    let raw_cases: &[(&[u8], u16, &str)] = &[
        (
            b"PUT /api/v1/vms/vm1/weight HTTP/1.1\r\nConnection: close\r\nContent-Type: text/plain\r\nContent-Length: 12\r\n\r\n{\"weight\":5}",
            415,
            "unsupported_media_type",
        ),
        (
            b"PUT /api/v1/vms/vm1/weight HTTP/1.1\r\nContent-Length: 100000\r\n\r\n",
            413,
            "payload_too_large",
        ),
        (
            b"PUT /api/v1/vms/vm1/weight HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n",
            501,
            "not_implemented",
        ),
        (b"BLAH\r\n\r\n", 400, "bad_request"),
        (b"GET /api/v1/info HTTP/3\r\n\r\n", 505, "http_version_not_supported"),
    ];
    for (data, status, code) in raw_cases {
        let r = send_raw(&sock, data);
        assert_error(r.status, &body_json(&r), *status, code);
    }
    let mut big = b"GET /api/v1/info HTTP/1.1\r\n".to_vec();
    for i in 0..1000 {
        big.extend_from_slice(format!("X-Pad-{i}: {}\r\n", "a".repeat(20)).as_bytes());
    }
    big.extend_from_slice(b"\r\n");
    let r = send_raw(&sock, &big);
    assert_error(r.status, &body_json(&r), 431, "header_too_large");
    // The server still works.
    rig.client().info().expect("still serving");
}

#[test]
fn keep_alive_and_pipelining() {
    let rig = Rig::new("keepalive", ApiOptions::default());
    let mut s = UnixStream::connect(rig.api.path()).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(20)))
        .expect("timeout");
    let body = r#"{"weight":42}"#;
    let req = format!(
        "GET /api/v1/info HTTP/1.1\r\n\r\nPUT /api/v1/vms/vm2/weight HTTP/1.1\r\nContent-Length: {}\r\n\r\n{body}GET /api/v1/vms/vm2 HTTP/1.1\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(req.as_bytes()).expect("write");
    let mut out = Vec::new();
    s.read_to_end(&mut out).expect("read");
    let text = String::from_utf8_lossy(&out);
    assert_eq!(text.matches("HTTP/1.1 200 OK").count(), 3, "{text}");
    assert!(text.contains("\"weight\":42"), "{text}");
    assert_eq!(rig.host.backend.vm_weight("vm2"), Some(42));
}

#[test]
fn slow_clients_are_cut_off() {
    let rig = Rig::new(
        "slow",
        ApiOptions {
            request_timeout: Duration::from_millis(300),
            idle_timeout: Duration::from_millis(300),
            ..ApiOptions::default()
        },
    );
    // A client that starts a request and stalls gets 408, within bounded time.
    let mut s = UnixStream::connect(rig.api.path()).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(20)))
        .expect("timeout");
    let t0 = Instant::now();
    s.write_all(b"PUT /api/v1/vms/vm1/weight HTTP/1.1\r\nContent-Length: 20\r\n\r\n{\"wei")
        .expect("write");
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let r = parse_response(&out).expect("response");
    assert_error(r.status, &body_json(&r), 408, "request_timeout");
    assert!(t0.elapsed() < Duration::from_secs(10));
    // A client dripping one byte at a time is cut off too.
    let mut s = UnixStream::connect(rig.api.path()).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(20)))
        .expect("timeout");
    let t0 = Instant::now();
    for b in b"GET /api/v1/info HTTP/1.1\r\nX: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa" {
        if s.write_all(&[*b]).is_err() {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let r = parse_response(&out).expect("response");
    assert_eq!(r.status, 408);
    assert!(t0.elapsed() < Duration::from_secs(10));
    // An idle connection is closed without an answer.
    let mut s = UnixStream::connect(rig.api.path()).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(20)))
        .expect("timeout");
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    assert!(out.is_empty());
    rig.client().info().expect("still serving");
}

#[test]
fn concurrent_updates_are_consistent() {
    let rig = Rig::new("concurrent", ApiOptions::default());
    rig.host
        .backend
        .start_scheduler(SchedConfig::default())
        .expect("scheduler");
    let path = rig.api.path().to_path_buf();
    let mut threads = Vec::new();
    for t in 0..8u32 {
        let path = path.clone();
        threads.push(std::thread::spawn(move || {
            let c = ApiClient::new(&path).with_timeout(Duration::from_secs(30));
            for i in 0..15u32 {
                let w = 1 + t * 100 + i;
                c.set_weight("vm1", w).expect("weight");
                // Each thread changes one tunable; partial updates must not undo others.
                match t % 3 {
                    0 => c
                        .set_scheduler(&json!({"threshold_us": 1000 + u64::from(i)}))
                        .map(|_| ()),
                    1 => c.set_scheduler(&json!({"interval_ms": 7})).map(|_| ()),
                    _ => c.pause("vm2").and_then(|_| c.resume("vm2")).map(|_| ()),
                }
                .expect("update");
                c.vm("vm1").expect("read");
            }
            // The last weight this thread wrote.
            1 + t * 100 + 14
        }));
    }
    let lasts: Vec<u32> = threads
        .into_iter()
        .map(|t| t.join().expect("thread"))
        .collect();
    let w = rig.host.backend.vm_weight("vm1").expect("weight");
    assert!(lasts.contains(&w), "weight {w} is one thread's last write");
    let cfg = rig.host.backend.scheduler_config().expect("config");
    assert_eq!(cfg.interval_ms, 7);
    assert_eq!(cfg.threshold_us, 1014);
    assert_eq!(rig.host.backend.vm_paused("vm2"), Some(false));
    let s = rig.client().scheduler().expect("scheduler");
    assert!(s.running);
}

/// Operator requests (`GET /api/v1/vms` through [`ApiClient`]) one after another while an
/// attack runs: each one's latency and outcome.
fn operator_requests(rig: &Rig, n: usize) -> Vec<(Duration, Result<usize, String>)> {
    let c = ApiClient::new(rig.api.path()).with_timeout(Duration::from_secs(5));
    (0..n)
        .map(|_| {
            let t0 = Instant::now();
            let r = c.vms().map(|l| l.vms.len()).map_err(|e| e.to_string());
            (t0.elapsed(), r)
        })
        .collect()
}

/// Every operator request answered with the VM list within 2 s (issue 28 item 6).
fn assert_operator_served(what: &str, outcomes: &[(Duration, Result<usize, String>)]) {
    let worst = outcomes.iter().map(|o| o.0).max().unwrap_or_default();
    eprintln!("{what}: operator requests {outcomes:?}, worst {worst:?}");
    for (t, r) in outcomes {
        assert_eq!(r.as_ref().ok(), Some(&2), "{what}: {r:?} after {t:?}");
        assert!(*t < Duration::from_secs(2), "{what}: answered after {t:?}");
    }
}

/// Reads one response from a kept-alive connection.
fn read_response(s: &mut UnixStream) -> Result<RawResponse, ClientError> {
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = s.read(&mut buf)?;
        out.extend_from_slice(&buf[..n]);
        match parse_response(&out) {
            Ok(r) => return Ok(r),
            Err(e) if n == 0 => return Err(e),
            Err(_) => {}
        }
    }
}

#[test]
fn idle_connections_do_not_lock_out_the_operator() {
    let rig = Rig::new("idle", ApiOptions::default());
    // More connections that send nothing than the server serves at once, held open.
    let held: Vec<UnixStream> = (0..40)
        .map(|_| UnixStream::connect(rig.api.path()).expect("connect"))
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let mut outcomes = operator_requests(&rig, 5);
    // As many connections that ask once, keep the connection and go quiet.
    let mut kept_ok = 0;
    let kept: Vec<UnixStream> = (0..40)
        .map(|_| {
            let mut s = UnixStream::connect(rig.api.path()).expect("connect");
            s.set_read_timeout(Some(Duration::from_secs(5)))
                .expect("timeout");
            s.write_all(b"GET /api/v1/info HTTP/1.1\r\n\r\n")
                .expect("write");
            kept_ok += usize::from(read_response(&mut s).is_ok_and(|r| r.status == 200));
            s
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    outcomes.extend(operator_requests(&rig, 5));
    assert_operator_served("40 idle + 40 idle keep-alive connections", &outcomes);
    assert_eq!(kept_ok, 40, "each keep-alive client was answered");
    drop(kept);
    // Those that sent nothing were left alone: no answer (they asked nothing), not closed
    // (they hold no slot; the idle timeout closes them).
    for mut s in held {
        s.set_nonblocking(true).expect("nonblocking");
        let mut out = [0u8; 64];
        let r = s.read(&mut out);
        assert!(
            matches!(&r, Err(e) if e.kind() == ErrorKind::WouldBlock),
            "{r:?}"
        );
    }
}

#[test]
fn a_slow_request_head_is_cut_off_at_its_own_deadline() {
    let rig = Rig::new(
        "slowhead",
        ApiOptions {
            head_timeout: Duration::from_millis(400),
            ..ApiOptions::default()
        },
    );
    // A head dribbled a byte every 50 ms: 408 at the head deadline, not the request's 5 s.
    let mut s = UnixStream::connect(rig.api.path()).expect("connect");
    s.set_read_timeout(Some(Duration::from_millis(50)))
        .expect("timeout");
    let t0 = Instant::now();
    let mut out = Vec::new();
    for b in b"GET /api/v1/info HTTP/1.1\r\nX-Slow: ".iter().cycle() {
        if s.write_all(&[*b]).is_err() || t0.elapsed() > Duration::from_secs(10) {
            break;
        }
        match s.read_to_end(&mut out) {
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            _ => break,
        }
    }
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let _ = s.read_to_end(&mut out);
    let r = parse_response(&out).expect("response");
    assert_error(r.status, &body_json(&r), 408, "request_timeout");
    assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
    // A body may arrive after the head deadline (within the request's).
    let mut s = UnixStream::connect(rig.api.path()).expect("connect");
    s.write_all(
        b"PUT /api/v1/vms/vm1/weight HTTP/1.1\r\nConnection: close\r\nContent-Length: 14\r\n\r\n",
    )
    .expect("head");
    std::thread::sleep(Duration::from_millis(700));
    s.write_all(br#"{"weight":321}"#).expect("body");
    let mut out = Vec::new();
    s.read_to_end(&mut out).expect("read");
    assert_eq!(parse_response(&out).expect("response").status, 200);
    assert_eq!(rig.host.backend.vm_weight("vm1"), Some(321));
}

/// A slow-loris client: sends a request head one byte every 200 ms, never finishing it;
/// when the server answers or closes, connects again. Returns how each connection the
/// server ended was answered: its status and whether it carried `Retry-After` (`None`: no
/// answer).
fn slow_loris(path: &Path, stop: &AtomicBool) -> Vec<Option<(u16, bool)>> {
    let head =
        b"GET /api/v1/info HTTP/1.1\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
    let mut ended = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        let Ok(mut s) = UnixStream::connect(path) else {
            std::thread::sleep(Duration::from_millis(50));
            continue;
        };
        // The read timeout paces the bytes.
        s.set_read_timeout(Some(Duration::from_millis(200)))
            .expect("timeout");
        let mut out = Vec::new();
        let mut buf = [0u8; 1024];
        for b in head.iter().cycle() {
            if stop.load(Ordering::Relaxed) {
                return ended;
            }
            if s.write_all(&[*b]).is_err() {
                break;
            }
            match s.read(&mut buf) {
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
                Ok(n) => {
                    out.extend_from_slice(&buf[..n]);
                    break;
                }
                Err(_) => break,
            }
        }
        // Answered or closed: read the rest of the answer, then start over.
        s.set_read_timeout(Some(Duration::from_secs(2)))
            .expect("timeout");
        let _ = s.read_to_end(&mut out);
        ended.push(
            parse_response(&out)
                .ok()
                .map(|r| (r.status, r.header("retry-after").is_some())),
        );
    }
    ended
}

#[test]
fn slow_loris_clients_do_not_delay_the_operator() {
    let rig = Rig::new("loris", ApiOptions::default());
    let stop = Arc::new(AtomicBool::new(false));
    let lorises: Vec<_> = (0..40)
        .map(|_| {
            let (path, stop) = (rig.api.path().to_path_buf(), stop.clone());
            std::thread::spawn(move || slow_loris(&path, &stop))
        })
        .collect();
    // Let them take every connection slot.
    std::thread::sleep(Duration::from_millis(1500));
    let outcomes = operator_requests(&rig, 5);
    stop.store(true, Ordering::Relaxed);
    let ended: Vec<Option<(u16, bool)>> = lorises
        .into_iter()
        .flat_map(|t| t.join().expect("loris"))
        .collect();
    let count = |want: Option<(u16, bool)>| ended.iter().filter(|e| **e == want).count();
    eprintln!(
        "40 slow-loris clients: {} connections ended: {} answered 408, {} 503 with Retry-After, {} not answered",
        ended.len(),
        count(Some((408, false))),
        count(Some((503, true))),
        count(None)
    );
    assert_operator_served("40 slow-loris clients", &outcomes);
    // Each was cut off with an answer: 408 at its head deadline, or 503 (Retry-After) when
    // evicted for another request or never seated.
    assert!(
        ended
            .iter()
            .all(|e| matches!(e, Some((408, false)) | Some((503, true)))),
        "{ended:?}"
    );
}

#[test]
fn a_burst_of_clients_all_get_an_answer() {
    const CLIENTS: usize = 300;
    let rig = Rig::new("burst", ApiOptions::default());
    // All connect first, then all send: every connection is open at once.
    let start = Arc::new(Barrier::new(CLIENTS));
    let clients: Vec<_> = (0..CLIENTS)
        .map(|_| {
            let (path, start) = (rig.api.path().to_path_buf(), start.clone());
            std::thread::spawn(move || {
                let s = UnixStream::connect(&path);
                start.wait();
                let t0 = Instant::now();
                let r = s.map_err(ClientError::from).and_then(|mut s| {
                    s.set_read_timeout(Some(Duration::from_secs(15)))?;
                    // A refused connection may be answered before its request is written.
                    let _ = s.write_all(b"GET /api/v1/vms HTTP/1.1\r\nConnection: close\r\n\r\n");
                    let mut out = Vec::new();
                    s.read_to_end(&mut out)?;
                    parse_response(&out)
                });
                (t0.elapsed(), r)
            })
        })
        .collect();
    let outcomes: Vec<(Duration, Result<RawResponse, ClientError>)> = clients
        .into_iter()
        .map(|t| t.join().expect("client"))
        .collect();
    let count = |f: &dyn Fn(&RawResponse) -> bool| {
        outcomes
            .iter()
            .filter(|(_, r)| r.as_ref().is_ok_and(f))
            .count()
    };
    let ok = count(&|r| r.status == 200);
    let busy = count(&|r| r.status == 503 && r.header("retry-after").is_some());
    let worst = outcomes.iter().map(|o| o.0).max().unwrap_or_default();
    let unanswered: Vec<String> = outcomes
        .iter()
        .filter_map(|(_, r)| match r {
            Ok(r) if r.status == 200 || r.status == 503 => None,
            Ok(r) => Some(format!("status {}", r.status)),
            Err(e) => Some(e.to_string()),
        })
        .collect();
    eprintln!(
        "{CLIENTS} concurrent clients: {ok} answered 200, {busy} answered 503 with Retry-After, {} not answered, slowest {worst:?}",
        unanswered.len()
    );
    let mut kinds: Vec<&String> = unanswered.iter().collect();
    kinds.dedup();
    assert!(
        unanswered.is_empty(),
        "{} not answered: {kinds:?}",
        unanswered.len()
    );
    assert_eq!(ok + busy, CLIENTS, "every 503 carries Retry-After");
    assert!(worst < Duration::from_secs(2), "slowest answer {worst:?}");
    // The server still works.
    rig.client().info().expect("still serving");
}

#[test]
fn client_reports_api_errors() {
    let rig = Rig::new("client", ApiOptions::default());
    match rig.client().set_weight("ghost", 5) {
        Err(ClientError::Api { status, code, .. }) => {
            assert_eq!((status, code.as_str()), (404, "vm_not_found"))
        }
        other => panic!("{other:?}"),
    }
    let gone = ApiClient::new(rig.host.dir.join("nothing.sock"));
    assert!(matches!(gone.info(), Err(ClientError::Connect { .. })));
}

fn vgpuctl(sock: &Path, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_vgpuctl"))
        .arg("--socket")
        .arg(sock)
        .args(args)
        .output()
        .expect("run vgpuctl");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn vgpuctl_drives_the_api() {
    let rig = Rig::new("ctl", ApiOptions::default());
    let sock = rig.api.path().to_path_buf();
    let (ok, out, _) = vgpuctl(&sock, &["info"]);
    assert!(ok && out.contains("sim") && out.contains("policy"), "{out}");
    let (ok, out, _) = vgpuctl(&sock, &["vm", "list"]);
    assert!(
        ok && out.starts_with("NAME") && out.contains("vm2"),
        "{out}"
    );
    let (ok, out, err) = vgpuctl(&sock, &["vm", "set-weight", "vm1", "250"]);
    assert!(ok, "{err}");
    assert!(out.contains("weight 250"), "{out}");
    assert_eq!(rig.host.backend.vm_weight("vm1"), Some(250));
    let (ok, _, err) = vgpuctl(&sock, &["vm", "set-weight", "vm1", "0"]);
    assert!(!ok && err.contains("invalid_weight"), "{err}");
    let (ok, _, err) = vgpuctl(&sock, &["vm", "set-weight", "vm1", "20000"]);
    assert!(!ok && err.contains("10000"), "{err}");
    let (ok, _, err) = vgpuctl(&sock, &["vm", "show", "ghost"]);
    assert!(!ok && err.contains("vm_not_found"), "{err}");
    let (ok, _, err) = vgpuctl(&sock, &["vm", "set-vram-quota", "vm2", "16M"]);
    assert!(ok, "{err}");
    assert_eq!(
        rig.host.backend.vm_limits("vm2").map(|l| l.vram_bytes),
        Some(16 << 20)
    );
    let (ok, out, _) = vgpuctl(&sock, &["--json", "vm", "show", "vm2"]);
    assert!(ok);
    let v: Value = serde_json::from_str(&out).expect("json");
    assert_eq!(v["limits"]["vram_bytes"], 16 << 20);
    let (ok, out, _) = vgpuctl(&sock, &["vm", "pause", "vm2"]);
    assert!(ok && out.contains("paused"), "{out}");
    let (ok, out, _) = vgpuctl(&sock, &["vm", "drain", "vm2", "--timeout-ms", "500"]);
    assert!(ok && out.contains("drained"), "{out}");
    let (ok, out, _) = vgpuctl(&sock, &["--json", "vm", "resume", "vm2"]);
    assert!(ok);
    let v: Value = serde_json::from_str(&out).expect("json");
    assert_eq!(v["paused"], false);
    let (ok, out, _) = vgpuctl(&sock, &["vm", "stats", "vm1"]);
    assert!(ok && out.contains("SHARE 10s"), "{out}");
    assert!(out.contains("VRAM swapping: 0 evictions"), "{out}");
    let (ok, out, err) = vgpuctl(&sock, &["vm", "vram", "vm1"]);
    assert!(ok, "{err}");
    assert!(
        out.contains("evictions (bytes out)") && out.contains("swap-ins (bytes in)"),
        "{out}"
    );
    let (ok, out, _) = vgpuctl(&sock, &["--json", "vm", "vram", "vm2"]);
    assert!(ok);
    let v: Value = serde_json::from_str(&out).expect("json");
    assert_eq!(v["quota_bytes"], 16 << 20);
    assert_eq!(v["evictions"], 0);
    assert_eq!(v["processes"], json!([]));
    let (ok, _, err) = vgpuctl(&sock, &["vm", "vram", "ghost"]);
    assert!(!ok && err.contains("vm_not_found"), "{err}");
    let (ok, out, err) = vgpuctl(
        &sock,
        &["sched", "set", "--policy", "fair", "--interval-ms", "20"],
    );
    assert!(ok, "{err}");
    assert!(out.contains("fair") && out.contains("20"), "{out}");
    let (ok, out, _) = vgpuctl(&sock, &["--json", "sched", "show"]);
    assert!(ok);
    let v: Value = serde_json::from_str(&out).expect("json");
    assert_eq!(v["config"]["interval_ms"], 20);
    let (ok, _, err) = vgpuctl(&sock, &["sched", "set", "--unshadow-cap", "lots"]);
    assert!(!ok && err.contains("unshadow-cap"), "{err}");
    let (ok, out, _) = vgpuctl(&sock, &["metrics"]);
    assert!(
        ok && out.contains("vgpu_vm_weight{vm=\"vm1\"} 250"),
        "{out}"
    );
    let (ok, _, err) = vgpuctl(&rig.host.dir.join("none.sock"), &["info"]);
    assert!(!ok && err.contains("none.sock"), "{err}");
}

/// The daemon from a config file (with a flag overriding it), queried through its API.
#[test]
fn daemon_serves_its_config() {
    let dir = std::env::temp_dir().join(format!("vgpu-api-daemon-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let api = dir.join("api.sock");
    let cfg = dir.join("backend.toml");
    std::fs::write(
        &cfg,
        format!(
            "socket_dir = \"{d}\"\n[gpu]\nvram_mib = 96\n[api]\nsocket = \"{a}\"\n\
             [scheduler]\npolicy = \"fair\"\ninterval_ms = 15\n[defaults]\nweight = 50\n\
             [[vm]]\nname = \"a\"\nvram_mib = 32\n[[vm]]\nname = \"b\"\nweight = 400\n",
            d = dir.display(),
            a = api.display()
        ),
    )
    .expect("config");
    let mut child = Command::new(env!("CARGO_BIN_EXE_vgpu-backend"))
        .arg("--config")
        .arg(&cfg)
        .args(["--sched-interval-ms", "25"])
        .stderr(Stdio::null())
        .spawn()
        .expect("daemon");
    let c = ApiClient::new(&api);
    let t0 = Instant::now();
    let info = loop {
        match c.info() {
            Ok(i) => break i,
            Err(e) if t0.elapsed() > Duration::from_secs(20) => {
                let _ = child.kill();
                panic!("daemon API: {e}")
            }
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    };
    let result = std::panic::catch_unwind(|| {
        assert_eq!(info.gpu.vram_bytes, 96 << 20);
        assert_eq!(info.policy, "fair");
        let a = c.vm("a").expect("a");
        assert_eq!((a.weight, a.limits.vram_bytes), (50, 32 << 20));
        let b = c.vm("b").expect("b");
        assert_eq!((b.weight, b.limits.vram_bytes), (400, 96 << 20));
        assert!(dir.join("a.sock").exists());
        // The flag overrode the file.
        assert_eq!(c.scheduler().expect("sched").config.interval_ms, 25);
    });
    // SAFETY: plain kill(2) on our own child's pid.
    unsafe {
        libc::kill(child.id() as i32, libc::SIGTERM);
    }
    let status = child.wait().expect("wait");
    let _ = std::fs::remove_dir_all(&dir);
    result.expect("checks");
    assert!(status.success(), "{status:?}");

    // A bad config is refused with a clear message.
    let bad = std::env::temp_dir().join(format!("vgpu-api-bad-{}.toml", std::process::id()));
    std::fs::write(&bad, "[scheduler]\ninterval_ms = 0\n").expect("bad config");
    let out = Command::new(env!("CARGO_BIN_EXE_vgpu-backend"))
        .arg("--config")
        .arg(&bad)
        .args(["--vm", "x", "--socket-dir", "/tmp"])
        .output()
        .expect("daemon");
    let _ = std::fs::remove_file(&bad);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("scheduler.interval_ms = 0"), "{err}");
}
