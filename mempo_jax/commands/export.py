"""Export a run folder's checkpoint as a Hugging Face folder (``mempo-export``)::

    python -m mempo_jax.commands.export --run_dir RUN_DIR [--checkpoint STEP] --out DIR [--peft_out DIR]

Writes what the trainer writes to ``RUN_DIR/hf_export`` (``mempo_jax.run.export.export_policy``:
weights, tokenizer and the run's protocol, ``run.export_protocol``) for any RL checkpoint of the run; ``--peft_out`` also writes a LoRA run's adapters as a PEFT folder
over the source checkpoint. The source checkpoint's token ids and context length are carried over
when ``ModelOptions.checkpoint`` of ``RUN_DIR/config.gin`` still exists. Exit status: 0 written
(the folder printed), 2 bad input (one ``error:`` line on stderr).
"""

from __future__ import annotations

import argparse
import sys

from mempo_jax.commands.cli import command_name
from mempo_jax.run.checkpoint import load_policy
from mempo_jax.run.export import export_adapter, export_policy
from mempo_jax.run.run_folder import run_protocol, run_source_checkpoint


def _parse_args(argv):
    p = argparse.ArgumentParser(prog=command_name("mempo_jax.commands.export"), description=__doc__.split("\n\n")[0])
    p.add_argument("--run_dir", required=True, help="run folder of python -m mempo_jax.commands.train (from an HF checkpoint)")
    p.add_argument("--checkpoint", type=int, default=None, help="RL checkpoint step (default: the newest)")
    p.add_argument("--out", required=True, help="output folder (created; an existing one is replaced)")
    p.add_argument("--peft_out", default=None, help="a LoRA run: also write its adapters as a PEFT folder here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    """Export a run folder's checkpoint; returns 0, or 2 after one ``error: …`` line on stderr."""
    args = _parse_args(argv)
    try:
        tokenizer, model_cfg, _, params = load_policy(args.run_dir, args.checkpoint)
        source = run_source_checkpoint(args.run_dir)
        out = export_policy(args.out, model_cfg, params, tokenizer, source=source,
                            protocol=run_protocol(args.run_dir, tokenizer))
        if args.peft_out:
            if source is None:
                raise ValueError(f"--peft_out: the source checkpoint of {args.run_dir} is not found")
            export_adapter(args.peft_out, model_cfg, params, source)
    except (ValueError, FileNotFoundError) as e:
        print("error: " + " ".join(str(e).split()), file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
