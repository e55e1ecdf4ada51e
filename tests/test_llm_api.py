"""The Python door in vLLM's names: `SamplingParams`, `LLM(...)` and `EngineConfig` take vLLM's
spellings and refuse unknown ones by name; `generate` takes a lone prompt, `chat` renders
conversations with the chat template, and every output has vLLM's shape, so a vLLM offline script
ports by changing its import. On the bundled model (a few seconds to load)."""

from __future__ import annotations

import textwrap

import pytest

from engine import LLM, SamplingParams
from engine.config import ENGINE_NAMES, EngineConfig, choice_seed
from engine.llm import PromptError, one_or_many

ASK = [{"role": "user", "content": "Write a haiku about the sea."}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(progress=False, max_num_seqs=4)


# ---- arguments ---------------------------------------------------------------------------------


def test_vllm_names_are_aliases() -> None:
    p = SamplingParams(temperature=0, max_tokens=16, stop=["\n\n"], logit_bias={7: 2.0})
    assert (p.max_new_tokens, p.stop, p.logit_bias) == (16, ("\n\n",), ((7, 2.0),))
    assert SamplingParams(stop="END").stop == ("END",)
    cfg = EngineConfig(tensor_parallel_size=2, max_num_seqs=4, block_size=32,
                       enforce_eager=True, trust_remote_code=True)
    assert (cfg.tp, cfg.max_batch_size, cfg.page_size, cfg.use_graphs) == (2, 4, 32, False)
    # vLLM's knobs not implemented here are accepted at the value that changes nothing
    assert SamplingParams(presence_penalty=0.0, repetition_penalty=1.0, stop_token_ids=[],
                          skip_special_tokens=True) == SamplingParams()
    # what LLM(config=..., **knobs) hands to dataclasses.replace
    assert ENGINE_NAMES.canonical({"max_num_seqs": 2}, EngineConfig.__pydantic_fields__) == {
        "max_batch_size": 2}


@pytest.mark.parametrize(("make", "words"), [
    (lambda: SamplingParams(bogus=1), ["bogus"]),
    (lambda: SamplingParams(max_tokns=3), ["max_tokns", "max_tokens", "max_new_tokens"]),
    (lambda: EngineConfig(max_batch_sise=4), ["max_batch_sise", "did you mean max_batch_size"]),
    (lambda: LLM(bogus=1), ["LLM()", "bogus"]),
    (lambda: LLM(max_batch_sise=4), ["max_batch_sise", "max_batch_size"]),
    (lambda: LLM(tensor_parallel_sise=2), ["tensor_parallel_sise", "tp here"]),
    (lambda: LLM(warmup=False), ["warmup", "warm_up"]),
    (lambda: SamplingParams(max_tokens=3, max_new_tokens=4), ["max_tokens", "max_new_tokens"]),
])
def test_unknown_arguments_are_refused_by_name(make, words: list[str]) -> None:
    with pytest.raises(TypeError) as e:  # before anything loads
        make()
    assert all(w in str(e.value) for w in words), str(e.value)


@pytest.mark.parametrize(("make", "name"), [
    (lambda: SamplingParams(presence_penalty=0.5), "presence_penalty"),
    (lambda: SamplingParams(stop_token_ids=[2]), "stop_token_ids"),
    (lambda: SamplingParams(min_p=0.1), "min_p"),
    (lambda: EngineConfig(pipeline_parallel_size=2), "pipeline_parallel_size"),
    (lambda: EngineConfig(seed=0), "SamplingParams(seed"),
])
def test_unimplemented_vllm_knobs_say_not_supported(make, name: str) -> None:
    with pytest.raises(ValueError, match="not supported") as e:
        make()
    assert name in str(e.value)


def test_server_fields_say_not_supported() -> None:
    pytest.importorskip("fastapi")
    from engine.serve import protocol as api

    for body in (b'{"messages": [{"role": "user", "content": "x"}], "presence_penalty": 0.5}',
                 b'{"prompt": "x", "frequency_penalty": -1}'):
        model = api.ChatRequest if b"messages" in body else api.CompletionRequest
        with pytest.raises(Exception) as e:
            api.parse(body, model)
        err = e.value.detail["error"]  # type: ignore[attr-defined]
        assert "not supported" in err["message"] and err["param"].endswith("_penalty"), err
    ok = api.parse(b'{"prompt": "x", "presence_penalty": 0, "frequency_penalty": 0.0}',
                   api.CompletionRequest)
    assert ok.presence_penalty == 0


def test_a_lone_prompt_is_one_prompt() -> None:
    assert one_or_many("def main():\n") == ["def main():\n"]
    assert one_or_many({"prompt": "x"}) == [{"prompt": "x"}]
    assert one_or_many([1, 2, 3]) == [[1, 2, 3]]
    assert one_or_many(["a", "b"]) == ["a", "b"]
    assert one_or_many([[1], [2]]) == [[1], [2]]


# ---- generation --------------------------------------------------------------------------------


def test_max_tokens_and_vllm_output_shape(llm: LLM) -> None:
    [out] = llm.generate("def main():\n", SamplingParams(temperature=0, max_tokens=16,
                                                         ignore_eos=True))
    assert len(out.outputs) == 1
    c = out.outputs[0]
    assert len(c.token_ids) == 16 and c.finish_reason == "length"
    assert (c.text, c.token_ids) == (out.text, out.token_ids)
    assert out.prompt_token_ids == llm.tokenizer.encode("def main():\n")
    assert out.prompt == "def main():\n" and out.finished and out.request_id == "0"


def test_n_choices_are_seeded_seed_plus_i(llm: LLM) -> None:
    sp = SamplingParams(temperature=0.9, seed=11, max_tokens=6, ignore_eos=True, n=3)
    outs = llm.generate(["Once upon a time", "def f(x):"], sp)
    assert len(outs) == 2 and [len(o.outputs) for o in outs] == [3, 3]
    assert [c.index for c in outs[0].outputs] == [0, 1, 2]
    singles = llm.generate(["Once upon a time"] * 3, [
        SamplingParams(temperature=0.9, seed=choice_seed(11, i), max_tokens=6, ignore_eos=True)
        for i in range(3)])
    assert [c.token_ids for c in outs[0].outputs] == [o.token_ids for o in singles]
    assert llm.stats["prompts"] == 3 and llm.stats["tokens"] == 18


def test_chat_renders_with_the_chat_template(llm: LLM) -> None:
    sp = SamplingParams(temperature=0, max_tokens=4)
    [out] = llm.chat(ASK, sp)
    assert out.prompt_token_ids == llm.tokenizer.apply_chat_template(ASK)
    outs = llm.chat([ASK, [{"role": "user", "content": "Hi"}]], sp, tools=TOOLS,
                    chat_template_kwargs={"thinking": False})
    assert len(outs) == 2
    assert outs[0].prompt_token_ids == llm.tokenizer.apply_chat_template(
        ASK, tools=TOOLS, thinking=False)
    with pytest.raises(PromptError, match="prompt 1"):
        llm.chat([ASK, [{"role": "nobody"}]], sp)


def test_a_vllm_offline_script_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM's offline quick start and chat example, their import changed (run as a script
    would be, in this process to spare loading torch again)."""
    script = textwrap.dedent('''
        from engine import LLM, SamplingParams

        prompts = ["Hello, my name is", "The capital of France is"]
        sampling_params = SamplingParams(temperature=0, max_tokens=8, stop=["\\n\\n"])
        llm = LLM()
        for output in llm.generate(prompts, sampling_params):
            print(f"Prompt: {output.prompt!r}, Generated text: {output.outputs[0].text!r}")
        one = llm.generate("def main():\\n", sampling_params)
        assert len(one) == 1 and len(one[0].outputs[0].token_ids) <= 8
        conversation = [{"role": "system", "content": "You are a helpful assistant"},
                        {"role": "user", "content": "Hello"}]
        outputs = llm.chat(conversation, sampling_params, use_tqdm=False)
        print("Chat:", repr(outputs[0].outputs[0].text), outputs[0].outputs[0].finish_reason)
    ''')
    exec(compile(script, "vllm_offline.py", "exec"), {"__name__": "__main__"})
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("Prompt: 'Hello, my name is', Generated text: ")
    assert lines[1].startswith("Prompt: 'The capital of France is', Generated text: ")
    assert lines[2].startswith("Chat: ")
