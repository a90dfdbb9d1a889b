//! `/v1/completions`: token-id prompts on the tiny llama fixture against its transformers
//! greedy reference, text prompts (single, batched, echoed, streamed) on SmolLM2, logprobs.

use serde_json::{json, Value};

use crate::common::*;

fn greedy_case(i: usize, len: usize) -> (Vec<u32>, Vec<u32>) {
    let r = fixture_reference("llama");
    (ids(&r["prompts"][i]), ids(&r["greedy"][i])[..len].to_vec())
}

fn token_body(prompt: Value, max_tokens: usize) -> Value {
    json!({"model": "llama", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true,
           "return_token_ids": true})
}

#[tokio::test]
async fn token_prompts_reproduce_the_reference() {
    let (p0, want0) = greedy_case(0, 16);
    let (p1, want1) = greedy_case(1, 16);
    let (status, resp) = post(&tiny().at("/v1/completions"), &token_body(json!(p0), 16)).await;
    assert_eq!(status, 200, "{resp}");
    assert_eq!(resp["object"], "text_completion");
    assert!(resp["id"].as_str().is_some_and(|id| id.starts_with("cmpl-")));
    assert_eq!(ids(&resp["choices"][0]["token_ids"]), want0);
    assert_eq!(resp["choices"][0]["finish_reason"], "length");
    assert_eq!(resp["usage"]["prompt_tokens"], p0.len());
    assert_eq!(resp["usage"]["completion_tokens"], 16);
    assert_eq!(ids(&resp["prompt_token_ids"][0]), p0);
    // A batch of token-id prompts: one choice per prompt, in order.
    let (_, resp) = post(&tiny().at("/v1/completions"), &token_body(json!([p0, p1]), 16)).await;
    let choices = resp["choices"].as_array().expect("choices");
    assert_eq!(choices.len(), 2);
    assert_eq!(choices[0]["index"], 0);
    assert_eq!(ids(&choices[0]["token_ids"]), want0);
    assert_eq!(ids(&choices[1]["token_ids"]), want1);
    assert_eq!(resp["usage"]["prompt_tokens"], p0.len() + p1.len());
    assert_eq!(resp["usage"]["completion_tokens"], 32);
}

#[tokio::test]
async fn streamed_token_prompts_reproduce_the_reference() {
    let (p0, want0) = greedy_case(0, 12);
    let (p1, want1) = greedy_case(1, 12);
    let mut body = token_body(json!([p0, p1]), 12);
    body["n"] = json!(2);
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let events = post_stream(&tiny().at("/v1/completions"), &body).await;
    let mut got = vec![Vec::new(); 4];
    let mut finishes = vec![0; 4];
    for e in &events[..events.len() - 1] {
        assert_eq!(e["object"], "text_completion");
        for c in e["choices"].as_array().expect("choices") {
            let i = c["index"].as_u64().expect("index") as usize;
            got[i].extend(ids(&c["token_ids"]));
            finishes[i] += usize::from(c["finish_reason"] == "length");
        }
    }
    // n = 2 greedy choices per prompt are the same; prompt p's choices are 2p and 2p + 1.
    assert_eq!(got, vec![want0.clone(), want0, want1.clone(), want1]);
    assert_eq!(finishes, vec![1; 4]);
    let usage = &events.last().expect("usage")["usage"];
    assert_eq!(usage["prompt_tokens"], p0.len() + p1.len());
    assert_eq!(usage["completion_tokens"], 48);
}

#[tokio::test]
async fn completion_logprobs_cover_every_token() {
    let (p0, want) = greedy_case(2, 6);
    let mut body = token_body(json!(p0), 6);
    body["logprobs"] = json!(2);
    let (status, resp) = post(&tiny().at("/v1/completions"), &body).await;
    assert_eq!(status, 200, "{resp}");
    let lp = &resp["choices"][0]["logprobs"];
    let tokens: Vec<String> = want.iter().map(|t| format!("token_id:{t}")).collect();
    assert_eq!(lp["tokens"], json!(tokens));
    let values = lp["token_logprobs"].as_array().expect("token_logprobs");
    assert_eq!(values.len(), 6);
    for (i, top) in lp["top_logprobs"].as_array().expect("top_logprobs").iter().enumerate() {
        let top = top.as_object().expect("top map");
        assert_eq!(top.len(), 2);
        // Greedy: the chosen token is the best alternative.
        assert_eq!(top.get(&tokens[i]).and_then(Value::as_f64), values[i].as_f64());
    }
    assert_eq!(lp["text_offset"].as_array().expect("offsets").len(), 6);
    assert!(resp["choices"][0]["logprobs"].is_object());
    let (_, plain) = post(&tiny().at("/v1/completions"), &token_body(json!(p0), 2)).await;
    assert!(plain["choices"][0]["logprobs"].is_null());
}

#[tokio::test]
async fn text_prompts_echo_batch_and_stream() {
    let server = own_smol();
    let url = server.at("/v1/completions");
    let body = json!({"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "ignore_eos": true});
    let (status, one) = post(&url, &body).await;
    assert_eq!(status, 200, "{one}");
    let text = one["choices"][0]["text"].as_str().expect("text").to_string();
    assert!(!text.is_empty());
    let (_, tok) = post(&server.at("/tokenize"), &json!({"prompt": "The capital of France is"})).await;
    assert_eq!(one["usage"]["prompt_tokens"], tok["count"]);
    // echo prepends the prompt.
    let mut echo = body.clone();
    echo["echo"] = json!(true);
    let (_, echoed) = post(&url, &echo).await;
    assert_eq!(echoed["choices"][0]["text"].as_str(), Some(format!("The capital of France is{text}").as_str()));
    // A list of strings: one choice each, in order. (Batched together, a quantized model's
    // logits differ slightly from a lone run, so the texts are not compared with `one`.)
    let mut batch = body.clone();
    batch["prompt"] = json!(["The capital of France is", "Once upon a time"]);
    let (_, both) = post(&url, &batch).await;
    for i in 0..2 {
        assert_eq!(both["choices"][i]["index"], i);
        assert!(both["choices"][i]["text"].as_str().is_some_and(|t| !t.is_empty()));
    }
    let (_, tok2) = post(&server.at("/tokenize"), &json!({"prompt": "Once upon a time"})).await;
    assert_eq!(
        both["usage"]["prompt_tokens"].as_u64(),
        Some(tok["count"].as_u64().expect("n") + tok2["count"].as_u64().expect("n"))
    );
    assert_eq!(both["usage"]["completion_tokens"], 16);
    // Streamed (with echo): the chunks add up to the same text.
    echo["stream"] = json!(true);
    let events = post_stream(&url, &echo).await;
    let streamed: String = events.iter().map(|e| e["choices"][0]["text"].as_str().unwrap_or("")).collect();
    assert_eq!(streamed, format!("The capital of France is{text}"));
    assert_eq!(events.last().expect("last")["choices"][0]["finish_reason"], "length");
}

#[tokio::test]
async fn seeded_sampling_is_reproducible() {
    let (p0, _) = greedy_case(1, 1);
    let body = |n: usize, seed: u64| {
        json!({"prompt": p0, "max_tokens": 12, "temperature": 1.0, "top_p": 0.9, "seed": seed, "n": n,
               "ignore_eos": true, "return_token_ids": true})
    };
    let url = tiny().at("/v1/completions");
    let choice = |resp: &Value, i: usize| ids(&resp["choices"][i]["token_ids"]);
    let (status, a) = post(&url, &body(2, 7)).await;
    assert_eq!(status, 200, "{a}");
    let (_, b) = post(&url, &body(2, 7)).await;
    assert_eq!((choice(&a, 0), choice(&a, 1)), (choice(&b, 0), choice(&b, 1)), "same seed, same tokens");
    assert_ne!(choice(&a, 0), choice(&a, 1), "each choice has its own stream of randomness");
    let (_, one) = post(&url, &body(1, 7)).await;
    assert_eq!(choice(&one, 0), choice(&a, 0), "choice 0 samples with the request's seed");
    let (_, other) = post(&url, &body(1, 8)).await;
    assert_ne!(choice(&other, 0), choice(&one, 0), "another seed, other tokens");
}

/// Issue 26 (7): a tiny temperature is greedy, not garbage (1e-38 made `logit / T` overflow
/// and the draw took the least likely token), on every surface.
#[tokio::test]
async fn tiny_temperatures_answer_as_temperature_zero() {
    let server = own_smol();
    let chat = |t: f64| {
        json!({"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 12,
               "temperature": t, "top_p": 0.9, "seed": 3})
    };
    let (status, greedy) = post(&server.at("/v1/chat/completions"), &chat(0.0)).await;
    assert_eq!(status, 200, "{greedy}");
    let want = greedy["choices"][0]["message"]["content"].as_str().expect("content").to_string();
    for t in [1e-38, 1e-30, 1e-6] {
        let (status, tiny) = post(&server.at("/v1/chat/completions"), &chat(t)).await;
        assert_eq!(status, 200, "{tiny}");
        assert_eq!(tiny["choices"][0]["message"]["content"].as_str(), Some(want.as_str()), "temperature {t}");
    }
    let text = |t: f64| json!({"prompt": "The capital of France is", "max_tokens": 8, "temperature": t});
    let (_, greedy) = post(&server.at("/v1/completions"), &text(0.0)).await;
    let (_, tiny) = post(&server.at("/v1/completions"), &text(1e-38)).await;
    assert_eq!(tiny["choices"][0]["text"], greedy["choices"][0]["text"]);
    let messages = |t: f64| {
        json!({"model": "smollm2", "max_tokens": 12, "temperature": t,
               "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    };
    let (_, greedy) = post(&server.at("/v1/messages"), &messages(0.0)).await;
    let (status, tiny) = post(&server.at("/v1/messages"), &messages(1e-38)).await;
    assert_eq!(status, 200, "{tiny}");
    assert_eq!(tiny["content"], greedy["content"]);
    // Temperatures no API allows: 400 naming the field.
    let (status, body) = post(&server.at("/v1/messages"), &messages(-0.5)).await;
    assert_eq!(status, 400, "{body}");
    assert!(body.to_string().contains("temperature"), "{body}");
}
