"""Device-side plumbing: the mesh and sharding rules, multi-process lockstep, batching, log-probs, config validation."""
