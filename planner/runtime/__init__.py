"""The planner's runtime: what ``apply`` installs on the user's model and what runs in each
planned step (checkpoints and op ranges, offload hooks, the guard, a table's per-batch
plans)."""
