"""The MemPO learning math: rewards, the memory reward, grouped advantages, PPO losses, the learner, one RL step, SFT."""
