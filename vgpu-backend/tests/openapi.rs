//! `docs/api/openapi.json` against the real server:
//! - the documented operations are exactly the server's routes;
//! - every documented operation answers through the socket, with a documented status and a
//!   body that matches its documented schema;
//! - a property test generates requests from the document's schemas — valid bodies and
//!   bodies broken in one place (unknown field, missing field, wrong type, out of range,
//!   malformed JSON) for existing and unknown VMs — and checks that valid requests succeed,
//!   invalid ones are refused with 400, and every answer is documented and matches its
//!   schema.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use serde_json::{json, Map, Value};
use vgpu_backend::api::client::ApiClient;
use vgpu_backend::api::routes::ROUTES;
use vgpu_backend::api::{ApiOptions, ApiServer};
use vgpu_backend::VmLimits;
use vgpu_test_support::Host;

const VMS: [&str; 2] = ["vm1", "vm2"];

fn doc() -> Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../docs/api/openapi.json");
    let text = std::fs::read_to_string(&path).expect("openapi.json");
    serde_json::from_str(&text).expect("openapi.json is JSON")
}

/// One documented operation.
#[derive(Debug, Clone)]
struct Op {
    path: String,
    method: String,
    /// The request body schema and whether a body is required.
    body: Option<(Value, bool)>,
    /// Documented statuses with their schema (`None`: not JSON).
    responses: Vec<(u16, Option<Value>)>,
}

fn resolve<'a>(doc: &'a Value, s: &'a Value) -> &'a Value {
    match s.get("$ref").and_then(Value::as_str) {
        Some(r) => {
            let name = r.trim_start_matches("#/components/schemas/");
            resolve(doc, &doc["components"]["schemas"][name])
        }
        None => s,
    }
}

fn ops(doc: &Value) -> Vec<Op> {
    let mut out = Vec::new();
    for (path, item) in doc["paths"].as_object().expect("paths") {
        for (method, op) in item.as_object().expect("path item") {
            if method == "parameters" {
                continue;
            }
            let body = op.get("requestBody").map(|b| {
                (
                    resolve(doc, &b["content"]["application/json"]["schema"]).clone(),
                    b["required"].as_bool().unwrap_or(false),
                )
            });
            let responses = op["responses"]
                .as_object()
                .expect("responses")
                .iter()
                .map(|(code, r)| {
                    (
                        code.parse::<u16>().expect("status"),
                        r["content"]
                            .get("application/json")
                            .map(|c| resolve(doc, &c["schema"]).clone()),
                    )
                })
                .collect();
            out.push(Op {
                path: path.clone(),
                method: method.to_uppercase(),
                body,
                responses,
            });
        }
    }
    out
}

/// Whether `v` matches `schema` (the subset of OpenAPI 3.0 schemas the document uses).
fn valid(doc: &Value, v: &Value, schema: &Value) -> Result<(), String> {
    let s = resolve(doc, schema);
    if v.is_null() {
        return if s["nullable"].as_bool() == Some(true) {
            Ok(())
        } else {
            Err("null".into())
        };
    }
    if let Some(e) = s.get("enum").and_then(Value::as_array) {
        if !e.contains(v) {
            return Err(format!("{v} not in {e:?}"));
        }
    }
    match s["type"].as_str() {
        Some("object") => {
            let o = v.as_object().ok_or(format!("{v} not an object"))?;
            let props = s["properties"].as_object().cloned().unwrap_or_default();
            for r in s["required"].as_array().into_iter().flatten() {
                let r = r.as_str().unwrap_or_default();
                if !o.contains_key(r) {
                    return Err(format!("missing {r}"));
                }
            }
            for (k, x) in o {
                match props.get(k) {
                    Some(p) => valid(doc, x, p).map_err(|e| format!("{k}: {e}"))?,
                    None if s["additionalProperties"] == json!(false) => {
                        return Err(format!("unknown field {k}"))
                    }
                    None => {}
                }
            }
            Ok(())
        }
        Some("array") => {
            for x in v.as_array().ok_or(format!("{v} not an array"))? {
                valid(doc, x, &s["items"])?;
            }
            Ok(())
        }
        Some("string") => v.as_str().map(|_| ()).ok_or(format!("{v} not a string")),
        Some("boolean") => v.as_bool().map(|_| ()).ok_or(format!("{v} not a bool")),
        Some("integer") => {
            let n = v
                .as_u64()
                .ok_or(format!("{v} not a non-negative integer"))?;
            if s["minimum"].as_u64().is_some_and(|m| n < m)
                || s["maximum"].as_u64().is_some_and(|m| n > m)
                || s["multipleOf"].as_u64().is_some_and(|m| n % m != 0)
            {
                return Err(format!("{n} out of range"));
            }
            Ok(())
        }
        Some("number") => {
            let n = v.as_f64().ok_or(format!("{v} not a number"))?;
            if s["minimum"].as_f64().is_some_and(|m| n < m)
                || s["maximum"].as_f64().is_some_and(|m| n > m)
            {
                return Err(format!("{n} out of range"));
            }
            Ok(())
        }
        other => Err(format!("unsupported schema type {other:?}")),
    }
}

/// Values matching `schema`.
fn gen(doc: &Value, schema: &Value) -> BoxedStrategy<Value> {
    let s = resolve(doc, schema).clone();
    let inner = if let Some(e) = s.get("enum").and_then(Value::as_array) {
        proptest::sample::select(e.clone()).boxed()
    } else {
        match s["type"].as_str() {
            Some("object") => {
                let required: BTreeSet<String> = s["required"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|r| r.as_str().map(String::from))
                    .collect();
                let fields: Vec<BoxedStrategy<Option<(String, Value)>>> = s["properties"]
                    .as_object()
                    .cloned()
                    .unwrap_or_default()
                    .into_iter()
                    .map(|(k, p)| {
                        let g = gen(doc, &p);
                        let k2 = k.clone();
                        if required.contains(&k) {
                            g.prop_map(move |v| Some((k2.clone(), v))).boxed()
                        } else {
                            proptest::option::of(g.prop_map(move |v| (k2.clone(), v))).boxed()
                        }
                    })
                    .collect();
                fields
                    .prop_map(|fs| Value::Object(fs.into_iter().flatten().collect::<Map<_, _>>()))
                    .boxed()
            }
            Some("integer") => {
                let lo = s["minimum"].as_u64().unwrap_or(0);
                let hi = s["maximum"].as_u64().unwrap_or(1 << 53);
                let m = s["multipleOf"].as_u64().unwrap_or(1).max(1);
                let (klo, khi) = (lo.div_ceil(m), hi / m);
                prop_oneof![Just(klo), Just(khi), klo..=khi]
                    .prop_map(move |k| json!(k * m))
                    .boxed()
            }
            Some("number") => (0.0f64..1e6).prop_map(|x| json!(x)).boxed(),
            Some("boolean") => any::<bool>().prop_map(Value::Bool).boxed(),
            _ => "[a-z]{0,8}".prop_map(Value::String).boxed(),
        }
    };
    if s["nullable"].as_bool() == Some(true) {
        prop_oneof![1 => Just(Value::Null), 3 => inner].boxed()
    } else {
        inner
    }
}

/// Breaks a valid object in one place.
fn mutate(doc: &Value, schema: &Value, mut v: Value, how: usize, at: Index) -> Value {
    let s = resolve(doc, schema);
    let Some(o) = v.as_object_mut() else {
        return json!([v]);
    };
    let keys: Vec<String> = s["properties"]
        .as_object()
        .map(|p| p.keys().cloned().collect())
        .unwrap_or_default();
    let key = (!keys.is_empty()).then(|| keys[at.index(keys.len())].clone());
    match (how, key) {
        (0, _) | (_, None) => {
            o.insert("zz_unknown".into(), json!(1));
        }
        (1, Some(k)) => {
            o.remove(&k);
        }
        (2, Some(k)) => {
            let p = resolve(doc, &s["properties"][&k]);
            let wrong = if p["type"] == "string" {
                json!(12)
            } else {
                json!("x")
            };
            o.insert(k, wrong);
        }
        (3, Some(k)) => {
            o.insert(k, json!(-1));
        }
        (4, Some(k)) => {
            let p = resolve(doc, &s["properties"][&k]);
            let big = match p["maximum"].as_u64() {
                Some(m) => json!(m + 1),
                None => json!(1e300),
            };
            o.insert(k, big);
        }
        (_, Some(k)) => {
            o.insert(k, json!(1.5));
        }
    }
    v
}

struct Rig {
    host: Host,
    api: ApiServer,
}

impl Rig {
    fn new(tag: &str) -> Rig {
        let host = Host::new(
            &format!("openapi-{tag}"),
            64 << 20,
            VmLimits::default(),
            &VMS,
        );
        let api = ApiServer::start(
            &host.backend,
            &host.dir.join("api.sock"),
            ApiOptions::default(),
        )
        .expect("api");
        Rig { host, api }
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        self.api.shutdown();
    }
}

#[test]
fn documented_operations_are_the_routes() {
    let d = doc();
    let documented: BTreeSet<(String, String)> =
        ops(&d).into_iter().map(|o| (o.path, o.method)).collect();
    let routed: BTreeSet<(String, String)> = ROUTES
        .iter()
        .flat_map(|(p, ms)| ms.iter().map(move |m| (p.to_string(), m.to_string())))
        .collect();
    assert_eq!(documented, routed);
    // Every schema reference resolves.
    let text = d.to_string();
    for r in text.split("\"$ref\":\"").skip(1) {
        let name = r
            .split('"')
            .next()
            .unwrap_or_default()
            .trim_start_matches("#/components/schemas/");
        assert!(
            d["components"]["schemas"].get(name).is_some(),
            "dangling $ref {name}"
        );
    }
}

/// Sends `op` for VM `name` with `body`; checks the answer is documented and matches its
/// schema; returns the status and body.
fn call(
    d: &Value,
    c: &ApiClient,
    op: &Op,
    name: &str,
    body: Option<&str>,
) -> Result<(u16, Value), String> {
    let path = op.path.replace("{name}", name);
    let r = c
        .raw(&op.method, &path, body.map(str::as_bytes))
        .map_err(|e| e.to_string())?;
    let (_, schema) = op
        .responses
        .iter()
        .find(|(s, _)| *s == r.status)
        .ok_or_else(|| {
            format!(
                "{} {path} {body:?}: undocumented status {}: {}",
                op.method,
                r.status,
                String::from_utf8_lossy(&r.body)
            )
        })?;
    let v = match schema {
        Some(schema) => {
            let v: Value = serde_json::from_slice(&r.body)
                .map_err(|e| format!("{} {path}: not JSON: {e}", op.method))?;
            valid(d, &v, schema)
                .map_err(|e| format!("{} {path} -> {}: {e}: {v}", op.method, r.status))?;
            v
        }
        None => Value::String(String::from_utf8_lossy(&r.body).into_owned()),
    };
    Ok((r.status, v))
}

#[test]
fn every_documented_operation_answers() {
    let d = doc();
    let rig = Rig::new("each");
    let c = ApiClient::new(rig.api.path()).with_timeout(Duration::from_secs(30));
    // Let the sampler fill the share windows so that they are checked too.
    std::thread::sleep(Duration::from_millis(500));
    for op in ops(&d) {
        let body = op.body.as_ref().map(|(schema, _)| {
            // The smallest valid body: required fields at their minimum.
            let mut o = Map::new();
            for r in schema["required"].as_array().into_iter().flatten() {
                let k = r.as_str().unwrap_or_default();
                let p = resolve(&d, &schema["properties"][k]);
                let v = match p.get("enum").and_then(Value::as_array) {
                    Some(e) => e[0].clone(),
                    None => json!(p["minimum"].as_u64().unwrap_or(1)),
                };
                o.insert(k.into(), v);
            }
            Value::Object(o).to_string()
        });
        let (status, v) = call(&d, &c, &op, "vm1", body.as_deref()).expect("call");
        assert_eq!(status, 200, "{} {}: {v}", op.method, op.path);
    }
}

#[test]
fn generated_requests_follow_the_document() {
    let d = Arc::new(doc());
    let ops = Arc::new(ops(&d));
    let rig = Rig::new("prop");
    let c = ApiClient::new(rig.api.path()).with_timeout(Duration::from_secs(30));
    let (d2, ops2) = (d.clone(), ops.clone());
    let strategy = (0..ops.len()).prop_flat_map(move |i| {
        let op = &ops2[i];
        let name = prop_oneof![
            4 => proptest::sample::select(VMS.to_vec()).prop_map(String::from),
            1 => "[A-Za-z0-9_.-]{1,12}".prop_filter("not a VM", |n| !VMS.contains(&n.as_str())),
        ];
        // (body text, whether it is valid)
        let body: BoxedStrategy<Option<(String, bool)>> = match &op.body {
            None => Just(None).boxed(),
            Some((schema, required)) => {
                let ok = gen(&d2, schema);
                let (d3, s3) = (d2.clone(), schema.clone());
                let broken = (gen(&d2, schema), 0..6usize, any::<Index>())
                    .prop_map(move |(v, how, at)| mutate(&d3, &s3, v, how, at));
                let (d4, s4) = (d2.clone(), schema.clone());
                let judged = prop_oneof![3 => ok, 3 => broken].prop_map(move |v| {
                    let is_valid = valid(&d4, &v, &s4).is_ok();
                    Some((v.to_string(), is_valid))
                });
                let required = *required;
                prop_oneof![
                    8 => judged,
                    1 => Just(Some(("{\"a\":".to_string(), false))),
                    1 => Just(if required { Some((String::new(), false)) } else { None }),
                ]
                .boxed()
            }
        };
        (Just(i), name, body)
    });
    let mut runner = TestRunner::new(Config {
        cases: 400,
        failure_persistence: None,
        ..Config::default()
    });
    let seen = std::sync::Mutex::new(std::collections::BTreeMap::<u16, u32>::new());
    let result = runner.run(&strategy, |(i, name, body)| {
        let op = &ops[i];
        let text = body.as_ref().map(|(t, _)| t.as_str());
        let (status, v) = call(&d, &c, op, &name, text).map_err(TestCaseError::fail)?;
        *seen
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(status)
            .or_default() += 1;
        let exists = VMS.contains(&name.as_str());
        let body_ok = body.as_ref().is_none_or(|(_, ok)| *ok);
        let what = format!("{} {} {name} {text:?} -> {status} {v}", op.method, op.path);
        if op.path.contains("{name}") && !exists {
            prop_assert_eq!(status, 404, "{}", what);
            prop_assert_eq!(&v["code"], "vm_not_found", "{}", what);
        } else if !body_ok {
            prop_assert_eq!(status, 400, "{}", what);
        } else if status == 400 {
            // The one refusal of a valid body the document names: a policy not implemented.
            prop_assert_eq!(&v["code"], "policy_not_implemented", "{}", what);
        } else {
            prop_assert_eq!(status, 200, "{}", what);
        }
        Ok(())
    });
    // Leave the shared state sane for the checks below.
    rig.host.backend.set_vm_weight("vm1", 100).expect("reset");
    if let Err(e) = result {
        panic!("{e}");
    }
    // The generator reached every kind of answer.
    let seen = seen.into_inner().unwrap_or_else(|e| e.into_inner());
    println!("statuses: {seen:?}");
    for status in [200, 400, 404] {
        assert!(seen.get(&status).is_some_and(|n| *n >= 10), "{seen:?}");
    }
    // The server survived it all.
    c.info().expect("still serving");
}

/// The VRAM body with processes (the server's answers here have none: no guest runs) is
/// what the document's `VmVram` schema says, field for field.
#[test]
fn vram_body_with_processes_matches_its_schema() {
    use vgpu_backend::api::types::VmVramBody;
    use vgpu_backend::{ProcVramStats, VmVramStats, VramReport};
    let d = doc();
    let report = VramReport {
        vm: VmVramStats {
            quota_bytes: 64 << 20,
            resident_bytes: 2 << 20,
            swapped_bytes: 4 << 20,
            evictions: 3,
            swap_ins: 1,
            pauses: 2,
            pause_ns_total: 5_000,
            pause_ns_max: 4_000,
            ..VmVramStats::default()
        },
        procs: vec![ProcVramStats {
            pid: u32::MAX,
            evictions: 3,
            pause_ns: 5_000,
            ..ProcVramStats::default()
        }],
        pause_p50_ns: 1_000,
        pause_p99_ns: 4_000,
    };
    let body = serde_json::to_value(VmVramBody::from(&report)).expect("body");
    valid(&d, &body, &json!({"$ref": "#/components/schemas/VmVram"})).expect("VmVram");
    assert_eq!(body["processes"][0]["pid"], u32::MAX);
    assert_eq!(body["pause_p99_ns"], 4_000);
    // A field the document does not know is refused.
    let mut extra = body.clone();
    extra["processes"][0]["bogus"] = json!(1);
    assert!(valid(&d, &extra, &json!({"$ref": "#/components/schemas/VmVram"})).is_err());
}

/// A destination's migration body after a load (the server's answers here have none) is
/// what the document's `Migration` and `MigrationPolicy` schemas say.
#[test]
fn migration_body_with_a_policy_matches_its_schema() {
    use vgpu_backend::api::types::MigrationBody;
    use vgpu_backend::{MigrationPhase, MigrationProgress, StreamPolicy};
    let d = doc();
    let p = MigrationProgress {
        phase: MigrationPhase::Loaded,
        policy: Some(StreamPolicy {
            weight: 100,
            vram_quota: 512 << 20,
            stream_weight: 10_000,
            stream_vram_quota: 1 << 40,
        }),
        ..MigrationProgress::default()
    };
    let body = serde_json::to_value(MigrationBody::from(&p)).expect("body");
    valid(
        &d,
        &body,
        &json!({"$ref": "#/components/schemas/Migration"}),
    )
    .expect("Migration");
    assert_eq!(body["policy"]["ignored"], json!(["weight", "vram_quota"]));
    let none =
        serde_json::to_value(MigrationBody::from(&MigrationProgress::default())).expect("body");
    assert!(none["policy"].is_null());
    valid(
        &d,
        &none,
        &json!({"$ref": "#/components/schemas/Migration"}),
    )
    .expect("no policy");
    let mut extra = body.clone();
    extra["policy"]["bogus"] = json!(1);
    assert!(valid(
        &d,
        &extra,
        &json!({"$ref": "#/components/schemas/Migration"})
    )
    .is_err());
}
