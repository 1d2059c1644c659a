"""The command-line programs. Each module holds one command's argument parsing and its
``main(argv=None) -> int`` (the process exit status); nothing below this package imports it.

Each runs as its console script (``pyproject.toml``) or as ``python -m mempo_jax.commands.NAME``:

* ``train`` (``mempo-train``): the main job, SFT then RL with evaluations;
* ``evaluate`` (``mempo-evaluate``): a run folder or a Hugging Face folder on QA datasets;
* ``plan`` (``mempo-plan``): a recipe's memory plan on its TPU slice;
* ``export`` (``mempo-export``): a run's checkpoint as a Hugging Face folder;
* ``plot`` (``mempo-plot``): learning curves of run folders;
* ``compare`` (``mempo-compare``): paired comparison of two evaluations;
* ``retrieval_server`` (``mempo-retrieve-server``): the Search-R1 ``/retrieve`` server;
* ``write_sft_messages`` (``mempo-write-sft-messages``): the scripted agent's SFT file;
* ``smollm2`` (``mempo-smollm2``): SmolLM2-135M-Instruct as a Hugging Face folder.

Importing the package runs ``cli.skip_absent_tpu``: with ``libtpu`` installed on a host without TPU
chips, JAX's start-up would load it and print libtpu's errors; the commands then run on the CPU
backend quietly (a set ``JAX_PLATFORMS`` wins).
"""

from mempo_jax.commands.cli import skip_absent_tpu

skip_absent_tpu()
