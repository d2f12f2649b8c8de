"""Fleet audits (pure): fragmentation, stranded GPUs."""
