"""Loading a configuration: gin files and ``--gin_param`` bindings parsed into the validated dataclasses
of ``mempo_jax.config`` (``load_config``, ``load_run_config``), with one-line errors naming the file,
line or field; retired fields refused with their replacement (``RETIRED_FIELDS``). Library code never
reads gin: only the commands call this module.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import re
import tokenize
from typing import NamedTuple, Sequence

import gin

from mempo_jax import recipes
from mempo_jax.agent.rollout import RolloutConfig
from mempo_jax.config import (CheckpointConfig, EvalConfig, ExecutionConfig, ExperimentConfig, ModelOptions,
                              SFTConfig)
from mempo_jax.core.distributed import DistributedConfig
from mempo_jax.core.mesh_config import MeshConfig, PlanConfig, TPUConfig
from mempo_jax.data.scripted_agent import ScriptedAgentConfig
from mempo_jax.data.world import WorldConfig
from mempo_jax.model.lora import LoraConfig
from mempo_jax.rl.config import RLConfig
from mempo_jax.rl.learner import OptimConfig
from mempo_jax.rl.losses import LossConfig
from mempo_jax.rl.memory_reward import MemoryRewardConfig

# MeshConfig / TPUConfig / PlanConfig (mempo_jax.core.mesh_config) sit beside ExperimentConfig in a pod
# recipe; they are registered here so every shipped gin file parses through ``load_config``.
_CONFIGURABLES = (ExperimentConfig, WorldConfig, ModelOptions, SFTConfig, ScriptedAgentConfig, OptimConfig,
                  RLConfig, RolloutConfig, LossConfig, MemoryRewardConfig, EvalConfig, CheckpointConfig, ExecutionConfig, MeshConfig,
                  TPUConfig, PlanConfig, LoraConfig, DistributedConfig)
# Fields that are no longer fields, and the one to bind instead (None: delete the binding). A config
# that binds one, a recipe or a run folder's config.gin, is refused at start-up with one line naming
# the replacement; CHANGELOG.md says when each moved and why.
RETIRED_FIELDS = {
    "PlanConfig.micro_batch_rows": "ExecutionConfig.micro_batch_rows",
    "PlanConfig.logprob_chunk_rows": "ExecutionConfig.logprob_chunk_rows",
    "PlanConfig.scoring_chunk_rows": "ExecutionConfig.scoring_chunk_rows",
    "SFTConfig.micro_batch_rows": "ExecutionConfig.sft_micro_batch_rows",
    **{f"RLConfig.{old}": f"MemoryRewardConfig.{new}" for old, new in (
        ("memory_answer", "answer"), ("memory_prefix", "prefix"), ("memory_reward_malformed", "include_malformed"),
        ("memory_reward_on", "trajectories"), ("memory_reward_scale", "scale"), ("memory_baseline", "baseline"),
        ("memory_hindsight", "hindsight"), ("memory_norm", "norm"), ("memory_group", "group"))},
    "RolloutConfig.engine": None,
}
_registered = False
_gin_search_dirs: set[str] = set()  # folders already given to gin.add_config_file_search_path


def _register() -> None:
    global _registered
    if not _registered:
        with gin.unlock_config():  # an earlier parse (another module, a test) may have locked it
            for cls in _CONFIGURABLES:
                try:
                    gin.external_configurable(cls)
                except ValueError:  # registered already
                    pass
        _registered = True


def _add_gin_search_dirs(gin_files: Sequence[str]) -> None:
    """Let gin find an ``include`` beside the given files and among the shipped recipes
    (``recipes.search_dirs``; gin tries the working directory first)."""
    for folder in recipes.search_dirs(gin_files):
        if folder not in _gin_search_dirs:
            gin.add_config_file_search_path(folder)
            _gin_search_dirs.add(folder)


class _DropGinPathProbes(logging.Filter):
    """Drops gin's ``Path not found: F`` log line: gin's package-resource reader logs it for every
    search folder an ``include`` is not in before the folder that holds it (``recipes.search_dirs``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Path not found:")


def load_config(gin_files: Sequence[str] = (), gin_params: Sequence[str] = ()) -> ExperimentConfig:
    """Parse gin files and bindings into a validated ``ExperimentConfig``.

    A gin file is a path or a shipped recipe's name (``smollm2_hotpotqa``; ``recipes.resolve_recipe``),
    from any working directory; its ``include`` statements are found as ``recipes.find_file`` says.

    Raises:
      ValueError: one line naming the unknown binding, the unparsable ``--gin_param``, the bad
        value (with the binding that set it) or the missing file.
    """
    _register()
    gin.clear_config()
    gin_files = [recipes.resolve_recipe(f) for f in gin_files]
    _add_gin_search_dirs(gin_files)
    for param in gin_params:  # a syntax error names its --gin_param (gin's message says "line N")
        problem = _syntax_error(param)
        if problem:
            hint = ("; a string value needs quotes, e.g. X.field=\"value\""
                    if "malformed node or string" in problem else "")
            problem = re.sub(r"<ast\.\w+ object at 0x[0-9a-f]+>", "an unquoted name", problem)
            raise ValueError(f"config error: cannot parse --gin_param {param!r}: "
                             f"{re.sub(r' [(]line [0-9]+[)]$', '', problem)}{hint}")
    _check_retired(gin_files, gin_params)
    probes = _DropGinPathProbes()
    logging.getLogger().addFilter(probes)
    try:
        gin.parse_config_files_and_bindings(list(gin_files), list(gin_params))
        with gin.config_scope(None):
            cfg = gin.get_configurable(ExperimentConfig)()
            # CheckpointConfig.* / MeshConfig.* / ExecutionConfig.* bindings apply without an
            # ExperimentConfig.<field> = @...() line, MemoryRewardConfig.* ones without RLConfig.memory_reward (unbound ones stay out of the operative config).
            nested = {"checkpoint": CheckpointConfig}
            nested.update({name: kind for name, kind in (("mesh", MeshConfig), ("execution", ExecutionConfig),
                                                         ("lora", LoraConfig), ("distributed", DistributedConfig))
                           if binds_any(kind)})
            cfg = dataclasses.replace(cfg, **{name: gin.get_configurable(kind)() for name, kind in nested.items()
                                              if not _is_bound(f"ExperimentConfig.{name}")})
            if binds_any(MemoryRewardConfig) and not _is_bound("RLConfig.memory_reward"):  # likewise
                cfg = dataclasses.replace(cfg, rl=dataclasses.replace(
                    cfg.rl, memory_reward=gin.get_configurable(MemoryRewardConfig)()))
    except (ValueError, TypeError, KeyError, OSError, SyntaxError, tokenize.TokenError) as e:
        if isinstance(e, tokenize.TokenError):  # gin's message names no file: find the one that does not parse
            for path in gin_files:
                problem = _syntax_error(pathlib.Path(path).read_text(encoding="utf-8"))
                if problem:
                    raise ValueError(f"config error: cannot parse {path}: {problem}") from None
        missing = _missing_gin_file(gin_files) if isinstance(e, (TypeError, OSError)) else ""
        if missing:  # gin's resource reader fails on a missing file with a TypeError naming no file
            raise ValueError(f"config error: {missing}") from None
        msg = _one_line_gin_error(e, gin_params)
        raise ValueError(f"config error: {msg}{_binding_source(msg, gin_files, gin_params)}"
                         f"{_package_include_hint(e, msg)}") from None
    finally:
        logging.getLogger().removeFilter(probes)
    _check_types(cfg, "ExperimentConfig")
    return cfg


def _missing_gin_file(gin_files: Sequence[str]) -> str:
    """"no such gin file: F ..." for the first of ``gin_files``, or of the files their ``include``
    statements name (gin's own parser, followed recursively; found as ``recipes.find_file`` says),
    that is not a file; "" when every one exists."""
    todo, seen = [(str(f), "", None) for f in gin_files], set()
    while todo:
        name, where, beside = todo.pop(0)
        found = recipes.find_file(name, beside)
        if found is None:
            return (f"no such gin file: {name}{f' (include at {where})' if where else ''}; looked in the working "
                    f"directory {os.getcwd()}{', beside the including file' if where else ''} and among the "
                    f"shipped recipes ({', '.join(recipes.recipe_names())})")
        path = str(found)
        if path in seen:
            continue
        seen.add(path)
        parser = gin.config_parser.ConfigParser(found.read_text(encoding="utf-8"),
                                                gin.config.ParserDelegate(skip_unknown=True))
        try:
            todo += [(st.filename, f"{path}:{st.location.line_num}", found.parent) for st in parser
                     if isinstance(st, gin.config_parser.IncludeStatement)]
        except (SyntaxError, tokenize.TokenError, ValueError):  # gin's own error says what does not parse
            continue
    return ""


def _check_retired(gin_files: Sequence[str], gin_params: Sequence[str]) -> None:
    """Refuse a binding of a field in ``RETIRED_FIELDS``.

    Raises:
      ValueError: ``config error: X moved to Y; bind Y instead (FILE:LINE: binding)`` (or
        ``(--gin_param B)``), or ``config error: X was removed; delete the binding (…)``.
    """
    for old, new in RETIRED_FIELDS.items():
        where = _binding_source(old, gin_files, gin_params)
        if where and new:
            raise ValueError(f"config error: {old} moved to {new}; bind {new} instead{where}")
        if where:
            raise ValueError(f"config error: {old} was removed; delete the binding{where}")


def _syntax_error(text: str) -> str:
    """gin's first message line for a bindings text that does not parse, else "" (nothing is bound)."""
    try:
        for _ in gin.config_parser.ConfigParser(text, gin.config.ParserDelegate(skip_unknown=True)):
            pass
    except (SyntaxError, tokenize.TokenError, ValueError) as e:
        if isinstance(e, tokenize.TokenError) and e.args:
            line = e.args[1][0] if len(e.args) > 1 and isinstance(e.args[1], tuple) else "?"
            return f"{e.args[0]} (line {line})"
        lines = str(e).strip().splitlines()
        return lines[0] if lines else type(e).__name__
    return ""


def _binding_source(msg: str, gin_files: Sequence[str], gin_params: Sequence[str]) -> str:
    """`` (--gin_param B)`` or `` (FILE:LINE: B)`` for the binding of the field a field check
    names (``"RLConfig.steps must be ..."``), else ""; the last binding wins, as in gin."""
    m = re.match(r"([A-Za-z_]\w*)\.([A-Za-z_]\w*)\b", msg)
    if not m or "(--gin_param" in msg or re.search(r"\(\S+:\d+: ", msg):
        return ""
    lhs = re.compile(rf"^\s*(?:[\w/]+/)?{m.group(1)}\.{m.group(2)}\s*=")
    for param in reversed(list(gin_params)):
        if lhs.match(param):
            return f" (--gin_param {param})"
    for path in reversed(list(gin_files)):
        try:
            lines = pathlib.Path(path).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError):
            continue
        for i in range(len(lines) - 1, -1, -1):
            if lhs.match(lines[i]):
                return f" ({path}:{i + 1}: {lines[i].strip()})"
    return ""


def _package_include_hint(e: BaseException, msg: str) -> str:
    """For gin's TypeError on an ``include 'pkg/file.gin'`` whose first folder is an importable Python
    package (gin's resource reader then looks inside that package and fails on a namespace
    package): what happened and what to write instead; else ""."""
    m = re.search(r"include '([^'/]+)/[^']*'", msg)
    if not isinstance(e, TypeError) or not m:
        return ""
    import importlib.util

    try:
        spec = importlib.util.find_spec(m.group(1))
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return ""
    where = ", ".join(dict.fromkeys(spec.submodule_search_locations or [])) or spec.origin
    return (f"; gin looked for it inside the importable Python package {m.group(1)!r} ({where}): include it "
            "by its bare name, or by an absolute path")


def _one_line_gin_error(e: BaseException, gin_params: Sequence[str]) -> str:
    """gin's first message line plus where the binding came from (file:line or the --gin_param)."""
    lines = [x.strip() for x in str(e).strip().splitlines() if x.strip()]
    if not lines:
        return repr(e)
    msg = lines[0]
    for i, line in enumerate(lines[1:], 1):
        m = re.match(r'In file "(.+)", line (\d+)', line)
        if m:
            return f"{msg} ({m.group(1)}:{m.group(2)}: {lines[i + 1] if i + 1 < len(lines) else ''})"
        m = re.match(r"In bindings string line (\d+)", line)
        if m and 0 < int(m.group(1)) <= len(gin_params):
            return f"{msg} (--gin_param {gin_params[int(m.group(1)) - 1]})"
    return msg


_SIMPLE_TYPES = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,), "tuple": (tuple, list),
                 "int | str": (int, str)}


def _check_types(obj, path: str) -> None:
    """Raise a one-line ``ValueError`` naming the first field whose value has the wrong type
    (e.g. ``RLConfig.steps="x"``); nested config dataclasses are checked recursively."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        where = f"{type(obj).__name__}.{f.name}"
        if dataclasses.is_dataclass(value):
            _check_types(value, where)
            continue
        ann = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
        allowed = _SIMPLE_TYPES.get(ann)
        if allowed is None:
            continue
        if (isinstance(value, bool) and bool not in allowed) or not isinstance(value, allowed):
            raise ValueError(f"config error: {where} must be {ann}, got {value!r} ({path})")


def binds_any(cls) -> bool:
    """True when the parsed config (call after ``load_config``) binds a field of the dataclass
    ``cls`` (e.g. ``MeshConfig``)."""
    return any(_is_bound(f"{cls.__name__}.{f.name}") for f in dataclasses.fields(cls))


def mesh_requested() -> bool:
    """True when the parsed config binds a ``MeshConfig`` field (a sharded run; call after
    ``load_config``). Without one, ``python -m mempo_jax.commands.train`` runs on one device."""
    return binds_any(MeshConfig)


def _is_bound(name: str) -> bool:
    try:
        gin.query_parameter(name)
    except ValueError:
        return False
    return True


def operative_config() -> str:
    """The gin bindings actually used (written to ``RUN_DIR/config.gin``)."""
    return gin.operative_config_str()


class RunConfig(NamedTuple):
    """What ``load_run_config`` returns.

    Attributes:
      experiment: the validated ``ExperimentConfig``.
      mesh: ``experiment.mesh`` (the ``MeshConfig``).
      tpu, plan: the bound ``TPUConfig`` and ``PlanConfig`` (defaults where unbound; the planner's).
      sharded: True when the config binds a ``MeshConfig`` field: the run's mesh is ``mesh`` over
        every device (it also is on several processes); else the smallest mesh, ``(1, 1, 1)``.
    """

    experiment: ExperimentConfig
    mesh: MeshConfig
    tpu: TPUConfig
    plan: PlanConfig
    sharded: bool


def load_run_config(gin_files: Sequence[str], gin_params: Sequence[str] = ()) -> RunConfig:
    """Parse a recipe the way ``python -m mempo_jax.commands.train`` does (every ``configs/*.gin`` loads).

    Args:
      gin_files: gin files, parsed in order.
      gin_params: ``--gin_param`` bindings, applied after the files.

    Returns:
      A ``RunConfig``.

    Raises:
      ValueError: one line (``config error: ...``) naming the unknown binding, the bad value or
        the ``MeshConfig`` / ``TPUConfig`` / ``PlanConfig`` field that is out of range.
    """
    cfg = load_config(gin_files, gin_params)
    try:  # unbound ones are plain defaults, kept out of the operative config (RUN_DIR/config.gin)
        with gin.config_scope(None):
            tpu, plan = [gin.get_configurable(c)() if binds_any(c) else c() for c in (TPUConfig, PlanConfig)]
    except (ValueError, TypeError) as e:
        raise ValueError(f"config error: {_one_line_gin_error(e, gin_params)}") from None
    return RunConfig(cfg, cfg.mesh, tpu, plan, mesh_requested())
