//! Request JSON → engine request, for each API surface, through the same public steps its
//! handler takes: the body checked and its typed fields parsed (`JsonBody`, which names a wrong field), the
//! conversation, its rendering through a real chat template (tools, tool choice, forced
//! calls) and the engine parameters (sampling, stops, constraints). The first byte picks the
//! surface: OpenAI chat, completions, Responses or Anthropic messages; the rest is the body.
//! Every outcome must be a value or an `ApiError` with a 4xx status, never a panic.
#![no_main]

use std::sync::OnceLock;

use ferrite_models::chat_template::ChatTemplate;
use ferrite_models::load::GenerationDefaults;
use ferrite_server::anthropic::request::MessagesRequest;
use ferrite_server::extract::JsonBody;
use ferrite_server::openai::chat::ChatFields;
use ferrite_server::openai::completions::{prompts, CompletionFields};
use ferrite_server::openai::params::CommonParams;
use ferrite_server::responses::request::ResponsesRequest;
use ferrite_server::{ApiError, ModelInfo};
use libfuzzer_sys::fuzz_target;

/// A model with a Hermes-style template (tools, `<think>`-free) and no tokenizer: rendering
/// is fuzzed, tokenizing is not (it is the tokenizers crate's).
fn model() -> &'static ModelInfo {
    static MODEL: OnceLock<ModelInfo> = OnceLock::new();
    MODEL.get_or_init(|| {
        let source = include_str!("../templates/hermes.jinja");
        let template = ChatTemplate::new(source, None, Some("<|im_end|>".into())).expect("template compiles");
        ModelInfo {
            name: "fuzz".into(),
            aliases: Vec::new(),
            tokenizer: None,
            chat_template: Some(template),
            defaults: GenerationDefaults::default(),
            created: 0,
            max_text_bytes: usize::MAX,
        }
    })
}

fn convert(surface: u8, body: &JsonBody) -> Result<(), ApiError> {
    let model = model();
    match surface % 4 {
        0 => {
            let common: CommonParams = body.parse()?;
            let chat: ChatFields = body.parse()?;
            model.render_conversation(&chat.conversation()?)?;
            common.to_request_params(model, chat.max_completion_tokens.or(common.max_tokens), chat.logprobs()?)?;
        }
        1 => {
            let common: CommonParams = body.parse()?;
            let fields: CompletionFields = body.parse()?;
            prompts(model, &fields.prompt, fields.add_special_tokens.unwrap_or(true))?;
            common.to_request_params(model, common.max_tokens, None)?;
        }
        2 => {
            let req: ResponsesRequest = body.parse()?;
            req.constraint()?;
            let history = req.input_messages()?;
            model.render_conversation(&req.conversation(&history)?)?;
            req.params().to_request_params(model, req.max_output_tokens, None)?;
        }
        _ => {
            let req: MessagesRequest = body.parse()?;
            model.render_conversation(&req.conversation()?)?;
            req.params().to_request_params(model, req.max_tokens, None)?;
        }
    }
    Ok(())
}

fuzz_target!(|data: &[u8]| {
    let [surface, body @ ..] = data else { return };
    let Ok(body) = JsonBody::new(axum::body::Bytes::copy_from_slice(body)) else { return };
    if let Err(e) = convert(*surface, &body) {
        assert!(e.status.is_client_error(), "{} for {}", e.status, String::from_utf8_lossy(&data[1..]));
    }
});
