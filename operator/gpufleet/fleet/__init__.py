"""Fleet control loops that run beside reconciliation: per-service autoscaling
and fragmentation audits (one shared paced loop), cluster-wide audits, and the
requests routers hold. Each takes the small interfaces of ``ports`` it uses;
``runtime.OperatorRuntime`` wires and starts them."""
