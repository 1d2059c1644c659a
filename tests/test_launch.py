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
from mempo_jax import config as config_lib
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
        config_lib.load_config([str(REPO / path)])
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
    jax_version = next(line.split("==")[1] for line in (REPO / "requirements.txt").read_text().splitlines()
                       if line.startswith("jax=="))
    remote = ssh[-1].removeprefix("--command=")
    assert f"python3 -m pip install -q -r requirements.txt 'jax[tpu]=={jax_version}'" in remote
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
