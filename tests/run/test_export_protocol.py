"""The protocol written beside an export (``run.export_protocol``): what is written, what is read
back, and one line naming the file and field for a malformed one."""

import json

import pytest

from mempo_jax.agent.rollout import RolloutConfig
from mempo_jax.agent.trajectory import FULL
from mempo_jax.config import ExperimentConfig, ModelOptions
from mempo_jax.run.export_protocol import (GENERATION_CONFIG_FILE, PROMPT_FILE, PROTOCOL_FILE, ExportProtocol)

ROLLOUT = RolloutConfig(max_turns=5, max_new_tokens=40, max_context_tokens=700, max_observation_tokens=48,
                        context_steps="full", temperature=0.7)


def _protocol(**kw):
    fields = dict(system_prompt="Answer {literally} with <search> and <answer>.", tags="tokens",
                  chat_template="require", tool_layout="user", topk=2, rollout=ROLLOUT)
    return ExportProtocol(**{**fields, **kw})


def test_round_trip_keeps_prompt_tags_topk_and_budgets(tmp_path):
    (tmp_path / GENERATION_CONFIG_FILE).write_text(json.dumps({"temperature": 0.2, "top_p": 0.9,
                                                               "bos_token_id": 1, "transformers_version": "5"}))
    _protocol().write(tmp_path, {"eos_token_id": 2, "bos_token_id": None, "pad_token_id": 0})
    got = ExportProtocol.read(tmp_path)
    assert got.system_prompt == "Answer {literally} with <search> and <answer>."
    assert (got.tags, got.chat_template, got.tool_layout, got.topk) == ("tokens", "require", "user", 2)
    want = {"max_turns": 5, "max_new_tokens": 40, "max_context_tokens": 700, "max_observation_tokens": 48}
    assert {k: getattr(got.rollout, k) for k in want} == want
    assert got.rollout.context_steps == FULL and json.loads((tmp_path / PROTOCOL_FILE).read_text())[
        "rollout"]["context_steps"] == "full"
    assert got.rollout.temperature == RolloutConfig().temperature  # sampling options are not carried
    gen = json.loads((tmp_path / GENERATION_CONFIG_FILE).read_text())
    # greedy per turn; the source's own keys stay, its sampling ones go
    assert gen == {"do_sample": False, "max_new_tokens": 40, "eos_token_id": 2, "pad_token_id": 0, "bos_token_id": 1,
                   "transformers_version": "5"}
    assert json.loads((tmp_path / PROTOCOL_FILE).read_text())["stop_strings"] == ["</search>", "</access>", "</answer>"]


def test_of_run_reads_the_experiment_config():
    cfg = ExperimentConfig(topk=4, model=ModelOptions(tags="text", chat_template="require"))
    p = ExportProtocol.of_run(cfg, "the prompt")
    assert (p.system_prompt, p.tags, p.chat_template, p.topk, p.rollout) == (
        "the prompt", "text", "require", 4, cfg.rl.rollout)


def test_a_folder_without_the_file_has_no_protocol(tmp_path):
    assert ExportProtocol.read(tmp_path) is None


@pytest.mark.parametrize("edit, message", [
    (lambda r: r.pop("topk"), "field topk is missing or not int"),
    (lambda r: r.update(topk=True), "field topk is missing or not int"),
    (lambda r: r["rollout"].update(max_turns="6"), "field rollout.max_turns is missing or not int"),
    (lambda r: r["rollout"].update(context_steps="sometimes"), "field rollout.context_steps is 'sometimes'"),
    (lambda r: r["rollout"].update(max_turns=0), "max_turns"),
    (lambda r: r.update(format_version=9), "format_version 9"),
    (lambda r: r.update(system_prompt_file="gone.txt"), "system_prompt_file gone.txt is not in"),
])
def test_a_malformed_protocol_is_one_line_naming_file_and_field(tmp_path, edit, message):
    _protocol().write(tmp_path, {})
    rec = json.loads((tmp_path / PROTOCOL_FILE).read_text())
    edit(rec)
    (tmp_path / PROTOCOL_FILE).write_text(json.dumps(rec))
    with pytest.raises((ValueError, FileNotFoundError)) as e:
        ExportProtocol.read(tmp_path)
    assert message in str(e.value) and PROTOCOL_FILE in str(e.value) and "\n" not in str(e.value)


def test_invalid_json_names_the_file(tmp_path):
    (tmp_path / PROTOCOL_FILE).write_text("{not json")
    (tmp_path / PROMPT_FILE).write_text("p")
    with pytest.raises(ValueError, match=f"{PROTOCOL_FILE}: not valid JSON"):
        ExportProtocol.read(tmp_path)


def test_a_run_folders_format_comes_from_its_saved_tokenizer_from_any_directory(tmp_path, monkeypatch, smollm2_dir):
    """``run_folder.run_policy_format``: a run whose ``ModelOptions.checkpoint`` is a relative path
    (``ckpt/…``, as a recipe writes it) is prompted from its own ``hf_tokenizer/`` with its chat
    template, from a directory where that relative path does not exist."""
    import shutil

    from mempo_jax.run.checkpoint import HF_TOKENIZER_DIR, load_run_tokenizer
    from mempo_jax.run.experiment import policy_format
    from mempo_jax.run.run_folder import run_model_options, run_policy_format

    run = tmp_path / "run"
    (run / HF_TOKENIZER_DIR).mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(smollm2_dir / name, run / HF_TOKENIZER_DIR / name)
    (run / "config.gin").write_text("ExperimentConfig.model = @ModelOptions()\n"
                                    "ModelOptions.checkpoint = 'ckpt/smollm2-135m-instruct'\n"
                                    "ModelOptions.chat_template = 'require'\n")
    monkeypatch.chdir(tmp_path)  # no ckpt/ here
    tokenizer = load_run_tokenizer(run)
    fmt = run_policy_format(run, tokenizer)
    text = tokenizer.decode(fmt.prompt_ids("Where was Fouxnul born?"))
    # the chat template's three turns (its special tokens are dropped by decode)
    assert text.startswith("system\nAnswer the question.") and text.endswith("\nuser\nWhere was Fouxnul born?\nassistant\n")
    assert fmt.prompt_ids("q") == policy_format(run_model_options(run), tokenizer,
                                                folder=smollm2_dir).prompt_ids("q")  # as from the source
    with pytest.raises(FileNotFoundError, match="ckpt/smollm2-135m-instruct"):
        policy_format(run_model_options(run), tokenizer)  # the source path alone: relative to the cwd
