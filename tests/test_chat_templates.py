"""The chat-template environment against transformers': each packaged model's template renders
ten conversations (system turns, several turns, tools, tool calls and results) exactly as
transformers' apply_chat_template renders them; a template file replaces the GGUF's, and a bad
one is refused in one sentence."""

import pytest

from ktlong.errors import KtlongError
from ktlong.gguf.chat_template import read_chat_template, template_for

pytestmark = pytest.mark.slow  # loads real models' tokenizers

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "a city <name>"}},
                   "required": ["city"]}}}
CALL = {"role": "assistant", "content": "", "tool_calls": [
    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich & <Bern>"}}}]}
RESULT = {"role": "tool", "content": '{"temperature_c": 18}'}
USER = {"role": "user", "content": "Hello! What's new?"}
CONVERSATIONS = [
    ([USER], None),
    ([{"role": "system", "content": "You answer in French."}, USER], None),
    ([USER, {"role": "assistant", "content": "Not much."}, {"role": "user", "content": "Tell me more."}], None),
    ([{"role": "user", "content": "Quotes \" and 'apostrophes', <tags> & unicode: é, 漢字"}], None),
    ([{"role": "system", "content": ""}, {"role": "user", "content": "  spaces  \n\n"}], None),
    ([USER], [WEATHER]),
    ([{"role": "system", "content": "Be brief."}, USER], [WEATHER]),
    ([{"role": "user", "content": "Weather in Zürich?"}, CALL, RESULT], [WEATHER]),
    ([{"role": "user", "content": "Weather in Zürich?"}, CALL, RESULT, {"role": "assistant", "content": "18 °C."},
      {"role": "user", "content": "And tomorrow?"}], [WEATHER]),
    ([{"role": "user", "content": "Two calls"}, {"role": "assistant", "content": "", "tool_calls": CALL["tool_calls"] * 2},
      RESULT, RESULT], [WEATHER]),
]


@pytest.mark.parametrize("model", ["qwen2.5-coder-0.5b", "smollm2-135m"])
def test_templates_render_as_transformers_does(model, real_model, hf_tokenizer):
    lm = real_model(model)
    hf = hf_tokenizer(lm.path)
    for messages, tools in CONVERSATIONS:
        if tools and "tools" not in (lm.tokenizer.chat_template or ""):
            tools = None  # a template without tools: transformers passes them, the template ignores them
        for generation_prompt in (True, False):
            ours = lm.chat_template.render(messages, add_generation_prompt=generation_prompt, tools=tools)
            theirs = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=generation_prompt,
                                            tokenize=False)
            assert ours == theirs, (model, messages, tools)


def test_a_template_file_replaces_the_ggufs(real_model, tmp_path):
    lm = real_model("smollm2-135m")
    path = tmp_path / "plain.jinja"
    path.write_text("{% for m in messages %}[{{ m.role | upper }}] {{ m.content }}\n{% endfor %}"
                    "{% if add_generation_prompt %}[ASSISTANT]{% endif %}{{ eos_token }}")
    template = template_for(lm.tokenizer, read_chat_template(str(path)))
    assert template.render([USER]) == "[USER] Hello! What's new?\n[ASSISTANT]" + lm.tokenizer.token_text(lm.tokenizer.eos_id)
    (tmp_path / "broken.jinja").write_text("{% for m in messages %}")
    (tmp_path / "binary.jinja").write_bytes(b"\xff\xfe\x00")
    for name, says in (("missing.jinja", "Cannot read"), ("broken.jinja", "not valid Jinja"),
                       ("binary.jinja", "not UTF-8")):
        with pytest.raises(KtlongError, match=says):
            read_chat_template(str(tmp_path / name))
