"""Bad input is caught before work starts, in one line: every config field is
validated by its dataclass; bad data, tokenizers, gin syntax, a read-only or full run folder stop
``python -m mempo_jax.commands.train`` at start-up with one ``error:`` line and exit status 2, and a fresh
run folder is not even created. Each case runs the real entry point (``train.main``) on the small
config; none trains a step."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import subprocess
import sys

import pytest
from hypothesis import given, settings, strategies as st

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from chaos_resume import SMALL_PARAMS  # noqa: E402

from conftest import SPM_CACHE  # noqa: E402  (the session's shared tokenizer cache)


def _main(capsys, run_dir, *params, cache=SPM_CACHE):
    """``train.main`` on the small config plus ``params``; returns (exit status, the stderr lines)."""
    from mempo_jax.commands import train

    argv = ["--run_dir", str(run_dir), "--cache_dir", str(cache)]
    for p in (*SMALL_PARAMS, *params):
        argv += ["--gin_param", p]
    rc = train.main(argv)
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip() and "it/s]" not in x]
    return rc, err


def _one_error(err: list[str]) -> str:
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert "Traceback" not in err[0]
    return err[0]


# ---- item 10: every config field, validated by its dataclass ----------------------------------------
@pytest.mark.parametrize("binding, message", [
    ("RLConfig.steps=-1", "RLConfig.steps must be >= 0, got -1"),
    ("RLConfig.group_size=0", "RLConfig.group_size must be >= 1, got 0"),
    ("RLConfig.questions_per_step=0", "RLConfig.questions_per_step must be >= 1, got 0"),
    ("RLConfig.ppo_epochs=1.5", "RLConfig.ppo_epochs must be an int, got 1.5"),
    ("RLConfig.seed=-1", "RLConfig.seed must be >= 0, got -1"),
    ('RLConfig.outcome_metric="bleu"', "RLConfig.outcome_metric: unknown metric 'bleu'"),
    ('MemoryRewardConfig.answer="both"', "MemoryRewardConfig.answer must be one of ('gold', 'generated'), got 'both'"),
    ('MemoryRewardConfig.group="step"', "MemoryRewardConfig.group must be one of ('question', 'turn'), got 'step'"),
    ('RLConfig.memory_norm="center"', "RLConfig.memory_norm moved to MemoryRewardConfig.norm; bind MemoryRewardConfig.norm"),
    ("RLConfig.memory_coef=nan", None),  # gin has no nan literal: a parse error, also one line
    ("SFTConfig.batch_rows=0", "SFTConfig.batch_rows must be >= 1, got 0"),
    ("SFTConfig.full_fraction=1.5", "SFTConfig.full_fraction must be <= 1.0, got 1.5"),
    ("ExecutionConfig.sft_micro_batch_rows=3",
     "ExecutionConfig.sft_micro_batch_rows must be 0 or divide SFTConfig.batch_rows = 8"),
    ("PlanConfig.micro_batch_rows=8", "PlanConfig.micro_batch_rows moved to ExecutionConfig.micro_batch_rows"),
    ("SFTConfig.micro_batch_rows=8", "SFTConfig.micro_batch_rows moved to ExecutionConfig.sft_micro_batch_rows"),
    ("OptimConfig.grad_clip=0", "OptimConfig.grad_clip must be > 0.0, got 0"),
    ("OptimConfig.b2=1.0", "OptimConfig.b2 must be < 1.0, got 1.0"),
    ("rl/OptimConfig.warmup_steps=-3", "OptimConfig.warmup_steps must be >= 0, got -3"),
    ("RolloutConfig.top_p=0.0", "RolloutConfig.top_p must be > 0.0, got 0.0"),
    ("RolloutConfig.temperature=-1.0", "RolloutConfig.temperature must be >= 0.0, got -1.0"),
    ("RolloutConfig.max_new_tokens=5000", "RolloutConfig.max_new_tokens = 5000 must be < RolloutConfig.max_context_tokens"),
    ('RolloutConfig.context_steps="most"', "RolloutConfig.context_steps must be 'full' or an integer >= 1"),
    ('RolloutConfig.engine="legacy"', "RolloutConfig.engine was removed; delete the binding"),
    ("RolloutConfig.prefill_chunk=100", "RolloutConfig.prefill_chunk = 100 must be a power of two"),
    ("LossConfig.kl_coef=-0.1", "LossConfig.kl_coef must be >= 0.0, got -0.1"),
    ('LossConfig.kl_type="k9"', "LossConfig.kl_type must be one of"),
    ("EvalConfig.context_modes=()", "EvalConfig.context_modes must name at least one mode"),
    ('EvalConfig.context_modes=(1, "half")', "EvalConfig.context_modes[1]: context_steps must be 'full'"),
    ("EvalConfig.bootstrap_samples=0", "EvalConfig.bootstrap_samples must be >= 1, got 0"),
    ("CheckpointConfig.grace_s=0", "CheckpointConfig.grace_s must be > 0.0, got 0"),
    ("CheckpointConfig.async_save=1", "CheckpointConfig.async_save must be a bool, got 1"),
    ("WorldConfig.multi_max=1", "WorldConfig.multi_max must be >= 2, got 1"),
    ("WorldConfig.heldout_fraction=-0.1", "WorldConfig.heldout_fraction must be >= 0.0, got -0.1"),
    ("ScriptedAgentConfig.lazy_prob=2.0", "ScriptedAgentConfig.lazy_prob must be <= 1.0, got 2.0"),
    ("ExperimentConfig.seed=-1", "ExperimentConfig.seed must be >= 0, got -1"),
    ("ExperimentConfig.vocab_size=100", "ExperimentConfig.vocab_size must be >= 272, got 100"),
    ("ExperimentConfig.log_rollouts=-1", "ExperimentConfig.log_rollouts must be >= 0, got -1"),
    ('ModelOptions.preset="gpt5"', "ModelOptions.preset must be one of"),
    ('ModelOptions.overrides=(("num_layerz", 1),)', "ModelOptions.overrides: unknown ModelConfig field 'num_layerz'"),
    ('ModelOptions.overrides=(("num_heads", 3),)', "ModelOptions.overrides: ModelConfig.num_heads (3) must be a multiple"),
])
def test_a_bad_config_value_fails_at_start_up_naming_the_field(binding, message, tmp_path, capsys):
    """``RLConfig.steps = -1`` used to run SFT and the evaluation, then die with an OverflowError;
    ``group_size = 0`` ran SFT, then "need at least one array to concatenate"."""
    run = tmp_path / "run"
    rc, err = _main(capsys, run, binding)
    line = _one_error(err)
    assert rc == 2
    if message is None:
        assert "cannot parse --gin_param" in line and binding in line
    else:
        assert line.startswith("error: config error: ") and message in line, line
        assert line.endswith(f"(--gin_param {binding})"), line  # and the binding that set it
    assert not run.exists()  # nothing created


def test_a_bad_value_in_a_gin_file_names_the_file_and_line(tmp_path, capsys):
    from mempo_jax.commands import train

    gin = tmp_path / "x.gin"
    gin.write_text(f'include "{REPO / "configs" / "tiny_world.gin"}"\nRLConfig.steps = 3\nRLConfig.group_size = 0\n')
    rc = train.main(["--run_dir", str(tmp_path / "run"), "--gin_file", str(gin)])
    line = _one_error([x for x in capsys.readouterr().err.splitlines() if x.strip()])
    assert rc == 2 and line == (f"error: config error: RLConfig.group_size must be >= 1, got 0 "
                                f"({gin}:3: RLConfig.group_size = 0)")


@pytest.mark.parametrize("text, problem", [
    ("RLConfig.steps=(3", "EOF in multi-line statement"),
    ("RLConfig.steps 3", "Couldn't parse statement, expected ':' or '='."),
    ("RLConfig.steps=3=4", "Expected newline."),
    ("RolloutConfig.context_steps=full",  # a string without quotes: the message says so, no <ast.Name object at 0x…>
     'malformed node or string on line 1: an unquoted name; a string value needs quotes, e.g. X.field="value"'),
])
def test_an_unparsable_gin_param_is_one_line_naming_it(text, problem, tmp_path, capsys):
    """``RLConfig.steps=(3`` raised a ``tokenize.TokenError`` traceback (exit 1)."""
    rc, err = _main(capsys, tmp_path / "run", text)
    assert rc == 2 and _one_error(err) == f"error: config error: cannot parse --gin_param {text!r}: {problem}"
    gin = tmp_path / "broken.gin"
    gin.write_text("RLConfig.steps = (3\n")
    from mempo_jax.commands import train

    assert train.main(["--run_dir", str(tmp_path / "run"), "--gin_file", str(gin)]) == 2
    line = _one_error([x for x in capsys.readouterr().err.splitlines() if x.strip()])
    assert line == f"error: config error: cannot parse {gin}: EOF in multi-line statement (line 2)"
    assert not (tmp_path / "run").exists()


def test_a_missing_gin_file_or_include_is_named(tmp_path, capsys, monkeypatch):
    """A ``--gin_file`` or an ``include`` that names no file: one line naming it, the including
    file and line, and the working directory includes resolve against (gin's own error was
    ``expected str, bytes or os.PathLike object, not NoneType``, naming nothing)."""
    from mempo_jax.commands import train

    monkeypatch.chdir(REPO)
    assert train.main(["--run_dir", str(tmp_path / "run"), "--gin_file", "configs/smollm2_hotpot.gin"]) == 2
    line = _one_error([x for x in capsys.readouterr().err.splitlines() if x.strip()])
    assert line.startswith(f"error: config error: no such gin file: configs/smollm2_hotpot.gin; looked in the "
                           f"working directory {REPO} and among the shipped recipes ("), line
    assert " hotpotqa, " in line and "smollm2_hotpotqa, " in line and line.endswith("tiny_world)"), line
    gin = tmp_path / "x.gin"
    gin.write_text("RLConfig.steps = 3\ninclude 'configs/tiny_wrld.gin'\n")
    monkeypatch.chdir(tmp_path)
    assert train.main(["--run_dir", str(tmp_path / "run"), "--gin_file", str(gin)]) == 2
    line = _one_error([x for x in capsys.readouterr().err.splitlines() if x.strip()])
    assert line.startswith(f"error: config error: no such gin file: configs/tiny_wrld.gin (include at {gin}:2); "
                           f"looked in the working directory {tmp_path}, beside the including file and among the "
                           "shipped recipes"), line
    assert not (tmp_path / "run").exists()


def test_a_missing_checkpoint_folder_is_named(tmp_path, capsys):
    rc, err = _main(capsys, tmp_path / "run", f'ModelOptions.checkpoint="{tmp_path / "nope"}"', "ModelOptions.overrides=()")
    assert rc == 2 and _one_error(err).startswith(f"error: ModelOptions.checkpoint: no such folder: {tmp_path / 'nope'}")
    assert not (tmp_path / "run").exists()


@settings(max_examples=200, deadline=None)
@given(value=st.one_of(st.integers(-5, 5), st.floats(allow_nan=True, allow_infinity=True, width=32), st.booleans(),
                       st.text(max_size=3), st.none()),
       lo=st.one_of(st.none(), st.integers(-3, 3)), hi=st.one_of(st.none(), st.integers(-3, 3)),
       kind=st.sampled_from([int, float]))
def test_check_accepts_exactly_the_values_in_range(value, lo, hi, kind):
    """``validation.check`` against an independent statement of its contract."""
    import dataclasses
    import math

    from mempo_jax.core.validation import check

    @dataclasses.dataclass
    class Cfg:
        x: object

    typed = (not isinstance(value, bool)) and (isinstance(value, int) if kind is int else
                                               isinstance(value, (int, float)) and math.isfinite(value))
    ok = typed and (lo is None or value >= lo) and (hi is None or value <= hi)
    try:
        check(Cfg(value), "x", kind, lo, hi)
        raised = None
    except ValueError as e:
        raised = str(e)
    assert (raised is None) == ok, (value, lo, hi, kind, raised)
    if raised:
        assert raised.startswith("Cfg.x must be ") and raised.endswith(f"got {value!r}") and "\n" not in raised


def test_every_shipped_recipe_still_validates():
    from mempo_jax.config_loader import load_run_config

    for gin in sorted((REPO / "configs").glob("*.gin")):
        load_run_config([str(gin)])


# ---- item 11: data, tokenizer, run folder ---------------------------------------------------------
_GOOD = {"id": "a", "question": "Where was Ann born?", "answer": "Paris",
         "supporting_facts": {"title": ["Ann"], "sent_id": [0]},
         "context": {"title": ["Ann"], "sentences": [["Ann was born in Paris."]]}}


def _hotpot(tmp_path, *rows, raw: bytes | None = None):
    path = tmp_path / "hotpot.jsonl"
    if raw is not None:
        path.write_bytes(raw)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path, ('ExperimentConfig.dataset="hotpotqa"', f'ExperimentConfig.data_path="{path}"')


@pytest.mark.parametrize("row, message", [
    ({"answer": 42}, "field 'answer': must be a string, got int"),
    ({"question": ["Where", "born?"]}, "field 'question': missing or not a non-empty string"),
    ({"supporting_facts": {"title": "Ann"}}, "field 'supporting_facts.title': missing or not a list"),
])
def test_a_malformed_hotpotqa_row_names_file_line_and_field(row, message, tmp_path, capsys):
    """``answer: 42`` raised a TypeError traceback in the tokenizer, a list question an AttributeError."""
    path, params = _hotpot(tmp_path, _GOOD, dict(_GOOD, id="b", **row))
    run = tmp_path / "run"
    rc, err = _main(capsys, run, *params)
    assert rc == 2 and _one_error(err) == f"error: {path}:2: {message}"
    assert not run.exists()


@pytest.mark.parametrize("raw, message", [
    (b"", "empty file, cannot detect the QA format"),
    (json.dumps(_GOOD).encode() + b"\n" + json.dumps(dict(_GOOD, id="b")).encode()[:-2] + b'\xff"}\n',
     "2: not UTF-8 text (byte 0xff"),
])
def test_an_empty_or_non_utf8_data_file_is_named(raw, message, tmp_path, capsys):
    path, params = _hotpot(tmp_path, raw=raw)
    run = tmp_path / "run"
    rc, err = _main(capsys, run, *params)
    line = _one_error(err)
    assert rc == 2 and line.startswith(f"error: {path}") and message in line, line
    assert not run.exists()


def _texts():
    from mempo_jax.config_loader import load_config
    from mempo_jax.data.world import build_world
    from mempo_jax.run.experiment import tokenizer_texts

    cfg = load_config([str(REPO / "configs" / "tiny_world.gin")], SMALL_PARAMS)
    world = build_world(cfg.world)
    return tokenizer_texts(cfg, world.documents, world.train + world.heldout)


def test_a_vocabulary_too_small_for_sentencepiece(tmp_path, capsys):
    """It raised SentencePiece's RuntimeError ("INTERNAL: src/trainer_interface.cc(638) …")."""
    import sentencepiece  # noqa: F401 - the real trainer decides what is too small

    cache, run = tmp_path / "spm", tmp_path / "run"
    rc, err = _main(capsys, run, "ExperimentConfig.vocab_size=300", cache=cache)
    line = _one_error(err)
    assert rc == 2 and line.startswith("error: vocabulary size 300 (ExperimentConfig.vocab_size) is too small"), line
    need = int(line.split("needs at least ")[1].split()[0])
    chars = len(set("".join(t.replace("\n", " ") for t in _texts())))
    assert 300 < need and need >= 256 + chars  # byte pieces + the text's distinct characters
    assert not cache.exists() and not run.exists()


def test_a_garbage_cached_tokenizer_is_named(tmp_path, capsys):
    from mempo_jax.text.tokenizer import train_sentencepiece

    cache = tmp_path / "spm"
    cached = pathlib.Path(train_sentencepiece(_texts(), cache, 400).path)  # the file the run will load
    cached.write_bytes(b"\x00garbage, not a protobuf" * 7)
    run = tmp_path / "run"
    rc, err = _main(capsys, run, cache=cache)
    line = _one_error(err)
    assert rc == 2 and line.startswith(f"error: cached tokenizer {cached} is not a SentencePiece model (")
    assert line.endswith("delete it to retrain") and not run.exists()


@contextlib.contextmanager
def _tmpfs(path: pathlib.Path, *options: str):
    """A real tmpfs mounted at ``path`` (needs root and CAP_SYS_ADMIN; the test skips otherwise)."""
    path.mkdir(parents=True, exist_ok=True)
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join(options), "tmpfs", str(path)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_a_read_only_run_folder(tmp_path, capsys):
    """An existing run folder, and an absent one under a read-only parent, on a read-only file system."""
    mnt = tmp_path / "ro"
    with _tmpfs(mnt, "size=1m"):
        (mnt / "run").mkdir()
        (mnt / "run" / "metrics.jsonl").write_text("")
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        for run in (mnt / "run", mnt / "fresh" / "run"):
            rc, err = _main(capsys, run)
            line = _one_error(err)
            where = mnt / "run" if run == mnt / "run" else mnt
            assert rc == 2 and line == f"error: --run_dir {run}: cannot write in {where} (read-only file system)"
        assert sorted(p.name for p in mnt.iterdir()) == ["run"]


def test_a_run_folder_without_room_for_a_checkpoint(tmp_path, capsys):
    """A file system with less free space than one checkpoint (params + optimizer state) is refused
    at start-up, before SFT runs (it used to fail at the first save)."""
    mnt = tmp_path / "small"
    with _tmpfs(mnt, "size=2m"):
        (mnt / "filler").write_bytes(b"\0" * (1900 << 10))
        run = mnt / "run"
        rc, err = _main(capsys, run)
        line = _one_error(err)
        assert rc == 2 and line.startswith(f"error: --run_dir {run}: ") and "MB free on its file system" in line
        assert "one checkpoint of this model needs" in line and not run.exists()


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_disk_while_writing_is_one_line_naming_the_file(tmp_path, capsys, monkeypatch):
    """A write that fails with ENOSPC (here the tokenizer cache's temporary file, which /dev/full
    fills at once) is one line naming the file, exit 2: not a traceback."""
    import tempfile

    from mempo_jax.text.tokenizer import train_sentencepiece

    probe = tmp_path / "probe"
    model = pathlib.Path(train_sentencepiece(_texts(), probe, 400).path)
    cache = tmp_path / "spm"
    cache.mkdir()
    tmp = cache / (model.stem + ".full.tmp")  # where this run's tokenizer is written first
    tmp.symlink_to("/dev/full")

    def mkstemp_on_dev_full(*args, **kwargs):
        return os.open(tmp, os.O_WRONLY), str(tmp)

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp_on_dev_full)
    run = tmp_path / "run"
    rc, err = _main(capsys, run, cache=cache)
    assert rc == 2 and _one_error(err) == f"error: {tmp}: No space left on device [errno 28]"
    assert not run.exists() and not (cache / model.name).exists()


def test_two_writers_of_one_cached_tokenizer_both_succeed(tmp_path, monkeypatch):
    """Processes sharing a tokenizer cache (xdist workers, the small run beside them) may train the
    same model at once. Here a second writer trains and renames into place between the first
    writer's write and its rename; both must end with the model loaded, the cache holding it alone.
    (With one fixed temporary name the second writer renamed the first one's file away: ENOENT.)"""
    from mempo_jax.text import tokenizer as tok

    cache = tmp_path / "spm"
    real_replace = os.replace
    nested = []

    def replace_after_another_writer(src, dst):
        if not nested:
            nested.append(None)  # the second writer's own rename goes straight through
            nested[0] = tok.train_sentencepiece(_texts(), cache, 400)
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace_after_another_writer)
    first = tok.train_sentencepiece(_texts(), cache, 400)
    assert nested and pathlib.Path(first.path) == pathlib.Path(nested[0].path)
    assert first.encode("Paris <mem>") == nested[0].encode("Paris <mem>")
    assert sorted(p.name for p in cache.iterdir()) == [pathlib.Path(first.path).name]


def test_a_run_folder_that_is_a_file(tmp_path, capsys):
    run = tmp_path / "run"
    run.write_text("x")
    rc, err = _main(capsys, run)
    assert rc == 2 and _one_error(err) == f"error: --run_dir {run}: exists and is not a folder"
