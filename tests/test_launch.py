"""launch/*.sh: the gcloud commands for the v5p-64 recipe, checked twice — as ``--dry-run`` prints
them and as a stub ``gcloud`` first on PATH receives them — plus argument errors and shellcheck."""

import gzip
import os
import shlex
import shutil
import subprocess
import tarfile

import pytest

from conftest import REPO
from mempo_jax import config_loader
from mempo_jax.core import mesh_config

CONFIG = "configs/qwen2_5_7b_v5p64.gin"
BASE = ["--name", "mempo-7b", "--zone", "us-east5-a", "--project", "my-proj"]
SCRIPTS = ["create", "setup", "run", "logs", "copy_results", "delete"]
STUB = """#!/usr/bin/env bash
{ printf 'gcloud'; printf ' %q' "$@"; printf '\\n'; } >> "$GCLOUD_LOG"
"""


@pytest.fixture
def stub(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "gcloud").write_text(STUB)
    (bin_dir / "gcloud").chmod(0o755)
    log = tmp_path / "gcloud.log"
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", GCLOUD_LOG=str(log), TMPDIR=str(tmp_path))
    for k in ("MEMPO_TPU_NAME", "MEMPO_ZONE", "MEMPO_PROJECT"):
        env.pop(k, None)
    return env, log


def run_script(name, args, env):
    return subprocess.run(["bash", str(REPO / "launch" / f"{name}.sh"), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)


def commands(name, args, stub):
    """argv lists of the gcloud calls of one script: the dry-run print equals what the stub recorded."""
    env, log = stub
    dry = run_script(name, [*args, "--dry-run"], env)
    assert dry.returncode == 0, dry.stderr
    assert not log.exists()  # --dry-run never calls gcloud
    real = run_script(name, args, env)
    assert real.returncode == 0, real.stderr
    recorded = log.read_text().splitlines()
    log.unlink()
    assert dry.stdout.splitlines() == recorded
    return [shlex.split(line) for line in recorded]


def test_create_tpu_vm_and_queued_resource(stub):
    (cmd,) = commands("create", ["--config", CONFIG, *BASE], stub)
    assert cmd == ["gcloud", "compute", "tpus", "tpu-vm", "create", "mempo-7b", "--zone=us-east5-a",
                   "--project=my-proj", "--accelerator-type=v5p-64", "--version=v2-alpha-tpuv5"]
    (cmd,) = commands("create", ["--config", CONFIG, *BASE, "--queued", "--spot"], stub)
    assert cmd == ["gcloud", "compute", "tpus", "queued-resources", "create", "mempo-7b", "--node-id=mempo-7b",
                   "--zone=us-east5-a", "--project=my-proj", "--accelerator-type=v5p-64",
                   "--runtime-version=v2-alpha-tpuv5", "--spot"]


def test_scripts_read_the_slice_that_gin_binds():
    mesh_config.register()
    for path in (CONFIG, "configs/qwen2_5_0_5b_v5e8.gin"):
        config_loader.load_config([str(REPO / path)])
        tpu = mesh_config.from_gin().tpu
        src = f'source launch/common.sh; gin_string TPUConfig.accelerator_type {path}; ' \
              f'gin_string TPUConfig.runtime_version {path}'
        out = subprocess.run(["bash", "-c", src], cwd=REPO, capture_output=True, text=True, check=True).stdout
        assert out.split() == [tpu.accelerator_type, tpu.runtime_version]


def test_setup_copies_head_and_installs_requirements_on_all_workers(stub, tmp_path):
    scp, ssh = commands("setup", BASE, stub)
    tarball = tmp_path / "mempo_jax-mempo-7b.tar.gz"
    assert scp == ["gcloud", "compute", "tpus", "tpu-vm", "scp", str(tarball), "mempo-7b:~/mempo_jax.tar.gz",
                   "--worker=all", "--zone=us-east5-a", "--project=my-proj"]
    with tarfile.open(fileobj=gzip.open(tarball)) as tar:  # git HEAD, with the package and requirements
        names = set(tar.getnames())
    assert {"requirements.txt", "mempo_jax/commands/train.py", CONFIG} <= names
    assert ssh[:8] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "mempo-7b", "--worker=all", "--zone=us-east5-a"]
    jax_spec = next(line[len("jax"):] for line in (REPO / "requirements.txt").read_text().splitlines()
                    if line.startswith(("jax=", "jax>", "jax<", "jax~")))
    remote = ssh[-1].removeprefix("--command=")
    assert f"python3 -m pip install -q -r requirements.txt 'jax[tpu]{jax_spec}'" in remote
    assert remote.startswith("mkdir -p ~/mempo_jax ~/mempo_logs && tar -xzf ~/mempo_jax.tar.gz -C ~/mempo_jax")


def test_run_starts_the_config_on_every_worker(stub):
    (cmd,) = commands("run", ["--config", CONFIG, *BASE, "--gin_param", "RLConfig.steps=3"], stub)
    assert cmd[:9] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "mempo-7b", "--worker=all",
                       "--zone=us-east5-a", "--project=my-proj"]
    remote = shlex.split(cmd[9].removeprefix("--command="))
    start = remote.index("MEMPO_MULTIHOST=1")
    assert remote[:start] == ["mkdir", "-p", "~/mempo_logs", "&&", "cd", "~/mempo_jax", "&&"]
    assert remote[start + 1:] == ["nohup", "python3", "-m", "mempo_jax.commands.train", "--run_dir", "runs/qwen2_5_7b_v5p64",
                                  "--gin_file", CONFIG, "--gin_param", "RLConfig.steps=3", ">",
                                  "~/mempo_logs/qwen2_5_7b_v5p64.log", "2>&1", "<", "/dev/null", "&"]


def test_logs_copy_and_delete(stub, tmp_path):
    (cmd,) = commands("logs", ["--config", CONFIG, *BASE], stub)
    assert cmd[6] == "--worker=0" and cmd[-1] == "--command=tail -n 200 -F ~/mempo_logs/qwen2_5_7b_v5p64.log"
    dest = tmp_path / "results"
    (cmd,) = commands("copy_results", ["--config", CONFIG, *BASE, "--dest", str(dest)], stub)
    assert cmd == ["gcloud", "compute", "tpus", "tpu-vm", "scp", "--recurse",
                   "mempo-7b:~/mempo_jax/runs/qwen2_5_7b_v5p64", str(dest), "--worker=0", "--zone=us-east5-a",
                   "--project=my-proj"]
    assert dest.is_dir()
    (cmd,) = commands("copy_results", [*BASE, "--run-dir", "gs://bkt/runs/7b", "--dest", str(dest)], stub)
    assert cmd == ["gcloud", "storage", "cp", "--recursive", "gs://bkt/runs/7b", str(dest)]
    (cmd,) = commands("delete", BASE, stub)
    assert cmd == ["gcloud", "compute", "tpus", "tpu-vm", "delete", "mempo-7b", "--zone=us-east5-a",
                   "--project=my-proj", "--quiet"]
    (cmd,) = commands("delete", [*BASE, "--queued"], stub)
    assert cmd[3:6] == ["queued-resources", "delete", "mempo-7b"] and cmd[-2:] == ["--force", "--quiet"]


@pytest.mark.parametrize("script, args, message", [
    ("create", ["--name", "x", "--config", CONFIG], "--zone (or $MEMPO_ZONE) is required"),
    ("create", ["--name", "x", "--zone", "z"], "no accelerator type"),
    ("create", ["--name", "x", "--zone", "z", "--config", "configs/none.gin"], "no such config"),
    ("run", ["--name", "x", "--zone", "z"], "--config is required"),
    ("run", ["--name", "x", "--zone", "z", "--config", CONFIG, "--bogus"], "unknown option: --bogus"),
    ("delete", ["--zone", "z"], "--name (or $MEMPO_TPU_NAME) is required"),
])
def test_argument_errors_exit_2(stub, script, args, message):
    env, log = stub
    proc = run_script(script, [*args, "--dry-run"], env)
    assert proc.returncode == 2 and message in proc.stderr and proc.stdout == ""
    assert not log.exists()


def test_help_prints_usage():
    proc = subprocess.run(["bash", str(REPO / "launch" / "run.sh"), "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "Usage: launch/run.sh --config CONFIG" in proc.stderr


def test_scripts_are_shellcheck_clean():
    """shellcheck is a system tool, not a pip package: README's test command skips this check on a
    machine without it; ``.ci/run`` installs it and sets ``MEMPO_REQUIRE_SHELLCHECK=1``, which makes it
    required."""
    if shutil.which("shellcheck") is None:
        if os.environ.get("MEMPO_REQUIRE_SHELLCHECK") == "1":
            pytest.fail("shellcheck missing and MEMPO_REQUIRE_SHELLCHECK=1 (apt-get install -y shellcheck)")
        pytest.skip("shellcheck not installed (a system package: apt-get install shellcheck); .ci/run requires it")
    scripts = sorted(str(p) for p in (REPO / "launch").glob("*.sh"))
    assert len(scripts) == 7
    proc = subprocess.run(["shellcheck", "-x", *scripts], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stdout
    for name in SCRIPTS:
        assert os.access(REPO / "launch" / f"{name}.sh", os.X_OK), name


# ---- launch/run.sh --max-restarts: the supervisor, driven by a scripted gcloud ------------------------
SCRIPTED = """#!/usr/bin/env bash
# A gcloud stand-in: records every call; answers `describe` and the job-status probe from scripted
# answer files, one line per call (the last line repeats), each word of a status line one worker's.
{ printf 'gcloud'; printf ' %q' "$@"; printf '\\n'; } >> "$GCLOUD_LOG"
answer() {
  local file="$GCLOUD_SCRIPT/$1" line
  line="$(head -n 1 "$file")"
  if (($(wc -l < "$file") > 1)); then sed -i 1d "$file"; fi
  printf '%s\\n' $line
}
case "$*" in
  *" describe "*) answer states ;;
  *"--command=cat "*) echo "Using ssh batch size of 1."; answer statuses ;;
esac
"""


@pytest.fixture
def scripted(tmp_path, stub):
    env, log = stub
    (tmp_path / "bin" / "gcloud").write_text(SCRIPTED)
    script = tmp_path / "script"
    script.mkdir()
    env = dict(env, GCLOUD_SCRIPT=str(script))

    def run(states, statuses, *extra):
        (script / "states").write_text("\n".join(states) + "\n")
        (script / "statuses").write_text("\n".join(statuses) + "\n")
        proc = run_script("run", ["--config", CONFIG, *BASE, "--queued", "--poll", "0", *extra], env)
        calls = [shlex.split(line) for line in log.read_text().splitlines()] if log.exists() else []
        return proc, calls

    return run


def _kinds(calls):
    """Each gcloud call in short: ``describe``, ``delete``, ``create``, ``scp``, ``setup``, ``launch``, ``probe``."""
    out = []
    for c in calls:
        command = next((a for a in c if a.startswith("--command=")), "")
        if "describe" in c or "delete" in c or "create" in c or "scp" in c:
            out.append(next(k for k in ("describe", "delete", "create", "scp") if k in c))
        elif command.startswith("--command=cat "):
            out.append("probe")
        elif "pip install" in command:
            out.append("setup")
        else:
            out.append("launch")
    return out


def test_supervisor_recreates_a_preempted_slice_and_relaunches_an_exited_job(scripted):
    proc, calls = scripted(["ACTIVE", "SUSPENDED", "PROVISIONING", "ACTIVE"],
                           ["running running", "0 running", "done done"], "--max-restarts", "2", "--spot")
    assert proc.returncode == 0, proc.stderr
    assert _kinds(calls) == ["launch", "describe", "probe",  # running
                             "describe", "delete", "create", "describe", "describe", "scp", "setup", "launch",
                             "describe", "probe",  # a worker exited with 0 before the end (a preemption's save)
                             "launch", "describe", "probe"]  # done
    create = next(c for c in calls if "create" in c)
    assert create[3:6] == ["queued-resources", "create", "mempo-7b"] and "--spot" in create
    lines = [x.split("] ", 1)[1] for x in proc.stderr.splitlines() if x.startswith("[launch/run.sh")]
    assert lines == ["following the job (--max-restarts 2, every 0s)",
                     "restart 1/2: queued resource mempo-7b is SUSPENDED; recreating the slice, then relaunching "
                     "from the last checkpoint",
                     "restart 2/2: a worker exited before the end (statuses: 0 running); relaunching from the last "
                     "checkpoint",
                     "the run is done (every worker reports it)"]
    launch = calls[0][-1].removeprefix("--command=")
    # the relaunch stops a trainer still running there, and the job records how it ended
    assert launch.startswith("mkdir -p ~/mempo_logs && { if [ -f ~/mempo_logs/qwen2_5_7b_v5p64.pid ]")
    job = shlex.split(launch)[shlex.split(launch).index("-c") + 1]
    assert job.startswith("python3 -m mempo_jax.commands.train --run_dir runs/qwen2_5_7b_v5p64 --gin_file " + CONFIG)
    assert job.endswith("if [ $rc = 0 ] && [ -f runs/qwen2_5_7b_v5p64/summary.json ]; then echo done; "
                        "else echo $rc; fi > ~/mempo_logs/qwen2_5_7b_v5p64.status")


def test_supervisor_gives_up_after_its_restarts_and_on_a_bad_config(scripted):
    proc, calls = scripted(["ACTIVE", "FAILED"], ["running"], "--max-restarts", "0")
    assert proc.returncode == 1 and _kinds(calls) == ["launch", "describe", "probe", "describe"]
    assert "giving up: queued resource mempo-7b is FAILED, and --max-restarts 0 are used" in proc.stderr


def test_supervisor_does_not_restart_a_run_stopped_by_bad_input(scripted):
    proc, calls = scripted(["ACTIVE"], ["2 running"], "--max-restarts", "3")
    assert proc.returncode == 2 and _kinds(calls) == ["launch", "describe", "probe"]
    assert "a worker stopped with status 2 (bad config or input" in proc.stderr


def test_supervisor_dry_run_prints_one_restart(stub, scripted):
    env, log = stub
    args = ["--config", CONFIG, *BASE, "--queued", "--max-restarts", "1", "--dry-run"]
    dry = run_script("run", args, env)
    assert dry.returncode == 0 and not log.exists(), dry.stderr
    printed = [shlex.split(x) for x in dry.stdout.splitlines()]
    assert _kinds(printed) == ["launch", "describe", "probe", "delete", "create", "describe", "scp", "setup", "launch"]
    assert "restart 1/1: queued resource mempo-7b is SUSPENDED (dry run)" in dry.stderr
    # the same commands, run against the stand-in with that history, are what gcloud receives
    proc, calls = scripted(["SUSPENDED", "ACTIVE", "SUSPENDED"], ["running"], "--max-restarts", "1")
    assert proc.returncode == 1  # preempted again after its one restart: it gives up
    assert calls[:2] == printed[:2] and calls[2:8] == printed[3:] and _kinds(calls[8:]) == ["describe"]


def test_supervisor_of_a_bucket_run_folder_asks_the_bucket_for_the_summary(stub):
    env, log = stub
    args = ["--config", CONFIG, *BASE, "--run-dir", "gs://bkt/runs/7b", "--max-restarts", "1", "--dry-run"]
    dry = run_script("run", args, env)
    assert dry.returncode == 0 and not log.exists(), dry.stderr
    launch = shlex.split(dry.stdout.splitlines()[0])[-1].removeprefix("--command=")
    job = shlex.split(launch)[shlex.split(launch).index("-c") + 1]
    assert job.startswith("python3 -m mempo_jax.commands.train --run_dir gs://bkt/runs/7b --gin_file " + CONFIG)
    assert "if [ $rc = 0 ] && gcloud storage ls gs://bkt/runs/7b/summary.json > /dev/null 2>&1; then echo done" in job


@pytest.mark.parametrize("args, message", [
    (["--max-restarts", "x"], "--max-restarts must be a whole number, got 'x'"),
    (["--max-restarts", "1", "--poll", "1.5"], "--poll must be a whole number of seconds, got '1.5'"),
])
def test_supervisor_argument_errors(stub, args, message):
    proc = run_script("run", ["--config", CONFIG, *BASE, *args, "--dry-run"], stub[0])
    assert proc.returncode == 2 and message in proc.stderr and proc.stdout == ""
