"""AgentFormat: the prompt and tool-result ids of a policy (plain for the from-scratch tokenizer,
the checkpoint's chat template otherwise), checked against transformers' apply_chat_template on
the real SmolLM2-135M-Instruct tokenizer."""
import pytest

from mempo_jax.text.chat_template import system_prompt
from mempo_jax.agent.format import PLAIN_SYSTEM_PROMPT, AgentFormat
from mempo_jax.text.hf_tokenizer import HFTokenizer

QUESTION = "Which city hosted the 1992 Summer Olympics?"
TURN = "<mem> The question asks for a host city. </mem><think> search it </think><search> 1992 Summer Olympics </search>"
OBS = "[d1] 1992 Summer Olympics: The games were held in Barcelona, Spain."


@pytest.fixture(scope="module")
def hf(smollm2_dir):
    import transformers

    return HFTokenizer(smollm2_dir), transformers.AutoTokenizer.from_pretrained(str(smollm2_dir)), smollm2_dir


def _reference_ids(ref, messages, add_generation_prompt):
    out = ref.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_plain_format_is_the_tiny_worlds_prompt(hf):
    tok = hf[0]
    fmt = AgentFormat(tok, AgentFormat.for_checkpoint(hf[2], tok).codec, PLAIN_SYSTEM_PROMPT)
    want = [tok.bos_id] + tok.encode(f"{PLAIN_SYSTEM_PROMPT}\nQuestion: {QUESTION}\n")
    assert fmt.prompt_ids(QUESTION) == want


def test_checkpoint_prompt_equals_apply_chat_template(hf):
    tok, ref, folder = hf
    fmt = AgentFormat.for_checkpoint(folder, tok, tags="text", enabled_tools=("search",))
    messages = [{"role": "system", "content": system_prompt(("search",))}, {"role": "user", "content": QUESTION}]
    assert fmt.prompt_ids(QUESTION) == _reference_ids(ref, messages, True)
    assert "<access>" not in fmt.system_prompt and "<search>" in fmt.system_prompt


def test_assistant_layout_continues_the_assistant_stream(hf):
    tok, ref, folder = hf
    fmt = AgentFormat.for_checkpoint(folder, tok, tags="text")
    obs = fmt.observation_ids(OBS, 64)
    assert tok.decode(obs) == f"<information>{OBS}</information>"
    assert fmt.observation_ids(OBS, 5) == obs[:3 + 5] + tok.encode("</information>")  # cut to 5 body ids


def test_tool_layout_renders_a_tool_message_of_the_template(hf):
    tok, ref, folder = hf
    fmt = AgentFormat.for_checkpoint(folder, tok, tags="text", tool_layout="tool")
    context = fmt.prompt_ids(QUESTION) + tok.encode(TURN) + fmt.observation_ids(OBS, 64)
    messages = [{"role": "system", "content": fmt.system_prompt}, {"role": "user", "content": QUESTION},
                {"role": "assistant", "content": TURN},
                {"role": "tool", "content": f"<information>{OBS}</information>"}]
    assert ref.decode(context) == ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert context == _reference_ids(ref, messages, True)


def test_bad_layout_and_missing_template_are_clear_errors(hf, tmp_path):
    tok, _, folder = hf
    with pytest.raises(ValueError, match="tool_layout must be one of"):
        AgentFormat.for_checkpoint(folder, tok, tool_layout="system")
    (tmp_path / "tokenizer.json").write_bytes((folder / "tokenizer.json").read_bytes())
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        AgentFormat.for_checkpoint(tmp_path, HFTokenizer(tmp_path))
