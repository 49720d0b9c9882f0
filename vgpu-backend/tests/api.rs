//! The control API through its real unix socket: every endpoint, bad input of every kind,
//! slow and concurrent clients, `vgpuctl`, and the daemon started from a TOML config.
//! (Pause, drain and weights with guest work running are in
//! `bench/tests/api_loopback.rs`.)

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Command, Stdio};
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

#[test]
fn too_many_connections_get_503() {
    let rig = Rig::new("conns", ApiOptions::default());
    // Hold MAX_CONNECTIONS idle connections open.
    let held: Vec<UnixStream> = (0..vgpu_backend::api::MAX_CONNECTIONS)
        .map(|_| UnixStream::connect(rig.api.path()).expect("connect"))
        .collect();
    // Give the accept loop time to take them all.
    std::thread::sleep(Duration::from_millis(300));
    let r = rig
        .client()
        .raw("GET", "/api/v1/info", None)
        .expect("answer");
    assert_error(r.status, &body_json(&r), 503, "too_many_connections");
    drop(held);
    let t0 = Instant::now();
    loop {
        match rig.client().info() {
            Ok(_) => break,
            Err(e) if t0.elapsed() > Duration::from_secs(10) => panic!("{e}"),
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
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
