"""Post-training: RL losses, trajectories, tasks and rewards, the code sandbox, the GRPO loop."""
