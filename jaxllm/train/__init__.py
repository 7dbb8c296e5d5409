"""Training: optimizer and schedule, train state and steps, the loop, checkpoints, run logs."""
