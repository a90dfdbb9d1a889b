//! `ferrite serve --isolate --lora-modules ...`: the engine runs in a child process and the
//! adapters are loaded there (`LoadAdapter` over the socket). Over HTTP: the start-up adapters
//! are listed with their base and give PEFT's greedy tokens (the base model its own
//! reference); an adapter loaded at run time serves, one unloaded is gone, a bad one is a 400;
//! after a `kill -9` of the child, the restarted engine serves the same adapters with the same
//! tokens.

mod serve_common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use serve_common::{client, serve, Server};

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").join(path)
}

fn lora_dir(name: &str) -> PathBuf {
    repo("tests/fixtures/lora").join(name)
}

fn read_json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).expect("read")).expect("json")
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().expect("ids").iter().map(|x| x.as_u64().expect("id") as u32).collect()
}

fn start() -> Server {
    let model = format!("llama={}", repo("tests/fixtures/models/llama").display());
    let mut args: Vec<String> =
        ["--isolate", "--model", &model, "--threads", "1", "--lora-modules"].map(String::from).into();
    args.extend(["qv", "all"].map(|n| format!("{n}={}", lora_dir(n).display())));
    serve(&args)
}

async fn post(server: &Server, path: &str, body: &Value) -> (u16, Value) {
    let resp = client().post(format!("{}{path}", server.url)).json(body).send().await.expect("request");
    let status = resp.status().as_u16();
    let text = resp.text().await.expect("body");
    (status, serde_json::from_str(&text).unwrap_or(Value::String(text)))
}

async fn get(server: &Server, path: &str) -> Value {
    client().get(format!("{}{path}", server.url)).send().await.expect("request").json().await.expect("json")
}

/// Greedy token ids of `prompt` through `model` (status, ids).
async fn tokens(server: &Server, model: &str, prompt: &[u32], n: usize) -> (u16, Vec<u32>) {
    let body = json!({"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": true,
                      "return_token_ids": true});
    let (status, resp) = post(server, "/v1/completions", &body).await;
    (status, if status == 200 { ids(&resp["choices"][0]["token_ids"]) } else { Vec::new() })
}

async fn pid(server: &Server) -> u32 {
    let m = get(server, "/v1/models/llama").await;
    m["pid"].as_u64().unwrap_or_else(|| panic!("a pid: {m}")) as u32
}

#[test]
fn isolated_engines_serve_lora_adapters_across_loads_and_restarts() {
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    runtime.block_on(async {
        let server = start();
        let base_ref = read_json(&repo("tests/fixtures/models/llama/reference.json"));
        let lora_ref = read_json(&lora_dir("reference.json"));
        let prompt = ids(&base_ref["prompts"][1]);
        let want = |adapter: Option<&str>| match adapter {
            None => ids(&base_ref["greedy"][1])[..16].to_vec(),
            Some(a) => ids(&lora_ref["adapters"][a]["greedy"][1]),
        };
        let check = |names: &'static [(&'static str, Option<&'static str>)]| {
            let (server, prompt) = (&server, &prompt);
            async move {
                for &(model, adapter) in names {
                    let (status, got) = tokens(server, model, prompt, 16).await;
                    assert_eq!(status, 200, "{model}");
                    assert_eq!(got, want(adapter), "{model}: the tokens of {adapter:?}");
                }
            }
        };

        let models = get(&server, "/v1/models").await;
        for name in ["qv", "all"] {
            let m = models["data"].as_array().expect("data").iter().find(|m| m["id"] == name).expect("listed");
            assert_eq!(m["parent"], "llama", "{m}");
        }
        check(&[("llama", None), ("qv", Some("qv")), ("all", Some("all"))]).await;

        // Run-time load and unload, and a bad adapter, through the child.
        let (status, body) =
            post(&server, "/v1/load_lora_adapter", &json!({"lora_name": "late", "lora_path": lora_dir("mlp-late")}))
                .await;
        assert_eq!(status, 200, "{body}");
        let (status, got) = tokens(&server, "late", &prompt, 16).await;
        assert_eq!((status, got), (200, ids(&lora_ref["adapters"]["mlp-late"]["greedy"][1])));
        let (status, body) = post(&server, "/v1/unload_lora_adapter", &json!({"lora_name": "qv"})).await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(tokens(&server, "qv", &prompt, 4).await.0, 404);
        let (status, body) =
            post(&server, "/v1/load_lora_adapter", &json!({"lora_name": "wide", "lora_path": lora_dir("wide")})).await;
        assert_eq!(status, 400, "{body}");
        assert!(body.to_string().contains("does not fit the base model"), "{body}");

        // A killed child comes back with its adapters.
        let old = pid(&server).await;
        let status = Command::new("kill").args(["-9", &old.to_string()]).status().expect("kill");
        assert!(status.success());
        let deadline = Instant::now() + Duration::from_secs(300);
        loop {
            let m = get(&server, "/v1/models/llama").await;
            if m["status"] == "loaded" && m["pid"].as_u64().is_some_and(|p| p as u32 != old) {
                break;
            }
            assert!(Instant::now() < deadline, "not restarted: {m}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        check(&[("all", Some("all")), ("late", Some("mlp-late")), ("llama", None)]).await;
    });
}
