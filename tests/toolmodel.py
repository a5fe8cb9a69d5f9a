"""A tiny Qwen3-MoE with the real Qwen3 tokenizer, overfit to answer one tool-using
conversation with a <think> block and a <tool_call>: protocol tests parse text a model
really emits. Built once per test session (conftest's tool_pack)."""

import torch

import tiny

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
ANSWER = ('<think>\nThe user wants the weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
          '"arguments": {"city": "Paris"}}\n</tool_call><|im_end|>')


def overfit_tool_model(hf_dir, tokenizer_dir):
    """Train the tiny model until it answers ASK (with TOOLS) with ANSWER, greedily."""
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
    tiny.build_checkpoint("qwen3_moe", hf_dir, tokenizer_dir=tokenizer_dir, tie_word_embeddings=True,
                          eos_token_id=151645)          # <|im_end|>: the tiny default (1) is a quote in Qwen's vocabulary
    tok = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    prompt = tok.apply_chat_template(ASK, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([p_ids + tok(ANSWER, add_special_tokens=False)["input_ids"]])
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    answer = ids[0, len(p_ids):]
    for _ in range(150):
        # the loss transformers computes with the prompt's labels masked, from the answer's logits
        # only: the 151,936-word head over the prompt's positions was most of a step's time
        hidden = model.model(ids).last_hidden_state[0, len(p_ids) - 1:-1]
        loss = torch.nn.functional.cross_entropy(model.lm_head(hidden).float(), answer)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if loss.item() < 0.01:
            break
    for old in list(hf_dir.glob("*.safetensors")) + list(hf_dir.glob("*.index.json")):
        old.unlink()
    model.save_pretrained(hf_dir)
