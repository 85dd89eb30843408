"""Tool calls through the official `openai` client with the packaged Qwen2.5-Coder-0.5B: the tools
reach the model's own chat template (the prompt equals transformers' apply_chat_template), its
`<tool_call>` answer comes back as OpenAI tool_calls, whole and streamed, equal to the call read
independently from a greedy generation of the same prompt; a tool result goes back and the final
answer equals that generation's; tool_choice none, required and named; refusals in one sentence."""

import json
import re

import pytest

openai = pytest.importorskip("openai")

from ktlong.chat.generate import generate
from ktlong.chat.sampling import Sampler
from ktlong.config import default_config
from ktlong.server.__main__ import make_app
from ktlong.server.tool_calls import HermesFormat, Llama31Format, ToolCallStream, tool_format
from ktlong.session.dense import DenseSession
from tests.http_server import RunningServer, started

pytestmark = pytest.mark.slow  # loads a real model

MODEL = "qwen2.5-coder-0.5b"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "the city"}},
                   "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "The time now in a city.",
                                          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture(scope="module")
def lm(real_model):
    return real_model(MODEL)


@pytest.fixture(scope="module")
def server(lm):
    app, _ = make_app(started(lm, MODEL, max_new_tokens=40, max_seq_len=4096))
    s = RunningServer(app)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def hf(lm, hf_tokenizer):
    return hf_tokenizer(lm.path)


def greedy(lm, prompt_ids, max_tokens=40) -> str:
    return generate(DenseSession.from_config(lm.model, default_config(), 4096), prompt_ids, max_tokens, Sampler(),
                    lm.tokenizer.stop_ids, lm.tokenizer).text


def reference_call(lm, hf, messages, tools, opening):
    """transformers renders the prompt; the model continues the opened call; the call is read
    with json, apart from the server's parser."""
    prompt = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    text = opening + greedy(lm, lm.tokenizer.encode(prompt + opening))
    body = re.search(r"<tool_call>\s*(\{.*\})\s*(</tool_call>|$)", text, re.S).group(1)
    call = json.loads(body)
    return call["name"], call["arguments"]


def test_a_named_tool_call_round_trip(server, lm, hf):
    client = server.client()
    choice = {"type": "function", "function": {"name": "get_weather"}}
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, CLOCK], tool_choice=choice)
    name, arguments = reference_call(lm, hf, ASK, [WEATHER],
                                     '<tool_call>\n{"name": "get_weather", "arguments": ')
    assert out.choices[0].finish_reason == "tool_calls"
    call = out.choices[0].message.tool_calls[0]
    assert call.type == "function" and call.function.name == name == "get_weather"
    assert json.loads(call.function.arguments) == arguments and "paris" in json.dumps(arguments).lower()
    assert out.usage.prompt_tokens == len(lm.tokenizer.encode(
        hf.apply_chat_template(ASK, tools=[WEATHER], add_generation_prompt=True, tokenize=False)
        + '<tool_call>\n{"name": "get_weather", "arguments": '))

    streamed = {}
    finish = None
    for event in client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, CLOCK],
                                                tool_choice=choice, stream=True):
        for c in event.choices:
            for d in c.delta.tool_calls or []:
                streamed.setdefault(d.index, [d.function.name, ""])[1] += d.function.arguments or ""
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and streamed == {0: ["get_weather", call.function.arguments]}

    # the result goes back; the final answer is what the model says over transformers' rendering
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 18, "sky": "sunny"}'}]
    final = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER, CLOCK])
    hf_history = ASK + [{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "content": '{"temperature_c": 18, "sky": "sunny"}'}]
    prompt = hf.apply_chat_template(hf_history, tools=[WEATHER, CLOCK], add_generation_prompt=True, tokenize=False)
    expected = greedy(lm, lm.tokenizer.encode(prompt))
    assert final.choices[0].finish_reason == "stop" and not final.choices[0].message.tool_calls
    assert final.choices[0].message.content == expected and "18" in expected


def test_tool_choice_none_and_required(server, lm, hf):
    client = server.client()
    plain = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="none")
    assert plain.choices[0].message.content == greedy(lm, lm.tokenizer.encode(
        hf.apply_chat_template(ASK, add_generation_prompt=True, tokenize=False)))
    required = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, CLOCK],
                                              tool_choice="required")
    name, arguments = reference_call(lm, hf, ASK, [WEATHER, CLOCK], '<tool_call>\n{"name": "')
    call = required.choices[0].message.tool_calls[0]
    assert (call.function.name, json.loads(call.function.arguments)) == (name, arguments)
    # auto: this model answers with the call's bare JSON object, which is read as the call
    auto = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, CLOCK])
    bare = json.loads(greedy(lm, lm.tokenizer.encode(
        hf.apply_chat_template(ASK, tools=[WEATHER, CLOCK], add_generation_prompt=True, tokenize=False))))
    call = auto.choices[0].message.tool_calls[0]
    assert auto.choices[0].finish_reason == "tool_calls" and auto.choices[0].message.content is None
    assert (call.function.name, json.loads(call.function.arguments)) == (bare["name"], bare["arguments"])


def test_tool_requests_are_refused_in_one_sentence(server, lm):
    client = server.client()
    cases = [dict(tools=[{"type": "function"}]), dict(tools=[WEATHER], tool_choice="sometimes"),
             dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
             dict(tool_choice="required"),
             dict(messages=ASK + [{"role": "assistant", "tool_calls": [{"function": {"name": "x", "arguments": "[1"}}]}])]
    for case in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, **{"messages": ASK, **case})
        assert e.value.body["message"].count(".") >= 1 and "'" in e.value.body["message"]
    small = RunningServer(make_app(started(lm, MODEL, max_new_tokens=8, use_chat_template=False))[0])
    try:
        with pytest.raises(openai.BadRequestError, match="no tool support"):
            small.client().chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER])
    finally:
        small.stop()


def test_formats_read_calls_and_hold_them_back_in_a_stream():
    hermes = HermesFormat()
    text = 'Let me check.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>'
    content, calls = hermes.parse(text, ("f", "g"))
    assert content == "Let me check." and [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"a": 1}), ("g", {})]
    assert hermes.parse(text, ("f",))[1][0].name == "f"  # a function not offered is not a call
    assert hermes.parse("<tool_call>not json</tool_call> rest", ("f",)) == ("<tool_call>not json</tool_call> rest", [])
    assert [c.name for c in hermes.parse(' {"name": "f", "arguments": {}}', ("f",))[1]] == ["f"]  # bare
    assert hermes.parse('{"name": "h", "arguments": {}}', ("f",)) == ('{"name": "h", "arguments": {}}', [])
    stream = ToolCallStream(hermes, ("f",))
    out = "".join(stream.push(p) for p in ["Let me ", "check.\n<tool", "_call>\n{\"name\": \"f\", ", "\"arguments\": {}}\n</tool_call>"])
    assert out == "Let me check.\n" and [c.name for c in stream.finish()[1]] == ["f"]
    plain = ToolCallStream(hermes, ("f",))
    assert "".join(plain.push(p) for p in ["a <tool", " b"]) + plain.finish()[0] == "a <tool b"
    llama = Llama31Format()
    content, calls = llama.parse('<|python_tag|>{"name": "f", "parameters": {"x": "y"}}', ("f",))
    assert content == "" and (calls[0].name, json.loads(calls[0].arguments)) == ("f", {"x": "y"})
    assert llama.parse("Paris is sunny.", ("f",)) == ("Paris is sunny.", [])
    assert tool_format(None) is None and tool_format("{{ messages }}") is None
    assert isinstance(tool_format("{% if tools %}<tool_call>{% endif %}"), HermesFormat)
    assert isinstance(tool_format("{% if tools %}<|python_tag|>{% endif %}"), Llama31Format)
