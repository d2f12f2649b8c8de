"""KV-watermark autoscaling: replica signals → scaling decisions (pure)."""
