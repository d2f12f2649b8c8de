"""Pure decisions: observed state → desired children, replicas and status."""
