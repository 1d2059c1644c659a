"""Chat templates, the MemPO system prompt and tool-result layouts.

Reference: transformers' ``apply_chat_template`` (CPU, test-only) on the real SmolLM2-135M-Instruct
tokenizer, and on the real Qwen2.5-Instruct chat template (tests/fixtures) put into a copy of the
SmolLM2 tokenizer folder (SmolLM2's vocabulary has ``<|im_start|>`` / ``<|im_end|>`` too).
"""

import json
import pathlib
import shutil

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from mempo_jax.agent.format import AgentFormat
from mempo_jax.text.chat_template import (
    ACTION_DESCRIPTIONS, TOOL_RESULT_LAYOUTS, ChatTemplate, PlainTemplate, encode_rendered, observation_frame,
    observation_text, question_messages, system_prompt)
from mempo_jax.text.protocol import ACCESS, ANSWER, INFORMATION, MEM, SEARCH, THINK
from mempo_jax.agent.rollout import SYSTEM_PROMPT
from mempo_jax.text.hf_tokenizer import HFTokenizer

FIXTURES = pathlib.Path(__file__).parents[1] / "fixtures"
QWEN_TEMPLATE = (FIXTURES / "qwen2_5_instruct_chat_template.jinja").read_text(encoding="utf-8")
SMOL_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
QWEN_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."

TURN_1 = "<mem> The question asks where Ada's employer is based. </mem><think> Find Ada first. </think>" \
         "<search> Ada Lovelace employer </search>"
OBS_1 = "[doc 3] Ada Lovelace: Ada works for Babbage & Co. (« Analytical » engines, 1843).\n[doc 9] Other: x"
TURN_2 = "<mem> Ada works for Babbage & Co. Need its city. </mem><access> 9 </access>"
OBS_2 = "\"Babbage & Co\"\nHeadquarters: London. 中文 ünïcode <b>tags</b>"


def _conversations():
    sys_msg = {"role": "system", "content": system_prompt(["search", "access"])}
    question = {"role": "user", "content": "Which city is Ada Lovelace's employer based in?"}
    return {
        "system_user": [sys_msg, question],
        "user_only": [question],
        "multi_turn": [sys_msg, question,
                       {"role": "assistant", "content": TURN_1},
                       {"role": "tool", "content": f"{INFORMATION[0]}{OBS_1}{INFORMATION[1]}"},
                       {"role": "assistant", "content": TURN_2},
                       {"role": "tool", "content": f"{INFORMATION[0]}{OBS_2}{INFORMATION[1]}"},
                       {"role": "user", "content": "Answer now, please."}],
    }


CONVERSATIONS = _conversations()


def _hf_ids(hf, messages, add_generation_prompt=True, **kw):
    out = hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                 return_dict=False, **kw)
    return [int(i) for i in out]


@pytest.fixture(scope="module")
def qwen_dir(smollm2_dir, tmp_path_factory):
    """SmolLM2's tokenizer with the Qwen2.5-Instruct template in tokenizer_config.json (no .jinja file)."""
    folder = tmp_path_factory.mktemp("qwen_template")
    shutil.copy(smollm2_dir / "tokenizer.json", folder / "tokenizer.json")
    config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = QWEN_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module", params=["smollm2", "qwen2.5"])
def checkpoint(request, smollm2_dir, qwen_dir):
    """(folder, our tokenizer, transformers' tokenizer, default system prompt) per template."""
    from transformers import AutoTokenizer

    folder = smollm2_dir if request.param == "smollm2" else qwen_dir
    return folder, HFTokenizer(folder), AutoTokenizer.from_pretrained(str(folder)), \
        SMOL_DEFAULT_SYSTEM if request.param == "smollm2" else QWEN_DEFAULT_SYSTEM


# -- parity with transformers -------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_prompt_ids_equal_transformers(checkpoint, name):
    folder, tok, hf, default_system = checkpoint
    template = ChatTemplate.from_checkpoint(folder)
    messages = CONVERSATIONS[name]
    ours = template.prompt_ids(tok, messages)
    assert ours == _hf_ids(hf, messages)
    text = template.render(messages, add_generation_prompt=True)
    assert text == hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")
    if name == "user_only":  # the template's own default system message
        assert text.startswith(f"<|im_start|>system\n{default_system}<|im_end|>\n")
    assert ours[0] == tok.piece_id("<|im_start|>")  # the special token is one id, no BOS added
    assert template.prompt_ids(tok, messages, add_generation_prompt=False) == \
        _hf_ids(hf, messages, add_generation_prompt=False)


_PIECES = st.sampled_from(["<|im_start|>", "<|im_end|>", "<mem>", "</search>", "<information>", "\n", " ",
                           "  ", "é", "中", "'", '"', "{{", "%}", "Paris", "doc 3", ";", "\t"])
_TEXT = st.lists(st.one_of(_PIECES, st.text(max_size=6)), max_size=8).map("".join)
_MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "tool", "system"]),
                                  "content": _TEXT})


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=st.lists(_MESSAGE, min_size=1, max_size=5), gen=st.booleans())
def test_prompt_ids_equal_transformers_on_generated_conversations(checkpoint, messages, gen):
    folder, tok, hf, _ = checkpoint
    template = ChatTemplate.from_checkpoint(folder)
    assert template.render(messages, gen) == hf.apply_chat_template(messages, add_generation_prompt=gen,
                                                                     tokenize=False)
    assert template.prompt_ids(tok, messages, gen) == _hf_ids(hf, messages, gen)


def test_template_features_render_as_transformers(smollm2_dir):
    """bos/eos variables, trim/lstrip blocks, loop controls, namespace, tojson (no HTML escaping,
    non-ASCII kept, indent), strftime_now, {% generation %}, None-valued keys dropped."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(smollm2_dir))
    custom = (
        "{{ bos_token }}{% set ns = namespace(n=0) %}\n"
        "{% for m in messages %}\n"
        "  {% if m.role == 'skip' %}{% continue %}{% endif %}\n"
        "  {% set ns.n = ns.n + 1 %}\n"
        "[{{ ns.n }}:{{ m.role }}] {{ m | tojson }} {{ m.content | tojson(indent=2) }}\n"
        "  {% if m.name is defined %}name={{ m.name }}{% endif %}\n"
        "  {% if m.content == 'STOP' %}{% break %}{% endif %}\n"
        "{% endfor %}\n"
        "{% generation %}{{ eos_token }}{% endgeneration %}|{{ unk_token }}|{{ strftime_now('%Y-%m') }}|"
        "{{ dict(a=1) | tojson }}|{{ tools is none }}{{ documents is none }}\n"
        "{% if add_generation_prompt %}GEN{% endif %}")
    messages = [{"role": "user", "content": "<b>&'é中</b>", "name": None},
                {"role": "skip", "content": "x"},
                {"role": "assistant", "content": "STOP"},
                {"role": "user", "content": "never"}]
    ours = ChatTemplate(custom, ChatTemplate.from_checkpoint(smollm2_dir).special_tokens).render(messages, True)
    assert ours == hf.apply_chat_template(messages, chat_template=custom, add_generation_prompt=True,
                                          tokenize=False)
    assert '"<b>&\'é中</b>"' in ours and "never" not in ours and "name=" not in ours


def test_template_exception_is_one_clear_error(smollm2_dir):
    import jinja2
    from transformers import AutoTokenizer

    custom = "{% if messages[0].role != 'system' %}{{ raise_exception('system message required') }}{% endif %}x"
    hf = AutoTokenizer.from_pretrained(str(smollm2_dir))
    with pytest.raises(jinja2.exceptions.TemplateError, match="system message required"):
        hf.apply_chat_template([{"role": "user", "content": "q"}], chat_template=custom, tokenize=False)
    template = ChatTemplate(custom, source="custom.jinja")
    with pytest.raises(ValueError, match=r"custom\.jinja.*system message required") as err:
        template.render([{"role": "user", "content": "q"}])
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="empty conversation"):
        template.render([])
    with pytest.raises(ValueError, match="message 0"):
        template.render(["not a dict"])
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate("{% for m in messages %}", source="broken.jinja")


# -- loading ----------------------------------------------------------------------------------
def _tokenizer_folder(smollm2_dir, tmp_path, config_update=None, jinja=None):
    shutil.copy(smollm2_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    config.update(config_update or {})
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja is not None:
        (tmp_path / "chat_template.jinja").write_text(jinja)
    return tmp_path


def test_template_list_in_tokenizer_config_takes_default(smollm2_dir, tmp_path):
    from transformers import AutoTokenizer

    folder = _tokenizer_folder(smollm2_dir, tmp_path, {"chat_template": [
        {"name": "tool_use", "template": "TOOLS {{ messages[0].content }}"},
        {"name": "default", "template": QWEN_TEMPLATE}]})
    messages = CONVERSATIONS["multi_turn"]
    hf = AutoTokenizer.from_pretrained(str(folder))
    assert ChatTemplate.from_checkpoint(folder).prompt_ids(HFTokenizer(folder), messages) == _hf_ids(hf, messages)
    assert ChatTemplate.from_checkpoint(folder, name="tool_use").render(messages) == f"TOOLS {messages[0]['content']}"
    with pytest.raises(ValueError, match=r"no chat template named 'nope'.*\['default', 'tool_use'\]"):
        ChatTemplate.from_checkpoint(folder, name="nope")


def test_jinja_file_wins_over_tokenizer_config(smollm2_dir, tmp_path):
    from transformers import AutoTokenizer

    folder = _tokenizer_folder(smollm2_dir, tmp_path, {"chat_template": "CONFIG"}, jinja=QWEN_TEMPLATE)
    template = ChatTemplate.from_checkpoint(folder)
    assert template.source == str(folder / "chat_template.jinja")
    messages = CONVERSATIONS["system_user"]
    assert template.render(messages, True) == \
        AutoTokenizer.from_pretrained(str(folder)).apply_chat_template(messages, add_generation_prompt=True,
                                                                       tokenize=False)
    assert template.render(messages, True).startswith("<|im_start|>system\nAnswer the question.")


def test_missing_template_is_one_clear_error(smollm2_dir, tmp_path):
    (tmp_path / "none").mkdir()
    folder = _tokenizer_folder(smollm2_dir, tmp_path / "none")
    with pytest.raises(FileNotFoundError, match=f"no chat template in {folder}") as err:
        ChatTemplate.from_checkpoint(folder)
    assert "\n" not in str(err.value)
    with pytest.raises(FileNotFoundError, match="checkpoint folder not found"):
        ChatTemplate.from_checkpoint(tmp_path / "absent")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "tokenizer_config.json").write_text(json.dumps({"chat_template": 3}))
    with pytest.raises(ValueError, match=r"tokenizer_config\.json field chat_template"):
        ChatTemplate.from_checkpoint(bad)
    (bad / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"tokenizer_config\.json: not valid JSON"):
        ChatTemplate.from_checkpoint(bad)


# -- the plain template (from-scratch tokenizer) -------------------------------------------------
@pytest.fixture(scope="module")
def spm_tokenizer(tmp_path_factory):
    from mempo_jax.data.world import WorldConfig, build_world
    from mempo_jax.run.experiment import _tokenizer_texts
    from mempo_jax.text.tokenizer import train_sentencepiece

    world = build_world(WorldConfig(num_people=30, num_companies=10, num_cities=8, num_countries=3,
                                    num_single=20, num_bridge=20, num_multi=20))
    return train_sentencepiece(_tokenizer_texts(world.documents, world.train + world.heldout),
                               tmp_path_factory.mktemp("spm"), 400)


@pytest.fixture(scope="module")
def smol_tokenizer(smollm2_dir):
    return HFTokenizer(smollm2_dir)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(question=st.text(max_size=40))
def test_plain_template_gives_build_prompt_ids_bitwise(spm_tokenizer, smol_tokenizer, question):
    assert smol_tokenizer.bos_id is not None  # SmolLM2 names a BOS token: the plain template puts it first
    for tok in (spm_tokenizer, smol_tokenizer):
        messages = question_messages(question, SYSTEM_PROMPT)
        bos = [] if tok.bos_id is None else [tok.bos_id]  # the from-scratch prompt, written out independently
        assert PlainTemplate().prompt_ids(tok, messages) == bos + tok.encode(f"{SYSTEM_PROMPT}\nQuestion: {question}\n")
        assert PlainTemplate().render(messages, True) == f"{SYSTEM_PROMPT}\nQuestion: {question}\n"


def test_plain_template_renders_the_stream_and_rejects_unknown_roles():
    stream = PlainTemplate().render(question_messages("q?", "S") + [
        {"role": "assistant", "content": TURN_1}, {"role": "tool", "content": "obs"}])
    assert stream == f"S\nQuestion: q?\n{TURN_1}<information>obs</information>"
    with pytest.raises(ValueError, match=r"message 1 has role 'narrator'"):
        PlainTemplate().render([{"role": "user", "content": "q"}, {"role": "narrator", "content": "x"}])
    with pytest.raises(ValueError, match="message 0 has no string content"):
        PlainTemplate().render([{"role": "user", "content": 3}])


# -- encode_rendered ----------------------------------------------------------------------------
def test_encode_rendered_maps_special_tokens_to_ids(smollm2_dir):
    from transformers import AutoTokenizer

    tok = HFTokenizer(smollm2_dir)
    text = "<|im_start|>user\nhi <mem><|im_end|>\n<|im_start|>assistant\n"
    ids = encode_rendered(tok, text)
    assert ids == AutoTokenizer.from_pretrained(str(smollm2_dir))(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == tok.piece_id("<|im_start|>") and tok.piece_id("<|im_end|>") in ids
    assert ids.count(tok.piece_id("<|im_start|>")) == 2
    with pytest.raises(TypeError):
        encode_rendered(tok, ["<|im_start|>"])


# -- the MemPO system prompt ---------------------------------------------------------------------
TOOL_TAGS = {"search": SEARCH, "access": ACCESS}


@pytest.mark.parametrize("enabled", [[], ["search"], ["access"], ["search", "access"], ["access", "search"]])
def test_system_prompt_describes_only_enabled_tools(enabled):
    text = system_prompt(enabled)
    for tool, (open_, close) in TOOL_TAGS.items():
        assert (open_ in text) == (tool in enabled), tool
        assert (close in text) == (tool in enabled), tool
        assert (ACTION_DESCRIPTIONS[tool] in text) == (tool in enabled)
    assert ANSWER[0] in text and ACTION_DESCRIPTIONS["answer"] in text
    assert MEM[0] in text and THINK[0] in text and INFORMATION[0] in text and INFORMATION[1] in text
    assert text.index(MEM[0]) < text.index(THINK[0]) < text.index(ANSWER[0])
    assert "first in every turn" in text and 'separated by ";"' in text
    assert "{" not in text and not text.endswith("\n")


def test_system_prompt_action_list_and_order():
    assert "exactly one action (<search>, <access> or <answer>)" in system_prompt(["access", "search"])
    assert "exactly one action (<search> or <answer>)" in system_prompt(["search"])
    assert "exactly one action (<answer>)" in system_prompt([])
    assert system_prompt(["access", "search"]) == system_prompt(("search", "access"))


def test_system_prompt_file_override_and_errors(tmp_path):
    custom = tmp_path / "prompt.txt"
    custom.write_text("Use {action_tags}.\n{actions}\n\n", encoding="utf-8")
    assert system_prompt(["search"], custom) == \
        f"Use <search> or <answer>.\n{ACTION_DESCRIPTIONS['search']}\n{ACTION_DESCRIPTIONS['answer']}"
    with pytest.raises(FileNotFoundError, match="system prompt file not found"):
        system_prompt(["search"], tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(ValueError, match="empty.txt is empty"):
        system_prompt(["search"], tmp_path / "empty.txt")
    with pytest.raises(ValueError, match=r"unknown tool 'browse'.*\['search', 'access'\]"):
        system_prompt(["search", "browse"])


# -- tool-result layouts -------------------------------------------------------------------------
def test_observation_frames_golden(smollm2_dir, qwen_dir):
    smol, qwen = ChatTemplate.from_checkpoint(smollm2_dir), ChatTemplate.from_checkpoint(qwen_dir)
    for t in (smol, qwen, PlainTemplate()):
        assert observation_frame(t, "assistant") == ("<information>", "</information>")
    assert observation_frame(smol, "tool") == ("<|im_end|>\n<|im_start|>tool\n<information>",
                                               "</information><|im_end|>\n<|im_start|>assistant\n")
    assert observation_frame(smol, "user") == ("<|im_end|>\n<|im_start|>user\n<information>",
                                               "</information><|im_end|>\n<|im_start|>assistant\n")
    assert observation_frame(qwen, "tool") == ("<|im_end|>\n<|im_start|>user\n<tool_response>\n<information>",
                                               "</information>\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert observation_text(qwen, "OBS", "user") == \
        "<|im_end|>\n<|im_start|>user\n<information>OBS</information><|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("layout", ["user", "tool"])
def test_observation_text_continues_the_rendered_conversation(checkpoint, layout):
    """prompt + sampled turn + observation_text == transformers' rendering (text and ids) of the
    conversation with that turn as an assistant message and the result as a user / tool message."""
    folder, tok, hf, _ = checkpoint
    template = ChatTemplate.from_checkpoint(folder)
    context = CONVERSATIONS["system_user"]
    stream = template.render(context, True)
    for turn, obs in ((TURN_1, OBS_1), (TURN_2, OBS_2)):
        stream += turn + observation_text(template, obs, layout, context)
        context = context + [{"role": "assistant", "content": turn},
                             {"role": layout, "content": f"{INFORMATION[0]}{obs}{INFORMATION[1]}"}]
        assert stream == hf.apply_chat_template(context, add_generation_prompt=True, tokenize=False)
        assert encode_rendered(tok, stream) == _hf_ids(hf, context)


def test_assistant_layout_gives_the_rollouts_observation_ids(spm_tokenizer):
    before, after = observation_frame(PlainTemplate(), "assistant")
    obs = "[doc 3] Ada works for Babbage."
    ids = encode_rendered(spm_tokenizer, before) + spm_tokenizer.encode(obs)[:5] + encode_rendered(spm_tokenizer, after)
    assert ids == AgentFormat.plain(spm_tokenizer).observation_ids(obs, 5)


def test_layouts_that_cannot_be_derived_are_clear_errors(smollm2_dir):
    smol = ChatTemplate.from_checkpoint(smollm2_dir)
    with pytest.raises(ValueError, match="tool_result_layout must be one of"):
        observation_frame(smol, "system")
    with pytest.raises(ValueError, match="needs a chat template"):
        observation_frame(PlainTemplate(), "tool")
    alternating = ChatTemplate(
        "{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}"
        "{{ raise_exception('Conversation roles must be user/assistant') }}{% endif %}"
        "[{{ m.role }}]{{ m.content }}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}",
        source="alternating.jinja")
    with pytest.raises(ValueError, match="cannot put a tool message after an assistant turn.*roles must be"):
        observation_frame(alternating, "tool", context=[{"role": "user", "content": "q"}])
    trimmed = ChatTemplate(  # the generation prompt differs from how an assistant message starts
        "{% for m in messages %}<{{ m.role }}> {{ m.content | trim }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>\n{% endif %}", source="trimmed.jinja")
    with pytest.raises(ValueError, match="trimmed.jinja does not render an assistant message"):
        observation_frame(trimmed, "user")
    dropping = ChatTemplate(  # tool messages vanish
        "{% for m in messages %}{% if m.role != 'tool' %}<{{ m.role }}>{{ m.content }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}", source="dropping.jinja")
    with pytest.raises(ValueError, match="dropping.jinja does not keep a tool message's content"):
        observation_frame(dropping, "tool")
    assert observation_frame(dropping, "user") == ("<user><information>", "</information><assistant>")
    assert set(TOOL_RESULT_LAYOUTS) == {"assistant", "user", "tool"}
