"""A training run: building the experiment, stages, checkpoints, resume, preemption, metrics, evaluation, export."""
