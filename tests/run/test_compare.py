"""``mempo-compare``: paired differences of two stored held-out evaluations, with bootstrap CIs.

Golden values are computed by hand on small evaluations; on a real run folder of the main job the
RL-vs-SFT comparison equals the ``rl_vs_sft`` gains the trainer wrote to ``summary.json``.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys

import pytest
from hypothesis import given, settings, strategies as st

from conftest import REPO
from mempo_jax.commands.compare import main
from mempo_jax.run.compare import Evaluation, compare, format_comparison, load_evaluation, only_kinds

sys.path.insert(0, str(REPO / "benchmarks"))
from chaos_resume import SMALL_PARAMS  # noqa: E402


def _write_eval(run, stage, em, f1, ids=None):
    run.mkdir(parents=True, exist_ok=True)
    (run / f"eval_{stage}.json").write_text(json.dumps({"per_question_em": em, "per_question_f1": f1}))
    if ids is not None:
        (run / f"eval_{stage}_predictions.jsonl").write_text(
            "".join(json.dumps({"mode": m, "id": i}) + "\n" for m, qs in ids.items() for i in qs))


def test_means_differences_and_counts_by_hand(tmp_path):
    _write_eval(tmp_path / "a", "rl", {"k1": [1, 0, 1, 0], "full": [1, 1, 1, 1]},
                {"k1": [1, 0.5, 1, 0], "full": [1, 1, 1, 1]})
    _write_eval(tmp_path / "b", "sft", {"k1": [0, 0, 1, 1]}, {"k1": [0, 0, 1, 0.25]})
    a, b = load_evaluation(str(tmp_path / "a")), load_evaluation(f"{tmp_path / 'b'}:sft")
    r = compare(a, b)
    assert list(r) == ["k1"]  # the only mode both evaluated
    em, f1 = r["k1"]["em"], r["k1"]["f1"]
    assert (em["a"], em["b"], em["diff"], em["above"], em["below"], em["n"]) == (0.5, 0.5, 0.0, 1, 1, 4)
    assert f1["a"] == pytest.approx(0.625) and f1["b"] == pytest.approx(0.3125)
    assert f1["diff"] == pytest.approx(0.3125) and (f1["above"], f1["below"]) == (2, 1)
    assert em["lo"] <= 0.0 <= em["hi"] and -0.25 <= f1["lo"] <= f1["diff"] <= f1["hi"] <= 0.75
    assert "| k1 | f1 | 0.625 | 0.312 | +0.312 [" in format_comparison(a, b, r)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 30), st.integers(-8, 8).map(lambda k: k / 8),
       st.lists(st.integers(0, 8).map(lambda k: k / 8), min_size=1, max_size=30))
def test_a_constant_difference_has_a_point_interval(n, delta, base):
    """Every question differs by the same ``delta`` (eighths: exact in binary, so ``x + delta``
    differs from ``x`` exactly when ``delta`` is not 0): every bootstrap mean is ``delta``."""
    base = (base * n)[:n]
    a = Evaluation("a", {"em": {"k1": [x + delta for x in base]}, "f1": {"k1": [x + delta for x in base]}}, None)
    b = Evaluation("b", {"em": {"k1": base}, "f1": {"k1": base}}, None)
    r = compare(a, b, samples=50)["k1"]["f1"]
    assert r["lo"] == pytest.approx(delta, abs=1e-9) and r["hi"] == pytest.approx(delta, abs=1e-9)
    assert (r["above"], r["below"]) == ((n, 0) if delta > 0 else (0, n) if delta < 0 else (0, 0))


@pytest.mark.parametrize("make, message", [
    (lambda t: None, "no run folder"),
    (lambda t: t.mkdir(), "no {run}/eval_rl.json"),
    (lambda t: (t.mkdir(), (t / "eval_rl.json").write_text("{")), "eval_rl.json: not readable as JSON"),
    (lambda t: (t.mkdir(), (t / "eval_rl.json").write_text("{}")), "eval_rl.json: no per_question_em field"),
    (lambda t: (t.mkdir(), (t / "eval_rl.json").write_text("[]")), "eval_rl.json: not a JSON object"),
    (lambda t: (t.mkdir(), (t / "eval_rl.json").write_text('{"per_question_em": {"k1": [1, null]}}')),
     "eval_rl.json: per_question_em[k1] holds None, not a finite number"),
    (lambda t: (t.mkdir(), (t / "eval_rl.json").write_text('{"per_question_em": {"k1": []}}')),
     "eval_rl.json: per_question_em[k1] is not a non-empty list"),
    (lambda t: (_write_eval(t, "rl", {"k1": [1]}, {"k1": [1]}), (t / "eval_rl_predictions.jsonl").write_bytes(b"\xff")),
     "eval_rl_predictions.jsonl: not readable"),
])
def test_bad_input_is_one_line_naming_the_file(tmp_path, capsys, make, message):
    run = tmp_path / "run"
    make(run)
    _write_eval(tmp_path / "ok", "rl", {"k1": [1]}, {"k1": [1]})
    assert main([str(run), str(tmp_path / "ok")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message.format(run=run) in err and "\n" not in err


def _write_evaluate_out(folder, records):
    """A ``mempo-evaluate --out`` folder: ``eval_meta.json`` and ``predictions.jsonl``."""
    folder.mkdir(parents=True)
    (folder / "eval_meta.json").write_text("{}")
    (folder / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def _record(dataset, mode, qid, em, f1, **extra):
    return {"dataset": dataset, "mode": mode, "id": qid, "em": em, "f1": f1, **extra}


def test_evaluate_out_folders_compare_per_dataset_and_mode_by_hand(tmp_path, capsys):
    a = [_record("hotpotqa", "k1", "q1", 1.0, 1.0), _record("hotpotqa", "k1", "q2", 0.0, 0.5),
         _record("nq", "k1", "n1", 1.0, 1.0), _record("hotpotqa", "full", "q1", 0.0, 0.0)]
    b = [_record("hotpotqa", "k1", "q1", 0.0, 0.25), _record("hotpotqa", "k1", "q2", 0.0, 0.5),
         _record("nq", "k1", "n1", 1.0, 1.0)]
    _write_evaluate_out(tmp_path / "a", a)
    _write_evaluate_out(tmp_path / "b", b)
    assert main([str(tmp_path / "a"), str(tmp_path / "b"), "--json"]) == 0
    out, err = capsys.readouterr()
    r = json.loads(out)
    assert list(r) == ["hotpotqa/k1", "nq/k1"] and "also evaluated hotpotqa/full" in err
    em, f1 = r["hotpotqa/k1"]["em"], r["hotpotqa/k1"]["f1"]
    assert (em["a"], em["b"], em["diff"], em["above"], em["below"], em["n"]) == (0.5, 0.0, 0.5, 1, 0, 2)
    assert (f1["a"], f1["b"], f1["diff"], f1["above"], f1["below"]) == (0.75, 0.375, 0.375, 1, 0)
    assert r["nq/k1"]["em"]["diff"] == 0.0
    gz = tmp_path / "a_gz"  # committed gzipped beside a results page: the same comparison
    gz.mkdir()
    (gz / "eval_meta.json").write_text("{}")
    (gz / "predictions.jsonl.gz").write_bytes(gzip.compress((tmp_path / "a" / "predictions.jsonl").read_bytes()))
    b_eval = load_evaluation(str(tmp_path / "b"))
    assert compare(load_evaluation(str(gz)), b_eval) == compare(load_evaluation(str(tmp_path / "a")), b_eval)
    _write_evaluate_out(tmp_path / "c", [dict(x, id="other") for x in b])
    with pytest.raises(ValueError, match="list different questions"):
        compare(load_evaluation(str(tmp_path / "a")), load_evaluation(str(tmp_path / "c")))


@pytest.mark.parametrize("records, message", [
    ([], "predictions.jsonl: no prediction record"),
    ([{"dataset": "d", "mode": "k1", "id": "q", "em": 1.0}], "predictions.jsonl:1: no f1 field"),
    ([_record("d", "k1", "q", 1.0, 1.0), _record("d", "k1", "r", None, 1.0)],
     "predictions.jsonl:2: em is None, not a finite number"),
    ([[1, 2]], "predictions.jsonl:1: not a prediction record (not a JSON object)"),
])
def test_bad_evaluate_out_folder_is_one_line_naming_file_and_line(tmp_path, capsys, records, message):
    _write_evaluate_out(tmp_path / "bad", records)
    _write_evaluate_out(tmp_path / "ok", [_record("d", "k1", "q", 1.0, 1.0)])
    assert main([str(tmp_path / "bad"), str(tmp_path / "ok")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err


def test_samples_below_one_are_refused(tmp_path, capsys):
    _write_eval(tmp_path / "a", "rl", {"k1": [1]}, {"k1": [1]})
    with pytest.raises(SystemExit):
        main([str(tmp_path / "a"), str(tmp_path / "a"), "--samples", "0"])
    assert "must be >= 1" in capsys.readouterr().err


def test_em_only_evaluation_and_notes(tmp_path, capsys):
    """An evaluation stored without per-question F1 is compared on EM; a mode on one side only and
    a missing predictions file are noted on stderr."""
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "eval_rl.json").write_text(json.dumps({"per_question_em": {"k1": [1, 1], "full": [0, 0]}}))
    _write_eval(tmp_path / "b", "rl", {"k1": [0, 1]}, {"k1": [0, 0.5]}, ids={"k1": ["q1", "q2"]})
    assert main([str(tmp_path / "a"), str(tmp_path / "b"), "--json"]) == 0
    out, err = capsys.readouterr()
    result = json.loads(out)
    assert list(result) == ["k1"] and list(result["k1"]) == ["em"] and result["k1"]["em"]["diff"] == 0.5
    assert "also evaluated full (not compared)" in err and "has no predictions file" in err


def test_different_held_out_sets_are_refused(tmp_path):
    _write_eval(tmp_path / "a", "rl", {"k1": [1, 0]}, {"k1": [1, 0]}, ids={"k1": ["q1", "q2"]})
    _write_eval(tmp_path / "b", "rl", {"k1": [1, 0, 0]}, {"k1": [1, 0, 0]})
    _write_eval(tmp_path / "c", "rl", {"k1": [1, 0]}, {"k1": [1, 0]}, ids={"k1": ["q2", "q1"]})
    _write_eval(tmp_path / "d", "rl", {"full": [1, 0]}, {"full": [1, 0]})
    _write_eval(tmp_path / "e", "rl", {"k1": [1, 0]}, {"k1": [1, 0]}, ids={"k1": ["q1"]})
    for other, message in (("b", "evaluated 2 questions"), ("c", "list different questions"),
                           ("d", "share no context mode"), ("e", "ids do not match the 2 questions")):
        with pytest.raises(ValueError, match=message):
            compare(load_evaluation(str(tmp_path / "a")), load_evaluation(str(tmp_path / other)))


def test_rl_against_sft_of_a_real_run_equals_its_summary(small_run, tmp_path):
    """The main job's own files: ``mempo-compare RUN:rl RUN:sft`` (run from another folder, as a
    module) reproduces ``summary.json``'s ``rl_vs_sft`` gains, with the trainer's bootstrap
    settings (``EvalConfig.bootstrap_samples``, seed 0)."""
    samples = next(p.split("=")[1] for p in SMALL_PARAMS if p.startswith("EvalConfig.bootstrap_samples="))
    out = subprocess.run([sys.executable, "-m", "mempo_jax.commands.compare", f"{small_run}:rl", f"{small_run}:sft",
                          "--json", "--samples", samples], capture_output=True, text=True, cwd=tmp_path,
                         env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    want = json.loads((small_run / "summary.json").read_text())["gains"]["rl_vs_sft"]
    assert set(got) == set(want)
    for mode in want:
        for metric, (mean, lo, hi) in want[mode].items():
            r = got[mode][metric]
            assert (r["diff"], r["lo"], r["hi"]) == pytest.approx((mean, lo, hi), abs=1e-12)


def _write_kinded(run, stage, em, kinds, gz=False):
    import gzip

    run.mkdir(parents=True, exist_ok=True)
    (run / f"eval_{stage}.json").write_text(json.dumps({"per_question_em": {"k1": em}}))
    text = "".join(json.dumps({"mode": "k1", "id": f"{k}-{i}", "kind": k}) + "\n" for i, k in enumerate(kinds))
    name = f"eval_{stage}_predictions.jsonl"
    if gz:
        (run / (name + ".gz")).write_bytes(gzip.compress(text.encode()))
    else:
        (run / name).write_text(text)


def test_kinds_compare_only_those_questions_by_hand(tmp_path, capsys):
    kinds = ["single", "bridge", "multi", "single", "multi", "bridge"]
    _write_kinded(tmp_path / "a", "rl", [1, 1, 1, 0, 0, 1], kinds, gz=True)  # committed predictions: gzipped
    _write_kinded(tmp_path / "b", "rl", [0, 0, 1, 1, 1, 0], kinds)
    a, b = load_evaluation(str(tmp_path / "a")), load_evaluation(str(tmp_path / "b"))
    ra, rb = only_kinds(a, ["bridge", "multi"]), only_kinds(b, ["bridge", "multi"])
    assert ra.per_question["em"]["k1"] == [1, 1, 0, 1] and rb.per_question["em"]["k1"] == [0, 1, 1, 0]
    r = compare(ra, rb, samples=200)["k1"]["em"]
    assert (r["a"], r["b"], r["diff"], r["above"], r["below"], r["n"]) == (0.75, 0.5, 0.25, 2, 1, 4)
    assert main([str(tmp_path / "a"), str(tmp_path / "b"), "--kinds", "bridge,multi", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["k1"]["em"]["n"] == 4


def test_kinds_without_kind_records_or_matches_is_one_line(tmp_path, capsys):
    _write_eval(tmp_path / "a", "rl", {"k1": [1.0, 0.0]}, {"k1": [0.0, 1.0]}, ids={"k1": ["q0", "q1"]})
    _write_kinded(tmp_path / "b", "rl", [1, 0], ["single", "single"])
    for run, message in ((tmp_path / "a", "needs the predictions file's kind field"), (tmp_path / "b", "no k1 question of kind bridge")):
        assert main([str(run), str(run), "--kinds", "bridge"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and err.count("\n") == 1, err
